"""What ``.gitignore`` files leave out of a tree in a git work tree, by git's rules (pathspec's reading of a
pattern, git's order of deciding).

An ingest of a working checkout indexed what git leaves out (a tester's ``local_settings.py`` and ``secrets/``,
ignored and never committed, were served to every reader of the workspace), where search tools over code follow
``.gitignore`` by default. Outside a work tree no ignore file applies, as for git: an unpacked source distribution
ships files its ``.gitignore`` names (a generated ``_version.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pathspec.patterns.gitignore.basic import GitIgnoreBasicPattern

from ontofabric.shared.logging import get_logger

from .reading import read_regular_file

log = get_logger(__name__)

MAX_IGNORE_FILE_BYTES = 1 << 20
"""A ``.gitignore`` larger than this is read no further (its patterns past it do not apply)."""


@dataclass(frozen=True)
class IgnoreFile:
    """The patterns of one ignore file, in order, each with whether it names directories only (a trailing ``/``)."""

    patterns: tuple[tuple[GitIgnoreBasicPattern, bool], ...]

    @classmethod
    def of(cls, text: str) -> IgnoreFile:
        patterns = []
        for line in text.splitlines():
            pattern = GitIgnoreBasicPattern(line)
            if pattern.include is not None:  # not a comment or a blank line
                patterns.append((pattern, line.rstrip().endswith("/")))
        return cls(tuple(patterns))

    def decides(self, path: str, is_directory: bool) -> bool | None:
        """Whether this file leaves out ``path`` (relative to its directory): its last pattern matching it decides
        (True: left out; False: included again by a ``!`` pattern); None when none matches. A directory is matched
        as a name, and as a directory by the patterns that name directories only: pathspec alone read ``foo/**`` as
        leaving out ``foo`` itself (git reads it as what is in it), and gave ``*`` precedence over a later ``!*/``."""
        decided = None
        for pattern, directories_only in self.patterns:
            if directories_only and not is_directory:
                continue  # such a pattern leaves out a file only through its directory, which the walk prunes
            if pattern.match_file(f"{path}/" if directories_only else path):
                decided = bool(pattern.include)
        return decided


class GitIgnores:
    """The ignore files that apply to a tree in a git work tree: its directories' ``.gitignore`` (read as a walk
    reaches each, top down), those of the directories above it up to the work tree's top, and that repository's
    ``.git/info/exclude`` (not the user's global excludes file). As git reads them, the nearest file with a pattern
    matching a path decides, and within a file its last matching pattern (``!`` patterns include again)."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._own: dict[str, IgnoreFile] = {}
        """By the tree-relative directory holding the file ("" for the root)."""
        self._above: list[tuple[str, IgnoreFile]] = []
        """Nearest first: the tree's path from that directory (with a trailing ``/``, "" from the root itself), and
        the patterns."""
        self._top = work_tree_top(root)
        if self._top is None:
            return
        top, directory = self._top, root.parent
        while top != root and directory != directory.parent:
            patterns = _read(directory / ".gitignore")
            if patterns is not None:
                self._above.append((f"{root.relative_to(directory).as_posix()}/", patterns))
            if directory == top:
                break
            directory = directory.parent
        excluded = _read(top / ".git" / "info" / "exclude") if (top / ".git").is_dir() else None
        if excluded is not None:
            self._above.append(("" if top == root else f"{root.relative_to(top).as_posix()}/", excluded))
        if top != root and self._decided_above("", is_directory=True):
            # The tree is itself left out above it (a package in a virtualenv the repository ignores): asked for on
            # purpose, as a path given to git is, so only its own files apply (the judged trees read as empty).
            log.info("ingest_tree_ignored_above", reason="only the tree's own .gitignore files apply")
            self._above = []

    def enter(self, relative: str) -> None:
        """Reads the ``.gitignore`` of the tree's directory ``relative`` ("" for the root), if it has one and the
        tree is in a work tree."""
        if self._top is None:
            return
        patterns = _read(self._root / relative / ".gitignore")
        if patterns is not None:
            self._own[relative] = patterns

    def ignored(self, relative: str, is_directory: bool) -> bool:
        """Whether git leaves out the tree's path ``relative`` (POSIX). A directory's parents are asked first by the
        walk, which does not go into one left out: as in git, nothing under it can be included again."""
        parts = relative.split("/")
        for depth in range(len(parts) - 1, -1, -1):
            base = "/".join(parts[:depth])
            patterns = self._own.get(base)
            if patterns is not None:
                decided = patterns.decides(relative[len(base) + 1 :] if base else relative, is_directory)
                if decided is not None:
                    return decided
        return bool(self._decided_above(relative, is_directory))

    def _decided_above(self, relative: str, is_directory: bool) -> bool | None:
        """What the ignore files above the tree say of its path ``relative`` ("" for the tree itself)."""
        for prefix, patterns in self._above:
            decided = patterns.decides((prefix + relative).rstrip("/"), is_directory)
            if decided is not None:
                return decided
        return None


def work_tree_top(directory: Path) -> Path | None:
    """The top of the git work tree ``directory`` is in (the nearest directory holding ``.git``), or None."""
    for candidate in (directory, *directory.parents):
        if (candidate / ".git").exists():
            return candidate
    return None


def _read(path: Path) -> IgnoreFile | None:
    """The patterns of the ignore file at ``path``, or None when there is none. Read as the tree's sources are:
    a regular file, no link followed (one could lead anywhere, or to a device that never ends)."""
    try:
        text = read_regular_file(path, MAX_IGNORE_FILE_BYTES)
    except (FileNotFoundError, NotADirectoryError):  # most directories have none: no look before
        return None
    except (OSError, UnicodeError, SyntaxError, LookupError) as error:
        log.warning("ingest_ignore_file_unread", path=repr(str(path)), error=str(error))
        return None
    return IgnoreFile.of(text)
