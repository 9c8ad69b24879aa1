"""Log lines are rate-limited per cause, and say how many of a cause were left out."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from ontofabric.shared.logging import RateLimited


def _record(message: object, logger: str = "ontofabric.services.query.run") -> logging.LogRecord:
    return logging.LogRecord(logger, logging.WARNING, __file__, 1, message, None, None)


def _passes(limiter: RateLimited, **fields: str) -> dict[str, object] | None:
    record = _record({"event": "part_failed", **fields})
    return record.msg if limiter.filter(record) else None  # type: ignore[return-value]


def test_one_cause_logs_a_bounded_number_of_lines_per_window_and_counts_the_rest() -> None:
    now = [0.0]
    limiter = RateLimited(per_window=3, window_s=10.0, clock=lambda: now[0])
    outage = {"part": "keyword", "error": "TimeoutError: "}
    assert [_passes(limiter, **outage) is not None for _ in range(5)] == [True, True, True, False, False]
    # Another cause is not held back by the first one's flood.
    assert _passes(limiter, part="dense", error="TimeoutError: ") is not None
    assert _passes(limiter, part="keyword", error="ConnectionError: refused") is not None
    now[0] = 10.0  # the next window: the first line says what was left out
    first = _passes(limiter, **{**outage, "error": "TimeoutError: later"})
    assert first is not None
    assert first["suppressed"] == 2
    again = _passes(limiter, **outage)
    assert again is not None
    assert "suppressed" not in again


@pytest.mark.parametrize("size", [600, 2000])
def test_another_librarys_lines_are_limited_too_by_their_start(size: int) -> None:
    now = [0.0]
    limiter = RateLimited(per_window=1, window_s=10.0, clock=lambda: now[0])
    logger = "opentelemetry.trace.propagation.tracecontext"
    line = f"traceparent header exceeded the maximum length of 512 characters {'x' * size}"
    assert limiter.filter(_record(line, logger))
    assert not limiter.filter(_record(line + " again", logger))
    now[0] = 20.0
    record = _record(line, logger)
    assert limiter.filter(record)
    assert str(record.msg).endswith("(1 more like it suppressed)")


def test_a_dropped_line_raises_nothing_into_the_code_that_logged_it(caplog: pytest.LogCaptureFixture) -> None:
    # A limiter that raised (structlog's DropEvent is a BaseException) once ended a query worker's runner.
    handler = logging.StreamHandler()
    handler.addFilter(RateLimited(per_window=1))
    logger = logging.getLogger("ontofabric.tests.flood")
    logger.addHandler(handler)
    try:
        for _ in range(50):
            logger.warning("the same line")
    finally:
        logger.removeHandler(handler)


@pytest.mark.parametrize(("transformers_first", "level"), [(False, "INFO"), (True, "INFO"), (False, "DEBUG")])
def test_loading_the_model_writes_only_json_lines(transformers_first: bool, level: str) -> None:
    """An operator's finding: transformers drew a "Loading weights" progress bar into the workers' JSON-lines log.
    Whether transformers was imported before logging was configured or after. At DEBUG, sentence-transformers drew
    its "Batches" bar for every document embedded (an independent tester's finding)."""
    script = (
        ("import transformers\n" if transformers_first else "")
        + "from ontofabric.shared.logging import configure_logging\n"
        "from ontofabric.shared.settings import Settings\n"
        f"configure_logging({level!r}, 'json')\n"
        "from ontofabric.shared.embedder import load_embedder\n"
        "load_embedder(Settings()).embed_documents(['def f(): pass'])\n"
        "import logging; logging.getLogger('ontofabric.test').warning('loaded')\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "ONTOFABRIC_"))}
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert ran.returncode == 0, ran.stderr
    lines = [line for line in ran.stderr.replace("\r", "\n").splitlines() if line.strip()]
    assert lines  # the warning at least
    for line in lines:
        json.loads(line)


@pytest.mark.parametrize(("level", "traceback_kept"), [("INFO", False), ("DEBUG", True)])
def test_another_librarys_warning_states_its_error_in_a_line(level: str, traceback_kept: bool) -> None:
    """An ops tester's: asyncpg's pool logged a 34-line traceback every 40 s while its database did not answer.
    Its errors, and every line at DEBUG, keep theirs."""
    script = (
        "import logging\n"
        "from ontofabric.shared.logging import configure_logging\n"
        f"configure_logging({level!r}, 'json')\n"
        "log = logging.getLogger('asyncpg.pool')\n"
        "try:\n"
        "    raise TimeoutError('the database did not answer')\n"
        "except TimeoutError:\n"
        "    log.warning('Failed to restore the pool connection floor; retrying', exc_info=True)\n"
        "    log.error('gave up', exc_info=True)\n"
    )
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    warning, error = (json.loads(line) for line in ran.stderr.splitlines())
    assert ("exception" in warning) is traceback_kept
    if not traceback_kept:
        assert warning["error"] == "TimeoutError: the database did not answer"
    assert "Traceback" in error["exception"]


def test_an_application_that_set_up_no_logging_gets_no_line_on_its_stdout() -> None:
    """A tester's application embedding the query client had 208 of the client's info lines on its stdout, where a
    host speaking a protocol (a stdio MCP server) would have been corrupted: warnings go to stderr, as the standard
    library's logging does with no handler, and information lines nowhere."""
    script = (
        "import structlog\n"
        "from ontofabric.services.query.client import QueryClient\n"
        "from ontofabric.shared.logging import get_logger\n"
        "get_logger('ontofabric.services.query.client').info('query_request_resent', sends=2)\n"
        "get_logger('ontofabric.services.query.client').warning('query_clocks_disagree', read_as='x')\n"
        "structlog.get_logger().info('the_applications_own')\n"
    )
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    # The application's own structlog lines as structlog's defaults print them: nothing was configured for it (a
    # review's: the first mend configured structlog for the whole process, and the application's line was gone).
    assert "query_request_resent" not in ran.stdout
    assert "the_applications_own" in ran.stdout
    assert "query_clocks_disagree" in ran.stderr
    assert "query_request_resent" not in ran.stderr


def test_a_line_logged_inside_a_span_carries_its_trace_and_span_ids() -> None:
    """A JSON line names the trace it was logged in, so that a log search finds a request's lines from its trace
    (DESIGN.md, observability); outside any span it names none."""
    script = (
        "from opentelemetry import trace\n"
        "from opentelemetry.sdk.trace import TracerProvider\n"
        "from ontofabric.shared.logging import configure_logging, get_logger\n"
        "configure_logging('INFO', 'json')\n"
        "trace.set_tracer_provider(TracerProvider())\n"
        "log = get_logger('ontofabric.test')\n"
        "log.warning('outside')\n"
        "with trace.get_tracer('test').start_as_current_span('request') as span:\n"
        "    log.warning('inside')\n"
        "    context = span.get_span_context()\n"
        "    print(f'{context.trace_id:032x} {context.span_id:016x}')\n"
    )
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    trace_id, span_id = ran.stdout.split()
    outside, inside = (json.loads(line) for line in ran.stderr.splitlines())
    assert "trace_id" not in outside
    assert (inside["event"], inside["trace_id"], inside["span_id"]) == ("inside", trace_id, span_id)
