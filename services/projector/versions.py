"""ontologyVersion announcements: the latest version per (workspace, branch) in the KV bucket and on the event
subject, after the commit that made it (projectors, and a rebuild after its swap)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError, NoStreamResponseError
from nats.js.kv import KeyValue
from pydantic import ValidationError
from tenacity import AsyncRetrying, RetryError, retry_if_exception_type, stop_after_attempt

from ontofabric.contracts import OntologyVersionChanged
from ontofabric.shared.jetstream import server_answer_headers
from ontofabric.shared.logging import describe, get_logger
from ontofabric.shared.subjects import Names

from .planning import VersionState
from .store import VersionUpdate, unsigned64

log = get_logger(__name__)

CAS_ATTEMPTS = 20
READS_AT_ONCE = 32


class VersionNotAnnounced(Exception):
    """The KV compare-and-set never succeeded; the batch is retried (its deltas are no-ops then)."""


class VersionPublisher:
    """Compare-and-set on the KV revision, so two projector workers can never leave an older version behind."""

    def __init__(
        self, nc: Client, kv: KeyValue, names: Names, remake: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        self._nc = nc
        self._kv = kv
        self._names = names
        self._remake = remake
        """Makes the bucket again where it is missing, and announces into it what the index holds (a projector's;
        None: others only report it)."""
        self._remaking = False

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
        except (NoStreamResponseError, NoRespondersError, BucketNotFoundError) as error:
            # Deleted behind the projector's back (a fault tester's: every batch retried for ever, the bucket
            # unnamed): made again where it is missing; the batch comes back and announces.
            bucket = self._names.version_bucket
            if self._remake is not None and not self._remaking:  # the remake announces through here in turn
                log.error("versions_bucket_unanswered", bucket=bucket, error=describe(error), action="made again")
                self._remaking = True
                try:
                    await self._remake()
                finally:
                    self._remaking = False
            raise VersionNotAnnounced(
                f"{key}: the versions bucket {bucket} did not answer ({describe(error)})"
            ) from error
        await self._nc.publish(self._names.version_event_subject(update.workspace, update.branch), data)

    async def announced_revisions(self, holds: Callable[[str], bool]) -> dict[tuple[str, str], int]:
        """The revision of every version the bucket holds for the workspaces ``holds``, read a few at a time."""
        keys = [
            key for key in await version_keys(self._nc, self._names) if holds(self._names.parse_version_key(key)[0])
        ]
        reading = asyncio.Semaphore(READS_AT_ONCE)

        async def revision(key: str) -> int | None:
            async with reading:
                try:
                    entry = await self._kv.get(key)
                    return OntologyVersionChanged.model_validate_json(entry.value or b"").revision
                except (KeyNotFoundError, ValidationError):  # gone since, or not a version
                    return None

        read = await asyncio.gather(*(revision(key) for key in keys))
        return {self._names.parse_version_key(k): r for k, r in zip(keys, read, strict=True) if r is not None}

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
        if stored >= record.revision and await self._answered_by_server(key):
            # A red team's: a direct get of a tenant's own value answered onto another's key, a version of a
            # revision no announcement reaches, froze that workspace's announced version for good.
            log.warning("version_entry_replaced", key=key, reason="a server's answer, not a projector's")
            stored = -1
        if stored >= record.revision:
            return False
        await self._kv.update(key, data, last=entry.revision)
        return True

    async def _answered_by_server(self, key: str) -> bool:
        """Whether the key's entry, as its stream stores it, is a server's answer: its headers say so (a KV get
        shows the value alone). Read only where the entry would stop this announcement."""
        stored = await self._nc.jetstream().get_msg(
            self._names.version_stream, subject=f"$KV.{self._names.version_bucket}.{key}"
        )
        return server_answer_headers(stored.headers)


async def version_keys(nc: Client, names: Names) -> list[str]:
    """The keys of the versions bucket, from its stream's own subject list: nats-py's `kv.keys()` watches the bucket
    and stops at its first "nothing pending" marker, which under load can come before the first key is delivered,
    and then reports no keys at all."""
    prefix = f"$KV.{names.version_bucket}."
    info = await nc.jetstream().stream_info(names.version_stream, subjects_filter=f"{prefix}>")
    return sorted(subject[len(prefix) :] for subject in info.state.subjects or {})


async def announce_records(publisher: VersionPublisher, records: Iterable[Mapping[str, Any]]) -> None:
    """Announce versions as the versions table holds them (workspace, branch, state_hash, stream_seq, revision)."""
    for r in records:
        version = VersionState(unsigned64(r["state_hash"]), r["stream_seq"])
        await publisher.publish(VersionUpdate(r["workspace"], r["branch"], version, r["revision"]))
