"""The one bounded cache: by entries, and by weight where a size is given."""

from __future__ import annotations

import random

from ontofabric.shared.lru import LruCache


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
