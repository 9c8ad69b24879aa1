"""Where a long run reports how far it got: the CLI draws progress bars from it, tests record it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol


class Progress(Protocol):
    def stage(self, name: str, total: int) -> None: ...

    def advance(self, name: str, amount: int = 1) -> None: ...


class Silent:
    """Progress nobody watches."""

    def stage(self, name: str, total: int) -> None:
        pass

    def advance(self, name: str, amount: int = 1) -> None:
        pass


STALLED_AFTER_S = 30.0
"""How long the index may stay put while a command waits for it before the command says so."""


class ProjectionWatch:
    """Told the index's stream position at every look while a command waits for ``target``: advances the stage
    "projected" by what it gained, and calls ``stalled(floor, target, seconds)`` once each time the position has
    not moved for ``stalled_after_s`` (a projector down, or stuck, is said instead of waited on in silence).
    ``first``: the first stream sequence the command published, from which the stage counts (sized from the first
    position seen, 3,029 deltas published were "projected: 0/3028", and 760 stored "0/0": a fault tester's)."""

    def __init__(
        self,
        progress: Progress,
        target: int,
        stalled: Callable[[int, int, float], object],
        stalled_after_s: float = STALLED_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
        first: int | None = None,
    ) -> None:
        self._progress = progress
        self._target = target
        self._first = first
        self._stalled = stalled
        self._stalled_after_s = stalled_after_s
        self._clock = clock
        self.floor: int | None = None
        """The last position seen (None: not looked yet)."""
        self._moved_at = 0.0
        self._said = False

    def __call__(self, floor: int) -> None:
        now = self._clock()
        if self.floor is None:
            start = floor if self._first is None else min(self._first - 1, floor)
            self._progress.stage("projected", max(self._target - start, 0))
            if floor > start:
                self._progress.advance("projected", min(floor, self._target) - start)
            self._moved_at = now
        elif floor > self.floor:
            self._progress.advance("projected", min(floor, self._target) - min(self.floor, self._target))
            self._moved_at, self._said = now, False
        elif not self._said and now - self._moved_at >= self._stalled_after_s:
            self._stalled(floor, self._target, now - self._moved_at)
            self._said = True
        self.floor = floor if self.floor is None else max(self.floor, floor)
