"""How a dotted name a query gives matches a symbol's qualified name or an object type (pure): shared by the
store's lookups, the ordering of definitions and the graph's."""

from __future__ import annotations

import re
from collections.abc import Sequence

from ontofabric.shared.analysis import folded

_CAPITALS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"  # spelt out: what a range covers depends on the database's collation
PRIVATE_PART = rf"[.]_[^_.{_CAPITALS}][^.]*(?=[.])"
"""A module part of a qualified name that is private by Python's convention (``._client`` of
``httpx._client.Client``), neither the first part nor the last; the same pattern in SQL (PostgreSQL's regular
expressions read it alike). A part capitalised after its underscore is a class's, by the same convention, and is
kept: no module publishes the members of a private class (an agent tester's ``jinja2.ext.gettext`` was answered
by ``jinja2.ext._TranslationsBasic.gettext``, "the definition", at 1.0)."""
_PRIVATE_PART = re.compile(PRIVATE_PART)


def last_part(name: str) -> str:
    """What the store looks a name up by: its last dotted part (``__call__`` of ``Retrying.__call__``)."""
    return name.rsplit(".", 1)[-1]


def republished_as(symbol_fqn: str, aliases: Sequence[str], source_domain: str) -> str | None:
    """The shortest name a Python package re-exports the symbol under, where it is shorter than its own
    (``anyio.sleep`` for ``anyio._core._eventloop.sleep``): an alias of fewer parts than its own name as imported,
    which is an alias too in a src layout (``pkg.mod.f`` for ``src.pkg.mod.f``; a review's, where every chunk had
    an alias); else None. Python's aliases alone say so: other languages' name every declaration by its package or
    crate (a review's Go ``package main`` function went first)."""
    if source_domain != "python" or not symbol_fqn:
        return None
    imported = [alias for alias in aliases if symbol_fqn.endswith("." + alias)]
    parts = min(name.count(".") for name in [symbol_fqn, *imported])
    shorter = [alias for alias in aliases if alias.count(".") < parts]
    return min(shorter, key=lambda alias: (alias.count("."), alias)) if shorter else None


def published_name(symbol_fqn: str) -> str:
    """The qualified name without its private parts: the name a package that re-exports the symbol publishes it
    by (``httpx.Client`` for ``httpx._client.Client``)."""
    return _PRIVATE_PART.sub("", symbol_fqn)


def match_quality(symbol_fqn: str, name: str) -> int | None:
    """How well a symbol's qualified name matches the asked ``name``, best first: 0 it is the name, 1 it ends with
    it (the name's parts are its last parts), 2 it is the name without its private parts (``published_name``); 3,
    4 and 5 the same ignoring case in any script (:func:`folded`); None when none of these. Below ``AS_WRITTEN``:
    matched as written."""
    published = published_name(symbol_fqn)  # of the name as written: a class's part is told by its capital
    for ignoring_case, (fqn, asked, without_private) in enumerate(
        ((symbol_fqn, name, published), (folded(symbol_fqn), folded(name), folded(published)))
    ):
        if fqn == asked:
            return AS_WRITTEN * ignoring_case
        if fqn.endswith("." + asked):
            return AS_WRITTEN * ignoring_case + 1
        if without_private == asked:
            return AS_WRITTEN * ignoring_case + 2
    return None


AS_WRITTEN = 3
"""The match qualities below this match the name as written (case and all)."""


def qualities_kept(best: int, name: str) -> range:
    """The match qualities (:func:`match_quality`) that name what ``name`` asks for, where ``best`` is the best
    found: a dotted name that is a symbol's whole qualified name names that symbol alone (an agent tester's
    ``faststream.types`` also named ``faststream._internal.types``, published as it, and ``importers`` listed that
    one's 78 importers of a module no file imports), and so does one that is it ignoring case alone, where none is
    it as written (a retest's ``faststream.Types``); else the names matching as written; else any."""
    if best in (0, AS_WRITTEN) and "." in name.strip("."):  # the whole name, as written or ignoring case alone
        return range(best, best + 1)
    return range(AS_WRITTEN) if best < AS_WRITTEN else range(2 * AS_WRITTEN)
