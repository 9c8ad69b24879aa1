"""Chunking Python at AST boundaries and Markdown by heading; the incremental ingest plan."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from ontofabric.services.ingest.chunking import (
    MAX_HEADING_CHARS,
    MAX_SYMBOL_CHARS,
    FileStart,
    bounded_symbol,
    chunk_document,
    chunk_python,
    module_name,
    object_type_name,
    tree_package,
    truncate_utf8,
)
from ontofabric.services.ingest.graph import python_graph
from ontofabric.services.ingest.ingester import (
    DELETED_FILE,
    TOMBSTONE,
    UNKNOWN,
    Manifest,
    as_far_as_read,
    chunk_sources,
    chunk_tree,
    discover,
    event_id,
    plan_ingest,
    python_of,
    read_tree,
    without_removals,
)

PYTHON = textwrap.dedent(
    '''
    """Parsing helpers."""

    import json


    class Reader:
        """Reads things."""

        @staticmethod
        def parse(text):
            """Parse JSON text."""
            return json.loads(text)

        @property
        def size(self):
            return 1

        @size.setter
        def size(self, value):
            pass


    async def fetch(url):
        return url
    '''
)


def _by_key(chunks: list) -> dict:  # type: ignore[type-arg]
    return {c.symbol_key: c for c in chunks}


def test_python_chunks_follow_the_syntax_tree() -> None:
    chunks = _by_key(chunk_python("pkg/reader.py", PYTHON, 100_000))
    assert set(chunks) == {
        "python:pkg/reader.py",
        "python:pkg/reader.py:doc",
        "python:pkg/reader.py/Reader#",
        "python:pkg/reader.py/Reader#:doc",
        "python:pkg/reader.py/Reader.parse().",
        "python:pkg/reader.py/Reader.parse().:doc",
        "python:pkg/reader.py/Reader.size().",
        "python:pkg/reader.py/Reader.size().~2",
        "python:pkg/reader.py/fetch().",
    }
    module = chunks["python:pkg/reader.py"]
    assert (module.chunk_level, module.symbol_kind, module.object_type) == ("file", "module", "pkg.reader")
    cls = chunks["python:pkg/reader.py/Reader#"]
    assert (cls.chunk_level, cls.symbol_kind, cls.symbol_fqn) == ("type", "class", "pkg.reader.Reader")
    method = chunks["python:pkg/reader.py/Reader.parse()."]
    assert (method.chunk_level, method.symbol_kind, method.object_type) == ("method", "method", "pkg.reader.Reader")
    assert method.content.lstrip().startswith("@staticmethod")  # decorators belong to the chunk
    assert method.content.rstrip().endswith("return json.loads(text)")
    function = chunks["python:pkg/reader.py/fetch()."]
    assert (function.symbol_kind, function.object_type) == ("function", "pkg.reader")
    doc = chunks["python:pkg/reader.py/Reader.parse().:doc"]
    assert (doc.chunk_level, doc.content) == ("doc", "Parse JSON text.")
    assert all(c.file_path == "pkg/reader.py" and c.source_domain == "python" for c in chunks.values())


def test_every_chunk_states_the_lines_of_the_file_its_text_comes_from() -> None:
    chunks = _by_key(chunk_python("pkg/reader.py", PYTHON, 100_000))
    assert {key: c.lines for key, c in chunks.items()} == {
        "python:pkg/reader.py": (1, 25),
        "python:pkg/reader.py:doc": (2, 2),
        "python:pkg/reader.py/Reader#": (7, 21),
        "python:pkg/reader.py/Reader#:doc": (8, 8),
        "python:pkg/reader.py/Reader.parse().": (10, 13),  # from its decorator
        "python:pkg/reader.py/Reader.parse().:doc": (12, 12),
        "python:pkg/reader.py/Reader.size().": (15, 17),
        "python:pkg/reader.py/Reader.size().~2": (19, 21),
        "python:pkg/reader.py/fetch().": (24, 25),
    }
    lines = PYTHON.split("\n")
    for chunk in chunks.values():
        if chunk.chunk_level != "doc":
            first, last = chunk.lines or (0, 0)
            assert chunk.content == "\n".join(lines[first - 1 : last]) + "\n", chunk.symbol_key
    assert chunk_python("broken.py", "def oops(:\n\n", 1000)[0].lines == (1, 2)  # unparsed: the file's lines
    # A decorator's expression may start below its `@`: the chunk starts at the `@`.
    (wrapped,) = [c for c in chunk_python("w.py", "x = 1\n@(\n    deco\n)\ndef f():\n    pass\n", 1000) if c.line]
    assert (wrapped.lines, wrapped.content) == ((2, 6), "@(\n    deco\n)\ndef f():\n    pass\n")


def test_a_form_feed_or_line_separator_in_a_comment_does_not_move_the_lines_below_it() -> None:
    # str.splitlines ends a line at each: the class below was cut from the wrong lines.
    source = "x = 1  # page\x0c break\ny = 2  # a \u2028 separator\r\n\r\nclass Below:\r    pass\n"
    (below,) = [c for c in chunk_python("m.py", source, 1000) if c.symbol_kind == "class"]
    assert (below.lines, below.content) == ((4, 5), "class Below:\r    pass\n")


def test_identity_survives_body_edits_and_content_hash_does_not() -> None:
    before = _by_key(chunk_python("pkg/reader.py", PYTHON, 100_000))
    after = _by_key(
        chunk_python("pkg/reader.py", PYTHON.replace("json.loads(text)", "json.loads(text or '{}')"), 100_000)
    )
    key = "python:pkg/reader.py/Reader.parse()."
    assert before[key].document_id == after[key].document_id
    assert before[key].content_hash != after[key].content_hash
    unchanged = "python:pkg/reader.py/fetch()."
    assert before[unchanged].content_hash == after[unchanged].content_hash


def test_unparsable_python_still_yields_the_file() -> None:
    chunks = chunk_python("broken.py", "def oops(:\n", 1000)
    assert [c.chunk_level for c in chunks] == ["file"]


def test_a_file_over_the_size_limit_is_read_as_one_chunk_without_symbols_sections_calls_or_graph(
    tmp_path: Path,
) -> None:
    """An audit's 1.8 MB file of statements took 17-22 s and 800 MB to read, at every ingest; a generated file of
    many classes is as many chunks to embed."""
    big = "".join(f"class C{i}(Base):\n    def m(self):\n        return helper()\n" for i in range(40))
    sources = {
        "gen.py": f"from small import Base, helper\n{big}",
        "small.py": "class Base:\n    pass\n\n\ndef helper():\n    return 1\n",
        "long.md": "# One\n\ntext\n\n## Two\n\n" + "more text\n" * 200,
    }
    limit = 1500  # gen.py and long.md are over it
    chunks = chunk_sources(tmp_path, sources, 1 << 20, max_file_bytes=limit)
    by_file = {path: [c for c in chunks if c.file_path == path] for path in sources}
    (gen,) = by_file["gen.py"]
    assert (gen.chunk_level, gen.content, gen.calls) == ("file", sources["gen.py"], ())
    assert gen.parse_error is not None
    assert gen.parse_error.startswith(f"{len(sources['gen.py']):,} bytes, over ONTOFABRIC_INGEST_MAX_FILE_BYTES")
    (long,) = by_file["long.md"]
    assert (long.symbol_fqn, long.lines, long.parse_error) == ("long.md", (1, 206), gen.parse_error.replace(
        f"{len(sources['gen.py']):,}", f"{len(sources['long.md']):,}"))  # fmt: skip
    assert {c.symbol_fqn for c in by_file["small.py"]} == {"small", "small.Base", "small.helper"}
    nodes, _ = python_graph(python_of(sources, None, limit))
    assert [n.object_type for n in nodes] == ["small", "small.Base"]
    # 0, the default: no limit, as before (the file, 40 classes and 40 methods).
    assert sum(1 for c in chunk_sources(tmp_path, sources, 1 << 20) if c.file_path == "gen.py") == 81


def test_of_a_file_over_the_size_limit_only_what_could_be_indexed_is_read(tmp_path: Path) -> None:
    """A tester's 50 GB file ran the ingest out of memory (a traceback), and six 80 MB logs took it to 1.2 GB: the
    whole file was read, decoded and kept, to index a chunk of its start."""
    line = "é = 'a line of a generated table'\n"  # a character of two bytes first: the read may end inside one
    (tmp_path / "gen.py").write_text(line * 100_000, encoding="utf-8")
    (tmp_path / "small.py").write_text("def helper():\n    return 1\n", encoding="utf-8")
    whole = (tmp_path / "gen.py").stat().st_size
    assert len(line.encode()) == 35
    for limit in (3_990, 3_991, 3_992):  # the read ending before, inside and after a two-byte character
        sources = read_tree(tmp_path, max_read_bytes=limit)
        start = sources["gen.py"]
        assert isinstance(start, FileStart)
        assert start.whole_bytes == whole
        assert (line * 200).startswith(start)
        assert limit - 2 <= len(start.encode()) <= limit
        assert "\ufffd" not in start
        assert sources["small.py"] == "def helper():\n    return 1\n"  # under the limit: whole, a plain text
        (gen,) = [c for c in chunk_sources(tmp_path, sources, 1_000, max_file_bytes=3_000) if c.file_path == "gen.py"]
        assert gen.parse_error is not None
        assert gen.parse_error.startswith(f"{whole:,} bytes, over ONTOFABRIC_INGEST_MAX_FILE_BYTES")  # the whole file's
        assert gen.cut_from_bytes == whole
    assert read_tree(tmp_path)["gen.py"] == line * 100_000  # no limit: all of it


def test_a_tree_deeper_than_the_interpreters_recursion_limit_is_read(tmp_path: Path) -> None:
    """A tester's tree 1,100 directories deep (a path of 2,226 characters) ended the ingest in a RecursionError
    (os.walk recurses). Read in the order os.walk reads a tree."""
    depth = sys.getrecursionlimit() + 100
    deep = tmp_path
    for _ in range(depth):  # one by one: Path.mkdir(parents=True) recurses too
        deep = deep / "d"
        deep.mkdir()
    (deep / "bottom.py").write_text("def bottom():\n    return 1\n")
    for name in ("b/x.py", "a/z.py", "a/c/y.py", "top.py", "a/a.md"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    try:
        found = [path.relative_to(tmp_path).as_posix() for path in discover(tmp_path)]
        assert found == ["top.py", "a/a.md", "a/z.py", "a/c/y.py", "b/x.py", "d/" * depth + "bottom.py"]
    finally:  # from the bottom up: shutil.rmtree, as pytest cleans its directories up, recurses too
        (deep / "bottom.py").unlink()
        while deep != tmp_path:
            deep.rmdir()
            deep = deep.parent


def test_what_gitignore_files_leave_out_is_not_read_as_git_reads_them(tmp_path: Path) -> None:
    """A tester's checkout had `local_settings.py` and `secrets/` in its .gitignore, never committed: both were
    indexed and served to every reader of the workspace."""
    files = {
        ".git/info/exclude": "scratch.py\n",
        ".gitignore": "*.log.txt\n/outer_only.py\n",  # above the tree: applies to it, from where it is
        "repo/.gitignore": "local_settings.py\nsecrets/\n*.gen.py\n!keep.gen.py\n/top_only.md\n",
        "repo/pkg/.gitignore": "!local_settings.py\nnotes.md\n",
        "repo/local_settings.py": "SECRET = 'x'\n",
        "repo/pkg/local_settings.py": "included = True\n",  # a nearer file includes it again
        "repo/secrets/prod.txt": "password\n",
        "repo/a.gen.py": "x = 1\n",
        "repo/keep.gen.py": "x = 1\n",
        "repo/top_only.md": "# top\n",
        "repo/pkg/top_only.md": "# not the top one\n",
        "repo/pkg/notes.md": "# notes\n",
        "repo/pkg/run.log.txt": "a log\n",
        "repo/scratch.py": "x = 1\n",
        "repo/outer_only.py": "x = 1\n",  # anchored to the directory above: not this one
        "repo/main.py": "def main():\n    return 1\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    root = tmp_path / "repo"
    ignored: list[str] = []
    found = [path.relative_to(root).as_posix() for path in discover(root, ignored=ignored)]
    assert found == ["keep.gen.py", "main.py", "outer_only.py", "pkg/local_settings.py", "pkg/top_only.md"]
    assert sorted(ignored) == sorted([
        "a.gen.py", "local_settings.py", "pkg/notes.md", "pkg/run.log.txt", "scratch.py", "secrets/", "top_only.md",
    ])  # fmt: skip
    everything = [path.relative_to(root).as_posix() for path in discover(root, gitignore=False)]
    assert sorted(everything) == sorted([*found, *(p for p in ignored if not p.endswith("/")), "secrets/prod.txt"])
    # A link is not followed to read one.
    (tmp_path / ".git" / "info" / "exclude").unlink()
    (root / "pkg" / ".gitignore").unlink()
    (root / "pkg" / ".gitignore").symlink_to(tmp_path / ".gitignore")
    found = [path.relative_to(root).as_posix() for path in discover(root)]
    assert "scratch.py" in found
    assert "pkg/notes.md" in found
    assert "pkg/local_settings.py" not in found  # the root's pattern, no nearer file including it again
    # Outside a git work tree none applies, as for git (a review's: an unpacked source distribution ships files
    # its .gitignore names, a generated _version.py).
    (tmp_path / ".git" / "info").rmdir()
    (tmp_path / ".git").rmdir()
    assert list(discover(root)) == list(discover(root, gitignore=False))


def test_directories_are_left_out_as_git_leaves_them_out(tmp_path: Path) -> None:
    """A review's, checked against git: with `*`, `!*/`, `!*.py` (keep the Python files alone) git indexes
    `x/a.py` and `x/y/b.py`, and with `foo/**`, `!foo/keep.py` it keeps `foo/keep.py`; the walk left out both
    directories (pathspec read `foo/**` as leaving out `foo` itself, and `*` as outranking a later `!*/`)."""
    (tmp_path / ".git").mkdir()
    files = ["top.py", "notes.md", "x/a.py", "x/a.md", "x/y/b.py", "foo/keep.py", "foo/gone.py", "bar/baz/c.py"]
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    (tmp_path / ".gitignore").write_text("*\n!*/\n!*.py\nfoo/**\n!foo/keep.py\nbar/\n")
    found = sorted(path.relative_to(tmp_path).as_posix() for path in discover(tmp_path))
    assert found == ["foo/keep.py", "top.py", "x/a.py", "x/y/b.py"]


def test_a_tree_the_gitignore_above_it_leaves_out_is_read_by_its_own_alone(tmp_path: Path) -> None:
    """The full suite's: a package installed in the checkout's virtualenv, which the repository's .gitignore leaves
    out (`.venv/`), read as empty. Asked for on purpose, as a path given to git is, its own files alone apply."""
    (tmp_path / ".git").mkdir()
    (tmp_path / ".gitignore").write_text(".venv/\n*.py\n")
    tree = tmp_path / ".venv" / "lib" / "pkg"
    tree.mkdir(parents=True)
    for name in ("core.py", "skip.py"):
        (tree / name).write_text("x = 1\n")
    (tree / ".gitignore").write_text("skip.py\n")
    assert [path.name for path in discover(tree)] == ["core.py"]


def test_a_file_in_utf16_over_the_size_limit_is_read_whole(tmp_path: Path) -> None:
    """A review's: read by its start alone, a UTF-16 file was cut as if it were UTF-8, and sized by its bytes on
    disk, about twice its text's as UTF-8, which the limit is of."""
    text = "x = 1\n" * 1000
    (tmp_path / "wide.py").write_bytes(text.encode("utf-16"))
    read = read_tree(tmp_path, max_read_bytes=1000)["wide.py"]
    assert not isinstance(read, FileStart)
    assert read == text


def test_every_line_about_a_file_of_the_tree_names_it_by_its_path_in_the_tree(tmp_path: Path) -> None:
    """A tester's: a skipped file was named by its absolute path (quoted, or not), a file not in UTF-8 by its name
    alone, which two directories may share."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "latin1.md").write_bytes("# caf\xe9 au lait, a longer line of prose\n".encode("latin-1"))
    (tmp_path / "docs" / "nul.txt").write_bytes(b"a\0b\n")
    (tmp_path / "docs" / "link.py").symlink_to(tmp_path / "docs" / "latin1.md")
    (tmp_path / "docs" / "new\nline.py").write_text("x = 1\n")
    with capture_logs() as logs:
        read_tree(tmp_path)
    named = sorted((entry["event"], entry["path"]) for entry in logs if "path" in entry)
    assert named == [
        ("ingest_file_not_utf8", "docs/latin1.md"),
        ("ingest_file_skipped", "docs/link.py"),
        ("ingest_file_skipped", "docs/nul.txt"),
    ]
    (link,) = [entry for entry in logs if entry["path"] == "docs/link.py"]
    assert link["error"] == "docs/link.py: a symbolic link (links are not followed)"


def test_a_docstring_escaping_half_a_character_is_chunked_as_text_a_delta_can_carry() -> None:
    source = 'def f():\n    """lone \\udc00 half; a pair \\ud83d\\ude00 whole; a \\0 NUL"""\n    return 1\n'
    (doc,) = [c for c in chunk_python("m.py", source, 1000) if c.chunk_level == "doc"]
    assert doc.content == "lone \ufffd half; a pair \U0001f600 whole; a \ufffd NUL"  # pip's chardet: a NUL
    doc.content.encode("utf-8")  # what the ingest stopped on


def test_markdown_is_split_by_heading_outside_code_fences() -> None:
    source = textwrap.dedent(
        """\
        Intro text.

        # Title
        Body.

        ```bash
        # not a heading
        ```

        ## Install
        pip install it

        ### Deep
        deeper

        # Title
        again
        """
    )
    chunks = chunk_document("docs/guide.md", source, 100_000)
    assert [c.symbol_fqn for c in chunks] == [
        "docs/guide.md",
        "docs/guide.md > Title",
        "docs/guide.md > Title > Install",
        "docs/guide.md > Title > Install > Deep",
        "docs/guide.md > Title",
    ]
    assert "# not a heading" in chunks[1].content
    assert [c.lines for c in chunks] == [(1, 2), (3, 9), (10, 12), (13, 15), (16, 17)]
    assert len({c.symbol_key for c in chunks}) == 5
    assert {c.object_type for c in chunks} == {"docs.guide"}
    assert {c.chunk_level for c in chunks} == {"doc"}


def test_a_long_markdown_section_is_cut_into_parts_at_blank_lines_each_with_its_headings_and_lines() -> None:
    from ontofabric.services.ingest.chunking import SECTION_PART_CHARS, file_lines

    paragraphs = "".join(f"Paragraph {n}, line {i}: the budget, the staff.\n" for n in range(60) for i in range(3))
    spaced = paragraphs.replace(": the budget, the staff.\nParagraph", ": the budget, the staff.\n\nParagraph")
    table = "".join(f"| `SETTING_{n}` | {n} | what it does, said at some length |\n" for n in range(150))
    source = f"# Guide\nshort\n## Long\n{spaced}## Table\n{table}## After\nend\n"
    chunks = chunk_document("docs/guide.md", source, 1_000_000)
    lines = file_lines(source)
    for chunk in chunks:  # each part is its lines of the file, whole
        assert chunk.lines is not None
        assert "".join(lines[chunk.lines[0] - 1 : chunk.lines[1]]) == chunk.content
    long = [c for c in chunks if c.symbol_fqn == "docs/guide.md > Guide > Long"]
    table_parts = [c for c in chunks if c.symbol_fqn == "docs/guide.md > Guide > Table"]
    assert len(long) > 1
    assert len(table_parts) > 1  # a table with no blank line is cut at lines
    assert all(len(c.content) <= SECTION_PART_CHARS for c in [*long, *table_parts])
    assert all(c.content.endswith("\n\n") for c in long[:-1])  # at a blank line, between paragraphs
    assert [c.lines for c in chunks if c.symbol_fqn.endswith(("> Guide", "> After"))] == [
        (1, 2),
        (len(lines) - 1, len(lines)),
    ]
    assert len({c.symbol_key for c in chunks}) == len(chunks)
    assert "".join(c.content for c in chunks) == source  # nothing lost, nothing twice
    # A review's: a heading was a part alone before a line longer than a part, blank lines were parts of their
    # own, and a part could pass the size after a cut.
    from ontofabric.services.ingest.chunking import section_parts

    long_line = section_parts("# H\n" + "y" * 5000 + "\n" + "z\n" * 10, (1, 12))
    assert [lines for _, lines in long_line] == [(1, 2), (3, 12)]
    blanks = section_parts("# H\n" + "a\n" * 2500 + "\n" * 2000 + "b\n", (1, 4503))
    assert all(part.strip() for part, _ in blanks)
    paragraphs = "".join(f"{'w' * 1500}\n{'v' * 1400}\n\n" for _ in range(20))  # cut, the rest still too long
    assert all(len(part) <= SECTION_PART_CHARS for part, _ in section_parts(paragraphs, (1, 60)))


def test_markdown_headings_are_read_as_commonmark_reads_them_outside_fences_and_front_matter() -> None:
    """An outside tester's: a ``` line inside a ```` fence closed it, the fence's `# ...` line became a section, and
    so did a `# comment` of YAML front matter; a setext heading (`Title` over `=====`) was no heading at all."""
    source = textwrap.dedent(
        """\
        ---
        title: x
        # a yaml comment
        ---
        # Real
        text
        ````
        ```
        # inside a four-backtick fence
        ```
        ````
        ## After fences
           ### Indented up to three spaces
        body
        ~~~
        # in a tilde fence
        ~~~
        Setext title
        ============
        - a list item
        ---
        Setext second
        -------------
        text

        ---
        after a thematic break
        |---|---|
        """
    )
    chunks = chunk_document("f.md", source, 100_000)
    assert [(c.symbol_fqn, c.lines) for c in chunks] == [
        ("f.md", (1, 4)),
        ("f.md > Real", (5, 11)),
        ("f.md > Real > After fences > Indented up to three spaces", (12, 17)),  # a heading alone joins it
        ("f.md > Setext title", (18, 21)),
        ("f.md > Setext title > Setext second", (22, 28)),
    ]
    assert chunks[3].content.startswith("Setext title\n====")


def test_markdown_heading_titles_lose_their_closing_hashes_and_a_long_line_is_read_at_once() -> None:
    source = "# C#\ntext\n## Setup ##\nmore\n#\n- item\n---\n**Bold** title\n---\n"
    assert [(c.symbol_fqn, c.lines) for c in chunk_document("h.md", source, 100_000)] == [
        ("h.md > C#", (1, 2)),
        ("h.md > C# > Setup", (3, 7)),  # a lone # is no section; `---` under a list item no heading
        ("h.md > C# > **Bold** title", (8, 9)),
    ]
    # A review's: the heading expression backtracked over spaces, 46 s for 4,000 of them (hours for these).
    (long,) = chunk_document("l.md", "# a" + " " * 20_000 + "b\n", 100_000)
    assert long.symbol_fqn == "l.md > a" + " " * (MAX_HEADING_CHARS - 2) + "…"
    # A fence's marker inside YAML front matter opens no fence.
    front = "---\nx: |\n  ```\n---\n# A\ntext\n# B\n"
    assert [c.symbol_fqn for c in chunk_document("f.md", front, 100_000)] == ["f.md", "f.md > A", "f.md > B"]
    # A setext title of several lines is all of them, as CommonMark reads it: its last line alone was the title,
    # and the others stayed in the section above.
    several = "# A\ntext\n\nA title written\nover two lines\n---\nbody\n"
    assert [(c.symbol_fqn, c.lines) for c in chunk_document("s.md", several, 100_000)] == [
        ("s.md > A", (1, 3)),
        ("s.md > A > A title written over two lines", (4, 7)),
    ]
    # "```js```" is inline code, no fence: the heading after it was read as the fence's text.
    inline = "# A\n```js``` is inline code here\n# B\n~~~ a ~ tilde fence's info may hold ~\n# in it\n~~~\n"
    assert [c.symbol_fqn for c in chunk_document("i.md", inline, 100_000)] == ["i.md > A", "i.md > B"]
    # An outside tester's: a `# TODO` in an HTML comment became a section, and every section below it nested in it.
    # Nor are headings read in <pre>, <script> or the like up to their closing tag, or in a <div> up to a blank line.
    html = "# A\n<!--\n# TODO\n-->\n## Install\n<div>\n# in a div\n</div>\n\n# B\n<!-- one line -->\n# C\n"
    html += "<pre>\n# in pre\n\n# still in pre\n</pre>\n# D\n"
    assert [(c.symbol_fqn, c.lines) for c in chunk_document("h.md", html, 100_000)] == [
        ("h.md > A", (1, 4)),
        ("h.md > A > Install", (5, 9)),
        ("h.md > B", (10, 11)),
        ("h.md > C", (12, 17)),
        ("h.md > D", (18, 18)),
    ]
    # A block that closes on its own line ends there too, and is no part of a setext title below it (a review's
    # changelog: "<!-- auto-changelog-above --> 1.2.4 / 2021-08-05").
    closed = "# A\n<!-- auto -->\n1.2.4\n-----\n<pre>x</pre>\nTitle\n-----\n"
    assert [c.symbol_fqn for c in chunk_document("c.md", closed, 100_000)] == [
        "c.md > A",
        "c.md > A > 1.2.4",
        "c.md > A > Title",
    ]


def test_restructuredtext_is_split_by_section_title_as_docutils_reads_titles() -> None:
    """Sphinx documentation is reStructuredText: it was not read at all. A title's level is the order its style
    first appears in; a line under a list item, explicit markup or an indented block is no title, nor is a
    transition, nor an underline shorter than its title and than four characters."""
    from ontofabric.services.ingest.chunking import chunk_file, file_lines

    source = textwrap.dedent(
        """\
        .. _top:

        ==========
         Tenacity
        ==========

        Retrying library.

        Waiting
        =======

        How long to wait.

        Exponential
        -----------

        Doubles each time::

            Not a title
            ===========

        .. note::
           Not a title either
           ------------------

        - a list item
          -----------

        ----

        Jitter
        ------
        Random.

        Ab
        --
        A short title, its underline as long.

        Long title here
        --
        (too short an underline: text)

        Stopping
        ========

        After a delay.
        """
    )
    chunks = chunk_document("docs/index.rst", source, 100_000)
    assert [(c.symbol_fqn, c.lines) for c in chunks] == [
        ("docs/index.rst > Tenacity", (1, 8)),  # the label before it is no text of its own
        ("docs/index.rst > Tenacity > Waiting", (9, 13)),
        ("docs/index.rst > Tenacity > Waiting > Exponential", (14, 30)),
        ("docs/index.rst > Tenacity > Waiting > Jitter", (31, 34)),
        ("docs/index.rst > Tenacity > Waiting > Ab", (35, 42)),
        ("docs/index.rst > Tenacity > Stopping", (43, 46)),
    ]
    lines = file_lines(source)
    assert all("".join(lines[c.lines[0] - 1 : c.lines[1]]) == c.content for c in chunks if c.lines)
    assert {(c.source_domain, c.symbol_kind, c.chunk_level, c.object_type) for c in chunks} == {
        ("restructuredtext", "section", "doc", "docs.index")
    }
    assert len({c.symbol_key for c in chunks}) == len(chunks)
    # The ingester reads such files, and a long one by parts as it does Markdown.
    assert chunk_file("a.rst", "Title\n=====\n" + "word " * 2000 + "\n", 100_000)[0].symbol_fqn == "a.rst > Title"
    assert len(chunk_file("b.rst", "Title\n=====\n" + "a line of words\n\n" * 600, 1_000_000)) > 1
    # A text file's titles are read so too (documentation kept in .txt is reStructuredText); plain text is one
    # section, in parts when long. They were left out without a word.
    (notes,) = chunk_file("docs/notes.txt", "Title\n=====\n\nbody\n", 100_000)
    assert (notes.symbol_fqn, notes.source_domain, notes.lines) == ("docs/notes.txt > Title", "text", (1, 4))
    plain = "a line of plain words, with no title at all\n\n" * 200
    assert [c.symbol_fqn for c in chunk_file("LICENSE.txt", plain, 100_000)] == ["LICENSE.txt"] * 3
    # A review's, as docutils reads them: a title right under another's underline, or right after a label, starts a
    # section (it was missed, and every level after it shifted); an option list's item over an underline is none;
    # a label between a heading and its first subsection is no text of the heading's section.
    close = "=========\n Project\n=========\nOverview\n========\nSome text.\n.. _label:\nLabelled\n--------\n"
    close += "\n-a  An option\n-------------\nmore\n\nSphinx\n======\n\n.. _linux:\n\nLinux\n-----\nbody\n"
    assert [(c.symbol_fqn, c.lines) for c in chunk_document("c.rst", close, 100_000)] == [
        ("c.rst > Project > Overview", (1, 7)),
        ("c.rst > Project > Overview > Labelled", (8, 14)),
        ("c.rst > Project > Sphinx > Linux", (15, 22)),
    ]
    # A second review's: after `...` or `..word` (no explicit markup), a line of punctuation or a transition, the
    # paragraph goes on, and the line under it is no title's.
    for before in ("...and so it goes", "..nospace", "????", "----------"):
        text = f"Intro\n=====\n\n{before}\nTitle\n-----\n"
        assert [c.symbol_fqn for c in chunk_document("e.rst", text, 100_000)] == ["e.rst > Intro"], before
    # After a field's, a list's, a line block's or an option's item the title is one (after a doctest's, not).
    for before in (":field: value", "- item", "| line", "-a  opt"):
        text = f"Intro\n=====\n\n{before}\nTitle\n-----\n"
        assert [c.symbol_fqn for c in chunk_document("f.rst", text, 100_000)][-1] == "f.rst > Intro > Title", before


def test_a_heading_with_nothing_under_it_goes_with_its_first_subsection() -> None:
    """A review of the documentation tester's finding: `## Set up` right above `### On Linux` was a chunk of the
    title alone, which a question in the title's words found first. A heading alone before a sibling, or at the
    end, stays its own."""
    markdown = "# Guide\n\n## Set up\n\n### On Linux\ntext\n## Empty\n## Next\nmore\n## Last\n"
    assert [(c.symbol_fqn, c.lines) for c in chunk_document("g.md", markdown, 100_000)] == [
        ("g.md > Guide > Set up > On Linux", (1, 6)),
        ("g.md > Guide > Empty", (7, 7)),
        ("g.md > Guide > Next", (8, 9)),
        ("g.md > Guide > Last", (10, 10)),
    ]
    rst = "Guide\n=====\n\nSet up\n------\n\nOn Linux\n~~~~~~~~\ntext\n"
    assert [(c.symbol_fqn, c.lines) for c in chunk_document("g.rst", rst, 100_000)] == [
        ("g.rst > Guide > Set up > On Linux", (1, 9)),
    ]
    setext = "Title\n=====\nSub\n---\nbody\n"  # a setext title's own lines are no body of its section
    assert [(c.symbol_fqn, c.lines) for c in chunk_document("s.md", setext, 100_000)] == [
        ("s.md > Title > Sub", (1, 5))
    ]


def test_a_chunk_cut_to_the_content_limit_states_the_lines_its_text_reaches() -> None:
    """An outside tester's: a 4,000-line function said lines 4-4006 of a text that stopped at line 3545."""
    source = "x = 1\n\n\ndef f():\n" + "".join(f"    v{i} = {i}  # filler line {i}\n" for i in range(3000))
    function = next(c for c in chunk_python("big.py", source, 20_000) if c.symbol_kind == "function")
    assert function.cut_from_bytes is not None
    first, last = function.lines or (0, 0)
    assert first == 4
    assert last == first + function.content.count("\n")  # the last of them in part
    assert source.split("\n")[last - 1].startswith(function.content.rsplit("\n", 1)[1])
    assert chunk_python("empty.py", "", 1000)[0].lines is None  # an empty file has no line to state
    # A docstring's text is cleaned, not the file's lines: cut, it keeps its literal's.
    docstring = 'def g():\n    """\n' + "".join(f"    line {i} of the docstring\n" for i in range(100)) + '    """\n'
    (doc,) = [c for c in chunk_python("d.py", docstring, 200) if c.symbol_kind == "docstring"]
    assert (doc.cut_from_bytes is not None, doc.lines) == (True, (2, 103))


def test_names() -> None:
    assert module_name("services/query/__init__.py") == "services.query"
    assert module_name("setup.py") == "setup"
    assert module_name("pkg/nfd_mode\u0301.py") == "pkg.nfd_mod\u00e9"  # as Python reads the name importing it
    assert module_name("\ufb01le_lig.py") == "file_lig"
    assert module_name("src/a\uff0fb.py") == "src.a\uff0fb"  # a form holding a separator is kept (a review's)
    assert module_name("src/a\uff0eb.py") != module_name("src/a/b.py")
    assert object_type_name("m.x\U000e0100y") == "m.x_y"  # a variation selector past the planes shows nothing
    assert object_type_name("2fa.helpers") == "_2fa.helpers"
    assert object_type_name("my pkg.mod") == "my_pkg.mod"
    assert truncate_utf8("héllo", 2) == "h"


def test_a_chunk_longer_than_the_content_limit_keeps_its_start_and_says_how_long_it_was() -> None:
    """A tester's 2 MB file was cut without a word: the ingester now logs each cut chunk (``ingest_chunk_cut``)."""
    source = "def small():\n    return 1\n\n\ndef large():\n    return '" + "x" * 300 + "'\n"
    chunks = {c.symbol_fqn: c for c in chunk_python("m.py", source, 200)}
    assert chunks["m.small"].cut_from_bytes is None
    assert (chunks["m.large"].cut_from_bytes or 0) > 200
    assert len(chunks["m.large"].content.encode()) == 200
    (whole,) = chunk_document("a.md", "# A\n\nshort\n", 200)
    assert whole.cut_from_bytes is None


def test_names_past_what_a_document_carries_are_named_in_a_warning() -> None:
    """A tenant tester's module assigning 10,000 names: those past the 512th were not found by name, unsaid."""
    from structlog.testing import capture_logs

    sources = {"many.py": "".join(f"a{n} = {n}\n" for n in range(10_000)), "few.py": "x = 1\n"}
    with capture_logs() as logged:
        chunk_sources(Path("."), sources, 1 << 20)
    (cut,) = [entry for entry in logged if entry["event"] == "ingest_names_cut"]
    assert (cut["symbol"], cut["names"]) == ("many", 10_000)
    assert 0 < cut["kept"] < 10_000


def _desired(chunks: list) -> dict[str, str]:  # type: ignore[type-arg]
    return {f"d:{c.document_id}": c.content_hash for c in chunks}


def test_ingest_plan_publishes_only_changes() -> None:
    first = chunk_python("pkg/reader.py", PYTHON, 100_000)
    plan = plan_ingest(_desired(first), Manifest())
    assert len(plan.upserts) == len(first)
    assert plan.deletes == []
    again = plan_ingest(_desired(first), plan.manifest)
    assert (again.upserts, again.deletes, again.unchanged) == ([], [], len(first))

    edited = chunk_python("pkg/reader.py", PYTHON.replace("return url", "return url.strip()"), 100_000)
    changed = plan_ingest(_desired(edited), plan.manifest)
    by_key = {f"d:{c.document_id}": c.symbol_key for c in edited}
    assert sorted(by_key[k] for k in changed.upserts) == ["python:pkg/reader.py", "python:pkg/reader.py/fetch()."]
    without_fetch = [c for c in first if "fetch" not in c.symbol_key]
    removed = plan_ingest(_desired(without_fetch), plan.manifest)
    assert removed.deletes == [f"d:{c.document_id}" for c in first if "fetch" in c.symbol_key]
    assert removed.reverts == []


def test_branch_plan_holds_only_the_delta_over_main() -> None:
    main = Manifest({"d:a": "1", "d:b": "1", "d:c": "1"})
    # The branch changes a, removes b, adds d, keeps c as main has it.
    first = plan_ingest({"d:a": "2", "d:c": "1", "d:d": "1"}, Manifest(), main)
    assert (first.upserts, first.deletes, first.reverts) == (["d:a", "d:d"], ["d:b"], [])
    assert first.manifest.entries == {"d:a": "2", "d:b": TOMBSTONE, "d:d": "1"}
    # Later the branch undoes its change to a and brings b back as main has it: both revert to main's.
    second = plan_ingest({"d:a": "1", "d:b": "1", "d:c": "1", "d:d": "1"}, first.manifest, main)
    assert (second.upserts, second.deletes, second.reverts) == ([], [], ["d:a", "d:b"])
    assert second.manifest.entries == {"d:d": "1"}
    # Nothing changed since: nothing to publish.
    third = plan_ingest({"d:a": "1", "d:b": "1", "d:c": "1", "d:d": "1"}, second.manifest, main)
    assert (third.upserts, third.deletes, third.reverts) == ([], [], [])


def test_a_branch_that_changes_a_file_holds_every_document_of_it() -> None:
    """So that main's later changes to the file (lines moved, documents added, the file deleted) do not show
    through on the branch: a query there reads main's documents of the file as hidden (an outside tester's)."""
    main = Manifest({"d:mod": "1", "d:f": "1", "d:g": "1", "d:other": "1"})
    files = {"d:mod": "a.py", "d:f": "a.py", "d:g": "a.py", "d:other": "b.py", "d:new": "c.py"}
    plan = plan_ingest({"d:mod": "2", "d:f": "1", "d:g": "2", "d:other": "1"}, Manifest(), main, files)
    assert (plan.upserts, plan.deletes) == (["d:f", "d:g", "d:mod"], [])  # f as main has it, and not b.py's
    # Back as main has it: the whole file reverts, and main's shows through again.
    back = plan_ingest(main.entries, plan.manifest, main, files)
    assert (back.upserts, back.reverts, back.manifest.entries) == ([], ["d:f", "d:g", "d:mod"], {})


def test_a_file_whose_documents_differ_only_in_what_other_files_make_of_them_follows_main() -> None:
    """An outside tester's: a function moved on a branch changed the calls of every chunk calling it, and each of
    their files was taken whole, so main's later changes to those files stopped showing on the branch."""
    main = Manifest({"d:utils": "u|sig", "d:nap": "n|sig", "d:wait": "w|sig", "d:caller": "c|sig|calls:utils.f"})
    files = {"d:utils": "utils.py", "d:nap": "nap.py", "d:wait": "wait.py", "d:caller": "wait.py"}
    moved = {"d:utils": "u2|sig", "d:nap": "n2|sig", "d:wait": "w|sig", "d:caller": "c|sig|calls:nap.f"}
    plan = plan_ingest(moved, Manifest(), main, files)
    assert plan.upserts == ["d:caller", "d:nap", "d:utils"]  # the caller overrides main's by id; wait.py's rest not
    assert plan.whole_file == {"d:nap", "d:utils"}
    # A caller whose text changed too makes its file the branch's.
    edited = plan_ingest({**moved, "d:caller": "c2|sig|calls:nap.f"}, Manifest(), main, files)
    assert edited.whole_file == {"d:caller", "d:nap", "d:utils", "d:wait"}


def test_a_branch_that_only_takes_documents_out_of_a_file_or_deletes_it_says_so() -> None:
    """Note 77's: a file a branch changed only by losing a document (its last section, a cut tail) was not held
    whole, and a Markdown file it deleted had no module to say so; main's later changes showed through on it."""
    main_files = {"d:intro": "a.md", "d:usage": "a.md", "d:last": "a.md", "d:top": "b.md", "d:end": "b.md"}
    main = Manifest(dict.fromkeys(main_files, "1"), files=main_files)
    files = {"d:intro": "a.md", "d:usage": "a.md"}  # a.md lost its last section; b.md is gone
    plan = plan_ingest({"d:intro": "1", "d:usage": "1"}, Manifest(), main, files)
    assert (plan.upserts, plan.deletes) == (["d:intro", "d:usage"], ["d:end", "d:last", "d:top"])
    assert plan.deleted_files == {"d:end": "b.md", "d:top": "b.md"}
    saved = Manifest.from_json(plan.manifest.to_json())
    assert saved.files == {"d:intro": "a.md", "d:usage": "a.md", "d:last": "a.md", "d:end": "b.md", "d:top": "b.md"}
    assert (saved.entries["d:last"], saved.entries["d:end"]) == (TOMBSTONE, DELETED_FILE)
    assert plan_ingest({"d:intro": "1", "d:usage": "1"}, saved, main, files).deletes == []  # said once
    # Tombstones sent before files were recorded name no file: they go again, naming it.
    before = Manifest({k: TOMBSTONE if v == DELETED_FILE else v for k, v in saved.entries.items()})
    assert plan_ingest({"d:intro": "1", "d:usage": "1"}, before, main, files).deletes == ["d:end", "d:top"]
    # Main's manifest saved again by a release that records no files: the branch's own record stands in.
    again = plan_ingest({"d:intro": "1", "d:usage": "1"}, saved, Manifest(main.entries), files)
    assert (again.upserts, again.deletes, again.reverts) == ([], [], [])
    # b.md back on the branch, changed: its tombstones no longer say the file is deleted.
    files_back = {**files, "d:top": "b.md"}
    back = plan_ingest({"d:intro": "1", "d:usage": "1", "d:top": "2"}, saved, main, files_back)
    assert (back.upserts, back.deletes, back.deleted_files) == (["d:top"], ["d:end"], {})
    # Main's manifest saved before files were recorded: as before, a tombstone of the key only.
    unrecorded = plan_ingest({"d:intro": "1", "d:usage": "1"}, Manifest(), Manifest(main.entries), files)
    assert (unrecorded.upserts, unrecorded.deleted_files) == ([], {})


def test_a_plan_made_with_part_of_the_tree_unread_takes_nothing_out_and_sends_only_new_text() -> None:
    """A review's: with a file unread, an unchanged file's calls and a class's bases (read from the whole tree)
    came out otherwise and were sent, and on a branch a key unknown on both sides was reverted."""
    previous = Manifest({"d:a": "h1|sig|calls:b.g", "d:b": "h2|sig", "d:gone": "h3|sig", "n:a.A": "b.B", "l:x": "1"})
    desired = {"d:a": "h1|sig|", "d:new": "h4|sig", "n:a.A": "B", "n:a.C": "", "l:y": "1"}  # b.py not read
    plan = without_removals(plan_ingest(as_far_as_read(desired, previous), previous), previous)
    assert (plan.upserts, plan.deletes, plan.reverts) == (["d:new"], [], [])
    assert plan.manifest.entries == {**previous.entries, "d:new": "h4|sig"}  # the next full read removes d:gone
    # A branch: main's unknown key, unknown on the branch too, is not reverted; a hidden one stays hidden.
    main = Manifest({"d:u": UNKNOWN, "d:m": "h5|sig", "d:hidden": "h6|sig"})
    branch = Manifest({"d:u": UNKNOWN, "d:own": "h7|sig", "d:hidden": TOMBSTONE})
    on_branch = without_removals(plan_ingest(as_far_as_read({}, branch, main), branch, main), branch)
    assert (on_branch.upserts, on_branch.deletes, on_branch.reverts) == ([], [], [])
    assert on_branch.manifest.entries == branch.entries


def test_event_ids_repeat_for_a_rerun_and_change_after_a_round_trip() -> None:
    base = Manifest({"d:doc": "hash-a"}).digest
    assert event_id("w", "main", base, "d:doc", "hash-b") == event_id("w", "main", base, "d:doc", "hash-b")
    # A -> B -> A: publishing A again must not look like a duplicate of the first A.
    after_b = Manifest({"d:doc": "hash-b"}).digest
    first = event_id("w", "main", Manifest().digest, "d:doc", "hash-a")
    assert first != event_id("w", "main", after_b, "d:doc", "hash-a")


def test_a_manifest_of_the_first_format_reads_as_document_keys() -> None:
    old = Manifest.from_json(b'{"version": 1, "entries": {"pkg/a.py::f": "h1"}}')
    assert old.entries == {"d:pkg/a.py::f": "h1"}
    plan = plan_ingest({"d:pkg/a.py::f": "h1"}, old)
    assert (plan.upserts, plan.deletes) == ([], [])  # nothing changed, so nothing to publish or remove
    assert Manifest.from_json(Manifest({"n:pkg.a": "h"}).to_json()).entries == {"n:pkg.a": "h"}
    # The patterns an ingest excluded go with it, only when there were some (earlier manifests read as before).
    assert Manifest.from_json(Manifest({"n:pkg.a": "h"}).to_json()).exclude is None  # not recorded: unknown
    assert Manifest.from_json(Manifest({"n:pkg.a": "h"}, ()).to_json()).exclude == ()  # recorded: none
    kept = Manifest.from_json(Manifest({"d:a": "1"}, ("tests", "*_pb2.py")).to_json())
    assert kept == Manifest({"d:a": "1"}, ("tests", "*_pb2.py"))
    assert kept.merged_with(Manifest({"d:a": "2"})).exclude == ("tests", "*_pb2.py")
    assert kept.digest == Manifest({"d:a": "1"}).digest  # event ids do not move with the patterns


def test_manifests_of_two_racing_ingests_merge_into_what_is_known() -> None:
    mine = Manifest({"d:a": "1", "d:both": "1", "d:differs": "1"})
    theirs = Manifest({"d:b": "1", "d:both": "1", "d:differs": "2"})
    merged = mine.merged_with(theirs)
    assert merged.entries == {"d:a": UNKNOWN, "d:b": UNKNOWN, "d:both": "1", "d:differs": UNKNOWN}
    # The next ingest of a tree holding a and both sends a again, and removes b and differs.
    plan = plan_ingest({"d:a": "1", "d:both": "1"}, merged)
    assert (plan.upserts, plan.deletes) == (["d:a"], ["d:b", "d:differs"])
    # The last delta either published is what the index must reach.
    mine = Manifest({"d:a": "1"}, published_through=40, published_from=31)
    published = mine.merged_with(Manifest({"d:a": "1"}, published_through=7, published_from=5))
    assert (published.published_from, published.published_through) == (5, 40)
    assert Manifest.from_json(published.to_json()) == published
    assert Manifest.from_json(b'{"version": 2, "entries": {}}').published_through is None  # an earlier release's
    assert Manifest({"d:a": "1"}).merged_with(Manifest()).published_through is None
    assert published.digest == Manifest({"d:a": "1"}).digest  # event ids do not move with it


def test_a_tree_that_is_a_package_names_its_modules_as_python_imports_them(tmp_path: Path) -> None:
    assert tree_package("tenacity", ["__init__.py", "retry.py"]) == "tenacity"
    assert tree_package("my-project", ["__init__.py"]) is None  # no importable name
    assert tree_package("repo", ["pkg/__init__.py", "setup.py"]) is None  # a project holding packages
    # Named by the ingest: whatever the checkout is called, or no package at all.
    assert tree_package("tenacity-fix", ["__init__.py"], "tenacity") == "tenacity"
    assert tree_package("tenacity", ["__init__.py"], "") is None
    with pytest.raises(ValueError, match="not a package name"):
        tree_package("x", [], "my-package")
    assert module_name("__init__.py", "tenacity") == "tenacity"
    assert module_name("wait/__init__.py", "tenacity") == "tenacity.wait"

    package = tmp_path / "tenacity"
    package.mkdir()
    (package / "__init__.py").write_text("from .retry import Retrying\n\nclass BaseAction:\n    pass\n")
    (package / "retry.py").write_text("class Retrying:\n    pass\n")
    names = {c.symbol_fqn for c in chunk_tree(package, 1 << 20)}
    assert {"tenacity", "tenacity.BaseAction", "tenacity.retry", "tenacity.retry.Retrying"} <= names
    nodes, links = python_graph({"__init__.py": "from .retry import Retrying\n", "retry.py": ""}, "tenacity")
    assert {n.object_type for n in nodes} == {"tenacity", "tenacity.retry"}
    assert [(k.source_type, k.target_type) for k in links] == [("tenacity", "tenacity.retry")]


def test_a_callee_name_the_contract_cannot_carry_is_left_out_and_the_ingest_goes_on(tmp_path: Path) -> None:
    from ontofabric.services.ingest.ingester import chunk_sources, to_document

    long = "C" * 1100
    source = f"class {long}:\n    pass\n\n\ndef make():\n    return {long}()\n\n\ndef use():\n    return make()\n"
    chunks = chunk_sources(tmp_path, {"m.py": source}, 1 << 20)
    calls = {c.symbol_fqn: c.calls for c in chunks if c.chunk_level == "method"}
    assert calls == {"m.make": (), "m.use": ("m.make",)}
    for chunk in chunks:  # each one a valid document
        to_document(chunk, None, None)


def test_calls_past_their_share_of_the_metadata_are_left_out_and_the_ingest_goes_on(tmp_path: Path) -> None:
    """400 callees of 200 characters each are within the contract's count and length, not its metadata bound."""
    from ontofabric.services.ingest.ingester import CALLS_BYTES, DEFINES_BYTES, chunk_sources, to_document

    names = [f"f{n:03d}_" + "x" * 195 for n in range(400)]
    source = "".join(f"def {name}():\n    pass\n\n\n" for name in names)
    source += "def use():\n" + "".join(f"    {name}()\n" for name in names)
    chunks = chunk_sources(tmp_path, {"m.py": source}, 1 << 20)
    (use,) = [c for c in chunks if c.symbol_fqn == "m.use"]
    assert use.calls == tuple(f"m.{name}" for name in names[: len(use.calls)])  # the first ones, in order
    assert CALLS_BYTES // 210 <= len(use.calls) < 400
    for chunk in chunks:
        to_document(chunk, None, None)
    # And names assigned past theirs, beside calls past theirs: one module chunk carrying both is still valid.
    source += "".join(f"{name.upper()} = 1\n" for name in names) + "".join(f"{name}()\n" for name in names)
    (module,) = [c for c in chunk_sources(tmp_path, {"m.py": source}, 1 << 20) if c.symbol_fqn == "m"]
    document = to_document(module, None, None)
    assert document.metadata.calls
    assert document.metadata.defines
    assert DEFINES_BYTES // 210 <= len(document.metadata.defines) < 400


def test_a_symbol_too_long_for_the_index_keeps_its_start_a_hash_of_the_whole_and_its_name() -> None:
    """A lookup by name reads a qualified name's last dotted part: a shortened one keeps it (a review's finding)."""
    deep = ".".join(f"package{n}" for n in range(100))
    short, other = bounded_symbol(f"{deep}.Circle.area"), bounded_symbol(f"{deep}.Circle.perimeter")
    assert len(short) == MAX_SYMBOL_CHARS
    assert short.startswith("package0.package1.")
    assert short.endswith(".area")
    assert short.rsplit(".", 1)[0] != other.rsplit(".", 1)[0]  # the hash of the whole tells them apart
    assert bounded_symbol("pkg.mod.f") == "pkg.mod.f"
    huge = bounded_symbol("f" * 6000)  # a name longer than the limit itself: start and hash only
    assert len(huge) == MAX_SYMBOL_CHARS


def test_a_module_and_a_class_carry_the_names_their_own_statements_assign() -> None:
    """An agent tester's: a module constant (DEFAULT_TIMEOUT_CONFIG) has no chunk of its own, and a query for it
    found only the code using it."""
    source = (
        "import os\nLIMIT = 5\nA, (B, *C) = 1, (2, 3)\nTYPED: int = 1\nDECLARED: int\n"
        "try:\n    FAST = True\nexcept ImportError:\n    FAST = False\n"
        "class K:\n    size = 3\n    def f(self):\n        local = 1\n"
    )
    chunks = {c.symbol_fqn: c for c in chunk_python("m.py", source, 10_000)}
    assert chunks["m"].defines == ("LIMIT", "A", "B", "C", "TYPED", "DECLARED", "FAST")
    assert chunks["m.K"].defines == ("size",)
    assert chunks["m.K.f"].defines == ()


def test_overload_stubs_of_a_function_defined_below_them_are_not_chunks_of_their_own() -> None:
    """An agent tester's: each @overload stub was Command.main once more in an answer, with the implementation's
    calls. A stub with no implementation beside it (a protocol's) stays."""
    source = (
        "import typing as t\nfrom typing import overload\n"
        "class K:\n    @t.overload\n    def f(self, x: int) -> int: ...\n"
        "    @overload\n    def f(self, x: str) -> str: ...\n"
        "    def f(self, x):\n        return x\n"
        "@overload\ndef only(x: int) -> int: ...\n"
    )
    chunks = [(c.symbol_fqn, c.chunk_level) for c in chunk_python("m.py", source, 10_000)]
    assert chunks == [("m", "file"), ("m.K", "type"), ("m.K.f", "method"), ("m.only", "method")]
    (implementation,) = [c for c in chunk_python("m.py", source, 10_000) if c.symbol_fqn == "m.K.f"]
    assert "return x" in implementation.content


def test_a_class_or_function_under_a_module_level_if_or_try_is_a_chunk_of_its_own() -> None:
    """A tester's: urllib3's 32 definitions under `if typing.TYPE_CHECKING:`, a version check or a `try` were not
    indexed, and a question for one was told to check its spelling."""
    source = (
        "import typing\nif typing.TYPE_CHECKING:\n    class Base:\n        pass\nelse:\n    Base = object\n"
        "try:\n    import brotli\n\n    class Decoder:\n        def decompress(self, data):\n            return data\n"
        "except ImportError:\n    pass\n"
        "class K:\n    if True:\n        def f(self):\n            return 1\n"
        "def outer():\n    if True:\n        def inner():\n            return 2\n"
    )
    chunks = {(c.symbol_fqn, c.chunk_level) for c in chunk_python("m.py", source, 10_000)}
    assert {
        ("m.Base", "type"),
        ("m.Decoder", "type"),
        ("m.Decoder.decompress", "method"),
        ("m.K.f", "method"),
    } <= chunks
    assert ("m.inner", "method") not in chunks  # a function's own block stays in its chunk
    assert ("m.outer.inner", "method") not in chunks
