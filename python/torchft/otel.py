"""OpenTelemetry (OTLP/HTTP) export of torchft's logs, lighthouse events and metrics.

Two ways in, both optional (the package imports without OpenTelemetry; it is imported only
when an export is asked for, and a missing SDK then fails with the packages to install):

* **Python loggers**, as upstream torchft does it: with ``TORCHFT_USE_OTEL=1``,
  :func:`setup_logger` attaches an OTLP log handler to a named logger (upstream scripts call
  ``setup_logger("torchft_quorums")``, ``"torchft_commits"``, ``"torchft_errors"``). Records
  go to the OpenTelemetry SDK's default endpoint (``OTEL_EXPORTER_OTLP_ENDPOINT``, else
  ``http://localhost:4318``); ``TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON`` names a JSON file
  mapping each logger name to the resource attributes of its records. :func:`shutdown`
  flushes them.

* **The lighthouse**, by a bridge process::

      python -m torchft.otel --lighthouse URL [--job NAME] [--endpoint URL]
                             [--interval S] [--service-name NAME] [--no-backlog]

  It follows the lighthouse's ``/events`` stream and exports every event as one OTLP log
  record (body: the event's kind; attributes: its fields, nested objects flattened to dotted
  keys; timestamp: its ``ts``; severity WARN for the kinds in :data:`WARN_KINDS`, INFO
  otherwise), and every ``--interval`` seconds exports the room's ``/metrics`` gauges and
  counters as OTLP metrics with their labels as attributes. A dropped connection is resumed
  with ``Last-Event-ID``, so no event is exported twice or skipped while the lighthouse still
  buffers it; a restarted lighthouse (its ``/status`` start time changed) is followed from
  its first buffered event. The lighthouse's token and TLS settings are those of every
  torchft process (``TORCHFT_TOKEN_FILE``/``TORCHFT_TOKEN``, ``TORCHFT_TLS_*``). SIGTERM and
  SIGINT stop it after a last scrape and a flush of everything queued.

Exit codes of the bridge: 0 after a signal, 1 when the lighthouse refuses its token, 2 for
bad arguments or settings (a missing endpoint included) or a missing SDK.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import logging
import math
import signal
import socket
import ssl
import sys
import threading
import time
import traceback
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

from torchft import config

if TYPE_CHECKING:
    from opentelemetry._logs import Logger as OTelLogger
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricsData
    from opentelemetry.sdk.resources import Resource

__all__ = [
    "INSTALL_HINT",
    "LOGGERS",
    "TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON",
    "WARN_KINDS",
    "Bridge",
    "BridgeOptions",
    "OTelUnavailableError",
    "Series",
    "flatten_attributes",
    "main",
    "metric_series",
    "parse_args",
    "setup_logger",
    "shutdown",
]

logger: logging.Logger = logging.getLogger(__name__)

#: What to install for any export (named in every error about a missing SDK).
INSTALL_HINT = "pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http"

#: The variable naming the resource attributes file (upstream's name for it).
TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON = "TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON"

#: The loggers upstream torchft passes to :func:`setup_logger` when it is imported.
LOGGERS: tuple[str, ...] = ("torchft_quorums", "torchft_commits", "torchft_errors")

#: Event kinds exported with severity WARN (every other kind is INFO).
WARN_KINDS: frozenset[str] = frozenset(
    {
        "replica_lost",
        "replica_failed",
        "replica_hung",
        "replica_diverged",
        "progress_regressed",
        "commit_failed",
        "snapshot_failed",
        "straggler_flagged",
        "straggler_dropped",
    }
)

#: What the lighthouse sends in place of the events a slow subscriber missed.
_LAGGED = "feed_lagged"

#: Attribute values OTLP carries: scalars and homogeneous lists of scalars.
AttrValue = (
    str | bool | int | float | Sequence[str] | Sequence[bool] | Sequence[int] | Sequence[float]
)


class OTelUnavailableError(ImportError):
    """An OTLP export was asked for but the OpenTelemetry SDK or exporter is not installed."""


def _require_sdk() -> None:
    """Imports the SDK and the OTLP/HTTP exporter, or says what to install.

    Raises:
        OTelUnavailableError: either is missing.
    """
    try:
        import opentelemetry.exporter.otlp.proto.http  # noqa: F401
        import opentelemetry.sdk  # noqa: F401
    except ImportError as e:
        raise OTelUnavailableError(
            f"OpenTelemetry export needs the OpenTelemetry SDK and its OTLP/HTTP exporter, "
            f"which are not installed ({e}): {INSTALL_HINT}"
        ) from e


# ----------------------------------------------------------------------------- attributes

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _scalar(value: Any) -> str | bool | int | float | None:
    """``value`` as an OTLP scalar: an int beyond 64 bits becomes its decimal text; None
    for anything that is not a scalar."""
    if isinstance(value, bool | str | float):
        return value
    if isinstance(value, int):
        return value if _INT64_MIN <= value <= _INT64_MAX else str(value)
    return None


def flatten_attributes(fields: Mapping[str, Any], prefix: str = "") -> dict[str, AttrValue]:
    """Turns JSON-like fields into OTLP attributes.

    Nested objects become dotted keys (``evidence.input_s``); a list of scalars of one type
    stays a list; any other list is its JSON text; None (JSON null) is left out, as OTLP has
    no null attribute; anything else is its ``str``.

    Args:
        fields: The fields (an event, a log record's extras).
        prefix: Put before every key (used for nesting).

    Returns:
        Attributes the OTLP exporters accept.
    """
    out: dict[str, AttrValue] = {}
    for key, value in fields.items():
        name = f"{prefix}{key}"
        if value is None:
            continue
        if isinstance(value, Mapping):
            out.update(flatten_attributes(value, name + "."))
            continue
        scalar = _scalar(value)
        if scalar is not None:
            out[name] = scalar
        elif isinstance(value, list | tuple):
            items = [_scalar(v) for v in value]
            if all(v is not None for v in items) and len({type(v) for v in items}) <= 1:
                out[name] = items  # type: ignore[assignment]
            else:
                out[name] = json.dumps(value, default=str, sort_keys=True)
        else:
            out[name] = str(value)
    return out


def _nanos(ts: float) -> int:
    """Unix seconds as nanoseconds, exact to the microsecond (the lighthouse's precision)."""
    return round(ts * 1e6) * 1000


# ----------------------------------------------------------------------------- loggers

# Attributes every ``logging.LogRecord`` has: not user extras.
_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "taskName",
}


#: Python log levels (the lowest of each band) and their OTLP severity names.
_LEVELS: tuple[tuple[int, str], ...] = (
    (logging.CRITICAL, "FATAL"),
    (logging.ERROR, "ERROR"),
    (logging.WARNING, "WARN"),
    (logging.INFO, "INFO"),
    (logging.NOTSET, "DEBUG"),
)


class _OTelLogHandler(logging.Handler):
    """Hands Python log records to an OpenTelemetry logger provider.

    The SDK's own ``LoggingHandler`` is deprecated; this one keeps to the stable
    ``Logger.emit`` API. Attributes are the record's extras (flattened), its code location
    and, for an exception, ``exception.type``/``.message``/``.stacktrace``.
    """

    def __init__(self, provider: LoggerProvider) -> None:
        """Emits through ``provider`` (one OTel logger per Python logger name)."""
        super().__init__(logging.NOTSET)
        self.provider = provider
        self._loggers: dict[str, OTelLogger] = {}

    def emit(self, record: logging.LogRecord) -> None:
        """Exports one record; never raises (errors go to ``handleError``)."""
        from opentelemetry._logs import SeverityNumber

        try:
            otel = self._loggers.get(record.name)
            if otel is None:
                otel = self._loggers[record.name] = self.provider.get_logger(record.name)
            extras = {k: v for k, v in vars(record).items() if k not in _RECORD_FIELDS}
            attributes = flatten_attributes(extras)
            attributes.update(
                {
                    "code.file.path": record.pathname,
                    "code.function.name": record.funcName,
                    "code.line.number": record.lineno,
                }
            )
            if record.exc_info and record.exc_info[1] is not None:
                exc = record.exc_info[1]
                attributes["exception.type"] = type(exc).__qualname__
                attributes["exception.message"] = str(exc)
                attributes["exception.stacktrace"] = "".join(
                    traceback.format_exception(type(exc), exc, exc.__traceback__)
                )
            text = next(name for level, name in _LEVELS if record.levelno >= level)
            otel.emit(
                timestamp=int(record.created * 1e9),
                severity_number=SeverityNumber[text],
                severity_text=text,
                body=record.getMessage(),
                attributes=attributes,
            )
        except Exception:
            self.handleError(record)


#: The loggers :func:`setup_logger` exports, with their handler (which owns its provider).
_ATTACHED: dict[str, _OTelLogHandler] = {}
_ATTACHED_LOCK = threading.Lock()


def _resource_attributes(name: str) -> dict[str, AttrValue]:
    """The resource attributes of logger ``name`` from ``TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON``
    (none when unset, or when the file has no entry for ``name``).

    Raises:
        ValueError: The file cannot be read, is not JSON, or is not an object of objects.
    """
    path = config.env_value(TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON)
    if path is None:
        return {}
    where = f"{TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON}={path!r}"
    try:
        with open(path, encoding="utf-8") as f:
            table = json.load(f)
    except OSError as e:
        raise ValueError(f"{where}: cannot read it: {e.strerror or e}") from e
    except ValueError as e:
        raise ValueError(f"{where}: not JSON: {e}") from e
    if not isinstance(table, dict):
        raise ValueError(f"{where}: must be a JSON object mapping logger names to attributes")
    entry = table.get(name, {})
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: the entry of logger {name!r} must be a JSON object")
    return flatten_attributes(entry)


def setup_logger(name: str) -> None:
    """Exports logger ``name``'s records over OTLP/HTTP when ``TORCHFT_USE_OTEL`` is on.

    Upstream torchft's entry point, with its name and switch: scripts that call it keep
    working. Off (the default), nothing happens and OpenTelemetry is not imported. Calling it
    again for the same name does nothing. The exporter reads the standard ``OTEL_EXPORTER_*``
    variables (endpoint, headers, certificates); unlike upstream's, records are not also
    printed to stdout.

    Args:
        name: The Python logger's name (e.g. ``"torchft_quorums"``).

    Raises:
        OTelUnavailableError: The switch is on but OpenTelemetry is not installed.
        ValueError: ``TORCHFT_USE_OTEL`` is not a switch, or the resource attributes file is
            unusable (the message names the variable).
    """
    if not config.env_flag("TORCHFT_USE_OTEL", False):
        return
    with _ATTACHED_LOCK:
        if name in _ATTACHED:
            return
        _require_sdk()
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
        from opentelemetry.sdk._logs import LoggerProvider
        from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
        from opentelemetry.sdk.resources import Resource

        provider = LoggerProvider(resource=Resource.create(_resource_attributes(name)))
        provider.add_log_record_processor(BatchLogRecordProcessor(OTLPLogExporter(timeout=5)))
        handler = _OTelLogHandler(provider)
        logging.getLogger(name).addHandler(handler)
        _ATTACHED[name] = handler


def shutdown() -> None:
    """Flushes and detaches every logger :func:`setup_logger` exports (upstream's name).

    A later :func:`setup_logger` attaches afresh. Records still queued at interpreter exit
    are flushed by the SDK without this call.
    """
    with _ATTACHED_LOCK:
        attached = dict(_ATTACHED)
        _ATTACHED.clear()
    for name, handler in attached.items():
        logging.getLogger(name).removeHandler(handler)
        handler.provider.shutdown()


# ----------------------------------------------------------------------------- metrics


@dataclass(frozen=True)
class Series:
    """One metric of a ``/metrics`` scrape, as it is exported.

    Attributes:
        name: The sample name (``torchft_quorum_changes_total`` for a counter).
        kind: ``"gauge"``, or ``"sum"`` for a counter (monotonic, cumulative).
        description: The ``# HELP`` text.
        points: Each sample's labels and value.
    """

    name: str
    kind: str
    description: str
    points: tuple[tuple[tuple[tuple[str, str], ...], float], ...]


def metric_series(text: str, job: str) -> list[Series]:
    """The gauges and counters of one room in a Prometheus text scrape.

    A room's samples are those labelled ``job=NAME``; the default room's (``job=""``) are
    those without a ``job`` label, the lighthouse-wide ones included. Untyped samples count
    as gauges; histograms, summaries and NaN values are left out.

    Args:
        text: The ``/metrics`` body.
        job: The room.

    Returns:
        The room's metrics, in scrape order.

    Raises:
        ValueError: The text does not parse.
    """
    from prometheus_client.parser import text_string_to_metric_families

    out: list[Series] = []
    for family in text_string_to_metric_families(text):
        if family.type in ("gauge", "untyped", "unknown"):
            kind, suffix = "gauge", None
        elif family.type == "counter":
            kind, suffix = "sum", "_total"
        else:
            logger.debug("not exported: %s (%s)", family.name, family.type)
            continue
        by_name: dict[str, list[tuple[tuple[tuple[str, str], ...], float]]] = {}
        for sample in family.samples:
            if suffix is not None and not sample.name.endswith(suffix):
                continue  # a counter's _created sample
            if sample.labels.get("job", "") != job or math.isnan(sample.value):
                continue
            labels = tuple(sorted(sample.labels.items()))
            by_name.setdefault(sample.name, []).append((labels, float(sample.value)))
        for name, points in by_name.items():
            out.append(Series(name, kind, family.documentation, tuple(points)))
    return out


class _MetricState:
    """Start times of the exported counters: when each series was first seen, moved to the
    scrape that saw it go down (the lighthouse restarted and counts from zero again)."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[int, float]] = {}

    def start(self, name: str, labels: tuple[tuple[str, str], ...], value: float, now: int) -> int:
        """The start time of one point of ``name`` scraped at ``now``."""
        key = (name, labels)
        seen = self._seen.get(key)
        start = now if seen is None or value < seen[1] else seen[0]
        self._seen[key] = (start, value)
        return start


def _metrics_data(
    series: list[Series], state: _MetricState, resource: Resource, now: int
) -> MetricsData:
    """The SDK's export batch for one scrape."""
    from opentelemetry.sdk.metrics.export import (
        AggregationTemporality,
        Gauge,
        Metric,
        MetricsData,
        NumberDataPoint,
        ResourceMetrics,
        ScopeMetrics,
        Sum,
    )
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    metrics = []
    for s in series:
        points = [
            NumberDataPoint(
                attributes=dict(labels),
                start_time_unix_nano=state.start(s.name, labels, value, now),
                time_unix_nano=now,
                value=value,
            )
            for labels, value in s.points
        ]
        data: Gauge | Sum
        if s.kind == "sum":
            data = Sum(points, AggregationTemporality.CUMULATIVE, is_monotonic=True)
        else:
            data = Gauge(points)
        metrics.append(Metric(name=s.name, description=s.description, unit="", data=data))
    scope = ScopeMetrics(InstrumentationScope("torchft.lighthouse"), metrics, schema_url="")
    return MetricsData([ResourceMetrics(resource, [scope], schema_url="")])


# ----------------------------------------------------------------------------- the bridge


class _Fatal(Exception):
    """The lighthouse refuses this bridge for good (its token): retrying cannot help."""


class _Unavailable(Exception):
    """The lighthouse (or the room) cannot be followed now; retried after a backoff."""


def _http_url(text: str, what: str) -> urllib.parse.SplitResult:
    """Checks an http(s) URL with a host and nothing after its path.

    Raises:
        ValueError: naming ``what``.
    """
    try:
        url = urllib.parse.urlsplit(text.strip())
        url.port  # noqa: B018 (raises on a bad port)
    except ValueError as e:
        raise ValueError(f"{what} {text!r} is not a URL: {e}") from e
    if url.scheme not in ("http", "https"):
        raise ValueError(f"{what} {text!r} must be an http:// or https:// URL")
    if not url.hostname:
        raise ValueError(f"{what} {text!r} has no host")
    if url.query or url.fragment or url.username or url.password:
        raise ValueError(f"{what} {text!r} must have no query, fragment or credentials")
    return url


@dataclass(frozen=True)
class BridgeOptions:
    """The bridge's settings, validated (see :func:`parse_args`)."""

    lighthouse: urllib.parse.SplitResult
    job: str
    endpoint: str
    interval: float
    service_name: str
    backlog: bool

    @property
    def lighthouse_url(self) -> str:
        """The lighthouse's base URL, for messages and the resource."""
        return urllib.parse.urlunsplit(self.lighthouse)


def _interval(text: str) -> float:
    """``--interval``: finite seconds above zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def parse_args(argv: Sequence[str] | None) -> BridgeOptions:
    """Parses and checks the bridge's command line (argparse exits 2 on an error).

    The endpoint is ``--endpoint``, else ``OTEL_EXPORTER_OTLP_ENDPOINT``: a collector's base
    URL, to which ``/v1/logs`` and ``/v1/metrics`` are appended.
    """
    parser = argparse.ArgumentParser(
        prog="python -m torchft.otel",
        description="Export a torchft lighthouse's events (as OTLP logs) and metrics (as OTLP "
        "metrics) to an OpenTelemetry collector over OTLP/HTTP.",
    )
    parser.add_argument("--lighthouse", required=True, metavar="URL", help="http(s)://host:port")
    parser.add_argument(
        "--job", default="", metavar="NAME", help="the job's room (default: the default room)"
    )
    parser.add_argument(
        "--endpoint",
        metavar="URL",
        help="collector base URL, e.g. http://otel-collector:4318 (default: env "
        "OTEL_EXPORTER_OTLP_ENDPOINT)",
    )
    parser.add_argument(
        "--interval", type=_interval, default=15.0, metavar="S", help="seconds between scrapes"
    )
    parser.add_argument(
        "--service-name", default="torchft-lighthouse", metavar="NAME", help="service.name"
    )
    parser.add_argument(
        "--no-backlog",
        dest="backlog",
        action="store_false",
        help="skip the events the lighthouse buffered before the bridge started",
    )
    args = parser.parse_args(argv)
    try:
        lighthouse = _http_url(args.lighthouse, "--lighthouse")
        job = config.JOB.check("--job", args.job) if args.job else ""
        if not args.service_name.strip():
            raise ValueError("--service-name must not be empty")
        source = "--endpoint" if args.endpoint is not None else "OTEL_EXPORTER_OTLP_ENDPOINT"
        endpoint = args.endpoint if args.endpoint is not None else config.env_value(source)
        if endpoint is None:
            raise ValueError(
                "no OTLP endpoint: pass --endpoint URL or set OTEL_EXPORTER_OTLP_ENDPOINT "
                "(the collector's OTLP/HTTP base URL, e.g. http://otel-collector:4318)"
            )
        url = _http_url(endpoint, source)
        if url.path.rstrip("/").endswith(("/v1/logs", "/v1/metrics")):
            raise ValueError(
                f"{source} {endpoint!r} names a signal path: give the collector's base URL "
                "(/v1/logs and /v1/metrics are appended)"
            )
    except ValueError as e:
        parser.error(str(e))
    return BridgeOptions(
        lighthouse=lighthouse._replace(path=lighthouse.path.rstrip("/")),
        job=job,
        endpoint=urllib.parse.urlunsplit(url).rstrip("/"),
        interval=args.interval,
        service_name=args.service_name,
        backlog=args.backlog,
    )


class _Lighthouse:
    """HTTP(S) requests to one lighthouse room, with the job's token and TLS settings."""

    #: Seconds a request may take; the event stream's idle limit (the lighthouse sends a
    #: keep-alive every 15 s) is :data:`IDLE_S`.
    TIMEOUT_S = 10.0
    IDLE_S = 45.0

    def __init__(self, opts: BridgeOptions) -> None:
        """Reads the token and TLS files (``TORCHFT_TOKEN_FILE``, ``TORCHFT_TLS_*``).

        Raises:
            ValueError: The settings are unusable (the message names the variable).
        """
        from torchft.checkpointing._security import TransportSecurity

        security = TransportSecurity.from_env()
        self._url = opts.lighthouse
        self._query = "?" + urllib.parse.urlencode({"job": opts.job}) if opts.job else ""
        self._headers = security.headers()
        self._tls: ssl.SSLContext | None = None
        if self._url.scheme == "https":
            self._tls = security.client_context() or ssl.create_default_context()

    def connect(self, timeout: float) -> http.client.HTTPConnection:
        """A connected (not yet requested) connection."""
        host, port = self._url.hostname or "", self._url.port
        conn: http.client.HTTPConnection
        if self._tls is not None:
            conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=self._tls)
        else:
            conn = http.client.HTTPConnection(host, port, timeout=timeout)
        conn.connect()
        return conn

    def request(
        self,
        conn: http.client.HTTPConnection,
        path: str,
        headers: Mapping[str, str] = {},  # noqa: B006 (never mutated)
        room: bool = True,
    ) -> http.client.HTTPResponse:
        """Sends ``GET path`` (with ``?job=`` when ``room``) and returns the response."""
        target = self._url.path + path + (self._query if room else "")
        conn.request("GET", target, headers={**self._headers, **headers})
        return conn.getresponse()

    def get(self, path: str, room: bool = True) -> tuple[int, bytes]:
        """``GET path``: status and body."""
        conn = self.connect(self.TIMEOUT_S)
        try:
            resp = self.request(conn, path, room=room)
            return resp.status, resp.read()
        finally:
            conn.close()

    def status(self) -> tuple[float, int]:
        """The room's start time and its newest event's id, from ``/status``. A new start
        time means a new lighthouse (or a reopened room) whose event ids start over.

        Raises:
            _Fatal: The token is refused.
            _Unavailable: The room is not open, or the answer is not a status.
        """
        status, body = self.get("/status")
        _check_status(status, body)
        try:
            doc = json.loads(body)
            events = doc.get("events") or [{"seq": 0}]
            return float(doc["started_unix_s"]), int(events[-1]["seq"])
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise _Unavailable(f"/status answered without started_unix_s ({e})") from e


def _check_status(status: int, body: bytes) -> None:
    """Raises the error an HTTP status means for the bridge (200: none)."""
    if status == 200:
        return
    text = body.decode("utf-8", "replace").strip()[:300]
    if status in (401, 403):
        raise _Fatal(
            f"the lighthouse refused this bridge (HTTP {status}: {text}); set the job's token "
            "with TORCHFT_TOKEN_FILE (or TORCHFT_TOKEN)"
        )
    raise _Unavailable(f"HTTP {status}: {text}")


class _SseParser:
    """Server-sent events, one line at a time: each complete message as (id, data)."""

    def __init__(self) -> None:
        self._data: list[str] = []
        self._id: str | None = None

    def feed(self, raw: bytes) -> tuple[str | None, str] | None:
        """Takes one line; returns the message a blank line completes."""
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if not line:
            msg = (self._id, "\n".join(self._data)) if self._data else None
            self._data, self._id = [], None
            return msg
        if line.startswith(":"):
            return None  # a comment: the keep-alive
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "data":
            self._data.append(value)
        elif field == "id":
            self._id = value
        return None


#: Longest line of the event stream accepted.
_MAX_LINE = 16 * 1024 * 1024


class Bridge:
    """Follows one lighthouse room and exports its events and metrics (see the module docs).

    The event stream is read on the calling thread (:meth:`run`); ``/metrics`` is scraped on
    a second one. :meth:`stop` may be called from a signal handler.
    """

    def __init__(self, opts: BridgeOptions) -> None:
        """Builds the exporters (the SDK must be importable).

        Raises:
            ValueError: The token or TLS settings are unusable.
        """
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk._logs import LoggerProvider
        from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
        from opentelemetry.sdk.resources import Resource
        from prometheus_client import parser  # noqa: F401 (used by metric_series)

        self._opts = opts
        self._lighthouse = _Lighthouse(opts)
        attributes: dict[str, AttrValue] = {
            "service.name": opts.service_name,
            "torchft.lighthouse": opts.lighthouse_url,
        }
        if opts.job:
            attributes["torchft.job"] = opts.job
        self._resource: Resource = Resource.create(attributes)
        self._provider: LoggerProvider = LoggerProvider(resource=self._resource)
        self._provider.add_log_record_processor(
            BatchLogRecordProcessor(
                OTLPLogExporter(endpoint=opts.endpoint + "/v1/logs", timeout=10),
                schedule_delay_millis=500,
                max_queue_size=65536,
            )
        )
        self._events: OTelLogger = self._provider.get_logger("torchft.lighthouse")
        self._metric_exporter: MetricExporter = OTLPMetricExporter(
            endpoint=opts.endpoint + "/v1/metrics", timeout=10
        )
        self._metric_state = _MetricState()
        self._stop = threading.Event()
        self._lock = threading.RLock()  # re-entrant: stop() runs in signal handlers
        self._sock: socket.socket | None = None
        self._fatal: str | None = None
        # The id of the last event exported, and the start time of the room it came from.
        self._last_id: int | None = None
        self._started: float | None = None
        self.exported_events = 0
        self._scrape_failing: str | None = None

    # ------------------------------------------------------------------ control

    def stop(self, why: str = "") -> None:
        """Ends :meth:`run` (safe from a signal handler: it only sets a flag and shuts the
        event stream's socket so the blocked read returns)."""
        if why and not self._stop.is_set():
            logger.info("stopping (%s)", why)
        self._stop.set()
        with self._lock:
            sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def run(self) -> int:
        """Exports until :meth:`stop` or a refused token, then flushes.

        Returns:
            0 after :meth:`stop`, 1 when the lighthouse refused the token.
        """
        where = f" (job {self._opts.job!r})" if self._opts.job else ""
        logger.info(
            "exporting %s%s to %s every %gs",
            self._opts.lighthouse_url,
            where,
            self._opts.endpoint,
            self._opts.interval,
        )
        scraper = threading.Thread(target=self._scrape_loop, name="otel-metrics", daemon=True)
        scraper.start()
        try:
            self._follow()
        finally:
            self._stop.set()
            scraper.join(self._lighthouse.TIMEOUT_S * 2)
            if self._fatal is None:
                self._scrape()  # the last values, so a stop loses nothing since the last scrape
            self._provider.force_flush(10_000)
            self._provider.shutdown()
            self._metric_exporter.shutdown()
            logger.info("stopped after exporting %d events", self.exported_events)
        if self._fatal is not None:
            logger.error("%s", self._fatal)
            return 1
        return 0

    # ------------------------------------------------------------------ events

    def _follow(self) -> None:
        """Connects, streams and reconnects (with backoff) until stopped."""
        delay = 0.5
        while not self._stop.is_set():
            try:
                if self._stream():
                    delay = 0.5
                    continue
            except _Fatal as e:
                self._fatal = str(e)
                return
            except (OSError, http.client.HTTPException, _Unavailable) as e:
                if self._stop.is_set():
                    return
                logger.warning(
                    "lighthouse %s unavailable (%s); retrying in %.1fs",
                    self._opts.lighthouse_url,
                    e or type(e).__name__,
                    delay,
                )
            self._stop.wait(delay)
            delay = min(delay * 2, 15.0)

    def _stream(self) -> bool:
        """One connection to ``/events``: resumes after the last exported event and exports
        what arrives until the stream ends.

        Returns:
            Whether the stream delivered anything (the backoff starts over).
        """
        started, newest = self._lighthouse.status()
        if self._started is not None and started != self._started:
            logger.warning(
                "the lighthouse restarted (or the room reopened): following it from its first "
                "buffered event (what the previous one sent after the connection dropped is in "
                "its --event_log only)"
            )
            self._last_id = 0
        self._started = started
        if self._last_id is None:
            self._last_id = 0 if self._opts.backlog else newest
        after = self._last_id
        headers = {
            "Accept": "text/event-stream",
            "Cache-Control": "no-cache",
            "Last-Event-ID": str(after),
        }
        conn = self._lighthouse.connect(self._lighthouse.IDLE_S)
        with self._lock:
            self._sock = conn.sock
        if self._stop.is_set():
            conn.close()
            return False
        try:
            resp = self._lighthouse.request(conn, "/events", headers)
            _check_status(resp.status, resp.read() if resp.status != 200 else b"")
            if self._lighthouse.status()[0] != started:
                return False  # restarted while connecting: connect again, to the new one
            logger.info("following events%s", f" after #{after}" if after else "")
            return self._read(resp)
        finally:
            with self._lock:
                self._sock = None
            conn.close()

    def _read(self, resp: http.client.HTTPResponse) -> bool:
        """Exports the messages of one stream until it ends or the bridge stops."""
        parser = _SseParser()
        got = False
        while not self._stop.is_set():
            line = resp.readline(_MAX_LINE)
            if not line:
                if not self._stop.is_set():
                    logger.warning("the event stream ended; reconnecting")
                return got
            if len(line) >= _MAX_LINE:
                raise _Unavailable(f"an event stream line over {_MAX_LINE} bytes")
            msg = parser.feed(line)
            if msg is not None:
                got = True
                self._on_message(*msg)
        return got

    def _on_message(self, msg_id: str | None, data: str) -> None:
        """Exports one message, once: an id at or below the last exported one is skipped."""
        seq: int | None = None
        if msg_id is not None:
            with contextlib.suppress(ValueError):
                seq = int(msg_id)
        if seq is not None and self._last_id is not None and seq <= self._last_id:
            logger.debug("skipping event #%d: already exported", seq)
            return
        try:
            event = json.loads(data)
        except ValueError:
            event = None
        if not isinstance(event, dict) or not isinstance(event.get("kind"), str):
            logger.warning("skipping a message that is not an event: %.200s", data)
        elif event["kind"] == _LAGGED:
            logger.warning(
                "the lighthouse skipped %s events for this bridge (it fell behind); they are "
                "in its --event_log only",
                event.get("skipped"),
            )
            self._export(event)
        else:
            self._export(event)
        if seq is not None:
            self._last_id = seq

    def _export(self, event: dict[str, Any]) -> None:
        """One event as one OTLP log record."""
        from opentelemetry._logs import SeverityNumber

        kind: str = event["kind"]
        warn = kind in WARN_KINDS or kind == _LAGGED
        ts = event.get("ts")
        fields = {k: v for k, v in event.items() if k not in ("kind", "ts")}
        self._events.emit(
            timestamp=_nanos(ts) if isinstance(ts, int | float) and math.isfinite(ts) else None,
            observed_timestamp=time.time_ns(),
            severity_number=SeverityNumber.WARN if warn else SeverityNumber.INFO,
            severity_text="WARN" if warn else "INFO",
            body=kind,
            attributes=flatten_attributes(fields),
            event_name=f"torchft.{kind}",
        )
        self.exported_events += 1

    # ------------------------------------------------------------------ metrics

    def _scrape_loop(self) -> None:
        """Scrapes now and every interval until stopped."""
        while not self._stop.is_set():
            self._scrape()
            self._stop.wait(self._opts.interval)

    def _scrape(self) -> None:
        """One scrape of ``/metrics``, exported; failures are logged when they start."""
        from opentelemetry.sdk.metrics.export import MetricExportResult

        try:
            status, body = self._lighthouse.get("/metrics", room=False)
            if status != 200:
                text = body.decode("utf-8", "replace").strip()[:300]
                raise _Unavailable(f"/metrics answered HTTP {status}: {text}")
            series = metric_series(body.decode("utf-8", "replace"), self._opts.job)
            data = _metrics_data(series, self._metric_state, self._resource, time.time_ns())
            if self._metric_exporter.export(data) != MetricExportResult.SUCCESS:
                raise _Unavailable(f"the collector at {self._opts.endpoint} refused the metrics")
        except Exception as e:  # the scraping thread outlives any one bad scrape
            why = str(e) or type(e).__name__
            if self._scrape_failing != why:
                logger.warning("metrics not exported: %s", why)
            self._scrape_failing = why
            return
        if self._scrape_failing is not None:
            logger.info("metrics exported again")
        self._scrape_failing = None


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m torchft.otel``: runs the bridge until SIGTERM or SIGINT.

    Args:
        argv: Arguments without the program name; ``sys.argv[1:]`` when None.

    Returns:
        The exit code (0 after a signal, 1 on a refused token, 2 on a bad setting).
    """
    opts = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        _require_sdk()
        bridge = Bridge(opts)
    except ImportError as e:  # the SDK (named by the message), or prometheus-client
        hint = "" if isinstance(e, OTelUnavailableError) else ": pip install prometheus-client"
        print(f"error: {e}{hint}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    def on_signal(signum: int, frame: FrameType | None) -> None:
        bridge.stop(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return bridge.run()


if __name__ == "__main__":
    sys.exit(main())
