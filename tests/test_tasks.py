"""Stopping background loops."""

from __future__ import annotations

import asyncio

import pytest

from ontofabric.shared.tasks import cancel_and_wait


async def _watch(reply: asyncio.Future[int], rounds: list[int]) -> None:
    """A watch loop as the workers have them: a request, then a pause, for ever."""
    while True:
        rounds.append(await asyncio.wait_for(reply, 10))
        await asyncio.sleep(3600)


async def test_a_loop_whose_reply_comes_with_its_cancellation_is_stopped() -> None:
    reply: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    rounds: list[int] = []
    watching = asyncio.create_task(_watch(reply, rounds))
    await asyncio.sleep(0)  # the loop waits for its reply
    reply.set_result(1)
    watching.cancel()  # in the same turn: Python 3.11's wait_for returns the reply and drops the cancellation
    await asyncio.sleep(0.05)
    assert rounds == [1]
    assert not watching.done()  # the trap is real: cancelled once, the loop went on

    await asyncio.wait_for(cancel_and_wait(watching), 5)
    assert watching.cancelled()


async def test_an_error_the_loop_ended_with_is_raised() -> None:
    async def failing() -> None:
        raise RuntimeError("broken watch")

    task = asyncio.create_task(failing())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="broken watch"):
        await cancel_and_wait(task)
