"""The Postgres sink: a batch in one transaction of the store, then the ontologyVersions it changed announced.

The same sink writes a rebuild's shadow tables, without announcements (the swap announces them)."""

from __future__ import annotations

from collections.abc import Sequence

from ontofabric.shared.db import is_transient
from ontofabric.shared.logging import describe, get_logger

from .planning import REUSED_DETAIL, Delta, Rejection
from .reembedding import ModelChanged
from .runner import Written
from .store import BatchResult, Fenced, PostgresProjectionStore
from .versions import VersionPublisher

log = get_logger(__name__)


class NotAnnounced(Exception):
    """Committed, but the new versions were not announced: the batch comes back (all no-ops) and announces."""


class PostgresSink:
    def __init__(
        self, store: PostgresProjectionStore, versions: VersionPublisher | None, index: str = "postgres"
    ) -> None:
        self.index = index
        """The index it keeps: a label on metrics, logs and dead letters."""
        self._store = store
        self._versions = versions
        self._changed: set[str] = set()
        """Workspaces whose partitions changed since the last ``settled``."""

    async def write(self, deltas: Sequence[Delta], redelivered: bool) -> Written:
        result = await self._store.apply(deltas)
        self._changed |= {delta.envelope.workspace for delta in result.plan.applied}
        if self._versions is not None:
            try:
                await self._announce(result, redelivered)
            except Exception as error:
                raise NotAnnounced(describe(error)) from error
        log.info(
            "batch_projected",
            index=self.index,
            applied=len(result.plan.applied),
            noops=len(result.plan.noops),
            versions={f"{v.workspace}/{v.branch}": v.version.label for v in result.versions},
        )
        return Written(
            applied=len(result.plan.applied),
            noops=len(result.plan.noops),
            refused={
                seq: Rejection("event_id_reused", REUSED_DETAIL.format(seq=first.seq))
                for seq, first in result.plan.reused.items()
            },
        )

    async def _announce(self, result: BatchResult, redelivered: bool) -> None:
        assert self._versions is not None
        # A redelivered batch may follow a crash between commit and announcement: announce it again then.
        for update in result.versions:
            if redelivered or (update.workspace, update.branch) in result.plan.versions:
                await self._versions.publish(update)

    def retryable(self, error: BaseException) -> bool:
        # Fenced: the batch is left to the process that has claimed the consumer since.
        return isinstance(error, NotAnnounced | ModelChanged | Fenced) or is_transient(error)

    async def settled(self) -> None:
        """Fresh planner statistics for the partitions that changed much: an optimisation, never a reason to
        retry a batch."""
        workspaces, self._changed = self._changed, set()
        if not workspaces:
            return
        try:
            analysed = await self._store.refresh_statistics(workspaces)
        except Exception as error:
            log.warning("statistics_refresh_failed", error=describe(error))
            return
        if analysed:
            log.info("partitions_analysed", partitions=analysed)
