"""When a request's answer is due: the caller's timeout (header ``Ontofabric-Timeout-Ms``) from the moment the
worker received it, less a margin for the reply's way back. Relative, as gRPC's ``grpc-timeout``: no clock is
compared between machines, unless the caller also says when it sent the request (``Ontofabric-Sent-At-Ms``): then
a wait before the worker read it, past the clocks' allowance, counts too (a worker that stalled reads requests
whose callers gave up long ago). Pure logic; the worker applies it (refusing what is already late, bounding every
stage)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from ontofabric.contracts import CLOCK_ALLOWANCE_MS, MAX_TIMEOUT_MS, SENT_AT_HEADER, TIMEOUT_HEADER, ErrorDetail
from ontofabric.shared.lru import LruCache

MIN_MARGIN_S = 0.005
MAX_MARGIN_S = 0.25
MARGIN_SHARE = 0.05
"""Of the caller's timeout, kept for the reply to travel back and for the time a busy event loop takes to get
to a request after it arrived (between 5 and 250 ms: with 100 ms, 1 of 1,106 requests under 50 callers on a
2-core machine got its refusal just after its caller gave up)."""


def margin_s(timeout_s: float) -> float:
    """What is kept back of a caller's timeout for the reply's way back, before the event loop's lag."""
    return min(MAX_MARGIN_S, max(MIN_MARGIN_S, timeout_s * MARGIN_SHARE))


def longest_hopeless_ms(least_ms: float) -> int:
    """The longest stated timeout (whole ms) that, its margin kept back, leaves no more than ``least_ms``: no
    answer needing that much can come within it, however idle the worker."""
    timeout_ms = math.floor(least_ms)
    while timeout_ms + 1 - margin_s((timeout_ms + 1) / 1000) * 1000 <= least_ms:
        timeout_ms += 1
    return timeout_ms


@dataclass(frozen=True)
class Deadline:
    at: float
    """The time (the event loop's clock, seconds) by which the reply must be sent."""
    timeout_ms: int
    """What the caller asked for (or the worker's default)."""
    stated: bool = True
    """The caller said its timeout (the header); False: the worker's default is a guess at it."""
    waited_before_s: float = 0.0
    """What the request waited before the worker read it, by its send time (past the clocks' allowance)."""

    def left(self, now: float) -> float:
        return self.at - now


LAG_HALF_LIFE_S = 5.0
"""How fast a delay is forgotten: it counts half after this long."""
MAX_LAG_SHARE = 0.25
"""The most of a caller's timeout that the event loop's lag adds to the margin."""


class RecentDelay:
    """The largest recent delay, forgotten with a half-life. The worker keeps how late its event loop has lately
    run what was due: a loop that stalls (a large answer built, the GIL held by the model thread on two busy cores)
    runs a deadline's timer late and reads requests late, so its recent lag is kept back from every deadline as
    margin. A client keeps how late its requests' receipts came (services/query/client.py)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._at = 0.0

    def observe(self, late_s: float, now: float) -> None:
        self.seconds, self._at = max(late_s, self.at(now)), now

    def at(self, now: float) -> float:
        """The delay as it counts at ``now``, faded since it was last observed."""
        return self.seconds * 0.5 ** ((now - self._at) / LAG_HALF_LIFE_S) if self._at else 0.0


def header_value(headers: Mapping[str, str] | None, wanted: str) -> str | None:
    """A header's value by its name in any case (some clients write header names in lower case)."""
    return next((value for name, value in (headers or {}).items() if name.lower() == wanted.lower()), None)


def waited_before_receipt_s(headers: Mapping[str, str] | None, now_wall_s: float) -> float | ErrorDetail:
    """How long the request waited before the worker read it, by the caller's ``Ontofabric-Sent-At-Ms`` and this
    host's wall clock, less the clocks' allowance; 0 without the header; what is wrong with a malformed one."""
    raw = header_value(headers, SENT_AT_HEADER)
    if raw is None:
        return 0.0
    text = raw.strip()
    if not (text.isascii() and text.isdigit() and len(text) <= 16):
        return ErrorDetail(field=f"header {SENT_AT_HEADER}", message="whole milliseconds since the Unix epoch")
    apart_s = now_wall_s - int(text) / 1000
    if abs(apart_s) > CLOCKS_APART_S:  # no wait: a contract tester's 0 was refused late, retryable, each time again
        return ErrorDetail(
            field=f"header {SENT_AT_HEADER}",
            message=f"{text} is more than a day from this worker's clock: whole milliseconds since the Unix epoch, "
            "by a clock that is set",
        )
    return max(0.0, apart_s - CLOCK_ALLOWANCE_MS / 1000)


CLOCKS_APART_S = 86_400.0
"""A send time further than this from the worker's clock is no wait but a clock set wrong (or seconds for
milliseconds): refused as the header's error, not answered as late (retryable, and late again when retried)."""


def deadline_of(
    headers: Mapping[str, str] | None,
    received: float,
    default_ms: int,
    lag_s: float = 0.0,
    waited_before_s: float = 0.0,
) -> Deadline | ErrorDetail:
    """The request's deadline, or what is wrong with its timeout header. ``lag_s``: the event loop's recent lag
    (:class:`RecentDelay`), kept back as well; ``waited_before_s``: what the request waited before the worker read it
    (:func:`waited_before_receipt_s`)."""
    raw = header_value(headers, TIMEOUT_HEADER)
    if raw is None:
        timeout_ms = default_ms
    else:
        # Leading zeros are digits the contract's pattern allows (a tester's 0005000 was refused for its length).
        text = raw.strip()
        text = text.lstrip("0") or text[:1]
        well_formed = text.isascii() and text.isdigit() and len(text) <= len(str(MAX_TIMEOUT_MS))
        if not well_formed or not 1 <= int(text) <= MAX_TIMEOUT_MS:
            return ErrorDetail(
                field=f"header {TIMEOUT_HEADER}", message=f"whole milliseconds from 1 to {MAX_TIMEOUT_MS}"
            )
        timeout_ms = int(text)
    timeout_s = timeout_ms / 1000
    margin = margin_s(timeout_s) + min(lag_s, timeout_s * MAX_LAG_SHARE)
    at = received + max(0.0, timeout_s - margin - waited_before_s)
    return Deadline(at, timeout_ms, stated=raw is not None, waited_before_s=waited_before_s)


SERVICE_TIME_WEIGHT = 0.1
"""Weight of the newest request in the moving average of how long one takes, one right after the one before."""
SERVICE_TIME_HALF_LIFE_S = 1.0
"""How fast what the average says is forgotten while no request ends: after this long without one, a next one
that took less weighs half as much again as the average (a tester's worker, after a slow reranker spell, refused
90 of 100 requests it answered in 100 ms, told they would take 850: the few it admitted moved it a tenth each)."""

WORKSPACES_TIMED = 4096
"""Workspaces whose own request times a worker remembers (the least recently served go first)."""


def _moved(average: float, took_s: float, idle_s: float) -> float:
    """The average moved towards ``took_s``; down by more the longer no request ended before it (``idle_s``), up
    by a tenth whatever the wait (a review's: one slow request after a quiet second nearly replaced the average
    over every request, and other tenants' bursts were refused)."""
    faded = 1 - (1 - SERVICE_TIME_WEIGHT) * 0.5 ** (max(0.0, idle_s) / SERVICE_TIME_HALF_LIFE_S)
    weight = faded if took_s < average else SERVICE_TIME_WEIGHT
    return took_s if average == 0 else average + weight * (took_s - average)


@dataclass
class ServiceTime:
    """Moving averages of how long a worker takes per request: over every request (how fast its runners come free)
    and per workspace, each operation apart (how long a newcomer's own work takes). A red team's finding: judged
    by the average over every request, one tenant's costly requests had another's cheap ones refused (45 of 47,
    each expected to take the 4 s the costly ones took)."""

    seconds: float = 0.0
    _at: float = 0.0
    _own: LruCache[str, tuple[float, float]] = field(default_factory=lambda: LruCache(WORKSPACES_TIMED))
    """workspace -> (its average, when it was last moved)"""

    def record(
        self, took_s: float, workspace: str = "", cut: bool = False, now: float = 0.0, of_its_work: bool = True
    ) -> None:
        """``cut``: its deadline ended the work, which would have taken longer, and no less than the workspace's
        average: its own average counts it as that, or each cut pulls it down and the worker admits more than it
        can answer (a load tester's requests were taken up with 170 ms left of 2 s, and cut again). The average
        over every request counts what it took: its runner came free then (a review's: counted at a costly
        tenant's average, short deadlines of that tenant raised every other tenant's expected wait). ``now``: when
        it ended (the event loop's clock), for :data:`SERVICE_TIME_HALF_LIFE_S`. ``of_its_work``: False for a request
        that is no measure of its workspace's work (an answer from the cache), which counts only in how fast
        runners come free."""
        self.seconds, self._at = _moved(self.seconds, took_s, now - self._at), now
        if not of_its_work:
            return
        average, at = self._own.get(workspace) or (0.0, now)
        own = max(took_s, average) if cut else took_s
        self._own.put(workspace, (_moved(average, own, now - at), now))

    def own(self, workspace: str) -> float:
        """A workspace's own average; 0 before it has been served (nobody is refused on a guess)."""
        return (self._own.get(workspace) or (0.0, 0.0))[0]

    def expected_wait(self, ahead: int, concurrency: int) -> float:
        """Seconds until a request with ``ahead`` others held before it would be taken: they leave ``concurrency``
        at a time."""
        return max(0, ahead - concurrency + 1) / concurrency * self.seconds

    def expected_finish(self, ahead: int, concurrency: int, workspace: str = "") -> float:
        """Seconds until a request of ``workspace`` with ``ahead`` others held before it would be answered: its
        turn, then its own work, as long as that workspace's take."""
        return self.expected_wait(ahead, concurrency) + self.own(workspace)


@dataclass
class PacedReturns:
    """The waits a worker states to the requests it refuses (``retryAfterMs``). Each is told a moment at least one
    runner's turn (a request's time over the runners) after the moment told the one refused before it, so that a
    burst refused together comes back about as fast as runners come free rather than all at once: a tester's 150
    calls at once against 6 places were all told 80 ms, came back together, and were refused again. Never more than
    ``horizon`` past the wait itself, so that refused callers who never come back do not push the next ones' waits
    out for ever."""

    _last: float = -math.inf
    """The moment the last refused request was told to come back."""

    def stated_wait(self, now: float, wait: float, turn: float, horizon: float) -> float:
        """The wait to state to a request refused at ``now`` that would wait ``wait`` for a runner if it came back
        alone; ``turn``: seconds between runners coming free."""
        back_at = min(max(now + wait, self._last + turn), now + wait + horizon)
        self._last = back_at
        return back_at - now
