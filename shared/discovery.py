"""Which workers are running: each worker process answers NATS service discovery (the nats.micro protocol,
``$SRV.PING|INFO|STATS.<name>``) under its part's name, saying where it runs and since when; ``ontofabric status``
pings each name and lists who answers."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib.metadata import version as package_version

from nats import micro
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.micro.service import Service

DISCOVERY_WAIT_S = 0.5
"""How long replies to a service-discovery ping are gathered."""


async def announce(nc: Client, name: str, description: str, **details: str) -> Service:
    """Answer service discovery as ``name`` until the service is stopped (or the connection closes)."""
    metadata = {"host": socket.gethostname(), "pid": str(os.getpid()), "started": datetime.now(UTC).isoformat()}
    return await micro.add_service(
        nc,
        name=name,
        version=package_version("ontofabric"),
        description=description,
        metadata={**metadata, **details},
    )


@dataclass(frozen=True)
class Worker:
    id: str
    version: str
    host: str | None
    pid: str | None
    started: str | None
    details: dict[str, str] = field(default_factory=dict)
    """What else the worker said of itself (a projector: its index and partitions)."""


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
