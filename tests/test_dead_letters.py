"""Dead letters for operators, against real NATS and PostgreSQL: listed and filtered, re-driven through the
projector after a fix (never over a later state of the document), purged; and through the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import string
import subprocess
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import pytest
import structlog
import typer
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import NotFoundError

from ontofabric.contracts import DeltaEnvelope
from ontofabric.contracts.deltas import NodeRemoved, NodeUpserted, OntologyNode
from ontofabric.contracts.documents import MAX_METADATA_BYTES, DocumentMetadata, stored_json_bytes
from ontofabric.services.ingest.client import DeltaPublisher, envelope
from ontofabric.services.ops.dead_letters import (
    Selection,
    applied_through,
    dead_letters,
    parse_when,
    purge,
    redrive,
    redriven,
)
from ontofabric.services.ops.rebuild import Rebuild
from ontofabric.services.ops.snapshots import CompactionRefused, compact
from ontofabric.services.projector.consumer import dead_letter
from ontofabric.services.projector.planning import Rejection
from ontofabric.services.projector.snapshots import find_snapshot_store, load_snapshot
from ontofabric.services.projector.worker import ProjectorService
from ontofabric.shared.db import migrate
from ontofabric.shared.placement import Placement

from .conftest import Deployment, RecordedProgress, metric_points, projected_rows
from .factories import document, unit_vector, upsert

ONTOFABRIC = str(Path(sys.executable).parent / "ontofabric")
LIMIT = 200
"""The projector's max_content_bytes in these tests: a longer document is dead-lettered (content_too_large)."""


def test_times_are_iso_or_ages() -> None:
    now = datetime(2026, 11, 24, 12, 0, tzinfo=UTC)
    assert parse_when("2h", now) == now - timedelta(hours=2)
    assert parse_when("1.5d", now) == now - timedelta(days=1.5)
    assert parse_when("2026-11-24T10:00", now) == datetime(2026, 11, 24, 10, 0, tzinfo=UTC)
    with pytest.raises(ValueError, match="neither"):
        parse_when("yesterday", now)


async def _project(deployment: Deployment, limit: int, *deltas: DeltaEnvelope) -> list[int]:
    """The deltas published and projected by a projector taking documents up to ``limit`` bytes; their sequences."""
    settings = deployment.settings.model_copy(update={"max_content_bytes": limit})
    projector = ProjectorService(settings, deployment.nats_url_as("projector"), deployment.database_url)
    await projector.start()
    try:
        acks = await deployment.publisher.publish_many(deltas)
        await deployment.wait_projected(acks[-1].seq)
    finally:
        await projector.stop()
    return [ack.seq for ack in acks]


async def test_dead_letters_are_listed_redriven_after_a_fix_and_purged(deployment: Deployment) -> None:
    long = "x" * (LIMIT + 50)
    seqs = await _project(
        deployment,
        LIMIT,
        upsert("acme", document("fine", "short")),
        upsert("acme", document("long", f"long {long}")),
        upsert("acme", document("again", f"again {long}")),
        upsert("globex", document("other", f"other {long}")),
        upsert("acme", document("again", "again, short now")),  # a later state of "again"
    )
    names, nc = deployment.names, deployment.nc
    letters = await dead_letters(nc, names, Selection())
    assert [(letter.workspace, letter.reason) for letter in letters] == [
        ("acme", "content_too_large"), ("acme", "content_too_large"), ("globex", "content_too_large")
    ]  # fmt: skip
    assert all(letter.original_seq and letter.original_subject.endswith(".main") for letter in letters)
    assert [letter.seq for letter in await dead_letters(nc, names, Selection(workspace="globex"))] == [letters[2].seq]
    assert await dead_letters(nc, names, Selection(reason="oversized")) == []
    assert len(await dead_letters(nc, names, Selection(since=datetime.now(UTC) - timedelta(minutes=5)))) == 3
    assert await dead_letters(nc, names, Selection(until=datetime.now(UTC) - timedelta(minutes=5))) == []

    # The fix: a projector that takes longer documents. Re-driven: "long" applies; "again" is left, since the index
    # holds a later state of it.
    placement = Placement.of(deployment.settings, deployment.database_url)
    acme = await dead_letters(nc, names, Selection(workspace="acme"))
    outcome = await redrive(nc, names, acme, placement.database_url_of)
    assert [letter.seq for letter, _ in outcome.sent] == [acme[0].seq]
    assert [(letter.seq, later) for letter, later in outcome.superseded] == [(acme[1].seq, seqs[4])]
    (sent_seq,) = [seq for _, seq in outcome.sent]
    # The delta's trace context goes with its dead letter and its re-drive (an SRE's: both dropped it).
    original = (await deployment.js.get_msg(names.delta_stream, seqs[1])).headers or {}
    again = (await deployment.js.get_msg(names.delta_stream, sent_seq)).headers or {}
    assert original["traceparent"] == again["traceparent"] == acme[0].trace["traceparent"]
    projector = ProjectorService(deployment.settings, deployment.nats_url_as("projector"), deployment.database_url)
    await projector.start()
    try:
        await deployment.wait_projected(sent_seq)
    finally:
        await projector.stop()
    rows = await projected_rows(deployment, "WHERE workspace = 'acme' AND NOT deleted")
    assert {doc for _, doc in rows} == {"fine", "long", "again"}
    assert rows[("acme", "again")][1] == "again, short now"  # not the re-driven older state
    remaining = await dead_letters(nc, names, Selection())
    assert [letter.seq for letter in remaining] == [acme[1].seq, letters[2].seq]  # the re-driven one is gone

    # Every one of those read, and none stored after: what `dlq purge` listed before asking is what goes.
    read = await dead_letters(nc, names, Selection())
    assert await purge(nc, names, Selection(), read[:1]) == 1
    assert [letter.seq for letter in await dead_letters(nc, names, Selection())] == [letters[2].seq]
    assert await purge(nc, names, Selection(workspace="globex")) == 1
    assert await dead_letters(nc, names, Selection()) == []


async def test_a_workspace_whose_dead_letter_was_redriven_after_a_fix_rebuilds(deployment: Deployment) -> None:
    """The fix (a larger max_content_bytes) applies to the rebuild's replay too: it applies the original delta, and
    must still end where the index is, at the re-driven copy (under the original's event id it was a repeat)."""
    await _project(
        deployment,
        LIMIT,
        upsert("acme", document("big", "short at first", embedding=unit_vector("short"))),
        upsert("acme", document("big", "long " + "x" * LIMIT, embedding=unit_vector("long"))),
    )
    fixed = deployment.settings.model_copy(update={"max_content_bytes": 10 * LIMIT})
    letters = await dead_letters(deployment.nc, deployment.names, Selection(workspace="acme"))
    placement = Placement.of(fixed, deployment.database_url)
    outcome = await redrive(deployment.nc, deployment.names, letters, placement.database_url_of)
    (sent_seq,) = [seq for _, seq in outcome.sent]
    projector = ProjectorService(fixed, deployment.nats_url_as("projector"), deployment.database_url)
    await projector.start()
    try:
        await deployment.wait_projected(sent_seq)
    finally:
        await projector.stop()
    report = await Rebuild(fixed, deployment.nats_url, deployment.database_url, "acme", RecordedProgress()).run()
    assert report.swapped
    rows = await projected_rows(deployment, "WHERE workspace = 'acme' AND NOT deleted")
    assert rows[("acme", "big")][1].startswith("long ")


async def test_a_dead_letter_the_stream_refuses_is_left_and_the_rest_are_sent(deployment: Deployment) -> None:
    await _project(
        deployment,
        LIMIT,
        upsert("acme", document("one", "x" * (LIMIT + 1))),
        upsert("acme", document("two", "y" * (LIMIT + 1))),
    )
    first, second = await dead_letters(deployment.nc, deployment.names, Selection(workspace="acme"))
    grown = dataclasses.replace(first, data=b"z" * (2 * 1024 * 1024))  # past what NATS carries
    outcome = await redrive(deployment.nc, deployment.names, [grown, second], None)
    assert [(letter.seq, "MaxPayloadError" in why) for letter, why in outcome.refused] == [(first.seq, True)]
    assert [letter.seq for letter, _ in outcome.sent] == [second.seq]
    assert [letter.seq for letter in await dead_letters(deployment.nc, deployment.names, Selection())] == [first.seq]


def test_a_redriven_delta_has_an_event_id_of_its_own_and_what_is_not_a_delta_goes_as_it_is() -> None:
    sent = json.loads(upsert("acme", document("a", "naïve"), event_id="e" * 128).model_dump_json(by_alias=True))
    sent["payload"]["document"]["content"] = "naïve \ud800"  # half a character: what a dead letter may hold
    again = json.loads(redriven(json.dumps(sent).encode(), 42))
    assert again["eventId"] == "e" * 96 + "~redriven:42"
    assert len(again["eventId"]) <= 128
    assert again["payload"] == sent["payload"]
    wide = json.loads(upsert("acme", document("b", "解析" * 1000)).model_dump_json(by_alias=True))
    body = json.dumps(wide, ensure_ascii=False).encode()
    assert len(redriven(body, 42)) < len(body) + 50  # as UTF-8: escaped, it took twice the bytes, past max_payload
    for body in (b"not json", b"[1]", b'{"eventId": 3}', b"[" * 5000 + b"]" * 5000):
        assert redriven(body, 42) == body
    # Written under its field name, which the contract reads too: it kept its id, and a replay took it for a repeat.
    snake = json.dumps({**{k: v for k, v in sent.items() if k != "eventId"}, "event_id": "ev-snake"}).encode()
    assert json.loads(redriven(snake, 7))["event_id"] == "ev-snake~redriven:7"


async def test_a_redrive_whose_message_id_another_took_still_stores_the_delta(deployment: Deployment) -> None:
    """A red team's finding: a tenant may publish on its own subjects under any message id, among them the one a
    re-drive of its workspace's dead letter would use; the re-drive was then taken for a repeat, not stored, and the
    dead letter deleted all the same: the change was lost for good."""
    await _project(deployment, LIMIT, upsert("acme", document("long", "x" * (LIMIT + 1))))
    (letter,) = await dead_letters(deployment.nc, deployment.names, Selection())
    squatter = upsert("acme", document("harmless", "hello")).model_dump_json(by_alias=True).encode()
    taken = await deployment.js.publish(
        letter.original_subject,
        squatter,
        headers={"Nats-Msg-Id": f"redrive:{deployment.names.dlq_stream}:{letter.seq}"},
    )
    outcome = await redrive(deployment.nc, deployment.names, [letter], None)
    ((_, sent_seq),) = outcome.sent
    assert sent_seq > taken.seq
    stored = await deployment.js.get_msg(deployment.names.delta_stream, sent_seq)
    assert stored.subject == letter.original_subject
    assert json.loads(stored.data)["eventId"].endswith(f"~redriven:{letter.seq}")
    assert await dead_letters(deployment.nc, deployment.names, Selection()) == []


async def test_the_dlq_commands(deployment: Deployment) -> None:
    await _project(deployment, LIMIT, upsert("acme", document("long", "x" * (LIMIT + 1))))
    env = deployment.env()

    def dlq(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [ONTOFABRIC, "dlq", *args], env=env, input=stdin, capture_output=True, text=True, check=False, timeout=60
        )

    listed = dlq("list", "--json", "--workspace", "acme")
    assert listed.returncode == 0, listed.stderr
    (entry,) = [json.loads(line) for line in listed.stdout.splitlines()]
    assert (entry["workspace"], entry["branch"], entry["reason"]) == ("acme", "main", "content_too_large")
    # The branch in the plain listing too (an auditor could not tell main's letters from a branch's).
    assert f"{entry['seq']}\t" in (plain := dlq("list").stdout)
    assert "\tacme\tmain\tcontent_too_large\t" in plain
    shown = dlq("show", str(entry["seq"]))
    assert shown.returncode == 0, shown.stderr
    assert '"content_too_large"' in shown.stdout
    assert '"long"' in shown.stdout
    assert dlq("list", "--since", "sometime").returncode != 0
    refused = dlq("purge", stdin="n\n")  # asks first, saying what it would delete (an operator tester's)
    assert refused.returncode == 1
    assert f"{entry['seq']}\tacme\tcontent_too_large" in refused.stdout
    assert "delete 1: every dead letter?" in refused.stdout
    nothing = dlq("purge", "--reason", "apply_failed")
    assert (nothing.returncode, nothing.stdout) == (0, "")  # nothing to ask about
    assert "no dead letter matches" in nothing.stderr
    assert dlq("purge", "--reason", "no_such_reason").returncode == 2  # no reason a projector gives: a usage error
    # A sequence named that is no dead letter is an error, as for `dlq show` (an ops tester's: "re-drove 0", exit 0);
    # nothing is done to the others named with it.
    for command, done in (("redrive", "re-driven"), ("purge", "deleted")):
        typo = dlq(command, str(entry["seq"]), "999999", "--yes")
        assert typo.returncode == 2, typo.stderr
        assert f"no dead letter at sequence 999999: nothing {done}" in " ".join(typo.stderr.split())
    assert dlq("show", str(entry["seq"])).returncode == 0  # still there
    assert dlq("list", "--json").stdout.strip()
    redriven = dlq("redrive", str(entry["seq"]), "--yes")
    assert redriven.returncode == 0, redriven.stderr
    assert "re-drove 1" in redriven.stderr
    assert "refused for what their delta holds" not in redriven.stderr  # a content limit is a setting's
    assert dlq("list", "--json").stdout.strip() == ""  # the projector is not running: nothing dead-lettered again
    # One refused for what it holds is re-driven as asked, with a word that it will be set aside again.
    as_set_aside = {
        "Ontofabric-Reason": "invalid_schema",
        "Ontofabric-Original-Subject": deployment.names.delta_subject("acme", "main"),
    }
    await deployment.js.publish(deployment.names.dlq_subject("acme"), b"{}", headers=as_set_aside)
    hopeless = dlq("redrive", "--yes", "--force")  # --force: the re-drive above is not projected yet
    assert hopeless.returncode == 0, hopeless.stderr
    said = " ".join(hopeless.stderr.split())
    assert "1 of them (invalid_schema) were refused for what their delta holds" in said
    assert "re-drove 1" in said
    # A body nested deeper than a JSON parser goes is shown as it is, and re-driven as it is.
    deep = b"[" * 5000 + b"]" * 5000
    await deployment.js.publish(deployment.names.dlq_subject("acme"), deep, headers={"Ontofabric-Reason": "x"})
    (entry,) = [json.loads(line) for line in dlq("list", "--json").stdout.splitlines()]
    shown = dlq("show", str(entry["seq"]))
    assert shown.returncode == 0, shown.stderr
    assert "[[[[" in shown.stdout
    # Half a character, as a malformed delta may hold: valid JSON that no terminal can print raw (a tester's
    # finding: the command stopped half-way with a traceback). It stays escaped.
    half = b'{"payload": {"documentId": "x\\ud800y", "content": "na\xc3\xafve"}}'
    await deployment.js.publish(deployment.names.dlq_subject("acme"), half, headers={"Ontofabric-Reason": "x"})
    entry = [json.loads(line) for line in dlq("list", "--json").stdout.splitlines()][-1]
    shown = dlq("show", str(entry["seq"]))
    assert shown.returncode == 0, shown.stderr
    assert '"x\\ud800y"' in shown.stdout
    # What a tenant sent reaches the operator's terminal escaped: control sequences cleared the screen and set the
    # window's title as `dlq list` and `dlq show` printed them (an outside tester's).
    hostile = b"\x1b[2J\x1b]0;pwned\x07 not json \xe2\x80\xae\xc2\x9b"
    quoted = {"Ontofabric-Reason": "invalid_schema", "Ontofabric-Detail": "payload: tag '\x1b[41mEVIL\x1b[0m'\tx"}
    await deployment.js.publish(deployment.names.dlq_subject("acme"), hostile, headers=quoted)
    await deployment.js.publish(
        deployment.names.dlq_subject("acme"), b'{"type": "\xc2\x9b2J\xe2\x80\xae"}', headers=quoted
    )
    listed = dlq("list", "--workspace", "acme")
    *_, raw, as_json = [int(line.split("\t")[0]) for line in listed.stdout.splitlines()]
    shown = dlq("show", str(raw)).stdout + dlq("show", str(as_json)).stdout
    for printed in (listed.stdout, shown, dlq("purge", str(raw), stdin="n\n").stdout):
        assert not any(c in printed for c in "\x1b\x07\x9b\u202e"), printed
    assert "tag '\\x1b[41mEVIL\\x1b[0m'\\tx" in listed.stdout  # a tab shifts no column (a review's)
    assert "\\x1b[2J\\x1b]0;pwned\\x07 not json \\u202e\\x9b" in shown
    assert '"\\u009b2J\\u202e"' in shown  # JSON: escaped as JSON escapes
    # A detail past what a listing shows is said to be cut (a producer tester read a cut one as whole).
    long_detail = {"Ontofabric-Reason": "invalid_schema", "Ontofabric-Detail": "d" * 119 + "tail"}
    await deployment.js.publish(deployment.names.dlq_subject("acme"), b"{}", headers=long_detail)
    assert dlq("list", "--workspace", "acme").stdout.splitlines()[-1].endswith("\t" + "d" * 119 + "…")


async def test_compaction_after_the_dead_letters_are_purged_leaves_their_deltas_out(deployment: Deployment) -> None:
    """Once a dead letter is purged (or re-driven), compaction can no longer learn from the dead-letter stream that
    the projector refused its delta: it refused every later run, for good, and the stream grew without bound. The
    index's record of handled events tells instead: a dead-lettered delta's event is not there."""
    long = "x" * (LIMIT + 50)
    seqs = await _project(
        deployment,
        LIMIT,
        upsert("acme", document("fine", "short")),
        upsert("acme", document("long", f"long {long}")),
    )
    names, nc = deployment.names, deployment.nc
    assert await purge(nc, names, Selection()) == 1
    tight = deployment.settings.model_copy(update={"max_content_bytes": LIMIT})
    placement = Placement.of(tight, deployment.database_url)
    report = await compact(nc, names, tight, RecordedProgress(), placement)
    assert report.covers == seqs[-1]
    store = await find_snapshot_store(deployment.js, names)
    assert store is not None
    snapshot = await load_snapshot(store, "acme")
    assert snapshot is not None
    assert [delta.seq for delta in snapshot.deltas] == [seqs[0]]  # the refused one is not in what the index holds
    # A delta the projector applied, refused by this run's tighter settings alone, is still refused.
    await _project(deployment, 10 * LIMIT, upsert("acme", document("medium", f"medium {long}")))
    with pytest.raises(CompactionRefused, match="the projector applied it"):
        await compact(nc, names, tight, RecordedProgress(), placement)


async def test_compaction_keeps_a_delta_an_earlier_release_applied_that_this_one_refuses(
    deployment: Deployment,
) -> None:
    """A delta applied under an earlier release's looser contract (here a NUL in its metadata, refused since) was
    folded as never applied: left out of the snapshot, and purged from the stream, while the index held its row.
    The index's record of handled events tells it was applied: it is kept as it was stored."""
    names, nc = deployment.names, deployment.nc
    body = json.loads(upsert("acme", document("old", "from an earlier release")).model_dump_json())
    body["payload"]["document"]["metadata"] = {"note": "a\u0000b"}
    body["eventId"] = "applied-by-an-earlier-release"
    stored = json.dumps(body).encode()
    old = await deployment.js.publish(names.delta_subject("acme", "main"), stored)
    seqs = await _project(deployment, 10 * LIMIT, upsert("acme", document("fine", "short")))
    (letter,) = await dead_letters(nc, names, Selection())
    assert (letter.reason, letter.original_seq) == ("invalid_schema", old.seq)
    # What the earlier release left: no dead letter, the event recorded as handled at its sequence.
    assert await purge(nc, names, Selection()) == 1
    await deployment.fetch(
        "INSERT INTO handled_events (workspace, event_id, stream_seq) VALUES ('acme', $1, $2)", body["eventId"], old.seq
    )
    placement = Placement.of(deployment.settings, deployment.database_url)
    report = await compact(nc, names, deployment.settings, RecordedProgress(), placement)
    assert report.covers == seqs[-1]
    store = await find_snapshot_store(deployment.js, names)
    assert store is not None
    snapshot = await load_snapshot(store, "acme")
    assert snapshot is not None
    assert (snapshot.deltas[0].seq, snapshot.deltas[0].data) == (old.seq, stored)
    assert [delta.seq for delta in snapshot.deltas] == [old.seq, seqs[0]]
    # The next compaction folds on from that snapshot (it raised reading it) and keeps it still.
    more = await _project(deployment, 10 * LIMIT, upsert("acme", document("fine", "edited")))
    again = await compact(nc, names, deployment.settings, RecordedProgress(), placement)
    assert again.covers == more[-1]
    snapshot = await load_snapshot(store, "acme")
    assert snapshot is not None
    assert [delta.seq for delta in snapshot.deltas] == [old.seq, more[0]]


@pytest.mark.parametrize("fixed_under_the_same_event", [False, True])
async def test_compaction_leaves_out_a_delta_the_index_refused_once_its_dead_letter_is_gone(
    deployment: Deployment, fixed_under_the_same_event: bool
) -> None:
    """A red team's finding: a delta the database refused (``apply_failed``: a key too long for its index, which
    the contract now refuses first; here a trigger refuses it as PostgreSQL did, program limit exceeded), its dead
    letter purged, was folded into the snapshot in place of the delta the index holds; the stream lost that one,
    and every rebuild after refused its swap (``--force`` emptied the row). A fault tester's variant: the producer
    sends the fix under the refused delta's event id, the index handles the event at the fix's sequence, and the
    refused one counted as handled for its event id alone."""
    await migrate(deployment.database_url, deployment.settings)
    await deployment.fetch(
        """
        CREATE FUNCTION refuse_marked() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.content = 'refused by the database' THEN
                RAISE EXCEPTION 'index row size exceeds btree maximum' USING ERRCODE = '54000';
            END IF;
            RETURN NEW;
        END $$
        """
    )
    await deployment.fetch(
        "CREATE TRIGGER refuse_marked BEFORE INSERT OR UPDATE ON documents"
        " FOR EACH ROW EXECUTE FUNCTION refuse_marked()"
    )
    seqs = await _project(
        deployment,
        10 * LIMIT,
        upsert("acme", document("x", "first")),
        upsert("acme", document("x", "refused by the database"), event_id="the-edit"),
    )
    if fixed_under_the_same_event:
        # Sent by the producer after a restart: another publisher session, so no JetStream repeat.
        again = DeltaPublisher(deployment.js, deployment.names)
        deployment_again = dataclasses.replace(deployment, publisher=again)
        seqs += await _project(
            deployment_again, 10 * LIMIT, upsert("acme", document("x", "the edit, fixed"), event_id="the-edit")
        )
    (letter,) = await dead_letters(deployment.nc, deployment.names, Selection())
    assert (letter.reason, letter.original_seq) == ("apply_failed", seqs[1])
    assert await purge(deployment.nc, deployment.names, Selection()) == 1
    kept, content = ([seqs[2]], "the edit, fixed") if fixed_under_the_same_event else ([seqs[0]], "first")
    settings = deployment.settings.model_copy(update={"max_content_bytes": 10 * LIMIT})
    placement = Placement.of(settings, deployment.database_url)
    await compact(deployment.nc, deployment.names, settings, RecordedProgress(), placement)
    store = await find_snapshot_store(deployment.js, deployment.names)
    assert store is not None
    snapshot = await load_snapshot(store, "acme")
    assert snapshot is not None
    assert [delta.seq for delta in snapshot.deltas] == kept
    report = await Rebuild(settings, deployment.nats_url, deployment.database_url, "acme", RecordedProgress()).run()
    assert report.swapped
    rows = await projected_rows(deployment, "WHERE workspace = 'acme' AND NOT deleted")
    assert rows[("acme", "x")][1] == content


async def test_a_dead_letter_whose_branch_the_projector_has_not_caught_up_with_waits(deployment: Deployment) -> None:
    """While the projector lags, a later state of the document may be in the stream and not yet in the index, so
    the index check alone let an older state be re-driven over it."""
    long = "x" * (LIMIT + 50)
    await _project(deployment, LIMIT, upsert("acme", document("m", f"first {long}")))
    names, nc = deployment.names, deployment.nc
    (letter,) = await dead_letters(nc, names, Selection())
    newer = await deployment.publisher.publish(upsert("acme", document("m", "third, short")))  # no projector runs
    placement = Placement.of(deployment.settings, deployment.database_url)
    floors = await applied_through(deployment.js, names, deployment.settings, placement, {"acme"})
    assert floors["acme"] < newer.seq
    outcome = await redrive(nc, names, [letter], placement.database_url_of, floors)
    assert outcome.sent == []
    assert [(left.seq, last) for left, last in outcome.waiting] == [(letter.seq, newer.seq)]
    assert [left.seq for left in await dead_letters(nc, names, Selection())] == [letter.seq]  # still there
    # Caught up: the index holds the later state, so the letter is superseded, not sent.
    projector = ProjectorService(deployment.settings, deployment.nats_url_as("projector"), deployment.database_url)
    await projector.start()
    try:
        await deployment.wait_projected(newer.seq)
    finally:
        await projector.stop()
    # A consumer of another partition layout that has applied nothing (being filled, or left over) holds no letter
    # back: the one that applies the workspace's deltas for this deployment decides.
    other_layout = ConsumerConfig(durable_name=names.postgres_projector_durables(2)[0], ack_policy=AckPolicy.EXPLICIT)
    await deployment.js.add_consumer(names.delta_stream, other_layout)
    floors = await applied_through(deployment.js, names, deployment.settings, placement, {"acme"})
    assert floors == {"acme": newer.seq}
    outcome = await redrive(nc, names, [letter], placement.database_url_of, floors)
    assert [(left.seq, later) for left, later in outcome.superseded] == [(letter.seq, newer.seq)]


@contextlib.asynccontextmanager
async def _projecting(deployment: Deployment) -> AsyncIterator[None]:
    """A projector taking documents up to LIMIT bytes, running while the block does."""
    settings = deployment.settings.model_copy(update={"max_content_bytes": LIMIT})
    projector = ProjectorService(settings, deployment.nats_url_as("projector"), deployment.database_url)
    await projector.start()
    try:
        yield
    finally:
        await projector.stop()


async def _content_of(deployment: Deployment, doc_id: str) -> str:
    rows = await projected_rows(deployment, "WHERE workspace = 'acme' AND NOT deleted")
    return str(rows[("acme", doc_id)][1])


async def test_a_graph_dead_letter_the_index_holds_a_later_state_of_is_not_redriven(deployment: Deployment) -> None:
    """A fault tester's finding: only documents were checked, so a redrive brought back a node (and a link) that
    later deltas had removed."""
    node = OntologyNode(domain="d", name="G2", kind="class")  # objectType d.G2
    first = await _project(
        deployment, LIMIT, envelope("acme", NodeUpserted(node=node.model_copy(update={"name": "G"})), event_id="used")
    )
    # The same event id with another node, from another publisher session (no JetStream repeat): event_id_reused.
    again = dataclasses.replace(deployment, publisher=DeltaPublisher(deployment.js, deployment.names))
    reused = await _project(again, LIMIT, envelope("acme", NodeUpserted(node=node), event_id="used"))
    (letter,) = await dead_letters(deployment.nc, deployment.names, Selection())
    assert (letter.reason, letter.original_seq) == ("event_id_reused", reused[0])
    removed = await _project(deployment, LIMIT, envelope("acme", NodeRemoved(object_type="d.G2")))
    placement = Placement.of(deployment.settings, deployment.database_url)
    floors = await applied_through(deployment.js, deployment.names, deployment.settings, placement, {"acme"})
    outcome = await redrive(deployment.nc, deployment.names, [letter], placement.database_url_of, floors)
    assert outcome.sent == []
    assert [(left.seq, later) for left, later in outcome.superseded] == [(letter.seq, removed[0])]
    assert first[0] < reused[0] < removed[0]


async def test_a_copy_of_an_event_set_aside_as_a_reuse_is_no_later_change_than_the_event(
    deployment: Deployment,
) -> None:
    """A delivery-order tester's copy of event A, stored after event B changed the same document, was set aside
    event_id_reused (its digest read otherwise); re-driven, it was taken for a change first published after B and
    put A's content back over B's, for good. A digest an earlier release made otherwise is what sets a copy aside
    here; a real reuse of an id, another change, is re-driven as before (the test after this one)."""
    first = await _project(deployment, LIMIT, upsert("acme", document("x", "alpha"), event_id="A"))
    newer = await _project(deployment, LIMIT, upsert("acme", document("x", "beta"), event_id="B"))
    await deployment.fetch("UPDATE handled_events SET payload_digest = repeat('0', 32) WHERE event_id = 'A'")
    again = dataclasses.replace(deployment, publisher=DeltaPublisher(deployment.js, deployment.names))
    copy = await _project(again, LIMIT, upsert("acme", document("x", "alpha"), event_id="A"))
    (letter,) = await dead_letters(deployment.nc, deployment.names, Selection())
    assert (letter.reason, letter.original_seq) == ("event_id_reused", copy[0])
    placement = Placement.of(deployment.settings, deployment.database_url)
    floors = await applied_through(deployment.js, deployment.names, deployment.settings, placement, {"acme"})
    outcome = await redrive(deployment.nc, deployment.names, [letter], placement.database_url_of, floors)
    assert outcome.sent == []
    assert [(left.seq, later) for left, later in outcome.superseded] == [(letter.seq, newer[0])]
    rows = await deployment.fetch("SELECT content FROM documents WHERE workspace = 'acme' AND id = 'x'")
    assert [r["content"] for r in rows] == ["beta"]
    assert first[0] < newer[0] < copy[0]


async def test_a_redrive_judges_later_states_by_the_index_before_it_not_by_its_own_redrives(
    deployment: Deployment,
) -> None:
    """A consistency tester's: two dead letters of one document, an older change and a newer, with others between
    them. The projector applied the older one's re-drive while the run went on, and the newer was then left for
    "the index holds its document at a later sequence": that sequence was the run's own. The older change won."""
    async with _projecting(deployment):
        acks = await deployment.publisher.publish_many(
            [upsert("acme", document("x", "v1"), event_id="e1"), upsert("acme", document("x", "v2"), event_id="e2")]
        )
        again = DeltaPublisher(deployment.js, deployment.names)  # another session: no JetStream repeat
        acks += await again.publish_many([upsert("acme", document("x", "R1 older change"), event_id="e1")])
        # Between the two letters, others the re-drive takes its time over (each dead-lettered again then).
        acks += await deployment.publisher.publish_many(
            [upsert("acme", document(f"big{n}", "z" * (2 * LIMIT))) for n in range(40)]
        )
        later = DeltaPublisher(deployment.js, deployment.names)
        acks += await later.publish_many([upsert("acme", document("x", "R2 newer change"), event_id="e2")])
        await deployment.wait_projected(acks[-1].seq)
        letters = await dead_letters(deployment.nc, deployment.names, Selection(workspace="acme"))
        reused = [letter for letter in letters if letter.reason == "event_id_reused"]
        assert [letter.original_seq for letter in reused] == [acks[2].seq, acks[-1].seq]
        placement = Placement.of(deployment.settings, deployment.database_url)
        floors = await applied_through(deployment.js, deployment.names, deployment.settings, placement, {"acme"})
        # In the order of the dead letters, but the older change's letter last (set aside again after a first
        # re-drive, it would be): the newer alone goes (a review's).
        others = [letter for letter in letters if letter.reason != "event_id_reused"]
        in_order = [*others, reused[1], reused[0]]
        outcome = await redrive(deployment.nc, deployment.names, in_order, placement.database_url_of, floors)
        assert outcome.superseded == []
        assert [(left.seq, latest.seq) for left, latest in outcome.outdone] == [(reused[0].seq, reused[1].seq)]
        assert reused[1].seq in {letter.seq for letter, _ in outcome.sent}
        await deployment.wait_projected(max(seq for _, seq in outcome.sent))
    assert await _content_of(deployment, "x") == "R2 newer change"


async def test_a_redrive_of_an_older_change_is_no_later_state_for_a_newer_ones_letter(deployment: Deployment) -> None:
    """A verifier re-drove an older change's letter alone, then the newer change's: the index held the document at
    the first re-drive's sequence, later than the newer change's own, and its letter was left for it. A re-drive
    carries the sequence its change was first published at, and is judged by that."""
    async with _projecting(deployment):
        acks = await deployment.publisher.publish_many(
            [upsert("acme", document("x", "v1"), event_id="e1"), upsert("acme", document("x", "v2"), event_id="e2")]
        )
        for event_id, text in (("e1", "R1 older change"), ("e2", "R2 newer change")):
            again = DeltaPublisher(deployment.js, deployment.names)  # another session: no JetStream repeat
            acks += await again.publish_many([upsert("acme", document("x", text), event_id=event_id)])
        await deployment.wait_projected(acks[-1].seq)
        older, newer = await dead_letters(deployment.nc, deployment.names, Selection(workspace="acme"))
        placement = Placement.of(deployment.settings, deployment.database_url)
        runs = []
        for letter in (older, newer):
            floors = await applied_through(deployment.js, deployment.names, deployment.settings, placement, {"acme"})
            runs.append(await redrive(deployment.nc, deployment.names, [letter], placement.database_url_of, floors))
            await deployment.wait_projected(runs[-1].sent[0][1])
        assert [(len(run.sent), run.superseded) for run in runs] == [(1, []), (1, [])]
    assert await _content_of(deployment, "x") == "R2 newer change"


async def test_what_a_tenant_puts_in_its_own_deltas_does_not_steer_a_redrive(deployment: Deployment) -> None:
    """A review's: a letter was keyed by the workspace its body claims, so another tenant's delta naming acme's row
    left acme's own letter unsent; and a forged Ontofabric-Redriven-Origin of "²" failed the whole redrive."""
    async with _projecting(deployment):
        own = await deployment.publisher.publish_many([upsert("acme", document("x", "z" * (2 * LIMIT)))])
        claimed = upsert("acme", document("x", "from globex"))
        forged = {"Nats-Msg-Id": "forged", "Ontofabric-Redriven-Origin": "²"}
        subject = deployment.names.delta_subject("globex", "main")
        ack = await deployment.js.publish(subject, claimed.model_dump_json().encode(), headers=forged)
        await deployment.wait_projected(ack.seq)
        letters = await dead_letters(deployment.nc, deployment.names, Selection())
        assert [(letter.workspace, letter.reason) for letter in letters] == [
            ("acme", "content_too_large"), ("globex", "subject_mismatch")
        ]  # fmt: skip
        assert letters[0].original_seq == own[0].seq
        placement = Placement.of(deployment.settings, deployment.database_url)
        floors = await applied_through(
            deployment.js, deployment.names, deployment.settings, placement, {"acme", "globex"}
        )
        outcome = await redrive(deployment.nc, deployment.names, letters, placement.database_url_of, floors)
    assert outcome.outdone == []
    assert [letter.seq for letter, _ in outcome.sent] == [letter.seq for letter in letters]


async def test_a_delta_on_a_token_that_names_no_workspace_is_dead_lettered_as_unknown(deployment: Deployment) -> None:
    """A consistency tester's: a delta on "acm_65" (no name's canonical token; "acme" is) was dead-lettered under
    that token, which `dlq list --workspace` cannot select; the contract's "_unknown" is for such a subject."""
    delta = upsert("acme", document("odd", "text"))
    settings = deployment.settings.model_copy(update={"max_content_bytes": LIMIT})
    projector = ProjectorService(settings, deployment.nats_url_as("projector"), deployment.database_url)
    await projector.start()
    try:
        odd = deployment.names.delta_subject("acme", "main").replace(".acme.", ".acm_65.")
        ack = await deployment.js.publish(odd, delta.model_dump_json().encode(), headers={"Nats-Msg-Id": "odd"})
        await deployment.wait_projected(ack.seq)
    finally:
        await projector.stop()
    (letter,) = await dead_letters(deployment.nc, deployment.names, Selection())
    assert (letter.reason, letter.workspace, letter.original_subject) == ("subject_mismatch", None, odd)
    stored = await deployment.js.get_msg(deployment.names.dlq_stream, letter.seq)
    assert stored.subject == deployment.names.dlq_subject("_unknown")
    # Selected by that name (a verifier's `dlq list --workspace _unknown` was refused as no workspace name).
    assert await dead_letters(deployment.nc, deployment.names, Selection(workspace="_unknown")) == [letter]
    assert letter.summary()["workspace"] == "_unknown"  # as `dlq list --json` and `dlq show` print it, not null
    assert await dead_letters(deployment.nc, deployment.names, Selection(workspace="acme")) == []
    # Not re-driven: the projector would set it aside again, under a new sequence, for ever (a review's).
    outcome = await redrive(deployment.nc, deployment.names, [letter], None)
    assert (outcome.nowhere, outcome.sent) == ([letter], [])
    from ontofabric.services.cli import _workspace_filter

    assert _workspace_filter("_unknown") == "_unknown"
    with pytest.raises(typer.BadParameter):
        _workspace_filter("_other")


async def test_an_acknowledgement_another_publisher_sent_to_a_delta_subject_is_no_dead_letter_at_all(
    deployment: Deployment,
) -> None:
    """An outside tester's: alice's publishes naming bob's delta subject as their reply subject had JetStream store
    its acknowledgements there; dead-lettered in bob's share, they pushed bob's own dead letters out. A review's:
    an error acknowledgement (asked for by a header) was not recognised, and one alice wrote on her own subject went
    to the share of no workspace's, pushing out what was there. None is dead-lettered; a delta after them applies."""
    from ontofabric.shared.jetstream import last_sequence_on

    projector = ProjectorService(deployment.settings, deployment.nats_url_as("projector"), deployment.database_url)
    await projector.start()
    try:
        bob = deployment.names.delta_subject("bob", "main")
        alice = deployment.names.delta_subject("alice", "main")
        delta = upsert("alice", document("a", "text")).model_dump_json().encode()
        await deployment.nc.publish(alice, delta, reply=bob)
        # An error answer: JetStream refuses the publish for the sequence it expects, and says so to the reply.
        await deployment.nc.publish(alice, delta, reply=bob, headers={"Nats-Expected-Last-Sequence": "999999"})
        await deployment.nc.flush()
        for _ in range(100):  # the server stores its two answers on bob's subject (both: on a busy machine the
            # error answer came after the first had been read alone, CI 2026-12-07)
            info = await deployment.js.stream_info(deployment.names.delta_stream, subjects_filter=bob)
            if (info.state.subjects or {}).get(bob, 0) >= 2:
                break
            await asyncio.sleep(0.05)
        stored = await last_sequence_on(deployment.js, deployment.names.delta_stream, bob)
        bodies = [
            json.loads((await deployment.js.get_msg(deployment.names.delta_stream, seq)).data)
            for seq in (stored - 1, stored)
        ]
        assert "error" in bodies[-1], bodies
        # And one alice writes on her own subject, shaped as an answer.
        ack = await deployment.js.publish(alice, b'{"stream": "anything", "seq": 7}')
        later = await deployment.js.publish(bob, upsert("bob", document("b", "text")).model_dump_json().encode())
        await deployment.wait_projected(max(ack.seq, later.seq))
    finally:
        await projector.stop()
    assert await dead_letters(deployment.nc, deployment.names, Selection()) == []
    assert await deployment.fetch("SELECT id FROM documents WHERE workspace = 'bob' AND NOT deleted") != []


async def test_a_name_too_long_for_its_index_is_dead_lettered_naming_the_field(deployment: Deployment) -> None:
    """A fault tester's 12 kB qualified name of random characters: PostgreSQL refused the index entry, and the
    dead letter said only that, naming no field."""
    name = "".join(random.Random(7).choices(string.ascii_letters + string.digits, k=12_000))  # compresses little
    seqs = await _project(deployment, LIMIT, upsert("acme", document("long", "text", symbolFqn=name)))
    (letter,) = await dead_letters(deployment.nc, deployment.names, Selection())
    assert (letter.reason, letter.original_seq) == ("apply_failed", seqs[0])
    assert "metadata.symbolFqn's last part is 12000 bytes" in letter.detail
    assert "metadata.symbolKey" not in letter.detail  # its own key is short
    # Re-driven, the same bytes come back: the operator is told so (not of another apply_failed letter).
    passing = {
        "Ontofabric-Reason": "apply_failed", "Ontofabric-Detail": "connection reset",
        "Ontofabric-Original-Subject": deployment.names.delta_subject("acme", "main"),
    }  # fmt: skip
    await deployment.js.publish(deployment.names.dlq_subject("acme"), b"{}", headers=passing)
    # Two with nowhere of their own to go back to: none named (the re-drive stopped on an empty subject, with a
    # traceback), and another workspace's subject (it would have written there).
    headless = {"Ontofabric-Reason": "apply_failed"}
    await deployment.js.publish(deployment.names.dlq_subject("acme"), b"{}", headers=headless)
    elsewhere = passing | {"Ontofabric-Original-Subject": deployment.names.delta_subject("other", "main")}
    await deployment.js.publish(deployment.names.dlq_subject("acme"), b"{}", headers=elsewhere)
    redriven = await asyncio.to_thread(
        subprocess.run, [ONTOFABRIC, "dlq", "redrive", "--yes", "--force"], env=deployment.env(),
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    said = " ".join(redriven.stderr.split())
    assert redriven.returncode == 0, said
    assert "1 of them (apply_failed) were refused for a name longer than an index key takes" in said
    assert "re-drove 2 dead letter(s), left 2" in said
    assert "the subject it came from (none) is none of acme's delta subjects" in said
    other = deployment.names.delta_subject("other", "main")
    assert f"the subject it came from ({other}) is none of acme's delta subjects" in said
    assert "Traceback" not in said
    with pytest.raises(NotFoundError):  # nothing written into the other workspace
        await deployment.js.get_last_msg(deployment.names.delta_stream, other)


async def test_metadata_is_bounded_as_the_index_stores_it(deployment: Deployment) -> None:
    """A fault tester's delta of 960 kB held 160,000 × 1e308 in a free key: jsonb writes each in full, so every read
    of the document carried 50 MB, and other workspaces' queries went unanswered meanwhile. The bound counts the
    metadata as stored; what is within it is stored at the size counted."""
    numbers = [1.5e3, 1e20, -2.5e-7, 0.125, 7, 9, 2**63, -12345678901234567890]  # 9: a review's, counted as 2
    kept = json.loads(upsert("acme", document("kept", "text")).model_dump_json())
    kept["payload"]["document"]["metadata"].update({"n": numbers, "note": "é\n", "deep": {"a": [True, None]}})
    over = json.loads(upsert("acme", document("over", "text")).model_dump_json())
    over["payload"]["document"]["metadata"]["n"] = [1e300] * 240  # 2.4 kB as sent, 72 kB as stored
    subject = deployment.names.delta_subject("acme", "main")
    settings = deployment.settings
    projector = ProjectorService(settings, deployment.nats_url_as("projector"), deployment.database_url)
    await projector.start()
    try:
        for delta in (over, kept):
            ack = await deployment.js.publish(
                subject, json.dumps(delta).encode(), headers={"Nats-Msg-Id": delta["eventId"]}
            )
        await deployment.wait_projected(ack.seq)
    finally:
        await projector.stop()
    (letter,) = await dead_letters(deployment.nc, deployment.names, Selection())
    assert letter.reason == "invalid_schema"
    assert f"metadata is over {MAX_METADATA_BYTES} bytes as stored" in letter.detail
    conn = await asyncpg.connect(deployment.database_url)
    try:
        stored, size = await conn.fetchrow(
            "SELECT metadata::text, octet_length(metadata::text) FROM documents WHERE id = 'kept'"
        )
        assert await conn.fetchval("SELECT count(*) FROM documents WHERE id = 'over'") == 0
    finally:
        await conn.close()
    sent = DocumentMetadata.model_validate(kept["payload"]["document"]["metadata"])
    assert size == stored_json_bytes(sent.model_dump(mode="json", exclude_none=True))
    assert json.loads(stored)["n"] == [
        1500.0,
        100000000000000000000,
        -2.5e-7,
        0.125,
        7,
        9,
        2**63,
        -12345678901234567890,
    ]
    assert "100000000000000000000" in stored  # written in full
    assert "-0.00000025" in stored


async def test_a_delta_dead_lettered_again_is_one_letter_counted_and_said_once(deployment: Deployment) -> None:
    """An operator tester's: a projector killed mid-batch after dead-lettering three deltas, and the one taking over
    read them again; the dead-letter stream kept one letter each, but both processes logged `delta_dead_lettered`
    and counted it: 6 in the metrics for 3 letters."""
    names = deployment.names
    ack = await deployment.js.publish(names.delta_subject("acme", "main"), b"not json")

    def counted(outcome: str) -> int:
        return sum(
            int(point.value)
            for point in metric_points("projector.deltas")
            if point.attributes.get("outcome") == outcome and point.attributes.get("index") == "dl-test"
        )

    said = []
    for reader in ("first", "second"):  # each a delivery of the same delta, as a crash and a takeover make
        config = ConsumerConfig(durable_name=f"{names.prefix}-{reader}", ack_policy=AckPolicy.EXPLICIT)
        await deployment.js.add_consumer(names.delta_stream, config)
        subscription = await deployment.js.pull_subscribe_bind(f"{names.prefix}-{reader}", names.delta_stream)
        (msg,) = await subscription.fetch(1, timeout=5)
        assert msg.metadata.sequence.stream == ack.seq
        with structlog.testing.capture_logs() as logged:
            assert await dead_letter(deployment.js, names, [(msg, Rejection("invalid_schema", "not JSON"))], "dl-test")
        said += [entry["event"] for entry in logged]
        if reader == "first":  # whose it is (an auditor could not tell from the log)
            assert (logged[0]["workspace"], logged[0]["branch"]) == ("acme", "main")
    assert said == ["delta_dead_lettered", "delta_dead_lettered_before"]
    assert (counted("dead_lettered"), counted("dead_lettered_before")) == (1, 1)
    assert len(await dead_letters(deployment.nc, names, Selection())) == 1


def test_a_watch_counts_each_delta_set_aside_once() -> None:
    """Set aside twice (delivered again across a projector's restart), a delta is one of those an ingest sent: a red
    team's ingest read "57 of the 20 deltas published were dead-lettered"."""
    from ontofabric.services.ops.dead_letters import DeadLetterWatch, SetAside

    watch = DeadLetterWatch()
    first, again, other = (
        SetAside(7, "content_too_large", "", "postgres"),
        SetAside(7, "content_too_large", "x", "postgres"),
        SetAside(9, "r", "", "postgres"),
    )
    watch._seen += [first, other, again, SetAside(12, "r", "", "postgres")]
    assert watch.of({7, 9}) == [first, other]
