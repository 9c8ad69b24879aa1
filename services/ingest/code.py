"""Chunks of source files in languages other than Python, read by tree-sitter (pure): a file's chunk, and one per
declaration a reader looks for, its leading comments with it: functions, classes, interfaces, structs, enums,
traits and type aliases, and the methods inside classes and ``impl`` blocks. A monorepo tester's Go, TypeScript,
Rust and Java files were not read at all, and no answer could point an agent at them.

Their calls and graph are read by :mod:`code_graph` (Python's by :mod:`graph`); no exports are read of them.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import posixpath
import statistics
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace

import tree_sitter
import tree_sitter_go
import tree_sitter_java
import tree_sitter_javascript
import tree_sitter_rust
import tree_sitter_typescript

from ontofabric.contracts.identifiers import as_python_reads
from ontofabric.shared.logging import get_logger

from .chunking import (
    Chunk,
    ChunkLevel,
    UniqueKeys,
    bounded_symbol,
    cut_chunk,
    file_lines,
    object_type_name,
    suffix_of,
)

log = get_logger(__name__)


@dataclass(frozen=True)
class Language:
    domain: str
    """The chunks' ``sourceDomain``."""
    grammar: Callable[[], object]
    declarations: dict[str, tuple[str, ChunkLevel]]
    """Node type -> the symbol kind and chunk level of a declaration of that type."""
    containers: frozenset[str]
    """Node types whose children may be declarations too (a class's body, an ``export``, a Go type list)."""


_JAVASCRIPT_DECLARATIONS: dict[str, tuple[str, ChunkLevel]] = {
    "function_declaration": ("function", "method"),
    "generator_function_declaration": ("function", "method"),
    "class_declaration": ("class", "type"),
    "abstract_class_declaration": ("class", "type"),
    "interface_declaration": ("interface", "type"),
    "enum_declaration": ("enum", "type"),
    "type_alias_declaration": ("type", "type"),
    "method_definition": ("method", "method"),
    "abstract_method_signature": ("method", "method"),
    "method_signature": ("method", "method"),  # an interface's or a declared class's
    "variable_declarator": ("function", "method"),  # only when it holds a function (:func:`_holds_function`)
    "field_definition": ("method", "method"),  # `handleClick = () => {...}` in a class: only holding a function
    "public_field_definition": ("method", "method"),
    "function_signature": ("function", "method"),  # `declare function f(): T;` of a .d.ts
}
_JAVASCRIPT_CONTAINERS = frozenset(
    {"export_statement", "class_body", "lexical_declaration", "variable_declaration", "expression_statement",
     "ambient_declaration"}
)  # fmt: skip

LANGUAGES: dict[str, Language] = {
    ".ts": Language("typescript", tree_sitter_typescript.language_typescript, _JAVASCRIPT_DECLARATIONS,
                    _JAVASCRIPT_CONTAINERS | {"statement_block"}),
    ".tsx": Language("typescript", tree_sitter_typescript.language_tsx, _JAVASCRIPT_DECLARATIONS,
                     _JAVASCRIPT_CONTAINERS | {"statement_block"}),
    ".go": Language(
        "go",
        tree_sitter_go.language,
        {"function_declaration": ("function", "method"), "method_declaration": ("method", "method"),
         "type_spec": ("type", "type"), "method_elem": ("method", "method")},  # an interface's method
        frozenset({"type_declaration"}),
    ),
    ".rs": Language(
        "rust",
        tree_sitter_rust.language,
        {"function_item": ("function", "method"), "struct_item": ("struct", "type"), "enum_item": ("enum", "type"),
         "trait_item": ("trait", "type"), "union_item": ("struct", "type"), "type_item": ("type", "type"),
         "function_signature_item": ("method", "method"), "macro_definition": ("macro", "method")},
        frozenset({"impl_item", "declaration_list", "mod_item", "trait_item"}),
    ),
    ".java": Language(
        "java",
        tree_sitter_java.language,
        {"class_declaration": ("class", "type"), "interface_declaration": ("interface", "type"),
         "enum_declaration": ("enum", "type"), "record_declaration": ("class", "type"),
         "annotation_type_declaration": ("interface", "type"), "method_declaration": ("method", "method"),
         "constructor_declaration": ("method", "method")},
        frozenset({"class_body", "interface_body", "enum_body", "enum_body_declarations", "record_body"}),
    ),
}  # fmt: skip
for _suffix in (".mts", ".cts"):
    LANGUAGES[_suffix] = LANGUAGES[".ts"]
for _suffix in (".js", ".jsx", ".mjs", ".cjs"):
    LANGUAGES[_suffix] = Language(
        "javascript", tree_sitter_javascript.language, _JAVASCRIPT_DECLARATIONS, _JAVASCRIPT_CONTAINERS
    )

CODE_SUFFIXES = tuple(LANGUAGES)
"""The suffixes of the source files read here."""
MINIFIED_LINE_CHARS = 300
"""A file half of whose lines are longer is minified or generated (a bundle): its file's chunk alone, not one per
declaration; so are the declarations sharing a line longer than this. The median, not the mean: a tester's `.d.ts`
of 214 lines, a few of 2,400 characters, was taken for minified; the upper one, so that a bundle of one line and
a source map's comment is (a review's)."""
MAX_DEPTH = 100
"""How many nodes holding declarations deep declarations are read (a class in a class, an ``export``, a body)."""
_COMMENTS = frozenset({"comment", "line_comment", "block_comment"})
_ATTRIBUTES = frozenset({"attribute_item", "decorator"})
"""What stands between a declaration and its doc comment: Rust's ``#[...]``, TypeScript's ``@Decorator``."""
_SIGNATURES = frozenset({"method_signature", "function_signature", "abstract_method_signature"})
_FUNCTIONS = _SIGNATURES | {"function_declaration", "generator_function_declaration", "method_definition"}
"""What an overload signature goes with (not a namespace of its name: `declare function debug` beside `declare
namespace debug`, a review's, was lost)."""
_HOLDERS = frozenset({"variable_declarator", "field_definition", "public_field_definition"})
"""Declarations that are a function's only when they hold one (:func:`_holds_function`)."""
_BINDINGS = frozenset({"variable_declarator", "const_spec", "var_spec", "const_item", "static_item"})
_BINDING_LISTS = frozenset(
    {"export_statement", "lexical_declaration", "variable_declaration", "const_declaration", "var_declaration",
     "var_spec_list", "ambient_declaration"}
)  # fmt: skip
_NAMED_TYPES = frozenset({"type_identifier", "generic_type", "scoped_type_identifier", "reference_type"})
_NAMESPACES = frozenset({"mod_item", "internal_module", "module"})
_WRAPPERS = frozenset(
    {"export_statement", "lexical_declaration", "variable_declaration", "ambient_declaration", "type_declaration"}
)
_FUNCTION_VALUES = frozenset({"arrow_function", "function_expression", "function", "generator_function"})


@functools.cache
def _language(suffix: str) -> tree_sitter.Language:
    return tree_sitter.Language(LANGUAGES[suffix].grammar())


_PARSERS = threading.local()
"""A parser per thread and language: a parser holds the state of its parse, and two ingests may read at once."""


def parser(suffix: str) -> tree_sitter.Parser:
    parsers: dict[str, tree_sitter.Parser] = _PARSERS.__dict__.setdefault("by_suffix", {})
    if suffix not in parsers:
        parsers[suffix] = tree_sitter.Parser(_language(suffix))
    return parsers[suffix]


def chunk_code(path: str, source: str, max_content_bytes: int, unread: str | None = None) -> list[Chunk]:
    """A source file's chunks (``path``'s suffix one of :data:`CODE_SUFFIXES`): its file's, then its declarations'
    (:class:`Language`), each named ``<module>.<Owner>.<name>`` after the file's path (``web/src/api.ts`` is
    ``web.src.api``). ``unread``: why the file is not to be cut (:func:`chunking.chunk_file`): its file's chunk
    alone, with the reason as its ``parse_error``; so too a minified file."""
    suffix = suffix_of(path)
    language = LANGUAGES[suffix]
    module = module_name(path)
    module_type = object_type_name(module)
    keys = UniqueKeys()
    lines = file_lines(source)

    def make(key: str, kind: str, fqn: str, level: ChunkLevel, object_type: str, span: tuple[int, int]) -> Chunk:
        text = "".join(lines[span[0] - 1 : span[1]]) if level != "file" else source
        line = span[0] if level != "file" else 0
        whole = Chunk(keys.unique(key), kind, fqn, level, object_type, language.domain, path, text, line=line)
        return cut_chunk(whole, max_content_bytes, span if lines else None)

    file_chunk = make(f"{language.domain}:{path}", "module", module, "file", module_type, (1, max(len(lines), 1)))
    middle = minified_width(lines)
    if unread is None and middle is not None:
        unread = f"half its lines of {middle} characters or more: minified or generated, not cut"
    if unread is not None:
        return [replace(file_chunk, parse_error=unread)]
    tree = parser(suffix).parse(source.encode("utf-8"))
    line_of = line_counter(lines)
    broken = _first_error(tree.root_node)
    if broken is not None:  # what the parser recovered is kept; what it could not, the file's chunk still holds
        log.warning(
            "ingest_code_not_parsed_whole", path=path, line=line_of(broken.start_byte),
            reason="a syntax error: declarations around it may be missing or merged",
        )  # fmt: skip
    package = package_of(tree.root_node)
    # Constants and variables at the file's level, named by the file's chunk (as a Python module's are).
    chunks = [replace(file_chunk, defines=tuple(dict.fromkeys(_defined(tree.root_node))))]
    declared = list(declarations(tree.root_node, language, line_of, ()))

    for kind, level, qualname, span, node in chunked_declarations(declared, lines, line_of):
        owner = qualname.rpartition(".")[0]
        object_type = object_type_name(f"{module}.{qualname}") if level == "type" else (
            object_type_name(f"{module}.{owner}") if owner else module_type
        )  # fmt: skip
        key = f"{language.domain}:{path}/{qualname}" + ("#" if level == "type" else "().")
        made = make(key, kind, f"{module}.{qualname}", level, object_type, span)
        if level == "type":  # its fields, named by its chunk as a Python class's attributes are (a retest's)
            made = replace(made, defines=tuple(dict.fromkeys(_fields(node.child_by_field_name("body")))))
        # By its package's name too, as the language names it (`com.acme.TaxCalculator`, Go's `server.Handle`).
        chunks.append(replace(made, aliases=(bounded_symbol(f"{package}.{qualname}"),)) if package else made)
    return chunks


def module_name(path: str) -> str:
    """The dotted name of a source file's chunks, after its path: ``web/src/api.ts`` is ``web.src.api``, and
    ``index.d.ts`` is ``index``; in the form Python reads names in (:func:`as_python_reads`), as a query's name is
    read (a Unicode tester's ``módulo.ts``, its name decomposed, was found by neither spelling)."""
    return as_python_reads(path.removesuffix(suffix_of(path)).removesuffix(".d").replace("/", "."))


def rust_module_of(path: str) -> tuple[str, tuple[str, ...]]:
    """A Rust file's crate (the directory of its ``src``, or its own directory) and its module's path in it
    (``src/net/tcp.rs`` and ``src/net/tcp/mod.rs`` are ``net::tcp``; ``src/lib.rs`` and ``src/main.rs`` the root)."""
    parts = path.removesuffix(".rs").split("/")
    if "src" in parts[:-1]:
        at = len(parts) - 1 - parts[::-1].index("src", 1)
        crate, inner = "/".join(parts[: at + 1]), parts[at + 1 :]
    else:
        crate, inner = "/".join(parts[:-1]), parts[-1:]
    if inner and inner[-1] == "mod":
        inner = inner[:-1]
    if len(inner) == 1 and inner[0] in ("lib", "main"):
        inner = []
    return crate, tuple(inner)


def crate_roots(rust_crates: Mapping[str, str]) -> dict[str, str]:
    """``rust_crates`` (a directory holding a ``Cargo.toml`` -> its crate's name) by the crate's root as
    :func:`rust_module_of` names it (its ``src``)."""
    return {posixpath.join(directory, "src"): name for directory, name in rust_crates.items()}


def rust_aliases(path: str, symbol: str, crate_names: Mapping[str, str]) -> tuple[str, ...]:
    """The names Rust code gives a declaration (``symbol``, named after the file's path, :func:`module_name`; the
    module itself too): its path from the crate's root (``backoff.Backoff`` for ``src/backoff/mod.rs``'s
    ``Backoff``, as ``crate::backoff::Backoff`` writes it) and from the crate's name where a ``Cargo.toml`` gives
    one (``crate_names``: :func:`crate_roots`; ``throttle.backoff.Backoff``), but for one its own name already ends
    with. An agent tester's ``backoff::Backoff`` and ``throttle::clock::Clock`` were not found by name."""
    crate, inner = rust_module_of(path)
    if inner[:1] == ("bin",):  # src/bin/tool.rs: a binary crate of its own, no module of the library
        return ()
    module = module_name(path)
    parts = [*inner, *([symbol[len(module) + 1 :]] if symbol != module else [])]
    named = [".".join(parts)] if parts else []
    if (crate_name := crate_names.get(crate)) is not None:
        named.append(".".join([crate_name, *parts]))
    return tuple(name for name in named if symbol != name and not symbol.endswith("." + name))


def index_aliases(path: str, symbol: str) -> tuple[str, ...]:
    """A TypeScript or JavaScript index file's names by its directory, as ``import ... from './http'`` names the
    module: ``src.http`` for ``src/http/index.ts``'s module, ``src.http.retry`` for its ``retry``. An agent tester's
    importers of ``src.http`` were "not indexed": the module was named ``src.http.index`` alone."""
    module = module_name(path)
    if not module.endswith(".index") or not (symbol == module or symbol.startswith(module + ".")):
        return ()
    return (module.removesuffix(".index") + symbol[len(module) :],)


def is_declaration_file(path: str) -> bool:
    """A TypeScript declaration file (``x.d.ts``, ``.d.mts``, ``.d.cts``): the types of a module whose code is
    another file of the same module name (:func:`module_name`), as a published package ships them."""
    return path.endswith((".d.ts", ".d.mts", ".d.cts"))


def minified_width(lines: list[str]) -> int | None:
    """The upper median of the lines' lengths when over MINIFIED_LINE_CHARS (a minified or generated file, read as
    its file's chunk alone), else None."""
    middle = statistics.median_high(len(line) for line in lines) if lines else 0
    return middle if middle > MINIFIED_LINE_CHARS else None


def line_counter(lines: list[str]) -> Callable[[int], int]:
    """The line (1-based) of a byte of the source, its lines as :func:`chunking.file_lines` counts them (a lone CR
    ends one too: tree-sitter's rows count only LFs)."""
    starts = [0, *itertools.accumulate(len(line.encode("utf-8")) for line in lines)][:-1]
    return functools.partial(bisect.bisect_right, starts)


Declared = tuple[str, ChunkLevel, str, tuple[int, int], tree_sitter.Node]
"""A declaration (:func:`declarations`): its kind, level, qualified name within its file, lines and node."""


def chunked_declarations(
    declared: list[Declared], lines: list[str], line_of: Callable[[int], int]
) -> Iterator[Declared]:
    """The declarations that are chunks of their own: not those sharing a long line with another, minified code
    past :func:`minified_width` (a bundle under a short banner), each of which would be a copy of the whole line
    (a review's 10,000 chunks of one 358 kB line)."""

    def own_line(node: tree_sitter.Node) -> int | None:
        """The one line the declaration itself is on (its comments aside), None for one of several lines."""
        first = line_of(node.start_byte)
        return first if first == line_of(max(node.start_byte, node.end_byte - 1)) else None

    # Each line's declarations: how many, and the bytes from the first's start to the last's end.
    on_line: dict[int | None, tuple[int, int, int]] = {}
    for *_, node in declared:
        count, start, end = on_line.get(own_line(node), (0, node.start_byte, node.end_byte))
        on_line[own_line(node)] = (count + 1, min(start, node.start_byte), max(end, node.end_byte))
    for declaration in declared:
        node = declaration[-1]
        on = own_line(node)
        count, start, end = on_line[on]
        # One holding every other on its line (a one-line Go interface and its methods) is still one declaration.
        holds_them = node.start_byte <= start and end <= node.end_byte
        if on is None or count < 2 or len(lines[on - 1]) <= MINIFIED_LINE_CHARS or holds_them:
            yield declaration


def package_of(root: tree_sitter.Node) -> str | None:
    """The package a Java or Go file declares (``package com.acme;``, ``package server``)."""
    for node in root.named_children:
        if node.type in ("package_declaration", "package_clause"):
            named = next((n for n in node.named_children if n.type != "comment"), None)
            return named.text.decode("utf-8", errors="replace") if named is not None and named.text else None
    return None


def _first_error(root: tree_sitter.Node) -> tree_sitter.Node | None:
    """The first node the parser could not read, or had to make up, breadth first; None in a file that parses."""
    if not root.has_error:
        return None
    pending = [root]
    while pending:
        node = pending.pop(0)
        if node.is_error or node.is_missing:
            return node
        pending.extend(child for child in node.children if child.has_error or child.is_missing)
    return None


def declarations(
    node: tree_sitter.Node,
    language: Language,
    line_of: Callable[[int], int],
    owners: tuple[str, ...],
    in_type: bool = False,
    depth: int = 0,
) -> Iterator[Declared]:
    """Each declaration under ``node``: its kind, level, qualified name within the file (under ``owners``: the types
    and namespaces holding it; ``in_type``: the last a type, whose functions are methods), its lines (1-based,
    inclusive) with the comments right above it, and its node. None deeper than MAX_DEPTH nodes holding
    declarations (generated code nests past Python's recursion limit: its file's chunk holds them)."""
    if depth > MAX_DEPTH:
        return
    depth += 1
    for child in node.named_children:
        declared = language.declarations.get(child.type)
        name = _name(child) if declared is not None else None
        if (
            declared is not None
            and name is not None
            and (child.type not in _HOLDERS or _holds_function(child))
            and not _continued_below(child, name)
        ):
            kind, level = declared
            if child.type == "constructor_declaration":  # Java's is named as its class is
                name = "constructor"
            if kind == "function" and in_type:
                kind = "method"
            elif child.type == "type_spec":  # Go: `type Server struct`, `type Store interface`
                shape = child.child_by_field_name("type")
                kind = {"struct_type": "struct", "interface_type": "interface"}.get(shape.type if shape else "", kind)
            yield kind, level, ".".join([*owners, name]), _span(child, line_of), child
            body = child.child_by_field_name("body")
            if child.type == "type_spec" and kind == "interface":  # Go: its methods, what calls through it call
                body = child.child_by_field_name("type")
            if body is not None and level == "type":
                yield from declarations(body, language, line_of, (*owners, name), True, depth)
        elif child.type == "impl_item":  # Rust: the methods of the type it implements
            implemented = child.child_by_field_name("type")
            body = child.child_by_field_name("body")
            if implemented is not None and body is not None:
                yield from declarations(body, language, line_of, (*owners, impl_type_name(implemented)), True, depth)
        elif child.type in _NAMESPACES and (space := _name(child)) is not None:  # `mod net {}`, `namespace Api {}`
            body = child.child_by_field_name("body")
            if body is not None:
                yield from declarations(body, language, line_of, (*owners, space), False, depth)
        elif child.type in language.containers:
            yield from declarations(child, language, line_of, owners, in_type, depth)


def _defined(root: tree_sitter.Node) -> Iterator[str]:
    """The names a file's own level binds to what is no function: ``const``, ``let``, ``var`` (JavaScript's and
    TypeScript's, exported or not), Go's ``const`` and ``var``, Rust's ``const`` and ``static``."""
    pending = list(root.named_children)
    while pending:
        node = pending.pop(0)
        if node.type in _BINDINGS and not _holds_function(node):
            for named in node.children_by_field_name("name"):
                if named.type == "identifier" and named.text is not None:
                    yield named.text.decode("utf-8", errors="replace")
        elif node.type in _BINDING_LISTS:
            pending[:0] = node.named_children


def _fields(body: tree_sitter.Node | None) -> Iterator[str]:
    """The fields a type's body declares that hold no function: Java's (``static final double RATE``), a
    TypeScript or JavaScript class's properties."""
    for node in body.named_children if body is not None else ():
        named: list[tree_sitter.Node | None]
        if node.type == "field_declaration":
            named = [declarator.child_by_field_name("name") for declarator in node.children_by_field_name("declarator")]
        elif node.type in ("public_field_definition", "field_definition") and not _holds_function(node):
            named = [node.child_by_field_name("name") or node.child_by_field_name("property")]
        else:
            continue
        for name in named:
            if name is not None and name.text is not None and name.type in ("identifier", "property_identifier"):
                yield name.text.decode("utf-8", errors="replace")


def _continued_below(node: tree_sitter.Node, name: str) -> bool:
    """Whether ``node`` is a signature another declaration of the same name follows (TypeScript's overloads, each
    exported or not): it goes with the last of them, the implementation where there is one (:func:`_span`)."""
    if node.type not in _SIGNATURES:
        return False
    node = _wrapped_by(node)
    below = node.next_named_sibling
    while below is not None and below.type in _COMMENTS:
        below = below.next_named_sibling
    below = _declared_in(below) if below is not None else None
    return below is not None and below.type in _FUNCTIONS and _name(below) == name


def _wrapped_by(node: tree_sitter.Node) -> tree_sitter.Node:
    """The ``export`` or declaration list holding ``node`` as its one declaration, else ``node``."""
    while node.parent is not None and node.parent.type in _WRAPPERS and _declared_alone(node.parent):
        node = node.parent
    return node


def _declared_in(node: tree_sitter.Node) -> tree_sitter.Node:
    """The one declaration an ``export`` or declaration list holds, else ``node``."""
    while node.type in _WRAPPERS and _declared_alone(node):
        node = next(child for child in node.named_children if child.type not in _ATTRIBUTES | _COMMENTS)
    return node


def _name(node: tree_sitter.Node) -> str | None:
    """A declaration's own name; a Go method's with its receiver's type before it (``Server.Start``)."""
    named = node.child_by_field_name("name") or node.child_by_field_name("property")
    if named is None or named.text is None:
        return None
    # A private member's without its `#` (`#retry` is `retry`): a query's name and a relation's symbol are
    # identifiers, and a tester's callers of `Ky.#retry` could not be asked.
    name = named.text.decode("utf-8", errors="replace").removeprefix("#")
    receiver = node.child_by_field_name("receiver") if node.type == "method_declaration" else None
    if receiver is not None:
        types = [n for n in walk(receiver) if n.type == "type_identifier"]
        if types and types[0].text is not None:
            return f"{types[0].text.decode('utf-8', errors='replace')}.{name}"
    return name


def impl_type_name(node: tree_sitter.Node) -> str:
    """The name of the type an ``impl`` block implements (``Vec<T>`` is ``Vec``, ``io::Error`` is ``Error``); a
    type of no name (``[u8; 4]``) is ``impl``."""
    if node.type not in _NAMED_TYPES:  # a tuple, an array, a function pointer
        return "impl"
    found = next((n for n in walk(node) if n.type == "type_identifier"), None)
    return (found.text or b"impl").decode("utf-8", errors="replace") if found is not None else "impl"


def _holds_function(holder: tree_sitter.Node) -> bool:
    """Whether a variable or a class's field is bound to a function (an arrow function, a function expression)."""
    value = holder.child_by_field_name("value")
    return value is not None and value.type in _FUNCTION_VALUES


def _span(node: tree_sitter.Node, line_of: Callable[[int], int]) -> tuple[int, int]:
    """The lines of a declaration (``line_of``: a byte's line) with the comments right above it (a JSDoc, a Go or
    Rust doc comment), its attributes and decorators, and the overload signatures of its name, those with no code
    before them on their line; and with the ``export`` or declaration list holding it when it is their only
    declaration (``export const f = ...``)."""
    name = _name(node)
    node = _wrapped_by(node)
    first, last = line_of(node.start_byte), line_of(max(node.start_byte, node.end_byte - 1))
    above = node.prev_sibling
    doc_taken = False
    """A doc comment (``/**``) taken: any comment above it is another's (a file's header, a licence: an agent
    tester's `.d.ts`, compiled without blank lines, gave its first function the file's), until an overload's
    signature, which has its own (a review's)."""
    while above is not None and line_of(max(above.start_byte, above.end_byte - 1)) >= first - 1:
        if not above.is_named:  # a `;` ending the signature above
            above = above.prev_sibling
            continue
        signature = _declared_in(above)
        if not (above.type in _COMMENTS | _ATTRIBUTES or (signature.type in _SIGNATURES and _name(signature) == name)):
            break
        if (above.text or b"").startswith((b"//!", b"/*!")):  # Rust's inner doc comment: the module's, not the item's
            break
        if above.type in _COMMENTS and doc_taken:
            break
        doc_taken = above.type in _COMMENTS and (above.text or b"").startswith(b"/**")
        before = above.prev_sibling
        if before is not None and line_of(max(before.start_byte, before.end_byte - 1)) >= line_of(above.start_byte):
            break  # a comment after code on its line (`a = 1; // the first`) is that code's
        first = line_of(above.start_byte)
        above = before
    return first, last


def _declared_alone(wrapper: tree_sitter.Node) -> bool:
    """Whether an ``export`` or a declaration list holds one declaration (its decorators and comments aside)."""
    return sum(1 for child in wrapper.named_children if child.type not in _ATTRIBUTES | _COMMENTS) == 1


def walk(node: tree_sitter.Node) -> Iterator[tree_sitter.Node]:
    pending = [node]
    while pending:
        current = pending.pop()
        yield current
        pending.extend(reversed(current.named_children))
