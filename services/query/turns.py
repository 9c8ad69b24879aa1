"""The query worker's waiting requests, taken one workspace at a time in turn (pure, on asyncio).

One shared first-come queue let a tenant that floods a worker hold every place and every turn: another tenant's
few requests, far below capacity, were refused or answered as rarely as the flood's (an independent load harness:
20 % answered during another workspace's flood). Here each workspace waits behind its own requests, and a runner
takes the next workspace's in turn; and when the worker is full, a workspace holding less takes the place of the
newest waiting request of the one holding the most (``displaced_by``).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


def displaced_by(held_by: Mapping[str, int], newcomer: str) -> str | None:
    """When a worker is full: the workspace one of whose waiting requests gives its place to ``newcomer``'s, the
    one holding the most, if it holds at least two more than ``newcomer`` (so floods, one or several, leave room
    for a tenant that asks little, and a workspace alone still has every place); None when none does."""
    if not held_by:
        return None
    largest = max(held_by, key=lambda workspace: held_by[workspace])
    return largest if largest != newcomer and held_by[largest] >= held_by.get(newcomer, 0) + 2 else None


def ahead_in_turn(waiting_of_own: int, workspaces: int, held: int) -> int:
    """About how many held requests go before a new one: its workspace's own, each with a turn of every other
    waiting workspace's, never more than are held."""
    return min(held, (waiting_of_own + 1) * max(1, workspaces) - 1)


class TurnQueue(Generic[T]):
    """Items by key; ``get`` takes the oldest item of the key whose turn it is, then that key goes to the back."""

    def __init__(self) -> None:
        self._queues: dict[str, deque[T]] = {}
        self._turns: deque[str] = deque()
        """Keys with items waiting, in the order they are served."""
        self._available = asyncio.Semaphore(0)
        self._unfinished = 0
        self._finished = asyncio.Event()
        self._finished.set()

    def put_nowait(self, key: str, item: T) -> None:
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = deque()
            self._turns.append(key)
        queue.append(item)
        self._unfinished += 1
        self._finished.clear()
        self._available.release()

    async def get(self) -> T:
        await self._available.acquire()
        key = self._turns.popleft()
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

    def task_done(self) -> None:
        """One item taken has been dealt with."""
        self._unfinished -= 1
        if self._unfinished == 0:
            self._finished.set()

    async def join(self) -> None:
        """Until every item put has been dealt with."""
        await self._finished.wait()

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._queues.values())
