"""NATS names: subjects, streams, consumers and buckets.

User strings (workspace and branch names) never enter a subject raw: branches contain ``/`` and ``.``, and a ``.``
would split a token, a ``*`` or ``>`` would turn it into a wildcard. :func:`encode_token` maps any string onto the
characters ``[A-Za-z0-9-_]`` reversibly, keeping plain names readable (``feature/x.y`` -> ``feature_2fx_2ey``).
"""

from __future__ import annotations

import re
import uuid
import zlib
from dataclasses import dataclass
from typing import Literal, get_args

Operation = Literal["query", "document", "status"]
"""What a query worker answers: ontology_query, a document by id, a workspace's status."""
OPERATIONS: tuple[Operation, ...] = get_args(Operation)

_SAFE = re.compile(r"[A-Za-z0-9-]")
_ESCAPE = re.compile(r"_([0-9a-f]{2})|_u([0-9a-f]{6})")


def encode_token(value: str) -> str:
    """Encode ``value`` as one subject token (also a valid KV key segment and consumer-name part)."""
    if not value:
        raise ValueError("a subject token cannot be empty")
    out: list[str] = []
    for char in value:
        if _SAFE.fullmatch(char):
            out.append(char)
        elif ord(char) < 0x100:
            out.append(f"_{ord(char):02x}")
        else:
            out.append(f"_u{ord(char):06x}")
    return "".join(out)


def decode_token(token: str) -> str:
    """The string ``token`` encodes. Only the canonical encoding is accepted (:func:`encode_token`'s own output):
    otherwise ``alpha``, ``alph_61`` and ``_u000061lpha`` would name one workspace on three subjects, and a NATS
    permission written against one of them could be walked around through another. Raises ValueError."""
    value = _ESCAPE.sub(_escaped, token)
    if not value or encode_token(value) != token:
        raise ValueError(f"{token!r} is not the canonical subject token of any name")
    return value


def _escaped(match: re.Match[str]) -> str:
    """The character an escape (``_2e``, ``_u00e9``) stands for; ValueError past U+10FFFF."""
    return chr(int(match.group(1) or match.group(2), 16))


_ANY_CASE_ESCAPE = re.compile(r"_([0-9a-fA-F]{2})|_[uU]([0-9a-fA-F]{6})")


def canonical_spelling(token: str) -> str | None:
    """The canonical token of the name ``token`` spells another way (upper-case hex, ``_u`` for a code point below
    256), or None: what an error names, since only the canonical one is accepted (an outside team's client wrote
    ``team_2Esearch`` with ``%02X``, and was told only that the subject named no workspace)."""
    try:
        canonical = encode_token(_ANY_CASE_ESCAPE.sub(_escaped, token))
    except ValueError:
        return None
    return canonical if canonical != token else None


@dataclass(frozen=True)
class Names:
    """Every NATS name the services use, derived from one prefix so deployments (and tests) can coexist."""

    prefix: str = "ontofabric"

    @property
    def _upper(self) -> str:
        return self.prefix.upper().replace("-", "_")

    # deltas
    @property
    def delta_stream(self) -> str:
        return f"{self._upper}_DELTAS"

    @property
    def delta_subjects(self) -> str:
        return f"{self.prefix}.delta.>"

    def delta_subject(self, workspace: str, branch: str) -> str:
        return f"{self.prefix}.delta.{encode_token(workspace)}.{encode_token(branch)}"

    def scope_of_delta(self, subject: str) -> tuple[str, str] | None:
        """The workspace and branch a delta subject names; None when it is not ``<prefix>.delta.<ws>.<branch>``
        with canonical tokens (the projector dead-letters such a delta, ``subject_mismatch``)."""
        head = f"{self.prefix}.delta."
        tokens = subject[len(head) :].split(".") if subject.startswith(head) else []
        if len(tokens) != 2:
            return None
        try:
            return decode_token(tokens[0]), decode_token(tokens[1])
        except ValueError:
            return None

    def workspace_delta_subjects(self, workspace: str) -> str:
        """Every branch's deltas of one workspace (what a rebuild of that workspace replays)."""
        return f"{self.prefix}.delta.{encode_token(workspace)}.*"

    @property
    def published_subjects(self) -> str:
        """Where the delta stream republishes the headers of every delta it stores (sequence, time, subject)."""
        return f"{self.prefix}.published.>"

    def scope_of_published(self, subject: str) -> tuple[str, str]:
        """The workspace and branch of a republished delta's subject."""
        workspace, branch = subject.rsplit(".", 2)[-2:]
        return decode_token(workspace), decode_token(branch)

    # dead letters
    @property
    def dlq_stream(self) -> str:
        return f"{self._upper}_DLQ"

    @property
    def dlq_subjects(self) -> str:
        return f"{self.prefix}.dlq.>"

    def dlq_subject(self, workspace_token: str) -> str:
        return f"{self.prefix}.dlq.{workspace_token}"

    @staticmethod
    def workspace_of_dlq_subject(subject: str) -> str | None:
        """The workspace a dead letter's subject names; None when it names none (:data:`NO_WORKSPACE`)."""
        try:
            return decode_token(subject.rsplit(".", 1)[-1])
        except ValueError:
            return None

    # ontology versions
    @property
    def version_bucket(self) -> str:
        return f"{self.prefix}_versions"

    @property
    def version_stream(self) -> str:
        """The stream that holds the versions bucket."""
        return f"KV_{self.version_bucket}"

    @staticmethod
    def version_key(workspace: str, branch: str) -> str:
        return f"{encode_token(workspace)}.{encode_token(branch)}"

    @staticmethod
    def parse_version_key(key: str) -> tuple[str, str]:
        workspace, branch = key.split(".", 1)
        return decode_token(workspace), decode_token(branch)

    def version_event_subject(self, workspace: str, branch: str) -> str:
        return f"{self.prefix}.version.{encode_token(workspace)}.{encode_token(branch)}"

    # requests to the query workers
    def request_subject(self, operation: Operation, workspace: str) -> str:
        return f"{self.prefix}.{operation}.{encode_token(workspace)}"

    @property
    def request_subjects(self) -> list[str]:
        """Every operation's requests, of any workspace: what the query workers subscribe to."""
        return [f"{self.prefix}.{operation}.*" for operation in OPERATIONS]

    def operation_of(self, subject: str) -> Operation | None:
        """The operation a request subject names; None when it names none."""
        if not subject.startswith(self.prefix + "."):
            return None
        operation, _, token = subject[len(self.prefix) + 1 :].partition(".")
        return next((o for o in OPERATIONS if o == operation and token and "." not in token), None)

    @property
    def query_queue(self) -> str:
        return f"{self.prefix}-query"

    @property
    def query_service(self) -> str:
        """The name the query workers answer NATS service discovery by (``$SRV.PING.<name>``): one reply each."""
        return f"{self.prefix}-query"

    @property
    def projector_service(self) -> str:
        """The name projectors answer NATS service discovery by."""
        return f"{self.prefix}-projector"

    # consumers and ingest state
    @property
    def postgres_projector_durable(self) -> str:
        return f"{self.prefix}-projector-postgres"

    def postgres_projector_durables(self, partitions: int) -> list[str]:
        """The Postgres projectors' durable consumers when the workspaces are divided into ``partitions``: one per
        partition, named by the layout, so that a new layout starts consumers of its own from the stream's first
        delta rather than inheriting positions that skipped what the new partition holds."""
        if partitions == 1:
            return [self.postgres_projector_durable]
        return [f"{self.postgres_projector_durable}-{index}of{partitions}" for index in range(partitions)]

    @property
    def every_postgres_projector_durable(self) -> list[str]:
        """The durables of every layout: what NATS permissions name (they cannot match part of a token)."""
        return [durable for count in PARTITION_COUNTS for durable in self.postgres_projector_durables(count)]

    @property
    def azure_projector_durable(self) -> str:
        return f"{self.prefix}-projector-azure-search"

    def count_consumer(self) -> str:
        """A fresh name for a short-lived consumer that counts deltas (never a durable's)."""
        return f"{self.prefix}-count-{uuid.uuid4().hex}"

    @property
    def manifest_bucket(self) -> str:
        """KV bucket of ingest manifests, keyed ``<workspace>.<branch>...`` (shared/manifest_store.py)."""
        return f"{self.prefix}_manifests"

    @property
    def legacy_manifest_bucket(self) -> str:
        """The object store earlier versions kept every workspace's manifests in; moved into the KV bucket."""
        return f"{self.prefix}_ingest_state"

    @property
    def snapshot_bucket(self) -> str:
        """Object store of each workspace's fold of the compacted delta stream (services/ops/snapshots.py)."""
        return f"{self.prefix}_snapshots"

    @property
    def streams(self) -> list[str]:
        """Every JetStream stream of the deployment, buckets included (a KV bucket or object store is a stream)."""
        return [
            self.delta_stream,
            self.dlq_stream,
            self.version_stream,
            f"KV_{self.manifest_bucket}",
            f"OBJ_{self.legacy_manifest_bucket}",
            f"OBJ_{self.snapshot_bucket}",
        ]


NO_WORKSPACE = "_unknown"
"""The dead-letter subject's last token, and the name operators select it by, for deltas whose subject names no
workspace: no workspace is named so (a name starts with a letter or digit)."""

PARTITION_COUNTS = (1, 2, 4, 8, 16)
"""How many partitions the Postgres projectors may divide the workspaces into."""


@dataclass(frozen=True)
class Partition:
    """One of ``count`` parts of the workspaces, by a stable hash of the workspace's subject token (the same in
    every process and release): every delta of a workspace falls in one partition, so one consumer applies them
    all, in stream order, while other partitions' consumers apply other workspaces beside it."""

    index: int
    count: int

    def holds(self, subject: str) -> bool:
        return partition_of_token(workspace_token_of(subject) or "", self.count) == self.index


def partition_of_token(workspace_token: str, count: int) -> int:
    """The partition of ``count`` a workspace falls in, by its subject token."""
    return zlib.crc32(workspace_token.encode()) % count


def workspace_token_of(subject: str) -> str | None:
    """The workspace token of a delta or query subject, or None when the subject has no such token."""
    parts = subject.split(".")
    return parts[2] if len(parts) >= 3 else None


def workspace_of(subject: str) -> str | None:
    """The workspace a delta or query subject names; None when it names none (no token, or not a canonical one)."""
    try:
        return decode_token(workspace_token_of(subject) or "")
    except ValueError:
        return None
