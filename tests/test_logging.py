"""Log lines are rate-limited per cause, and say how many of a cause were left out."""

from __future__ import annotations

import pytest
import structlog

from ontofabric.shared.logging import RateLimited


def _line(limiter: RateLimited, **fields: str) -> dict[str, object] | None:
    try:
        return limiter(None, "warning", {"logger": "ontofabric.services.query.run", "event": "part_failed", **fields})
    except structlog.DropEvent:
        return None


def test_one_cause_logs_a_bounded_number_of_lines_per_window_and_counts_the_rest() -> None:
    now = [0.0]
    limiter = RateLimited(per_window=3, window_s=10.0, clock=lambda: now[0])
    outage = {"part": "keyword", "error": "TimeoutError: "}
    assert [_line(limiter, **outage) is not None for _ in range(5)] == [True, True, True, False, False]
    # Another cause is not held back by the first one's flood.
    assert _line(limiter, part="dense", error="TimeoutError: ") is not None
    assert _line(limiter, part="keyword", error="ConnectionError: refused") is not None
    now[0] = 10.0  # the next window: the first line says what was left out
    first = _line(limiter, **{**outage, "error": "TimeoutError: later"})
    assert first is not None
    assert first["suppressed"] == 2
    again = _line(limiter, **outage)
    assert again is not None
    assert "suppressed" not in again


@pytest.mark.parametrize("event", ["Baggage header `%s` exceeded the maximum" % ("x" * n) for n in (100, 200, 300)])
def test_a_message_that_differs_only_far_into_it_is_one_cause(event: str) -> None:
    limiter = RateLimited(per_window=1, window_s=10.0, clock=lambda: 0.0)
    assert _line(limiter, event=event) is not None
    assert _line(limiter, event=event + " and more") is None
