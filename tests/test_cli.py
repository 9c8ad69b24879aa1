"""The command line as a user runs it: help texts, `up` + `ingest` + `query` as processes, and `demo`."""

from __future__ import annotations

import asyncio
import json
import os
import re
import select
import signal
import socket
import stat
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import asyncpg
import pytest
from structlog.testing import capture_logs

from ontofabric.services.projector.worker import ProjectorService
from ontofabric.shared import db
from ontofabric.shared.db import Migration, migrate
from ontofabric.shared.logging import LOG_LINES_PER_WINDOW
from ontofabric.shared.runtime import free_port
from ontofabric.shared.settings import Settings

from .conftest import Deployment
from .factories import document, upsert

ONTOFABRIC = str(Path(sys.executable).parent / "ontofabric")
COMMANDS = [
    "up", "projector", "query-worker", "ingest", "query", "mcp", "demo", "eval", "rebuild", "migrate", "contracts",
    "settings", "gateway-token", "nats-user", "dlq", "status", "compact", "reembed", "calibrate", "forget-layout",
    "adopt-stream", "delete-branch",
]  # fmt: skip


def _env(**values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONTOFABRIC_")}
    env.update(values)
    return env


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command: str) -> None:
    unsized = {k: v for k, v in _env().items() if k not in ("COLUMNS", "TERMINAL_WIDTH")}
    result = subprocess.run([ONTOFABRIC, command, "--help"], capture_output=True, text=True, env=unsized, check=False)
    assert result.returncode == 0, result.stderr
    assert "Usage" in result.stdout
    assert "<bool>" not in result.stdout  # a flag takes no value, so its help shows none
    assert "…" not in result.stdout  # printed to no terminal, nothing cut (a docs tester's `--sample-documen…`)


def test_the_installed_version_is_printed() -> None:
    """A new operator's: `ontofabric --version` was "No such option"."""
    result = subprocess.run([ONTOFABRIC, "--version"], capture_output=True, text=True, env=_env(), check=False)
    assert (result.returncode, result.stdout) == (0, f"ontofabric {version('ontofabric')}\n"), result.stderr


def test_a_commands_help_paragraphs_are_not_cut_at_their_docstrings_line_breaks() -> None:
    """A tester's `adopt-stream --help` read "made / again": each paragraph is wrapped as one."""
    result = subprocess.run(
        [ONTOFABRIC, "compact", "--help"], capture_output=True, text=True, env=_env(COLUMNS="400"), check=False
    )
    assert result.returncode == 0, result.stderr
    (paragraph,) = [line for line in result.stdout.splitlines() if "Bounds the stream" in line]
    assert paragraph.rstrip().endswith("so it asks first.")


@pytest.mark.parametrize("group", [[], ["dlq"], ["gateway-token"], ["nats-user"]])
def test_command_summaries_are_not_cut_at_their_docstrings_line_breaks(group: list[str]) -> None:
    """Wide enough for every summary, each command's row is one line: a docstring's own line breaks are not kept."""
    result = subprocess.run(
        [ONTOFABRIC, *group, "--help"], capture_output=True, text=True, env=_env(COLUMNS="400"), check=False
    )
    assert result.returncode == 0, result.stderr
    panel = [row for row in result.stdout.split("Commands")[1].splitlines() if row.startswith("│")]
    assert panel
    assert all(re.match(r"│ [a-z-]+ +\S", row) for row in panel), "\n".join(panel)


def test_client_commands_explain_what_is_missing(tmp_path: Path) -> None:
    result = subprocess.run(
        [ONTOFABRIC, "query", "anything", "--data-dir", str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 2
    assert "ontofabric up" in result.stderr


@pytest.mark.parametrize(
    "command", [["query", "anything"], ["ingest", ".", "--workspace", "w"], ["dlq", "list"], ["status", "--json"]]
)
def test_an_unreachable_nats_server_is_said_within_the_connect_timeout(tmp_path: Path, command: list[str]) -> None:
    """No command waits for ever for a server nobody runs; a query needs no database URL to say so. (The MCP
    gateway starts anyway: tests/test_gateway.py.) Status, which a health check reads, exits 2 as its help says
    when nothing could be read (an operator tester's: 1, as for problems listed)."""
    with socket.socket() as probe:  # a port nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = _env(
        ONTOFABRIC_NATS_URL=f"nats://127.0.0.1:{port}", ONTOFABRIC_NATS_CONNECT_TIMEOUT_S="1.5",
        ONTOFABRIC_DATABASE_URL="postgresql://nobody@127.0.0.1:1/none",  # an operator's command reads both
    )  # fmt: skip
    if command[0] in ("query", "ingest"):  # both need NATS only
        del env["ONTOFABRIC_DATABASE_URL"]
    started = time.monotonic()
    result = subprocess.run(
        [ONTOFABRIC, *command, "--data-dir", str(tmp_path)], cwd=tmp_path,
        capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == (2 if command[0] == "status" else 1), result.stderr
    assert f"no NATS server answered at nats://127.0.0.1:{port} within 1.5 s" in result.stderr
    assert not result.stdout
    assert time.monotonic() - started < 30
    assert "Traceback" not in result.stderr


def _start_up(env: dict[str, str], data_dir: Path, *options: str) -> subprocess.Popen[bytes]:
    """``ontofabric up`` as a process of its own session, once it has recorded its servers."""
    up = subprocess.Popen(
        [ONTOFABRIC, "up", *options], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    deadline = time.monotonic() + 90
    try:
        while not (data_dir / "runtime.json").exists():
            assert up.poll() is None, up.stderr.read().decode() if up.stderr else ""
            assert time.monotonic() < deadline, "ontofabric up did not start"
            time.sleep(0.2)
    except BaseException:
        _kill_if_running(up)
        raise
    return up


def _kill_if_running(up: subprocess.Popen[bytes]) -> None:
    """``up`` and every process of its session, if it still runs (a test that failed midway)."""
    if up.poll() is None:
        os.killpg(up.pid, signal.SIGKILL)
        up.wait()


@pytest.mark.slow
def test_up_stops_its_workers_when_its_terminal_closes(tmp_path: Path) -> None:
    """A stop tester's: SIGHUP (a terminal closed) ended `up` at once, its workers not stopped, nothing logged."""
    data_dir = tmp_path / "data"
    up = _start_up(_env(ONTOFABRIC_DATA_DIR=str(data_dir), ONTOFABRIC_EMBEDDER="none"), data_dir)
    try:
        assert up.stderr is not None
        said, deadline = b"", time.monotonic() + 120
        while b'"workers_running"' not in said:  # its handlers are set
            assert time.monotonic() < deadline, said.decode()
            if select.select([up.stderr], [], [], 1)[0]:  # read past the pipe's buffer, which select cannot see
                said += os.read(up.stderr.fileno(), 1 << 16)
        up.send_signal(signal.SIGHUP)
        _, rest = up.communicate(timeout=60)
    finally:
        _kill_if_running(up)
    assert up.returncode == 0
    events = [json.loads(line) for line in rest.decode().splitlines()]
    assert [e["reason"] for e in events if e["event"] == "workers_stopping"] == ["signal"]
    assert "embedded_server_stopped" in {e["event"] for e in events}


@pytest.mark.slow
def test_up_stops_and_says_so_when_an_embedded_server_ends(tmp_path: Path) -> None:
    """Not left up with its workers retrying against a server that is gone: exit 1, naming it, for a supervisor."""
    data_dir = tmp_path / "data"
    up = _start_up(_env(ONTOFABRIC_DATA_DIR=str(data_dir), ONTOFABRIC_EMBEDDER="none"), data_dir)
    try:
        nats_pid = json.loads((data_dir / "runtime.json").read_text())["natsNodes"][0]["pid"]
        os.kill(nats_pid, signal.SIGKILL)
        _, stderr = up.communicate(timeout=60)
    finally:
        _kill_if_running(up)
    assert up.returncode == 1
    assert "embedded server ended: nats" in stderr.decode()
    # Its stderr is a JSON log stream (the default format) to its last line (a new operator's ended in plain text).
    events = [json.loads(line) for line in stderr.decode().splitlines()]
    assert [e["exit_code"] for e in events if e["event"] == "stopped" and "server ended: nats" in e["reason"]] == [1]


def _ingest_geometry(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``ontofabric ingest`` of a tree of one file, one function, into workspace geo."""
    source = tmp_path / "src"
    source.mkdir(exist_ok=True)
    (source / "geometry.py").write_text("def circle_area(radius):\n    return 3.14159 * radius ** 2\n")
    return subprocess.run(
        [ONTOFABRIC, "ingest", str(source), "--workspace", "geo"], env=env, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip


@pytest.mark.slow
def test_up_runs_the_servers_alone_for_workers_of_their_own(tmp_path: Path) -> None:
    """A rolling-restart tester's: `up` always ran a projector, which became the active one, so restarting or failing
    over the projector took the servers down with it."""
    data_dir = tmp_path / "data"
    env = _env(ONTOFABRIC_DATA_DIR=str(data_dir), ONTOFABRIC_EMBEDDER="none")
    # The workers' metrics port: `up` without workers leaves it to them (a review's).
    metered = {**env, "ONTOFABRIC_METRICS_PORT": str(free_port())}
    up = _start_up(metered, data_dir, "--no-projector", "--no-query-worker")
    workers: list[subprocess.Popen[bytes]] = []

    def query() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [ONTOFABRIC, "query", "the area of a circle", "--workspace", "geo", "--json"], env=env,
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip

    try:
        alone = query()
        assert alone.returncode != 0
        said = " ".join(alone.stderr.split())
        assert "no query worker listens on ontofabric.query.geo: is `ontofabric up` running" in said, said
        # The query worker first: it waits for the streams a projector makes (it stopped with a traceback).
        for command, its_env in (("query-worker", env), ("projector", metered)):
            workers.append(subprocess.Popen([ONTOFABRIC, command], env=its_env, stderr=subprocess.DEVNULL))
            time.sleep(3 if command == "query-worker" else 0)
        for _ in range(60):  # until the projector has made the streams
            ingest = _ingest_geometry(tmp_path, env)
            if "does not exist" not in ingest.stderr:
                break
            time.sleep(1)
        assert ingest.returncode == 0, ingest.stderr
        for _ in range(100):  # the worker may still be starting, then learns the version through its KV watch
            answered = query()
            if answered.returncode == 0 and json.loads(answered.stdout)["results"]:
                break
            time.sleep(0.3)
        assert answered.returncode == 0, answered.stderr
        assert json.loads(answered.stdout)["results"][0]["metadata"]["symbolFqn"] == "geometry.circle_area"
        # The request's other options, from the command line (an agent tester could not try them there).
        optioned = subprocess.run(
            [ONTOFABRIC, "query", "area", "--workspace", "geo", "--json", "--related-to", "callers:circle_area",
             "--min-relevance", "0.5", "--symbol-kind", "function", "--follow-links"],
            env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert optioned.returncode == 0, optioned.stderr
        meta = json.loads(optioned.stdout)["_meta"]
        assert meta["relation"] == {"relation": "callers", "symbol": "circle_area", "symbolIndexed": True}
        assert "belowMinRelevance" in meta  # said only when minRelevance was sent
        assert "expansion" in meta["timingsMs"]  # run only with followLinks
        kinds = {r["metadata"].get("symbolKind") for r in json.loads(optioned.stdout)["results"]}
        assert kinds == {"function"}, kinds  # the function, and not its file's chunk
        # A relation alone, without TEXT, as the contract allows (an agent tester's "Missing argument 'text'").
        alone = subprocess.run(
            [ONTOFABRIC, "query", "--workspace", "geo", "--json", "--related-to", "callers:circle_area"],
            env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert alone.returncode == 0, alone.stdout + alone.stderr
        answered_alone = json.loads(alone.stdout)  # the relation read, and the rest ranked for the symbol's name
        assert answered_alone["_meta"]["relation"] == meta["relation"]
        assert answered_alone["results"][0]["metadata"]["symbolFqn"] == "geometry.circle_area"
        refused = subprocess.run(
            [ONTOFABRIC, "query", "area", "--workspace", "geo", "--related-to", "friends:circle_area"],
            env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert refused.returncode == 1
        assert "relatedTo.relation" in refused.stdout
        assert [worker.poll() for worker in workers] == [None, None]
        # One projector answers: `up` ran none of its own (else a second one stood by beside the process's).
        status = subprocess.run(
            [ONTOFABRIC, "status", "--json"], env=env, capture_output=True, text=True, timeout=60, check=False
        )
        assert status.returncode == 0, status.stderr
        found = json.loads(status.stdout)
        assert (len(found["projectors"]), len(found["query_workers"])) == (1, 1), found
    finally:
        for worker in workers:
            worker.terminate()
            worker.wait(timeout=30)
        os.killpg(up.pid, signal.SIGTERM)
        up.wait(timeout=60)
    assert up.returncode == 0


def test_up_with_nothing_to_run_is_refused(tmp_path: Path) -> None:
    """Both servers elsewhere and neither worker: `up` would start nothing and wait as if it served."""
    env = _env(
        ONTOFABRIC_DATA_DIR=str(tmp_path / "data"), ONTOFABRIC_NATS_URL="nats://127.0.0.1:1",
        ONTOFABRIC_DATABASE_URL="postgresql://nobody@127.0.0.1:1/none",
    )  # fmt: skip
    refused = subprocess.run(
        [ONTOFABRIC, "up", "--no-projector", "--no-query-worker"], env=env, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stderr
    assert "nothing to run" in refused.stderr


def test_an_ingest_interrupted_says_what_became_of_its_deltas(tmp_path: Path) -> None:
    """A tester's: Ctrl-C ended an ingest with exit 130 and not a word. Here it waits on a NATS server that never
    says hello."""
    (tmp_path / "m.py").write_text("def f():\n    return 1\n")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        env = _env(
            ONTOFABRIC_NATS_URL=f"nats://127.0.0.1:{silent.getsockname()[1]}", ONTOFABRIC_EMBEDDER="none",
            ONTOFABRIC_DATA_DIR=str(tmp_path / "data"),
        )  # fmt: skip
        # Ctrl-C as a terminal sends it: to a process whose SIGINT is not ignored. A child inherits an ignored
        # SIGINT (a runner started in the background by a non-interactive shell has it so), and Python then never
        # raises it.
        ingest = subprocess.Popen(
            [ONTOFABRIC, "ingest", str(tmp_path), "--workspace", "w"], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
        silent.settimeout(60)
        accepted, _ = silent.accept()  # it is connecting
        with accepted:
            ingest.send_signal(signal.SIGINT)
            _, stderr = ingest.communicate(timeout=30)
    assert ingest.returncode == 130, stderr
    # Before anything was published (a tester's: the same words about published deltas at every stage).
    assert "interrupted before anything was published: the index is as it was" in " ".join(stderr.split())
    assert "Traceback" not in stderr


def test_a_ctrl_c_while_the_command_loads_ends_it_without_a_traceback(tmp_path: Path) -> None:
    """A stop tester's: a Ctrl-C in a command's first seconds (its modules loading, up to 3 s under load) printed a
    KeyboardInterrupt traceback of the import it came in. Here it comes as the command line's module is imported."""
    script = (
        "import os, signal, sys\n"
        "class InterruptOnImport:\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'ontofabric.services.cli':\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "sys.meta_path.insert(0, InterruptOnImport())\n"
        "sys.argv = ['ontofabric', 'settings']\n"
        "from ontofabric.services.entry import main\n"
        "main()\n"
    )
    ran = subprocess.run(
        [sys.executable, "-c", script], env=_env(ONTOFABRIC_DATA_DIR=str(tmp_path)), capture_output=True, text=True,
        timeout=120, check=False, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    assert ran.returncode == 130, ran.stderr
    assert "Traceback" not in ran.stderr
    assert not ran.stdout


def _stopped_waiting_on_nats(
    tmp_path: Path, command: list[str], stop: signal.Signals, on_sigint: signal.Handlers
) -> tuple[int, str]:
    """``command`` started with SIGINT handled as ``on_sigint``, sent ``stop`` while it waits on a NATS server that
    never says hello: its exit code and stderr."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        env = _env(
            ONTOFABRIC_NATS_URL=f"nats://127.0.0.1:{silent.getsockname()[1]}", ONTOFABRIC_EMBEDDER="none",
            ONTOFABRIC_DATABASE_URL="postgresql://nobody@127.0.0.1:1/none", ONTOFABRIC_DATA_DIR=str(tmp_path),
        )  # fmt: skip
        running = subprocess.Popen(
            [ONTOFABRIC, *command], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, on_sigint),
        )  # fmt: skip
        silent.settimeout(60)
        accepted, _ = silent.accept()
        with accepted:
            running.send_signal(stop)
            _, stderr = running.communicate(timeout=30)
    return running.returncode, stderr


@pytest.mark.parametrize(("stop", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_rebuild_interrupted_says_how_to_resume_or_discard(tmp_path: Path, stop: signal.Signals, code: int) -> None:
    """An operator tester's: Ctrl-C ended a rebuild with exit 130 and not a word; a model tester's: SIGTERM (a
    supervisor's stop) ended `reembed` without one. Here it waits on a NATS server that never says hello."""
    # SIGINT as a terminal sends it: see above.
    returncode, stderr = _stopped_waiting_on_nats(tmp_path, ["rebuild", "acme"], stop, signal.SIG_DFL)
    assert returncode == code, stderr
    said = " ".join(stderr.split())
    assert "interrupted:" in said
    assert "run `ontofabric rebuild acme` again to resume, or with --discard" in said
    assert "Traceback" not in stderr


def test_a_compaction_stopped_by_sigterm_in_a_scripts_background_says_nothing_is_lost(tmp_path: Path) -> None:
    """An operator tester's: compact had no SIGTERM handling, and a `cmd &` of a script starts a command with SIGINT
    ignored, where asyncio.run installs no handler of its own: the interrupt was raised in whatever frame the
    signal came to (once swallowed in a weakref's callback, a rebuild going on to swap). Here compact waits on a
    NATS server that never says hello."""
    # SIGINT ignored, as a script's `cmd &` starts it.
    returncode, stderr = _stopped_waiting_on_nats(tmp_path, ["compact", "--yes"], signal.SIGTERM, signal.SIG_IGN)
    assert returncode == 143, stderr
    said = " ".join(stderr.split())
    assert "interrupted: the stream is purged only below what stored snapshots hold" in said
    assert "Traceback" not in stderr


def test_sigterm_without_asyncios_handler_interrupts_between_the_loops_callbacks() -> None:
    """With SIGINT ignored, asyncio.run installs no handler: the interrupt is raised by the loop, between its
    callbacks, not in the frame the signal came to."""
    from ontofabric.services import cli

    reached: list[str] = []

    async def main() -> None:
        cli._raise_terminated(signal.SIGTERM, None)
        reached.append("after the signal")
        await asyncio.sleep(10)
        reached.append("never")

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with pytest.raises(KeyboardInterrupt):
            asyncio.run(main())
    finally:
        signal.signal(signal.SIGINT, previous)
        cli._terminated.clear()
    assert reached == ["after the signal"]


@pytest.mark.slow
def test_up_ingest_query_and_clean_stop(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    # A reranker key, recognisable, to a rerank endpoint that refuses connections: it is used and must never show.
    reranker_key = "RrKeyQ7zX3"
    env = _env(
        ONTOFABRIC_DATA_DIR=str(data_dir), ONTOFABRIC_EMBEDDER="none", ONTOFABRIC_RERANKER="cohere",
        ONTOFABRIC_RERANKER_URL="https://127.0.0.1:9/v2/rerank", ONTOFABRIC_RERANKER_API_KEY=reranker_key,
    )  # fmt: skip
    outputs: list[str] = []
    up = _start_up(env, data_dir)
    try:
        ingest = _ingest_geometry(tmp_path, env)
        assert ingest.returncode == 0, ingest.stderr
        outputs += [ingest.stdout, ingest.stderr]
        assert "2 upserts" in ingest.stdout
        for _ in range(50):  # the query worker learns the new version through its KV watch
            query = subprocess.run(
                [ONTOFABRIC, "query", "the area of a circle from its radius", "--workspace", "geo", "--json"],
                env=env, capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            assert query.returncode == 0, query.stderr
            outputs += [query.stdout, query.stderr]
            reply = json.loads(query.stdout)
            if reply["results"]:
                break
            time.sleep(0.2)
        assert reply["results"][0]["metadata"]["symbolFqn"] == "geometry.circle_area"
        assert reply["_meta"]["degraded"] == ["embedder", "reranker"]  # the key was sent, and the call failed
        assert reply["_meta"]["hybrid"] is False
        # A short query that the keyword list answers to saturation (the function's own name) needs no reranker.
        short = subprocess.run(
            [ONTOFABRIC, "query", "circle area radius", "--workspace", "geo", "--json"], env=env,
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert short.returncode == 0, short.stderr
        outputs += [short.stdout, short.stderr]
        short_meta = json.loads(short.stdout)["_meta"]
        assert (short_meta["skippedRerank"], short_meta["degraded"]) == ("bm25_saturation", ["embedder"])
        # The reply's budget and contents as the contract names them (a tester could not raise the budget here).
        bare = subprocess.run(
            [ONTOFABRIC, "query", "circle area radius", "--workspace", "geo", "--json", "--max-tokens", "20000",
             "--no-content"], env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert bare.returncode == 0, bare.stderr
        bare_reply = json.loads(bare.stdout)
        assert bare_reply["_meta"]["budget"]["maxTokens"] == 20000
        assert bare_reply["results"]
        assert all(r["content"] is None for r in bare_reply["results"])
        unknown = subprocess.run(
            [ONTOFABRIC, "query", "circle", "--workspace", "goe"], env={**env, "COLUMNS": "200"}, capture_output=True,
            text=True, timeout=60, check=False,
        )  # fmt: skip
        assert unknown.returncode == 0, unknown.stderr
        assert "nothing is indexed in workspace 'goe'" in unknown.stdout  # not to be read as "nothing matched"
        typo = subprocess.run(
            [ONTOFABRIC, "query", "circle", "--workspace", "geo", "--branch", "featur"], env={**env, "COLUMNS": "200"},
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert typo.returncode == 0, typo.stderr
        assert "branch 'featur' has nothing of its own indexed: these are main's results" in typo.stdout
        # 12,000 CJK characters are 36 kB as UTF-8: refused for the query's length, not as a 72 kB request.
        wide = subprocess.run(
            [ONTOFABRIC, "query", "検索" * 6_000, "--workspace", "geo", "--json"], env=env, capture_output=True,
            text=True, timeout=60, check=False,
        )  # fmt: skip
        assert "semanticQuery" in wide.stdout + wide.stderr, wide.stdout + wide.stderr
        assert "72," not in wide.stdout + wide.stderr
        # A tenant's own NATS user, added to the running server: it reads geo, and nothing else.
        added = subprocess.run(
            [ONTOFABRIC, "nats-user", "add", "client", "--workspace", "geo"], env=env, capture_output=True,
            text=True, timeout=60, check=False,
        )  # fmt: skip
        assert added.returncode == 0, added.stderr
        tenant = {**env, "ONTOFABRIC_NATS_URL": added.stdout.strip()}
        for workspace, code in (("geo", 0), ("other", 2)):
            asked = subprocess.run(
                [ONTOFABRIC, "query", "circle", "--workspace", workspace, "--json"], env=tenant, capture_output=True,
                text=True, timeout=60, check=False,
            )  # fmt: skip
            assert asked.returncode == code, asked.stderr
        assert "refused" in asked.stderr
        listed = subprocess.run([ONTOFABRIC, "nats-user", "list"], env=env, capture_output=True, text=True, check=True)
        assert "ontofabric~client~geo\tclient\tgeo" in listed.stdout
        revoked = subprocess.run(
            [ONTOFABRIC, "nats-user", "revoke", "ontofabric~client~geo"], env=env, capture_output=True, text=True,
            timeout=60, check=False,
        )  # fmt: skip
        assert revoked.returncode == 0, revoked.stderr
        refused = subprocess.run(
            [ONTOFABRIC, "query", "circle", "--workspace", "geo"], env=tenant, capture_output=True, text=True,
            timeout=60, check=False,
        )  # fmt: skip
        assert refused.returncode == 2
        assert "refused these credentials" in refused.stderr  # at once, not a hang: the server said why
        # One that logs in with an nkey seed: the command prints the two settings, the seed stays in its file.
        added = subprocess.run(
            [ONTOFABRIC, "nats-user", "add", "client", "--workspace", "geo", "--nkey"], env=env, capture_output=True,
            text=True, timeout=60, check=False,
        )  # fmt: skip
        assert added.returncode == 0, added.stderr
        outputs += [added.stdout, added.stderr]
        login = dict(part.split("=", 1) for part in added.stdout.split())
        assert set(login) == {"ONTOFABRIC_NATS_URL", "ONTOFABRIC_NATS_NKEY_SEED"}
        seed = Path(login["ONTOFABRIC_NATS_NKEY_SEED"]).read_text().strip()
        asked = subprocess.run(
            [ONTOFABRIC, "query", "circle", "--workspace", "geo", "--json"], env={**env, **login},
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert asked.returncode == 0, asked.stderr
        rebuild = subprocess.run(
            [ONTOFABRIC, "rebuild", "geo"], env=env, capture_output=True, text=True, timeout=120, check=False
        )
        assert rebuild.returncode == 0, rebuild.stderr
        outputs += [rebuild.stdout, rebuild.stderr]
        assert "rebuilt 'geo': 3 deltas replayed" in rebuild.stdout, rebuild.stdout
        recorded = json.loads((data_dir / "runtime.json").read_text())
        passwords = [password for _, password in recorded["natsLogins"].values()]
        passwords.append(unquote(urlsplit(recorded["databaseUrl"]).password or ""))
        assert all(passwords)
        assert stat.S_IMODE((data_dir / "runtime.json").stat().st_mode) == 0o600
        assert f"main: ontologyVersion {reply['_meta']['ontologyVersion']}" in rebuild.stdout
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        code = up.wait(60)
    assert code == 0
    # Every output of the workers, the commands and the servers, scanned for the secrets they were given.
    assert up.stderr is not None
    up_log = up.stderr.read().decode()
    # stderr is up's JSON-lines log: its "ready" too (a soak found it a banner of six lines wrapped at 80 columns).
    events = [json.loads(line) for line in up_log.splitlines() if line.strip()]
    (ready,) = [event for event in events if event["event"] == "ready"]
    assert ready["credentials"] == str(data_dir / "runtime.json")
    outputs += [up_log, *(path.read_text() for path in data_dir.rglob("*.log"))]
    for secret in [reranker_key, *passwords, seed]:
        assert not [text for text in outputs if secret in text]
    assert not (data_dir / "runtime.json").exists()
    leftovers = subprocess.run(["pgrep", "-f", str(data_dir)], capture_output=True, text=True, check=False)
    assert leftovers.stdout.strip() == "", "embedded servers outlived `ontofabric up`"


@pytest.mark.slow
def test_demo_runs_and_exits_zero() -> None:
    result = subprocess.run([ONTOFABRIC, "demo"], env=_env(), capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("_meta") >= 5
    assert "cacheHit=True" in result.stdout
    assert "lateInteraction weight=0.2 candidates=" in result.stdout  # what ran, as the _meta envelope says
    assert "demo wall time" in result.stdout


@pytest.mark.parametrize(("stop", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_demo_stopped_removes_its_data_directory(stop: signal.Signals, code: int) -> None:
    """A fresh-install tester's: SIGTERM (a supervisor's stop, `timeout`'s) ended the demo before it removed its
    data directory (47 MB, a password file among them); Ctrl-C removed it."""
    demo = subprocess.Popen(
        [ONTOFABRIC, "demo"], env=_env(ONTOFABRIC_EMBEDDER="none", PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal sends it
    )  # fmt: skip
    assert demo.stdout is not None
    try:
        line = demo.stdout.readline()
        found = re.search(r"Fresh data directory (\S+)", line)
        assert found is not None, line
        data_dir = Path(found.group(1))
        time.sleep(3)  # the servers starting
        demo.send_signal(stop)
        _, stderr = demo.communicate(timeout=60)
    finally:
        demo.kill()
    assert demo.returncode == code, stderr
    assert "interrupted: the demo's servers are stopped and its data directory removed" in " ".join(stderr.split())
    assert not data_dir.exists()
    assert "Traceback" not in stderr


def test_settings_piped_at_80_columns_name_every_variable_whole() -> None:
    """A tester's: piped, 80 of 103 names ended in an ellipsis (ONTOFABRIC_NATS_CONNECT…)."""
    shown = subprocess.run(
        [ONTOFABRIC, "settings"], capture_output=True, text=True, env=_env(COLUMNS="80"), check=False, timeout=60
    )
    assert shown.returncode == 0, shown.stderr
    named = set(re.findall(r"\bONTOFABRIC_[A-Z0-9_]+\b", shown.stdout))
    assert named >= {f"ONTOFABRIC_{name.upper()}" for name in Settings.model_fields}
    assert "…" not in shown.stdout
    # A line a setting, its value whole (a configuration tester's URLs were wrapped at 13 columns).
    far = "postgresql://u@" + "a-long-host-name." * 5 + "example:5432/db"
    piped = subprocess.run(
        [ONTOFABRIC, "settings"], capture_output=True, text=True, env=_env(ONTOFABRIC_DATABASE_URL=far), check=True,
        timeout=60,
    )  # fmt: skip
    (line,) = [line for line in piped.stdout.splitlines() if line.startswith("ONTOFABRIC_DATABASE_URL\t")]
    assert line.split("\t")[1] == far
    assert len(piped.stdout.splitlines()) == len(Settings.model_fields)


def test_a_message_piped_is_one_line_however_long(tmp_path: Path) -> None:
    """An operator tester's: into a pipe, rich cut messages at 80 columns, mid-path, which broke grep and scripts."""
    far = tmp_path / ("a-directory-with-a-long-name-" * 3) / "data"
    shown = subprocess.run(
        [ONTOFABRIC, "query", "hello", "--data-dir", str(far)], capture_output=True, text=True, env=_env(), check=False,
        timeout=60,
    )  # fmt: skip
    assert shown.returncode != 0
    (said,) = [line for line in shown.stderr.splitlines() if line.startswith("error:")]
    assert f"(data dir {far})" in said, shown.stderr


def test_readme_settings_table_is_current() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    table = subprocess.run([ONTOFABRIC, "settings", "--markdown"], capture_output=True, text=True, check=True).stdout
    stale = [line for line in table.splitlines() if line not in readme]
    assert stale == [], "README's settings table is stale; paste `ontofabric settings --markdown`"


async def test_a_database_refusing_the_credentials_is_said_without_a_traceback_or_the_password(
    deployment: Deployment,
) -> None:
    """A security tester's `migrate` with a wrong password printed a traceback of 59 lines."""
    wrong = urlsplit(deployment.database_url)._replace(
        netloc=f"postgres:Wr0ngPassw0rd@{urlsplit(deployment.database_url).netloc.rpartition('@')[2]}"
    )
    env = {**deployment.env(), "ONTOFABRIC_DATABASE_URL": urlunsplit(wrong)}
    result = await asyncio.to_thread(
        subprocess.run, [ONTOFABRIC, "migrate"], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    said = " ".join(result.stderr.split())
    assert result.returncode == 2, result.stderr
    assert "PostgreSQL refused the connection (InvalidPasswordError" in said
    assert "Traceback" not in result.stderr
    assert "Wr0ngPassw0rd" not in result.stderr


@pytest.mark.parametrize("command", [["rebuild", "acme"], ["compact", "--yes"], ["dlq", "redrive", "--yes"]])
async def test_an_unreachable_database_is_said_without_a_traceback(
    deployment: Deployment, projector: ProjectorService, command: list[str]
) -> None:
    """Operators' commands read PostgreSQL too: with it away they printed asyncpg's traceback."""
    long = "x" * (deployment.settings.max_content_bytes + 10)  # a dead letter, for redrive to have one
    ack = await deployment.publisher.publish(upsert("acme", document("big", long)))
    await deployment.wait_projected(ack.seq)
    with socket.socket() as probe:  # a port nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**deployment.env(), "ONTOFABRIC_DATABASE_URL": f"postgresql://nobody@127.0.0.1:{port}/none"}
    result = await asyncio.to_thread(
        subprocess.run, [ONTOFABRIC, *command], capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL,
        timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "PostgreSQL could not be reached" in " ".join(result.stderr.split())
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "command",
    [["ingest", ".", "--workspace", "bad ws"], ["ingest", ".", "--workspace", "w", "--branch", "../../etc"],
     ["rebuild", ""], ["query", "x", "--workspace", "a b"], ["dlq", "list", "--workspace", "a/b"]],
)  # fmt: skip
def test_a_workspace_or_branch_that_is_no_valid_name_is_a_usage_error_before_any_work(
    tmp_path: Path, command: list[str]
) -> None:
    """Before, ingest embedded the whole tree and then printed pydantic's traceback; rebuild "" a ValueError's."""
    result = subprocess.run(
        [ONTOFABRIC, *command, "--data-dir", str(tmp_path)], capture_output=True, text=True, env=_env(),
        timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "is not a valid name" in " ".join(result.stderr.split())
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", [["list"], ["purge", "--yes"], ["redrive", "--yes"]])
def test_a_dead_letter_reason_no_projector_gives_is_a_usage_error(tmp_path: Path, command: list[str]) -> None:
    """An operator tester's misspelt reason selected nothing, and purge said it deleted none, exit 0."""
    result = subprocess.run(
        [ONTOFABRIC, "dlq", *command, "--reason", "content_too_larg", "--data-dir", str(tmp_path)],
        capture_output=True, text=True, env=_env(), timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    said = " ".join(result.stderr.replace("│", " ").split())
    assert "'content_too_larg' is no reason a projector gives: one of oversized," in said, said


@pytest.mark.parametrize(
    "option",
    [["--split", "dev"], ["--config", "dense"], ["--sample-queries", "5"], ["--keep-identical-ids"], ["--seed", "3"]],
)
def test_eval_of_a_source_tree_refuses_what_only_a_beir_set_has(tmp_path: Path, option: list[str]) -> None:
    """Before, these were accepted and silently ignored (so was --baseline, which now gates the concept queries)."""
    result = _eval_tree(tmp_path, {"project": "p", "version": "0", "concepts": []}, *option)
    assert result.returncode != 0
    assert option[0] in result.stderr
    assert "source tree" in result.stderr


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (["--exclude", "../elsewhere"], "--exclude '../elsewhere' names no path inside the tree"),
        (["--exclude", "."], "--exclude '.' names no path inside the tree"),
        (["--exclude", "!tests"], "--exclude '!tests' starts with !, which negates a pattern in .gitignore"),
    ],
)
def test_eval_of_a_source_tree_refuses_an_exclusion_that_names_nothing_in_it(
    tmp_path: Path, options: list[str], said: str
) -> None:
    result = _eval_tree(tmp_path, {"project": "p", "version": "0", "concepts": []}, *options)
    assert result.returncode == 2
    assert said in " ".join(result.stderr.split())


def test_eval_of_a_beir_set_refuses_an_exclusion(tmp_path: Path) -> None:
    """--exclude reads a source tree; on a BEIR set it would be ignored."""
    command = [ONTOFABRIC, "eval", str(tmp_path), "--exclude", "tests"]
    result = subprocess.run(command, capture_output=True, text=True, check=False, cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    assert "--exclude applies to a source tree" in " ".join(result.stderr.split())


@pytest.mark.parametrize(
    ("project", "tree_is", "baseline_of", "said"),
    [
        ("p 1", "1", "q 1", "the baseline was measured on q 1 (concept), this run on p 1 (concept)"),  # another project
        ("p 0.0.1", "2.0", "p 0.0.1", "the judgments are of p 0.0.1; the tree is 2.0"),  # another version
    ],
)
def test_eval_of_a_source_tree_gates_only_like_with_like_and_says_so_before_any_work(
    tmp_path: Path, project: str, tree_is: str, baseline_of: str, said: str
) -> None:
    name, version = project.split()
    (tmp_path / "b.json").write_text(json.dumps({"dataset": baseline_of, "split": "concept", "ndcg@10": {}}))
    judgments = {"project": name, "version": version, "concepts": []}
    # The tree's version is read from the distribution installed beside it, as in site-packages.
    installed = tmp_path / "site" / f"p-{tree_is}.dist-info"
    installed.mkdir(parents=True)
    (installed / "METADATA").write_text(f"Metadata-Version: 2.1\nName: p\nVersion: {tree_is}\n")
    (tmp_path / "site" / "p").mkdir()
    result = _eval_tree(tmp_path, judgments, "--baseline", str(tmp_path / "b.json"), tree=tmp_path / "site" / "p")
    assert result.returncode == 2
    assert said in " ".join(result.stderr.split())


def _eval_tree(
    tmp_path: Path, judgments: dict[str, Any], *options: str, tree: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`ontofabric eval` of ``tree`` (``tmp_path``) as a source tree with these judgments: what it refuses before
    any work."""
    (tmp_path / "j.json").write_text(json.dumps(judgments))
    command = [ONTOFABRIC, "eval", str(tree or tmp_path), "--judgments", str(tmp_path / "j.json"), *options]
    return subprocess.run(command, capture_output=True, text=True, check=False, cwd=tmp_path, timeout=60)


def test_a_rebuild_the_database_drops_says_it_can_be_resumed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A red team's finding: PostgreSQL restarted under a rebuild's replay ended it in asyncpg's traceback, not the
    advice to run it again (which resumes)."""
    from typer.testing import CliRunner

    from ontofabric.services import cli
    from ontofabric.services.ops.rebuild import Rebuild

    async def dropped(self: Rebuild) -> None:
        raise asyncpg.InterfaceError("connection is closed")

    monkeypatch.setattr(Rebuild, "run", dropped)
    env = {"ONTOFABRIC_NATS_URL": "nats://127.0.0.1:1", "ONTOFABRIC_DATABASE_URL": "postgresql://127.0.0.1:1/x"}
    result = CliRunner().invoke(cli.app, ["rebuild", "acme", "--data-dir", str(tmp_path)], env=env)
    assert result.exit_code == 2  # as a RebuildFailed
    assert "the rebuild was interrupted: InterfaceError: connection is closed" in " ".join(result.output.split())
    assert "run again to resume" in result.output


def test_a_rebuild_refused_before_any_shadow_was_made_offers_nothing_to_discard(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An independent tester's finding: `rebuild nosuchws` advised --discard, which then found nothing to discard."""
    from typer.testing import CliRunner

    from ontofabric.services import cli
    from ontofabric.services.ops.rebuild import Rebuild
    from ontofabric.services.ops.shadow import RebuildFailed

    async def refused(self: Rebuild) -> None:
        raise RebuildFailed("the stream holds no deltas of workspace 'nosuchws'", resumable=False, shadow=False)

    monkeypatch.setattr(Rebuild, "run", refused)
    env = {"ONTOFABRIC_NATS_URL": "nats://127.0.0.1:1", "ONTOFABRIC_DATABASE_URL": "postgresql://127.0.0.1:1/x"}
    result = CliRunner().invoke(cli.app, ["rebuild", "nosuchws", "--data-dir", str(tmp_path)], env=env)
    assert result.exit_code == 2
    assert "running again will not help as things are" in " ".join(result.output.split())
    assert "--discard" not in result.output


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        ("ONTOFABRIC_SUBJECT_PREFIX", "a.b", "String should match pattern '^[a-z][a-z0-9_-]{0,30}$'"),
        ("ONTOFABRIC_CALIBRATION_DENSE", "abc", "ONTOFABRIC_CALIBRATION_DENSE: not valid JSON"),
        # A tester's: pydantic's union said "at most 3 items" of a list of 4, where 5 are taken too.
        ("ONTOFABRIC_CALIBRATION_HYBRID", "[1, 2, 3, 4]", "HYBRID: 4 numbers: a list of 5 (each signal's weight"),
        ("ONTOFABRIC_RERANKER", "cohere", "error: settings: ONTOFABRIC_RERANKER=cohere needs ONTOFABRIC_RERANKER_URL"),
        ("ONTOFABRIC_KEYWORD_BACKEND", "azure-ai-search", "azure-ai-search needs ONTOFABRIC_AZURE_SEARCH_ENDPOINT"),
        # An independent tester's: a traceback from deep in the driver, at start of every server command.
        ("ONTOFABRIC_DATABASE_URL", "postgresql://u:secret@127.0.0.1:notaport/db", "URL: Port could not be cast"),
        ("ONTOFABRIC_NATS_URL", "nats://127.0.0.1:4222,nats://u:secret@h:99999", "NATS_URL: Port out of range"),
        # A security tester's: a password holding `#` (or `,` in a NATS URL) printed up to it, as the port.
        ("ONTOFABRIC_DATABASE_URL", "postgresql://u:Sec#ret21@h/db", "URL: Port could not be cast to integer value"),
        ("ONTOFABRIC_NATS_URL", "nats://u:Sec,ret18@h:4222", "written %2F, %3F, %23, %40 and %2C"),
        # A review's: a value holding a quote is quoted by urllib with the other kind of quotes.
        ("ONTOFABRIC_DATABASE_URL", "postgresql://u:Sec'r#et@h/db", "URL: Port could not be cast to integer value"),
        # Taken at start, where asyncpg refuses it only when it first connects (a replica's may be much later).
        ("ONTOFABRIC_QUERY_REPLICA_URLS", "garbage", "QUERY_REPLICA_URLS: not a PostgreSQL URL"),
        ("ONTOFABRIC_DATABASE_URL", "host=db user=u password=secret", "DATABASE_URL: not a PostgreSQL URL"),
        # A tester's: taken, then every tool call failed with "cannot convert float infinity to integer".
        ("ONTOFABRIC_GATEWAY_TIMEOUT_S", "inf", "ONTOFABRIC_GATEWAY_TIMEOUT_S: Input should be a finite number"),
        # A configuration tester's: tracebacks at start (PostgreSQL's integer range), from the first connection
        # (the CA file), from the Azure projector (the key), and a worker that hung making its runners.
        ("ONTOFABRIC_STATEMENT_TIMEOUT_MS", "2147483648", "less than or equal to 2147483647"),
        ("ONTOFABRIC_NATS_TLS_CA", "/nonexistent/ca.pem", "no CA certificates (PEM) read (No such file or directory)"),
        ("ONTOFABRIC_AZURE_SEARCH_ENDPOINT", "https://x.search.windows.net", "needs ONTOFABRIC_AZURE_SEARCH_API_KEY"),
        ("ONTOFABRIC_QUERY_CONCURRENCY", "99999999999999999999", "less than or equal to 4096"),
        ("ONTOFABRIC_FUSION_DENSE_UNRELATED_COSINE", "0.7", "UNRELATED_COSINE is over ONTOFABRIC_FUSION_DENSE_TRUSTED"),
        # Operator testers': a value named as a setting ('second-ONTOFABRIC_EMBEDDER'), an origin without its scheme.
        ("ONTOFABRIC_RERANKER", "foo", "'onnx', 'second-embedder' or 'cohere'"),
        ("ONTOFABRIC_GATEWAY_ALLOWED_ORIGINS", "ide.example.com", "ORIGINS: 'ide.example.com' is no origin"),
        # A configuration tester's: taken, then a traceback at the first connection or every query degraded.
        ("ONTOFABRIC_GATEWAY_ALLOWED_ORIGINS", "https://u:secret@ide.example.com", "'https://u:***@ide.example.com'"),
        ("ONTOFABRIC_NATS_URL", "nats://", "ONTOFABRIC_NATS_URL: not a NATS URL"),
        ("ONTOFABRIC_NATS_URL", "http://h:4222", "ONTOFABRIC_NATS_URL: not a NATS URL"),
        ("ONTOFABRIC_EMBEDDING_API_URL", "abc", "ONTOFABRIC_EMBEDDING_API_URL: not an http:// or https:// URL"),
        ("ONTOFABRIC_RERANKER_URL", "abc", "ONTOFABRIC_RERANKER_URL: not an http:// or https:// URL"),
        ("ONTOFABRIC_NATS_TLS_KEY", ONTOFABRIC, "ONTOFABRIC_NATS_TLS_KEY needs ONTOFABRIC_NATS_TLS_CERT"),
        ("ONTOFABRIC_BM25_FULL_READ_POSTINGS", "99999999999999999999", "less than or equal to 1000000000"),
        ("ONTOFABRIC_PROJECTOR_ACK_WAIT_S", "99999999999999999999", "less than or equal to 3600"),
        ("ONTOFABRIC_DELTA_MAX_AGE_DAYS", "0.0000000001", "is shorter than ONTOFABRIC_DEDUPE_WINDOW_S (600 s)"),
        ("ONTOFABRIC_DATA_DIR", "  ", "ONTOFABRIC_DATA_DIR: only whitespace"),
        ("ONTOFABRIC_EMBEDDING_MODEL", "\t", "ONTOFABRIC_EMBEDDING_MODEL: only whitespace"),
    ],
)  # fmt: skip
def test_a_setting_that_is_not_valid_is_named_with_what_is_wrong(variable: str, value: str, said: str) -> None:
    """An operator's review: a pattern's brackets were taken for markup (it printed '^{0,30}$'), and a list setting
    that was not JSON ended in a traceback."""
    result = subprocess.run(
        [ONTOFABRIC, "settings"], capture_output=True, text=True, env=_env(**{variable: value}), check=False, timeout=60
    )
    assert result.returncode == 2
    assert said in " ".join(result.stderr.split())
    assert "Traceback" not in result.stderr
    assert "secret" not in result.stderr.lower()
    assert "'Sec'" not in result.stderr
    assert "Sec'r" not in result.stderr


def test_a_database_url_of_several_hosts_is_a_url_a_connection_can_use() -> None:
    """The review's finding: libpq's and asyncpg's host list (h1:5432,h2:5433) was refused as a port not a number."""
    from ontofabric.shared.settings import Settings

    several = "postgresql://u:p@h1:5432,h2:5433/db"
    assert Settings(database_url=several).database_url == several
    with pytest.raises(ValueError, match="database_url: Port could not be cast"):
        Settings(database_url="postgresql://u:p@h1:5432,h2:x/db")


def test_zero_means_no_limit_for_both_stream_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A review: ONTOFABRIC_DEAD_LETTERS_PER_WORKSPACE=0 meant no limit, ONTOFABRIC_DELTA_STREAM_MAX_BYTES=0 was
    refused."""
    from ontofabric.shared.settings import Settings

    monkeypatch.setenv("ONTOFABRIC_DELTA_STREAM_MAX_BYTES", "0")
    monkeypatch.setenv("ONTOFABRIC_DEAD_LETTERS_PER_WORKSPACE", "0")
    unbounded = Settings()
    assert (unbounded.delta_stream_max_bytes, unbounded.dead_letters_per_workspace) == (None, 0)
    monkeypatch.setenv("ONTOFABRIC_DELTA_STREAM_MAX_BYTES", "1024")
    with pytest.raises(ValueError, match="greater than or equal to 1048576"):
        Settings()


def test_an_empty_variable_is_a_setting_left_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """A configuration tester's `ONTOFABRIC_DATABASE_URL=` (as compose files write it) went to 127.0.0.1:5432
    instead of the embedded server, and an empty ONTOFABRIC_NATS_URL lost runtime.json's login."""
    from ontofabric.shared.settings import Settings

    monkeypatch.setenv("ONTOFABRIC_DATABASE_URL", "")
    monkeypatch.setenv("ONTOFABRIC_NATS_URL", "")
    monkeypatch.setenv("ONTOFABRIC_QUERY_CONCURRENCY", "")
    settings = Settings()
    assert (settings.database_url, settings.nats_url, settings.query_concurrency) == (None, None, 8)


def test_a_misspelt_setting_is_named_not_ignored_silently(tmp_path: Path) -> None:
    """An operator's review: ONTOFABRIC_DATABSE_URL was ignored without a word, and the embedded server used."""
    env = _env(ONTOFABRIC_DATABSE_URL="postgresql://127.0.0.1:1/x", ONTOFABRIC_IMAGE_EXTRAS="otlp")
    shown = subprocess.run([ONTOFABRIC, "settings"], capture_output=True, text=True, env=env, check=True, timeout=60)
    said = " ".join(shown.stderr.split())
    assert "ONTOFABRIC_DATABSE_URL is set but is no setting; ignored (did you mean ONTOFABRIC_DATABASE_URL?)" in said
    assert "IMAGE_EXTRAS" not in said  # ours, for the container image's build

    env["ONTOFABRIC_DATABASE_URL"] = "postgresql://127.0.0.1:1/x"  # refused at once: migrate ends quickly
    logged = subprocess.run(
        [ONTOFABRIC, "migrate", "--data-dir", str(tmp_path)], capture_output=True, text=True, env=env, check=False,
        timeout=120,
    )  # fmt: skip
    (warning,) = [json.loads(line) for line in logged.stderr.splitlines() if "unknown_setting" in line]
    assert warning["variable"] == "ONTOFABRIC_DATABSE_URL"
    assert warning["did_you_mean"] == "ONTOFABRIC_DATABASE_URL"


def test_a_data_directory_that_is_a_file_is_said_without_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "data").write_text("not a directory")
    result = subprocess.run(
        [ONTOFABRIC, "up", "--data-dir", str(tmp_path / "data")], capture_output=True, text=True, env=_env(),
        check=False, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert "data: cannot be a directory (File exists)" in " ".join(result.stderr.split())
    assert "Traceback" not in result.stderr


def test_a_metrics_port_already_taken_is_said_without_a_traceback(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = _env(ONTOFABRIC_METRICS_PORT=str(port), ONTOFABRIC_METRICS_HOST="127.0.0.1")
        result = subprocess.run(
            [ONTOFABRIC, "query-worker", "--data-dir", str(tmp_path)], capture_output=True, text=True, env=env,
            check=False, timeout=120,
        )  # fmt: skip
    assert result.returncode == 2
    assert f"127.0.0.1:{port} cannot be served" in " ".join(result.stderr.split())
    assert "Traceback" not in result.stderr


async def test_migrate_needs_the_database_alone(deployment: Deployment) -> None:
    """docs/security.md has a deployment migrate before any other part runs: it refused without a NATS URL."""
    env = {k: v for k, v in deployment.env().items() if k != "ONTOFABRIC_NATS_URL"}
    result = await asyncio.to_thread(
        subprocess.run, [ONTOFABRIC, "migrate"], capture_output=True, text=True, env=env, check=False, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "applied" in result.stdout


def test_a_server_older_than_the_migrations_need_is_said_before_any_runs() -> None:
    """A review's: on PostgreSQL 17 migration 0036 failed with "function casefold does not exist"."""
    from ontofabric.shared.db import unsupported_server

    assert unsupported_server(170005) == "PostgreSQL 18 or later is needed; this server is PostgreSQL 17"
    assert unsupported_server(180004) is None
    assert unsupported_server(190000) is None


async def test_a_database_a_newer_release_migrated_is_said_to_be_so(deployment: Deployment) -> None:
    """An upgrade tester's old release started on a newer schema without a word (its ingest later failed with a
    traceback). Not refused: going back a release is a way out of a bad upgrade, and migrations only add."""
    await migrate(deployment.database_url, deployment.settings)
    await deployment.fetch("INSERT INTO schema_migrations (version, name) VALUES (9999, '9999_newer.sql')")
    try:
        with capture_logs() as logged:
            assert await migrate(deployment.database_url, deployment.settings) == []
    finally:
        await deployment.fetch("DELETE FROM schema_migrations WHERE version = 9999")
    (said,) = [entry for entry in logged if entry["event"] == "database_of_a_newer_release"]
    assert said["unknown_migrations"] == [9999]


async def test_a_fresh_databases_migrations_are_logged_in_one_line_too(deployment: Deployment) -> None:
    """A fresh-install tester's: the log's limit of 20 lines an event in 10 s kept 20 of 33 `migration_applied`
    lines, and nothing said the rest were applied."""
    try:
        with capture_logs() as logged:
            done = await migrate(deployment.database_url, deployment.settings, schema="fresh_probe")
        (said,) = [entry for entry in logged if entry["event"] == "migrations_applied"]
        assert (said["count"], said["first"], said["last"]) == (len(done), done[0], done[-1])
        assert len(done) > LOG_LINES_PER_WINDOW
    finally:
        await deployment.fetch("DROP SCHEMA IF EXISTS fresh_probe CASCADE")


async def test_a_failing_migration_is_said_with_those_applied_before_it(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one line for all was not written when a later migration failed: nothing said which had been applied."""
    known = db.migrations()
    broken = Migration(version=known[-1].version + 1, name="9999_broken.sql", sql="SELECT no_such_column FROM nowhere")
    monkeypatch.setattr(db, "migrations", lambda: [*known, broken])
    try:
        with capture_logs() as logged, pytest.raises(asyncpg.UndefinedTableError):
            await migrate(deployment.database_url, deployment.settings, schema="broken_probe")
        (said,) = [entry for entry in logged if entry["event"] == "migration_failed"]
        assert said["migration"] == "9999_broken.sql"
        assert (said["applied_this_run"], said["applied_in_all"]) == (len(known), len(known))
        assert said["last_applied"] == known[-1].name
        assert "nowhere" in said["error"]
        assert broken.version not in {
            row["version"] for row in await deployment.fetch("SELECT version FROM broken_probe.schema_migrations")
        }
    finally:
        await deployment.fetch("DROP SCHEMA IF EXISTS broken_probe CASCADE")


def test_contracts_write_refuses_an_installed_copy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An independent tester's finding: in a wheel install it rewrote the schemas inside site-packages."""
    from typer.testing import CliRunner

    from ontofabric.contracts import schema
    from ontofabric.services import cli

    installed = tmp_path / "site-packages" / "ontofabric" / "contracts" / "schemas"
    installed.mkdir(parents=True)
    monkeypatch.setattr(schema, "SCHEMA_DIR", installed)
    result = CliRunner().invoke(cli.app, ["contracts", "--write"])
    assert result.exit_code == 2
    assert "is an installed copy" in " ".join(result.output.split())
    assert list(installed.iterdir()) == []


def test_an_http_gateway_on_a_port_in_use_says_so_in_a_line(tmp_path: Path) -> None:
    """An independent tester's finding: uvicorn's own 'ERROR: [Errno 98]' line, not JSON, and exit 3."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = subprocess.run(
            [ONTOFABRIC, "mcp", "--http", f"127.0.0.1:{port}", "--data-dir", str(tmp_path)],
            capture_output=True, text=True, env=_env(), timeout=60, check=False,
        )  # fmt: skip
    assert result.returncode == 2
    assert f"the gateway cannot listen on 127.0.0.1:{port}" in " ".join(result.stderr.split())
    assert "Traceback" not in result.stderr


def test_ingest_refuses_a_path_that_is_no_directory(tmp_path: Path) -> None:
    """An ingest tester's pipe named fifo.py, passed as PATH, was read as an empty tree: with --allow-empty, it would
    have emptied the branch."""
    from typer.testing import CliRunner

    from ontofabric.services import cli

    pipe = tmp_path / "fifo.py"
    os.mkfifo(pipe)
    result = CliRunner().invoke(
        cli.app, ["ingest", str(pipe), "--workspace", "acme", "--allow-empty"], env={"COLUMNS": "300"}
    )
    assert result.exit_code == 2
    assert "is not a directory" in result.output


async def test_adopt_stream_empties_the_index_and_the_running_projector_fills_it_again(
    deployment: Deployment, projector: ProjectorService
) -> None:
    acks = await deployment.publisher.publish_many([upsert("acme", document(f"d{n}", f"text {n}")) for n in range(5)])
    await deployment.wait_projected(acks[-1].seq)
    before = await deployment.fetch("SELECT id, content, stream_seq FROM documents ORDER BY id")

    def adopt(*args: str) -> subprocess.CompletedProcess[str]:
        command = [ONTOFABRIC, "adopt-stream", *args]
        return subprocess.run(
            command, env=deployment.env(), input="n\n", capture_output=True, text=True, check=False, timeout=60
        )

    declined = await asyncio.to_thread(adopt)
    assert declined.returncode == 1
    assert await deployment.fetch("SELECT id, content, stream_seq FROM documents ORDER BY id") == before  # untouched
    adopted = await asyncio.to_thread(adopt, "--yes")
    assert adopted.returncode == 0, adopted.stderr
    said = " ".join(adopted.stdout.split())
    assert "emptied the index on 1 database(s) (5 documents)" in said
    assert f"sequences 1..{acks[-1].seq}" in said
    assert "no Postgres projector answers" not in adopted.stderr  # the fixture's answers discovery
    async with asyncio.timeout(30):  # the running projector claims again and fills the index from the stream
        while await deployment.fetch("SELECT id, content, stream_seq FROM documents ORDER BY id") != before:
            await asyncio.sleep(0.2)
    later = await deployment.publisher.publish(upsert("acme", document("d0", "text 0, later")))
    await deployment.wait_projected(later.seq)
    assert (await deployment.fetch("SELECT content FROM documents WHERE id = 'd0'"))[0]["content"] == "text 0, later"


async def test_an_ingest_that_cannot_read_its_dead_letters_says_so_and_exits_1(
    deployment: Deployment, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fault tester's ingest printed its success, then NATS stopped before it had read its dead letters, and it
    ended in a FlushTimeoutError traceback."""
    import typer

    from ontofabric.services.cli import _dead_letters_in
    from ontofabric.shared.jetstream import connect

    nc = await connect(deployment.nats_url, "test-gone")
    await nc.close()
    with pytest.raises(typer.Exit) as exited:
        await _dead_letters_in(nc)
    assert exited.value.exit_code == 1
    said = " ".join(capsys.readouterr().err.split())
    assert "whether a projector set any aside could not be read: NATS went away" in said


@pytest.mark.parametrize("value", ["2", "-0.1"])
def test_a_min_relevance_outside_the_contract_is_a_usage_error(value: str) -> None:
    """An operator tester's: `--min-relevance 2` went to a worker, which refused it (exit 1), where `--top-k 0` is a
    usage error before anything is sent (exit 2); the contract bounds both."""
    from typer.testing import CliRunner

    from ontofabric.services import cli

    result = CliRunner().invoke(cli.app, ["query", "x", "--min-relevance", value])
    assert result.exit_code == 2, result.output
    assert "--min-relevance" in result.output
