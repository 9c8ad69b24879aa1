"""The query side's core: the value types every stage passes along and the ports adapters implement.

Adapters (Postgres, Azure AI Search, the rerankers) import this module; it imports no adapter. A retriever is a
named part behind :class:`Retriever`; everything else the pipeline reads (documents, the dense score of given ids,
representatives, graph rows) comes from one :class:`DocumentStore`.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from ontofabric.contracts import MAIN_BRANCH
from ontofabric.shared.embedder import Vector
from ontofabric.shared.late_interaction import TokenMatrix

from .graph import GraphRows

DENSE, KEYWORD = "dense", "keyword"
"""The two retrievers adaptive fusion weighs against each other (and ``_meta.hybrid`` asks about)."""


@dataclass(frozen=True)
class Scope:
    """What a query may see: a workspace, main or a branch overlaid on it, and the request's filters."""

    workspace: str
    branch: str
    object_types: tuple[str, ...] | None = None
    """Restrict to these object types (a requested type and its subtypes); None: any."""
    chunk_level: str | None = None
    provenance: str | None = None
    symbol_kind: str | None = None
    paths: tuple[str, ...] | None = None
    """Restrict to files matching one of these patterns (contracts.path_patterns); None: any."""
    exclude_paths: tuple[str, ...] | None = None
    """Leave out files matching one of these patterns; None: none."""

    @property
    def on_main(self) -> bool:
        return self.branch == MAIN_BRANCH

    @property
    def branches(self) -> list[str]:
        """The branches whose rows the scope reads: main, and the branch overlaid on it."""
        return [MAIN_BRANCH] if self.on_main else [MAIN_BRANCH, self.branch]

    @property
    def filtered(self) -> bool:
        filters = (
            self.object_types,
            self.chunk_level,
            self.provenance,
            self.symbol_kind,
            self.paths,
            self.exclude_paths,
        )
        return any(f is not None for f in filters)

    @property
    def unfiltered(self) -> Scope:
        """The same workspace and branch without the request's filters (documents are fetched by id)."""
        return Scope(self.workspace, self.branch)


@dataclass(frozen=True)
class Candidate:
    """One hit of one retriever; its rank is its 1-based position in that retriever's list."""

    id: str
    score: float


@dataclass(frozen=True)
class Hits:
    """A retriever's ranked candidates and the ontologyVersion of the data it read (from
    :meth:`DocumentStore.similarities`: scores of the ids asked for, in no order)."""

    candidates: list[Candidate]
    version: str
    ceiling: float | None = None
    """The highest score a document could reach for this query (keyword: every query term some document has,
    saturated); None when the retriever cannot say."""
    query_ceiling: float | None = None
    """Keyword: the same over every query term, also those no document has."""
    coverage: Mapping[str, float] | None = None
    """Keyword, when the list holds every document of the scope's workspace and branches that holds a query term
    (no filter, nothing pruned, fewer hits than asked for) and those are few against the workspace (the query's
    terms are rare there): each hit's share of the query's term weight (idf times the query's repeats, over every
    query term), in [0, 1], whatever the document's length and counts. None otherwise, and from a backend that
    cannot say."""
    lagging: bool = False
    """The index searched had not yet taken in every delta of the version read (an index of its own, such as
    Azure AI Search): the answer says ``{name}IndexBehind``."""
    pruned: bool = False
    """Keyword: some query terms were looked up only for the leading candidates (``PostgresKeyword``), so a
    document holding only those terms may be missing and the ranking is not exact BM25."""
    embedding_model: str | None = None
    """Dense: the model whose vectors were compared, when not the query's own (the index had changed model, and the
    query was embedded again by the index's)."""


@dataclass(frozen=True)
class SearchInput:
    """What a retriever searches with."""

    text: str
    vector: Vector | None = None
    """The query's embedding; given to retrievers that declare ``needs_embedding``."""
    model: str | None = None
    """The model that made ``vector``: an index that holds another model's vectors refuses it."""


class ModelChanged(Exception):
    """The index's vectors are another embedding model's than the query's, and this worker has no such model."""


VectorBy = Callable[[str, str, str], Awaitable[Vector]]
"""(model, text, workspace) -> the text's vector by that model, embedded in the workspace's turn; ModelChanged when
this worker has no such model."""


async def vector_for_index(
    query: SearchInput, index_model: str | None, vector_by: VectorBy | None, workspace: str = ""
) -> Vector:
    """The query's vector to compare with an index of ``index_model``'s vectors: its own when the two models agree
    (or either is not known), else the query embedded again by the index's model: an index that changed model
    while the query was embedded, or one database of several that has swapped and another not. Two models'
    vectors are never compared."""
    assert query.vector is not None, "the pipeline embeds the query for retrievers that need it"
    if query.model is None or index_model is None or query.model == index_model:
        return query.vector
    if vector_by is None:
        raise ModelChanged(f"the index holds {index_model} vectors; the query was embedded by {query.model}")
    return await vector_by(index_model, query.text, workspace)


class Retriever(Protocol):
    """A named source of ranked candidates. Register one in ``retrievers.py``: the pipeline runs, fuses and
    reports every registered retriever by its name (``_meta.retrievers``, ``foundBy``, ``_meta.degraded``)."""

    name: str
    backend: str
    """Where it searches (``_meta.backend`` names the keyword retriever's)."""
    needs_embedding: bool

    async def search(self, scope: Scope, query: SearchInput, limit: int) -> Hits: ...


@dataclass(frozen=True)
class StoredDocument:
    id: str
    content: str
    object_type: str
    source_domain: str
    metadata: dict[str, Any]
    token_signs: bytes | None = None
    """Packed sign bits of its token vectors (shared/late_interaction.py), when it was sent with them."""
    second_vector: bytes | None = None
    """Its second model's vector (float16 bytes, shared/onnx_models.py), when asked for and of that model."""


@dataclass(frozen=True)
class Fetched:
    documents: dict[str, StoredDocument]
    version: str
    model: str | None = None
    """The embedding model of the index read (its token signs are that model's)."""


@dataclass(frozen=True)
class Representatives:
    documents: dict[str, str]
    """object type -> id of its representative document"""
    version: str | None
    """ontologyVersion of the snapshot read; None when nothing was asked."""


EXPANSION_LEVELS = ("type", "file", "method", "doc")
"""What represents a linked type in graph expansion: its class's chunk, else its module's file, else one of its
functions (a type an ingester chunks no other way), else a document about it (a producer's prose, of level `doc` or
none: a knowledge-base tester's types of `doc` chunks alone were said to have none indexed)."""
DEFINING_LEVELS = ("type", "file")
"""What stands for a type found by a relation (a subclass, an importer): the class's chunk, the module's file."""


NAMED_LISTED = 5
"""The most symbols a name a relation is asked of is said to name (``_meta.relation.symbolsNamed``)."""


@dataclass(frozen=True)
class Definitions:
    """Chunks a lookup found for the symbol a query names: its definitions, or the chunks standing in the relation
    the query asks about to it (its callers, callees, subclasses, bases, importers or imported modules)."""

    symbols: dict[str, str]
    """id -> symbolFqn of each chunk found"""
    version: str
    modules: frozenset[str] = frozenset()
    """Those of them that are a whole file (a module): after the classes and functions."""
    found_by: str = "symbol"
    """What they go by in ``foundBy``: symbol (definitions), or the relation (``symbols.RELATIONS``)."""
    distances: dict[str, int] = field(default_factory=dict)
    """id -> how far it stands from the named symbol where that varies (a subclass's subclass: 1); nearer first."""
    symbol_indexed: bool | None = None
    """For a relation's lookup: whether the name it was asked of is known (the graph names such a type, or a chunk
    defines such a symbol); None until told."""
    published_as: str | None = None
    """For a definitions lookup: the qualified name of the symbol a package publishes under the name asked
    (``click.core.Option`` for ``click.Option``), when one does."""
    module_named: str | None = None
    """For a definitions lookup: the module a Rust module's path in its crate names (``throttle.bucket`` for
    ``src/bucket/mod.rs``, ingest.code.rust_aliases), or a TypeScript or JavaScript directory does (``src.http``
    for ``src/http/index.ts``, ingest.code.index_aliases): what a question of its imports is asked of."""
    assigning: frozenset[str] = frozenset()
    """For a definitions lookup: those found as the chunk assigning the name (a module's constant, a class's
    attribute), which has no chunk of its own."""
    publishing: frozenset[str] = frozenset()
    """Those of ``assigning`` found as a module publishing the name for one it assigns (``pytest.skip``): assigned
    at the module's level, if under that name at all (``MARK_GEN as mark``: none)."""
    named: tuple[str, ...] = ()
    """For a relation's lookup: the symbols (or types) the name asked names, in order, at most
    :data:`NAMED_LISTED` + 1 (more than one: the answer stands in the relation to any of them)."""


class DocumentStore(Protocol):
    """The source of truth the retrievers' hits are read from. Each call reads one consistent snapshot and says
    which ontologyVersion it saw."""

    def session(self, scope: Scope) -> AbstractAsyncContextManager[None]:
        """A block whose reads of the scope's workspace and branch (this store's and the retrievers', in this task
        and the tasks it starts) share one snapshot where the store can: one answer, one state, fewer round
        trips. A store that cannot share reads each call alone."""
        ...

    async def fetch(
        self,
        scope: Scope,
        ids: Sequence[str],
        token_signs_of: Sequence[str] = (),
        second_vectors_of: Sequence[str] = (),
        second_model: str | None = None,
    ) -> Fetched:
        """The documents of ``ids`` that are live in the scope, with token signs for those in ``token_signs_of``
        and, for those in ``second_vectors_of``, their vector by ``second_model`` where they have one."""
        ...

    async def similarities(self, scope: Scope, query: SearchInput, ids: Sequence[str]) -> Hits:
        """The dense score (cosine similarity) of each of ``ids`` live in the scope to the query's vector, in no
        particular order."""
        ...

    async def representatives(
        self, scope: Scope, object_types: Sequence[str], levels: Sequence[str] = EXPANSION_LEVELS
    ) -> Representatives:
        """One document of the scope per object type: a chunk of the first of ``levels`` it has one of."""
        ...

    async def graph_rows(self, workspace: str, branch: str) -> GraphRows: ...

    async def listing(self, scope: Scope, limit: int, offset: int = 0) -> Hits:
        """``limit`` documents the scope selects, in a stable order (file, symbol, id), after the first ``offset``,
        each scoring 1."""
        ...

    async def definitions(self, scope: Scope, name: str, limit: int) -> Definitions:
        """At most ``limit`` chunks of the scope that define a symbol (code, not a docstring or a section) whose
        qualified name is the dotted ``name``, ends with ``.`` and it, or is it without private parts, ignoring
        case; those matching as written first, then classes and functions before modules, then shorter names.
        Also those assigning the name at their level (``metadata.defines``) and those whose symbol a package
        publishes under it (``metadata.aliases``), as written."""
        ...

    async def files(
        self, scope: Scope, path: str, limit: int, line: int | None = None, name: str | None = None
    ) -> Definitions:
        """At most ``limit`` chunks of the scope that are a file the ``path`` names, found by ``file``: a module's
        chunk (the whole file), or a document's sections in their order. The file stored under the path itself
        first, then under a path it ends with (a tree ingested from a directory inside the asker's: ``console.py``
        for ``rich/console.py``), the longer first, then one ending with it (``src/rich/console.py``), the
        shorter first. With a ``line`` or a function's ``name`` (a traceback's frame), one file's chunks: those of
        that name first, then those holding the line, the innermost first, then the file."""
        ...

    async def callers(self, scope: Scope, name: str, limit: int, named_on_main: bool = False) -> Definitions:
        """At most ``limit`` chunks of the scope whose ``metadata.calls`` names a symbol that ``name`` names (as
        :meth:`definitions` matches it, wherever in the workspace's branch it is defined; ``named_on_main``: on main
        alone instead, for a symbol a branch deleted or renamed), found by ``caller``; functions and
        methods before modules."""
        ...

    async def callees(self, scope: Scope, name: str, limit: int) -> Definitions:
        """At most ``limit`` chunks of the scope defining a class or function that the ``metadata.calls`` of a
        symbol ``name`` names (matched as for :meth:`callers`) name, found by ``callee``."""
        ...


@dataclass(frozen=True)
class Visible:
    rows: dict[tuple[str, str], str]
    """(id, branch) of the documents asked about that are live and visible in the scope, with the MD5 of the
    content the scope shows (shared/checksums.py)."""
    version: str
    stream_seqs: dict[str, int]
    """The highest stream sequence applied to each branch read."""


class Visibility(Protocol):
    """What an index kept outside the document store checks its hits against."""

    async def visible(self, scope: Scope, ids: Sequence[str]) -> Visible: ...

    async def shadowed(self, scope: Scope) -> tuple[list[str], str]:
        """Main's ids the scope's branch hides (none on main), and the version of the snapshot that says so."""
        ...


@dataclass(frozen=True)
class EmbeddedQuery:
    vector: Vector
    tokens: TokenMatrix
    """One vector per token, for late interaction."""
    model: str
    """The embedding model that made them."""


@dataclass(frozen=True)
class Pending:
    """Deltas published after the position an answer read."""

    deltas: int
    oldest_ms: float | None
    """How long ago the oldest of them was published; None when there are none."""


class FreshnessSource(Protocol):
    """How far the index is behind the delta stream."""

    async def position(self) -> int | None:
        """The stream sequence up to which every delta is in the index (or dead-lettered); None when it cannot
        be read. An answer that reads it before its first snapshot holds every delta up to it."""
        ...

    async def pending(self, workspace: str, branches: list[str], position: int) -> Pending | None:
        """The deltas of the workspace's branches published past ``position``; None when that cannot be told."""
        ...

    def stream_refused(self, workspace: str) -> bool:
        """Whether the projector of the workspace's index refuses the delta stream (not the one the index read):
        nothing new reaches the workspace's answers until an operator adopts the stream."""
        ...


class VersionSource(Protocol):
    def current(self, workspace: str, branch: str) -> str: ...

    def generation(self, workspace: str) -> int: ...


class RerankerError(Exception):
    """The reranker answered with an error or with something that is not a ranking."""


class Reranker(Protocol):
    name: str

    async def rerank(self, query: str, documents: Sequence[str], top_n: int) -> list[tuple[int, float]]:
        """(index into ``documents``, relevance in [0, 1]) for the best ``top_n``, best first, no index twice.
        ``documents`` arrive in the fused order, best first."""
        ...

    async def close(self) -> None: ...


def check_ranking(ranking: Sequence[tuple[int, float]], documents: int) -> list[tuple[int, float]]:
    """The reranker port's promise, enforced whatever the adapter: every document sent ranked (the pipeline asks
    for all of them), each index into the documents once, every relevance a number in [0, 1], best first. Anything
    else is a failed call: a ranking of some documents says nothing of where the others belong, and one moved to
    the top past those it was never compared with is no reranked answer."""
    if documents and not ranking:
        raise RerankerError("the reranker ranked none of the documents")
    indexes = [i for i, _ in ranking]
    if any(not 0 <= i < documents for i in indexes) or len(set(indexes)) != len(indexes):
        raise RerankerError("the reranker returned indexes outside the documents sent, or repeated ones")
    if any(not (math.isfinite(score) and 0.0 <= score <= 1.0) for _, score in ranking):
        raise RerankerError("the reranker returned a relevance that is not a number in [0, 1]")
    if len(ranking) != documents:
        raise RerankerError(f"the reranker ranked {len(ranking)} of the {documents} documents sent")
    return sorted(ranking, key=lambda pair: -pair[1])
