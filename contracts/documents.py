"""SemanticDocument: one retrievable chunk of an ontology, as ingesters publish it."""

from __future__ import annotations

import base64
import json
import math
import re
from datetime import UTC, datetime
from decimal import Decimal
from typing import Annotated, Literal

import numpy as np
from pydantic import (
    AfterValidator,
    Base64Bytes,
    ConfigDict,
    Field,
    Strict,
    StringConstraints,
    TypeAdapter,
    field_validator,
    model_validator,
)
from pydantic.config import JsonDict

from ._base import JsonWalk, WholeNumbers, WireModel

ChunkLevel = Literal["file", "type", "method", "doc"]
CHUNK_LEVELS: tuple[ChunkLevel, ...] = ("file", "type", "method", "doc")
Provenance = Literal["hand-authored", "ingested"]
PROVENANCES: tuple[Provenance, ...] = ("hand-authored", "ingested")

Workspace = Annotated[
    str,
    StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"),
    Field(description="Workspace (tenant) name: letters, digits, '.', '_', '-'; at most 128 characters."),
]
WORKSPACE: TypeAdapter[str] = TypeAdapter(Workspace)
"""Checks a workspace name given outside a request model (a subject, a gateway's argument)."""
MAIN_BRANCH = "main"
"""The trunk: every other branch stores only its delta over it."""
STREAM_REFUSED = (
    "True when the workspace's index has stopped following the delta stream: the projector of its partition refuses "
    "the stream as not the one the index read (the stream's store lost and made again, or restored from an older "
    "copy) and applies nothing of it until an operator runs `ontofabric adopt-stream`. Answers still come from the "
    "index as it was. Said within about 15 s of the refusal."
)
NOT_FOLLOWING = (
    "STALE: the index has stopped following the delta stream (its projector refuses a stream that is not the one it "
    "read); nothing new is indexed until an operator runs `ontofabric adopt-stream`"
)
"""What a person or an agent reading an answer's text is told when ``streamRefused`` is true."""

Branch = Annotated[
    str,
    StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,254}$"),
    Field(description="Branch name, git style (may contain '/' and '.'); 'main' is the trunk."),
]
BRANCH: TypeAdapter[str] = TypeAdapter(Branch)
"""Checks a branch name given outside a request model (a command's option)."""
NOT_IN_NAMES = (
    r"\x00-\x9f\u00a0\u00ad\u034f\u061c\u115f\u1160\u1680\u17b4\u17b5\u180b-\u180f\u2000-\u200f\u2028-\u202f"
    r"\u205f-\u206f\u3000\u3164\ufe00-\ufe0f\ufeff\uffa0"
)
"""Past ASCII, what no object type holds: controls, spaces and separators, and what shows nothing (zero-width
characters, joiners, direction marks, variation selectors, fillers), as ranges of a regular expression's class."""
NAME_START = rf"(?:[A-Za-z_]|[^{NOT_IN_NAMES}])"
"""A name's first character in an object type: an ASCII letter or ``_``, or any character past ASCII but a control,
a line or paragraph separator, a zero-width one or one that turns the text's direction (letters of any script: a
tester's ``class Животное`` and ``class Растение`` were both ``________``, one node)."""
NAME_CHARACTER = NAME_START.replace("A-Za-z_", "A-Za-z0-9_.$-")
"""Any other character of an object type: ASCII letters, digits, ``_ . $ -``, or past ASCII as :data:`NAME_START`."""
OBJECT_TYPE_PATTERN = re.compile(f"^{NAME_START}{NAME_CHARACTER}{{0,511}}$")
"""What an object type is: letters, digits, ``_ . $ -`` and characters past ASCII as :data:`NAME_START` says, a
letter or ``_`` first, 512 at most."""
ObjectType = Annotated[
    str,
    StringConstraints(pattern=OBJECT_TYPE_PATTERN.pattern),
    Field(description="Ontology object type, '{domain}.{typeName}' (a top-level type may have no domain)."),
]
OBJECT_TYPE: TypeAdapter[str] = TypeAdapter(ObjectType)
"""Checks an object type made outside a field (a node's, from its domain and name)."""
SymbolKind = Annotated[
    str,
    StringConstraints(pattern=r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$"),
    Field(description="A kind of symbol: module, class, function, method, docstring, section ..."),
]
DocumentId = Annotated[
    str,
    StringConstraints(pattern=r"^[^\x00-\x1f\x7f]{1,512}$"),
    Field(description="Stable document identifier (no control characters, at most 512 characters)."),
]


def _no_nul(value: str) -> str:
    # PostgreSQL text cannot hold NUL; refusing it here turns a later database error into a clear rejection.
    if "\x00" in value:
        raise ValueError("text must not contain NUL characters")
    return value


Text = Annotated[str, AfterValidator(_no_nul)]


def _finite_nonzero(vector: list[float]) -> list[float]:
    if not vector:
        raise ValueError("embedding must not be empty")
    # Vectors are stored as float32: check what will be stored, not the float64 that arrived.
    stored = np.asarray(vector, dtype=np.float32)
    if not np.isfinite(stored).all():
        raise ValueError("embedding must contain only finite float32 numbers")
    with np.errstate(over="ignore"):
        squared_norm = np.dot(stored, stored)  # in float32, as pgvector sums
    if float(np.sqrt(squared_norm)) < 1e-12:
        raise ValueError("embedding must not be (nearly) the zero vector: cosine distance is undefined")
    if not np.isfinite(squared_norm):  # the cosine would be NaN
        raise ValueError("embedding's values are too large: its squared norm overflows float32 (normalise it)")
    return vector


Embedding = Annotated[list[Annotated[float, Strict()]], AfterValidator(_finite_nonzero)]
"""Numbers as the schema says: a fault harness's "0.1" and true among them were read as 0.1 and 1.0."""


def strict_base64(value: object) -> object:
    """``value`` as it came, once it decodes as base64 with nothing outside the alphabet: Base64Bytes alone skips
    such characters, and a corrupted payload must be refused instead."""
    if isinstance(value, str | bytes):
        base64.b64decode(value, validate=True)
    return value


MAX_TOKENS = 1024
"""More tokens than any supported embedding model reads (MiniLM: 256, BERT-style models: 512)."""


class TokenVectors(WireModel):
    """The document's token vectors from the embedding model's pass, for late interaction (MaxSim): the sign of
    each dimension, one bit, packed eight to a byte with the first dimension in the high bit, token after token."""

    encoding: Literal["sign-bits"] = Field(default="sign-bits", description="Only sign-bits so far.")
    dimension: int = Field(ge=1, le=16000, description="Dimensions per token; must equal the deployment's.")
    data: Base64Bytes = Field(description=f"Base64 of the packed bits: ceil(dimension / 8) bytes a token, 1 to "
                              f"{MAX_TOKENS} tokens.")  # fmt: skip

    @classmethod
    def of_signs(cls, dimension: int, signs: bytes) -> TokenVectors:
        """From packed sign bits as they are (``data`` itself expects base64, as on the wire)."""
        return cls(dimension=dimension, data=base64.b64encode(signs))

    @field_validator("data", mode="before")
    @classmethod
    def _strict_base64(cls, value: object) -> object:
        return strict_base64(value)

    @model_validator(mode="after")
    def _whole_tokens(self) -> TokenVectors:
        width = math.ceil(self.dimension / 8)
        if not self.data or len(self.data) % width:
            raise ValueError(f"{len(self.data)} bytes are not a whole number of tokens of {width} bytes")
        if len(self.data) // width > MAX_TOKENS:
            raise ValueError(f"token vectors hold more than {MAX_TOKENS} tokens")
        return self


class SecondVector(WireModel):
    """The document's vector from a second embedding model, for the second opinion the query worker fuses into
    the order of its leading candidates (docs/quality.md, "Second vectors"); ranked without it when absent or of
    another model than the worker's."""

    model: Text = Field(min_length=1, max_length=256, description="The second model that made the vector.")
    encoding: Literal["float16"] = Field(default="float16", description="Only little-endian float16 so far.")
    dimension: int = Field(ge=1, le=4096, description="Dimensions of the vector.")
    data: Base64Bytes = Field(description="Base64 of the vector: 2 bytes a dimension, little-endian float16.")

    @field_validator("data", mode="before")
    @classmethod
    def _strict_base64(cls, value: object) -> object:
        return strict_base64(value)

    @model_validator(mode="after")
    def _whole_vector(self) -> SecondVector:
        if len(self.data) != 2 * self.dimension:
            raise ValueError(f"{len(self.data)} bytes are not a float16 vector of {self.dimension} dimensions")
        values = np.frombuffer(self.data, dtype="<f2")
        if not np.isfinite(values).all() or not values.any():
            raise ValueError("the second vector must be finite and not zero")
        return self

    @classmethod
    def of_half(cls, model: str, data: bytes) -> SecondVector:
        """From float16 bytes as they are (``data`` itself expects base64, as on the wire)."""
        return cls(model=model, dimension=len(data) // 2, data=base64.b64encode(data))


MAX_CALLS = 512
MAX_CALLEE_CHARS = 1024
MAX_DEFINES = 512
MAX_ALIASES = 64
MAX_METADATA_BYTES = 64 * 1024
"""A document's metadata as the index stores and returns it (jsonb writes a number out in full: 1e308 is 309
digits). Every answer and every document read carries it: a fault tester's 24 kB delta of 4,000 × 1e300 grew to
1.2 MB on each read, and one under a megabyte to 50 MB that stalled other workspaces' queries."""


def stored_json_bytes(value: object, limit: int | None = None) -> int:
    """The size of ``value`` (parsed JSON) as PostgreSQL's jsonb writes it back, numbers in positional notation;
    counting stops past ``limit``."""
    size = 0
    pending = [value]
    while pending and (limit is None or size <= limit):
        item = pending.pop()
        if isinstance(item, dict):
            size += 2 + 4 * len(item) - (2 if item else 0)  # braces, ': ' and ', '
            for key in item:
                size += stored_json_bytes(str(key))
                if limit is not None and size > limit:
                    return size
            pending += item.values()
        elif isinstance(item, list):
            size += 2 + 2 * len(item) - (2 if item else 0)
            pending += item
        elif isinstance(item, str):
            size += len(json.dumps(item, ensure_ascii=False).encode("utf-8"))
        elif isinstance(item, bool) or item is None:
            size += 4 if item in (True, None) else 5
        elif isinstance(item, int):
            most = int(item.bit_length() * math.log10(2)) + 1  # digits of 2 ** bit_length: str() refuses past 4,300
            size += (item < 0) + max(1, most - (abs(item) < 10 ** (most - 1)))
        elif isinstance(item, float):
            sign, digits, exponent = Decimal(repr(item)).as_tuple()
            assert isinstance(exponent, int), "finite numbers only"  # NaN and infinity are refused before
            size += sign + (len(digits) + exponent if exponent >= 0 else max(len(digits) + exponent, 1) + 1 - exponent)
    return size


MAX_LINE = 2**31 - 1
"""The largest line number a document's metadata states (PostgreSQL's integer)."""

SymbolNames = list[Annotated[Text, Field(min_length=1, max_length=MAX_CALLEE_CHARS)]]
"""Qualified names a document's metadata lists (its calls, the names it assigns, its symbol's other names)."""


class DocumentMetadata(WireModel, WholeNumbers):
    """Metadata used for filtering and identity; free extra keys are kept as they are. The whole is at most 64 KiB
    as the index stores it, where a number takes its digits in full (1e300: 301 bytes); a delta over it is
    dead-lettered invalid_schema."""

    # endLine given as a number needs startLine as a number; a null one needs nothing, as the check reads it (a
    # contract tester's endLine: null alone was refused by the schema's dependentRequired and applied).
    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={
            "if": {"required": ["endLine"], "properties": {"endLine": {"type": "integer"}}},
            "then": {"required": ["startLine"], "properties": {"startLine": {"type": "integer"}}},
        },
    )

    symbol_key: Text | None = Field(
        default=None,
        description="Refactor-stable symbol identity. Keep it within 512 characters, as the reference ingester "
        "does: it is an index key, and one the database cannot index (past about 2,000 bytes that do not "
        "compress) is dead-lettered apply_failed.",
    )
    symbol_kind: Text | None = Field(default=None, description="module, class, function, method, section, ...")
    symbol_fqn: Text | None = Field(
        default=None,
        description="Human-readable fully qualified name; within 512 characters, as symbolKey (its last part is "
        "an index key).",
    )
    content_hash: Text | None = Field(default=None, description="sha256 of the content, hex.")
    file_path: Text | None = Field(
        default=None,
        description="Source path relative to the ingested root. An index key (a branch hides main's documents by "
        "file): one the database cannot index (past about 2,000 bytes that do not compress) is dead-lettered "
        "apply_failed, as a symbolKey is.",
    )
    whole_file: bool | None = Field(
        default=None,
        strict=True,
        description="On a branch: its producer sends every document of its file (filePath) that the branch holds, "
        "as the reference ingester does for each file a branch changes; a query on the branch then hides main's "
        "documents of that file, so main's later changes to it (lines moved, documents added, the file deleted) "
        "do not show through. Without it, a branch document hides main's of its id or symbolKey only. When the "
        "branch also has a graph node of its own for the file's module (the symbolFqn of its module chunk), live "
        "or removed, it is taken to send every node and link that module defines (its classes, and the links from "
        "them and from it), and main's are hidden on the branch too.",
    )
    start_line: int | None = Field(
        default=None,
        strict=True,  # a line number, not true or "12"
        ge=1,
        le=MAX_LINE,
        description="The first line (1-based) of the file at filePath that the content comes from: where an agent "
        "opens it. The reference ingester gives every chunk one (a class or function from its first decorator, a "
        "docstring its string literal).",
    )
    end_line: int | None = Field(
        default=None,
        strict=True,
        ge=1,
        le=MAX_LINE,
        description="The last line (inclusive); only with startLine, not before it.",
    )
    chunk_level: ChunkLevel | None = None
    provenance: Provenance | None = None
    calls: SymbolNames | None = Field(
        default=None,
        max_length=MAX_CALLS,
        description="Qualified names (symbolFqn) of the symbols this chunk's own code calls, as far as its source "
        "tells them (a module's chunk: its top-level statements; a class's: its body outside its methods); a "
        "question for a symbol's callers or callees is answered from them (OntologyQuery options.exactSymbols).",
    )
    defines: SymbolNames | None = Field(
        default=None,
        max_length=MAX_DEFINES,
        description="Names this chunk's own statements assign at its level (a module's chunk: its constants and other "
        "module variables, which have no chunk of their own); a query that is one of these names, alone or after "
        "its module's name, puts the chunk first as it does a symbol's definition (options.exactSymbols).",
    )
    aliases: SymbolNames | None = Field(
        default=None,
        max_length=MAX_ALIASES,
        description="Other qualified names of this chunk's symbol: those a package publishes it under (click.Option "
        "for click.core.Option, re-exported by click/__init__.py); a query that is one of them, as written, puts the "
        "chunk first as it does a symbol's definition (options.exactSymbols).",
    )

    @model_validator(mode="after")
    def _lines_in_order(self) -> DocumentMetadata:
        if self.end_line is not None and (self.start_line is None or self.end_line < self.start_line):
            raise ValueError("metadata endLine: only with startLine, and not before it")
        return self

    @model_validator(mode="after")
    def _storable(self) -> DocumentMetadata:
        """Free keys are stored as they are, as jsonb, which holds neither NUL nor NaN: checked like declared ones;
        the whole within MAX_METADATA_BYTES as stored."""
        walk = JsonWalk(list((self.model_extra or {}).items()))
        for place, value in walk:
            if "\x00" in str(walk.step(place)) or (isinstance(value, str) and "\x00" in value):
                raise ValueError(f"metadata {walk.place(place, brackets=True)!r}: text must not contain NUL characters")
            if isinstance(value, float) and not math.isfinite(value):  # stored as JSON, it would become null
                raise ValueError(f"metadata {walk.place(place, brackets=True)!r}: numbers must be finite")
        stored = stored_json_bytes(self.model_dump(mode="json", exclude_none=True), MAX_METADATA_BYTES)
        if stored > MAX_METADATA_BYTES:
            raise ValueError(
                f"metadata is over {MAX_METADATA_BYTES} bytes as stored (numbers are stored in full: 1e300 takes "
                "301 bytes)"
            )
        return self


def _model_named_with_vectors(schema: JsonDict) -> None:
    """Vectors name the model that made them (a tester's vectors without a name were indexed unchecked)."""
    schema["allOf"] = [
        {
            "if": {"required": [name], "properties": {name: {"type": "array" if name == "embedding" else "object"}}},
            "then": {"required": ["embeddingModel"], "properties": {"embeddingModel": {"type": "string"}}},
        }
        for name in ("embedding", "tokenVectors")
    ]


class SemanticDocument(WireModel):
    model_config = ConfigDict(json_schema_extra=_model_named_with_vectors)

    id: DocumentId
    content: Text = Field(
        description="The text that is searched and returned. At most ONTOFABRIC_MAX_CONTENT_BYTES bytes of UTF-8 "
        "(262,144 by default, a deployment's setting): a longer one is dead-lettered `content_too_large`."
    )
    object_type: ObjectType
    source_domain: Text = Field(min_length=1, max_length=256)
    metadata: DocumentMetadata = Field(default_factory=DocumentMetadata)
    embedding: Embedding | None = Field(
        default=None,
        description="Dense vector; its length must equal the deployment's dimension. The deployment's embedding model "
        "(ONTOFABRIC_EMBEDDING_MODEL; all-MiniLM-L6-v2 by default, mean-pooled to unit length) reading the symbolFqn, "
        "a newline and the content (the content alone without a symbolFqn); a text longer than the model reads is "
        "embedded in windows (README, ONTOFABRIC_EMBEDDING_WINDOWS). Without one, the document is found by keyword "
        "search only.",
    )
    embedding_model: Text | None = Field(
        default=None,
        description="Model that produced the embedding and token vectors; required with them, and checked against "
        "the deployment's model (another is dead-lettered embedding_model_mismatch; an embedding of no named model "
        "is not used, and the document is found by keyword search only).",
    )
    token_vectors: TokenVectors | None = Field(
        default=None,
        description="For late interaction, from the model named in embeddingModel (required with them); without "
        "them the document is ranked as fused.",
    )
    second_vector: SecondVector | None = Field(
        default=None, description="A second embedding model's vector, for the query worker's second opinion."
    )
    indexed_at: datetime | None = None

    @field_validator("indexed_at")
    @classmethod
    def _storable_time(cls, value: datetime | None) -> datetime | None:
        # Stored in UTC: 0001-01-01T00:00+14:00 is a valid ISO time whose UTC is before year 1.
        if value is not None and value.tzinfo is not None:
            try:
                value.astimezone(UTC)
            except OverflowError:
                raise ValueError("indexedAt in UTC falls outside years 1 to 9999") from None
        return value
