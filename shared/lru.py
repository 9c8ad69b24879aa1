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
    measure (one entry larger than that is not kept). Not thread-safe: one asyncio loop owns it.

    Given ``owner`` (a tenant's answers: their workspace), what must go is taken from the owner holding the most
    by the bound run over, its least recently used entry first; between owners holding alike, the entry least
    recently used of all. So no owner is pushed out by another's flood while it holds less than the flooder,
    and owners holding alike share the cache as plain LRU would (an outside tester's 1,100 questions to one
    workspace pushed every other tenant's answers out)."""

    def __init__(
        self,
        max_entries: int,
        max_bytes: int | None = None,
        size: Callable[[V], int] | None = None,
        owner: Callable[[K], Hashable] | None = None,
    ) -> None:
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._size = size
        self._owner = owner
        self._sizes: dict[K, int] = {}
        self.bytes = 0
        """What the entries weigh, by ``size`` (0 without one)."""
        self._entries: OrderedDict[K, V] = OrderedDict()
        # Given an owner: each owner's keys, least recently used first, with when each was last used (a count).
        self._owned: dict[Hashable, OrderedDict[K, int]] = {}
        self._owned_bytes: dict[Hashable, int] = {}
        self._uses = 0

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
            self._used(key)
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
        if self._owner is not None:
            owner = self._owner(key)
            self._owned.setdefault(owner, OrderedDict())
            self._owned_bytes[owner] = self._owned_bytes.get(owner, 0) + weight
            self._used(key)
        while True:
            if len(self._entries) > self._max_entries:
                self._forget(self._victim(by_bytes=False, keep=key))
            elif self._max_bytes is not None and self.bytes > self._max_bytes:
                self._forget(self._victim(by_bytes=True, keep=key))
            else:
                break

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

    def _used(self, key: K) -> None:
        if self._owner is None:
            return
        self._uses += 1
        keys = self._owned[self._owner(key)]
        keys[key] = self._uses
        keys.move_to_end(key)

    def _victim(self, by_bytes: bool, keep: K) -> K:
        """The entry to go: the least recently used, of the owner holding the most when there are owners; never
        ``keep``, the entry just put (a review's: one weighing more than every other owner's, once it had pushed
        out others' entries, went itself, kept by no one)."""
        if self._owner is None:
            return next(iter(self._entries))
        owners = [owner for owner, keys in self._owned.items() if next(iter(keys)) != keep]

        def holding(owner: Hashable) -> tuple[int, int]:
            keys = self._owned[owner]
            held = self._owned_bytes[owner] if by_bytes else len(keys)
            return held, -next(iter(keys.values()))  # alike: the one whose least recent use is oldest

        return next(iter(self._owned[max(owners, key=holding)]))

    def _forget(self, key: K) -> None:
        if key not in self._entries:
            return
        del self._entries[key]
        weight = self._sizes.pop(key)
        self.bytes -= weight
        if self._owner is not None:
            owner = self._owner(key)
            keys = self._owned[owner]
            del keys[key]
            self._owned_bytes[owner] -= weight
            if not keys:
                del self._owned[owner], self._owned_bytes[owner]


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
