"""The ``ontology_query`` request-reply contract: the request, the ranked response with ``_meta``, the error."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, Self

from pydantic import AfterValidator, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict
from pydantic_core import ErrorDetails, InitErrorDetails, PydanticCustomError

from ._base import StrictRequest, WireModel
from .documents import (
    MAIN_BRANCH,
    OBJECT_TYPE_PATTERN,
    STREAM_REFUSED,
    Branch,
    ChunkLevel,
    ObjectType,
    Provenance,
    SymbolKind,
    Workspace,
)
from .identifiers import as_python_reads, hyphenated_name
from .path_patterns import normal_pattern, pattern_problem

MAX_TOP_K = 100
MAX_PATH_PATTERNS = 20
"""Patterns in paths, and in excludePaths, at most."""
MAX_PATH_PATTERN_CHARS = 512
PATH_PATTERN_SCHEMA: JsonDict = {"items": {"type": "string", "minLength": 1, "maxLength": MAX_PATH_PATTERN_CHARS}}
"""What the schema says of each pattern: an empty one was valid by it and refused (a contract tester's)."""


def _path_pattern(written: str) -> str:
    """A pattern as it is matched (path_patterns.normal_pattern): one that can name no file of a tree (empty, `.`,
    absolute, leading out of it) is refused, not read as matching nothing, and so is one .gitignore would read
    otherwise (path_patterns.pattern_problem). Checked each on its own, so that an error names the pattern by
    its place in the list (`paths.3`: a contract tester's 20 patterns were all `paths`)."""
    if len(written) > MAX_PATH_PATTERN_CHARS:
        raise ValueError(f"a pattern takes at most {MAX_PATH_PATTERN_CHARS} characters")
    if "\x00" in written:  # no path holds one, and PostgreSQL refused the whole statement for it (a review's)
        raise ValueError("a pattern may not hold NUL")
    problem = pattern_problem(written)
    if problem is not None:
        raise ValueError(problem)
    pattern = normal_pattern(written)
    if pattern is None:
        raise ValueError(f"{written!r} names no path inside a tree: write one from its root (services/query)")
    return pattern


PathPattern = Annotated[str, AfterValidator(_path_pattern)]


def _as_object_types_are_written(asked: str) -> str:
    """An object type asked for in the form object types are written in (:func:`as_python_reads`: a retest's filter
    typed with a decomposed accent found nothing), where that form is one (a review's ``notes⑴`` became
    ``notes(1)``, which the worker then refused): else as asked."""
    read = as_python_reads(asked)
    return read if read == asked or OBJECT_TYPE_PATTERN.fullmatch(read) else asked


MAX_LINK_DEPTH = 1
RELATIONS_READ = MAX_TOP_K
"""At most this many chunks a lookup of a name's definitions or relation reads (a common name may have hundreds):
as many as the largest topK shows (a graph tester's 200 importers stopped at 50 with topK 100)."""
MAX_TOKENS_LIMIT = 250_000
MAX_LISTING_OFFSET = 1_000_000
"""The furthest a listing reads on (``offset``): past it, narrow the filters."""
MIN_MAX_TOKENS = 1_000
"""The smallest budget a request may ask for: room for ``_meta`` and a few results without their contents."""


DistanceMetric = Literal["cosine", "innerProduct", "l2"]
Retriever = Literal["dense", "keyword"]
"""The retrievers a request may choose. Replies name retrievers as text: a deployment may register more."""
FusionMethod = Literal["rrf", "convex", "adaptive"]


def field_refused(model: object, field: str, kind: str, message: str, value: object) -> ValidationError:
    """A model validator's refusal as ``field``'s own error, so that the caller is told which field to change."""
    problem = PydanticCustomError(kind, message)
    return ValidationError.from_exception_data(
        type(model).__name__, [InitErrorDetails(type=problem, loc=(field,), input=value)]
    )


class FusionOptions(StrictRequest):
    """How the ranked lists are combined; every field left out takes the deployment's default."""

    method: FusionMethod | None = Field(
        default=None,
        description="rrf: reciprocal rank fusion; convex: weighted sum of min-max normalised scores with a fixed "
        "dense weight; adaptive: convex with the weight set per query from how far the keyword list's top hit "
        "stands out, lowered where the dense list's top cosine says it found nothing near.",
    )
    rrf_k: int | None = Field(
        default=None, ge=1, le=1000,
        description="RRF constant k: rrf, and adaptive where it falls back to rrf (lists other than dense and "
        "keyword); refused with method convex.",
    )  # fmt: skip
    dense_weight: float | None = Field(
        default=None, ge=0.0, le=1.0,
        description="convex: weight of dense scores; refused with method rrf or adaptive (which sets its own).",
    )  # fmt: skip

    @model_validator(mode="after")
    def _parameters_of_the_method_asked(self) -> Self:
        """A parameter of another method than the one asked for would be ignored in silence (an independent
        tester's finding): refused, naming it."""
        # Each named as its own field, not as the fusion object (a contract tester's).
        if self.method == "convex" and self.rrf_k is not None:
            message = "rrfK applies to method rrf (and adaptive's fall-back to it), not convex"
            raise field_refused(self, "rrfK", "parameter_of_another_method", message, self.rrf_k)
        if self.method in ("rrf", "adaptive") and self.dense_weight is not None:
            message = f"denseWeight applies to method convex, not {self.method}"
            raise field_refused(self, "denseWeight", "parameter_of_another_method", message, self.dense_weight)
        return self


class LateInteractionOptions(StrictRequest):
    """Late interaction over the candidates' stored token vectors; every field left out takes the default."""

    weight: float | None = Field(
        default=None, ge=0.0, le=1.0,
        description="Share of the MaxSim similarity against the fused order; 0 turns late interaction off.",
    )  # fmt: skip
    depth: int | None = Field(default=None, ge=2, le=200, description="Leading candidates it reorders.")


class SecondOpinionOptions(StrictRequest):
    """The second embedding model's opinion over the candidates' stored second vectors; every field left out
    takes the default."""

    weight: float | None = Field(
        default=None, ge=0.0, le=10.0,
        description="The second model's weight against the order it is given (1); 0 turns the second opinion off.",
    )  # fmt: skip
    depth: int | None = Field(default=None, ge=2, le=200, description="Leading candidates it reorders.")


def _unique_when_given(schema: JsonDict) -> None:
    """uniqueItems on the list's own branch, beside its type: beside anyOf, ajv's strict types refused it."""
    branches = schema.get("anyOf")
    for branch in branches if isinstance(branches, list) else []:
        if isinstance(branch, dict) and branch.get("type") == "array":
            branch["uniqueItems"] = True


class QueryOptions(StrictRequest):
    retrievers: list[Retriever] | None = Field(
        default=None,
        min_length=1,
        max_length=2,
        description="Retrievers to run; default both.",
        json_schema_extra=_unique_when_given,
    )
    candidates: int | None = Field(
        default=None, ge=1, le=1000, description="Candidates per retriever; fewer than topK are read as topK."
    )
    fusion: FusionOptions | None = None
    late_interaction: LateInteractionOptions | None = None
    second_opinion: SecondOpinionOptions | None = Field(
        default=None,
        description="Where the deployment stores second vectors (a second embedding model's), their opinion "
        "reorders the leading candidates after late interaction (_meta.secondOpinion).",
    )
    collapse_nested: bool | None = Field(
        default=None,
        description="Leave out a chunk whose text is inside a better-ranked result's, or holds it, for the same "
        "symbol (a file and its classes, a class and its methods, a function and its docstring), so that one "
        "symbol takes one place; false returns every chunk. Default: the deployment's (true).",
    )
    exact_symbols: bool | None = Field(
        default=None,
        description="When the query is one identifier (Retrying, tenacity.retry.Retrying, Retrying.__call__), put"
        " the chunks defining a symbol of that name (its symbolFqn, or the symbolFqn's last parts, or the "
        "symbolFqn without its private parts as a package re-exports it: httpx.Client for httpx._client.Client; "
        "case ignored after exact matches), or assigning it at their level (metadata.defines: a module's "
        "constant, a class's attribute, matched as written) first, each scoring 1 and found by 'symbol'. When the"
        " query is a file's path (pkg/util.py, docs/guide.md), that file's chunk or sections first, found by "
        "'file'; with a line (pkg/util.py:120) or as a traceback's frame, the chunks holding it. When the query "
        "pastes an exception's or a logged line (ValueError: ..., the last line of a traceback, INFO: ...), the "
        "code among the retrievers' leading candidates whose string literals write that message, its fields "
        "filled in as the run did, first, found by 'message'. When the"
        " query asks one relation of one named symbol, put the chunks standing in it first, each scoring 1: its "
        "callers (what calls to_seconds, callers of Retrying.copy: the chunks whose metadata.calls names it) as "
        "'caller', what it calls (what does wraps call) as 'callee'; its subclasses (what subclasses wait_base: "
        "through the graph's interfaces, the nearest first) as 'subclass', its bases (what does Retrying inherit "
        "from) as 'base'; its importers (what imports tenacity._utils: the graph's imports links) as 'importer', "
        "what it imports (what does tenacity.wait import) as 'imported'; a type by its class chunk, else its "
        "file. Default: the deployment's (true).",
    )

    @field_validator("retrievers")
    @classmethod
    def _distinct(cls, value: list[Retriever] | None) -> list[Retriever] | None:
        if value is not None and len(set(value)) != len(value):
            raise ValueError("retrievers must not repeat")
        return value


FILTERS = ("object_type", "chunk_level", "provenance", "symbol_kind", "paths", "exclude_paths")
"""Request fields that restrict what a query may see; with one of them, semanticQuery may be left out."""


_DEFAULT_IGNORABLE = (
    (0x00AD, 0x00AD), (0x034F, 0x034F), (0x061C, 0x061C), (0x115F, 0x1160), (0x17B4, 0x17B5), (0x180B, 0x180F),
    (0x200B, 0x200F), (0x202A, 0x202E), (0x2060, 0x206F), (0x3164, 0x3164), (0xFE00, 0xFE0F), (0xFEFF, 0xFEFF),
    (0xFFA0, 0xFFA0), (0xFFF0, 0xFFF8), (0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A), (0xE0000, 0xE0FFF),
)  # fmt: skip
"""Unicode's Default_Ignorable_Code_Point (DerivedCoreProperties.txt): what a renderer shows nothing of, the zero-width
space, direction marks, joiners, variation selectors and the Hangul fillers among them."""


SHOWS_NOTHING = re.compile("[\\s" + "".join(f"\\U{a:08x}-\\U{b:08x}" for a, b in _DEFAULT_IGNORABLE) + "]*")
"""Text of whitespace (as str.isspace reads it) and characters shown as nothing (:data:`_DEFAULT_IGNORABLE`) alone,
by ``fullmatch``: one pass, where a test of each character against each range took 17 ms over a 63 kB body, read
before the worker judges its load (a review's)."""


def _pattern_class(code_points: list[int]) -> str:
    """Code points as the inside of a JSON Schema pattern's character class, runs written as ranges."""
    runs: list[list[int]] = []
    for point in code_points:
        if runs and point == runs[-1][1] + 1:
            runs[-1][1] = point
        else:
            runs.append([point, point])
    return "".join(f"\\u{a:04x}" if a == b else f"\\u{a:04x}-\\u{b:04x}" for a, b in runs)


_BLANK = _pattern_class(
    sorted(
        {point for point in range(0x3001) if chr(point).isspace()}  # none above U+3000
        | {point for first, last in _DEFAULT_IGNORABLE if last < 0x10000 for point in range(first, last + 1)}
    )
)
"""What shows nothing within the Basic Multilingual Plane (the sets :func:`_shows_nothing` reads, enumerated rather
than each of 65,536 characters tested at import), as a pattern's character class (the few ignorable
characters above it are refused by the validator alone: a pattern cannot name them the same way in every regular
expression dialect)."""


def _query_or_filter_schema(schema: dict[str, Any]) -> None:
    """The rule of ``_query_or_filter`` said in the schema too: one of these is required, and not null (a null
    one is as good as left out); and what ``_has_text`` refuses in semanticQuery (a conformance tester's: all
    three were valid by the schema and refused)."""
    schema["anyOf"] = [
        {"required": [key], "properties": {key: {"not": {"type": "null"}}}}
        for key in map(to_camel, ("semantic_query", "related_to", *FILTERS))
    ]
    text = next(option for option in schema["properties"]["semanticQuery"]["anyOf"] if option.get("type") == "string")
    # Some text that shows, and no NUL: whitespace spelt out as str.isspace() reads it (JSON Schema's regular
    # expressions are ECMA-262's, whose \\s is another set), and what shows nothing apart from the first other
    # character, so that no string makes the match backtrack (a review's findings).
    text["pattern"] = f"^[{_BLANK}]*[^{_BLANK}\\u0000][^\\u0000]*$"


Relation = Literal["callers", "callees", "subclasses", "bases", "importers", "imports"]
MAX_SYMBOL_CHARS = 300
_IDENTIFIER = (
    r"([A-Za-z_]|\$(?![0-9])|[^\x00-\x7F])([A-Za-z0-9_]|\$(?![0-9])|[^\x00-\x7F])*(-([A-Za-z0-9_]|[^\x00-\x7F])+)*"
)
"""An identifier, or words joined by hyphens as a file's module is named (``auth-extensions``)."""


class RelatedTo(StrictRequest):
    """A relation of one symbol, asked for by structure rather than in words."""

    relation: Relation = Field(
        description="callers: the chunks whose code calls the symbol; callees: what its code calls; subclasses: the "
        "types deriving from it (the nearest first); bases: the types it derives from; importers: the modules "
        "importing it; imports: the modules it imports. Calls are read from the source's syntax: a call by a name "
        "the module defines or imports, through a module, a class, self, cls or super(); one through a parameter, "
        "an attribute or what another call returned is not found, so an empty answer is no proof that nothing "
        "calls the symbol."
    )
    symbol: str = Field(
        min_length=1,
        max_length=MAX_SYMBOL_CHARS,
        # Identifiers in any script, as Python reads them (a tenant tester's "café" was refused, asked in words it
        # was found): JSON Schema's patterns have no Unicode classes without a flag, so this one lets any character
        # past ASCII through and the check below reads them. Stated in the schema only: the check below says what
        # is wrong in words, where the pattern's refusal quoted the pattern (an agent tester's path, cut short).
        json_schema_extra={"pattern": rf"^{_IDENTIFIER}(\.{_IDENTIFIER})*$"},
        description="The symbol's name or dotted qualified name (to_seconds, tenacity.wait.wait_base), matched as "
        "a query that is one identifier matches definitions.",
    )

    @field_validator("symbol")
    @classmethod
    def _identifiers(cls, symbol: str) -> str:
        named = unicodedata.normalize("NFKC", symbol)  # as Python reads an identifier, and as words asking it are
        # A part may join words by hyphens: the module of a file named so (client.auth-extensions, an agent tester's,
        # could not be asked; lib.rfc-2616, a review's, was valid by the schema and refused here).
        if not hyphenated_name().fullmatch(named):
            path = "/" in named or "\\" in named
            raise ValueError(
                "a name, or names joined by dots, as Python reads identifiers (or joined by hyphens)"
                + (": a file is asked by its module's name, its path joined by dots (src/clock.rs is src.clock)"
                   if path else "")
            )  # fmt: skip
        if len(named) > MAX_SYMBOL_CHARS:  # NFKC may lengthen it: 'ﬃ' is 'ffi' (a review's)
            raise ValueError(f"at most {MAX_SYMBOL_CHARS} characters as Python reads them")
        return named


class OntologyQuery(StrictRequest):
    """One query. Unknown parameters, wrongly typed values and out-of-range values are rejected."""

    model_config = ConfigDict(**StrictRequest.model_config, json_schema_extra=_query_or_filter_schema)

    semantic_query: str | None = Field(
        default=None,
        min_length=1,
        description="Natural-language or keyword query, of at most the deployment's ONTOFABRIC_MAX_QUERY_CHARS "
        "characters (2,000 unless set; a longer one is refused, naming this field) and within the 64 KiB a whole "
        "request may take as JSON. Left out, the answer lists the documents the filters (objectType, chunkLevel, "
        "provenance, symbolKind, paths, excludePaths) select, in a stable order (file, symbol, id).",
    )
    object_type: Annotated[ObjectType, AfterValidator(_as_object_types_are_written)] | None = Field(
        default=None,
        description="Restrict results to this object type and the types that implement or derive from it; read as "
        "object types are written, in Unicode's NFKC form (a decomposed accent composed: a retest's filter typed "
        "so found nothing).",
    )
    top_k: int = Field(default=10, ge=1, le=MAX_TOP_K, description="Number of results, 1-100.")
    offset: int = Field(
        default=0,
        ge=0,
        le=MAX_LISTING_OFFSET,
        description="A listing's (no semanticQuery, no relatedTo) results to skip, in its stable order: the next "
        "page starts at offset plus the results listed. A ranked answer takes none.",
    )
    min_relevance: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="Drop results whose score (0-1) is below this value. With calibrated scores (the default, "
        "_meta.calibrated) it is a probability of relevance: 0.5 keeps what is more likely relevant than not.",
    )
    precision: bool = Field(default=True, description="Rerank the fused candidates when a reranker is set up.")
    include_content: bool = Field(
        default=True,
        description="false: results carry no content (null), only ids, scores and metadata; for callers that "
        "rank or judge by id, and so that a deep answer over long documents fits in one message.",
    )
    max_tokens: int | None = Field(
        default=None,
        ge=MIN_MAX_TOKENS,
        le=MAX_TOKENS_LIMIT,
        description="Size budget of the reply, in tokens (estimated at 4 bytes of JSON each). Contents past it are "
        "cut or left out, lowest ranks first, and _meta.budget says which; the rest of get_document's content can be "
        "fetched by id. Default: the deployment's (8,000).",
    )
    follow_links: bool = Field(default=False, description="Attach 1-hop linked types as context.")
    link_depth: int = Field(default=1, ge=1, le=MAX_LINK_DEPTH, description="Graph expansion depth; only 1.")
    chunk_level: ChunkLevel | None = Field(default=None, description="Restrict results to this chunk level.")
    provenance: Provenance | None = Field(default=None, description="Restrict results to this provenance.")
    symbol_kind: SymbolKind | None = Field(
        default=None, description="Restrict results to this kind of symbol, e.g. class, function, method, docstring."
    )
    paths: list[PathPattern] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_PATH_PATTERNS,
        json_schema_extra=PATH_PATTERN_SCHEMA,
        description="Restrict results to files matching one of these patterns, read as .gitignore (and ingest "
        "--exclude) reads one: without `/` a file or directory name at any depth (`tests`, `*_test.py`), with `/` a "
        "path from the tree's root (`services/query`, `docs/*.md`), a `**` directory none or any (`docs/**/*.md`); a "
        "directory's files with it; a leading `!` (a negation there) is refused. Documents of no "
        "file are left out. With Azure AI Search as the keyword backend (_meta.backend) its hits are filtered after "
        "its search, so a narrow pattern over a large workspace may leave keyword search few.",
    )
    exclude_paths: list[PathPattern] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_PATH_PATTERNS,
        json_schema_extra=PATH_PATTERN_SCHEMA,
        description="Leave out results of files matching one of these patterns, read as paths reads them "
        "(`tests`, `test_*.py`: the implementation without its tests).",
    )
    distance_metric: DistanceMetric = Field(
        default="cosine",
        description="Vector distance for dense search. The index ranks by cosine distance; for unit-length vectors, "
        "which the embedder produces, innerProduct and l2 give the same order, and _meta.distanceMetric says what ran.",
    )
    branch: Branch = Field(default=MAIN_BRANCH, description="Branch to read: main, or main overlaid with the branch.")
    workspace: Workspace | None = Field(
        default=None, description="Defaults to the workspace of the subject the request was sent to."
    )
    options: QueryOptions | None = Field(default=None, description="Retrieval and fusion tuning.")
    related_to: RelatedTo | None = Field(
        default=None,
        description="Put the chunks standing in this relation to the symbol first, each scoring 1, found by the "
        "relation (caller, callee, subclass, base, importer, imported; _meta.relationMatches), whatever "
        "options.exactSymbols says; the rest of the answer is ranked for semanticQuery, or, without it, for the "
        "symbol's name. The same as asking it in words (what calls to_seconds), without depending on the wording.",
    )

    @field_validator("semantic_query")
    @classmethod
    def _has_text(cls, value: str | None) -> str | None:
        if value is not None and SHOWS_NOTHING.fullmatch(value):
            # Ignorable characters as whitespace: a query of a zero-width space and two marks was answered, dense
            # alone, with whatever lay nearest (an outside tester's).
            raise ValueError("semanticQuery must contain text that shows: not only whitespace or invisible marks")
        if value is not None and "\x00" in value:
            raise ValueError("semanticQuery must not contain NUL characters")
        return value

    @model_validator(mode="after")
    def _query_or_filter(self) -> OntologyQuery:
        if self.semantic_query is None and self.related_to is None and all(getattr(self, n) is None for n in FILTERS):
            filters = ", ".join(map(to_camel, FILTERS))
            message = f"semanticQuery is required unless relatedTo or a filter ({filters}) is given"
            raise field_refused(self, "semanticQuery", "missing", message, None)
        if self.offset and not self.listing:
            # A ranked answer is made anew for each request and its order is no page's (an agent tester's listing
            # of 300 methods could not be read past topK 100).
            message = "offset reads on through a listing (no semanticQuery, no relatedTo); a ranked answer takes none"
            raise field_refused(self, "offset", "offset_with_query", message, self.offset)
        return self

    @property
    def listing(self) -> bool:
        """No query text and no relation: the answer lists what the filters select."""
        return self.semantic_query is None and self.related_to is None

    @property
    def search_text(self) -> str | None:
        """What the retrievers search for: the query text, else the name of the symbol a relation is asked of."""
        return self.semantic_query or (self.related_to.symbol if self.related_to is not None else None)


class FoundBy(WireModel):
    """Which retriever found a hit, at which rank (1-based) and with which raw score."""

    retriever: str = Field(
        description="The retriever's name: dense, keyword, or another the deployment runs; symbol for a result "
        "whose symbolFqn the query named (_meta.exactSymbolMatches); file for a chunk of the file whose path the "
        "query is (a module's chunk, a document's sections; with a line, or as a traceback's frame, the chunks "
        "holding it; _meta.exactSymbolMatches too); message for code whose string literals write the error or log "
        "message the query pastes (_meta.exactSymbolMatches too); caller, callee, "
        "subclass, base, importer or imported for a result standing in the relation the query asked about to the "
        "symbol it named "
        "(_meta.relationMatches)."
    )
    rank: int
    score: float


class SearchResult(WireModel):
    id: str
    score: float = Field(
        description="When _meta.calibrated: the estimated probability that the result is relevant, on one scale "
        "whatever retrievers ran (Platt scaling over its signals and its place among the ranked results, before "
        "minRelevance drops any, fitted on judged queries; "
        "docs/quality.md), 1 for a definition or a file the query names (foundBy symbol, file); minRelevance is "
        "then a threshold on it. Each result's own: it follows the order, but a result whose signals are much "
        "stronger than those "
        "of one ranked before it may score higher. "
        "Otherwise (a listing; no signal to judge by; an index of another embedding model than the fit's; "
        "calibration turned off by the deployment) a relative relevance in [0, 1]: the reranker's, late "
        "interaction's blend, or the fused one."
    )
    rank: int
    content: str | None = Field(
        description="The document's text; null when the request set includeContent false, or when the reply's "
        "budget left no room for it (then contentLength is set)."
    )
    content_truncated: bool = Field(default=False, description="The content is the start of the text only.")
    content_length: int | None = Field(
        default=None,
        description="The whole text's length in characters (Unicode code points), when content is cut or left out.",
    )
    object_type: str
    source_domain: str
    metadata: dict[str, Any]
    found_by: list[FoundBy]
    assigned_at_line: int | None = Field(
        default=None,
        exclude_if=lambda line: line is None,  # sent only where it says something: every result's bytes count
        description="For a result found by symbol as the chunk assigning the name asked (a module's constant, a "
        "class's attribute: no chunk of their own): the line of its file where the name is assigned, when the "
        "text shows it (get_document's sliceLines reads around it; a long module's content may be cut before it).",
    )
    signals: dict[str, float] = Field(
        default_factory=dict,
        description="What the score was estimated from, those measured: cosine (the dense similarity to the query) "
        "and keyword (its BM25 score over the best the query could reach, 0 to 1; in a keyword list of fewer than "
        "ten hits whose terms are rare, as for _meta.signals.keywordCoverage, the share of the query's term weight "
        "it holds times its score over the top hit's, where that is more). A function's code that took its "
        "docstring's place (the docstring folded into it) shows its docstring's where those scored higher.",
    )


class ExpandedContext(WireModel):
    """A type one link away from a top hit's type, with one document that represents it (context, not ranked)."""

    linked_type: str
    link_name: str
    direction: Literal["outgoing", "incoming"] = Field(
        description="outgoing: the hit's type links to linkedType (it uses it); incoming: linkedType links to it."
    )
    linked_from_type: str
    linked_from_document_id: str
    representative_document_id: str | None = Field(
        description=(
            "A type-level chunk of linkedType, else a file-level one (a module's), else a method-level one, else "
            "any other (doc-level or of no level); null when none is indexed."
        )
    )


class RelationAsked(WireModel):
    """The relation of one symbol a request asked about, and whether the workspace knows the symbol."""

    relation: Relation = Field(description="In relatedTo's words, whether asked by relatedTo or in the query's.")
    symbol: str
    symbol_indexed: bool = Field(
        description="False when neither a chunk of the workspace and branch defines a symbol of this name nor "
        "its ontology graph names a type so (a node, a base, a link's end): the answer then says nothing of the "
        "relation (check the name)."
    )
    symbols_named: list[str] | None = Field(
        default=None,
        exclude_if=lambda named: named is None,  # sent only when it says something, as its description says
        description="Sent when the name names more than one symbol (or type): their qualified names, at most five. "
        "The answer then holds what stands in the relation to any of them; a qualified name asks for one.",
    )
    more_symbols_named: bool | None = Field(
        default=None,
        exclude_if=lambda more: more is None,
        description="Sent (true) when the name names more symbols than symbolsNamed lists.",
    )
    defined_on_main: bool | None = Field(
        default=None,
        exclude_if=lambda defined: defined is None,
        description="Sent (true) on a branch when symbolIndexed is false and main defines a symbol of this name: "
        "the branch deleted, renamed or moved it, or main added it after the branch's version of its file. Asked for "
        "its callers, the answer holds the branch's code that still calls main's symbol by a name it imports "
        "(relationMatches of them; not a method called through self or an instance); its other relations are not "
        "read, and the search results for the name may show where it is still written.",
    )


class FusionReport(WireModel):
    """The fusion that ran, with the parameters it used for this query."""

    method: str
    parameters: dict[str, float]


class LateInteractionReport(WireModel):
    """Late interaction as it ran: how many leading candidates it reordered, how many of them had token vectors."""

    weight: float
    candidates: int
    with_token_vectors: int


class SecondOpinionReport(WireModel):
    """The second opinion as it ran: its model and weight, how many leading candidates it reordered, and how many
    of them had a second vector of that model (those without one keep their place in both opinions)."""

    model: str
    weight: float
    candidates: int
    with_second_vectors: int


class DistanceMetricReport(WireModel):
    """The vector distance dense search ranked by, against the one the request named."""

    requested: DistanceMetric
    ran: DistanceMetric
    note: str | None = Field(default=None, description="Why what ran differs from what was asked, when it does.")


class CollapsedResult(WireModel):
    """A chunk left out because a better-ranked result holds its text, or its text holds that result's."""

    id: str
    into: str = Field(description="The better-ranked result of the same symbol that was kept.")


class BudgetReport(WireModel):
    """How the reply fits its budget: its estimated size, and what was cut to fit."""

    max_tokens: int
    estimated_tokens: int = Field(description="The reply's size in bytes of JSON / 4, rounded up.")
    contents_cut: list[str] = Field(default_factory=list, description="Results whose content is cut short.")
    contents_omitted: int = Field(default=0, description="Results sent without their content for want of room.")
    results_dropped: int = Field(
        default=0,
        description="Results left out for want of room: the lowest-ranked, and any too large to list even alone "
        "(by its metadata), whatever its rank.",
    )
    collapsed_dropped: int = Field(
        default=0, description="Entries of _meta.collapsed left out for want of room (those of dropped results too)."
    )
    context_dropped: int = Field(
        default=0,
        description="Entries of _meta.expandedContext left out for want of room (those of dropped results too).",
    )
    reserved_tokens: int = Field(
        default=0,
        description="Of maxTokens, what a reply cut to fit keeps free (0 when nothing was cut): room for this report "
        "and for what two answers to one question differ by in _meta (timings, cacheHit, freshness), so that asking "
        "again gets the same results. A cut reply's estimatedTokens ends up to about this far below maxTokens.",
    )


class Freshness(WireModel):
    """How far the answer is behind the delta stream."""

    indexed_seq: int = Field(
        description="The stream sequence the answer covers: every delta up to it (of any workspace) was in the index, "
        "or dead-lettered, before the answer's first read. An ingester whose deltas were stored at or below it reads "
        "its own writes."
    )
    pending_deltas: int | None = Field(
        default=None,
        description="Deltas of the branches read published past indexedSeq (after a retry, some of them may already "
        "be in the answer); null when the worker cannot tell.",
    )
    pending_ms: float | None = Field(
        default=None, description="How long ago the oldest of them was published; null when none is pending."
    )
    stream_refused: bool = Field(default=False, description=STREAM_REFUSED)


class QueryMeta(WireModel):
    ontology_version: str = Field(description="Version of the data the answer was computed from.")
    workspace: str
    branch: str
    hybrid: bool = Field(
        description="True only when dense and keyword retrieval both ran, both found candidates, and were fused."
    )
    reranked: bool = Field(description="True only when a reranker reordered the results.")
    reranker: str | None = Field(default=None, description="Which reranker reordered them (cross-encoder, cohere).")
    skipped_rerank: str | None = Field(
        default=None, description="Why no reranker ran although precision was requested."
    )
    skipped_late_interaction: str | None = Field(
        default=None,
        description="Why late interaction did not run by default: long_query (more embedding-model tokens than the "
        "deployment compares; a request that sets lateInteraction.weight runs it anyway); not_embedded (the request "
        "set lateInteraction.weight, but the query was not embedded: keyword retrieval alone, or the embedder away); "
        "no_token_vectors (fewer than two of the leading candidates have stored token vectors); model_changed (the "
        "index's embedding model changed while the query was answered: the query's tokens are the other model's; "
        "degraded lists lateInteraction too).",
    )
    skipped_second_opinion: str | None = Field(
        default=None,
        description="Why the second opinion a request asked for (secondOpinion.weight above 0) did not run: "
        "not_configured (this deployment keeps no second vectors).",
    )
    cache_hit: bool
    degraded: list[str] = Field(
        default_factory=list, description="Parts that failed or were unavailable, e.g. embedder, keyword."
    )
    could_benefit_from_link_expansion: bool = False
    expanded_context: list[ExpandedContext] = Field(default_factory=list)
    expanded_context_truncated: bool = Field(
        default=False, description="True when the hits link to more types than expansion attaches (a set bound)."
    )
    backend: str = Field(description="Keyword backend that served the query.")
    retrievers: list[str] = Field(
        description="Retrievers that ran, by name, each list fused even when it came back empty (keyword search "
        "finds nothing for a query of stop words or unknown words): hybrid says whether two lists held candidates."
    )
    fusion: FusionReport | None = Field(
        default=None,
        description="How the lists of the retrievers that ran were combined, also when one was empty (hybrid "
        "false); null when one retriever ran.",
    )
    late_interaction: LateInteractionReport | None = Field(
        default=None, description="Late interaction over stored token vectors; null when it did not run."
    )
    second_opinion: SecondOpinionReport | None = Field(
        default=None, description="The second embedding model's opinion; null when it did not run."
    )
    embedding_model: str | None = Field(
        default=None,
        description="The embedding model the query was embedded by (dense search and late interaction compare it only "
        "with what that model embedded; during a model change, the model the index held); null when the query was "
        "not embedded.",
    )
    distance_metric: DistanceMetricReport | None = Field(
        default=None, description="The distance dense search ranked by; null when dense search did not run."
    )
    collapsed: list[CollapsedResult] = Field(
        default_factory=list,
        description="Chunks left out for a better-ranked result of the same symbol, of those that would have been "
        "among the answer's topK without it.",
    )
    calibrated: bool = Field(
        default=False,
        description="True when every result's score is a calibrated probability of relevance (see score).",
    )
    exact_symbol_matches: int = Field(
        default=0,
        description="Results placed first because the query is their symbol's name, or their file's path, or a "
        "message their code writes (options.exactSymbols); their foundBy names 'symbol', 'file' or 'message'.",
    )
    indexed_on_main: bool | None = Field(
        default=None,
        exclude_if=lambda indexed: indexed is None,
        description="Sent (true) on a branch when the query is one symbol's name or one file's path, the branch "
        "indexes no chunk defining it or of it (within the filters) and main does: the branch deleted, renamed or "
        "moved it, or main added it after the branch's version of its file. The results are then search results for "
        "the name or path.",
    )
    relation_matches: int = Field(
        default=0,
        description="Results placed first because they stand in the relation the query asked about to the symbol "
        "it named (callers, callees, subclasses, bases, importers, imported modules; options.exactSymbols); their "
        "foundBy names the relation.",
    )
    below_min_relevance: int = Field(
        default=0,
        description="Results the answer would have held (within topK) that minRelevance left out; 0 without it.",
    )
    relation_found: int = Field(
        default=0,
        description="How many chunks within the request's filters stand in the asked relation, as far as the lookup "
        f"reads ({RELATIONS_READ}: that many means at least as many); relationMatches of them are in the answer, "
        "and a larger topK shows more.",
    )
    relation: RelationAsked | None = Field(
        default=None,
        description="The relation of one symbol the request asked about (relatedTo, or a query asking one relation "
        "in words: what calls X) and whether that symbol is indexed; null when none was asked, or the lookup did "
        "not run (options.exactSymbols false without relatedTo, or exactSymbol in degraded).",
    )
    keyword_pruned: bool = Field(
        default=False,
        description="True when the keyword retriever read some of the query's commonest terms only for its leading "
        "candidates (bounded BM25): a document holding none of the rarer terms may be missing from its list.",
    )
    filters: dict[str, str | list[str]] = Field(
        default_factory=dict,
        exclude_if=lambda filters: not filters,
        description="The filters the answer was made within, by their request names, as the worker read them (path "
        "patterns as matched: a leading ./ and a trailing / taken off, backslashes read); left out without any. An "
        "objectType also selects the types deriving from it.",
    )
    listing: bool = Field(
        default=False,
        description="True when the request had no semanticQuery: the results are what its filters select, in a "
        "stable order (file, symbol, id), each scoring 1; nothing was ranked.",
    )
    signals: dict[str, float] = Field(
        default_factory=dict,
        description="What the query looked like to the pipeline: queryTokens, keywordSaturation (keyword top score "
        "over the best reachable), keywordCoverage (when the keyword list holds every document having a query "
        "term and they are few against the workspace: the share of the query's term weight its top hit holds; "
        "below ten hits it bounds keywordGap, with the saturation, whichever is more), keywordGap (how far the "
        "keyword top hit stands out).",
    )
    freshness: Freshness | None = Field(default=None, description="How far the answer is behind the delta stream.")
    budget: BudgetReport | None = Field(
        default=None, description="The reply's size against its budget and what was cut to fit (set by the worker)."
    )
    timings_ms: dict[str, float] = Field(
        description="Wall time per pipeline stage, milliseconds; queue: the wait in the worker before the pipeline "
        "ran (not part of total). On a cache hit, the stages are those of the run that made the answer, and queue "
        "and total this request's."
    )


class QueryResponse(WireModel):
    results: list[SearchResult]
    meta: QueryMeta = Field(alias="_meta")


ErrorCode = Literal["invalid_request", "not_found", "unavailable", "overloaded", "deadline_exceeded", "internal"]
"""``overloaded``: the worker's queue was full, refused at once; ``deadline_exceeded``: no answer could be made
before the request's deadline (it waited too long, or the stages it needs took too long). Both are retryable,
but for a ``deadline_exceeded`` whose timeout leaves no retriever any time (``retryable`` false, the timeout
header named in ``details``): the same request again could only be answered from the cache."""

MAX_REQUEST_BYTES = 64 * 1024
"""A request body longer than this is refused unread. The longest valid request is a few kilobytes (a query of
2,000 characters, written as \\u escapes, is 12 kB); parsing a megabyte of unknown fields and reporting them
held a worker's event loop, and every other tenant's deadline, for half a second."""

TIMEOUT_HEADER = "Ontofabric-Timeout-Ms"
"""Request header: how long the caller waits for the reply, in milliseconds (whole, 1 to 300000). The worker answers
or refuses within it and does no work for a caller that has given up; without it the worker's default applies."""
MAX_TIMEOUT_MS = 300_000
SENT_AT_HEADER = "Ontofabric-Sent-At-Ms"
"""Optional request header: when the caller sent the request, in whole milliseconds since the Unix epoch (its wall
clock). A worker that reads the request more than CLOCK_ALLOWANCE_MS after that (it stalled, the request waited in
its socket) counts the wait against the timeout: no work for a caller that has given up. Send it only from hosts
whose clocks agree with the workers' within that allowance (NTP keeps them within a few milliseconds); a wait
under it is not counted, so it bounds how late an answer can come after a stall (it was 1 s, and a load tester's
answers after a 5 s NATS freeze came up to 0.9 s past their deadlines)."""
CLOCK_ALLOWANCE_MS = 250
RECEIPT_HEADER = "Ontofabric-Receipt"
RECEIVED = "received"
"""Optional request header ``Ontofabric-Receipt`` (any value): the worker that reads the request sends its caller
an empty message with the header set to ``received`` before the reply. A caller that gets no receipt soon (a
second or so) knows the worker holding the request is frozen or gone, not working on it, and can send the request
again at once rather than after its timeout. Only for callers that read more than one message from the reply
subject (a plain NATS request takes the first)."""


class ErrorDetail(WireModel):
    field: str | None = Field(
        description="What the problem is about: a request field, camelCase (a nested one as a dotted path); "
        "`header <Name>` for a request header; null for the body as a whole."
    )
    message: str


MAX_ERROR_DETAILS = 20
MAX_DETAIL_CHARS = 200
"""An error reply names the first problems, each cut short, and counts the rest: it always fits a message, whatever
a request holds (60,000 unknown fields once made an error too large to send)."""


def source_place(metadata: Mapping[str, Any]) -> str | None:
    """Where a result's text is, as editors and agents open it: ``wait.py:45-60`` (its file and lines), ``wait.py``
    without lines, None without a file. Lines another ingester stored as anything but numbers are left out."""
    path, start, end = metadata.get("filePath"), metadata.get("startLine"), metadata.get("endLine")
    if not isinstance(path, str) or not path:
        return None
    if type(start) is not int or start < 1:
        return path
    return f"{path}:{start}" + (f"-{end}" if type(end) is int and end > start else "")


def clipped(text: str) -> str:
    return text if len(text) <= MAX_DETAIL_CHARS else text[: MAX_DETAIL_CHARS - 1] + "…"


def validation_details(problems: Sequence[ErrorDetails]) -> list[ErrorDetail]:
    """A request's problems as an error reply names them (unknown fields as such), the first MAX_ERROR_DETAILS."""
    details = []
    for problem in problems[:MAX_ERROR_DETAILS]:
        location = ".".join(str(part) for part in problem["loc"]) or None
        message = "unknown parameter" if problem["type"] == "extra_forbidden" else problem["msg"]
        details.append(ErrorDetail(field=clipped(location) if location else None, message=clipped(message)))
    if len(problems) > MAX_ERROR_DETAILS:
        details.append(ErrorDetail(field=None, message=f"and {len(problems) - MAX_ERROR_DETAILS} more problems"))
    return details


class QueryError(WireModel):
    code: ErrorCode
    message: str
    retryable: bool = False
    details: list[ErrorDetail] = Field(default_factory=list)
    retry_after_ms: int | None = Field(
        default=None,
        ge=1,
        description="With `overloaded`: about how long until the refusing worker expects to start a request like "
        "this one (those it holds ahead of it leaving), in milliseconds, and past the moments it told the requests "
        "it refused just before, one runner's turn apart, so that a burst refused together is not told to come "
        "back all at once. A retry sooner is likely refused again by that worker; another worker of the same queue "
        "group may answer at once. null when it expects no wait (the request's own deadline was too short for its "
        "work), has answered nothing yet to expect by, and on every other error.",
    )


class ErrorReply(WireModel):
    error: QueryError
