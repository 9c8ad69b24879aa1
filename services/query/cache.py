"""What the query worker keeps between queries is keyed by ontologyVersion: an answer or a graph is only ever used
for the version it was read at, and dropped when the version moves or a rebuild replaces the index."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ontofabric.shared.lru import LruCache


class Versioned(Hashable, Protocol):
    @property
    def workspace(self) -> str: ...

    @property
    def branch(self) -> str: ...

    @property
    def ontology_version(self) -> str: ...


@dataclass(frozen=True)
class VersionKey:
    """What was read: a workspace's branch (main ⊕ branch) at an ontologyVersion, in a rebuild generation."""

    workspace: str
    branch: str
    ontology_version: str
    generation: int = 0
    """The workspace's rebuild generation it was read in (VersionTracker.generation)."""


@dataclass(frozen=True)
class CacheKey:
    """An answer's key: what it was read from, and the query asked."""

    workspace: str
    branch: str
    ontology_version: str
    query_hash: str
    params_hash: str
    generation: int = 0


def stable_hash(value: Any) -> str:
    """sha256 of the canonical JSON of ``value`` (sorted keys), for query and parameter hashes."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


K = TypeVar("K", bound=Versioned)
V = TypeVar("V")


def drop_stale(cache: LruCache[K, V], workspace: str, current_version: Callable[[str], str]) -> int:
    """Drop the workspace's entries read at another version than their branch's current one.

    A branch's version includes main's, so a new main version makes the branches' entries stale too."""
    return cache.drop_where(
        lambda key: key.workspace == workspace and key.ontology_version != current_version(key.branch)
    )


def drop_workspace(cache: LruCache[K, V], workspace: str) -> int:
    """Drop every entry of the workspace (after a rebuild: all were read from the replaced index)."""
    return cache.drop_where(lambda key: key.workspace == workspace)
