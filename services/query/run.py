"""One query's run: what each stage recorded as it went, from which the answer's ``_meta`` is built.

Stages never copy facts into a result type of their own: they time themselves, name what failed and report what
ran here, and :meth:`QueryRun.meta` turns that into the ``_meta`` envelope.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic.alias_generators import to_camel

from ontofabric.contracts import OntologyQuery, QueryMeta
from ontofabric.contracts.query import FILTERS
from ontofabric.shared.logging import describe, get_logger

log = get_logger(__name__)

T = TypeVar("T")

_RUN_FIELDS = frozenset({"workspace", "branch", "degraded", "timings_ms", "cache_hit", "backend"})
"""``_meta`` fields the run fills itself; stages report the others."""


def milliseconds_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 3)


@dataclass
class QueryRun:
    query: OntologyQuery
    workspace: str
    started: float = field(default_factory=time.perf_counter)
    timings: dict[str, float] = field(default_factory=dict)
    degraded: list[str] = field(default_factory=list)
    """Parts that failed or were unavailable, in the order they did."""
    out_of_time: set[str] = field(default_factory=set)
    """Those of them skipped or cut for the deadline (not failed)."""
    versions_read: set[str] = field(default_factory=set)
    """The ontologyVersion of every snapshot the answer read: more than one means it mixes states."""
    reports: dict[str, Any] = field(default_factory=dict)
    """``_meta`` fields as the stages reported them, by their Python names."""
    deadline: float | None = None
    """When the reply is due (the event loop's clock); None: no deadline (evaluation, benchmarks)."""
    embedded: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once the query's embedding is done, failed, or not asked for: work that can wait for the CPU until then
    (the second model's query vector) does not slow it."""

    def time_left(self) -> float:
        """Seconds until the deadline; infinite without one."""
        return math.inf if self.deadline is None else self.deadline - asyncio.get_running_loop().time()

    @property
    def text(self) -> str:
        """The text of a search (``OntologyQuery.search_text``; a listing has none)."""
        text = self.query.search_text
        assert text is not None, "a listing runs no stage that reads the query text"
        return text

    async def timed(self, stage: str, work: Awaitable[T]) -> T:
        """``work``'s result; its wall time goes into ``_meta.timingsMs[stage]``, failed or not."""
        started = time.perf_counter()
        try:
            return await work
        finally:
            self.timings[stage] = milliseconds_since(started)

    async def guarded(
        self, part: str, work: Awaitable[T], *, stage: str | None = None, reserve_s: float | None = None
    ) -> T | None:
        """``work``'s result, or None when it failed: the part is then named in ``_meta.degraded`` and the answer
        goes on without it. ``stage``: time it under that name too. ``reserve_s``: the part is optional under a
        deadline; it must end that long before it (for what follows), and is skipped when it cannot (``deadline``
        and the part in ``_meta.degraded``)."""
        budget = self.time_left() - reserve_s if reserve_s is not None else math.inf
        if budget <= 0:
            if asyncio.iscoroutine(work):
                work.close()
            elif isinstance(work, asyncio.Future):
                work.cancel()
            self.skip_for_deadline(part)
            return None
        timed = self.timed(stage, work) if stage is not None else work
        try:
            # asyncio.timeout, not wait_for: wait_for runs the work as a task of its own, and when the answer is
            # cut while that task ends in an error (a statement cancelled), nobody retrieved the error: asyncio
            # logged "Task exception was never retrieved" for it, under whichever request ran at collection.
            async with asyncio.timeout(None if math.isinf(budget) else budget):
                return await timed
        except Exception as error:
            if isinstance(error, TimeoutError) and reserve_s is not None and self.time_left() <= reserve_s:
                self.skip_for_deadline(part)
            else:
                self.degrade(part, error)
            return None

    def skip_for_deadline(self, part: str) -> None:
        """``part`` did not run (or was cut short) for want of time before the request's deadline."""
        log.info("part_skipped", part=part, reason="deadline")
        if "deadline" not in self.degraded:
            self.degraded.append("deadline")
        self.degraded.append(part)
        self.out_of_time.add(part)

    def degrade(self, part: str, error: BaseException | None = None, **context: Any) -> None:
        if error is not None:
            log.warning("part_failed", part=part, error=describe(error), **context)
        self.degraded.append(part)

    def read(self, version: str | None) -> None:
        if version is not None:
            self.versions_read.add(version)

    def report(self, **fields: Any) -> None:
        """Record ``_meta`` fields (QueryMeta's Python names); a name QueryMeta does not have is a bug."""
        unknown = (fields.keys() - QueryMeta.model_fields.keys()) | (fields.keys() & _RUN_FIELDS)
        if unknown:
            raise KeyError(f"not _meta fields a stage reports: {sorted(unknown)}")
        self.reports.update(fields)

    def settle(self, *, consistent: bool) -> None:
        """After the last read: an answer that read more than one state, or lost documents between its reads,
        says so (it is then not cached)."""
        if len(self.versions_read) > 1 or not consistent:
            self.degrade("ontologyVersionChanged")

    def meta(self, backend: str, cache_hit: bool = False) -> QueryMeta:
        self.timings["total"] = milliseconds_since(self.started)
        return QueryMeta(
            workspace=self.workspace,
            branch=self.query.branch,
            # Said back, so that an agent sees its filters were read, and how (an agent tester's).
            filters={to_camel(name): value for name in FILTERS if (value := getattr(self.query, name)) is not None},
            degraded=list(self.degraded),
            timings_ms=dict(self.timings),
            cache_hit=cache_hit,
            backend=backend,
            **self.reports,
        )
