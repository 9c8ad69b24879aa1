"""Where a long run reports how far it got: the CLI draws progress bars from it, tests record it."""

from __future__ import annotations

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
