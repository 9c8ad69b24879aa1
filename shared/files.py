"""Directories made for the deployment's files."""

from __future__ import annotations

import os
import stat
from pathlib import Path

NOT_FOR_OTHERS_TO_WRITE = stat.S_IWGRP | stat.S_IWOTH


def make_directory(path: Path) -> None:
    """``path`` and its missing parents, which only their owner may write whatever the umask: in a directory others
    may write they can replace what it holds (a security tester running `up` under a umask of 000 got a data
    directory and a model cache anyone could write, and replaced the gateway's tokens file). Directories that
    already exist are left as they are. OSError as ``Path.mkdir`` raises it."""
    missing = []
    for directory in (path, *path.parents):
        if directory.exists():
            break
        missing.append(directory)
    path.mkdir(parents=True, exist_ok=True)
    for made in missing:
        mode = stat.S_IMODE(made.stat().st_mode)
        if mode & NOT_FOR_OTHERS_TO_WRITE:
            os.chmod(made, mode & ~NOT_FOR_OTHERS_TO_WRITE)
