"""The query worker's waiting requests, taken one workspace at a time in turn (``shared.turns.TurnQueue``), and
who gives a place to whom when it is full (pure).

One shared first-come queue let a tenant that floods a worker hold every place and every turn: another tenant's
few requests, far below capacity, were refused or answered as rarely as the flood's (an independent load harness:
20 % answered during another workspace's flood). Here each workspace waits behind its own requests, and a runner
takes the next workspace's in turn; and when the worker is full, a workspace holding less takes the place of the
newest waiting request of the one holding the most (``displaced_by``).
"""

from __future__ import annotations

from collections.abc import Mapping


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


RUNNERS_LEFT_TO_OTHERS = 0.25
"""The share of a worker's runners one workspace leaves to the others, even alone: a runner cannot be taken back
from the work it has, so a tenant holding every runner with costly requests made every other tenant wait for one
of them to end (a red team: 1.5 s and more)."""


def runners_per_workspace(concurrency: int) -> int:
    """How many of ``concurrency`` runners one workspace's requests may hold at once (all, below 4)."""
    return max(1, concurrency - int(concurrency * RUNNERS_LEFT_TO_OTHERS))


def runners_serving(workspaces: int, concurrency: int) -> int:
    """How many runners the requests held before a newcomer leave through: its workspace's share
    (``runners_per_workspace``) when that workspace holds every request, all of them when others hold some too.
    Counted as all, the wait of one workspace holding 12 to 15 requests on 16 runners (12 its own) read as none, and
    the requests admitted on it failed for time (a load tester's finding)."""
    return concurrency if workspaces > 1 else runners_per_workspace(concurrency)
