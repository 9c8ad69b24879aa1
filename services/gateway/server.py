"""``ontofabric mcp``: an MCP server (the official SDK's low-level server) over stdio or streamable HTTP, that holds no
index. Each tool call is one request-reply to the query workers over NATS, on the workspace's subject; any number of
gateways can run beside each other.

A malformed argument comes back as a tool error naming the field (the worker validates it against the same
contract the tool's inputSchema is generated from); no worker answering is a retryable tool error within the
timeout, never a hang.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import re
import secrets
import socket
from collections.abc import Callable
from importlib.metadata import version
from typing import Any, get_args
from urllib.parse import urlsplit

import mcp_types as types
import uvicorn
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.streamable_http import REQUEST_CANCELLED
from mcp.server.transport_security import DEFAULT_MAX_REQUEST_BODY_SIZE
from mcp.shared.exceptions import MCPError
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, MODERN_PROTOCOL_VERSIONS
from nats.errors import (
    ConnectionClosedError,
    ConnectionDrainingError,
    NoRespondersError,
    OutboundBufferLimitError,
    StaleConnectionError,
)
from nats.errors import TimeoutError as NatsTimeoutError
from pydantic import ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ontofabric.contracts import MAX_REQUEST_BYTES, ErrorReply, QueryError
from ontofabric.contracts.documents import WORKSPACE
from ontofabric.contracts.query import ErrorCode, clipped
from ontofabric.services.query.client import ConnectionDown, QueryClient, RequestTooLarge
from ontofabric.services.query.requests import read_request, repeated_keys_by_item
from ontofabric.shared.half_characters import BYTE_ORDER_MARK, HALF_CHARACTER, surrogate_field
from ontofabric.shared.jetstream import PermissionDenied
from ontofabric.shared.logging import get_logger
from ontofabric.shared.lru import LruCache
from ontofabric.shared.subjects import Names
from ontofabric.shared.tasks import cancel_and_wait, watch_lateness
from ontofabric.shared.telemetry import meter

from .admission import (
    ARRIVED,
    BODY_READ_S,
    MIN_RETRY_AFTER_S,
    READ_FROM,
    AdmitRequests,
    Intake,
    LoopLag,
    body_within,
    refused_requests,
)
from .auth import ALL_WORKSPACES, CALLER, Grant, RequireBearer, TokenStore
from .bodies import peek_body, replaying
from .connections import BoundedConnections, connection_limit
from .link import NatsLink, NatsRefused, NatsUnavailable
from .stdio import (
    CHECKED_BYTES,
    NOT_A_REQUEST,
    ODD_ID,
    TOOL_ARGUMENTS,
    checked_request,
    not_utf8_error,
    repeat_refusal,
    repeated_key_answer,
    request_id_of,
    stdio_streams,
    too_deep_answer,
    tool_error,
    unreadable,
)
from .tools import (
    DEFAULT_ANSWER_TOKENS,
    TOOLS,
    ArgumentsRefused,
    ToolSpec,
    as_declared,
    fitted_text,
    forwarded,
    render,
    render_error,
    request_body,
    restated,
    shorter_texts,
)

log = get_logger(__name__)
NATS_CONNECTION_LOST = (ConnectionClosedError, ConnectionDrainingError, OutboundBufferLimitError, StaleConnectionError)
"""What a call meets when the connection it was sent on goes away under it."""

INSTRUCTIONS = (
    "ontofabric answers questions about a code base and its ontology: ontology_query searches it (hybrid retrieval "
    "with an honest _meta envelope), get_document reads one document, ontology_status says how fresh the index is."
)
_BY_NAME = {tool.name: tool for tool in TOOLS}

tool_calls = meter().create_histogram(
    "gateway.tool_calls.duration_ms",
    unit="ms",
    description="tool calls the MCP gateway handled, from their arrival to the answer, by tool ('unknown' for a name "
    "no tool has) and outcome (ok, the "
    "error's code: invalid_request, forbidden, not_found, overloaded, unavailable, deadline_exceeded, internal; or "
    "cancelled by the client)",
)
OUTCOMES = frozenset(get_args(ErrorCode)) | {"forbidden"}
UNKNOWN_TOOL = "unknown"
"""The ``tool`` of a call naming no tool of the gateway's (an SRE's 167 such calls were counted nowhere)."""
"""The error codes a tool's answer may begin with (a worker's, and the gateway's own forbidden): the outcome label
takes no other value, so a worker of another release cannot grow the metric's series."""


def outcome_of(result: types.CallToolResult) -> str:
    """``ok``, or the code a tool error's text begins with (``error overloaded (retryable ...``)."""
    if not result.is_error:
        return "ok"
    first = result.content[0] if result.content else None
    said = _ERROR_CODE.match(first.text) if isinstance(first, types.TextContent) else None
    return said[1] if said is not None and said[1] in OUTCOMES else "other"


_ERROR_CODE = re.compile(r"error (\w+)")


class Gateway:
    """The tools, forwarded to the query workers of one deployment (its NATS subject prefix)."""

    def __init__(
        self,
        link: NatsLink,
        names: Names,
        workspace: str | None,
        timeout_s: float,
        answer_tokens: int = DEFAULT_ANSWER_TOKENS,
    ) -> None:
        self._link = link
        self._answer_tokens = answer_tokens
        """The deployment's answer budget (ONTOFABRIC_ANSWER_MAX_TOKENS): a document's reply is held to it."""
        self._names = names
        self._workspace = workspace
        self._timeout_s = timeout_s
        self.server = Server(
            "ontofabric",
            version=version("ontofabric"),
            instructions=INSTRUCTIONS,
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
        )

    async def _list_tools(
        self, ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        if params is not None and params.cursor:  # one page, no cursor given out: the spec's -32602 ("" reads as none)
            raise MCPError(
                code=types.INVALID_PARAMS, message=f"unknown cursor {params.cursor!r}: the list has one page"
            )
        return types.ListToolsResult(tools=[_tool(spec) for spec in TOOLS])

    async def _call_tool(
        self, ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        spec = _BY_NAME.get(params.name)
        if spec is None:  # counted under one name: a client's made-up names would each make a series
            tool_calls.record(0.0, {"tool": UNKNOWN_TOOL, "outcome": "invalid_request"})
            raise MCPError(code=types.INVALID_PARAMS, message=f"unknown tool {params.name!r}")
        return await self.call(spec, dict(params.arguments or {}))

    async def call(self, spec: ToolSpec, arguments: dict[str, Any]) -> types.CallToolResult:
        """One tool call: the request to the workspace's worker, its reply as structured content and as text;
        its time and outcome recorded in ``gateway.tool_calls.duration_ms``."""
        loop = asyncio.get_running_loop()
        arrived = ARRIVED.get(loop.time())
        outcome = "internal"  # what an exception out of the call is, unless its client cancelled it
        try:
            result = await self._answer(spec, arguments)
            outcome = outcome_of(result)
            return result
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            tool_calls.record((loop.time() - arrived) * 1000, {"tool": spec.name, "outcome": outcome})

    async def _answer(self, spec: ToolSpec, arguments: dict[str, Any]) -> types.CallToolResult:
        arguments = as_declared(spec, arguments)
        caller = CALLER.get()
        workspace = arguments.get("workspace") or self._workspace or _only_workspace(caller)
        if caller is not None and isinstance(workspace, str) and not caller.allows(workspace):
            return tool_error(
                f"error forbidden (not retryable): the token of {caller.client!r} may not read workspace "
                f"{workspace!r}\n- workspace: one of {', '.join(caller.workspaces)}"
            )
        if workspace is None:
            readable = ""
            if caller is not None:
                any_one = ALL_WORKSPACES in caller.workspaces
                readable = ": any" if any_one else f": one of {', '.join(caller.workspaces)}"
            return tool_error(f"error invalid_request: no workspace\n- workspace: give the workspace to read{readable}")
        if self._workspace is not None and workspace != self._workspace:
            return tool_error(
                f"error invalid_request: this gateway serves workspace {self._workspace!r} only\n"
                "- workspace: leave it out, or give that one"
            )
        try:
            workspace = WORKSPACE.validate_python(workspace)
        except ValidationError as error:
            return tool_error(f"error invalid_request: bad workspace\n- workspace: {error.errors()[0]['msg']}")
        try:
            request = request_body(forwarded(spec, arguments, self._answer_tokens))
        except ArgumentsRefused as error:
            return tool_error(str(error))
        except (TypeError, ValueError) as error:  # not JSON: what a client's own parser let through
            return tool_error(f"error invalid_request: the arguments are not JSON ({error})")
        loop = asyncio.get_running_loop()
        arrived = ARRIVED.get(loop.time())
        ends = arrived + self._timeout_s
        waited_s = loop.time() - arrived
        if waited_s > self._timeout_s / 2:  # most of its time went before the gateway could read it
            refused_requests.add(1, {"reason": "waited"})
            log.warning(
                "gateway_call_refused",
                reason="waited",
                waited_ms=round(waited_s * 1000),
                caller=None if caller is None else caller.client,
            )
            # The calls ahead of it took that long to read: one sent sooner would queue behind them. (Its own slow
            # upload counts too: at most a call's time.)
            retry_after_ms = round(min(max(MIN_RETRY_AFTER_S, waited_s), self._timeout_s) * 1000)
            return tool_error(
                f"error overloaded (retryable: try again in about {retry_after_ms} ms): the call "
                f"waited {waited_s * 1000:.0f} ms for this gateway to read it"
            )
        try:
            try:
                # The connection counts against the call's time: a connect that hangs would otherwise hold every
                # call that waits for it with no answer.
                async with asyncio.timeout_at(ends):
                    nc = await self._link.client()
                left_s = ends - loop.time()
                if left_s <= 0:
                    raise TimeoutError  # none left for the request
            except TimeoutError:
                raise NatsUnavailable(f"no connection to NATS within {self._timeout_s:g} s") from None
            client = QueryClient(nc, self._names, left_s)
            raw = await client.send_raw(workspace, request, spec.operation)
        except NatsRefused as error:  # before NatsUnavailable, which it is a kind of
            return tool_error(f"error forbidden (not retryable: the gateway's NATS credentials need mending): {error}")
        except NatsUnavailable as error:
            return invalid_here(spec, arguments, request) or tool_error(
                f"error unavailable (retryable: try again): {error}"
            )
        except NoRespondersError:
            return invalid_here(spec, arguments, request) or tool_error(
                f"error unavailable (retryable: try again): no query worker is serving workspace {workspace!r}"
            )
        except ConnectionDown as error:  # the link's connection went down while the request waited
            return tool_error(f"error unavailable (retryable: try again): {error}")
        except (NatsTimeoutError, TimeoutError):
            return tool_error(f"error unavailable (retryable: try again): no answer within {self._timeout_s:g} s")
        except NATS_CONNECTION_LOST as error:  # the link replaced it (the server moved) while the call was on it
            return tool_error(f"error unavailable (retryable: try again): the connection to NATS was lost ({error})")
        except PermissionDenied:
            return tool_error(
                f"error forbidden (not retryable): this gateway's credentials may not read workspace {workspace!r}"
            )
        except RequestTooLarge as error:
            return tool_error(f"error invalid_request: the arguments are too large\n- request: {error}")
        try:
            data = json.loads(raw)
            if isinstance(data, dict) and "error" in data:
                return tool_error(render_error(restated(spec, arguments, ErrorReply.model_validate(data))))
            reply = spec.reply.model_validate(data)
        except ValueError as error:  # ValidationError too: a worker of another version, or a broken reply
            log.warning("reply_unreadable", tool=spec.name, error=str(error)[:300])
            return tool_error("error internal (retryable: try again): the query worker's reply could not be read")
        # The reply as this gateway's contract reads it, which is what its outputSchema says: a worker of another
        # version may send a value the contract only coerces ("5" for 5), which a client's check of the schema
        # refused.
        structured = reply.model_dump(mode="json")

        def envelope_bytes() -> int:  # the result without its text, as JSON with every default written (an upper bound)
            empty = types.CallToolResult(content=[types.TextContent(text="")], structured_content=structured)
            return len(empty.model_dump_json(by_alias=True, exclude_none=True).encode())

        text = render(reply, arguments)
        text = fitted_text(spec, arguments, text, envelope_bytes, lambda: shorter_texts(reply, arguments))
        return types.CallToolResult(content=[types.TextContent(text=text)], structured_content=structured)

    async def serve_stdio(self) -> None:
        async with stdio_streams() as (read, write):
            await self.server.run(read, write, self.server.create_initialization_options())

    async def serve_http(
        self, host: str, port: int, tokens: TokenStore, intake: Intake, allowed_origins: frozenset[str] = frozenset()
    ) -> None:
        """Streamable HTTP at ``http://HOST:PORT/mcp``, stateless, answering in JSON: the tools never call back to
        the client, so any request can go to any gateway (several behind a load balancer need no sticky sessions).
        Every request needs a bearer token on record and reads only that token's workspaces; on loopback, only
        while there is a tokens file (see :class:`RequireBearer`).
        """
        sdk_app = self.server.streamable_http_app(
            streamable_http_path=MCP_PATH, host=host, stateless_http=True, json_response=True
        )
        # /mcp/ was redirected to whatever Host the request named, before the SDK's Host check (a red team's);
        # RequestFraming serves it as /mcp instead.
        sdk_app.router.redirect_slashes = False
        lag = LoopLag()
        app: ASGIApp = Batches(AdmitRequests(CancelledWithClient(MisreadBodies(sdk_app)), intake, lag))
        bearer = RequireBearer(
            NoEventStreams(PostedJson(app)), tokens, open_without_tokens=is_loopback(host), served_path=MCP_PATH
        )
        app = RequestFraming(
            bearer, None if is_loopback(host) else allowed_origins, pages_need_tokens=lambda: not bearer.open_to_all()
        )
        BoundedConnections.limit = connection_limit()
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", lifespan="on", http=BoundedConnections,
            timeout_keep_alive=KEEP_ALIVE_S,
        )  # fmt: skip
        # Bound here, not by uvicorn: a port in use was its plain-text log line and exit 3 (an independent tester).
        listening = listen_on(host, port)
        watching = asyncio.create_task(watch_lateness(lag.observe), name="gateway-loop-lag")
        try:
            await uvicorn.Server(config).serve(sockets=listening)
        finally:
            await cancel_and_wait(watching)
            for sock in listening:
                sock.close()


KEEP_ALIVE_S = 75
"""How long an idle connection is kept between requests: past its clients' own (httpx and Node's 5 s or less), so
that the gateway does not close one as a client sends on it. At uvicorn's 5 s a soak tester's clients pausing 5 s
between calls lost 2 calls in 160 to a reset, and the MCP Python SDK ends its session on one. Bounded by the
connections the gateway holds (connections.py)."""


class ListenRefused(Exception):
    """The HTTP gateway's address cannot be listened on (in use, not this machine's, not permitted)."""


def listen_on(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on every address ``host`` resolves to (``localhost``: IPv4 and IPv6 alike), as asyncio's
    own server binds them; ListenRefused, naming the address, when one cannot be."""
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    sockets: list[socket.socket] = []
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, protocol, _, address in dict.fromkeys(found):
            sock = socket.socket(family, kind, protocol)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # the IPv4 address gets its own socket
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(2048)
            sock.setblocking(False)
    except OSError as error:
        for sock in sockets:
            sock.close()
        raise ListenRefused(f"the gateway cannot listen on {shown}: {error.strerror or error}") from None
    return sockets


MCP_PATH = "/mcp"
"""Where the SDK's app serves MCP (its default)."""


class RequestFraming:
    """ASGI middleware, outermost: requests a proxy in front could read otherwise than the gateway, or that come from
    a browser page the gateway does not know.

    - ``Content-Length`` beside ``Transfer-Encoding``: refused 400, and the connection closed. RFC 9112 (6.3) has a
      server close it after answering such a request; a red team's second request, sent on in the same bytes, was
      read and answered as a request of its own, where a proxy framing by the length would have seen one.
    - Beyond loopback, a request stating an ``Origin`` not in ``allowed_origins`` (or more than one): refused 403
      (MCP's transport: servers must check Origin, against DNS rebinding). One allowed is answered as CORS has a
      browser page ask: its preflight (OPTIONS) at once, and the answer readable by it; without that a page could
      not call at all, its bearer token needing a preflight (a verifier's). ``allowed_origins`` None: on loopback,
      where the SDK checks Origin and Host itself, and pages served from loopback (its own rule) are answered so
      while they need a token (``pages_need_tokens``: a tokens file exists): their preflight had been refused 401
      for want of the token it asks leave to send (an outside tester's, the MCP Inspector's direct connection).
      Open to all, no page is answered so: any program serving pages on the host could read through it."""

    def __init__(
        self, app: ASGIApp, allowed_origins: frozenset[str] | None, pages_need_tokens: Callable[[], bool]
    ) -> None:
        self._app = app
        self._allowed_origins = None if allowed_origins is None else frozenset(map(web_origin, allowed_origins))
        self._pages_need_tokens = pages_need_tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        if scope.get("path") == f"{MCP_PATH}/":  # a client configured so was redirected, and followed it
            scope = {**scope, "path": MCP_PATH, "raw_path": MCP_PATH.encode()}
        headers = dict(scope["headers"])
        if b"transfer-encoding" in headers and b"content-length" in headers:
            message = "a request states both Content-Length and Transfer-Encoding (RFC 9112, 6.3)"
            error = {"code": types.INVALID_REQUEST, "message": message}
            await _answer_json(send, 400, {"jsonrpc": "2.0", "id": None, "error": error}, close=True)
            return
        origins = [value.decode("latin-1") for name, value in scope["headers"] if name == b"origin"]
        if self._allowed_origins is None:  # on loopback the SDK refuses other pages than loopback ones itself
            loopback_page = len(origins) == 1 and origins[0].startswith(LOOPBACK_PAGES)
            if not loopback_page or not self._pages_need_tokens():  # open to all: no page reads it (a review's)
                await self._app(scope, receive, send)
                return
        elif not origins:
            await self._app(scope, receive, send)
            return
        elif len(origins) > 1 or web_origin(origins[0]) not in self._allowed_origins:
            message = f"Origin {', '.join(origins)} is not allowed here (ONTOFABRIC_GATEWAY_ALLOWED_ORIGINS)"
            error = {"code": types.INVALID_REQUEST, "message": message}
            await _answer_json(send, 403, {"jsonrpc": "2.0", "id": None, "error": error})
            return
        allowed = [(b"access-control-allow-origin", origins[0].encode("latin-1")), (b"vary", b"Origin")]
        if scope.get("method") == "OPTIONS":
            asked = headers.get(b"access-control-request-headers", b"")
            preflight = [
                *allowed,
                (b"access-control-allow-methods", b"POST"),
                (b"access-control-allow-headers", asked or b"authorization, content-type, mcp-protocol-version"),
                (b"access-control-max-age", b"600"),
            ]
            await send({"type": "http.response.start", "status": 204, "headers": preflight})
            await send({"type": "http.response.body", "body": b""})
            return

        async def readable(message: Message) -> None:
            if message["type"] == "http.response.start":
                exposed = [(b"access-control-expose-headers", b"mcp-session-id, www-authenticate")]
                message = {**message, "headers": [*message.get("headers", []), *allowed, *exposed]}
            await send(message)

        await self._app(scope, receive, readable)


LOOPBACK_PAGES = ("http://127.0.0.1:", "http://localhost:", "http://[::1]:")
"""The origins the MCP SDK lets call a gateway on loopback (``streamable_http_app``'s defaults there)."""


def web_origin(text: str) -> str:
    """An origin as browsers state it: scheme and host in lower case, without a default port or a trailing slash
    (a setting written ``https://IDE.example:443/`` matches what a browser sends)."""
    parts = urlsplit(text.strip().rstrip("/"))
    scheme, host = parts.scheme.lower(), (parts.hostname or "").lower()
    if not scheme or not host:  # `null` (an opaque origin) as itself: as "://" it matched any other such text
        return text.strip().lower()
    try:
        port = parts.port
    except ValueError:
        return text
    default = {"http": 80, "https": 443}.get(scheme)
    shown = f"[{host}]" if ":" in host else host
    return f"{scheme}://{shown}" + (f":{port}" if port is not None and port != default else "")


class NoEventStreams:
    """ASGI middleware: every method but POST is answered 405 (``Allow: POST``). A GET for a stream of messages the
    server sends unasked, as MCP allows: the
    tools never call back, so the stream would stay silent; the stateless SDK app held one open per client for as
    long as it stayed connected, past the limit on requests held (which counts POSTs), once the gateway gave
    session ids (a review's finding: 100 Python clients, 100 open connections)."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = scope.get("method")
        if scope["type"] != "http" or method == "POST" or scope.get("path") != MCP_PATH:
            await self._app(scope, receive, send)  # other paths as the SDK serves them (a discovery's 404)
            return
        # Every other method too, each 405 saying what is allowed: the SDK's said GET and DELETE to a PUT while
        # answering both 405 itself, and its DELETE's said nothing (a tester's; RFC 9110, 15.5.6).
        why = {"GET": "this server sends nothing unasked", "DELETE": "this server keeps no session to end"}
        error = {"code": types.INVALID_REQUEST, "message": f"Method Not Allowed: {why.get(str(method), 'POST only')}"}
        body = json.dumps({"jsonrpc": "2.0", "id": None, "error": error}).encode()
        await send({"type": "http.response.start", "status": 405, "headers": [*_JSON_HEADERS, (b"allow", b"POST")]})
        await send({"type": "http.response.body", "body": b"" if method == "HEAD" else body})


class PostedJson:
    """ASGI middleware: a POST to the MCP path is read only as a JSON body sent as it is, and told so otherwise with
    a JSON-RPC error (415), where the SDK answered a compressed body "Parse error", a body of another type a plain-text
    400 on loopback, and a media type in capitals (``Application/JSON``, the same type by RFC 9110, 8.3.1) 415 (an
    outside tester's three). The media type goes on in lower case."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") != MCP_PATH:
            await self._app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        encodings = [v.decode("latin-1").strip() for n, v in scope["headers"] if n == b"content-encoding"]
        encoding = ", ".join(e for e in encodings if e.lower() not in ("", "identity"))  # every one stated counts
        stated = headers.get(b"content-type", b"").decode("latin-1")
        media_type, separator, parameters = stated.partition(";")
        if encoding:
            refused = f"Content-Encoding {encoding} is not read here: send the body uncompressed"
        elif media_type.strip().lower() != "application/json":
            refused = f"Content-Type must be application/json, not {stated.strip() or 'none'}"
        else:
            typed = ("application/json" + separator + parameters).encode("latin-1")
            others = [(name, value) for name, value in scope["headers"] if name != b"content-type"]
            await self._app({**scope, "headers": [*others, (b"content-type", typed)]}, receive, send)
            return
        error = {"code": types.INVALID_REQUEST, "message": refused}
        await _answer_json(send, 415, {"jsonrpc": "2.0", "id": None, "error": error}, close=True)  # body unread


class MisreadBodies:
    """ASGI middleware: bodies the SDK's HTTP transport misreads are answered here, as they are over stdio.

    - Half of a character (a lone UTF-16 surrogate escape, as a JavaScript client cutting an emoji writes): the SDK
      refused the body as a whole ("Parse error", HTTP 400, id null), so the client's SDK threw instead of the
      caller hearing what was wrong. A tool call gets a tool error naming the argument, as over stdio; another
      request a JSON-RPC error naming the field, under its id.
    - An id that is neither a string nor an integer (null, 1.5, true, an object): the SDK took the message for a
      notification and answered 202 with nothing, so its caller waited for ever. It gets an invalid request error.
    - A batch (JSON-RPC's array of requests, which MCP no longer has), or JSON that is no object at all (``null``,
      ``123``): an invalid request, as over stdio, where the SDK answered an invalid-params error holding a
      validation dump.
    - A request whose envelope or params do not fit (``jsonrpc`` "1.0", ``params`` an array, ``arguments`` a
      string, no tool name): the SDK answered a validation dump under id null, or "Invalid request parameters"; it
      gets the error stdio gives, naming the field, under its id (id null for a message that has none).
    - Bytes that are not UTF-8 (text a client sent in another encoding): the SDK answered a parse error under id
      null; it gets an error under its id naming the field, as over stdio.
    - An ``MCP-Protocol-Version`` header naming no version the SDK speaks: the SDK asked for ``params._meta``
      envelope keys; the answer names the header, the versions spoken and the one asked for.
    - A request naming a key twice in one object: the SDK kept the last value without a word
      (:func:`~.stdio.repeated_key_answer`).
    - A request nested deeper than the SDK's parser reads: a parse error under id null
      (:func:`~.stdio.too_deep_answer`).

    A body past the SDK's own limit is answered 413 with a JSON-RPC error: unread when its declared length says so,
    else once that much of it came."""

    def __init__(self, app: ASGIApp, max_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_SIZE) -> None:
        self._app = app
        self._max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = _json_post(scope, self._max_body_bytes)
        if headers is None:
            declared = _declared_length(scope)
            if declared is not None and declared > self._max_body_bytes:
                # The SDK's 413 was plain text; a JSON-RPC client reads an error (a tester's 6 MB call).
                await self._too_large(send, f"{declared} bytes")
                return
            await self._app(scope, receive, send)
            return
        read, body = await peek_body(receive, self._max_body_bytes)
        if read and read[-1]["type"] == "http.disconnect":
            # The body did not come whole in time (or its client left, which reads no answer): the SDK answered a
            # slow body 500 "Error handling POST request", with an error-level traceback each (a red team's).
            message = "the request's body did not arrive whole in time"
            error = {"code": types.INVALID_REQUEST, "message": message}
            await _answer_json(send, 408, {"jsonrpc": "2.0", "id": None, "error": error}, close=True)
            return
        size = sum(len(m.get("body", b"")) for m in read if m["type"] == "http.request")
        if size > self._max_body_bytes and read[-1]["type"] == "http.request":  # not a client that left
            # A body sent in chunks states no length: the SDK read it and answered plain text (a verifier's).
            await self._too_large(send, f"{size} bytes" if body is not None else f"over {size} bytes")
            return
        version = headers.get(b"mcp-protocol-version", b"").decode("latin-1")
        answer = None if body is None else _answer_to_unknown_version(version, body) or _answer_to_misread(body)
        if answer is None:
            await self._app(scope, replaying(read, receive), send)
            return
        status, reply = answer
        await send({"type": "http.response.start", "status": status, "headers": _JSON_HEADERS if reply else []})
        await send({"type": "http.response.body", "body": json.dumps(reply).encode() if reply else b""})

    async def _too_large(self, send: Send, size: str) -> None:
        message = f"the request is {size}, more than the {self._max_body_bytes} bytes this gateway reads"
        error = {"code": types.INVALID_REQUEST, "message": message}
        await _answer_json(send, 413, {"jsonrpc": "2.0", "id": None, "error": error})


BATCH_VERSIONS = ("2025-03-26", "")
"""The protocol versions whose requests may come as a JSON-RPC batch; none named (no MCP-Protocol-Version header):
a server assumes 2025-03-26 (MCP 2025-06-18, "Protocol Version Header")."""
REQUEST_REFUSALS = frozenset({403, 406, 415, 421})
"""Statuses by which the SDK refuses an HTTP request for its headers (origin, Accept, content type, host), whatever
message it carries: in a batch, the batch's answer (a tester got 200 and an error per message instead)."""
MAX_BATCH = 16
"""The most messages one batch may hold: each is worked on at once, as that many requests would be."""


class Batches:
    """ASGI middleware: a JSON-RPC batch, which MCP's 2025-03-26 revision requires a server to take (later ones
    dropped it; a conformance tester's finding). Each message goes on through the rest of the app as a request of
    its own, all at once: each is admitted (or refused overloaded), timed from its arrival, cancellable and
    answered as if it came alone (a review found a first version, inside MisreadBodies, let a batch past the
    admission, ran its calls one after another on the first one's clock, and had no bound). The answers go back
    together; a batch of notifications only gets 202. At most ``MAX_BATCH`` messages; ``initialize`` is refused
    in a batch, as MCP says. A refusal of the HTTP request itself (an origin or a host the SDK refuses) answers
    the whole batch as it would a request alone. Other protocol versions get MisreadBodies' refusal."""

    def __init__(
        self, app: ASGIApp, max_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_SIZE, body_read_s: float = BODY_READ_S
    ) -> None:
        self._app = app
        self._max_body_bytes = max_body_bytes
        self._body_read_s = body_read_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = _json_post(scope, self._max_body_bytes)
        if headers is None or headers.get(b"mcp-protocol-version", b"").decode("latin-1") not in BATCH_VERSIONS:
            await self._app(scope, receive, send)
            return
        # Within admission's time for a body: read here, before admission, it was not bounded (a tester's 200-byte
        # body, 18 bytes of it sent, held its request open for minutes). Admission counts from now.
        started = asyncio.get_running_loop().time()
        receive = body_within(receive, started + self._body_read_s)
        read, body = await peek_body(receive, self._max_body_bytes)
        batch = None if body is None else _json_array(body)
        read_from = READ_FROM.set(started)
        try:
            if batch is None:
                await self._app(scope, replaying(read, receive), send)
            else:
                assert body is not None
                if len(body) > MAX_BATCH * CHECKED_BYTES:  # holds a message larger than any read for repeats
                    why = f"a batch of at most {MAX_BATCH * CHECKED_BYTES} bytes is taken: send its messages alone"
                    await _answer_json(send, 400, {"jsonrpc": "2.0", "id": None, "error": _invalid(why)})
                    return
                # Read from the bytes: parsed, each message kept a key's last value (a review's).
                await self._answer(scope, batch, repeated_keys_by_item(body), send, receive)
        finally:
            READ_FROM.reset(read_from)

    async def _answer(
        self, scope: Scope, batch: list[Any], repeats: dict[int, str], send: Send, receive: Receive
    ) -> None:
        if not batch or len(batch) > MAX_BATCH:
            why = "an empty batch" if not batch else f"a batch of at most {MAX_BATCH} messages is taken"
            await _answer_json(send, 400, {"jsonrpc": "2.0", "id": None, "error": _invalid(why)})
            return
        client_gone = asyncio.Event()
        watching = asyncio.create_task(_until_gone(receive, client_gone), name="batch-client")
        try:
            replies = await asyncio.gather(
                *(self._alone(scope, message, client_gone, repeats.get(n)) for n, message in enumerate(batch))
            )
        finally:
            watching.cancel()
        answers = []
        for status, reply_headers, answered in replies:
            if not answered:
                continue  # a notification's 202
            try:
                answers.append(json.loads(answered))
            except ValueError:
                refused_itself = True
            else:
                refused_itself = status in REQUEST_REFUSALS
            if refused_itself:  # the HTTP request's refusal (its headers'), not a message's: the batch's answer
                await send({"type": "http.response.start", "status": status, "headers": reply_headers})
                await send({"type": "http.response.body", "body": answered})
                return
        if answers:
            await _answer_json(send, 200, answers)
        else:
            await send({"type": "http.response.start", "status": 202, "headers": []})
            await send({"type": "http.response.body", "body": b""})

    async def _alone(
        self, scope: Scope, message: Any, client_gone: asyncio.Event, repeated: str | None = None
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """``message`` answered as a request of its own: the status, headers and body of the answer. ``repeated``:
        the key it named twice, if any (its parsed form holds the last value only)."""
        if isinstance(message, list):
            return (
                200,
                [],
                json.dumps({"jsonrpc": "2.0", "id": None, "error": _invalid("a batch within a batch")}).encode(),
            )
        if isinstance(message, dict) and message.get("method") == "initialize":
            refused = _invalid("initialize may not be part of a batch (MCP 2025-03-26): send it alone")
            return 200, [], json.dumps({"jsonrpc": "2.0", "id": request_id_of(message), "error": refused}).encode()
        body = json.dumps(message).encode()
        read_here = repeat_refusal(message, repeated) if repeated is not None else too_deep_answer(body)
        if read_here is not None:
            return 200, [], json.dumps(_as_sent(read_here)).encode()
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        alone = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        sent: list[Message] = []
        handed = False

        async def receive() -> Message:
            nonlocal handed
            if not handed:
                handed = True
                return {"type": "http.request", "body": body, "more_body": False}
            await client_gone.wait()  # the batch's client went away: each message's call with it
            return {"type": "http.disconnect"}

        async def capture(reply: Message) -> None:
            sent.append(reply)

        try:
            await self._app(alone, receive, capture)
        except Exception:  # one message's failure is its answer, and stops none of the others (a review's)
            log.exception("gateway_batch_message_failed")
            refused = {"code": types.INTERNAL_ERROR, "message": "this message failed in the gateway; see its log"}
            answer = {"jsonrpc": "2.0", "id": request_id_of(message), "error": refused}
            return 200, [], json.dumps(answer).encode()
        start = next((reply for reply in sent if reply["type"] == "http.response.start"), {})
        answered = b"".join(reply.get("body", b"") for reply in sent if reply["type"] == "http.response.body")
        return int(start.get("status", 500)), list(start.get("headers", [])), answered


async def _until_gone(receive: Receive, client_gone: asyncio.Event) -> None:
    """Sets ``client_gone`` when the batch's client goes away (its body is read: what comes next is that)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    client_gone.set()


def _invalid(message: str) -> dict[str, Any]:
    return {"code": types.INVALID_REQUEST, "message": message}


async def _answer_json(send: Send, status: int, answer: Any, close: bool = False) -> None:
    """``close``: the connection ends after this answer."""
    headers = [*_JSON_HEADERS, (b"connection", b"close")] if close else _JSON_HEADERS
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": json.dumps(answer).encode()})


def _json_array(body: bytes) -> list[Any] | None:
    """The body as a JSON array (a batch); None when it is not one."""
    if body.lstrip()[:1] != b"[":
        return None
    try:
        found = json.loads(body.decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    return found if isinstance(found, list) else None


def _json_post(scope: Scope, max_body_bytes: int) -> dict[bytes, bytes] | None:
    """The headers of a POST of JSON whose declared length is within ``max_body_bytes``; None for any other request
    (the SDK's own 400 says what is wrong with another content type; MisreadBodies answers one too large before
    its body is sent)."""
    if scope["type"] != "http" or scope.get("method") != "POST":
        return None
    headers = dict(scope.get("headers", []))
    declared = _declared_length(scope)
    too_large = declared is not None and declared > max_body_bytes
    return None if b"json" not in headers.get(b"content-type", b"").lower() or too_large else headers


def _declared_length(scope: Scope) -> int | None:
    """The body's length as a POST's ``Content-Length`` states it; None when it states none."""
    if scope["type"] != "http" or scope.get("method") != "POST":
        return None
    declared = dict(scope.get("headers", [])).get(b"content-length", b"")
    return int(declared) if declared.isdigit() else None


_JSON_HEADERS = [(b"content-type", b"application/json")]


def _as_sent(answer: types.JSONRPCResponse | types.JSONRPCError) -> dict[str, Any]:
    """An answer as JSON-RPC writes it: its id kept when null (an error to a message with no readable id)."""
    return {"id": None, **answer.model_dump(mode="json", by_alias=True, exclude_none=True)}


def _json_object(body: bytes) -> dict[str, Any] | None:
    """The body as a JSON object; None when it is not one (not JSON, nested past the parser, an array ...)."""
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return parsed if isinstance(parsed, dict) else None


def _answer_to_misread(body: bytes) -> tuple[int, dict[str, Any] | None] | None:
    """The HTTP status and JSON-RPC answer to a body the SDK would misread (None for no answer: a notification),
    or None when the SDK reads it right."""
    if (refused := not_utf8_error(body)) is not None:
        return 400, refused.model_dump(mode="json", by_alias=True, exclude_none=True)
    if body.startswith(codecs.BOM_UTF8):  # the SDK's "Parse error: expected value at line 1 column 1" (a tester's)
        return 400, {"jsonrpc": "2.0", "id": None, "error": {"code": types.PARSE_ERROR, "message": BYTE_ORDER_MARK}}
    if body.lstrip()[:1] != b"{":  # a batch or a lone value: the SDK answered -32602 with a pydantic dump
        try:
            found = json.loads(body.decode("utf-8"))  # not bytes: json reads a BOM or UTF-16 there, the SDK does not
        except (ValueError, RecursionError):
            return None  # not JSON: the SDK's parse error says so
        if isinstance(found, list):
            message = "a batch (a JSON array) is not taken under this protocol version: send each request alone"
        else:
            message = f"{NOT_A_REQUEST}: message: Input should be an object"
        return 400, {"jsonrpc": "2.0", "id": None, "error": {"code": types.INVALID_REQUEST, "message": message}}
    if (read_here := too_deep_answer(body) or repeated_key_answer(body)) is not None:
        return (200 if isinstance(read_here, types.JSONRPCResponse) else 400), _as_sent(read_here)
    field = surrogate_field(body)
    odd_id = field is None and b'"id"' in body
    if field is None and not odd_id:
        # Without an id, a notification or nothing the SDK reads: it answered the latter -32602 with a pydantic
        # dump of every message type (a tester's {"method": "ping"}), where stdio names the field.
        parsed = _json_object(body)
        return None if parsed is None else _answer_to_ill_framed(parsed, body)
    parsed = _json_object(body)
    if parsed is None:
        return None
    if odd_id:
        if "id" not in parsed:  # "id" only inside it (an argument's name): no id of its own
            return _answer_to_ill_framed(parsed, body)
        if request_id_of(parsed) is not None:
            return _answer_to_ill_formed(parsed, body)
        error = {
            "code": types.INVALID_REQUEST,
            "message": f"{NOT_A_REQUEST}: {ODD_ID}",
        }
        return 400, {"jsonrpc": "2.0", "id": None, "error": error}
    if "id" not in parsed:  # a notification: accepted, nothing to answer
        return 202, None
    assert field is not None
    if parsed.get("method") == "tools/call" and field.startswith(TOOL_ARGUMENTS):
        argument = field.removeprefix(TOOL_ARGUMENTS)
        text = f"error invalid_request: the arguments are not text\n- {clipped(argument)}: {HALF_CHARACTER}"
        result = tool_error(text).model_dump(mode="json", by_alias=True, exclude_none=True)
        return 200, {"jsonrpc": "2.0", "id": request_id_of(parsed), "result": result}
    error = {"code": types.INVALID_PARAMS, "message": f"{clipped(field)}: {HALF_CHARACTER}"}
    return 200, {"jsonrpc": "2.0", "id": request_id_of(parsed), "error": error}


def _answer_to_unknown_version(version: str, body: bytes) -> tuple[int, dict[str, Any]] | None:
    """The answer to a request whose ``MCP-Protocol-Version`` header names no version the SDK speaks: the SDK took
    it for a newer one and asked for ``params._meta`` envelope keys, naming neither the header nor the versions."""
    supported = [*HANDSHAKE_PROTOCOL_VERSIONS, *MODERN_PROTOCOL_VERSIONS]
    if not version or version in supported:
        return None
    error = {
        "code": types.UNSUPPORTED_PROTOCOL_VERSION,
        "message": f"the MCP-Protocol-Version header names {version!r}, a version this server does not speak",
        "data": {"supported": supported, "requested": version},
    }
    return 400, {"jsonrpc": "2.0", "id": request_id_of(_json_object(body)), "error": error}


def _answer_to_ill_framed(message: dict[str, Any], body: bytes) -> tuple[int, dict[str, Any]] | None:
    """The answer to a message whose envelope the SDK refuses without naming the field (a pydantic dump under id
    null), as stdio answers it (stdio.unreadable); None when the envelope is one the SDK reads."""
    try:
        types.jsonrpc_message_adapter.validate_python(message, by_name=False)
    except ValidationError as refused:
        answer = unreadable(body, refused)
        assert answer is not None
        return 400, _as_sent(answer)
    return None


def _answer_to_ill_formed(request: dict[str, Any], body: bytes) -> tuple[int, dict[str, Any]] | None:
    """The answer to a request whose envelope or params the SDK refuses without naming the field (a pydantic dump
    under id null, or "Invalid request parameters"), as stdio answers it (stdio.unreadable, SessionOpening); None
    when the SDK reads it right."""
    if (ill_framed := _answer_to_ill_framed(request, body)) is not None:
        return ill_framed
    problem = checked_request(request)
    if not isinstance(problem, str):
        return None
    error = {"code": types.INVALID_PARAMS, "message": problem}
    return 200, {"jsonrpc": "2.0", "id": request_id_of(request), "error": error}


PEEKED_BODY_BYTES = 64 * 1024
"""How much of a POST's body the gateway reads for its JSON-RPC id and method; a larger one is not cancellable."""
CALLS_REMEMBERED = 4096
"""How many ended calls, and cancellations of calls not yet seen, the gateway remembers (by caller and id)."""
RECENT_END_S = 60.0
"""A cancellation naming a call of its caller that ended this recently is late, whatever else holds the id."""
EARLY_CANCEL_S = 5.0
"""How long a cancellation naming no call yet waits for the call to take its id."""
SESSION_HEADER = b"mcp-session-id"
SESSION_ID_CHARACTERS = frozenset(range(0x21, 0x7F))
"""What MCP allows in a session id (visible ASCII); a header with anything else, or longer than 128, is not read."""
CallKey = tuple[str, str, int | str]
"""A call as a cancellation names it: its token's client name, its session and its JSON-RPC id ("" for none)."""


class CancelledWithClient:
    """ASGI middleware: a request whose client goes away before its answer, or cancels it, is cancelled, and with
    it the call to the query workers.

    - Gone: stateless and answering in JSON, the SDK's app never looks at the connection again once it has read the
      body, so a call whose client had given up ran its whole timeout and was sent to the workers a second time
      (``QueryClient``'s resend for a worker lost mid-request): five clients that left after 1 s made ten requests
      to a slow worker. The server says a client has gone by answering ``receive`` with ``http.disconnect``, which
      it also does once the response is complete: that one is not a departure.
    - Cancelled: ``notifications/cancelled`` comes in a POST of its own, which a stateless app reads apart from the
      call it names, so the call ran on (a tester's TypeScript client aborted after 1 s; the gateway resent to the
      workers for 10 s). The call it names is cancelled here and answered with an error its client no longer reads
      (HTTP needs an answer). Only a caller with a token or a session (below): calls are told apart by the caller's
      client name, session and id, and without either one client could cancel another's call of the same id.
      Sessions without an id on one token number their calls alike, and a cancellation may come after its call
      has ended (MCP allows it): one naming an id held by more than one call, or by a call of that caller that
      ended within ``RECENT_END_S``, cancels nothing (a review's finding: a late one cancelled the other session's
      call). One that names no call yet (its body still arriving) cancels the call that takes the id within
      ``EARLY_CANCEL_S``. A gateway cancels only the calls it serves: behind a load balancer, a cancellation sent
      to another gateway does nothing.
    - Sessions: the answer to ``initialize`` carries an ``Mcp-Session-Id`` of its own (random), which MCP clients
      send with every request after it. It keeps no state (any gateway serves any session, and none is ever
      unknown): it only tells calls apart, so that a client without a token can cancel its own calls and two
      sessions on one token no longer number theirs alike (a TypeScript client's timeout had cancelled nothing
      through a gateway open on loopback)."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app
        self._calls: dict[CallKey, list[asyncio.Future[None]]] = {}
        self._cancelled: set[asyncio.Future[None]] = set()
        self._ended: LruCache[CallKey, float] = LruCache(CALLS_REMEMBERED)
        self._early: LruCache[CallKey, float] = LruCache(CALLS_REMEMBERED)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":  # a GET stream sees its client go itself
            await self._app(scope, receive, send)
            return
        body_read = asyncio.Event()
        body = bytearray()
        answered = started = False

        async def reading() -> Message:
            message = await receive()
            if message["type"] == "http.request" and len(body) <= PEEKED_BODY_BYTES:
                body.extend(message.get("body", b""))
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                body_read.set()
            return message

        held: Message | None = None  # the start of an answer to initialize, until its body says how it went

        async def sending(message: Message) -> None:
            nonlocal answered, started, held
            started = True
            if message["type"] == "http.response.start" and message.get("status") == 200 and _initialize(body):
                held = message
                return
            if held is not None:
                start, held = _with_session(held, message.get("body", b"")), None
                await send(start)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                answered = True
            await send(message)

        call = asyncio.ensure_future(self._app(scope, reading, sending))
        caller = CALLER.get()
        key: CallKey | None = None

        async def watch() -> None:
            nonlocal key
            await body_read.wait()
            key = self._read(caller, _session_of(scope), bytes(body), call)
            message = await receive()  # the next one the server has: the client gone, or the answer complete
            if message["type"] == "http.disconnect" and not answered:
                log.info("gateway_client_gone", path=scope.get("path"))
                call.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await call
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # this request's own task is cancelled: the server stops
                raise
            # The client has gone, or cancelled the call: nobody reads an answer, but a connection still open needs
            # one.
            if call in self._cancelled and not started:
                # The code the SDK's own HTTP transport answers a cancelled request with (LSP's RequestCancelled):
                # the request was valid, so not INVALID_REQUEST, as this said until a tester's note.
                error = {"code": REQUEST_CANCELLED, "message": "cancelled by its client"}
                await send({"type": "http.response.start", "status": 200, "headers": _JSON_HEADERS})
                reply = {"jsonrpc": "2.0", "id": None if key is None else key[2], "error": error}
                await send({"type": "http.response.body", "body": json.dumps(reply).encode()})
        finally:
            watcher.cancel()
            self._cancelled.discard(call)
            if key is not None:
                self._calls[key].remove(call)
                if not self._calls[key]:
                    del self._calls[key]
                self._ended.put(key, asyncio.get_running_loop().time())

    def _read(
        self, caller: Grant | None, session: str | None, body: bytes, call: asyncio.Future[None]
    ) -> CallKey | None:
        """Registers a request under its caller, session and id, and returns that key; cancels the call a
        cancellation names. Neither a token nor a session: nobody is told apart, nothing is registered."""
        if (caller is None and session is None) or len(body) > PEEKED_BODY_BYTES:
            return None
        client = "" if caller is None else caller.client
        message = _json_object(body)
        if message is None:
            return None
        now = asyncio.get_running_loop().time()
        request_id = request_id_of(message)
        if request_id is not None and "method" in message:
            key = (client, session or "", request_id)
            self._calls.setdefault(key, []).append(call)
            early = self._early.pop(key)
            if early is not None and now - early <= EARLY_CANCEL_S and len(self._calls[key]) == 1:
                self._cancel(call, request_id, "cancelled before its body was read")
            return key
        params = message.get("params")
        if message.get("method") != "notifications/cancelled" or not isinstance(params, dict):
            return None
        named = request_id_of({"id": params.get("requestId")})
        if named is None:
            return None
        key = (client, session or "", named)
        held = self._calls.get(key, [])
        ended = self._ended.get(key)
        if ended is not None and now - ended <= RECENT_END_S:
            return None  # late, for its own call that has ended; any call holding the id now is another session's
        if len(held) == 1:
            self._cancel(held[0], named, params.get("reason"))
        elif not held:
            self._early.put(key, now)
        return None

    def _cancel(self, call: asyncio.Future[None], request_id: int | str, reason: object) -> None:
        log.info("gateway_call_cancelled_by_client", request_id=request_id, reason=reason)
        self._cancelled.add(call)
        call.cancel()


def _session_of(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == SESSION_HEADER:
            held: bytes = value
            if 0 < len(held) <= 128 and all(byte in SESSION_ID_CHARACTERS for byte in held):
                return held.decode("ascii")
            return None
    return None


def _initialize(body: bytearray) -> bool:
    """Whether a request's body is an ``initialize``."""
    if b'"initialize"' not in body:  # every answer passes here: most need no parse
        return False
    request = _json_object(bytes(body)) if len(body) <= PEEKED_BODY_BYTES else None
    return request is not None and request.get("method") == "initialize"


def _with_session(start: Message, answer: bytes) -> Message:
    """The start of an answer to ``initialize`` with a new session id, unless the app gave it one or the answer is
    an error (a tester's: a failed initialize got a session to use)."""
    headers = list(start.get("headers", ()))
    if any(name.lower() == SESSION_HEADER for name, _ in headers):
        return start
    reply = _json_object(answer)
    if reply is not None and "error" in reply:
        return start
    return {**start, "headers": [*headers, (SESSION_HEADER, secrets.token_hex(16).encode())]}


def _tool(spec: ToolSpec) -> types.Tool:
    return types.Tool(
        name=spec.name,
        title=spec.title,
        description=spec.description,
        input_schema=spec.input_schema,
        output_schema=spec.output_schema,
        annotations=types.ToolAnnotations(
            title=spec.title, read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False
        ),
    )


def invalid_here(spec: ToolSpec, arguments: dict[str, Any], request: bytes) -> types.CallToolResult | None:
    """The tool error naming what the contract refuses in ``request``, when no worker could be asked to say so (an
    install tester's: an argument that can never pass was answered "unavailable, try again"); None for a valid one.
    What a worker's settings decide (a query's length) is the worker's to say."""
    if len(request) > MAX_REQUEST_BYTES:  # not parsed here either, as no worker parses it (a review's)
        too_large = RequestTooLarge(len(request), MAX_REQUEST_BYTES)
        return tool_error(f"error invalid_request: the arguments are too large\n- request: {too_large}")
    refused = read_request(spec.request, request)
    if isinstance(refused, QueryError):
        return tool_error(render_error(restated(spec, arguments, ErrorReply(error=refused))))
    return None


def _only_workspace(caller: Grant | None) -> str | None:
    """The workspace a call may leave out when its token reads exactly one."""
    if caller is None or len(caller.workspaces) != 1 or caller.workspaces[0] == ALL_WORKSPACES:
        return None
    return caller.workspaces[0]


LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})
"""The addresses the MCP SDK guards against DNS rebinding (its Host check): only these serve without tokens."""


def is_loopback(host: str) -> bool:
    return host in LOOPBACK


async def serve(
    link: NatsLink,
    names: Names,
    workspace: str | None,
    timeout_s: float,
    http: tuple[str, int] | None,
    tokens: TokenStore | None = None,
    intake: Intake | None = None,
    allowed_origins: frozenset[str] = frozenset(),
    answer_tokens: int = DEFAULT_ANSWER_TOKENS,
) -> None:
    """Serve over stdio, or over HTTP at ``http`` (host, port) with the bearer ``tokens`` (see :mod:`.auth`), taking
    on what ``intake`` allows (see :mod:`.admission`); beyond loopback, browser pages of ``allowed_origins`` only."""
    gateway = Gateway(link, names, workspace, timeout_s, answer_tokens)
    if http is None:
        await gateway.serve_stdio()
    else:
        assert tokens is not None, "an HTTP gateway takes its tokens"
        assert intake is not None, "an HTTP gateway takes its intake"
        log.info("gateway_listening", url=f"http://{http[0]}:{http[1]}{MCP_PATH}", tokens=str(tokens.path))
        await gateway.serve_http(*http, tokens, intake, allowed_origins)
