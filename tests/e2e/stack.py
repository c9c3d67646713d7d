"""Start Axon's services as real processes for end-to-end tests, and break their connections."""

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import redis

from services.cli import launcher
from services.cli.launcher import Service

ADMIN_TOKEN = "e2e-admin-token-0123456789abcdef"
# The credential of the hops between the run's own services (the gateway holds it).
INTERNAL_TOKEN = "e2e-internal-token-0123456789abcdef-0123456789"
INTERNAL_AUTH = {"authorization": f"Bearer {INTERNAL_TOKEN}"}


@dataclass
class Stack:
    """A set of Axon processes sharing one namespace and this run's servers (`service_urls`);
    stops them all on `close()`."""

    namespace: str
    database_url: str
    redis_url: str
    amqp_url: str
    log_dir: Path
    # The workers' AXON_MODEL_CACHE_DIR (where they convert a GGUF once), unless a test sets its own.
    model_cache_dir: Path | None = None
    services: list[Service] = field(default_factory=list)
    # Every service any stack of this test process started, in order: tests/e2e/conftest.py stops
    # those a module's tests started when the module ends.
    started: ClassVar[list[Service]] = []

    def env(self, extra: dict[str, str]) -> dict[str, str]:
        return launcher.environment_with(
            {
                "AXON_NAMESPACE": self.namespace,
                "AXON_REDIS_URL": self.redis_url,
                "AXON_AMQP_URL": self.amqp_url,
                "AXON_DATABASE_URL": self.database_url,
                "AXON_LOG_FORMAT": "json",
                "AXON_LOG_LEVEL": "INFO",
                "AXON_ADMIN_TOKEN": ADMIN_TOKEN,
                "AXON_INTERNAL_TOKEN": INTERNAL_TOKEN,
                **({"AXON_MODEL_CACHE_DIR": str(self.model_cache_dir)} if self.model_cache_dir else {}),
                **extra,
            }
        )

    def start(
        self,
        name: str,
        *,
        env: dict[str, str] | None = None,
        ready_timeout_s: float = 60,
        ready_path: str = "/ready",
        port: int | None = None,
    ) -> Service:
        port = port or launcher.free_port()
        service = launcher.start_service(
            name.split(":")[0],
            env=self.env(env or {}),
            port=port,
            name=name,
            log_path=self.log_dir / f"{name.replace(':', '-')}-{port}.log",
        )
        self.services.append(service)
        Stack.started.append(service)
        launcher.wait_ready([service], timeout_s=ready_timeout_s, path=ready_path)
        return service

    def close(self) -> None:
        for service in reversed(self.services):
            service.stop(timeout_s=15)


def kill_subscribers(redis_url: str, pid: int) -> int:
    """Close the Redis pub/sub connections of process `pid` (as a Redis failover would); returns
    how many."""
    client = redis.Redis.from_url(redis_url)
    redis_port = client.connection_pool.connection_kwargs["port"]
    listing = subprocess.run(["ss", "-tnpH", "state", "established"], capture_output=True, text=True, check=True)
    ports = set()
    for line in listing.stdout.splitlines():
        if f"pid={pid}," in line:
            local, peer = [field for field in line.split() if field.count(":") == 1][:2]
            if peer.endswith(f":{redis_port}"):
                ports.add(local.rsplit(":", 1)[1])
    killed = 0
    try:
        for entry in client.client_list(_type="pubsub"):
            if entry["addr"].rsplit(":", 1)[1] in ports:
                killed += client.client_kill_filter(_id=entry["id"])
    finally:
        client.close()
    return killed
