"""The deployment at a glance, for operators: per workspace and branch the announced version, the latest delta,
the deltas published past the index's position and how long the oldest has waited; dead letters per workspace;
the projectors' consumers; the projectors and query workers that answer service discovery; the documents whose
keyword index an older analysis made."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta

import asyncpg
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, StreamInfo
from nats.js.errors import APIError, BucketNotFoundError, KeyNotFoundError, NotFoundError
from pydantic import ValidationError

from ontofabric.contracts import NO_VERSION, OntologyVersionChanged
from ontofabric.services.projector.planning import ANALYSIS_VERSION
from ontofabric.services.projector.snapshots import compacted_through, find_snapshot_store
from ontofabric.services.projector.store import documents_of_another_analysis
from ontofabric.services.projector.versions import version_keys
from ontofabric.services.query.freshness import published_past
from ontofabric.shared.discovery import BUILD, SCHEMA, Worker, discover, postgres_partitions, running_layouts
from ontofabric.shared.logging import describe
from ontofabric.shared.placement import Placement
from ontofabric.shared.settings import redacted_url
from ontofabric.shared.subjects import NO_WORKSPACE, PARTITION_COUNTS, Names, encode_token, partition_of_token

from .shadow import LeftSchema, rebuild_schemas, retired_schema, shadow_schema


@dataclass(frozen=True)
class BranchStatus:
    workspace: str
    branch: str
    ontology_version: str
    announced_at: datetime | None
    """None: no version announced yet (every delta of the branch is still pending, or dead-lettered)."""
    latest_seq: int | None
    """The last delta published to this workspace and branch."""
    position: int
    """Every delta up to here is in the index (the ack floor of the consumer of the workspace's partition)."""
    pending_deltas: int
    oldest_pending_ms: float | None


@dataclass(frozen=True)
class ConsumerStatus:
    name: str
    ack_floor: int
    undelivered: int
    """Deltas in the stream not yet delivered to it."""
    unacknowledged: int
    waiting_pulls: int
    """Fetches waiting for deltas: a live projector idling has one or more."""
    last_active: datetime | None
    """When it last delivered a delta (NATS's, forgotten when its server restarts) or its index last moved (the
    database's, infra/migrations/0033), the later: after a restart of `up` every consumer read as never active."""
    configured: bool = True
    """False: a Postgres consumer of another partition layout than this deployment's settings (one being filled
    for a new layout, or one left by a layout given up: it holds compaction back until deleted)."""
    index_position: int | None = None
    """Where its index's database says the index stands (infra/migrations/0027), written by its projector every
    few seconds; None: not known (not read, or not said yet). Well behind ``ack_floor`` while its projector runs:
    the database went back in time (a replica promoted, a backup restored), and the projector reads again from
    there."""


@dataclass(frozen=True)
class StreamStatus:
    name: str
    messages: int
    bytes: int
    max_bytes: int | None
    """The most it may hold (ONTOFABRIC_DELTA_STREAM_MAX_BYTES); full, it refuses new messages. None: no limit."""


READS_AT_ONCE = 16
"""JetStream requests status keeps in flight at once, reading the branches (one after another, 1,400
workspaces took seconds)."""
STALLED_AFTER_S = 60.0
"""How long a consumer's index position may stand still while the delta after its floor waits before status names
it (a batch takes seconds; the alert rules page after ten minutes)."""
DATABASE_WAIT_S = 5.0
"""How long status waits for each database to connect and count, before saying it could not."""


@dataclass
class AnalysisStatus:
    version: int = ANALYSIS_VERSION
    """The keyword analysis of this build (services/projector/planning.py, ANALYSIS_VERSION)."""
    documents_of_another_analysis: dict[str, int] = field(default_factory=dict)
    """Per workspace, its live documents that another analysis indexed: projected before an upgrade, they rank by
    the old one until ``ontofabric rebuild WORKSPACE``."""
    unread: list[str] = field(default_factory=list)
    """The databases that could not be counted, and why: their workspaces' counts are unknown."""
    model_changes: list[str] = field(default_factory=list)
    """Per database, a change of embedding model begun and not finished (running, or interrupted)."""
    rebuild_schemas: dict[str, list[LeftSchema]] = field(default_factory=dict)
    """Per database (its URL without password), the schemas rebuilds left or are building."""


@dataclass
class DeploymentStatus:
    branches: list[BranchStatus] = field(default_factory=list)
    dead_letters: dict[str, int] = field(default_factory=dict)
    """Per workspace."""
    consumers: list[ConsumerStatus] = field(default_factory=list)
    streams: list[StreamStatus] = field(default_factory=list)
    projectors: list[Worker] = field(default_factory=list)
    query_workers: list[Worker] = field(default_factory=list)
    analysis: AnalysisStatus = field(default_factory=AnalysisStatus)
    problems: list[str] = field(default_factory=list)
    """What is missing that the rest of the report is read from (a fault tester's status ended in a traceback)."""
    notes: list[str] = field(default_factory=list)
    """What reads otherwise than this command's settings say, and is no problem of the deployment."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), default=_json_value, indent=2)


def _json_value(value: object) -> str:
    """A value JSON has no type for: a time in ISO 8601 (``T`` between date and time, as the projectors' ``started``
    and ``dlq list`` write it: an auditor's ``announced_at`` had a space), anything else as ``str`` writes it."""
    return value.isoformat() if isinstance(value, datetime) else str(value)


NO_QUERY_WORKER = "no query worker answers: every query goes unanswered until one runs"


async def deployment_status(
    nc: Client, names: Names, placement: Placement, workspace: str | None = None
) -> DeploymentStatus:
    js = nc.jetstream()
    status = DeploymentStatus()
    # The layouts read: this command's, and those the running Postgres projectors announce. Run from a shell
    # without the deployment's ONTOFABRIC_PROJECTOR_PARTITIONS, status read the configured layout's consumers
    # alone, said every workspace indexed to 0 and no projector answering, and exited 1 (a tester's).
    status.projectors, status.query_workers, status.analysis = await asyncio.gather(
        discover(nc, names.projector_service), discover(nc, names.query_service), analysis_status(placement, workspace)
    )
    applying = [layout for layout in map(postgres_partitions, status.projectors) if layout is not None]
    running = sorted(running_layouts(status.projectors))
    layouts = sorted({placement.partitions, *running})
    if running and placement.partitions not in running:
        status.notes.append(
            f"the Postgres projectors answering run {' and '.join(map(str, running))} partition(s), this command's "
            f"ONTOFABRIC_PROJECTOR_PARTITIONS says {placement.partitions}: read as they run (set it alike everywhere)"
        )
    durables = names.postgres_projector_durables(placement.partitions)
    read = [durable for layout in layouts for durable in names.postgres_projector_durables(layout)]
    others = [durable for durable in names.every_postgres_projector_durable if durable not in read]
    # Each projector consumer read once: its position serves the branches below, and the consumer table.
    for durable in [*read, names.azure_projector_durable, *others]:
        try:
            info = await js.consumer_info(names.delta_stream, durable)
        except NotFoundError:
            continue
        status.consumers.append(
            ConsumerStatus(
                durable,
                int(info.ack_floor.stream_seq or 0) if info.ack_floor else 0,
                int(info.num_pending or 0),
                int(info.num_ack_pending or 0),
                int(info.num_waiting or 0),
                info.delivered.last_active if info.delivered else None,
                durable not in others,
            )
        )
    # Each consumer's row read from its own partition's database: a partition moved to another database leaves a
    # stale row behind, which, read last, won (a review's).
    homes = {
        durable: placement.databases[placement.database_of_partition(partition)]
        for count in PARTITION_COUNTS
        for partition, durable in enumerate(names.postgres_projector_durables(count))
    }
    positions, refusals, still = await _index_positions(placement, homes)
    now = datetime.now(UTC)
    status.consumers = [
        dataclasses.replace(
            c,
            index_position=positions.get(c.name),
            last_active=max(
                (at for at in (c.last_active, _seconds_before(now, still.get(c.name))) if at is not None), default=None
            ),
        )
        for c in status.consumers
    ]
    for durable, reason in sorted(refusals.items()):
        status.problems.append(
            f"the projector consumer {durable} applies nothing: as its projector found when it refused the stream, "
            f"{reason}. `ontofabric adopt-stream` empties the index and fills it again from the stream as it is "
            "(docs/reliability.md)"
        )
    floors = {consumer.name: consumer.ack_floor for consumer in status.consumers}
    try:
        announced = await _announced(nc, names)
    except BucketNotFoundError:
        announced = []
        status.problems.append(
            f"the versions bucket {names.version_bucket} does not exist, so no version reads as announced: a "
            "projector makes it again when it starts, or when it next announces one"
        )
    # A refused stream's consumers are not made; nor, beside another layout's refusal, those of a layout not in use
    # (status run without the deployment's ONTOFABRIC_PROJECTOR_PARTITIONS).
    unused = bool(refusals) and not any(durable in floors for durable in durables)
    # The consumers of the layouts the projectors run (a review's: one of them missing went unsaid), else this one's.
    expected = [d for layout in running or [placement.partitions] for d in names.postgres_projector_durables(layout)]
    for durable in expected:
        if durable not in floors and durable not in refusals and not unused:
            status.problems.append(
                f"the projector consumer {durable} does not exist, so its workspaces read as indexed to 0: a running "
                "projector makes it again within seconds; is one running?"
            )
    versions: dict[tuple[str, str], tuple[str, datetime | None]] = {
        (version.workspace, version.branch): (version.ontology_version, version.updated_at) for version in announced
    }
    subjects = names.delta_subjects if workspace is None else names.workspace_delta_subjects(workspace)
    # The stream's totals too.
    refused = (
        "; the projectors then refuse the new one where the index had read the lost one, until an operator runs "
        "`ontofabric adopt-stream`"
    )
    deltas = await _stream(js, names.delta_stream, subjects, status, then=refused)
    if deltas is not None:
        for unannounced in _published_branches(deltas, names) - set(versions):
            # Published to, never projected: the projector is down or behind.
            versions[unannounced] = (NO_VERSION, None)
        reading = asyncio.Semaphore(READS_AT_ONCE)

        async def branch_status(branch_workspace: str, branch: str) -> BranchStatus:
            ontology_version, announced_at = versions[branch_workspace, branch]
            subject = names.delta_subject(branch_workspace, branch)
            position = max(floors.get(durable, 0) for durable in _durables_of(names, branch_workspace, layouts))
            async with reading:
                latest, pending = await published_past(js, names, subject, position)
            return BranchStatus(
                branch_workspace, branch, ontology_version, announced_at, latest, position, pending.deltas,
                pending.oldest_ms,
            )  # fmt: skip

        shown = sorted(key for key in versions if workspace is None or key[0] == workspace)
        status.branches.extend(await asyncio.gather(*(branch_status(*key) for key in shown)))
        first = int(deltas.state.first_seq or 0)
        if first > 1:  # compacted, or aged out: the snapshots must hold what went
            snapshots = await find_snapshot_store(js, names)
            covered = 0 if snapshots is None else await compacted_through(snapshots)
            if covered < first - 1:
                held = f"through sequence {covered}" if covered else "nothing"
                status.problems.append(
                    f"the delta stream starts at sequence {first} and the snapshots cover {held}: deltas "
                    f"{covered + 1}..{first - 1} are nowhere (the snapshot store lost, or deltas aged out before a "
                    "compaction), so a rebuild or an index filled from nothing lacks them; ingest the workspaces again"
                )
    dlq = await _stream(js, names.dlq_stream, names.dlq_subjects, status)
    for subject, count in sorted((dlq.state.subjects or {}).items() if dlq is not None else ()):
        # Named as `dlq list --workspace` selects them (a subject of an earlier version's odd token among them).
        owner = names.workspace_of_dlq_subject(subject) or NO_WORKSPACE
        if workspace is None or owner == workspace:
            status.dead_letters[owner] = status.dead_letters.get(owner, 0) + count
    for info in (deltas, dlq):
        if info is None:
            continue
        limit = info.config.max_bytes or -1
        status.streams.append(
            StreamStatus(info.config.name or "", info.state.messages, info.state.bytes, limit if limit > 0 else None)
        )
        if info.config.discard == DiscardPolicy.NEW:  # else it drops its oldest to take the new
            _stream_nearly_full(info, names, status)
    releases = releases_answering([*status.projectors, *status.query_workers])
    if len(releases) > 1:
        status.problems.append(
            "workers of more than one release answer ("
            + "; ".join(f"{schema}: {', '.join(workers)}" for schema, workers in releases.items())
            + "): a projector of an earlier release writes rows by its own rules and may take no part in claims, "
            "and query workers of two releases may answer one query two ways; stop the workers of the release "
            "you are leaving"
        )
    # A Postgres projector of a layout read holding each workspace's partition (the Azure projector answers on the
    # same service, and a partition may have none: a review's), else deltas wait for nothing.
    unheld = [
        branch
        for branch in status.branches
        if branch.pending_deltas
        and not any(
            partition_of_token(encode_token(branch.workspace), count) in partitions for count, partitions in applying
        )
    ]
    if unheld:  # an ops tester's health check exited 0 over a stopped projector
        waiting = sum(branch.pending_deltas for branch in unheld)
        unapplied_deltas = f"{waiting} pending delta{'' if waiting == 1 else 's'}"
        if applying:  # two layouts at once that leave a partition out (a tester's): say whose
            unapplied = ", ".join(sorted({branch.workspace for branch in unheld}))
            status.problems.append(
                f"no Postgres projector applies the partition of {unapplied} ({unapplied_deltas}): the projectors "
                f"answering run {' and '.join(map(str, running))} partition(s) between them; run one of each "
                "partition of one layout"
            )
        else:
            status.problems.append(f"no Postgres projector answers for {unapplied_deltas}: applied once one runs")
    # The consumers of the layouts read that a projector answering applies: one with none is said above, a refused
    # one too, and another layout's or an Azure consumer may be left over, unread on purpose.
    for layout in layouts:
        for partition, durable in enumerate(names.postgres_projector_durables(layout)):
            consumer = next((c for c in status.consumers if c.name == durable), None)
            applied = any(count == layout and partition in partitions for count, partitions in applying)
            if consumer is None or not applied or durable in refusals:
                continue
            stalled_s = await _stalled_for(js, names, consumer, still.get(durable))
            if stalled_s is not None and stalled_s > STALLED_AFTER_S:
                # An operator tester's: a projector up and answering, every write stuck behind a lock, and status
                # said nothing for minutes; only the alert rules did, after ten.
                status.problems.append(
                    f"the projector consumer {consumer.name} has settled nothing for {stalled_s:.0f} s while deltas "
                    "wait: its projector answers, and its writes fail or hang (its log says why: batch_retry)"
                )
    if not status.query_workers:  # an operator tester's health check exited 0 while every query went unanswered
        status.problems.append(NO_QUERY_WORKER)
    status.notes += status.analysis.model_changes
    status.notes += _left_by_rebuilds(
        status.analysis.rebuild_schemas, {b.workspace for b in status.branches}, workspace
    )
    for unread in status.analysis.unread:  # a fault tester's: every connection slot taken, and no problem said
        status.problems.append(f"a database could not be read ({unread}): its index positions and counts are missing")
    return status


def _left_by_rebuilds(by_database: dict[str, list[LeftSchema]], workspaces: set[str], asked: str | None) -> list[str]:
    """A note for each rebuild's schema on the databases: what it holds and what to run about it."""
    named = {shadow_schema(workspace): workspace for workspace in workspaces}
    named |= {retired_schema(workspace): workspace for workspace in workspaces}
    notes = []
    for database, schemas in by_database.items():
        for left in schemas:
            workspace = left.workspace or named.get(left.schema)
            if asked is not None and workspace != asked:
                continue
            size = f"{left.size_bytes / 1e6:.1f} MB"
            which = f"workspace {workspace!r}" if workspace is not None else "a workspace not known here"
            command = f"ontofabric rebuild {workspace}" if workspace is not None else "ontofabric rebuild W"
            notes.append(
                f"{database}: the tables a rebuild of {which} swapped out were not dropped ({left.schema}, {size}): "
                f"the next `{command}` drops them"
                if left.retired
                else f"{database}: a rebuild of {which} is running or was interrupted ({left.schema}, {size}): "
                f"`{command}` resumes it, `{command} --discard` drops it"
            )
    return notes


def _durables_of(names: Names, workspace: str, layouts: Sequence[int]) -> list[str]:
    """The projector consumer applying the workspace in each of ``layouts``."""
    token = encode_token(workspace)
    return [names.postgres_projector_durables(layout)[partition_of_token(token, layout)] for layout in layouts]


async def _stalled_for(
    js: JetStreamContext, names: Names, consumer: ConsumerStatus, still_s: float | None
) -> float | None:
    """How long the consumer's index position has stood still (``still_s``, by its database's clock) while the
    delta after its floor waited to be settled: the shorter of the two. None while nothing waits, or when that
    cannot be told. Not its last ack: a partition's consumer acks the other partitions' deltas as it passes them,
    whatever its own writes do (a review's)."""
    if still_s is None or not consumer.undelivered + consumer.unacknowledged:
        return None
    try:
        waiting = await js.get_msg(names.delta_stream, consumer.ack_floor + 1)
    except (NotFoundError, APIError):  # compacted away, deleted, or JetStream away: not told
        return None
    if waiting.time is None:
        return None
    return min(still_s, (datetime.now(UTC) - waiting.time).total_seconds())


def _stream_nearly_full(info: StreamInfo, names: Names, status: DeploymentStatus) -> None:
    """A stream that refuses new messages once full, past STREAM_FULL_SHARE of its bytes or of its messages, as a
    problem (as the alert OntofabricStreamFilling says it: an operator's status read no problem at 100 %, while the
    stream refused every tenant's deltas; a retest's DLQ capped by count stalled every projection unsaid)."""
    held = {"bytes": (info.state.bytes, info.config.max_bytes), "messages": (info.state.messages, info.config.max_msgs)}
    shares = {what: count / cap for what, (count, cap) in held.items() if cap is not None and cap > 0}
    if not shares or max(shares.values()) <= STREAM_FULL_SHARE:
        return
    what = max(shares, key=lambda name: shares[name])
    share = shares[what]
    # Refusing new messages, a stream never reaches its byte cap: it is full once a message of its mean size no longer
    # fits (a fault tester's, 279 bytes short of 190 MB, read "100% nearly full" while every delta was refused).
    mean = info.state.bytes / info.state.messages if info.state.messages else 0
    full = share >= 1 or (what == "bytes" and (info.config.max_bytes or 0) - info.state.bytes < mean)
    if info.config.name == names.delta_stream and what == "bytes":
        remedy = "run `ontofabric compact` (it folds what is projected) or raise ONTOFABRIC_DELTA_STREAM_MAX_BYTES"
    else:
        remedy = f"raise its max_{'bytes' if what == 'bytes' else 'msgs'}"
    state = "full: it refuses new messages" if full else f"{share:.0%} full: once full, it refuses every new message"
    status.problems.append(f"the stream {info.config.name} is {state} (by {what}); {remedy}")


STREAM_FULL_SHARE = 0.85
"""Of a capped stream's bytes or messages, what status calls a problem (as the alert OntofabricStreamFilling does)."""


async def _stream(
    js: JetStreamContext, name: str, subjects: str, status: DeploymentStatus, then: str = ""
) -> StreamInfo | None:
    """The stream's state with its subjects' counts; None, and a problem said (with ``then``), when it does not
    exist (deleted while NATS runs: a tester's status ended in a traceback)."""
    try:
        return await js.stream_info(name, subjects_filter=subjects)
    except NotFoundError:
        status.problems.append(
            f"the stream {name} does not exist: a projector, a query worker or `ontofabric up` makes it again when "
            f"it starts{then}"
        )
        return None


def releases_answering(workers: Sequence[Worker]) -> dict[str, list[str]]:
    """The workers (host:pid) by the release they announce, as "schema N, build B" (the latest migration it
    knows and a digest of its code), or "an earlier release" for those that announce neither."""
    releases: dict[str, list[str]] = {}
    for worker in workers:
        schema, build = worker.details.get(SCHEMA), worker.details.get(BUILD)
        release = f"schema {schema}" + (f", build {build}" if build else "") if schema else "an earlier release"
        releases.setdefault(release, []).append(f"{worker.host}:{worker.pid}")
    return dict(sorted(releases.items()))


async def _index_positions(
    placement: Placement, homes: dict[str, str]
) -> tuple[dict[str, int], dict[str, str], dict[str, float]]:
    """Each consumer's index position, why its projector refuses the delta stream where it does
    (services/projector/following.py), and for how many seconds its position has not moved, as the database of its
    partition (``homes``) says (of every layout: a status run without the deployment's
    ONTOFABRIC_PROJECTOR_PARTITIONS names the running layout's refusals too); those of a database that cannot be
    read within DATABASE_WAIT_S are left out (the analysis counts say why)."""

    async def read(url: str) -> list[asyncpg.Record]:
        durables = [durable for durable, home in homes.items() if home == url]
        conn: asyncpg.Connection | None = None
        try:
            async with asyncio.timeout(DATABASE_WAIT_S):
                conn = await asyncpg.connect(url)
                try:
                    rows: list[asyncpg.Record] = await conn.fetch(
                        "SELECT durable, position, refused, extract(epoch FROM now() - advanced_at)::float8 AS still_s"
                        " FROM projection_fences WHERE durable = ANY($1::text[])",
                        durables,
                    )
                except asyncpg.UndefinedColumnError:  # not migrated to 0033 yet: no stall judged, the rest read
                    rows = await conn.fetch(
                        "SELECT durable, position, refused, NULL::float8 AS still_s"
                        " FROM projection_fences WHERE durable = ANY($1::text[])",
                        durables,
                    )
                await conn.close()
                conn = None
                return rows
        except Exception:  # a status line must not fail the command
            return []
        finally:
            if conn is not None:
                conn.terminate()

    rows = [
        row for read_each in await asyncio.gather(*map(read, sorted(set(placement.databases)))) for row in read_each
    ]
    positions = {row["durable"]: int(row["position"]) for row in rows if row["position"] is not None}
    refusals = {row["durable"]: row["refused"] for row in rows if row["refused"] is not None}
    return positions, refusals, {row["durable"]: float(row["still_s"]) for row in rows if row["still_s"] is not None}


def _seconds_before(now: datetime, seconds: float | None) -> datetime | None:
    return None if seconds is None else now - timedelta(seconds=seconds)


async def analysis_status(placement: Placement, workspace: str | None = None) -> AnalysisStatus:
    """The documents of another keyword analysis than this build's, counted on each database at once (or on
    ``workspace``'s) through an index for it (infra/migrations/0025)."""
    status = AnalysisStatus()
    databases = range(len(placement.databases)) if workspace is None else [placement.database_of(workspace)]
    counted = await asyncio.gather(*(_count_another_analysis(placement, d, workspace) for d in databases))
    for database, (counts, unread, change, left) in zip(databases, counted, strict=True):
        status.documents_of_another_analysis.update(counts)
        if unread is not None:
            status.unread.append(unread)
        if change is not None:
            status.model_changes.append(change)
        if left:
            status.rebuild_schemas[redacted_url(placement.databases[database])] = left
    status.documents_of_another_analysis = dict(sorted(status.documents_of_another_analysis.items()))
    return status


async def _count_another_analysis(
    placement: Placement, database: int, workspace: str | None
) -> tuple[dict[str, int], str | None, str | None, list[LeftSchema]]:
    """The counts of one database, or why there are none; and a change of embedding model begun on it and not
    finished (a model-change tester's status said nothing of one interrupted). Never longer than DATABASE_WAIT_S:
    a connection that stops answering is dropped, not closed politely (asyncpg's close waits for the server's
    answer)."""
    url = placement.databases[database]
    conn: asyncpg.Connection | None = None
    try:
        async with asyncio.timeout(DATABASE_WAIT_S):
            conn = await asyncpg.connect(url)
            counts = await documents_of_another_analysis(conn, placement, database, workspace)
            left = await rebuild_schemas(conn)
            models = await conn.fetchrow("SELECT embedding_model, next_embedding_model FROM deployment")
            await conn.close()
            conn = None
            change = None
            if models is not None and models["next_embedding_model"] is not None:
                change = (
                    f"{redacted_url(url)}: a change of embedding model from {models['embedding_model']!r} to "
                    f"{models['next_embedding_model']!r} is running or was interrupted: answers use the first until "
                    "it swaps (`ontofabric reembed` resumes it, `--discard` drops it)"
                )
            return counts, None, change, left
    except TimeoutError:
        why = f"no answer within {DATABASE_WAIT_S:g} s"
    except (asyncpg.UndefinedColumnError, asyncpg.UndefinedTableError):
        why = "not migrated to this build's schema (`ontofabric migrate`, or start a projector of this build)"
    except Exception as error:  # a status line must not fail the command: say why it is missing
        why = describe(error)
    finally:
        if conn is not None:
            conn.terminate()
    return {}, f"{redacted_url(url)}: {why}", None, []


def _published_branches(info: StreamInfo, names: Names) -> set[tuple[str, str]]:
    """The (workspace, branch) pairs the delta stream holds deltas of, by the subjects ``info`` lists (one that
    is not a canonical ``<prefix>.delta.<workspace>.<branch>`` names none: the projector dead-letters it). The
    server pages its answer past 100,000 subjects, so beyond that some go unlisted."""
    scopes = (names.scope_of_delta(subject) for subject in info.state.subjects or {})
    return {scope for scope in scopes if scope is not None}


async def _announced(nc: Client, names: Names) -> list[OntologyVersionChanged]:
    kv = await nc.jetstream().key_value(names.version_bucket)
    versions = []
    for key in await version_keys(nc, names):  # a status with no branches came of `kv.keys()`
        try:
            entry = await kv.get(key)
            versions.append(OntologyVersionChanged.model_validate_json(entry.value or b""))
        except (KeyNotFoundError, ValidationError):
            continue  # gone since, or not a version (see projector/versions.py): nothing to report
    return versions
