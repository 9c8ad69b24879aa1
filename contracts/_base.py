"""Shared model configuration for the wire contracts: camelCase on the wire, snake_case in Python."""

from __future__ import annotations

import types
from collections.abc import Iterable, Iterator
from functools import cache
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic.alias_generators import to_camel


class WholeNumbers(BaseModel):
    """``5.0`` for an integer field is 5: JSON Schema counts it an integer, and strict validation refused it (a
    conformance tester's query over NATS; a nats.js tester's ``startLine`` written by a library that writes every
    number with a point, dead-lettered though the schema takes it). A fraction is still refused."""

    @model_validator(mode="before")
    @classmethod
    def _whole_numbers_written_with_a_point(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        whole = {
            key: int(value)
            for key, value in data.items()
            if type(value) is float and value.is_integer() and key in _integer_fields(cls)
        }
        return {**data, **whole} if whole else data


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


class StrictRequest(WholeNumbers):
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


class JsonWalk:
    """Every value nested in a JSON value (parsed), depth first, each with its place built only when asked
    (:meth:`place`). A place made as text for every value copied a long key into each of its many children: an
    audit's delta of 240 KB (a 80,000-character key over a list of 80,000 items) took over 3 GB."""

    def __init__(self, items: Iterable[tuple[str | int, object]]) -> None:
        self._steps: list[tuple[int, str | int]] = []
        """Each place reached: (its parent's index, or -1, and the key or index leading to it)."""
        self._pending: list[tuple[int, object]] = []
        self._push(-1, items)

    def __iter__(self) -> Iterator[tuple[int, object]]:
        """(place, value) for each value in document order, a container before its items."""
        while self._pending:
            place, value = self._pending.pop()
            yield place, value
            if isinstance(value, dict):
                self._push(place, value.items())
            elif isinstance(value, list):
                self._push(place, enumerate(value))

    def _push(self, parent: int, children: Iterable[tuple[str | int, object]]) -> None:
        """Children to visit, the first on top: values come in document order."""
        first = len(self._pending)
        for step, item in children:
            self._pending.append((len(self._steps), item))
            self._steps.append((parent, step))
        self._pending[first:] = self._pending[first:][::-1]

    def step(self, place: int) -> str | int:
        """The key or index leading to ``place``."""
        return self._steps[place][1]

    def place(self, place: int, *, brackets: bool) -> str:
        """The keys and indexes to ``place``, dotted (``brackets``: an index as ``[0]``, else as ``.0``)."""
        steps: list[str | int] = []
        while place >= 0:
            place, step = self._steps[place]
            steps.append(step)
        text = ""
        for step in reversed(steps):
            if isinstance(step, int) and brackets:
                text += f"[{step}]"
            else:
                text += f".{step}" if text else str(step)
        return text
