"""The gateway's tools as agents see them (pure): names, descriptions, input and output schemas generated from the
contracts, and a compact text rendering of each reply.

A tool's structured result is the query worker's reply as it is (``structuredContent``, described by the tool's
``outputSchema``); the text beside it is for clients that show only text to the model. Both come from the worker's
reply, which is already fitted to the request's budget (``maxTokens``).
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from pydantic import BaseModel
from pydantic.alias_generators import to_camel

from ontofabric.contracts import (
    MAIN_BRANCH,
    DocumentReply,
    DocumentRequest,
    ErrorReply,
    OntologyQuery,
    QueryMeta,
    QueryResponse,
    SearchResult,
    StatusReply,
    StatusRequest,
    main_only,
    nothing_indexed,
    source_place,
)
from ontofabric.contracts.documents import NOT_FOLLOWING
from ontofabric.contracts.query import FILTERS, MAX_TOKENS_LIMIT, MIN_MAX_TOKENS, RELATIONS_READ
from ontofabric.services.query.budget import BYTES_PER_TOKEN, cut_to, json_size, slice_lines
from ontofabric.services.query.client import request_json
from ontofabric.services.query.names import republished_as
from ontofabric.services.query.symbols import (
    BASE,
    CALLEE,
    CALLER,
    FILE,
    IMPORTED,
    IMPORTER,
    MESSAGE,
    SUBCLASS,
    SYMBOL,
    code_shaped,
    file_asked,
    identifier_of,
)
from ontofabric.shared.printable import printable, shown_time
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Operation

WORKSPACE_DESCRIPTION = "Workspace (tenant) to read. Default: the gateway's (ontofabric mcp --workspace)."
DEFAULT_ANSWER_TOKENS: int = Settings.model_fields["answer_max_tokens"].default
DEFAULT_TOP_K: int = OntologyQuery.model_fields["top_k"].default
"""The deployment's answer budget unless set (ONTOFABRIC_ANSWER_MAX_TOKENS)."""
_RESULT_BUDGET = (
    "Size budget of the whole tool result, in tokens (estimated at 4 bytes of JSON each): it carries the reply twice "
    "(as data and as text), so the reply gets half. "
)
DOCUMENT_MAX_TOKENS_DESCRIPTION = _RESULT_BUDGET + (
    "The content is cut at a line's end to fit, with maxChars or without; read on from offset plus its length. "
    "Default: the deployment's budget (8,000) for the reply, about twice that for the whole result. Under about "
    "2,000 the text holds less of the content than the structured reply, which takes no less than 1,000."
)
MAX_TOKENS_DESCRIPTION = _RESULT_BUDGET + (
    "Contents past it are cut or left out, lowest ranks first, and "
    "_meta.budget says which; the rest of a content can be fetched by id (get_document). Default: the deployment's "
    "budget (8,000) for the reply, about twice that for the whole result. Under about 1,100 the reply alone, which "
    "takes no less than 1,000, may leave the result a few percent over."
)


@dataclass(frozen=True)
class ToolSpec:
    name: str
    title: str
    description: str
    operation: Operation
    request: type[BaseModel]
    reply: type[BaseModel]

    @property
    def input_schema(self) -> dict[str, Any]:
        return _input_schema(self.request)

    @property
    def output_schema(self) -> dict[str, Any]:
        return self.reply.model_json_schema(by_alias=True, mode="serialization")


ROOT_COMBINATORS = ("anyOf", "oneOf", "allOf")
"""Left out at the root of a tool's input schema: the Anthropic API (Bedrock's, Vertex's and OpenAI's too) refuses
a tool whose input schema has one there, and a client that hands the tool list to it loses the whole session
(public reports against several MCP servers). The rule they say (ontology_query: a query or a filter) is in the
tool's description, and the worker still checks it, naming the field."""


@cache  # read on every call (as_declared), and pydantic makes it anew each time it is asked: 3 ms
def _input_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The request contract's schema, as the worker validates it, without root combinators; the workspace defaults
    to the gateway's. One dict per model, shared: read it, do not change it."""
    schema = copy.deepcopy(model.model_json_schema(by_alias=True, mode="validation"))
    for combinator in ROOT_COMBINATORS:
        schema.pop(combinator, None)
    for properties in [
        schema.get("properties", {}),
        *(d.get("properties", {}) for d in schema.get("$defs", {}).values()),
    ]:
        for name, spec in properties.items():
            properties[name] = _left_out_rather_than_null(spec)
    workspace = schema.get("properties", {}).get("workspace")
    if workspace is not None:
        workspace["description"] = WORKSPACE_DESCRIPTION
    max_tokens = schema.get("properties", {}).get("maxTokens")
    if max_tokens is not None:
        max_tokens["description"] = (
            DOCUMENT_MAX_TOKENS_DESCRIPTION if model is DocumentRequest else MAX_TOKENS_DESCRIPTION
        )
    definitions = schema.pop("$defs", {})
    return {key: _inlined(value, definitions) for key, value in schema.items()}


def _inlined(spec: Any, definitions: dict[str, Any]) -> Any:
    """``spec`` with each ``$ref`` to ``definitions`` replaced by the definition (its own keys, such as a
    description, kept over the definition's). Clients that build arguments from a parameter's ``type`` find none
    beside a ``$ref``: the MCP Inspector's command line sent `options` as a string, and schema sanitisers of
    function-calling APIs turn an untyped parameter into a string. The request contract is not recursive."""
    if isinstance(spec, list):
        return [_inlined(item, definitions) for item in spec]
    if not isinstance(spec, dict):
        return spec
    reference = spec.get("$ref")
    if isinstance(reference, str) and reference.startswith("#/$defs/"):
        own = {key: value for key, value in spec.items() if key != "$ref"}
        spec = {**definitions[reference.removeprefix("#/$defs/")], **own}
    return {key: _inlined(value, definitions) for key, value in spec.items()}


def _left_out_rather_than_null(spec: dict[str, Any]) -> dict[str, Any]:
    """A parameter that may be null and defaults to null, said as its one type: leaving it out means the same, and
    clients that build arguments from a parameter's ``type`` (the MCP Inspector's command line) find none in an
    ``anyOf`` with null, and cannot send a number."""
    options = spec.get("anyOf")
    if spec.get("default", ...) is not None or not isinstance(options, list) or len(options) != 2:
        return spec
    if {"type": "null"} not in options:
        return spec
    kept = next(option for option in options if option != {"type": "null"})
    outer = {key: value for key, value in spec.items() if key not in ("anyOf", "default")}
    return {**kept, **outer}


TOOLS = (
    ToolSpec(
        name="ontology_query",
        title="Search the ontology",
        description=(
            "Hybrid search (dense and BM25 keyword retrieval, fused, optionally reranked) over a workspace's "
            "SemanticDocuments: code chunks (files, classes, methods, docstrings) and documentation, each with its "
            "file and lines (metadata filePath, startLine, endLine; path:12-30 in the text). Give semanticQuery, or "
            "only filters (objectType, chunkLevel, provenance, symbolKind, paths, excludePaths) to list what they "
            "select; paths and excludePaths restrict to files by pattern (services/query, tests, *_test.py). "
            "A semanticQuery that is one identifier (RetryCallState, pkg.mod.Class.method) puts the chunks defining "
            "that symbol first; one that is a file's path (pkg/util.py, docs/guide.md) puts that file first (a "
            "module's whole chunk, a document's sections), with a line (pkg/util.py:120) or as a traceback's frame "
            "the chunks holding it; one that asks a relation of one symbol (what calls "
            "retry_with, what does wraps "
            "call, what subclasses wait_base, what does Retrying inherit from, what imports pkg.util, what does "
            "pkg.util import) puts those chunks first; relatedTo asks the same by structure ({relation: callers, "
            "symbol: retry_with}), whatever the wording. "
            "followLinks attaches the types one link away in the ontology graph. The reply's _meta says what ran: "
            "check _meta.degraded first: a part named there failed or was unavailable and the answer is the best of "
            "what still ran (e.g. 'reranker', 'embedder', 'keyword'). _meta.freshness says how far the index is "
            "behind (pendingDeltas, pendingMs; streamRefused: it has stopped following); _meta.budget says which "
            "contents were cut to fit maxTokens, which bounds this whole tool result (fetch the rest with "
            "get_document); _meta.collapsed lists chunks left out because a better-ranked result holds the same symbol."
        ),
        operation="query",
        request=OntologyQuery,
        reply=QueryResponse,
    ),
    ToolSpec(
        name="get_document",
        title="Read a document",
        description=(
            "One document by id, as ontology_query returns ids, whole or a slice of its content (offset, "
            "maxChars): to read a hit returned without content, or the rest of a cut one. A slice says which lines "
            "of the file it spans (sliceLines)."
        ),
        operation="document",
        request=DocumentRequest,
        reply=DocumentReply,
    ),
    ToolSpec(
        name="ontology_status",
        title="How fresh is the index",
        description=(
            "For a workspace and branch: the ontologyVersion, the stream sequence the index has handled against the "
            "last one published, how many deltas are pending and for how long, the dead letters, and the time of the "
            "last change, and the workspace's other branches, the latest changed first. Pending deltas mean recent "
            "edits are not searchable yet; streamRefused, that none will be until an operator acts."
        ),
        operation="status",
        request=StatusRequest,
        reply=StatusReply,
    ),
)


def forwarded(spec: ToolSpec, arguments: dict[str, Any], answer_tokens: int = DEFAULT_ANSWER_TOKENS) -> dict[str, Any]:
    """The worker's request for a tool call. A tool result carries the reply twice (structured, and as text of
    about the same size or less), so the worker is asked for half the ``maxTokens`` given, never below the least
    it takes: the whole result then stays within ``maxTokens`` (under twice that least, :func:`fitted_text`).
    A document asked with maxChars and no maxTokens is held to the deployment's budget (``answer_tokens``), as a
    query's reply is (the result about twice it): a tester's maxChars of 200,000 made a tool result of 102,000
    tokens. Asked with neither, the worker holds it to that budget itself (and one of an earlier release, which
    refuses the field, is sent none: a review's)."""
    max_tokens = arguments.get("maxTokens")
    if spec.operation == "document" and max_tokens is None and arguments.get("maxChars") is not None:
        return {**arguments, "maxTokens": answer_tokens}
    if spec.operation not in ("query", "document") or type(max_tokens) is not int:
        return arguments  # none given (the worker's default), or not a number (the worker's error names it)
    if not MIN_MAX_TOKENS <= max_tokens <= MAX_TOKENS_LIMIT:
        return arguments  # not allowed: the worker's error names the field with the value given
    return {**arguments, "maxTokens": max(MIN_MAX_TOKENS, max_tokens // 2)}


class ArgumentsRefused(ValueError):
    """Arguments the worker could not be sent: the message is the tool error's, naming the field."""


def request_body(request: dict[str, Any]) -> bytes:
    """The worker's request as JSON in UTF-8 (:func:`request_json`), refused here, naming the field, when a number in
    it is not finite (its size is the query client's to check)."""
    field = _not_finite(request)
    if field is not None:  # Python's JSON reads NaN and Infinity; no JSON client can mean them
        raise ArgumentsRefused(f"error invalid_request: a number is not finite\n- {field}: a finite number")
    return request_json(request)


def _not_finite(value: Any, path: str = "") -> str | None:
    """The dotted name of the first number in ``value`` that is NaN or infinite, if any."""
    if isinstance(value, float) and not math.isfinite(value):
        return path or "request"
    if isinstance(value, dict):
        children = [(f"{path}.{key}" if path else str(key), item) for key, item in value.items()]
    elif isinstance(value, list):
        children = [(f"{path}.{index}" if path else str(index), item) for index, item in enumerate(value)]
    else:
        return None
    for name, item in children:
        found = _not_finite(item, name)
        if found is not None:
            return found
    return None


def as_declared(spec: ToolSpec, arguments: dict[str, Any]) -> dict[str, Any]:
    """A call's arguments with each whole number written as a float (3.0) made an integer where the tool's schema
    says integer: JSON Schema counts it one, and clients that keep numbers as doubles send it so, while the worker's
    contract is strict and the gateway's own budget reads ``maxTokens`` as an integer."""
    declared: dict[str, Any] = _whole_numbers(arguments, spec.input_schema)
    return declared


def _whole_numbers(value: Any, schema: dict[str, Any]) -> Any:
    """``value`` with each float that is a whole number where ``schema`` says integer made an int."""
    if isinstance(value, float) and schema.get("type") == "integer" and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict) and isinstance(schema.get("properties"), dict):
        properties = schema["properties"]
        return {key: _whole_numbers(item, properties.get(key, {})) for key, item in value.items()}
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_whole_numbers(item, schema["items"]) for item in value]
    return value


def restated(spec: ToolSpec, arguments: dict[str, Any], reply: ErrorReply) -> ErrorReply:
    """The worker's error in the caller's terms: a ``maxTokens`` it names is the half the gateway asked for
    (:func:`forwarded`), not the value the caller gave."""
    given, sent = arguments.get("maxTokens"), forwarded(spec, arguments).get("maxTokens")
    if spec.operation != "query" or given == sent:  # its advice (topK, includeContent) is a query's
        return reply
    details = [
        detail.model_copy(
            update={
                "message": f"{given} is too small for this answer: a tool result carries the reply twice (as data "
                "and as text), so the reply may have half of it; give more, or ask for fewer results (topK) or "
                "includeContent false"
            }
        )
        if detail.field == "maxTokens"
        else detail
        for detail in reply.error.details
    ]
    return reply.model_copy(update={"error": reply.error.model_copy(update={"details": details})})


TEXT_CUT = "\n… (the text is cut to fit maxTokens; the structured result holds the whole answer)"
CONTENTS_LEFT_OUT = (
    "\n… (contents left out of this text to fit maxTokens: each is in the structured result, or get_document by id)"
)
CONTENT_CUT = "\n… (the content is cut here to fit maxTokens: read on with offset where the first line says it ends)"


def fitted_text(
    spec: ToolSpec,
    arguments: dict[str, Any],
    text: str,
    envelope_bytes: Callable[[], int],
    shorter: Callable[[], Sequence[str]] = tuple,
) -> str:
    """The text of a tool result cut to what ``maxTokens`` leaves of it beside the rest of the result
    (``envelope_bytes``: the result as sent, its text empty), the text measured as JSON writes it (its newlines and
    quotes escaped: counting them raw let a result overrun a small budget by 2 %, a tester's finding). Only a budget
    under twice the least the worker takes needs it: the worker cannot be asked for half of it.

    ``shorter()``: the same answer with less in it, fullest first (:func:`render` without contents, then the results'
    lines alone). The first that fits is sent, else as many of the last one's lines as fit, and at least its first
    (a few percent over the least budget): an agent reading the text alone got a budget of 1,000 as a cut marker
    and no result, not even an id to read on (a tester's finding)."""
    max_tokens = arguments.get("maxTokens")
    if spec.operation not in ("query", "document") or type(max_tokens) is not int:
        return text  # a document's too: an agent tester's get_document at 1,000 made a result of 1,788 tokens
    room = max_tokens * BYTES_PER_TOKEN - envelope_bytes() + len('""')  # the envelope holds the text's quotes
    if json_size(text) <= room:
        return text
    if candidates := [candidate for candidate in shorter() if candidate]:
        *fuller, last = candidates
        left_out = CONTENT_CUT if spec.operation == "document" else CONTENTS_LEFT_OUT
        fitting = (c + left_out for c in fuller if json_size(c + left_out) <= room)
        return next(fitting, None) or _first_lines(last, room - json_size(TEXT_CUT) + len('""')) + TEXT_CUT
    room -= json_size(TEXT_CUT) - len('""')
    if room < len('""'):  # the reply alone fills the budget (the worker takes no less than the least): it overruns
        return TEXT_CUT.lstrip() if text else ""
    return cut_to(text, room) + TEXT_CUT


def _first_lines(text: str, room: int) -> str:
    """The lines of ``text`` that fit ``room`` (as JSON), and the first one whatever its size."""
    first, *rest = text.split("\n")
    kept = [first]
    for line in rest:
        if json_size("\n".join([*kept, line])) > room:
            break
        kept.append(line)
    return "\n".join(kept)


def render(reply: BaseModel, arguments: dict[str, Any] | None = None, contents: bool = True) -> str:
    """A reply as compact text for the model; ``arguments``: the call's, which the text may answer to;
    ``contents``: with the results' contents (else their lines and the notes alone, for :func:`fitted_text`)."""
    if isinstance(reply, QueryResponse):
        return _render_query(reply, arguments or {}, contents)
    if isinstance(reply, DocumentReply):
        return _render_document(reply, str((arguments or {}).get("branch") or MAIN_BRANCH))
    if isinstance(reply, StatusReply):
        return _render_status(reply)
    if isinstance(reply, ErrorReply):
        return render_error(reply)
    raise TypeError(f"no rendering of {type(reply).__name__}")


def shorter_texts(reply: BaseModel, arguments: dict[str, Any]) -> list[str]:
    """What :func:`fitted_text` may send of a query's answer when its whole text does not fit: without contents,
    then each result's symbol, place and id alone. None without results: the whole text is the notes, cut as they
    are."""
    if isinstance(reply, DocumentReply):
        return _shorter_document(reply, str(arguments.get("branch") or MAIN_BRANCH))
    if not isinstance(reply, QueryResponse) or not reply.results:
        return []
    ids = [_result_line(r, briefly=True) for r in reply.results]
    return [render(reply, arguments, contents=False), "\n".join(ids)]


def _shorter_document(reply: DocumentReply, branch: str) -> list[str]:
    """A document's text with less of its content, fullest first, down to none, each saying where it ends: cut
    after rendering, its first line said the reply's end, past what the text held, and an agent reading on from
    there would skip the rest (a review's)."""
    texts, room = [], json_size(reply.content)
    while room > SHORTEST_SLICE_BYTES:
        room = room * 4 // 5
        texts.append(_render_slice(reply, cut_to(reply.content, room), branch))
    return [*texts, _render_slice(reply, "", branch)]


SHORTEST_SLICE_BYTES = 64
"""The least of a document's content its text holds, short of none."""


def _render_slice(reply: DocumentReply, content: str, branch: str) -> str:
    """``reply`` rendered with only ``content``, the start of its own, and the lines that start spans."""
    lines = None
    if reply.slice_lines is not None:
        first, last = reply.slice_lines
        lines = slice_lines({"startLine": first, "endLine": last}, content, 0, len(content))
    shown = reply.model_copy(update={"content": content, "truncated": True, "slice_lines": lines})
    # With none of the content in the text, "ask with offset" from its end asked again for what this reply holds:
    # an agent reading the text alone looped (an agent tester's).
    held = (reply.offset, reply.offset + len(reply.content)) if reply.content and not content else None
    return _render_document(shown, branch, held)


def render_error(reply: ErrorReply) -> str:
    error = reply.error
    after = f" in about {error.retry_after_ms} ms" if error.retry_after_ms is not None else ""
    lines = [f"error {error.code}{f' (retryable: try again{after})' if error.retryable else ''}: {error.message}"]
    lines += [f"- {detail.field or 'request'}: {detail.message}" for detail in error.details]
    return "\n".join(lines)


CALLS_READ = "in Python, TypeScript, JavaScript, Go, Java and Rust; other languages' calls are not read"
"""What the ingester reads calls in (graph.python_calls, code_graph.read_code), said beside callers and callees."""

_RAISING = re.compile(r"\b(?:raise[sd]?|throw[sn]?)\b", re.IGNORECASE)
STANDING = {
    CALLER: "calls",
    CALLEE: "is called by",
    SUBCLASS: "derives from",
    BASE: "is a base of",
    IMPORTER: "imports",
    IMPORTED: "is imported by",
}
"""How a result placed first for a relation stands to the symbol asked about, by the name ``foundBy`` gives it."""


def _render_query(reply: QueryResponse, arguments: dict[str, Any], contents: bool = True) -> str:
    meta = reply.meta
    ran = "listing" if meta.listing else ("hybrid" if meta.hybrid else "+".join(meta.retrievers) or "none")
    head = [f"ontologyVersion {meta.ontology_version} · {ran}{' · reranked' if meta.reranked else ''}"]
    head.append(_counted(len(reply.results), "result"))
    if meta.filters:  # as the worker read them (an agent tester's could not tell they were honoured)
        read = "; ".join(
            f"{name} {', '.join(value) if isinstance(value, list) else value}" for name, value in meta.filters.items()
        )
        head.append(f"within {printable(read)}")
    if meta.budget is not None and meta.budget.results_dropped:
        if "replySize" in meta.degraded:  # the message size made the cut, not the budget
            fit = "to fit the largest message the NATS server takes (ask with a smaller topK or includeContent false)"
        else:
            fit = "to fit maxTokens (ask with a larger maxTokens or a smaller topK)"
        head.append(f"{meta.budget.results_dropped} more left out {fit}")
    if nothing_indexed(meta.ontology_version):
        head.append(
            f"nothing is indexed in workspace {meta.workspace!r}, branch {meta.branch!r}: check the name, or whether "
            "its first ingest is still pending (ontology_status)"
        )
    elif main_only(meta.ontology_version):
        head.append(
            f"branch {meta.branch!r} has nothing of its own indexed: these are main's results (check the branch's "
            "name, or ontology_status)"
        )
    head.extend(answer_notes(reply, arguments))
    if meta.calibrated:
        head.append("scores: estimated probability of relevance, each its own (the ranking is the order)")
    if (pending := pending_note(meta)) is not None:
        head.append(pending)
    if meta.freshness is not None and meta.freshness.stream_refused:
        head.append(NOT_FOLLOWING)
    if meta.degraded:
        head.append(f"DEGRADED: {', '.join(meta.degraded)}")
    lines = [" · ".join(head)]
    for result in reply.results:
        lines.append(_result_line(result))
        if not contents:
            continue
        if result.content is not None:
            lines.append(result.content + ("\n[cut: get_document for the rest]" if result.content_truncated else ""))
        elif result.content_length is not None and arguments.get("includeContent") is not False:
            lines.append(f"[content left out for size: {result.content_length} characters, get_document]")
    if meta.budget is not None and meta.budget.context_dropped:  # a tester could not tell "none" from "cut"
        lines.append(
            f"\n{_counted(meta.budget.context_dropped, 'linked type')} of followLinks left out to fit maxTokens"
        )
    for context in meta.expanded_context:
        # The arrow points as the link does, as `ontofabric query` draws it: a tester read "Parameter -inherits->
        # Argument" for an incoming link, Argument inheriting from Parameter.
        arrow = "->" if context.direction == "outgoing" else "<-"
        link = printable(f"{context.linked_from_type} {arrow}{context.link_name}{arrow} {context.linked_type}")
        document = context.representative_document_id
        lines.append(f"\nlinked: {link}" + (f" (document {printable(document)})" if document else ""))
    # With their ids, for get_document (a tester's agent saw only a count, and a method's docstring stood for its
    # code), and with the entries a cut reply had no room for (another's answer folded 5 and said none).
    rank_of = {result.id: result.rank for result in reply.results}
    for rank in sorted({rank_of[c.into] for c in meta.collapsed if c.into in rank_of}):
        ids = [c.id for c in meta.collapsed if rank_of.get(c.into) == rank]
        lines.append(f"\nleft out, nested in or holding result {rank}: {', '.join(ids)}")
    dropped = meta.budget.collapsed_dropped if meta.budget is not None else 0
    if dropped:
        lines.append(
            f"\n{_counted(dropped, 'more chunk')} left out as nested in or holding a result, not named for room"
        )
    return "\n".join(lines)


BRANCH_LACKS = (
    "the branch's files hold none (deleted, renamed or moved on the branch, or added to main after the branch's "
    "version of its file)"
)
"""Why a branch lacks what main holds: not always its own deletion (an agent tester's was told the branch had
deleted what main added after it)."""


def answer_notes(reply: QueryResponse, arguments: dict[str, Any]) -> list[str]:
    """What an answer's results are not, said in words: no definition of the name asked, no symbol of the relation
    asked, only some of those standing in it, nothing of the objectType asked. The MCP text and ``ontofabric
    query``'s table both say them (a tester's table showed a wrong chunk at 0.9 for a name it said nothing of)."""
    meta, object_type = reply.meta, arguments.get("objectType")
    notes: list[str] = []
    named = identifier_of(str(arguments.get("semanticQuery") or ""))
    file = file_asked(str(arguments.get("semanticQuery") or ""))

    def ran(lookup: str) -> bool:  # its timing is there, and it did not fail
        return lookup in meta.timings_ms and lookup not in meta.degraded

    # The lookup ran and placed nothing: a tester's made-up name got ten results unsaid.
    filtered = any(arguments.get(name) is not None for name in FILTER_ARGUMENTS)
    # A branch's deletion, rename or move: not to be taken for a misspelt name (an agent tester's).
    on_main = f", though main indexes one: {BRANCH_LACKS}" if meta.indexed_on_main else ""
    if file is not None and _no_definition_placed(meta) and ran("exactFile"):
        notes.append(  # a review's: a filter leaving out the file's chunks is no file missing
            f"no file at a path {printable(file.path)!r} names (nor ending with it) is indexed"
            f"{' with chunks within the filters' if filtered else ''} in workspace {meta.workspace!r}, branch "
            f"{meta.branch!r}{on_main}: these are search results for the path"
        )
    elif named is not None and code_shaped(named) and _no_definition_placed(meta) and ran("exactSymbol"):
        notes.append(
            f"no chunk defining a symbol named {named!r}{' within the filters' if filtered else ''} is indexed in "
            f"workspace {meta.workspace!r}, branch {meta.branch!r}{on_main}: these are search results for the name"
        )
    asked = meta.relation
    if asked is not None and not asked.symbol_indexed and asked.defined_on_main:
        if meta.relation_matches and asked.relation == "callers":
            found = (
                f"the first {meta.relation_matches} results are the branch's code that still calls main's by a name it "
                "imports (not read: a call through self or an instance, or one whose import the branch took out)"
            )
        elif meta.relation_matches:
            found = f"the first {meta.relation_matches} results still stand in relation {asked.relation!r} to main's"
        else:
            found = f"nothing its code still says of it is read as its {asked.relation}"
            if reply.results:  # said to show where it is written only where one does (an agent tester's)
                short = asked.symbol.rpartition(".")[2]
                written = any(short in (result.content or "") for result in reply.results)
                found += ": these are search results for the name" + (
                    ", which show where it is still written" if written else ""
                )
        notes.append(
            f"no symbol named {asked.symbol!r} is indexed on branch {meta.branch!r} of workspace {meta.workspace!r}, "
            f"though main defines one: {BRANCH_LACKS}; {found}"
        )
    elif asked is not None and not asked.symbol_indexed:
        notes.append(
            f"no symbol named {asked.symbol!r} is indexed in workspace {meta.workspace!r}, branch {meta.branch!r}, "
            f"so nothing was found as its {asked.relation}"
            + (": these are search results for the name" if reply.results else "")
            + " (check the name's spelling, or ask by the qualified name a result shows)"
        )
    elif asked is not None and meta.relation_found > meta.relation_matches > 0:  # an agent tester's: 3 of 13
        more = f"{meta.relation_found} or more" if meta.relation_found >= RELATIONS_READ else str(meta.relation_found)
        # Which limit cut them: a tester's answer said "larger topK" with topK 30 and 28 results cut for size.
        budget_cut = meta.budget is not None and meta.budget.results_dropped > 0
        notes.append(
            f"{meta.relation_matches} of the {more} chunks standing in relation {asked.relation!r} to "
            f"{asked.symbol!r} shown: ask with a larger {'maxTokens' if budget_cut else 'topK'} for the rest"
        )
    elif asked is not None and not meta.relation_matches:
        # Search results alone then (none stands in it, or filters, topK or minRelevance left those out): said, so
        # that they do not read as the relation's, whether relatedTo or the query's words asked it.
        relation = f"no result here was found standing in relation {asked.relation!r} to {asked.symbol!r}"
        if asked.relation in ("callers", "callees"):  # a tester read "nothing calls it" above a result calling it
            relation += (
                f" by reading the code's syntax ({CALLS_READ}), which does not see a call through a variable or an "
                "attribute"
            )  # a monorepo tester's Go function, whose callers were read nowhere then
        elif asked.relation in ("importers", "imports"):  # a tester's "where is get_coro_name imported": none
            relation += " (imports are read between modules: for a class or function, ask what calls it)"
        notes.append(relation + (": these are search results" if reply.results else ""))
    if asked is not None and asked.relation == "callers" and _RAISING.search(str(arguments.get("semanticQuery", ""))):
        notes.append(  # an agent tester's "what raises X" had the class's definition first
            f"what raises {asked.symbol!r} is read as what calls it: raise {asked.symbol}(...) and raise "
            f"{asked.symbol} make one"
        )
    if asked is not None and meta.relation_matches and asked.relation in ("callers", "callees"):
        # An agent tester read a lone caller at 1.0 as the whole list: Context.invoke has four, three through ctx.
        notes.append(
            f"{asked.relation} are read from the code's syntax ({CALLS_READ}): a call through an attribute, what a "
            "call returned, or a variable whose type the code does not write (ctx.invoke(), self.stream.expect(), "
            "a Go local bound to what a function outside the tree returns), and a call in a macro's body, are not "
            "seen, so there may be more"
        )  # a retest's TypeScript caller went unsaid beside a Python one; a polyglot tester's Go locals
    if asked is not None and asked.symbols_named:  # an agent tester's callers of three get_command, merged unsaid
        listed = ", ".join(printable(name) for name in asked.symbols_named) + (
            ", ..." if asked.more_symbols_named else ""
        )
        notes.append(
            f"{asked.symbol!r} names more than one symbol ({listed}): these stand in relation {asked.relation!r} to "
            "any of them; ask by a qualified name for one"
        )
    if not reply.results and isinstance(object_type, str) and _alone_selected_nothing(meta, arguments, "objectType"):
        # An agent asks for objectType "method" or "class" (a tester's finding) and hears nothing more.
        notes.append(
            f"nothing matched objectType {object_type!r} (nor a type deriving from it): an objectType is a module's "
            "or a class's dotted name as results show it, after the file's path (pkg.module, pkg.module.Class); a "
            "kind of symbol is symbolKind (class, function, method)"
        )
    paths, left_out = arguments.get("paths"), arguments.get("excludePaths")
    if (
        not reply.results
        and isinstance(paths, list)
        and _alone_selected_nothing(meta, {**arguments, "excludePaths": None}, "paths")
    ):
        less = f" less excludePaths {', '.join(printable(str(p)) for p in left_out)}" if left_out else ""
        notes.append(  # a monorepo tester's paths ["*.go"] and typo ["docz"] each answered a bare "0 results"
            f"no indexed file matches paths {', '.join(printable(str(path)) for path in paths)}{less}: a pattern "
            "reads as ingest's --exclude reads one (without / a file or directory name at any depth, with / a path "
            "from the tree's top); ontology_status says what the workspace holds"
        )
    if meta.listing and reply.results:  # an agent tester's listing of 300 methods could not be read past topK
        offset, asked = arguments.get("offset"), arguments.get("topK")
        start = offset if type(offset) is int else 0
        dropped = meta.budget.results_dropped if meta.budget is not None else 0
        if len(reply.results) + dropped >= (asked if type(asked) is int else DEFAULT_TOP_K):
            notes.append(f"the listing may go on: ask with offset {start + len(reply.results)} for what follows")
    kind = arguments.get("symbolKind")
    if not reply.results and isinstance(kind, str) and _alone_selected_nothing(meta, arguments, "symbolKind"):
        notes.append(  # an agent tester's "klass" got nothing, with nothing said
            f"nothing matched symbolKind {kind!r}: a kind is one an ingester wrote (this project's: module, class, "
            "function, method, docstring, section)"
        )
    if meta.below_min_relevance:  # in `ontofabric query`'s table too (a quality tester's was empty, unsaid)
        notes.append(
            f"left out: {_counted(meta.below_min_relevance, 'more result')} scoring below minRelevance "
            f"{arguments.get('minRelevance')} (ask with a lower one to see them)"
        )
    return notes


def _result_line(result: SearchResult, briefly: bool = False) -> str:
    """A result's line in the text: its rank, symbol, place, kind, score and id; ``briefly``, rank, symbol, place
    and id alone (what an answer too large for its budget still names)."""
    # Names as the tenant's files gave them, on their line: a file named with line breaks wrote result lines of its
    # own ("1. ... score 1.000", instructions) into the text an agent reads (an outside tester's).
    symbol = printable(str(result.metadata.get("symbolFqn") or result.object_type))
    where = printable(source_place(result.metadata) or "")
    named = f"{result.rank}. {symbol}" + (f" ({where})" if where else "")
    assigned = f" · assigns it at line {result.assigned_at_line}" if result.assigned_at_line is not None else ""
    if briefly:
        return f"{named} · id {result.id}{assigned}"
    return (
        f"\n{named}"
        # The kind of symbol where the ingester says it: its chunk level calls a function a "method".
        + f" · {printable(str(result.metadata.get('symbolKind') or result.metadata.get('chunkLevel', '')))}"
        + f" · score {result.score:.3f} · id {result.id}"
        + (
            f" · defines the name asked{_published(result)}"
            if any(f.retriever == SYMBOL for f in result.found_by)
            else ""
        )
        + (" · of the file asked" if any(f.retriever == FILE for f in result.found_by) else "")
        + (" · writes the message asked" if any(f.retriever == MESSAGE for f in result.found_by) else "")
        + assigned
        + "".join(f" · {STANDING[f.retriever]} the symbol asked" for f in result.found_by if f.retriever in STANDING)
    )


def _published(result: SearchResult) -> str:
    """`, published as anyio.sleep` for a definition its package re-exports (an agent tester could not tell why
    `httpx._api.get` came first for `get`), else nothing; nothing for a chunk that assigns the name, whose
    published name is its class's or module's (a review's `Context`, annotating `command`)."""
    if result.assigned_at_line is not None:
        return ""
    aliases = result.metadata.get("aliases")
    named = republished_as(
        str(result.metadata.get("symbolFqn") or ""),
        [str(alias) for alias in aliases] if isinstance(aliases, list) else [],
        result.source_domain,
    )
    return f", published as {printable(named)}" if named else ""


def _no_definition_placed(meta: QueryMeta) -> bool:
    """Whether a query that was one name got no definition of it placed first (and asked no relation)."""
    return meta.relation is None and not meta.exact_symbol_matches


def pending_note(meta: QueryMeta) -> str | None:
    """What the answer does not hold yet: the deltas published that the index has not applied."""
    if meta.freshness is None or not meta.freshness.pending_deltas:
        return None
    return f"{_counted(meta.freshness.pending_deltas, 'delta')} not yet indexed ({meta.freshness.pending_ms} ms)"


FILTER_ARGUMENTS = tuple(to_camel(name) for name in FILTERS)
"""The request's filters as the tool's arguments name them."""


def _counted(count: int, noun: str) -> str:
    """``1 result``, ``2 results``: what an agent reads is written as a person would."""
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _alone_selected_nothing(meta: QueryMeta, arguments: dict[str, Any], named: str) -> bool:
    """Whether an empty answer is the filter ``named``'s doing alone: not the budget's, another filter's,
    minRelevance's, an empty index's or a narrowing that could not run."""
    others = (*FILTER_ARGUMENTS, "minRelevance")
    return (
        not (meta.budget is not None and meta.budget.results_dropped)
        and all(arguments.get(name) is None for name in others if name != named)
        and not nothing_indexed(meta.ontology_version)
        and "objectTypeNarrowing" not in meta.degraded
    )


def _render_document(reply: DocumentReply, branch: str, held: tuple[int, int] | None = None) -> str:
    """``held``: characters the structured result holds and this text does not (none of them fit beside it)."""
    end = reply.offset + len(reply.content)
    where = printable(source_place(reply.metadata) or "")
    head = printable(str(reply.metadata.get("symbolFqn") or reply.object_type)) + (f" ({where})" if where else "")
    head += f" · id {reply.id} · characters {reply.offset}-{end}"
    if held is not None:
        head += (
            f" of {reply.content_length} (none fits in this text beside the structured result, which holds characters "
            f"{held[0]}-{held[1]}: ask again with a larger maxTokens to read them here)"
        )
    else:
        head += f" of {reply.content_length}" + (" (more: ask with offset)" if reply.truncated else "")
    if reply.slice_lines is not None and (reply.offset > 0 or reply.truncated):  # a slice: where it is
        head += f" · lines {reply.slice_lines[0]}-{reply.slice_lines[1]} of the file"
    if main_only(reply.ontology_version):  # an agent tester's misspelt branch read main's without a word
        head += (
            f"\nbranch {branch!r} has nothing of its own indexed: this is main's document (check the branch's name, "
            "or ontology_status)"
        )
    return f"{head}\n{reply.content}"


def _render_status(reply: StatusReply) -> str:
    lines = [
        f"workspace {reply.workspace} · branch {reply.branch} · ontologyVersion {reply.ontology_version} · "
        f"indexed to stream seq {reply.indexed_seq} · {_counted(reply.pending_deltas, 'delta')} pending · "
        f"{_counted(reply.dead_letters, 'dead letter')}"
    ]
    if reply.stream_refused:
        lines.append(NOT_FOLLOWING)
    for branch in reply.branches:
        waited = f", oldest {branch.pending_ms} ms" if branch.pending_ms is not None else ""
        # None once compaction folded its deltas into a snapshot: no number to print.
        last = "no delta of it in the stream" if branch.latest_seq is None else f"last delta seq {branch.latest_seq}"
        # A branch that only deletes files read as "0 documents", as an empty or misspelt one does (a tester's).
        hides = f" (and hides {_counted(branch.hidden, 'document')} of main's)" if branch.hidden else ""
        lines.append(
            f"- {branch.branch}: {_counted(branch.documents, 'document')}{hides}, {last}, {branch.pending_deltas} "
            f"pending{waited}, last change {shown_time(branch.last_change) if branch.last_change else 'none yet'}"
        )
    if reply.other_branches:  # an agent could not find a branch it had not been told of (a tester's)
        more = " (and more)" if reply.more_branches else ""
        names = ", ".join(printable(name) for name in reply.other_branches)
        lines.append(f"other branches (ask with branch): {names}{more}")
    return "\n".join(lines)
