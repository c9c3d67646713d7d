"""services.cli.launcher: waiting for readiness, failing early on exit, stopping and killing, against
small stand-in processes (a few lines of Python each) rather than Axon's services."""

import os
import signal
import sys
from pathlib import Path

import pytest

from services.cli.launcher import (
    NotReadyInTime,
    Service,
    ServiceExited,
    environment_with,
    free_port,
    start_process,
    stop_all,
    wait_ready,
)

# Answers /ready 503 {"reason": "loading"} twice, then 200; ignores SIGTERM when told to.
_SERVER = """
import http.server, json, signal, sys
if sys.argv[2] == "ignore-sigterm":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
answers = iter([503, 503])
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        status = next(answers, 200)
        body = json.dumps({"reason": "loading"} if status != 200 else {}).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
print("listening", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


class Heard:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def ready(self, service: Service) -> None:
        self.events.append((service.name, "ready"))

    def waiting(self, service: Service, reason: str) -> None:
        self.events.append((service.name, reason))


def _server(tmp_path: Path, *, ignore_sigterm: bool = False) -> Service:
    port = free_port()
    argv = [sys.executable, "-c", _SERVER, str(port), "ignore-sigterm" if ignore_sigterm else "-"]
    return start_process("fake", argv, env=dict(os.environ), port=port, log_path=tmp_path / "fake.log")


def test_waits_until_ready_and_reports_each_answer(tmp_path: Path) -> None:
    service = _server(tmp_path)
    heard = Heard()
    try:
        wait_ready([service], timeout_s=10, poll_interval_s=0.05, progress=heard)
        assert heard.events[-1] == ("fake", "ready")
        assert heard.events.count(("fake", "loading")) == 2
        assert service.log_text() == "listening\n"
    finally:
        assert service.stop(timeout_s=5) == -signal.SIGTERM


def test_a_process_that_exits_fails_the_wait_with_its_log(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"]
    service = start_process("doomed", argv, env=dict(os.environ), port=free_port(), log_path=tmp_path / "doomed.log")
    with pytest.raises(ServiceExited, match="doomed exited with code 3:\nno model here") as raised:
        wait_ready([service], timeout_s=10)
    assert raised.value.service is service


def test_not_ready_by_the_deadline_names_the_late(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import time; time.sleep(30)"]
    service = start_process("silent", argv, env=dict(os.environ), port=free_port(), log_path=tmp_path / "silent.log")
    try:
        with pytest.raises(NotReadyInTime, match=r"silent not ready in 0\.3s") as raised:
            wait_ready([service], timeout_s=0.3)
        assert raised.value.pending == [service]
    finally:
        service.kill()
    assert service.exit_code == -signal.SIGKILL


def test_stop_kills_what_ignores_sigterm(tmp_path: Path) -> None:
    service = _server(tmp_path, ignore_sigterm=True)
    wait_ready([service], timeout_s=10, poll_interval_s=0.05)
    assert service.stop(timeout_s=0.5) == -signal.SIGKILL


def test_stop_all_stops_every_one(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    services = [_server(tmp_path / "a"), _server(tmp_path / "b", ignore_sigterm=True)]
    wait_ready(services, timeout_s=10, poll_interval_s=0.05)
    stop_all(services, timeout_s=1)
    assert [s.exit_code for s in services] == [-signal.SIGTERM, -signal.SIGKILL]


def test_environment_with_replaces_the_callers_axon_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AXON_NAMESPACE", "mine")
    monkeypatch.setenv("AXON_ENGINE", "vllm")
    env = environment_with({"AXON_NAMESPACE": "theirs"})
    assert env["AXON_NAMESPACE"] == "theirs"
    assert "AXON_ENGINE" not in env
    assert env["PATH"] == os.environ["PATH"]
