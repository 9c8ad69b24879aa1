"""structlog set-up: JSON lines on stderr with trace ids; stdlib loggers (nats, transformers) go the same way."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, MutableMapping
from typing import Any, cast

import structlog
from opentelemetry import trace


def _add_trace_ids(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        event["trace_id"] = f"{context.trace_id:032x}"
        event["span_id"] = f"{context.span_id:016x}"
    return event


LOG_WINDOW_S = 10.0
LOG_LINES_PER_WINDOW = 20


class RateLimited(logging.Filter):
    """At most ``per_window`` lines of one cause per ``window_s``; the first line after a window that dropped some
    says how many (``suppressed``). A cause is the logger, the event, the part and the error's type: a database
    outage under load logs what failed, not the same warning for every request. A filter on the handler, so that
    it sees our structlog events and other libraries' log calls alike (and drops a line without raising into the
    code that logged it)."""

    def __init__(
        self,
        per_window: int = LOG_LINES_PER_WINDOW,
        window_s: float = LOG_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self._per_window = per_window
        self._window_s = window_s
        self._clock = clock
        self._windows: dict[tuple[str, ...], tuple[float, int, int]] = {}
        """cause -> (window start, lines let through in it, lines dropped since the last one let through)"""

    def filter(self, record: logging.LogRecord) -> bool:
        event = record.msg if isinstance(record.msg, dict) else {"event": str(record.msg)}
        error = str(event.get("error", "")).split(":", 1)[0]
        cause = (record.name, *(str(event.get(k, ""))[:80] for k in ("event", "part")), error[:80])
        now = self._clock()
        started, passed, dropped = self._windows.get(cause, (now, 0, 0))
        if now - started >= self._window_s:
            started, passed = now, 0
        if passed >= self._per_window:
            self._windows[cause] = (started, passed, dropped + 1)
            return False
        if dropped:
            if isinstance(record.msg, dict):
                record.msg["suppressed"] = dropped
            else:
                record.msg = f"{record.msg} ({dropped} more like it suppressed)"
        self._windows[cause] = (started, passed + 1, 0)
        if len(self._windows) > 10_000:  # causes are few; a flood of distinct ones must not grow this for ever
            self._windows.clear()
        return True


def _library_warning_without_traceback(_: Any, level: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Another library's warning states its error in a line: asyncpg's pool, while its database did not answer,
    logged a 34-line traceback every 40 s (an ops tester's). Errors, and any line at DEBUG, keep theirs."""
    exc_info = event.get("exc_info")
    if level == "warning" and isinstance(exc_info, tuple) and isinstance(exc_info[1], BaseException):
        del event["exc_info"]
        event.setdefault("error", describe(exc_info[1]))
    return event


def configure_logging(level: str = "INFO", fmt: str = "json") -> None:
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_trace_ids,
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared if level == "DEBUG" else [*shared, _library_warning_without_traceback],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    handler.addFilter(RateLimited())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # Library chatter stays at WARNING unless we are debugging (the MCP SDK's info lines hold session ids, and one
    # comes for each request naming an unknown session: a review's).
    for noisy in ("nats", "asyncio", "sentence_transformers", "transformers", "httpx", "mcp"):
        logging.getLogger(noisy).setLevel(level if level == "DEBUG" else "WARNING")
    _no_library_progress_bars()


def _no_library_progress_bars() -> None:
    """transformers draws a progress bar on stderr while it loads a model's weights: in JSON-lines logs that is a
    line no log reader can parse. Our own commands draw the progress bars that matter. An operator who wants the
    library's back sets HF_HUB_DISABLE_PROGRESS_BARS=0."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read when huggingface_hub is imported
    wanted = os.environ["HF_HUB_DISABLE_PROGRESS_BARS"].strip().lower() in ("0", "false", "no", "off")
    if not wanted and "transformers" in sys.modules:  # imported already
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


def describe(error: BaseException) -> str:
    """An error as logs, dead letters and replies state it: its type, then its message."""
    return f"{type(error).__name__}: {error}"


_UNCONFIGURED_PROCESSORS: list[Any] = [
    structlog.stdlib.filter_by_level,
    structlog.stdlib.add_log_level,
    structlog.dev.ConsoleRenderer(colors=False),
]


class _UntilConfigured:
    """A logger that logs as structlog is configured (:func:`configure_logging`, or an application's own set-up)
    and, until it is, through the standard library's logging: the application's handlers, or logging's last resort
    (warnings and worse, on stderr). structlog's own default printed every line on stdout, which a host speaking a
    protocol there (a stdio MCP server) cannot take (a tester's application embedding the query client). Nothing
    is configured for the process: an application logging with structlog's defaults keeps them (a review's)."""

    __slots__ = ("_configured", "_name", "_unconfigured")

    def __init__(self, name: str) -> None:
        self._name = name
        self._configured: Any = None
        self._unconfigured: Any = None

    def _target(self) -> Any:
        if structlog.is_configured():
            if self._configured is None:
                self._configured = structlog.stdlib.get_logger(self._name)
            return self._configured
        if self._unconfigured is None:
            self._unconfigured = structlog.wrap_logger(
                logging.getLogger(self._name),
                processors=_UNCONFIGURED_PROCESSORS,
                wrapper_class=structlog.stdlib.BoundLogger,
            )
        return self._unconfigured

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._target(), attribute)


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return cast(structlog.stdlib.BoundLogger, _UntilConfigured(name))
