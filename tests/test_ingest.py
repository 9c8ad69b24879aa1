"""The reference ingester through the real path: incremental publishes, deletes, and the projected rows."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from nats.js.api import DiscardPolicy, PubAck
from nats.js.errors import ServiceUnavailableError
from structlog.testing import capture_logs

from ontofabric.contracts import MAIN_BRANCH, DeltaEnvelope, QueryResponse, StatusReply
from ontofabric.contracts.path_patterns import matches
from ontofabric.services.gateway.tools import _render_status
from ontofabric.services.ingest import ingester as ingester_module
from ontofabric.services.ingest.chunking import MAX_SYMBOL_CHARS, chunk_file, self_import_name
from ontofabric.services.ingest.client import DeltaPublisher, PublishFailed
from ontofabric.services.ingest.graph import python_calls
from ontofabric.services.ingest.ingester import (
    UNKNOWN,
    ExclusionRefused,
    Ingester,
    Manifest,
    exclusion_patterns,
    python_of,
    read_tree,
)
from ontofabric.services.ops.dead_letters import Selection, dead_letters
from ontofabric.services.projector.worker import ProjectorService
from ontofabric.services.query.client import QueryClient
from ontofabric.shared.embedder import Embedder, EmbedderMismatch, LoadedOnDemand, build_embedder, embedding_text
from ontofabric.shared.embedding_cache import EmbeddingCache
from ontofabric.shared.manifest_store import ManifestStore
from ontofabric.shared.onnx_models import OnnxEmbedder
from ontofabric.shared.progress import ProjectionWatch
from ontofabric.shared.settings import Settings

from .conftest import Deployment, RecordedProgress, Start


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


async def _live(deployment: Deployment) -> dict[str, tuple[str, str]]:
    rows = await deployment.fetch(
        "SELECT symbol_key, content_hash, chunk_level FROM documents WHERE workspace = 'repo' AND NOT deleted"
    )
    return {r["symbol_key"]: (r["content_hash"], r["chunk_level"]) for r in rows}


async def test_ingest_publishes_only_what_changed(
    deployment: Deployment,
    projector: ProjectorService,
    embedder: Embedder,
    tmp_path: Path,
    tiny_onnx_embedder: Path,
) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": '"""The package."""\n',
            "pkg/shapes.py": """
                class Circle:
                    def area(self, r):
                        return 3.14 * r * r
                """,
            "README.md": "# Shapes\nCompute areas.\n## Usage\nCall area.\n",
            ".hidden/skip.py": "x = 1\n",
            "table.csv": "not,a,source,file\n",
        },
    )
    ingester = Ingester(deployment.js, deployment.names, embedder, deployment.settings.max_content_bytes)

    first = await ingester.ingest(tmp_path, "repo")
    assert first.files == 3
    assert first.upserts == first.chunks == 7  # __init__ file+doc, shapes file+class+method, two sections
    assert first.deletes == 0
    assert first.last_sequence is not None
    await deployment.wait_projected(first.last_sequence)
    live = await _live(deployment)
    assert len(live) == 7
    assert live["python:pkg/shapes.py/Circle.area()."][1] == "method"
    embedded = await deployment.fetch("SELECT content, embedding, token_signs FROM documents")
    assert all(r["embedding"] is not None for r in embedded)
    # Each chunk's token signs, one row of 48 bytes per token the model read from its embedding text.
    assert all(r["token_signs"] and len(r["token_signs"]) % 48 == 0 for r in embedded)
    assert len({r["token_signs"] for r in embedded}) == 7
    # Each document carries its own chunk's vector, whatever order the chunks were embedded in (longest first).
    rows = await deployment.fetch(
        "SELECT content, symbol_fqn, embedding::real[] AS embedding FROM documents ORDER BY length(content) DESC"
    )
    own = embedder.embed_documents([embedding_text(r["content"], r["symbol_fqn"]) for r in rows])
    assert [float(np.dot(np.asarray(r["embedding"]), v)) for r, v in zip(rows, own, strict=True)] == pytest.approx(
        [1.0] * 7, abs=1e-5
    )

    unchanged = await ingester.ingest(tmp_path, "repo")
    assert (unchanged.upserts, unchanged.deletes, unchanged.unchanged) == (0, 0, 7)
    assert unchanged.last_sequence is None
    # The embedder's arithmetic alone (an ingester on a CPU with or without native bfloat16) sends nothing again.
    # Nor does it load the model, which an ingest loads when it first embeds.
    for precision in ("float32", "bfloat16"):
        other = build_embedder(Settings(embedding_precision=precision), for_queries=False, on_demand=True)
        assert isinstance(other, LoadedOnDemand)
        again = await Ingester(deployment.js, deployment.names, other, deployment.settings.max_content_bytes).ingest(
            tmp_path, "repo"
        )
        assert (again.upserts, again.unchanged, other.loaded) == (0, 7, False), precision

    # What the embedder adds changed (token vectors off): every document goes again, though no content changed.
    plain = Ingester(
        deployment.js, deployment.names, embedder, deployment.settings.max_content_bytes, token_vectors=False
    )
    resent = await plain.ingest(tmp_path, "repo")
    assert (resent.upserts, resent.unchanged) == (7, 0)
    assert resent.last_sequence is not None
    await deployment.wait_projected(resent.last_sequence)
    rows = await deployment.fetch("SELECT count(*) AS n FROM documents WHERE token_signs IS NULL AND NOT deleted")
    assert rows[0]["n"] == 7
    assert (await ingester.ingest(tmp_path, "repo")).upserts == 7  # and back

    # A second model switched on sends every document again, now with its vector.
    second = OnnxEmbedder(tiny_onnx_embedder, "tiny-second")
    with_second = Ingester(
        deployment.js, deployment.names, embedder, deployment.settings.max_content_bytes, second=second
    )
    seconded = await with_second.ingest(tmp_path, "repo")
    assert (seconded.upserts, seconded.unchanged) == (7, 0)
    assert seconded.last_sequence is not None
    await deployment.wait_projected(seconded.last_sequence)
    stored = await deployment.fetch("SELECT second_vector, second_model FROM documents WHERE NOT deleted")
    assert {r["second_model"] for r in stored} == {"tiny-second"}
    assert {len(r["second_vector"]) for r in stored} == {2 * 32}  # float16, the tiny model's 32 dimensions
    assert (await ingester.ingest(tmp_path, "repo")).upserts == 7  # and back

    # Edit one method, remove the package docstring file, add nothing else.
    (tmp_path / "pkg/shapes.py").write_text("class Circle:\n    def area(self, r):\n        return 3.14159 * r * r\n")
    (tmp_path / "pkg/__init__.py").unlink()
    changed = await ingester.ingest(tmp_path, "repo")
    # The file, the class and the method chunks of shapes.py changed; the package's two chunks vanished.
    assert (changed.upserts, changed.deletes) == (3, 2)
    assert changed.last_sequence is not None
    await deployment.wait_projected(changed.last_sequence)
    live = await _live(deployment)
    expected = {
        c.symbol_key: (c.content_hash, c.chunk_level)
        for name in ("pkg/shapes.py", "README.md")
        for c in chunk_file(name, (tmp_path / name).read_text(), deployment.settings.max_content_bytes)
    }
    assert live == expected

    # A chunk carries the symbols its code calls; another file's change can move them without touching its text,
    # and then it goes again too.
    calls = "SELECT metadata -> 'calls' AS calls FROM documents WHERE symbol_fqn = 'pkg.use.make' AND NOT deleted"
    (tmp_path / "pkg/use.py").write_text("from .shapes import Circle\n\n\ndef make():\n    return Circle()\n")
    added = await ingester.ingest(tmp_path, "repo")
    assert (added.upserts, added.deletes) == (2, 0)  # the file and its function
    assert added.last_sequence is not None
    await deployment.wait_projected(added.last_sequence)
    assert [r["calls"] for r in await deployment.fetch(calls)] == ['["pkg.shapes.Circle"]']
    assert (await ingester.ingest(tmp_path, "repo")).upserts == 0  # the calls read the same: nothing goes again
    (tmp_path / "pkg/shapes.py").write_text("class Disc:\n    def area(self, r):\n        return 3.14159 * r * r\n")
    renamed = await ingester.ingest(tmp_path, "repo")
    # shapes.py's file, class and method. Not make: it still calls pkg.shapes.Circle, a name shapes.py no longer
    # binds (what a branch renaming Circle asks the callers of: note 90's).
    assert (renamed.upserts, renamed.deletes) == (3, 2)
    assert renamed.last_sequence is not None
    await deployment.wait_projected(renamed.last_sequence)
    assert [r["calls"] for r in await deployment.fetch(calls)] == ['["pkg.shapes.Circle"]']
    # Moved where make's import still finds it (shapes.py imports it in turn): its call moves with it.
    (tmp_path / "pkg/round.py").write_text("class Circle:\n    pass\n")
    (tmp_path / "pkg/shapes.py").write_text("from .round import Circle\n")
    moved = await ingester.ingest(tmp_path, "repo")
    assert moved.last_sequence is not None
    await deployment.wait_projected(moved.last_sequence)
    assert [r["calls"] for r in await deployment.fetch(calls)] == ['["pkg.round.Circle"]']


async def test_an_ingest_whose_publish_failed_part_way_records_what_was_stored_and_the_next_sends_the_rest(
    deployment: Deployment, projector: ProjectorService, embedder: Embedder, tmp_path: Path
) -> None:
    """An operator's delta stream, capped below one ingest, refused its end: every key stayed unknown, so each run
    again (after a compaction, as the error advises) sent everything under new event ids and never got further."""
    _write(tmp_path, {f"pkg/m{i:02}.py": f"def f{i:02}(x):\n    return x + {i}\n" for i in range(12)})
    names, js = deployment.names, deployment.js
    config = (await js.stream_info(names.delta_stream)).config
    held = (await js.stream_info(names.delta_stream)).state.bytes
    await js.update_stream(dataclasses.replace(config, max_bytes=held + 60_000, discard=DiscardPolicy.NEW))
    ingester = Ingester(js, names, embedder, deployment.settings.max_content_bytes)
    with pytest.raises(PublishFailed) as failed:
        await ingester.ingest(tmp_path, "repo")
    stored = failed.value.keys_by_sequence
    chunks = 24  # each module's file chunk and its function's
    assert 0 < len(stored) < chunks
    manifest = await ingester.load_manifest("repo", MAIN_BRANCH)
    assert all(manifest.entries[key] != UNKNOWN for key in stored.values())
    assert sum(value == UNKNOWN for value in manifest.entries.values()) == len(manifest.entries) - len(stored)
    assert manifest.published_through == max(stored)
    documents_stored = sum(key.startswith("d:") for key in stored.values())  # the others, graph nodes and links

    await js.update_stream(config)  # room made
    rest = await ingester.ingest(tmp_path, "repo")
    assert rest.upserts == chunks - documents_stored
    assert rest.last_sequence is not None
    await deployment.wait_projected(rest.last_sequence)
    assert len(await _live(deployment)) == chunks


async def test_a_branch_publishes_only_what_differs_from_main(
    deployment: Deployment, projector: ProjectorService, tmp_path: Path
) -> None:
    _write(tmp_path, {"a.py": "def f():\n    return 1\n", "b.py": "def g():\n    return 2\n"})
    ingester = Ingester(deployment.js, deployment.names, None, deployment.settings.max_content_bytes)
    main = await ingester.ingest(tmp_path, "repo")
    same = await ingester.ingest(tmp_path, "repo", "feature/x")
    assert main.upserts == 4
    assert (same.upserts, same.deletes, same.reverts, same.last_sequence) == (0, 0, 0, None)

    (tmp_path / "a.py").write_text("def f():\n    return 10\n")
    (tmp_path / "b.py").unlink()
    changed = await ingester.ingest(tmp_path, "repo", "feature/x")
    assert (changed.upserts, changed.deletes, changed.reverts) == (2, 2, 0)  # a's file and function; b's two
    assert changed.last_sequence is not None
    await deployment.wait_projected(changed.last_sequence)
    rows = await deployment.fetch(
        "SELECT symbol_key, deleted FROM documents WHERE branch = 'feature/x' ORDER BY deleted, symbol_key"
    )
    assert [(r["symbol_key"], r["deleted"]) for r in rows] == [
        ("python:a.py", False), ("python:a.py/f().", False), (None, True), (None, True),
    ]  # fmt: skip
    main_rows = await deployment.fetch("SELECT count(*) AS n FROM documents WHERE branch = 'main' AND NOT deleted")
    assert main_rows[0]["n"] == 4  # main is untouched by the branch


async def test_a_deleted_branch_reads_as_main_and_its_next_ingest_starts_afresh(
    deployment: Deployment, projector: ProjectorService, start_query_worker: Start, tmp_path: Path
) -> None:
    """A branch merged or given up could not be taken away: its documents, tombstones and graph stayed for good,
    and every query on it read them."""
    main_tree, branch_tree = tmp_path / "main", tmp_path / "branch"
    files = {"__init__.py": "", "a.py": "def f():\n    return 1\n", "b.py": "class Shape:\n    pass\n"}
    _write(main_tree, files)
    _write(branch_tree, {**files, "a.py": "class Base:\n    pass\n\n\ndef f():\n    return Base()\n"})
    (branch_tree / "b.py").unlink()
    circle = "from .a import Base\n\n\nclass Circle(Base):\n    def unicorn_area(self):\n        return 2\n"
    _write(branch_tree, {"c.py": circle})
    ingester = Ingester(deployment.js, deployment.names, None, deployment.settings.max_content_bytes)
    await ingester.ingest(main_tree, "repo")
    first = await ingester.ingest(branch_tree, "repo", "feature/x")
    assert first.last_sequence is not None
    await deployment.wait_projected(first.last_sequence)
    own = "SELECT count(*) AS n FROM {} WHERE workspace = 'repo' AND branch = 'feature/x' AND NOT transparent"
    tables = ("documents", "ontology_nodes", "ontology_links")

    async def held() -> list[int]:
        return [(await deployment.fetch(own.format(table)))[0]["n"] for table in tables]

    assert all(await held())  # the branch's documents and tombstones, nodes and links
    await start_query_worker(None)
    client = QueryClient(deployment.nc, deployment.names)

    async def ids(branch: str) -> list[str]:
        reply = await client.query("repo", {"semanticQuery": "unicorn_area Shape f", "branch": branch})
        assert isinstance(reply, QueryResponse), reply
        return [result.id for result in reply.results]

    assert await ids("feature/x") != await ids("main")
    _write(tmp_path / "later", {**files, "a.py": "def f():\n    return 3\n"})
    later = await ingester.ingest(tmp_path / "later", "repo", "later")  # named after, changed after feature/x
    assert later.last_sequence is not None
    await deployment.wait_projected(later.last_sequence)

    async def other_branches() -> list[str]:
        status = await client.status("repo", {})
        assert isinstance(status, StatusReply), status
        return status.other_branches

    assert await other_branches() == ["later", "feature/x"]  # the latest changed first
    on_branch = await client.status("repo", {"branch": "feature/x"})
    assert isinstance(on_branch, StatusReply), on_branch
    assert [(b.branch, b.hidden) for b in on_branch.branches] == [("main", 0), ("feature/x", first.deletes)]
    assert f"(and hides {first.deletes} documents of main's)" in _render_status(on_branch)

    _tree, env = _one_file_tree_as_ingester(deployment, tmp_path)
    command = [str(Path(sys.executable).parent / "ontofabric"), "delete-branch", "--workspace", "repo"]

    def delete_branch(branch: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*command, "--branch", branch, "--yes"], env=env, capture_output=True, text=True, timeout=120, check=False
        )

    deleted = await asyncio.to_thread(delete_branch, "feature/x")
    assert deleted.returncode == 0, deleted.stderr
    assert f"{first.upserts + first.deletes} documents and" in deleted.stdout
    assert "it reads as main" in " ".join(deleted.stdout.split())
    assert await held() == [0, 0, 0]
    postings = "SELECT count(*) AS n FROM postings WHERE workspace = 'repo' AND branch = 'feature/x'"
    assert (await deployment.fetch(postings))[0]["n"] == 0
    assert await ids("feature/x") == await ids("main")
    emptied = await ingester.load_manifest("repo", "feature/x")
    assert (emptied.entries, emptied.exclude, emptied.package) == ({}, None, None)  # a next ingest starts afresh
    assert await other_branches() == ["later"]  # nothing of its own: not named to ask about
    # A revert a projector set aside is forgotten into the emptied manifest, so that the next run sends it again.
    await ingester.forget("repo", "feature/x", ["d:gone-astray"], held_or_not=True)
    assert (await ingester.load_manifest("repo", "feature/x")).entries == {"d:gone-astray": UNKNOWN}
    resent = await ingester.revert_branch("repo", "feature/x")
    assert (resent.reverts, len(resent.published)) == (1, 1)
    assert (await ingester.load_manifest("repo", "feature/x")).entries == {}

    again = await asyncio.to_thread(delete_branch, "feature/x")  # nothing left: said, and no delta sent
    assert again.returncode == 0, again.stderr
    assert "repo/feature/x was taken back already: nothing left to send; it reads as main" in again.stdout
    misspelt = await asyncio.to_thread(delete_branch, "feature/y")
    assert misspelt.returncode == 0, misspelt.stderr
    assert "no ingest of repo/feature/y is recorded (check the names)" in " ".join(misspelt.stderr.split())
    on_main = await asyncio.to_thread(delete_branch, "main")
    assert on_main.returncode == 2
    assert "only a branch can be deleted" in on_main.stderr
    # Ingested again, the branch sends everything it differs from main by, as its first ingest did.
    second = await ingester.ingest(branch_tree, "repo", "feature/x")
    assert (second.upserts, second.deletes, second.graph_changes) == (first.upserts, first.deletes, first.graph_changes)
    assert second.last_sequence is not None
    await deployment.wait_projected(second.last_sequence)
    assert all(await held())


async def test_delete_branch_run_again_after_its_wait_timed_out_waits_for_its_reverts(
    deployment: Deployment, tmp_path: Path
) -> None:
    """A tester's: run again after its wait timed out (no projector running), delete-branch said "nothing to take
    back" at once and exited 0, over reverts not applied; a CI job retrying it reported success."""
    _write(tmp_path / "main", {"a.py": "def f():\n    return 1\n"})
    _write(tmp_path / "branch", {"a.py": "def f():\n    return 2\n"})
    ingester = Ingester(deployment.js, deployment.names, None, deployment.settings.max_content_bytes)
    projector = ProjectorService(deployment.settings, deployment.nats_url_as("projector"), deployment.database_url)
    await projector.start()
    await ingester.ingest(tmp_path / "main", "repo")
    branch = await ingester.ingest(tmp_path / "branch", "repo", "fix")
    assert branch.last_sequence is not None
    await deployment.wait_projected(branch.last_sequence)
    await projector.stop()
    _tree, env = _one_file_tree_as_ingester(deployment, tmp_path)
    command = [str(Path(sys.executable).parent / "ontofabric"), "delete-branch", "--workspace", "repo"]

    def delete_branch() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*command, "--branch", "fix", "--yes", "--wait-timeout", "1"],
            env=env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip

    for _ in range(2):  # the first sends its reverts, the second finds none to send: both wait for them
        timed_out = await asyncio.to_thread(delete_branch)
        assert timed_out.returncode == 1, timed_out.stdout
        assert "not projected within 1 s" in " ".join(timed_out.stderr.split())
    projector = ProjectorService(deployment.settings, deployment.nats_url_as("projector"), deployment.database_url)
    await projector.start()
    try:
        done = await asyncio.to_thread(delete_branch)
    finally:
        await projector.stop()
    assert done.returncode == 0, done.stderr
    assert "repo/fix was taken back already: nothing left to send; it reads as main" in done.stdout
    own = "SELECT count(*) AS n FROM documents WHERE workspace = 'repo' AND branch = 'fix' AND NOT transparent"
    assert (await deployment.fetch(own))[0]["n"] == 0


async def test_after_two_ingests_of_one_branch_raced_the_next_one_leaves_exactly_its_tree(
    deployment: Deployment, projector: ProjectorService, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    _write(ours, {"a.py": "def a():\n    return 1\n", "common.py": "def c():\n    return 1\n"})
    _write(theirs, {"b.py": "def b():\n    return 2\n", "common.py": "def c():\n    return 2\n"})
    ingester = Ingester(deployment.js, deployment.names, None, deployment.settings.max_content_bytes)
    # Both plan from the same (empty) manifest and publish interleaved; only one manifest save can land first. Each
    # waits for the other's load: on a busy machine one ingest had finished before the other loaded (the full
    # suite, 2026-12-03), and there was no race to test.
    real_load, both_loaded, loads = ingester._manifests.load, asyncio.Barrier(2), 0

    async def planned_together(workspace: str, branch: str) -> Any:
        nonlocal loads
        loads += 1
        loaded = await real_load(workspace, branch)
        if loads <= 2:
            await both_loaded.wait()
        return loaded

    monkeypatch.setattr(ingester._manifests, "load", planned_together)
    reports = await asyncio.gather(ingester.ingest(ours, "repo"), ingester.ingest(theirs, "repo"))
    # Every chunk of either tree may be in the index in either version: none is known any more.
    raced = (await ingester.load_manifest("repo", "main")).entries
    assert sorted(value for key, value in raced.items() if key.startswith("d:")) == [UNKNOWN] * 6
    # Said by the one that saved second (a tester's: both said their counts, and the CLI exited 0 for both).
    assert any(report.raced for report in reports)
    again = await ingester.ingest(ours, "repo")
    assert not again.raced
    assert (again.upserts, again.deletes) == (4, 2)  # ours sent again; b.py and its function removed
    assert again.last_sequence is not None
    await deployment.wait_projected(again.last_sequence)
    expected = {
        c.symbol_key: (c.content_hash, c.chunk_level)
        for name in ("a.py", "common.py")
        for c in chunk_file(name, (ours / name).read_text(), deployment.settings.max_content_bytes)
    }
    assert await _live(deployment) == expected


async def test_an_ingest_whose_vectors_all_come_from_the_cache_still_checks_their_dimension(
    deployment: Deployment, embedder: Embedder, tmp_path: Path
) -> None:
    """A reviewer's: with the model loaded on demand, a wrong ONTOFABRIC_EMBEDDING_DIM was no longer found at start,
    and cached vectors of another dimension were sent, for the projector to dead-letter."""
    _write(tmp_path / "tree", {"a.py": "def a():\n    return 1\n"})
    cache = EmbeddingCache(tmp_path / "embeddings.sqlite")
    filled = Ingester(deployment.js, deployment.names, embedder, deployment.settings.max_content_bytes, cache=cache)
    await filled.ingest(tmp_path / "tree", "repo")
    wrong = LoadedOnDemand(Settings(embedding_dim=768))
    ingester = Ingester(deployment.js, deployment.names, wrong, deployment.settings.max_content_bytes, cache=cache)
    with pytest.raises(EmbedderMismatch, match="have 384 dimensions; the deployment is set to 768"):
        await ingester.ingest(tmp_path / "tree", "other")
    assert not wrong.loaded
    assert (await ingester.load_manifest("other", "main")).entries == {}  # nothing sent, nothing recorded
    cache.close()


async def test_a_branch_checked_out_in_a_directory_of_another_name_names_its_modules_as_main_does(
    deployment: Deployment, projector: ProjectorService, tmp_path: Path
) -> None:
    """An outside tester's: a branch ingested from a git worktree named `tenacity2` renamed every module, sent
    every chunk again and held every file whole, without a word."""
    files = {"__init__.py": "from .core import run\n", "core.py": "def run():\n    return 1\n"}
    _write(tmp_path / "pkg", files)
    _write(tmp_path / "pkg-feature", {**files, "core.py": "def run():\n    return 2\n"})
    ingester = Ingester(deployment.js, deployment.names, None, deployment.settings.max_content_bytes)
    early = await ingester.ingest(tmp_path / "pkg", "repo", "early")  # a tester's: said nothing
    assert (early.main_never_ingested, early.upserts) == (True, 3)
    await ingester.ingest(tmp_path / "pkg", "repo")
    assert (await ingester.load_manifest("repo", "main")).package == "pkg"
    # Ingested again once main is, the branch follows main: its chunks reverted, none of them unchanged.
    again = await ingester.ingest(tmp_path / "pkg", "repo", "early")
    assert (again.main_never_ingested, again.reverts, again.unchanged) == (False, 3, 0)
    report = await ingester.ingest(tmp_path / "pkg-feature", "repo", "feat")
    assert (report.package_of_main, report.upserts, report.unchanged) == ("pkg", 2, 1)  # core.py's file and run
    assert report.last_sequence is not None
    await deployment.wait_projected(report.last_sequence)
    rows = await deployment.fetch("SELECT symbol_fqn FROM documents WHERE branch = 'feat' ORDER BY symbol_fqn")
    assert [r["symbol_fqn"] for r in rows] == ["pkg.core", "pkg.core.run"]
    # Named on purpose, it is as named.
    named = await ingester.ingest(tmp_path / "pkg-feature", "repo", "other", package="feature")
    assert (named.package_of_main, named.unchanged) == (None, 0)


async def test_a_package_checked_out_under_another_name_is_named_as_its_own_files_import_it(
    deployment: Deployment, projector: ProjectorService, tmp_path: Path
) -> None:
    """An outside tester's: a copy of a package in a directory of another name (`src`) named its modules after the
    directory, so its files' absolute imports (`pkg.sub.core`) resolved to nothing, and "what calls validate"
    found one caller of three without a word."""
    callers = {
        f"{name}.py": f"from pkg.sub.core import validate\n\n\ndef {name}():\n    return validate()\n" for name in "abc"
    }
    files = {"__init__.py": "", "sub/__init__.py": "", "sub/core.py": "def validate():\n    return 1\n", **callers}
    _write(tmp_path / "src", files)
    sources = read_tree(tmp_path / "src")
    assert self_import_name(sources, "src") == "pkg"
    assert self_import_name(sources, "pkg") is None  # checked out under its own name
    python = python_of(sources, "pkg", 0)
    assert sorted(key[1] for key, names in python_calls(python).items() if "pkg.sub.core.validate" in names) == [
        "pkg.a.a", "pkg.b.b", "pkg.c.c",
    ]  # fmt: skip
    ingester = Ingester(deployment.js, deployment.names, None, deployment.settings.max_content_bytes)
    report = await ingester.ingest(tmp_path / "src", "repo")
    assert report.package_from_imports == "pkg"
    assert (await ingester.load_manifest("repo", "main")).package == "pkg"
    assert report.last_sequence is not None
    await deployment.wait_projected(report.last_sequence)
    rows = await deployment.fetch("SELECT symbol_fqn FROM documents WHERE symbol_fqn LIKE '%validate' ORDER BY 1")
    assert [r["symbol_fqn"] for r in rows] == ["pkg.sub.core.validate"]
    # Named on purpose, it is as named; and a tree whose files import it under two names as often is left alone.
    named = await ingester.ingest(tmp_path / "src", "other", package="src")
    assert named.package_from_imports is None
    assert (named.package, named.package_before) == ("src", None)  # a first ingest renames nothing
    # Named otherwise than by the last ingest (an upgrade, or --package given or dropped), it is said: every module
    # goes again, and the branches ingested before keep the old names (an upgrade tester's).
    renamed = await ingester.ingest(tmp_path / "src", "other")
    assert (renamed.package, renamed.package_before, renamed.unchanged) == ("pkg", "src", 0)
    again = await ingester.ingest(tmp_path / "src", "other")
    assert (again.package_before, again.upserts) == (None, 0)
    two = {**sources, **{f"{n}.py": "from other.sub.core import validate\n" for n in "def"}}
    assert self_import_name(two, "src") is None
    # Names the tree's module does not bind are another package's (a review's: a Django app importing from
    # django.urls beside its own urls.py was named django).
    django = {"urls.py": "urlpatterns = []\n", **{f"{n}.py": "from django.urls import path\n" for n in "abc"}}
    assert self_import_name({"__init__.py": "", **django}, "polls") is None


def test_the_cycle_collector_is_paused_while_a_tree_is_read_and_left_as_it_was_after() -> None:
    """Sympy's 1,534 files were parsed in 49 s with the collector running, 13 s without (docs/benchmarks.md)."""
    import gc

    from ontofabric.services.ingest.ingester import collector_paused, read_sources

    seen: list[bool] = []
    sources = {"a.py": "def f():\n    return g()\n\n\ndef g():\n    return 1\n"}
    with pytest.MonkeyPatch.context() as patch:
        real = ingester_module.python_of
        patch.setattr(ingester_module, "python_of", lambda *a: seen.append(gc.isenabled()) or real(*a))
        chunks, _, _ = read_sources(Path("tree"), sources, None, 65536, 1 << 20)
    assert (seen, gc.isenabled(), len(chunks)) == ([False], True, 3)
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("a failed reading")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # paused by someone else: left so
    finally:
        gc.enable()


async def test_an_ingest_cancelled_while_it_reads_the_tree_stops_reading_it(
    deployment: Deployment, tmp_path: Path
) -> None:
    """A tester's Ctrl-C while a tree of 2,300 files was read waited for the whole reading (30 s), with no progress
    shown: it is the stage "read", and cancelled, it stops at the next file."""
    body = "".join(f"def f{n}(x):\n    return g{n}(x) + 1\n\n\ndef g{n}(x):\n    return x\n\n\n" for n in range(40))
    _write(tmp_path / "big", {f"pkg/m{n}.py": body for n in range(600)} | {"pkg/__init__.py": ""})
    progress = RecordedProgress()
    ingester = Ingester(deployment.js, deployment.names, None, deployment.settings.max_content_bytes, progress)
    ingest = asyncio.create_task(ingester.ingest(tmp_path / "big", "big"))
    async with asyncio.timeout(60):
        while progress.done["read"] < 5:
            await asyncio.sleep(0.01)
    ingest.cancel()
    with pytest.raises(asyncio.CancelledError):
        await ingest
    stopped_at = progress.done["read"]
    await asyncio.sleep(1.0)
    assert progress.done["read"] <= stopped_at + 1 < progress.totals["read"]  # at most the file it was on
    assert progress.totals["read"] == 601 + 3 * 601
    whole = RecordedProgress()
    await Ingester(deployment.js, deployment.names, None, 65536, whole)._read(
        tmp_path / "big", {"pkg/a.py": "x = 1\n", "pkg/b.md": "# B\n"}, None
    )
    assert whole.done["read"] == whole.totals["read"] == 5


async def test_what_gitignore_leaves_out_is_not_published_and_what_was_is_deleted(
    deployment: Deployment, projector: ProjectorService, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tester's ignored `local_settings.py` and `secrets/` were served to every reader of the workspace. The
    files of kinds not read are counted, but for those left out (a monorepo tester's 34 of 50 files went unsaid)."""
    from ontofabric.services.cli import _note_exclusions

    files = {"app.py": "def run():\n    return 1\n", "local_settings.py": "TOKEN = 'ab12'\n", "secrets/p.txt": "pw\n"}
    others = {"web/a.kt": "", "web/b.kt": "", "Dockerfile": "", "dist/x.kt": "", "secrets/k.pem": "", "v/c.kt": ""}
    others["NOTES.MD"] = ""  # not read: a review's was counted as .md, which the note says is read
    _write(tmp_path / "tree", {**files, **others})
    (tmp_path / "tree" / ".git").mkdir()  # a work tree: outside one no .gitignore applies, as for git
    ingester = Ingester(deployment.js, deployment.names, None, deployment.settings.max_content_bytes)
    everything = await ingester.ingest(tmp_path / "tree", "repo", gitignore=False)  # as before .gitignore was read
    assert everything.ignored == ()
    (tmp_path / "tree" / ".gitignore").write_text("local_settings.py\nsecrets/\ndist/\n")
    report = await ingester.ingest(tmp_path / "tree", "repo", exclude=["v"])
    assert report.ignored == ("secrets/", "local_settings.py")
    assert report.other_kinds == ((".kt", 2), (".MD", 1), ("Dockerfile", 1))
    _note_exclusions(report, "repo", "main")
    assert "4 files of kinds this ingester does not read are not indexed (.kt 2, .MD 1, Dockerfile 1); it reads " in (
        " ".join(capsys.readouterr().err.split())
    )
    assert report.deletes == 2  # what the first ingest published of them
    assert report.last_sequence is not None
    await deployment.wait_projected(report.last_sequence)
    rows = await deployment.fetch("SELECT DISTINCT file_path FROM documents WHERE NOT deleted ORDER BY 1")
    assert [r["file_path"] for r in rows] == ["app.py"]


async def test_two_racing_ingests_of_a_branch_one_deleting_a_file_the_other_changing_it_reuse_no_event_id(
    deployment: Deployment, projector: ProjectorService, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reviewer's: both tombstoned main's section under one event id, one naming the file it deleted and one
    not, and the second was set aside as an event id reused."""
    main, ours, theirs = tmp_path / "main", tmp_path / "ours", tmp_path / "theirs"
    for tree in (main, ours, theirs):
        _write(tree, {"g.md": "# G\n\ng steps\n"})
    _write(main, {"f.md": "# F\n\nf steps\n"})
    _write(theirs, {"f.md": "# F2\n\nf steps\n"})  # the same file, its one section renamed
    ingester = Ingester(deployment.js, deployment.names, None, deployment.settings.max_content_bytes)
    first = await ingester.ingest(main, "repo")
    assert first.last_sequence is not None
    await deployment.wait_projected(first.last_sequence)
    real_load, both_loaded, loads = ingester._manifests.load, asyncio.Barrier(2), 0

    async def planned_together(workspace: str, branch: str) -> Any:
        nonlocal loads
        loaded = await real_load(workspace, branch)
        if branch == "feat" and (loads := loads + 1) <= 2:
            await both_loaded.wait()
        return loaded

    monkeypatch.setattr(ingester._manifests, "load", planned_together)
    raced = await asyncio.gather(ingester.ingest(ours, "repo", "feat"), ingester.ingest(theirs, "repo", "feat"))
    await deployment.wait_projected(max(r.last_sequence or 0 for r in raced))
    assert [letter.reason for letter in await dead_letters(deployment.nc, deployment.names, Selection())] == []
    again = await ingester.ingest(ours, "repo", "feat")
    assert again.last_sequence is not None
    await deployment.wait_projected(again.last_sequence)
    rows = await deployment.fetch("SELECT deleted, file_path FROM documents WHERE branch = 'feat' AND NOT transparent")
    assert [(r["deleted"], r["file_path"]) for r in rows] == [(True, "f.md")]  # ours: f.md deleted, named


async def test_a_tree_that_goes_back_to_an_earlier_state_is_indexed_as_it_is_each_time(
    deployment: Deployment, projector: ProjectorService, embedder: Embedder, tmp_path: Path
) -> None:
    """A revert, then the change again (or a file deleted, restored, deleted): each ingest's deltas are new events.
    With ids from the manifest's contents alone, going back repeated earlier ids, which were dropped as repeats."""
    ingester = Ingester(deployment.js, deployment.names, embedder, deployment.settings.max_content_bytes)
    states = {"apples": 'def fruit():\n    return "apples"\n', "bananas": 'def fruit():\n    return "bananas"\n'}
    indexed: dict[str, dict[str, tuple[str, str]]] = {}
    for state in ["apples", "bananas", "apples", "bananas", "gone", "apples", "gone"]:
        (tmp_path / "tog.py").unlink(missing_ok=True)
        if state != "gone":
            _write(tmp_path, {"tog.py": states[state]})
        report = await ingester.ingest(tmp_path, "repo", allow_empty=state == "gone")  # emptied on purpose
        assert report.last_sequence is not None
        await deployment.wait_projected(report.last_sequence)
        live = await _live(deployment)
        assert live == indexed.setdefault(state, live), state  # as the first time the tree was so
    assert indexed["gone"] == {}
    assert indexed["apples"] != indexed["bananas"]


async def test_chunks_an_edit_above_moves_go_again_with_their_new_lines_and_their_cached_vectors(
    deployment: Deployment,
    projector: ProjectorService,
    embedder: Embedder,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An agent tester's: results carried no lines, and its agent grepped for the symbol to open it."""
    tree = tmp_path / "tree"
    _write(tree, {"m.py": "def first():\n    return 1\n\n\ndef second():\n    return 2\n"})
    _write(tree, {"notes.md": "# Notes\nsome\n\n## More\nmore\n"})
    cache = EmbeddingCache(tmp_path / "embeddings.sqlite")
    ingester = Ingester(deployment.js, deployment.names, embedder, deployment.settings.max_content_bytes, cache=cache)
    stored = (
        "SELECT symbol_fqn, (metadata ->> 'startLine')::int AS start, (metadata ->> 'endLine')::int AS end,"
        " embedding FROM documents WHERE workspace = 'repo' AND NOT deleted"
    )

    async def lines_after(report: Any) -> dict[str, tuple[int, int]]:
        assert report.last_sequence is not None
        await deployment.wait_projected(report.last_sequence)
        return {r["symbol_fqn"]: (r["start"], r["end"]) for r in await deployment.fetch(stored)}

    assert await lines_after(await ingester.ingest(tree, "repo")) == {
        "m": (1, 6), "m.first": (1, 2), "m.second": (5, 6), "notes.md > Notes": (1, 3),
        "notes.md > Notes > More": (4, 5),
    }  # fmt: skip
    vectors = {r["symbol_fqn"]: r["embedding"] for r in await deployment.fetch(stored)}
    # A comment between the two functions: the file's text changed, second's lines alone; first stays as it was.
    (tree / "m.py").write_text("def first():\n    return 1\n\n# between\n\ndef second():\n    return 2\n")
    embedded: list[str] = []
    model_pass = embedder.embed_with_tokens
    monkeypatch.setattr(
        embedder, "embed_with_tokens", lambda texts, **kw: (embedded.extend(texts), model_pass(texts, **kw))[1]
    )
    moved = await ingester.ingest(tree, "repo")
    assert (moved.upserts, moved.unchanged) == (2, 3)
    assert embedded == [embedding_text((tree / "m.py").read_text(), "m")]  # second's vectors came from the cache
    assert (await lines_after(moved))["m.second"] == (6, 7)
    assert {r["symbol_fqn"]: r["embedding"] for r in await deployment.fetch(stored)}["m.second"] == vectors["m.second"]
    assert (await ingester.ingest(tree, "repo")).upserts == 0


async def test_a_chunk_with_no_text_goes_without_vectors(
    deployment: Deployment, projector: ProjectorService, embedder: Embedder, tmp_path: Path
) -> None:
    """An agent tester's: pytest's empty `_pytest/_py/__init__.py` had a vector of its name alone, the first dense
    result for "Pytester". It has none now; its chunk stays, for its name and its relations."""
    tree = tmp_path / "tree"
    _write(tree, {"__init__.py": "", "tools.py": "def helper():\n    return 1\n"})
    report = await Ingester(deployment.js, deployment.names, embedder, deployment.settings.max_content_bytes).ingest(
        tree, "repo"
    )
    assert report.last_sequence is not None
    await deployment.wait_projected(report.last_sequence)
    rows = await deployment.fetch(
        "SELECT symbol_fqn, embedding IS NOT NULL AS embedded FROM documents WHERE workspace = 'repo' AND NOT deleted"
    )
    assert {r["symbol_fqn"]: r["embedded"] for r in rows} == {
        "tree": False,
        "tree.tools": True,
        "tree.tools.helper": True,
    }
    # An index made before: the manifest says so, and the next ingest sends the empty file again (a review's).
    from ontofabric.services.ingest.ingester import _derived_state, chunk_tree

    (empty,) = [c for c in chunk_tree(tree, 1 << 20) if c.symbol_fqn == "tree"]
    assert _derived_state(empty).endswith("|no-vectors")


async def test_a_python_file_that_does_not_parse_is_indexed_whole_and_named_in_the_report(
    deployment: Deployment, embedder: Embedder, tmp_path: Path
) -> None:
    """An agent tester's: a file broken mid-edit lost every symbol's chunk, and the ingest said nothing."""
    _write(tmp_path, {"good.py": "def fine():\n    return 1\n", "broken.py": "def get(:\n    return 2\n"})
    ingester = Ingester(deployment.js, deployment.names, embedder, deployment.settings.max_content_bytes)
    report = await ingester.ingest(tmp_path, "repo")
    assert report.unparsed == ("broken.py (line 1: invalid syntax)",)
    assert report.chunks == 3  # good.py's file and function; broken.py's file only


class _Recorded:
    def __init__(self) -> None:
        self.stages: dict[str, int] = {}
        self.done: dict[str, int] = {}

    def stage(self, name: str, total: int) -> None:
        self.stages[name], self.done[name] = total, 0

    def advance(self, name: str, amount: int = 1) -> None:
        self.done[name] += amount


def test_a_wait_on_the_projector_shows_progress_and_says_once_when_the_index_stops_moving() -> None:
    progress, said, now = _Recorded(), [], [0.0]
    watch = ProjectionWatch(progress, 110, lambda *stall: said.append(stall), stalled_after_s=30, clock=lambda: now[0])
    for at, floor in ((0, 100), (5, 104), (20, 104), (34, 104)):
        now[0] = at
        watch(floor)
    assert progress.stages == {"projected": 10}
    assert progress.done == {"projected": 4}
    assert said == []  # still for 29 s
    now[0] = 35
    watch(104)
    now[0] = 90
    watch(104)
    assert said == [(104, 110, 30.0)]  # once for one stall
    for at, floor in ((91, 108), (200, 108), (201, 120)):
        now[0] = at
        watch(floor)
    assert said == [(104, 110, 30.0), (108, 110, 109.0)]  # moved, then stalled again: said again
    assert progress.done == {"projected": 10}  # never past the target
    assert watch.floor == 120


def test_a_wait_counts_from_the_first_delta_the_command_published() -> None:
    """A fault tester's: 3,029 deltas published read "projected: 0/3028" (sized from the first position seen, one
    already applied), and 760 stored, all applied by then, "0/0"."""
    for floor, done in ((1000, 0), (1001, 1), (4029, 3029), (5000, 3029)):
        progress = _Recorded()
        ProjectionWatch(progress, 4029, lambda *stall: None, first=1001)(floor)
        assert (progress.stages, progress.done) == ({"projected": 3029}, {"projected": done})


def test_progress_where_no_terminal_shows_bars_is_written_as_it_goes() -> None:
    """An independent tester's finding: under a pipe (nohup, CI, systemd) rich drew the bars only when the command
    ended, so an ingest of a cold cache was silent for three minutes."""
    import io

    from rich.console import Console

    from ontofabric.services.render import PLAIN_PROGRESS_EVERY_S, RichProgress

    out, now = io.StringIO(), [0.0]
    with RichProgress(Console(file=out, force_terminal=False), clock=lambda: now[0]) as progress:
        assert not progress.begun("embed")
        progress.stage("embed", 100)
        assert out.getvalue() == "embed: 0/100\n"  # said at once, not at the end
        assert progress.begun("embed")
        assert not progress.begun("publish")  # what an interrupted ingest's last words depend on
        progress.advance("embed", 10)
        now[0] = PLAIN_PROGRESS_EVERY_S
        progress.advance("embed", 30)
        assert out.getvalue().splitlines()[-1] == f"embed: 40/100 ({PLAIN_PROGRESS_EVERY_S:.0f} s)"
        progress.advance("embed", 1)  # within the interval: no line
        assert len(out.getvalue().splitlines()) == 2
        now[0] += 1
        progress.advance("embed", 59)  # done: said whatever the interval
        assert out.getvalue().splitlines()[-1] == f"embed: 100/100 ({PLAIN_PROGRESS_EVERY_S + 1:.0f} s)"
        progress.advance("embed", 1)  # past the total: no second "done"
        assert len(out.getvalue().splitlines()) == 3
        # The same stage again (a rebuild's next replay round) goes on from where it was, on one count.
        progress.stage("embed", 10)
        assert out.getvalue().splitlines()[-1] == "embed: 101/110"
        progress.advance("embed", 9)
        assert out.getvalue().splitlines()[-1] == f"embed: 110/110 ({PLAIN_PROGRESS_EVERY_S + 1:.0f} s)"
    # Drawn as bars: one bar, its total grown.
    drawn = RichProgress(Console(file=io.StringIO(), force_terminal=True))
    with drawn:
        drawn.stage("replay", 10)
        drawn.advance("replay", 10)
        drawn.stage("replay", 5)
        (bar,) = drawn._progress.tasks
        assert (bar.completed, bar.total) == (10, 15)
        assert drawn.begun("replay")


def _one_file_tree_as_ingester(deployment: Deployment, tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A tree of one function, and the environment of an ingest command run as the ingest role, embedding
    nothing."""
    tree = tmp_path / "tree"
    _write(tree, {"geometry.py": "def circle_area(radius):\n    return 3.14159 * radius ** 2\n"})
    env = {
        **deployment.env(), "ONTOFABRIC_NATS_URL": deployment.nats_url_as("ingest"), "ONTOFABRIC_EMBEDDER": "none",
        "ONTOFABRIC_CACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "300",
    }  # fmt: skip
    return tree, env


async def _records_deltas_past_what_it_published(deployment: Deployment, workspace: str, beyond: int) -> None:
    """Main's manifest of ``workspace`` made to record its last delta ``beyond`` sequences past the one it
    published: a stream made again since (adopt-stream, a restore)."""
    store = ManifestStore(deployment.js, deployment.names)
    loaded = await store.load(workspace, "main")
    recorded = Manifest.from_json(loaded.data or b"")
    assert recorded.published_through is not None
    moved = dataclasses.replace(recorded, published_through=recorded.published_through + beyond)
    await store.save(workspace, "main", moved.to_json(), loaded)


async def test_ingest_with_no_projector_running_gives_up_after_its_wait_timeout_and_says_why(
    deployment: Deployment, tmp_path: Path
) -> None:
    """And the same ingest again, nothing having changed, waits for what the first one sent: it said it was done at
    once, exit 0, with the file still not in the index (a tester's retry of an ingest that timed out)."""
    tree, env = _one_file_tree_as_ingester(deployment, tmp_path)
    ontofabric = str(Path(sys.executable).parent / "ontofabric")

    def ingest() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [ontofabric, "ingest", str(tree), "--workspace", "lonely", "--wait-timeout", "2"], env=env,
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip

    async def with_a_projector() -> subprocess.CompletedProcess[str]:
        projector = ProjectorService(deployment.settings, deployment.nats_url_as("projector"), deployment.database_url)
        await projector.start()
        try:
            return await asyncio.to_thread(ingest)
        finally:
            await projector.stop()

    ran = await asyncio.to_thread(ingest)
    assert ran.returncode == 1, ran.stderr
    assert "not projected within 2 s" in ran.stderr
    assert "this ingest's last delta is" in ran.stderr
    assert "The deltas are stored" in ran.stderr
    assert " upserts, 0 deletes, " in ran.stdout  # what it sent, said as without a wait (an auditor's had none)
    again = await asyncio.to_thread(ingest)
    assert again.returncode == 1, again.stderr
    assert "0 upserts, 0 deletes, 0 reverts, 2 unchanged" in again.stdout  # nothing to send, and said so
    assert "an earlier ingest's last delta is" in again.stderr
    done = await with_a_projector()
    assert done.returncode == 0, done.stderr
    assert "0 upserts, 0 deletes, 0 reverts, 2 unchanged" in done.stdout
    # A manifest recording deltas past the stream's end (the stream made again since: adopt-stream, a restore) is
    # said and not waited for (a review's: such an ingest waited out its whole --wait-timeout and exited 1).
    await _records_deltas_past_what_it_published(deployment, "lonely", 1000)
    stale = await with_a_projector()
    assert stale.returncode == 0, stale.stderr
    assert "past the end of the delta stream (made again since?): not waiting for them" in " ".join(
        stale.stderr.split()
    )


async def test_a_branch_ingest_with_nothing_of_its_own_waits_for_what_main_last_sent(
    deployment: Deployment, tmp_path: Path
) -> None:
    """A branch reads main's documents where it has none of its own: its ingest, with nothing to send, said it was
    done at once while main's last ingest (timed out, no projector running) was not in the index yet."""
    tree, env = _one_file_tree_as_ingester(deployment, tmp_path)
    command = [str(Path(sys.executable).parent / "ontofabric"), "ingest", str(tree), "--workspace", "shared"]

    def ingest(*more: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*command, "--wait-timeout", "2", *more], env=env, capture_output=True, text=True, timeout=120, check=False
        )

    on_main = await asyncio.to_thread(ingest)
    assert on_main.returncode == 1, on_main.stderr
    on_branch = await asyncio.to_thread(ingest, "--branch", "feature")
    said = " ".join(on_branch.stderr.split())
    assert on_branch.returncode == 1, said
    assert " unchanged; " in on_branch.stdout  # what it sent, though its wait ran out
    assert "main's last ingest's (the branch reads its documents) last delta is" in said
    projector = ProjectorService(deployment.settings, deployment.nats_url_as("projector"), deployment.database_url)
    await projector.start()
    try:
        done = await asyncio.to_thread(ingest, "--branch", "feature")
        assert done.returncode == 0, done.stderr
        assert "0 upserts, 0 deletes, 0 reverts" in done.stdout
        # One that sends deltas of its own waits for them alone: main's recorded sequence may be of a stream made
        # again since, and never come (a review's: it waited out its timeout and exited 1).
        await _records_deltas_past_what_it_published(deployment, "shared", 1_000_000)
        _write(tree, {"volume.py": "def cube(side):\n    return side ** 3\n"})
        own = await asyncio.to_thread(ingest, "--branch", "feature")
        assert own.returncode == 0, own.stderr
        assert "2 upserts" in own.stdout
    finally:
        await projector.stop()


@pytest.mark.parametrize(
    ("branch", "whose"), [("main", "an earlier ingest"), ("feature", "main's last ingest")], ids=["retry", "branch"]
)
async def test_an_ingest_says_so_when_earlier_deltas_it_waited_for_were_dead_lettered(
    deployment: Deployment, tmp_path: Path, branch: str, whose: str
) -> None:
    """A review's: the retry of an ingest that timed out waited for the earlier ingest's deltas, but only its own
    were looked for among the dead letters, so it exited 0 over deltas that never reached the index. And a branch's
    ingest with nothing of its own, which waits for main's last ingest: what of it was set aside, the branch reads
    without."""
    tree, env = _one_file_tree_as_ingester(deployment, tmp_path)
    command = [str(Path(sys.executable).parent / "ontofabric"), "ingest", str(tree), "--workspace", "lonely"]
    first = await asyncio.to_thread(
        subprocess.run, [*command, "--wait-timeout", "1"], env=env, capture_output=True, text=True, timeout=120
    )
    assert first.returncode == 1, first.stderr
    waiting = await asyncio.create_subprocess_exec(
        *command, "--branch", branch, "--wait-timeout", "60", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert waiting.stdout is not None
    async with asyncio.timeout(60):
        while not (await waiting.stdout.readline()).startswith(b"publish"):  # watching for dead letters from here
            pass
    # A projector whose content limit the chunks pass: each is set aside while the ingest waits.
    strict = deployment.settings.model_copy(update={"max_content_bytes": 10})
    projector = ProjectorService(strict, deployment.nats_url_as("projector"), deployment.database_url)
    await projector.start()
    try:
        _, stderr = await asyncio.wait_for(waiting.communicate(), 60)
    finally:
        await projector.stop()
    said = " ".join(stderr.decode().split())
    assert waiting.returncode == 1, said
    assert f"2 deltas {whose} published were dead-lettered" in said


async def test_ingest_into_a_full_delta_stream_says_so_at_once_and_exits_1(
    deployment: Deployment, tmp_path: Path
) -> None:
    """JetStream answers a full stream with 503, which an ingest used to retry for a minute and then report as
    ServiceUnavailableError, with a traceback."""
    stream = (await deployment.js.stream_info(deployment.names.delta_stream)).config
    limited = dataclasses.replace(stream, max_bytes=1024 * 1024, discard=DiscardPolicy.NEW)
    await deployment.js.update_stream(limited)
    for size in (100_000, 1_000, 10):  # full to the last bytes
        with contextlib.suppress(ServiceUnavailableError):
            for _ in range(200):
                await deployment.js.publish(deployment.names.delta_subject("other", "main"), b"x" * size)
    _write(tmp_path, {"geometry.py": "def circle_area(radius):\n    return 3.14159 * radius ** 2\n"})
    env = {
        **deployment.env(), "ONTOFABRIC_NATS_URL": deployment.nats_url_as("ingest"), "ONTOFABRIC_EMBEDDER": "none",
        "ONTOFABRIC_CACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "300",
    }  # fmt: skip
    ontofabric = str(Path(sys.executable).parent / "ontofabric")
    began = time.monotonic()
    ran = await asyncio.to_thread(
        subprocess.run, [ontofabric, "ingest", str(tmp_path), "--workspace", "late"], env=env,
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    said = " ".join(ran.stderr.split())
    assert ran.returncode == 1, said
    assert "the delta stream is full" in said, said
    assert "ontofabric compact" in said
    assert "Traceback" not in said
    assert time.monotonic() - began < 30  # not after the publisher's minute of retries


async def test_an_ingest_whose_publish_failed_part_way_records_unknown_what_a_projector_set_aside_of_it(
    deployment: Deployment, tmp_path: Path
) -> None:
    """What a publish that failed part way stored is recorded as sent, so the next ingest sends only the rest: the
    command waits for it to be projected first, and records unknown again what a projector set aside of it, or the
    next ingest would call those unchanged."""
    long_body = "\n".join(f"    total += {n}  # a long function" for n in range(120))
    _write(
        tmp_path,
        {f"large{i}.py": f"def long_sum{i}():\n    total = 0\n{long_body}\n    return total\n" for i in range(6)},
    )
    names, js = deployment.names, deployment.js
    config = (await js.stream_info(names.delta_stream)).config
    held = (await js.stream_info(names.delta_stream)).state.bytes
    env = {
        **deployment.env(), "ONTOFABRIC_NATS_URL": deployment.nats_url_as("ingest"),
        "ONTOFABRIC_CACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "300",
    }  # fmt: skip
    command = [str(Path(sys.executable).parent / "ontofabric"), "ingest", str(tmp_path), "--workspace", "strict"]
    strict = deployment.settings.model_copy(update={"max_content_bytes": 2048})  # every chunk set aside
    service = ProjectorService(strict, deployment.nats_url_as("projector"), deployment.database_url)
    await service.start()  # which sets the stream's limits as its settings have them: capped after
    await js.update_stream(dataclasses.replace(config, max_bytes=held + 15_000, discard=DiscardPolicy.NEW))
    try:
        ran = await asyncio.to_thread(
            subprocess.run, command, env=env, capture_output=True, text=True, timeout=300, check=False
        )
    finally:
        await service.stop()
    said = " ".join(ran.stderr.split())
    assert ran.returncode == 1, said
    assert "the delta stream is full" in said, said
    assert "deltas stored before the failure were set aside by a projector" in said, said
    assert "publishing failed part way" in said  # said before it waits
    manifest = await ManifestStore(js, names).load("strict", MAIN_BRANCH)
    entries = Manifest.from_json(manifest.data).entries if manifest.data else {}
    documents = {key: value for key, value in entries.items() if key.startswith("d:")}
    assert len(documents) == 12
    assert set(documents.values()) == {UNKNOWN}  # stored and set aside, or never stored: all sent again


async def test_an_ingest_whose_publish_failed_part_way_with_no_projector_says_one_must_run(
    deployment: Deployment, tmp_path: Path
) -> None:
    """An operator's retest: with no projector the wait for what was stored said nothing for 120 s, then
    "TimeoutError: ", and the error advised a compaction, which folds only what a projector applied."""
    _write(tmp_path / "tree", {f"m{i}.py": f"def f{i}(x):\n    return x + {i}\n" for i in range(12)})
    names, js = deployment.names, deployment.js
    config = (await js.stream_info(names.delta_stream)).config
    held = (await js.stream_info(names.delta_stream)).state.bytes
    await js.update_stream(dataclasses.replace(config, max_bytes=held + 15_000, discard=DiscardPolicy.NEW))
    env = {
        **deployment.env(), "ONTOFABRIC_NATS_URL": deployment.nats_url_as("ingest"),
        "ONTOFABRIC_CACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "300",
    }  # fmt: skip
    command = [
        str(Path(sys.executable).parent / "ontofabric"), "ingest", str(tmp_path / "tree"), "--workspace", "alone",
        "--wait-timeout", "3",
    ]  # fmt: skip
    ran = await asyncio.to_thread(
        subprocess.run, command, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    said = " ".join(ran.stderr.split())
    assert ran.returncode == 1, said
    assert "publishing failed part way" in said, said
    assert "were not seen projected (the index at stream seq" in said, said
    assert "makes room only of what a projector has applied, so one must be running" in said, said


async def test_ingest_says_which_of_its_deltas_a_projector_dead_lettered_and_exits_1(
    deployment: Deployment, tmp_path: Path
) -> None:
    """Before, an ingest whose deltas were all set aside (a projector with other limits, another embedding model)
    reported success: every delta was "projected", none indexed."""
    long_body = "\n".join(f"    total += {n}  # a long function" for n in range(120))
    _write(tmp_path, {
        "small.py": "def area(r):\n    return 3.14 * r * r\n",
        "large.py": f"def long_sum():\n    total = 0\n{long_body}\n    return total\n",
    })  # fmt: skip
    env = {
        **deployment.env(), "ONTOFABRIC_NATS_URL": deployment.nats_url_as("ingest"),
        "ONTOFABRIC_CACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "300",
    }  # fmt: skip
    command = [str(Path(sys.executable).parent / "ontofabric"), "ingest", str(tmp_path), "--workspace", "strict"]

    async def ingest_beside(settings: Settings) -> tuple[subprocess.CompletedProcess[str], set[str]]:
        """The ingest run while a projector of ``settings`` runs, and the symbol keys then indexed."""
        service = ProjectorService(settings, deployment.nats_url_as("projector"), deployment.database_url)
        await service.start()
        try:
            ran = await asyncio.to_thread(
                subprocess.run, command, env=env, capture_output=True, text=True, timeout=300, check=False
            )
        finally:
            await service.stop()
        rows = await deployment.fetch("SELECT symbol_key FROM documents WHERE workspace = 'strict' AND NOT deleted")
        return ran, {r["symbol_key"] for r in rows}

    strict = deployment.settings.model_copy(update={"max_content_bytes": 2048})  # the ingester's limit: 256 KiB
    ran, indexed = await ingest_beside(strict)
    said = " ".join(ran.stderr.split())
    assert ran.returncode == 1, ran.stdout + ran.stderr
    # The function's chunk and its file's (which holds it).
    assert "2 of the" in said
    assert "were dead-lettered, not indexed (content_too_large: 2)" in said
    assert "the first: content is" in said
    assert "ontofabric dlq list --workspace strict" in said
    assert not any("long_sum" in key for key in indexed)  # symbol keys: python:large.py/long_sum().
    assert indexed, "the small file's chunks were indexed"
    # The same ingest again sends those two again and says so again, rather than calling them unchanged and
    # exiting 0, as every ingest after did (an ops tester's).
    again, _ = await ingest_beside(strict)
    said = " ".join(again.stderr.split())
    assert again.returncode == 1, said
    assert "2 upserts" in again.stdout
    assert "2 of the 2 deltas published were dead-lettered" in said
    # With the limit raised, the next ingest indexes them.
    fixed, indexed = await ingest_beside(deployment.settings)
    assert fixed.returncode == 0, fixed.stderr
    assert "2 upserts" in fixed.stdout
    assert any("long_sum" in key for key in indexed), indexed


async def test_ingest_skips_what_no_delta_can_carry_and_goes_on(
    deployment: Deployment, projector: ProjectorService, tmp_path: Path
) -> None:
    """A red team's findings: a source file holding NUL, a file name of bytes that are no UTF-8, and text of control
    characters (six bytes each as JSON, past the stream's limit) each stopped the whole ingest with a traceback."""
    _write(tmp_path, {"good.py": "def area(r):\n    return 3.14 * r * r\n", "binary.py": "x = 1\0\n"})
    (tmp_path / "controls.md").write_text("\x01" * 200_000)
    os.close(os.open(os.fsencode(tmp_path) + b"/bad\xffname.md", os.O_CREAT | os.O_WRONLY))
    ingester = Ingester(deployment.js, deployment.names, None, deployment.settings.max_content_bytes)
    report = await ingester.ingest(tmp_path, "repo")
    assert report.files == 2  # good.py and controls.md
    assert report.too_large == ["markdown:controls.md#"]
    assert report.upserts == 2  # good.py's two chunks: not the one left unsent (an operator tester's count)
    assert report.last_sequence is not None
    await deployment.wait_projected(report.last_sequence)
    assert {key.split("/")[0] for key in await _live(deployment)} == {"python:good.py"}
    manifest = await ingester.load_manifest("repo", "main")
    assert list(manifest.entries.values()).count(UNKNOWN) == 1  # tried again by the next ingest


async def test_an_ingest_that_sends_nothing_saves_no_manifest_though_a_new_file_is_too_large_to_send(
    deployment: Deployment, projector: ProjectorService, tmp_path: Path
) -> None:
    """A reviewer's: the too-large document's file counted as a file to record, which the manifest never holds,
    so every ingest saved it again."""
    _write(tmp_path, {"good.py": "def area(r):\n    return 3.14 * r * r\n"})
    ingester = Ingester(deployment.js, deployment.names, None, deployment.settings.max_content_bytes)
    await ingester.ingest(tmp_path, "repo")
    (tmp_path / "controls.md").write_text("\x01" * 200_000)
    generations = set()
    for _ in range(3):
        report = await ingester.ingest(tmp_path, "repo")
        assert (report.too_large, report.last_sequence) == (["markdown:controls.md#"], None)
        generations.add((await ingester._manifests.load("repo", "main")).generation)
    assert len(generations) == 1


async def test_an_ingest_stopped_part_way_leaves_nothing_the_next_one_cannot_remove(
    deployment: Deployment, projector: ProjectorService, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A red team's finding: an ingest killed while publishing had saved no manifest, so what it had stored was
    recorded nowhere; once those files were deleted, no later ingest removed their documents."""
    _write(tmp_path, {"keep.py": "def keep():\n    return 1\n"})
    ingester = Ingester(deployment.js, deployment.names, None, deployment.settings.max_content_bytes)
    await ingester.ingest(tmp_path, "repo")
    _write(tmp_path, {f"extra_{n}.py": f"def extra_{n}():\n    return {n}\n" for n in range(20)})
    publish_many = DeltaPublisher.publish_many

    async def dies_half_way(self: DeltaPublisher, deltas: Sequence[DeltaEnvelope], **kwargs: Any) -> list[PubAck]:
        acks = await publish_many(self, deltas[: len(deltas) // 2], **kwargs)
        await deployment.wait_projected(acks[-1].seq)
        raise KeyboardInterrupt  # the process killed before it could save its manifest

    monkeypatch.setattr(DeltaPublisher, "publish_many", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        await ingester.ingest(tmp_path, "repo")
    monkeypatch.undo()
    assert len(await _live(deployment)) > 2  # some of the extra files' documents are in
    for n in range(20):
        (tmp_path / f"extra_{n}.py").unlink()
    again = await ingester.ingest(tmp_path, "repo")
    assert again.last_sequence is not None
    await deployment.wait_projected(again.last_sequence)
    assert {key.split("/")[0] for key in await _live(deployment)} == {"python:keep.py"}


async def test_a_section_under_a_very_long_heading_is_indexed(
    deployment: Deployment, projector: ProjectorService, tmp_path: Path
) -> None:
    """A red team's finding: a heading of 3,000 characters made a key longer than PostgreSQL's index takes, and
    the section was dead-lettered (apply_failed)."""
    heading = " ".join(f"word{n}" for n in range(500))
    _write(tmp_path, {"notes.md": f"# {heading}\nThe body of the section.\n"})
    ingester = Ingester(deployment.js, deployment.names, None, deployment.settings.max_content_bytes)
    report = await ingester.ingest(tmp_path, "repo")
    assert report.last_sequence is not None
    await deployment.wait_projected(report.last_sequence)
    (key,) = await _live(deployment)
    assert key.startswith("markdown:notes.md#word0-word1-")
    assert len(key) < 200
    assert (await deployment.js.stream_info(deployment.names.dlq_stream)).state.messages == 0


async def test_symbols_with_very_long_names_are_indexed_under_keys_the_contract_carries(
    deployment: Deployment, projector: ProjectorService, tmp_path: Path
) -> None:
    """A function name of 6,000 characters (legal Python) and a Markdown trail of six long headings under a deep
    path made symbol keys and qualified names longer than PostgreSQL's indexes take; they are shortened, each
    ending in a hash of the whole, so two that share a long start stay two."""
    # Hex of hashes, so that PostgreSQL cannot compress the index entry below its limit.
    long_name = "handler_" + "".join(hashlib.sha256(str(n).encode()).hexdigest() for n in range(100))
    deep = "/".join(["d" * 100] * 4)
    headings = "".join(f"{'#' * level} {'heading ' * 14}{level}\nbody {level}\n" for level in range(1, 7))
    _write(
        tmp_path,
        {
            "long.py": f"def {long_name}a():\n    return 1\n\n\ndef {long_name}b():\n    return 2\n",
            f"{deep}/notes.md": headings,
        },
    )
    ingester = Ingester(deployment.js, deployment.names, None, deployment.settings.max_content_bytes)
    report = await ingester.ingest(tmp_path, "repo")
    assert report.last_sequence is not None
    await deployment.wait_projected(report.last_sequence)
    assert (await deployment.js.stream_info(deployment.names.dlq_stream)).state.messages == 0
    rows = await deployment.fetch(
        "SELECT symbol_key AS key, symbol_fqn AS fqn FROM documents WHERE workspace = 'repo' AND NOT deleted"
    )
    functions = [row for row in rows if "handler_" in row["fqn"]]
    assert len(functions) == 2  # not one: the hash of the whole tells them apart
    assert len({row["key"] for row in functions}) == 2
    assert max(len(row["key"]) for row in rows) <= MAX_SYMBOL_CHARS
    assert max(len(row["fqn"]) for row in rows) <= MAX_SYMBOL_CHARS
    assert sum(1 for row in rows if row["key"].startswith("markdown:")) == 6


def test_links_and_files_that_are_not_regular_are_not_read(tmp_path: Path) -> None:
    """A tenant tester's: a link to the deployment's runtime.json (its passwords) or to another workspace's tree
    was followed, and its target indexed into the workspace the tree was ingested into."""
    secrets = tmp_path / "data"
    secrets.mkdir()
    (secrets / "runtime.json").write_text('{"password": "hunter2"}')
    tree = tmp_path / "tree"
    _write(tree, {"app.py": "x = 1\r\ny = 2\r\n", "docs/guide.md": "# Guide\n"})
    (tree / "notes.md").symlink_to(secrets / "runtime.json")
    (tree / "guide.md").symlink_to(tree / "docs" / "guide.md")  # inside the tree too: a link is not its file
    os.mkfifo(tree / "pipe.py")  # would never end
    (tree / "elsewhere").symlink_to(secrets, target_is_directory=True)  # a directory's link: not gone into, said
    with capture_logs() as logged:
        assert read_tree(tree) == {"app.py": "x = 1\ny = 2\n", "docs/guide.md": "# Guide\n"}  # newlines as before
    skipped = [entry["path"].strip("'").rsplit("/", 1)[-1] for entry in logged if entry["event"].endswith("_skipped")]
    assert sorted(skipped) == ["elsewhere", "guide.md", "notes.md", "pipe.py"]
    # Decoded as Python decodes source (a tester's): a byte-order mark dropped, a coding line followed.
    (tree / "bom.py").write_bytes(b"\xef\xbb\xbfdef bom(): pass\n")
    (tree / "latin.py").write_bytes(b"# -*- coding: latin-1 -*-\nname = '\xe9t\xe9'\n")
    (tree / "odd.py").write_bytes(b"# -*- coding: no-such-codec -*-\nx = 1\n")
    (tree / "rot.py").write_bytes(b"# coding: rot13\nk = 1\n")  # a codec, not a text one: no crash
    (tree / "bom.md").write_bytes(b"\xef\xbb\xbf# Title\n")
    # A Unicode tester's: a file saved as UTF-16, or with one Windows-1252 byte, was skipped, and so its documents
    # deleted from the index, with exit 0.
    (tree / "wide.py").write_bytes("def brew(): return 'caf\u00e9'\r\n".encode("utf-16"))
    (tree / "wider.md").write_bytes("# Caf\u00e9 \U0001f680\n".encode("utf-32"))
    (tree / "stray.md").write_bytes(b"# Guide\nEnd of the page \x96 bye\n")
    (tree / "stray.py").write_bytes(b"x = 1  # caf\xe9\n")
    (tree / "mixed.md").write_bytes("# Caf\u00e9, then a stray ".encode() + b"\x96 byte in a longer line of prose\n")
    (tree / "quoted.md").write_bytes("\u201cCAF\u00c9\u201d est ferm\u00e9, l\u2019\u00e9t\u00e9\n".encode("cp1252"))
    (tree / "binary.md").write_bytes(b"# \x00\x01\x02")
    with capture_logs() as logged:
        read = read_tree(tree)
    assert (read["bom.py"], read["bom.md"]) == ("def bom(): pass\n", "# Title\n")
    assert read["latin.py"] == "# -*- coding: latin-1 -*-\nname = '\u00e9t\u00e9'\n"
    assert (read["wide.py"], read["wider.md"]) == ("def brew(): return 'caf\u00e9'\n", "# Caf\u00e9 \U0001f680\n")
    # Not valid in their encoding and holding no UTF-8: 8-bit text, read as Windows-1252, and said so (a monorepo
    # tester's Latin-1 changelog read "Am\ufffdlioration"). Holding UTF-8 too: read as UTF-8, each byte that is not
    # replaced.
    assert (read["stray.md"], read["stray.py"]) == ("# Guide\nEnd of the page \u2013 bye\n", "x = 1  # caf\u00e9\n")
    assert read["mixed.md"] == "# Caf\u00e9, then a stray \ufffd byte in a longer line of prose\n"
    # `\u00c9\u201d` in Windows-1252 reads as one UTF-8 character: 8-bit all the same, by the count (a review's).
    assert read["quoted.md"] == "\u201cCAF\u00c9\u201d est ferm\u00e9, l\u2019\u00e9t\u00e9\n"
    assert (read["odd.py"], read["rot.py"]) == ("# -*- coding: no-such-codec -*-\nx = 1\n", "# coding: rot13\nk = 1\n")
    not_utf8 = sorted(entry["path"] for entry in logged if entry["event"] == "ingest_file_not_utf8")
    assert not_utf8 == ["mixed.md", "odd.py", "quoted.md", "rot.py", "stray.md", "stray.py"]
    assert "binary.md" not in read  # NUL: not text at all


def test_exclusions_read_as_gitignore_reads_them(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/core.py": "x = 1\n",
            "pkg/core_pb2.py": "y = 2\n",
            "pkg/migrations/m1.py": "z = 3\n",
            "pkg/tests/test_inner.py": "def test(): pass\n",
            "tests/test_core.py": "def test(): pass\n",
            "docs/guide.md": "# Guide\n",
            "README.md": "# Readme\n",
        },
    )
    everything = set(read_tree(tmp_path))
    assert len(everything) == 8

    def kept(*written: str) -> set[str]:
        return set(read_tree(tmp_path, exclusion_patterns(tmp_path, written)))

    # Without a slash, a name at any depth; with one, a path from the root; a directory takes all it holds.
    assert kept("tests") == everything - {"tests/test_core.py", "pkg/tests/test_inner.py"}
    assert kept("*_pb2.py", "docs/*.md") == everything - {"pkg/core_pb2.py", "docs/guide.md"}
    assert kept("pkg/migrations") == everything - {"pkg/migrations/m1.py"}
    assert kept("tests/") == kept("tests")  # a trailing slash is dropped
    assert kept("./tests") == kept("tests\\") == kept("tests")  # as a shell completes it, or Windows writes it
    assert kept(str(tmp_path / "docs")) == everything - {"docs/guide.md"}  # an absolute path inside the tree
    assert kept("test", "core") == everything  # whole names, not parts of them
    assert matches("pkg/tests/x.py", ["tests"])
    assert not matches("Tests/x.py", ["tests"])  # case-sensitive, as paths are
    for nothing in ("", ".", "../elsewhere", "/elsewhere"):
        with pytest.raises(ExclusionRefused):
            exclusion_patterns(tmp_path, [nothing])


def test_exclude_reads_backslash_escapes_as_gitignore_does(tmp_path: Path) -> None:
    """An ingest tester's `--exclude 'st\\*r.py'` was read as the path `st/*r.py`, and `a\\[1\\]` as a character
    class: both excluded nothing, where .gitignore names the files themselves."""
    _write(tmp_path, {"st*r.py": "", "star.py": "", "a[1]/b.py": "", "a1/b.py": "", "#x.py": ""})

    def kept(*written: str) -> set[str]:
        return set(read_tree(tmp_path, exclusion_patterns(tmp_path, written)))

    assert kept("st\\*r.py") == {"star.py", "a[1]/b.py", "a1/b.py", "#x.py"}
    assert kept("a\\[1\\]") == {"st*r.py", "star.py", "a1/b.py", "#x.py"}
    assert kept("\\#x.py") == {"st*r.py", "star.py", "a[1]/b.py", "a1/b.py"}
    assert kept("st*r.py") == {"a[1]/b.py", "a1/b.py", "#x.py"}  # unescaped, a pattern as before


def test_directories_of_tools_output_are_left_out_unless_they_are_packages(tmp_path: Path) -> None:
    """pip's `operations/build` package was left out as build output (an ingest tester's); a Go service's `vendor`
    READMEs ranked above a monorepo tester's own, and pip's `_vendor` is its own."""
    _write(
        tmp_path,
        {
            "pkg/operations/build/__init__.py": "", "pkg/operations/build/wheel.py": "",
            "build/lib/pkg/x.py": "", "dist/y.py": "", ".tox/z.py": "", "pkg/core.py": "",
            "svc/vendor/github.com/pkg/errors/README.md": "", "pkg/vendor/__init__.py": "",
            "crate/target/debug/build/x.rs": "", "crate/Cargo.toml": "", ".github/workflows/deploy.yml": "",
            ".idea/notes.md": "", "go/internal/target/aim.go": "",  # a package named target: no build beside it
        },
    )  # fmt: skip
    assert set(read_tree(tmp_path)) == {
        "pkg/operations/build/__init__.py",
        "pkg/operations/build/wheel.py",
        "pkg/core.py",
        "pkg/vendor/__init__.py",
        ".github/workflows/deploy.yml",  # a hidden directory read all the same: CI workflows
        "crate/Cargo.toml",
        "go/internal/target/aim.go",
    }


async def test_a_directory_that_cannot_be_listed_deletes_nothing(
    deployment: Deployment, projector: ProjectorService, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ingest tester's directory made unlistable (a mount point gone, access taken away) was left out without
    a word and everything an earlier ingest had published of it deleted, exit 0. (Run as root, a mode cannot take
    the listing away: the listing fails here as it does without access.)"""
    _write(tmp_path, {"a.py": "def f():\n    return 1\n", "nolist/x.py": "def g():\n    return 2\n"})
    ingester = Ingester(deployment.js, deployment.names, None, deployment.settings.max_content_bytes)
    first = await ingester.ingest(tmp_path, "repo")
    assert first.upserts == 4
    (tmp_path / "a.py").unlink()  # gone for good: its deletion waits with the rest
    scandir = os.scandir

    def refusing(path: Any) -> Any:
        if Path(os.fsdecode(path)).name == "nolist":
            raise PermissionError(13, "Permission denied", os.fsdecode(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refusing)
    unread = await ingester.ingest(tmp_path, "repo")
    assert unread.unread == ("nolist",)
    assert (unread.upserts, unread.deletes, unread.last_sequence) == (0, 0, None)
    monkeypatch.setattr(os, "scandir", scandir)
    readable = await ingester.ingest(tmp_path, "repo")  # everything read: a.py's two documents go now
    assert (readable.unread, readable.upserts, readable.deletes) == ((), 0, 2)
    assert readable.last_sequence is not None
    await deployment.wait_projected(readable.last_sequence)
    assert set(await _live(deployment)) == {"python:nolist/x.py", "python:nolist/x.py/g()."}


async def test_ingest_leaves_out_what_exclude_names_and_deletes_what_it_had_published(
    deployment: Deployment, projector: ProjectorService, tmp_path: Path
) -> None:
    tree = tmp_path / "tree"
    _write(
        tree,
        {
            "geometry.py": "def circle_area(radius):\n    return 3.14159 * radius ** 2\n",
            "tests/test_geometry.py": "def test_area():\n    assert circle_area(1) > 3\n",
            "extern/lib.py": "def vendored():\n    return 1\n",
        },
    )
    env = {
        **deployment.env(), "ONTOFABRIC_NATS_URL": deployment.nats_url_as("ingest"), "ONTOFABRIC_EMBEDDER": "none",
        "ONTOFABRIC_CACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "300",
    }  # fmt: skip
    ontofabric = str(Path(sys.executable).parent / "ontofabric")

    def ingest(*options: str) -> tuple[set[str], str]:
        ran = subprocess.run(
            [ontofabric, "ingest", str(tree), "--workspace", "repo", *options], env=env,
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert ran.returncode == 0, ran.stderr
        return {line for line in ran.stdout.splitlines() if "files," in line}, ran.stderr

    _, said = await asyncio.to_thread(ingest, "--exclude", "tests", "--exclude", "./extern/*")
    assert "note:" not in said  # the first ingest: nothing to differ from
    files = await deployment.fetch("SELECT DISTINCT file_path FROM documents WHERE workspace = 'repo' AND NOT deleted")
    assert {r["file_path"] for r in files} == {"geometry.py"}
    _, said = await asyncio.to_thread(ingest)  # all of it, and the ingest says its patterns changed
    assert "the last ingest of repo/main excluded 'extern/*' tests; this one excludes nothing" in said
    files = await deployment.fetch("SELECT DISTINCT file_path FROM documents WHERE workspace = 'repo' AND NOT deleted")
    assert {r["file_path"] for r in files} == {"geometry.py", "tests/test_geometry.py", "extern/lib.py"}
    (report,), said = await asyncio.to_thread(ingest, "--exclude", "tests")  # the tests' chunks go again
    assert "0 upserts, 2 deletes" in report
    assert "excluded nothing; this one excludes tests" in said
    # Patterns that change nothing in the index are recorded all the same; the same set in another order or
    # spelling is the same.
    (report,), said = await asyncio.to_thread(ingest, "--exclude", "tests", "--exclude", "nomatch")
    assert "0 upserts, 0 deletes" in report
    assert "excluded tests; this one excludes nomatch tests" in said
    assert "note:" not in (await asyncio.to_thread(ingest, "--exclude", "tests/", "--exclude", "nomatch"))[1]
    same = ("--exclude", "nomatch", "--exclude", "tests", "--exclude", "./tests")
    assert "note:" not in (await asyncio.to_thread(ingest, *same))[1]
    # One pattern too broad would have deleted the whole index: refused, nothing sent.
    refused = await asyncio.to_thread(
        subprocess.run, [ontofabric, "ingest", str(tree), "--workspace", "repo", "--exclude", "*.py"], env=env,
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert refused.returncode == 2
    assert "leaves out every source file" in refused.stderr
    files = await deployment.fetch("SELECT DISTINCT file_path FROM documents WHERE workspace = 'repo' AND NOT deleted")
    assert {r["file_path"] for r in files} == {"geometry.py", "extern/lib.py"}
    # A branch ingested with other patterns than main's is told so; with main's, it is not.
    _, said = await asyncio.to_thread(ingest, "--branch", "feature/x")
    assert "repo/main was last ingested excluding nomatch tests; this ingest of feature/x excludes nothing" in said
    _, said = await asyncio.to_thread(ingest, "--branch", "feature/x", "--exclude", "tests", "--exclude", "nomatch")
    assert "repo/main was last" not in said
    assert "the last ingest of repo/feature/x excluded nothing; this one excludes nomatch tests" in said
    # A tree with no source file (a wrong path, a volume not mounted) would delete the whole index: refused,
    # nothing sent (an independent tester's finding: it deleted every document, exit 0); asked for, it empties it.
    empty = tmp_path / "empty"
    empty.mkdir()

    def ingest_empty(*options: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [ontofabric, "ingest", str(empty), "--workspace", "repo", *options], env=env,
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip

    refused = await asyncio.to_thread(ingest_empty)
    assert refused.returncode == 2
    assert "holds no source file" in refused.stderr
    assert "would take 4 documents out of repo/main" in " ".join(refused.stderr.split())
    files = await deployment.fetch("SELECT DISTINCT file_path FROM documents WHERE workspace = 'repo' AND NOT deleted")
    assert {r["file_path"] for r in files} == {"geometry.py", "extern/lib.py"}
    # A branch whose main was never ingested: its documents would go as reverts, not deletes (the review's case).
    alone = await asyncio.to_thread(
        subprocess.run, [ontofabric, "ingest", str(tree), "--workspace", "solo", "--branch", "feature/y"], env=env,
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert alone.returncode == 0, alone.stderr
    refused = await asyncio.to_thread(
        subprocess.run, [ontofabric, "ingest", str(empty), "--workspace", "solo", "--branch", "feature/y"], env=env,
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert refused.returncode == 2
    assert "out of solo/feature/y" in " ".join(refused.stderr.split())
    emptied = await asyncio.to_thread(ingest_empty, "--allow-empty")
    assert emptied.returncode == 0, emptied.stderr
    assert "0 upserts, 4 deletes" in emptied.stdout
    assert not await deployment.fetch(
        "SELECT 1 FROM documents WHERE workspace = 'repo' AND branch = 'main' AND NOT deleted"
    )
    assert "warning" not in emptied.stderr  # emptied on purpose
    # A first ingest of a tree with no source file deletes nothing, so it runs, but it says what it found.
    first = await asyncio.to_thread(
        subprocess.run, [ontofabric, "ingest", str(empty), "--workspace", "fresh"], env=env,
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr
    assert "holds no source file this ingester reads (.py, .md, .rst, .txt, .yaml" in " ".join(first.stderr.split())


def test_a_chunk_whose_names_past_ascii_a_release_reads_otherwise_is_sent_again(tmp_path: Path) -> None:
    """A review's: object types and module names renamed (letters kept, NFKC) never reached the documents of files
    that did not change, since the manifest kept their content alone. Names past ASCII go into it; others do not, so
    that their values stay."""
    import dataclasses

    from ontofabric.services.ingest.ingester import _derived_state, chunk_tree

    _write(tmp_path, {"tiere.py": "class Животное:\n    pass\n", "plain.py": "class Animal:\n    pass\n"})
    chunks = {c.symbol_fqn: c for c in chunk_tree(tmp_path, 1 << 20)}
    named = chunks["tiere.Животное"]
    renamed = dataclasses.replace(named, object_type="tiere.________")  # as an earlier release named it
    assert _derived_state(named) != _derived_state(renamed)
    assert "|names:" not in _derived_state(chunks["plain.Animal"])
    # A name that became ASCII as Python reads it (a review's `ﬁle.ts`, once `ﬁle`, now `file`) goes too.
    _write(tmp_path, {"\ufb01le.ts": "export class Box {}\n"})
    (ligature,) = [c for c in chunk_tree(tmp_path, 1 << 20) if c.symbol_fqn == "file.Box"]
    assert "|names:" in _derived_state(ligature)
