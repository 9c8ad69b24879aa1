"""The local embedder: float32 and bfloat16 give the same unit vectors to within what retrieval can tell, are
cached apart, and the CPU's own flags decide which one `auto` picks."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ontofabric.shared import embedder as embedder_module
from ontofabric.shared.embedder import (
    Coalescer,
    Embedder,
    EmbedderMismatch,
    LoadedOnDemand,
    LocalSentenceTransformer,
    ModelMissing,
    ModelThread,
    build_embedder,
    cpu_has_bfloat16,
    load_sentence_transformer,
    pool_windows,
    wants_bfloat16,
    window_spans,
)
from ontofabric.shared.embedding_cache import EmbeddingCache, text_hash
from ontofabric.shared.late_interaction import pack_signs
from ontofabric.shared.onnx_models import AGREEMENT_PROBES, _disagreement, export_name, exported_encoder, reference_path
from ontofabric.shared.settings import Settings, SettingsUnusable

TEXTS = [
    "def parse_json(text):\n    return json.loads(text)",
    "PostgreSQL is a relational database with full-text search.",
    "a recipe for bread with flour and water",
]


@pytest.fixture(scope="module")
def embedders() -> dict[bool, LocalSentenceTransformer]:
    settings = Settings()
    return {
        bfloat16: LocalSentenceTransformer(
            settings.embedding_model,
            settings.resolved_model_path(),
            settings.embedding_dim,
            bfloat16=bfloat16,
            windows=1,
        )
        for bfloat16 in (False, True)
    }


def test_native_bfloat16_is_read_from_the_cpu_flags(tmp_path: Path) -> None:
    for flags, expected in [("fpu avx2 avx512f avx512_bf16", True), ("fpu amx_bf16 amx_tile", True),
                            ("fpu avx2 avx512f", False), ("fpu avx512_bf16x", False)]:  # fmt: skip
        (tmp_path / "cpuinfo").write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        assert cpu_has_bfloat16(tmp_path / "cpuinfo") is expected, flags
    assert cpu_has_bfloat16(tmp_path / "missing") is False


@pytest.mark.parametrize("native", [True, False])
def test_auto_follows_the_cpu(monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    monkeypatch.setattr(embedder_module, "cpu_has_bfloat16", lambda: native)
    assert wants_bfloat16("auto") is native
    assert wants_bfloat16("float32") is False
    assert wants_bfloat16("bfloat16") is True


def test_the_settings_decide_the_arithmetic_documents_are_read_in_and_queries_keep_float32() -> None:
    assert Settings().embedding_precision == "float32"  # stored vectors keep float32 unless asked
    for precision, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        built = build_embedder(Settings(embedding_precision=precision, query_embedding_runtime="torch"))
        assert isinstance(built, LocalSentenceTransformer)
        built.embed_query("a query")
        # A process that only answers queries never loads the bfloat16 copy.
        assert built._documents_model is None
        built.embed_documents(TEXTS[:1])
        assert built._documents_model is not None  # loaded by the documents' embedding itself
        assert next(built._documents_model.parameters()).dtype is dtype
        assert next(built._model.parameters()).dtype is torch.float32
        # Stored vectors say which model and reading made them, not the arithmetic: no ingest sends them again
        # for that alone (an ingester on a CPU without native bfloat16 beside one with it).
        assert built.vectors_name == build_embedder(Settings(embedding_precision="float32")).cache_name


def test_a_bfloat16_embedder_embeds_queries_as_a_float32_one_does(
    embedders: dict[bool, LocalSentenceTransformer],
) -> None:
    for query in ["how are deltas dead-lettered", "PostgreSQL full-text search ranks documents " * 40]:
        full, half = (embedders[b].embed_query(query) for b in (False, True))
        assert np.array_equal(full, half)


def test_bfloat16_and_float32_embed_alike(embedders: dict[bool, LocalSentenceTransformer]) -> None:
    vectors = {bfloat16: e.embed_documents(TEXTS) for bfloat16, e in embedders.items()}
    for v in vectors.values():
        assert v.dtype == np.float32
        assert np.linalg.norm(v, axis=1) == pytest.approx(1.0, abs=1e-5)  # unit length whatever the arithmetic
    assert np.sum(vectors[False] * vectors[True], axis=1).min() > 0.995


def test_the_two_precisions_are_cached_apart(tmp_path: Path, embedders: dict[bool, LocalSentenceTransformer]) -> None:
    cache = EmbeddingCache(tmp_path / "embeddings.sqlite")
    try:
        full = cache.embed(embedders[False], TEXTS)
        half = cache.embed(embedders[True], TEXTS)  # not served float32's vectors
        hashes = [text_hash(t) for t in TEXTS]
        stored_full = cache.get_many(embedders[False].cache_name, hashes)
        stored_half = cache.get_many(embedders[True].cache_name, hashes)
    finally:
        cache.close()
    assert embedders[False].cache_name != embedders[True].cache_name
    assert not np.array_equal(full.vectors, half.vectors)
    assert np.array_equal(np.stack([stored_full[h][0] for h in hashes]), full.vectors)
    assert np.array_equal(np.stack([stored_half[h][0] for h in hashes]), half.vectors)
    assert [stored_full[h][1] for h in hashes] == full.token_signs


def test_one_pass_gives_the_vector_and_the_tokens_the_model_read(
    embedders: dict[bool, LocalSentenceTransformer],
) -> None:
    embedder = embedders[False]
    texts = ["short", "a longer text about parsing json strings into python objects"]
    vectors, tokens = embedder.embed_with_tokens(texts)
    assert np.array_equal(vectors, embedder.embed_documents(texts))
    # Batched together the short text is padded to the long one's length; the padding is not its tokens.
    assert len(tokens[0]) == len(embedder.embed_with_tokens(texts[:1])[1][0]) < len(tokens[1])
    for t in tokens:
        assert np.linalg.norm(t, axis=1) == pytest.approx(1.0, abs=1e-5)


def test_a_cache_directory_that_cannot_be_one_is_named(tmp_path: Path) -> None:
    # An operator tester's ONTOFABRIC_CACHE_DIR naming a file: the ingest ended in a FileExistsError traceback.
    (tmp_path / "afile").write_text("")
    with pytest.raises(SettingsUnusable, match=r"ONTOFABRIC_CACHE_DIR: the embedding cache .* cannot be opened"):
        EmbeddingCache(tmp_path / "afile" / "embeddings.sqlite")


def test_the_cache_computes_only_what_it_lacks_and_keeps_the_token_signs(
    tmp_path: Path, embedders: dict[bool, LocalSentenceTransformer], monkeypatch: pytest.MonkeyPatch
) -> None:
    embedder = embedders[False]
    cache = EmbeddingCache(tmp_path / "embeddings.sqlite")
    try:
        first = cache.embed(embedder, TEXTS[:2])
        sent: list[list[str]] = []
        real = embedder.embed_with_tokens

        def counting(texts: list[str], batch_size: int = 64) -> tuple[np.ndarray, list[np.ndarray]]:
            sent.append(list(texts))
            return real(texts, batch_size)

        monkeypatch.setattr(embedder, "embed_with_tokens", counting)
        again = cache.embed(embedder, TEXTS)
    finally:
        cache.close()
    assert sent == [TEXTS[2:]]
    assert np.array_equal(again.vectors[:2], first.vectors)
    assert again.token_signs[:2] == first.token_signs
    _, tokens = real(TEXTS)
    assert again.token_signs == [pack_signs(t) for t in tokens]


def test_a_cache_file_from_before_token_signs_is_upgraded_in_place(
    tmp_path: Path, embedders: dict[bool, LocalSentenceTransformer]
) -> None:
    path = tmp_path / "embeddings.sqlite"
    old = sqlite3.connect(path)
    old.execute(
        "CREATE TABLE embeddings (model TEXT NOT NULL, content_hash TEXT NOT NULL, vector BLOB NOT NULL,"
        " PRIMARY KEY (model, content_hash))"
    )
    stale = np.zeros(384, np.float32)  # a vector without signs is not served: it is computed again, with them
    old.execute(
        "INSERT INTO embeddings VALUES (?, ?, ?)", (embedders[False].cache_name, text_hash(TEXTS[0]), stale.tobytes())
    )
    old.commit()
    old.close()
    cache = EmbeddingCache(path)
    try:
        embedded = cache.embed(embedders[False], TEXTS[:1])
    finally:
        cache.close()
    assert np.array_equal(embedded.vectors, embedders[False].embed_documents(TEXTS[:1]))
    assert embedded.token_signs[0]


# --- long texts: read in windows ------------------------------------------------------------------------------


def test_windows_end_where_words_end_and_stop_at_the_limit() -> None:
    # Ten tokens of four words: "alpha" is 3 tokens, "beta" 2, "gamma" 4, "delta" 1 (offsets are the tokens' spans).
    word_ids = [0, 0, 0, 1, 1, 2, 2, 2, 2, 3]
    offsets = [(i, i + 1) for i in range(10)]
    assert window_spans(offsets, word_ids, width=4, limit=10) == [(0, 3), (3, 5), (5, 9), (9, 10)]
    assert window_spans(offsets, word_ids, width=4, limit=2) == [(0, 3), (3, 5)]
    assert window_spans(offsets, word_ids, width=6, limit=10) == [(0, 5), (5, 10)]
    # A word longer than a window is cut inside it rather than looping.
    assert window_spans(offsets, [0] * 10, width=4, limit=10) == [(0, 4), (4, 8), (8, 10)]
    assert window_spans(offsets[:3], word_ids[:3], width=4, limit=10) == [(0, 3)]


def test_pooled_windows_count_the_opening_twice_and_the_rest_by_their_tokens() -> None:
    first, second = np.eye(3, dtype=np.float32)[0], np.eye(3, dtype=np.float32)[1]
    alone = pool_windows(first[None, :], [200])
    assert np.array_equal(alone, first)
    pooled = pool_windows(np.stack([first, second]), [200, 50])
    # first + (200 * first + 50 * second) / 250 = 1.8 first + 0.2 second, at unit length
    assert pooled == pytest.approx(np.array([1.8, 0.2, 0.0]) / np.hypot(1.8, 0.2), abs=1e-6)
    assert float(np.linalg.norm(pooled)) == pytest.approx(1.0, abs=1e-6)
    # The opening counts twice: the same windows in another order pool to another vector.
    assert not np.allclose(pool_windows(np.stack([second, first]), [50, 200]), pooled)


@pytest.fixture(scope="module")
def windowed() -> LocalSentenceTransformer:
    settings = Settings()
    return LocalSentenceTransformer(
        settings.embedding_model, settings.resolved_model_path(), settings.embedding_dim, windows=4
    )


LONG_OPENING = " ".join(["The river carries water from the mountains down to the sea through the valley."] * 30)
LONG_TEXT = LONG_OPENING + " Finally, the database index stores embeddings for vector search over documents."


def test_a_long_text_is_read_past_what_the_model_reads_at_once(
    windowed: LocalSentenceTransformer, embedders: dict[bool, LocalSentenceTransformer]
) -> None:
    tokenizer = windowed._model.tokenizer
    assert len(tokenizer(LONG_OPENING, add_special_tokens=False)["input_ids"]) > windowed._model.max_seq_length
    first_only = embedders[False]
    vector, tokens = windowed.embed_with_tokens([LONG_TEXT])
    cut_vector, cut_tokens = first_only.embed_with_tokens([LONG_TEXT])
    # What the first window cannot see moves the vector towards it; the token vectors stay the first window's.
    query = windowed.embed_query("vector search index for embeddings in a database")
    assert float(vector[0] @ query) > float(cut_vector[0] @ query) + 0.02
    assert np.array_equal(tokens[0], cut_tokens[0])
    assert len(tokens[0]) == windowed._model.max_seq_length
    assert windowed.cache_name != first_only.cache_name


def test_texts_that_fit_embed_as_they_did_and_each_window_fits_the_model(
    windowed: LocalSentenceTransformer, embedders: dict[bool, LocalSentenceTransformer]
) -> None:
    assert np.array_equal(windowed.embed_documents(TEXTS), embedders[False].embed_documents(TEXTS))
    very_long = " ".join(f"word{i} value" for i in range(3000))
    pieces, owners = windowed._read_in_windows([TEXTS[0], very_long])
    assert owners == [0, 1, 1, 1, 1]  # the short text whole, the long one in at most four windows
    tokenizer = windowed._model.tokenizer
    lengths = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in pieces[1:]]
    assert max(lengths) <= windowed._model.max_seq_length - 2
    # Each window, tokenised on its own, gives the tokens it had inside the whole text, in order.
    read = [token for piece in pieces[1:] for token in tokenizer(piece, add_special_tokens=False)["input_ids"]]
    assert read == tokenizer(very_long, add_special_tokens=False, verbose=False)["input_ids"][: len(read)]


def test_a_batch_of_long_and_short_texts_embeds_each_as_it_would_alone(windowed: LocalSentenceTransformer) -> None:
    texts = [LONG_TEXT, TEXTS[1], "", "   ", LONG_OPENING, TEXTS[0]]
    for batch in (texts, texts[::-1]):
        vectors, tokens = windowed.embed_with_tokens(batch)
        assert len(vectors) == len(tokens) == len(batch)
        for text, vector, token_rows in zip(batch, vectors, tokens, strict=True):
            alone_vectors, alone_tokens = windowed.embed_with_tokens([text])
            assert np.allclose(vector, alone_vectors[0], atol=1e-5), text[:20]
            assert token_rows.shape == alone_tokens[0].shape
    empty_vectors, empty_tokens = windowed.embed_with_tokens([])
    assert empty_vectors.shape == (0, windowed.dimension)
    assert empty_tokens == []


def test_windows_without_a_fast_tokenizer_are_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings()
    real = embedder_module.load_sentence_transformer

    class WithoutOffsets:
        """The real model behind a tokenizer that, like transformers' Python tokenizers, reports no offsets."""

        def __init__(self, path: Path, bfloat16: bool) -> None:
            self.model = real(path, bfloat16)
            self.tokenizer = SimpleNamespace(is_fast=False)

        def __getattr__(self, name: str) -> object:
            return getattr(self.model, name)

    monkeypatch.setattr(embedder_module, "load_sentence_transformer", WithoutOffsets)
    model = (settings.embedding_model, settings.resolved_model_path(), settings.embedding_dim)
    with pytest.raises(EmbedderMismatch, match="ONTOFABRIC_EMBEDDING_WINDOWS=1"):
        LocalSentenceTransformer(*model, windows=4)
    assert LocalSentenceTransformer(*model, windows=1).embed_documents(TEXTS).shape == (3, settings.embedding_dim)


async def _slow_run(work: Callable[[], Sequence[str]]) -> Sequence[str]:
    """A model thread that takes a while: callers arriving meanwhile must wait for the next batch."""
    await asyncio.sleep(0.05)
    return work()


async def test_callers_arriving_while_a_batch_runs_share_the_next_one() -> None:
    batches: list[list[int]] = []

    def work(items: list[int]) -> list[str]:
        batches.append(items)
        return [f"out-{item}" for item in items]

    coalescer: Coalescer[int, str] = Coalescer(work, _slow_run, max_batch=4)
    first = asyncio.create_task(coalescer.submit(0))
    await asyncio.sleep(0.01)  # the first batch is running, alone: a lone caller waits for no one
    rest = await asyncio.gather(*(coalescer.submit(n) for n in range(1, 7)))
    assert await first == "out-0"
    assert rest == [f"out-{n}" for n in range(1, 7)]  # each caller gets its own item's result
    assert batches == [[0], [1, 2, 3, 4], [5, 6]]  # at most max_batch at once


async def test_a_batch_weighs_at_most_its_limit_and_a_heavier_item_goes_alone() -> None:
    batches: list[list[str]] = []

    def work(items: list[str]) -> list[str]:
        batches.append(items)
        return items

    coalescer: Coalescer[str, str] = Coalescer(work, _slow_run, max_batch=8, weight=len, max_weight=10)
    first = asyncio.create_task(coalescer.submit("a"))
    await asyncio.sleep(0.01)
    await asyncio.gather(*(coalescer.submit(text) for text in ["bbbb", "cccc", "dddd", "e" * 30, "f"]))
    await first
    assert batches == [["a"], ["bbbb", "cccc"], ["dddd"], ["e" * 30], ["f"]]


async def test_a_failing_item_fails_only_its_own_caller() -> None:
    batches: list[list[int]] = []

    def work(items: list[int]) -> list[str]:
        batches.append(items)
        if 1 in items:
            raise ValueError("the model failed on item 1")
        return [str(item) for item in items]

    coalescer: Coalescer[int, str] = Coalescer(work, _slow_run, max_batch=2)
    outcomes = await asyncio.gather(*(coalescer.submit(n) for n in range(4)), return_exceptions=True)
    assert outcomes[0] == "0"  # batched with the failing item, served when run alone
    assert isinstance(outcomes[1], ValueError)
    assert outcomes[2:] == ["2", "3"]
    assert batches == [[0, 1], [0], [1], [2, 3]]
    wrong: Coalescer[int, str] = Coalescer(lambda items: [], _slow_run, max_batch=2)
    with pytest.raises(RuntimeError, match="0 results for a batch of 1"):
        await asyncio.gather(wrong.submit(1), wrong.submit(2))


async def test_a_caller_that_gave_up_costs_nothing_and_none_waits_for_ever() -> None:
    batches: list[list[int]] = []

    def work(items: list[int]) -> list[str]:
        batches.append(items)
        return [str(item) for item in items]

    coalescer: Coalescer[int, str] = Coalescer(work, _slow_run, max_batch=8)
    first = asyncio.create_task(coalescer.submit(0))
    await asyncio.sleep(0.01)  # batch [0] is running; 1, 2 and 3 queue for the next
    waiting = [asyncio.create_task(coalescer.submit(n)) for n in (1, 2, 3)]
    await asyncio.sleep(0)
    waiting[1].cancel()
    assert await first == "0"
    assert [await waiting[0], await waiting[2]] == ["1", "3"]
    assert batches == [[0], [1, 3]]

    # The loop closing cancels the batch being run: its callers are cancelled, not left waiting.
    stuck = asyncio.create_task(coalescer.submit(4))
    await asyncio.sleep(0.01)
    for task in asyncio.all_tasks():
        if task.get_coro().__qualname__.startswith("Coalescer._run_batches"):  # type: ignore[union-attr]
            task.cancel()
    async with asyncio.timeout(1):
        with pytest.raises(asyncio.CancelledError):
            await stuck


def test_a_coalescer_serves_one_event_loop_after_another() -> None:
    coalescer: Coalescer[int, str] = Coalescer(lambda items: [str(i) for i in items], _slow_run, max_batch=8)
    assert asyncio.run(coalescer.submit(1)) == "1"
    assert asyncio.run(coalescer.submit(2)) == "2"  # a loop per test, as pytest-asyncio runs them


async def test_queries_embedded_together_equal_each_embedded_alone(
    embedders: dict[bool, LocalSentenceTransformer],
) -> None:
    model = embedders[False]
    queries = ["parse json", "relational database full-text search", "bread", TEXTS[0], "how to sort a dict by value"]
    alone = [await model.embed_query_with_tokens_async(q) for q in queries]
    together = await asyncio.gather(*(model.embed_query_with_tokens_async(q) for q in queries))
    for (vector, tokens), (alone_vector, alone_tokens) in zip(together, alone, strict=True):
        assert np.allclose(vector, alone_vector, atol=1e-5)
        assert tokens.shape == alone_tokens.shape
        assert np.allclose(tokens, alone_tokens, atol=1e-4)


async def test_queries_compute_with_their_own_thread_count_and_other_threads_keep_theirs() -> None:
    settings = Settings()
    before = torch.get_num_threads()
    if before < 2:
        pytest.skip("one core: there is no smaller thread count to set")
    embedder = LocalSentenceTransformer(
        settings.embedding_model, settings.resolved_model_path(), settings.embedding_dim, windows=1, query_threads=1
    )
    assert await embedder.on_model_thread(torch.get_num_threads) == 1
    assert torch.get_num_threads() == before
    fresh = ThreadPoolExecutor(max_workers=1)  # a thread whose first use of torch comes after the model thread's
    try:
        assert fresh.submit(torch.get_num_threads).result() == before
    finally:
        fresh.shutdown()
    vector, _ = await embedder.embed_query_with_tokens_async("read a file")
    assert np.allclose(vector, embedder.embed_query("read a file"), atol=1e-5)  # the same vector either way


QUERIES = [
    "how to read a json file",
    "def flatten(items): return [x for sub in items for x in sub]",
    "PostgreSQL full-text search ranks documents by term frequency " * 30,  # longer than one window
    "q",
]


def query_embedder(cache_dir: Path | None, *, bfloat16: bool = False) -> LocalSentenceTransformer:
    settings = Settings()
    return LocalSentenceTransformer(
        settings.embedding_model,
        settings.resolved_model_path(),
        settings.embedding_dim,
        bfloat16=bfloat16,
        windows=4,
        query_threads=1,
        query_runtime="onnx",
        cache_dir=cache_dir,
    )


Embedded = Sequence[tuple[np.ndarray, np.ndarray]]


def assert_same_embeddings(found: Embedded, expected: Embedded) -> None:
    assert len(found) == len(expected)
    for (vector, tokens), (vector_expected, tokens_expected) in zip(found, expected, strict=True):
        assert float(vector @ vector_expected) > 1 - 1e-5
        assert tokens.shape == tokens_expected.shape
        assert float(np.min(np.sum(tokens * tokens_expected, axis=1))) > 1 - 1e-5


def test_queries_on_onnx_runtime_embed_as_pytorch_does(tmp_path: Path) -> None:
    embedder = query_embedder(tmp_path)
    assert embedder.query_runtime == "onnx"
    (exported,) = (tmp_path / "onnx").glob("*.onnx")
    assert exported.stat().st_mode & 0o777 == 0o644  # readable by the other users of a shared cache
    # A batch padded to its longest text, and a text read in windows, each as PyTorch embeds it.
    assert_same_embeddings(embedder._embed_queries(QUERIES), embedder._embed_queries_on_torch(QUERIES))
    alone = embedder.embed_query(QUERIES[0])
    assert float(alone @ embedder.embed_documents([QUERIES[0]])[0]) > 1 - 1e-5


def test_the_export_is_made_once_and_a_damaged_one_again(tmp_path: Path) -> None:
    query_embedder(tmp_path)
    (exported,) = (tmp_path / "onnx").glob("*.onnx")
    made = exported.stat().st_mtime_ns
    assert query_embedder(tmp_path).query_runtime == "onnx"
    assert exported.stat().st_mtime_ns == made  # read, not made again

    left_by_a_killed_export = tmp_path / "onnx" / f"{exported.name}abc.partial"
    left_by_a_killed_export.write_bytes(b"half a model")
    exported.write_bytes(b"not a model")
    embedder = query_embedder(tmp_path)
    assert embedder.query_runtime == "onnx"
    assert exported.stat().st_size > 1_000_000
    assert not left_by_a_killed_export.exists()
    assert_same_embeddings(embedder._embed_queries(QUERIES[:2]), embedder._embed_queries_on_torch(QUERIES[:2]))


def test_without_a_writable_cache_the_export_is_private_and_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    temporary = tmp_path / "temporary"
    temporary.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(temporary))
    for cache_dir in (blocked, None):
        embedder = query_embedder(cache_dir)
        assert embedder.query_runtime == "onnx"
        assert list(temporary.iterdir()) == []  # the session holds the model; no file is left behind
        assert_same_embeddings(embedder._embed_queries(QUERIES[:1]), embedder._embed_queries_on_torch(QUERIES[:1]))


def test_a_missing_runtime_and_document_only_processes_stay_on_pytorch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert Settings.model_fields["query_embedding_runtime"].default == "onnx"
    # Queries are embedded in float32 whatever documents are read in.
    assert query_embedder(tmp_path / "half", bfloat16=True).query_runtime == "onnx"
    documents_only = build_embedder(Settings(cache_dir=tmp_path), for_queries=False)
    assert isinstance(documents_only, LocalSentenceTransformer)
    assert documents_only.query_runtime == "torch"
    assert not (tmp_path / "onnx").exists()

    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime" else real(name, *a))
    embedder = query_embedder(tmp_path)
    assert embedder.query_runtime == "torch"
    assert_same_embeddings(embedder._embed_queries(QUERIES[:1]), embedder._embed_queries_on_torch(QUERIES[:1]))


DOCUMENTS = [LONG_TEXT, TEXTS[1], "", "   ", LONG_OPENING, " ".join(f"word{i} value" for i in range(3000)), TEXTS[0]]


def test_documents_on_the_export_embed_as_pytorch_does_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ingest embeds its documents with the export the query side checked, without loading PyTorch (5-7 s of a
    small edit's ingest): the same vectors and token rows, long texts read in the same windows."""
    pytorch = query_embedder(tmp_path)  # exports, and keeps PyTorch's embeddings of the probes beside the export
    model_path = Settings().resolved_model_path()
    assert exported_encoder(model_path, 1, 0, tmp_path) is None  # checked for another reading of long texts
    encoder = exported_encoder(model_path, 4, 0, tmp_path)
    assert encoder is not None
    # Batches cut by their size, or by the tokens one run may read (a window of 256 alone: a tester's ingest
    # peaked at 2.1 GB with 64 windows to a run).
    for batch_size, tokens_per_run in ((64, 4096), (2, 4096), (64, 300)):
        monkeypatch.setattr("ontofabric.shared.onnx_models.TOKENS_PER_RUN", tokens_per_run)
        vectors, tokens = encoder.embed_with_tokens(DOCUMENTS, batch_size)
        expected_vectors, expected_tokens = pytorch.embed_with_tokens(DOCUMENTS)
        found = list(zip(vectors, tokens, strict=True))
        assert_same_embeddings(found, list(zip(expected_vectors, expected_tokens, strict=True)))
    empty_vectors, empty_tokens = encoder.embed_with_tokens([])
    assert (len(empty_vectors), empty_tokens) == (0, [])


def test_a_query_process_finding_the_export_checked_starts_without_pytorch(tmp_path: Path) -> None:
    """A query worker loaded PyTorch and the model at every start (seconds, and hundreds of MB) only to check the
    export and embed nothing but queries, which the export embeds."""
    first = query_embedder(tmp_path)
    assert first._pytorch is not None  # nothing checked yet: PyTorch made the export and checked it
    expected = first._embed_queries_on_torch(QUERIES)
    later = query_embedder(tmp_path)
    assert later.query_runtime == "onnx"
    assert later._pytorch is None
    assert_same_embeddings(later._embed_queries(QUERIES), expected)
    # A document, or a query on PyTorch, loads it then.
    vectors = later.embed_documents(QUERIES[:1])
    assert later._pytorch is not None
    assert float(vectors[0] @ expected[0][0]) > 1 - 1e-5
    # An export checked for another reading of long texts is checked again, on PyTorch.
    settings = Settings()
    other = LocalSentenceTransformer(
        settings.embedding_model, settings.resolved_model_path(), settings.embedding_dim,
        windows=2, query_runtime="onnx", cache_dir=tmp_path,
    )  # fmt: skip
    assert other._pytorch is not None
    assert other.query_runtime == "onnx"
    with pytest.raises(EmbedderMismatch, match="makes 384-dimensional vectors; the deployment is set to 768"):
        LocalSentenceTransformer(
            settings.embedding_model, settings.resolved_model_path(), 768,
            windows=4, query_runtime="onnx", cache_dir=tmp_path,
        )  # fmt: skip


def _damage(path: Path, how: str) -> None:
    with np.load(path) as stored:
        arrays = dict(stored)
    if how == "other probes":
        arrays["probes"] = np.asarray([*AGREEMENT_PROBES[:-1], "another text"])
    elif how == "other versions":  # made by another PyTorch or transformers
        arrays["versions"] = np.asarray(str(arrays["versions"]).replace("torch==", "torch==0.0."))
    elif how == "not finite":  # NaN agreed with anything once
        arrays["tokens1"] = np.full_like(arrays["tokens1"], np.nan)
    else:  # what PyTorch gave, moved: the export no longer agrees with it
        arrays["vector0"] = np.roll(arrays["vector0"], 1)
    with path.open("wb") as out:
        np.savez(out, **arrays)


ON_DEMAND_PROBE = """
import sys
from pathlib import Path
from ontofabric.shared.embedder import LoadedOnDemand
from ontofabric.shared.settings import Settings
embedder = LoadedOnDemand(Settings(cache_dir=Path(sys.argv[1])))
vectors = embedder.embed_documents(["def area(radius):\\n    return 3.14 * radius ** 2"])
print(embedder.on_onnx, "torch" in sys.modules, vectors.shape)
"""


def _ingest_process(cache_dir: Path, **env: str) -> list[str]:
    """What a new process embedding one document on demand, as an ingest does, reports: on ONNX Runtime, PyTorch
    imported, the vectors' shape."""
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", ON_DEMAND_PROBE, str(cache_dir)],
        env={**os.environ, "ONTOFABRIC_LOG_LEVEL": "ERROR", **env}, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return out.strip().splitlines()[-1].split(" ", 2)


def test_an_ingest_embeds_on_the_checked_export_or_else_on_pytorch(tmp_path: Path) -> None:
    # No export yet: PyTorch, and no ONNX session (where no export ever agrees, every ingest would make one).
    assert _ingest_process(tmp_path) == ["False", "True", "(1, 384)"]
    assert not (tmp_path / "onnx").exists()
    query_embedder(tmp_path)  # a query worker starts: it makes the export and keeps PyTorch's reference
    (exported,) = (tmp_path / "onnx").glob("*.onnx")
    kept = reference_path(exported, Settings().embedding_windows)
    assert kept.is_file()
    assert kept.stat().st_mode & 0o777 == 0o644
    assert exported.name == export_name(Settings().resolved_model_path())
    # The next ingest: the export alone, PyTorch never imported.
    assert _ingest_process(tmp_path) == ["True", "False", "(1, 384)"]
    # Asked for PyTorch, or documents in bfloat16: PyTorch.
    assert _ingest_process(tmp_path, ONTOFABRIC_DOCUMENT_EMBEDDING_RUNTIME="torch")[:2] == ["False", "True"]
    assert _ingest_process(tmp_path, ONTOFABRIC_EMBEDDING_PRECISION="bfloat16")[:2] == ["False", "True"]
    # A reference kept for other probes or by other versions, one with values that are not finite, or one the
    # export no longer agrees with, is not trusted: PyTorch. The next query worker checks the export again on
    # PyTorch and keeps its own reference.
    for how in ("other probes", "other versions", "not finite", "moved"):
        _damage(kept, how)
        assert _ingest_process(tmp_path)[:2] == ["False", "True"], how
        query_embedder(tmp_path)
        assert _ingest_process(tmp_path)[:2] == ["True", "False"], how
    kept.write_bytes(b"half a file")
    on_demand = LoadedOnDemand(Settings(cache_dir=tmp_path))
    on_demand.embed_documents(["x"])
    assert on_demand.loaded
    assert not on_demand.on_onnx


def test_the_export_is_named_after_every_file_of_the_model(tmp_path: Path) -> None:
    """A reviewer's: named after the weights alone, an export outlived a change of the model's configuration (the
    length it reads: cosine 0.83 to PyTorch's vectors on a long text), or of weights in files of other names."""
    import shutil

    model = Settings().resolved_model_path()
    copy = tmp_path / model.name
    shutil.copytree(model, copy)
    assert export_name(copy) == export_name(model)
    config = copy / "sentence_bert_config.json"
    config.write_text(config.read_text().replace("256", "128"))
    changed = export_name(copy)
    assert changed != export_name(model)
    (copy / "model.safetensors").rename(copy / "model-00001-of-00001.safetensors")
    assert export_name(copy) not in (changed, export_name(model))


def test_a_reference_that_cannot_be_kept_leaves_the_checked_export_in_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez", disk_full)
    embedder = query_embedder(tmp_path)
    assert embedder.query_runtime == "onnx"
    assert [p.suffix for p in (tmp_path / "onnx").iterdir() if p.suffix != ".lock"] == [".onnx"]  # no partial left
    assert exported_encoder(Settings().resolved_model_path(), 4, 0, tmp_path) is None  # nothing kept to check by
    monkeypatch.undo()
    query_embedder(tmp_path)
    encoder = exported_encoder(Settings().resolved_model_path(), 4, 0, tmp_path)
    assert encoder is not None
    assert encoder.embed_with_tokens([])[0].shape == (0, 384)  # as PyTorch's empty batch


def test_outputs_that_are_not_finite_never_agree() -> None:
    row = np.full((3, 4), 0.5, np.float32)
    expected = [(row[0], row)]
    assert _disagreement([(row[0], row)], expected) < 1e-6
    broken = np.full((3, 4), np.nan, np.float32)
    assert _disagreement([(broken[0], broken)], expected) == 2.0
    assert _disagreement([(row[0], row)], [(broken[0], broken)]) == 2.0  # a kept reference read from disk
    assert _disagreement([None], expected) == 2.0
    # A model that projects its vectors after the transformer: an export of the transformer alone is wider (CI's
    # log, 2026-12-03: a ValueError from the product instead of a plain disagreement).
    assert _disagreement([(np.full(6, 0.5, np.float32), row)], expected) == 2.0


def test_a_model_the_exporter_cannot_trace_stays_on_pytorch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def cannot_trace(transformer: object, target: Path) -> None:
        raise RuntimeError("unsupported operator")

    monkeypatch.setattr("ontofabric.shared.onnx_models._export", cannot_trace)
    assert query_embedder(tmp_path).query_runtime == "torch"


TELEMETRY_PROBE = """
import sys
import numpy as np
import onnx
from onnx import TensorProto, helper

graph = helper.make_graph(
    [helper.make_node("Identity", ["x"], ["y"])], "identity",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
)
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
model.ir_version = 8
if sys.argv[1] == "project":
    from ontofabric.shared.onnx_models import onnxruntime_module
    onnxruntime = onnxruntime_module()
else:
    import onnxruntime
session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
assert session.run(None, {"x": np.ones(1, dtype=np.float32)})[0][0] == 1.0
"""


def _files_after_a_session(home: Path, how: str) -> list[Path]:
    """What a process that runs one ONNX Runtime session leaves under its home and cache directories."""
    import os
    import subprocess
    import sys

    from ontofabric.shared.onnx_models import TELEMETRY_SWITCH

    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k != TELEMETRY_SWITCH}
    env |= {"HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")}
    subprocess.run([sys.executable, "-c", TELEMETRY_PROBE, how], env=env, check=True, timeout=120)
    return [path for path in home.rglob("*") if path.is_file()]


def test_onnx_runtime_records_no_telemetry(tmp_path: Path) -> None:
    """ONNX Runtime loaded the project's way keeps no telemetry store; loaded plainly, this build does (else the
    check would prove nothing)."""
    plain = _files_after_a_session(tmp_path / "plain", "plain")
    if not any(path.name == "onnxruntime.db" for path in plain):
        pytest.skip("this onnxruntime build keeps no telemetry store")
    assert _files_after_a_session(tmp_path / "project", "project") == []


class _Jobs:
    """Jobs for a model thread, by name: each records that it ran; ``blocker`` first waits for ``release`` (the
    thread is busy while others queue); ``broken`` raises."""

    def __init__(self, blocker: str) -> None:
        self.blocker = blocker
        self.release = threading.Event()
        self.ran: list[str] = []

    def __call__(self, name: str) -> str:
        if name == self.blocker:
            self.release.wait(5)
        self.ran.append(name)
        if name == "broken":
            raise ValueError("no such token")
        return name


async def test_the_model_thread_takes_each_workspaces_jobs_in_turn() -> None:
    """A red team's finding: 16 costly requests of one workspace queued their late interaction first-come on the
    model thread, and another tenant's query embedding waited 2.4 s behind them."""
    jobs = _Jobs(blocker="flood-0")
    with ThreadPoolExecutor(max_workers=1) as executor:
        thread = ModelThread(executor)
        flood = [asyncio.create_task(thread.run(partial(jobs, f"flood-{n}"), "flood")) for n in range(8)]
        await asyncio.sleep(0.05)
        light = asyncio.create_task(thread.run(partial(jobs, "light"), "light"))
        await asyncio.sleep(0.05)
        jobs.release.set()
        assert await light == "light"
        await asyncio.gather(*flood)
    # The one at work when it came, one of the flood's in its turn, then its own: not behind the whole flood.
    assert jobs.ran.index("light") == 2, jobs.ran
    assert [name for name in jobs.ran if name != "light"] == [f"flood-{n}" for n in range(8)]  # each turn in order


async def test_a_model_thread_job_whose_caller_gave_up_is_not_run_and_an_error_reaches_its_caller() -> None:
    jobs = _Jobs(blocker="busy")
    with ThreadPoolExecutor(max_workers=1) as executor:
        thread = ModelThread(executor)
        busy = [asyncio.create_task(thread.run(partial(jobs, name), "a")) for name in ("busy", "next")]
        await asyncio.sleep(0.05)
        abandoned = asyncio.create_task(thread.run(partial(jobs, "abandoned"), "a"))
        await asyncio.sleep(0.05)
        abandoned.cancel()
        jobs.release.set()
        await asyncio.gather(*busy)
        with pytest.raises(ValueError, match="no such token"):
            await thread.run(partial(jobs, "broken"), "b")
    assert jobs.ran == ["busy", "next", "broken"]


def test_a_model_path_that_holds_no_model_is_said_in_a_line(tmp_path: Path) -> None:
    """An independent tester's finding: a path that is no directory, or an empty one, ended in the Hub client's
    traceback about repo ids (for `up`, `query-worker`, `ingest` and `reembed`)."""
    for where in (tmp_path / "nonexistent", tmp_path):
        with pytest.raises(ModelMissing, match=r"no embedding model at .*ONTOFABRIC_EMBEDDING_MODEL_PATH"):
            load_sentence_transformer(where, bfloat16=False)


def test_an_embedder_loaded_on_demand_loads_only_for_a_text_the_cache_lacks(embedder: Embedder, tmp_path: Path) -> None:
    """An ingest that sends nothing new, or whose texts the cache holds, waited ~5 s for the model to load."""
    on_demand = LoadedOnDemand(Settings(cache_dir=tmp_path))
    names = (on_demand.model_name, on_demand.cache_name, on_demand.vectors_name, on_demand.dimension)
    assert names == (embedder.model_name, embedder.cache_name, embedder.vectors_name, embedder.dimension)
    cache = EmbeddingCache(tmp_path / "embeddings.sqlite")
    known = cache.embed(embedder, ["def first():\n    return 1"])
    again = cache.embed(on_demand, ["def first():\n    return 1"])
    assert not on_demand.loaded
    assert np.array_equal(again.vectors, known.vectors)
    assert again.token_signs == known.token_signs
    fresh = cache.embed(on_demand, ["def second():\n    return 2"])
    assert on_demand.loaded
    expected = embedder.embed_documents(["def second():\n    return 2"])[0]
    assert float(fresh.vectors[0] @ expected) == pytest.approx(1.0, abs=1e-5)
    cache.close()
