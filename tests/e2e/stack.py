"""Start Axon's services as real processes for end-to-end tests."""

from dataclasses import dataclass, field
from pathlib import Path

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
    services: list[Service] = field(default_factory=list)

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
        launcher.wait_ready([service], timeout_s=ready_timeout_s, path=ready_path)
        return service

    def close(self) -> None:
        for service in reversed(self.services):
            service.stop(timeout_s=15)
