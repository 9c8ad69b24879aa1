"""Ingest manifests in their KV bucket: parts, compare-and-set, the move out of the old object store, and each
ingester confined to its own workspaces' manifests."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import nats.js.errors
import pytest
from structlog.testing import capture_logs

from ontofabric.contracts import DocumentUpserted
from ontofabric.services.ingest.client import envelope
from ontofabric.services.ingest.ingester import Ingester, Manifest
from ontofabric.shared.jetstream import NotSetUp, PermissionDenied, refused_promptly
from ontofabric.shared.manifest_store import (
    ManifestChanged,
    ManifestMissing,
    ManifestStore,
    StoredManifest,
    migrate_legacy_manifests,
)
from ontofabric.shared.runtime import EmbeddedRuntime
from ontofabric.shared.subjects import encode_token

from .conftest import Deployment, connect_as
from .factories import document


def _manifest(size: int, tag: str = "") -> bytes:
    return Manifest({f"d:pkg/m{i}.py::f{i}": f"{tag}{i:064x}" for i in range(size)}).to_json()


async def _keys(deployment: Deployment) -> set[str]:
    kv = await deployment.js.key_value(deployment.names.manifest_bucket)
    try:
        return set(await kv.keys())
    except Exception:  # nats-py raises NoKeysError on an empty bucket
        return set()


async def test_a_manifest_larger_than_a_message_is_saved_in_parts_and_replaced_whole(deployment: Deployment) -> None:
    store = ManifestStore(deployment.js, deployment.names, part_bytes=4096)
    first, second = _manifest(2000), _manifest(1500, "b")
    assert (await store.load("acme", "feature/x")).data is None

    saved = await store.save("acme", "feature/x", first, StoredManifest(None, 0))
    assert saved.parts > 2  # compressed, it still needs several parts of 4 KiB
    loaded = await store.load("acme", "feature/x")
    assert loaded.data == first
    await store.save("acme", "feature/x", second, loaded)
    assert (await store.load("acme", "feature/x")).data == second

    # Only the head and the current generation's parts are left: the first generation was purged.
    prefix = f"acme.{encode_token('feature/x')}"
    current = json.loads(
        (await (await deployment.js.key_value(deployment.names.manifest_bucket)).get(f"{prefix}.head")).value or b""
    )
    expected = {f"{prefix}.head", *(f"{prefix}.parts.{current['generation']}.{i}" for i in range(current["parts"]))}
    assert await _keys(deployment) == expected


async def test_of_two_saves_from_one_manifest_only_the_first_lands(deployment: Deployment) -> None:
    store = ManifestStore(deployment.js, deployment.names)
    base = await store.save("acme", "main", _manifest(3), StoredManifest(None, 0))
    await store.save("acme", "main", _manifest(4, "a"), base)
    with pytest.raises(ManifestChanged):
        await store.save("acme", "main", _manifest(5, "b"), base)
    assert (await store.load("acme", "main")).data == _manifest(4, "a")
    with pytest.raises(ManifestChanged):  # creating where one exists is a race lost too
        await store.save("acme", "main", _manifest(6), StoredManifest(None, 0))
    # The loser's parts were purged: the head and the winner's parts remain.
    assert len(await _keys(deployment)) == 2


async def test_a_manifest_read_while_another_ingest_replaces_it_is_read_from_the_new_head(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ingests of a branch at once: the parts one read was about to take were purged by the other's save
    between the head and the parts, and the read stopped with "a part of the ingest manifest is missing"."""
    store = ManifestStore(deployment.js, deployment.names)
    base = await store.save("acme", "main", _manifest(3), StoredManifest(None, 0))
    read_part = ManifestStore._get
    replaced = False

    async def racing(self: ManifestStore, key: str) -> bytes | None:
        nonlocal replaced
        if ".parts." in key and not replaced:  # the other ingest saves right after this one read the head
            replaced = True
            await ManifestStore(deployment.js, deployment.names).save("acme", "main", _manifest(4, "a"), base)
        return await read_part(self, key)

    monkeypatch.setattr(ManifestStore, "_get", racing)
    assert (await store.load("acme", "main")).data == _manifest(4, "a")
    monkeypatch.undo()
    # A head that names missing parts and stays put is still said to be damaged.
    kv = await deployment.js.key_value(deployment.names.manifest_bucket)
    await kv.put("acme.main.head", json.dumps({"generation": "gone", "parts": 1}).encode())
    with pytest.raises(ManifestMissing, match="is missing"):
        await store.load("acme", "main")


async def test_the_manifests_of_the_old_shared_object_store_move_into_the_bucket(
    deployment: Deployment, runtime: EmbeddedRuntime
) -> None:
    legacy = await deployment.js.create_object_store(deployment.names.legacy_manifest_bucket)
    old = b'{"version": 1, "entries": {"pkg/a.py::f": "h1"}}'
    await legacy.put(f"acme/{encode_token('feature/x')}", old)
    await legacy.put("beta/main", _manifest(3))
    await legacy.put("not-a-manifest", b"{}")

    projector = await connect_as(deployment, runtime, "projector")
    try:  # the projector does it at start, with its own credentials
        assert await migrate_legacy_manifests(projector.jetstream(), deployment.names) == 2
    finally:
        await projector.close()
    assert deployment.names.legacy_manifest_bucket not in {s.config.name for s in await deployment.js.streams_info()}
    ingester = Ingester(deployment.js, deployment.names, None, deployment.settings.max_content_bytes)
    assert (await ingester.load_manifest("acme", "feature/x")).entries == {"d:pkg/a.py::f": "h1"}
    assert (await ingester.load_manifest("beta", "main")).to_json() == _manifest(3)
    assert await migrate_legacy_manifests(deployment.js, deployment.names) == 0  # nothing left to move


async def test_an_ingester_reads_and_writes_only_its_own_workspaces_manifests(
    deployment: Deployment, runtime: EmbeddedRuntime, tmp_path: Path
) -> None:
    operator = ManifestStore(deployment.js, deployment.names)
    await operator.save("beta", "main", _manifest(3), StoredManifest(None, 0))
    nc = await connect_as(deployment, runtime, "ingest", "acme")
    try:
        js = nc.jetstream()
        acme = ManifestStore(js, deployment.names)
        saved = await acme.save("acme", "main", _manifest(2), StoredManifest(None, 0))
        assert (await acme.load("acme", "main")).data == _manifest(2)
        assert saved.revision > 0
        started = time.monotonic()
        with pytest.raises(PermissionDenied):
            await acme.load("beta", "main")
        with pytest.raises(PermissionDenied):
            await acme.save("beta", "main", _manifest(1), StoredManifest(None, 0))
        # Nor the streams' info, which would list every workspace's subjects or manifest keys.
        for stream in (deployment.names.delta_stream, f"KV_{deployment.names.manifest_bucket}"):
            info = js.stream_info(stream, subjects_filter=">")
            with pytest.raises(PermissionDenied):
                await refused_promptly(nc, f"$JS.API.STREAM.INFO.{stream}", info)
        assert time.monotonic() - started < 3  # refused at once, not after a timeout
        # A whole ingest needs none of it.
        (tmp_path / "a.py").write_text("def a():\n    return 1\n")
        report = await Ingester(js, deployment.names, None, deployment.settings.max_content_bytes).ingest(
            tmp_path, "acme", "feature"
        )
        assert report.upserts == 2
        # A rollup header on its own key would purge every workspace's keys: the bucket takes none.
        bucket = deployment.names.manifest_bucket
        with pytest.raises(nats.js.errors.APIError, match="rollup"):
            await js.publish(f"$KV.{bucket}.acme.x", b"", headers={"Nats-Rollup": "all"})
        assert (await operator.load("beta", "main")).data == _manifest(3)
        # A delta whose acknowledgement it sends to another workspace's manifest head: the server writes it there,
        # whatever permissions say. The head is then not one an ingester wrote, and loading it says so.
        beta_head = (await operator.load("beta", "main")).revision
        delta = envelope("acme", DocumentUpserted(document=document("d", "text")))
        await nc.publish(deployment.names.delta_subject("acme", "main"), delta.model_dump_json(by_alias=True).encode(),
                         reply=f"$KV.{bucket}.beta.main.head")  # fmt: skip
        await nc.flush()
    finally:
        with capture_logs() as logged:
            await nc.close()
    # Its own close, after requests the server refused: no error said of the server ending it (a tester's).
    assert "nats_connection_closed" not in {entry["event"] for entry in logged}
    heads = await deployment.js.key_value(deployment.names.manifest_bucket)
    async with asyncio.timeout(10):
        while (await heads.get("beta.main.head")).revision == beta_head:
            await asyncio.sleep(0.05)
    with pytest.raises(ManifestMissing, match="is not one an ingester wrote"):
        await operator.load("beta", "main")


async def test_an_ingest_before_any_projector_started_says_what_is_missing(deployment: Deployment) -> None:
    await deployment.js.delete_key_value(deployment.names.manifest_bucket)
    with pytest.raises(NotSetUp, match="start a projector"):
        await ManifestStore(deployment.js, deployment.names).load("acme", "main")


async def test_a_manifest_read_no_server_answers_for_a_moment_is_made_again(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault tester's ingest, started while `up` restarted its NATS server, was told the bucket did not exist
    (exit 2): JetStream had no responder for a moment. The read is made again; only a bucket still unanswered after
    a few seconds is missing (the test above)."""
    from nats.errors import NoRespondersError
    from nats.js.kv import KeyValue

    store = ManifestStore(deployment.js, deployment.names)
    await store.load("acme", "main")  # the bucket as a projector made it
    original, refused = ManifestStore._stored, [2]

    async def away(self: ManifestStore, key: str) -> KeyValue.Entry | None:
        if refused[0]:
            refused[0] -= 1
            raise NoRespondersError
        return await original(self, key)

    monkeypatch.setattr(ManifestStore, "_stored", away)
    loaded = await store.load("acme", "main")
    assert (refused[0], loaded.data) == (0, None)
