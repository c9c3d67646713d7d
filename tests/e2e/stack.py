"""Start Axon's services as real processes for end-to-end tests."""

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ADMIN_TOKEN = "e2e-admin-token-0123456789abcdef"

_MODULES = {
    "worker": "services.worker.main",
    "sessions": "services.sessions.main",
    "gateway": "services.gateway.main",
}
_PORT_VARS = {"worker": "AXON_WORKER_PORT", "sessions": "AXON_SESSIONS_PORT", "gateway": "AXON_GATEWAY_PORT"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Service:
    name: str
    port: int
    process: subprocess.Popen
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to clean up."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)

    def stop(self, timeout_s: float = 30) -> int:
        """SIGTERM, then wait; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout=10)


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
        env = {k: v for k, v in os.environ.items() if not k.startswith("AXON_")}
        env.update(
            AXON_NAMESPACE=self.namespace,
            AXON_REDIS_URL=self.redis_url,
            AXON_AMQP_URL=self.amqp_url,
            AXON_DATABASE_URL=self.database_url,
            AXON_LOG_FORMAT="json",
            AXON_LOG_LEVEL="INFO",
            AXON_ADMIN_TOKEN=ADMIN_TOKEN,
        )
        env.update(extra)
        return env

    def start(
        self,
        name: str,
        *,
        env: dict[str, str] | None = None,
        ready_timeout_s: float = 60,
        ready_path: str = "/ready",
        port: int | None = None,
    ) -> Service:
        kind = name.split(":")[0]
        port = port or free_port()
        extra = {_PORT_VARS[kind]: str(port), **(env or {})}
        log_path = self.log_dir / f"{name.replace(':', '-')}-{port}.log"
        with log_path.open("wb") as log_file:
            process = subprocess.Popen(
                [sys.executable, "-m", _MODULES[kind]],
                env=self.env(extra),
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        service = Service(name, port, process, log_path)
        self.services.append(service)
        self.wait_ready(service, timeout_s=ready_timeout_s, path=ready_path)
        return service

    def wait_ready(self, service: Service, *, timeout_s: float, path: str = "/ready") -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if service.process.poll() is not None:
                raise RuntimeError(f"{service.name} exited early:\n{service.log_text()[-3000:]}")
            try:
                if httpx.get(f"{service.url}{path}", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{service.name} not ready in {timeout_s}s:\n{service.log_text()[-3000:]}")

    def close(self) -> None:
        for service in reversed(self.services):
            service.stop(timeout_s=15)
