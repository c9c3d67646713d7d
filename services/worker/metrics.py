"""Prometheus metrics of one worker process (its own registry, built in the app factory)."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shared.web import LATENCY_BUCKETS_S, HttpMetrics


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.http = HttpMetrics(self.registry)
        self.jobs = Counter(
            "axon_worker_jobs_total", "Jobs finished, by outcome.", ["model", "outcome"],
            registry=self.registry,
        )
        self.output_tokens = Counter(
            "axon_worker_output_tokens_total", "Tokens generated.", ["model"], registry=self.registry
        )
        self.prompt_tokens = Counter(
            "axon_worker_prompt_tokens_total", "Prompt tokens processed.", ["model"],
            registry=self.registry,
        )
        self.running = Gauge(
            "axon_worker_running_sequences", "Sequences being generated now.", ["model"],
            registry=self.registry,
        )
        self.max_seqs = Gauge(
            "axon_worker_max_sequences", "Sequences the engine runs at once.", ["model"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "axon_worker_time_to_first_token_seconds",
            "From taking a job to publishing its first token.", ["model"],
            buckets=LATENCY_BUCKETS_S, registry=self.registry,
        )
        self.job_duration = Histogram(
            "axon_worker_job_duration_seconds", "From taking a job to its final chunk.", ["model"],
            buckets=LATENCY_BUCKETS_S, registry=self.registry,
        )
