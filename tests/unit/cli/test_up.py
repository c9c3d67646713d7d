"""`axon up`'s console, its children's environment, its stop signals and its local key's file."""

import io
import os
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.cli import up
from services.cli.launcher import PrefixedConsole, Service, free_port, start_process
from services.cli.local_key import LocalKey, admin_token_path, local_key_path, write_secret
from shared.settings import CommonSettings


class _Pipe(io.BytesIO):
    """A child's output pipe: its bytes, then end of file."""


def test_every_child_line_is_whole_and_prefixed_even_when_children_write_at_once() -> None:
    out = io.BytesIO()
    console = PrefixedConsole(["worker", "sessions", "gateway"], out=out)
    lines = {
        name: [f"{name} line {i} ".encode() + b"x" * 5000 + b"\n" for i in range(200)] for name in ("worker", "gateway")
    }
    threads = [console.follow(name, _Pipe(b"".join(lines[name]))) for name in lines]
    console.write("axon: stopping\n")
    for thread in threads:
        thread.join(timeout=10)
    written = out.getvalue().splitlines(keepends=True)
    assert len(written) == 401
    for name in lines:
        mine = [line for line in written if line.startswith(f"{name:<8} | ".encode())]
        assert mine == [f"{name:<8} | ".encode() + line for line in lines[name]]
    assert b"axon: stopping\n" in written


def test_a_last_line_without_newline_gets_one() -> None:
    out = io.BytesIO()
    PrefixedConsole(["gateway"], out=out).follow("gateway", _Pipe(b"one\ntwo")).join(timeout=5)
    assert out.getvalue() == b"gateway | one\ngateway | two\n"


def test_children_get_a_fresh_internal_token_unless_one_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AXON_INTERNAL_TOKEN", raising=False)
    first, _ = up._child_environment()
    second, _ = up._child_environment()
    assert len(first["AXON_INTERNAL_TOKEN"]) >= 32
    assert first["AXON_INTERNAL_TOKEN"] != second["AXON_INTERNAL_TOKEN"]

    monkeypatch.setenv("AXON_INTERNAL_TOKEN", "t" * 40)
    chosen, _ = up._child_environment()
    assert chosen["AXON_INTERNAL_TOKEN"] == "t" * 40


def test_the_children_listen_on_loopback_unless_axon_host_says_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AXON_HOST", raising=False)
    env, _ = up._child_environment()
    assert env["AXON_HOST"] == "127.0.0.1"
    key = LocalKey(key="axk_test", path=Path("/state/axon.key"), created=True)
    assert "listens on 127.0.0.1 only: set AXON_HOST=0.0.0.0" in up._examples(env, key, admin_token=None, terminal=True)
    monkeypatch.setenv("AXON_HOST", "0.0.0.0")
    env, _ = up._child_environment()
    assert env["AXON_HOST"] == "0.0.0.0"
    assert "listens on 0.0.0.0: other machines can reach it" in up._examples(env, key, admin_token=None, terminal=True)


def _sleeper() -> Service:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    return Service("sleeper", 0, process, None)


@pytest.mark.parametrize("later", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_the_first_signal_asks_the_second_is_counted_the_third_kills_the_children(later: int) -> None:
    stop = up._StopRequests()
    child = _sleeper()
    stop.children.append(child)
    try:
        stop._handle(signal.SIGINT, None)
        assert stop.requested and not stop.forced and child.exit_code is None
        stop._handle(later, None)
        assert stop.ignored == 1 and not stop.forced and child.exit_code is None
        stop._handle(later, None)
        assert stop.forced
        assert child.process.wait(timeout=5) == -signal.SIGKILL
    finally:
        child.kill()


def test_children_run_in_sessions_of_their_own_so_a_terminals_ctrl_c_reaches_axon_up_alone(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    child = start_process("child", argv, env=dict(os.environ), port=0, log_path=tmp_path / "c.log", own_session=True)
    try:
        assert os.getsid(child.pid) == child.pid != os.getsid(0)
        assert os.getpgid(child.pid) == child.pid
    finally:
        child.kill()


def test_a_console_whose_terminal_closed_drops_lines_instead_of_failing() -> None:
    class Closed(io.BytesIO):
        def write(self, data: bytes) -> int:  # type: ignore[override]
            raise OSError(5, "Input/output error")

    console = PrefixedConsole(["worker"], out=Closed())
    console.write("axon: stopping\n")  # no exception: `axon up` goes on stopping its children
    thread = console.follow("worker", _Pipe(b"a line\n"))
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_stopping_sends_one_sigterm_and_reports_a_clean_exit() -> None:
    script = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
        "print('up', flush=True)\n"
        "time.sleep(60)"
    )
    processes = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE) for _ in range(2)]
    for process in processes:
        assert process.stdout is not None and process.stdout.readline() == b"up\n"  # its handler is set
    children = [Service(f"child{i}", 0, process, None) for i, process in enumerate(processes)]
    said: list[str] = []
    try:
        assert up._stop_children(children, stop=up._StopRequests(), drain_timeout_s=7, say=said.append)
    finally:
        for child in children:
            child.kill()
    assert said[0].startswith("stopping: the services finish what they are answering (up to 7s, AXON_DRAIN_TIMEOUT_S)")
    assert "child0 exited with code 0" in said and "child1 exited with code 0" in said


def test_the_readme_gives_the_drain_timeout_the_settings_default() -> None:
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    assert f"up to `AXON_DRAIN_TIMEOUT_S`, {CommonSettings().drain_timeout_s:g} s" in " ".join(readme.split())


def test_the_key_file_follows_xdg_state_home_else_home() -> None:
    assert local_key_path("ns", {"XDG_STATE_HOME": "/state", "HOME": "/home/me"}) == Path("/state/axon/ns.key")
    assert local_key_path("ns", {"HOME": "/home/me"}) == Path("/home/me/.local/state/axon/ns.key")


def test_secrets_reach_a_terminal_only_and_the_admin_token_is_in_a_file_beside_the_key() -> None:
    assert admin_token_path("ns", {"XDG_STATE_HOME": "/state"}) == Path("/state/axon/ns.admin-token")
    env = {"AXON_HOST": "127.0.0.1", "AXON_ADMIN_TOKEN": "admin-secret-0123456789"}
    key = LocalKey(key="axk_secret", path=Path("/state/axon/ns.key"), created=False)
    token = Path("/state/axon/ns.admin-token")
    logged = up._examples(env, key, admin_token=token, terminal=False)
    assert "axk_secret" not in logged and "admin-secret" not in logged
    assert "export AXON_API_KEY=$(cat /state/axon/ns.key)" in logged
    assert "export AXON_ADMIN_TOKEN=$(cat /state/axon/ns.admin-token)" in logged
    shown = up._examples(env, key, admin_token=token, terminal=True)
    assert "export AXON_API_KEY=axk_secret" in shown and "admin-secret" not in shown
    assert "AXON_ADMIN_TOKEN" not in up._examples(env, key, admin_token=None, terminal=True)


def test_the_key_file_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "state" / "axon" / "ns.key"
    path.parent.mkdir(parents=True)
    path.write_text("old")
    os.chmod(path, 0o644)
    write_secret(path, "axk_new")
    assert path.read_text() == "axk_new\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_writes_from_many_threads_each_land_whole() -> None:
    """Writes from many threads at once each land whole (the console's lock)."""
    out = io.BytesIO()
    console = PrefixedConsole(["a"], out=out)
    threads = [threading.Thread(target=lambda: [console.write("y" * 1000 + "\n") for _ in range(50)]) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert out.getvalue().splitlines() == [b"y" * 1000] * 200


def test_configuration_md_lists_every_variable_axon_up_gives_its_children(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [name for name in os.environ if name.startswith("AXON_")]:
        monkeypatch.delenv(name, raising=False)
    for name in ("PYTHONUNBUFFERED", "AXON_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    env, _ = up._child_environment()
    added = set(env) - set(os.environ)
    assert {"AXON_LOG_FORMAT", "AXON_ADMIN_TOKEN", "AXON_INTERNAL_TOKEN", "AXON_HOST"} <= added
    text = (Path(__file__).resolve().parents[3] / "docs" / "configuration.md").read_text()
    section = " ".join(text[text.index("Each child gets a copy") : text.index("Their output shares")].split())
    assert "two changes" not in section
    for name in added:
        assert f"`{name}" in section, name


# A stand-in gateway on port argv[1]: every GET answers 200 (so /ready is ready), and /v1/models,
# asked with the key `axk_test`, lists the model `m` from its (argv[2] + 1)th answer on.
_GATEWAY = """
import http.server, json, sys
asked = 0
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global asked
        models = self.path == "/v1/models" and self.headers.get("Authorization") == "Bearer axk_test"
        asked += models
        data = [{"id": "m", "object": "model"}] if models and asked > int(sys.argv[2]) else []
        body = json.dumps({"object": "list", "data": data}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


@pytest.fixture
def gateway_listing_after(request: pytest.FixtureRequest) -> Iterator[Service]:
    port = free_port()
    argv = [sys.executable, "-c", _GATEWAY, str(port), str(request.param)]
    service = start_process("gateway", argv, env=dict(os.environ), port=port, log_path=None)
    try:
        yield service
    finally:
        service.kill()


@pytest.mark.parametrize("gateway_listing_after", [2], indirect=True)
def test_axon_up_waits_until_the_gateway_lists_the_model(gateway_listing_after: Service) -> None:
    said: list[str] = []
    assert up._wait_until_listed(
        [gateway_listing_after], key="axk_test", model="m", timeout_s=30, stop=up._StopRequests(), say=said.append
    )
    assert said == ["waiting for the gateway to list m in /v1/models"]


@pytest.mark.parametrize("gateway_listing_after", [10**6], indirect=True)
def test_a_model_never_listed_fails_axon_up_with_a_clear_message_and_no_key(gateway_listing_after: Service) -> None:
    said: list[str] = []
    written: list[str] = []
    status = up._run(
        [gateway_listing_after],
        ready_timeout_s=2,
        key="axk_test",
        model="m",
        stop=up._StopRequests(),
        say=said.append,
        write=written.append,
        examples="Axon is up",
    )
    assert status == 1 and not written
    assert said[-1].startswith("timed out: the gateway did not list m in /v1/models within 2s"), said
