"""ONTOFABRIC_QUERY_NICENESS: query work runs after projection when both wait for a core (shared/priority.py)."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import subprocess
import sys
import time
from pathlib import Path

import asyncpg
import pytest

from ontofabric.services.query.client import QueryClient
from ontofabric.shared.db import create_pool, migrate
from ontofabric.shared.priority import is_fresh_backend, lower_session_priority, process_started_at

from .conftest import Deployment, answered_once_up

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="niceness per thread is Linux's")

ONTOFABRIC = str(Path(sys.executable).with_name("ontofabric"))


def niceness(pid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, pid)


def autogroup_niceness(pid: int) -> int | None:
    """The niceness of ``pid``'s autogroup; None on a kernel without autogroups."""
    autogroup = Path(f"/proc/{pid}/autogroup")
    return int(autogroup.read_text().split()[-1]) if autogroup.exists() else None


def test_a_process_start_is_read_from_proc_on_the_clock_of_the_epoch() -> None:
    started = process_started_at(os.getpid())
    assert started is not None
    assert time.time() - 3600 < started <= time.time()  # this test process started within the hour
    assert process_started_at(2**22 + 1) is None  # above Linux's pid limit: no such process


def test_only_a_postgres_process_started_since_counts_as_a_fresh_session() -> None:
    assert not is_fresh_backend(os.getpid(), time.time() - 3600)  # started since, but python, not postgres
    assert not is_fresh_backend(2**22 + 1, 0.0)


async def skip_unless_reniceable(database_url: str) -> None:
    """The database's sessions can be lowered only where its server runs on this host, as this user (or this
    process may renice others'): not so for servers of ONTOFABRIC_TEST_DATABASE_URL elsewhere."""
    conn = await asyncpg.connect(database_url)
    try:
        address, pid = await conn.fetchrow("SELECT inet_server_addr(), pg_backend_pid()")
        if address is not None and not address.is_loopback:
            pytest.skip("the test database's server is not on this host")
        if process_started_at(pid) is None:  # read while its session is open
            pytest.skip("the test database's server runs in another process namespace")
    finally:
        await conn.close()


class _Remote:
    """A connection to a server elsewhere whose session's process id happens to be a local PostgreSQL's."""

    def __init__(self, pid: int, address: str) -> None:
        self._pid, self._address = pid, ipaddress.ip_address(address)

    async def fetchrow(self, query: str) -> dict[str, object]:
        return {"address": self._address, "pid": self._pid}

    def get_server_pid(self) -> int:
        return self._pid


@pytest.mark.servers
async def test_the_sessions_of_a_pool_with_a_niceness_run_at_it_and_others_do_not(deployment: Deployment) -> None:
    settings = deployment.settings
    await skip_unless_reniceable(deployment.database_url)
    await migrate(deployment.database_url, settings)  # pgvector, which the pools' sessions speak
    nice = await create_pool(deployment.database_url, settings, min_size=2, max_size=2, niceness=7)
    plain = await create_pool(deployment.database_url, settings, min_size=1, max_size=1)
    try:
        async with nice.acquire() as first, nice.acquire() as second, plain.acquire() as other:
            reniced = [niceness(first.get_server_pid()), niceness(second.get_server_pid())]
            assert reniced == [7, 7]
            assert niceness(other.get_server_pid()) == 0
            # A session opened before the window is not taken for this one's: the check that keeps a process
            # of another host's id alone.
            assert is_fresh_backend(first.get_server_pid(), time.time() - 60)
            assert not is_fresh_backend(first.get_server_pid(), time.time() + 60)
            # The same local process, but the server said to be at another address: another host's session.
            other_host = _Remote(other.get_server_pid(), "10.0.0.1")
            assert await lower_session_priority(other_host, 9) == "remote"  # type: ignore[arg-type]
            assert niceness(other.get_server_pid()) == 0
    finally:
        await nice.close()
        await plain.close()


def test_a_process_is_reniced_thread_by_thread_and_its_later_threads_inherit_it() -> None:
    code = (
        "import os, threading; from ontofabric.shared.priority import lower_process_priority as lower\n"
        "started = threading.Event(); waiting = threading.Thread(target=started.wait, daemon=True)\n"
        "waiting.start(); reniced, _ = lower(5)\n"
        "later = []; t = threading.Thread(target=lambda: later.append(os.getpriority(os.PRIO_PROCESS, 0))); "
        "t.start(); t.join()\n"
        "print(reniced, os.getpriority(os.PRIO_PROCESS, 0), os.getpriority(os.PRIO_PROCESS, waiting.native_id), "
        "*later)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    # Two threads lowered: the main one and the one waiting; and the one started after inherits it.
    assert done.stdout.split() == ["2", "5", "5", "5"]


@pytest.mark.servers
async def test_a_query_worker_with_a_niceness_runs_it_and_so_do_its_database_sessions(
    deployment: Deployment,
) -> None:
    await skip_unless_reniceable(deployment.database_url)
    env = deployment.env() | {
        "ONTOFABRIC_NATS_URL": deployment.nats_url_as("query"),
        "ONTOFABRIC_QUERY_NICENESS": "6",
        "ONTOFABRIC_LOG_LEVEL": "WARNING",
    }
    # In a session of its own, as a service manager starts it: it leads its session, and so its autogroup.
    worker = await asyncio.create_subprocess_exec(ONTOFABRIC, "query-worker", env=env, start_new_session=True)
    try:
        client = QueryClient(deployment.nc, deployment.names, timeout_s=5)
        await answered_once_up(client, "acme", {"semanticQuery": "anything"}, 90)
        threads = [int(tid) for tid in os.listdir(f"/proc/{worker.pid}/task")]
        assert len(threads) > 1  # the model's threads among them
        assert {niceness(tid) for tid in threads} == {6}
        # Where the kernel has autogroups it shares the cores between the groups first.
        assert autogroup_niceness(worker.pid) in (None, 6)
        admin = await create_pool(deployment.database_url, deployment.settings, min_size=1, max_size=1)
        try:
            sessions = await admin.fetch(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() "
                "AND backend_type = 'client backend'"
            )
        finally:
            await admin.close()
        assert sessions  # the worker's reader pool
        assert {niceness(row["pid"]) for row in sessions} == {6}
    finally:
        worker.terminate()
        await worker.wait()
