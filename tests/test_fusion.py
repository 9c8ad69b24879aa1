"""Reciprocal Rank Fusion and the versioned cache: pure logic."""

from __future__ import annotations

import pytest

from ontofabric.services.query.cache import CacheKey, drop_stale, stable_hash
from ontofabric.services.query.core import Candidate
from ontofabric.services.query.fusion import reciprocal_rank_fusion
from ontofabric.services.query.hints import reads_as_relationship_question
from ontofabric.shared.lru import LruCache


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
    cache: LruCache[CacheKey, str] = LruCache(10)
    cache.put(_key("v1"), "old")
    assert cache.get(_key("v1")) == "old"
    assert cache.get(_key("v2")) is None


def test_cache_evicts_least_recently_used() -> None:
    cache: LruCache[CacheKey, str] = LruCache(2)
    cache.put(_key("v", "a"), "A")
    cache.put(_key("v", "b"), "B")
    assert cache.get(_key("v", "a")) == "A"  # a is now the most recent
    cache.put(_key("v", "c"), "C")
    assert cache.get(_key("v", "b")) is None
    assert cache.get(_key("v", "a")) == "A"
    assert len(cache) == 2


def test_invalidate_stale_drops_only_that_workspace() -> None:
    cache: LruCache[CacheKey, str] = LruCache(10)
    cache.put(_key("v1", "a"), "A")
    cache.put(_key("v2", "b"), "B")
    cache.put(_key("v1", "a", workspace="other"), "other")
    assert drop_stale(cache, "w", lambda branch: "v2") == 1
    assert cache.get(_key("v2", "b")) == "B"
    assert cache.get(_key("v1", "a", workspace="other")) == "other"


def test_disabled_cache_stores_nothing() -> None:
    cache: LruCache[CacheKey, str] = LruCache(0)
    cache.put(_key("v"), "x")
    assert cache.get(_key("v")) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("what uses the projector", True),
        ("which classes implement Embedder", True),
        ("what depends on asyncpg", True),
        ("where is encode_token used", True),
        ("what does encode_token call", True),  # a relation question the lookups answer
        ("base classes of Embedder", True),
        ("how does reciprocal rank fusion work", False),
        ("parse a markdown file", False),
    ],
)
def test_relationship_hint(text: str, expected: bool) -> None:
    assert reads_as_relationship_question(text) is expected


def test_convex_fusion_weights_normalised_scores() -> None:
    from ontofabric.services.query.fusion import convex_fusion

    dense = [Candidate("a", 0.9), Candidate("b", 0.5), Candidate("c", 0.1)]
    keyword = [Candidate("c", 10.0), Candidate("d", 5.0), Candidate("a", 0.0)]
    fused = {f.id: f for f in convex_fusion({"dense": dense, "keyword": keyword}, {"dense": 0.7, "keyword": 0.3})}
    assert fused["a"].score == pytest.approx(0.7 * 1.0 + 0.3 * 0.0)
    assert fused["b"].score == pytest.approx(0.7 * 0.5)
    assert fused["c"].score == pytest.approx(0.7 * 0.0 + 0.3 * 1.0)
    assert fused["d"].score == pytest.approx(0.3 * 0.5)
    assert all(0.0 <= f.relevance <= 1.0 for f in fused.values())


def test_keyword_gap_measures_how_far_the_top_hit_stands_out() -> None:
    from ontofabric.services.query.fusion import keyword_gap

    assert keyword_gap([], 10.0) == 0.0
    flat = [Candidate(str(i), 5.0) for i in range(10)]
    assert keyword_gap(flat, 10.0) == pytest.approx(0.0)
    decisive = [Candidate("a", 10.0)] + [Candidate(str(i), 2.0) for i in range(9)]
    assert keyword_gap(decisive, 20.0) == pytest.approx(0.8)
    # A list that ran out: the places it did not fill score 0, and the top hit's saturation bounds the gap.
    short = [Candidate("a", 10.0), Candidate("b", 5.0)]
    assert keyword_gap(short, 20.0) == pytest.approx(0.5)  # its saturation
    assert keyword_gap(short, 10.0) == pytest.approx((10 - 5 / 9) / 10)
    five_alike = [Candidate(str(i), 4.0) for i in range(5)]  # the only documents holding a rare word, alike
    assert keyword_gap(five_alike, 4.0) == pytest.approx(5 / 9)
    assert keyword_gap(five_alike, None) == 0.0
    # Without a ceiling (a backend stating none) the gap is over the hits, as before (a review's).
    weak = [Candidate("a", 10.0)] + [Candidate(str(i), 2.0) for i in range(4)]
    assert keyword_gap(weak, None) == pytest.approx(0.8)
    # One more weak hit, the list's tenth, moves nothing (a review's: the bound held below ten hits only).
    nine = [Candidate("a", 10.0)] + [Candidate(str(i), 0.5) for i in range(8)]
    assert keyword_gap(nine, 40.0) == pytest.approx(keyword_gap([*nine, Candidate("z", 0.5)], 40.0))
    # A lone hit: its saturation stands in, so a weak lone match is no decisive one.
    assert keyword_gap([Candidate("only", 3.0)], 10.0) == pytest.approx(0.3)
    assert keyword_gap([Candidate("only", 3.0)], None) == 0.0


def test_adaptive_fusion_does_not_let_one_weak_keyword_hit_win() -> None:
    from ontofabric.services.query.fusion import adaptive_fusion

    # A realistic dense list: a hundred candidates, cosine falling from 0.75 to 0.25.
    dense = [Candidate("d0", 0.75)] + [Candidate(f"x{i}", 0.75 - 0.005 * (i + 1)) for i in range(99)]
    fused, weight, _ = adaptive_fusion(dense, [Candidate("k1", 4.5)], keyword_ceiling=10.0)
    assert fused[0].id == "d0"
    assert weight == pytest.approx(0.55)
    zero, _, _ = adaptive_fusion(dense, [Candidate("k1", 0.0)], keyword_ceiling=None)  # no division by zero
    assert zero[0].id == "d0"


def test_adaptive_fusion_finds_the_few_documents_that_alone_hold_a_rare_word() -> None:
    """An outside tester's: five documents sent without vectors, the only ones holding a rare word and alike in
    BM25, stood out by nothing (a gap of 0 over the hits there were), and dense's cosines of unrelated code filled
    the answer."""
    from ontofabric.services.query.fusion import adaptive_fusion

    dense = [Candidate(f"code{i}", 0.22 - 0.001 * i) for i in range(50)]
    rare = [Candidate(f"bare{i}", 7.5) for i in range(5)]
    fused, weight, gap = adaptive_fusion(dense, rare, keyword_ceiling=7.5, keyword_hits_dense={})
    assert {hit.id for hit in fused[:5]} == {f"bare{i}" for i in range(5)}
    assert gap == pytest.approx(5 / 9)
    assert weight == pytest.approx(4 / 9)


def test_adaptive_fusion_lets_the_keyword_list_lead_for_a_query_that_is_one_identifier() -> None:
    """An agent tester's: a name written once, in one long file, was its only keyword hit, saturated 0.077, and
    came 34th under dense's cosines for a name the model never learned. As one identifier, the keyword list leads."""
    from ontofabric.services.query.fusion import adaptive_fusion

    dense = [Candidate(f"x{i}", 0.45 - 0.002 * i) for i in range(50)] + [Candidate("file", 0.2)]
    lone = [Candidate("file", 0.77)]
    as_words, weight_as_words, _ = adaptive_fusion(dense, lone, keyword_ceiling=10.0)
    as_name, weight_as_name, gap = adaptive_fusion(dense, lone, keyword_ceiling=10.0, lexical=True)
    assert [hit.id for hit in as_words].index("file") > 10
    assert (as_name[0].id, weight_as_name, gap) == ("file", pytest.approx(0.05), 1.0)
    assert weight_as_words > 0.9
    # With no keyword hit at all, dense alone still orders the answer.
    nothing, weight_of_nothing, _ = adaptive_fusion(dense, [], keyword_ceiling=None, lexical=True)
    assert (nothing[0].id, weight_of_nothing) == ("x0", pytest.approx(0.95))


def test_a_dense_list_that_found_nothing_near_weighs_less_than_the_keyword_gap_alone_gives_it() -> None:
    """An outside tester's "47% identical": the one abstract holding both words was first by BM25, but the list was
    flat (the words common), so dense took 0.77 of the weight with a top cosine of 0.26, and it came 75th. Here a
    top cosine of 0.30 keeps a third of the weight."""
    from ontofabric.services.query.fusion import adaptive_fusion, dense_share, fuse

    assert [dense_share(c, 0.2, 0.5) for c in (0.1, 0.2, 0.35, 0.5, 0.9)] == pytest.approx([0, 0, 0.5, 1, 1])
    flat = [Candidate("holder", 6.0)] + [Candidate(f"k{i}", 5.0 - 0.1 * i) for i in range(20)]
    unrelated = [Candidate(f"d{i}", 0.30 - 0.001 * i) for i in range(50)]
    cosines = {"holder": 0.05, **{f"k{i}": 0.12 for i in range(20)}}
    as_before, weight_before, gap = adaptive_fusion(unrelated, flat, 10.0, keyword_hits_dense=cosines)
    trusting, weight, same_gap = adaptive_fusion(
        unrelated, flat, 10.0, keyword_hits_dense=cosines, dense_trust=(0.2, 0.5)
    )
    assert [hit.id for hit in as_before].index("holder") > 10
    assert trusting[0].id == "holder"
    assert (same_gap, weight) == (gap, pytest.approx(weight_before * (0.30 - 0.2) / (0.5 - 0.2)))
    # A dense list that found something near keeps the weight the gap gives it.
    near = [Candidate("d0", 0.62), *unrelated]
    _, kept, _ = adaptive_fusion(near, flat, 10.0, keyword_hits_dense=cosines, dense_trust=(0.2, 0.5))
    assert kept == pytest.approx(weight_before)
    # _meta says the share dense kept, only where it lowered the weight (a review's: not for a query that is one
    # identifier, whose keyword list leads with the least weight on dense anyway).
    lists = {"dense": unrelated, "keyword": flat}
    _, lowered = fuse(lists, "adaptive", rrf_k=60, dense_weight=0.5, keyword_ceiling=10.0, dense_trust=(0.2, 0.5))
    assert lowered is not None
    assert lowered.parameters["denseShare"] == pytest.approx(1 / 3, abs=1e-4)
    _, named = fuse(lists, "adaptive", rrf_k=60, dense_weight=0.5, keyword_ceiling=10.0, lexical=True,
                    dense_trust=(0.2, 0.5))  # fmt: skip
    assert named is not None
    assert "denseShare" not in named.parameters


def test_a_list_that_ran_out_is_weighed_by_the_query_terms_its_hits_hold_not_by_their_length() -> None:
    """A made-up word written once in a 90 KB function (and in its file's chunk), nowhere else: BM25's length
    normalisation saturated both at 0.014, dense took 0.95 of the weight with cosines for a word it never learned,
    and neither was in the top 5. Holding every query term, they lead; a hit holding a part of the query weighs
    that part, and without coverage (a backend stating none, a list filtered or cut) the saturation bounds the gap
    as before."""
    from ontofabric.services.query.fusion import adaptive_fusion, keyword_gap

    dense = [Candidate(f"x{i}", 0.45 - 0.002 * i) for i in range(50)]
    holders = [Candidate("function", 0.154), Candidate("file", 0.150)]
    cosines = {"function": 0.10, "file": 0.12}  # dense prefers the file: BM25's order still decides
    fused, weight, gap = adaptive_fusion(dense, holders, keyword_ceiling=10.9, keyword_hits_dense=cosines)
    assert [hit.id for hit in fused].index("function") > 10  # as before: by saturation alone
    every_term = {"function": 1.0, "file": 1.0}
    fused, weight, gap = adaptive_fusion(
        dense, holders, keyword_ceiling=10.9, keyword_hits_dense=cosines, keyword_coverage=every_term
    )
    assert [hit.id for hit in fused[:2]] == ["function", "file"]
    assert gap == pytest.approx((0.154 - 0.150 / 9) / 0.154)
    assert weight == pytest.approx(1 - gap)
    # A decisive BM25 top hit keeps its lead over a weak one that dense likes better (a review's).
    decisive = [Candidate("a", 8.0), Candidate("b", 2.0)]
    ordered, _, _ = adaptive_fusion(
        dense, decisive, 10.0, keyword_hits_dense={"a": 0.2, "b": 0.5}, keyword_coverage={"a": 1.0, "b": 1.0}
    )
    assert [hit.id for hit in ordered[:2]] == ["a", "b"]
    # Half the query's weight held: the gap is bounded by that half.
    assert keyword_gap(holders, 10.9, {"function": 0.5}) == pytest.approx(0.5)
    assert keyword_gap([holders[0]], 10.9, {"function": 0.5}) == pytest.approx(0.5)
    # A list of ten or more is read by its scores alone, whatever the coverage.
    full = [Candidate(str(i), 5.0) for i in range(10)]
    assert keyword_gap(full, 10.0, dict.fromkeys(map(str, range(10)), 1.0)) == pytest.approx(0.0)
    long_list, _, _ = adaptive_fusion(dense, full, 10.0, keyword_coverage=dict.fromkeys(map(str, range(10)), 1.0))
    assert {hit.id: hit.score for hit in long_list}["0"] == pytest.approx(0.95 * (0.45 - 0.002 * 49) + 0.05 * 0.5)


def test_adaptive_fusion_trusts_a_decisive_keyword_list_more() -> None:
    from ontofabric.services.query.fusion import adaptive_fusion

    dense = [Candidate("d1", 0.8), Candidate("k1", 0.5)] + [Candidate(f"x{i}", 0.4) for i in range(8)]
    flat_keyword = [Candidate("k1", 5.0)] + [Candidate(f"y{i}", 4.8) for i in range(9)]
    decisive_keyword = [Candidate("k1", 9.0)] + [Candidate(f"y{i}", 1.0) for i in range(9)]
    flat, flat_weight, _ = adaptive_fusion(dense, flat_keyword, keyword_ceiling=10.0)
    sharp, sharp_weight, gap = adaptive_fusion(dense, decisive_keyword, keyword_ceiling=10.0)
    assert flat_weight > sharp_weight
    assert sharp_weight == pytest.approx(1 - gap)
    assert flat[0].id == "d1"  # a flat keyword list does not overturn the dense top hit
    assert sharp[0].id == "k1"  # a decisive keyword hit that dense also found wins
    assert {"dense", "keyword"} == set(sharp[0].found_by)


def test_adaptive_fusion_weighs_keyword_only_hits_by_their_own_cosine() -> None:
    from ontofabric.services.query.fusion import adaptive_fusion

    dense = [Candidate("d1", 0.9), Candidate("d2", 0.6)]
    keyword = [Candidate("near", 2.0), Candidate("far", 2.0), Candidate("bare", 2.0), Candidate("d2", 1.0)]
    # Not looked up: every keyword-only hit takes dense's lowest cosine, 0.6, and they tie.
    guessed, weight, _ = adaptive_fusion(dense, keyword, keyword_ceiling=4.0)
    scores = {f.id: f.score for f in guessed}
    assert scores["near"] == scores["far"] == scores["bare"]
    # Looked up: each its own; the list's own score wins for an id in both; one without a cosine (no embedding)
    # takes the lowest of all rather than an upper bound.
    looked_up = {"near": 0.7, "far": 0.2, "d2": 0.0}
    fused, same_weight, _ = adaptive_fusion(dense, keyword, 4.0, keyword_hits_dense=looked_up)
    scores = {f.id: f.score for f in fused}
    assert same_weight == weight
    assert scores["near"] == pytest.approx(weight * 0.7 + (1 - weight) * 0.5)
    assert scores["d2"] == pytest.approx(weight * 0.6 + (1 - weight) * 0.25)
    assert scores["bare"] == pytest.approx(scores["far"])
    assert [f.id for f in fused].index("near") < [f.id for f in fused].index("far")


def test_fuse_dispatches_and_reports_parameters() -> None:
    from ontofabric.services.query.fusion import fuse

    lists = {"dense": _list("a", "b"), "keyword": _list("b", "c")}
    _, rrf = fuse(lists, "rrf", rrf_k=60, dense_weight=0.5)
    _, convex = fuse(lists, "convex", rrf_k=60, dense_weight=0.3)
    _, adaptive = fuse(lists, "adaptive", rrf_k=60, dense_weight=0.5, keyword_ceiling=2.0)
    single, none = fuse({"dense": _list("a", "b")}, "adaptive", rrf_k=60, dense_weight=0.5)
    assert rrf is not None
    assert rrf.parameters == {"k": 60}
    assert convex is not None
    assert convex.parameters == {"denseWeight": 0.3}
    assert adaptive is not None
    assert set(adaptive.parameters) == {"denseWeight", "keywordGap"}
    assert none is None
    assert [f.id for f in single] == ["a", "b"]


def test_fuse_judges_a_lone_keyword_hit_over_every_query_term() -> None:
    from ontofabric.services.query.fusion import fuse

    lists = {"dense": [Candidate("a", 0.7), Candidate("b", 0.6)], "keyword": [Candidate("k", 3.0)]}
    # Over the terms some document has, the lone hit is 3/5 saturated; over every query term, 3/10.
    _, matched_terms = fuse(lists, "adaptive", rrf_k=60, dense_weight=0.5, keyword_ceiling=5.0)
    _, all_terms = fuse(lists, "adaptive", rrf_k=60, dense_weight=0.5, keyword_ceiling=5.0, query_ceiling=10.0)
    assert matched_terms is not None
    assert all_terms is not None
    assert matched_terms.parameters["keywordGap"] == pytest.approx(0.6)
    assert all_terms.parameters["keywordGap"] == pytest.approx(0.3)
