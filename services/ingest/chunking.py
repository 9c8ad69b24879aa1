"""Chunking source files at structural boundaries (pure; no I/O).

Python is split at AST boundaries: the file (chunk level ``file``), each class (``type``), each function and
method (``method``) and each docstring (``doc``). Markdown and reStructuredText are split by section title (``doc``).
Every chunk carries a symbol key that survives edits to the symbol's body, so re-ingesting a changed file updates
chunks in place.
"""

from __future__ import annotations

import ast
import hashlib
import re
import sys
import unicodedata
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Literal

from ontofabric.contracts.documents import NOT_IN_NAMES
from ontofabric.contracts.identifiers import as_python_reads
from ontofabric.shared.embedder import embedding_text

ChunkLevel = Literal["file", "type", "method", "doc"]

MAX_OBJECT_TYPE_CHARS = 512  # the contract's limit (contracts/documents.py ObjectType)
_HEADING = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*))?$")  # its closing #s taken off apart (_heading_title)
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_FRONT_MATTER_END = re.compile(r"^(---|\.\.\.)\s*$")
_UNDERLINE = re.compile(r"^ {0,3}(=+|-+)[ \t]*\r?\n?$")  # a setext heading's, under its title
_NO_TITLE = re.compile(r"^\s*([-*+](\s|$)|[>|]|\d+[.)](\s|$)|$)")  # a list item, quote, table row, blank line
# HTML blocks that hold no headings (CommonMark's kinds 1, 2 and 6): each with the end that closes it; None is a
# blank line. A `# TODO` in a comment was read as a heading, and every section below it as nested in it.
_HTML_BLOCKS: tuple[tuple[re.Pattern[str], re.Pattern[str] | None], ...] = (
    (
        re.compile(r"^ {0,3}<(script|pre|style|textarea)(\s|>|$)", re.I),
        re.compile(r"</(script|pre|style|textarea)>", re.I),
    ),
    (re.compile(r"^ {0,3}<!--"), re.compile(r"-->")),
    (
        re.compile(
            r"^ {0,3}</?(address|article|aside|blockquote|details|dialog|div|dl|fieldset|figcaption|figure|footer|form"
            r"|h[1-6]|header|hr|li|main|nav|ol|p|section|summary|table|tbody|td|tfoot|th|thead|tr|ul)(\s|/?>|$)",
            re.I,
        ),
        None,
    ),
)
_BREAK = re.compile(r"^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$")  # a thematic break (`---`, `* * *`): no title either
_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")


@dataclass(frozen=True)
class Chunk:
    symbol_key: str
    symbol_kind: str
    symbol_fqn: str
    chunk_level: ChunkLevel
    object_type: str
    source_domain: str
    file_path: str
    content: str
    calls: tuple[str, ...] = ()
    """Qualified names of the symbols the chunk's own code calls (``graph.python_calls``; set by the ingester,
    which sees the whole tree)."""
    cut_from_bytes: int | None = None
    """The text's size when it was longer than the content limit and ``content`` is its start; None when whole."""
    line: int = 0
    """The line of a class's or function's ``class`` or ``def`` statement (0 for any other chunk): what tells a
    property's getter from its setter, which share a qualified name."""
    defines: tuple[str, ...] = ()
    """The names the chunk's own statements assign at its level (a module's constants, a class's attributes):
    they have no chunk of their own, so a query for one finds them here (``assigned_names``)."""
    aliases: tuple[str, ...] = ()
    """The names a package re-exports the chunk's symbol under (``click.Option`` for ``click.core.Option``; set by
    the ingester, which sees the whole tree: ``graph.python_exports``)."""
    parse_error: str | None = None
    """A file's chunk: why its source could not be parsed (or, over the ingest's size limit, was not), so that it
    has no chunk of a symbol or section, nor calls."""
    lines: tuple[int, int] | None = None
    """The first and last line (1-based, inclusive) of the file that the chunk's text comes from: a class or
    function from its first decorator, a docstring its string literal, a file all of it. What lets an agent open
    the file where the result is, rather than grep for the symbol."""

    @property
    def content_hash(self) -> str:
        return hashlib.sha256(self.content.encode("utf-8")).hexdigest()

    @property
    def document_id(self) -> str:
        """Stable across content changes: derived from the symbol key alone."""
        return hashlib.sha256(self.symbol_key.encode("utf-8")).hexdigest()[:32]

    @property
    def embedding_text(self) -> str:
        return embedding_text(self.content, self.symbol_fqn)


def file_lines(source: str) -> list[str]:
    """The lines of a file as Python and editors count them, each with its end: ``str.splitlines`` also ends a
    line at a form feed, U+2028 and other separators, which a comment or a string may hold, and every chunk below
    one was cut from the wrong lines and numbered wrong."""
    return _LINE.findall(source)


MAX_SYMBOL_CHARS = 512
"""The longest symbol key or qualified name the ingester makes: PostgreSQL indexes them with the workspace and
branch, in index entries of at most about 2,700 bytes, and refused a longer one (apply_failed). The contract does
not bound them: deltas with longer ones, applied before, are in streams and snapshots."""


def bounded_symbol(name: str) -> str:
    """A symbol key or qualified name within ``MAX_SYMBOL_CHARS``: a longer one keeps its start, a hash of the whole
    (so that keys stay unique) and its last dotted part when that is short (what a lookup by name reads)."""
    if len(name) <= MAX_SYMBOL_CHARS:
        return name
    digest = hashlib.sha256(name.encode("utf-8")).hexdigest()[:32]
    last = name.rsplit(".", 1)[-1] if "." in name else ""
    tail = f"~{digest}.{last}" if 0 < len(last) <= MAX_SYMBOL_CHARS // 4 else f"~{digest}"
    return name[: MAX_SYMBOL_CHARS - len(tail)] + tail


def object_type_name(dotted: str) -> str:
    """A dotted name made valid as an objectType: its letters, digits and marks of any script and ``_.$-`` kept,
    any other character ``_``; no leading digit; 512 at most. A tester's ``class Животное`` and ``class Растение``
    were both ``________`` (any letter past ASCII was ``_``), one node of the graph."""
    cleaned = "".join(map(_object_type_character, as_python_reads(dotted))).strip(".") or "_"
    valid = f"_{cleaned}" if not (cleaned[0].isalpha() or cleaned[0] == "_") else cleaned
    return valid[:MAX_OBJECT_TYPE_CHARS]


def _object_type_character(char: str) -> str:
    """A character of a name as an object type holds it: a letter, digit or mark of any script, or what else
    continues a Python identifier (``x‿y``, ``x·y``, ``℘``: a Unicode tester's ``x·y`` and ``x_y`` were one type),
    but none :data:`NOT_IN_NAMES` refuses; any other ``_``."""
    if char.isascii():
        return char if char.isalnum() or char in "_.$-" else "_"
    if _REFUSED_IN_NAMES.match(char) or not (unicodedata.category(char)[0] in "LMN" or f"a{char}".isidentifier()):
        return "_"
    return char


_REFUSED_IN_NAMES = re.compile(f"[{NOT_IN_NAMES}\U000e0000-\U000e01ef]")
"""What :data:`NOT_IN_NAMES` refuses, and past the planes a JSON Schema's pattern can state, the tags and the
variation selectors there (a review's ``x\U000e0100y`` was kept as it is)."""


def whole_characters(text: str) -> str:
    """``text`` with an escaped surrogate pair made the character it stands for and a lone half made U+FFFD, and an
    escaped NUL made U+FFFD too. A docstring is the value of a string literal, and ``"\\udc00"`` and ``"\\0"`` are
    valid Python: no text of a delta can hold either (a tester's tree with one such docstring stopped the whole
    ingest with a traceback; another's held pip, whose vendored chardet documents a pattern of ``\\0``)."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace").replace("\0", "\ufffd")


class FileStart(str):
    """The start of a file too large to be read whole (the ingest reads no more of one than it could index: a
    tester's 50 GB file ran it out of memory), with the size of the whole file in bytes."""

    whole_bytes: int

    def __new__(cls, text: str, whole_bytes: int) -> FileStart:
        start = super().__new__(cls, text)
        start.whole_bytes = whole_bytes
        return start


def utf8_size(text: str) -> int:
    """The bytes ``text`` takes as UTF-8; of a whole file for a :class:`FileStart`."""
    return text.whole_bytes if isinstance(text, FileStart) else len(text.encode("utf-8", "surrogatepass"))


def truncate_utf8(text: str, max_bytes: int) -> str:
    encoded = text.encode("utf-8")
    if len(encoded) <= max_bytes:
        return text
    return encoded[:max_bytes].decode("utf-8", errors="ignore")


def cut_chunk(
    whole: Chunk, max_content_bytes: int, span: tuple[int, int] | None, lines_of_content: bool = True
) -> Chunk:
    """``whole`` (its content the symbol's whole text) with its content cut to ``max_content_bytes``, its names
    within MAX_SYMBOL_CHARS, and the lines ``span`` states (``lines_of_content``: the content is those lines, so
    a cut one states fewer)."""
    kept, cut = truncate_utf8(whole.content, max_content_bytes), cut_from(whole.content, max_content_bytes)
    return replace(
        whole,
        symbol_key=bounded_symbol(whole.symbol_key),
        symbol_fqn=bounded_symbol(whole.symbol_fqn),
        content=kept,
        cut_from_bytes=cut,
        lines=lines_kept(span, kept, cut is not None and lines_of_content),
    )


def lines_kept(lines: tuple[int, int] | None, kept: str, cut: bool) -> tuple[int, int] | None:
    """The lines a chunk states: its text's in the file, or, when its text was cut to the content limit, those the
    start it keeps reaches (the last one perhaps in part). A tester's 4,000-line function said lines 4-4006 of a
    text that stopped at line 3545."""
    if lines is None or not cut:
        return lines
    first = lines[0]
    return first, max(first, min(lines[1], first + len(file_lines(kept)) - 1))


def cut_from(text: str, max_bytes: int) -> int | None:
    """The text's size in bytes when :func:`truncate_utf8` cuts it, else None."""
    size = utf8_size(text)
    return size if size > max_bytes else None


def module_name(path: str, package: str | None = None) -> str:
    """``services/query/fusion.py`` -> ``services.query.fusion``; a package's ``__init__.py`` names the package.
    ``package``: the name of the tree itself when it is a package (its root holds ``__init__.py``), which then
    leads every module's name, as Python imports it (``retry.py`` of tenacity's tree is ``tenacity.retry``). In
    the form Python reads an identifier in (NFKC): a file named with a decomposed accent (as macOS writes names)
    or a ligature is imported by its composed and plain letters, and a query's name is read so (a Unicode tester's
    ``nfd_modé`` was found in neither spelling)."""
    parts = [*([package] if package else []), *path.removesuffix(".py").split("/")]
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return as_python_reads(".".join(parts))


def tree_package(root_name: str, paths: Iterable[str], named: str | None = None) -> str | None:
    """The tree's own package name. ``named``: as the ingest was told (empty: none), for a package checked out
    under another directory name. Else its directory's name when the root holds ``__init__.py`` and the name is
    an identifier Python could import; else None (the tree is a project holding packages)."""
    if named is not None:
        if named and not all(part.isidentifier() for part in named.split(".")):
            raise ValueError(f"{named!r} is not a package name Python could import")
        return named or None
    return root_name if "__init__.py" in paths and root_name.isidentifier() else None


_FROM_IMPORT = re.compile(
    r"^[ \t]*from[ \t]+([A-Za-z_.]\w*(?:\.[A-Za-z_]\w*)*)[ \t]+import[ \t]+(\([^)]*\)|[^\n#;]*)", re.MULTILINE
)
"""``from P.sub.mod import a, b as c`` (names in parentheses over several lines too): the module and its names."""
_TOP_LEVEL_BINDING = re.compile(
    r"^(?:(?:async[ \t]+)?def|class)[ \t]+([A-Za-z_]\w*)|^([A-Za-z_]\w*)[ \t]*(?::[^=\n]*)?=", re.M
)
"""A def or class at a module's top level, or an assignment there."""
_IMPORTED = re.compile(r"([A-Za-z_]\w*)(?:[ \t]+as[ \t]+([A-Za-z_]\w*))?")
SELF_IMPORT_FILES = 3
"""In how many of a tree's files at least its own modules must be imported under one other name for the tree to be
named after it (:func:`self_import_name`)."""


def self_import_name(sources: Mapping[str, str], own: str | None) -> str | None:
    """The name a package tree's modules import it by, when that is not ``own`` (its directory's name): a checkout
    of package ``P`` in a directory of another name (``main``, ``src``) whose files import names from ``P.sub.mod``
    that ``sub/mod.py`` (or ``sub/mod/__init__.py``) of the tree binds at its top level. Named after its directory,
    those imports resolved to nothing: a tester's "what calls validate_delta" found one caller of three, and no note
    said why. None unless one name does so in SELF_IMPORT_FILES files at least and more often than any other; never
    a name of the standard library. The names must be the tree's: a Django app's three files importing from
    ``django.urls``, beside its own ``urls.py``, named every module of it ``django.…`` (a review's)."""
    modules = {path for path in sources if path.endswith(".py")}
    bound: dict[str, set[str]] = {}

    def binds(path: str) -> set[str]:
        if path not in bound:
            text = sources[path]
            names = {name for found in _TOP_LEVEL_BINDING.findall(text) for name in found if name}
            for _, imported in _FROM_IMPORT.findall(text):
                names.update(alias or name for name, alias in _IMPORTED.findall(imported.strip("()")))
            bound[path] = names
        return bound[path]

    files_per_name: Counter[str] = Counter()
    for path in modules:
        names = set()
        for dotted, imported in _FROM_IMPORT.findall(sources[path]):
            first, *rest = dotted.split(".")
            inside = "/".join(rest)
            module = (
                next((m for m in (f"{inside}.py", f"{inside}/__init__.py") if m in modules), None) if rest else None
            )
            wanted = {name for name, _ in _IMPORTED.findall(imported.strip("()"))}
            if first and module is not None and wanted and wanted <= binds(module):
                names.add(first)
        files_per_name.update(names - set(sys.stdlib_module_names))
    ranked = files_per_name.most_common(2)
    if not ranked or ranked[0][1] < SELF_IMPORT_FILES or (len(ranked) == 2 and ranked[1][1] == ranked[0][1]):
        return None
    return None if ranked[0][0] == own else ranked[0][0]


class UniqueKeys:
    """Symbol keys unique within one file (a property and its setter share a qualified name)."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}

    def unique(self, key: str) -> str:
        count = self._seen.get(key, 0) + 1
        self._seen[key] = count
        return key if count == 1 else f"{key}~{count}"


def chunk_python(
    path: str,
    source: str,
    max_content_bytes: int,
    package: str | None = None,
    tree: ast.Module | None = None,
    unread: str | None = None,
) -> list[Chunk]:
    """``tree``: ``source`` parsed, when it already is (parsing is most of what reading a tree costs). ``unread``:
    why the file is not to be parsed (:func:`chunk_file`)."""
    module = module_name(path, package)
    module_type = object_type_name(module)
    file_key = f"python:{path}"
    keys = UniqueKeys()

    def make(
        key: str, kind: str, fqn: str, level: ChunkLevel, object_type: str, content: str, span: tuple[int, int] | None
    ) -> Chunk:
        # A docstring's text is cleaned (its first line dropped, indents taken off): its literal's lines stand.
        return cut_chunk(
            Chunk(keys.unique(key), kind, fqn, level, object_type, "python", path, content),
            max_content_bytes, span, lines_of_content=kind != "docstring",
        )  # fmt: skip

    lines = file_lines(source)  # an empty file has none to state
    chunks = [make(file_key, "module", module, "file", module_type, source, (1, len(lines)) if lines else None)]
    if unread is not None:
        return [replace(chunks[0], parse_error=unread)]
    try:
        tree = tree if tree is not None else ast.parse(source)
    except SyntaxError as error:  # the file chunk still makes it findable
        return [replace(chunks[0], parse_error=f"line {error.lineno}: {error.msg}")]
    except (ValueError, RecursionError) as error:  # RecursionError: nested deeper than the parser goes
        return [replace(chunks[0], parse_error=str(error) or "nested too deeply")]

    def span(node: ast.AST) -> tuple[int, int]:
        first = min([getattr(node, "lineno", 1)] + [d.lineno for d in getattr(node, "decorator_list", [])])
        last = getattr(node, "end_lineno", None) or first
        if getattr(node, "decorator_list", None):
            # A decorator's line is its expression's, which may start below its `@` (`@(` then a newline).
            at = next((n for n in range(first, 0, -1) if lines[n - 1].lstrip().startswith("@")), first)
            first = at
        return first, last

    def segment(node: ast.AST) -> str:
        first, last = span(node)
        return "".join(lines[first - 1 : last])

    def docstring(owner: ast.AST, owner_key: str, owner_fqn: str, object_type: str) -> None:
        text = ast.get_docstring(owner)  # type: ignore[arg-type]
        if text and text.strip():
            text = whole_characters(text)
            literal = owner.body[0]  # type: ignore[attr-defined]  # where get_docstring found it
            chunks.append(make(f"{owner_key}:doc", "docstring", owner_fqn, "doc", object_type, text, span(literal)))

    docstring(tree, file_key, module, module_type)

    def visit(block: list[ast.stmt], qualname: str, owner_type: str, in_class: bool) -> None:
        body = at_level(block)  # an `if TYPE_CHECKING:` block's classes too (a tester's urllib3 had 32 unseen)
        implemented = {
            n.name for n in body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and not is_overload(n)
        }
        for node in body:
            if (
                isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                and is_overload(node)
                and node.name in implemented
            ):
                continue  # a typing stub of a function defined below it: the same symbol again, without its code
            if isinstance(node, ast.ClassDef):
                name = f"{qualname}.{node.name}" if qualname else node.name
                class_type = object_type_name(f"{module}.{name}")
                key = f"python:{path}/{name}#"
                made = make(key, "class", f"{module}.{name}", "type", class_type, segment(node), span(node))
                chunks.append(replace(made, defines=assigned_names(node.body), line=node.lineno))
                docstring(node, key, f"{module}.{name}", class_type)
                visit(node.body, name, class_type, True)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{qualname}.{node.name}" if qualname else node.name
                key = f"python:{path}/{name}()."
                kind = "method" if in_class else "function"
                made = make(key, kind, f"{module}.{name}", "method", owner_type, segment(node), span(node))
                chunks.append(replace(made, line=node.lineno))
                docstring(node, key, f"{module}.{name}", owner_type)

    chunks[0] = replace(chunks[0], defines=assigned_names(tree.body))
    visit(tree.body, "", module_type, False)
    return chunks


def is_overload(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Whether ``@overload`` (``typing.overload``, ``t.overload``) declares the function: a signature for type
    checkers, whose body is ``...``. Chunked, each stub was the same symbol once more in an answer and took the
    implementation's calls (an agent tester's 'what calls echo': three chunks of Command.main). Left to the file's
    chunk, what a stub's signature calls (a default: ``retry=retry_if_exception_type()``) is its
    implementation's (``graph._code_scopes``)."""
    return any(
        (isinstance(d, ast.Name) and d.id == "overload") or (isinstance(d, ast.Attribute) and d.attr == "overload")
        for d in function.decorator_list
    )


def assigned_names(body: list[ast.stmt]) -> tuple[str, ...]:
    """The names a module's or a class's own statements assign or declare, in order, each once: ``X = ...``,
    ``X: int = ...``, ``X: int``,
    ``A, B = ...``, also under a module-level ``if``, ``try`` or ``with`` (``try: X = a except: X = b``); not what
    a function or a nested class assigns, nor imports, nor what a type checker or a script alone runs
    (:func:`at_level`'s ``run_time``)."""
    names: dict[str, None] = {}
    for statement in at_level(body, run_time=True):
        names.update(dict.fromkeys(assigned_by(statement)))
    return tuple(names)


def assigned_by(statement: ast.stmt) -> Iterator[str]:
    """The names one statement assigns or declares (:func:`assigned_names`): not an item's or an attribute's."""

    def targets(node: ast.expr) -> Iterator[str]:
        if isinstance(node, ast.Name):
            yield node.id
        elif isinstance(node, ast.Tuple | ast.List):
            for element in node.elts:
                yield from targets(element.value if isinstance(element, ast.Starred) else element)

    if isinstance(statement, ast.Assign):
        for target in statement.targets:
            yield from targets(target)
    elif isinstance(statement, ast.AnnAssign):  # with or without a value: a dataclass's or a model's field
        yield from targets(statement.target)


def at_level(body: list[ast.stmt], run_time: bool = False) -> list[ast.stmt]:
    """A module's or a class's own statements, in order, those under an ``if``, ``try`` or ``with`` among them (an
    ``if TYPE_CHECKING:`` block's classes, a ``try: import x`` fallback's functions): what a module or class
    defines there is its own, where a function's body is not. The ``if``, ``try`` and ``with`` themselves are
    left out. ``run_time``: without what runs only for a type checker (``if TYPE_CHECKING:``) or only when the
    module is run as a script (``if __name__ == "__main__":``): a name bound there is no name the module has when
    imported (an agent tester's ``rich.Console``, imported by rich's ``__init__`` for type checking alone, was
    answered as a name to import from it; a demo's ``console = Console()`` as a definition of ``console``)."""
    flat: list[ast.stmt] = []
    pending = body[::-1]  # the next on top: taking from the front made a module of 300,000 lines take seconds
    while pending:
        statement = pending.pop()
        if isinstance(statement, ast.If) and run_time and _not_at_run_time(statement.test):
            pending += statement.orelse[::-1]
        elif isinstance(statement, ast.If | ast.With | ast.AsyncWith):
            pending += [*statement.body, *getattr(statement, "orelse", [])][::-1]
        elif isinstance(statement, ast.Try | ast.TryStar):
            handlers = [line for handler in statement.handlers for line in handler.body]
            pending += [*statement.body, *handlers, *statement.orelse, *statement.finalbody][::-1]
        else:
            flat.append(statement)
    return flat


def _not_at_run_time(test: ast.expr) -> bool:
    """Whether an ``if``'s test is ``TYPE_CHECKING`` (``typing.TYPE_CHECKING``, ``t.TYPE_CHECKING``) or
    ``__name__ == "__main__"`` (either way round)."""
    if isinstance(test, ast.Name | ast.Attribute):
        return (test.id if isinstance(test, ast.Name) else test.attr) == "TYPE_CHECKING"
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
        sides = [test.left, test.comparators[0]]
        named = any(isinstance(side, ast.Name) and side.id == "__name__" for side in sides)
        return named and any(isinstance(side, ast.Constant) and side.value == "__main__" for side in sides)
    return False


MAX_HEADING_CHARS = 120
"""A heading names its section's key and qualified name as far as this: a heading of 3,000 characters made a key
longer than PostgreSQL's index takes, and its section was dead-lettered (``apply_failed``)."""


def _heading_title(written: str | None) -> str:
    """An ATX heading's title without its closing #s (`## Title ##`), which count only after a space. Apart from the
    regular expression: one that took them off too backtracked for minutes over a line of spaces."""
    title = (written or "").strip()
    bare = title.rstrip("#")
    return bare.rstrip() if bare == "" or bare[-1] in " \t" else title


def _shortened(title: str) -> str:
    return title if len(title) <= MAX_HEADING_CHARS else title[: MAX_HEADING_CHARS - 1] + "…"


def _html_block(line: str) -> tuple[re.Pattern[str] | None, bool] | None:
    """For a line that starts an HTML block: the end that closes it (None: a blank line), and whether the line
    closes it itself; None for any other line."""
    for start, end in _HTML_BLOCKS:
        opened = start.match(line)
        if opened:
            return end, end is not None and end.search(line, opened.end()) is not None
    return None


Section = tuple[list[str], str, tuple[int, int], bool]
"""A document's section: its heading path, its text, its first and last line, and whether it holds any text
besides its heading."""


def _markdown_sections(source: str) -> Iterator[Section]:
    """Each heading's section, and the text before the first heading."""
    path: list[str] = []
    current: list[str] = []
    first, heading_lines = 1, 0  # the current section's first line, and how many of its lines are its heading
    lines = file_lines(source)
    fence = ""  # the open code fence's marker: only the same character, as many or more, closes it (CommonMark)
    # YAML front matter (a first line `---` up to a `---` or `...`) is no text of headings: `# a comment` in it was.
    front_matter_ends = 0
    if lines and lines[0].rstrip() == "---":
        front_matter_ends = next((n for n, line in enumerate(lines[1:], 2) if _FRONT_MATTER_END.match(line)), 0)
    # How many lines just before this one are a paragraph a setext underline makes a heading of (`Title` over
    # `=====`): all of them are its title, as CommonMark reads it (the last alone was, and the rest stayed above).
    paragraph = 0
    html: tuple[re.Pattern[str] | None, bool] | None = None  # the open HTML block (_html_block), if any
    for number, line in enumerate(lines, start=1):
        marker = _FENCE.match(line)
        heading: tuple[int, str] | None = None
        taken = 0  # the lines before this one the heading takes: its title's, for a setext heading
        under, paragraph = paragraph, 0
        if number <= front_matter_ends:
            pass
        elif fence:
            run = marker.group(1) if marker else ""
            if run[:1] == fence[0] and len(run) >= len(fence) and not line[marker.end() if marker else 0 :].strip():
                fence = ""
        elif html is not None:
            end = html[0]
            if end.search(line) if end is not None else not line.strip():
                html = None
        elif marker and not (marker.group(1)[0] == "`" and "`" in line[marker.end() :]):
            fence = marker.group(1)  # a backtick fence's info string holds no backtick: "```js```" is inline code
        elif (started := _html_block(line)) is not None:
            html = None if started[1] else started  # closed on its own line or not, no text of a title
        else:
            atx = _HEADING.match(line.rstrip("\r\n"))
            title = _heading_title(atx.group(2)) if atx else ""  # a heading without one is no section of its own
            underline = _UNDERLINE.match(line) if under and not atx else None
            if atx and title:
                heading = len(atx.group(1)), title
            elif underline:
                title = " ".join(written.strip() for written in current[-under:])
                heading, taken = (1 if underline.group(1)[0] == "=" else 2, title), under
            elif not atx and not _NO_TITLE.match(line) and not _BREAK.match(line.rstrip("\r\n")):
                paragraph = under + 1
        if heading:
            before = current[: len(current) - taken]
            if "".join(before).strip():
                yield list(path), "".join(before), (first, number - taken - 1), _has_body(before, heading_lines)
            path = _nested(path, heading[0], heading[1])
            current, first, heading_lines = [*current[len(before) :], line], number - taken, taken + 1
        else:
            current.append(line)
    if "".join(current).strip():
        yield list(path), "".join(current), (first, first + len(current) - 1), _has_body(current, heading_lines)


_LABEL = re.compile(r"^\.\. _[^:]*:\s*$")
"""A reStructuredText label (`.. _linux:`), which names the title after it: no text of the section it is in."""


def _has_body(section: list[str], heading_lines: int) -> bool:
    """Whether a section holds text besides its heading (a label for the next title is none, a review's Sphinx
    case)."""
    return any(line.strip() and not _LABEL.match(line) for line in section[heading_lines:])


def _nested(path: list[str], level: int, title: str) -> list[str]:
    """The heading path after a heading of ``level`` (1 the outermost): a level skipped is an empty heading."""
    return [*path[: level - 1], *[""] * max(0, level - 1 - len(path)), _shortened(title.strip())]


_RST_PUNCTUATION = frozenset("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
# A line that starts a list item, explicit markup (`.. note::`, a comment), a doctest, a line block, a field list or
# an option list (`-a  Verbose`, `--out=FILE  Where`): no title, whatever is under it (docutils reads these before a
# paragraph).
_RST_NO_TITLE = re.compile(
    r"([-+*\u2022\u2023\u2043]|\.\.|>>>|\|)(\s|$)|:[^:\s][^:]*:(\s|$)|--?[A-Za-z0-9][\w-]*([ =]<?[\w-]+>?)?  +\S"
)


def _adornment(line: str) -> str:
    """The character a line repeats when it is one punctuation character over and over (a title's underline or
    overline); '' for any other line."""
    bare = line.rstrip()
    return bare[0] if bare and bare[0] in _RST_PUNCTUATION and bare.count(bare[0]) == len(bare) else ""


def _rst_title(lines: list[str], at: int, after_title: bool = False) -> tuple[tuple[str, bool], str, int] | None:
    """The section title starting at line ``at`` (0-based), as docutils reads one: its style (the adornment's
    character, and whether it has an overline too), its text and how many lines it takes; None when there is none.
    A title starts a paragraph, unindented (with an overline, it may be inset): after a blank line, another title's
    underline, explicit markup (`.. _label:`) or an indented block (a review's: a title right under another's
    underline was missed, and every level after it shifted). An underline shorter than its text counts only from
    four characters on."""
    if at + 1 >= len(lines) or (at > 0 and not after_title and _continues_a_paragraph(lines[at - 1])):
        return None
    line = lines[at]
    if over := _adornment(line):
        title = lines[at + 1].strip()
        closed = at + 2 < len(lines) and lines[at + 2].rstrip() == line.rstrip()
        fits = len(line.rstrip()) >= max(min(len(title), 4), 1)
        return ((over, True), title, 3) if title and closed and fits and not _adornment(lines[at + 1]) else None
    title = line.strip()
    if not title or line[0] in " \t" or _RST_NO_TITLE.match(line):
        return None
    under, length = _adornment(lines[at + 1]), len(lines[at + 1].rstrip())
    return ((under, False), title, 2) if under and length >= min(len(title), 4) else None


_EXPLICIT_MARKUP = re.compile(r"\.\.(\s|$)")


def _continues_a_paragraph(before: str) -> bool:
    """Whether a line after ``before`` goes on with its paragraph rather than starting a block of its own (after
    explicit markup, `.. ` and not `...`, an indented block, or a list's, a field's or a line block's item, it does
    not; after a doctest's line it does)."""
    if not before.strip() or before[0] in " \t" or _EXPLICIT_MARKUP.match(before):
        return False
    return before.startswith(">>>") or not _RST_NO_TITLE.match(before)


def _rst_sections(source: str) -> Iterator[Section]:
    """Each section title's section of a reStructuredText file, and the text before the first title. A title's
    level is its style's place in the order the styles first appear (docutils: no style has a level of its own).
    Indented lines (literal blocks, directives' content) are never titles."""
    lines = file_lines(source)
    styles: list[tuple[str, bool]] = []
    path: list[str] = []
    current: list[str] = []
    first, heading_lines, at, after_title = 1, 0, 0, -1  # after_title: the line after the last title's
    while at < len(lines):
        found = _rst_title(lines, at, at == after_title)
        if found is None:
            current.append(lines[at])
            at += 1
            continue
        style, title, size = found
        if "".join(current).strip():
            yield list(path), "".join(current), (first, at), _has_body(current, heading_lines)
        if style not in styles:
            styles.append(style)
        path = _nested(path, styles.index(style) + 1, title)
        current, first, heading_lines = lines[at : at + size], at + 1, size
        at += size
        after_title = at
    if "".join(current).strip():
        yield list(path), "".join(current), (first, first + len(current) - 1), _has_body(current, heading_lines)


def _headings_joined_to_their_first_subsection(sections: Iterable[Section]) -> Iterator[Section]:
    """A section with nothing but its heading, right before its first subsection, goes with that subsection: alone
    it was a chunk of a title, which a question using the title's words found first and which answered nothing.
    Every line is still in exactly one section."""
    held: Section | None = None
    for headings, text, lines, has_body in sections:
        if held is not None:
            above, above_text, (above_first, _), _ = held
            if len(headings) > len(above) and headings[: len(above)] == above:
                text, lines = above_text + text, (above_first, lines[1])
            else:
                yield held
            held = None
        if has_body:
            yield headings, text, lines, has_body
        else:
            held = headings, text, lines, has_body
    if held is not None:
        yield held


SECTION_PART_CHARS = 4_000
"""A Markdown or reStructuredText section longer than this is cut into parts about as long, at blank lines where it
can be, each with the section's headings and its own lines: a sentence deep in a section of 33 kB was found by
neither retriever (its vector read the section's first windows, keyword search weighed its words against the whole
length), and a hit pointed at the section's start alone (an agent tester's). Four of the embedder's windows, so a
part is read whole."""


def section_parts(text: str, lines: tuple[int, int]) -> list[tuple[str, tuple[int, int]]]:
    """``text`` (a section, from line ``lines[0]``) as parts of at most :data:`SECTION_PART_CHARS`, each with its
    first and last line: cut after the last blank line of a part's second half, else before the line that fills
    it. Longer only where one line is (with what little came before it: a heading is not a part alone); blank
    lines alone go with the part before. A section that fits is one part."""
    if len(text) <= SECTION_PART_CHARS:
        return [(text, lines)]
    parts: list[tuple[str, tuple[int, int]]] = []
    part: list[str] = []
    size, first = 0, lines[0]
    for line in file_lines(text):
        part.append(line)
        size += len(line)
        while size > SECTION_PART_CHARS and size - len(part[-1]) >= SECTION_PART_CHARS // 4:
            half = len(part) // 2
            blank = max((n for n, kept in enumerate(part[:-1]) if not kept.strip() and n >= half), default=None)
            cut = len(part) - 1 if blank is None else blank + 1
            parts.append(("".join(part[:cut]), (first, first + cut - 1)))
            first, part = first + cut, part[cut:]
            size = sum(map(len, part))
    if part:
        parts.append(("".join(part), (first, first + len(part) - 1)))
    merged: list[tuple[str, tuple[int, int]]] = []
    for chunk, (start, last) in parts:
        if merged and not chunk.strip():
            before, (begun, _) = merged[-1]
            merged[-1] = (before + chunk, (begun, last))
        else:
            merged.append((chunk, (start, last)))
    return merged


def _whole(source: str) -> Iterator[Section]:
    """A file of no headings as one section (in parts when long: :func:`section_parts`)."""
    yield [], source, (1, max(len(file_lines(source)), 1)), True


DOCUMENT_FORMATS = {
    ".md": ("markdown", _markdown_sections),
    ".rst": ("restructuredtext", _rst_sections),
    ".txt": ("text", _rst_sections),
    ".yaml": ("yaml", _whole),
    ".yml": ("yaml", _whole),
    ".toml": ("toml", _whole),
    ".sql": ("sql", _whole),
    ".sh": ("shell", _whole),
}
"""The suffixes of the documents read by section, with their source domain and how their sections are found. A
``.txt`` file's titles are read as reStructuredText's: plain text without underlined titles is one section (in
parts when long), and documentation kept in ``.txt`` files (Django's, older Python projects') is reStructuredText.
They were left out without a word. Configuration, migrations and scripts are read whole, in parts when long (a
monorepo tester's CI workflow, Kubernetes manifests and SQL migrations went unread)."""


def suffix_of(path: str) -> str:
    """A source file's suffix as the chunkers dispatch on it, from its last dot (``.ts``, ``.md``)."""
    return path[path.rfind(".") :]


def chunk_document(path: str, source: str, max_content_bytes: int, unread: str | None = None) -> list[Chunk]:
    """A Markdown, reStructuredText or text file's sections (:data:`DOCUMENT_FORMATS`, by ``path``'s suffix).
    ``unread``: why the file is not to be cut into sections (:func:`chunk_file`): then it is one chunk. A long
    section is cut into parts (:func:`section_parts`)."""
    suffix = suffix_of(path)
    domain, sections_of = DOCUMENT_FORMATS[suffix]
    document_type = object_type_name(path.removesuffix(suffix).replace("/", "."))
    keys = UniqueKeys()
    chunks = []
    if unread is None:
        sections: Iterable[tuple[list[str], str, tuple[int, int]]] = (
            (headings, part, part_lines)
            for headings, text, lines, _ in _headings_joined_to_their_first_subsection(sections_of(source))
            for part, part_lines in section_parts(text, lines)
        )
    else:  # one chunk, its path the only heading
        sections = [([], source, (1, len(file_lines(source))))] if source.strip() else []
    for headings, text, lines in sections:
        trail = [h for h in headings if h]
        anchor = "/".join(re.sub(r"[^a-z0-9]+", "-", h.lower()).strip("-") for h in trail)
        key, fqn = keys.unique(f"{domain}:{path}#{anchor}"), " > ".join([path, *trail])
        whole = Chunk(key, "section", fqn, "doc", document_type, domain, path, text, parse_error=unread)
        chunks.append(cut_chunk(whole, max_content_bytes, lines))
    return chunks


def chunk_file(
    path: str,
    source: str,
    max_content_bytes: int,
    package: str | None = None,
    tree: ast.Module | None = None,
    unread: str | None = None,
) -> list[Chunk]:
    """The chunks of one file (``path`` relative to the tree; ``package``: see :func:`module_name`; ``tree``: a
    Python file's, when already parsed). ``unread``: why the file is not to be parsed or cut into sections (a
    file over the ingest's size limit): its one chunk, with the reason as its ``parse_error``."""
    from .code import CODE_SUFFIXES, chunk_code  # which reads the helpers here

    if path.endswith(".py"):
        return chunk_python(path, source, max_content_bytes, package, tree, unread)
    if path.endswith(tuple(DOCUMENT_FORMATS)):
        return chunk_document(path, source, max_content_bytes, unread)
    if path.endswith(CODE_SUFFIXES):
        return chunk_code(path, source, max_content_bytes, unread)
    return []
