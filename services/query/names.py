"""How a dotted name a query gives matches a symbol's qualified name or an object type (pure): shared by the
store's lookups, the ordering of definitions and the graph's."""

from __future__ import annotations


def last_part(name: str) -> str:
    """What the store looks a name up by: its last dotted part (``__call__`` of ``Retrying.__call__``)."""
    return name.rsplit(".", 1)[-1]


def match_quality(symbol_fqn: str, name: str) -> int | None:
    """How well a symbol's qualified name matches the asked ``name``, best first: 0 it is the name, 1 it ends with
    it (the name's parts are its last parts), 2 and 3 the same ignoring case; None when neither."""
    for ignoring_case, (fqn, asked) in enumerate(((symbol_fqn, name), (symbol_fqn.lower(), name.lower()))):
        if fqn == asked:
            return 2 * ignoring_case
        if fqn.endswith("." + asked):
            return 2 * ignoring_case + 1
    return None
