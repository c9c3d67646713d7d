"""Axon's services as child processes: started by kind with an environment, waited for until they are
ready, stopped or killed. `axon up`, the benchmarks and the end-to-end tests all start them here."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import httpx

SERVICE_MODULES = {
    "worker": "services.worker.main",
    "sessions": "services.sessions.main",
    "gateway": "services.gateway.main",
}
PORT_VARIABLES = {"worker": "AXON_WORKER_PORT", "sessions": "AXON_SESSIONS_PORT", "gateway": "AXON_GATEWAY_PORT"}
_LOG_TAIL_CHARS = 3000
# How long a killed process is given to be reaped.
_REAP_TIMEOUT_S = 10.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def environment_with(settings: Mapping[str, str]) -> dict[str, str]:
    """This process's environment with its own AXON_* settings replaced by `settings`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AXON_")}
    env.update(settings)
    return env


@dataclass
class Service:
    """A child process serving HTTP (or HTTPS) on 127.0.0.1:`port`, its output in `log_path` (None: the console)."""

    name: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path | None
    scheme: str = "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def exit_code(self) -> int | None:
        """None while it runs."""
        return self.process.poll()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def log_tail(self) -> str:
        return self.log_text()[-_LOG_TAIL_CHARS:]

    def terminate(self) -> None:
        """SIGTERM, if it still runs."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait_then_kill(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for it to exit, then SIGKILL it; returns the exit code."""
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout=_REAP_TIMEOUT_S)

    def stop(self, timeout_s: float = 30) -> int:
        """SIGTERM, then wait; returns the exit code."""
        self.terminate()
        return self.wait_then_kill(timeout_s)

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to clean up."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=_REAP_TIMEOUT_S)


class PrefixedConsole:
    """This process's stdout shared by its children: each line of theirs written whole (never split
    or interleaved with another), after its process's name (`gateway  | ...`)."""

    def __init__(self, names: Sequence[str], out: IO[bytes] | None = None) -> None:
        self._width = max((len(name) for name in names), default=0)
        self._out = out if out is not None else sys.stdout.buffer
        self._lock = threading.Lock()
        self._gone = False

    def write(self, text: str) -> None:
        """Write `text` (whole lines) at once, between the children's lines."""
        self._write(text.encode())

    def follow(self, name: str, pipe: IO[bytes]) -> threading.Thread:
        """Copy `pipe` line by line, prefixed with `name`, until it closes (in a thread of its own)."""
        prefix = f"{name:<{self._width}} | ".encode()

        def copy() -> None:
            with pipe:
                for line in iter(pipe.readline, b""):
                    self._write(prefix + (line if line.endswith(b"\n") else line + b"\n"))

        thread = threading.Thread(target=copy, name=f"console-{name}", daemon=True)
        thread.start()
        return thread

    def _write(self, data: bytes) -> None:
        with self._lock:
            if self._gone:
                return
            try:
                self._out.write(data)
                self._out.flush()
            except OSError:
                # The terminal closed (EIO) or the pipe's reader left (EPIPE): nobody reads any more,
                # and the children's lines are still drained, so none of them blocks writing.
                self._gone = True


def start_process(
    name: str,
    argv: list[str],
    *,
    env: dict[str, str],
    port: int,
    log_path: Path | None,
    console: PrefixedConsole | None = None,
    scheme: str = "http",
    own_session: bool = False,
) -> Service:
    """Run `argv`, its stdout and stderr written to `log_path` (truncated first), else to `console`,
    else straight to this process's own. With `own_session`, in a session (and process group) of
    its own, reading nothing: a terminal's Ctrl+C reaches this process alone, which decides what
    its children get."""
    options: dict[str, Any] = {"env": env}
    if own_session:
        options.update(start_new_session=True, stdin=subprocess.DEVNULL)
    if log_path is None and console is not None:
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **options)
        assert process.stdout is not None
        console.follow(name, process.stdout)
        return Service(name, port, process, None, scheme)
    if log_path is None:
        return Service(name, port, subprocess.Popen(argv, **options), None, scheme)
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, **options)
    return Service(name, port, process, log_path, scheme)


def start_service(
    kind: str,
    *,
    env: dict[str, str],
    port: int,
    name: str | None = None,
    log_path: Path | None = None,
    console: PrefixedConsole | None = None,
    own_session: bool = False,
) -> Service:
    """An Axon service (`worker`, `sessions`, `gateway`) as its console script runs it, listening on `port`
    (a gateway given a certificate, `AXON_TLS_CERTFILE`, with HTTPS); `own_session` as `start_process`'s."""
    return start_process(
        name or kind,
        [sys.executable, "-m", SERVICE_MODULES[kind]],
        env={**env, PORT_VARIABLES[kind]: str(port)},
        port=port,
        log_path=log_path,
        console=console,
        scheme="https" if kind == "gateway" and env.get("AXON_TLS_CERTFILE") else "http",
        own_session=own_session,
    )


def stop_all(services: Sequence[Service], timeout_s: float) -> None:
    """SIGTERM to every one (the last started first), then wait for them all until one deadline, killing the late."""
    for service in reversed(services):
        service.terminate()
    deadline = time.monotonic() + timeout_s
    for service in services:
        service.wait_then_kill(max(0.1, deadline - time.monotonic()))


class ServiceExited(RuntimeError):
    """A service's process ended before it was ready."""

    def __init__(self, service: Service) -> None:
        super().__init__(f"{service.name} exited with code {service.exit_code}:\n{service.log_tail()}")
        self.service = service


class NotReadyInTime(TimeoutError):
    """Services still not ready at the deadline."""

    def __init__(self, pending: list[Service], timeout_s: float) -> None:
        logs = "\n".join(f"{service.name}:\n{service.log_tail()}" for service in pending)
        names = ", ".join(service.name for service in pending)
        super().__init__(f"{names} not ready in {timeout_s}s:\n{logs}")
        self.pending = pending


class ReadyProgress(Protocol):
    """Told what each probe of a starting service found (`axon up` prints it)."""

    def ready(self, service: Service) -> None: ...

    def waiting(self, service: Service, reason: str) -> None: ...


def wait_ready(
    services: Sequence[Service],
    *,
    timeout_s: float,
    path: str = "/ready",
    poll_interval_s: float = 0.1,
    progress: ReadyProgress | None = None,
    stop_requested: Callable[[], bool] | None = None,
) -> None:
    """Until `GET path` answers 200 on every one of `services`, or `stop_requested()` is true.

    Raises:
        ServiceExited: one exited first (the message ends with its log's tail).
        NotReadyInTime: some were still not ready after `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    pending = list(services)
    # Only our own children on the loopback interface are asked, and a certificate made for the
    # gateway's public name cannot match 127.0.0.1: a readiness probe does not verify it.
    with httpx.Client(timeout=2, verify=False) as client:
        while pending and time.monotonic() < deadline:
            if stop_requested is not None and stop_requested():
                return
            for service in list(pending):
                if _answers_ready(client, service, path, progress):
                    pending.remove(service)
            if pending:
                time.sleep(poll_interval_s)
    if pending:
        raise NotReadyInTime(pending, timeout_s)


def _answers_ready(client: httpx.Client, service: Service, path: str, progress: ReadyProgress | None) -> bool:
    if service.exit_code is not None:
        raise ServiceExited(service)
    try:
        response = client.get(f"{service.url}{path}")
    except httpx.HTTPError:
        return False
    if response.status_code == 200:
        if progress is not None:
            progress.ready(service)
        return True
    if progress is not None:
        progress.waiting(service, response.json().get("reason", "starting"))
    return False
