"""The ontology graph as the query worker holds it: main ⊕ branch, subtypes for objectType narrowing, and the
1-hop neighbourhood for graph expansion (pure; the rows come from Postgres).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ontofabric.contracts import MAIN_BRANCH
from ontofabric.shared.analysis import folded
from ontofabric.shared.lru import LruCache

from .cache import VersionKey, by_workspace, drop_stale, drop_workspace
from .names import last_part, match_quality, qualities_kept


@dataclass(frozen=True)
class NodeRow:
    branch: str
    object_type: str
    kind: str | None
    interfaces: tuple[str, ...]
    deleted: bool
    transparent: bool


@dataclass(frozen=True)
class LinkRow:
    branch: str
    source_type: str
    link_name: str
    target_type: str
    deleted: bool
    transparent: bool


@dataclass(frozen=True)
class GraphRows:
    nodes: list[NodeRow]
    links: list[LinkRow]
    version: str = ""
    """ontologyVersion of the snapshot the rows were read in."""
    whole_modules: frozenset[str] = frozenset()
    """The modules of the files the branch holds whole (its documents say so: ``metadata.wholeFile``, or the
    file deleted)."""


@dataclass(frozen=True)
class Neighbour:
    linked_type: str
    link_name: str
    direction: Literal["outgoing", "incoming"]


MAX_RESOLVED_TYPES = 64
"""The most bases a resolution order is worked out over; past it (a generated hierarchy's), nearest first: C3 over
901 types took a second of the event loop, and recursed past Python's limit down a chain of 499 (a review's)."""


@dataclass
class OntologyGraph:
    version: str = ""
    kinds: dict[str, str | None] = field(default_factory=dict)
    interfaces: dict[str, tuple[str, ...]] = field(default_factory=dict)
    links: set[tuple[str, str, str]] = field(default_factory=set)
    _subtypes: dict[str, set[str]] = field(default_factory=dict)
    _neighbours: dict[str, list[Neighbour]] = field(default_factory=dict)
    _by_last_part: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Every type a row names is known by name, a node's or not: a link's end and a base may name a type with no
        # node (one outside the tree, or one whose node was removed while links and bases still name it), and the
        # relations asked of it follow them as expansion and the objectType filter do.
        mentioned = {
            *self.kinds,
            *(base for bases in self.interfaces.values() for base in bases),
            *(end for source, _, target in self.links for end in (source, target)),
        }
        for object_type in sorted(mentioned):
            self._by_last_part.setdefault(folded(last_part(object_type)), []).append(object_type)
        for object_type, bases in self.interfaces.items():
            for base in bases:
                self._subtypes.setdefault(base, set()).add(object_type)
        for source, name, target in sorted(self.links):
            self._neighbours.setdefault(source, []).append(Neighbour(target, name, "outgoing"))
            self._neighbours.setdefault(target, []).append(Neighbour(source, name, "incoming"))

    def with_subtypes(self, object_type: str) -> set[str]:
        """The type and every type that implements or derives from it, transitively."""
        return {object_type, *(sub for level in self.subtypes(object_type) for sub in level)}

    def subtypes(self, object_type: str) -> list[list[str]]:
        """Every type that implements or derives from the type, transitively, by distance: those deriving from it
        directly, then from those, ...; each level by name."""
        return self._levels(object_type, self.derived)

    def derived(self, object_type: str) -> list[str]:
        """The types that implement or derive from the type directly, by name."""
        return sorted(self._subtypes.get(object_type, ()))

    def supertypes(self, object_type: str) -> list[list[str]]:
        """The types the type implements or derives from, transitively, by distance; each level by name: a base
        with no node of its own too (one outside the tree, or one whose node was removed), as :meth:`subtypes`
        counts the type among that base's (a tester's bases and subclasses disagreed once a base's node was
        removed)."""
        return self._levels(object_type, lambda current: self.interfaces.get(current, ()))

    def resolution_order(self, object_type: str) -> list[str]:
        """The type's bases in the order a member it does not define is looked for in them: C3 linearisation
        (Python's method resolution order) over each type's bases as listed, which puts a Java class's superclass
        chain before its interfaces and a Go type's embedded types before the interfaces it satisfies (an agent
        tester's ``Comment.Pos`` was taken for an interface's, the nearer by distance, where ``Comment`` had it
        through two embedded structs). Bases that admit no such order are read depth first, left to right; more
        than MAX_RESOLVED_TYPES bases, nearest first."""
        nearest = [base for level in self.supertypes(object_type) for base in level]
        if len(nearest) > MAX_RESOLVED_TYPES:
            return nearest
        orders: dict[str, list[str]] = {}
        entered: set[str] = set()

        def linear(current: str) -> list[str]:
            if current in orders:
                return orders[current]
            if current in entered:  # a cycle
                return [current]
            entered.add(current)
            bases = list(dict.fromkeys(self.interfaces.get(current, ())))
            pending = [linear(base) for base in bases] + [bases]
            order = [current]
            while pending := [sequence for sequence in pending if sequence]:
                head = next((s[0] for s in pending if not any(s[0] in other[1:] for other in pending)), None)
                if head is None:  # no consistent order: the rest depth first
                    order += [t for sequence in pending for t in sequence if t not in order]
                    break
                order.append(head)
                pending = [sequence[1:] if sequence[0] == head else sequence for sequence in pending]
            orders[current] = list(dict.fromkeys(order))
            return orders[current]

        return linear(object_type)[1:]

    def _levels(self, start: str, step: Callable[[str], Iterable[str]]) -> list[list[str]]:
        levels: list[list[str]] = []
        seen = {start}
        frontier = [start]
        while frontier:
            frontier = sorted({found for current in frontier for found in step(current) if found not in seen})
            seen.update(frontier)
            if frontier:
                levels.append(frontier)
        return levels

    def linked(self, object_type: str, link_name: str, direction: Literal["outgoing", "incoming"]) -> list[str]:
        """The types at the other end of the type's links of that name and direction, by name (``imports``
        incoming: the modules importing a module)."""
        return [
            n.linked_type for n in self.neighbours(object_type) if n.link_name == link_name and n.direction == direction
        ]

    def named(self, name: str) -> list[str]:
        """The types a dotted name names, as a query's identifier names symbols (``symbols.match_quality``): the
        type is the name or ends with ``.`` and it; ignoring case only when none matches as written. A type only a
        base or a link names is left out for a type with a node of its own that matches as well: "what subclasses
        Response" in a tree defining a Response is about that one, not about httpx.Response, which one of its
        classes derives from (an agent tester's answer listed that class as deriving from the symbol asked)."""
        matched = sorted(
            (quality, object_type)
            for object_type in self._by_last_part.get(folded(last_part(name)), ())
            if (quality := match_quality(object_type, name)) is not None
        )
        kept = qualities_kept(matched[0][0], name) if matched else range(0)
        named = [(q, t) for q, t in matched if q in kept]
        # An outside type goes only for an own type matching at least as well: asked as `logging`, the stdlib
        # module a link names still answers beside an own `pkg.logging` (a review's).
        own = min((q for q, t in named if t in self.kinds), default=None)
        return [t for q, t in named if t in self.kinds or own is None or q < own]

    def as_files_or_types(self, named: Sequence[str], files: bool) -> list[str]:
        """``named`` with a file and the type it is named after (Java's ``Order.java``: the module
        ``...model.Order`` and its class ``...model.Order.Order``) as one: the file where imports are asked
        (``import com.acme.model.Order`` names the class, and the graph links files), the type otherwise. An agent
        tester's importers of a Java class by its package name were none, and every question of a Java type said
        its name was two symbols."""
        chosen: list[str] = []
        for object_type in named:
            name = object_type.rpartition(".")[2]
            if (
                self.kinds.get(object_type) == "module"
                and self.kinds.get(f"{object_type}.{name}", "module") != "module"
            ):
                file, own = object_type, f"{object_type}.{name}"
            else:
                file = own = object_type
                # A type named as its file, or nested in one (`import ...model.Order.Builder`, a retest's): its
                # file's. A package's module of its name (app/app.py) is a module, and stays itself.
                if files and self.kinds.get(object_type, "module") != "module":
                    file = self._file_named_after(object_type) or object_type
            chosen.append(file if files else own)
        return list(dict.fromkeys(chosen))

    def _file_named_after(self, object_type: str) -> str | None:
        """The module of the file holding ``object_type`` when the type holding it at the file's level is named as
        the file is (Java's ``Order.java``, ``...model.Order.Order.Builder``); None otherwise."""
        parts = object_type.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            module = ".".join(parts[:cut])
            if self.kinds.get(module) == "module":
                return module if parts[cut] == parts[cut - 1] else None
        return None

    def neighbours(self, object_type: str) -> list[Neighbour]:
        """Types one link away, both directions, in a stable order."""
        return self._neighbours.get(object_type, [])


def overlay(rows: GraphRows, branch: str) -> OntologyGraph:
    """main ⊕ branch: the branch's rows replace main's with the same key; its tombstones remove them; its
    transparent rows (reverts) leave main's as they are. On main, only main's live rows count.

    A module of a file the branch holds whole (its documents say so: ``GraphRows.whole_modules``) that the branch
    has a row of its own for, live or a tombstone, is a file the branch changed (the ingester then sends every node
    and link of it: ``plan_ingest``) or deleted: main's rows of the types that module defines, and of the links
    from them, are hidden, so that main's later changes to that file do not show through (an outside tester's:
    main's later bases and imports did, and its removals took the branch's unchanged ones). Both are asked: a
    producer that sends a module's node alone, or a branch ingested before its ingester sent whole graphs (it has
    no row of such a module), overrides main's rows by key only (a review's)."""
    held: set[str] = set()
    modules: set[str] = set()
    if branch != MAIN_BRANCH and rows.whole_modules:
        modules = {n.object_type for n in rows.nodes if n.kind == "module"}
        mine = modules & rows.whole_modules
        held = {n.object_type for n in rows.nodes if n.branch == branch and not n.transparent and n.object_type in mine}

    def hidden(layer: str, object_type: str) -> bool:
        return layer == MAIN_BRANCH and bool(held) and defining_module(object_type, modules) in held

    nodes: dict[str, NodeRow] = {}
    links: dict[tuple[str, str, str], LinkRow] = {}
    for layer in (MAIN_BRANCH, branch) if branch != MAIN_BRANCH else (MAIN_BRANCH,):
        for node in (n for n in rows.nodes if n.branch == layer and not n.transparent):
            if hidden(layer, node.object_type):
                continue
            nodes.pop(node.object_type, None)
            if not node.deleted:
                nodes[node.object_type] = node
        for link in (k for k in rows.links if k.branch == layer and not k.transparent):
            if hidden(layer, link.source_type):
                continue
            key = (link.source_type, link.link_name, link.target_type)
            links.pop(key, None)
            if not link.deleted:
                links[key] = link
    return OntologyGraph(
        version=rows.version,
        kinds={t: n.kind for t, n in nodes.items()},
        interfaces={t: n.interfaces for t, n in nodes.items()},
        links=set(links),
    )


def defining_module(object_type: str, modules: Collection[str]) -> str | None:
    """The module defining a type: the type itself when it is one of ``modules``, else its longest dotted prefix
    that is (``pkg.mod.Outer.Inner`` -> ``pkg.mod``); None when no prefix is."""
    name = object_type
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


@dataclass(frozen=True)
class Expansion:
    linked_type: str
    link_name: str
    direction: Literal["outgoing", "incoming"]
    linked_from_type: str
    linked_from_document_id: str


def expand(graph: OntologyGraph, hits: Sequence[tuple[str, str]], limit: int | None = None) -> list[Expansion]:
    """One hop from the types of the top hits (document id, object type), in rank order, at most ``limit``.

    Each linked type appears once, from the best-ranked hit that reaches it; the hits' own types are not context.
    """
    own_types = {object_type for _, object_type in hits}
    seen: set[str] = set()
    expansions: list[Expansion] = []
    for document_id, object_type in hits:
        for neighbour in graph.neighbours(object_type):
            if neighbour.linked_type in own_types or neighbour.linked_type in seen:
                continue
            seen.add(neighbour.linked_type)
            expansions.append(
                Expansion(neighbour.linked_type, neighbour.link_name, neighbour.direction, object_type, document_id)
            )
            if limit is not None and len(expansions) >= limit:
                return expansions
    return expansions


class GraphCache:
    """Graphs per (workspace, branch, ontologyVersion), loaded once and kept for the next queries."""

    def __init__(self, load: Callable[[str, str], Awaitable[GraphRows]], max_graphs: int = 32) -> None:
        self._load = load
        self._graphs: LruCache[VersionKey, OntologyGraph] = LruCache(max_graphs, owner=by_workspace)

    async def get(self, workspace: str, branch: str, version: str, generation: int = 0) -> OntologyGraph:
        """The graph at ``version``, or, when it has moved on since, the newer one the load read (its
        ``version`` says which: the caller compares). ``generation``: the workspace's rebuilds seen so far."""
        graph = self._graphs.get(VersionKey(workspace, branch, version, generation))
        if graph is None:
            graph = overlay(await self._load(workspace, branch), branch)
            # Kept under the version it was read at, never under one it may not be.
            self._graphs.put(VersionKey(workspace, branch, graph.version, generation), graph)
        return graph

    def drop_workspace(self, workspace: str) -> int:
        return drop_workspace(self._graphs, workspace)

    def drop_stale(self, workspace: str, current: Callable[[str], str]) -> int:
        """Forget the workspace's graphs whose version is no longer the branch's current one."""
        return drop_stale(self._graphs, workspace, current)
