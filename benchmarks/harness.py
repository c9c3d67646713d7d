"""What the benchmarks share: a database and Redis namespace of their own, real service processes,
API keys, and the CPU time each process (and Redis, RabbitMQ, PostgreSQL) spends.

Everything a benchmark creates is removed at the end (`BenchEnvironment` is a context manager).
"""

import asyncio
import os
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg

from services.cli import launcher
from services.cli.launcher import Service
from services.worker.engines.gguf import bundled_gguf_path
from shared.keys import KeyLimits, KeyRepository
from shared.migrations import drop_database, migrate, split_database_url

ADMIN_TOKEN = "bench-admin-token-0123456789abcdef"
# The credential of the hops between the run's own services (the gateway holds it).
INTERNAL_TOKEN = "bench-internal-token-0123456789abcdef-0123456789"
# Limits far above anything a benchmark sends: every request is admitted, but all three limits
# (requests, tokens, concurrency) are checked on every request, as in production.
UNLIMITED = KeyLimits(rpm=1_000_000_000, tpm=2_000_000_000, max_concurrent=100_000)
# The shared servers whose CPU a benchmark also reports (process name patterns for pgrep).
SERVERS = {"redis": "redis-server", "rabbitmq": "beam.smp", "postgres": "postgres"}


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time a process (all its threads) has used so far; None off Linux."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_pids() -> dict[str, list[int]]:
    """The pids of the local Redis, RabbitMQ and PostgreSQL servers (empty where not found)."""
    pids = {}
    for name, pattern in SERVERS.items():
        found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True, check=False).stdout.split()
        pids[name] = [int(pid) for pid in found]
    return pids


@dataclass
class BenchEnvironment:
    """A database (`axon_bench_<id>`), Redis namespace and log folder of one benchmark run."""

    postgres_url: str = os.environ.get("AXON_BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    redis_url: str = os.environ.get("AXON_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
    amqp_url: str = os.environ.get("AXON_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
    # Traces of every service of the run (issue 30's overhead figures): the collector's URL
    # (`AXON_OTLP_ENDPOINT`; empty: tracing off) and the share of requests traced.
    otlp_endpoint: str = os.environ.get("AXON_BENCH_OTLP_ENDPOINT", "")
    trace_sample_ratio: str = os.environ.get("AXON_BENCH_TRACE_SAMPLE_RATIO", "1.0")
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:10])
    processes: list[Service] = field(default_factory=list)
    # Models whose job queues this run declared (removed with the run).
    models: set[str] = field(default_factory=set)
    # Tenants of the run's keys: the fair share's queues of each model and tenant are removed too.
    tenants: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.namespace = f"axon_bench_{self.run_id}"
        admin_url, _ = split_database_url(self.postgres_url)
        self.database_url = admin_url.rsplit("/", 1)[0] + f"/axon_bench_{self.run_id}"
        self.log_dir = Path(tempfile.mkdtemp(prefix="axon-bench-"))

    def __enter__(self) -> "BenchEnvironment":
        asyncio.run(migrate(self.database_url))
        return self

    def __exit__(self, *_exc: object) -> None:
        for process in reversed(self.processes):
            process.stop(timeout_s=20)
        print("removing the benchmark's database, Redis keys and queues...", file=sys.stderr, flush=True)
        asyncio.run(drop_database(self.database_url))
        asyncio.run(_delete_namespace(self.redis_url, self.namespace))
        asyncio.run(_delete_topology(self.amqp_url, self.namespace, self.models, self.tenants))

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of a service of this run (the caller's own AXON_* settings dropped)."""
        return launcher.environment_with(
            {
                "AXON_NAMESPACE": self.namespace,
                "AXON_REDIS_URL": self.redis_url,
                "AXON_AMQP_URL": self.amqp_url,
                "AXON_DATABASE_URL": self.database_url,
                "AXON_ADMIN_TOKEN": ADMIN_TOKEN,
                "AXON_INTERNAL_TOKEN": INTERNAL_TOKEN,
                "AXON_LOG_LEVEL": "INFO",
                "AXON_OTLP_ENDPOINT": self.otlp_endpoint,
                "AXON_TRACE_SAMPLE_RATIO": self.trace_sample_ratio,
                **(extra or {}),
            }
        )

    def create_key(self, limits: KeyLimits = UNLIMITED, *, tenant: str = "bench") -> str:
        """A new API key of `tenant` in this run's database (printed nowhere)."""
        self.tenants.add(tenant)

        async def create() -> str:
            pool = await asyncpg.create_pool(self.database_url, min_size=1, max_size=1)
            try:
                key, _record = await KeyRepository(pool).create(name=tenant, limits=limits, tenant=tenant)
                return key
            finally:
                await pool.close()

        return asyncio.run(create())

    def start(
        self, name: str, argv: list[str], *, env: dict[str, str] | None = None, port: int | None = None
    ) -> Service:
        process = launcher.start_process(
            name, argv, env=self.env(env), port=port or launcher.free_port(), log_path=self.log_dir / f"{name}.log"
        )
        self.processes.append(process)
        return process

    def start_service(
        self, kind: str, *, env: dict[str, str] | None = None, name: str | None = None, ready_timeout_s: float = 300
    ) -> Service:
        """An Axon service (`worker`, `sessions`, `gateway`) as its console script runs it, once ready
        (a vLLM worker's first start also converts the bundled model: minutes on a busy machine)."""
        name = name or kind
        process = launcher.start_service(
            kind, env=self.env(env), port=launcher.free_port(), name=name, log_path=self.log_dir / f"{name}.log"
        )
        self.processes.append(process)
        launcher.wait_ready([process], timeout_s=ready_timeout_s)
        return process

    def start_stack(self, worker_env: dict[str, str], *, label: str = "") -> dict[str, Service]:
        """Worker, session manager and gateway, as `axon up` starts them (`label`, for several stacks
        in one run: put after their names, `worker-<label>`, …)."""
        suffix = f"-{label}" if label else ""
        self.models.add(worker_env["AXON_MODEL"])
        worker = self.start_service("worker", env=worker_env, name=f"worker{suffix}")
        sessions = self.start_service("sessions", name=f"sessions{suffix}")
        gateway = self.start_service("gateway", name=f"gateway{suffix}", env={"AXON_SESSIONS_URL": sessions.url})
        return {"worker": worker, "sessions": sessions, "gateway": gateway}


def loop_factory() -> Any:
    """uvloop's event loop where it is installed (as the services run), else asyncio's default."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def start_gateways(env: "BenchEnvironment", affinity_wait_ms: int) -> dict[str, Service]:
    """Two session managers, each with a gateway: `on` with `AXON_AFFINITY_WAIT_MS` = `affinity_wait_ms`,
    `off` with 0 (every job to its model's shared queue)."""
    gateways = {}
    for label, wait in (("on", affinity_wait_ms), ("off", 0)):
        sessions = env.start_service("sessions", name=f"sessions-{label}", env={"AXON_AFFINITY_WAIT_MS": str(wait)})
        gateways[label] = env.start_service("gateway", name=f"gateway-{label}", env={"AXON_SESSIONS_URL": sessions.url})
    return gateways


def start_vllm_workers_per_core(
    env: "BenchEnvironment", model: str, *, label: str, settings: dict[str, str] | None = None
) -> list[Service]:
    """One vLLM worker of `model` per core (0 and 1: `AXON_CPU_THREADS_BIND`), on the bundled
    model, with more `settings`; ids `bench-<label>-<core>`."""
    return [
        env.start_service(
            "worker",
            name=f"worker-{core}",
            env={
                "AXON_ENGINE": "vllm",
                "AXON_MODEL": model,
                "AXON_MODEL_PATH": str(bundled_gguf_path()),
                "AXON_CPU_THREADS_BIND": str(core),
                "AXON_WORKER_ID": f"bench-{label}-{core}",
                **(settings or {}),
            },
            ready_timeout_s=900,
        )
        for core in (0, 1)
    ]


def start_service_pair(env: "BenchEnvironment", label: str, sessions_env: dict[str, str]) -> Service:
    """A session manager with `sessions_env` and a gateway in front of it (returned)."""
    sessions = env.start_service("sessions", name=f"sessions-{label}", env=sessions_env)
    return env.start_service("gateway", name=f"gateway-{label}", env={"AXON_SESSIONS_URL": sessions.url})


class CpuMeter:
    """CPU seconds each watched process spends between `start()` and `stop()`."""

    def __init__(self, pids: dict[str, list[int]]) -> None:
        self._pids = pids
        self._before: dict[str, float] = {}
        self.seconds: dict[str, float] = {}

    def _read(self) -> dict[str, float]:
        return {name: sum(cpu_seconds(pid) or 0.0 for pid in pids) for name, pids in self._pids.items()}

    def start(self) -> None:
        self._before = self._read()

    def stop(self) -> dict[str, float]:
        after = self._read()
        self.seconds = {name: after[name] - self._before.get(name, 0.0) for name in after}
        return self.seconds


async def _delete_namespace(redis_url: str, namespace: str) -> None:
    from shared.clients import create_redis

    client = create_redis(redis_url, timeout_s=5)
    try:
        # After a long run the namespace holds hundreds of thousands of keys: one UNLINK a page.
        page: list[bytes] = []
        async for name in client.scan_iter(match=f"{namespace}:*", count=1000):
            page.append(name)
            if len(page) == 1000:
                await client.unlink(*page)
                page.clear()
        if page:
            await client.unlink(*page)
    finally:
        await client.aclose()


async def _delete_topology(
    amqp_url: str, namespace: str, models: set[str], tenants: frozenset[str] | set[str] = frozenset()
) -> None:
    import aio_pika

    from shared.names import Names

    names = Names(namespace)
    connection = await aio_pika.connect(amqp_url, timeout=10)
    try:
        channel = await connection.channel()
        queues = [*(names.jobs_queue(model) for model in models), *(names.batch_queue(model) for model in models)]
        queues += [
            names.tenant_queue(model, tenant, batch=batch)
            for model in models
            for tenant in tenants
            for batch in (False, True)
        ]
        for queue in [*queues, names.dead_letter_queue]:
            await channel.queue_delete(queue)
        for exchange in (names.jobs_exchange, names.dead_letter_exchange):
            await channel.exchange_delete(exchange)
    finally:
        await connection.close()
