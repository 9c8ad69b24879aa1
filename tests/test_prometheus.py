"""The alert rules under promtool's unit tests, and a real Prometheus scraping a query worker's metrics endpoint,
evaluating the rules and the Grafana dashboard's queries.

Both need Debian's `prometheus` package (`promtool`, `prometheus`); .ci/run installs it and sets
ONTOFABRIC_TEST_REQUIRE_TOOLS so that CI fails rather than skips without it."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from ontofabric.services.query.client import QueryClient
from ontofabric.shared.runtime import free_port
from ontofabric.shared.telemetry import OTLP_TIMEOUT_S, otlp_timeout_s

from .conftest import Deployment, answered_once_up

RULES = Path(__file__).parent.parent / "infra" / "prometheus"
DASHBOARD = Path(__file__).parent.parent / "infra" / "grafana" / "dashboards" / "ontofabric.json"
ONTOFABRIC = str(Path(sys.executable).parent / "ontofabric")


def _binary(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        if os.environ.get("ONTOFABRIC_TEST_REQUIRE_TOOLS"):
            pytest.fail(f"{name} is missing (apt-get install prometheus)")
        pytest.skip(f"{name} is not installed (apt-get install prometheus)")
    return found


def test_the_rules_are_valid_and_their_unit_tests_pass() -> None:
    promtool = _binary("promtool")
    checked = subprocess.run([promtool, "check", "rules", "rules.yml"], cwd=RULES, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run([promtool, "test", "rules", "rules_test.yml"], cwd=RULES, capture_output=True, text=True)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def _ask(port: int, path: str, **params: str) -> Any:
    url = f"http://127.0.0.1:{port}{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)["data"]


@pytest.mark.servers
async def test_a_real_prometheus_scrapes_a_query_worker_and_evaluates_the_rules(
    deployment: Deployment, tmp_path: Path
) -> None:
    prometheus = _binary("prometheus")
    metrics_port, web_port = free_port(), free_port()
    env = deployment.env() | {
        "ONTOFABRIC_NATS_URL": deployment.nats_url_as("query"),
        "ONTOFABRIC_METRICS_PORT": str(metrics_port),
        "ONTOFABRIC_LOG_LEVEL": "WARNING",
    }
    worker = await asyncio.create_subprocess_exec(ONTOFABRIC, "query-worker", env=env)
    config = tmp_path / "prometheus.yml"
    config.write_text(
        json.dumps(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(RULES / "rules.yml")],
                "scrape_configs": [
                    {"job_name": "ontofabric-query", "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]}
                ],
            }
        )
    )
    server = await asyncio.create_subprocess_exec(
        prometheus,
        f"--config.file={config}",
        f"--storage.tsdb.path={tmp_path / 'data'}",
        f"--web.listen-address=127.0.0.1:{web_port}",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        client = QueryClient(deployment.nc, deployment.names, timeout_s=5)
        await answered_once_up(client, "acme", {"semanticQuery": "anything"}, 90)
        series = "retrieval_query_duration_ms_milliseconds_count"
        async with asyncio.timeout(60):  # scraped
            while not (found := (await asyncio.to_thread(_ask, web_port, "/api/v1/query", query=series))["result"]):
                await asyncio.sleep(0.5)
        assert found[0]["metric"]["shape"] == "concept"
        assert found[0]["metric"]["job"] == "ontofabric-query"
        # Counted from 0 at start: a first burst of errors or degraded answers is an increase Prometheus sees (an ops
        # tester's 88 refusals were a series born at 58 and 30, and no rate).
        for seeded in (
            'retrieval_query_errors_total{code="overloaded",request="query",timeout=""}',
            'retrieval_degraded_total{sink="reranker"}',
        ):
            (sample,) = (await asyncio.to_thread(_ask, web_port, "/api/v1/query", query=seeded))["result"]
            assert sample["value"][1] == "0", seeded
        up = await asyncio.to_thread(_ask, web_port, "/api/v1/query", query="up")
        assert [sample["value"][1] for sample in up["result"]] == ["1"]
        # What the dead-letter rule reads a new process by, under the target's own labels.
        started = await asyncio.to_thread(_ask, web_port, "/api/v1/query", query="process_start_time_seconds")
        assert [sample["metric"]["job"] for sample in started["result"]] == ["ontofabric-query"]
        # What OntofabricNatsUnreachable reads: the worker's connection, up.
        connected = await asyncio.to_thread(_ask, web_port, "/api/v1/query", query="nats_connected")
        assert [sample["value"][1] for sample in connected["result"]] == ["1"], connected
        async with asyncio.timeout(30):  # every rule evaluated, none failing
            while True:
                groups = (await asyncio.to_thread(_ask, web_port, "/api/v1/rules"))["groups"]
                rules = [rule for group in groups for rule in group["rules"]]
                if rules and all(rule.get("lastEvaluation", "").startswith("2") for rule in rules):
                    break
                await asyncio.sleep(0.5)
        assert {group["name"] for group in groups} == {"ontofabric-recording", "ontofabric-alerts"}
        assert all(rule["health"] == "ok" for rule in rules), [r for r in rules if r["health"] != "ok"]
        # Every query of the Grafana dashboard is one this Prometheus runs; the latency panel shows the query.
        dashboard = json.loads(DASHBOARD.read_text())
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                await asyncio.to_thread(_ask, web_port, "/api/v1/query", query=target["expr"])  # raises on an error
        latency = dashboard["panels"][0]["targets"][0]["expr"]
        async with asyncio.timeout(30):
            while not (await asyncio.to_thread(_ask, web_port, "/api/v1/query", query=latency))["result"]:
                await asyncio.sleep(0.5)
    finally:
        for process in (server, worker):
            process.terminate()
            await process.wait()


def test_the_cache_gauges_are_exported_only_by_a_process_holding_a_cache() -> None:
    """An SRE's: the CLI, an ingest and the gateway each exported both cache gauges at 0, as if they held a cache."""
    script = (
        "from opentelemetry.sdk.metrics.export import InMemoryMetricReader\n"
        "from ontofabric.shared.telemetry import configure_telemetry\n"
        "reader = InMemoryMetricReader()\n"
        "configure_telemetry('probe', extra_readers=(reader,), trace_clients=False)\n"
        "from ontofabric.services.query.cache import metered\n"
        "from ontofabric.shared.lru import LruCache\n"
        "def names():\n"
        "    data = reader.get_metrics_data()\n"
        "    return sorted(m.name for r in (data.resource_metrics if data else []) for s in r.scope_metrics"
        " for m in s.metrics)\n"
        "print(names())\n"
        "cache = metered(LruCache(10, 1000, len))\n"
        "print(names())\n"
    )
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert ran.returncode == 0, ran.stderr
    before, after = ran.stdout.splitlines()
    assert "retrieval.cache" not in before
    assert "'retrieval.cache.bytes', 'retrieval.cache.entries'" in after


def test_an_otlp_export_waits_briefly_unless_the_standard_variables_say_otherwise() -> None:
    """An operator tester's collector away: every one-shot command waited 9-11 s at exit for the exporter's own
    10 s (traces and metrics each), and a stopping `up` 20 s, past a container's grace."""
    assert otlp_timeout_s({}) == OTLP_TIMEOUT_S <= 2.0
    assert otlp_timeout_s({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}) == OTLP_TIMEOUT_S
    assert otlp_timeout_s({"OTEL_EXPORTER_OTLP_TIMEOUT": "10"}) is None  # the exporter reads it itself
    assert otlp_timeout_s({"OTEL_EXPORTER_OTLP_TIMEOUT": "10"}, "METRICS") is None
    # One signal's own: the other keeps the short one (a review's: the traces' left the metrics' at 10 s).
    traces_only = {"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "5"}
    assert (otlp_timeout_s(traces_only), otlp_timeout_s(traces_only, "METRICS")) == (None, OTLP_TIMEOUT_S)
