"""OpenTelemetry meters and tracer.

Instruments are created from the global providers; :func:`configure_telemetry` installs real providers and, when
``OTEL_EXPORTER_OTLP_ENDPOINT`` is set and the ``otlp`` extra is installed, OTLP exporters. Without it the
instruments still record (tests read them with an in-memory reader).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache

from opentelemetry import metrics, trace
from opentelemetry.instrumentation.utils import suppress_instrumentation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from .logging import get_logger

log = get_logger(__name__)

_configured = False


def configure_telemetry(
    service_name: str,
    extra_readers: tuple[MetricReader, ...] = (),
    extra_spans: tuple[SpanProcessor, ...] = (),
    metrics_address: tuple[str, int] | None = None,
    trace_clients: bool = True,
) -> None:
    """Install SDK providers once per process (tests pass in-memory readers and span processors).
    ``metrics_address``: (host, port) where Prometheus scrapes this process's metrics, at ``/metrics``.
    ``trace_clients``: a span for each database statement (asyncpg) and outgoing HTTP request (httpx)."""
    global _configured
    if _configured:
        return
    _configured = True
    resource = Resource.create({"service.name": service_name})
    readers: list[MetricReader] = list(extra_readers)
    if metrics_address is not None:
        readers.append(serve_prometheus(*metrics_address))
    tracer_provider = TracerProvider(resource=resource)
    for processor in extra_spans:
        tracer_provider.add_span_processor(processor)
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        try:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            # By the package: `ontofabric[otlp]` names another project to a registry when installed from a path.
            log.warning("otlp_exporter_missing", hint="pip install opentelemetry-exporter-otlp-proto-http")
        else:
            metrics_timeout_s = otlp_timeout_s(os.environ, "METRICS")
            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(timeout=metrics_timeout_s)))
            tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(timeout=otlp_timeout_s(os.environ))))
    metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=readers))
    trace.set_tracer_provider(tracer_provider)
    if trace_clients:
        from opentelemetry.instrumentation.asyncpg import AsyncPGInstrumentor
        from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor

        AsyncPGInstrumentor().instrument()  # type: ignore[no-untyped-call]
        HTTPXClientInstrumentor().instrument()


OTLP_TIMEOUT_S = 2.0
"""How long one export to the OTLP collector may take (retries included) unless OTEL_EXPORTER_OTLP_TIMEOUT says: the
exporter's own 10 s, waited at exit for traces and metrics each, made every one-shot command 9-11 s longer and a
stopping `up` 20 s while the collector was away (an operator tester's), past a container's 10 s grace."""


def otlp_timeout_s(environ: Mapping[str, str], signal: str = "TRACES") -> float | None:
    """An OTLP exporter's timeout for ``signal`` (TRACES, METRICS): None where the standard variables set one for
    it (the exporter reads them; the traces' alone left the metrics' at 10 s, a review's)."""
    standard = ("OTEL_EXPORTER_OTLP_TIMEOUT", f"OTEL_EXPORTER_OTLP_{signal}_TIMEOUT")
    return None if any(environ.get(name) for name in standard) else OTLP_TIMEOUT_S


class MetricsUnservable(Exception):
    """The metrics endpoint's address cannot be listened on."""


def serve_prometheus(host: str, port: int) -> MetricReader:
    """A reader whose metrics Prometheus scrapes over HTTP at ``http://host:port/metrics`` (port 0: any free one)."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import start_http_server

    reader: MetricReader = PrometheusMetricReader()
    try:
        server, _ = start_http_server(port, addr=host)
    except OSError as error:  # the port taken, or no such address: said as the setting, not a traceback
        raise MetricsUnservable(
            f"ONTOFABRIC_METRICS_HOST/ONTOFABRIC_METRICS_PORT {host}:{port} cannot be served: {error}"
        ) from error
    # A port picked for it is said at any log level: nothing else tells where to scrape (a tester's `mcp`, whose
    # level is warning, said nothing).
    (log.warning if port == 0 else log.info)("metrics_served", url=f"http://{host}:{server.server_port}/metrics")
    return reader


def tracer() -> trace.Tracer:
    return trace.get_tracer("ontofabric")


TRACE_HEADERS = ("traceparent", "tracestate")
"""The W3C trace context's headers, as ``propagate.inject`` writes them on a NATS message."""


TRACE_HEADER_MAX_CHARS = 512
"""The longest trace header carried on: W3C Trace Context has vendors propagate a ``tracestate`` of at least 512
characters and drop entries past that; a ``traceparent`` is 55. A fault tester's 64 kB ``tracestate``, copied
onto its delta's dead letter, took the letter past the server's header limit: refused on every try, it held
the index's position for every workspace."""


def trace_context_of(headers: Mapping[str, str] | None) -> dict[str, str]:
    """The trace context a message carries, to carry on with what is made of it (a dead letter, its re-drive): a
    header longer than W3C's limit is left behind."""
    return {
        name: headers[name]
        for name in TRACE_HEADERS
        if headers and name in headers and len(headers[name]) <= TRACE_HEADER_MAX_CHARS
    }


@contextmanager
def housekeeping() -> Iterator[None]:
    """Database statements and HTTP requests within make no spans: housekeeping outside any request made each of
    its statements a trace of its own (an SRE's idle projector: two a second). Not around what starts tasks,
    which would inherit it."""
    with suppress_instrumentation():
        yield


@dataclass(frozen=True)
class Instruments:
    query_duration: metrics.Histogram
    fusion_duration: metrics.Histogram
    cache_hit: metrics.Counter
    cache_miss: metrics.Counter
    degraded: metrics.Counter
    query_errors: metrics.Counter
    projector_deltas: metrics.Counter
    projector_batch_duration: metrics.Histogram
    rerank_duration: metrics.Histogram
    rerank_cost: metrics.Counter
    graph_expansion_duration: metrics.Histogram
    projector_freshness: metrics.Histogram
    projector_redeliveries: metrics.Counter

    def candidates(self, retriever: str) -> metrics.Counter:
        """Candidates a retriever returned: ``retrieval.candidates.dense`` and ``.sparse`` (keyword), the seed's
        names, and ``retrieval.candidates.{name}`` for any other retriever."""
        return _candidates_counter(_SEED_CANDIDATE_NAMES.get(retriever, retriever))


def meter() -> metrics.Meter:
    return metrics.get_meter("ontofabric")


_SEED_CANDIDATE_NAMES = {"keyword": "sparse"}


@cache
def _candidates_counter(name: str) -> metrics.Counter:
    return meter().create_counter(f"retrieval.candidates.{name}", description=f"{name} candidates returned")


SUB_MILLISECOND_BUCKETS_MS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0)
"""For stages of a millisecond or less: OpenTelemetry's default buckets start at 5 ms, where every fusion fell."""
LONG_BUCKETS_MS = (10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1e3, 2.5e3, 5e3, 1e4, 3e4, 6e4, 3e5, 9e5, 3.6e6)
"""For what can take minutes (a projector behind, a slow batch): the default buckets end at 10 s, past which a
quantile reads 10 s whatever it is."""


@cache
def instruments() -> Instruments:
    meter = metrics.get_meter("ontofabric")
    return Instruments(
        query_duration=meter.create_histogram(
            "retrieval.query.duration_ms",
            unit="ms",
            description="ontology_query wall time in the worker, from its receipt: the wait for a runner included",
        ),
        fusion_duration=meter.create_histogram(
            "retrieval.fusion.duration_ms",
            unit="ms",
            description="fusing the retrievers' lists into one ranking",
            explicit_bucket_boundaries_advisory=SUB_MILLISECOND_BUCKETS_MS,
        ),
        cache_hit=meter.create_counter("retrieval.cache.hit", description="ontology_query answers read from the cache"),
        cache_miss=meter.create_counter(
            "retrieval.cache.miss", description="ontology_query answers made, none of the same version being cached"
        ),
        degraded=meter.create_counter("retrieval.degraded", description="answers with a failed part, by sink"),
        query_errors=meter.create_counter("retrieval.query.errors", description="error replies, by code"),
        projector_deltas=meter.create_counter(
            "projector.deltas",
            description="deltas handled, by outcome (applied, noop, dead_lettered, retried; server_answer_dropped: "
            "a server's answer stored on a delta subject)",
        ),
        projector_batch_duration=meter.create_histogram(
            "projector.batch.duration_ms",
            unit="ms",
            description="a projector's batch, from its fetch to its acknowledgements, by index",
            explicit_bucket_boundaries_advisory=LONG_BUCKETS_MS,
        ),
        rerank_duration=meter.create_histogram(
            "retrieval.rerank.duration_ms", unit="ms", description="reranker calls' wall time, by reranker"
        ),
        rerank_cost=meter.create_counter(
            "retrieval.rerank.cost_usd",
            description="reranker cost estimated from the configured prices, by workspace and reranker",
        ),
        graph_expansion_duration=meter.create_histogram(
            "retrieval.graph_expansion.duration_ms",
            unit="ms",
            description="the bounded graph expansion of an answer's results (followLinks)",
            explicit_bucket_boundaries_advisory=SUB_MILLISECOND_BUCKETS_MS,
        ),
        projector_freshness=meter.create_histogram(
            "projector.freshness_ms",
            unit="ms",
            description="from a delta stored in the stream to its commit in the index, where queries read it",
            explicit_bucket_boundaries_advisory=LONG_BUCKETS_MS,
        ),
        projector_redeliveries=meter.create_counter(
            "projector.redeliveries", description="deltas delivered again (after a nak, an ack wait or a crash)"
        ),
    )
