"""An LRU of query answers keyed by ontologyVersion: an answer is only ever served for the version it was made from."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

V = TypeVar("V")


@dataclass(frozen=True)
class CacheKey:
    workspace: str
    branch: str
    ontology_version: str
    query_hash: str
    params_hash: str
    generation: int = 0
    """The workspace's rebuild generation the answer was read in (VersionTracker.generation)."""


def stable_hash(value: Any) -> str:
    """sha256 of the canonical JSON of ``value`` (sorted keys), for query and parameter hashes."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class VersionedCache(Generic[V]):
    """Bounded LRU. Not thread-safe: one asyncio loop owns it."""

    def __init__(self, max_entries: int) -> None:
        self._max_entries = max_entries
        self._entries: OrderedDict[CacheKey, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: CacheKey) -> V | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: CacheKey, value: V) -> None:
        if self._max_entries <= 0:
            return
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)

    def drop_workspace(self, workspace: str) -> int:
        stale = [key for key in self._entries if key.workspace == workspace]
        for key in stale:
            del self._entries[key]
        return len(stale)

    def invalidate_stale(self, workspace: str, current_version: Callable[[str], str]) -> int:
        """Drop the workspace's answers made from another version than their branch's current one.

        A branch answer's version includes main's, so a new main version makes the branches' answers stale too.
        """
        stale = [
            key
            for key in self._entries
            if key.workspace == workspace and key.ontology_version != current_version(key.branch)
        ]
        for key in stale:
            del self._entries[key]
        return len(stale)
