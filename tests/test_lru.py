"""The one bounded cache: by entries, and by weight where a size is given."""

from __future__ import annotations

import asyncio
import random

import pytest

from ontofabric.shared.lru import LruCache, LruMemo


def test_the_least_recently_used_go_first_when_entries_or_bytes_run_over() -> None:
    cache: LruCache[str, str] = LruCache(10, max_bytes=100, size=len)
    cache.put("a", "x" * 40)
    cache.put("b", "x" * 40)
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("c", "x" * 40)  # 120 bytes: b, the least recent, goes
    assert ("a" in cache, "b" in cache, "c" in cache) == (True, False, True)
    assert cache.bytes == 80
    cache.put("a", "x" * 10)  # replacing an entry replaces its weight
    assert cache.bytes == 50
    cache.put("huge", "x" * 101)  # more than the whole budget: not kept, nothing pushed out for it
    assert "huge" not in cache
    assert len(cache) == 2
    assert cache.drop_where(lambda key: key == "c") == 1
    assert cache.bytes == 10


def test_the_weight_always_equals_what_is_held() -> None:
    rng = random.Random(7)
    cache: LruCache[int, str] = LruCache(20, max_bytes=500, size=len)
    for _ in range(2000):
        key = rng.randrange(50)
        if rng.random() < 0.1:
            cache.drop_where(lambda k, key=key: k == key)  # type: ignore[misc]
        else:
            cache.put(key, "x" * rng.randrange(0, 120))
        held = [cache.get(k) for k in range(50) if k in cache]
        assert cache.bytes == sum(len(v or "") for v in held) <= 500
        assert len(cache) <= 20


def test_one_owner_s_flood_pushes_out_its_own_entries_not_another_s() -> None:
    cache: LruCache[tuple[str, int], str] = LruCache(10, owner=lambda key: key[0])
    for n in range(3):
        cache.put(("quiet", n), "answer")
    for n in range(1100):  # a tenant asking 1,100 distinct questions
        cache.put(("loud", n), "answer")
    assert all(("quiet", n) in cache for n in range(3))
    assert [key for key, _ in cache.items() if key[0] == "loud"] == [("loud", n) for n in range(1093, 1100)]
    # Holding alike, owners share as plain LRU: the entry least recently used of all goes.
    even: LruCache[tuple[str, int], str] = LruCache(2, owner=lambda key: key[0])
    even.put(("a", 0), "x")
    even.put(("b", 0), "x")
    assert even.get(("a", 0)) is not None
    even.put(("c", 0), "x")
    assert [key for key, _ in even.items()] == [("a", 0), ("c", 0)]


def test_by_weight_the_owner_weighing_most_gives_way() -> None:
    cache: LruCache[tuple[str, int], str] = LruCache(100, max_bytes=100, size=len, owner=lambda key: key[0])
    cache.put(("small", 0), "x" * 20)
    cache.put(("small", 1), "x" * 20)
    for n in range(5):
        cache.put(("big", n), "x" * 30)  # holding more than small, big gives way: its least recent first
    assert [key for key, _ in cache.items() if key[0] == "small"] == [("small", 0), ("small", 1)]
    assert cache.bytes <= 100
    assert [key for key, _ in cache.items() if key[0] == "big"] == [("big", 3), ("big", 4)]


def test_an_entry_just_put_is_not_what_makes_room_for_itself() -> None:
    """A review's: one entry weighing as much as another owner's many pushed one of theirs out, then itself."""
    cache: LruCache[tuple[str, int], str] = LruCache(100, max_bytes=64, size=len, owner=lambda key: key[0])
    for n in range(8):
        cache.put(("many", n), "x" * 5)
    cache.put(("one", 0), "x" * 40)
    assert ("one", 0) in cache
    assert [key for key, _ in cache.items() if key[0] == "many"] == [("many", n) for n in range(4, 8)]
    assert cache.bytes == 60


def test_with_owners_the_counts_always_equal_what_is_held() -> None:
    rng = random.Random(11)
    cache: LruCache[tuple[int, int], str] = LruCache(20, max_bytes=500, size=len, owner=lambda key: key[0])
    for _ in range(3000):
        key = (rng.randrange(4), rng.randrange(30))
        action = rng.random()
        if action < 0.1:
            cache.drop_where(lambda k, key=key: k[0] == key[0])  # type: ignore[misc]
        elif action < 0.2:
            cache.pop(key)
        elif action < 0.4:
            cache.get(key)
        else:
            cache.put(key, "x" * rng.randrange(0, 120))
        held = cache.items()
        assert cache.bytes == sum(len(v) for _, v in held) <= 500
        assert len(held) <= 20
        for owner in range(4):
            mine = [k for k, _ in held if k[0] == owner]
            assert sorted(cache._owned.get(owner, {})) == sorted(mine)
            assert cache._owned_bytes.get(owner, 0) == sum(len(v) for k, v in held if k[0] == owner)


async def test_a_memo_makes_an_entry_once_for_those_asking_together() -> None:
    memo: LruMemo[str, int] = LruMemo(4)
    made: list[str] = []
    release = asyncio.Event()

    async def make(key: str) -> int:
        made.append(key)
        await release.wait()
        return len(made)

    askers = [asyncio.create_task(memo.get("v1", lambda: make("v1"))) for _ in range(8)]
    await asyncio.sleep(0)
    release.set()
    assert await asyncio.gather(*askers) == [1] * 8
    assert made == ["v1"]
    assert await memo.get("v1", lambda: make("again")) == 1  # kept


async def test_when_the_making_is_cancelled_a_waiting_asker_makes_it_and_when_it_fails_they_fail() -> None:
    memo: LruMemo[str, str] = LruMemo(4)
    started = asyncio.Event()

    async def never() -> str:
        started.set()
        await asyncio.sleep(3600)
        return "never"

    fail = asyncio.Event()

    async def fails() -> str:
        started.set()
        await fail.wait()
        raise ConnectionError("the database went away")

    async def made() -> str:
        return "made"

    first = asyncio.create_task(memo.get("k", never))
    await started.wait()
    second = asyncio.create_task(memo.get("k", made))
    await asyncio.sleep(0)
    first.cancel()  # the maker's own answer gave up: the one waiting goes on
    assert await second == "made"
    with pytest.raises(asyncio.CancelledError):
        await first

    # A failed making fails those waiting for it at once (a review's: each made it in turn, its timeout added),
    # and the next asker makes it again.
    started.clear()
    failing = asyncio.create_task(memo.get("j", fails))
    await started.wait()
    waiting = [asyncio.create_task(memo.get("j", made)) for _ in range(3)]
    await asyncio.sleep(0)  # each waiting
    fail.set()
    with pytest.raises(ConnectionError):
        await failing
    for waiter in waiting:
        with pytest.raises(ConnectionError):
            await waiter
    assert await memo.get("j", made) == "made"

    # A waiter cancelled itself is cancelled, and the making goes on for the others.
    release = asyncio.Event()

    async def slow() -> str:
        await release.wait()
        return "slow"

    maker = asyncio.create_task(memo.get("m", slow))
    await asyncio.sleep(0)
    waiter = asyncio.create_task(memo.get("m", made))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    release.set()
    assert await maker == "slow"
