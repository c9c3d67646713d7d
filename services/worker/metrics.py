"""Prometheus metrics of one worker process (its own registry, built in the app factory)."""

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from shared.logging import get_logger
from shared.metrics import LATENCY_BUCKETS_S, HttpMetrics

log = get_logger(__name__)


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.http = HttpMetrics(self.registry)
        self.jobs = Counter(
            "axon_worker_jobs_total",
            "Jobs finished, by outcome.",
            ["model", "outcome"],
            registry=self.registry,
        )
        self.output_tokens = Counter(
            "axon_worker_output_tokens_total", "Tokens generated.", ["model"], registry=self.registry
        )
        self.prompt_tokens = Counter(
            "axon_worker_prompt_tokens_total",
            "Prompt tokens processed.",
            ["model"],
            registry=self.registry,
        )
        self.cached_prompt_tokens = Counter(
            "axon_worker_cached_prompt_tokens_total",
            "Prompt tokens the engine found in its prefix cache (not computed again).",
            ["model"],
            registry=self.registry,
        )
        self.prefix_index_blocks = Gauge(
            "axon_worker_prefix_index_blocks",
            "KV-cache blocks the engine holds, as its events told the prefix index.",
            ["model"],
            registry=self.registry,
        )
        self.prefix_index_anchors = Gauge(
            "axon_worker_prefix_index_anchors",
            "Prompt anchors in this worker's set of the prefix index (prefixes its engine holds).",
            ["model"],
            registry=self.registry,
        )
        self.prefix_index_lag = Histogram(
            "axon_worker_prefix_index_lag_seconds",
            "From the engine publishing a batch of KV-cache events to the prefix index holding it in Redis.",
            ["model"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=self.registry,
        )
        self.kv_event_gaps = Counter(
            "axon_worker_kv_event_gaps_total",
            "Gaps in the engine's KV-cache event stream, by how they healed: replay (from the engine's"
            " buffer), resync (the worker's set started afresh), restart (the engine's publisher began again).",
            ["model", "healed"],
            registry=self.registry,
        )
        self.running = Gauge(
            "axon_worker_running_sequences",
            "Sequences being generated now.",
            ["model"],
            registry=self.registry,
        )
        self.max_seqs = Gauge(
            "axon_worker_max_sequences",
            "Sequences the engine runs at once.",
            ["model"],
            registry=self.registry,
        )
        self.tenant_queue_wait = Histogram(
            "axon_worker_tenant_queue_wait_seconds",
            "From a job's publish (the session manager's clock) to a worker taking it, by tenant and"
            " band (interactive, batch): the wait the fair share decides. First attempts only.",
            ["model", "tenant", "band"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.tenant_tokens = Counter(
            "axon_worker_tenant_tokens_total",
            "Tokens served per tenant and band, by kind (prompt, output): what the fair share counts,"
            " at AXON_FAIR_PROMPT_TOKEN_COST and AXON_FAIR_OUTPUT_TOKEN_COST, divided by the tenant's weight.",
            ["model", "tenant", "band", "kind"],
            registry=self.registry,
        )
        self.tenant_sequences = Gauge(
            "axon_worker_tenant_sequences",
            "Jobs of each tenant running on this worker (its share of the worker's sequences).",
            ["model", "tenant"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "axon_worker_time_to_first_token_seconds",
            "From taking a job to publishing its first token.",
            ["model"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.job_duration = Histogram(
            "axon_worker_job_duration_seconds",
            "From taking a job to its final chunk.",
            ["model"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )

    def observe_engine(
        self,
        *,
        model: str,
        max_seqs: int,
        in_flight: Callable[[], int],
        generating: Callable[[], int],
        batch: Callable[[], int],
        kv_cache_usage: Callable[[], float | None] | None,
    ) -> None:
        """Gauges read at scrape time: waiting sequences, batch utilization, batch lines, KV cache (engines
        that report it), GPU memory (where a GPU exists)."""
        self.max_seqs.labels(model).set(max_seqs)
        Gauge(
            "axon_worker_waiting_sequences",
            "Jobs taken from the queue but not yet generating.",
            ["model"],
            registry=self.registry,
        ).labels(model).set_function(lambda: max(0, in_flight() - generating()))
        Gauge(
            "axon_worker_batch_utilization",
            "Running sequences / the most the engine runs at once.",
            ["model"],
            registry=self.registry,
        ).labels(model).set_function(lambda: generating() / max_seqs)
        Gauge(
            "axon_worker_batch_sequences",
            "Batch lines' jobs this worker runs (taken into free sequences; preempted by interactive jobs).",
            ["model"],
            registry=self.registry,
        ).labels(model).set_function(batch)
        if kv_cache_usage is not None:
            Gauge(
                "axon_worker_kv_cache_usage_ratio",
                "Fraction of the engine's KV cache in use.",
                ["model"],
                registry=self.registry,
            ).labels(model).set_function(lambda: kv_cache_usage() or 0.0)
        self._observe_gpu_memory()

    def include(self, families: Callable[[], Iterable[Metric]]) -> None:
        """Serve the metric families `families()` returns at each scrape (an engine's own)."""
        self.registry.register(_Families(families))

    def _observe_gpu_memory(self) -> None:
        """GPU memory in use per device, through NVML, only where a GPU and NVML exist."""
        try:
            import pynvml

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
        except Exception:  # noqa: BLE001 - no GPU, no driver or no NVML: nothing to report
            return
        gauge = Gauge(
            "axon_worker_gpu_memory_used_bytes",
            "GPU memory in use (all processes), per device.",
            ["device"],
            registry=self.registry,
        )
        for index in range(count):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)

            def memory_used(handle: object = handle) -> float:
                return float(pynvml.nvmlDeviceGetMemoryInfo(handle).used)  # the gauge takes float() of it anyway

            gauge.labels(str(index)).set_function(memory_used)
        log.info("gpu_metrics_enabled", devices=count)


class _Families(Collector):
    def __init__(self, families: Callable[[], Iterable[Metric]]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families()


class KvIndexMetrics:
    """The prefix index's metrics of one model (`services/worker/kv_index.py`)."""

    def __init__(self, metrics: WorkerMetrics, model: str) -> None:
        self._metrics = metrics
        self._model = model

    def index_size(self, blocks: int, anchors: int) -> None:
        self._metrics.prefix_index_blocks.labels(self._model).set(blocks)
        self._metrics.prefix_index_anchors.labels(self._model).set(anchors)

    def index_lag(self, seconds: float) -> None:
        self._metrics.prefix_index_lag.labels(self._model).observe(seconds)

    def gap(self, healed: str) -> None:
        self._metrics.kv_event_gaps.labels(self._model, healed).inc()
