"""Bearer tokens of the HTTP gateway: who may call it, and which workspaces each caller may read.

The gateway is an OAuth 2.1 resource server in the MCP specification's terms: every HTTP request carries
``Authorization: Bearer <token>``, and a request without a valid one is answered 401 with a ``WWW-Authenticate``
challenge. Tokens are issued by the operator (``ontofabric gateway-token add``), not by an authorization server: the
store keeps only their SHA-256, with the client's name and its workspaces. Revoking one takes effect on the next
request (the store is re-read when its file changes).
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import json
import os
import re
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from ontofabric.shared.files import make_directory
from ontofabric.shared.logging import get_logger
from ontofabric.shared.runtime import write_private

log = get_logger(__name__)

ALL_WORKSPACES = "*"
CLIENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]{0,127}")
"""A token holder's name: it keys the token, its share of the gateway and its calls' cancellations. A tester's empty
name escaped the share (no name was taken for no token), and one with a tab and a newline forged a line of
``gateway-token list``."""


@dataclass(frozen=True)
class Grant:
    """One issued token: its SHA-256, the client it was issued to, and the workspaces it may read."""

    sha256: str
    client: str
    workspaces: list[str]

    def allows(self, workspace: str) -> bool:
        return ALL_WORKSPACES in self.workspaces or workspace in self.workspaces


CALLER: contextvars.ContextVar[Grant | None] = contextvars.ContextVar("ontofabric_gateway_caller", default=None)
"""The grant of the HTTP request being served; None over stdio (the local user's own agent)."""


class TokensUnreadable(Exception):
    """The tokens file exists but is not a list of grants: nobody is let in until it is fixed."""


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class TokenStore:
    """The grants on record in one file (owner-only), re-read when the file changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[int, int] | None = None
        self._grants: dict[str, Grant] = {}

    def grants(self) -> list[Grant]:
        self._reload()
        return list(self._grants.values())

    def find(self, token: str) -> Grant | None:
        self._reload()
        digest = _digest(token)
        # Compared in constant time, so response times say nothing about how close a guess came.
        return next((g for g in self._grants.values() if hmac.compare_digest(g.sha256, digest)), None)

    def add(self, client: str, workspaces: Sequence[str]) -> str:
        """Issue a token to ``client`` (replacing its previous one); returns the token, which is not kept.
        ValueError for a name that is not :data:`CLIENT_NAME`."""
        if CLIENT_NAME.fullmatch(client) is None:
            raise ValueError(
                f"{client!r} is no client name: a letter or digit, then up to 127 letters, digits and . _ @ + -"
            )
        token = secrets.token_urlsafe(32)
        grants = {g.client: g for g in self.grants() if g.client != client}
        grants[client] = Grant(_digest(token), client, sorted(set(workspaces)))
        self._write(grants.values())
        return token

    def revoke(self, client: str) -> bool:
        grants = self.grants()
        kept = [g for g in grants if g.client != client]
        self._write(kept)
        return len(kept) < len(grants)

    def _write(self, grants: Iterable[Grant]) -> None:
        try:
            make_directory(self.path.parent)
            write_private(self.path, json.dumps([asdict(g) for g in grants], indent=1))
        except OSError as error:
            raise TokensUnreadable(f"the tokens file {self.path} cannot be written: {error}") from error
        self._seen = None

    def _reload(self) -> None:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            self._grants, self._seen = {}, None
            return
        except OSError as error:  # a tester's: a data directory that is a file ended in a traceback
            self._grants, self._seen = {}, None
            raise TokensUnreadable(f"the tokens file {self.path} cannot be read: {error}") from error
        others = _writable_by_others(self.path, stat)
        if others is not None:  # not to be trusted: closed, as for a file that cannot be read
            self._grants, self._seen = {}, None
            raise TokensUnreadable(f"the tokens file {self.path} {others}")
        seen = (stat.st_mtime_ns, stat.st_size)
        if seen != self._seen:
            try:
                grants = [Grant(**g) for g in json.loads(self.path.read_text())]
                if not all(isinstance(g.sha256, str) and isinstance(g.workspaces, list) for g in grants):
                    raise TypeError("a grant's sha256 is not text or its workspaces not a list")
            except (OSError, ValueError, TypeError) as error:  # ValueError: not JSON; TypeError: not grants
                # Closed, not open and not the last grants read: an edit that broke the file may have been a
                # revocation.
                self._grants, self._seen = {}, None
                raise TokensUnreadable(f"the tokens file {self.path} cannot be read: {error}") from error
            self._grants = {g.sha256: g for g in grants}
            self._seen = seen


def _writable_by_others(path: Path, file: os.stat_result) -> str | None:
    """Why the tokens file at ``path`` is not to be trusted, or None: another user than this process's (or root)
    owns it or its directory, others may write it (group or world), or anyone may replace it in its directory (the
    one it really is in, past links: world-writable without the sticky bit). A security tester's gateway honoured a
    token another local user had added to a file left writable, and under a umask of 000 another user replaced the
    file in its directory. A directory its group may write is trusted: under the umask of 002 that Debian and Ubuntu
    give their users, whose group is their own, data directories of earlier releases are (a review's)."""
    trusted = {os.geteuid(), 0}
    if file.st_uid not in trusted:
        return f"belongs to user {file.st_uid}, not to this process's: nobody is let in until its owner is"
    if file.st_mode & 0o022:
        mode = f"{file.st_mode & 0o777:o}"
        return f"may be written by others (mode {mode}): nobody is let in until it is owner-only (chmod 600)"
    directory = Path(os.path.realpath(path)).parent.stat()
    if directory.st_mode & 0o002 and not directory.st_mode & 0o1000:
        return (
            f"is in a directory anyone may write (mode {directory.st_mode & 0o777:o}), who could replace it: nobody "
            "is let in until it is not (chmod o-w)"
        )
    if directory.st_uid not in trusted:
        return f"is in a directory of user {directory.st_uid}, who could replace it: nobody is let in until it is moved"
    return None


class RequireBearer:
    """ASGI middleware: a request without a token on record is answered 401; with one, its grant is the caller.
    Decided per request: while the tokens file does not exist, ``open_without_tokens`` (a gateway on loopback)
    lets requests through, and from the moment it exists every request needs a token, also if the file is then
    deleted (that revokes every token; it does not open the gateway again)."""

    def __init__(self, app: ASGIApp, store: TokenStore, open_without_tokens: bool, served_path: str) -> None:
        self._app = app
        self._store = store
        self._open_without_tokens = open_without_tokens
        self._served = (served_path, served_path + "/")

    def open_to_all(self) -> bool:
        """Whether requests go through without a token now (a gateway on loopback before any tokens file)."""
        if self._open_without_tokens and self._store.path.exists():
            self._open_without_tokens = False
        return self._open_without_tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") not in self._served:
            # Nothing else is served: not OAuth discovery (protected resource and authorization server metadata),
            # nor the endpoints a client falls back to without it (/register, /authorize, /token: MCP 2025-03-26).
            # A client told 401 there reads the body as an OAuth error and reports that (a tester's Inspector said
            # "Dynamic Client Registration rejected"), not the token it lacks.
            message = f"not found: MCP is served at {self._served[0]}; no OAuth here, tokens are issued by the operator"
            await _answer(send, 404, -32601, message, [])
            return
        if scope["type"] != "http" or self.open_to_all():
            await self._app(scope, receive, send)
            return
        headers = [value for name, value in scope["headers"] if name == b"authorization"]
        if len(headers) > 1:
            # Which of two credentials a request means is not the gateway's to guess (each proxy keeps another).
            await _answer(send, 400, -32600, "more than one Authorization header: send one", [])
            return
        header = (headers[0] if headers else b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        try:
            grant = self._store.find(token.strip()) if scheme.lower() == "bearer" and token.strip() else None
        except TokensUnreadable as unreadable:
            log.error("gateway_tokens_unreadable", error=str(unreadable))
            await _answer(send, 503, -32002, "the gateway's tokens file cannot be read; its operator must fix it", [])
            return
        if grant is None:
            # RFC 6750, 3.1: a request without credentials gets the challenge without an error code.
            error = ', error="invalid_token"' if header else ""
            challenge = (b"www-authenticate", f'Bearer realm="ontofabric"{error}'.encode())
            # Which of the two it is, said: a verifier's wrong token was told to send one.
            sent = scheme.lower() == "bearer" and token.strip()
            said = "the token sent is not on record (mistyped, revoked, or another gateway's)" if sent else ""
            message = f"unauthorized: {said or 'send Authorization: Bearer <token>'}"
            await _answer(send, 401, -32001, message, [challenge])
            return
        token_of_request = CALLER.set(grant)
        try:
            await self._app(scope, receive, send)
        finally:
            CALLER.reset(token_of_request)


async def _answer(send: Send, status: int, code: int, message: str, headers: list[tuple[bytes, bytes]]) -> None:
    """An HTTP answer carrying a JSON-RPC error (id null: the request was not read)."""
    body = json.dumps({"jsonrpc": "2.0", "id": None, "error": {"code": code, "message": message}}).encode()
    await send(
        {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json"), *headers]}
    )
    await send({"type": "http.response.body", "body": body})
