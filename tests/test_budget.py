"""Bounded answers without servers: a reply cut to its budget and to the message size, and saying what it cut."""

from __future__ import annotations

import json
from unittest.mock import ANY

import pytest

from ontofabric.contracts import ExpandedContext, FoundBy, QueryMeta, QueryResponse, SearchResult
from ontofabric.contracts.query import CollapsedResult, Freshness
from ontofabric.services.query.budget import (
    BYTES_PER_TOKEN,
    NO_NOTES,
    RESERVE_BYTES,
    VARYING_META_BYTES,
    TooLarge,
    _report,
    _with_budget,
    cut_to,
    fit_reply,
)

META = QueryMeta(
    ontology_version="1-a", workspace="w", branch="main", hybrid=True, reranked=False, cache_hit=False,
    backend="postgres-bm25", retrievers=["dense", "keyword"], timings_ms={},
)  # fmt: skip


HELD = VARYING_META_BYTES // BYTES_PER_TOKEN
"""The tokens a budget holds for what two answers to one question may differ by."""


def _answer(contents: list[str | None]) -> QueryResponse:
    results = [
        SearchResult(
            id=f"d{i}", score=1 - i / 100, rank=i + 1, content=content, object_type="t.T", source_domain="t",
            metadata={"filePath": f"f{i}.py"}, found_by=[],
        )
        for i, content in enumerate(contents)
    ]  # fmt: skip
    return QueryResponse(results=results, _meta=META)


def _fit(response: QueryResponse, max_tokens: int, payload: int = 1_000_000) -> tuple[QueryResponse, bytes]:
    body = fit_reply(response, max_tokens, payload)
    return QueryResponse.model_validate_json(body), body


def test_an_answer_within_its_budget_is_whole_and_says_its_size() -> None:
    answer = _answer(["short text"] * 3)
    fitted, body = _fit(answer, 8000)
    assert fitted.results == answer.results
    assert fitted.meta.budget is not None
    assert fitted.meta.budget.max_tokens == 8000
    # The reply's own size, the figure included (a tester's replies came 1 or 2 under what they said).
    assert fitted.meta.budget.estimated_tokens == -(-len(body) // BYTES_PER_TOKEN)
    assert (fitted.meta.budget.contents_cut, fitted.meta.budget.contents_omitted) == ([], 0)
    assert fitted.meta.budget.reserved_tokens == 0  # nothing was cut, so nothing was kept free
    assert fitted.meta.degraded == []


def test_contents_past_the_budget_are_cut_then_left_out_and_every_result_stays() -> None:
    line = "def step(): return 1\n"
    answer = _answer([line * 60 for _ in range(10)])  # about 1,300 bytes of JSON each
    fitted, body = _fit(answer, HELD + 1000)  # 4,000 bytes beside the room held for what varies
    assert len(body) <= (HELD + 1000) * BYTES_PER_TOKEN
    assert [r.id for r in fitted.results] == [r.id for r in answer.results]  # every result, in its rank
    whole = [r for r in fitted.results if r.content == line * 60]
    assert [r.id for r in whole] == [r.id for r in fitted.results[: len(whole)]]  # the best ranks whole
    cut = fitted.results[len(whole)]
    assert cut.content_truncated is True
    assert cut.content is not None
    assert line * 60 != cut.content
    assert (line * 60).startswith(cut.content)
    assert cut.content.endswith("\n")  # at a line's end
    assert cut.content_length == len(line * 60)
    rest = fitted.results[len(whole) + 1 :]
    assert rest
    assert all(r.content is None and r.content_length == len(line * 60) for r in rest)
    assert fitted.meta.budget is not None
    assert fitted.meta.budget.contents_cut == [cut.id]
    assert fitted.meta.budget.contents_omitted == len(rest)
    assert fitted.meta.budget.results_dropped == 0
    assert fitted.meta.budget.estimated_tokens <= HELD + 1000
    assert fitted.meta.degraded == []  # the caller's own bound: not a failure
    # The room kept free is said, and accounts for the gap to the budget (an agent read content left out "for
    # size" beside an estimate well under its maxTokens, a tester's).
    reserved = fitted.meta.budget.reserved_tokens
    assert reserved == -(-(RESERVE_BYTES + VARYING_META_BYTES) // BYTES_PER_TOKEN)
    assert fitted.meta.budget.estimated_tokens + reserved >= HELD + 1000 - 400 // BYTES_PER_TOKEN


def test_a_content_below_one_left_out_is_left_out_too() -> None:
    """A tester's: the first result's content was left out (too little room for a slice of it) and the second's,
    shorter, kept: contents go lowest ranks first."""
    long, short = "def step(): return 1\n" * 60, "x = 1\n"
    for budget in range(300, 1200, 10):
        fitted, _ = _fit(_answer([long, short, short]), budget)
        kept = [r.content is not None for r in fitted.results]
        assert kept == sorted(kept, reverse=True), (budget, kept)  # no content after one left out


def test_the_counts_of_results_placed_first_count_only_those_kept() -> None:
    """A tester's: 3 results left of 50 by maxTokens, and exactSymbolMatches still said 50."""
    answer = _answer(["x = 1\n" * 40 for _ in range(30)])
    placed = [FoundBy(retriever="symbol", rank=1, score=1.0)]
    results = [r.model_copy(update={"found_by": placed}) for r in answer.results]
    named = answer.model_copy(
        update={"results": results, "meta": answer.meta.model_copy(update={"exact_symbol_matches": 30})}
    )
    fitted, _ = _fit(named, 500)
    assert fitted.meta.budget is not None
    assert fitted.meta.budget.results_dropped > 0
    assert fitted.meta.exact_symbol_matches == len(fitted.results)
    whole, _ = _fit(named, 100_000)
    assert whole.meta.exact_symbol_matches == 30


def test_a_budget_too_small_for_every_result_keeps_the_best_ranks() -> None:
    answer = _answer([None] * 100)
    fitted, body = _fit(answer, 1000)
    assert len(body) <= 1000 * BYTES_PER_TOKEN
    assert 0 < len(fitted.results) < 100
    assert [r.id for r in fitted.results] == [f"d{i}" for i in range(len(fitted.results))]
    assert fitted.meta.budget is not None
    assert fitted.meta.budget.results_dropped == 100 - len(fitted.results)


def test_as_many_results_are_kept_as_fit_whatever_their_sizes() -> None:
    """The count of results kept is added up from each result's size: it must be the largest count that fits, as
    when each count was tried whole."""
    answer = _answer([None] * 100)
    varied = answer.model_copy(update={"results": [
        r.model_copy(update={"metadata": {"filePath": "f" * (i * 37 % 90), "symbolFqn": "ü" * (i % 7)}})
        for i, r in enumerate(answer.results)
    ]})  # fmt: skip
    for max_tokens in range(1000, 3000, 53):
        fitted, body = _fit(varied, max_tokens)
        kept = len(fitted.results)
        assert len(body) <= max_tokens * BYTES_PER_TOKEN
        if kept < 100:  # one more would not have fitted with the report's reserve, counted as before: whole
            more = _with_budget(varied, _report(max_tokens), varied.results[: kept + 1], NO_NOTES)
            held = RESERVE_BYTES + VARYING_META_BYTES
            assert len(more.model_dump_json().encode()) + held > max_tokens * BYTES_PER_TOKEN


def test_a_result_too_large_to_list_alone_leaves_its_place_to_those_below_it() -> None:
    """Metadata of any size is valid: a first hit with a 40 kB field once emptied the whole answer (a tester's
    finding). It alone is left out, with its contents; the results below it that fit are listed as before."""
    answer = _answer(["def f(): pass\n"] * 6)
    huge = answer.results[0].model_copy(update={"metadata": {"filePath": "f0.py", "notes": "n" * 40_000}})
    answer = answer.model_copy(update={"results": [huge, *answer.results[1:]]})
    for max_tokens in (1000, 8000):
        fitted, body = _fit(answer, max_tokens)
        assert len(body) <= max_tokens * BYTES_PER_TOKEN
        assert [r.id for r in fitted.results] == ["d1", "d2", "d3", "d4", "d5"]
        assert [r.rank for r in fitted.results] == [2, 3, 4, 5, 6]  # the gap shows where it was
        assert all(r.content == "def f(): pass\n" for r in fitted.results)
        assert fitted.meta.budget is not None
        assert (fitted.meta.budget.results_dropped, fitted.meta.budget.contents_omitted) == (1, 0)
    # One that fits alone is not skipped for those below it: the best ranks are kept, as above.
    fitted, _ = _fit(answer, 12_000)
    assert [r.id for r in fitted.results] == [f"d{i}" for i in range(6)]


def test_what_the_meta_says_about_results_left_out_goes_with_them() -> None:
    """Chunks collapsed into a result, and context linked from one, leave with it: kept, they filled the least
    budget there is, so that a deep answer failed, or kept one result in a hundred."""
    answer = _answer([None] * 100)
    collapsed = [CollapsedResult(id=f"nested-{i}-{j}", into=f"d{i}") for i in range(100) for j in range(2)]
    context = [
        ExpandedContext(
            linked_type=f"pkg.Linked{i}", link_name="calls", direction="outgoing", linked_from_type="t.T",
            linked_from_document_id=f"d{i}", representative_document_id=f"r{i}",
        )
        for i in range(0, 100, 10)
    ]  # fmt: skip
    answer = answer.model_copy(
        update={"meta": answer.meta.model_copy(update={"collapsed": collapsed, "expanded_context": context})}
    )
    # Results fill the budget first and notes the room they leave, which moves with _meta's own size: budgets a
    # result's size apart leave every amount of room once, some of them room for notes.
    kept_notes = 0
    for max_tokens in range(1200, 1260, 4):
        fitted, body = _fit(answer, max_tokens)
        assert len(body) <= max_tokens * BYTES_PER_TOKEN
        kept = {r.id for r in fitted.results}
        assert len(kept) >= 5
        assert {entry.into for entry in fitted.meta.collapsed} <= kept
        assert {entry.linked_from_document_id for entry in fitted.meta.expanded_context} <= kept
        assert len(fitted.meta.expanded_context) < len(context)
        assert fitted.meta.expanded_context_truncated is False  # it says what expansion left out, not the budget
        assert fitted.meta.budget is not None
        assert fitted.meta.budget.collapsed_dropped == len(collapsed) - len(fitted.meta.collapsed)
        assert fitted.meta.budget.context_dropped == len(context) - len(fitted.meta.expanded_context)
        kept_notes += bool(fitted.meta.collapsed)
    assert kept_notes
    whole, _ = _fit(answer, 250_000)
    assert (whole.meta.collapsed, whole.meta.expanded_context) == (collapsed, context)  # nothing left out


def test_a_result_with_more_nested_chunks_than_room_stays_and_its_notes_are_trimmed() -> None:
    """The notes about results come after the results and their contents: a top hit with 45 chunks collapsed into
    it (a large class, asked by name) left an answer of 0 results where the results alone fitted."""
    answer = _answer(["class Context:\n    pass\n"] + [None] * 9)
    collapsed = [CollapsedResult(id=f"{'c' * 32}{j:02d}", into="d0") for j in range(45)]
    context = [
        ExpandedContext(
            linked_type="pkg.Linked", link_name="calls", direction="outgoing", linked_from_type="t.T",
            linked_from_document_id="d1", representative_document_id="r1",
        )
    ]  # fmt: skip
    answer = answer.model_copy(
        update={"meta": answer.meta.model_copy(update={"collapsed": collapsed, "expanded_context": context})}
    )
    fitted, body = _fit(answer, HELD + 1000)
    assert len(body) <= (HELD + 1000) * BYTES_PER_TOKEN
    assert [r.id for r in fitted.results] == [r.id for r in answer.results]  # every result stays
    assert fitted.results[0].content == answer.results[0].content
    assert fitted.meta.budget is not None
    assert fitted.meta.budget.results_dropped == 0
    assert 0 < len(fitted.meta.collapsed) < 45
    assert fitted.meta.collapsed == collapsed[: len(fitted.meta.collapsed)]  # the first, in order
    assert fitted.meta.budget.collapsed_dropped == 45 - len(fitted.meta.collapsed)
    assert fitted.meta.expanded_context == []  # d1's comes after every one of d0's
    assert fitted.meta.budget.context_dropped == 1


def test_the_message_size_cuts_too_and_says_so() -> None:
    answer = _answer(["x" * 1000] * 10)
    fitted, body = _fit(answer, 250_000, payload=4_500)
    assert len(body) <= 4_500
    assert [r.id for r in fitted.results] == [r.id for r in answer.results]
    assert fitted.meta.degraded == ["replySize"]
    with pytest.raises(TooLarge):
        fit_reply(answer, 250_000, 100)


def test_no_budget_is_ever_exceeded_and_no_cut_content_is_misreported() -> None:
    line = "x = call(argument)  # ünïcödé\n"
    answer = _answer([line * n for n in (3, 80, 7, 150, 1, 40, 90, 2, 60, 33)])
    for max_tokens in range(1000, 4000, 37):
        for payload in (1_000_000, max_tokens * BYTES_PER_TOKEN - 101):
            fitted, body = _fit(answer, max_tokens, payload)
            assert len(body) <= min(max_tokens * BYTES_PER_TOKEN, payload)
            assert fitted.meta.budget is not None
            assert fitted.meta.budget.estimated_tokens == -(-len(body) // BYTES_PER_TOKEN)
            for original, result in zip(answer.results, fitted.results, strict=False):
                assert original.content is not None
                if result.content != original.content:
                    assert result.content_length == len(original.content)
                    assert (result.id in fitted.meta.budget.contents_cut) == (result.content is not None)
                    assert original.content.startswith(result.content or "")


@pytest.mark.parametrize("text", ["plain words " * 50, 'quotes " and \\ back\nslashes\n' * 30, "ünïcödé ✓ " * 80])
def test_a_cut_text_fits_its_room_as_json(text: str) -> None:
    for room in (50, 200, 401):
        head = cut_to(text, room)
        assert text.startswith(head)
        assert len(json.dumps(head, ensure_ascii=False).encode()) <= room
        assert len(head) > 0
    # A text that fits is whole, its last line kept (a tester's docstrings lost theirs on every default read).
    assert cut_to(text.rstrip("\n") + "\nlast line", 100_000) == text.rstrip("\n") + "\nlast line"


def test_an_answer_from_the_cache_is_cut_as_the_first_answer_was() -> None:
    """What varies between two answers to one question (their timings, cacheHit, freshness) does not move the cut."""
    line = "def step(): return 1\n"
    first = _answer([line * (3 + i * 7 % 40) for i in range(30)])
    stages = ["embed", "dense", "keyword", "fetch", "denseScores", "fusion", "lateInteraction", "exactSymbol"]
    timings = {stage: 12345.678 for stage in [*stages, "secondOpinion", "graphExpansion", "queue", "total"]}
    first = first.model_copy(update={"meta": first.meta.model_copy(update={"timings_ms": timings})})
    cached_meta = {"cache_hit": True, "timings_ms": {"total": 0.4}, "freshness": Freshness(indexed_seq=7)}
    cached = first.model_copy(update={"meta": first.meta.model_copy(update=cached_meta)})
    for max_tokens in range(1000, 4000, 37):
        (made, made_body), (again, again_body) = _fit(first, max_tokens), _fit(cached, max_tokens)
        assert max(len(made_body), len(again_body)) <= max_tokens * BYTES_PER_TOKEN
        assert again.results == made.results, max_tokens
        assert made.meta.budget is not None
        assert again.meta.budget == made.meta.budget.model_copy(update={"estimated_tokens": ANY})


def test_the_best_ranked_result_keeps_a_slice_of_its_content_when_listing_every_result_would_leave_none() -> None:
    """A tester's: with topK 5 and maxTokens 1,500 every result was listed and not one kept its content."""
    answer = _answer(["def step(): return 1\n" * 100 for _ in range(20)])
    heavy = answer.model_copy(update={"results": [
        r.model_copy(update={"metadata": {"filePath": f"f{r.id}.py", "symbolFqn": "pkg.module." + "x" * 300}})
        for r in answer.results
    ]})  # fmt: skip
    for max_tokens in range(HELD + 700, HELD + 2000, 50):
        fitted, body = _fit(heavy, max_tokens)
        assert len(body) <= max_tokens * BYTES_PER_TOKEN
        first = fitted.results[0]
        assert first.content is not None, max_tokens
        assert len(first.content) >= 300, max_tokens
        assert fitted.meta.budget is not None
        assert fitted.meta.budget.results_dropped == 20 - len(fitted.results)


def test_a_first_result_that_fits_alone_is_listed_though_no_slice_of_its_content_fits_beside_it() -> None:
    """An agent tester's: at maxTokens 1,000 a class of 745 lines whose metadata alone took about 1,150 bytes came
    back as an empty answer (``resultsDropped`` 1), though listed without its content it fitted; with topK 20 all
    twenty went. Whenever the answer without contents lists the first result, the one with them does too."""
    answer = _answer(["class Context:\n    pass\n" * 2000 for _ in range(20)])
    heavy = answer.model_copy(update={"results": [
        r.model_copy(update={"metadata": {"filePath": f"f{r.id}.py", "symbolFqn": "pkg.core." + "x" * 1_500}})
        for r in answer.results
    ]})  # fmt: skip
    bare = heavy.model_copy(update={"results": [r.model_copy(update={"content": None}) for r in heavy.results]})
    listed_at = []
    for max_tokens in range(HELD + 600, HELD + 1200, 25):
        if not _fit(bare, max_tokens)[0].results:
            continue
        listed_at.append(max_tokens)
        for results in (heavy.results[:1], heavy.results):
            fitted, body = _fit(heavy.model_copy(update={"results": results}), max_tokens)
            assert len(body) <= max_tokens * BYTES_PER_TOKEN
            assert [r.id for r in fitted.results][:1] == ["d0"], max_tokens
            assert fitted.meta.budget is not None
            assert fitted.meta.budget.results_dropped == len(results) - len(fitted.results)
    assert len(listed_at) > 10  # the range reaches budgets the first result fits


def test_the_slice_is_held_for_the_first_result_listed_when_the_first_ranked_is_left_out() -> None:
    """A review's: the first-ranked result, too large to list and without content, held no room, and the first
    listed (the second-ranked) got none of its content among nine listed."""
    answer = _answer([None] + ["def step(): return 1\n" * 100 for _ in range(40)])
    huge = answer.results[0].model_copy(update={"metadata": {"filePath": "f0.py", "notes": "n" * 20_000}})
    answer = answer.model_copy(update={"results": [huge, *answer.results[1:]]})
    fitted, body = _fit(answer, 1000)
    assert len(body) <= 1000 * BYTES_PER_TOKEN
    assert fitted.results[0].id == "d1"
    assert fitted.results[0].content is not None
    assert len(fitted.results[0].content) >= 300


def test_a_large_first_content_leaves_room_for_the_context_its_links_lead_to() -> None:
    """An agent tester's followLinks at the default budget: a class of 745 lines took the whole room, and the 17
    small context entries (ids, about 330 bytes each) were all dropped. Up to a quarter of the room is theirs."""
    answer = _answer(["class Context:\n    def step(self):\n        return 1\n" * 3000, None, None])
    context = [
        ExpandedContext(
            linked_type=f"click.core.Linked{i}", link_name="calls", direction="outgoing", linked_from_type="click.core",
            linked_from_document_id=f"d{i % 3}", representative_document_id=f"{'r' * 32}{i:02d}",
        )
        for i in range(17)
    ]  # fmt: skip
    answer = answer.model_copy(update={"meta": answer.meta.model_copy(update={"expanded_context": context})})
    fitted, body = _fit(answer, 8000)
    assert len(body) <= 8000 * BYTES_PER_TOKEN
    kept = {entry.representative_document_id for entry in fitted.meta.expanded_context}
    assert kept == {entry.representative_document_id for entry in context}  # by the results' ranks
    first = fitted.results[0]
    assert first.content_truncated
    assert first.content is not None
    assert len(first.content) > 8000 * BYTES_PER_TOKEN // 2  # the content keeps most of the room
