"""Where an ingester keeps what it last published per workspace and branch: a KV bucket whose keys start with the
workspace's token, so a NATS permission on ``$KV.<bucket>.<workspace>.>`` confines an ingester to its own
workspaces (an object store cannot: its chunks are named by random ids). docs/security.md.

A manifest can outgrow one message, so it is stored compressed in parts. Each (workspace, branch) has a head key
naming a generation and its part count; a save writes the parts of a new generation under keys of their own, then
swaps the head with compare-and-set. A crash before the swap leaves the old manifest whole; of two saves racing from
one head only one wins, the other gets :class:`ManifestChanged`. The parts a head no longer names are purged with
markers that expire (per-message TTL), so the bucket does not grow with every save.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from nats.errors import NoRespondersError
from nats.js import JetStreamContext
from nats.js.errors import (
    BucketNotFoundError,
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)
from nats.js.kv import KeyValue

from .jetstream import (
    NATS_AWAY_RETRY_S,
    REPEATED_ANSWER,
    RETRY_FOR_S,
    RETRY_WAIT_S,
    RETRYABLE,
    NotSetUp,
    connection_of,
    refused_promptly,
)
from .logging import describe, get_logger
from .subjects import Names, decode_token, encode_token

log = get_logger(__name__)
T = TypeVar("T")

NO_RESPONDERS_FOR_S = 5.0
"""How long a manifest read that no JetStream server answers is made again before the bucket counts as missing."""
PART_BYTES = 256 * 1024
"""Well below nats-server's default 1 MB message limit."""
PURGE_MARKER_TTL_S = 60.0


class ManifestChanged(Exception):
    """Another save of the same workspace and branch landed since this one's manifest was loaded."""


class ManifestUnavailable(Exception):
    """The manifest could not be read or saved while the NATS server stayed away (the retry time passed)."""


class ManifestMissing(Exception):
    """The head names a part that is not there (removed by hand, or a bucket restored in part)."""

    def __init__(self, message: str, head_revision: int | None = None) -> None:
        super().__init__(message)
        self.head_revision = head_revision
        """The revision of the head read."""


@dataclass(frozen=True)
class StoredManifest:
    data: bytes | None
    """The manifest as saved; None when nothing was saved yet."""
    revision: int
    """The head's revision, to save against; 0 when there is no head."""
    generation: str = ""
    parts: int = 0


def _prefix(workspace: str, branch: str) -> str:
    return f"{encode_token(workspace)}.{encode_token(branch)}"


class ManifestStore:
    def __init__(self, js: JetStreamContext, names: Names, part_bytes: int = PART_BYTES) -> None:
        self._js = js
        self._names = names
        self._part_bytes = part_bytes
        self._kv: KeyValue | None = None

    async def _bucket(self) -> KeyValue:
        # Not js.key_value(), which asks for the stream's info: an ingester may not (the info lists every key,
        # so every workspace's and branch's name).
        if self._kv is None:
            bucket = self._names.manifest_bucket
            self._kv = KeyValue(name=bucket, stream=f"KV_{bucket}", pre=f"$KV.{bucket}.", js=self._js, direct=True)
        return self._kv

    async def _entry(self, key: str) -> KeyValue.Entry | None:
        bucket = self._names.manifest_bucket
        subject = f"$JS.API.DIRECT.GET.KV_{bucket}.$KV.{bucket}.{key}"
        # No responder: the bucket does not exist, or the server is stopping or starting, its connection still up
        # and JetStream not answering. An ingester may not ask the stream's info to tell which, so the read is
        # made again for a few seconds first (a fault tester's ingest, started as `up` restarted, was told the
        # bucket did not exist, exit 2; the same ingest a moment later ran).
        give_up_at = time.monotonic() + NO_RESPONDERS_FOR_S
        while True:
            try:
                entry = await refused_promptly(connection_of(self._js), subject, self._stored(key))
            except (KeyNotFoundError, KeyDeletedError):
                return None
            except NoRespondersError:
                if time.monotonic() + NATS_AWAY_RETRY_S > give_up_at:
                    raise NotSetUp(
                        f"the bucket {bucket} does not exist: start a projector once to create the streams "
                        "(`ontofabric up`, or `ontofabric projector` beside `up --no-projector`)"
                    ) from None
                await asyncio.sleep(NATS_AWAY_RETRY_S)
                continue
            if entry is None:  # a server's answer stored under the key (another tenant's direct get): no manifest's
                raise ManifestMissing(
                    f"the ingest manifest key {key} holds a NATS server's answer, not what an ingester wrote (another "
                    "client had one sent there)"
                )
            return entry

    async def _stored(self, key: str) -> KeyValue.Entry | None:
        """The key's entry as a direct get answers it; None for one whose stored message is itself a server's
        answer (:data:`~ontofabric.shared.jetstream.REPEATED_ANSWER`), which a KV get reads as a value: a red team
        had a direct get of its own values answered onto another tenant's head and part, and that tenant's next
        ingest sent nothing it had removed, for good."""
        bucket = self._names.manifest_bucket
        try:
            msg = await self._js.get_msg(f"KV_{bucket}", subject=f"$KV.{bucket}.{key}", direct=True)
        except NotFoundError:
            raise KeyNotFoundError from None
        headers = msg.headers or {}
        if REPEATED_ANSWER in headers:
            return None
        operation = headers.get("KV-Operation")
        if operation in ("DEL", "PURGE"):
            raise KeyDeletedError
        return KeyValue.Entry(self._names.manifest_bucket, key, msg.data, msg.seq, None, None, operation)

    async def _get(self, key: str) -> bytes | None:
        entry = await self._entry(key)
        return None if entry is None else entry.value or b""

    async def _retried(self, attempt: Callable[[], Awaitable[T]], doing: str, workspace: str, branch: str) -> T:
        """``attempt()``, made again while the NATS server does not answer, as a delta's publish is (a fault
        tester's ingest, the server stopped for 20 s while it embedded, ended in a traceback saving its manifest);
        past the retry time, :class:`ManifestUnavailable`."""
        wait, give_up_at = RETRY_WAIT_S[0], time.monotonic() + RETRY_FOR_S
        while True:
            try:
                return await attempt()
            except RETRYABLE as error:
                if time.monotonic() + wait > give_up_at:
                    raise ManifestUnavailable(
                        f"the ingest manifest of {workspace}/{branch} could not be {doing} within {RETRY_FOR_S:.0f} "
                        f"s ({describe(error)}): is the NATS server running, with room in its JetStream store (its log "
                        "says)? The same ingest again is safe"
                    ) from error
                log.warning("manifest_retried", workspace=workspace, branch=branch, doing=doing, error=describe(error))
                await asyncio.sleep(wait)
                wait = min(RETRY_WAIT_S[1], wait * 2)

    async def load(self, workspace: str, branch: str) -> StoredManifest:
        return await self._retried(lambda: self._load(workspace, branch), "read", workspace, branch)

    async def _load(self, workspace: str, branch: str) -> StoredManifest:
        """The manifest the head names. Read while another ingest saves, the parts may be purged between reading
        the head and them: read again from the new head, as long as the head keeps moving."""
        while True:
            try:
                return await self._load_once(workspace, branch)
            except ManifestMissing as missing:
                head = await self._entry(f"{_prefix(workspace, branch)}.head")
                if head is None or head.revision == missing.head_revision:
                    raise

    async def _load_once(self, workspace: str, branch: str) -> StoredManifest:
        prefix = _prefix(workspace, branch)
        head_entry = await self._entry(f"{prefix}.head")
        if head_entry is None:
            return StoredManifest(None, 0)
        try:
            head = json.loads(head_entry.value or b"{}")
            generation, count = str(head["generation"]), int(head["parts"])
        except (ValueError, TypeError, KeyError) as error:
            # Not one an ingester wrote: a JetStream acknowledgement another client had sent to this key, say.
            raise ManifestMissing(
                f"the ingest manifest head of {workspace}/{branch} ({prefix}.head, revision {head_entry.revision}) "
                f"is not one an ingester wrote: {(head_entry.value or b'')[:80]!r}",
                head_entry.revision,
            ) from error
        parts = await asyncio.gather(*(self._get(f"{prefix}.parts.{generation}.{i}") for i in range(count)))
        if any(part is None for part in parts):
            raise ManifestMissing(
                f"a part of the ingest manifest of {workspace}/{branch} is missing", head_entry.revision
            )
        data = zlib.decompress(b"".join(part or b"" for part in parts))
        return StoredManifest(data, head_entry.revision or 0, generation, count)

    async def save(self, workspace: str, branch: str, data: bytes, loaded: StoredManifest) -> StoredManifest:
        """Store ``data`` as the manifest, if the head is still the one ``loaded`` read; else ManifestChanged."""
        prefix = _prefix(workspace, branch)
        generation = uuid.uuid4().hex
        blob = zlib.compress(data)
        chunks = [blob[i : i + self._part_bytes] for i in range(0, len(blob), self._part_bytes)] or [b""]
        head = json.dumps({"generation": generation, "parts": len(chunks)}).encode()
        keys = [f"{prefix}.parts.{generation}.{i}" for i in range(len(chunks))]
        subjects = [f"$KV.{self._names.manifest_bucket}.{key}" for key in [*keys, f"{prefix}.head"]]

        async def attempt() -> int:
            try:
                writes = self._write(prefix, keys, chunks, head, loaded.revision)
                return await refused_promptly(connection_of(self._js), subjects, writes)
            except KeyWrongLastSequenceError as error:
                now = await self._entry(f"{prefix}.head")
                if now is not None and now.value == head:  # this save's own swap, its answer lost on the way
                    return now.revision or 0
                await self._purge(prefix, generation, len(chunks))
                raise ManifestChanged(f"another ingest of {workspace}/{branch} saved its manifest first") from error

        revision = await self._retried(attempt, "saved", workspace, branch)
        try:  # saved: the previous generation's parts are only left behind if this cannot be done
            purge = functools.partial(self._purge, prefix, loaded.generation, loaded.parts)
            await self._retried(purge, "cleaned up", workspace, branch)
        except ManifestUnavailable as unavailable:
            log.warning("manifest_parts_left", workspace=workspace, branch=branch, error=str(unavailable))
        return StoredManifest(data, revision, generation, len(chunks))

    async def _write(self, prefix: str, keys: list[str], chunks: list[bytes], head: bytes, last: int) -> int:
        kv = await self._bucket()
        for key, chunk in zip(keys, chunks, strict=True):
            await kv.put(key, chunk)
        if last:
            return await kv.update(f"{prefix}.head", head, last=last)
        return await kv.create(f"{prefix}.head", head)

    async def _purge(self, prefix: str, generation: str, parts: int) -> None:
        """Remove a generation's parts: a purge marker takes each one's place (the bucket keeps one message per
        key) and expires, so nothing is left. Without the rollup header nats-py's purge sends: the bucket refuses
        those (``ensure_jetstream``)."""
        for i in range(parts):
            subject = f"$KV.{self._names.manifest_bucket}.{prefix}.parts.{generation}.{i}"
            await self._js.publish(subject, headers={"KV-Operation": "PURGE"}, msg_ttl=PURGE_MARKER_TTL_S)


async def migrate_legacy_manifests(js: JetStreamContext, names: Names) -> int:
    """Move the manifests an earlier version kept in one object store of every workspace into the KV bucket, then
    delete that store (anyone allowed in it could read or rewrite every workspace's). Returns how many moved."""
    try:
        legacy = await js.object_store(names.legacy_manifest_bucket)
    except (BucketNotFoundError, NotFoundError):
        return 0
    try:
        objects = await legacy.list()
    except NotFoundError:  # an empty store
        objects = []
    store, moved = ManifestStore(js, names), 0
    for info in objects:
        workspace_token, _, branch_token = info.name.partition("/")
        try:
            workspace, branch = decode_token(workspace_token), decode_token(branch_token)
        except ValueError:
            log.warning("legacy_manifest_skipped", name=info.name, reason="not <workspace>/<branch>")
            continue
        if (await store.load(workspace, branch)).data is None:
            result = await legacy.get(info.name)
            await store.save(workspace, branch, result.data or b'{"entries": {}}', StoredManifest(None, 0))
            moved += 1
    await js.delete_object_store(names.legacy_manifest_bucket)
    log.info("legacy_manifests_moved", moved=moved, bucket=names.legacy_manifest_bucket)
    return moved
