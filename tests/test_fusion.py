"""Reciprocal Rank Fusion and the versioned cache: pure logic."""

from __future__ import annotations

import pytest

from ontofabric.services.query.cache import CacheKey, VersionedCache, stable_hash
from ontofabric.services.query.fusion import Candidate, reciprocal_rank_fusion
from ontofabric.services.query.hints import reads_as_relationship_question


def _list(*ids: str) -> list[Candidate]:
    return [Candidate(i, 1.0 / (n + 1)) for n, i in enumerate(ids)]


def test_rrf_scores_are_sums_of_reciprocal_ranks() -> None:
    fused = reciprocal_rank_fusion({"dense": _list("a", "b", "c"), "keyword": _list("c", "a", "d")}, k=60)
    scores = {f.id: f.score for f in fused}
    assert scores["a"] == pytest.approx(1 / 61 + 1 / 62)
    assert scores["c"] == pytest.approx(1 / 63 + 1 / 61)
    assert scores["b"] == pytest.approx(1 / 62)
    assert scores["d"] == pytest.approx(1 / 63)
    assert [f.id for f in fused] == ["a", "c", "b", "d"]
    assert fused[0].found_by["dense"].rank == 1
    assert fused[0].found_by["keyword"].rank == 2


def test_single_list_keeps_its_order_and_relevance_is_normalised() -> None:
    fused = reciprocal_rank_fusion({"keyword": _list("x", "y", "z")})
    assert [f.id for f in fused] == ["x", "y", "z"]
    assert fused[0].relevance == pytest.approx(1.0)
    assert 0 < fused[-1].relevance < fused[0].relevance


def test_first_in_both_lists_has_relevance_one() -> None:
    fused = reciprocal_rank_fusion({"dense": _list("a", "b"), "keyword": _list("a", "c")})
    assert fused[0].id == "a"
    assert fused[0].relevance == pytest.approx(1.0)


def test_ties_break_by_best_rank_then_id_deterministically() -> None:
    # b is rank 1 in one list only, a is rank 1 in the other: equal scores, equal best rank -> id order.
    fused = reciprocal_rank_fusion({"dense": _list("b"), "keyword": _list("a")})
    assert [f.id for f in fused] == ["a", "b"]
    assert reciprocal_rank_fusion({"dense": _list("b"), "keyword": _list("a")}) == fused


def test_limit_and_duplicates() -> None:
    fused = reciprocal_rank_fusion({"dense": _list("a", "a", "b", "c")}, limit=2)
    assert [f.id for f in fused] == ["a", "b"]
    assert fused[1].found_by["dense"].rank == 3


def test_empty_inputs() -> None:
    assert reciprocal_rank_fusion({}) == []
    assert reciprocal_rank_fusion({"dense": []}) == []
    with pytest.raises(ValueError, match="k must be"):
        reciprocal_rank_fusion({"dense": _list("a")}, k=0)


def _key(version: str, query: str = "q", workspace: str = "w") -> CacheKey:
    return CacheKey(workspace, "main", version, stable_hash(query), stable_hash({}))


def test_cache_is_keyed_by_version() -> None:
    cache: VersionedCache[str] = VersionedCache(10)
    cache.put(_key("v1"), "old")
    assert cache.get(_key("v1")) == "old"
    assert cache.get(_key("v2")) is None


def test_cache_evicts_least_recently_used() -> None:
    cache: VersionedCache[str] = VersionedCache(2)
    cache.put(_key("v", "a"), "A")
    cache.put(_key("v", "b"), "B")
    assert cache.get(_key("v", "a")) == "A"  # a is now the most recent
    cache.put(_key("v", "c"), "C")
    assert cache.get(_key("v", "b")) is None
    assert cache.get(_key("v", "a")) == "A"
    assert len(cache) == 2


def test_invalidate_stale_drops_only_that_scope() -> None:
    cache: VersionedCache[str] = VersionedCache(10)
    cache.put(_key("v1", "a"), "A")
    cache.put(_key("v2", "b"), "B")
    cache.put(_key("v1", "a", workspace="other"), "other")
    assert cache.invalidate_stale("w", "main", "v2") == 1
    assert cache.get(_key("v2", "b")) == "B"
    assert cache.get(_key("v1", "a", workspace="other")) == "other"


def test_disabled_cache_stores_nothing() -> None:
    cache: VersionedCache[str] = VersionedCache(0)
    cache.put(_key("v"), "x")
    assert cache.get(_key("v")) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("what uses the projector", True),
        ("which classes implement Embedder", True),
        ("what depends on asyncpg", True),
        ("where is encode_token used", True),
        ("how does reciprocal rank fusion work", False),
        ("parse a markdown file", False),
    ],
)
def test_relationship_hint(text: str, expected: bool) -> None:
    assert reads_as_relationship_question(text) is expected
