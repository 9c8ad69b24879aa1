"""The MCP gateway: agents reach the query workers through it (``ontofabric mcp``)."""
