"""What the query worker keeps between queries is keyed by ontologyVersion: an answer or a graph is only ever used
for the version it was read at, and dropped when the version moves or a rebuild replaces the index."""

from __future__ import annotations

import functools
import hashlib
import json
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from opentelemetry.metrics import CallbackOptions, Observation

from ontofabric.shared.lru import LruCache
from ontofabric.shared.telemetry import meter


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


def by_workspace(key: Versioned) -> str:
    """Whose an entry is, for the caches to share out between tenants (LruCache's ``owner``)."""
    return key.workspace


def drop_stale(cache: LruCache[K, V], workspace: str, current_version: Callable[[str], str]) -> int:
    """Drop the workspace's entries read at another version than their branch's current one.

    A branch's version includes main's, so a new main version makes the branches' entries stale too."""
    return cache.drop_where(
        lambda key: key.workspace == workspace and key.ontology_version != current_version(key.branch)
    )


def drop_workspace(cache: LruCache[K, V], workspace: str) -> int:
    """Drop every entry of the workspace (after a rebuild: all were read from the replaced index)."""
    return cache.drop_where(lambda key: key.workspace == workspace)


_answer_caches: tuple[weakref.ref[LruCache[Any, bytes]], ...] = ()
"""The answer caches of this process's query workers, for the gauges below. Read from the metric reader's thread:
a tuple replaced whole, never changed in place (a set iterated there while the loop added to it, or the collector
took a cache from it, could fail), and each cache's length and bytes read whole."""


def metered(cache: LruCache[K, bytes]) -> LruCache[K, bytes]:
    """``cache``, its entries and bytes counted in ``retrieval.cache.entries`` and ``retrieval.cache.bytes``."""
    global _answer_caches
    _answer_caches = (*(ref for ref in _answer_caches if ref() is not None), weakref.ref(cache))
    _gauges()
    return cache


def unmetered(cache: LruCache[K, bytes]) -> None:
    """Count ``cache`` no more: its worker stopped (until the collector took it, a stopped worker's answers were
    still counted)."""
    global _answer_caches
    _answer_caches = tuple(ref for ref in _answer_caches if (held := ref()) is not None and held is not cache)


def _live_caches() -> list[LruCache[Any, bytes]]:
    return [cache for ref in _answer_caches if (cache := ref()) is not None]


def _observe_entries(_: CallbackOptions) -> list[Observation]:
    return [Observation(sum(len(cache) for cache in _live_caches()))]


def _observe_bytes(_: CallbackOptions) -> list[Observation]:
    return [Observation(sum(cache.bytes for cache in _live_caches()))]


@functools.cache
def _gauges() -> None:
    """Made with the first cache: every process importing this module (the CLI, an ingest, the gateway) exported
    two gauges of 0 otherwise, as if it held a cache (an SRE's)."""
    meter().create_observable_gauge(
        "retrieval.cache.entries",
        callbacks=[_observe_entries],
        description="answers the query workers' caches hold (at most ONTOFABRIC_QUERY_CACHE_ENTRIES a worker)",
    )
    meter().create_observable_gauge(
        "retrieval.cache.bytes",
        unit="By",
        callbacks=[_observe_bytes],
        description="what the answers the query workers' caches hold weigh (at most ONTOFABRIC_QUERY_CACHE_BYTES a "
        "worker)",
    )
