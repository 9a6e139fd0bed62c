"""Metrics of the server: a small Prometheus registry (text exposition format 0.0.4) and the
server's own metrics on it (:class:`ServerMetrics`), with the runtime's statistics as gauges.

The server needs a handful of counters, gauges and histograms; a dependency for that would weigh
more than this module. Every metric is updated on the event-loop thread only, so there is no
locking.
"""

from __future__ import annotations

import logging
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

LabelValues = tuple[str, ...]


def _check_name(name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"metric name {name!r} is not a valid Prometheus name ([a-zA-Z_:][a-zA-Z0-9_:]*)")
    return name


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float) -> str:
    """Render a sample value the way Prometheus parses it (+Inf, -Inf, NaN, integers without '.0')."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _labels(names: Sequence[str], values: Sequence[str], extra: Mapping[str, str] | None = None) -> str:
    pairs = [(n, v) for n, v in zip(names, values)]
    if extra:
        pairs.extend(extra.items())
    if not pairs:
        return ""
    return "{" + ",".join(f'{n}="{_escape_label(str(v))}"' for n, v in pairs) + "}"


class _Metric(ABC):
    kind = "untyped"

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()) -> None:
        self.name = _check_name(name)
        self.help = help
        for label in labelnames:
            if not _LABEL.match(label) or label.startswith("__"):
                raise ValueError(f"metric {name}: label name {label!r} is not valid")
        self.labelnames = tuple(labelnames)

    def _key(self, labels: Mapping[str, str]) -> LabelValues:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"metric {self.name}: labels {sorted(labels)} given, {list(self.labelnames)} expected")
        return tuple(str(labels[n]) for n in self.labelnames)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {_escape_help(self.help)}", f"# TYPE {self.name} {self.kind}"]

    @abstractmethod
    def render(self) -> list[str]:
        """The metric's sample lines; each kind (counter, gauge, histogram) renders its own."""


class Counter(_Metric):
    """A monotonically increasing total, optionally split by labels."""

    kind = "counter"

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help, labelnames)
        self._values: dict[LabelValues, float] = {} if labelnames else {(): 0.0}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"counter {self.name} cannot decrease (inc by {amount})")
        key = self._key(labels)
        self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        return self._values.get(self._key(labels), 0.0)

    def render(self) -> list[str]:
        return self.header() + [
            f"{self.name}{_labels(self.labelnames, key)} {format_value(v)}" for key, v in sorted(self._values.items())
        ]


class Gauge(_Metric):
    """A value that goes up and down; either set directly or read from a callback at render time."""

    kind = "gauge"

    def __init__(self, name: str, help: str, fn: Callable[[], float] | None = None) -> None:
        super().__init__(name, help)
        self._value = 0.0
        self._fn = fn

    def set(self, value: float) -> None:
        self._value = float(value)

    def inc(self, amount: float = 1.0) -> None:
        self._value += amount

    def dec(self, amount: float = 1.0) -> None:
        self._value -= amount

    def value(self) -> float:
        return float(self._fn()) if self._fn is not None else self._value

    def render(self) -> list[str]:
        return self.header() + [f"{self.name} {format_value(self.value())}"]


class Histogram(_Metric):
    """Cumulative buckets plus _sum and _count, as Prometheus expects."""

    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: Iterable[float]) -> None:
        super().__init__(name, help)
        bounds = sorted(float(b) for b in buckets)
        if not bounds or any(math.isinf(b) or math.isnan(b) for b in bounds):
            raise ValueError(f"histogram {name}: buckets must be finite numbers, got {bounds}")
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # last bucket is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        i = 0
        while i < len(self.bounds) and value > self.bounds[i]:
            i += 1
        self._counts[i] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = self.header()
        running = 0
        for bound, n in zip([*self.bounds, math.inf], self._counts):
            running += n
            lines.append(f'{self.name}_bucket{{le="{format_value(bound)}"}} {running}')
        lines.append(f"{self.name}_sum {format_value(self.sum)}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


class Registry:
    """An ordered set of metrics plus optional collectors that emit extra samples at render time."""

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}
        self._collectors: list[Callable[[], Iterable[_Metric]]] = []

    def register(self, metric: _Metric) -> _Metric:
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} registered twice")
        self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Counter:
        return self.register(Counter(name, help, labelnames))  # type: ignore[return-value]

    def gauge(self, name: str, help: str, fn: Callable[[], float] | None = None) -> Gauge:
        return self.register(Gauge(name, help, fn))  # type: ignore[return-value]

    def histogram(self, name: str, help: str, buckets: Iterable[float]) -> Histogram:
        return self.register(Histogram(name, help, buckets))  # type: ignore[return-value]

    def add_collector(self, collect: Callable[[], Iterable[_Metric]]) -> None:
        """``collect()`` returns freshly built metrics each render (e.g. a snapshot of runtime stats)."""
        self._collectors.append(collect)

    def render(self) -> str:
        lines: list[str] = []
        seen = set(self._metrics)
        for metric in self._metrics.values():
            lines.extend(metric.render())
        for collect in self._collectors:
            for metric in collect():
                if metric.name in seen:
                    continue  # a collector never shadows a registered metric
                seen.add(metric.name)
                lines.extend(metric.render())
        return "\n".join(lines) + "\n"


# --- the server's metrics ----------------------------------------------------------------------

log = logging.getLogger("asyncside.serving")

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def runtime_samples(stats: Mapping[str, Any], prefix: str = "asyncside_runtime") -> dict[str, float]:
    """Flatten the numeric leaves of ``Runtime.stats()`` into metric names."""
    out: dict[str, float] = {}
    for key, value in stats.items():
        name = f"{prefix}_{re.sub(r'[^a-zA-Z0-9_]', '_', str(key))}"
        if isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, (int, float)) and math.isfinite(value):
            out[name] = float(value)
        elif isinstance(value, Mapping) and not any(str(k).isdigit() for k in value):
            out.update(runtime_samples(value, name))
        # per-layer maps (digit keys) and non-numbers are left to /health and the stats API
    return out


_MEMORY_HELP = {
    "mlx_active_bytes": "Bytes of MLX arrays alive (model weights, pools, KV caches)",
    "mlx_cache_bytes": "Bytes of freed buffers MLX keeps for reuse",
    "mlx_cache_limit_bytes": "Bound of MLX's cache of freed buffers (0: MLX's default, its memory limit)",
    "prompt_cache_bytes": "Bytes of KV caches the prompt cache keeps",
    "prompt_cache_limit_bytes": "Bound of the prompt cache in bytes",
    "kv_reserved_bytes": "Worst-case bytes of the admitted requests' KV caches (under a memory budget)",
    "kv_allowance_bytes": "The memory plan's KV allowance: what admitted requests' KV caches may take",
    "max_active_by_rows": ("Requests generating at once that the pools' rows hold a decode step of "
                           "(a plan reading past the page cache)"),
    "active_limit": ("Requests the engine lets generate at once now, within max_active_by_rows (chosen by "
                     "measured tokens per second)"),
    "staging_bytes": "Bytes of the reader's staging buffers (fixed at startup)",
    "host_tier_bytes": "Bytes of the host tier of expert records (fixed at startup)",
}


class ServerMetrics:
    """The server's metrics. ``engine()`` returns the running Batcher (None before startup) and
    ``runtime_stats()`` the runtime's statistics (None when there are none)."""

    def __init__(self, engine: Callable[[], Any], runtime_stats: Callable[[], Mapping[str, Any] | None],
                 health: Callable[[], Any] = lambda: None,
                 memory: Callable[[], Mapping[str, float]] = dict) -> None:
        self._runtime_stats = runtime_stats
        self._health = health
        self._memory = memory
        r = self.registry = Registry()
        self.requests = r.counter(
            "asyncside_http_requests_total", "HTTP requests answered, by endpoint and status", ("endpoint", "status")
        )
        self.prompt_tokens = r.counter("asyncside_prompt_tokens_total", "Prompt tokens of admitted requests",
                                       ("endpoint",))
        self.cached_tokens = r.counter("asyncside_cached_prompt_tokens_total",
                                       "Prompt tokens taken from the prefix cache", ("endpoint",))
        self.generated = r.counter("asyncside_generated_tokens_total", "Tokens generated", ("endpoint",))
        self.disconnects = r.counter(
            "asyncside_client_disconnects_total", "Requests ended because the client went away", ("endpoint",)
        )
        self.errors = r.counter(
            "asyncside_generation_errors_total", "Generations that failed with an error", ("endpoint",)
        )
        self.rejected = r.counter("asyncside_rejected_requests_total",
                                  "Requests refused because the queue was full (429)", ("endpoint",))
        self.timeouts = r.counter("asyncside_request_timeouts_total", "Requests that ran past the request timeout",
                                  ("endpoint",))
        self.ttft = r.histogram(
            "asyncside_time_to_first_token_seconds", "Time from request to first generated token", TTFT_BUCKETS
        )
        self.duration = r.histogram(
            "asyncside_request_duration_seconds", "Time from request to last byte of generation", DURATION_BUCKETS
        )
        self.batch = r.histogram("asyncside_decode_batch_size", "Requests in each decode step", BATCH_BUCKETS)
        self.active = r.gauge("asyncside_active_requests", "Generating requests in flight (HTTP)")

        def of(attr: str) -> Callable[[], float]:
            return lambda: float(getattr(engine(), attr, 0) or 0) if engine() is not None else 0.0

        r.gauge("asyncside_engine_requests", "Requests in the engine (prefilling or decoding)", of("active"))
        r.gauge("asyncside_waiting_requests", "Requests queued for an engine slot", of("waiting"))
        r.gauge("asyncside_decode_steps", "Decode steps taken by the engine", of("steps"))
        r.gauge("asyncside_decode_steps_ahead", "Decode steps queued on the previous step's lazy tokens",
                of("steps_ahead"))
        r.gauge("asyncside_decode_launch_seconds",
                "Wall time building and queuing decode steps (on the CPU with the chunks awaited in between)",
                of("launch_seconds"))
        r.gauge("asyncside_prefill_chunks", "Prefill forwards run (one request's chunk each, or a joint one's)",
                of("prefill_chunks"))
        r.gauge("asyncside_prefill_joined", "Requests whose chunk ran in a joint prefill forward with others",
                of("prefill_joined"))
        r.gauge("asyncside_prefill_seconds", "Wall time in prefill forwards, awaited", of("prefill_seconds"))
        r.gauge("asyncside_decode_wait_seconds",
                "Wall time awaiting decode steps' tokens (what building the next step did not overlap)",
                of("wait_seconds"))

        def host(phase: str) -> Callable[[], float]:
            def read() -> float:
                # The forward's queued steps count host time by phase (prefill chunks included).
                ns = getattr(getattr(getattr(getattr(engine(), "model", None), "forward", None), "queued", None),
                             "host_ns", None)
                if not isinstance(ns, Mapping):
                    return 0.0
                return float(ns.get(phase, 0)) if phase == "steps" else float(ns.get(phase, 0)) / 1e9
            return read

        r.gauge("asyncside_queued_steps_built", "Queued steps built (decode steps and prefill chunks)", host("steps"))
        for phase, what in (("begin", "the expert source's bookkeeping before a step"),
                            ("build", "building a step's graph"), ("end", "the expert source's bookkeeping after"),
                            ("plan", "walking a step's graph"),
                            ("schedule", "handing a step to MLX (on a GPU: encoding its kernels)")):
            r.gauge(f"asyncside_queued_step_host_seconds_{phase}", f"Host time in queued steps: {what}", host(phase))
        r.gauge("asyncside_prefill_tokens", "Prompt tokens computed by the engine", of("prefill_tokens"))
        r.add_collector(self._runtime_metrics)
        r.add_collector(self._health_metrics)
        r.add_collector(self._memory_metrics)

    def _memory_metrics(self) -> list[Gauge]:
        out = []
        for name, value in sorted(self._memory().items()):
            g = Gauge(f"asyncside_{name}", _MEMORY_HELP.get(name, "Bytes (a cache of the server or its bound)"))
            g.set(value)
            out.append(g)
        return out

    def _health_metrics(self) -> list[Gauge]:
        h = self._health()
        if h is None:
            return []
        out = []
        bad = Gauge("asyncside_bad_experts", "Experts whose record failed its read or checksum and has not "
                                             "verified since (/health is degraded while this is above 0)")
        bad.set(len(h.bad))
        out.append(bad)
        for kind in ("checksum", "short_read", "io_error"):
            g = Gauge(f"asyncside_expert_read_failures_{kind}", f"Expert reads that failed ({kind}), in all")
            g.set(h.read_failures.get(kind, 0))
            out.append(g)
        healed = Gauge("asyncside_experts_healed", "Bad experts that verified again (a repaired store), in all")
        healed.set(h.healed)
        reopened = Gauge("asyncside_blobs_reopened", "Blobs found replaced on disk and re-opened, in all")
        reopened.set(h.reopened)
        return out + [healed, reopened]

    def _runtime_metrics(self) -> list[Gauge]:
        try:
            stats = self._runtime_stats()
            if stats is None:
                return []
            samples = runtime_samples(stats)
        except Exception as exc:  # a metrics scrape must not take the server down
            log.warning("runtime stats failed: %s", exc)
            return []
        metrics = []
        for name, value in sorted(samples.items()):
            g = Gauge(name, "Runtime statistic (Runtime.stats())")
            g.set(value)
            metrics.append(g)
        return metrics

    def render(self) -> str:
        return self.registry.render()
