"""Path patterns (pure): the database's reading of a pattern is the ingest's."""

from __future__ import annotations

import re
from random import Random

import pytest

from ontofabric.contracts.path_patterns import MAX_GLOBSTARS, matches, normal_pattern, pattern_problem, pattern_regex


@pytest.mark.parametrize(
    ("pattern", "path", "matched"),
    [
        ("tests", "pkg/tests/test_a.py", True),
        ("tests", "pkg/tests.py", False),
        ("test_*.py", "pkg/sub/test_a.py", True),
        ("test_*.py", "pkg/test_a/b.py", False),
        ("docs/*.md", "docs/a/b.md", True),  # with `/`, `*` crosses it too, as --exclude reads it
        ("services/query", "services/query/fusion.py", True),
        ("services/query", "services/query_old/x.py", False),
        ("services/q?ery", "services/query/x.py", True),
        ("[!t]*.py", "pkg/a.py", True),
        ("[!t]*.py", "pkg/t.py", False),
        ("x/[^v]*", "x/a.py", True),  # git negates with ^ too
        ("x/[^v]*", "x/valid.py", False),
        ("x/[[]^v]*", "x/[^v]a", True),  # an escaped bracket opens no class
        ("[a^]*.py", "^.py", True),  # within a class, ^ is a member
        ("a[^b", "a[^b", True),  # no class: every character itself
        ("a[^b", "a[!b", False),
        ("a[", "a[", True),  # no class: the bracket itself
        ("*.md", "README.md", True),
        ("st[*]r.py", "st*r.py", True),
        ("st[*]r.py", "start.py", False),
        # A ** directory is no directory or any, as git reads it (a contract tester's h11/**/*.py matched nothing
        # directly in h11, and excluded nothing there).
        ("h11/**/*.py", "h11/_writers.py", True),
        ("h11/**/*.py", "h11/a/b/c.py", True),
        ("h11/**/*.py", "h11x/a.py", False),
        ("**/guide.md", "guide.md", True),
        ("**/guide.md", "docs/x/guide.md", True),
        ("docs/**/guide.md", "docs/guide.md", True),
        ("a/**/b", "a/xb", False),
        ("a/**/**/b", "a/b", True),
        ("a/**/b/**/c", "a/b/x/c", True),
        ("a/**", "a/x/y", True),
    ],
)
def test_a_pattern_selects_in_the_database_what_it_leaves_out_of_an_ingest(
    pattern: str, path: str, matched: bool
) -> None:
    normal = normal_pattern(pattern)
    assert normal is not None
    assert matches(path, [normal]) is matched
    assert (re.search(pattern_regex(normal), path) is not None) is matched


def test_random_patterns_read_the_same_both_ways() -> None:
    """The regular expression (PostgreSQL's syntax, the same as Python's for what it uses) against fnmatch's
    reading, over random patterns and paths."""
    random = Random(7)
    names = ["a", "b", "ab", "a.py", "b.md", "t_a", "x-y", "a b"]
    glob = ["a", "b", "*", "?", ".", "/", "[ab]", "[!a]", "_", "-", "[", "]"]
    for _ in range(5000):
        path = "/".join(random.choice(names) for _ in range(random.randint(1, 4)))
        written = "".join(random.choice(glob) for _ in range(random.randint(1, 6)))
        pattern = normal_pattern(written)
        if pattern is None:
            continue
        expected = matches(path, [pattern])
        assert (re.search(pattern_regex(pattern), path) is not None) is expected, (pattern, path)


def test_a_pattern_that_names_no_path_in_a_tree_is_none() -> None:
    assert [normal_pattern(p) for p in ("", ".", "/etc", "../x", "./tests/", "a\\*b")] == [
        None, None, None, None, "tests", "a[*]b",
    ]  # fmt: skip


def test_a_run_of_stars_is_one() -> None:
    """A fault harness's 512 stars, valid by the contract, became 512 stacked ``[^/]*``: 5 s of the database's
    time a path, every worker statement of the workspace held to its timeout. fnmatch reads a run as one star."""
    assert pattern_regex("*" * 512) == pattern_regex("*")
    assert pattern_regex("src/" + "*" * 300 + ".py") == pattern_regex("src/*.py")
    assert pattern_regex("a*?*b") != pattern_regex("a*b")  # a star beside another wildcard is no run
    assert re.search(pattern_regex(normal_pattern("[*]**") or ""), "*x") is not None


def test_a_pattern_git_would_read_otherwise_is_refused_with_why() -> None:
    """A contract tester's ``!docs`` (a negation in .gitignore) selected nothing, unsaid."""
    assert "negates" in (pattern_problem("!docs") or "")
    assert pattern_problem("\\!docs") is None  # the character itself, escaped
    many = "/".join(["a", *["**", "b"] * (MAX_GLOBSTARS + 1)])
    assert f"more than {MAX_GLOBSTARS}" in (pattern_problem(many) or "")
    assert pattern_problem("/".join(["a", *["**", "b"] * MAX_GLOBSTARS])) is None
    # A class holding / (a review's `[!/**/]` was read one way by the ingest, another by the database).
    assert "within a [...] class" in (pattern_problem("src/[!/**/]x.py") or "")
    assert pattern_problem("src/[ab]/x[!c].py") is None
    assert pattern_problem("a[/b") is None  # no class: the bracket itself
    assert pattern_problem("a\\[/b]") is None  # an escaped bracket opens no class (a review's was refused)
    assert pattern_problem("app/\\[slug\\]/page.tsx") is None
