"""JSON Schema for every wire message, generated from the models into ``contracts/schemas/``.

Regenerate with ``ontofabric contracts --write``; a test fails when the committed files drift from the models.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from .deltas import DeltaEnvelope
from .documents import SemanticDocument
from .lookup import DocumentReply, DocumentRequest, StatusReply, StatusRequest
from .query import ErrorReply, OntologyQuery, QueryResponse
from .versions import OntologyVersionChanged

SCHEMA_DIR = Path(__file__).parent / "schemas"

Mode = Literal["validation", "serialization"]

# Requests are described as they are accepted; replies as they are sent.
MESSAGES: dict[str, tuple[type[BaseModel], Mode]] = {
    "semantic-document": (SemanticDocument, "validation"),
    "delta-envelope": (DeltaEnvelope, "validation"),
    "ontology-query": (OntologyQuery, "validation"),
    "query-response": (QueryResponse, "serialization"),
    "error-reply": (ErrorReply, "serialization"),
    "ontology-version-changed": (OntologyVersionChanged, "serialization"),
    "document-request": (DocumentRequest, "validation"),
    "document-reply": (DocumentReply, "serialization"),
    "status-request": (StatusRequest, "validation"),
    "status-reply": (StatusReply, "serialization"),
}


DIALECT = "https://json-schema.org/draft/2020-12/schema"
"""What the files are written in (``$defs``): said, so that a validator need not guess (ajv's default is draft-07)."""


def portable(node: Any) -> Any:
    """A schema as validators of any language read it (a tester's ajv in strict mode refused ours): without
    OpenAPI's discriminator object, which no JSON Schema dialect has, nor AsyncAPI's Schema Object (each
    alternative's ``const`` of ``type`` tells them apart), and with base64 text as ``contentEncoding``, JSON
    Schema's word for it, rather than pydantic's ``format`` of that name, which validators do not know."""
    if isinstance(node, dict):
        converted = {key: portable(value) for key, value in node.items() if key != "discriminator"}
        if converted.get("format") == "base64":
            del converted["format"]
            converted["contentEncoding"] = "base64"
        return converted
    if isinstance(node, list):
        return [portable(item) for item in node]
    return node


def render() -> dict[str, str]:
    """File name -> JSON text for every message schema."""
    rendered: dict[str, str] = {}
    for name, (model, mode) in MESSAGES.items():
        schema = portable(model.model_json_schema(by_alias=True, mode=mode))
        schema["$schema"] = DIALECT
        schema["$id"] = f"urn:ontofabric:contracts:{name}"
        rendered[f"{name}.schema.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return rendered


def write(directory: Path = SCHEMA_DIR) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for file_name, text in render().items():
        path = directory / file_name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def drift(directory: Path = SCHEMA_DIR) -> list[str]:
    """Names of schema files that are missing or differ from the models."""
    return [
        file_name
        for file_name, text in render().items()
        if not (directory / file_name).exists() or (directory / file_name).read_text(encoding="utf-8") != text
    ]
