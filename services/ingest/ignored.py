"""What ``.gitignore`` files leave out of a tree, by git's rules as pathspec reads them.

An ingest of a working checkout indexed what git leaves out (a tester's ``local_settings.py`` and ``secrets/``,
ignored and never committed, were served to every reader of the workspace), where search tools over code follow
``.gitignore`` by default.
"""

from __future__ import annotations

from pathlib import Path

from pathspec import GitIgnoreSpec

from ontofabric.shared.logging import get_logger

from .reading import read_regular_file

log = get_logger(__name__)

MAX_IGNORE_FILE_BYTES = 1 << 20
"""A ``.gitignore`` larger than this is read no further (its patterns past it do not apply)."""


class GitIgnores:
    """The ``.gitignore`` files that apply to a tree: its directories' own (read as a walk reaches each, top down),
    those of the directories above it up to the top of its git work tree, and that repository's
    ``.git/info/exclude``. As git reads them, the nearest file with a pattern matching a path decides, and within a
    file its last matching pattern (``!`` patterns include again)."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._own: dict[str, GitIgnoreSpec] = {}
        """By the tree-relative directory holding the file ("" for the root)."""
        self._above: list[tuple[str, GitIgnoreSpec]] = []
        """Nearest first: the tree's path from that directory (with a trailing ``/``, "" from the root itself), and
        the patterns."""
        top = work_tree_top(root)
        if top is None:
            return
        directory = root.parent
        while top != root and directory != directory.parent:
            spec = _read(directory / ".gitignore")
            if spec is not None:
                self._above.append((f"{root.relative_to(directory).as_posix()}/", spec))
            if directory == top:
                break
            directory = directory.parent
        excluded = _read(top / ".git" / "info" / "exclude") if (top / ".git").is_dir() else None
        if excluded is not None:
            self._above.append(("" if top == root else f"{root.relative_to(top).as_posix()}/", excluded))

    def enter(self, relative: str) -> None:
        """Reads the ``.gitignore`` of the tree's directory ``relative`` ("" for the root), if it has one."""
        spec = _read(self._root / relative / ".gitignore")
        if spec is not None:
            self._own[relative] = spec

    def ignored(self, relative: str, is_directory: bool) -> bool:
        """Whether git leaves out the tree's path ``relative`` (POSIX). A directory's parents are asked first by the
        walk, which does not go into one left out: as in git, nothing under it can be included again."""
        path = f"{relative}/" if is_directory else relative
        parts = relative.split("/")
        for depth in range(len(parts) - 1, -1, -1):
            base = "/".join(parts[:depth])
            spec = self._own.get(base)
            if spec is not None:
                decided = spec.check_file(path[len(base) + 1 :] if base else path).include
                if decided is not None:
                    return decided
        for prefix, spec in self._above:
            decided = spec.check_file(prefix + path).include
            if decided is not None:
                return decided
        return False


def work_tree_top(directory: Path) -> Path | None:
    """The top of the git work tree ``directory`` is in (the nearest directory holding ``.git``), or None."""
    for candidate in (directory, *directory.parents):
        if (candidate / ".git").exists():
            return candidate
    return None


def _read(path: Path) -> GitIgnoreSpec | None:
    """The patterns of the ignore file at ``path``, or None when there is none. Read as the tree's sources are:
    a regular file, no link followed (one could lead anywhere, or to a device that never ends)."""
    if not path.is_file():
        return None
    try:
        text = read_regular_file(path, MAX_IGNORE_FILE_BYTES)
    except (OSError, UnicodeError, SyntaxError, LookupError) as error:
        log.warning("ingest_ignore_file_unread", path=repr(str(path)), error=str(error))
        return None
    return GitIgnoreSpec.from_lines(text.splitlines())
