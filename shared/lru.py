"""The one bounded cache of the project: least recently used entries go first."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LruCache(Generic[K, V]):
    """At most ``max_entries`` entries (0 keeps none) and, given ``size``, at most ``max_bytes`` of them by that
    measure (one entry larger than that is not kept). Not thread-safe: one asyncio loop owns it."""

    def __init__(self, max_entries: int, max_bytes: int | None = None, size: Callable[[V], int] | None = None) -> None:
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._size = size
        self._sizes: dict[K, int] = {}
        self.bytes = 0
        """What the entries weigh, by ``size`` (0 without one)."""
        self._entries: OrderedDict[K, V] = OrderedDict()

    @property
    def keeps(self) -> bool:
        """Whether it keeps anything at all (``max_entries`` above 0): what is put in a cache that keeps nothing
        need not be made."""
        return self._max_entries > 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: K) -> bool:
        return key in self._entries

    def get(self, key: K) -> V | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        if self._max_entries <= 0:
            return
        weight = self._size(value) if self._size is not None else 0
        if self._max_bytes is not None and weight > self._max_bytes:
            return
        self._forget(key)
        self._entries[key] = value
        self._sizes[key] = weight
        self.bytes += weight
        while len(self._entries) > self._max_entries or (self._max_bytes is not None and self.bytes > self._max_bytes):
            self._forget(next(iter(self._entries)))

    def peek(self, key: K) -> V | None:
        """The entry, without making it recently used."""
        return self._entries.get(key)

    def pop(self, key: K) -> V | None:
        """The entry, forgotten."""
        value = self._entries.get(key)
        self._forget(key)
        return value

    def items(self) -> list[tuple[K, V]]:
        """Every entry, least recently used first."""
        return list(self._entries.items())

    def drop_where(self, stale: Callable[[K], bool]) -> int:
        """Forget every entry whose key is ``stale``; returns how many went."""
        keys = [key for key in self._entries if stale(key)]
        for key in keys:
            self._forget(key)
        return len(keys)

    def _forget(self, key: K) -> None:
        if key in self._entries:
            del self._entries[key]
            self.bytes -= self._sizes.pop(key)


class LruMemo(Generic[K, V]):
    """An :class:`LruCache` of entries made when first asked, one making per key at a time: those asking for an
    entry being made wait for it (a new version's first answers, arriving together, each read the same rows: a
    review's). When its making fails, they fail with its error; when it is cancelled, they make it themselves."""

    def __init__(self, max_entries: int) -> None:
        self._made: LruCache[K, V] = LruCache(max_entries)
        self._making: dict[K, asyncio.Future[V]] = {}

    async def get(self, key: K, make: Callable[[], Awaitable[V]]) -> V:
        while True:
            found = self._made.get(key)
            if found is not None:
                return found
            making = self._making.get(key)
            if making is None:
                break
            try:
                return await asyncio.shield(making)
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if not making.cancelled() or (current is not None and current.cancelling()):
                    raise  # this asker itself was cancelled
        making = asyncio.get_running_loop().create_future()
        self._making[key] = making
        try:
            value = await make()
        except Exception as error:  # those waiting fail with it, at once (one by one, each read timed out in turn)
            making.set_exception(error)
            making.exception()  # read: unread by any waiter, it would be logged as never retrieved
            raise
        except BaseException:
            making.cancel()  # the maker's own answer gave up: those waiting make it themselves
            raise
        finally:
            del self._making[key]
        making.set_result(value)
        self._made.put(key, value)
        return value
