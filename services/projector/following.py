"""Whether an index follows the delta stream it reads, or another one (infra/migrations/0029).

An index holds, for each delta it applied, the stream sequence it came at; a consumer reads on from the index's
position. Both hold only while the stream is the one the index read. A JetStream store lost and made again starts
its sequences at 1 under an index past them; one restored from a backup older than the database numbers new deltas
with sequences the index has already read. Either way every later change was skipped without a word (a disaster
recovery tester's, 2026-12-02). The index therefore records the stream it follows: when it was made, and a digest
of the last delta it applied, with its sequence (its mark, written by each batch with its rows). A stream made at
another time, one that ends before what the index read, or one with another delta at the mark is refused, and the
refusal stands until an operator adopts the stream (``ontofabric adopt-stream``): a stream once found to be
another does not become the index's own by being written to (a tester's restored backup, written past the index's
position, passed the check again once an ingester had republished the same delta at the mark).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class Followed:
    """What an index recorded of the stream it reads (nothing yet: a new index, or one from before 0029)."""

    created: datetime | None = None
    """When the stream was made, as JetStream reports it."""
    mark_seq: int | None = None
    """The sequence of the last delta the index applied."""
    mark: str | None = None
    """That delta, by :func:`delta_mark`."""


def delta_mark(subject: str, data: bytes) -> str:
    """A digest of a delta as the stream holds it: its subject and its bytes. Not its event id: an ingester that
    derives ids from what it publishes (the reference one does) sends the same id again for another history."""
    return hashlib.sha256(subject.encode() + b"\0" + data).hexdigest()[:32]


def refusal(
    followed: Followed, position: int | None, created: datetime | None, last_seq: int, found: str | None
) -> str | None:
    """Why the index must not read the stream as it is now (None: it is the stream the index follows).
    ``position``: how far the index has read; ``created``, ``last_seq``: the stream's; ``found``: the digest of the
    delta now at ``followed.mark_seq`` (None when it could not be read: purged by a compaction, or deleted)."""
    if followed.created is not None and created is not None and created != followed.created:
        return (
            f"the delta stream was made at {created.isoformat()}, not at {followed.created.isoformat()} as the one "
            "this index follows: its store was lost or replaced"
        )
    read = max(position or 0, followed.mark_seq or 0)
    if read > last_seq:
        return (
            f"the delta stream ends at sequence {last_seq}, before the {read} this index has read: it was restored "
            "from an older backup, or lost"
        )
    if followed.mark is not None and found is not None and found != followed.mark:
        return (
            f"the delta at sequence {followed.mark_seq} is not the one this index read there: the stream was "
            "replaced (an older backup restored, then written to)"
        )
    return None
