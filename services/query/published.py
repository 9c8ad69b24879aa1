"""What has been published to the delta stream, as this worker has seen it: the headers the stream republishes for
every delta it stores (its sequence and time), kept per workspace and branch until answers cover them.

An answer then says how many deltas of the branches it read were published past what the projector had handled,
and how long ago the oldest was (``_meta.freshness``). The watch counts what it has seen since the worker started:
a delta published before and not yet projected is not counted.
"""

from __future__ import annotations

import time
from collections import deque
from datetime import datetime

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from ontofabric.shared.logging import describe, get_logger
from ontofabric.shared.subjects import Names

from .core import Pending

log = get_logger(__name__)

MAX_TRACKED = 100_000
"""Deltas remembered per workspace and branch at most: past that, the oldest are forgotten (and not counted)."""


def _epoch(stamp: str) -> float:
    """An RFC 3339 time with up to nanoseconds, as nats-server writes it, in seconds since the epoch."""
    whole, _, fraction = stamp.rstrip("Z").partition(".")
    seconds = datetime.fromisoformat(whole + "+00:00").timestamp()
    return seconds + (float(f"0.{fraction}") if fraction else 0.0)


class PublishedDeltas:
    def __init__(self, nc: Client, names: Names) -> None:
        self._nc = nc
        self._names = names
        self._published: dict[tuple[str, str], deque[tuple[int, float]]] = {}
        self._subscription: Subscription | None = None

    async def start(self) -> None:
        self._subscription = await self._nc.subscribe(self._names.published_subjects, cb=self._seen)

    async def stop(self) -> None:
        if self._subscription is not None:
            await self._subscription.unsubscribe()
            self._subscription = None

    async def _seen(self, msg: Msg) -> None:
        try:
            headers = msg.headers or {}
            scope = self._names.scope_of_published(msg.subject)
            seq, at = int(headers["Nats-Sequence"]), _epoch(headers["Nats-Time-Stamp"])
        except (KeyError, ValueError) as error:
            log.warning("published_header_unreadable", subject=msg.subject, error=describe(error))
            return
        self._published.setdefault(scope, deque(maxlen=MAX_TRACKED)).append((seq, at))

    def pending(self, workspace: str, handled: dict[str, int]) -> Pending | None:
        if self._subscription is None:
            return None
        count, oldest = 0, None
        for branch, seq in handled.items():
            published = self._published.get((workspace, branch))
            while published and published[0][0] <= seq:  # covered: no answer from here on needs them
                published.popleft()
            if published:
                count += len(published)
                oldest = min(oldest or published[0][1], published[0][1])
        return Pending(count, None if oldest is None else round((time.time() - oldest) * 1000, 1))
