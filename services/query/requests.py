"""A request body read against its contract (pure): what a query worker parses, and what the MCP gateway checks
itself when no worker can be asked, said the same way by both."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from ontofabric.contracts import MAX_REQUEST_BYTES, QueryError
from ontofabric.contracts._base import JsonWalk
from ontofabric.contracts.query import ErrorDetail, clipped, validation_details
from ontofabric.shared.half_characters import unreadable_text

Model = TypeVar("Model", bound=BaseModel)


def read_request(model: type[Model], body: bytes) -> Model | QueryError:
    """The request ``body`` holds, or the ``invalid_request`` error naming what is wrong with it: longer than
    MAX_REQUEST_BYTES (not parsed), a field holding half a character, or what the contract refuses."""
    if len(body) > MAX_REQUEST_BYTES:
        return QueryError(
            code="invalid_request",
            message=f"the request is {len(body):,} bytes; a request takes at most {MAX_REQUEST_BYTES:,}",
            details=[ErrorDetail(field=None, message=f"at most {MAX_REQUEST_BYTES:,} bytes")],
        )
    try:
        request = model.model_validate_json(body, by_name=False)  # the wire names only, as the schema says
    except ValidationError as error:
        problems = error.errors(include_url=False, include_input=False)
        # Half a character, text in another encoding (`café` in Latin-1), a byte-order mark: named by the field
        # and what is wrong, as the MCP gateway names them (an outside tester's got pydantic's "invalid unicode
        # code point at line 1 column 23").
        found = unreadable_text(body, error)
        details = (
            [ErrorDetail(field=clipped(found[0]) if found[0] else None, message=found[1])]
            if found
            else validation_details(problems)
        )
        return QueryError(
            code="invalid_request", message=f"the request does not match {model.__name__}", details=details
        )
    repeated = repeated_key(body)
    return request if repeated is None else repeated_key_error(repeated)


def repeated_key_error(repeated: str) -> QueryError:
    """The error for a request that names the field ``repeated`` (a path, :func:`repeated_key`) twice."""
    return QueryError(
        code="invalid_request",
        message=f"the request names {repeated!r} twice",
        details=[ErrorDetail(field=clipped(repeated), message="given twice: a request names each field once")],
    )


def repeated_key(body: bytes) -> str | None:
    """The first key an object of the JSON ``body`` holds twice, with its path (``options.candidates``,
    ``relatedTo.symbol``; a list's items by index, as ``validation_details`` names them); None when
    none is. The contract's parser keeps the last, so a client that sent two values never learned which one was
    read (a fault harness's ``{"topK": 1, "topK": 50}``)."""
    try:
        parsed, repeats = _marking_repeats(body)
    except (ValueError, RecursionError):  # what the contract's parser accepted, this one need not: left to it
        return None
    return _path_of_repeat(parsed) if repeats else None


def repeated_keys_by_item(body: bytes) -> dict[int, str]:
    """For a JSON array ``body`` (a JSON-RPC batch): each item one of whose objects holds a key twice, with its path
    within the item (:func:`repeated_key`); empty for anything else."""
    try:
        parsed, repeats = _marking_repeats(body)
    except (ValueError, RecursionError):
        return {}
    if not repeats or not isinstance(parsed, list):
        return {}
    return {index: path for index, item in enumerate(parsed) if (path := _path_of_repeat(item)) is not None}


def _marking_repeats(body: bytes) -> tuple[Any, bool]:
    """``body`` parsed, each object that held a key twice a :class:`_Repeats`, and whether there is one."""
    repeats = False

    def checked(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal repeats
        keys = [key for key, _ in pairs]
        if len(set(keys)) == len(keys):
            return dict(pairs)
        repeats = True
        return _Repeats(pairs, next(key for n, key in enumerate(keys) if key in keys[:n]))

    return json.loads(body, object_pairs_hook=checked), repeats


class _Repeats(dict[str, Any]):
    """An object that held ``repeated`` twice (its last value kept, as the contract's parser keeps it)."""

    def __init__(self, pairs: list[tuple[str, Any]], repeated: str) -> None:
        super().__init__(pairs)
        self.repeated = repeated


def _path_of_repeat(value: Any) -> str | None:
    """The place of the first object that held a key twice, in document order, the outer first (as
    validation_details names places). Built only for it: one made for every value copied a long key into each of
    its many items (an audit's)."""
    walk = JsonWalk([("", value)])
    for place, item in walk:
        if isinstance(item, _Repeats):
            return ".".join(part for part in (walk.place(place, brackets=False), item.repeated) if part)
    return None
