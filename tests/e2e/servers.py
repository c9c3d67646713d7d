"""Private Redis, RabbitMQ and PostgreSQL servers for the tests that stop and restart one.

Each runs from the machine's own binaries (Debian's packages) on a spare loopback port, with its
data in a temporary folder, so stopping it touches nothing shared. Stopping is graceful (SIGTERM:
Redis writes its append-only file, RabbitMQ and PostgreSQL shut down cleanly) and starting again
reuses the same data.
"""

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from services.cli.launcher import free_port

RABBITMQ_SERVER = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
POSTGRES_BIN = next(iter(sorted(Path("/usr/lib/postgresql").glob("*/bin"))), Path("/nonexistent"))


def _wait_port(port: int, *, up: bool, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            sock.settimeout(0.5)
            listening = sock.connect_ex(("127.0.0.1", port)) == 0
        if listening == up:
            return
        time.sleep(0.1)
    raise TimeoutError(f"port {port} did not go {'up' if up else 'down'} in {timeout_s} s")


class _Server:
    """A server process started with `argv`, stopped with SIGTERM."""

    name = "server"
    start_timeout_s = 30.0

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.process: subprocess.Popen | None = None
        self.log_path = root / f"{self.name}.log"

    def argv(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return dict(os.environ)

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(self.argv(), env=self.env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_port(self.port, up=True, timeout_s=self.start_timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"{self.name} did not start:\n{self.log_path.read_text(errors='replace')[-3000:]}"
            ) from None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        _wait_port(self.port, up=False, timeout_s=10)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


class PrivateRedis(_Server):
    """redis-server with the append-only file on (`appendfsync everysec`), as production runs it."""

    name = "redis"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def argv(self) -> list[str]:
        return [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.root),
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--save",
            "",
            "--daemonize",
            "no",
        ]


class PrivateRabbitMQ(_Server):
    """A RabbitMQ node of its own (node name, ports, database), no plugins."""

    name = "rabbitmq"
    start_timeout_s = 60.0

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.dist_port = free_port()
        self.node = f"axontest{self.port}@localhost"
        (root / "enabled_plugins").write_text("[].\n")

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def argv(self) -> list[str]:
        return [str(RABBITMQ_SERVER)]

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "HOME": str(self.root),
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.root / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.root / "log"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.root / "enabled_plugins"),
            "RABBITMQ_CONFIG_FILE": str(self.root / "none"),
            # The start script then runs the Erlang VM in its own process: SIGTERM stops the broker.
            "RUNNING_UNDER_SYSTEMD": "true",
        }


class PrivatePostgres(_Server):
    """A PostgreSQL cluster of its own (initdb on first start), trust auth, user postgres."""

    name = "postgres"

    def __init__(self, root: Path) -> None:
        # A folder of its own under /tmp: as root the server runs as `postgres` (initdb refuses to
        # run as root), which cannot enter pytest's private temporary folders.
        super().__init__(Path(tempfile.mkdtemp(prefix="axon-test-postgres-")))
        self.data = self.root / "pgdata"
        self._user = "postgres" if os.geteuid() == 0 else None

    @property
    def admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _as_user(self, argv: list[str]) -> list[str]:
        return ["runuser", "-u", self._user, "--", *argv] if self._user else argv

    def argv(self) -> list[str]:
        return self._as_user(
            [
                str(POSTGRES_BIN / "postgres"),
                "-D",
                str(self.data),
                "-p",
                str(self.port),
                "-k",
                str(self.root),
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "fsync=off",
            ]
        )

    def remove(self) -> None:
        """Delete its data (stop it first)."""
        shutil.rmtree(self.root, ignore_errors=True)

    def start(self) -> None:
        if not self.data.exists():
            if self._user:
                shutil.chown(self.root, user=self._user)
            subprocess.run(
                self._as_user([str(POSTGRES_BIN / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres"]),
                check=True,
                capture_output=True,
            )
        super().start()


def available() -> dict[str, bool]:
    """Which private servers this machine can run."""
    return {
        "redis": shutil.which("redis-server") is not None,
        "rabbitmq": RABBITMQ_SERVER.exists(),
        "postgres": (POSTGRES_BIN / "initdb").exists() and (os.geteuid() != 0 or _has_user("postgres")),
    }


def _has_user(name: str) -> bool:
    with contextlib.suppress(KeyError):
        pwd.getpwnam(name)
        return True
    return False
