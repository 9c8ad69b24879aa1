"""The local embedder: float32 and bfloat16 give the same unit vectors to within what retrieval can tell, and the
CPU's own flags decide which one `auto` picks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ontofabric.shared.embedder import LocalSentenceTransformer, cpu_has_bfloat16, wants_bfloat16
from ontofabric.shared.settings import Settings

TEXTS = [
    "def parse_json(text):\n    return json.loads(text)",
    "PostgreSQL is a relational database with full-text search.",
    "a recipe for bread with flour and water",
]


def test_native_bfloat16_is_read_from_the_cpu_flags(tmp_path: Path) -> None:
    for flags, expected in [("fpu avx2 avx512f avx512_bf16", True), ("fpu amx_bf16 amx_tile", True),
                            ("fpu avx2 avx512f", False), ("fpu avx512_bf16x", False)]:  # fmt: skip
        (tmp_path / "cpuinfo").write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        assert cpu_has_bfloat16(tmp_path / "cpuinfo") is expected, flags
    assert cpu_has_bfloat16(tmp_path / "missing") is False


def test_precision_settings_resolve_on_this_cpu() -> None:
    assert wants_bfloat16("float32") is False
    assert wants_bfloat16("bfloat16") is True
    assert wants_bfloat16("auto") is cpu_has_bfloat16()
    assert Settings().embedding_precision == "float32"  # stored vectors keep float32 unless asked


def test_bfloat16_and_float32_embed_alike() -> None:
    settings = Settings()
    vectors = {
        bfloat16: LocalSentenceTransformer(
            settings.embedding_model, settings.resolved_model_path(), settings.embedding_dim, bfloat16=bfloat16
        ).embed_documents(TEXTS)
        for bfloat16 in (False, True)
    }
    for v in vectors.values():
        assert v.dtype == np.float32
        assert np.linalg.norm(v, axis=1) == pytest.approx(1.0, abs=1e-5)  # unit length whatever the arithmetic
    agreement = np.sum(vectors[False] * vectors[True], axis=1)
    assert agreement.min() > 0.995
    # Same neighbours: each text is nearest to itself across precisions.
    assert list((vectors[False] @ vectors[True].T).argmax(axis=1)) == [0, 1, 2]
