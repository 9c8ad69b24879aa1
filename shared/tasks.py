"""Background tasks: kept until they end, and stopped (the loops a worker runs: watches, gauges, watermarks)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

LATENESS_TICK_S = 0.05
"""How often :func:`watch_lateness` looks how late the event loop runs."""
CANCEL_AGAIN_AFTER_S = 1.0
"""How long a cancelled task has to end before it is cancelled again: its clean-up (a database session's end, a
watch's unsubscribe) takes far less, and a second cancellation would cut it."""


async def cancel_and_wait(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` and wait until it has ended; an exception it ended with is raised here.

    Python 3.11's ``asyncio.wait_for`` (under every nats-py request) returns a reply that arrived together with the
    cancellation and drops the cancellation: a loop cancelled at that moment would run on for ever. So the task is
    cancelled again, every ``CANCEL_AGAIN_AFTER_S``, until it ends.
    """
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=CANCEL_AGAIN_AFTER_S)
    if not task.cancelled():
        task.result()


def still_wanted() -> None:
    """Raise CancelledError when the current task was cancelled but the cancellation never reached it: nats-py
    loses one in a flush it forces, and 3.11's wait_for one that comes with a reply. A loop of such calls asks at
    each round; the cancellation of an expired ``asyncio.timeout`` counts, and comes out as its TimeoutError."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def start_held(coroutine: Coroutine[Any, Any, T], held: set[asyncio.Task[Any]]) -> asyncio.Task[T]:
    """``coroutine`` as a task, kept in ``held`` until it ends: asyncio keeps only weak references to tasks, and one
    nothing else refers to may be collected before it ends."""
    task = asyncio.get_running_loop().create_task(coroutine)
    held.add(task)
    task.add_done_callback(held.discard)
    return task


async def watch_lateness(observe: Callable[[float, float], None], tick_s: float = LATENESS_TICK_S) -> None:
    """Runs until cancelled: every ``tick_s``, ``observe(late_s, now)`` with how late the event loop ran a timer due
    then (a loop with a backlog of ready work runs every timer late by it)."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + tick_s
        await asyncio.sleep(tick_s)
        now = loop.time()
        observe(max(0.0, now - due), now)
