"""The ontology graph of a Python tree (pure): modules and classes as nodes; inheritance, imports between
modules, and calls whose callee resolves statically, as links between the types that hold them.

Names resolve within the ingested tree only: a base class or callee from outside it is no node and no link (an
outside base still shows among a class's interfaces, by the name it is written with). An absolute import that
names the tree through a package prefix it does not contain (``ontofabric.services.x`` for ``services/x.py``)
resolves by its longest known suffix; one naming a package below the tree's top by its own name (``shoplib.x`` for
``src/shoplib/x.py``) resolves to it.
"""

from __future__ import annotations

import ast
import functools
import sys
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from pydantic import ValidationError

from ontofabric.contracts import CALLS, IMPORTS, INHERITS, OntologyNode, link_key
from ontofabric.contracts.identifiers import as_python_reads

from .chunking import assigned_names, at_level, is_overload, module_name, object_type_name

MAX_REEXPORT_HOPS = 4


@dataclass(frozen=True)
class GraphNode:
    domain: str
    name: str
    kind: str
    interfaces: tuple[str, ...] = ()

    @property
    def object_type(self) -> str:
        return f"{self.domain}.{self.name}" if self.domain else self.name


@dataclass(frozen=True, order=True)
class GraphLink:
    source_type: str
    name: str
    target_type: str

    @property
    def key(self) -> str:
        return link_key(self.source_type, self.name, self.target_type)


@dataclass
class _Module:
    fqn: str
    object_type: str
    tree: ast.Module
    is_package: bool
    path: str
    defs: dict[str, str] = field(default_factory=dict)
    """Top-level name -> object type it belongs to (a class's own type; a function's module type)."""
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    """Local name -> (module as written, imported symbol or None for the module itself)."""
    imported_at_top: dict[str, None] = field(default_factory=dict)
    """The names its own top-level imports bind (``imports`` holds a function's too)."""
    assigned: dict[str, ast.expr] = field(default_factory=dict)
    """Top-level name -> the name it is bound to by a plain assignment (``s = attrs``): another name for it."""
    values: dict[str, None] = field(default_factory=dict)
    """The names its own top-level statements assign (:func:`chunking.assigned_names`): constants, instances."""
    star_sources: list[str] = field(default_factory=list)
    """The tree's modules it imports every public name of (``from .core import *``), once each, in order."""
    public: tuple[str, ...] | None = None
    """Its ``__all__``, when written as a list or tuple of strings."""


def split_object_type(object_type: str) -> tuple[str, str]:
    """A node's domain and name, from its object type."""
    domain, _, name = object_type.rpartition(".")
    return domain, name


def _classes(body: list[ast.stmt], prefix: str = "") -> Iterator[tuple[str, ast.ClassDef]]:
    for node in at_level(body):
        if isinstance(node, ast.ClassDef):
            qualname = f"{prefix}{node.name}"
            yield qualname, node
            yield from _classes(node.body, f"{qualname}.")


def _import_names(modules: Mapping[str, _Module]) -> dict[str, _Module]:
    """The name a module of a package below the tree's top is imported by (its path from the package's top):
    ``shoplib.pricing`` for ``src/shoplib/pricing.py`` (a ``src`` layout, a monorepo's ``py/``), whose own name
    leads with directories that are no packages (a tester's "what calls compute_total" over a ``src`` layout found
    no caller). None that a module of the tree has as its own name, nor under a package name two directories hold
    or the standard library has."""
    packages = {module.path.rpartition("/")[0] for module in modules.values() if module.is_package}
    names: dict[str, _Module] = {}
    roots: dict[str, set[str]] = {}  # a package's name -> the directories holding a package of that name
    for module in modules.values():
        *directories, file = module.path.split("/")
        top = len(directories)
        while top > 0 and "/".join(directories[:top]) in packages:
            top -= 1
        if top == 0 or top == len(directories):  # named from the tree's top already, or in no package
            continue
        stem = file.removesuffix(".py")
        name = as_python_reads(".".join([*directories[top:], *([] if stem == "__init__" else [stem])]))
        roots.setdefault(directories[top], set()).add("/".join(directories[:top]))
        if name not in modules:
            names[name] = module
    # Not a package two directories hold (two services' `app`: one's `app.models` is not the other's), nor one
    # named as the standard library's modules (a test fixture's `json` is not what `import json` imports).
    shared = {package for package, held in roots.items() if len(held) > 1 or package in sys.stdlib_module_names}
    return {name: module for name, module in names.items() if name.partition(".")[0] not in shared}


class _Resolver:
    def __init__(self, modules: Mapping[str, _Module]) -> None:
        self._modules = modules
        self.import_names = _import_names(modules)
        self._deepest = max((name.count(".") + 1 for name in modules), default=0)
        self._published: dict[str, dict[str, None]] = {}
        self._starred: dict[str, dict[str, _Module]] = {}
        self._bound_anywhere: dict[str, frozenset[str]] = {}

    def published(self, module: _Module) -> dict[str, None]:
        """The names ``from module import *`` takes, in order: its ``__all__``, else its top-level names without
        a leading underscore, those it takes by ``*`` in turn among them (through modules that import each other
        so too: every one of them reached once)."""
        found = self._published.get(module.fqn)
        if found is not None:
            return found
        listed: dict[str, None] = {}
        public: dict[str, None] = {}
        seen: set[str] = set()
        pending = [module]
        while pending:
            source = pending.pop(0)
            if source.fqn in seen:
                continue
            seen.add(source.fqn)
            if source.public is not None:
                listed.update(dict.fromkeys(source.public))
                if source is module:
                    break
                continue
            public.update(dict.fromkeys([*source.defs, *source.imported_at_top, *source.values]))
            pending += self._star_sources(source)
        found = listed | {name: None for name in public if not name.startswith("_")}
        self._published[module.fqn] = found
        return found

    def starred(self, module: _Module) -> dict[str, _Module]:
        """Each name ``module`` takes by ``*``, with the module it takes it from (the first that publishes it);
        once per module: looked up for every name a module's code uses, 4,000 star imports were read again for
        each (a review's file of 149 kB took 8.5 s)."""
        found = self._starred.get(module.fqn)
        if found is None:
            found = {}
            for source in self._star_sources(module):
                for name in self.published(source):
                    found.setdefault(name, source)
            self._starred[module.fqn] = found
        return found

    def _star_sources(self, module: _Module) -> list[_Module]:
        return [self._modules[fqn] for fqn in module.star_sources if fqn != module.fqn]

    def module(self, dotted: str) -> _Module | None:
        parts = dotted.split(".")
        # No module's name has more parts than the deepest: a dotted import of 2,000 parts, looked up for each
        # use of a name it imports, joined every suffix each time (an audit's file of 12 KB took 45 s).
        whole = self.named(dotted)
        if whole is not None:
            return whole
        for start in range(max(1, len(parts) - self._deepest), len(parts)):
            found = self._modules.get(".".join(parts[start:]))
            if found is not None:
                return found
        return None

    def named(self, dotted: str) -> _Module | None:
        """The tree's module of that whole name, or imported by it (:func:`_import_names`)."""
        return self._modules.get(dotted) or self.import_names.get(dotted)

    def absolute(self, module: _Module, written: str, level: int) -> str:
        if level == 0:
            return written
        package = module.fqn.split(".") if module.is_package else module.fqn.split(".")[:-1]
        base = package[: len(package) - (level - 1)] if level > 1 else package
        return ".".join([*base, written] if written else base)

    def symbol(self, module: _Module, name: str, hops: int = 0) -> str | None:
        """The object type a top-level name of ``module`` refers to, defined there or imported into it (through
        modules that import it in turn, as a package's ``__init__`` does)."""
        if name in module.defs:
            return module.defs[name]
        if name not in module.imports:
            return None
        written, symbol = module.imports[name]
        target = self.module(written)
        if target is None:
            return None
        if symbol is None:
            return target.object_type
        if symbol in target.defs:
            return target.defs[symbol]
        submodule = self.module(f"{written}.{symbol}")
        if submodule is not None:
            return submodule.object_type
        return self.symbol(target, symbol, hops + 1) if hops < MAX_REEXPORT_HOPS and target is not module else None

    def imported_as(self, module: _Module, local: str) -> str | None:
        """The dotted name a local name was imported as (``x.y`` for ``import x.y as local`` or ``from x import
        y``); None when it was not imported."""
        if local not in module.imports:
            return None
        written, symbol = module.imports[local]
        return written if symbol is None else f"{written}.{symbol}"

    def imported_module(self, module: _Module, local: str) -> _Module | None:
        """The tree module a local name stands for (``import x.y as local`` or ``from x import local``)."""
        imported = self.imported_as(module, local)
        return self.module(imported) if imported is not None else None

    def symbol_fqn(self, module: _Module, name: str, hops: int = 0, values: bool = False) -> str | None:
        """The qualified name of the class or function a top-level name of ``module`` stands for: defined there,
        imported from the tree (through modules that import it in turn, as a package's ``__init__`` does, by name
        or by ``*``), or bound to such a name by a plain assignment (``s = attrs``). With ``values``, also of a
        name a module assigns anything else (``skip = _Skip()``), under that module's name."""
        if name in module.defs:
            return f"{module.fqn}.{name}"
        if hops >= MAX_REEXPORT_HOPS:
            return None
        if name in module.imports:
            written, symbol = module.imports[name]
            target = self.module(written)
            if target is None or symbol is None or target is module:
                return None
            return self.symbol_fqn(target, symbol, hops + 1, values)
        if name in module.assigned:
            # Another name for a class or function only: a value bound to another (`SETTINGS = DEFAULTS`) is this
            # module's own, whose chunk answers it with its line (a review's found it answered by DEFAULTS').
            bound = self.named_symbol(module, module.assigned[name], hops + 1)
            if bound is not None or not values:
                return bound
        if values and name in module.values:
            return f"{module.fqn}.{name}"
        source = self.starred(module).get(name)
        return self.symbol_fqn(source, name, hops + 1, values) if source is not None else None

    def named_symbol(self, module: _Module, node: ast.expr, hops: int = 0, values: bool = False) -> str | None:
        """``Name``, ``module_alias.Name`` or ``package.module.Name`` (after ``import package.module``) as the
        qualified name of a class or function of the tree (``values``: or of a name a module assigns)."""
        if isinstance(node, ast.Name):
            return self.symbol_fqn(module, node.id, hops, values)
        dotted = _dotted(node.value) if isinstance(node, ast.Attribute) else None
        if dotted is None:
            return None
        assert isinstance(node, ast.Attribute)
        head, _, rest = dotted.partition(".")
        imported = self.imported_as(module, head)
        if imported is None:
            return None
        target = self.module(f"{imported}.{rest}" if rest else imported)
        return self.symbol_fqn(target, node.attr, hops, values) if target is not None else None

    def unbound(self, module: _Module, node: ast.expr) -> str | None:
        """``name`` (``from pkg.mod import name``) or ``mod.name`` (``mod`` a module imported by its name) as
        ``pkg.mod.name``, when the tree holds that module and nothing in it binds such a name, or when the tree's
        own package holds no such module (moved or deleted): code still calling what a branch deleted, renamed or
        moved (an agent tester's "what still calls the class I renamed" found nothing). A module that may make
        any name (a ``__getattr__``, ``globals()``, a ``*`` import from outside the tree) leaves none unbound."""
        written: str | None = None
        name: str | None = None
        if isinstance(node, ast.Name) and node.id in module.imports:
            written, name = module.imports[node.id]
        elif isinstance(node, ast.Attribute) and (dotted := _dotted(node.value)) is not None:
            head, _, rest = dotted.partition(".")
            imported = self.imported_as(module, head)
            written = None if imported is None else f"{imported}.{rest}" if rest else imported
            name = node.attr
        if written is None or name is None:
            return None
        target = self.module(written)
        if target is not None and target.fqn != written and "." not in target.fqn:
            target = None  # by a last part alone: another project's `numpy.core` is not the tree's `core`
        if target is None:
            gone = self.gone_module(written)
            return None if gone is None else f"{gone}.{name}"
        if target is module or self._binds(target, name):
            return None
        return f"{target.fqn}.{name}"

    def gone_module(self, written: str) -> str | None:
        """``written``, a dotted module name the tree does not hold, when it is of the tree's own package (its
        top-level package is a regular package of the tree, one with an ``__init__``): a module moved or deleted
        (a branch's), not another project's. A namespace package (``google/cloud/x`` without ``google/__init__``)
        is shared with other projects (``google.protobuf``): none of its names counts (a review's)."""
        top = written.partition(".")[0]
        own = top in self._modules and self._modules[top].is_package
        return written if "." in written and written not in self._modules and own else None

    def _binds(self, module: _Module, name: str) -> bool:
        """Whether ``module`` may bind ``name``: it defines, imports, assigns or publishes it anywhere (a function's
        ``global``, a loop's target, ``__all__``), has a submodule of that name, or may make any name."""
        bound = self._bound_anywhere.get(module.fqn)
        if bound is None:
            bound = self._bound_anywhere[module.fqn] = self._names_bound(module)
        return name in bound or "*" in bound or name in self.starred(module) or f"{module.fqn}.{name}" in self._modules

    def _names_bound(self, module: _Module) -> frozenset[str]:
        """Every name a module's code binds anywhere (a store, a ``def`` or ``class``, an import, ``global``,
        ``except ... as``, a ``match`` capture, ``__all__``), and ``*`` when it may make any name (a
        ``__getattr__``, ``globals()`` or ``vars()``, ``sys.modules`` written, a ``*`` import from outside the
        tree): more than it binds at its top level, so that a name it may bind is never taken for one it does not.
        One walk of the module."""
        names: set[str] = set(module.public or ())
        getattr_def = next(
            (n for n in module.tree.body if isinstance(n, ast.FunctionDef) and n.name == "__getattr__"), None
        )
        served = _names_served(getattr_def) if getattr_def is not None else None
        inside = set(map(id, ast.walk(getattr_def))) if served is not None and getattr_def is not None else set()
        for node in ast.walk(module.tree):
            if id(node) in inside:  # a __getattr__ that serves only the names it tests for: those, below
                continue
            if isinstance(node, ast.Name):
                if isinstance(node.ctx, ast.Store | ast.Del):
                    names.add(node.id)
                elif node.id in ("globals", "vars"):
                    names.add("*")
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Import | ast.ImportFrom):
                for alias in node.names:
                    if alias.name != "*":
                        names.add(alias.asname or alias.name.split(".")[0])
                    # `from ._speedups import *`: any name, from a module not the tree's
                    elif (
                        isinstance(node, ast.ImportFrom)
                        and self.absolute(module, node.module or "", node.level) not in self._modules
                    ):
                        names.add("*")
            elif isinstance(node, ast.Global | ast.Nonlocal):
                names.update(node.names)
            elif isinstance(node, ast.ExceptHandler | ast.MatchAs | ast.MatchStar) and node.name:
                names.add(node.name)
            elif isinstance(node, ast.MatchMapping) and node.rest:
                names.add(node.rest)
            elif isinstance(node, ast.Attribute) and node.attr == "modules" and _dotted(node) == "sys.modules":
                names.add("*")
        if served is not None:
            names |= served | {"__getattr__"}
        elif "__getattr__" in names:
            names.add("*")
        return frozenset(names)

    def expression(self, module: _Module, node: ast.expr) -> str | None:
        """``Name`` or ``module_alias.Name`` as an object type, when it resolves inside the tree."""
        if isinstance(node, ast.Name):
            return self.symbol(module, node.id)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            target = self.imported_module(module, node.value.id)
            if target is None:
                return None
            if node.attr in target.defs:
                return target.defs[node.attr]
            submodule = self.module(f"{target.fqn}.{node.attr}")
            if submodule is not None:
                return submodule.object_type
            # A name the module imports in turn: `abc.TaskGroup` after `from .. import abc`, whose __init__
            # re-exports it (an agent tester's anyio: 24 backend classes derived from no type of the tree).
            return self.symbol(target, node.attr)
        return None


def _names_served(getattr_def: ast.FunctionDef) -> frozenset[str] | None:
    """The names a module's ``__getattr__`` serves, when it tells them by testing its parameter against strings
    (``if name in {"A", "B"}: ...``, ``elif name == "C": ...``) and raises for the rest; None when it may serve any
    (click's ``parser`` serves six deprecated names: every call of a name it no longer bound read as possibly
    served, and a half-done rename's callers were lost; an agent tester's)."""
    if not getattr_def.args.args:
        return None
    parameter = getattr_def.args.args[0].arg
    served: set[str] = set()
    body = list(getattr_def.body)
    if not body or not isinstance(body[-1], ast.Raise):
        return None
    for statement in body[:-1]:
        if isinstance(statement, ast.Import | ast.ImportFrom | ast.Pass) or (
            isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
        ):
            continue
        branch: ast.stmt | None = statement
        while isinstance(branch, ast.If):  # an if / elif chain, each testing the parameter
            tested = _strings_tested(branch.test, parameter)
            if tested is None:
                return None
            served |= tested
            if not branch.orelse:
                branch = None
            elif len(branch.orelse) == 1 and isinstance(branch.orelse[0], ast.If):
                branch = branch.orelse[0]
            else:
                return None  # an else serves what no test named
        if branch is not None:
            return None
    return frozenset(served)


def _strings_tested(test: ast.expr, parameter: str) -> set[str] | None:
    """The strings ``test`` compares ``parameter`` with (``==``, ``in`` a literal set, tuple or list, ``or`` of
    such tests); None for any other test."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or):
        parts = [_strings_tested(value, parameter) for value in test.values]
        return None if any(part is None for part in parts) else set().union(*(p for p in parts if p is not None))
    if not (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.left, ast.Name)
        and test.left.id == parameter
    ):
        return None
    operator, compared = test.ops[0], test.comparators[0]
    if isinstance(operator, ast.Eq) and isinstance(compared, ast.Constant) and isinstance(compared.value, str):
        return {compared.value}
    if isinstance(operator, ast.In) and isinstance(compared, ast.Set | ast.Tuple | ast.List):
        values = [e.value for e in compared.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        return set(values) if len(values) == len(compared.elts) else None
    return None


def _dotted(node: ast.expr) -> str | None:
    """``a.b.C`` as written, for a name or an attribute chain; None for anything computed. Walked, not recursed:
    a chain of 2,000 names in a file of 4 KB stopped the whole ingest with a RecursionError (an audit's)."""
    attributes: list[str] = []
    while isinstance(node, ast.Attribute):
        attributes.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(attributes)]) if isinstance(node, ast.Name) else None


def _interface(resolver: _Resolver, module: _Module, base: ast.expr) -> str | None:
    """A base class as an interface: the type it resolves to inside the tree, else its dotted name as written
    (``Generic[T]`` counts as ``Generic``). A base computed by a call (``namedtuple(...)``) has no name: left out."""
    if isinstance(base, ast.Subscript):
        base = base.value
    resolved = resolver.expression(module, base)
    if resolved is not None:
        return resolved
    dotted = _dotted(base)
    return object_type_name(dotted) if dotted else None


def representable(node: GraphNode) -> bool:
    """Whether the contract can carry the node (a 600-character class name cannot)."""
    try:
        OntologyNode(domain=node.domain, name=node.name, kind=node.kind, interfaces=list(node.interfaces))
    except ValidationError:
        return False
    return True


@dataclass
class PythonTree:
    """A tree's parsable Python files, each parsed once, with the names each defines and imports at its top
    level (:func:`read_python`): what the graph, the calls and the exports are read from. Each of the three had
    parsed every file again, and the parses were most of an unchanged re-ingest's reading."""

    modules: dict[str, _Module]
    resolver: _Resolver

    def parsed(self, path: str) -> ast.Module | None:
        """The file's tree (None where it could not be parsed, or is no Python file of the tree)."""
        module = self._by_path.get(path)
        return module.tree if module is not None else None

    def imported_as(self, fqn: str) -> str | None:
        """A symbol's qualified name as Python imports it, where its module's name is not that
        (:func:`_import_names`: ``shoplib.pricing.compute_total`` for ``src.shoplib.pricing.compute_total``);
        None otherwise."""
        parts = fqn.split(".")
        for end in range(len(parts), 0, -1):
            imported = self._imported_names.get(".".join(parts[:end]))
            if imported is not None:
                return ".".join([imported, *parts[end:]])
        return None

    @functools.cached_property
    def _imported_names(self) -> dict[str, str]:
        return {module.fqn: name for name, module in self.resolver.import_names.items()}

    @functools.cached_property
    def _by_path(self) -> dict[str, _Module]:
        return {module.path: module for module in self.modules.values()}


def _tree_of(sources: Mapping[str, str] | PythonTree, package: str | None) -> PythonTree:
    return sources if isinstance(sources, PythonTree) else read_python(sources, package)


def read_python(
    sources: Mapping[str, str], package: str | None = None, tick: Callable[[], object] = lambda: None
) -> PythonTree:
    """The parsable Python files of ``sources`` (relative path -> text; ``package``: the tree's own package name,
    see :func:`chunking.module_name`). ``tick``: called before each Python file is parsed."""
    modules: dict[str, _Module] = {}
    for path, source in sorted(sources.items()):
        if not path.endswith(".py"):
            continue
        tick()
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError, RecursionError):  # nested deeper than the parser goes: not read
            continue
        fqn = module_name(path, package)
        modules[fqn] = _Module(fqn, object_type_name(fqn), tree, path.endswith("__init__.py"), path)
    resolver = _Resolver(modules)
    for module in modules.values():
        at_run_time = {id(statement) for statement in at_level(module.tree.body, run_time=True)}
        for statement in at_level(module.tree.body):
            if isinstance(statement, ast.Import | ast.ImportFrom | ast.Assign) and id(statement) not in at_run_time:
                continue  # what a type checker or a script alone runs binds nothing the module publishes
            if isinstance(statement, ast.ClassDef):
                module.defs[statement.name] = object_type_name(f"{module.fqn}.{statement.name}")
            elif isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef):
                module.defs[statement.name] = module.object_type
            elif isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Name | ast.Attribute):
                for target in statement.targets:
                    if isinstance(target, ast.Name) and target.id not in module.defs:
                        module.assigned[target.id] = statement.value
            elif isinstance(statement, ast.Import):
                module.imported_at_top.update(dict.fromkeys(a.asname or a.name.split(".")[0] for a in statement.names))
            elif isinstance(statement, ast.ImportFrom):
                written = resolver.absolute(module, statement.module or "", statement.level)
                for alias in statement.names:
                    if alias.name != "*":
                        module.imported_at_top[alias.asname or alias.name] = None
                    # A module of the tree by its whole name: another project's `numpy.core` is not the tree's
                    # `core` (a review's), as other imports may resolve by their last parts.
                    elif (taken := resolver.named(written)) is not None and taken.fqn not in module.star_sources:
                        module.star_sources.append(taken.fqn)
        module.values = dict.fromkeys(assigned_names(module.tree.body))
        module.public = _all_of(module.tree)
        for found in ast.walk(module.tree):
            if isinstance(found, ast.Import):
                for alias in found.names:
                    local = alias.asname or alias.name.split(".")[0]
                    module.imports[local] = (alias.name if alias.asname else alias.name.split(".")[0], None)
            elif isinstance(found, ast.ImportFrom):
                written = resolver.absolute(module, found.module or "", found.level)
                for alias in found.names:
                    if alias.name != "*":
                        module.imports[alias.asname or alias.name] = (written, alias.name)
    return PythonTree(modules, resolver)


def _all_of(tree: ast.Module) -> tuple[str, ...] | None:
    """A module's ``__all__`` as written at its top level, when it is a list or tuple of strings."""
    for statement in at_level(tree.body):
        if (
            isinstance(statement, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__all__" for t in statement.targets)
            and isinstance(statement.value, ast.List | ast.Tuple)
        ):
            names = [e.value for e in statement.value.elts if isinstance(e, ast.Constant)]
            if all(isinstance(name, str) for name in names):
                return tuple(str(name) for name in names)
    return None


def python_graph(
    sources: Mapping[str, str] | PythonTree, package: str | None = None, tick: Callable[[], object] = lambda: None
) -> tuple[list[GraphNode], list[GraphLink]]:
    """Nodes and links of the Python files ``sources`` (relative path -> text, or as :func:`read_python` read
    them; ``package``: the tree's own package name, see :func:`chunking.module_name`, for sources as text).
    ``tick``: called before each module's links are read."""
    tree = _tree_of(sources, package)
    modules, resolver = tree.modules, tree.resolver

    nodes: dict[str, GraphNode] = {}
    links: set[GraphLink] = set()

    def link(source: str, name: str, target: str | None) -> None:
        if target is not None and target != source and target in nodes and source in nodes:
            links.add(GraphLink(source, name, target))

    def gone(module: _Module, written: str) -> None:
        """An import of a module of the tree's own package that the tree no longer holds (a branch moved or
        deleted it): still a link, as main's was, so that its importers stay (an agent tester's moved module lost
        every importer on the branch, its unchanged files' among them)."""
        missing = resolver.gone_module(written)
        if missing is not None and module.object_type in nodes:
            links.add(GraphLink(module.object_type, IMPORTS, object_type_name(missing)))

    for module in modules.values():
        nodes[module.object_type] = GraphNode(*split_object_type(module.object_type), kind="module")
        for qualname, cls in _classes(module.tree.body):
            object_type = object_type_name(f"{module.fqn}.{qualname}")
            interfaces = tuple(i for i in (_interface(resolver, module, b) for b in cls.bases) if i)
            nodes[object_type] = GraphNode(
                split_object_type(object_type)[0], split_object_type(object_type)[1], "class", interfaces
            )
    # A type whose names the contract cannot carry (a 600-character class name) stays out of the graph, so one
    # odd source never stops an ingest; its documents are ingested all the same.
    nodes = {t: n for t, n in nodes.items() if representable(n)}
    for module in modules.values():
        tick()
        for found in ast.walk(module.tree):
            if isinstance(found, ast.Import):
                for alias in found.names:
                    target = resolver.module(alias.name)
                    link(module.object_type, IMPORTS, target.object_type if target else None)
                    if target is None:
                        gone(module, alias.name)
            elif isinstance(found, ast.ImportFrom):
                written = resolver.absolute(module, found.module or "", found.level)
                target = resolver.module(written)
                link(module.object_type, IMPORTS, target.object_type if target else None)
                if target is None:
                    gone(module, written)
                for alias in found.names:
                    submodule = resolver.module(f"{written}.{alias.name}")
                    if submodule is not None and target is not None and submodule.fqn.startswith(target.fqn):
                        link(module.object_type, IMPORTS, submodule.object_type)
        for qualname, cls in _classes(module.tree.body):
            object_type = object_type_name(f"{module.fqn}.{qualname}")
            for base in cls.bases:  # `PromptBase[bool]` inherits from PromptBase (an agent tester's: no link)
                generic = base.value if isinstance(base, ast.Subscript) else base
                link(object_type, INHERITS, resolver.expression(module, generic))
        for owner, body in _callers(module):
            for call in (n for statement in body for n in ast.walk(statement) if isinstance(n, ast.Call)):
                link(owner, CALLS, resolver.expression(module, call.func))
    return sorted(nodes.values(), key=lambda n: n.object_type), sorted(links)


def defining_files(sources: PythonTree) -> dict[str, str]:
    """Each type :func:`python_graph` makes a node of -> the file defining it (a module's own, a class's
    module's): what a node, and a link from it, belong to when a branch holds that file whole."""
    files: dict[str, str] = {}
    for module in sources.modules.values():
        files[module.object_type] = module.path
        for qualname, _ in _classes(module.tree.body):
            files[object_type_name(f"{module.fqn}.{qualname}")] = module.path
    return files


def _callers(module: _Module) -> Iterator[tuple[str, list[ast.stmt]]]:
    """(type the code belongs to, statements): module-level code and functions, and each class's body."""
    top = [n for n in module.tree.body if not isinstance(n, ast.ClassDef)]
    yield module.object_type, top
    for qualname, cls in _classes(module.tree.body):
        members = [n for n in cls.body if not isinstance(n, ast.ClassDef)]
        yield object_type_name(f"{module.fqn}.{qualname}"), members


@dataclass(frozen=True)
class _Class:
    members: frozenset[str]
    """The names its body defines: its methods and the classes nested in it."""
    bases: tuple[str, ...]
    """The qualified names of its bases that are classes of the tree, in order."""
    bound: frozenset[str] = frozenset()
    """Every name its body binds at its level (members, assignments, imports): what an annotation of one of its
    methods names, where it names one of these."""


def _bound_at(statements: Iterable[ast.stmt]) -> frozenset[str]:
    """The names ``statements`` assign or import at their own level (a class body's ``Context = Other``)."""
    bound: set[str] = set()
    for statement in statements:
        if isinstance(statement, ast.Import | ast.ImportFrom):
            bound |= {alias.asname or alias.name.split(".")[0] for alias in statement.names}
        elif isinstance(statement, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            bound |= {n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name)}
    return frozenset(bound)


def _method(classes: Mapping[str, _Class], class_fqn: str, name: str, inherited_only: bool = False) -> str | None:
    """The qualified name of the member ``name`` (a method or nested class) as ``class_fqn`` resolves it: its own,
    else the first of its bases' in depth-first order (close to Python's method resolution order for the single
    inheritance trees use most); ``inherited_only``: as ``super()`` resolves it."""
    seen: set[str] = set()
    order = list(classes[class_fqn].bases)[::-1] if inherited_only else [class_fqn]  # the next on top
    while order:
        current = order.pop()
        if current in seen or current not in classes:
            continue
        seen.add(current)
        if name in classes[current].members:
            return f"{current}.{name}"
        order += classes[current].bases[::-1]
    return None


Scope = tuple[str, int, list[ast.AST], str | None]
"""A chunk's code: its qualified name, the line of its ``class`` or ``def`` (0 for a module's own statements), the
code, and the class ``self`` stands for in it."""


def _code_scopes(module: _Module) -> Iterator[Scope]:
    """The code of each chunk :func:`chunking.chunk_python` makes, by its qualified name and line: the module's own
    statements, each class's body outside its methods, each function and method whole (nested functions and
    decorators included), with the class ``self`` stands for in it."""
    yield module.fqn, 0, [n for n in at_level(module.tree.body) if not isinstance(n, _DEFINITIONS)], None

    def visit(body: list[ast.stmt], prefix: str, owner: str | None) -> Iterator[Scope]:
        level = at_level(body)
        # An overload stub beside its implementation is no chunk of its own: what its signature calls (a
        # default's call) is the implementation's, as before stubs were left out (tenacity's `retry`).
        implemented = {
            n.name: n.lineno
            for n in level
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and not is_overload(n)
        }
        for node in level:
            if isinstance(node, ast.ClassDef):
                fqn = f"{prefix}.{node.name}"
                own: list[ast.AST] = [*map(applied, node.decorator_list), *node.bases, *node.keywords]
                statements = [n for n in at_level(node.body) if not isinstance(n, _DEFINITIONS)]
                yield fqn, node.lineno, [*own, *statements], None
                yield from visit(node.body, fqn, fqn)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                line = implemented.get(node.name, node.lineno) if is_overload(node) else node.lineno
                yield f"{prefix}.{node.name}", line, [node], owner

    yield from visit(module.tree.body, module.fqn, None)


_DEFINITIONS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def python_exports(sources: Mapping[str, str] | PythonTree, package: str | None = None) -> dict[str, tuple[str, ...]]:
    """For each class or function of the tree a package re-exports (its ``__init__`` imports it from the tree:
    ``from .core import Option``), the names it is published under there (``click.Option`` for
    ``click.core.Option``), in order; a name imported under another (``as``) is published under that one. Any
    module also publishes what it takes by ``from x import *`` (``attrs.validators.instance_of``, defined as
    ``attr.validators.instance_of``) and the names it binds to another (``s = attrs``: ``attr.s``). So are the
    names a module assigns (``pytest.skip`` for ``_pytest.outcomes.skip``, ``skip = _Skip()``: an agent tester's
    most used names of pytest were "not indexed"), under the module's name and the name (its chunk's
    ``defines``)."""
    tree = _tree_of(sources, package)
    modules, resolver = tree.modules, tree.resolver
    exported: dict[str, dict[str, None]] = {}
    for module in modules.values():
        # The package's own imports, not a function's (a review's): what its module level binds.
        bound = (
            a.asname or a.name
            for s in at_level(module.tree.body, run_time=True)
            if isinstance(s, ast.ImportFrom) and module.is_package
            for a in s.names
            if a.name != "*"
        )
        for local in dict.fromkeys([*bound, *module.assigned, *resolver.starred(module)]):
            imported_module = local in module.imports and module.imports[local][1] is None
            target = None if imported_module else resolver.symbol_fqn(module, local, values=True)
            published = f"{module.fqn}.{local}"
            if target is not None and target != published:
                exported.setdefault(target, {})[published] = None
    # A package's own names first, then the shorter: only so many are carried, and 400 examples taking a package
    # by `*` pushed its own `mylib.C0` out (a review's).
    packages = {module.fqn for module in modules.values() if module.is_package}
    return {
        target: tuple(sorted(names, key=lambda name: (name.rpartition(".")[0] not in packages, name.count("."))))
        for target, names in exported.items()
    }


def python_calls(
    sources: Mapping[str, str] | PythonTree, package: str | None = None, tick: Callable[[], object] = lambda: None
) -> dict[tuple[str, str, int], tuple[str, ...]]:
    """For each chunk of code (by its file, the qualified name :func:`chunking.chunk_python` gives it: a package's
    function can share its name with a module of the package, and the line of its ``class`` or ``def``: a
    property's getter and setter share their name, and each calls what it calls), the classes and
    functions of the tree its code calls, resolved from the syntax alone: a name its module defines or imports
    from the tree (unless the function binds that name itself), ``module.name`` through an imported module,
    ``Class.name``, and ``self.name``, ``cls.name`` or ``super().name`` through the class and its bases in the tree;
    also a name a module assigns (``concat = "".join``), under that module's name; and a method through a
    parameter annotated with one class of the tree (``ctx: Context``), or a local bound once to what such a class's
    call or a function annotated to return one makes (``ctx = get_current_context()``), neither bound otherwise;
    and a name imported from a module of the tree that binds no such name (:meth:`_Resolver.unbound`: what a
    branch deleted or renamed), under that module's name. A call through any other object (an attribute, what a
    call returned unbound) cannot be told from the syntax and is left out, as is a chunk calling itself. A
    module's chunk holds its own statements' calls only, a class's those of its body outside its methods.
    ``tick``: called before each module's calls are read."""
    tree = _tree_of(sources, package)
    modules, resolver = tree.modules, tree.resolver
    classes: dict[str, _Class] = {}
    for module in modules.values():
        for qualname, cls in _classes(module.tree.body):
            members = frozenset(n.name for n in at_level(cls.body) if isinstance(n, _DEFINITIONS))
            bases = (resolver.named_symbol(module, b.value if isinstance(b, ast.Subscript) else b) for b in cls.bases)
            bound = members | _bound_at(at_level(cls.body))
            classes[f"{module.fqn}.{qualname}"] = _Class(members, tuple(b for b in bases if b is not None), bound)

    # What each function of the tree is annotated to return, where that is one class of the tree (and whether it is
    # async: its call returns that only awaited).
    returns: dict[str, tuple[str, bool]] = {}
    for module in modules.values():
        scopes: list[tuple[str, list[ast.stmt], str | None]] = [(module.fqn, module.tree.body, None)]
        scopes += [(f"{module.fqn}.{qualname}", cls.body, f"{module.fqn}.{qualname}") for qualname, cls in _classes(
            module.tree.body
        )]  # fmt: skip
        for prefix, body, owner in scopes:
            own = classes[owner].bound if owner is not None and owner in classes else frozenset()
            defined: dict[str, set[tuple[str, bool] | None]] = {}
            for definition in at_level(body):
                if not isinstance(definition, ast.FunctionDef | ast.AsyncFunctionDef) or is_overload(definition):
                    continue
                kind = _one_type(definition.returns)
                named = None if kind is None or (isinstance(kind, ast.Name) and kind.id in own) else (
                    resolver.named_symbol(module, kind)
                )  # fmt: skip
                # A decorator may make the call return another thing (`@contextmanager`): only those known not to.
                kept = all(_dotted(d) in TYPE_KEEPING_DECORATORS for d in definition.decorator_list)
                returned = (named, isinstance(definition, ast.AsyncFunctionDef)) if named in classes and kept else None
                defined.setdefault(definition.name, set()).add(returned)
            for name, returned_set in defined.items():  # defined twice (`if`/`else`) alike, or it is not told
                (returned,) = returned_set if len(returned_set) == 1 else (None,)
                if returned is not None:
                    returns[f"{prefix}.{name}"] = returned

    # Each (class, name) resolved once: a method's every `self.x()` walked the bases again, and a chain of 8,000
    # classes with as many calls took 13 s (an audit's).
    @functools.cache
    def member(class_fqn: str, name: str, inherited_only: bool = False) -> str | None:
        return _method(classes, class_fqn, name, inherited_only)

    def callee(module: _Module, func: ast.expr, owner: str | None, typed: Mapping[str, str]) -> str | None:
        if isinstance(func, ast.Subscript):
            # `Box[int]()` makes a Box (an agent tester's anyio `_MemoryObjectItemReceiver[T_co]()` was no call of
            # it); `handlers[key]()` calls what a mapping holds, no symbol's.
            made = callee(module, func.value, owner, typed)
            return made if made in classes else None
        if isinstance(func, ast.Attribute):
            value = func.value
            if isinstance(value, ast.Name) and value.id in ("self", "cls") and owner is not None:
                return member(owner, func.attr)
            if isinstance(value, ast.Name) and value.id in typed:  # `ctx.invoke()` for `ctx: Context`
                return member(typed[value.id], func.attr)
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
                return member(owner, func.attr, inherited_only=True) if owner is not None else None
            named = resolver.named_symbol(module, value)
            if named in classes:  # Class.method(...)
                return member(named, func.attr)
        # And a name a module assigns a callable (jinja2's `concat = "".join`, pytest's `skip = _Skip()`): an agent
        # tester's callers of jinja2.utils.concat were none.
        return resolver.named_symbol(module, func, values=True)

    def made_by(
        module: _Module,
        value: ast.expr,
        owner: str | None,
        typed: Mapping[str, str],
        own: frozenset[str],
        local: Collection[str],
    ) -> str | None:
        """The class of the tree a local's one binding makes (``value``: what it is assigned, or its annotation);
        ``local``: the names the function binds itself, which hide the module's (`def f(Client=Server)`: a
        review's false callers)."""
        awaited = isinstance(value, ast.Await)
        call = value.value if isinstance(value, ast.Await) else value
        if not isinstance(call, ast.Call):  # an annotation
            kind = _one_type(value)
            if kind is None or (isinstance(kind, ast.Name) and kind.id in own):
                return None
            named = resolver.named_symbol(module, kind)
            return named if named in classes else None
        written = _dotted(_unsubscripted(call.func))  # the callee as written; None for one computed (`f()()`)
        head = written.partition(".")[0] if written is not None else None
        if head is not None and head in local and head not in typed and head not in ("self", "cls"):
            return None
        target = callee(module, call.func, owner, typed)
        if target in classes and not awaited:
            return target
        made, is_async = returns.get(target or "", (None, False))
        return made if made is not None and is_async == awaited else None

    imported_once: dict[str, frozenset[str]] = {}

    def typed_locals(
        module: _Module, scope: ast.FunctionDef | ast.AsyncFunctionDef, around: _Around, owner: str | None
    ) -> _Around:
        """What calls in ``scope`` read of its locals: those known to hold an instance of one of the tree's classes
        (parameters annotated with one, and locals bound once to what a class's call makes or a function annotated
        to return one of the tree's returns, `ctx = get_current_context()`, `client = Client()`, or annotated so),
        and ``around``'s, the functions enclosing it (a closure's), where ``scope`` binds none of those names itself
        nor declares them global; and every name bound in it or around it, which hides the module's of that name
        (a review's `def outer(Builder): def inner(): b = Builder()` made b the module's Builder)."""
        otherwise = _bound_otherwise(scope)  # read once: the parameters' and the locals' checks
        shadowed = _local_names(scope)
        hidden = shadowed | otherwise | _declared_global(scope)
        typed = {name: kind for name, kind in around.typed.items() if name not in hidden}
        # Names the module's class of that name would be read for: its own class's (a nested class), and any bound
        # here or around it.
        own = (classes[owner].bound if owner in classes else frozenset()) | around.bound
        typed |= {
            name: named
            for name, annotation in _annotated_parameters(scope, otherwise).items()
            if not (isinstance(annotation, ast.Name) and annotation.id in own)
            and (named := resolver.named_symbol(module, annotation)) in classes
        }
        # A name imported inside resolves as the module's imports do, where that is this import (a tester's `from
        # .core import Builder` then `b = Builder()` had no Builder behind b): a name the module does not define nor
        # import elsewhere (a review's two functions importing two classes as T).
        if otherwise and module.path not in imported_once:
            imported_once[module.path] = _imported_once(module.tree)
        resolved = _imported_inside(scope) & imported_once[module.path] if otherwise else frozenset()
        bound_here = shadowed | (otherwise - (resolved - module.defs.keys()))
        local = bound_here | around.bound
        for name, value in _assigned_once(scope, otherwise).items():
            made = made_by(module, value, owner, typed, own, local)
            if made is not None:
                typed[name] = made
        # An import it resolves hides nothing from the functions in it either (a review's: a lazy import used in a
        # closure).
        return _Around(typed, frozenset(around.bound | (bound_here - _declared_global(scope))), around.depth + 1)

    def typed_of(
        module: _Module,
        scope: ast.FunctionDef | ast.AsyncFunctionDef,
        scope_of: Mapping[int, ast.FunctionDef | ast.AsyncFunctionDef],
        read: dict[int, _Around],
        owner: str | None,
    ) -> Mapping[str, str]:
        """The typed locals a call in ``scope`` reads (:func:`typed_locals`), each scope read once, from the
        outermost in; none in a function nested deeper than NESTED_TYPED_DEPTH in the chunk's (each level reads
        its whole body again: a review's 98 levels took 70 times as long)."""
        known = read.get(id(scope))
        if known is None:
            enclosing = scope_of[id(scope)]
            typed_of(module, enclosing, scope_of, read, owner)
            around = read[id(enclosing)]
            if around.depth > NESTED_TYPED_DEPTH:
                known = read[id(scope)] = _Around({}, around.bound, around.depth + 1)
            else:
                known = read[id(scope)] = typed_locals(module, scope, around, owner)
        return known.typed

    calls: dict[tuple[str, str, int], set[str]] = {}
    for module in modules.values():
        tick()  # before each module's calls are read
        for fqn, line, code, owner in _code_scopes(module):
            found = calls.setdefault((module.path, fqn, line), set())
            for node in code:
                function = node if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else None
                shadowed = _local_names(function) if function is not None else set()
                # A name the method's class defines (a nested class) is that one, not the module's (a review's).
                own = classes[owner].bound if owner in classes else frozenset()
                # A call in a function nested in this one reads that function's locals, and this one's it does not
                # bind again (a tester's `def wrap(): builder = _ClassBuilder(...); builder.build_class()` inside
                # attr's `attrs` called no method of _ClassBuilder).
                read: dict[int, _Around] = {}
                scope_of: dict[int, ast.FunctionDef | ast.AsyncFunctionDef] = {}
                if function is not None:
                    read[id(function)] = typed_locals(module, function, _Around({}, frozenset(), 0), owner)
                    scope_of = _innermost_functions(function)
                # Its decorators and defaults run where it is defined, outside it: its own locals do not hide what
                # they call (a review's).
                outside = {id(n) for root in _run_outside(function) for n in ast.walk(root)} if function else set()
                for call, self_class in _calls_in(node, owner):
                    inside = id(call) not in outside and id(call.func) not in outside
                    written = _unsubscripted(call.func)
                    if isinstance(written, ast.Name) and written.id in shadowed and inside:
                        continue  # a parameter or local variable, not the module's name
                    typed: Mapping[str, str] = {}
                    if inside and function is not None and isinstance(call.func, ast.Attribute):
                        # A bare `raise b.Error` is a call made here, of no node of the tree: where its class is.
                        scope = scope_of.get(id(call), scope_of.get(id(call.func), function))
                        typed = typed_of(module, scope, scope_of, read, owner)
                    target = callee(module, call.func, self_class, typed)
                    # Not through a local of the module's name (`def f(mod): mod.x()`).
                    if target is None and not (inside and (_dotted(call.func) or "").split(".")[0] in shadowed):
                        target = resolver.unbound(module, call.func)
                    if target is not None and target != fqn:
                        found.add(target)
    _walked.cache_clear()  # nothing of the tree kept past it
    return {key: tuple(sorted(found)) for key, found in calls.items() if found}


def _unsubscripted(func: ast.expr) -> ast.expr:
    """What a call is made of as written: ``Box`` of ``Box[int]()`` (a generic class made) and of ``Box[int][str]()``
    (a review's), else ``func``."""
    while isinstance(func, ast.Subscript):
        func = func.value
    return func


def _annotated_parameters(function: ast.FunctionDef | ast.AsyncFunctionDef, otherwise: set[str]) -> dict[str, ast.expr]:
    """Each parameter of ``function`` annotated with one type (``ctx: Context``, ``"Context"``,
    ``Optional[Context]``, ``Context | None``) that nothing inside the function binds again, with that type's
    expression: what a call through it (``ctx.invoke()``) calls. An agent tester's callers of click's
    ``Context.invoke`` missed ``Command.invoke`` and ``Group.invoke``, which call it through their ``ctx: Context``."""
    arguments = function.args
    rebound = _bound_inside(function, otherwise)
    typed = {}
    for argument in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]:
        annotation = _one_type(argument.annotation)
        if annotation is not None and argument.arg not in rebound and argument.arg not in ("self", "cls"):
            typed[argument.arg] = annotation
    return typed


def _assigned_once(function: ast.FunctionDef | ast.AsyncFunctionDef, otherwise: set[str]) -> dict[str, ast.expr]:
    """Each name bound once in ``function``'s own scope and nowhere else in it (no parameter of it, no binding in
    a function or class nested in it, no ``global`` or ``nonlocal``, no other kind of binding), by ``name =
    <call>`` (or ``name = await <call>``), or by ``name: T = ...``: the call, or the annotation. A review found
    a nested function's or class's store taken for the function's own."""
    arguments = function.args
    parameters = {a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]}
    parameters |= {a.arg for a in (arguments.vararg, arguments.kwarg) if a is not None}
    own = list(_own_scope(function))
    counts: dict[str, int] = {}
    for node in own:
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store | ast.Del):
            counts[node.id] = counts.get(node.id, 0) + 1
    declared = {
        name for node in _walked(function) if isinstance(node, ast.Global | ast.Nonlocal) for name in node.names
    }
    # Stored in a scope nested in it: every store not in its own (one walk: a walk per nested scope was quadratic
    # in the depth of nesting, a review's).
    own_ids = {id(node) for node in own}
    nested = {
        n.id for n in _walked(function)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store | ast.Del) and id(n) not in own_ids
    }  # fmt: skip
    once = {name for name, count in counts.items() if count == 1} - parameters - otherwise
    once -= nested | declared
    assigned: dict[str, ast.expr] = {}
    for node in own:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name, value = node.targets[0].id, node.value
            if name in once and isinstance(value.value if isinstance(value, ast.Await) else value, ast.Call):
                assigned[name] = value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in once:
            assigned[node.target.id] = node.annotation
    return assigned


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
"""What opens a scope of its own inside a function."""

TYPE_KEEPING_DECORATORS = frozenset(
    {"staticmethod", "classmethod", "functools.cache", "functools.lru_cache", "cache", "lru_cache", "override",
     "typing.override", "typing_extensions.override", "abstractmethod", "abc.abstractmethod"}
)  # fmt: skip
"""Decorators that leave what a call of the function returns as annotated."""


@functools.lru_cache(maxsize=64)
def _walked(function: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[ast.AST, ...]:
    """``ast.walk(function)``, kept for the functions read last: a function's calls read its nodes some eight
    times over (its locals, bindings, imports, globals), and walking them was half of reading a tree (sympy's
    calls took 66 s). Cleared when a tree's calls are read (:func:`python_calls`)."""
    return tuple(ast.walk(function))


def _own_scope(function: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[ast.AST]:
    """The nodes of ``function``'s body in its own scope: not inside a function, lambda or class nested in it."""
    pending: list[ast.AST] = list(function.body)
    while pending:
        node = pending.pop()
        yield node
        if not isinstance(node, _SCOPES):
            pending.extend(ast.iter_child_nodes(node))


def _bound_otherwise(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The names bound inside ``function`` other than by a name's store: ``except ... as``, imports, ``match``
    captures, nested definitions and their parameters."""
    bound: set[str] = set()
    for node in _walked(function):
        if isinstance(node, ast.ExceptHandler | ast.MatchAs | ast.MatchStar) and node.name:
            bound.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            bound.add(node.rest)
        elif isinstance(node, ast.alias):
            bound.add(node.asname or node.name.split(".")[0])
        elif isinstance(node, _DEFINITIONS) and node is not function:
            bound.add(node.name)
        elif isinstance(node, ast.arguments) and node is not function.args:
            every = [*node.posonlyargs, *node.args, *node.kwonlyargs, node.vararg, node.kwarg]
            bound |= {argument.arg for argument in every if argument is not None}
    return bound


@dataclass(frozen=True)
class _Around:
    """What a function nested in another reads of the functions around it (:func:`python_calls`)."""

    typed: dict[str, str]
    """Locals known to hold an instance of one of the tree's classes, by name."""
    bound: frozenset[str]
    """Every name the functions around it bind (it too, once read as one around another)."""
    depth: int
    """How deep it is in the chunk's function (that function: 1)."""


NESTED_TYPED_DEPTH = 3
"""How many levels deep in a chunk's function a nested function still has its typed locals read; calls in one
nested deeper read none (a missed caller, not a false one)."""


def _imported_once(tree: ast.Module) -> frozenset[str]:
    """The names one import alone binds in the whole module."""
    counts = Counter(node.asname or node.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.alias))
    return frozenset(name for name, count in counts.items() if count == 1)


def _imported_inside(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The names imports inside ``function`` bind."""
    return {node.asname or node.name.split(".")[0] for node in _walked(function) if isinstance(node, ast.alias)}


def _declared_global(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The names ``function`` (or a function nested in it) declares ``global``."""
    return {name for node in _walked(function) if isinstance(node, ast.Global) for name in node.names}


def _innermost_functions(
    function: ast.FunctionDef | ast.AsyncFunctionDef,
) -> dict[int, ast.FunctionDef | ast.AsyncFunctionDef]:
    """For each node inside ``function`` (by ``id``), the innermost function whose body holds it, ``function``
    itself or one nested in it (through classes too: a class's body is no scope its methods read). A nested
    function's decorators, parameters (their defaults) and return annotation are its enclosing function's: they
    run there. Iterative, as :func:`_calls_in`."""
    innermost: dict[int, ast.FunctionDef | ast.AsyncFunctionDef] = {}
    pending: list[tuple[ast.AST, ast.FunctionDef | ast.AsyncFunctionDef]] = [(n, function) for n in function.body]
    while pending:
        node, scope = pending.pop()
        innermost[id(node)] = scope
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            pending.extend((statement, node) for statement in node.body)
            outside = [*node.decorator_list, node.args, *([node.returns] if node.returns is not None else [])]
            pending.extend((part, scope) for part in outside)
        else:
            pending.extend((child, scope) for child in ast.iter_child_nodes(node))
    return innermost


def _bound_inside(function: ast.FunctionDef | ast.AsyncFunctionDef, otherwise: set[str]) -> set[str]:
    """The names anything inside ``function`` binds, its own parameters apart: assignments and ``otherwise``, what
    :func:`_bound_otherwise` read of it (a review's list of false callers)."""
    stored = {n.id for n in _walked(function) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store | ast.Del)}
    return stored | otherwise


def _one_type(annotation: ast.expr | None) -> ast.expr | None:
    """The one type an annotation names, if it names one (``X``, ``mod.X``, ``"X"``, ``Optional[X]``,
    ``X | None``); None for anything else (a union, a generic's parameters, a string that is no expression).
    Unwrapped in a loop: a review's `Context | None | None ...` 1,500 times deep stopped a whole ingest with a
    RecursionError, and a string holding a lone surrogate with a UnicodeEncodeError."""
    for _ in range(MAX_ANNOTATION_DEPTH):
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            if len(annotation.value) > 200:
                return None
            try:
                annotation = ast.parse(annotation.value.strip(), mode="eval").body
            except (SyntaxError, ValueError, RecursionError, MemoryError):
                return None
        elif isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
            sides = [annotation.left, annotation.right]
            kept = [side for side in sides if not (isinstance(side, ast.Constant) and side.value is None)]
            if len(kept) != 1:
                return None
            annotation = kept[0]
        elif isinstance(annotation, ast.Subscript):
            generic = _dotted(annotation.value)
            if generic is None or generic.rsplit(".", 1)[-1] != "Optional":
                return None
            annotation = annotation.slice
        else:
            return annotation if isinstance(annotation, ast.Name | ast.Attribute) else None
    return None


MAX_ANNOTATION_DEPTH = 8
"""How many ``Optional``, ``| None`` and quotes an annotation is unwrapped through before it names no one type."""


def _run_outside(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.expr]:
    """What a function's definition evaluates where it is defined: its decorators and its parameters' defaults."""
    arguments = function.args
    return [*function.decorator_list, *arguments.defaults, *(d for d in arguments.kw_defaults if d is not None)]


def applied(decorator: ast.expr) -> ast.expr:
    """A decorator as the call it makes: ``@fixture`` calls ``fixture`` with what it decorates (an agent tester's
    20 uses of pytest's bare ``@fixture`` were no callers of it, where ``@fixture(scope=...)`` was)."""
    return decorator if isinstance(decorator, ast.Call) else ast.Call(func=decorator, args=[], keywords=[])


def _calls_in(node: ast.AST, owner: str | None) -> Iterator[tuple[ast.Call, str | None]]:
    """The calls within ``node`` (itself included), decorators' too (:func:`applied`), and a bare ``raise E`` as
    ``E()``, each with the class ``self`` stands for there: none inside a class defined within the code (its
    methods' ``self`` is that class, which the tree does not name). Iterative, as ``ast.walk``: generated code
    nests expressions deeper than Python's recursion limit."""
    pending: list[tuple[ast.AST, str | None]] = [(node, owner)]
    while pending:
        current, self_class = pending.pop()
        if isinstance(current, ast.Call):
            yield current, self_class
        if isinstance(current, ast.Raise) and current.exc is not None and _class_named(current.exc):
            # ``raise E`` makes an E as ``raise E()`` does: what raises E calls it (an agent tester's
            # "what raises FrameTooLargeError" found none of its bare raises).
            yield ast.Call(func=current.exc, args=[], keywords=[]), self_class
        if isinstance(current, _DEFINITIONS):  # its decorators run where it is defined: the same ``self``
            pending.extend((applied(d), self_class) for d in current.decorator_list if not isinstance(d, ast.Call))
        inner = None if isinstance(current, ast.ClassDef) else self_class
        pending.extend((child, inner) for child in ast.iter_child_nodes(current))


def _class_named(expression: ast.expr) -> bool:
    """Whether a raise's expression names a class as Python names them (``TooLarge``, ``errors.Closed``): a
    constant holding an instance (``STOP``) or a function (``make``) is raised, not called (a review's)."""
    if isinstance(expression, ast.Name):
        name = expression.id
    elif isinstance(expression, ast.Attribute):
        name = expression.attr
    else:
        return False
    name = name.lstrip("_")  # a private class too (`_Abort`)
    return name[:1].isupper() and any(char.islower() for char in name)


def _local_names(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """Names a function binds itself (parameters, assignments, loop and ``with`` targets, nested definitions), so
    that a call of one of them is not taken for the module's symbol of that name; those it declares ``global`` are
    the module's. An import inside the function is not among them: what it imports resolves as the module's
    imports do."""
    arguments = function.args
    bound = {a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]}
    bound |= {a.arg for a in (arguments.vararg, arguments.kwarg) if a is not None}
    declared_global: set[str] = set()
    for node in _walked(function):
        if node is function:
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.Global):
            declared_global |= set(node.names)
    return bound - declared_global
