"""The `ontofabric` command's entry point, light enough to load before anything that takes time."""

from __future__ import annotations

import sys


def main() -> None:
    """Run the command line. A Ctrl-C while its modules load (seconds on a busy machine) ends it as a shell's
    interrupt does, exit 130, without a traceback of the import it came in (a stop tester's, in 45 runs)."""
    try:
        from .cli import main as run
    except KeyboardInterrupt:
        sys.exit(130)
    run()
