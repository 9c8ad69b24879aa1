"""ontologyVersion announcements: the latest version per (workspace, branch) in the KV bucket and on the event
subject, after the commit that made it (projectors, and a rebuild after its swap)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from nats.aio.client import Client
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue
from pydantic import ValidationError
from tenacity import AsyncRetrying, RetryError, retry_if_exception_type, stop_after_attempt

from ontofabric.contracts import OntologyVersionChanged
from ontofabric.shared.logging import get_logger
from ontofabric.shared.subjects import Names

from .planning import VersionState
from .store import VersionUpdate, unsigned64

log = get_logger(__name__)

CAS_ATTEMPTS = 20


class VersionNotAnnounced(Exception):
    """The KV compare-and-set never succeeded; the batch is retried (its deltas are no-ops then)."""


class VersionPublisher:
    """Compare-and-set on the KV revision, so two projector workers can never leave an older version behind."""

    def __init__(self, nc: Client, kv: KeyValue, names: Names) -> None:
        self._nc = nc
        self._kv = kv
        self._names = names

    async def publish(self, update: VersionUpdate) -> None:
        record = OntologyVersionChanged(
            workspace=update.workspace,
            branch=update.branch,
            ontology_version=update.version.label,
            stream_seq=update.version.stream_seq,
            revision=update.revision,
            updated_at=datetime.now(UTC),
        )
        data = record.model_dump_json().encode()
        key = self._names.version_key(update.workspace, update.branch)
        try:
            # Another worker writing in between makes the update fail: read again and compare again.
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(KeyWrongLastSequenceError), stop=stop_after_attempt(CAS_ATTEMPTS)
            ):
                with attempt:
                    if not await self._put_if_newer(key, record, data):
                        return  # this version, or a newer one, is announced already
        except RetryError as error:
            raise VersionNotAnnounced(f"{key}: the versions bucket kept changing under {CAS_ATTEMPTS} tries") from error
        await self._nc.publish(self._names.version_event_subject(update.workspace, update.branch), data)

    async def announced_revision(self, workspace: str, branch: str) -> int | None:
        """The revision of the version the bucket holds for this branch; None when it holds none (or not a version)."""
        try:
            entry = await self._kv.get(self._names.version_key(workspace, branch))
        except KeyNotFoundError:
            return None
        try:
            return OntologyVersionChanged.model_validate_json(entry.value or b"").revision
        except ValidationError:
            return None

    async def _put_if_newer(self, key: str, record: OntologyVersionChanged, data: bytes) -> bool:
        try:
            entry = await self._kv.get(key)
        except KeyNotFoundError:
            entry = None
        if entry is None or entry.value is None:
            await self._kv.create(key, data)
            return True
        try:
            stored = OntologyVersionChanged.model_validate_json(entry.value).revision
        except ValidationError:
            # Not a version: written by something else (a JetStream ack sent there as a reply subject). Replaced,
            # so one bad entry cannot stop the projector announcing versions.
            log.warning("version_entry_replaced", key=key, reason="unreadable")
            stored = -1
        if stored >= record.revision:
            return False
        await self._kv.update(key, data, last=entry.revision)
        return True


async def announce_records(publisher: VersionPublisher, records: Iterable[Mapping[str, Any]]) -> None:
    """Announce versions as the versions table holds them (workspace, branch, state_hash, stream_seq, revision)."""
    for r in records:
        version = VersionState(unsigned64(r["state_hash"]), r["stream_seq"])
        await publisher.publish(VersionUpdate(r["workspace"], r["branch"], version, r["revision"]))
