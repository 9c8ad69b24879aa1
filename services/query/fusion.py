"""Reciprocal Rank Fusion (Cormack, Clarke and Buettcher, SIGIR 2009): score(d) = sum over lists of 1 / (k + rank)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Candidate:
    """One hit of one retriever; its rank is its 1-based position in that retriever's list."""

    id: str
    score: float


@dataclass(frozen=True)
class SourceHit:
    rank: int
    score: float


@dataclass(frozen=True)
class Fused:
    id: str
    rrf: float
    relevance: float
    """``rrf`` divided by its maximum for the lists that ran: 1.0 means ranked first by every one of them."""
    found_by: Mapping[str, SourceHit] = field(default_factory=dict)

    @property
    def best_rank(self) -> int:
        return min(hit.rank for hit in self.found_by.values())


def reciprocal_rank_fusion(
    ranked_lists: Mapping[str, Sequence[Candidate]], k: int = 60, limit: int | None = None
) -> list[Fused]:
    """Fuse ranked lists by name. One list comes back in its own order; ties break by best rank, then id."""
    if k < 1:
        raise ValueError("k must be at least 1")
    scores: dict[str, float] = {}
    found_by: dict[str, dict[str, SourceHit]] = {}
    for name, candidates in ranked_lists.items():
        seen: set[str] = set()
        for position, candidate in enumerate(candidates, start=1):
            if candidate.id in seen:  # a retriever listing a document twice counts once, at its best rank
                continue
            seen.add(candidate.id)
            scores[candidate.id] = scores.get(candidate.id, 0.0) + 1.0 / (k + position)
            found_by.setdefault(candidate.id, {})[name] = SourceHit(position, candidate.score)
    ceiling = len(ranked_lists) / (k + 1) if ranked_lists else 1.0
    fused = [Fused(doc_id, score, score / ceiling, found_by[doc_id]) for doc_id, score in scores.items()]
    fused.sort(key=lambda f: (-f.rrf, f.best_rank, f.id))
    return fused if limit is None else fused[:limit]
