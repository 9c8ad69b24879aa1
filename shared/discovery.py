"""Which workers are running: each worker process answers NATS service discovery (the nats.micro protocol,
``$SRV.PING|INFO|STATS[.<name>[.<id>]]``) under its part's name, saying where it runs and since when;
``ontofabric status`` pings each name and lists who answers.

The answers are our own, not nats.micro's service: its handlers reply with ``msg.respond``, which sends the
request's headers back with the reply, so one ping carrying large headers took the reply over max_payload and the
server ended the connection of every worker that answered it (an independent review, 2026-11-28)."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import os
import socket
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib.metadata import version as package_version
from pathlib import Path

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import TimeoutError as NatsTimeoutError

from .jetstream import subscriptions_visible
from .logging import describe, get_logger

log = get_logger(__name__)

DISCOVERY_WAIT_S = 0.5
"""How long replies to a service-discovery ping are gathered."""


@dataclass
class Announcement:
    """A worker answering service discovery; :meth:`stop` ends it."""

    subscriptions: list[Subscription]
    id: str = ""
    """The id this worker answers under."""
    started: str = ""
    """When it began to answer, as its answers say (ISO 8601, UTC)."""

    async def stop(self) -> None:
        for subscription in self.subscriptions:
            await subscription.unsubscribe()
        self.subscriptions = []


@dataclass
class Endpoint:
    """A subject a worker answers requests on, and what it has answered there (nats.micro's endpoint stats)."""

    name: str
    subject: str
    queue_group: str
    requests: int = 0
    errors: int = 0
    last_error: str = ""
    processing_ns: int = 0

    def record(self, seconds: float, error: str | None) -> None:
        """One answer, given ``seconds`` after its request arrived; ``error``: its error code, if it is one."""
        self.requests += 1
        self.processing_ns += max(0, round(seconds * 1e9))
        if error is not None:
            self.errors += 1
            self.last_error = error

    def info(self) -> dict[str, object]:
        return {"name": self.name, "subject": self.subject, "queue_group": self.queue_group, "metadata": None}

    def stats(self) -> dict[str, object]:
        return {
            "name": self.name, "subject": self.subject, "queue_group": self.queue_group,
            "num_requests": self.requests, "num_errors": self.errors, "last_error": self.last_error,
            "processing_time": self.processing_ns,
            "average_processing_time": self.processing_ns // self.requests if self.requests else 0,
        }  # fmt: skip


async def announce(
    nc: Client, name: str, description: str, details: Mapping[str, str], endpoints: Sequence[Endpoint] = ()
) -> Announcement:
    """Answer service discovery as ``name`` until the announcement is stopped (or the connection closes): PING,
    INFO and STATS, to all services, to ``name``'s and to this one's, with nats.micro's documents; ``details`` go
    into its metadata, INFO lists ``endpoints``, STATS says what each has answered so far."""
    started = datetime.now(UTC)
    metadata = {
        "host": socket.gethostname(), "pid": str(os.getpid()), "started": started.isoformat(),
        SCHEMA: release_schema(), BUILD: release_build(), **details,
    }  # fmt: skip
    service_id = uuid.uuid4().hex
    ping = {
        "type": "io.nats.micro.v1.ping_response", "id": service_id, "name": name,
        "version": package_version("ontofabric"), "metadata": metadata,
    }  # fmt: skip
    info = {
        **ping, "type": "io.nats.micro.v1.info_response", "description": description,
        "endpoints": [endpoint.info() for endpoint in endpoints],
    }  # fmt: skip
    stats = {
        **ping, "type": "io.nats.micro.v1.stats_response",
        "started": started.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z",
    }  # fmt: skip
    answers: dict[str, Callable[[], bytes]] = {
        "PING": lambda: json.dumps(ping).encode(),
        "INFO": lambda: json.dumps(info).encode(),
        "STATS": lambda: json.dumps({**stats, "endpoints": [endpoint.stats() for endpoint in endpoints]}).encode(),
    }
    subscriptions = []
    for verb, answer in answers.items():
        handler = _answering(nc, answer)
        for subject in (f"$SRV.{verb}", f"$SRV.{verb}.{name}", f"$SRV.{verb}.{name}.{service_id}"):
            subscriptions.append(await nc.subscribe(subject, cb=handler))
    # Answering once this returns: a ping sent right after (status, a standby's look) had missed the worker while
    # its subscriptions still waited in the client's buffer (a test's status, run at once, saw no such projector).
    await subscriptions_visible(nc)
    return Announcement(subscriptions, service_id, metadata["started"])


def _answering(nc: Client, body: Callable[[], bytes]) -> Callable[[Msg], Awaitable[None]]:
    async def answer(msg: Msg) -> None:
        if not msg.reply:
            return
        try:
            await nc.publish(msg.reply, body())  # without the request's headers (the module's docstring)
        except Exception as error:  # the connection going away: the pinger hears from the others
            log.warning("discovery_answer_failed", error=describe(error))

    return answer


@dataclass(frozen=True)
class Worker:
    id: str
    version: str
    host: str | None
    pid: str | None
    started: str | None
    details: dict[str, str] = field(default_factory=dict)
    """What else the worker said of itself (a projector: its index and partitions)."""


def postgres_partitions(worker: Worker) -> tuple[int, frozenset[int]] | None:
    """The partition layout a Postgres projector announced and the partitions of it it applies (its ``partitions``
    detail: "all", or "0,2 of 4"); None for another index or an announcement without it."""
    if worker.details.get("index") != "postgres":
        return None
    held = worker.details.get("partitions", "")
    if held == "all":
        return 1, frozenset({0})
    indexes, of, count = held.rpartition(" of ")
    parts = indexes.split(",")
    if not of or not count.isdigit() or not all(part.isdigit() for part in parts):
        return None
    return int(count), frozenset(int(part) for part in parts)


def postgres_layout(worker: Worker) -> int | None:
    """The partition layout a Postgres projector announced; None for another index."""
    announced = postgres_partitions(worker)
    return None if announced is None else announced[0]


def running_layouts(projectors: Iterable[Worker]) -> set[int]:
    """The partition layouts the Postgres projectors among ``projectors`` announce: what reads the index's position
    reads theirs beside its own configured one (``ONTOFABRIC_PROJECTOR_PARTITIONS`` may be unset where it runs)."""
    return {layout for layout in map(postgres_layout, projectors) if layout is not None}


def held_elsewhere(
    own_id: str, own_started: str, layout: int, partitions: Iterable[int], peers: Iterable[Worker]
) -> set[int]:
    """Of a process's ``partitions`` (of ``layout``), those a live Postgres projector that began before it also
    applies (its start, then its id, decide a tie): each consumer is applied by one process at a time. With several
    processes taking batches of one consumer, a later copy of an event (stored again by another publisher session)
    could commit in one before its first copy in another; every change between them was then older than the row,
    and lost for good (a red team, 2026-11-29; services/projector/worker.py)."""
    mine = (own_started, own_id)
    held: set[int] = set()
    for peer in peers:
        announced = postgres_partitions(peer)
        if peer.id == own_id or announced is None or announced[0] != layout:
            continue
        if (peer.started or "", peer.id) < mine:
            held |= set(partitions) & announced[1]
    return held


INSTANCE = "instance"
"""The detail that names the worker object behind an announcement, the same across its announcements (a process
that gives its seniority up answers anew under another id)."""
SCHEMA = "schema"
"""The detail that names the latest database migration the worker's release knows: the package's version number
is the same across releases, and a projector of an earlier release beside a current one writes rows by its own
rules (an upgrade tester's). Absent from releases before it was announced."""


def release_schema() -> str:
    """This release's :data:`SCHEMA` detail."""
    from .db import migrations  # the migrations' package, read once a worker announces itself

    return str(migrations()[-1].version)


BUILD = "build"
"""The detail that tells releases of the same schema apart: a digest of the release's code. An upgrade tester's
query workers of two releases, both of schema 35, ranked one query two ways, and status saw one release."""


@functools.cache
def release_build() -> str:
    """This release's :data:`BUILD` detail: the first 12 hex digits of a SHA-256 over its Python files (their
    paths and bytes), the same wherever the same release is installed."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for folder in ("contracts", "services", "shared"):
        for path in sorted((root / folder).rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def remembered_peers(
    peers: Mapping[str, tuple[float, Worker]], answered: Iterable[Worker], now: float, lease_s: float, gone: Set[str]
) -> tuple[dict[str, tuple[float, Worker]], set[str]]:
    """The workers to count on after a look, each with when it last answered (``peers`` before it, ``answered``
    now, at ``now``), and the ids that are gone from now on. A worker that has not answered for ``lease_s`` is gone
    (a process away that long gives its seniority up and answers anew: its old id answering again as it wakes is
    not to be stood by for), and so is an announcement whose worker (its ``instance``) answers under a newer one.
    Ids in ``gone`` stay out."""
    current = dict(peers)
    newest: dict[str, Worker] = {}
    for worker in answered:
        if worker.id in gone:
            continue
        current[worker.id] = (now, worker)
        instance = worker.details.get(INSTANCE)
        if instance:
            known = newest.get(instance)
            if known is None or (known.started or "") < (worker.started or ""):
                newest[instance] = worker
    kept: dict[str, tuple[float, Worker]] = {}
    departed: set[str] = set()
    for key, (at, worker) in current.items():
        if key in gone:
            continue
        renewed = newest.get(worker.details.get(INSTANCE, ""))
        if now - at > lease_s or (renewed is not None and renewed.id != key):
            departed.add(key)
        else:
            kept[key] = (at, worker)
    return kept, departed


async def discover(nc: Client, name: str, wait_s: float = DISCOVERY_WAIT_S) -> list[Worker]:
    """The workers that answer a service-discovery ping of ``name`` within ``wait_s``, the longest running first."""
    replies: list[Msg] = []
    subscription = await nc.subscribe(nc.new_inbox())
    try:
        await nc.publish(f"$SRV.PING.{name}", b"", reply=subscription.subject)
        deadline = asyncio.get_running_loop().time() + wait_s
        while (left := deadline - asyncio.get_running_loop().time()) > 0:
            try:
                replies.append(await subscription.next_msg(timeout=left))
            except NatsTimeoutError:
                break
        # And those already read off the socket: a loop stalled past the deadline found them queued, dropped (a
        # flake hunter's reading: a status would see no worker answering).
        while subscription.pending_msgs:
            replies.append(await subscription.next_msg(timeout=DISCOVERY_WAIT_S))
    finally:
        await subscription.unsubscribe()
    workers = []
    for reply in replies:
        try:
            ping = json.loads(reply.data)
            meta = dict(ping.get("metadata") or {})
            host, pid, started = meta.pop("host", None), meta.pop("pid", None), meta.pop("started", None)
            workers.append(Worker(ping["id"], ping.get("version", ""), host, pid, started, meta))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # not a nats.micro answer: nothing to list
    return sorted(workers, key=lambda worker: worker.started or "")
