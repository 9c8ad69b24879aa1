"""What a rebuilt index must hold: the fold of its workspace's stream, and how to compare an index against it.

Pure logic. The rebuild folds every delta that applied (the projector's own :class:`StateFold` rule) and compares
the result with the rows it reads back from its shadow tables; any difference stops the swap.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from ontofabric.contracts import EntityKind, SemanticDocument
from ontofabric.services.projector.planning import (
    Delta,
    EntityRef,
    StateFold,
    VersionState,
    entity_of,
    upserted_document,
)
from ontofabric.shared.checksums import content_md5

RowKey = tuple[str, EntityKind, str]
"""(branch, kind, key) of one row of a workspace: a document id, a node's object type, a link's key."""


@dataclass(frozen=True)
class RowFacts:
    """What is checked of each row: the delta that wrote it and, for a live document, checksums of its content,
    its vector, its token signs and its second vector (None where it has none)."""

    seq: int
    deleted: bool
    transparent: bool
    content_md5: str | None = None
    vector_md5: str | None = None
    signs_md5: str | None = None
    second_md5: str | None = None
    vector_model: str | None = field(default=None, compare=False)
    """The model its vector is of: compared only where the vector was embedded again (:func:`agree`)."""


def _md5(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def vector_md5(embedding: Sequence[float]) -> str:
    """md5 of the vector as pgvector sends it (``vector_send``): dimension, a zero, then big-endian float32s, the
    precision the projector stores."""
    return _md5(struct.pack(">HH", len(embedding), 0) + np.asarray(embedding, dtype=">f4").tobytes())


def document_facts(seq: int, document: SemanticDocument) -> RowFacts:
    """The facts of a live document row as the projector writes it."""
    tokens, second = document.token_vectors, document.second_vector
    return RowFacts(
        seq,
        deleted=False,
        transparent=False,
        content_md5=content_md5(document.content),
        vector_md5=vector_md5(document.embedding) if document.embedding is not None else None,
        signs_md5=_md5(tokens.data) if tokens is not None else None,
        second_md5=_md5(second.model.encode() + b"\x00" + second.data) if second is not None else None,
    )


MADE_HERE = "made here"
"""The checksum expected of a vector the projector embedded again (``Delta.reembedded``): any agrees with it. The
same texts embedded in other batches differ in their last bits (an operator's resumed rebuild after a model change
was refused over 1e-7), so the stream cannot vouch for them: their rows' content, state and sequence still can."""


def agree(expected: RowFacts, actual: RowFacts) -> bool:
    """Whether a row's facts are those expected, a vector made here (:data:`MADE_HERE`) agreeing with any of the
    model that made it (a review's: one of another model, or none, agreed too)."""
    made_here = expected.vector_md5 == MADE_HERE
    if made_here and actual.vector_md5 is not None and actual.vector_model == expected.vector_model:
        signs = MADE_HERE if expected.signs_md5 == MADE_HERE else actual.signs_md5  # the tokens' signs made with it
        actual = replace(actual, vector_md5=MADE_HERE, signs_md5=signs)
    return expected == actual


def row_key(delta: Delta) -> RowKey:
    ref = entity_of(delta.envelope)
    return (ref.branch, ref.kind, ref.key)


class ExpectedIndex:
    """The fold of one workspace's deltas, in stream order, from an empty index."""

    def __init__(self, workspace: str) -> None:
        self.workspace = workspace
        self._fold = StateFold()
        self._documents: dict[RowKey, RowFacts] = {}
        """The facts of each live document row, checksums included."""

    def add(self, delta: Delta) -> bool:
        """Fold one delta of this workspace; True when it applied."""
        if delta.envelope.workspace != self.workspace:
            raise ValueError(f"delta {delta.seq} belongs to workspace {delta.envelope.workspace!r}")
        if not self._fold.add(delta):
            return False
        key = row_key(delta)
        document = upserted_document(delta.envelope)
        if document is not None:
            facts = document_facts(delta.seq, document)
            if delta.reembedded is not None:
                signs = MADE_HERE if facts.signs_md5 is not None else None
                facts = replace(facts, vector_md5=MADE_HERE, signs_md5=signs, vector_model=delta.reembedded)
            self._documents[key] = facts
        else:
            self._documents.pop(key, None)
        return True

    def mark_handled(self, event_ids: Collection[str]) -> None:
        """Events a compacted stream no longer holds but the fold handled (from the workspace's snapshot)."""
        self._fold.mark_handled({(self.workspace, event_id) for event_id in event_ids})

    def rows(self, only: Collection[RowKey] | None = None) -> dict[RowKey, RowFacts]:
        """Every row the stream folds to, or only the given ones (those of them it has)."""
        if only is not None:
            refs = (EntityRef(self.workspace, branch, kind, key) for branch, kind, key in only)
            states = {ref: self._fold.rows[ref] for ref in refs if ref in self._fold.rows}
        else:
            states = self._fold.rows
        facts = {}
        for ref, state in states.items():
            key = (ref.branch, ref.kind, ref.key)
            facts[key] = self._documents.get(key) or RowFacts(state.seq, state.deleted, state.transparent)
        return facts

    def __len__(self) -> int:
        return len(self._fold.rows)

    def versions(self) -> dict[str, VersionState]:
        """The ontologyVersion of each branch the stream changed."""
        return {branch: version for (_, branch), version in self._fold.changed_versions.items()}


def unexplained_live_rows(
    live_seqs: Mapping[RowKey, int], expected_rows: Mapping[RowKey, RowFacts], covered_seq: int, *, limit: int = 10
) -> list[str]:
    """Live rows the fold of the stream up to ``covered_seq`` cannot account for.

    A live row written at or before that sequence must be in the fold, written by the same or a later delta;
    otherwise the rebuild read a delta differently from the projector (other limits, another model) or never read
    it (removed from the stream), and swapping would lose the row. A live row behind the fold is only a projector
    catching up; one written after it is not the rebuild's to judge.
    """
    unexplained = sorted(
        key
        for key, seq in live_seqs.items()
        if seq <= covered_seq and (key not in expected_rows or expected_rows[key].seq < seq)
    )
    if not unexplained:
        return []
    shown = "; ".join(_describe(key, None, None) + f" (seq {live_seqs[key]})" for key in unexplained[:limit])
    more = f" (+{len(unexplained) - limit} more)" if len(unexplained) > limit else ""
    return [f"{len(unexplained)} live rows the stream does not account for: {shown}{more}"]


def differences(
    expected_rows: Mapping[RowKey, RowFacts],
    actual_rows: Mapping[RowKey, RowFacts],
    expected_versions: Mapping[str, VersionState],
    actual_versions: Mapping[str, VersionState],
    *,
    limit: int = 10,
) -> list[str]:
    """Every way the index differs from the fold, the first ``limit`` of each kind spelt out.

    A version row the stream never changed (a branch whose deltas were all no-ops) holds the empty version.
    """
    problems: list[str] = []
    missing = sorted(expected_rows.keys() - actual_rows.keys())
    extra = sorted(actual_rows.keys() - expected_rows.keys())
    changed = sorted(
        k for k in expected_rows.keys() & actual_rows.keys() if not agree(expected_rows[k], actual_rows[k])
    )
    for label, keys in (("missing", missing), ("not in the stream", extra), ("different", changed)):
        if keys:
            shown = "; ".join(_describe(k, expected_rows.get(k), actual_rows.get(k)) for k in keys[:limit])
            more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""
            problems.append(f"{len(keys)} rows {label}: {shown}{more}")
    for branch in sorted(expected_versions.keys() | actual_versions.keys()):
        want = expected_versions.get(branch, VersionState())
        got = actual_versions.get(branch, VersionState())
        if want != got:
            problems.append(f"branch {branch!r}: ontologyVersion {got.label}, the stream folds to {want.label}")
    return problems


def _describe(key: RowKey, expected: RowFacts | None, actual: RowFacts | None) -> str:
    branch, kind, name = key
    text = f"{kind} {name!r} on {branch!r}"
    if expected is not None and actual is not None:
        text += f" (index {_facts(actual)}, stream {_facts(expected)})"
    return text


def _facts(facts: RowFacts) -> str:
    state = "reverted" if facts.transparent else "deleted" if facts.deleted else "live"
    checksums = [
        f"{name} {value[:8]}"
        for name, value in (
            ("content", facts.content_md5),
            ("vector", facts.vector_md5),
            ("signs", facts.signs_md5),
            ("second vector", facts.second_md5),
        )
        if value is not None
    ]
    return f"seq {facts.seq} {state}" + "".join(f", {c}" for c in checksums)
