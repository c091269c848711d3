"""Prometheus metrics: one registry for the process, collectors for the runtime, helpers for the
layers that move bytes or serve requests, and a loopback HTTP endpoint.

Runtime metrics cost nothing on the hot path: the collector reads each live queue's counters
(`CommandQueue._submitted`, `.bytes_copied`, its inbox and timeline) and the device failure counts
only when scraped. Transports, collectives and the node daemon update the metrics below directly
(each update is a lock and an add, ~0.3 µs):

    from tinydist.observability import metrics
    server = metrics.serve_metrics("127.0.0.1", 9464)            # loopback unless told otherwise
    metrics.record_rpc("Launch", "OK", seconds, "tinydist.v1.DeviceService")   # grpc_server_handled_total
    with metrics.time_collective("allreduce", "ring"): ...
    metrics.add_transport_bytes("tcp", "send", n)

Everything is in `REGISTRY` (not prometheus_client's global one), so importing tinydist never
touches other libraries' metrics.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import importlib.metadata
import itertools
import platform
import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import (CollectorRegistry, Counter, Gauge, GCCollector, PlatformCollector,
                               ProcessCollector, generate_latest, start_http_server)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from tinydist.base.logs import get_logger
from tinydist.security.bind import bind_policy, parse_host_port

log = get_logger(layer="metrics")

REGISTRY = CollectorRegistry(auto_describe=True)
DEFAULT_ADDRESS = ("127.0.0.1", 9464)

# ---- pushed by other layers ------------------------------------------------------------------------

TRANSPORT_BYTES = Counter("tinydist_transport_bytes", "Bytes moved by a transport, by direction (send/recv).",
                          ["transport", "direction"], registry=REGISTRY)
TRANSPORT_MESSAGES = Counter("tinydist_transport_messages", "Messages (frames) moved by a transport.",
                             ["transport", "direction"], registry=REGISTRY)
COLLECTIVE_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)
COLLECTIVE_ERRORS = Counter("tinydist_collective_errors", "Collectives that raised, by error type.",
                            ["collective", "error"], registry=REGISTRY)
# RPC servers' metrics under go-grpc-prometheus's names and labels (grpc_service is the full
# service name, grpc_type one of unary / client_stream / server_stream / bidi_stream, grpc_code the
# status code name), so dashboards written for any gRPC server read them unchanged; kept by
# RpcMetrics, read by RpcCollector when scraped (below)
_GRPC = ["grpc_service", "grpc_method", "grpc_type"]
RPC_BUCKETS = (1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)  # grpc_server_handling_seconds, + +Inf
AUTH_DENIALS = Counter("tinydist_auth_denials", "Requests refused by authentication or authorisation, by reason.",
                       ["reason"], registry=REGISTRY)
DEVICE_HANGS_REMOTE = Counter("tinydist_node_device_hangs", "Device hangs a node daemon reported for its devices.",
                              ["device"], registry=REGISTRY)


def add_transport_bytes(transport: str, direction: str, nbytes: int, messages: int = 1) -> None:
    TRANSPORT_BYTES.labels(transport, direction).inc(nbytes)
    if messages:
        TRANSPORT_MESSAGES.labels(transport, direction).inc(messages)


class CollectiveSeconds(Collector):
    """tinydist_collective_seconds, a histogram by (collective, algorithm) kept in plain lists and
    turned into prometheus_client's family only when scraped. Why: every `td.dist` call observes
    one, and a 4 KiB allreduce on one host takes ~3-5 us, while `time_collective` as a
    prometheus_client Histogram (a generator context manager, `.labels()`, a locked add per bucket
    and for the sum) took 5.5-7.1 us a call, and a labelled child's `observe` alone ~1.9 us
    (load 4-6); `observe` here is a dict lookup, a bisect and two adds under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (collective, algorithm) -> counts per bucket (COLLECTIVE_BUCKETS, then +Inf), then the sum
        self._series: dict[tuple[str, str], list[float]] = {}

    def observe(self, collective: str, algorithm: str, seconds: float) -> None:
        series = self._series.get((collective, algorithm))
        if series is None:
            series = self._series.setdefault((collective, algorithm), [0] * (len(COLLECTIVE_BUCKETS) + 2))
        bucket = bisect.bisect_left(COLLECTIVE_BUCKETS, seconds)    # the first bound >= seconds: Prometheus' `le`
        with self._lock:
            series[bucket] += 1
            series[-1] += seconds

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily("tinydist_collective_seconds", "Latency of one collective, start to finish on this rank.",
                                       labels=["collective", "algorithm"])
        with self._lock:
            snapshot = {key: list(series) for key, series in self._series.items()}
        for labels, series in sorted(snapshot.items()):
            cumulative = list(itertools.accumulate(series[:-1]))
            bounds = [floatToGoString(b) for b in COLLECTIVE_BUCKETS] + ["+Inf"]
            family.add_metric(list(labels), list(zip(bounds, cumulative)), series[-1])
        yield family


COLLECTIVE_SECONDS = CollectiveSeconds()
REGISTRY.register(COLLECTIVE_SECONDS)


def collective_failed(collective: str, exc: BaseException) -> None:
    """Count a collective that raised in tinydist_collective_errors."""
    COLLECTIVE_ERRORS.labels(collective, type(exc).__name__).inc()


@contextlib.contextmanager
def time_collective(collective: str, algorithm: str = "") -> Iterator[None]:
    """Observe the block's duration in tinydist_collective_seconds; count it in
    tinydist_collective_errors instead if it raises. (td.dist's own calls skip the context
    manager: `COLLECTIVE_SECONDS.observe` and `collective_failed` directly.)"""
    start = time.perf_counter()
    try:
        yield
    except BaseException as exc:
        collective_failed(collective, exc)
        raise
    COLLECTIVE_SECONDS.observe(collective, algorithm, time.perf_counter() - start)


@contextlib.contextmanager
def time_rpc(method: str, service: str = "", grpc_type: str = "unary") -> Iterator[dict[str, str]]:
    """Time an RPC handler and count it by status: the status is "OK" unless the block sets
    `state["status"]` or raises (then the exception's `.code().name` for gRPC, else "UNKNOWN",
    what a gRPC server answers for an exception it does not map)."""
    state = {"status": "OK"}
    start = time.perf_counter()
    rpc_metrics(service, method, grpc_type).start()
    try:
        yield state
    except BaseException as exc:
        code = getattr(exc, "code", None)
        try:
            state["status"] = code().name if callable(code) else "UNKNOWN"
        except Exception:  # noqa: BLE001 - a status must never mask the error
            state["status"] = "UNKNOWN"
        raise
    finally:
        record_rpc(method, state["status"], time.perf_counter() - start, service, grpc_type, started=False)


def record_rpc(method: str, code: str, seconds: float, service: str = "", grpc_type: str = "unary",
               started: bool = True) -> None:
    """Count one handled RPC by its final gRPC status code name and observe how long it took
    (`started`: count it in grpc_server_started_total too, for a caller that did not)."""
    rpcs = rpc_metrics(service, method, grpc_type)
    if started:
        rpcs.start()
    rpcs.finish(code, seconds)


class RpcMetrics:
    """One (service, method, grpc_type)'s grpc_server_* series as plain numbers under one lock, read
    by RpcCollector at scrape time; get it with `rpc_metrics()`. A server's hot path pays one lock and
    a few adds a call: through prometheus_client's Counter and Histogram objects `start` and `finish`
    were 15 Python calls and four locks, ~5 us (the largest part of the node gate's Python work per
    Ping, `bench/remote_calls.py`)."""

    __slots__ = ("_lock", "buckets", "created", "handled", "labels", "started", "total_seconds")

    def __init__(self, service: str, method: str, grpc_type: str) -> None:
        self.labels = (service, method, grpc_type)
        self._lock = threading.Lock()
        self.created = time.time()
        self.started = 0
        self.handled: dict[str, int] = {}          # by status code name
        self.buckets = [0] * (len(RPC_BUCKETS) + 1)  # not cumulative; the last is +Inf
        self.total_seconds = 0.0

    def start(self) -> None:
        with self._lock:
            self.started += 1

    def finish(self, code: str, seconds: float) -> None:
        """Count one handled RPC by its final status name and observe how long it took."""
        bucket = bisect.bisect_left(RPC_BUCKETS, seconds)  # the first bound >= seconds, as `le` means
        with self._lock:
            self.handled[code] = self.handled.get(code, 0) + 1
            self.buckets[bucket] += 1
            self.total_seconds += seconds

    def read(self) -> tuple[int, dict[str, int], list[int], float]:
        with self._lock:
            return self.started, dict(self.handled), list(self.buckets), self.total_seconds


_RPC_METRICS: dict[tuple[str, str, str], RpcMetrics] = {}
_RPC_METRICS_LOCK = threading.Lock()


def rpc_metrics(service: str, method: str, grpc_type: str = "unary") -> RpcMetrics:
    """The one RpcMetrics of these labels in this process (every server and handler shares it)."""
    key = (service, method, grpc_type)
    found = _RPC_METRICS.get(key)
    if found is None:
        with _RPC_METRICS_LOCK:
            found = _RPC_METRICS.setdefault(key, RpcMetrics(*key))
    return found


class RpcCollector(Collector):
    """grpc_server_started_total, grpc_server_handled_total and grpc_server_handling_seconds from
    every RpcMetrics, as prometheus_client's Counter and Histogram would expose them."""

    def collect(self) -> Iterator[Any]:
        started = CounterMetricFamily("grpc_server_started", "RPCs started on the server.", labels=_GRPC)
        handled = CounterMetricFamily("grpc_server_handled", "RPCs completed on the server, regardless of success or failure.",
                                      labels=[*_GRPC, "grpc_code"])
        seconds = HistogramMetricFamily("grpc_server_handling_seconds", "Time to handle one RPC, until the server finished it.",
                                        labels=_GRPC)
        bounds = [floatToGoString(b) for b in (*RPC_BUCKETS, float("inf"))]
        for rpcs in sorted(list(_RPC_METRICS.values()), key=lambda m: m.labels):
            count, by_code, buckets, total = rpcs.read()
            labels = list(rpcs.labels)
            started.add_metric(labels, count, created=rpcs.created)
            for code, n in sorted(by_code.items()):
                handled.add_metric([*labels, code], n, created=rpcs.created)
            if count or by_code:
                cumulative, running = [], 0
                for bound, n in zip(bounds, buckets):
                    running += n
                    cumulative.append((bound, running))
                seconds.add_metric(labels, cumulative, total)
        yield from (started, handled, seconds)


REGISTRY.register(RpcCollector())


def grpc_type(client_stream: bool, server_stream: bool) -> str:
    """go-grpc-prometheus's grpc_type label of a method."""
    return {(False, False): "unary", (True, False): "client_stream", (False, True): "server_stream",
            (True, True): "bidi_stream"}[(client_stream, server_stream)]


def count_auth_denial(reason: str) -> None:
    AUTH_DENIALS.labels(reason).inc()


# ---- read from the runtime at scrape time ----------------------------------------------------------

class RuntimeCollector(Collector):
    """Queue depth, in-flight and total submissions, bytes copied, device failures and hangs."""

    def collect(self) -> Iterator[Any]:
        from tinydist.runtime import command_queue, device

        depth = GaugeMetricFamily("tinydist_queue_depth", "Batches waiting in a queue's inbox (not yet started).",
                                  labels=["device", "queue"])
        inflight = GaugeMetricFamily("tinydist_inflight_submissions", "Batches submitted and not yet completed.",
                                     labels=["device", "queue"])
        submitted = CounterMetricFamily("tinydist_submissions", "Batches submitted to a queue.", labels=["device", "queue"])
        completed = CounterMetricFamily("tinydist_completed_submissions", "Batches a queue completed (its timeline value).",
                                        labels=["device", "queue"])
        copied = CounterMetricFamily("tinydist_bytes_copied", "Bytes submitted in copy commands on a queue.",
                                     labels=["device", "queue"])
        for _ in range(3):  # another thread may open a device while we iterate
            try:
                queues = list(command_queue.QUEUES)
                break
            except RuntimeError:
                continue
        else:
            queues = []
        for q in sorted(queues, key=lambda q: q.name):
            if q.device.state.value == "closed":
                continue
            labels = [q.device.name, q.kind]
            done = q.timeline.value
            depth.add_metric(labels, q._inbox.qsize())
            inflight.add_metric(labels, max(q._submitted - done, 0))
            submitted.add_metric(labels, q._submitted)
            completed.add_metric(labels, done)
            copied.add_metric(labels, q.bytes_copied)
        failures = CounterMetricFamily("tinydist_device_failures", "Devices marked failed, by device and error type.",
                                       labels=["device", "reason"])
        hangs = CounterMetricFamily("tinydist_device_hangs", "Devices declared hung (DeviceHang) in this process.",
                                    labels=["device"])
        hang_counts: dict[str, int] = {}
        for (name, reason), count in sorted(device.FAILURES.items()):
            failures.add_metric([name, reason], count)
            if reason == "DeviceHang":
                hang_counts[name] = hang_counts.get(name, 0) + count
        for name, count in hang_counts.items():
            hangs.add_metric([name], count)
        kept = GaugeMetricFamily("tinydist_device_bytes_kept_for_stuck_workers",
                                 "Memory closed devices left mapped because a worker was stuck in a command.",
                                 labels=["device"])
        for name, nbytes in sorted(device.KEPT_FOR_STUCK_WORKERS.items()):
            kept.add_metric([name], nbytes)
        yield from (depth, inflight, submitted, completed, copied, failures, hangs, kept)


REGISTRY.register(RuntimeCollector())
# the standard process metrics (process_cpu_seconds_total, process_resident_memory_bytes, open fds, …),
# python_info and the garbage collector's counts, as prometheus_client's default registry has them
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)
GCCollector(registry=REGISTRY)


def _version() -> str:
    try:
        return importlib.metadata.version("tinydist")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


BUILD_INFO = Gauge("tinydist_build_info", "Always 1; the labels say which tinydist and Python this process runs.",
                   ["version", "python", "component"], registry=REGISTRY)


def set_component(component: str) -> None:
    """Name this process's role (`node`, `scheduler`, …) in tinydist_build_info; the default is `library`."""
    BUILD_INFO.clear()
    BUILD_INFO.labels(_version(), platform.python_version(), component).set(1)


set_component("library")


def render(registry: CollectorRegistry = REGISTRY) -> str:
    """The current metrics in Prometheus text format."""
    return generate_latest(registry).decode()


# ---- the HTTP endpoint -----------------------------------------------------------------------------

class MetricsServer:
    """A running `/metrics` endpoint; `close()` stops it."""

    def __init__(self, server: Any, thread: threading.Thread, host: str) -> None:
        self._server, self._thread = server, thread
        self.host = host
        self.port: int = server.server_address[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def serve_metrics(host: str = DEFAULT_ADDRESS[0], port: int = DEFAULT_ADDRESS[1], *, allow_remote: bool = False,
                  registry: CollectorRegistry = REGISTRY) -> MetricsServer:
    """Serve Prometheus text format at http://host:port/metrics on a daemon thread (port 0 picks a
    free one: read `.port`). Binds loopback only unless `allow_remote=True`: metrics name devices,
    methods and failure reasons, and the endpoint has no authentication."""
    host, port = bind_policy(host, port, loopback_only=not allow_remote, allow_wildcard=allow_remote,
                             remote_hint="the metrics endpoint has no authentication; pass allow_remote=True (and put "
                                         "it behind something that authenticates) to expose it")
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:      # the bare "[Errno 98] Address already in use" names no address
        raise OSError(exc.errno, f"cannot serve metrics on {host}:{port}: {exc.strerror}") from exc
    handle = MetricsServer(server, thread, host)
    log.info("serving metrics", url=handle.url)
    return handle


def parse_address(text: str) -> tuple[str, int]:
    """"127.0.0.1:9464", "[::1]:9464", ":9464" (loopback) or "9464" → (host, port)."""
    return parse_host_port(text, what="--metrics address", default_host=DEFAULT_ADDRESS[0])


def _metrics_address(text: str) -> tuple[str, int]:
    try:
        return parse_address(text)
    except ValueError as exc:   # argparse shows an ArgumentTypeError's own message, not "invalid value"
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_metrics_argument(parser: argparse.ArgumentParser) -> None:
    """`--metrics HOST:PORT` for daemons; pair with `serving_from_args(args)`."""
    parser.add_argument("--metrics", metavar="HOST:PORT", type=_metrics_address, default=None,
                        help="serve Prometheus metrics at http://HOST:PORT/metrics (loopback, e.g. 127.0.0.1:9464)")


@contextlib.contextmanager
def serving_from_args(args: argparse.Namespace) -> Iterator[MetricsServer | None]:
    """`--metrics` served for as long as the command runs (None without the flag). A refused
    address (not loopback) is a usage error of `args.parser`; a port in use stays an OSError
    (a runtime failure, exit 1)."""
    if getattr(args, "metrics", None) is None:
        yield None
        return
    host, port = args.metrics
    try:
        endpoint = serve_metrics(host, port)
    except ValueError as exc:
        args.parser.error(str(exc))
    try:
        yield endpoint
    finally:
        endpoint.close()
