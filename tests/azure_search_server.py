"""A local stand-in for the part of the Azure AI Search REST API (2026-04-01) that the projector and the keyword query
adapter use, close enough to the service for the real azure-search-documents clients to run against it unchanged.

Scoring is Lucene's BM25 (k1 1.2, b 0.75) per field, summed over fields and query terms as the simple query parser's
disjunction does, over a simple analyzer (lower-case, split on non-alphanumerics). Features this server does not
implement (semantic ranking, vectors, facets, highlights, full Lucene syntax) are rejected with 400, not ignored.
"""

from __future__ import annotations

import asyncio
import json
import math
import operator
import re
import socket
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from aiohttp import web

API_VERSION = "2026-04-01"
MAX_ACTIONS = 1000
MAX_TERM_BYTES = 32766
MAX_BODY = 16 * 1024 * 1024
DEFAULT_PAGE = 50  # results per response without `top`; the service hands out the rest through nextPageParameters
MAX_PAGE, MAX_SKIP = 1000, 100_000
K1, B = 1.2, 0.75

_INDEX = r"/indexes\('(?P<index>[^'/]+)'\)"
_ROUTES = [  # (method, path, route name = handler method name)
    ("GET", "/indexes", "list_indexes"),
    ("POST", "/indexes", "create_index"),
    ("PUT", _INDEX, "create_or_update_index"),
    ("GET", _INDEX, "get_index"),
    ("DELETE", _INDEX, "delete_index"),
    ("GET", _INDEX + r"/docs/\$count", "count"),
    ("GET", _INDEX + r"/docs\('(?P<key>[^']*)'\)", "get_document"),
    ("POST", _INDEX + r"/docs/search\.index", "index_documents"),
    ("POST", _INDEX + r"/docs/search\.post\.search", "search"),
]
_INDEX_NAME = re.compile(r"(?=.{2,128}$)[a-z0-9]+(?:-[a-z0-9]+)*")
_FIELD_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,127}")
_DOC_KEY = re.compile(r"[A-Za-z0-9_=-]{1,1024}")
_SCALARS = {"Edm.String", "Edm.Int32", "Edm.Int64", "Edm.Double", "Edm.Single", "Edm.Boolean", "Edm.DateTimeOffset"}
_ACTIONS = {"upload", "merge", "mergeOrUpload", "delete"}
_SEARCH_PARAMS = {"search", "searchFields", "searchMode", "queryType", "filter", "orderby", "select", "top", "skip"}
_SEARCH_PARAMS |= {"count", "sessionId", "scoringStatistics"}
_UNSUPPORTED = {"facets", "highlight", "highlightPreTag", "highlightPostTag", "minimumCoverage", "scoringProfile"}
_UNSUPPORTED |= {"scoringParameters", "semanticConfiguration", "semanticQuery", "semanticErrorHandling", "debug"}
_UNSUPPORTED |= {"semanticMaxWaitInMilliseconds", "answers", "captions", "vectorQueries", "vectorFilterMode"}
_WORD = re.compile(r"[^\W_]+")
_TOKEN = re.compile(r"\s*('(?:[^']|'')*'|-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|[A-Za-z_][\w.]*|[(),:/])")
_CONSTANTS = {"true": True, "false": False, "null": None}
_COMPARE: dict[str, Callable[[Any, Any], bool]] = {
    op: getattr(operator, op) for op in ("eq", "ne", "gt", "ge", "lt", "le")
}

Predicate = Callable[[Mapping[str, Any]], bool]
Handler = Callable[[web.Request, dict[str, str], dict[str, Any]], web.Response]


class ODataError(Exception):
    """Becomes the service's error response, ``{"error": {"code", "message"}}`` with the given status."""

    def __init__(self, status: int, message: str, code: str = "InvalidRequestParameter") -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code

    def response(self, headers: Mapping[str, str] | None = None) -> web.Response:
        body = {"error": {"code": self.code, "message": self.message}}
        return web.json_response(body, status=self.status, headers=headers)


def _invalid(detail: str) -> ODataError:
    return ODataError(400, f"The request is invalid. Details: {detail}")


@dataclass
class _Index:
    definition: dict[str, Any]
    etag: str
    docs: dict[str, dict[str, Any]] = field(default_factory=dict)
    writes: int = 0  # bumped by every indexing request: the term statistics below are rebuilt after one
    _postings: dict[str, tuple[int, _Postings]] = field(default_factory=dict)

    def postings(self, name: str) -> _Postings:
        """A field's inverted index (term -> key -> frequency) and its lengths, kept until the next write."""
        built = self._postings.get(name)
        if built is None or built[0] != self.writes:
            terms: dict[str, dict[str, int]] = {}
            lengths: dict[str, int] = {}
            for key, doc in self.docs.items():
                if tokens := _field_tokens(doc.get(name)):
                    lengths[key] = len(tokens)
                    for term, count in Counter(tokens).items():
                        terms.setdefault(term, {})[key] = count
            built = self._postings[name] = (self.writes, _Postings(terms, lengths))
        return built[1]

    @property
    def fields(self) -> dict[str, dict[str, Any]]:
        return {spec["name"]: spec for spec in self.definition["fields"]}

    @property
    def key(self) -> str:
        return str(next(spec["name"] for spec in self.definition["fields"] if spec["key"]))

    def representation(self) -> dict[str, Any]:
        return {"@odata.etag": self.etag, **self.definition}


@dataclass(frozen=True)
class _Postings:
    terms: dict[str, dict[str, int]]
    lengths: dict[str, int]


@dataclass(frozen=True)
class _Ref:
    name: str
    element: str  # the field's type, or a collection's element type
    collection: bool


@dataclass(frozen=True)
class _Lit:
    value: Any


def _element(type_name: str) -> tuple[str, bool]:
    inner = re.fullmatch(r"Collection\((.*)\)", type_name)
    return (inner.group(1), True) if inner else (type_name, False)


def _conforms(element: str, value: Any) -> bool:
    if element in ("Edm.Int32", "Edm.Int64"):
        bound = 2**31 if element == "Edm.Int32" else 2**63
        return isinstance(value, int) and not isinstance(value, bool) and -bound <= value < bound
    if element in ("Edm.Double", "Edm.Single"):
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, bool if element == "Edm.Boolean" else str)


def _fits(type_name: str, value: Any) -> bool:
    element, collection = _element(type_name)
    if value is None:
        return True
    if collection:
        return isinstance(value, list) and all(_conforms(element, item) for item in value)
    return _conforms(element, value)


def _normalised_fields(raw: Any) -> list[dict[str, Any]]:
    """The fields with the REST defaults filled in, so stored definitions read like the service's."""
    if not isinstance(raw, list) or not raw:
        raise _invalid("index.fields : An index must contain at least one field.")
    fields: dict[str, dict[str, Any]] = {}
    for given in raw:
        name, type_name = given.get("name"), str(given.get("type"))
        element, collection = _element(type_name)
        if not isinstance(name, str) or not _FIELD_NAME.fullmatch(name) or name in fields:
            raise _invalid(f"index.fields : The field name '{name}' is invalid or used more than once.")
        if element not in _SCALARS:
            raise _invalid(f"Field '{name}' has type '{type_name}', which this test server does not support.")
        defaults = {"key": False, "retrievable": True, "searchable": element == "Edm.String"}
        defaults |= {"filterable": True, "facetable": True, "sortable": not collection}
        spec = given | {attribute: value for attribute, value in defaults.items() if given.get(attribute) is None}
        if spec["searchable"] and element != "Edm.String":
            raise _invalid(f"Field '{name}' of type '{type_name}' cannot be searchable; only string fields can.")
        if spec["sortable"] and collection:
            raise _invalid(f"Field '{name}' is a collection and cannot be sortable.")
        fields[name] = spec
    keys = [spec for spec in fields.values() if spec["key"]]
    if len(keys) != 1:
        raise _invalid(f"index.fields : Found {len(keys)} key fields; an index must have exactly one key field.")
    if keys[0]["type"] != "Edm.String":
        raise _invalid(f"Key field '{keys[0]['name']}' must be of type 'Edm.String'.")
    return list(fields.values())


def _tokens(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _field_tokens(value: Any) -> list[str]:
    values = value if isinstance(value, list) else [value]
    return [token for item in values if isinstance(item, str) for token in _tokens(item)]


def _bm25(index: _Index, fields: list[str], terms: list[str], mode: str) -> dict[str, float]:
    """Statistics come from the whole index: a filter narrows the hits, not the statistics, as in Lucene."""
    scores: dict[str, float] = {}
    matched: dict[str, set[str]] = {}
    for name in fields:
        postings = index.postings(name)
        avgdl = sum(postings.lengths.values()) / max(len(postings.lengths), 1)
        for term in terms:  # a repeated term counts twice, as its repeated query clause does
            holders = postings.terms.get(term, {})
            idf = math.log(1 + (len(postings.lengths) - len(holders) + 0.5) / (len(holders) + 0.5))
            for key, tf in holders.items():
                dl = postings.lengths[key]
                # Lucene 8+ drops BM25's constant (k1 + 1) numerator factor; order and ratios are unchanged.
                scores[key] = scores.get(key, 0.0) + idf * tf / (tf + K1 * (1 - B + B * dl / avgdl))
                matched.setdefault(key, set()).add(term)
    if mode == "all":
        return {key: score for key, score in scores.items() if matched[key] >= set(terms)}
    return scores


class _Filter:
    """Recursive descent over the OData $filter subset, compiled to a predicate and checked against the index."""

    def __init__(self, text: str, fields: Mapping[str, Mapping[str, Any]]) -> None:
        self.fields, self.pos, position = fields, 0, 0
        self.variables: dict[str, str] = {}  # lambda range variable -> element type
        self.tokens: list[str] = []
        while text[position:].strip():
            match = _TOKEN.match(text, position)
            if match is None:
                raise self._error(f"syntax error at position {position}")
            self.tokens.append(match.group(1))
            position = match.end()

    def _expression(self) -> Predicate:  # `or` binds looser than `and`
        return self._chain("or", lambda: self._chain("and", self._unary, all), any)

    def parse(self) -> Predicate:
        predicate = self._expression()
        if self.pos != len(self.tokens):
            raise self._error(f"unexpected '{self.tokens[self.pos]}'")
        return predicate

    def _error(self, detail: str) -> ODataError:
        return ODataError(400, f"Invalid expression: {detail}. Parameter name: $filter")

    def _peek(self) -> str:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else ""

    def _next(self, kind: str = "token") -> str:
        token = self._peek()
        if not {"token": token, "name": token[:1].isalpha(), "string": token[:1] == "'"}[kind]:
            raise self._error(f"expected a {kind}, found '{token or 'the end'}'")
        self.pos += 1
        return token

    def _accept(self, text: str) -> bool:
        if self._peek() != text:
            return False
        self.pos += 1
        return True

    def _expect(self, text: str) -> None:
        if not self._accept(text):
            raise self._error(f"expected '{text}', found '{self._peek() or 'the end'}'")

    def _chain(
        self, word: str, operand: Callable[[], Predicate], combine: Callable[[Iterable[bool]], bool]
    ) -> Predicate:
        parts = [operand()]
        while self._accept(word):
            parts.append(operand())
        return parts[0] if len(parts) == 1 else lambda scope: combine(part(scope) for part in parts)

    def _unary(self) -> Predicate:
        if self._accept("not"):
            inner = self._unary()
            return lambda scope: not inner(scope)
        if self._accept("("):
            inner = self._expression()
            self._expect(")")
            return inner
        if self._accept("search.in"):
            return self._search_in()
        return self._comparison()

    def _ref(self, name: str) -> _Ref:
        if name in self.variables:
            return _Ref(name, self.variables[name], collection=False)
        spec = self.fields.get(name)
        if spec is None or not spec["filterable"]:
            raise self._error(f"'{name}' is not a filterable field of the index")
        return _Ref(name, *_element(spec["type"]))

    def _operand(self) -> _Ref | _Lit:
        token = self._next()
        if token.startswith("'"):
            return _Lit(_unquote(token))
        if token[0] in "-0123456789":
            return _Lit(float(token) if any(c in token for c in ".eE") else int(token))
        if token in _CONSTANTS:
            return _Lit(_CONSTANTS[token])
        if token[0].isalpha():
            return self._ref(token)
        raise self._error(f"unexpected '{token}'")

    def _comparison(self) -> Predicate:
        left = self._operand()
        if isinstance(left, _Ref) and self._accept("/"):
            return self._lambda(left)
        op = self._peek()
        if op not in _COMPARE:  # a lone boolean field or constant is a predicate by itself
            if isinstance(left, _Ref) and left.element == "Edm.Boolean" and not left.collection:
                return lambda scope: scope.get(left.name) is True
            if isinstance(left, _Lit) and isinstance(left.value, bool):
                return lambda scope: bool(left.value)
            raise self._error(f"expected a comparison operator, found '{op or 'the end'}'")
        self.pos += 1
        right = self._operand()
        if isinstance(left, _Ref) and isinstance(right, _Lit):
            ref, lit, flipped = left, right, False
        elif isinstance(left, _Lit) and isinstance(right, _Ref):
            ref, lit, flipped = right, left, True
        else:
            raise self._error("a comparison needs a field on one side and a constant on the other")
        if ref.collection:
            raise self._error(f"'{ref.name}' is a collection: use any() or all()")
        if not (op in ("eq", "ne") if lit.value is None else _conforms(ref.element, lit.value)):
            raise self._error(f"cannot compare '{ref.name}' of type '{ref.element}' with {json.dumps(lit.value)}")
        compare = _COMPARE[op]

        def test(scope: Mapping[str, Any]) -> bool:
            value = scope.get(ref.name)
            if value is None and op not in ("eq", "ne"):
                return False
            return compare(lit.value, value) if flipped else compare(value, lit.value)

        return test

    def _lambda(self, ref: _Ref) -> Predicate:
        quantifier = self._next("name")
        if quantifier not in ("any", "all") or not ref.collection:
            raise self._error(f"'{quantifier}' is not a lambda over a collection field")
        self._expect("(")
        if quantifier == "any" and self._accept(")"):
            return lambda scope: bool(scope.get(ref.name))
        variable = self._next("name")
        self._expect(":")
        self.variables[variable] = ref.element
        body = self._expression()
        del self.variables[variable]
        self._expect(")")
        pick = any if quantifier == "any" else all
        return lambda scope: pick(body({**scope, variable: item}) for item in scope.get(ref.name) or [])

    def _search_in(self) -> Predicate:
        self._expect("(")
        ref = self._ref(self._next("name"))
        if ref.collection or ref.element != "Edm.String":
            raise self._error(f"search.in needs a string field or range variable, not '{ref.name}'")
        self._expect(",")
        values, delimiters = _unquote(self._next("string")), " ,"
        if self._accept(","):
            delimiters = _unquote(self._next("string"))
        self._expect(")")
        allowed = {value for value in re.split(f"[{re.escape(delimiters)}]", values) if value}
        return lambda scope: scope.get(ref.name) in allowed


def _unquote(literal: str) -> str:
    return literal[1:-1].replace("''", "'")


def _names(value: Any) -> list[str]:
    return [name.strip() for name in str(value or "").split(",") if name.strip()]


def _nulls_first(value: Any) -> tuple[bool, Any]:
    return value is not None, value


class AzureSearchServer:
    """``async with AzureSearchServer(api_key="k") as server:`` serves on ``server.endpoint`` until the block ends."""

    def __init__(self, api_key: str = "test-admin-key") -> None:
        self.api_key = api_key
        self.endpoint = ""
        self.delay_s = 0.0  # added to every request, before any injected failure
        self.hanging = False
        """While True, a request is taken in and never answered (until the server stops): a connection lost
        without a reset."""
        self._stopping = asyncio.Event()
        self.requests: Counter[str] = Counter()  # by route name; failed and retried attempts count too
        # (route or None for any, requests of that route to let through first, status, Retry-After seconds)
        self._failures: deque[tuple[str | None, int, int, float | None]] = deque()
        self._indexes: dict[str, _Index] = {}
        self._item_failures: dict[str, int] = {}
        self._etags = 0
        self._runner: web.AppRunner | None = None

    def fail_next(
        self, count: int, status: int, *, retry_after: float | None = None, route: str | None = None, after: int = 0
    ) -> None:
        """Answer the next ``count`` requests (of ``route`` only, when given, and after letting ``after`` of them
        through) with ``status``, and a Retry-After header if given."""
        self._failures.append((route, after, status, retry_after))
        self._failures.extend([(route, 0, status, retry_after)] * (count - 1))

    def fail_items(self, key: str, times: int) -> None:
        """Answer the next ``times`` index actions on ``key`` with a per-item 503 (the request itself succeeds)."""
        self._item_failures[key] = times

    def documents(self, index_name: str) -> dict[str, dict[str, Any]]:
        return self._indexes[index_name].docs

    async def __aenter__(self) -> AzureSearchServer:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(self._runner, sock).start()
        self.endpoint = f"http://127.0.0.1:{sock.getsockname()[1]}"
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._stopping.set()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _dispatch(self, request: web.Request) -> web.Response:
        # The service also takes the /indexes/name form; the SDK only sends /indexes('name').
        path = re.sub(r"^/indexes/([^/()']+)", r"/indexes('\1')", request.path)
        matches = [(method, route, m) for method, pattern, route in _ROUTES if (m := re.fullmatch(pattern, path))]
        route, params = next(((r, m.groupdict()) for method, r, m in matches if method == request.method), ("", {}))
        self.requests[route or "unknown"] += 1
        try:
            if not route:
                raise ODataError(405 if matches else 404, f"No route for {request.method} {request.path}")
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if self.hanging:
                await self._stopping.wait()
                raise ODataError(503, "The server is stopping.")
            if self._failures and self._failures[0][0] in (None, route):
                target, let_through, status, retry_after = self._failures.popleft()
                if let_through:
                    self._failures.appendleft((target, let_through - 1, status, retry_after))
                    return await self._handle(request, route, params)
                headers = {} if retry_after is None else {"Retry-After": f"{retry_after:g}"}
                code = HTTPStatus(status).phrase.replace(" ", "")
                return ODataError(status, "Injected failure.", code).response(headers)
            return await self._handle(request, route, params)
        except ODataError as error:
            return error.response()

    async def _handle(self, request: web.Request, route: str, params: dict[str, str]) -> web.Response:
        self._authorise(request)
        body = await self._body(request) if request.method in ("POST", "PUT") else {}
        handler: Handler = getattr(self, f"_{route}")
        return handler(request, params, body)

    def _authorise(self, request: web.Request) -> None:
        supplied, version = request.headers.get("api-key"), request.query.get("api-version")
        if supplied is None:
            raise ODataError(401, "Access denied: no api-key header was supplied.", "Unauthorized")
        if supplied != self.api_key:
            raise ODataError(403, "Access denied: the api-key is not valid for this service.", "Forbidden")
        if version is None:
            raise ODataError(400, "The api-version query parameter (?api-version=) is required for all requests.")
        if version != API_VERSION:
            raise ODataError(400, f"Invalid or unsupported api-version '{version}'; this server speaks {API_VERSION}.")

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.read())
        except web.HTTPRequestEntityTooLarge as error:
            raise ODataError(413, "The request is too large.", "RequestEntityTooLarge") from error
        except ValueError as error:
            raise _invalid(f"The request body is not valid JSON: {error}") from error
        if not isinstance(body, dict):
            raise _invalid("The request body must be a JSON object.")
        return body

    def _lookup(self, name: str) -> _Index:
        if name not in self._indexes:
            raise ODataError(404, f"The index '{name}' was not found.", "ResourceNotFound")
        return self._indexes[name]

    # Index definitions

    def _list_indexes(self, request: web.Request, params: dict[str, str], body: dict[str, Any]) -> web.Response:
        return web.json_response({"value": [index.representation() for index in self._indexes.values()]})

    def _create_index(self, request: web.Request, params: dict[str, str], body: dict[str, Any]) -> web.Response:
        if body.get("name") in self._indexes:
            raise ODataError(409, f"Cannot create index '{body['name']}' because it already exists.", "ResourceExists")
        return self._store_index(body)

    def _create_or_update_index(
        self, request: web.Request, params: dict[str, str], body: dict[str, Any]
    ) -> web.Response:
        if body.get("name") != params["index"]:
            raise _invalid(f"The index name '{body.get('name')}' does not match the name in the URL.")
        return self._store_index(body)

    def _store_index(self, body: dict[str, Any]) -> web.Response:
        name = body.get("name")
        if not isinstance(name, str) or not _INDEX_NAME.fullmatch(name):
            raise _invalid(f"Invalid index name '{name}': use lower-case letters, digits and single dashes.")
        fields, existing = _normalised_fields(body.get("fields")), self._indexes.get(name)
        for old in existing.definition["fields"] if existing else []:  # fields can be added, not changed or removed
            new = next((spec for spec in fields if spec["name"] == old["name"]), {})
            if any(old[attribute] != new.get(attribute) for attribute in ("type", "key", "searchable", "filterable")):
                raise _invalid(f"Existing field '{old['name']}' cannot be changed or removed.")
        self._etags += 1
        definition = {k: v for k, v in body.items() if not k.startswith("@odata.")} | {"fields": fields}
        index = self._indexes[name] = _Index(definition, f'"0x{self._etags:X}"', existing.docs if existing else {})
        for doc in index.docs.values():
            doc.update({spec["name"]: None for spec in fields if spec["name"] not in doc})
        return web.json_response(index.representation(), status=200 if existing else 201, headers={"ETag": index.etag})

    def _get_index(self, request: web.Request, params: dict[str, str], body: dict[str, Any]) -> web.Response:
        index = self._lookup(params["index"])
        return web.json_response(index.representation(), headers={"ETag": index.etag})

    def _delete_index(self, request: web.Request, params: dict[str, str], body: dict[str, Any]) -> web.Response:
        self._lookup(params["index"])
        del self._indexes[params["index"]]
        return web.Response(status=204)

    # Documents

    def _count(self, request: web.Request, params: dict[str, str], body: dict[str, Any]) -> web.Response:
        return web.Response(text=str(len(self._lookup(params["index"]).docs)), content_type="text/plain")

    def _get_document(self, request: web.Request, params: dict[str, str], body: dict[str, Any]) -> web.Response:
        index = self._lookup(params["index"])
        doc = index.docs.get(params["key"])
        if doc is None:
            raise ODataError(404, f"Document with key '{params['key']}' was not found.", "ResourceNotFound")
        return web.json_response({name: doc[name] for name in self._selected(index, request.query.get("$select"))})

    def _selected(self, index: _Index, select: Any) -> list[str]:
        names, fields = _names(select), index.fields
        if names in ([], ["*"]):
            return [name for name, spec in fields.items() if spec["retrievable"]]
        if unknown := [name for name in names if not fields.get(name, {}).get("retrievable")]:
            raise ODataError(400, f"Invalid expression: '{unknown[0]}' is not a retrievable field. Parameter: $select")
        return names

    def _index_documents(self, request: web.Request, params: dict[str, str], body: dict[str, Any]) -> web.Response:
        index, actions = self._lookup(params["index"]), body.get("value")
        if not isinstance(actions, list) or not 1 <= len(actions) <= MAX_ACTIONS:
            raise _invalid(f"actions : The items collection must have from 1 to {MAX_ACTIONS} valid items.")
        fields = index.fields
        # One action that does not fit the schema fails the whole request, before any action applies.
        for action in actions:
            if not isinstance(action, dict) or action.get("@search.action", "upload") not in _ACTIONS:
                raise _invalid(f"Invalid index action {json.dumps(action)[:200]}.")
            for name, value in action.items():
                if name != "@search.action" and name not in fields:
                    raise _invalid(f"The property '{name}' does not exist on type 'search.documentFields'.")
                if name != "@search.action" and not _fits(fields[name]["type"], value):
                    raise _invalid(f"Cannot convert {json.dumps(value)[:100]} to type '{fields[name]['type']}'.")
        results = [self._apply(index, action) for action in actions]
        index.writes += 1
        return web.json_response({"value": results}, status=200 if all(r["status"] for r in results) else 207)

    def _apply(self, index: _Index, action: dict[str, Any]) -> dict[str, Any]:
        key, kind = action.get(index.key), action.get("@search.action", "upload")
        values = {name: value for name, value in action.items() if name != "@search.action"}

        def result(status: int, error: str | None = None) -> dict[str, Any]:
            return {"key": key, "status": error is None, "errorMessage": error, "statusCode": status}

        if not isinstance(key, str) or not _DOC_KEY.fullmatch(key):
            return result(400, f"Invalid document key: '{key}'. Keys can only contain letters, digits, '_', '-', '='.")
        if self._item_failures.get(key):  # the service throttles single items of a batch under load
            self._item_failures[key] -= 1
            return result(503, "Service unavailable for this item; retry later.")
        for name, value in values.items():  # a filterable string is one term, and Lucene caps a term's size
            if index.fields[name]["filterable"] and isinstance(value, str) and len(value.encode()) > MAX_TERM_BYTES:
                return result(
                    400,
                    f"Field '{name}' contains a term that is too large to process. The max length for UTF-8 encoded"
                    f" terms is {MAX_TERM_BYTES} bytes.",
                )
        existing = index.docs.get(key)
        if kind == "delete":  # deleting an absent document succeeds, as on the service
            index.docs.pop(key, None)
        elif kind == "merge" and existing is None:
            return result(404, "Document not found.")
        elif kind == "upload" or existing is None:  # an upload replaces the document: unset fields become null
            index.docs[key] = {name: values.get(name) for name in index.fields}
            return result(200 if existing else 201)
        else:
            existing.update(values)
        return result(200)

    def _search(self, request: web.Request, params: dict[str, str], body: dict[str, Any]) -> web.Response:
        index = self._lookup(params["index"])
        fields = index.fields
        if unknown := sorted(set(body) - _SEARCH_PARAMS - _UNSUPPORTED):
            raise ODataError(400, f"The parameter '{unknown[0]}' is not a valid parameter for the operation 'search'.")
        if unsupported := sorted(name for name in _UNSUPPORTED if body.get(name) not in (None, [], "")):
            raise ODataError(400, f"'{unsupported[0]}' is not implemented by this test server.", "NotSupported")
        if (body.get("queryType") or "simple") != "simple":
            raise ODataError(400, f"queryType '{body['queryType']}' is not supported here; only 'simple' is.")
        mode, top, skip = body.get("searchMode") or "any", body.get("top"), body.get("skip") or 0
        if mode not in ("any", "all") or not isinstance(skip, int) or not 0 <= skip <= MAX_SKIP:
            raise _invalid("searchMode must be 'any' or 'all', and skip an integer from 0 to 100000.")
        if top is not None and (not isinstance(top, int) or top < 0):
            raise _invalid("top must be a non-negative integer.")
        search_fields = _names(body.get("searchFields")) or [n for n, spec in fields.items() if spec["searchable"]]
        if unknown := [name for name in search_fields if not fields.get(name, {}).get("searchable")]:
            raise ODataError(
                400, f"Invalid expression: '{unknown[0]}' is not a searchable field. Parameter: searchFields"
            )
        selected = self._selected(index, body.get("select"))
        predicate = _Filter(body["filter"], fields).parse() if body.get("filter") else None
        text = (body.get("search") or "").strip()
        if text in ("", "*"):
            scores = dict.fromkeys(index.docs, 1.0)
        else:
            scores = _bm25(index, search_fields, _tokens(text), mode)
        hits = [(key, score) for key, score in scores.items() if predicate is None or predicate(index.docs[key])]
        hits.sort(key=lambda hit: (-hit[1], hit[0]))
        for clause in reversed(_names(body.get("orderby"))):  # stable sorts, last clause first
            hits = self._ordered(index, hits, clause)
        page = hits[skip : skip + (DEFAULT_PAGE if top is None else min(top, MAX_PAGE))]
        rows = [{"@search.score": score} | {name: index.docs[key][name] for name in selected} for key, score in page]
        result: dict[str, Any] = {"value": rows} | ({"@odata.count": len(hits)} if body.get("count") else {})
        remaining = None if top is None else top - len(page)
        if skip + len(page) < len(hits) and (remaining is None or remaining > 0):
            following = {"skip": skip + len(page)} | ({} if remaining is None else {"top": remaining})
            result["@search.nextPageParameters"] = body | following
            result["@odata.nextLink"] = f"{self.endpoint}{request.path}?api-version={API_VERSION}"
        return web.json_response(result)

    def _ordered(self, index: _Index, hits: list[tuple[str, float]], clause: str) -> list[tuple[str, float]]:
        name, _, direction = clause.partition(" ")
        direction, spec = direction.strip() or "asc", index.fields.get(name, {})
        if direction not in ("asc", "desc") or not (name == "search.score()" or spec.get("sortable")):
            raise ODataError(400, f"Invalid expression: cannot order by '{clause}'. Parameter name: $orderby")
        if name == "search.score()":
            return sorted(hits, key=lambda hit: hit[1], reverse=direction == "desc")
        # Nulls come first in ascending order and last in descending order.
        return sorted(hits, key=lambda hit: _nulls_first(index.docs[hit[0]][name]), reverse=direction == "desc")
