"""A request body read against its contract (pure): what a query worker parses, and what the MCP gateway checks
itself when no worker can be asked, said the same way by both."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ValidationError

from ontofabric.contracts import MAX_REQUEST_BYTES, QueryError
from ontofabric.contracts.query import ErrorDetail, clipped, validation_details
from ontofabric.shared.half_characters import HALF_CHARACTER, surrogate_field

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
        return model.model_validate_json(body, by_name=False)  # the wire names only, as the schema says
    except ValidationError as error:
        problems = error.errors(include_url=False, include_input=False)
        field = surrogate_field(body) if any(e["type"] == "json_invalid" for e in problems) else None
        details = [ErrorDetail(field=clipped(field), message=HALF_CHARACTER)] if field else validation_details(problems)
        return QueryError(
            code="invalid_request", message=f"the request does not match {model.__name__}", details=details
        )
