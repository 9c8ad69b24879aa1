"""A projector killed mid-stream (SIGKILL, no goodbye) and restarted ends with the fold of the stream."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from nats.js.errors import NotFoundError

from ontofabric.contracts import DeltaEnvelope, DocumentUpserted
from ontofabric.services.projector.planning import Delta, plan_batch
from ontofabric.shared.settings import Settings

from .conftest import Deployment
from .factories import delete, document, upsert

ONTOFABRIC = str(Path(sys.executable).parent / "ontofabric")


def _stream(count: int, ids: int, seed: int) -> list[DeltaEnvelope]:
    rng = random.Random(seed)
    deltas = []
    for n in range(count):
        doc_id = f"doc-{rng.randrange(ids)}"
        if rng.random() < 0.2:
            deltas.append(delete("acme", doc_id))
        else:
            deltas.append(upsert("acme", document(doc_id, f"{doc_id} revision {n} {rng.random()}")))
    return deltas


def _start_projector(deployment: Deployment) -> subprocess.Popen[bytes]:
    # The default ack wait (the test deployments use a shorter one), to measure the recovery a deployment gets.
    env = deployment.env() | {
        "ONTOFABRIC_PROJECTOR_BATCH_SIZE": "10",
        "ONTOFABRIC_LOG_LEVEL": "WARNING",
        "ONTOFABRIC_PROJECTOR_ACK_WAIT_S": str(Settings.model_fields["projector_ack_wait_s"].default),
    }
    return subprocess.Popen([ONTOFABRIC, "projector"], env=env, stdout=subprocess.DEVNULL, start_new_session=True)


async def _acked(deployment: Deployment) -> int:
    names = deployment.names
    try:
        info = await deployment.js.consumer_info(names.delta_stream, names.postgres_projector_durable)
    except NotFoundError:  # the projector process has not created its consumer yet
        return 0
    return info.ack_floor.stream_seq or 0


@pytest.mark.slow
async def test_killed_projector_restarts_to_the_fold_of_the_stream(deployment: Deployment) -> None:
    deltas = _stream(count=1500, ids=200, seed=7)
    first = _start_projector(deployment)
    try:
        acks = await deployment.publisher.publish_many(deltas)
        async with asyncio.timeout(60):
            while await _acked(deployment) < 300:
                await asyncio.sleep(0.02)
        os.killpg(first.pid, signal.SIGKILL)
        killed = time.monotonic()
        first.wait(10)
        killed_at = await _acked(deployment)
        assert killed_at < acks[-1].seq, "the projector finished before it could be killed; use a longer stream"
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)

    second = _start_projector(deployment)
    try:
        # Recovery: the deltas the killed projector had in hand come back after the ack wait (6 s), not after the
        # longest a batch may take (it was 30 s): the ack floor moves again soon after the new process is up.
        async with asyncio.timeout(60):
            while await _acked(deployment) <= killed_at:
                await asyncio.sleep(0.05)
        recovered_s = time.monotonic() - killed
        print(f"recovery: ack floor moving again {recovered_s:.1f} s after the kill")
        assert recovered_s < 15
        await deployment.wait_projected(acks[-1].seq, timeout_s=120)
    finally:
        os.killpg(second.pid, signal.SIGTERM)
        assert second.wait(30) == 0  # a clean stop on SIGTERM

    # The fold of the stream, computed independently: last writer per document in stream order.
    expected: dict[str, tuple[bool, str, int]] = {}
    for ack, delta in zip(acks, deltas, strict=True):
        payload = delta.payload
        if isinstance(payload, DocumentUpserted):
            expected[payload.document.id] = (False, payload.document.content, ack.seq)
        else:
            expected[payload.document_id] = (True, "", ack.seq)
    rows = await deployment.fetch("SELECT id, deleted, content, stream_seq FROM documents WHERE workspace = 'acme'")
    assert {r["id"]: (r["deleted"], r["content"], r["stream_seq"]) for r in rows} == expected

    # And the ontologyVersion equals the one a single uninterrupted pass computes.
    whole = plan_batch([Delta(a.seq, d) for a, d in zip(acks, deltas, strict=True)], {}, {})
    version = (await deployment.fetch("SELECT state_hash, stream_seq FROM ontology_versions"))[0]
    assert version["stream_seq"] == whole.versions[("acme", "main")].stream_seq
    assert version["state_hash"] % (1 << 64) == whole.versions[("acme", "main")].state_hash
