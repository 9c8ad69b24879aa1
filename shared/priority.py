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

import asyncpg

from .logging import get_logger

log = get_logger(__name__)

_PROC = Path("/proc")
# /proc/stat's boot time is in whole seconds: a process's start read from /proc is known to about a second.
_START_TOLERANCE_S = 2.0
# asyncpg's default connect timeout: a session's server process started at most that long before it is used.
_CONNECT_WINDOW_S = 60.0


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


def lower_process_priority(niceness: int) -> int:
    """Every thread of this process at ``niceness`` (those it starts later inherit it), and its autogroup too
    when this process leads its session (:func:`lower_autogroup_priority`). Returns the threads reniced."""
    tasks = _PROC / "self" / "task"
    tids = [int(name) for name in os.listdir(tasks)] if tasks.is_dir() else [0]
    if os.getsid(0) == os.getpid():
        lower_autogroup_priority(niceness)
    return sum(lower_priority(tid, niceness) for tid in tids)


def lower_autogroup_priority(niceness: int) -> bool:
    """This process's autogroup at ``niceness``. Where the kernel groups processes by session (Linux's
    autogroups, on by default on desktops and many servers), it shares the cores between the groups first and
    only then between the threads of each by their niceness: a query worker in its own session would take a
    group's full share whatever its threads' niceness. For a session leader only: the group is its session's,
    and another process of a shared session (a shell's) would be lowered with it."""
    autogroup = _PROC / "self" / "autogroup"
    try:
        current = int(autogroup.read_text().split()[-1])
        if current < niceness:
            autogroup.write_text(str(niceness))
    except (OSError, ValueError, IndexError):
        return False  # no autogroups here, or not to be changed
    return True


def process_started_at(pid: int) -> float | None:
    """When process ``pid`` of this host started (seconds since the epoch), from /proc; None where unknown."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
        boot = next(line for line in (_PROC / "stat").read_text().splitlines() if line.startswith("btime "))
    except (OSError, StopIteration):
        return None
    # The command name, in parentheses, may hold spaces: the fields after it are counted from its end.
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(boot.split()[1]) + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def is_fresh_backend(pid: int, opened_after: float) -> bool:
    """Whether process ``pid`` of this host is a PostgreSQL server process started after ``opened_after`` (seconds
    since the epoch): the one just forked for a session this process opened. A process of that id which is not
    PostgreSQL's, or is older, belongs to another host or container, and is left alone."""
    try:
        name = (_PROC / str(pid) / "comm").read_text().strip()
    except OSError:
        return False
    started = process_started_at(pid)
    return name.startswith("postgres") and started is not None and started >= opened_after - _START_TOLERANCE_S


async def lower_session_priority(conn: asyncpg.Connection, niceness: int) -> bool:
    """The server process of ``conn``'s session, just opened, at ``niceness`` when the server runs on this host:
    reached over loopback or a Unix socket, and the process of that id a PostgreSQL one that started within the
    time a connection may take. False otherwise, or where it may not be reniced (the server runs as another
    user)."""
    address = await conn.fetchval("SELECT inet_server_addr()")  # None over a Unix socket
    pid = conn.get_server_pid()
    if (address is not None and not address.is_loopback) or not is_fresh_backend(pid, time.time() - _CONNECT_WINDOW_S):
        return False
    return lower_priority(pid, niceness)
