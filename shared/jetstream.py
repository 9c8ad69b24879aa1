"""JetStream definitions (streams, KV buckets), the connection helper and the batch pull loop.

Every service calls :func:`ensure_jetstream` at start; it creates what is missing and leaves what exists alone,
so workers can start in any order.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import re
import ssl
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable, Mapping
from typing import TypeVar
from urllib.parse import unquote, urlsplit

import nats.errors
import nats.js.errors
import nats.protocol.parser
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    ConsumerInfo,
    DeliverPolicy,
    DiscardPolicy,
    Header,
    KeyValueConfig,
    RePublish,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import APIError, BadRequestError, NotFoundError
from opentelemetry.metrics import CallbackOptions, Observation

from .logging import describe, get_logger
from .nats_auth import inbox_prefix, nkey_public_key
from .settings import Settings, SettingsUnusable, redacted_url
from .subjects import PARTITION_COUNTS, Names
from .tasks import cancel_and_wait, still_wanted
from .telemetry import meter

T = TypeVar("T")

log = get_logger(__name__)

DEAD_LETTER_HEADROOM_BYTES = 16 * 1024
"""Room a stored delta leaves under NATS's default max_payload (1 MiB) for the headers its dead letter adds (about
700 bytes; the detail is cut at 1,000 characters). A delta filling the whole 1 MiB could be stored but not
dead-lettered: the server refused the dead letter and nats-py closed the projector's connection for good."""
# Deltas carry an embedding and up to max_content_bytes of text; JSON makes both larger.
MAX_DELTA_MESSAGE_BYTES = 1024 * 1024 - DEAD_LETTER_HEADROOM_BYTES


class PermissionDenied(Exception):
    """The server refused this connection's credentials a publish or subscription (NATS permissions)."""


class NatsUnreachable(Exception):
    """No NATS server answered a first connection in time."""


class ConnectionLost(Exception):
    """A NATS connection of this process closed for good (:func:`connection_lost`)."""


class NotSetUp(Exception):
    """A stream or bucket the deployment needs does not exist yet (a projector's first start creates them)."""


_VIOLATION = re.compile(r'permissions violation for (?:publish|subscription) to "([^"]+)"', re.IGNORECASE)
_Waiting = dict[str, dict["asyncio.Future[str]", str]]
"""Lower-cased subject -> the future a refusal of it resolves -> the subject as sent, of calls in flight (a gateway
holds hundreds on one subject: each ends in constant time)."""
_DENIALS: weakref.WeakKeyDictionary[Client, _Waiting] = weakref.WeakKeyDictionary()
_CLOSING: weakref.WeakSet[Client] = weakref.WeakSet()
"""Connections this process is closing itself (:func:`close`): their end is no loss."""
_LOST: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Event] = weakref.WeakKeyDictionary()
_CONNECTIONS: weakref.WeakKeyDictionary[Client, str] = weakref.WeakKeyDictionary()
"""Every connection :func:`connect` made and nobody closed, by its name: what ``nats.connected`` reports."""


def _observe_connections(_: CallbackOptions) -> list[Observation]:
    return [
        Observation(int(nc.is_connected), {"client": name})
        for nc, name in list(_CONNECTIONS.items())
        if not nc.is_closed
    ]


# Where NATS runs as a service of its own, an outage silences the lag series (they are read from NATS), and no
# query reaches a worker to fail: this is what an alert can read (OntofabricNatsUnreachable).
meter().create_observable_gauge(
    "nats.connected",
    callbacks=[_observe_connections],
    description="1 while this process's NATS connection is up, 0 while it is lost or not yet made (by its name)",
)


def connection_lost() -> asyncio.Event:
    """Set once a connection made by :func:`connect` on this event loop has closed for good without this process
    closing it. nats-py does not reconnect after the server ends a connection over a protocol error (a message
    over max_payload, for one): a worker left so would stay up and serve nothing, so it should exit instead and
    be restarted."""
    loop = asyncio.get_running_loop()
    lost = _LOST.get(loop)
    if lost is None:
        lost = _LOST[loop] = asyncio.Event()
    return lost


ANY_SUBJECT = ""
"""For :func:`refused_promptly`: whatever subject the server refuses on the connection (an operator command's many
requests: a tester's `status` with a client's login waited out a timeout and ended in a traceback)."""


async def refused_promptly(nc: Client, subjects: str | Collection[str], call: Awaitable[T]) -> T:
    """``call`` (requests or publishes to ``subjects`` on ``nc``, or to any with ANY_SUBJECT), failing with
    PermissionDenied as soon as the server refuses one of the subjects. The server drops a refused message without
    a reply and reports the refusal only to the connection's error callback, so the caller would otherwise wait for
    its whole timeout."""
    waiting = _DENIALS.get(nc)
    if waiting is None:  # a connection not made by connect(): nothing reports refusals
        return await call
    named = {subjects} if isinstance(subjects, str) else set(subjects)
    keys = {subject.lower(): subject for subject in named}  # nats-py lower-cases the server's error line
    refused: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    for key, subject in keys.items():
        waiting.setdefault(key, {})[refused] = subject
    task = asyncio.ensure_future(call)
    refused.add_done_callback(lambda _: task.cancel())
    try:
        return await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if refused.done() and (current is None or not current.cancelling()):
            raise PermissionDenied(
                f"the NATS server refused these credentials on the subject {refused.result()!r}: their user may not "
                "use it (another workspace's subject, or another role's)"
            ) from None
        raise
    finally:
        for key in keys:
            entries = waiting.get(key, {})
            entries.pop(refused, None)
            if not entries:
                waiting.pop(key, None)


def connection_of(js: JetStreamContext) -> Client:
    """The connection a JetStream context talks through (nats-py keeps it, without a public accessor)."""
    nc: Client = js._nc
    return nc


def nats_tls(settings: Settings) -> ssl.SSLContext | None:
    """The TLS context of NATS connections: the server verified against ``nats_tls_ca``, and the client's own
    certificate where one is set (mutual TLS); None without a CA (plain connections)."""
    if settings.nats_tls_ca is None:
        if settings.nats_tls_cert is not None:
            raise SettingsUnusable(
                "ONTOFABRIC_NATS_TLS_CERT needs ONTOFABRIC_NATS_TLS_CA: a server unverified is no TLS"
            )
        return None
    context = ssl.create_default_context(cafile=str(settings.nats_tls_ca))
    if settings.nats_tls_cert is not None:
        key = settings.nats_tls_key
        context.load_cert_chain(str(settings.nats_tls_cert), str(key) if key is not None else None)
    return context


def refused_login(error: BaseException | None) -> bool:
    """Whether ``error`` (nats-py's, or what its error callback got) is the server refusing the credentials."""
    return error is not None and "authorization violation" in str(error).lower()


@dataclasses.dataclass
class _Outage:
    """When a connection last logged each error since it was last connected, and how many came again unlogged."""

    logged: dict[str, float] = dataclasses.field(default_factory=dict)
    repeats: int = 0


UNREADABLE_HEADERS = "Ontofabric-Unreadable-Headers"
"""Set by :class:`SturdyClient`, in place of a message's headers that nats-py cannot read, to what was wrong."""
REPEATED_ANSWER = "Ontofabric-Answer-Stored"
"""Set by :class:`SturdyClient` on a direct get's answer whose stored message is itself a server's answer: its
headers name a stream's subject twice (the stored answer's, then this answer's). A dict of headers keeps one."""
STORED_STATUS = "Ontofabric-Stored-Status"
"""Where :class:`SturdyClient` puts the ``Status`` a stored message carries (a header, or inline on its first line)."""
SERVER_ANSWER_HEADERS = ("Nats-Stream", "Nats-Subject", "Nats-Sequence", "Status", STORED_STATUS)
"""Headers the server sets on what it answers with (a direct get's stored message, a status; a stored message's
status as :class:`SturdyClient` hands it over), which a publisher cannot take off: a tenant put a delta made out for
another into its own manifest key and had a direct get of it answered onto the other's delta subject, which the
projector indexed (a review's). No delta carries them: the projector drops a message that does
(services/projector/planning.py)."""


def server_answer_headers(headers: Mapping[str, str] | None) -> bool:
    """Whether a message carries the headers of a server's answer (:data:`SERVER_ANSWER_HEADERS`): read as stored
    (a stream's message get, not a direct get's answer, which adds its own)."""
    return any(name in SERVER_ANSWER_HEADERS for name in headers or {})


_STATUS = Header.STATUS.value
"""The header nats-py takes for the server's status on a fetch or a request."""
_STORED_SEQUENCE = "Nats-Sequence"
"""A header the server adds to a stored message it answers a direct get with."""
_SEPARATED = re.compile(rb"\\s")


def _subjects_read_as_the_server_writes_them() -> None:
    """nats-py reads a MSG or HMSG line's parts as separated by any whitespace, where the server separates them by
    spaces and tabs only, ends the line at its line feed, and takes a vertical tab, a form feed or a carriage return
    as part of a subject: a subject holding one (any publisher may write it) matched neither pattern, and nats-py's
    parser raised a protocol error and connected again, once for each such message (two reviews'). Its two
    patterns, made again with spaces and tabs as the separators; left as they are if a release of nats-py writes
    them otherwise (a test checks)."""
    for name in ("MSG_RE", "HMSG_RE"):
        pattern: re.Pattern[bytes] = getattr(nats.protocol.parser, name)
        if b"[^\\s]" in pattern.pattern:
            written = pattern.pattern.replace(b"[^\\s]", b"[^ \\t\n]").replace(b"[^\\S\r\n]", b"[ \\t]")
            setattr(nats.protocol.parser, name, re.compile(_SEPARATED.sub(b"[ \\t]", written)))


_subjects_read_as_the_server_writes_them()


class SturdyClient(Client):
    """nats-py's client, made to read what any publisher can send without stopping. An outside tester's findings,
    each from one message of a user confined to its own workspace, and a review's:

    - a status line that is not UTF-8 (``NATS/1.0 \\xff``) raised in nats-py's header parser, and its read loop
      ended without a word while the connection still counted as up: the query worker answered no one, for any
      workspace, for five minutes. Headers that cannot be read are handed over as :data:`UNREADABLE_HEADERS`.
    - a delta stored with a ``Status`` header was taken by nats-py's fetch for the server's status, and every fetch
      that reached it failed: the projector's position stopped there for every workspace. A stored message's
      status (delivered by JetStream, its reply an ``$JS.ACK.`` subject) is handed over as :data:`STORED_STATUS`,
      read from the headers as nats-py parsed them (a first version renamed the header's line, and ``\tStatus:``
      or ``Status\x0b:``, which nats-py's parser strips, got past it).
    - a subject or reply subject that is not UTF-8 raised in nats-py's building of the message: such a message,
      which cannot be answered, is dropped and logged (it made the worker connect again, a second each); one
      delivered from a stream is read with the odd bytes replaced, to be settled (dropped, it came again for ever).

    And whatever else ends nats-py's read loop while the connection is up makes the connection again.
    """

    async def _process_headers(self, headers: bytes) -> dict[str, str] | None:
        try:
            parsed = await super()._process_headers(headers)
        except Exception as error:  # whatever the parser raises on a message's headers, the read loop goes on
            return {UNREADABLE_HEADERS: describe(error)[:200]}
        # A red team's forged manifest, read by the ingest it was forged for: two lines of the name, each as the server
        # writes it. Counted on the bytes, not a copy: this runs for every message with headers.
        if parsed is not None and headers and headers.count(b"\r\nNats-Subject:") > 1:
            parsed[REPEATED_ANSWER] = "yes"
        return parsed

    def _build_message(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: dict[str, str] | None
    ) -> Msg | None:
        stored = reply.startswith(b"$JS.ACK.")  # delivered from a stream; a direct get's answer carries its sequence
        if headers and _STATUS in headers and (stored or _STORED_SEQUENCE in headers):
            # In place: nats-py reads the same dict for its control messages once the message is built.
            headers[STORED_STATUS] = headers.pop(_STATUS)
        try:
            return super()._build_message(sid, subject, reply, data, headers)  # type: ignore[no-any-return]
        except UnicodeDecodeError:
            if stored:  # to be settled (a subject no delta has: dead-lettered), or it is delivered again for ever
                return self.msg_class(
                    subject=subject.decode(errors="replace"), reply=reply.decode(), data=data, headers=headers,
                    _client=self, _sid=sid,
                )  # fmt: skip
            # Nobody to answer: nats-py skips a message it could not build (None).
            log.warning("nats_message_not_utf8_dropped", subject=subject[:200].decode(errors="replace"))
            return None

    async def _read_loop(self) -> None:
        await super()._read_loop()
        # nats-py's loop ends on any error it did not foresee, logging it, while the connection still counts as up
        # and nothing reads it: the connection is made again, as after a protocol error, rather than left mute.
        # Not when the loop's own task is being cancelled (nats-py swallows that).
        task = asyncio.current_task()
        if self.is_connected and not (task is not None and task.cancelling()):
            log.error("nats_read_loop_ended", action="reconnecting")
            await self._process_op_err(nats.errors.UnexpectedEOF())


async def connect(
    url: str,
    name: str,
    settings: Settings | None = None,
    wait_for_server: bool = False,
    on_unread: Callable[[nats.errors.SlowConsumerError], Awaitable[bool]] | None = None,
) -> Client:
    """A client that reconnects for ever and logs connection changes (not its own close). With a user in the URL,
    replies arrive under that user's own inbox prefix, the only one its permissions let it read. ``settings``
    bring TLS (:func:`nats_tls`). Raises NatsUnreachable when no server answers the first connection within
    ``nats_connect_timeout_s``; ``wait_for_server`` (a worker) waits until one does, logging each attempt.
    ``on_unread`` gets each message nats-py drops unread, past a subscription's pending limits; one it does not
    take (False) is logged as any error."""
    timeout_s = settings.nats_connect_timeout_s if settings else Settings.model_fields["nats_connect_timeout_s"].default
    first_connect_s = None if wait_for_server else timeout_s
    nc = SturdyClient()
    _CONNECTIONS[nc] = name
    waiting: _Waiting = {}
    authorization_refused = asyncio.Event()
    outage = _Outage()

    async def on_error(error: Exception) -> None:
        if on_unread is not None and isinstance(error, nats.errors.SlowConsumerError) and await on_unread(error):
            return
        if refused_login(error) and not nc.is_connected:
            authorization_refused.set()
        violation = _VIOLATION.search(str(error))
        if violation is not None:
            entries = waiting.get(violation.group(1).lower(), {})
            # Subjects that differ only in case cannot be told apart in the lower-cased report: then none is
            # failed early (the refused one times out), rather than failing one that was allowed.
            if len(set(entries.values())) == 1:
                for refused, subject in list(entries.items()):
                    if not refused.done():
                        refused.set_result(subject)
            for refused in list(waiting.get(ANY_SUBJECT, {})):
                if not refused.done():
                    refused.set_result(violation.group(1))
            log.warning("nats_permission_denied", subject=violation.group(1))
            return
        said, now = describe(error), time.monotonic()  # some errors have no text of their own
        # While the server is gone every reconnect attempt (once a second) fails alike: each error said once a
        # minute (by its text: with several servers their errors alternate).
        if now - outage.logged.get(said, -ERROR_REPEAT_S) < ERROR_REPEAT_S:
            outage.repeats += 1
            return
        log.warning("nats_error", error=said)
        outage.logged[said] = now

    async def on_disconnect() -> None:
        if not nc.is_closed:
            log.warning("nats_disconnected")

    async def on_reconnect() -> None:
        log.info("nats_reconnected", **({"errors_not_logged": outage.repeats} if outage.repeats else {}))
        outage.logged.clear()
        outage.repeats = 0

    async def on_closed() -> None:
        # Closed with an error on record and not by close(): the server ended it (a plain nc.close() has none). A
        # permissions violation stays on record but ends nothing: an application's own nc.close() after a refused
        # request was logged as the server ending the connection (a tester's).
        if nc not in _CLOSING and nc.last_error is not None and not _VIOLATION.search(str(nc.last_error)):
            log.error("nats_connection_closed", name=name, error=describe(nc.last_error))
            connection_lost().set()

    # Several seed URLs, comma-separated: the client connects to any that answers and fails over among them (and
    # the servers they announce). A login written into one of them is used with every one.
    servers = [part.strip() for part in url.split(",") if part.strip()]
    login = next((parts for parts in map(urlsplit, servers) if parts.username), None)
    # A user with a password names the inbox prefix; a bare user is a token, which must not travel in subjects.
    user = unquote(login.username) if login and login.username and login.password is not None else None
    password = unquote(login.password) if login and login.password is not None else None
    token = unquote(login.username) if login and login.username and login.password is None else None
    seed = settings.nats_nkey_seed if settings is not None else None
    # Whose replies these are: the user, or for an nkey login its public key, which the server knows it by.
    identity = nkey_public_key(seed) if seed is not None else user
    tls = nats_tls(settings) if settings is not None else None
    connecting = asyncio.ensure_future(
        nc.connect(
            servers,
            name=name,
            user=user,
            password=password,
            token=token,
            max_reconnect_attempts=-1,
            reconnect_time_wait=1,
            # A publish past the client's buffer waits for its flush; without a limit it waited for ever on a
            # connection that was lost meanwhile (a fault tester's ingest, its server killed mid-publish).
            flush_timeout=FLUSH_TIMEOUT_S,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
            closed_cb=on_closed,
            inbox_prefix=inbox_prefix(identity) if identity else "_INBOX",
            tls=tls,
            # TLS from the first byte: otherwise nats-py upgrades only when the server's INFO asks for it, and a server
            # (or a man in the middle) that does not ask would receive the credentials in plain text.
            tls_handshake_first=tls is not None,
            nkeys_seed=str(seed) if seed is not None else None,
        )
    )
    # A server that refuses the credentials at the first connection is not retried for ever (nats-py would): the
    # caller learns at once. Later refusals (a user revoked while connected) are retried, logged each time.
    refused = asyncio.ensure_future(authorization_refused.wait())
    try:
        await asyncio.wait([connecting, refused], timeout=first_connect_s, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the caller gave up
        await _abandon(connecting, nc)
        raise
    finally:
        refused.cancel()
    if not connecting.done() or connecting.cancelled():
        await _abandon(connecting, nc)
        if authorization_refused.is_set():
            raise PermissionDenied(f"the NATS server at {redacted_url(url)} refused these credentials")
        raise NatsUnreachable(f"no NATS server answered at {redacted_url(url)} within {first_connect_s:g} s")
    connecting.result()
    _DENIALS[nc] = waiting
    return nc


async def _abandon(attempt: asyncio.Task[None], nc: Client) -> None:
    """End a first connection's ``attempt`` and close ``nc``, whether or not it connected meanwhile. Cancelled until
    it ends: nats-py waits for the TCP connection with 3.11's wait_for, which loses a cancellation that comes as the
    socket connects; the attempt then retried for ever, and asyncio.run's shutdown with it (a CI run's `compact`,
    stopped by SIGTERM, never ended). A caller stopped meanwhile (its own stop cancels it again, every second) is
    stopped once this is done: left halfway, the attempt went on retrying (a review's)."""
    stopped: asyncio.CancelledError | None = None
    while True:
        try:
            with contextlib.suppress(Exception):  # how it failed no longer matters
                await cancel_and_wait(attempt)
            await close(nc)
            break
        except asyncio.CancelledError as error:
            stopped = error
    if stopped is not None:
        raise stopped


async def close(nc: Client) -> None:
    """Close ``nc``. A server that drops the connection while nats-py flushes what is pending on closing makes the
    flush raise (ConnectionResetError) once the client is already closed and its tasks stopped; the connection is
    gone anyway, so that is no failure of whoever stops."""
    _CLOSING.add(nc)
    try:
        await nc.close()
    except ConnectionError as error:
        log.info("nats_closed_with_connection_lost", error=str(error))


async def subscriptions_visible(nc: Client) -> None:
    """Return once the server has every subscription made on ``nc`` so far.

    One flush is not enough with nats-py: its PING goes straight to the socket while a new SUB may still wait in
    the client's pending buffer, so the PONG can arrive before the SUB is sent. The first round trip lets the
    flusher send what is pending; the second PONG comes after the server has read it.
    """
    await nc.flush()
    await nc.flush()


def delta_stream_config(names: Names, settings: Settings) -> StreamConfig:
    return StreamConfig(
        name=names.delta_stream,
        subjects=[names.delta_subjects],
        # The headers of each stored delta (its sequence and time) go out again on a subject of their own: query
        # workers learn what has been published without reading the stream.
        republish=RePublish(src=names.delta_subjects, dest=names.published_subjects, headers_only=True),
        retention=RetentionPolicy.LIMITS,  # kept for replay: projectors and rebuilds read it from sequence 1
        storage=StorageType.FILE,
        duplicate_window=settings.dedupe_window_s,
        max_msg_size=MAX_DELTA_MESSAGE_BYTES,
        max_age=settings.delta_max_age_days * 86400 if settings.delta_max_age_days else None,
        max_bytes=settings.delta_stream_max_bytes,
        # Full, the stream refuses what comes rather than drop history a rebuild replays; age still expires.
        discard=DiscardPolicy.NEW if settings.delta_stream_max_bytes else DiscardPolicy.OLD,
        num_replicas=settings.nats_replicas,
        description="SemanticDocument and ontology graph deltas",
    )


def dlq_stream_config(names: Names, settings: Settings) -> StreamConfig:
    return StreamConfig(
        name=names.dlq_stream,
        subjects=[names.dlq_subjects],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        # As long as the delta stream's: a delta dead-lettered above its consumer's floor and read again (a
        # hand-over after a database outage) keeps its one dead letter for as long. It was 2 minutes, and an outage
        # longer than that stored a second (a fault tester's).
        duplicate_window=settings.dedupe_window_s,
        max_msgs_per_subject=settings.dead_letters_per_workspace or -1,  # a subject per workspace: its oldest go
        num_replicas=settings.nats_replicas,
        description="Deltas that can never apply, with the reason in headers",
    )


def version_bucket_config(names: Names, settings: Settings) -> KeyValueConfig:
    return KeyValueConfig(
        bucket=names.version_bucket,
        history=1,
        storage=StorageType.FILE,
        replicas=settings.nats_replicas,
        description="latest ontologyVersion per workspace/branch",
    )


def manifest_bucket_config(names: Names, settings: Settings) -> KeyValueConfig:
    return KeyValueConfig(
        bucket=names.manifest_bucket,
        history=1,
        storage=StorageType.FILE,
        replicas=settings.nats_replicas,
        direct=True,  # reads by key subject, $JS.API.DIRECT.GET.<stream>.$KV.<bucket>.<key>: permissions scope them
        description="ingest manifests: <workspace>.<branch>.head and the parts it names",
    )


async def _say_what_a_lower_bound_drops(js: JetStreamContext, stream: str, per_subject: int) -> None:
    """Warn, per subject, of the oldest messages a new per-subject bound is about to drop (the dead letters of a
    workspace past ONTOFABRIC_DEAD_LETTERS_PER_WORKSPACE, the first time a projector of this release starts)."""
    held = (await js.stream_info(stream, subjects_filter=">")).state.subjects or {}
    for subject, count in sorted(held.items()):
        if count > per_subject:
            log.warning(
                "stream_bound_drops_oldest", stream=stream, subject=subject, dropped=count - per_subject,
                kept=per_subject, setting="ONTOFABRIC_DEAD_LETTERS_PER_WORKSPACE",
            )  # fmt: skip


FULL_SOON = 0.85
"""The share of a capped stream past which a projector's start warns (the alert OntofabricStreamFilling's too)."""
_SETTING_OF_LIMIT = {
    "max_bytes": "ONTOFABRIC_DELTA_STREAM_MAX_BYTES",
    "max_msgs_per_subject": "ONTOFABRIC_DEAD_LETTERS_PER_WORKSPACE",
    "max_age": "ONTOFABRIC_DELTA_MAX_AGE_DAYS",
    "num_replicas": "ONTOFABRIC_NATS_REPLICAS",
    "duplicate_window": "ONTOFABRIC_DEDUPE_WINDOW_S",
}


def _refused(stream: str, changes: list[str], error: APIError) -> str:
    named = ", ".join(_SETTING_OF_LIMIT.get(change, change) for change in changes)
    return f"the NATS server refused {stream} with {named}: {error.description or error}"


async def ensure_jetstream(js: JetStreamContext, names: Names, settings: Settings, reconcile: bool = False) -> None:
    """Create the deployment's streams and buckets where missing. With ``reconcile`` (the projector, whose user
    may update them), also bring existing ones to the configuration: the republish an older stream lacks, the
    delta stream's age and size limits, the dead letters kept per workspace, and the number of replicas
    (JetStream copies a stream to new peers, or drops some, while it keeps serving)."""
    streams: list[StreamConfig | KeyValueConfig] = [
        delta_stream_config(names, settings),
        dlq_stream_config(names, settings),
        version_bucket_config(names, settings),
        manifest_bucket_config(names, settings),
    ]
    for config in streams:
        stream = config.name if isinstance(config, StreamConfig) else f"KV_{config.bucket}"
        assert stream is not None
        created = False
        try:
            existing = (await js.stream_info(stream)).config
        except NotFoundError:
            if isinstance(config, StreamConfig):
                try:
                    await js.add_stream(config)
                except APIError as error:
                    limits = [k for k in ("max_bytes", "max_msgs_per_subject", "max_age") if getattr(config, k)]
                    limits.append("duplicate_window")  # both streams', from the setting
                    raise SettingsUnusable(_refused(stream, [*limits, "num_replicas"], error)) from error
                log.info("stream_created", stream=stream, replicas=settings.nats_replicas)
                continue
            try:
                await js.create_key_value(config)  # nats-py makes every bucket allow rollups: taken back below
                log.info("stream_created", stream=stream, replicas=settings.nats_replicas)
                created = True
            except BadRequestError:  # another process made it meanwhile, and may have taken rollups back already
                pass
            existing = (await js.stream_info(stream)).config
        changes = []
        wanted = existing
        if stream == f"KV_{names.manifest_bucket}" and existing.allow_rollup_hdrs:
            # Tenants' ingesters write their own keys of this bucket; one message with a rollup header would purge
            # every workspace's manifests, whatever subject permissions allow.
            changes.append("allow_rollup_hdrs")
            wanted = dataclasses.replace(wanted, allow_rollup_hdrs=False)
        if isinstance(config, StreamConfig) and existing.republish != config.republish:
            changes.append("republish")  # a stream made before the republish was added
            wanted = dataclasses.replace(wanted, republish=config.republish)
        if isinstance(config, StreamConfig) and abs((existing.max_age or 0) - (config.max_age or 0)) > 1:
            changes.append("max_age")  # ONTOFABRIC_DELTA_MAX_AGE_DAYS set, changed or unset
            wanted = dataclasses.replace(wanted, max_age=config.max_age or 0)
        if isinstance(config, StreamConfig):  # the size limits: unset is -1 on the server, None here
            if (existing.max_bytes or -1) != (config.max_bytes or -1):
                changes.append("max_bytes")  # ONTOFABRIC_DELTA_STREAM_MAX_BYTES set, changed or unset
                wanted = dataclasses.replace(wanted, max_bytes=config.max_bytes or -1)
            if (existing.max_msgs_per_subject or -1) != (config.max_msgs_per_subject or -1):
                changes.append("max_msgs_per_subject")  # ONTOFABRIC_DEAD_LETTERS_PER_WORKSPACE
                wanted = dataclasses.replace(wanted, max_msgs_per_subject=config.max_msgs_per_subject or -1)
            if existing.discard != config.discard:
                changes.append("discard")
                wanted = dataclasses.replace(wanted, discard=config.discard)
        if isinstance(config, StreamConfig) and abs((existing.duplicate_window or 0) - config.duplicate_window) > 0.5:
            changes.append("duplicate_window")  # ONTOFABRIC_DEDUPE_WINDOW_S changed, or a dead-letter stream's 2 min
            wanted = dataclasses.replace(wanted, duplicate_window=config.duplicate_window)
        if isinstance(config, StreamConfig) and existing.max_msg_size != config.max_msg_size:
            changes.append("max_msg_size")  # a delta stream made when deltas could fill the whole max_payload
            wanted = dataclasses.replace(wanted, max_msg_size=config.max_msg_size)
        if (existing.num_replicas or 1) != settings.nats_replicas:
            changes.append("num_replicas")
            wanted = dataclasses.replace(wanted, num_replicas=settings.nats_replicas)
        if changes and (reconcile or created):
            if "max_msgs_per_subject" in changes and (wanted.max_msgs_per_subject or -1) > 0:
                await _say_what_a_lower_bound_drops(js, stream, wanted.max_msgs_per_subject or 0)
            try:
                await js.update_stream(wanted)
            except APIError as error:  # a limit the server cannot give (more storage than it has, say)
                raise SettingsUnusable(_refused(stream, changes, error)) from error
            log.info("stream_updated", stream=stream, changed=changes)
            cap = wanted.max_bytes or -1
            if cap > 0 and (held := (await js.stream_info(stream)).state.bytes or 0) > FULL_SOON * cap:
                log.warning(
                    "stream_nearly_full", stream=stream, held_bytes=held, max_bytes=cap,
                    note="once full, it refuses every new delta: run `ontofabric compact` or raise "
                    "ONTOFABRIC_DELTA_STREAM_MAX_BYTES",
                )  # fmt: skip
        elif changes:
            log.warning("stream_differs", stream=stream, differs=changes, note="a projector's start updates it")


async def last_sequence_on(js: JetStreamContext, stream: str, subject: str) -> int:
    """The stream sequence of the last message on ``subject``; 0 when there is none."""
    try:
        return int((await js.get_last_msg(stream, subject)).seq or 0)
    except NotFoundError:
        return 0


async def ack_floor(js: JetStreamContext, stream: str, durable: str) -> int:
    """A durable consumer's position: the stream sequence up to which it has acked (or terminated) every message;
    0 when the consumer does not exist."""
    try:
        info = await js.consumer_info(stream, durable)
    except NotFoundError:
        return 0
    return _acked_through(info)


def _acked_through(info: ConsumerInfo) -> int:
    return int(info.ack_floor.stream_seq or 0) if info.ack_floor is not None else 0


async def wait_caught_up(
    js: JetStreamContext, stream: str, durable: str, stream_seq: int, timeout_s: float, poll_s: float = 0.05
) -> None:
    """Wait until the consumer has handled ``stream_seq``; TimeoutError after ``timeout_s``."""
    async with asyncio.timeout(timeout_s):
        while await ack_floor(js, stream, durable) < stream_seq:
            still_wanted()  # past the deadline (its cancellation lost in nats-py), a poll went on for ever
            await asyncio.sleep(poll_s)


async def projected_floor(js: JetStreamContext, names: Names, partitions: int) -> int:
    """The Postgres index's position: the stream sequence up to which every delta is in it (or dead-lettered),
    the lowest of the partitions' consumers' (each acks the deltas of other partitions as it passes them)."""
    durables = names.postgres_projector_durables(partitions)
    return min(await asyncio.gather(*(ack_floor(js, names.delta_stream, durable) for durable in durables)))


async def stream_ends_before(js: JetStreamContext, names: Names, partitions: int, stream_seq: int) -> bool:
    """Whether the delta stream, as the Postgres projector's consumers see it, ends before ``stream_seq``: each has
    acked all it was given, has none left to give, and stands below it. A sequence recorded before the stream was
    made again (``adopt-stream``, a restore) is then never coming. False while a consumer is missing or behind."""
    infos = await _projector_consumers(js, names, partitions)
    if infos is None:
        return False
    return all(
        not info.num_pending and not info.num_ack_pending and _acked_through(info) < stream_seq for info in infos
    )


async def highest_projected_floor(js: JetStreamContext, names: Names, layouts: Iterable[int]) -> int:
    """The highest of these partition layouts' positions (:func:`projected_floor`); 0 for none. Each layout's
    consumers together settle every delta, so every delta up to any layout's lowest floor was settled by it."""
    return max(await asyncio.gather(*(projected_floor(js, names, count) for count in sorted(set(layouts)))), default=0)


async def _projector_consumers(js: JetStreamContext, names: Names, partitions: int) -> list[ConsumerInfo] | None:
    """The Postgres projector's consumers of a partition layout; None while one of them is missing."""
    durables = names.postgres_projector_durables(partitions)
    try:
        return list(await asyncio.gather(*(js.consumer_info(names.delta_stream, durable) for durable in durables)))
    except NotFoundError:
        return None


async def layouts_with_consumers(js: JetStreamContext, names: Names, counts: Iterable[int]) -> list[int]:
    """Those of the partition layouts ``counts`` whose Postgres projector consumers all exist. Read from the
    consumers, not from service discovery, which an ingest user may not ask."""
    ordered = sorted(set(counts))
    found = await asyncio.gather(*(_projector_consumers(js, names, count) for count in ordered))
    return [count for count, infos in zip(ordered, found, strict=True) if infos is not None]


async def highest_known_floor(js: JetStreamContext, names: Names, layouts: Iterable[int]) -> int | None:
    """:func:`highest_projected_floor` of the layouts whose consumers all exist; None when none does. A projector
    taking over deletes its consumer and makes it again at the index's position: read meanwhile as 0, a query
    worker told its callers the index was thousands of deltas and minutes behind (a tester's)."""

    async def floor(partitions: int) -> int | None:
        infos = await _projector_consumers(js, names, partitions)
        return None if infos is None else min(_acked_through(info) for info in infos)

    known = [
        found for found in await asyncio.gather(*(floor(count) for count in sorted(set(layouts)))) if found is not None
    ]
    return max(known, default=None)


async def settled_by_other_layouts(js: JetStreamContext, names: Names, partitions: int) -> int:
    """The highest stream sequence up to which another partition layout's consumers settled every delta (applied,
    or dead-lettered); 0 when no other layout has consumers. A layout's consumers start from the stream's first
    delta: what another layout settled below this, it need not dead-letter again."""
    return await highest_projected_floor(js, names, (count for count in PARTITION_COUNTS if count != partitions))


FLUSH_TIMEOUT_S = 10.0
ERROR_REPEAT_S = 60.0  # how often a connection's same error is logged again while it lasts
NATS_AWAY = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.StaleConnectionError,
    nats.errors.ConnectionReconnectingError,
    nats.js.errors.ServiceUnavailableError,
)
"""What a JetStream request raises while its server is away or restarting: worth asking again."""
NATS_AWAY_RETRY_S = 1.0

RETRY_FOR_S = 60.0
"""How long a write to JetStream is tried again while its server does not answer."""
RETRY_WAIT_S = (0.1, 2.0)
"""The first and the longest wait between attempts to write what is not confirmed yet (a delta, a manifest)."""

# What a later attempt may get through: no acknowledgement in time, the stream's leader away, the connection down.
RETRYABLE = (
    *NATS_AWAY,
    asyncio.TimeoutError,  # nats-py's own is one; so is an acknowledgement waited for here
    nats.errors.OutboundBufferLimitError,
    nats.js.errors.NoStreamResponseError,  # a clustered stream between two leaders answers 503
    OSError,  # the socket, mid-write
)


LAYOUTS_LOOK_S = 5.0
"""How often a wait for the index looks again which partition layouts have consumers."""


async def wait_projected(
    js: JetStreamContext,
    names: Names,
    partitions: int,
    stream_seq: int,
    timeout_s: float,
    poll_s: float = 0.05,
    on_floor: Callable[[int], object] | None = None,
    moved: Callable[[], Awaitable[JetStreamContext | None]] | None = None,
) -> None:
    """Wait until the Postgres index holds ``stream_seq``: the highest position (:func:`highest_known_floor`) of the
    configured partition layout and of every other whose consumers exist, looked up every ``LAYOUTS_LOOK_S``: from
    a shell without the deployment's setting, an ingest waited on consumers no projector makes, or on a layout
    given up, and blamed the projector (a tester's). A layout no projector runs stopped below what was just
    published, and never ends the wait early. TimeoutError after ``timeout_s``, and only then.
    ``on_floor`` is told the index's position at every look. A look NATS does not answer (an outage, a restart) is
    tried again: nats-py's timeout is asyncio's, and an ingest took a JetStream request's for its own and said it
    had waited out an hour after seconds (a fault tester's). ``moved``, asked
    after such a look: a connection to where the server is now, when it moved (an ``ontofabric up`` restarted on
    other ports), else None; the wait goes on there (an operator tester's ingest looked at the old port until its
    timeout, and then named a stale position)."""
    async with asyncio.timeout(timeout_s) as deadline:
        layouts, looked = [partitions], -math.inf
        while True:
            try:
                if time.monotonic() - looked >= LAYOUTS_LOOK_S:
                    others = await layouts_with_consumers(js, names, set(PARTITION_COUNTS) - {partitions})
                    layouts, looked = [partitions, *others], time.monotonic()
                floor = await highest_known_floor(js, names, layouts) or 0
            except NATS_AWAY as error:
                # The deadline may have passed as a partition's look failed: gathered, the failure can come out in
                # place of the deadline's cancellation (a review's), which must still end the wait.
                if deadline.expired():
                    raise TimeoutError from error
                log.warning("projection_wait_unanswered", error=describe(error))
                elsewhere = await moved() if moved is not None else None
                if elsewhere is not None:
                    log.info("projection_wait_followed_the_server")
                    js, looked = elsewhere, -math.inf
                    continue
                await asyncio.sleep(max(poll_s, NATS_AWAY_RETRY_S))
                continue
            if on_floor is not None:
                on_floor(floor)
            if floor >= stream_seq:
                return
            still_wanted()
            await asyncio.sleep(poll_s)


BatchHandler = Callable[[list[Msg]], Awaitable[None]]

MAX_FETCH_BACKOFF_S = 2.0  # a JetStream leader election takes seconds: look again soon after
MAX_NAK_DELAY_S = 30.0
RECONNECT_POLL_S = 0.1


def backoff_s(attempt: int, first_s: float, cap_s: float) -> float:
    """``first_s``, twice that, four times ... for attempts 1, 2, 3 ..., never above ``cap_s`` (any attempt)."""
    return min(first_s * 2.0 ** min(max(attempt - 1, 0), 64), cap_s)


def nak_delay(num_delivered: int) -> float:
    """How long a nak'd message waits before its next delivery: 0.5 s, 1 s, 2 s ... capped at 30 s."""
    return backoff_s(num_delivered, 0.5, MAX_NAK_DELAY_S)


class SkippedMessages(Exception):
    """An ordered read found a gap in the consumer's deliveries."""


class StreamReader:
    """The one way deltas are read from the stream: batches of a pull subscription, as an async iterator.

    Our own loop rather than FastStream's batch subscriber: nats-py's fetch can raise asyncio's TimeoutError where
    FastStream 0.7 catches only nats-py's, and its loop then drops the messages it had already fetched for the
    batch; they came back only after the ack wait. Here every fetched message is in a batch.

    Unbounded (a projector's durable consumer): each fetch waits at most ``fetch_timeout_s`` and what arrived is a
    batch, cut to ``batch_size``; while the connection is down, or ``paused`` says so, it does not fetch; a failed
    fetch is tried again with backoff; only :meth:`stop` ends it.

    Bounded (``upto``: a replay through a consumer of its own that delivers in order, without acks): batches are
    filled to ``batch_size`` across fetches, so they are written in transactions as large as a projector's; a gap
    in the deliveries, a failed fetch or a connection down for a fetch timeout raises (a replay may hold locks
    others wait for); it ends with the message at stream sequence ``upto``, or when the consumer has nothing more
    to deliver.
    """

    def __init__(
        self,
        subscription: JetStreamContext.PullSubscription,
        *,
        name: str,
        connection: Client,
        batch_size: int,
        fetch_timeout_s: float,
        upto: int | None = None,
        paused: Callable[[], bool] | None = None,
    ) -> None:
        self.name = name
        self._subscription = subscription
        self._paused = paused
        """Unbounded: while this says so, nothing is fetched (a projector that may no longer apply its consumer)."""
        self._connection = connection
        self._batch_size = batch_size
        self._fetch_timeout_s = fetch_timeout_s
        self._upto = upto
        self._stopping = asyncio.Event()
        self._received = 0
        """Messages received by a bounded read: each must be the consumer's next delivery."""
        self._failures = 0
        self._disconnected_for = 0.0

    def stop(self) -> None:
        """End the iteration after the fetch in progress (and any backoff, at once)."""
        self._stopping.set()

    async def batches(self) -> AsyncIterator[list[Msg]]:
        bounded = self._upto is not None
        if bounded and not (await self._subscription.consumer_info()).num_pending:
            return
        filling: list[Msg] = []
        while not self._stopping.is_set():
            messages = await self._fetch(self._batch_size - len(filling))
            if not messages:
                if bounded and await self._delivered_all():
                    if filling:
                        yield filling
                    return
                continue
            if self._upto is None:
                for start in range(0, len(messages), self._batch_size):
                    yield messages[start : start + self._batch_size]
                continue
            self._check_in_order(messages)
            filling += [msg for msg in messages if msg.metadata.sequence.stream <= self._upto]
            last = messages[-1].metadata
            finished = last.sequence.stream >= self._upto or not last.num_pending
            if filling and (finished or len(filling) >= self._batch_size):
                yield filling
                filling = []
            if finished:
                return

    async def _fetch(self, wanted: int) -> list[Msg]:
        """What arrived within the fetch timeout (none: nothing did, or the connection is down).

        Unbounded, a failure is logged and tried again after a backoff, and nothing is fetched while the
        connection is down: a pull request sent then would wait in the client's buffer and, with every other one,
        reach the server on reconnect, which would deliver up to max_ack_pending deltas at once. Bounded, a replay
        stops instead (to be resumed): a failure raises, and so does a connection down for a fetch timeout."""
        if self._connection.is_closed:  # nats-py never reopens a closed client: waiting would be for ever
            raise ConnectionError(f"the NATS connection of consumer {self.name} is closed")
        if not self._connection.is_connected:
            if self._upto is not None:
                self._disconnected_for += RECONNECT_POLL_S
                if self._disconnected_for > self._fetch_timeout_s:
                    raise ConnectionError(f"NATS has been unreachable for {self._disconnected_for:.1f} s")
            await self._pause(RECONNECT_POLL_S)
            return []
        self._disconnected_for = 0.0
        if self._upto is None and self._paused is not None and self._paused():
            # Fetched, the batch would only go back, behind what the process applying the consumer now reads next.
            await self._pause(RECONNECT_POLL_S)
            return []
        try:
            messages = await self._subscription.fetch(wanted, timeout=self._fetch_timeout_s)
        except TimeoutError:  # nats-py's and asyncio's alike: nothing arrived in time
            self._failures = 0
            return []
        except Exception as error:  # connection lost, JetStream unavailable, consumer deleted ...
            if self._upto is not None:
                raise
            self._failures += 1
            backoff = backoff_s(self._failures, 0.2, MAX_FETCH_BACKOFF_S)
            log.warning("fetch_failed", consumer=self.name, error=describe(error), retry_in_s=backoff)
            await self._pause(backoff)
            return []
        self._failures = 0
        return messages

    def _check_in_order(self, messages: list[Msg]) -> None:
        for msg in messages:
            self._received += 1
            if msg.metadata.sequence.consumer != self._received:
                raise SkippedMessages(f"the read of the stream skipped messages before {msg.metadata.sequence.stream}")

    async def _delivered_all(self) -> bool:
        """Nothing left to deliver, and nothing delivered still on its way to us."""
        info = await self._subscription.consumer_info()
        delivered = info.delivered.consumer_seq if info.delivered is not None else 0
        return not info.num_pending and (delivered or 0) <= self._received

    async def _pause(self, seconds: float) -> None:
        """Sleep, unless stop() comes first."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stopping.wait()


class BatchPuller:
    """Hands every batch a reader yields, whole, to ``handle``, in a task of its own, until :meth:`stop`.
    No failure ends the loop: a batch the handler fails on is nak'd with backoff and the next one follows."""

    def __init__(self, reader: StreamReader, handle: BatchHandler, progress_every_s: float | None = None) -> None:
        self._reader = reader
        self._handle = handle
        self._progress_every_s = progress_every_s
        """While the handler works on a batch, tell the server this often that its unacked messages are in hand
        (``+WPI``), so that the ack wait can be short: a crashed consumer's messages come back after it, not after
        the longest a batch may take."""
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"pull:{self._reader.name}")
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not self._stopping:  # nothing should end the loop but stop(): say so loudly
            error = None if task.cancelled() else task.exception()
            log.error("pull_loop_ended", consumer=self._reader.name, error=repr(error) if error else "cancelled")

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Ends the loop after the current fetch and the batch in hand; cancels it after ``timeout_s``."""
        self._stopping = True
        self._reader.stop()
        if self._task is not None:
            try:
                async with asyncio.timeout(timeout_s):
                    await self._task
            except TimeoutError:
                log.warning("pull_stop_timed_out", consumer=self._reader.name, timeout_s=timeout_s)
            except Exception as error:  # already logged by _ended; stopping goes on
                log.warning("pull_loop_failed", consumer=self._reader.name, error=repr(error))
            self._task = None

    async def _run(self) -> None:
        async for batch in self._reader.batches():
            working = None
            if self._progress_every_s is not None:
                working = asyncio.create_task(_in_progress(batch, self._progress_every_s))
            try:
                await self._handle(batch)
            except Exception:
                # A bug, not a delivery problem: nak what the handler left, with backoff, and go on with the next.
                log.exception("batch_failed", consumer=self._reader.name, size=len(batch))
                for msg in batch:
                    with contextlib.suppress(Exception):  # acked already, or the connection is gone
                        await msg.nak(delay=nak_delay(msg.metadata.num_delivered))
            finally:
                if working is not None:
                    await cancel_and_wait(working)  # nats-py loses a cancellation in a flush it forces


async def _in_progress(batch: list[Msg], every_s: float) -> None:
    """Every ``every_s``, reset the ack wait of the batch's messages not acked yet."""
    while True:
        await asyncio.sleep(every_s)
        for msg in batch:
            if not msg.is_acked:
                with contextlib.suppress(Exception):  # acked meanwhile, or the connection is gone
                    await msg.in_progress()


@contextlib.asynccontextmanager
async def read_in_order(
    nc: Client, stream: str, subjects: str, start: int, upto: int, batch_size: int, fetch_timeout_s: float
) -> AsyncIterator[AsyncIterator[list[Msg]]]:
    """The messages of ``stream`` on ``subjects`` from sequence ``start`` through ``upto``, in batches, through a
    consumer of its own that delivers in order and takes no acks (a bounded :class:`StreamReader`: a gap raises
    :class:`SkippedMessages`). The consumer is removed when the block ends, however it ends."""
    if start > upto:
        yield _nothing()
        return
    js = nc.jetstream()
    subscription = await js.pull_subscribe(
        subjects,
        stream=stream,
        config=ConsumerConfig(
            ack_policy=AckPolicy.NONE,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=start,
            inactive_threshold=300.0,  # the server removes it if this process dies
            mem_storage=True,
        ),
    )
    consumer: str | None = None
    try:
        consumer = (await subscription.consumer_info()).name
        reader = StreamReader(
            subscription, name=consumer, connection=nc, batch_size=batch_size, fetch_timeout_s=fetch_timeout_s,
            upto=upto,
        )  # fmt: skip
        yield reader.batches()
    finally:
        with contextlib.suppress(Exception):
            await subscription.unsubscribe()  # an ephemeral consumer goes with its last subscription
        if consumer is not None:
            with contextlib.suppress(Exception):  # else the server removes it after inactive_threshold
                await js.delete_consumer(stream, consumer)


async def _nothing() -> AsyncIterator[list[Msg]]:
    return
    yield
