"""The local embedder: float32 and bfloat16 give the same unit vectors to within what retrieval can tell, are
cached apart, and the CPU's own flags decide which one `auto` picks."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import pytest
import torch

from ontofabric.shared import embedder as embedder_module
from ontofabric.shared.embedder import LocalSentenceTransformer, build_embedder, cpu_has_bfloat16, wants_bfloat16
from ontofabric.shared.embedding_cache import EmbeddingCache, text_hash
from ontofabric.shared.late_interaction import pack_signs
from ontofabric.shared.settings import Settings

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
            settings.embedding_model, settings.resolved_model_path(), settings.embedding_dim, bfloat16=bfloat16
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


def test_the_settings_decide_the_arithmetic_the_model_runs_in() -> None:
    assert Settings().embedding_precision == "float32"  # stored vectors keep float32 unless asked
    for precision, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        built = build_embedder(Settings(embedding_precision=precision))
        assert isinstance(built, LocalSentenceTransformer)
        assert next(built._model.parameters()).dtype is dtype


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
