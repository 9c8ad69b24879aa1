"""Changing the embedding model and its dimension without downtime: ``ontofabric reembed`` against real servers.

The next model is all-MiniLM-L6-v2 followed by a fixed random projection to 256 dimensions (saved as a
sentence-transformers model like any other): another model, with another dimension, that still ranks sensibly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from ontofabric.contracts import ErrorReply, QueryResponse
from ontofabric.services.ingest.ingester import ChunkEmbedding
from ontofabric.services.ops.dead_letters import Selection, dead_letters
from ontofabric.services.ops.reembed import ChangeRefused, ModelChange
from ontofabric.services.ops.snapshots import compact
from ontofabric.services.ops.status import deployment_status
from ontofabric.services.projector.planning import Limits, Rejection, validate_delta
from ontofabric.services.projector.worker import ProjectorService
from ontofabric.services.query.client import QueryClient
from ontofabric.services.query.core import ModelChanged, SearchInput, vector_for_index
from ontofabric.services.query.worker import QueryService
from ontofabric.shared.embedder import Embedder, ServedModel, build_embedder, load_embedder
from ontofabric.shared.embedding_cache import embed_with_signs
from ontofabric.shared.placement import Placement
from ontofabric.shared.settings import Settings

from .conftest import CORPUS, Deployment, RecordedProgress, corpus_deltas
from .factories import document, projected_minilm, upsert

CURRENT = "all-MiniLM-L6-v2"
NEXT = "minilm-projected-256"
NEXT_DIM = 256


@pytest.fixture(scope="session")
def next_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return projected_minilm(tmp_path_factory.mktemp("models") / NEXT, NEXT_DIM)


def _vector(text: str) -> np.ndarray:
    return np.asarray(json.loads(text), dtype=np.float32)


def _changing(settings: Settings, next_model: Path) -> Settings:
    return settings.model_copy(
        update={
            "embedder": "local",
            "next_embedding_model": NEXT,
            "next_embedding_model_path": next_model,
            "next_embedding_dim": NEXT_DIM,
        }
    )


def test_next_model_settings_come_together_and_name_another_model() -> None:
    with pytest.raises(ValueError, match="go together"):
        Settings(next_embedding_model=NEXT, next_embedding_dim=NEXT_DIM)  # which files? not the bundled model's
    with pytest.raises(ValueError, match="another model"):
        Settings(next_embedding_model=CURRENT, next_embedding_dim=384, next_embedding_model_path=Path("m"))
    settings = Settings(next_embedding_model=NEXT, next_embedding_dim=NEXT_DIM, next_embedding_model_path=Path("m"))
    following = settings.next_model()
    assert following is not None
    assert (following.embedding_model, following.embedding_dim, following.next_model()) == (NEXT, NEXT_DIM, None)
    assert list(settings.models()) == [CURRENT, NEXT]
    assert Settings().next_model() is None


def test_a_delta_of_another_model_passes_validation_only_where_it_is_embedded_again() -> None:
    delta = upsert("acme", document("a", "text", embedding=[0.1] * 384, embedding_model=CURRENT)).model_dump_json()
    limits = Limits(max_message_bytes=1 << 20, max_content_bytes=1 << 16, embedding_dim=NEXT_DIM, embedding_model=NEXT)
    refused = validate_delta(delta.encode(), "p.delta.acme.main", 1, limits)
    assert isinstance(refused, Rejection)
    assert refused.reason == "embedding_dimension_mismatch"
    limits = Limits(1 << 20, 1 << 16, NEXT_DIM, NEXT, reembeddable=frozenset({CURRENT}))
    assert not isinstance(validate_delta(delta.encode(), "p.delta.acme.main", 1, limits), Rejection)
    stray = upsert("acme", document("a", "text", embedding=[0.1] * 384, embedding_model="stray")).model_dump_json()
    refused = validate_delta(stray.encode(), "p.delta.acme.main", 1, limits)  # a model this index never held
    assert isinstance(refused, Rejection)
    assert refused.reason == "embedding_dimension_mismatch"


async def test_a_query_vector_is_compared_only_with_vectors_of_its_own_model() -> None:
    own = np.ones(4, dtype=np.float32)
    query = SearchInput("text", own, CURRENT)
    assert await vector_for_index(query, CURRENT, None) is own
    assert await vector_for_index(query, None, None) is own  # nothing read that says otherwise
    with pytest.raises(ModelChanged, match=f"holds {NEXT} vectors"):
        await vector_for_index(query, NEXT, None)

    async def vector_by(model: str, text: str, workspace: str) -> np.ndarray:
        return np.full(2, len(model + text + workspace), dtype=np.float32)

    again = await vector_for_index(query, NEXT, vector_by, "acme")  # by the index's model, in acme's turn
    assert again.tolist() == [len(NEXT + "text" + "acme")] * 2


async def _publish_corpus(deployment: Deployment, embedder: Embedder) -> int:
    acks = await deployment.publisher.publish_many(corpus_deltas(embedder, embedding_model=CURRENT, token_signs=True))
    return acks[-1].seq


class PublishingDuringFill(RecordedProgress):
    """Progress that, once the first round has embedded something, has an ingester rewrite a document: the change
    must embed it again before it swaps."""

    def __init__(self, deployment: Deployment, embedder: Embedder) -> None:
        super().__init__()
        self._deployment, self._embedder = deployment, embedder
        self.rewritten: asyncio.Task[None] | None = None

    def advance(self, name: str, amount: int = 1) -> None:
        super().advance(name, amount)
        if name.startswith("embed") and self.rewritten is None:
            self.rewritten = asyncio.ensure_future(self._rewrite())

    async def _rewrite(self) -> None:
        text = "Parse comma separated values from a spreadsheet export into records."
        vector = self._embedder.embed_documents([text])[0]
        doc = document(
            "csv", text, object_type="io.Files", embedding=[float(x) for x in vector], embedding_model=CURRENT
        )
        ack = await self._deployment.publisher.publish(upsert("acme", doc))
        await self._deployment.wait_projected(ack.seq)


async def _ask(client: QueryClient, text: str) -> QueryResponse:
    reply = await client.query("acme", {"semanticQuery": text, "topK": 3})
    assert not isinstance(reply, ErrorReply), reply
    return reply


async def test_the_model_and_its_dimension_change_while_queries_are_answered(
    deployment: Deployment, next_model: Path, embedder: Embedder
) -> None:
    settings = _changing(deployment.settings, next_model)
    projector = ProjectorService(settings, deployment.nats_url_as("projector"), deployment.database_url)
    await projector.start()
    served = build_embedder(settings)
    assert isinstance(served, ServedModel)
    worker = QueryService(settings, deployment.nats_url_as("query"), deployment.database_url, served, None)
    try:
        await deployment.wait_projected(await _publish_corpus(deployment, embedder))
        await worker.start()
        client = QueryClient(deployment.nc, deployment.names)
        before = await _ask(client, "sort numbers from largest to smallest")
        assert before.results[0].id == "sort"
        assert before.meta.hybrid
        assert served.model_name == CURRENT
        assert before.meta.embedding_model == CURRENT  # note 70: no answer said which model embedded it

        answers: Counter[str] = Counter()
        stop = asyncio.Event()

        async def keep_asking() -> None:
            while not stop.is_set():
                reply = await client.query("acme", {"semanticQuery": "compute fibonacci numbers", "topK": 3})
                if isinstance(reply, ErrorReply):
                    answers[f"error:{reply.error.code}"] += 1
                else:
                    answers["dense" if "dense" in reply.meta.retrievers else "without dense"] += 1
                    answers["fib first" if reply.results and reply.results[0].id == "fib" else "other first"] += 1
                await asyncio.sleep(0.01)

        asker = asyncio.create_task(keep_asking())
        progress = PublishingDuringFill(deployment, embedder)
        try:
            job = ModelChange(settings, deployment.nats_url, deployment.database_url, progress)
            report = await job.run()
        finally:
            stop.set()
            await asker
        assert progress.rewritten is not None
        await progress.rewritten

        assert report.swapped
        assert report.previous_model == CURRENT
        assert report.model == NEXT
        # The rewritten document once more, unless the rewrite was projected before the fill read it (in 4 of 6
        # runs on 2026-12-02, where this asserted one more and failed the suite): either way its vector below is the
        # new text's.
        assert report.embedded >= len(CORPUS)
        # Every answer came, all but those in flight across the swap with the dense leg, and none mixed models.
        print(dict(answers))
        assert not [k for k in answers if k.startswith("error")], answers
        assert answers["without dense"] <= 2, answers
        assert answers["other first"] == 0, answers

        rows = await deployment.fetch("SELECT embedding_model, embedding_dim, next_embedding_model FROM deployment")
        assert [tuple(r) for r in rows] == [(NEXT, NEXT_DIM, None)]
        documents = await deployment.fetch(
            "SELECT id, content, embedding::text AS embedding, vector_dims(embedding) AS dims, embedding_model,"
            " token_signs FROM documents WHERE NOT deleted ORDER BY id"
        )
        assert {d["embedding_model"] for d in documents} == {NEXT}
        assert {d["dims"] for d in documents} == {NEXT_DIM}
        # MiniLM's token vectors are 384 wide, the projected model's vectors 256: no token signs for it.
        assert {d["token_signs"] for d in documents} == {None}
        columns = await deployment.fetch(
            "SELECT attname FROM pg_attribute WHERE attrelid = 'documents'::regclass AND attnum > 0"
            " AND NOT attisdropped AND attname LIKE '%next%' OR attname LIKE '%retired%'"
        )
        assert columns == []
        following = load_embedder(settings.next_model())  # type: ignore[arg-type]
        rewritten = next(d for d in documents if d["id"] == "csv")
        assert rewritten["content"].startswith("Parse comma separated")
        expected = following.embed_documents([rewritten["content"]])[0]
        assert float(np.dot(expected, _vector(rewritten["embedding"]))) > 0.999

        after = await _ask(client, "sort numbers from largest to smallest")
        assert after.results[0].id == "sort"
        assert after.meta.hybrid
        assert served.model_name == NEXT
        assert after.meta.embedding_model == NEXT

        # An ingester still on the old model: the projector embeds its document again by the new one.
        text = "Rotate the log files every night and keep a week of them."
        vector = embedder.embed_documents([text])[0]
        doc = document("logs", text, embedding=[float(x) for x in vector], embedding_model=CURRENT)
        ack = await deployment.publisher.publish(upsert("acme", doc))
        await deployment.wait_projected(ack.seq)
        rows = await deployment.fetch(
            "SELECT embedding::text AS embedding, embedding_model FROM documents WHERE id = 'logs'"
        )
        assert rows[0]["embedding_model"] == NEXT
        assert float(np.dot(following.embed_documents([text])[0], _vector(rows[0]["embedding"]))) > 0.999
        logs = await _ask(client, "log rotation schedule")
        assert logs.results[0].id == "logs"
        assert "dense" in logs.meta.retrievers
        dead = await deployment.js.stream_info(deployment.names.dlq_stream)
        assert dead.state.messages == 0

        # The stream still holds the old model's deltas: a rebuild embeds them again and verifies; stopped part way
        # and run again, it resumes (an operator's resume was refused: its fold read the old model's deltas as
        # rejected, and the vectors made again as the stream's).
        from ontofabric.services.ops.rebuild import Rebuild

        small_batches = settings.model_copy(update={"projector_batch_size": 2})
        with pytest.raises(Interrupted):
            await Rebuild(small_batches, deployment.nats_url, deployment.database_url, "acme", StopsAt("replay")).run()
        rebuilt = await Rebuild(
            small_batches, deployment.nats_url, deployment.database_url, "acme", RecordedProgress()
        ).run()
        assert rebuilt.swapped
        assert rebuilt.resumed_from > 0
        assert not rebuilt.rejected
        models = await deployment.fetch("SELECT DISTINCT embedding_model FROM documents WHERE NOT deleted")
        assert [r["embedding_model"] for r in models] == [NEXT]
        assert (await _ask(client, "sort numbers from largest to smallest")).results[0].id == "sort"

        # So does a compaction: the index's model decides what it lets through, as for the projector. A delta
        # of the new model, 256 wide, beside the old one's: before, no settings could compact them both.
        text = "Send an email when the nightly job fails."
        newer = following.embed_documents([text])[0]
        doc = document("mail", text, embedding=[float(x) for x in newer], embedding_model=NEXT)
        ack = await deployment.publisher.publish(upsert("acme", doc))
        await deployment.wait_projected(ack.seq)
        placement = Placement.of(settings, deployment.database_url)
        compacted = await compact(deployment.nc, deployment.names, settings, RecordedProgress(), placement)
        assert compacted.covers == ack.seq
        # A rebuild from the snapshot stopped part way resumes too (the same operator's).
        with pytest.raises(Interrupted):
            await Rebuild(
                small_batches, deployment.nats_url, deployment.database_url, "acme", StopsAt("snapshot")
            ).run()
        from_snapshot = await Rebuild(
            small_batches, deployment.nats_url, deployment.database_url, "acme", RecordedProgress()
        ).run()
        assert from_snapshot.swapped

        again = await ModelChange(settings, deployment.nats_url, deployment.database_url, RecordedProgress()).run()
        assert again.already
        assert not again.swapped
    finally:
        with contextlib.suppress(Exception):
            await worker.stop()
        await projector.stop()


class Interrupted(Exception):
    pass


class StopsAt(RecordedProgress):
    """Stops the run at its first step of one stage, as a crash would."""

    def __init__(self, stage: str) -> None:
        super().__init__()
        self._stage = stage

    def advance(self, name: str, amount: int = 1) -> None:
        super().advance(name, amount)
        if name == self._stage:
            raise Interrupted


class InterruptingProgress(RecordedProgress):
    """Stops the run once its first batch of documents is embedded, as a crash would."""

    def advance(self, name: str, amount: int = 1) -> None:
        super().advance(name, amount)
        raise Interrupted


async def _next_columns(deployment: Deployment) -> list[str]:
    rows = await deployment.fetch(
        "SELECT attname FROM pg_attribute WHERE attrelid = 'documents'::regclass AND NOT attisdropped"
        " AND attname LIKE '%\\_next' ORDER BY 1"
    )
    return [r["attname"] for r in rows]


async def test_an_interrupted_change_blocks_rebuilds_and_other_changes_and_resumes_or_is_discarded(
    deployment: Deployment, projector: ProjectorService, next_model: Path, embedder: Embedder
) -> None:
    from ontofabric.services.ops.rebuild import Rebuild, RebuildFailed

    with pytest.raises(ChangeRefused, match="no next model"):
        await ModelChange(deployment.settings, deployment.nats_url, deployment.database_url, RecordedProgress()).run()
    await deployment.wait_projected(await _publish_corpus(deployment, embedder))
    settings = _changing(deployment.settings, next_model)

    def change(progress: RecordedProgress, using: Settings = settings) -> ModelChange:
        return ModelChange(using, deployment.nats_url, deployment.database_url, progress, force=True)

    # The running projector was started without the next model: it could not follow the swap.
    unforced = ModelChange(settings, deployment.nats_url, deployment.database_url, RecordedProgress())
    with pytest.raises(ChangeRefused, match=r"1 running workers cannot serve minilm-projected-256: .*\(no embedder\)"):
        await unforced.run()
    assert await _next_columns(deployment) == []
    with pytest.raises(Interrupted):
        await change(InterruptingProgress()).run()
    assert await _next_columns(deployment) == [
        "embedded_seq_next",
        "embedding_model_next",
        "embedding_next",
        "token_signs_next",
    ]
    rows = await deployment.fetch("SELECT embedding_model, next_embedding_model FROM deployment")
    assert tuple(rows[0]) == (CURRENT, NEXT)
    # status says so (a model-change tester's said nothing of it), as a note: answers go on with the old model.
    placement = Placement.of(deployment.settings, deployment.database_url)
    (note,) = [n for n in (await deployment_status(deployment.nc, deployment.names, placement)).notes if CURRENT in n]
    assert f"a change of embedding model from {CURRENT!r} to {NEXT!r} is running or was interrupted" in note

    with pytest.raises(RebuildFailed, match="model change is under way"):
        await Rebuild(settings, deployment.nats_url, deployment.database_url, "acme", RecordedProgress()).run()
    other = settings.model_copy(update={"next_embedding_model": "another", "next_embedding_dim": 128})
    with pytest.raises(ChangeRefused, match="did not finish"):
        await change(RecordedProgress(), other).run()

    resumed = await change(RecordedProgress()).run()
    assert resumed.swapped
    assert resumed.embedded == 0
    assert await _next_columns(deployment) == []
    rows = await deployment.fetch("SELECT DISTINCT embedding_model FROM documents WHERE NOT deleted")
    assert [r["embedding_model"] for r in rows] == [NEXT]

    # This projector has no embedder: a delta still of the old model cannot be embedded again here. It is set
    # aside with its reason (to re-drive once a projector can), not retried for ever, and the rest goes on.
    stale = document("old", "still embedded by the old model", embedding=[0.1] * 384, embedding_model=CURRENT)
    fresh = document("new", "no vector at all")
    acks = await deployment.publisher.publish_many([upsert("acme", stale), upsert("acme", fresh)])
    await deployment.wait_projected(acks[-1].seq)
    (letter,) = await dead_letters(deployment.nc, deployment.names, Selection())
    assert (letter.reason, letter.original_seq) == ("embedding_model_mismatch", acks[0].seq)
    assert "cannot embed by it" in letter.detail
    assert [r["id"] for r in await deployment.fetch("SELECT id FROM documents WHERE id IN ('old', 'new')")] == ["new"]


async def test_a_second_change_goes_back_past_what_the_first_left(
    deployment: Deployment, next_model: Path, embedder: Embedder
) -> None:
    forth = _changing(deployment.settings, next_model)
    back = forth.model_copy(
        update={
            "embedding_model": NEXT,
            "embedding_model_path": next_model,
            "embedding_dim": NEXT_DIM,
            "next_embedding_model": CURRENT,
            "next_embedding_model_path": Settings().resolved_model_path(),
            "next_embedding_dim": 384,
        }
    )
    projector = ProjectorService(forth, deployment.nats_url_as("projector"), deployment.database_url)
    await projector.start()
    try:
        await deployment.wait_projected(await _publish_corpus(deployment, embedder))
        progress = RecordedProgress()
        assert (await ModelChange(forth, deployment.nats_url, deployment.database_url, progress).run()).swapped
        # What a first change could leave when dropping its old columns failed: a sequence column that says every
        # row is embedded already, and a retired column in the way of the next swap.
        async with deployment.session() as conn:
            await conn.execute(
                "ALTER TABLE documents ADD COLUMN embedded_seq_next bigint, ADD COLUMN embedding_retired vector(384)"
            )
            await conn.execute("UPDATE documents SET embedded_seq_next = stream_seq")
        report = await ModelChange(
            back, deployment.nats_url, deployment.database_url, RecordedProgress(), force=True
        ).run()
        assert report.swapped
        assert (report.previous_model, report.model) == (NEXT, CURRENT)
        assert report.embedded == len(CORPUS)
        documents = await deployment.fetch(
            "SELECT DISTINCT embedding_model, vector_dims(embedding) AS dims FROM documents WHERE NOT deleted"
        )
        assert [tuple(r) for r in documents] == [(CURRENT, 384)]
        # The 256-dimensional model made no token signs; going back to MiniLM makes them again (a model tester's:
        # late interaction stayed off until every document was ingested again).
        unsigned = await deployment.fetch("SELECT id FROM documents WHERE NOT deleted AND token_signs IS NULL")
        assert unsigned == []
        rows = await deployment.fetch("SELECT embedding_model, previous_embedding_models FROM deployment")
        assert tuple(rows[0]) == (CURRENT, [NEXT])
        assert await _next_columns(deployment) == []
    finally:
        await projector.stop()


async def test_an_unfinished_change_is_discarded_and_the_index_keeps_its_model(
    deployment: Deployment, projector: ProjectorService, next_model: Path, embedder: Embedder
) -> None:
    await deployment.wait_projected(await _publish_corpus(deployment, embedder))
    settings = _changing(deployment.settings, next_model)
    job = ModelChange(settings, deployment.nats_url, deployment.database_url, InterruptingProgress(), force=True)
    with pytest.raises(Interrupted):
        await job.run()
    assert await job.discard()
    assert await _next_columns(deployment) == []
    rows = await deployment.fetch("SELECT embedding_model, next_embedding_model FROM deployment")
    assert tuple(rows[0]) == (CURRENT, None)
    rows = await deployment.fetch("SELECT DISTINCT embedding_model FROM documents WHERE NOT deleted")
    assert [r["embedding_model"] for r in rows] == [CURRENT]
    assert not await job.discard()


async def test_a_next_model_that_cannot_load_is_refused_before_anything_changes(
    deployment: Deployment, projector: ProjectorService, next_model: Path, tmp_path: Path
) -> None:
    """A model tester's: another dimension than the model makes, or a directory without weights, ended in a
    traceback naming the live model's setting, with the change left begun (columns added, the deployment row set),
    and every later change refused until --discard."""
    wrong_dimension = _changing(deployment.settings, next_model).model_copy(update={"next_embedding_dim": 300})
    (tmp_path / "config.json").write_text("{}")
    no_weights = _changing(deployment.settings, tmp_path)
    for settings, said in ((wrong_dimension, "(ONTOFABRIC_NEXT_EMBEDDING_DIM)"), (no_weights, "cannot be loaded")):
        job = ModelChange(settings, deployment.nats_url, deployment.database_url, RecordedProgress(), force=True)
        with pytest.raises(ChangeRefused, match=re.escape(said)):
            await job.run()
        assert await _next_columns(deployment) == []
        rows = await deployment.fetch("SELECT embedding_model, next_embedding_model FROM deployment")
        assert tuple(rows[0]) == (CURRENT, None)


def test_an_ingester_on_a_model_whose_tokens_are_wider_than_its_vectors_sends_no_token_signs(
    next_model: Path,
) -> None:
    """A model with a projection after pooling (sentence-transformers' Dense layer) makes 256-dimensional vectors
    from 384-dimensional tokens: the ingester packed those signs as 256-dimensional tokens and failed ("8112 bytes
    are not a whole number of tokens of 32 bytes"). Late interaction cannot compare them with a query's anyway."""
    settings = _changing(Settings(), next_model).next_model()
    assert settings is not None
    embedder = load_embedder(settings, for_queries=False)
    embedded = embed_with_signs(embedder, ["def read_csv(path): return list(csv.reader(open(path)))"])
    assert embedded.token_signs == [b""]
    (sent,) = ChunkEmbedding.of(embedded, NEXT_DIM, token_vectors=True)
    assert (len(sent.vector), sent.token_vectors) == (NEXT_DIM, None)
