"""CPU priority for query work on a host it shares with projection (``ONTOFABRIC_QUERY_NICENESS``).

On a host whose cores serve both the query workers and the projectors, queries under load take every core and
the projector falls behind: what was written becomes searchable seconds later instead of milliseconds.
A niceness above 0 asks the kernel to run query work after projection when both wait for a core, so
an index stays fresh while queries are answered with the cores that are left.

Linux keeps a niceness per thread: a process is reniced thread by thread, and threads started later inherit it
from the thread that starts them. A database session is served by its own server process; when the server runs
on this host, that process is reniced too, once it is known to be the session's (see
:func:`lower_session_priority`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Literal

import asyncpg

_PROC = Path("/proc")
# /proc/stat's boot time is in whole seconds: a process's start read from /proc is known to about a second.
_START_TOLERANCE_S = 2.0
_CONNECT_WINDOW_S = 10.0
"""A session's server process started at most this long before the pool's first look at it (right after connect);
a slower connect leaves the session at its priority."""
_AUTOGROUP_TRIES = 5
_AUTOGROUP_RETRY_S = 0.12
"""Linux takes one autogroup change per 100 ms from a process without CAP_SYS_ADMIN, host-wide: two query workers
starting together would have one refused (EAGAIN)."""

SessionPriority = Literal["lowered", "remote", "refused"]
"""What became of a session's server process: at the niceness; not this host's (or not known to be the session's);
on this host but not to be reniced by this user (a PostgreSQL running as another user, and no CAP_SYS_NICE)."""
AutogroupPriority = Literal["lowered", "not_leader", "unavailable", "refused"]


def lower_priority(tid: int, niceness: int) -> bool:
    """Run thread or process ``tid`` at ``niceness`` unless it already runs at that or lower priority. False
    where the system refuses (another user's process) or ``tid`` is gone."""
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) >= niceness:
            return True
        os.setpriority(os.PRIO_PROCESS, tid, niceness)
    except OSError:
        return False
    return True


def lower_process_priority(niceness: int) -> tuple[int, AutogroupPriority]:
    """Every thread of this process at ``niceness`` (those it starts later inherit it), and its autogroup too
    when this process leads its session (:func:`lower_autogroup_priority`). Returns how many threads run at the
    niceness, and what became of the autogroup."""
    tasks = _PROC / "self" / "task"
    tids = [int(name) for name in os.listdir(tasks)] if tasks.is_dir() else [0]
    autogroup: AutogroupPriority = lower_autogroup_priority(niceness) if os.getsid(0) == os.getpid() else "not_leader"
    return sum(lower_priority(tid, niceness) for tid in tids), autogroup


def lower_autogroup_priority(niceness: int) -> AutogroupPriority:
    """This process's autogroup at ``niceness``. Where the kernel groups processes by session (Linux's
    autogroups, on by default on desktops and many servers), it shares the cores between the groups first and
    only then between the threads of each by their niceness: a query worker in its own session would take a
    group's full share whatever its threads' niceness. For a session leader only: the group is its session's,
    and another process of a shared session (a shell's) would be lowered with it."""
    autogroup = _PROC / "self" / "autogroup"
    for attempt in range(_AUTOGROUP_TRIES):
        try:
            if int(autogroup.read_text().split()[-1]) < niceness:
                autogroup.write_text(str(niceness))
            return "lowered"
        except BlockingIOError:  # another process changed an autogroup within the last 100 ms
            if attempt + 1 < _AUTOGROUP_TRIES:
                time.sleep(_AUTOGROUP_RETRY_S)  # before the workers start: nothing else waits on this thread yet
        except PermissionError:
            return "refused"
        except (OSError, ValueError, IndexError):
            return "unavailable"  # no autogroups here
    return "refused"


def process_started_at(pid: int) -> float | None:
    """When process ``pid`` of this host started (seconds since the epoch), from /proc; None where unknown."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
        boot = next(line for line in (_PROC / "stat").read_text().splitlines() if line.startswith("btime "))
        # The command name, in parentheses, may hold spaces: the fields after it are counted from its end.
        fields = stat[stat.rindex(")") + 2 :].split()
        return int(boot.split()[1]) + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def _parent_of(pid: int) -> int | None:
    try:
        status = (_PROC / str(pid) / "status").read_text()
        return int(next(line for line in status.splitlines() if line.startswith("PPid:")).split()[1])
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def _is_postgres(pid: int | None) -> bool:
    try:
        return pid is not None and (_PROC / str(pid) / "comm").read_text().strip() == "postgres"
    except OSError:
        return False


def is_fresh_backend(pid: int, not_before: float) -> bool:
    """Whether process ``pid`` of this host is a PostgreSQL server process, forked by a PostgreSQL server, that
    started at ``not_before`` (seconds since the epoch) or later: the one just forked for a session this process
    opened. A process of that id that is not PostgreSQL's, or is older, belongs to another host or container (a
    server reached through a loopback tunnel), and is left alone."""
    started = process_started_at(pid)
    return (
        _is_postgres(pid)
        and _is_postgres(_parent_of(pid))
        and started is not None
        and started >= not_before - _START_TOLERANCE_S
    )


async def lower_session_priority(conn: asyncpg.Connection, niceness: int) -> SessionPriority:
    """The server process of ``conn``'s session, just opened, at ``niceness`` when the server runs on this host:
    reached over loopback or a Unix socket, the process id the server gives its session the one the connection
    was told (no pooler between), and the process of that id a PostgreSQL one, forked by a PostgreSQL server, that
    started within the time a connection may take. Lowering another user's process needs CAP_SYS_NICE (root)."""
    row = await conn.fetchrow("SELECT inet_server_addr() AS address, pg_backend_pid() AS pid")
    pid = conn.get_server_pid()
    if (
        row is None
        or row["pid"] != pid
        or (row["address"] is not None and not row["address"].is_loopback)  # None: over a Unix socket
        or not is_fresh_backend(pid, time.time() - _CONNECT_WINDOW_S)
    ):
        return "remote"
    return "lowered" if lower_priority(pid, niceness) else "refused"
