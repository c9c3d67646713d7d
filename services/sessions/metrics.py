"""Prometheus metrics of one session manager process."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shared.metrics import LATENCY_BUCKETS_S, HttpMetrics

# Seconds between tokens: from a fast GPU step to a stalled stream.
INTER_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 5)


class SessionsMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.http = HttpMetrics(self.registry)
        self.jobs_published = Counter(
            "axon_sessions_jobs_published_total",
            "Jobs confirmed by the broker.",
            ["model"],
            registry=self.registry,
        )
        self.jobs_routed = Counter(
            "axon_sessions_jobs_routed_total",
            "Jobs confirmed by the broker, by the queue they went to: `home` (a session's or a"
            " conversation's worker, spilling to the shared queue after AXON_AFFINITY_WAIT_MS),"
            " `shared`, `home_missing` (the home's queue was gone: returned, then shared), or `batch`"
            " (a batch line's, to the model's batch queue).",
            ["model", "route"],
            registry=self.registry,
        )
        self.prefix_routes = Counter(
            "axon_sessions_prefix_routes_total",
            "Routing decisions of single-choice jobs, by reason: cached_prefix (the worker holding the"
            " prompt's longest cached prefix), load_spill (a less loaded worker than that one), session"
            " (the session's home), none (the shared queue: no worker holds a prefix of it, or the"
            " index was not read).",
            ["model", "reason"],
            registry=self.registry,
        )
        self.outcomes = Counter(
            "axon_sessions_requests_total",
            "Completions by outcome.",
            ["model", "outcome"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "axon_sessions_time_to_first_token_seconds",
            "From accepting a request to relaying its first chunk.",
            ["model"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.inter_token = Histogram(
            "axon_sessions_inter_chunk_latency_seconds",
            "Time between consecutive chunks of a stream.",
            ["model"],
            buckets=INTER_TOKEN_BUCKETS_S,
            registry=self.registry,
        )
        self.output_tokens = Counter(
            "axon_sessions_output_tokens_total",
            "Tokens relayed to clients.",
            ["model"],
            registry=self.registry,
        )
        self.history_cache = Counter(
            "axon_sessions_history_cache_total",
            "History reads, by whether Redis had them.",
            ["result"],
            registry=self.registry,
        )
        self.persisted_rows = Counter(
            "axon_sessions_persisted_rows_total", "Outbox rows committed to PostgreSQL.", registry=self.registry
        )
        self.persist_batch_size = Histogram(
            "axon_sessions_persist_batch_size",
            "Rows per persister batch.",
            buckets=(1, 5, 10, 25, 50, 100, 250, 500, 1000, 2000, 5000),
            registry=self.registry,
        )
        self.persist_duration = Histogram(
            "axon_sessions_persist_batch_duration_seconds",
            "Time to commit one persister batch.",
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.outbox_length = Gauge("axon_sessions_outbox_length", "Rows waiting in the outbox.", registry=self.registry)
        self.outbox_lag = Gauge(
            "axon_sessions_outbox_oldest_age_seconds",
            "Age of the oldest row waiting in the outbox.",
            registry=self.registry,
        )
        self.active_streams = Gauge(
            "axon_sessions_active_streams",
            "Jobs whose chunks this process is relaying.",
            registry=self.registry,
        )
        self.responses_leased = Gauge(
            "axon_sessions_responses_leased",
            "Unfinished stored responses this process holds the lease of (relays them).",
            registry=self.registry,
        )
        self.responses_taken_over = Counter(
            "axon_sessions_responses_taken_over_total",
            "Unfinished stored responses this process finished from their job's chunk log: `lease_expired` (their"
            " session manager died or stopped), `stream_lost` (its own relay lost their chunks).",
            ["reason"],
            registry=self.registry,
        )
        self.batches_leased = Gauge(
            "axon_sessions_batches_leased",
            "Unfinished batches this process owns (holds the lease of), i.e. runs.",
            registry=self.registry,
        )
        self.batches_taken_over = Counter(
            "axon_sessions_batches_taken_over_total",
            "Unfinished batches this process took over after their owner's lease expired.",
            ["reason"],
            registry=self.registry,
        )
        self.batch_lines = Counter(
            "axon_sessions_batch_lines_total",
            "Batch lines answered by this process, by outcome: `completed` (200) or `failed` (an error line).",
            ["model", "outcome"],
            registry=self.registry,
        )
        self.batch_lines_waiting = Gauge(
            "axon_sessions_batch_lines_waiting",
            "Lines of running batches not answered yet, per model (every session manager reports the same: take max).",
            ["model"],
            registry=self.registry,
        )
        self.batch_oldest_waiting = Gauge(
            "axon_sessions_batch_oldest_waiting_seconds",
            "Age of the oldest running batch with lines not answered yet, per model (since it went in_progress).",
            ["model"],
            registry=self.registry,
        )
        self.batch_lines_running = Gauge(
            "axon_sessions_batch_lines_running",
            "Batch lines this process runs now (released as jobs, not answered yet).",
            registry=self.registry,
        )
        self.active_sessions = Gauge(
            "axon_sessions_active_sessions",
            "Sessions with a turn this process is answering now.",
            registry=self.registry,
        )
        self.completion_requests = Counter(
            "axon_sessions_completion_requests_total",
            "Completion requests by route, model and the HTTP status they were answered with "
            "(200 for a stream, even if it later ends with an error event; see axon_sessions_requests_total).",
            ["route", "model", "status"],
            registry=self.registry,
        )
        # Polled every few seconds (queue_depth.py); every session manager reports the same
        # values, so dashboards take max by (model).
        self.queue_depth = Gauge(
            "axon_sessions_queue_depth",
            "Jobs ready in the model's RabbitMQ queue, not yet delivered to a worker.",
            ["model"],
            registry=self.registry,
        )
        self.queue_consumers = Gauge(
            "axon_sessions_queue_consumers",
            "Consumers (worker processes) on the model's RabbitMQ queue.",
            ["model"],
            registry=self.registry,
        )
        self.live_workers = Gauge(
            "axon_sessions_live_workers",
            "Workers with a live heartbeat, for every model served in the namespace in the last 7 days (0: none now).",
            ["model"],
            registry=self.registry,
        )
        self.cold_start_waits = Counter(
            "axon_sessions_cold_start_waits_total",
            "Requests queued while their model had no live worker (scale to zero), by how their wait"
            " for its first chunk ended: `served`, `timed_out` (503 no_worker), `disconnected`, `error`.",
            ["model", "outcome"],
            registry=self.registry,
        )
        self.cold_start_waiting = Gauge(
            "axon_sessions_cold_start_waiting",
            "Requests waiting now for a worker of their model to start.",
            ["model"],
            registry=self.registry,
        )
        self.cold_start_wait = Gauge(
            "axon_sessions_cold_start_wait_seconds",
            "How long a request for the model waits for a worker to start when none is live (0: 503 at"
            " once), for every model polled; above 0 its pool may scale to zero.",
            ["model"],
            registry=self.registry,
        )
        self.tenant_waiting = Gauge(
            "axon_sessions_tenant_waiting_jobs",
            "Jobs waiting in each tenant's queue of the model, by band (interactive, batch), as the"
            " fair share counts them in Redis.",
            ["model", "tenant", "band"],
            registry=self.registry,
        )
        self.fairness = Gauge(
            "axon_sessions_fairness_index",
            "Jain's index (1: equal; 1/n: one of n took all) of the weighted tokens served in the last"
            " poll interval to the tenants that had jobs waiting at both its ends, by model and band;"
            " 1 with fewer than two such tenants.",
            ["model", "band"],
            registry=self.registry,
        )
        self.queue_poll_errors = Counter(
            "axon_sessions_queue_poll_errors_total",
            "Queue depth polls that failed (RabbitMQ or Redis unreachable).",
            registry=self.registry,
        )
