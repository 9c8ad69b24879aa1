"""The projector processes: the Postgres projector, and the Azure AI Search projector when it is set up.

Each connects, makes sure the streams exist, and runs the projection runner over a durable consumer of its own
(consumer.py) with its sink: Postgres (postgres.py) or Azure AI Search (azure.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

import asyncpg
from azure.core.exceptions import AzureError
from azure.search.documents.aio import SearchClient
from azure.search.documents.indexes.aio import SearchIndexClient
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from ontofabric.shared.azure_search import index_client, index_definition, read_watermark, search_client
from ontofabric.shared.db import (
    WRITER_ROLE,
    create_pool,
    migrate,
    once_the_database_serves,
    stalled_after_s,
    wait_until_migrated,
)
from ontofabric.shared.discovery import (
    DISCOVERY_WAIT_S,
    INSTANCE,
    Announcement,
    Worker,
    announce,
    discover,
    held_elsewhere,
    postgres_partitions,
    remembered_peers,
)
from ontofabric.shared.jetstream import ack_floor, connect, ensure_jetstream, settled_by_other_layouts
from ontofabric.shared.jetstream import close as close_nats
from ontofabric.shared.logging import describe, get_logger
from ontofabric.shared.manifest_store import migrate_legacy_manifests
from ontofabric.shared.placement import Placement
from ontofabric.shared.runtime import with_login
from ontofabric.shared.settings import Settings
from ontofabric.shared.subjects import Names, Partition, encode_token, partition_of_token
from ontofabric.shared.tasks import cancel_and_wait
from ontofabric.shared.telemetry import housekeeping

from . import azure as azure_sink
from .azure import (
    MAX_KEYS_PER_LOOKUP,
    MIN_RETRY_S,
    RETRIES,
    AzureSearchIndex,
    AzureSink,
    Watermark,
    replay_if_index_lost,
)
from .consumer import DurableProjection, RunningProjection, restart_consumer, start_projection
from .following import delta_mark, refusal
from .planning import ANALYSIS_VERSION, Limits
from .postgres import PostgresSink
from .reembedding import Reembedder, reembedder_for
from .runner import ProjectionRunner
from .snapshots import compacted_through, find_snapshot_store, restore_snapshots
from .store import PostgresProjectionStore, documents_of_another_analysis
from .versions import VersionPublisher, announce_records

log = get_logger(__name__)


IDLE_IN_TRANSACTION_S = 10.0
"""How long the server lets a projector's batch transaction wait for its next statement before ending it. A
batch's statements follow one another without waiting on anything else; a projector frozen inside one (SIGSTOP,
a paused VM) held its workspaces' version rows locked, and every other projector's batches, which mix workspaces,
waited on them for as long as the freeze lasted (a red team's finding: 25 s of no projection anywhere)."""


HOLD_CHECK_S = 2.0
"""How often a Postgres projector asks which other processes apply its consumers."""
_VERSIONS_HELD = "SELECT workspace, branch, state_hash, stream_seq, revision FROM ontology_versions"
"""Every version a database holds, as announce_records reads them."""
HOLDER_LEASE_S = 6.0
"""How long a process that answered discovery still counts as applying its consumers after it stops answering: a
slow answer (a busy event loop) is not a process gone. A standby takes over within about this plus HOLD_CHECK_S."""
FLOOR_READ_S = 1.0
"""How long a look waits for its consumers' ack floors (read at once): a slow JetStream API (a leader election)
must not hold it past the lease; a floor not read leaves the index's position where it was."""
FAILING_HANDOVER_S = 30.0
"""How long a process applies nothing (every write failing for a passing reason: its database unreachable from it)
before it leaves its consumers to a process standing by, which may reach the database. Where none can, they take
turns at this pace; nothing is lost either way."""


STREAM_CHECK_S = 1.0
"""How long a look waits for its check of the stream a partition's index follows (as FLOOR_READ_S: a slow
JetStream API must not hold the look past the lease); not checked, a running projection goes on."""


class FillDeferred(Exception):
    """An index to fill from nothing waits for the next look (a compaction holds the stream's start)."""


class ProjectorService:
    """The Postgres projector: migrations, pool, and the durable consumers whose deltas go to Postgres, one for
    each partition of the workspaces it applies (``partitions``; by default ``projector_partition``, or all).

    A consumer another process began applying first is left to it: this one stands by, and takes it over when that
    process no longer answers discovery (:func:`held_elsewhere`)."""

    def __init__(
        self,
        settings: Settings,
        nats_url: str,
        database_url: str,
        partitions: Sequence[int] | None = None,
        *,
        writer_login: tuple[str, str] | None = None,
    ) -> None:
        """``writer_login``: a login (user, password) of the database's server that holds the writer role and
        nothing more, which the pools write through (the embedded PostgreSQL's); ``database_url`` then only
        migrates."""
        self.settings = settings
        self.names = Names(settings.subject_prefix)
        self._nats_url = nats_url
        self._database_url = database_url
        self._writer_login = writer_login
        if partitions is None:
            one = settings.projector_partition
            partitions = range(settings.projector_partitions) if one is None else [one]
        self._partitions = list(partitions)
        self._nc: Client | None = None
        self._projections: dict[int, RunningProjection] = {}
        """The consumers this process applies now, by partition."""
        self._new_projection: dict[int, Callable[[], DurableProjection]] = {}
        self._durables = self.names.postgres_projector_durables(settings.projector_partitions)
        """The consumers of its layout, by partition."""
        self._stores: dict[int, PostgresProjectionStore] = {}
        """Each partition's store, which holds this process's claim on its consumer."""
        self._runners: dict[int, ProjectionRunner] = {}
        """Each partition's runner: what fills its index from the snapshots (the consumer's projection has its own
        reference)."""
        self._peers: dict[str, tuple[float, Worker]] = {}
        """Projectors that answered discovery, by id, with when they last did (monotonic)."""
        self._holding: asyncio.Task[None] | None = None
        self._analysis_report: asyncio.Task[None] | None = None
        self._standing_by: set[int] = set()
        """The partitions this process leaves to an earlier one."""
        self._departed: set[str] = set()
        """Announcements not to be stood by for again: released, past the lease once, or answered anew."""
        self._heard_itself = True
        """Whether its last discovery ping reached its own announcement (and so the others')."""
        self._last_look: float | None = None
        """When its last look at the other projectors ended (monotonic)."""
        self._announced: tuple[str, dict[str, str]] = ("", {})
        """What it answers discovery with: its description and details."""
        self._pools: dict[int, asyncpg.Pool] = {}
        """Writer pools by the index of their database in the placement."""
        self._service: Announcement | None = None
        self._versions: VersionPublisher | None = None
        self._refused: dict[int, str] = {}
        """The partitions whose index does not read the delta stream as it is, with why (following.py)."""

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop()  # whatever started before the failure
            raise

    async def _start(self) -> None:
        settings, names = self.settings, self.names
        placement = Placement.of(settings, self._database_url)
        for index in self._partitions:
            database = placement.database_of_partition(index)
            if database not in self._pools:
                self._pools[database] = await self._writer_pool(placement.databases[database])
        # Beside projection, not before it: a diagnostic must neither hold up nor fail a start.
        self._analysis_report = asyncio.create_task(self._report_another_analysis(placement), name="analysis-report")
        nc = self._nc = await connect(self._nats_url, "ontofabric-projector", settings, wait_for_server=True)
        js = nc.jetstream()
        await ensure_jetstream(js, names, settings, reconcile=True)
        await migrate_legacy_manifests(js, names)
        versions = VersionPublisher(nc, await js.key_value(names.version_bucket), names, self._versions_bucket_again)
        self._versions = versions
        count = settings.projector_partitions
        durables = self._durables
        reembedders = {database: await self._reembedder(pool) for database, pool in self._pools.items()}
        for index in self._partitions:
            database = placement.database_of_partition(index)
            pool = self._pools[database]
            store = self._stores[index] = PostgresProjectionStore(pool, settings.text_search_config, durables[index])
            sink = PostgresSink(store, versions)
            runner = self._runners[index] = ProjectionRunner(
                sink, Limits.from_settings(settings), reembedders[database]
            )
            partition = Partition(index, count) if count > 1 else None
            self._new_projection[index] = functools.partial(
                DurableProjection, runner, js, names, durables[index], partition=partition,
                settled_elsewhere=functools.partial(self._settled_before, index),
                held_back=functools.partial(self._held_back, index),
            )  # fmt: skip
        held = "all" if count == 1 else f"{','.join(map(str, self._partitions))} of {count}"
        description = "ontofabric Postgres projector"
        models = ",".join(settings.models()) if settings.embedder != "none" else ""
        details = {"index": "postgres", "partitions": held, "models": models, INSTANCE: uuid.uuid4().hex}
        self._announced = (description, details)
        self._service = await announce(nc, names.projector_service, description, self._announced[1])
        await self._hold()  # the first look: only the consumers no earlier process applies start
        self._holding = asyncio.create_task(self._keep_holding(), name="projector-holding")

    async def _keep_holding(self) -> None:
        while True:
            await asyncio.sleep(HOLD_CHECK_S)
            try:
                await self._hold()
            except Exception as error:  # NATS away: the consumers held stay as they are
                log.warning("projector_holding_failed", error=describe(error))

    def holding(self) -> bool:
        """Whether this process's last look at the others is recent enough for it to go on applying: one away for
        longer than the lease (frozen, a paused VM) may have been replaced, and applies nothing more until it has
        looked again (a review: a woken holder applied new batches beside the one that had taken over, and lost an
        update)."""
        return self._last_look is not None and time.monotonic() - self._last_look <= HOLDER_LEASE_S

    def _held_back(self, partition: int) -> str | None:
        """Why this process does not apply the partition's consumer now (the batch in hand is not written): it has
        found the stream refused, or it no longer holds, or another process has claimed the consumer since it did.
        None: it goes on applying it. (A refused batch was logged as left to the holder: note 73.)"""
        if partition in self._refused:
            return "stream_refused"
        if not self.holding() or self._stores[partition].fenced:
            return "left_to_the_holder"
        return None

    async def _hold(self) -> None:
        """Apply the consumers no earlier process applies and no other process holds a live claim on (renewed
        within the lease by a process discovery shows, infra/migrations/0023), renew the claims of those it
        applies, and leave the others."""
        nc, service = self._nc, self._service
        assert nc is not None
        assert service is not None
        settings, names = self.settings, self.names
        durables = self._durables
        now = time.monotonic()
        answered = await discover(nc, names.projector_service)
        if not any(worker.id == service.id for worker in answered):
            # Its own answer late (its event loop busy: one demo in six said no peer could be known): once more,
            # longer, before it is read as unheard.
            answered = await discover(nc, names.projector_service, 2 * DISCOVERY_WAIT_S)
        # Away past the lease, between looks or during this one (what it saw is then stale): a standby may have
        # taken over. It gives its seniority up, and the next look decides.
        gaps = [time.monotonic() - now, 0.0 if self._last_look is None else now - self._last_look]
        if max(gaps) > HOLDER_LEASE_S:
            await self._give_up_seniority("projector_away_past_its_lease", away_s=round(max(gaps), 1))
            self._last_look = time.monotonic()
            return
        heard = any(worker.id == service.id for worker in answered)
        self._say_whether_heard(heard)
        answering = {worker.id for worker in answered}
        # A holder that stopped said so: no need to wait out its lease (blind, no answer says it stopped).
        for index in self._standing_by if heard else ():
            try:
                released_by = await self._stores[index].released_by()
            except Exception as error:  # the database away: the lease decides
                log.warning("projector_release_unknown", durable=durables[index], error=describe(error))
                continue
            if released_by is not None and released_by not in answering:  # stopped, not standing by
                self._departed.add(released_by)
        self._peers, departed = remembered_peers(self._peers, answered, now, HOLDER_LEASE_S, self._departed)
        if heard:
            # Only a silence this process could have heard makes a peer gone for good. Blind (NATS away: both servers
            # restarted under a fault tester), it heard nobody, itself included; marked gone, the peers answering
            # again were never stood by for, and two processes took the consumer from each other every second.
            self._departed |= departed
        missing: set[int] = set()
        floors = await self._floors(list(self._projections), missing=missing)
        for index in missing:
            # Deleted behind this process's back (a fault tester's: projection stopped for every workspace, the
            # fetches failing unnamed, and status read the index as at 0): stopped, and made again below from the
            # index's own position, as a claim does.
            log.error("projector_consumer_missing", durable=durables[index], action="made again from the index")
            await self._projections.pop(index).stop()
        renewed: list[int] = []
        for index, applying in list(self._projections.items()):  # renewed for another lease, or left
            if await self._renewed(index, floors.get(index)):
                renewed.append(index)
                continue
            if not self._stores[index].went_back:  # one gone back is claimed again below, and logged by the store
                log.warning("projector_consumer_claimed_elsewhere", durable=durables[index])
            await applying.stop()
            del self._projections[index]
        # The streams of those renewed checked together: one after another, each bounded by STREAM_CHECK_S, many
        # partitions behind a slow JetStream would stretch a look towards the lease.
        checks = [self._refuses_the_stream(index, unchecked=False) for index in renewed]
        for index, refuses in zip(renewed, await asyncio.gather(*checks), strict=True):
            if refuses:  # its deltas wait in the stream, unacked
                await self._projections.pop(index).stop()
        peers = [worker for _, worker in self._peers.values()]
        failing = self._failing_beside_a_standby(now, peers)
        if failing:  # another process may reach the database this one cannot
            await self._give_up_seniority("projector_failing_hands_over", failing_s=failing)
            self._last_look = time.monotonic()
            return
        elsewhere = held_elsewhere(service.id, service.started, settings.projector_partitions, self._partitions, peers)
        for index in self._partitions:
            running = self._projections.get(index)
            if index in elsewhere:
                self._stand_by(index, "an earlier process applies it")
                if running is not None:  # the batch in hand is finished first, then the claim is the other's
                    await running.stop()
                    del self._projections[index]
                    await self._release(index)
            elif running is None:
                # A claim renewed lately holds if its process is up, or where discovery cannot tell (blind).
                live = {worker.id for worker in peers} if self._heard_itself else None
                try:
                    claim = await self._stores[index].claim(service.id, HOLDER_LEASE_S, live)
                except Exception as error:  # the database away: the next look tries again
                    log.warning("projector_claim_failed", durable=durables[index], error=describe(error))
                    continue
                if claim == "held":
                    self._stand_by(index, "another process that is up holds its claim on it")
                    continue
                if claim == "busy":
                    log.info("projector_claim_waiting", durable=durables[index], reason="a batch of the process it "
                             "replaces is still being written")  # fmt: skip
                    continue
                self._standing_by.discard(index)
                if await self._refuses_the_stream(index, unchecked=True):  # or not known yet: the next look
                    continue
                async with contextlib.AsyncExitStack() as filling:
                    try:
                        start_seq = await filling.enter_async_context(self._read_from_the_index(index))
                    except Exception as error:  # a compaction running, NATS or the database away: the next look
                        log.warning("projector_fill_deferred", durable=durables[index], error=describe(error))
                        continue
                    self._stores[index].in_step = True
                    projection = self._new_projection[index]()
                    self._projections[index] = await start_projection(
                        nc, names, settings, projection, settings.projector_batch_size, start_seq
                    )
                log.info("projector_started", durable=durables[index], stream=names.delta_stream)
        self._last_look = time.monotonic()

    @contextlib.asynccontextmanager
    async def _read_from_the_index(self, partition: int) -> AsyncIterator[int | None]:
        """Around the consumer's start, which begins where it yields (None: where the consumer is, or the stream's
        first delta for a new one). An index that holds nothing of the consumer's workspaces when its consumer
        is first claimed on this database (a database lost and replaced by an empty one, a new primary for a new
        layout) is filled from nothing, the snapshots of a compacted stream and then the stream from its first
        delta, rather than read on from where the consumer had got to for the index before (infra/migrations/0026).
        Compactions are held off until the consumer reads from the start again: one could purge what the index has
        yet to read. Done once the consumer has started; a fill stopped before is done again (it is idempotent).
        Otherwise the consumer reads from the index's own position (:meth:`_read_again_if_behind`)."""
        store, durable, holds = self._stores[partition], self._durables[partition], self._holds(partition)
        if not await store.needs_filling(lambda workspace: holds(encode_token(workspace))):
            yield await self._read_again_if_behind(partition)
            return
        assert self._nc is not None
        js = self._nc.jetstream()
        # What the lost index's consumer had settled needs no dead letter again: said before the consumer goes.
        await store.read_again(0, await ack_floor(js, self.names.delta_stream, durable))
        # First, lock or not: with the consumer gone its floor no longer says the index read what the lost one had
        # (how far projection has got, and compaction, read the floors; compaction also refuses while a fill is not
        # done).
        delivered = await restart_consumer(js, self.names, durable)
        async with store.compactions_held_off() as held_off:
            if not held_off:
                raise FillDeferred("a compaction, or another fill on the database, holds the lock: filled after it")
            # Versions numbered on from those announced: the bucket refuses a revision it has passed (an index
            # emptied by adopt-stream, while the bucket kept what the lost one had announced).
            await self._revisions_above_announced(partition)
            batch = self.settings.projector_batch_size
            first = int((await js.stream_info(self.names.delta_stream)).state.first_seq or 0)
            snapshots = await find_snapshot_store(js, self.names)
            covered = 0 if snapshots is None else await compacted_through(snapshots)
            runner = self._runners[partition]
            restored = await restore_snapshots(self._nc, self.names, runner, batch, holds, store.add_handled_events)
            # The snapshots hold what the stream no longer does: a holder's crash before its first look reads
            # again from there, not from nothing (no further than they cover: an age limit drops deltas too).
            await store.read_again(min(max(first - 1, 0), covered))
            yield None
        await store.filled()
        # A new deployment's first start fills nothing; a lost index filled again is worth an operator's look.
        said = log.warning if delivered or restored else log.info
        said("projector_index_filled_from_nothing", durable=durable, delivered_before=delivered, restored=restored)

    async def _refuses_the_stream(self, partition: int, unchecked: bool) -> bool:
        """Whether the partition's index must not read the delta stream as it is: another stream, or one behind what
        the index has read (following.py). Said once in the log, and in its row for `ontofabric status`, until an
        operator adopts the stream. Otherwise the stream's creation is recorded where it was not. ``unchecked``:
        the answer when NATS or the database cannot tell (a projection running goes on; a claim waits)."""
        try:
            async with asyncio.timeout(STREAM_CHECK_S):
                return await self._check_the_stream(partition)
        except Exception as error:
            log.warning("projector_stream_unchecked", durable=self._durables[partition], error=describe(error))
            return unchecked

    async def _check_the_stream(self, partition: int) -> bool:
        assert self._nc is not None
        js, store, durable = self._nc.jetstream(), self._stores[partition], self._durables[partition]
        stream = await js.stream_info(self.names.delta_stream)
        first, last = int(stream.state.first_seq or 0), int(stream.state.last_seq or 0)
        followed, position = store.followed, store.position

        found = None
        if store.refused is None and followed.mark_seq is not None and first <= followed.mark_seq <= last:
            with contextlib.suppress(NotFoundError):  # deleted (else compacted away, or not there)
                stored = await js.get_msg(self.names.delta_stream, followed.mark_seq)
                found = delta_mark(stored.subject or "", stored.data or b"")
        # Refused once, refused until adopted: written to since, it is still not the stream the index read.
        earlier = store.refused
        reason = earlier or refusal(followed, position, stream.created, last, found)
        if reason is not None:
            first_said = self._refused.get(partition) != reason
            self._refused[partition] = reason  # from now on no batch of it is written (_held_back)
            if store.refused != reason:  # a write that fails (the row's lock held past the check's bound): next look
                await store.refuse(reason)
                store.refused = reason
            if first_said:
                # A reason read from the row is as found then: the stream may have been written to since (a
                # tester read "ends at 18" beside stream_last 26 in one line).
                log.error(
                    "projector_refuses_the_stream", durable=durable, reason=reason,
                    reason_found="when the stream was first refused" if earlier else "now", position=position,
                    stream_first=first, stream_last=last,
                    action="nothing is applied until an operator adopts the stream as it is: `ontofabric "
                    "adopt-stream` empties the index and fills it again from the stream (docs/reliability.md)",
                )  # fmt: skip
            return True
        if self._refused.pop(partition, None) is not None:
            log.info("projector_follows_the_stream", durable=durable)
        if followed.created != stream.created:
            await store.follow(stream.created)
        return False

    async def _versions_bucket_again(self) -> None:
        """The deployment's streams and buckets made again where missing, and every version the databases hold
        announced into the versions bucket: made empty, it read "none yet" for every workspace not ingested since,
        across restarts too (a verifier's). Announcing a version the bucket holds, or a newer one of, is a no-op."""
        assert self._nc is not None
        assert self._versions is not None
        await ensure_jetstream(self._nc.jetstream(), self.names, self.settings)
        for pool in self._pools.values():
            rows = await pool.fetch(_VERSIONS_HELD)
            await announce_records(self._versions, [dict(r) for r in rows])

    async def _read_again_if_behind(self, partition: int) -> int | None:
        """Where a claimed consumer is to read from: the index's own position, kept in its database with every
        look (infra/migrations/0027), when the consumer had settled past it. The database went back under the
        consumer (a replica promoted without the last commits, a backup restored), or the last holder stopped
        without saying where the index stood (a crash): the deltas between are read again (the sequence rule makes
        those the index holds harmless) rather than never held. Also when the consumer holds deltas delivered and
        not settled (a holder crashed, frozen or fenced with a batch in hand, retries sent back before a hand-over):
        they would be delivered again after later deltas, and a later copy of an event (published again under
        another message id) would be applied before the event and the changes between, which are then older than
        the row. Deltas dead-lettered above the consumer's floor are set aside again (their dead letter's message id
        is the same: the dead-letter stream drops a copy within its duplicate window). None: read on from where the
        consumer is."""
        assert self._nc is not None
        store, durable, js = self._stores[partition], self._durables[partition], self._nc.jetstream()
        position = store.position
        if position is None:  # not known yet: the consumer's floor is taken as the index's, at the next look
            return None
        try:
            info = await js.consumer_info(self.names.delta_stream, durable)
            floor: int | None = info.ack_floor.stream_seq or 0
            # Whoever took them, this process before or another: a claim starts without the memory of what was
            # sent back, which kept a later copy of an event waiting for the event (a second review's: a holder
            # handing over as its writes fail releases its claim with its retries still to come).
            unsettled = int(info.num_ack_pending or 0)
        except NotFoundError:  # deleted while it was being read again: made anew from the same place
            floor, unsettled = None, 0
        if floor is not None and floor <= position and not unsettled:
            return None
        if floor is not None:
            await store.read_again(position, floor)  # before the consumer goes: its floor is the dead letters' mark
            await self._revisions_above_announced(partition)
            await restart_consumer(js, self.names, durable)
            went_back, store.went_back = store.went_back, False
            log.warning(
                "projector_reads_again", durable=durable, position=position, floor=floor, went_back=went_back,
                unsettled=unsettled,
                reason="the consumer had settled deltas past the index's position (its database went back, or its "
                "last holder stopped without saying where the index stood), or holds deltas an earlier holder took "
                "and did not settle: those would come back after later ones, a later copy of an event before the "
                "event (a fault tester's lost changes)",
            )  # fmt: skip
        first = int((await js.stream_info(self.names.delta_stream)).state.first_seq or 0)
        if first > position + 1:
            log.error(
                "projector_index_behind_the_stream", durable=durable, position=position, stream_starts_at=first,
                action="the stream no longer holds deltas this index lacks (compacted or aged out): rebuild the "
                "workspaces of this consumer (ontofabric rebuild WORKSPACE)",
            )  # fmt: skip
        return position + 1 if position else None

    async def _revisions_above_announced(self, partition: int) -> None:
        """Before the consumer reads again: the partition's versions numbered at least as far as the versions bucket
        announced them. A database gone back numbers them from an earlier count, and the bucket, which keeps the
        highest revision announced, refused every later version of a branch until the count passed it again (a
        review's finding)."""
        assert self._versions is not None
        holds = self._holds(partition)
        announced = await self._versions.announced_revisions(lambda workspace: holds(encode_token(workspace)))
        await self._stores[partition].raise_revisions(announced)

    def _holds(self, partition: int) -> Callable[[str], bool]:
        """Whether a workspace, by its subject token, is of the partition's consumer."""
        count = self.settings.projector_partitions
        return lambda token: count == 1 or partition_of_token(token, count) == partition

    async def _settled_before(self, partition: int) -> int:
        """The stream sequence up to which every delta of the partition's consumer that no index can apply was
        dead-lettered already: by another partition layout's consumers, or by this consumer before it was made to
        read again behind itself (a fill, a database gone back)."""
        assert self._nc is not None
        elsewhere = await settled_by_other_layouts(self._nc.jetstream(), self.names, self.settings.projector_partitions)
        return max(elsewhere, self._stores[partition].read_before)

    def _say_whether_heard(self, heard_itself: bool) -> None:
        """Log once per change whether its own discovery ping reached its own announcement (and so the others')."""
        if heard_itself == self._heard_itself:
            return
        self._heard_itself = heard_itself
        if not heard_itself:  # its login may not ask, or NATS is away
            log.warning(
                "projector_peers_unknown",
                reason="no answer to its own discovery ping, not even its own: it takes over only consumers whose "
                "claim no other process renewed within the lease (the projector's NATS login needs "
                "$SRV.PING.<prefix>-projector)",
            )

    def _stand_by(self, partition: int, reason: str) -> None:
        if partition not in self._standing_by:
            self._standing_by.add(partition)
            log.info("projector_standing_by", durable=self._durables[partition], reason=reason)

    async def _floors(
        self, partitions: list[int], nc: Client | None = None, missing: set[int] | None = None
    ) -> dict[int, int]:
        """The ack floors of these partitions' consumers, read at once and for at most FLOOR_READ_S: a slow
        JetStream API (a leader election) must not hold a look past the lease. Those not read are left out; those
        whose consumer does not exist are added to ``missing`` (when given), not read as 0."""
        nc = nc or self._nc
        if nc is None or not partitions:
            return {}
        js = nc.jetstream()

        async def floor_of(durable: str) -> int:
            if missing is None:
                return await ack_floor(js, self.names.delta_stream, durable)
            info = await js.consumer_info(self.names.delta_stream, durable)  # NotFoundError: gone
            return int(info.ack_floor.stream_seq or 0) if info.ack_floor is not None else 0

        reads = [floor_of(self._durables[index]) for index in partitions]
        read: list[int | BaseException]
        try:
            async with asyncio.timeout(FLOOR_READ_S):
                read = await asyncio.gather(*reads, return_exceptions=True)
        except TimeoutError:
            read = [TimeoutError(f"no answer within {FLOOR_READ_S:g} s")] * len(partitions)
        floors = {}
        for index, floor in zip(partitions, read, strict=True):
            if isinstance(floor, NotFoundError) and missing is not None:
                missing.add(index)
            elif isinstance(floor, BaseException):  # NATS away: renewed or released without it
                log.warning("projector_position_unknown", durable=self._durables[index], error=describe(floor))
            else:
                floors[index] = floor
        return floors

    async def _renewed(self, partition: int, floor: int | None) -> bool:
        """Whether this process's claim on the partition's consumer still stands, renewed for another lease with the
        consumer's ack ``floor`` (read before) as the index's position (a database away cannot tell: the claim
        stands until a batch or a renewal finds otherwise)."""
        store = self._stores[partition]
        if store.fenced:  # a batch found the consumer claimed by another process, or its database gone back
            return False
        try:
            with housekeeping():  # every few seconds, idle or not
                return await store.renew(floor)
        except Exception as error:
            log.warning("projector_renewal_failed", durable=self._durables[partition], error=describe(error))
            return True

    def _failing_beside_a_standby(self, now: float, peers: list[Worker]) -> dict[str, float]:
        """The consumers (durable: seconds) whose writes have failed for longer than FAILING_HANDOVER_S here while
        another process that could apply them is up."""
        assert self._service is not None
        layout = self.settings.projector_partitions
        others = [held for peer in peers if peer.id != self._service.id and (held := postgres_partitions(peer))]
        return {
            self._durables[index]: round(now - since, 1)
            for index, running in self._projections.items()
            if (since := running.failing_since) is not None
            and now - since > FAILING_HANDOVER_S
            and any(count == layout and index in partitions for count, partitions in others)
        }

    async def _give_up_seniority(self, event: str, **why: object) -> None:
        """Away longer than the lease (a standby may have taken over), or its writes failing beside a standby:
        leave every consumer and answer discovery anew, as the newest process, so that one which took over keeps
        them rather than handing them back."""
        log.warning(event, lease_s=HOLDER_LEASE_S, **why)
        for index, running in list(self._projections.items()):
            await running.stop()
            del self._projections[index]
            await self._release(index)  # this process's id ends here: a standby need not wait for it
        assert self._nc is not None
        await _stop_announcing(self._service)
        if self._service is not None:  # what it answered before is no earlier process to stand by for
            self._peers.pop(self._service.id, None)
            self._departed.add(self._service.id)
        description, details = self._announced
        self._service = await announce(self._nc, self.names.projector_service, description, details)
        self._standing_by.clear()

    async def _release(self, partition: int, nc: Client | None = None) -> None:
        """After the partition's consumer stopped here: release its claim, saying where the index stands."""
        store = self._stores[partition]
        # NATS away: released without it (the next holder reads again from the last position said).
        floor = (await self._floors([partition], nc)).get(partition) if store.in_step and not store.fenced else None
        try:
            await store.release(floor)
        except Exception as error:  # the database away: a standby waits out the lease instead
            log.warning("projector_release_failed", durable=self._durables[partition], error=describe(error))

    async def _report_another_analysis(self, placement: Placement) -> None:
        """Warn of the workspaces it applies whose documents another analysis indexed (an index projected before
        an upgrade): their keyword ranking is mixed until they are rebuilt."""
        for database, pool in list(self._pools.items()):
            try:
                async with pool.acquire() as conn:
                    counts = await documents_of_another_analysis(
                        conn, placement, database, among=lambda name: placement.partition_of(name) in self._partitions
                    )
            except Exception as error:  # the count is advice; projection goes on without it
                log.warning("analysis_not_counted", database=database, error=describe(error))
                continue
            for workspace, documents in counts.items():
                log.warning(
                    "documents_of_another_analysis", workspace=workspace, documents=documents,
                    analysis=ANALYSIS_VERSION, advice=f"ontofabric rebuild {workspace}",
                )  # fmt: skip

    async def _reembedder(self, pool: asyncpg.Pool) -> Reembedder | None:
        """What embeds again, for the model the database's index holds, documents another model embedded (a model
        change); None without a local embedder: those are refused then."""
        async with pool.acquire() as conn:
            return await reembedder_for(self.settings, conn)

    async def _writer_pool(self, database_url: str) -> asyncpg.Pool:
        """A pool acting as the writer role on a database this projector migrated (or waits for, when it writes
        through a login of that role only)."""
        settings = self.settings
        own_login = settings.projector_database_url is not None and not settings.partition_database_urls()
        # Each step waits while its database cannot serve yet (every connection slot taken, not up yet).
        if not own_login:
            await once_the_database_serves(database_url, functools.partial(migrate, database_url, settings))
        writer_url = settings.projector_database_url if own_login else database_url
        assert writer_url is not None
        if self._writer_login is not None and not own_login:
            writer_url = with_login(writer_url, *self._writer_login)
        await once_the_database_serves(
            writer_url, functools.partial(wait_until_migrated, writer_url, settings, role=WRITER_ROLE)
        )
        # Each consumer writes on a connection of its own. A statement unanswered past the server's own limit is
        # given up (its batch goes back to the consumer, its connection is replaced): a connection whose path lost
        # its state never hears back, and held the consumer's batch, and its deltas, for good.
        pool = functools.partial(
            create_pool,
            writer_url,
            settings,
            max_size=max(10, 2 * len(self._partitions)),
            role=WRITER_ROLE,
            command_timeout_s=stalled_after_s(settings),
            idle_in_transaction_s=IDLE_IN_TRANSACTION_S,
        )
        return await once_the_database_serves(writer_url, pool)

    async def stop(self) -> None:
        for task in (self._holding, self._analysis_report):
            if task is not None:
                await cancel_and_wait(task)
        self._holding = self._analysis_report = None
        projections, nc, pools, service = list(self._projections.values()), self._nc, self._pools, self._service
        self._projections, self._nc, self._pools, self._service = {}, None, {}, None
        await _stop_announcing(service)
        async with contextlib.AsyncExitStack() as closing:  # each closes, whatever the one before raised
            for pool in pools.values():
                closing.push_async_callback(pool.close)
            if nc is not None:
                closing.push_async_callback(close_nats, nc)
            # The batches in hand are finished and acked before the connection goes.
            await asyncio.gather(*(projection.stop() for projection in projections))
            for index in self._stores:  # then a standby may take the consumers over at once
                await self._release(index, nc)
        log.info("projector_stopped")


class AzureProjectorService:
    """The Azure AI Search projector: creates or updates the index, then pulls from a durable consumer of its own.
    Deltas no index can apply are left to the Postgres projector's dead letter (it reads the same stream)."""

    def __init__(self, settings: Settings, nats_url: str) -> None:
        self.settings = settings
        self.names = Names(settings.subject_prefix)
        self._nats_url = nats_url
        self._nc: Client | None = None
        self._puller: RunningProjection | None = None
        self._clients: tuple[SearchIndexClient, SearchClient] | None = None
        self._watermarking: asyncio.Task[None] | None = None
        self._service: Announcement | None = None

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        settings, names = self.settings, self.names
        documents = search_client(settings, RETRIES, read_timeout_s=azure_sink.READ_TIMEOUT_S)
        indexes, _ = self._clients = index_client(settings, RETRIES), documents
        try:
            await indexes.create_or_update_index(index_definition(settings.azure_search_index))
        except AzureError as error:
            name = settings.azure_search_index
            raise RuntimeError(f"cannot create the Azure AI Search index {name!r}: {error}") from error
        nc = self._nc = await connect(
            self._nats_url, "ontofabric-projector-azure-search", settings, wait_for_server=True
        )
        js = nc.jetstream()
        await ensure_jetstream(js, names, settings, reconcile=True)
        index = AzureSearchIndex(documents)
        recorded = await read_watermark(documents)
        runner = ProjectionRunner(AzureSink(index), Limits.from_settings(settings))
        batch_size = min(settings.projector_batch_size, MAX_KEYS_PER_LOOKUP)
        if recorded is None:  # a new or lost index: from the snapshots of a compacted stream, then the stream
            await replay_if_index_lost(js, names)
            await restore_snapshots(nc, names, runner, batch_size)
        durable = names.azure_projector_durable
        projection = DurableProjection(runner, js, names, durable, dead_letters_invalid=False, min_retry_s=MIN_RETRY_S)
        self._puller = await start_projection(nc, names, settings, projection, batch_size)
        watermark = Watermark(index, js, names, recorded or 0)
        self._watermarking = asyncio.create_task(watermark.keep(), name="azure-watermark")
        description = "ontofabric Azure AI Search projector"
        self._service = await announce(nc, names.projector_service, description, {"index": "azure-ai-search"})
        log.info("azure_projector_started", durable=durable, index=settings.azure_search_index)

    async def stop(self) -> None:
        puller, nc, clients, watermarking = self._puller, self._nc, self._clients, self._watermarking
        self._puller, self._nc, self._clients, self._watermarking = None, None, None, None
        service, self._service = self._service, None
        if watermarking is not None:
            await cancel_and_wait(watermarking)
        await _stop_announcing(service)
        async with contextlib.AsyncExitStack() as closing:
            for client in clients or ():
                closing.push_async_callback(client.close)
            if nc is not None:
                closing.push_async_callback(close_nats, nc)
            if puller is not None:
                await puller.stop()
        log.info("azure_projector_stopped")


async def _stop_announcing(service: Announcement | None) -> None:
    """No longer answer service discovery (first: a projector stopping is not one to count on)."""
    if service is not None:
        with contextlib.suppress(Exception):  # the connection may be gone already
            await service.stop()
