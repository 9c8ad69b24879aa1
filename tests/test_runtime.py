"""The embedded runtime: configured URLs start nothing, clients get clear errors, an embedded cluster forms."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import nats.errors
import pytest
import structlog
from structlog.testing import capture_logs

from ontofabric.shared import runtime
from ontofabric.shared.jetstream import connect, ensure_jetstream
from ontofabric.shared.runtime import (
    RUNTIME_FILE,
    EmbeddedRuntime,
    RuntimeUnavailable,
    resolve_endpoints,
    servers_moved,
    with_login,
)
from ontofabric.shared.settings import Settings, SettingsUnusable
from ontofabric.shared.subjects import Names


def test_configured_urls_start_nothing(tmp_path: Path) -> None:
    settings = Settings(nats_url="nats://nats.example:4222", database_url="postgresql://db.example/x")
    with EmbeddedRuntime(settings, tmp_path) as runtime:
        assert runtime.endpoints is not None
        assert runtime.endpoints.nats_url == "nats://nats.example:4222"
        assert not (tmp_path / RUNTIME_FILE).exists()
        assert not (tmp_path / "nats").exists()
        assert not (tmp_path / "postgres").exists()


def test_a_worker_found_through_up_learns_when_up_restarted_on_other_ports(tmp_path: Path) -> None:
    """Else it retries the old addresses for ever, and no supervisor restarts it."""
    record = {"pid": os.getpid(), "natsUrl": "nats://127.0.0.1:1", "databaseUrl": "postgresql://u@127.0.0.1:2/d"}
    (tmp_path / RUNTIME_FILE).write_text(json.dumps(record))
    settings = Settings(data_dir=tmp_path)
    moved = servers_moved(settings, resolve_endpoints(settings))
    assert moved is not None
    assert moved() == []
    (tmp_path / RUNTIME_FILE).write_text(json.dumps({**record, "natsUrl": "nats://127.0.0.1:3"}))
    assert moved() == [f"the nats-server of `ontofabric up` in {tmp_path} moved (up was restarted)"]
    (tmp_path / RUNTIME_FILE).write_text("{")
    assert moved() == []  # unreadable: nothing known
    (tmp_path / RUNTIME_FILE).unlink()
    assert moved() == []  # up stopped: the worker waits for its servers, as for any outage
    configured = Settings(data_dir=tmp_path, nats_url="nats://127.0.0.1:1", database_url="postgresql://x/y")
    assert servers_moved(configured, resolve_endpoints(configured)) is None


def test_a_login_goes_into_a_url_in_place_of_any_it_had() -> None:
    """One helper for a server's address and for a worker's own login on the owner's database URL."""
    assert with_login("nats://127.0.0.1:4222", "u", "p/w") == "nats://u:p%2Fw@127.0.0.1:4222"
    owner = "postgresql://postgres:s3cret@127.0.0.1:5432/ontofabric?sslmode=disable"
    assert (
        with_login(owner, "ontofabric_query", "pw")
        == "postgresql://ontofabric_query:pw@127.0.0.1:5432/ontofabric?sslmode=disable"
    )


def test_workers_beside_an_up_that_records_no_logins_of_theirs_say_so(tmp_path: Path) -> None:
    """An upgrade tester's workers of this release, started beside an `up` of the one before (which records no
    logins of the workers' own), connected as the superuser without a word."""
    from ontofabric.services.app import warn_without_logins

    record = {"pid": os.getpid(), "natsUrl": "nats://127.0.0.1:1", "databaseUrl": "postgresql://u@127.0.0.1:2/d"}
    (tmp_path / RUNTIME_FILE).write_text(json.dumps(record))
    settings = Settings(data_dir=tmp_path)
    with capture_logs() as logs:
        assert warn_without_logins(settings, resolve_endpoints(settings))
    assert [entry["event"] for entry in logs] == ["database_logins_not_recorded"]
    logins = {"query": ["ontofabric_query", "pw"], "projector": ["ontofabric_projector", "pw"]}
    (tmp_path / RUNTIME_FILE).write_text(json.dumps({**record, "databaseLogins": logins}))
    endpoints = resolve_endpoints(settings)
    assert endpoints.database_logins == {
        "query": ("ontofabric_query", "pw"),
        "projector": ("ontofabric_projector", "pw"),
    }
    assert not warn_without_logins(settings, endpoints)
    configured = Settings(data_dir=tmp_path, database_url="postgresql://x/y")  # its own logins are the operator's
    assert not warn_without_logins(configured, resolve_endpoints(configured))


def test_clients_find_a_running_up_or_say_what_to_do(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    with pytest.raises(RuntimeUnavailable, match="ontofabric up"):
        resolve_endpoints(settings)
    (tmp_path / RUNTIME_FILE).write_text(
        json.dumps({"natsUrl": "nats://127.0.0.1:1", "databaseUrl": "postgresql://x/y", "pid": os.getpid()})
    )
    assert resolve_endpoints(settings).nats_url == "nats://127.0.0.1:1"
    # A file left by a process that is gone does not count.
    (tmp_path / RUNTIME_FILE).write_text(
        json.dumps({"natsUrl": "nats://127.0.0.1:1", "databaseUrl": "postgresql://x/y", "pid": 2**22 + 12345})
    )
    with pytest.raises(RuntimeUnavailable):
        resolve_endpoints(settings)
    # One URL set, the other not: that one is named (an operator tester's was told to set both).
    half = Settings(data_dir=tmp_path / "none", nats_url="nats://127.0.0.1:1")
    with pytest.raises(RuntimeUnavailable, match="ONTOFABRIC_DATABASE_URL is not set"):
        resolve_endpoints(half)
    # A damaged file: named, not a traceback of the JSON parser.
    (tmp_path / RUNTIME_FILE).write_text("{broken")
    with pytest.raises(SettingsUnusable, match=r"runtime\.json cannot be read"):
        resolve_endpoints(settings)


def test_a_second_runtime_on_the_same_directory_is_refused(tmp_path: Path) -> None:
    first = EmbeddedRuntime(Settings(database_url="postgresql://db.example/x"), tmp_path)
    first._take_lock()
    try:
        with pytest.raises(RuntimeUnavailable, match="another ontofabric process"):
            EmbeddedRuntime(Settings(database_url="postgresql://db.example/x"), tmp_path)._take_lock()
    finally:
        first.stop()


@pytest.mark.slow
async def test_an_embedded_cluster_forms_and_every_node_learns_new_users(tmp_path: Path) -> None:
    """`up` with nats_cluster_nodes=3: three nats-servers on loopback form one JetStream cluster (a stream with
    three replicas can be made), a user added later is known to each node (`nats-user add` reloads them all),
    and a process that is not a server of the cluster cannot join it through a route port."""
    settings = Settings(nats_cluster_nodes=3, nats_replicas=3, database_url="postgresql://db.example/x")
    with EmbeddedRuntime(settings, tmp_path) as runtime:
        assert runtime.endpoints is not None
        assert runtime.endpoints.nats_url.count(",") == 2
        recorded = json.loads((tmp_path / RUNTIME_FILE).read_text())
        assert [node["name"] for node in recorded["natsNodes"]] == ["ontofabric-1", "ontofabric-2", "ontofabric-3"]
        operator = runtime.nats_logins("later", ["operator"])["operator"]  # added after the start
        for node in runtime.nats_nodes:
            nc = await connect(with_login(node.url, *operator), "cluster-test")
            try:
                if node is runtime.nats_nodes[0]:
                    js, names = nc.jetstream(), Names("later")
                    await ensure_jetstream(js, names, settings)
                    for stream in names.streams[:4]:
                        cluster = (await js.stream_info(stream)).cluster
                        assert cluster is not None
                        assert len(cluster.replicas or []) == 2  # besides the leader
                        await js.delete_stream(stream)
            finally:
                await nc.close()
        # Routes want the cluster's password: a stranger's route connection is refused.
        node = runtime.nats_nodes[0]
        assert node.cluster_port is not None
        reader, writer = await asyncio.open_connection("127.0.0.1", node.cluster_port)
        try:
            await reader.readline()  # the server's INFO
            writer.write(b'CONNECT {"verbose":false,"pedantic":false,"name":"stranger"}\r\nPING\r\n')
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(200), 5)
            assert b"Authorization Violation" in answer
        finally:
            writer.close()


def test_a_restarted_runtime_keeps_its_ports_while_they_are_free(tmp_path: Path) -> None:
    """An outside tester's: every restart of `up` moved both servers to new ports, so the URLs `nats-user add` had
    printed went stale and workers run apart had to be restarted. A port taken meanwhile: a fresh one."""

    def urls() -> tuple[str, str]:
        with EmbeddedRuntime(Settings(), tmp_path) as started:
            assert started.endpoints is not None
            return started.endpoints.nats_url, started.endpoints.database_url

    first = urls()
    assert urls() == first
    nats_port = urlsplit(first[0].split(",")[0]).port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", nats_port))
        taken.listen()
        moved = urls()
    assert urlsplit(moved[0]).port != nats_port
    assert moved[1] == first[1]  # the database's port was free: kept
    (tmp_path / "postgres" / "ports.json").write_text("[0, 1")  # unreadable: a fresh port
    assert urlsplit(urls()[1]).port not in (0, None)
    # The servers' logs name users, workspaces and refused subjects: their owner's alone (a tenant tester's).
    logs = {path.name: stat.S_IMODE(path.stat().st_mode) for path in tmp_path.rglob("*.log")}
    assert {"nats-server.log", "postgres.log"} <= logs.keys()
    assert set(logs.values()) == {0o600}, logs


@pytest.mark.parametrize("server", ["nats", "postgres"])
def test_a_port_taken_between_its_pick_and_the_server_s_start_is_picked_again(
    server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A port found free can be taken by another process before the server binds it (a suite run lost a
    cluster test to that): the server starts again on fresh ports."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    picks = iter([busy])
    real = runtime.free_port
    monkeypatch.setattr(runtime, "free_port", lambda: next(picks, 0) or real())
    elsewhere = {"database_url": "postgresql://db.example/x"} if server == "nats" else {"nats_url": "nats://x:1"}
    try:
        with structlog.testing.capture_logs() as logged, EmbeddedRuntime(Settings(**elsewhere), tmp_path) as started:
            assert started.endpoints is not None
            url = started.endpoints.nats_url if server == "nats" else started.endpoints.database_url
            assert f":{busy}" not in url
    finally:
        taken.close()
    taken_ports = [(e["server"], e["attempt"]) for e in logged if e["event"] == "embedded_server_port_taken"]
    assert taken_ports == [(server, 1)]


def test_a_server_that_does_not_stop_is_killed_with_every_process_it_started(tmp_path: Path) -> None:
    """A fault tester's PostgreSQL, frozen (SIGSTOP) as `up` stopped: the postmaster alone was killed, and its 12
    backends, frozen, kept its shared memory, so the next `up` could not start PostgreSQL. Each backend leads a
    session of its own (PostgreSQL calls setsid), as the child here does: killing the server's group missed them."""
    pid_file = tmp_path / "child.pid"
    server = runtime._spawn(
        "frozen",
        ["sh", "-c", f"trap '' TERM; setsid sleep 300 & echo $! > {pid_file}; wait"],
        tmp_path / "frozen.log",
        signal.SIGTERM,
    )
    for _ in range(100):
        if pid_file.exists() and pid_file.read_text().strip():
            break
        time.sleep(0.05)
    child = int(pid_file.read_text())
    # Frozen, the server and what it started: none answers (a server that takes its stop signal, as PostgreSQL
    # does, stays frozen; this one ignores it).
    for pid in (server.process.pid, child):
        os.kill(pid, signal.SIGSTOP)
    server.stop(timeout=0.5)
    assert not server.alive()
    for _ in range(100):  # the child is reaped by init once killed
        if not _exists(child):
            break
        time.sleep(0.05)
    assert not _exists(child)


def _exists(pid: int) -> bool:
    """Whether a process of that id exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][:1] != "Z"
    except OSError:
        return False


@contextlib.contextmanager
def _small_disk(directory: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` at ``directory`` (root only; skipped where mounting is not allowed)."""
    directory.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], capture_output=True, check=False
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode(errors='replace').strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


async def test_a_nats_store_whose_disk_filled_stores_again_once_there_is_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk tester's: once a stream failed to write to a full disk, nats-server (2.14 and later) kept the error,
    and no delta was stored after the disk was freed, until `up` was restarted. The runtime's store watch opens the
    stores again once there is room."""
    monkeypatch.setattr(runtime, "STORE_ROOM_BYTES", 8 * 1024 * 1024)  # of this small disk
    settings = Settings(database_url="postgresql://db.example/x")
    with _small_disk(tmp_path / "disk", "48m") as disk, EmbeddedRuntime(settings, disk) as embedded:
        assert embedded.store_watch is not None
        names = Names(settings.subject_prefix)
        nc = await connect(with_login(embedded.nats_nodes[0].url, *embedded.nats_logins(names.prefix)["operator"]), "t")
        try:
            js = nc.jetstream(timeout=2)
            await ensure_jetstream(js, names, settings)
            filler = disk / "filler"
            with filler.open("wb") as out:
                os.posix_fallocate(out.fileno(), 0, shutil.disk_usage(disk).free - 2 * 1024 * 1024)
            subject, body = names.delta_subject("acme", "main"), b"x" * 64 * 1024

            async def fill() -> None:
                for _ in range(200):  # 12.5 MB: more than the 2 MB left
                    await js.publish(subject, body)

            with pytest.raises(TimeoutError):
                await fill()
            assert runtime.store_write_error(embedded.nats_nodes[0]) is not None  # what the watch reads
            assert embedded.store_watch.look() == []  # no room yet: nothing to do
            assert "MiB free" in runtime.low_disk(disk)  # what a server's failure to start says then
            filler.unlink()
            assert runtime.low_disk(disk) == ""
            with pytest.raises(TimeoutError):  # the disk has room, and still nothing is stored
                await js.publish(subject, body)
            async with asyncio.timeout(runtime.STORE_WATCH_S * 3):
                while True:
                    with contextlib.suppress(TimeoutError, nats.errors.Error):
                        await js.publish(subject, body)
                        break
                    await asyncio.sleep(0.5)
            assert runtime.store_write_error(embedded.nats_nodes[0]) is None
        finally:
            await nc.close()


def test_a_runtime_on_a_full_disk_says_so(tmp_path: Path) -> None:
    """A verifier's `up` on a disk with no byte free ended in a traceback (OSError from writing the server's
    configuration)."""
    settings = Settings(database_url="postgresql://db.example/x")
    with _small_disk(tmp_path / "disk", "16m") as disk:
        with EmbeddedRuntime(settings, disk):
            pass  # its files made
        with (disk / "filler").open("wb") as out, contextlib.suppress(OSError):  # to the last byte
            while True:
                out.write(b"\0" * 65536)
                out.flush()
        with pytest.raises(RuntimeUnavailable, match="No space left on device; the disk holding it has only"):
            EmbeddedRuntime(settings, disk).start()


def test_the_store_watch_reopens_stores_only_for_room_and_not_again_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A review's: reopening ends only an error that room ends, and one that came back is not reopened every 10 s
    (JetStream off and on each time); any other write error is named for its operator."""
    errors = {"n": "JetStream stream '$G > S' write error: write /x/1.blk: read-only file system"}
    reopened: list[str] = []
    monkeypatch.setattr(runtime, "store_write_error", lambda node: errors.get(node.name))
    monkeypatch.setattr(runtime, "restart_jetstream", lambda directory, node, nodes: reopened.append(node.name))
    monkeypatch.setattr(runtime, "STORE_ROOM_BYTES", 0)
    watch = runtime.NatsStoreWatch(tmp_path, [runtime.NatsNode("n", tmp_path, 1)])
    with structlog.testing.capture_logs() as logged:
        assert watch.look() == []
    assert [entry["event"] for entry in logged] == ["nats_store_cannot_write"]
    assert "restart this server" in logged[0]["note"]
    now = [1000.0]
    monkeypatch.setattr(runtime.time, "monotonic", lambda: now[0])
    errors["n"] = "JetStream stream '$G > S' write error: write /x/1.blk: no space left on device"
    assert watch.look() == ["n"]
    assert watch.look() == []  # the error again at once: not before the wait
    del errors["n"]
    now[0] += 20
    assert watch.look() == []  # healthy a while, the wait not forgotten: sparse failures do not start it anew
    errors["n"] = "JetStream stream '$G > S' write error: write /x/2.blk: no space left on device"
    now[0] += 15  # past the first wait (30 s)
    assert watch.look() == ["n"]
    now[0] += 40  # within the doubled wait (60 s)
    assert watch.look() == []
    assert reopened == ["n", "n"]
    del errors["n"]
    now[0] += 200  # healthy longer than its wait: forgotten
    assert watch.look() == []
    errors["n"] = "JetStream stream '$G > S' write error: write /x/3.blk: no space left on device"
    assert watch.look() == ["n"]


@pytest.mark.skipif(os.geteuid() != 0, reason="creates a system user: as root only")
def test_the_system_user_made_for_postgres_is_logged(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh-install tester's: run as root, the user PostgreSQL runs as was created without a word, where the
    README says each change to the host is logged."""
    name = f"oftest{os.getpid() % 100_000}"
    monkeypatch.setattr(runtime, "POSTGRES_SYSTEM_USER", name)
    try:
        with structlog.testing.capture_logs() as logged:
            assert runtime._postgres_user() == name
            assert runtime._postgres_user() == name  # there now: said once
        assert [(e["event"], e["user"]) for e in logged] == [("created_system_user", name)]
    finally:
        subprocess.run(["userdel", name], capture_output=True, check=False)
