"""What the query worker knows of ontologyVersions: a watch on the versions KV bucket.

A watch first delivers the latest value of every key, so a worker started later still learns the current
version of every workspace and branch before it answers its first query.

A bucket deleted and made again (the projector remakes it, docs/reliability.md) starts its sequence anew, and the
watch's consumer, made again by nats-py at the sequence after the last it read, would skip every announcement the
new bucket holds: the worker took the old version for the announced one and cached no answer of a newer one until
a restart. So the tracker looks at the bucket's stream now and then and watches again from the start when it is
not the one it watched.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import datetime

from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue
from pydantic import ValidationError

from ontofabric.contracts import MAIN_BRANCH, NO_VERSION, OntologyVersionChanged, overlay_version
from ontofabric.shared.logging import describe, get_logger
from ontofabric.shared.subjects import Names
from ontofabric.shared.tasks import cancel_and_wait

log = get_logger(__name__)

LOOK_EVERY_S = 2.0
"""How often the tracker asks whether the bucket it watches is still the one there: about the delay with which a
new version reaches a worker after the bucket was made again."""

VersionListener = Callable[[str, str, str, bool], None]
"""Called with (workspace, branch, new version, rebuilt). ``rebuilt``: the version is the same, announced again with a
higher revision, because a rebuild replaced the workspace's index (``ontofabric rebuild``): what was read from the
old index is stale although its version is not."""


def is_rebuild(known_version: str | None, known_revision: int | None, version: str, revision: int) -> bool:
    """A rebuild announces the version it reproduced (the same deltas give the same version) with a higher
    revision; every other change of revision comes with a new version."""
    return known_version == version and known_revision is not None and revision > known_revision


class VersionTracker:
    def __init__(self, js: JetStreamContext, kv: KeyValue, names: Names, look_every_s: float = LOOK_EVERY_S) -> None:
        self._js = js
        self._kv = kv
        self._look_every_s = look_every_s
        self._names = names
        self._on_change: VersionListener | None = None
        self._versions: dict[tuple[str, str], str] = {}
        self._revisions: dict[tuple[str, str], int] = {}
        self._generations: dict[str, int] = {}
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def set_listener(self, listener: VersionListener) -> None:
        self._on_change = listener

    def current(self, workspace: str, branch: str) -> str:
        """The announced version of what a query on ``branch`` reads (main ⊕ branch)."""
        main = self._versions.get((workspace, MAIN_BRANCH), NO_VERSION)
        return overlay_version(main, branch, self._versions.get((workspace, branch)))

    def revision(self, workspace: str, branch: str) -> int:
        """The highest revision of the branch's version announced so far (0: none): what a read replica must have
        applied before it may answer."""
        return self._revisions.get((workspace, branch), 0)

    def generation(self, workspace: str) -> int:
        """How many rebuilds of the workspace this worker has seen: what was read before one is not to be kept."""
        return self._generations.get(workspace, 0)

    async def start(self, timeout_s: float = 30.0) -> None:
        self._task = asyncio.create_task(self._watch_forever(), name="version-watch")
        async with asyncio.timeout(timeout_s):
            await self._ready.wait()

    async def stop(self) -> None:
        if self._task is not None:
            task, self._task = self._task, None
            await cancel_and_wait(task)

    async def _watch_forever(self) -> None:
        failures = 0
        while True:
            try:
                made = await self._bucket_made()
                watcher = await self._kv.watchall()
                failures = 0
                try:
                    await self._follow(watcher, made)
                finally:
                    with contextlib.suppress(Exception):
                        await watcher.stop()  # type: ignore[no-untyped-call]
                await asyncio.sleep(0.1)  # a watch that ended by itself is not made again in a busy loop
            except asyncio.CancelledError:
                raise
            except Exception as error:
                failures += 1
                log.warning("version_watch_restart", error=str(error) or type(error).__name__, failures=failures)
                await asyncio.sleep(min(1.0 * failures, 10.0))  # a missing bucket waits for the projector to remake it

    async def _follow(self, watcher: KeyValue.KeyWatcher, made: datetime | None) -> None:
        """Apply the watch's entries until the bucket watched is no longer the one there."""
        reading = asyncio.create_task(self._read(watcher), name="version-watch-read")
        try:
            while not reading.done():
                await asyncio.wait({reading}, timeout=self._look_every_s)
                if reading.done():
                    break
                try:
                    now = await self._bucket_made()
                except Exception as error:  # not known now (NATS slow, say): the watch goes on (a review's)
                    log.debug("versions_bucket_unread", error=describe(error))
                    continue
                if now != made:
                    log.warning("versions_bucket_replaced", made=str(made), now=str(now))
                    return
            reading.result()
        finally:
            await cancel_and_wait(reading)

    async def _read(self, watcher: KeyValue.KeyWatcher) -> None:
        async for entry in watcher:
            if entry is None:  # every current value has been delivered
                self._ready.set()
                continue
            self._apply(entry.key, entry.value)

    async def _bucket_made(self) -> datetime | None:
        """When the bucket's stream was made (None: there is none), which tells a bucket made again from the one
        watched."""
        try:
            info = await self._js.stream_info(self._names.version_stream)
        except NotFoundError:
            return None
        return info.created

    def _apply(self, key: str, value: bytes | None) -> None:
        if not value:
            return
        try:
            record = OntologyVersionChanged.model_validate_json(value)
            workspace, branch = self._names.parse_version_key(key)
        except (ValidationError, ValueError) as error:
            log.warning("version_entry_unreadable", key=key, error=str(error))
            return
        scope = (workspace, branch)
        version = record.ontology_version
        rebuilt = is_rebuild(self._versions.get(scope), self._revisions.get(scope), version, record.revision)
        self._revisions[scope] = max(self._revisions.get(scope, 0), record.revision)
        if self._versions.get(scope) == version and not rebuilt:
            return
        self._versions[scope] = version
        if rebuilt:
            self._generations[workspace] = self._generations.get(workspace, 0) + 1
        log.info("ontology_version_seen", workspace=workspace, branch=branch, version=version, rebuilt=rebuilt)
        if self._on_change is not None:
            self._on_change(workspace, branch, version, rebuilt)
