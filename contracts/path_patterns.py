"""Path patterns as ``.gitignore`` reads one (pure): what ``ingest --exclude`` leaves out, and what a query's
``paths`` and ``excludePaths`` select. One reading for both, so that a pattern an operator knows from the one means
the same in the other."""

from __future__ import annotations

import fnmatch
import itertools
import posixpath
import re
from collections.abc import Collection

MAX_GLOBSTARS = 4
"""Of ``**`` directories (``a/**/b``, ``**/b``), at most this many in one pattern: each may match no directory or
several, so a pattern is matched as each of its readings, two to the power of these."""
_GLOBSTAR = re.compile(r"(?:^|/)\*\*(?:/\*\*)*/")
"""A leading ``**/`` or a ``/**/`` (a run of them is one): no directory or any number of them."""


def pattern_problem(written: str) -> str | None:
    """Why a pattern as written cannot be read as ``.gitignore`` would read it, if it cannot: a ``!`` that negates
    there, and would match nothing here (a contract tester's ``!docs`` selected nothing, unsaid), or more than
    :data:`MAX_GLOBSTARS` ``**`` directories."""
    if written.startswith("!"):
        return f"{written!r} starts with !, which negates a pattern in .gitignore: name what to leave out instead"
    pattern = unescaped(written)
    if len(_GLOBSTAR.findall(pattern)) > MAX_GLOBSTARS:
        return f"{written!r} holds more than {MAX_GLOBSTARS} ** directories"
    index = pattern.find("[")
    while index >= 0:  # each class as fnmatch reads them, left to right: a `[` within one opens none
        close = _class_close(pattern, index + 1)
        if "/" in pattern[index + 1 : close]:
            # git's classes match no `/`; here one did, and a review's `[!/**/]` read two ways
            return f"{written!r} holds / within a [...] class, which matches no / in a path"
        index = pattern.find("[", close + 1 if close > index + 1 else index + 1)
    return None


def _class_close(pattern: str, start: int) -> int:
    """Where the class opened just before ``start`` closes (its ``]``), as fnmatch reads it (a ``]`` first, or
    after ``!``, is a member); its start when it does not close (the ``[`` is itself, and holds nothing)."""
    end = start + (start < len(pattern) and pattern[start] == "!")
    end += end < len(pattern) and pattern[end] == "]"
    close = pattern.find("]", end)
    return close if close >= 0 else start


def unescaped(written: str) -> str:
    """A pattern's backslashes as ``.gitignore`` reads them, for :mod:`fnmatch`: one before ``*``, ``?``, ``[``,
    ``]`` or ``\\`` makes it that character itself (``st\\*r.py`` names the file ``st*r.py``: an ingest tester's was
    read as the path ``st/*r.py``), before ``!``, ``#`` or a space the character alone; any other is ``/`` (a
    Windows path)."""

    def one(match: re.Match[str]) -> str:
        char = match.group(1)  # empty for a backslash at the end
        if char and char in "*?[]\\":
            return f"[{char}]"
        return char if char and char in "!# " else "/" + char

    return _caret_negations(re.sub(r"\\(.?)", one, written, flags=re.DOTALL))


def _caret_negations(pattern: str) -> str:
    """Each class ``[^...]`` written as fnmatch negates one, ``[!...]``: git reads both as "none of" (a fault
    tester's ``x/[^v]*`` selected only the names starting with ``v``, fnmatch reading ``^`` as a member)."""
    out, index = list(pattern), 0
    while (index := pattern.find("[", index)) >= 0:
        end = index + 1
        negated = end < len(pattern) and pattern[end] in "!^"
        end += negated
        if end < len(pattern) and pattern[end] == "]":
            end += 1
        close = pattern.find("]", end)
        if close < 0:  # no class: the bracket itself, and what follows it too (a review's "a[^b")
            index += 1
            continue
        if negated:
            out[index + 1] = "!"
        index = close + 1
    return "".join(out)


def normal_pattern(written: str) -> str | None:
    """``written`` as :func:`matches` reads it: backslashes as :func:`unescaped` reads them, then
    :func:`within_the_tree`."""
    return within_the_tree(unescaped(written))


def within_the_tree(pattern: str) -> str | None:
    """``pattern`` (its backslashes read) without a leading ``./`` or a trailing ``/``; None for one that can name
    no path inside a tree (empty, ``.``, absolute, or leading out of it)."""
    pattern = posixpath.normpath(pattern) if pattern else ""
    if pattern in ("", ".", "..") or pattern.startswith(("../", "/")):
        return None
    return pattern


def matches(relative: str, patterns: Collection[str]) -> bool:
    """Whether a path relative to the tree (POSIX) is matched by one of ``patterns`` (normalised by
    :func:`normal_pattern`), shell-style (``fnmatch``, case-sensitive), as ``.gitignore`` reads a pattern: one
    without ``/`` matches a file or directory name at any depth (``tests``, ``*_pb2.py``); one with ``/`` matches
    the path from the tree's root, its ``*`` crossing ``/`` too (``docs/*.md``, ``src/*/migrations``), and a
    ``**`` directory no directory or any (``docs/**/*.md`` matches ``docs/guide.md``: a contract tester's matched
    only deeper files). What is in a matched directory is matched."""
    parts = relative.split("/")
    for pattern in patterns:
        if "/" in pattern:
            prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
            if any(fnmatch.fnmatchcase(p, reading) for reading in _readings(pattern) for p in prefixes):
                return True
        elif any(fnmatch.fnmatchcase(part, pattern) for part in parts):
            return True
    return False


def _readings(pattern: str) -> list[str]:
    """``pattern`` with each ``**`` directory (:data:`_GLOBSTAR`) read as none (``/``) and as some (``/*/``, its
    ``*`` crossing ``/``): every combination, so that each may be either (at most :data:`MAX_GLOBSTARS`, which
    :func:`pattern_problem` refuses past; any past that are read as some)."""
    found = list(_GLOBSTAR.finditer(pattern))
    if not found:
        return [pattern]
    pieces = _GLOBSTAR.split(pattern)
    choices: list[tuple[str, ...]] = [("", "*/") if m.group(0)[0] != "/" else ("/", "/*/") for m in found]
    choices = choices[:MAX_GLOBSTARS] + [(some,) for _, some in choices[MAX_GLOBSTARS:]]
    return [
        pieces[0] + "".join(c + piece for c, piece in zip(chosen, pieces[1:], strict=True))
        for chosen in itertools.product(*choices)
    ]


def pattern_regex(pattern: str) -> str:
    """A PostgreSQL regular expression (ARE) matching the paths :func:`matches` matches with ``pattern`` (normalised
    by :func:`normal_pattern`): the database selects by it what the ingest would have left out by it."""
    within_a_name = "/" not in pattern
    body = _glob_body(pattern, within_a_name)
    start = "(^|/)" if within_a_name else "^"
    return f"{start}{body}(/|$)"


def _glob_body(pattern: str, within_a_name: bool) -> str:
    """The glob as a regular expression, as :func:`fnmatch.fnmatchcase` reads it: ``*`` any characters, ``?`` one,
    ``[...]`` a class (``[!...]`` its complement), anything else itself; within a name, none of them ``/``; a
    ``**`` directory (:data:`_GLOBSTAR`) no directory or any."""
    anything, one = ("[^/]*", "[^/]") if within_a_name else (".*", ".")
    out, index = [], 0
    while index < len(pattern):
        globstar = None if within_a_name else _GLOBSTAR.match(pattern, index)
        if globstar is not None and (index == 0 or pattern[index] == "/"):
            out.append("(?:.*/)?" if index == 0 and pattern[0] != "/" else "/(?:.*/)?")
            index = globstar.end()
            continue
        char = pattern[index]
        index += 1
        if char == "*":
            # A run of them is one, as fnmatch reads it: 512 stacked `[^/]*` took the database 5 s a path (a
            # fault harness's pattern, valid by the contract, held every worker's statements to their timeout).
            if index < 2 or pattern[index - 2] != "*":
                out.append(anything)
        elif char == "?":
            out.append(one)
        elif char == "[":
            end = _class_close(pattern, index)
            if end == index:  # no class: a bracket itself, as fnmatch reads it
                out.append(r"\[")
                continue
            members = pattern[index:end]
            index = end + 1
            negated = members.startswith("!")
            kept = _class_members(members[1:] if negated else members)
            if negated:
                out.append(f"[^{kept}/]" if within_a_name else (f"[^{kept}]" if kept else "."))
            else:
                out.append(f"[{kept}]" if kept else "(?!)")  # no member left: nothing matches
        else:
            out.append(re.escape(char) if not char.isalnum() and char != "_" else char)
    return "".join(out)


def _class_members(members: str) -> str:
    """A class's members for the regular expression, as fnmatch keeps them: a range ``a-z`` as such, one whose
    ends are in reverse order left out (fnmatch drops it; PostgreSQL refused the whole statement), every other
    character itself, escaped where a class would read it otherwise (``[:alpha:]`` is a class name there)."""
    out, index = [], 0
    while index < len(members):
        if index + 2 < len(members) and members[index + 1] == "-":
            low, high = members[index], members[index + 2]
            index += 3
            if low <= high:
                out.append(f"{_class_character(low)}-{_class_character(high)}")
            continue
        out.append(_class_character(members[index]))
        index += 1
    return "".join(out)


def _class_character(char: str) -> str:
    return f"\\{char}" if char in "\\^]-[" else char
