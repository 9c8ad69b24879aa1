"""The AsyncAPI 3.0 document of every NATS subject and bucket the services use, generated from the contracts.

Addresses come from :class:`~.subjects.Names` with the default prefix, payloads from the same
pydantic models as ``contracts/schemas/``. Regenerate with ``ontofabric contracts --write``; a test fails when the
committed ``contracts/asyncapi.json`` drifts from them, and CI validates it with the AsyncAPI CLI.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic.json_schema import models_json_schema

from ontofabric.contracts.deltas import SCHEMA_VERSION
from ontofabric.contracts.query import (
    CLOCK_ALLOWANCE_MS,
    MAX_REQUEST_BYTES,
    RECEIPT_HEADER,
    RECEIVED,
    SENT_AT_HEADER,
    TIMEOUT_HEADER,
)
from ontofabric.contracts.schema import MESSAGES, SCHEMA_DIR, portable

from .jetstream import MAX_DELTA_MESSAGE_BYTES, SERVER_ANSWER_HEADERS
from .subjects import Names

DOCUMENT_PATH = SCHEMA_DIR.parent / "asyncapi.json"

Json = dict[str, Any]

_WORKSPACE = {
    "description": "The workspace, encoded as one subject token: [A-Za-z0-9-] kept, any other character as _hh "
    "(code point below 256) or _uhhhhhh, in lower-case hex, so `feature/x.y` is `feature_2fx_2ey`. Only this "
    "spelling is accepted (`team_2Esearch` or `team_u00002esearch` is refused): one name on two subjects would let "
    "a permission written for one be walked around through the other.",
    "examples": ["acme", "team_2esearch"],  # team.search: a workspace name holds no slash, a branch may
}
_BRANCH = {
    "description": "The branch, encoded as one subject token like the workspace (`main` for the trunk).",
    "examples": ["main", "feature_2fx_2ey"],
}
_TRACE_HEADERS: Json = {
    "traceparent": {"type": "string", "description": "W3C trace context: the trace continues in the receiver."},
    "tracestate": {"type": "string"},
}


def _component(name: str) -> str:
    """The component name of a message schema file name (``delta-envelope`` -> ``DeltaEnvelope``)."""
    return "".join(part.capitalize() for part in name.split("-"))


def _payload_schemas() -> Json:
    """Every wire model's JSON Schema as components, their shared definitions beside them."""
    models = [(model, mode) for model, mode in MESSAGES.values()]
    keys, definitions = models_json_schema(
        models, by_alias=True, ref_template="#/components/schemas/{model}", title="ontofabric"
    )
    schemas: Json = dict(definitions.get("$defs", {}))
    for name, (model, mode) in MESSAGES.items():
        reference = keys[(model, mode)]["$ref"].rsplit("/", 1)[-1]
        if reference != _component(name):
            schemas[_component(name)] = {"$ref": f"#/components/schemas/{reference}"}
    cleaned: Json = portable(schemas)
    return cleaned


def _message(title: str, payload: str | Json, summary: str, headers: Json | None = None) -> Json:
    message: Json = {
        "name": title,
        "title": title,
        "summary": summary,
        "contentType": "application/json",
        "payload": {"$ref": f"#/components/schemas/{payload}"} if isinstance(payload, str) else payload,
    }
    if headers is not None:
        message["headers"] = headers
    return message


def _headers(properties: Json, required: list[str] | None = None) -> Json:
    schema: Json = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema


_REQUEST_HEADERS = _headers(
    {
        TIMEOUT_HEADER: {
            "type": "string",
            "pattern": "^[0-9]+$",
            "description": "How long the caller waits, in milliseconds (1 to 300000): the worker answers or refuses "
            "within it. Without it the worker's default deadline bounds the work (ONTOFABRIC_QUERY_DEFAULT_TIMEOUT_MS, "
            "10 s), and the request waits for a free slot at most ONTOFABRIC_QUERY_UNSTATED_MAX_WAIT_MS (250 ms), "
            "since the caller's timeout is unknown. Spaces around the digits are ignored, as in HTTP; anything else "
            "is refused (invalid_request, field `header Ontofabric-Timeout-Ms`).",
        },
        SENT_AT_HEADER: {
            "type": "string",
            "pattern": "^[0-9]+$",
            "description": "Optional: when the caller sent the request, in milliseconds since the Unix epoch. A "
            f"worker that reads it more than {CLOCK_ALLOWANCE_MS} ms later (it stalled) counts the wait against the "
            "timeout, and does no work for a caller that has given up. Send it only where the hosts' clocks agree "
            "within that. Spaces around the digits are ignored. One more than a day from the worker's clock is "
            "refused (invalid_request naming the header).",
        },
        RECEIPT_HEADER: {
            "type": "string",
            "description": "Optional, any value: the worker that reads the request first sends an empty Receipt "
            f"message ({RECEIPT_HEADER}: {RECEIVED}) to the reply subject, then the reply. A caller that reads more "
            "than one message there tells a worker frozen or gone (no receipt within a second or so) from one at "
            "work, and sends the request again at once.",
        },
        **_TRACE_HEADERS,
    }
)
"""The headers every request to the query workers may carry (query, document and status alike)."""


def _messages() -> Json:
    return {
        "DeltaEnvelope": _message(
            "DeltaEnvelope",
            "DeltaEnvelope",
            "A document upsert, delete or revert, or an ontology graph change, of one workspace and branch. "
            f"A message carrying any of the headers {', '.join(SERVER_ANSWER_HEADERS)} is read as a NATS server's "
            "answer stored on the subject, not a delta: it is dropped without a dead letter (counted in the metric "
            "projector.deltas, outcome server_answer_dropped, and logged). A producer must not set them. Beyond "
            "this schema the projector refuses (dead-letters invalid_schema, naming the field): text holding a NUL "
            "or a lone surrogate (PostgreSQL stores neither); an embedding with a value that is no finite float32, "
            "or (nearly) the zero vector; a body nested more than 200 objects or arrays deep; a time whose UTC "
            "falls outside years 1 to 9999. It reads occurredAt loosely, as it always has (a time without offset, "
            "epoch seconds): the schema states the form to send.",
            _headers(
                {
                    "Nats-Msg-Id": {
                        "type": "string",
                        "description": "<workspace>:<eventId>:<session> of the envelope, where <session> is a "
                        "random part the publisher draws once: JetStream stores a repeat from the same publisher "
                        "inside its duplicate window once, and dedupes across every workspace's deltas. A message "
                        "id another tenant can foresee would let it have the server drop the delta as a repeat "
                        "(a tenant may publish under any id on its own subjects); the projector applies an event "
                        "id once per workspace whatever the message id. Required of a producer; a delta without it is "
                        "not refused, but a publish retried after a lost acknowledgement is then stored twice (and "
                        "applied once).",
                    },
                    "Content-Type": {"type": "string", "const": "application/json"},
                    **_TRACE_HEADERS,
                },
                ["Nats-Msg-Id"],
            ),
        ),
        "DeltaStored": _message(
            "DeltaStored",
            {"type": "string", "maxLength": 0, "description": "Empty: only the stored delta's headers come again."},
            "A delta the stream stored, republished by the stream as its headers alone: query workers learn the "
            "latest sequence of each workspace and branch without reading the stream. The delta's own headers come "
            "too (Content-Type, Nats-Msg-Id, whatever its producer set), before the stream's: where a producer set "
            "one of the names below, the stream's value is the last of that name's values. Read the last (a nats.js "
            "client's headers.get() returns the first).",
            _headers(
                {
                    "Nats-Stream": {"type": "string"},
                    "Nats-Subject": {"type": "string", "description": "The delta's own subject."},
                    "Nats-Sequence": {"type": "string", "description": "Its stream sequence."},
                    "Nats-Time-Stamp": {"type": "string", "description": "When the stream stored it (RFC 3339)."},
                    "Nats-Last-Sequence": {"type": "string"},
                },
                ["Nats-Stream", "Nats-Subject", "Nats-Sequence"],
            ),
        ),
        "DeadLetter": _message(
            "DeadLetter",
            {
                "description": "The rejected delta's bytes exactly as published (often a DeltaEnvelope, but whatever "
                "could not be read as one, too)."
            },
            "A delta that can never apply, with why in its headers. `ontofabric dlq` lists, re-drives and purges.",
            _headers(
                {
                    "Nats-Msg-Id": {"type": "string", "description": "dlq:<index>:<stream>:<sequence>."},
                    "Ontofabric-Reason": {
                        "type": "string",
                        "description": "A stable code: oversized, invalid_schema, subject_mismatch, content_too_large,"
                        " embedding_dimension_mismatch, embedding_model_mismatch, token_vectors_dimension_mismatch, "
                        "apply_failed, index_refused, event_id_reused.",
                    },
                    "Ontofabric-Detail": {"type": "string", "maxLength": 1000},
                    "Ontofabric-Index": {"type": "string", "description": "The index that refused it."},
                    "Ontofabric-Original-Subject": {"type": "string"},
                    "Ontofabric-Original-Stream": {"type": "string"},
                    "Ontofabric-Original-Sequence": {"type": "string"},
                    "Ontofabric-Delivered": {"type": "string", "description": "Deliveries before it was refused."},
                    **_TRACE_HEADERS,  # the delta's, carried on (and by its re-drive)
                },
                ["Ontofabric-Reason", "Ontofabric-Original-Subject", "Ontofabric-Original-Sequence"],
            ),
        ),
        "OntologyVersionChanged": _message(
            "OntologyVersionChanged",
            "OntologyVersionChanged",
            "A workspace and branch's new ontologyVersion, after the commit that made it: caches keyed by an "
            "older version stop being read.",
        ),
        "OntologyQuery": _message("OntologyQuery", "OntologyQuery", "A hybrid retrieval request.", _REQUEST_HEADERS),
        "Receipt": {
            **_message(
                "Receipt",
                {"type": "string", "maxLength": 0, "description": "Empty."},
                f"Sent before the reply to a request that carries {RECEIPT_HEADER}: a worker has it.",
                _headers({RECEIPT_HEADER: {"type": "string", "const": RECEIVED}}, [RECEIPT_HEADER]),
            ),
            "contentType": "application/octet-stream",
        },
        "QueryResponse": _message("QueryResponse", "QueryResponse", "The ranked results and the _meta envelope."),
        "ErrorReply": _message(
            "ErrorReply",
            "ErrorReply",
            "A refused or failed request: a stable code, whether it is retryable, and the fields at fault.",
        ),
        "DocumentRequest": _message("DocumentRequest", "DocumentRequest", "One document by id.", _REQUEST_HEADERS),
        "DocumentReply": _message("DocumentReply", "DocumentReply", "The document, or why there is none."),
        "StatusRequest": _message(
            "StatusRequest",
            "StatusRequest",
            "A workspace's index status. An ingester may ask it of its own workspace: its deltas are indexed (or "
            "dead-lettered) once indexedSeq reaches the sequence of the last one's publish acknowledgement.",
            _REQUEST_HEADERS,
        ),
        "StatusReply": _message("StatusReply", "StatusReply", "Per branch: version, freshness and lag."),
        "Snapshot": _message(
            "Snapshot",
            {"type": "string", "contentEncoding": "binary", "description": "zlib-compressed JSON, in chunks."},
            "A workspace's fold of the compacted delta stream (`ontofabric compact`): the last delta of each row as "
            "stored, and the event ids the fold handled; the object `_compacted` names the sequence they all cover.",
        ),
        "Manifest": _message(
            "Manifest",
            {"type": "string", "contentEncoding": "binary", "description": "zlib-compressed JSON, in parts."},
            "What an ingester last published for a workspace and branch (its own state, read by nobody else): a "
            "head key naming a generation and its part count, and the parts.",
        ),
    }


def _channel(address: str, description: str, messages: list[str], parameters: Json | None = None) -> Json:
    channel: Json = {
        "address": address,
        "description": description,
        "messages": {name: {"$ref": f"#/components/messages/{name}"} for name in messages},
    }
    if parameters:
        channel["parameters"] = parameters
    return channel


def _reply_channel(messages: list[str]) -> Json:
    return {
        "address": None,
        "description": "The requester's inbox: the request's NATS reply subject, which must start with `_INBOX.` "
        "(a worker answers no other subject). On a deployment with NATS logins each user may only subscribe under "
        "`_INBOX.<its user name>.`, so a client sets that as its inbox prefix (nats.js `inboxPrefix`, nats-py "
        "`inbox_prefix`); for an nkey user the name is its public key.",
        "messages": {name: {"$ref": f"#/components/messages/{name}"} for name in messages},
    }


def _channels(names: Names) -> Json:
    scope = {"workspace": _WORKSPACE, "branch": _BRANCH}
    workspace = {"workspace": _WORKSPACE}
    request = (
        "Request-reply to the query workers (queue group `{queue}`); any worker answers any workspace. A body over "
        f"{MAX_REQUEST_BYTES:,} bytes is refused unread (invalid_request)."
    )
    channels: Json = {
        "deltas": _channel(
            f"{names.prefix}.delta.{{workspace}}.{{branch}}",
            f"Stored by JetStream stream {names.delta_stream} (file storage, messages up to "
            f"{MAX_DELTA_MESSAGE_BYTES} bytes) and applied by the projectors in stream order.",
            ["DeltaEnvelope"],
            scope,
        ),
        "deltasStored": _channel(
            f"{names.prefix}.published.{{workspace}}.{{branch}}",
            f"Republished by stream {names.delta_stream} for every delta it stores (headers only).",
            ["DeltaStored"],
            scope,
        ),
        "deadLetters": _channel(
            f"{names.prefix}.dlq.{{workspace}}",
            f"Stored by JetStream stream {names.dlq_stream}. `_unknown` stands for a workspace the subject did not "
            "name.",
            ["DeadLetter"],
            workspace,
        ),
        "versionEvents": _channel(
            f"{names.prefix}.version.{{workspace}}.{{branch}}",
            "Core NATS, not stored: the bucket below holds the latest of each.",
            ["OntologyVersionChanged"],
            scope,
        ),
        "versionBucket": _channel(
            f"$KV.{names.version_bucket}.{{workspace}}.{{branch}}",
            f"KV bucket {names.version_bucket} (history 1): the latest ontologyVersion per workspace and branch, "
            "written with compare-and-set on the revision so an older version never replaces a newer one.",
            ["OntologyVersionChanged"],
            scope,
        ),
        "manifestBucket": _channel(
            f"$KV.{names.manifest_bucket}.{{workspace}}.{{branch}}.{{part}}",
            f"KV bucket {names.manifest_bucket}: keys `<workspace>.<branch>.head` and "
            "`<workspace>.<branch>.parts.<generation>.<index>`.",
            ["Manifest"],
            {**scope, "part": {"description": "`head`, or `parts.<generation>.<index>`."}},
        ),
        "snapshotBucket": _channel(
            f"$O.{names.snapshot_bucket}.{{part}}",
            f"Object store {names.snapshot_bucket}: one object per workspace, named by its subject token.",
            ["Snapshot"],
            {"part": {"description": "`C.<nuid>` for a chunk, `M.<base64 of the name>` for an object's metadata."}},
        ),
    }
    for operation, (request_message, reply_message) in {
        "query": ("OntologyQuery", "QueryResponse"),
        "document": ("DocumentRequest", "DocumentReply"),
        "status": ("StatusRequest", "StatusReply"),
    }.items():
        channels[f"{operation}Requests"] = _channel(
            f"{names.prefix}.{operation}.{{workspace}}",
            request.format(queue=names.query_queue),
            [request_message],
            workspace,
        )
        channels[f"{operation}Replies"] = _reply_channel([reply_message, "ErrorReply", "Receipt"])
    return channels


def _operation(action: str, channel: str, summary: str, messages: list[str], reply: str | None = None) -> Json:
    operation: Json = {
        "action": action,
        "channel": {"$ref": f"#/channels/{channel}"},
        "summary": summary,
        "messages": [{"$ref": f"#/channels/{channel}/messages/{name}"} for name in messages],
    }
    if reply is not None:
        operation["reply"] = {"channel": {"$ref": f"#/channels/{reply}"}}
    return operation


def _operations(names: Names) -> Json:
    queue = {"nats": {"queue": names.query_queue, "bindingVersion": "0.1.0"}}
    operations: Json = {
        "publishDelta": _operation("send", "deltas", "Ingesters publish deltas.", ["DeltaEnvelope"]),
        "projectDeltas": _operation(
            "receive",
            "deltas",
            "Projectors apply deltas (durable pull consumers, explicit ack; one per partition of the workspaces).",
            ["DeltaEnvelope"],
        ),
        "trackPublished": _operation(
            "receive", "deltasStored", "Query workers follow what the stream stored.", ["DeltaStored"]
        ),
        "deadLetter": _operation(
            "send", "deadLetters", "Projectors dead-letter a delta that can never apply.", ["DeadLetter"]
        ),
        "announceVersion": _operation(
            "send", "versionEvents", "Projectors and rebuilds announce a new version.", ["OntologyVersionChanged"]
        ),
        "invalidateCaches": _operation(
            "receive",
            "versionEvents",
            "Query workers drop cache entries of older versions.",
            ["OntologyVersionChanged"],
        ),
        "storeVersion": _operation(
            "send", "versionBucket", "Projectors record the latest version.", ["OntologyVersionChanged"]
        ),
        "saveManifest": _operation("send", "manifestBucket", "Ingesters save what they published.", ["Manifest"]),
        "saveSnapshot": _operation(
            "send", "snapshotBucket", "`ontofabric compact` stores each workspace's snapshot.", ["Snapshot"]
        ),
    }
    for operation, request_message, summary in (
        ("query", "OntologyQuery", "Answer an ontology_query."),
        ("document", "DocumentRequest", "Answer a document by id."),
        ("status", "StatusRequest", "Answer a workspace's status."),
    ):
        operations[f"{operation}"] = {
            **_operation("receive", f"{operation}Requests", summary, [request_message], f"{operation}Replies"),
            "bindings": queue,
        }
    return operations


def render(names: Names | None = None) -> str:
    names = names or Names()
    document: Json = {
        "asyncapi": "3.0.0",
        "id": "urn:ontofabric",
        "info": {
            "title": "ontofabric",
            "version": f"{SCHEMA_VERSION}.0.0",
            "description": "Event-driven indexing and query workers over NATS JetStream. Addresses use the default "
            f"subject prefix `{names.prefix}` (ONTOFABRIC_SUBJECT_PREFIX changes it; streams and buckets are named "
            "from it too). Payloads are the JSON Schemas of contracts/schemas. Query workers also answer NATS "
            f"service discovery (`$SRV.PING|INFO|STATS.{names.query_service}`, the nats.micro protocol), and so do the "
            f"projectors (`{names.projector_service}`).",
        },
        "defaultContentType": "application/json",
        "servers": {
            "nats": {
                "host": "localhost:4222",
                "protocol": "nats",
                "description": "A nats-server with JetStream (or a cluster of them). Each role connects with its own "
                "credentials, whose permissions docs/security.md lists.",
            }
        },
        "channels": _channels(names),
        "operations": _operations(names),
        "components": {"messages": _messages(), "schemas": _payload_schemas()},
    }
    return json.dumps(document, indent=2, sort_keys=False) + "\n"


def write(path: Path = DOCUMENT_PATH) -> Path:
    path.write_text(render(), encoding="utf-8")
    return path


def drifted(path: Path = DOCUMENT_PATH) -> bool:
    return not path.exists() or path.read_text(encoding="utf-8") != render()
