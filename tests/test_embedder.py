"""The local embedder: float32 and bfloat16 give the same unit vectors to within what retrieval can tell, are
cached apart, and the CPU's own flags decide which one `auto` picks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ontofabric.shared import embedder as embedder_module
from ontofabric.shared.embedder import LocalSentenceTransformer, build_embedder, cpu_has_bfloat16, wants_bfloat16
from ontofabric.shared.embedding_cache import EmbeddingCache, text_hash
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
    assert not np.array_equal(full, half)
    assert np.array_equal(np.stack([stored_full[h] for h in hashes]), full)
    assert np.array_equal(np.stack([stored_half[h] for h in hashes]), half)
