"""The calls and the graph of code in languages other than Python (pure), read from the syntax alone as
:mod:`graph` reads Python's: for each chunk :func:`code.chunk_code` makes, the declarations of the tree its code
calls; and the files and types as nodes, with the imports between files, the types each type extends or
implements, and the calls between them as links. A monorepo tester asked what calls a Go function and a TypeScript
one, and heard that calls were read in Python alone.

Imports link a file to the file it imports from (TypeScript and JavaScript by a relative path, ``require`` too),
to a Go package's file (:meth:`_Tree.package_file`), to the file declaring a Java type it imports by name (not
to a package it imports whole: each of its files would be a link), to the Rust module file a ``use`` names.

What is resolved, by language (a call through anything else, an object whose type the syntax does not say, is left
out, and so is a chunk calling itself; a name the code binds itself, a parameter, a local or an inner function, is
not the file's from where it is bound on):

- TypeScript and JavaScript: a name the file declares or imports by a relative path (``import``, ``require``,
  through an index file's re-exports), ``ns.f()`` for ``import * as ns``, ``Class.f()``, ``this.f()`` and
  ``super.f()`` through the class and the classes it extends (not within a nested ``function`` or class, whose
  ``this`` is another), ``x.f()`` through a local bound to ``new Class()`` or annotated ``: Class``,
  ``new Class()``, ``new ns.Class()`` and ``super(...)``, and a decorator (``@audited``, ``@memoize(60)``) as a
  call by what it decorates;
- Go: a name of the package (its directory), ``pkg.F()`` through an import of a package of the tree (by its
  ``go.mod``'s module path, else by the import path's end), ``x.M()`` where ``x`` is the method's receiver, a
  parameter of a type of the tree (an interface's method too), a field of such a one's struct (``s.store.Get()``)
  or a local bound to one's composite literal
  (``x := &T{}``, ``var x = T{}``) or to what a function of the tree declared to return one returns
  (``r := NewRouter()``), and a method a struct has through a type it embeds. A type's bases are what it embeds,
  and the interfaces of the tree it satisfies: it has a method of each of theirs' names with as many parameters
  and results (their types unread; not an interface embedding one from outside the tree, whose methods are
  unknown);
- Java: a method of the class, the classes it extends or implements and those holding it (``m()``, ``this.m()``,
  ``super.m()``; not within an anonymous or local class), one imported ``static``, ``Type.m()`` and ``x.m()``
  where ``x`` is a parameter, a local or a field declared with a type of the tree (by its own file, its package,
  its imports; ``Outer.Inner`` too), the nearest declaration of ``x`` in scope; ``new Type()`` and ``super(...)``;
- Rust: a function of the module or one it ``use``s (``crate::``, ``self::``, ``super::`` paths, and a crate of
  the tree by the name its ``Cargo.toml`` gives it: ``anyhow::Error`` in its tests), through what a module
  re-exports (``pub use``), ``module::f()``, ``Type::f()`` (the type of the module or one it ``use``s) and
  ``Self::f()``, ``self.f()``, a macro of the crate (``m!()``). Not a call in a macro's body, nor through a
  ``use`` of a module's every name (``use a::*``), nor a path starting ``::``.
"""

from __future__ import annotations

import bisect
import functools
import posixpath
import re
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import tree_sitter

from ontofabric.contracts import CALLS, IMPORTS, INHERITS
from ontofabric.contracts.identifiers import as_python_reads

from .chunking import ChunkLevel, bounded_symbol, file_lines, object_type_name, suffix_of
from .code import (
    LANGUAGES,
    Declared,
    chunked_declarations,
    crate_roots,
    declarations,
    impl_type_name,
    is_declaration_file,
    line_counter,
    minified_width,
    module_name,
    package_of,
    parser,
    rust_module_of,
    walk,
)
from .graph import GraphLink, GraphNode, representable, split_object_type

MAX_HOPS = 8
"""How many imports, re-exports or base classes a name is followed through (a cycle of re-exports ends too)."""
_JAVASCRIPT_SUFFIXES = (".ts", ".tsx", ".d.ts", ".mts", ".cts", ".js", ".jsx", ".mjs", ".cjs")
_GO_MODULE = re.compile(r"^[ \t]*module[ \t]+(\S+)", re.MULTILINE)
_GO_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.DOTALL)


class GoMethod(NamedTuple):
    """A Go method as an interface asks for it: its name, its parameters' and results' types (:func:`_go_signature`;
    None: not known), and, for an unexported one, the package declaring it (``""`` for an exported one)."""

    name: str
    parameters: tuple[str, ...] | None
    results: tuple[str, ...] | None
    package: str

    @property
    def slot(self) -> tuple[str, str, int, int]:
        """What a method that fits this one has alike: its name, its package, and how many parameters and results."""
        return self.name, self.package, len(self.parameters or ()), len(self.results or ())

    def fits(self, wanted: GoMethod) -> bool:
        """Whether this method is one ``wanted`` asks for: the same name and package, and each parameter's and
        result's type the same, where neither is a type parameter's (:data:`GO_ANY_TYPE`)."""

        def alike(had: tuple[str, ...] | None, asked: tuple[str, ...] | None) -> bool:
            if had is None or asked is None or len(had) != len(asked):
                return False
            return all(_same_go_type(a, b) for a, b in zip(had, asked, strict=True))

        return (
            self.slot == wanted.slot
            and alike(self.parameters, wanted.parameters)
            and alike(self.results, wanted.results)
        )


GO_ANY_TYPE = "?"
"""A parameter's or result's type that holds a type parameter (``K``, ``[]V``): any type may stand there."""


def _same_go_type(one: str, other: str) -> bool:
    """Whether two parameters' types (:func:`_go_type`, ``...`` before a variadic one's) may be the same."""
    if one.startswith("...") != other.startswith("..."):
        return False
    one, other = one.removeprefix("..."), other.removeprefix("...")
    return one == other or GO_ANY_TYPE in (one, other)


_GO_STANDARD_INTERFACES = {
    "": "type error interface{ Error() string }",
    "fmt": "type Stringer interface{ String() string }\ntype GoStringer interface{ GoString() string }",
    "io": """
type Reader interface{ Read(p []byte) (n int, err error) }
type Writer interface{ Write(p []byte) (n int, err error) }
type Closer interface{ Close() error }
type Seeker interface{ Seek(offset int64, whence int) (int64, error) }
type ReaderAt interface{ ReadAt(p []byte, off int64) (n int, err error) }
type WriterAt interface{ WriteAt(p []byte, off int64) (n int, err error) }
type ReaderFrom interface{ ReadFrom(r Reader) (n int64, err error) }
type WriterTo interface{ WriteTo(w Writer) (n int64, err error) }
type ByteReader interface{ ReadByte() (byte, error) }
type ByteWriter interface{ WriteByte(c byte) error }
type RuneReader interface{ ReadRune() (r rune, size int, err error) }
type StringWriter interface{ WriteString(s string) (n int, err error) }
type ReadWriter interface{ Reader; Writer }
type ReadCloser interface{ Reader; Closer }
type WriteCloser interface{ Writer; Closer }
type ReadWriteCloser interface{ Reader; Writer; Closer }
type ReadSeeker interface{ Reader; Seeker }
type ReadSeekCloser interface{ Reader; Seeker; Closer }
type WriteSeeker interface{ Writer; Seeker }
type ReadWriteSeeker interface{ Reader; Writer; Seeker }
""",
    "sort": "type Interface interface{ Len() int; Less(i, j int) bool; Swap(i, j int) }",
    "context": """
type Context interface {
    Deadline() (deadline time.Time, ok bool)
    Done() <-chan struct{}
    Err() error
    Value(key any) any
}
""",
    "net/http": "type Handler interface{ ServeHTTP(ResponseWriter, *Request) }",
    "encoding/json": "type Marshaler interface{ MarshalJSON() ([]byte, error) }\n"
    "type Unmarshaler interface{ UnmarshalJSON([]byte) error }",
    "encoding": "type TextMarshaler interface{ MarshalText() (text []byte, err error) }\n"
    "type TextUnmarshaler interface{ UnmarshalText(text []byte) error }",
}
"""Interfaces of Go's standard library a tree's types often embed, by import path (``""``: the predeclared
``error``), as Go declares them. An interface embedding ``io.Reader`` had methods unknown here, so no type was
said to implement it."""


@functools.cache
def go_standard_interfaces() -> dict[tuple[str, str], frozenset[GoMethod]]:
    """The methods of each of :data:`_GO_STANDARD_INTERFACES`, by import path and name (embedded ones included)."""
    found: dict[tuple[str, str], frozenset[GoMethod]] = {}
    for path, source in _GO_STANDARD_INTERFACES.items():
        declared: dict[str, tuple[set[GoMethod], list[str]]] = {}
        for spec in walk(parser(".go").parse(f"package p\n{source}".encode()).root_node):
            if spec.type != "type_spec":
                continue
            methods, embeds = declared.setdefault(_text(spec.child_by_field_name("name")) or "", (set(), []))
            embeds += _go_embedded(spec)
            for elem in walk(spec):
                if elem.type == "method_elem":
                    methods.add(GoMethod(_text(elem.child_by_field_name("name")) or "", *_go_signature(elem), ""))
        for name, (methods, embeds) in declared.items():
            found[path, name] = frozenset(methods.union(*(declared[e][0] for e in embeds)))
    return found


def _held(asked: GoMethod, held: Mapping[tuple[str, str, int, int], list[GoMethod]]) -> bool:
    """Whether a type whose methods are ``held`` (by :attr:`GoMethod.slot`) has one that ``asked`` fits: the same
    one first (most are), then one a type parameter's place lets fit."""
    candidates = held.get(asked.slot, ())
    return asked in candidates or any(had.fits(asked) for had in candidates)


CallKey = tuple[str, str, int]
"""A chunk as :func:`read_code` keys it: its file, its qualified name and its first line (0 for a file's)."""


@dataclass(frozen=True)
class CodeRead:
    """What :func:`read_code` reads of a tree's code in other languages than Python."""

    calls: dict[CallKey, list[str]]
    """Each chunk -> the qualified names of the tree's declarations its own code calls, in the order first called."""
    nodes: list[GraphNode]
    """The files (kind ``module``) and types (``class``)."""
    links: list[GraphLink]
    """Imports, inheritance and calls between them."""
    defined_in: dict[str, str]
    """Each node's object type -> the file defining it (:func:`graph.defining_files` for Python's)."""
    package_names: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Go: the file that stands for its package (:meth:`_Tree.package_file`) -> the package's names, by its
    directory and as declared (``pkg.ast`` and ``ast``), which a question of its importers asks by."""


@dataclass
class _File:
    path: str
    domain: str
    module: str
    package: str | None
    outline: list[tuple[str, ChunkLevel, str, tuple[int, int]]]
    """Its declarations that are chunks (:data:`code.Declared`, without their nodes: a tree's parsed files are
    not held at once, 182 MB for zod's 5 MB)."""
    top: dict[str, str] = field(default_factory=dict)
    """A name the file's own level declares -> its qualified name."""
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    """A local name -> the file (Go: the package) it is imported from, and the name there (None: the module
    itself, ``import * as ns``, Go's package name)."""
    exports: dict[str, str] = field(default_factory=dict)
    """TypeScript and JavaScript: an exported name -> the local name it exports (``export { a as b }``)."""
    forwarded: dict[str, tuple[str, str]] = field(default_factory=dict)
    """An exported name -> the file and name it re-exports (``export { a as b } from './x'``)."""
    starred: list[str] = field(default_factory=list)
    """The files whose names it re-exports all (``export * from './x'``)."""
    uses: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Rust: a name a ``use`` binds -> the path it names, as written (:meth:`_Tree.rust_absolute` reads it)."""
    wildcard: list[str] = field(default_factory=list)
    """Java: the packages it imports whole (``import com.acme.*``)."""
    statics: list[tuple[str, str | None]] = field(default_factory=list)
    """Java: the types whose static members it imports, and the member's name (None: all of them)."""
    go_imports: list[tuple[str | None, str]] = field(default_factory=list)
    """Go: each import's name (None: the package's own) and path, resolved once every file's package is known."""
    bases_written: dict[str, list[str]] = field(default_factory=dict)
    """A type's qualified name in the file -> the names of the types it extends or implements, as written."""
    imported: dict[str, None] = field(default_factory=dict)
    """TypeScript and JavaScript: the files of the tree it imports from (``import``, ``export ... from``,
    ``require``), in order."""


def rust_crate_name(cargo_toml: str) -> str | None:
    """The name a ``Cargo.toml``'s library is used by in code: its ``[lib]`` name, else its package's, with
    ``-`` as ``_`` (``serde-json`` is ``serde_json``); None for a workspace's own or one that is no TOML."""
    try:
        manifest = tomllib.loads(cargo_toml)
    except tomllib.TOMLDecodeError:
        return None
    lib, package = manifest.get("lib"), manifest.get("package")
    name = (lib.get("name") if isinstance(lib, dict) else None) or (
        package.get("name") if isinstance(package, dict) else None
    )  # fmt: skip
    return name.replace("-", "_") if isinstance(name, str) and name else None


def go_module_path(go_mod: str) -> str | None:
    """The module path a ``go.mod`` declares."""
    found = _GO_MODULE.search(_GO_COMMENT.sub("", go_mod))
    return found.group(1).strip('"') if found else None


def read_code(
    sources: Mapping[str, str],
    go_modules: Mapping[str, str] | None = None,
    rust_crates: Mapping[str, str] | None = None,
    tick: Callable[[], object] = lambda: None,
) -> CodeRead:
    """The calls and graph of the source files of ``sources`` in a language :data:`code.LANGUAGES` reads: for
    each chunk (keyed by file, qualified name and line as :func:`code.chunk_code` makes them; a minified file has
    none), the qualified names of the tree's declarations its own code calls (see the module's docstring), in the
    order it first calls them (a class's or a file's chunk holds the calls outside its methods and functions);
    and the graph. ``go_modules``: a directory of the tree holding a ``go.mod`` (``""`` for the top) -> the module
    path it declares; ``rust_crates``: a directory holding a ``Cargo.toml`` -> the name its library is used by
    (``anyhow``; :func:`rust_crate_name`). ``tick`` is called before each file is read, twice (and may raise to
    stop the reading: an ingest's interrupt waited for it, a second review's)."""
    crates = {name: directory for directory, name in crate_roots(rust_crates or {}).items()}
    tree = _Tree(frozenset(sources), dict(go_modules or {}), crates)
    for path, text in sources.items():  # each file parsed, its outline kept and its nodes let go
        tick()
        parsed = _parsed(path, text)
        if parsed is not None:
            root, declared = parsed
            tree.add(_File(path, LANGUAGES[suffix_of(path)].domain, module_name(path), package_of(root), [
                (kind, level, qualname, span) for kind, level, qualname, span, _node in declared
            ]), root, declared)  # fmt: skip
    tree.resolve()
    calls = tree.calls(sources, tick)
    return CodeRead(calls, *tree.graph(calls), tree.stand_in_names())


def _parsed(path: str, text: str) -> tuple[tree_sitter.Node, list[Declared]] | None:
    """A file's syntax tree and its declarations that are chunks; None for a file of no language read here or a
    minified one (its file's chunk alone)."""
    suffix = suffix_of(path)
    if suffix not in LANGUAGES:
        return None
    lines = file_lines(text)
    if minified_width(lines) is not None:
        return None
    root = parser(suffix).parse(text.encode("utf-8")).root_node
    line_of = line_counter(lines)
    return root, list(chunked_declarations(list(declarations(root, LANGUAGES[suffix], line_of, ())), lines, line_of))


def _text(node: tree_sitter.Node | None) -> str | None:
    return node.text.decode("utf-8", errors="replace") if node is not None and node.text is not None else None


def _string(node: tree_sitter.Node | None) -> str | None:
    """A string literal's text (``"./x"``, Go's ``"fmt"``), None for a template or no string."""
    if node is None or node.type not in ("string", "interpreted_string_literal", "raw_string_literal"):
        return None
    return "".join(_text(child) or "" for child in node.named_children) or None


class _Tree:
    """The tree's files read, and what resolves a name in each."""

    def __init__(self, paths: frozenset[str], go_modules: dict[str, str], rust_crates: dict[str, str]) -> None:
        self.paths = paths
        self.paths_read: dict[str, str] = {}
        """Each file's path as names are read (:func:`as_python_reads`) -> the path: an import spelling a file's
        decomposed name composed (a Unicode tester's) names that file."""
        for path in sorted(paths):
            self.paths_read.setdefault(as_python_reads(path), path)
        self.files: dict[str, _File] = {}
        self.go_modules = go_modules
        self.rust_crates = rust_crates
        """Rust: a crate's name (``anyhow``) -> its key (:func:`_crate`: the directory of its ``src``)."""
        self.members: dict[str, dict[str, str]] = {}
        """A type's key (:meth:`type_key`) -> its methods' and fields' names -> their qualified names."""
        self.bases: dict[str, list[str]] = {}
        """A type's key -> the keys of the types it extends (or implements), resolved."""
        self.types: dict[str, str] = {}
        """A type's key -> its qualified name (what ``new Type()`` calls)."""
        self.packages: dict[str, list[_File]] = {}
        """Go: a package (``dir:name``) -> its files; Java: a package's name -> its files."""
        self.package_names: dict[str, str] = {}
        """Go: a directory -> the package its files declare (not a ``_test`` one)."""
        self.java_types: dict[str, str] = {}
        """Java: a type's name with its package (``com.acme.Tax``) -> its key."""
        self.rust_modules: dict[tuple[str, tuple[str, ...]], dict[str, str]] = {}
        """Rust: a crate and a module's path in it -> the names the module declares -> their qualified names."""
        self.rust_macros: dict[tuple[str, str], set[str]] = {}
        self.rust_type_names: dict[tuple[str, str], set[str]] = {}
        self.rust_traits: set[str] = set()
        """Rust: the keys of the tree's traits, what an ``impl Trait for Type`` may name (:meth:`type_named`)."""
        """Rust: a crate and a type's name -> the keys of the types of that name it declares."""
        self.rust_members: list[tuple[_File, str, str, str]] = []
        """Rust: each ``impl``'s or trait's member (its file, the type as written, its name, its qualified name),
        until :meth:`resolve` knows every type."""
        self.go_types: dict[str, tuple[_File, str, str]] = {}
        """Go: a type's key -> its file, its qualified name there and its kind (``interface``, ``struct``...)."""
        self.go_fields: dict[str, dict[str, tuple[_File, str | None, str]]] = {}
        """Go: a struct's key -> its fields' names (an embedded one's by its type's name) -> its file and the
        field's type as written (:func:`_go_written`), where that is one named type."""
        self.go_signatures: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
        """Go: a method's qualified name -> its parameters' and results' types (:func:`_go_signature`)."""
        self.implemented: dict[str, list[str]] = {}
        """Go: a type's key -> the keys of the interfaces of the tree it satisfies (:meth:`_go_implementations`)."""
        self.go_results: dict[str, tuple[_File, str | None, str]] = {}
        """Go: a function's qualified name -> its file and the type it returns (:func:`_go_written`), where that
        is one named type."""
        self.rust_files: dict[tuple[str, tuple[str, ...]], _File] = {}
        """Rust: a crate and a module's path in it -> the file that is that module."""
        self.type_modules: dict[str, str] = {}
        """A type's key -> the module of the file declaring it."""
        self.object_types: dict[str, str] = {}
        """A chunk's qualified name -> its object type (as :func:`code.chunk_code` makes them)."""
        self.go_imports: dict[str, dict[str, None]] = {}
        """Go: a file -> the packages of the tree it imports."""
        self.package_top: dict[str, dict[str, str]] = {}
        """Go: a package -> the names its files declare at their level -> their qualified names."""
        self.package_files: dict[str, _File] = {}
        """Go: a package -> the file that stands for it (:meth:`package_file`)."""
        self.go_directories: dict[str, str | None] = {}
        """Go: an import path -> the directory of the tree it names (:meth:`go_directory`), once looked up."""
        self.rust_items: dict[tuple[str, tuple[str, ...]], str | None] = {}
        """Rust: (crate, path) -> :meth:`rust_item`'s answer, once found."""
        self.impl_keys: dict[tuple[str, str], str] = {}
        """Rust: (file, owner) -> :meth:`owner_key`'s answer, once found."""
        self.exported: dict[tuple[str, str], str | None] = {}
        """TypeScript and JavaScript: (file, name) -> what the file exports under the name, once looked up."""
        self.twins: dict[str, list[str]] = {}
        """TypeScript and JavaScript: a module (:func:`code.module_name` of a path) -> its files read (``x.js`` and
        its declarations' ``x.d.ts``)."""
        self.spaces: dict[str, dict[str, str]] = {}
        """TypeScript: a namespace's qualified name (``m.Validation``) -> what it declares by name: its functions,
        types and namespaces (``isEmail`` -> ``m.Validation.isEmail``)."""

    def add(self, read: _File, root: tree_sitter.Node, declared: list[Declared]) -> None:
        """A file's declarations, and what its syntax says of its imports and bases (resolved by :meth:`resolve`
        once every file is added)."""
        self.files[read.path] = read
        if read.domain in ("typescript", "javascript"):
            self.twins.setdefault(module_name(read.path), []).append(read.path)
        self._index(read)
        self._imports(read, root)
        self._bases_written(read, declared)
        if read.domain == "rust":
            for owner, trait in _trait_impls(root):  # `impl Backoff for Constant`: a base, as Java's `implements`
                read.bases_written.setdefault(owner, []).append(trait)
        for _kind, _level, qualname, _span, node in declared if read.domain == "go" else ():
            if node.type in ("method_declaration", "method_elem"):
                self.go_signatures[bounded_symbol(f"{read.module}.{qualname}")] = _go_signature(node)
            elif node.type == "type_spec":
                fields = {name: (read, *written) for name, written in _go_fields(node)}
                self.go_fields.setdefault(self.type_key(read, qualname), {}).update(fields)
            result = node.child_by_field_name("result")
            written = _go_written(result) if result is not None and node.type == "function_declaration" else None
            if written is not None:  # `func NewRouter() *Mux`: what `r := NewRouter()` binds
                self.go_results[bounded_symbol(f"{read.module}.{qualname}")] = (read, *written)

    def resolve(self) -> None:
        for read, owner, name, fqn in self.rust_members:
            self.members.setdefault(self.owner_key(read, owner), {}).setdefault(name, fqn)
        for read in self.files.values():
            for alias, written in read.go_imports:
                self._go_import(read, alias, written)
        for read in self.files.values():
            for qualname, names in read.bases_written.items():
                bases = [key for name in names if (key := self.type_named(read, name, qualname)) is not None]
                if bases:  # a class declared in `x.js` and `x.d.ts` has the bases of both
                    key = self.owner_key(read, qualname)  # Rust: an `impl`'s type may be another module's
                    self.bases[key] = list(dict.fromkeys((*self.bases.get(key, []), *bases)))
        self._go_implementations()

    def _go_implementations(self) -> None:
        """Each Go type of the tree that is no interface -> the interfaces of the tree each of whose methods it has
        (its own or an embedded type's): the same name, parameters and results of the same types (a type named
        ``pkg.Key`` and ``Key`` alike, one a type parameter's any), and an unexported one declared in the
        interface's package (only there can a type have it). Go says it nowhere: an agent tester's
        "what implements Store" found none of its two stores. An interface embedding one the tree does not declare,
        nor :data:`_GO_STANDARD_INTERFACES` (a union of types, another library's), has methods unknown here, and is
        left out."""
        known: dict[str, tuple[frozenset[GoMethod], bool]] = {}
        for key in self.go_types:
            self._go_method_set(key, known)
        having: dict[tuple[str, str, int, int], set[str]] = {}
        slots: dict[str, dict[tuple[str, str, int, int], list[GoMethod]]] = {}  # a type -> its methods by slot
        for key, (_read, _qualname, kind) in self.go_types.items():
            for method in known[key][0] if kind != "interface" else ():
                having.setdefault(method.slot, set()).add(key)
                slots.setdefault(key, {}).setdefault(method.slot, []).append(method)
        for interface, (_read, _qualname, kind) in self.go_types.items():
            wanted, complete = known[interface]
            if kind != "interface" or not complete or not wanted:  # `any` is every type's: no link says anything
                continue
            rarest = min(wanted, key=lambda method: len(having.get(method.slot, ())))
            for key in sorted(having.get(rarest.slot, ())):
                held = slots[key]
                if all(_held(asked, held) for asked in wanted):
                    self.implemented.setdefault(key, []).append(interface)

    def _go_method_set(self, start: str, known: dict[str, tuple[frozenset[GoMethod], bool]]) -> None:
        """A Go type's methods, its own and those of the types it embeds, and whether they are all it has (what it
        embeds is of the tree or one of :data:`_GO_STANDARD_INTERFACES`, and no embedding cycle, which Go refuses,
        runs through it), into ``known``. Without recursion: a tree's embedding may go deep."""
        pending, entered = [start], set()
        while pending:
            key = pending[-1]
            if key in known:
                pending.pop()
                continue
            bases = self.bases.get(key, [])
            if key not in entered:
                entered.add(key)
                pending.extend(base for base in bases if base not in known and base not in entered)
                continue
            pending.pop()
            read, qualname, _kind = self.go_types[key]
            package = key.rpartition(".")[0]
            own = {self._go_method(name, fqn, package) for name, fqn in self.members.get(key, {}).items()}
            inherited = [known.get(base) for base in bases]  # None: a cycle's
            standard = self._go_standard_embedded(read, qualname)
            known[key] = (
                frozenset(own).union(*(held[0] for held in inherited if held is not None), *standard),
                len(bases) + len(standard) == len(read.bases_written.get(qualname, []))
                and all(held is not None and held[1] for held in inherited),
            )

    def _go_standard_embedded(self, read: _File, qualname: str) -> list[frozenset[GoMethod]]:
        """The methods of each interface of :data:`_GO_STANDARD_INTERFACES` a Go type embeds (``io.Reader``,
        ``error``), where no type of the tree has that name there."""
        embedded = []
        for written in read.bases_written.get(qualname, []):
            if self.type_named(read, written, qualname) is not None:
                continue
            alias, _, name = written.rpartition(".")
            paths = [path for named, path in read.go_imports if (named or path.rpartition("/")[2]) == alias]
            methods = go_standard_interfaces().get((paths[0] if paths else "", name)) if paths or not alias else None
            embedded += [methods] if methods is not None else []
        return embedded

    def _go_method(self, name: str, fqn: str, package: str) -> GoMethod:
        """A Go type's member ``name`` (its ``fqn``) as an interface would ask for it."""
        parameters, results = self.go_signatures.get(fqn) or (None, None)
        return GoMethod(name, parameters, results, "" if name[:1].isupper() else package)

    # -- indexing ------------------------------------------------------------------------------------------------

    def type_key(self, read: _File, qualname: str) -> str:
        """What a type's members are kept under: its qualified name, but Go's methods are declared in any file of
        its package, and Rust's under the module of their ``impl`` (a ``mod`` in the file too)."""
        if read.domain == "go":
            return f"{self.go_package(read)}.{qualname}"
        if read.domain == "rust":
            crate, path = rust_module_of(read.path)
            *spaces, name = qualname.split(".")
            return _rust_key(crate, (*path, *spaces), name)
        return f"{read.module}.{qualname}"

    def owner_key(self, read: _File, owner: str) -> str:
        """The key of the type whose members a chunk's ``owner`` holds: :meth:`type_key`, but a Rust ``impl``'s
        type is the one it implements, which may be declared in another module (``use crate::E; impl E``: a
        retest's anyhow lost every ``Error::new()`` to it): the module's own type of the name, one it ``use``s,
        the crate's one type of the name, else the ``impl``'s module's (a type outside the tree)."""
        if read.domain != "rust":
            return self.type_key(read, owner)
        if (read.path, owner) in self.impl_keys:
            return self.impl_keys[read.path, owner]
        crate, path = rust_module_of(read.path)
        *spaces, name = owner.split(".")
        key = own = _rust_key(crate, (*path, *spaces), name)
        if own not in self.types and name in read.uses:
            used_crate, used = self.rust_absolute(read, read.uses[name])
            key = _rust_key(used_crate, used[:-1], used[-1]) if used else own
        if key not in self.types:
            named = self.rust_type_names.get((crate, name), set())
            key = next(iter(named)) if len(named) == 1 else own
        self.impl_keys[read.path, owner] = key
        return key

    def go_package(self, read: _File) -> str:
        return f"{posixpath.dirname(read.path)}:{read.package or ''}"

    def _index(self, read: _File) -> None:
        module_type = object_type_name(read.module)
        self.object_types[bounded_symbol(read.module)] = module_type
        if read.domain == "rust":
            self.rust_files.setdefault(rust_module_of(read.path), read)
        # Rust: what holds a method is a type (an `impl`, a trait), and an associated type in it no module's.
        impls = {qualname.rpartition(".")[0] for kind, _, qualname, _ in read.outline if kind == "method"}
        for kind, level, qualname, _span in read.outline:
            fqn = bounded_symbol(f"{read.module}.{qualname}")
            owner, _, name = qualname.rpartition(".")
            self.object_types[fqn] = object_type_name(f"{read.module}.{qualname}") if level == "type" else (
                object_type_name(f"{read.module}.{owner}") if owner else module_type
            )  # fmt: skip
            if level == "type":
                self.type_modules.setdefault(self.type_key(read, qualname), read.module)
            if read.domain == "rust":
                crate, path = rust_module_of(read.path)
                if kind == "macro":
                    self.rust_macros.setdefault((crate, name), set()).add(fqn)
                if owner in impls:  # a method, or an associated type or constant: its type's, once resolved
                    self.rust_members.append((read, owner, name, fqn))
                    continue
                space = (crate, (*path, *owner.split("."))) if owner else (crate, path)  # a `mod` in the file
                self.rust_modules.setdefault(space, {}).setdefault(name, fqn)
                if level == "type":
                    self.types.setdefault(self.type_key(read, qualname), fqn)
                    self.rust_type_names.setdefault((crate, name), set()).add(self.type_key(read, qualname))
                    if kind == "trait":
                        self.rust_traits.add(self.type_key(read, qualname))
                continue
            if not owner:
                read.top.setdefault(name, fqn)
            elif kind == "method":
                self.members.setdefault(self.type_key(read, owner), {}).setdefault(name, fqn)
            if level == "type":
                self.types[self.type_key(read, qualname)] = fqn
                if read.domain == "go":
                    self.go_types[self.type_key(read, qualname)] = (read, qualname, kind)
                if read.domain == "java":
                    dotted = f"{read.package}.{qualname}" if read.package else qualname
                    self.java_types[dotted] = self.type_key(read, qualname)
        if read.domain == "go":
            self.packages.setdefault(self.go_package(read), []).append(read)
            names = self.package_top.setdefault(self.go_package(read), {})
            names.update({name: fqn for name, fqn in read.top.items() if name not in names})
            if read.package and not read.package.endswith("_test"):
                self.package_names.setdefault(posixpath.dirname(read.path), read.package)
        elif read.domain == "java":
            self.packages.setdefault(read.package or "", []).append(read)
        elif read.domain in ("typescript", "javascript"):
            self._namespaces(read)

    def _namespaces(self, read: _File) -> None:
        """What a file's namespaces declare (:attr:`spaces`), each namespace named at the file's level by its first
        name: an agent tester's ``Validation.isEmail()`` called nothing."""
        types = {qualname for _kind, level, qualname, _span in read.outline if level == "type"}
        for kind, _level, qualname, _span in read.outline:
            owner, _, name = qualname.rpartition(".")
            if not owner or kind == "method" or owner in types:
                continue
            spaces = owner.split(".")
            read.top.setdefault(spaces[0], f"{read.module}.{spaces[0]}")
            for depth in range(1, len(spaces)):  # each namespace holds the next
                held = f"{read.module}.{'.'.join(spaces[:depth])}"
                self.spaces.setdefault(held, {}).setdefault(spaces[depth], f"{held}.{spaces[depth]}")
            self.spaces.setdefault(f"{read.module}.{owner}", {}).setdefault(
                name, bounded_symbol(f"{read.module}.{qualname}")
            )

    def _imports(self, read: _File, root: tree_sitter.Node) -> None:
        for node in root.named_children:
            if read.domain in ("typescript", "javascript"):
                self._javascript_import(read, node)
            elif read.domain == "go" and node.type == "import_declaration":
                for spec in (n for n in walk(node) if n.type == "import_spec"):
                    written = _string(spec.child_by_field_name("path"))
                    read.go_imports += [(_text(spec.child_by_field_name("name")), written)] if written else []
            elif read.domain == "java" and node.type == "import_declaration":
                named = next((n for n in node.named_children if n.type in ("scoped_identifier", "identifier")), None)
                dotted = _text(named)
                if dotted is None:
                    continue
                whole = any(n.type == "asterisk" for n in node.named_children)
                if any(n.type == "static" for n in node.children):  # a type's static members, called bare
                    read.statics.append(
                        (dotted, None) if whole else (dotted.rpartition(".")[0], dotted.rpartition(".")[2])
                    )
                elif whole:
                    read.wildcard.append(dotted)
                else:  # a type of the tree's or not: :meth:`type_named` tells
                    read.imports[dotted.rsplit(".", 1)[-1]] = (dotted, None)
            elif read.domain == "rust" and node.type == "use_declaration":
                argument = node.child_by_field_name("argument")
                if argument is not None:
                    self._rust_use(read, argument)

    def _javascript_import(self, read: _File, node: tree_sitter.Node) -> None:
        source = self.javascript_file(read.path, _string(node.child_by_field_name("source")))
        if source is not None and node.type in ("import_statement", "export_statement"):
            read.imported[source] = None
        if node.type == "import_statement" and source is not None:
            clause = next((n for n in node.named_children if n.type == "import_clause"), None)
            for part in clause.named_children if clause is not None else ():
                if part.type == "identifier":  # `import a from './x'`
                    read.imports[_text(part) or ""] = (source, "default")
                elif part.type == "namespace_import":  # `import * as ns from './x'`
                    for named in part.named_children:
                        read.imports[_text(named) or ""] = (source, None)
                elif part.type == "named_imports":
                    for specifier in part.named_children:
                        name = _text(specifier.child_by_field_name("name"))
                        local = _text(specifier.child_by_field_name("alias")) or name
                        if name and local:
                            read.imports[local] = (source, name)
        elif node.type == "export_statement":
            clause = next((n for n in node.named_children if n.type == "export_clause"), None)
            for specifier in clause.named_children if clause is not None else ():
                name = _text(specifier.child_by_field_name("name"))
                exported = _text(specifier.child_by_field_name("alias")) or name
                if name and exported and source is not None:
                    read.forwarded[exported] = (source, name)
                elif name and exported:
                    read.exports[exported] = name
            value = node.child_by_field_name("value")  # `export default foo`
            if value is not None and value.type == "identifier" and (local := _text(value)):
                read.exports["default"] = local
            declaration = node.child_by_field_name("declaration")  # `export default function foo() {}`
            if declaration is not None and any(c.type == "default" for c in node.children):
                default_name = _text(declaration.child_by_field_name("name"))
                read.exports.update({"default": default_name} if default_name is not None else {})
            if clause is None and source is not None and any(c.type == "*" for c in node.children):
                read.starred.append(source)  # `export * from './x'`
        elif node.type in ("lexical_declaration", "variable_declaration"):  # `const x = require('./x')`
            for declarator in node.named_children:
                value = declarator.child_by_field_name("value")
                function = value.child_by_field_name("function") if value is not None else None
                if value is None or value.type != "call_expression" or _text(function) != "require":
                    continue
                arguments = value.child_by_field_name("arguments")
                first = arguments.named_children[0] if arguments is not None and arguments.named_children else None
                required = self.javascript_file(read.path, _string(first))
                bound = declarator.child_by_field_name("name")
                if required is None or bound is None:
                    continue
                read.imported[required] = None
                if bound.type == "identifier":
                    read.imports[_text(bound) or ""] = (required, None)
                elif bound.type == "object_pattern":  # `const { a, b: c } = require('./x')`
                    for pattern in bound.named_children:
                        if pattern.type == "shorthand_property_identifier_pattern" and (text := _text(pattern)):
                            read.imports[text] = (required, text)
                        elif pattern.type == "pair_pattern":
                            key, value = pattern.child_by_field_name("key"), pattern.child_by_field_name("value")
                            if (k := _text(key)) and value is not None and value.type == "identifier":
                                read.imports[_text(value) or ""] = (required, k)

    def javascript_file(self, importer: str, written: str | None) -> str | None:
        """The file of the tree a relative module specifier names (``./x`` is ``x.ts``, ``x.js`` or
        ``x/index.ts``; ``./x.js`` may be ``x.ts``, as TypeScript's own ESM imports are written); None for a
        package's (``react``) or a path alias's."""
        if not written or not written.startswith("."):
            return None
        joined = posixpath.normpath(posixpath.join(posixpath.dirname(importer), written))
        stem = re.sub(r"\.(m|c)?jsx?$", "", joined)
        candidates = [
            joined,
            *(stem + s for s in _JAVASCRIPT_SUFFIXES),
            *(f"{joined}/index{s}" for s in _JAVASCRIPT_SUFFIXES),
        ]
        return next((path for c in candidates if (path := self.path_named(c)) is not None), None)

    def path_named(self, written: str) -> str | None:
        """The file of the tree at ``written``, or else the one whose path reads as it (:attr:`paths_read`)."""
        return written if written in self.paths else self.paths_read.get(as_python_reads(written))

    def _go_import(self, read: _File, alias: str | None, written: str) -> None:
        directory = self.go_directory(written)
        if directory is None or directory not in self.package_names or alias in ("_", "."):
            return
        package = self.package_names[directory]
        read.imports[alias or package] = (f"{directory}:{package}", None)
        self.go_imports.setdefault(read.path, {})[f"{directory}:{package}"] = None

    def go_directory(self, written: str) -> str | None:
        """The directory of the tree an import path names: under a module's ``go.mod`` (the longest module path
        that is its start), else none when the tree has a ``go.mod`` (another module's package, `errors` of
        github.com/pkg/errors beside a directory of the tree named so: a review's); without one, the longest
        directory of Go files that ends the path. Each path looked up once (a review's 6,000 files made 30 M
        comparisons, every file's imports of the standard library against every directory)."""
        if written in self.go_directories:
            return self.go_directories[written]
        found: str | None = None
        for directory, module in sorted(self.go_modules.items(), key=lambda item: -len(item[1])):
            if written == module or written.startswith(module + "/"):
                joined = posixpath.normpath(posixpath.join(directory, written[len(module) + 1 :]))
                found = "" if joined == "." else joined
                break
        else:
            named = self.directories_named.get(written.rpartition("/")[2], []) if not self.go_modules else []
            ends = [d for d in named if f"/{written}".endswith(f"/{d}")]
            found = max(ends, key=len) if ends else None
        self.go_directories[written] = found
        return found

    @functools.cached_property
    def directories_named(self) -> dict[str, list[str]]:
        """Go: the directories of the tree's packages by their last part (an import path is compared with those
        of its own last part: a second review's 4,000 paths against every directory were quadratic)."""
        named: dict[str, list[str]] = {}
        for directory in self.package_names:
            if directory:
                named.setdefault(directory.rpartition("/")[2], []).append(directory)
        return named

    def _rust_use(self, read: _File, argument: tree_sitter.Node) -> None:
        """The names a ``use`` binds, each with the path it names as written (:meth:`rust_absolute` reads it;
        an external crate's resolves to nothing). A list in a list is read without recursion: a review's
        ``use self::{self::{...}}`` a thousand deep stopped the whole ingest."""
        pending: list[tuple[tree_sitter.Node, tuple[str, ...]]] = [(argument, ())]
        while pending:
            node, prefix = pending.pop()
            if node.type in ("scoped_identifier", "identifier", "crate", "self", "super"):
                used = (*prefix, *_rust_path(node))
                if used and used[-1] not in ("self", "super", "crate"):
                    read.uses[used[-1]] = used
                elif used and used[-1] == "self" and len(used) > 1:  # `use a::b::{self}`
                    read.uses[used[-2]] = used[:-1]
            elif node.type == "use_as_clause":
                written, alias = node.child_by_field_name("path"), _text(node.child_by_field_name("alias"))
                if written is not None and alias:
                    read.uses[alias] = (*prefix, *_rust_path(written))
            elif node.type == "scoped_use_list":
                written, listed = node.child_by_field_name("path"), node.child_by_field_name("list")
                inner = (*prefix, *(_rust_path(written) if written is not None else ()))
                pending += [(child, inner) for child in (listed.named_children if listed is not None else ())]
            elif node.type == "use_list":
                pending += [(child, prefix) for child in node.named_children]

    def rust_absolute(self, read: _File, path: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
        """A path as written in ``read`` (``crate::a::f``, ``super::f``, ``self::a::f``, ``a::f``, ``anyhow::f``
        through a crate of the tree's name) as its crate and the path from that crate's root."""
        crate, here = rust_module_of(read.path)
        if path and path[0] == "crate":
            return crate, path[1:]
        if path and path[0] in ("self", "super"):
            base = list(here)
            while path and path[0] in ("self", "super"):
                if path[0] == "super" and base:
                    base.pop()
                path = path[1:]
            return crate, (*base, *path)
        # A 2018-edition path from the module (`a::f` for a child module `a`), a crate's of the tree (its tests
        # call it by its name: a tester's anyhow::Error), or another crate's, which names nothing here.
        if path and ((crate, (*here, path[0])) in self.rust_modules or (crate, (*here, path[0])) in self.rust_files):
            return crate, (*here, *path)
        if path and path[0] in self.rust_crates:
            return self.rust_crates[path[0]], path[1:]
        return crate, path

    def _bases_written(self, read: _File, declared: list[Declared]) -> None:
        for _kind, level, qualname, _span, node in declared:
            if level != "type":
                continue
            written: list[tree_sitter.Node] = []
            if read.domain in ("typescript", "javascript"):
                heritage = next((n for n in node.named_children if n.type == "class_heritage"), None)
                clauses = heritage.named_children if heritage is not None else []
                # An interface's `extends A, B` (a retest's KV extends RoKV had no base, nor 70 more in the MCP SDK).
                clauses += [n for n in node.named_children if n.type == "extends_type_clause"]
                written = [  # TypeScript's `extends` and `implements`, JavaScript's expression
                    value
                    for clause in clauses
                    for value in (
                        clause.children_by_field_name("value") if clause.type == "extends_clause"
                        else clause.named_children if clause.type in ("implements_clause", "extends_type_clause")
                        else []
                    )
                ] or [n for n in clauses if n.type in ("identifier", "member_expression")]  # fmt: skip
            elif read.domain == "go":
                read.bases_written.update({qualname: embedded} if (embedded := _go_embedded(node)) else {})
                continue
            elif read.domain == "rust" and (bounds := node.child_by_field_name("bounds")) is not None:
                written = list(bounds.named_children)  # a supertrait, `trait Precise: Clock` (a retest's)
            elif read.domain == "java":  # `extends Base<T>`: Base, not T; an interface's `extends` too
                extended = next((n for n in node.named_children if n.type == "extends_interfaces"), None)
                for holder in [
                    node.child_by_field_name("superclass"),
                    node.child_by_field_name("interfaces"),
                    extended,
                ]:
                    listed = (
                        [n for h in holder.named_children for n in ([h] if h.type != "type_list" else h.named_children)]
                        if holder is not None
                        else []
                    )
                    written += listed
            names = [_written_type(n) for n in written]
            if named := [name for name in names if name]:
                read.bases_written[qualname] = named

    # -- resolving -----------------------------------------------------------------------------------------------

    def type_named(self, read: _File, name: str, within: str = "") -> str | None:
        """The key of the type of the tree ``name`` names in ``read`` (``within``: the type it is written in)."""
        if read.domain in ("typescript", "javascript"):
            fqn = self.javascript_value(read, name)  # a type's key is its qualified name
            held, dot, member = name.partition(".")
            imported = read.imports.get(held) if dot and "." not in member else None
            if fqn is None and imported is not None and imported[1] is None:  # `extends ns.Base`, `ns` imported whole
                fqn = self.javascript_export(imported[0], member, 1)
            return fqn if fqn is not None and fqn in self.types else None
        if read.domain == "java":
            name = name.split("<", 1)[0]
            for qualname in [*(f"{scope}.{name}" for scope in _enclosing(within)), name]:  # nested, then the file's
                if self.type_key(read, qualname) in self.types:
                    return self.type_key(read, qualname)
            head, dot, rest = name.partition(".")  # `CodeBlock.Builder` through `import ...CodeBlock`
            imported = read.imports.get(head)
            candidates = [
                *([imported[0] + dot + rest] if imported is not None else []),
                f"{read.package}.{name}" if read.package else name,
                *(f"{package}.{name}" for package in read.wildcard),
                name,  # written whole: `com.acme.Base`
            ]
            return next((self.java_types[c] for c in candidates if c in self.java_types), None)
        if read.domain == "go":  # `Base`, `store.Store`
            package, _, name = name.rpartition(".")
            return self.go_named(read, package or None, name)
        if read.domain == "rust":  # a trait: `Backoff`, `crate::backoff::Backoff`, `backoff::Backoff`
            crate, here = rust_module_of(read.path)
            *path, last = name.split("::")
            if path:
                used_crate, used = self.rust_absolute(read, (*path, last))
                key: str | None = _rust_key(used_crate, used[:-1], used[-1]) if used else None
            else:  # the impl's module's own, one it `use`s, else (not `use`d from elsewhere) the crate's one
                key = self.rust_type(read, crate, (*here, *within.split(".")[:-1]), last, bare=True)
                named = self.rust_type_names.get((crate, last), set()) & self.rust_traits
                if key is None and last not in read.uses and len(named) == 1:
                    key = next(iter(named))
            # A trait of the tree: `use std::error::Error; impl Error for E` is no base of the crate's enum Error
            # (a review's), nor a prelude trait's impl of a struct of its name.
            return key if key in self.rust_traits else None
        return None

    def go_named(self, read: _File, package: str | None, name: str) -> str | None:
        """The key of the Go type ``package.name`` (None: ``read``'s own package) as ``read`` names it."""
        imported = read.imports.get(package) if package is not None else None
        key = f"{self.go_package(read)}.{name}" if package is None else (f"{imported[0]}.{name}" if imported else None)
        return key if key in self.types else None

    def go_field(self, key: str | None, name: str) -> str | None:
        """The key of the type of the tree a Go struct's field ``name`` is declared with, or one it has through a
        struct it embeds: the shallowest, as Go reads it (a review's was found depth first)."""
        holder = self._shallowest([key] if key is not None else [], lambda held: name in self.go_fields.get(held, {}))
        return self.go_named(*self.go_fields[holder][name]) if holder is not None else None

    def _shallowest(self, level: list[str], holds: Callable[[str], bool]) -> str | None:
        """The first type of ``level`` that ``holds``, else of the types they embed, level by level: a Go field's or
        method's promotion, the shallowest first."""
        seen: set[str] = set()
        for _hop in range(MAX_HOPS + 1):
            found = next((held for held in level if holds(held)), None)
            if found is not None or not level:
                return found
            seen.update(level)
            level = list(dict.fromkeys(base for held in level for base in self.bases.get(held, []) if base not in seen))
        return None

    def java_static(self, read: _File, name: str, by_name: bool = False) -> str | None:
        """The static member ``name`` a Java file imports (``import static com.acme.Util.check``, or ``.*`` unless
        ``by_name``): a tester's 36 callers of javapoet's ``checkArgument`` were one."""
        for dotted, member in read.statics:
            key = self.java_types.get(dotted)
            imported = member == name or (member is None and not by_name)
            if key is not None and imported and (found := self.member(key, name)) is not None:
                return found
        return None

    def rust_type(self, read: _File, crate: str, module: tuple[str, ...], name: str, bare: bool = False) -> str | None:
        """The key of the Rust type ``name`` names in a module of a crate (``read``: the file it is written in):
        the module's own (two modules' ``Conn`` are two types: a review's were one), or, written ``bare``
        (``Type::f()``), one ``read`` ``use``s. Not the crate's one type of the name: ``io::Error::new()`` and
        the prelude's ``Vec::new()`` were a crate's own (a second review's)."""
        key = _rust_key(crate, module, name)
        if key not in self.types and key not in self.members and bare and name in read.uses:
            used_crate, used = self.rust_absolute(read, read.uses[name])
            key = _rust_key(used_crate, used[:-1], used[-1]) if used else ""
        return key if key in self.types or key in self.members else None

    def member(self, key: str | None, name: str, hops: int = 0, inherited_only: bool = False) -> str | None:
        """The qualified name of a type's member ``name``, or of the first of its bases' (``inherited_only``: its
        bases' alone, as ``super.f()`` reads)."""
        if key is None or hops > MAX_HOPS:
            return None
        if key in self.go_types:  # the shallowest, as Go promotes a method (a retest's B.Name lost to a deeper C's)
            holder = self._shallowest(
                self.bases.get(key, []) if inherited_only else [key], lambda held: name in self.members.get(held, {})
            )
            return self.members[holder][name] if holder is not None else None
        own = None if inherited_only else self.members.get(key, {}).get(name)
        if own is not None:
            return own
        return next((m for b in self.bases.get(key, []) if (m := self.member(b, name, hops + 1)) is not None), None)

    def javascript_value(self, read: _File, local: str, hops: int = 0) -> str | None:
        """What a name bound at a TypeScript or JavaScript file's level is: its own declaration's qualified name,
        or what it imports, followed through re-exports."""
        if local in read.top:
            return read.top[local]
        imported = read.imports.get(local)
        if imported is None or imported[1] is None or hops > MAX_HOPS:
            return None
        return self.javascript_export(imported[0], imported[1], hops + 1)

    def javascript_export(self, path: str, name: str, hops: int) -> str | None:
        """What a file exports under ``name``, followed through its re-exports: the files it re-exports whole
        (``export *``) breadth first, each once (index files re-exporting each other all made a review's lookup
        take 15 s for 10 files, growing as the files to the power of MAX_HOPS), so that a cycle ends and the
        answer is the same whichever file asks first (a second review's). Kept for the lookups a file's own
        import starts."""
        # A name of the module's other file too: `import { Transport } from './transport.js'` names the interface
        # its `transport.d.ts` declares (an agent tester's `implements Transport` read as an outside name), and a
        # file not read (a generated `mod.d.ts`, indexed whole) is answered by its twin that was (a retest's).
        twins = [p for p in self.twins.get(module_name(path), []) if p != path]
        if hops > MAX_HOPS or (path not in self.files and not twins):
            return None
        if (path, name) in self.exported:
            return self.exported[path, name]
        found: str | None = None
        seen = {path, *twins}
        # The file and what it re-exports first, its twins after: `index.d.ts` declaring `Foo` took the place of the
        # `impl.js` that `index.js` re-exports it from (a review's).
        for first in ([path] if path in self.files else [], twins):
            pending = list(first)
            while pending and found is None:
                read = self.files.get(pending.pop(0))
                if read is None:
                    continue
                if name in read.forwarded:
                    found = self.javascript_export(*read.forwarded[name], hops + 1)
                    break
                local = read.exports.get(name, name if name != "default" else None)
                found = self.javascript_value(read, local, hops) if local is not None else None
                if name != "default":
                    pending += [s for s in read.starred if s not in seen]
                    seen.update(read.starred)
            if found is not None:
                break
        if hops <= 1:
            self.exported[path, name] = found
        return found

    def rust_item(self, read: _File, crate: str, path: tuple[str, ...], hops: int = 0) -> str | None:
        """The qualified name of what a path from a crate's root names: a module's item, or a type's member
        (``a::Type::new``), also through a ``use`` of the module (a ``pub use`` re-exporting it: a tester's
        ``crate::ErrorImpl`` was lib.rs's ``pub use``). ``read``: the file it is written in."""
        if hops > MAX_HOPS or (crate, path) in self.rust_items:  # each path once: modules `pub use`-ing each
            return self.rust_items.get((crate, path))  # other made a second review's lookups exponential
        self.rust_items[crate, path] = None  # while looked up: a cycle back here ends
        found = self._rust_item(read, crate, path, hops)
        self.rust_items[crate, path] = found
        return found

    def _rust_item(self, read: _File, crate: str, path: tuple[str, ...], hops: int) -> str | None:
        for cut in range(len(path) - 1, -1, -1):  # the longest module first, then shorter: one that names nothing
            rest = path[cut:]  # of the rest (`chain::Chain` holding `Chain`'s `type Item`) is no answer
            found = self.rust_modules.get((crate, path[:cut]), {}).get(rest[0]) if len(rest) == 1 else None
            if len(rest) == 2:
                found = self.member(self.rust_type(read, crate, path[:cut], rest[0]), rest[1])
            module = self.rust_files.get((crate, path[:cut]))
            if found is None and module is not None and rest[0] in module.uses:
                found = self.rust_item(
                    module, *self.rust_absolute(module, (*module.uses[rest[0]], *rest[1:])), hops + 1
                )
            if found is not None:
                return found
        return None

    # -- the calls -----------------------------------------------------------------------------------------------

    def calls(self, sources: Mapping[str, str], tick: Callable[[], object]) -> dict[CallKey, list[str]]:
        """Each file's calls (parsed again: see :attr:`_File.outline`)."""
        found: dict[CallKey, dict[str, None]] = {}  # a chunk's calls in the order first made
        for read in self.files.values():
            tick()
            root, declared = _parsed(read.path, sources[read.path]) or (None, [])
            if root is None:
                continue
            names = _Locals(read, root)
            file_key = (read.path, bounded_symbol(read.module), 0)
            scopes: list[_Calls] = [_Calls(self, read, file_key, root, "", (), names)]
            for kind, level, qualname, span, node in declared:
                fqn = bounded_symbol(f"{read.module}.{qualname}")
                owner = qualname if level == "type" else (qualname.rpartition(".")[0] if kind == "method" else "")
                # Rust: the `mod` inside the file the chunk is in (a type's or method's owner is no module).
                space = tuple(qualname.split(".")[: -2 if kind == "method" else -1])
                scopes.append(_Calls(self, read, (read.path, fqn, span[0]), node, owner, space, names))
            # Each call goes with the innermost chunk holding it (the file's first of two alike: the sort is stable).
            chunks = _Nested([(_decorated_from(scope.node), scope.node.end_byte) for scope in scopes])
            for call in _captured(read, _CALLS, root):
                scope = scopes[next(chunks.holding(call), 0)]
                called = scope.callee(call)
                if called is not None and called != scope.key[1]:
                    found.setdefault(scope.key, {})[called] = None
        return {key: list(names) for key, names in found.items()}

    def graph(self, calls: Mapping[CallKey, list[str]]) -> tuple[list[GraphNode], list[GraphLink], dict[str, str]]:
        """The nodes, the links and each node's file (:class:`CodeRead`)."""
        nodes: dict[str, GraphNode] = {}
        defined_in: dict[str, str] = {}

        def define(object_type: str, path: str) -> None:
            # A published package's `x.js` and its types' `x.d.ts` are one module: its node is answered by the
            # code's chunk, not by the declarations' (a tester's importers were `export {};` stubs).
            known = defined_in.get(object_type)
            if known is None or (is_declaration_file(known) and not is_declaration_file(path)):
                defined_in[object_type] = path

        for read in self.files.values():
            module_type = object_type_name(read.module)
            nodes.setdefault(module_type, GraphNode(*split_object_type(module_type), kind="module"))
            define(module_type, read.path)
            for _kind, level, qualname, _span in read.outline:
                if level != "type":
                    continue
                object_type = object_type_name(f"{read.module}.{qualname}")
                # Its bases as interfaces, as Python's: a type of the tree by its object type, another by its name.
                interfaces = tuple(
                    self.type_object_type(self.type_named(read, name, qualname)) or object_type_name(name)
                    for name in read.bases_written.get(qualname, [])
                ) + tuple(
                    filter(None, map(self.type_object_type, self.implemented.get(self.type_key(read, qualname), [])))
                )
                # Declared twice (`x.js` and `x.d.ts`), it has the bases of both: only the declarations say what a
                # class implements, and the code's class, read last, took every `implements Transport` away.
                twin = nodes.get(object_type)
                if twin is not None and twin.kind == "class":
                    interfaces = tuple(dict.fromkeys((*twin.interfaces, *interfaces)))
                nodes[object_type] = GraphNode(*split_object_type(object_type), "class", interfaces)
                define(object_type, read.path)
        nodes = {t: n for t, n in nodes.items() if representable(n)}
        links: set[GraphLink] = set()

        def link(source: str | None, name: str, target: str | None) -> None:
            if source is not None and target is not None and source != target and {source, target} <= nodes.keys():
                links.add(GraphLink(source, name, target))

        for read in self.files.values():
            module_type = object_type_name(read.module)
            for module in self.imported_modules(read):
                link(module_type, IMPORTS, object_type_name(module))
            for qualname in read.bases_written:
                for base in self.bases.get(self.type_key(read, qualname), []):
                    link(object_type_name(f"{read.module}.{qualname}"), INHERITS, self.type_object_type(base))
        for key, satisfied in self.implemented.items():
            for interface in satisfied:
                link(self.type_object_type(key), INHERITS, self.type_object_type(interface))
        for (_path, fqn, _line), called in calls.items():
            for callee in called:
                link(self.object_types.get(fqn), CALLS, self.object_types.get(callee))
        return sorted(nodes.values(), key=lambda n: n.object_type), sorted(links), {
            t: path for t, path in defined_in.items() if t in nodes
        }  # fmt: skip

    def type_object_type(self, key: str | None) -> str | None:
        """The object type of the type of a key (:meth:`type_key`), where the tree declares one."""
        fqn = self.types.get(key) if key is not None else None
        return self.object_types.get(fqn) if fqn is not None else None

    def package_file(self, package: str) -> str:
        """The module of the file that stands for a Go package in the graph: the one named as the package is
        (``store/store.go``), else its ``doc.go``, else its first by path. One file, not each: a file importing
        20 packages of 30 files each would make 600 links."""
        if package not in self.package_files:  # once a package (a second review's: once an importing file)
            files = sorted(self.packages[package], key=lambda f: f.path)
            name = package.rpartition(":")[2]
            named = [f for f in files if posixpath.basename(f.path) in (f"{name}.go", "doc.go")]
            self.package_files[package] = (sorted(named, key=lambda f: not f.path.endswith(f"/{name}.go")) or files)[0]
        return self.package_files[package].module

    def stand_in_names(self) -> dict[str, tuple[str, ...]]:
        """Go: each directory's package's stand-in file (:meth:`package_file`) -> the package's names
        (:class:`CodeRead`); an agent tester's importers of a package of no file named as it were "not indexed".
        A directory's package is the one most of its files declare (not a ``go:generate`` helper's ``main``
        beside it, a review's), and no ``main`` or ``_test`` one, which nothing imports."""
        by_directory: dict[str, list[str]] = {}
        for package in sorted({self.go_package(f) for f in self.files.values() if f.domain == "go"}):
            directory, _, declared = package.rpartition(":")
            if declared and declared != "main" and not declared.endswith("_test"):
                by_directory.setdefault(directory, []).append(package)
        named: dict[str, tuple[str, ...]] = {}
        for directory, packages in by_directory.items():
            package = max(
                packages, key=lambda p: (len(self.packages[p]), p.endswith(":" + posixpath.basename(directory)))
            )
            module = self.package_file(package)
            names = [module.rpartition(".")[0], package.rpartition(":")[2]]
            named[self.package_files[package].path] = tuple(dict.fromkeys(n for n in names if n and n != module))
        return {path: names for path, names in named.items() if names}

    def imported_modules(self, read: _File) -> Iterator[str]:
        """The modules of the tree's files ``read`` imports from (see the module's docstring)."""
        if read.domain in ("typescript", "javascript"):
            for file in read.imported:  # a file not read (generated, indexed whole): its module's twin that was
                read_as = file if file in self.files else next(iter(self.twins.get(module_name(file), [])), None)
                yield from [self.files[read_as].module] if read_as is not None else []
        elif read.domain == "go":
            for package in self.go_imports.get(read.path, {}):
                yield from [self.package_file(package)] if package in self.packages else []
        elif read.domain == "java":
            for dotted, _ in read.imports.values():
                key = self.java_types.get(dotted)
                yield from [self.type_modules[key]] if key in self.type_modules else []
        elif read.domain == "rust":
            for used in read.uses.values():
                crate, path = self.rust_absolute(read, used)
                module = next(  # a module, or one an item is in (`use crate::Error`: lib.rs); not `std::io`'s root
                    (
                        m
                        for cut in (len(path), len(path) - 1)
                        if cut >= 0 and (m := self.rust_files.get((crate, path[:cut])))
                    ),
                    None,
                )
                yield from [module.module] if module is not None else []


class _Calls:
    """What one chunk's calls resolve to: ``node`` its code (a call in a declaration below it that is a chunk of
    its own is that chunk's), ``owner`` the type whose method (or body) it is, ``space`` (Rust) the ``mod`` within
    its file it is in, ``names`` what its file's code binds below its own level."""

    def __init__(
        self,
        tree: _Tree,
        read: _File,
        key: CallKey,
        node: tree_sitter.Node,
        owner: str,
        space: tuple[str, ...],
        names: _Locals,
    ) -> None:
        self.tree, self.read, self.key, self.node, self.owner, self.space = tree, read, key, node, owner, space
        self.names = names
        self.owner_key = tree.owner_key(read, owner) if owner else None

    def callee(self, node: tree_sitter.Node) -> str | None:
        domain = self.read.domain
        if domain in ("typescript", "javascript"):
            return self.javascript(node)
        if domain == "go":
            return self.go(node.child_by_field_name("function"))
        if domain == "java":
            return self.java(node)
        if domain == "rust":
            return self.rust(node)
        return None

    def javascript(self, node: tree_sitter.Node) -> str | None:
        tree, read = self.tree, self.read
        if node.type == "new_expression":
            made = node.child_by_field_name("constructor")
            if made is not None and made.type == "member_expression":  # `new ns.Class()`, `new Space.Class()`
                return self.named_by(made, node)
            return (
                tree.javascript_value(read, _text(made) or "")
                if made is not None and made.type == "identifier"
                else None
            )
        # A bare decorator (`@audited`) calls what it names, as `@memoize(60_000)` calls memoize.
        function = node if node.type in ("identifier", "member_expression") else None
        function = node.child_by_field_name("function") if node.type == "call_expression" else function
        function = _last_of_sequence(function) if function is not None else None
        if function is None:
            return None
        if function.type == "identifier":
            name = _text(function) or ""
            return None if self.names.binds(name, node) else tree.javascript_value(read, name)
        if function.type == "super":  # `super(...)`: the base class's constructor, as `new Base()` is the class
            return self.base_class(node)
        if function.type != "member_expression":
            return None
        held, name = function.child_by_field_name("object"), _private(function.child_by_field_name("property"))
        if held is None:
            return None
        if held.type in ("this", "super") and self.another_this(node):
            return None
        if held.type == "this":
            return tree.member(self.owner_key, name)
        if held.type == "super":
            return tree.member(self.owner_key, name, inherited_only=True)
        if held.type == "member_expression":  # `ns.Class.f()` (a tester's errorForCode), `Space.Inner.f()`
            named = self.named_by(held, node)
            if named in tree.spaces:
                return tree.spaces[named].get(name)
            return tree.member(named if named in tree.types else None, name)
        if held.type != "identifier":
            return None
        if self.names.binds(local := _text(held) or "", node):  # a local: through the class it is declared as
            written = self.names.type_of(local, node)
            # `ns.Class` too, `new ns.Class()` or `: ns.Class` through `import * as ns` (a retest's were untyped)
            naming = ("type_identifier", "identifier", "member_expression", "nested_type_identifier")
            typed = written is not None and written.type in naming
            return tree.member(tree.type_named(read, _text(written) or ""), name) if typed else None
        imported = read.imports.get(local)
        if imported is not None and imported[1] is None:  # `ns.f()` through `import * as ns`
            return tree.javascript_export(imported[0], name, 1)
        space = tree.javascript_value(read, local)
        if space in tree.spaces:  # `Validation.isEmail()`, a namespace declared or imported by name
            return tree.spaces[space].get(name)
        return tree.member(tree.type_named(read, local), name)  # `Class.f()`

    def named_by(self, dotted: tree_sitter.Node, node: tree_sitter.Node) -> str | None:
        """What a dotted name at ``node`` names (``ns.Class`` through ``import * as ns``, ``Space.Inner``): a
        namespace's, a type's or a function's qualified name; None for one a local starts, or any other."""
        tree, parts = self.tree, list[str]()
        while dotted.type == "member_expression" and (held := dotted.child_by_field_name("object")) is not None:
            parts.append(_private(dotted.child_by_field_name("property")))
            dotted = held
        first = _text(dotted) or ""
        if dotted.type != "identifier" or not parts or self.names.binds(first, node):
            return None
        parts.reverse()
        whole = self.imported_whole(dotted, node)
        named = (
            tree.javascript_export(whole, parts.pop(0), 1)
            if whole is not None
            else tree.javascript_value(self.read, first)
        )
        for part in parts:
            named = tree.spaces.get(named, {}).get(part) if named is not None else None
        return named

    def imported_whole(self, space: tree_sitter.Node | None, node: tree_sitter.Node) -> str | None:
        """The file a name ``space`` stands for where its file imports that whole (``import * as ns``) and the code
        at ``node`` binds no other of the name."""
        name = (_text(space) or "") if space is not None and space.type == "identifier" else ""
        whole = self.read.imports.get(name)
        return whole[0] if whole is not None and whole[1] is None and not self.names.binds(name, node) else None

    def go(self, function: tree_sitter.Node | None) -> str | None:
        tree, read = self.tree, self.read
        if function is None:
            return None
        if function.type == "identifier":
            name = _text(function) or ""
            return (
                None if self.names.binds(name, function) else tree.package_top.get(tree.go_package(read), {}).get(name)
            )
        if function.type != "selector_expression":
            return None
        held, name = function.child_by_field_name("operand"), _text(function.child_by_field_name("field")) or ""
        if held is not None and held.type == "selector_expression":  # `s.store.Get()`: through a field's type
            owner = held.child_by_field_name("operand")
            local = (_text(owner) or "") if owner is not None and owner.type == "identifier" else ""
            written = self.names.type_of(local, function) if local and self.names.binds(local, function) else None
            if written is None:
                return None
            return tree.member(
                tree.go_field(self.go_type(written), _text(held.child_by_field_name("field")) or ""), name
            )
        if held is None or held.type != "identifier":
            return None
        local = _text(held) or ""
        if self.names.binds(local, function):  # the receiver, a parameter or a local of a type of the tree
            written = self.names.type_of(local, function)
            return tree.member(self.go_type(written), name) if written is not None else None
        imported = read.imports.get(local)
        return tree.package_top.get(imported[0], {}).get(name) if imported is not None else None

    def go_type(self, written: tree_sitter.Node) -> str | None:
        """The key of a Go type as a binding says it (:func:`_declared_type`): ``Server``, ``*Server``,
        ``store.Store``, or what the function called returns (``NewRouter()``, ``chi.NewRouter()``)."""
        tree, read = self.tree, self.read
        if written.type != "call_expression":
            named = _go_written(written)
            return tree.go_named(read, *named) if named is not None else None
        function = written.child_by_field_name("function")
        fqn = None
        if function is not None and function.type == "identifier":
            fqn = tree.package_top.get(tree.go_package(read), {}).get(_text(function) or "")
        elif function is not None and function.type == "selector_expression":
            imported = read.imports.get(_text(function.child_by_field_name("operand")) or "")
            name = _text(function.child_by_field_name("field")) or ""
            fqn = tree.package_top.get(imported[0], {}).get(name) if imported is not None else None
        result = tree.go_results.get(fqn) if fqn is not None else None
        return tree.go_named(*result) if result is not None else None

    def java(self, node: tree_sitter.Node) -> str | None:
        tree, read = self.tree, self.read
        if node.type == "object_creation_expression":
            made = node.child_by_field_name("type")
            key = tree.type_named(read, _written_type(made) or "", self.owner) if made is not None else None
            return tree.types.get(key) if key is not None else None
        if node.type == "explicit_constructor_invocation":  # `super(...)` in a constructor: the base class
            made = node.child_by_field_name("constructor")
            return self.base_class(node) if made is not None and made.type == "super" else None
        if node.type != "method_invocation":
            return None
        held, name = node.child_by_field_name("object"), _text(node.child_by_field_name("name")) or ""
        if (held is None or held.type in ("this", "super")) and self.another_this(node):
            return None  # a method of an anonymous or local class
        if held is None or held.type == "this":  # `m()` is the class's, an enclosing class's, or imported static
            for scope in [self.owner] if held is not None else _enclosing(self.owner):
                found = tree.member(tree.type_key(read, scope), name)
                if found is not None:
                    return found
                if len(tree.bases.get(tree.type_key(read, scope), [])) < len(read.bases_written.get(scope, [])):
                    # A base outside the tree may declare it (`size()` of an ArrayList: a retest's); a static
                    # import of the name itself is taken all the same (javapoet's classes implement Comparable).
                    return tree.java_static(read, name, by_name=True) if held is None else None
            return tree.java_static(read, name) if held is None else None
        if held.type == "super":
            return tree.member(self.owner_key, name, inherited_only=True)
        through = held.child_by_field_name("object") if held.type == "field_access" else None
        fields = through is not None and through.type == "this"  # `this.s`: the field, whatever a local is named
        if fields:
            held = held.child_by_field_name("field") or held
        if held.type != "identifier":
            return None
        local = _text(held) or ""
        if self.names.binds(local, node):  # a parameter, a local or a field, of the type it is declared with
            written = self.names.type_of(local, node, fields)
            key = tree.type_named(read, _written_type(written) or "", self.owner) if written is not None else None
            return tree.member(key, name)
        return tree.member(tree.type_named(read, local, self.owner), name)  # `Type.m()`

    def base_class(self, node: tree_sitter.Node) -> str | None:
        """The class ``super(...)`` makes: the first base of the chunk's class, where the tree declares it."""
        if self.another_this(node):
            return None
        bases = self.tree.bases.get(self.owner_key or "", [])
        return self.tree.types.get(bases[0]) if bases else None

    def another_this(self, node: tree_sitter.Node) -> bool:
        """Whether ``this`` (or a bare method's class) at ``node`` is another object than the chunk's."""
        return self.names.another_this(node, self.node)

    def rust(self, node: tree_sitter.Node) -> str | None:
        tree, read = self.tree, self.read
        if node.type == "macro_invocation":
            macro = _text(node.child_by_field_name("macro")) or ""
            made = tree.rust_macros.get((rust_module_of(read.path)[0], macro), set())
            return next(iter(made)) if len(made) == 1 else None
        function = node.child_by_field_name("function") if node.type == "call_expression" else None
        if function is None:
            return None
        if function.type == "identifier":
            name = _text(function) or ""
            if self.names.binds(name, node):
                return None
            here = self.rust_module()
            if name in tree.rust_modules.get(here, {}):
                return tree.rust_modules[here][name]
            used = read.uses.get(name)
            return tree.rust_item(read, *tree.rust_absolute(read, used)) if used is not None else None
        if function.type == "field_expression":  # `self.f()`
            held = function.child_by_field_name("value")
            if held is not None and held.type == "self":
                return tree.member(self.owner_key, _text(function.child_by_field_name("field")) or "")
            return None
        if function.type != "scoped_identifier":
            return None
        path = _rust_path(function)
        if len(path) == 2 and path[0] == "Self":
            return tree.member(self.owner_key, path[1])
        if path and path[0] in read.uses:  # `Type::new()` or `module::f()` through a `use`
            return tree.rust_item(read, *tree.rust_absolute(read, (*read.uses[path[0]], *path[1:])))
        if len(path) == 2 and (key := tree.rust_type(read, *self.rust_module(), path[0], bare=True)) is not None:
            return tree.member(key, path[1])
        return tree.rust_item(read, *tree.rust_absolute(read, path))

    def rust_module(self) -> tuple[str, tuple[str, ...]]:
        """The module the chunk's code is in: its file's, or a ``mod`` inside it."""
        crate, path = rust_module_of(self.read.path)
        return crate, (*path, *self.space)


_JAVASCRIPT_CALLS = """(call_expression) @call (new_expression) @call (decorator (identifier) @call)
    (decorator (member_expression) @call)"""
_CALLS = {
    "typescript": _JAVASCRIPT_CALLS,
    "javascript": _JAVASCRIPT_CALLS,
    "go": "(call_expression) @call",
    "java": "(method_invocation) @call (object_creation_expression) @call (explicit_constructor_invocation) @call",
    "rust": "(call_expression) @call (macro_invocation) @call",
}
"""The nodes that are calls, by language; found by a tree-sitter query (walking every node in Python took
2.5 times as long as chunking the files)."""


@functools.cache
def _query(suffix: str, source: str) -> tree_sitter.Query:
    return tree_sitter.Query(parser(suffix).language, source)  # type: ignore[arg-type]


def _captured(read: _File, queries: Mapping[str, str], node: tree_sitter.Node) -> list[tree_sitter.Node]:
    """The nodes under ``node`` that the language's query of ``queries`` captures, in the order they start."""
    if read.domain not in queries:
        return []
    captures = tree_sitter.QueryCursor(_query(suffix_of(read.path), queries[read.domain])).captures(node)
    return sorted((n for nodes in captures.values() for n in nodes), key=lambda n: (n.start_byte, -n.end_byte))


def _decorated_from(node: tree_sitter.Node) -> int:
    """Where a declaration starts with the decorators right above it, which are no node of its own in TypeScript:
    ``@memoize(60_000)`` on a method is the method's call, as Python's decorators are (an agent tester's went to
    the class)."""
    start, above = node.start_byte, node.prev_named_sibling
    while above is not None and above.type in ("decorator", "comment"):
        start = above.start_byte if above.type == "decorator" else start
        above = above.prev_named_sibling
    return start


def _last_of_sequence(function: tree_sitter.Node) -> tree_sitter.Node:
    """What a call calls through parentheses and a sequence: ``(0, ns.f)()``, as a TypeScript compiler writes a call
    of an imported function in CommonJS (an agent tester's nats.js had hundreds), calls ``ns.f``."""
    while function.type in ("parenthesized_expression", "sequence_expression") and function.named_children:
        function = function.named_children[-1]
    return function


def _written_type(node: tree_sitter.Node) -> str | None:
    """A type's name as written, without its type arguments: ``Base`` for ``Base<T>``, ``java.io.Serializable``
    and ``React.Component`` whole; None for what is no name (``mixin(X, Y)``, a conditional)."""
    while node.type == "generic_type" and node.named_children:
        node = node.named_children[0]
    named = ("identifier", "type_identifier", "scoped_type_identifier", "member_expression", "nested_type_identifier")
    return _text(node) if node.type in named else None


_BINDINGS = {
    "typescript": """(variable_declarator name: (identifier) @bound) (required_parameter pattern: (identifier) @bound)
        (optional_parameter pattern: (identifier) @bound) (arrow_function parameter: (identifier) @bound)
        (function_declaration name: (identifier) @bound) (shorthand_property_identifier_pattern) @bound
        (catch_clause parameter: (identifier) @bound) (for_in_statement left: (identifier) @bound)
        (pair_pattern value: (identifier) @bound) (array_pattern (identifier) @bound) (rest_pattern (identifier) @bound)
        (class_declaration name: (type_identifier) @bound)""",
    "javascript": """(variable_declarator name: (identifier) @bound) (formal_parameters (identifier) @bound)
        (assignment_pattern left: (identifier) @bound) (arrow_function parameter: (identifier) @bound)
        (function_declaration name: (identifier) @bound) (shorthand_property_identifier_pattern) @bound
        (catch_clause parameter: (identifier) @bound) (for_in_statement left: (identifier) @bound)
        (pair_pattern value: (identifier) @bound) (array_pattern (identifier) @bound) (rest_pattern (identifier) @bound)
        (class_declaration name: (identifier) @bound)""",
    "go": """(short_var_declaration left: (expression_list (identifier) @bound)) (var_spec name: (identifier) @bound)
        (parameter_declaration name: (identifier) @bound) (range_clause left: (expression_list (identifier) @bound))
        (receive_statement left: (expression_list (identifier) @bound))
        (type_switch_statement alias: (expression_list (identifier) @bound))""",
    "java": """(formal_parameter name: (identifier) @bound) (variable_declarator name: (identifier) @bound)
        (catch_formal_parameter name: (identifier) @bound) (enhanced_for_statement name: (identifier) @bound)
        (lambda_expression parameters: (identifier) @bound) (inferred_parameters (identifier) @bound)
        (resource name: (identifier) @bound) (instanceof_expression name: (identifier) @bound)
        (type_pattern (identifier) @bound)""",
    "rust": """(let_declaration pattern: (identifier) @bound) (parameter pattern: (identifier) @bound)
        (closure_parameters (identifier) @bound) (function_item name: (identifier) @bound)
        (tuple_pattern (identifier) @bound) (tuple_struct_pattern (identifier) @bound)
        (for_expression pattern: (identifier) @bound) (let_condition pattern: (identifier) @bound)
        (match_pattern (identifier) @bound) (captured_pattern (identifier) @bound)
        (field_pattern name: (shorthand_field_identifier) @bound)""",
}
"""The names code binds, by language: parameters, locals, a function's inner functions (a review's ``const helper
= ...; helper()`` was the module's ``helper``), Java's fields too."""
_SCOPES = {
    "typescript": frozenset({"statement_block", "program", "function_declaration", "function_expression",
                             "arrow_function", "method_definition", "generator_function_declaration",
                             "generator_function", "for_statement", "for_in_statement", "catch_clause"}),
    "go": frozenset({"block", "source_file", "function_declaration", "method_declaration", "func_literal",
                     "for_statement", "if_statement", "expression_switch_statement", "type_switch_statement",
                     "communication_case", "type_case"}),
    "java": frozenset({"block", "program", "method_declaration", "constructor_declaration", "lambda_expression",
                       "class_body", "for_statement", "enhanced_for_statement", "catch_clause",
                       "try_with_resources_statement", "switch_rule", "switch_block_statement_group"}),
    "rust": frozenset({"block", "source_file", "function_item", "closure_expression", "for_expression", "match_arm",
                       "if_expression", "while_expression"}),
}  # fmt: skip
"""The nodes a name bound in them is bound within, by language (the file's own level aside: its names are the
file's declarations and imports)."""
_SCOPES["javascript"] = _SCOPES["typescript"] | {"function"}
_THIS_BOUNDS = {
    "typescript": """(function_expression) @this (function_declaration) @this (generator_function) @this
        (generator_function_declaration) @this (class) @this (class_declaration) @this
        (abstract_class_declaration) @this (method_definition) @this""",
    "javascript": """(function_expression) @this (function_declaration) @this (generator_function) @this
        (generator_function_declaration) @this (class) @this (class_declaration) @this (method_definition) @this""",
    "java": """(class_declaration) @this (interface_declaration) @this (enum_declaration) @this
        (record_declaration) @this (object_creation_expression (class_body) @this)""",
}
"""What has a ``this`` of its own: a function (not an arrow function), a class (Java: a local or anonymous one)."""


class _Nested:
    """Ranges of a file's bytes that nest or do not meet (scopes, chunks), each node found in the innermost holding
    it in as many steps as ranges hold it (a review's 1,000 nested blocks made each step up a node's parents
    cost as much as its depth)."""

    def __init__(self, ranges: list[tuple[int, int]]) -> None:
        self.order = sorted(range(len(ranges)), key=lambda i: (ranges[i][0], -ranges[i][1]))  # stable: the first
        self.ranges = [ranges[i] for i in self.order]  # of two alike holds the other
        self.starts = [start for start, _ in self.ranges]
        self.holder: list[int] = []  # each range's innermost holder's place (-1: none)
        for place, (_, end) in enumerate(self.ranges):
            up = place - 1
            while up >= 0 and self.ranges[up][1] < end:
                up = self.holder[up]
            self.holder.append(up)

    def holding(self, node: tree_sitter.Node) -> Iterator[int]:
        """The indexes (in the list given) of the ranges holding ``node``, innermost first."""
        place = bisect.bisect_right(self.starts, node.start_byte) - 1
        while place >= 0:
            if self.ranges[place][1] >= node.end_byte:
                yield self.order[place]
            place = self.holder[place]


@dataclass(frozen=True)
class _Binding:
    at: int
    """The byte it is bound from."""
    written: tree_sitter.Node | None
    """What says its type (:func:`_declared_type`), where anything does."""
    field: bool
    """A Java field (what ``this.name`` names)."""


class _Locals:
    """What a file's code binds below its own level, each name in the scope it is bound in, and the ranges that
    have a ``this`` of their own."""

    def __init__(self, read: _File, root: tree_sitter.Node) -> None:
        kinds = _SCOPES.get(read.domain, frozenset())
        found: list[tuple[tuple[int, int], str, _Binding]] = []
        for name in _captured(read, _BINDINGS, root):
            declared = name.parent
            hoisted = declared is not None and declared.type in ("function_declaration", "function_item")
            above = declared.parent if hoisted and declared is not None else declared  # an inner function: its block's
            while above is not None and above.type not in kinds:
                above = above.parent
            if above is None or above.parent is None:  # the file's own level
                continue
            # Bound from where the declaration ends (`let vt = vt(p)` calls the file's vt: a retest's), a
            # function and a field in the whole of their scope, a parameter from its name.
            holder = declared.parent if declared is not None and declared.type == "variable_declarator" else declared
            field = holder is not None and holder.type == "field_declaration"
            if hoisted or field:
                at = above.start_byte
            elif declared is not None and declared.type in ("variable_declarator", "let_declaration", "var_spec"):
                at = declared.end_byte
            elif declared is not None and declared.type == "expression_list" and declared.parent is not None:
                at = declared.parent.end_byte  # Go's `:=` and `range`
            else:
                at = name.end_byte
            found.append(
                ((above.start_byte, above.end_byte), _text(name) or "", _Binding(at, _declared_type(name), field))
            )
        scopes = list(dict.fromkeys(within for within, _, _ in found))
        self.scopes = _Nested(scopes)
        place = {within: index for index, within in enumerate(scopes)}
        self.bound: dict[tuple[int, str], list[_Binding]] = {}
        for within, bound_name, binding in found:
            self.bound.setdefault((place[within], bound_name), []).append(binding)
        self.this_ranges = [
            (n.start_byte, n.end_byte) for n in _captured(read, _THIS_BOUNDS, root) if not _given_this(n)
        ]
        self.own_this = _Nested(self.this_ranges)

    def binding(self, name: str, node: tree_sitter.Node, fields: bool = False) -> _Binding | None:
        """What binds ``name`` at ``node``: in the innermost scope holding it that binds it there, the last binding
        before it (``{Y v; v.run();} {Z v; v.run();}``: a review's were both Z's); ``fields``: a field alone."""
        for scope in self.scopes.holding(node):
            bound = [
                b for b in self.bound.get((scope, name), []) if b.at <= node.start_byte and (b.field or not fields)
            ]
            if bound:
                return max(bound, key=lambda b: b.at)
        return None

    def binds(self, name: str, node: tree_sitter.Node) -> bool:
        """Whether ``name`` at ``node`` is bound by its code (a parameter, a local), not the file's."""
        return self.binding(name, node) is not None

    def type_of(self, name: str, node: tree_sitter.Node, fields: bool = False) -> tree_sitter.Node | None:
        """What says the type of ``name`` at ``node`` (:meth:`binding`)."""
        bound = self.binding(name, node, fields)
        return bound.written if bound is not None else None

    def another_this(self, node: tree_sitter.Node, chunk: tree_sitter.Node) -> bool:
        """Whether ``this`` at ``node`` is another object than the ``chunk``'s: the innermost range with a ``this``
        of its own holding it lies within the chunk and is not the chunk (a review's: ``this.run()`` in a
        callback and an anonymous class's method were the outer class's)."""
        innermost = next(self.own_this.holding(node), None)
        if innermost is None:
            return False
        start, end = self.this_ranges[innermost]
        return (
            chunk.start_byte <= start and end <= chunk.end_byte and (start, end) != (chunk.start_byte, chunk.end_byte)
        )


def _given_this(function: tree_sitter.Node) -> bool:
    """A function passed beside ``this`` to tslib's ``__awaiter``, which calls it with that ``this``: the body of an
    ``async`` method as a TypeScript compiler writes it for older targets, ``__awaiter(this, void 0, void 0,
    function* () {...})`` (an agent tester's nats.js methods had no callees)."""
    given = function.parent
    if function.type not in ("function_expression", "generator_function") or given is None:
        return False
    called = given.parent.child_by_field_name("function") if given.parent is not None else None
    # tslib's helper alone (`__awaiter`, `tslib_1.__awaiter`): another call given `this` and a function need not
    # call it with that `this` (a review's `$.proxy(this, function () {...})`).
    helper = called is not None and (_text(called) or "").rpartition(".")[2] == "__awaiter"
    return (
        helper and given.type == "arguments" and bool(given.named_children) and given.named_children[0].type == "this"
    )


def _declared_type(name: tree_sitter.Node) -> tree_sitter.Node | None:
    """What a binding's name says of its type: the type it is declared with (a Java parameter's, local's or
    field's, a Go parameter's or ``var``'s, a TypeScript annotation's), or what it is bound to: a class's ``new``
    (``const ky = new Ky()``: its constructor's name), a Go composite literal's type (``s := &Server{}``), a Go
    call (``r := NewRouter()``: :meth:`_Calls.go_type` reads its function's result)."""
    holder = name.parent
    if holder is None:
        return None
    if holder.type == "variable_declarator" and holder.parent is not None and holder.parent.type in (
        "local_variable_declaration", "field_declaration"
    ):  # fmt: skip
        holder = holder.parent  # Java: the declaration's type
    written = holder.child_by_field_name("type")
    if holder.type in ("instanceof_expression", "type_pattern"):  # Java's `o instanceof Client s`, `case Client c`
        written = holder.child_by_field_name("right") or next(iter(holder.named_children), None)
    if written is not None and written.type == "type_annotation":  # TypeScript's `: Ky`
        written = written.named_children[0] if written.named_children else None
    if written is not None:
        return written
    value: tree_sitter.Node | None = None
    if holder.type in ("variable_declarator", "var_spec"):  # `const ky = new Ky()`, Go's `var s = &Server{}`
        value = holder.child_by_field_name("value")
        if value is not None and value.type == "expression_list":
            value = value.named_children[0] if value.named_child_count == 1 else None
    elif (
        holder.type == "expression_list" and holder.parent is not None and holder.parent.type == "short_var_declaration"
    ):
        right = holder.parent.child_by_field_name("right")
        index = next((i for i, n in enumerate(holder.named_children) if n.id == name.id), -1)
        value = right.named_children[index] if right is not None and 0 <= index < right.named_child_count else None
    if value is not None and value.type == "unary_expression":
        value = value.child_by_field_name("operand")
    if value is None:
        return None
    if value.type == "new_expression":
        return value.child_by_field_name("constructor")
    if value.type == "composite_literal":
        return value.child_by_field_name("type")
    return value if value.type == "call_expression" else None


def _go_struct_fields(spec: tree_sitter.Node) -> Iterator[tuple[list[str], tree_sitter.Node]]:
    """A ``type_spec``'s struct's field declarations: their names (none for an embedded one) and their type."""
    shape = spec.child_by_field_name("type")
    if shape is None or shape.type != "struct_type":
        return
    fields = next((n for n in shape.named_children if n.type == "field_declaration_list"), None)
    for declared in fields.named_children if fields is not None else []:
        kind = declared.child_by_field_name("type") if declared.type == "field_declaration" else None
        if kind is not None:
            yield [_text(n) or "" for n in declared.children_by_field_name("name")], kind


def _go_fields(spec: tree_sitter.Node) -> Iterator[tuple[str, tuple[str | None, str]]]:
    """A Go struct's fields of one named type (``st store.Store``, ``log *Logger``; an embedded ``*Base`` by its
    type's name), each as its name and the type as written (:func:`_go_written`)."""
    for names, kind in _go_struct_fields(spec):
        written = _go_written(kind)
        if written is not None:
            yield from ((name, written) for name in names or [written[1]])


def _go_signature(method: tree_sitter.Node) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A Go method's (or an interface's) parameter types and result types (:func:`_go_type`): ``(a, b int)
    (int, error)`` is ``("int", "int")`` and ``("int", "error")``. A type parameter of its receiver's type or of
    its interface is :data:`GO_ANY_TYPE`. A review's: matched by their number alone, ``Get(K) (V, bool)`` took
    ``Get(string) ([]byte, error)`` for itself."""
    generic = _go_type_parameters(method)

    def types(listed: tree_sitter.Node | None) -> tuple[str, ...]:
        if listed is None:
            return ()
        if listed.type != "parameter_list":
            return (_go_type(listed, generic),)
        declared = [n for n in listed.named_children if n.type.endswith("parameter_declaration")]
        return tuple(
            ("..." if n.type.startswith("variadic") else "") + _go_type(n.child_by_field_name("type"), generic)
            for n in declared
            for _ in range(max(1, len(n.children_by_field_name("name"))))
        )

    return types(method.child_by_field_name("parameters")), types(method.child_by_field_name("result"))


def _go_type_parameters(method: tree_sitter.Node) -> frozenset[str]:
    """The type parameters a Go method's types may name: its receiver's (``func (s *Set[T]) Add(T)``), or its
    interface's (``type Getter[K any] interface{ Get(K) }``)."""
    if method.type == "method_elem":
        spec = method.parent.parent if method.parent is not None else None
        listed = spec.child_by_field_name("type_parameters") if spec is not None and spec.type == "type_spec" else None
        if listed is None:
            return frozenset()
        return frozenset(_text(name) or "" for p in listed.named_children for name in p.children_by_field_name("name"))
    receiver = method.child_by_field_name("receiver")
    arguments = list(_go_leaves(receiver, inside="type_arguments")) if receiver is not None else []
    return frozenset(text for kind, text in arguments if kind == "type_identifier")


def _go_type(written: tree_sitter.Node | None, generic: frozenset[str]) -> str:
    """A Go type as a parameter or result has it, to compare with another's: its words without spaces, a
    qualified type by its name alone (``store.Key`` where one package writes ``Key``), ``interface{}`` as
    ``any`` wherever it stands (``map[string]interface{}``), ``uint8`` as ``byte`` and ``int32`` as ``rune``
    (Go's aliases), and :data:`GO_ANY_TYPE` where it names a type parameter (one of ``generic``). A review's:
    ``[]interface{}`` and ``func(a, b int) int`` (read ``func(,int)int``) took no interface asking ``[]any``."""
    if written is None:
        return GO_ANY_TYPE
    words = []
    for kind, text in _go_leaves(written):
        if kind == "type_identifier" and text in generic:
            return GO_ANY_TYPE
        words.append(_GO_ALIASES.get(text, text) if kind == "type_identifier" else text)
    return "".join(words).replace("interface{}", "any")


_GO_ALIASES = {"uint8": "byte", "int32": "rune"}
"""Go's predeclared aliases, by the name they stand for (``byte`` is ``uint8``)."""


def _go_leaves(node: tree_sitter.Node, inside: str | None = None) -> Iterator[tuple[str, str]]:
    """The tokens of a Go type in their order, each as its kind and text: without a qualified type's package,
    comments, or a parameter's names (in a function type its type is written once for each: ``a, b int`` as
    ``int,int``); with ``inside``, only those within a node of that type. Without recursion: a hostile file may
    nest types deeply."""
    pending: list[tuple[tree_sitter.Node | str, bool]] = [(node, inside is None)]
    while pending:
        current, within = pending.pop()
        if isinstance(current, str):  # the comma between one declaration's parameters
            yield current, current
            continue
        within = within or current.type == inside
        if current.child_count == 0:
            if within and current.type != "comment":
                yield current.type, _text(current) or ""
            continue
        children: list[tree_sitter.Node | str]
        if current.type == "qualified_type":
            children = list(current.children_by_field_name("name"))
        elif current.type.endswith("parameter_declaration"):
            typed = [c for i, c in enumerate(current.children) if current.field_name_for_child(i) != "name"]
            typed = [c for c in typed if c.type != ","]
            times = max(1, len(current.children_by_field_name("name")))
            children = [*typed]
            for _ in range(times - 1):
                children += [",", *typed]
        else:
            children = list(current.children)
        pending.extend((child, within) for child in reversed(children))


def _go_embedded(spec: tree_sitter.Node) -> list[str]:
    """Go: the types a ``type_spec``'s struct embeds (``*Base``, ``pkg.Base``) or its interface does (``Named``),
    written ``pkg.Name`` or ``Name``; any other element of an interface (``~int | ~string``, ``io.Reader | T``) as
    written, which names no type of the tree."""
    shape = spec.child_by_field_name("type")
    if shape is None:
        return []
    if shape.type == "struct_type":
        held = [kind for names, kind in _go_struct_fields(spec) if not names]
    elif shape.type == "interface_type":
        held = [
            n.named_children[0] if n.named_child_count == 1 else n
            for n in shape.named_children
            if n.type == "type_elem"
        ]
    else:
        return []
    named = [(_go_written(n), n) for n in held]
    return [(_text(n) or "?") if w is None else ".".join(filter(None, w)) for w, n in named]


def _go_written(written: tree_sitter.Node) -> tuple[str | None, str] | None:
    """A Go type as written, its pointers and type arguments aside: its package's name as written (None: its
    file's own) and its name; None for any other type (a slice, a map, a function)."""
    while written.type in ("pointer_type", "generic_type") and written.named_children:
        written = written.child_by_field_name("type") or written.named_children[0]
    if written.type == "type_identifier":
        return None, _text(written) or ""
    if written.type == "qualified_type":
        return _text(written.child_by_field_name("package")), _text(written.child_by_field_name("name")) or ""
    return None


def _private(node: tree_sitter.Node | None) -> str:
    """A member's name as :func:`code.chunk_code` names it: a private one's without its ``#``."""
    return (_text(node) or "").removeprefix("#")


def _enclosing(qualname: str) -> list[str]:
    """A qualified name and those holding it, innermost first (``A.B.C``, ``A.B``, ``A``); none for ``""``."""
    return [qualname.rsplit(".", i)[0] for i in range(qualname.count(".") + 1)] if qualname else []


def _trait_impls(node: tree_sitter.Node, spaces: tuple[str, ...] = ()) -> Iterator[tuple[str, str]]:
    """Rust: each ``impl Trait for Type`` at a file's level or in its ``mod`` blocks, as the type's qualified name
    in the file (as its methods are named) and the trait's path as written, without its type arguments."""
    for child in node.named_children:
        if child.type == "impl_item":
            implemented, trait = child.child_by_field_name("type"), child.child_by_field_name("trait")
            written = _written_type(trait) if trait is not None else None
            if implemented is not None and written is not None:
                yield ".".join((*spaces, impl_type_name(implemented))), written
        elif child.type == "mod_item" and (body := child.child_by_field_name("body")) is not None:
            name = child.child_by_field_name("name")
            if name is not None and name.text is not None:
                yield from _trait_impls(body, (*spaces, name.text.decode("utf-8", errors="replace")))


def _rust_key(crate: str, module: tuple[str, ...], name: str) -> str:
    """A Rust type's key: its crate, its module's path and its name."""
    return f"{crate}::{'::'.join((*module, name))}"


def _rust_path(node: tree_sitter.Node | None) -> tuple[str, ...]:
    """The segments of a Rust path (``crate::a::f`` is ``crate``, ``a``, ``f``), read without recursion."""
    segments: list[str] = []
    while node is not None and node.type == "scoped_identifier":
        name = node.child_by_field_name("name")
        segments += [_text(name) or ""] if name is not None else []
        node = node.child_by_field_name("path")
    segments += [_text(node) or ""] if node is not None else []
    return tuple(reversed(segments))
