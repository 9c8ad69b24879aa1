"""compose.yaml, proven without Docker: validated by docker-compose (Debian's package), and its workers started each
as its own process with the variables the compose file gives them, against separately started servers (a
nats-server from compose's own configuration file, a user per role, and PostgreSQL), answering over NATS and
serving their metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tomllib
import urllib.request
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import nats
import pytest
import yaml

from ontofabric.services.ingest.client import DeltaPublisher
from ontofabric.services.query.client import QueryClient
from ontofabric.shared.discovery import discover
from ontofabric.shared.jetstream import connect, wait_projected
from ontofabric.shared.nats_auth import NATS_ROLES, compose_nats_config, compose_password_variable
from ontofabric.shared.runtime import (
    Endpoints,
    _spawn,
    _wait_until,
    free_port,
    nats_server_binary,
    postgres_bin_dir,
)
from ontofabric.shared.subjects import Names

from .conftest import answered_once_up, with_database
from .factories import document, upsert

ROOT = Path(__file__).parent.parent
COMPOSE = ROOT / "compose.yaml"
ONTOFABRIC = str(Path(sys.executable).parent / "ontofabric")


def _compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return loaded


def test_compose_runs_the_server_releases_the_tests_run() -> None:
    """compose pinned nats 2.10 and PostgreSQL 17 while the tests ran 2.15 and 18: ingest manifests' purge markers
    expire by a per-message TTL, which nats-server has since 2.11, and compose's would have stayed for good."""
    services = _compose()["services"]
    nats_version = subprocess.run([str(nats_server_binary()), "--version"], capture_output=True, text=True, check=True)
    tested = re.search(r"v(\d+\.\d+)\.", nats_version.stdout)
    assert tested is not None, nats_version.stdout
    assert services["nats"]["image"] == f"nats:{tested.group(1)}"
    postgres = subprocess.run(
        [str(postgres_bin_dir() / "postgres"), "--version"], capture_output=True, text=True, check=True
    )
    major = re.search(r"PostgreSQL\) (\d+)\.", postgres.stdout)
    assert major is not None, postgres.stdout
    assert services["postgres"]["image"] == f"pgvector/pgvector:pg{major.group(1)}"
    # From 18 the image keeps its data under a directory of the release and refuses a mount at .../data.
    assert "postgres-data:/var/lib/postgresql" in services["postgres"]["volumes"]


def test_docker_compose_validates_the_compose_file_and_prometheus_its_configuration(tmp_path: Path) -> None:
    compose = shutil.which("docker-compose")
    if compose is None:
        if os.environ.get("ONTOFABRIC_TEST_REQUIRE_TOOLS"):  # CI installs both packages
            pytest.fail("docker-compose is missing (apt-get install docker-compose)")
        pytest.skip("docker-compose is not installed (apt-get install docker-compose)")
    env = {**os.environ, **PASSWORDS, "TORCH_INDEX_URL": "https://download.invalid/whl/cpu"}
    checked = subprocess.run(
        [compose, "-f", str(COMPOSE), "config", "-q"], env=env, capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0, checked.stderr
    # Every file the compose file mounts exists in the tree.
    for service in _compose()["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), source
    promtool = shutil.which("promtool")
    if promtool is not None:  # the scrape configuration, with the rules where the container has them
        config = (ROOT / "infra" / "prometheus" / "prometheus.yml").read_text()
        (tmp_path / "prometheus.yml").write_text(config.replace("/etc/prometheus/rules.yml", "rules.yml"))
        shutil.copy(ROOT / "infra" / "prometheus" / "rules.yml", tmp_path / "rules.yml")
        result = subprocess.run([promtool, "check", "config", "prometheus.yml"], cwd=tmp_path, capture_output=True)
        assert result.returncode == 0, result.stdout + result.stderr


def test_what_the_image_copies_builds_the_package(tmp_path: Path) -> None:
    """The files infra/Dockerfile copies into the image are enough to build and install the package: a wheel
    built from them alone holds every package pyproject.toml names. The image had stopped building when the
    documentation became a package and the Dockerfile did not copy it (an auditor's, 2026-12-06)."""
    context = tmp_path / "app"
    context.mkdir()
    for line in (ROOT / "infra" / "Dockerfile").read_text().splitlines():
        if not line.startswith("COPY "):
            continue
        *sources, destination = line.split()[1:]
        for source in sources:
            target = context / (source if destination in ("./", ".") else destination)
            if (ROOT / source).is_dir():
                shutil.copytree(ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(ROOT / source, target)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", str(tmp_path / "wheel"), str(context)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "wheel").glob("ontofabric-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        folders = {str(Path(name).parent) for name in archive.namelist()}
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert {name.replace(".", "/") for name in packages} <= folders


PASSWORDS = {
    **{compose_password_variable(role): f"p{os.urandom(8).hex()}" for role in NATS_ROLES},
    "POSTGRES_QUERY_PASSWORD": f"p{os.urandom(8).hex()}",
}
"""What the shell running compose would give it, as README says to make them (a letter, then letters and digits)."""
QUERY_LOGIN = "ontofabric_query"
"""The query workers' PostgreSQL login in compose (infra/postgres/worker-logins.sh)."""


def _interpolated(value: str) -> str:
    """A compose value with the passwords' ``${NAME...}`` as compose fills them in (the owner's is left: the test
    gives its own URL for it)."""
    return re.sub(r"\$\{([A-Z_]+_PASSWORD)(:\?[^}]*)?\}", lambda found: PASSWORDS.get(found[1], found[0]), value)


def test_the_compose_nats_configuration_is_the_roles_permissions_rendered() -> None:
    """infra/nats/nats.conf is what shared/nats_auth.py renders: a change to a role's permissions reaches compose.
    To write it again: `.venv/bin/python -c 'from ontofabric.shared.nats_auth import compose_nats_config;
    print(compose_nats_config(), end="")' > infra/nats/nats.conf`."""
    assert (ROOT / "infra" / "nats" / "nats.conf").read_text() == compose_nats_config()
    nats = _compose()["services"]["nats"]
    assert "./infra/nats/nats.conf:/etc/nats/nats.conf:ro" in nats["volumes"]
    assert set(nats["environment"]) == {compose_password_variable(role) for role in NATS_ROLES}


def _worker_env(service: str, nats_url: str, database_url: str, metrics_port: int, query_login: str) -> dict[str, str]:
    """The service's environment from compose.yaml, with the compose network's host names replaced by where the
    servers run here (each login kept: the owner's is the test's own, the query workers' named ``query_login``)
    and, since the processes share one host, a port of its own for the metrics."""
    compose = _compose()
    environment = {
        k: _interpolated(str(v)) for k, v in compose["services"][service]["environment"].items() if v is not None
    }
    given = urlsplit(environment["ONTOFABRIC_NATS_URL"])
    assert given.hostname == "nats"
    served = urlsplit(nats_url)
    # The service's own login, at the server here.
    environment["ONTOFABRIC_NATS_URL"] = given._replace(
        netloc=f"{given.username}:{given.password}@{served.netloc}"
    ).geturl()
    owner = urlsplit(database_url)
    for variable in ("ONTOFABRIC_DATABASE_URL", "ONTOFABRIC_QUERY_DATABASE_URL"):
        if variable not in environment:
            continue
        url = urlsplit(environment[variable])
        assert url.hostname == "postgres"
        if url.username == "postgres":
            environment[variable] = database_url
        else:
            assert url.username == QUERY_LOGIN
            login = f"{query_login}:{url.password}@{owner.hostname}:{owner.port}"
            environment[variable] = owner._replace(netloc=login).geturl()
    environment["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{free_port()}"  # a collector that is not there
    environment["ONTOFABRIC_METRICS_PORT"] = str(metrics_port)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ONTOFABRIC_", "OTEL_"))}
    # The image's own defaults (infra/Dockerfile) stay the package's; no embedder, as in a test deployment.
    return base | environment | {"ONTOFABRIC_EMBEDDER": "none", "ONTOFABRIC_LOG_LEVEL": "WARNING"}


@contextlib.asynccontextmanager
async def _nats_as_compose_runs_it(directory: Path) -> AsyncIterator[str]:
    """A nats-server as compose.yaml's `nats` service runs it: its configuration file (infra/nats/nats.conf), on
    a port and store of this test's, the passwords in its environment. Yields its URL, without a login."""
    port = free_port()
    config = (ROOT / "infra" / "nats" / "nats.conf").read_text()
    for compose_runs, here in {
        '"host": "0.0.0.0"': '"host": "127.0.0.1"',
        '"port": 4222': f'"port": {port}',
        '"store_dir": "/data"': f'"store_dir": {json.dumps(str(directory / "js"))}',
        '"http_port": 8222': f'"http_port": {free_port()}',
    }.items():
        assert config.count(compose_runs) == 1, compose_runs
        config = config.replace(compose_runs, here)
    (directory / "nats.conf").write_text(config)
    argv = [str(nats_server_binary()), "--config", str(directory / "nats.conf")]
    server = _spawn("nats-server", argv, directory / "nats.log", signal.SIGTERM, env=os.environ | PASSWORDS)
    try:
        _wait_until(lambda: _listening(port), server, timeout=30)
        yield f"nats://127.0.0.1:{port}"
    finally:
        server.stop()


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


@pytest.mark.servers
async def test_the_compose_workers_started_as_processes_with_its_variables_serve(
    servers: Endpoints, tmp_path: Path
) -> None:
    database = "compose" + os.urandom(4).hex()
    query_login = f"{database}_query"  # of its own: the test servers' ontofabric_query is other tests'
    admin = await asyncpg.connect(with_database(servers.database_url, "postgres"))
    await admin.execute(f'CREATE DATABASE "{database}"')
    processes: list[asyncio.subprocess.Process] = []
    try:
        database_url = with_database(servers.database_url, database)
        _run_worker_logins(database_url, query_login)
        async with _nats_as_compose_runs_it(tmp_path) as nats_url:
            ports = {"projector": free_port(), "query-worker-1": free_port(), "query-worker-2": free_port()}
            for name, port in ports.items():
                service = name.rsplit("-", 1)[0] if name.startswith("query") else name
                command = _compose()["services"][service]["command"]
                env = _worker_env(service, nats_url, database_url, port, query_login)
                processes.append(await asyncio.create_subprocess_exec(ONTOFABRIC, *command, env=env))
            assert _compose()["services"]["query-worker"]["deploy"]["replicas"] == 2

            with pytest.raises(nats.errors.Error, match="Authorization Violation"):  # no login, no connection
                await nats.connect(nats_url, allow_reconnect=False, connect_timeout=2)
            operator = compose_password_variable("operator")
            nc = await connect(nats_url.replace("://", f"://operator:{PASSWORDS[operator]}@"), "compose-test")
            try:
                names = Names()  # compose sets no prefix: the default deployment
                js = nc.jetstream()
                async with asyncio.timeout(120):  # the projector made the streams
                    while True:
                        with contextlib.suppress(Exception):
                            await js.stream_info(names.delta_stream)
                            break
                        await asyncio.sleep(0.5)
                acks = await DeltaPublisher(js, names).publish_many(
                    [
                        upsert("acme", document(f"doc-{n}", f"compress a directory into a zip archive {n}"))
                        for n in range(5)
                    ]
                )
                await wait_projected(js, names, 1, acks[-1].seq, 60)
                client = QueryClient(nc, names, timeout_s=5)
                query = {"semanticQuery": "zip archive", "topK": 5}
                reply = await answered_once_up(client, "acme", query, 120, with_results=True)
                assert {r.id for r in reply.results} == {f"doc-{n}" for n in range(5)}
                async with asyncio.timeout(30):
                    while len(await discover(nc, names.query_service)) < 2:
                        await asyncio.sleep(0.5)
                # The query workers read as their own login, which can do nothing else.
                sessions = await admin.fetch(
                    "SELECT DISTINCT usename FROM pg_stat_activity WHERE datname = $1", database
                )
                assert query_login in {r["usename"] for r in sessions}
                reader = await asyncpg.connect(
                    _with_login(database_url, query_login, PASSWORDS["POSTGRES_QUERY_PASSWORD"])
                )
                try:
                    with pytest.raises(asyncpg.InsufficientPrivilegeError):
                        await reader.execute("DELETE FROM documents")
                    assert await reader.fetchval("SELECT rolsuper FROM pg_roles WHERE rolname = current_user") is False
                finally:
                    await reader.close()
                scraped = {name: await asyncio.to_thread(_scrape, port) for name, port in ports.items()}
                assert "projector_deltas_total" in scraped["projector"]
                assert any("retrieval_query_duration_ms" in scraped[n] for n in ("query-worker-1", "query-worker-2"))
            finally:
                await nc.close()
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        for process in processes:
            await asyncio.wait_for(process.wait(), 60)
        await admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        await admin.execute(f'DROP ROLE IF EXISTS "{query_login}"')
        await admin.close()


def _with_login(database_url: str, user: str, password: str) -> str:
    url = urlsplit(database_url)
    return url._replace(netloc=f"{user}:{password}@{url.hostname}:{url.port}").geturl()


def _run_worker_logins(database_url: str, query_login: str) -> None:
    """infra/postgres/worker-logins.sh as PostgreSQL's image runs it at its first start (its psql, the owner's
    user and database in the environment), against the test's server, making ``query_login``."""
    owner = urlsplit(database_url)
    env = {
        **os.environ,
        "PATH": f"{postgres_bin_dir()}{os.pathsep}{os.environ.get('PATH', '')}",
        "PGHOST": owner.hostname or "127.0.0.1", "PGPORT": str(owner.port), "PGPASSWORD": owner.password or "",
        "POSTGRES_USER": owner.username or "postgres", "POSTGRES_DB": owner.path.lstrip("/"),
        "POSTGRES_QUERY_PASSWORD": PASSWORDS["POSTGRES_QUERY_PASSWORD"], "POSTGRES_QUERY_LOGIN": query_login,
    }  # fmt: skip
    for _ in range(2):  # at a first start; and again, as a second run would: it changes nothing
        done = subprocess.run(
            ["sh", str(ROOT / "infra" / "postgres" / "worker-logins.sh")], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
