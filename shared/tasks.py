"""Stopping the background loops a worker runs (watches, gauges, watermarks)."""

from __future__ import annotations

import asyncio
from typing import Any

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
