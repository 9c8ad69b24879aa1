"""What stops the gateway before it serves, in a module of its own: the command line names it in every command's
error handling, and importing the gateway (the MCP SDK) for it took half a second of every command's start."""


class StdioUnusable(Exception):
    """Standard input or output is a regular file: an MCP client starts the gateway with pipes."""
