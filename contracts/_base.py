"""Shared model configuration for the wire contracts: camelCase on the wire, snake_case in Python."""

from __future__ import annotations

import types
from functools import cache
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic.alias_generators import to_camel


class WireModel(BaseModel):
    """A message read from the wire by someone else's code: unknown fields are ignored (evolution is additive)."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        extra="ignore",
        frozen=True,
    )


class StrictRequest(BaseModel):
    """A request we validate for a caller: unknown fields and loosely typed values are errors, not guesses."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        extra="forbid",
        strict=True,
        frozen=True,
        allow_inf_nan=False,  # NaN and Infinity are no JSON; read as numbers they failed a bound, not as what they are
    )

    @model_validator(mode="before")
    @classmethod
    def _whole_numbers_written_with_a_point(cls, data: Any) -> Any:
        """``5.0`` for an integer field is 5: JSON Schema counts it an integer, and so did the gateway, while strict
        validation refused it over NATS (a conformance tester's). A fraction is still refused."""
        if not isinstance(data, dict):
            return data
        whole = {
            key: int(value)
            for key, value in data.items()
            if type(value) is float and value.is_integer() and key in _integer_fields(cls)
        }
        return {**data, **whole} if whole else data


@cache
def _integer_fields(model: type[BaseModel]) -> frozenset[str]:
    """The names and aliases of ``model``'s fields that hold an integer (or an integer or null)."""
    names: set[str] = set()
    for name, field in model.model_fields.items():
        annotation = field.annotation
        options = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
        if int in options:
            names.update(n for n in (name, field.alias) if n)
    return frozenset(names)
