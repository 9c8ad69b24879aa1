"""Work taken one key at a time in turn (pure, on asyncio): a key that floods waits behind its own items, not in
front of the others'. The query worker's requests (as they arrive, and once admitted) and the model thread's jobs
are kept so, by workspace.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Turns(Generic[T]):
    """Items by key; :meth:`take` takes the oldest item of the key whose turn it is, then that key goes to the
    back. Not thread-safe: its owner serialises access (an event loop, or a lock)."""

    def __init__(self) -> None:
        self._queues: dict[str, deque[T]] = {}
        self._turns: deque[str] = deque()
        """Keys with items waiting, in the order they are served."""

    def put(self, key: str, item: T) -> None:
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = deque()
            self._turns.append(key)
        queue.append(item)

    def take(self, eligible: Callable[[str], bool] | None = None) -> T | None:
        """The next item in turn, of a key that is ``eligible`` (those that are not keep their places); None when
        none waits."""
        key = next((key for key in self._turns if eligible is None or eligible(key)), None)
        if key is None:
            return None
        self._turns.remove(key)
        queue = self._queues[key]
        item = queue.popleft()
        if queue:
            self._turns.append(key)  # its next waits for every other key's turn
        else:
            del self._queues[key]
        return item

    def newest(self, key: str, wanted: Callable[[T], bool]) -> T | None:
        """The newest waiting item of ``key`` that is ``wanted``, left where it is."""
        return next((item for item in reversed(self._queues.get(key, ())) if wanted(item)), None)

    def waiting(self, key: str) -> int:
        """How many items of ``key`` wait."""
        queue = self._queues.get(key)
        return 0 if queue is None else len(queue)

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._queues.values())


class TurnQueue(Generic[T]):
    """:class:`Turns` to wait on: ``get`` waits for an item, and ``join`` until every item taken is done."""

    def __init__(self) -> None:
        self._turns: Turns[T] = Turns()
        self._getters: list[asyncio.Future[None]] = []
        self._unfinished = 0
        self._finished = asyncio.Event()
        self._finished.set()

    def put_nowait(self, key: str, item: T) -> None:
        self._turns.put(key, item)
        self._unfinished += 1
        self._finished.clear()
        # One waiting get looks again, not all: one item came. (What is eligible changes when a taker ends its
        # work, and that taker looks itself when it asks for its next item.)
        while self._getters:
            getter = self._getters.pop(0)
            if not getter.done():
                getter.set_result(None)
                break

    async def get(self, eligible: Callable[[str], bool] | None = None) -> T:
        """The next item in turn of an ``eligible`` key, once there is one."""
        while (item := self._turns.take(eligible)) is None:
            getter = asyncio.get_running_loop().create_future()
            self._getters.append(getter)
            try:
                await getter
            finally:
                if getter in self._getters:
                    self._getters.remove(getter)
        return item

    def newest(self, key: str, wanted: Callable[[T], bool]) -> T | None:
        """The newest waiting item of ``key`` that is ``wanted``, left where it is."""
        return self._turns.newest(key, wanted)

    def waiting(self, key: str) -> int:
        """How many items of ``key`` wait."""
        return self._turns.waiting(key)

    def task_done(self) -> None:
        """One item taken has been dealt with."""
        self._unfinished -= 1
        if self._unfinished == 0:
            self._finished.set()

    async def join(self) -> None:
        """Until every item put has been dealt with."""
        await self._finished.wait()

    def __len__(self) -> int:
        return len(self._turns)
