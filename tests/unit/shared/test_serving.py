"""shared.serving: one stop request per SIGINT/SIGTERM pair, a third signal forces, and the deadline
hook ends what is still running. The server runs in a child process and gets real signals."""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.cli.launcher import free_port
from shared.serving import HOP_MARGIN_S, grace_s
from shared.stop_signals import StopSignals

ROOT = Path(__file__).resolve().parents[3]

# A server whose one route streams `tick` every 50 ms until the deadline hook says `end`; its
# drain hook prints `draining`, then waits for as long as argv[2] says (seconds), its bound argv[4]
# (argv[2] if not given).
_SERVER = """
import asyncio, sys
from shared.serving import serve

ended = asyncio.Event()

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    while not ended.is_set():
        await send({"type": "http.response.body", "body": b"tick\\n", "more_body": True})
        try:
            await asyncio.wait_for(ended.wait(), 0.05)
        except TimeoutError:
            pass
    await send({"type": "http.response.body", "body": b"end\\n", "more_body": False})

async def drain():
    print("draining", flush=True)
    await asyncio.sleep(float(sys.argv[2]))
    print("drained", flush=True)

async def at_deadline():
    print("deadline", flush=True)
    ended.set()

serve(
    app,
    host="127.0.0.1",
    port=int(sys.argv[1]),
    grace_s=float(sys.argv[3]),
    drain=drain,
    drain_timeout_s=float(sys.argv[4] if len(sys.argv) > 4 else sys.argv[2]),
    at_deadline=at_deadline,
)
print("exited cleanly", flush=True)
"""


# A server on port argv[1] whose startup leaves a reference cycle as garbage; its one route
# answers whether the collector freed it, and how many objects it froze.
_STARTUP = """
import gc, sys, weakref
from shared.serving import serve

class Node:
    pass

gc.disable()  # the cycle stays until the server's startup collects
cycle = Node()
cycle.self = cycle
alive = weakref.ref(cycle)
del cycle

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = f"{alive() is None} {gc.get_freeze_count()}".encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": body})

serve(app, host="127.0.0.1", port=int(sys.argv[1]), grace_s=1)
"""


def test_startup_collects_its_garbage_and_freezes_the_rest() -> None:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-c", _STARTUP, str(port)], cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                answer = httpx.get(f"http://127.0.0.1:{port}/").text
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the server did not answer"
                time.sleep(0.1)
    finally:
        process.kill()
        process.wait(timeout=10)
    freed, frozen = answer.split()
    assert freed == "True"
    assert int(frozen) > 10_000  # the imports (uvicorn, asyncio, ...), out of every later collection


def test_the_first_signal_stops_the_second_is_ignored_the_third_forces() -> None:
    signals = StopSignals()
    assert [signals.receive() for _ in range(4)] == ["stop", "ignore", "force", "force"]


def test_each_hop_waits_longer_than_the_one_behind_it() -> None:
    worker, sessions, gateway = (grace_s(30, hops_behind=hops) for hops in range(3))
    assert worker == 30
    assert worker < sessions < gateway
    assert gateway - sessions == sessions - worker == HOP_MARGIN_S


class _Server:
    def __init__(self, tmp_path: Path, *, drain_s: float, grace_s: float, drain_timeout_s: float | None = None) -> None:
        self.port = free_port()
        bound = [] if drain_timeout_s is None else [str(drain_timeout_s)]
        self.output = tmp_path / "server.log"
        with self.output.open("wb") as sink:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _SERVER, str(self.port), str(drain_s), str(grace_s), *bound],
                cwd=ROOT,
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with httpx.Client() as client, client.stream("GET", f"http://127.0.0.1:{self.port}/") as response:
                    next(response.iter_lines())
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise AssertionError(self.text())

    def text(self) -> str:
        return self.output.read_text()

    def wait_for(self, line: str, timeout_s: float = 10) -> None:
        deadline = time.monotonic() + timeout_s
        while line not in self.text().splitlines():
            assert time.monotonic() < deadline, f"no {line!r}:\n{self.text()}"
            time.sleep(0.05)

    def signal(self, sig: int) -> None:
        os.kill(self.process.pid, sig)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)


@pytest.fixture
def slow_drain(tmp_path: Path) -> Iterator[_Server]:
    server = _Server(tmp_path, drain_s=3600, grace_s=30)
    yield server
    server.close()


def test_sigint_then_sigterm_is_one_request_and_a_third_signal_exits_at_once(slow_drain: _Server) -> None:
    slow_drain.signal(signal.SIGINT)
    slow_drain.wait_for("draining")
    # The stop request names the drain's bound, then the server's wait after it.
    requested = next(line for line in slow_drain.text().splitlines() if "stop_requested" in line)
    assert "drain_timeout_s=3600" in requested and "then_grace_s=30" in requested, requested
    slow_drain.signal(signal.SIGTERM)
    time.sleep(0.5)
    assert slow_drain.process.poll() is None, slow_drain.text()  # still draining
    assert slow_drain.text().count("draining") == 1
    slow_drain.signal(signal.SIGINT)
    assert slow_drain.process.wait(timeout=5) == 1
    assert "third stop signal" in slow_drain.text()


def test_a_drain_past_its_bound_and_the_hop_margin_is_left_and_the_process_exits_0(tmp_path: Path) -> None:
    """A drain hook that never returns (a worker's broker away for good) does not hold the stop."""
    server = _Server(tmp_path, drain_s=3600, grace_s=1, drain_timeout_s=0.5)
    try:
        server.signal(signal.SIGTERM)
        server.wait_for("draining")
        assert server.process.wait(timeout=HOP_MARGIN_S + 10) == 0, server.text()
        assert "drain_timed_out" in server.text() and "drained" not in server.text().splitlines()
        assert "exited cleanly" in server.text()
    finally:
        server.close()


def test_a_stream_still_open_at_the_deadline_is_ended_by_the_hook_and_the_process_exits_0(tmp_path: Path) -> None:
    server = _Server(tmp_path, drain_s=0, grace_s=1)
    try:
        with httpx.Client(timeout=10) as client:
            with client.stream("GET", f"http://127.0.0.1:{server.port}/") as response:
                lines = response.iter_lines()
                assert next(lines) == "tick"
                server.signal(signal.SIGTERM)
                started = time.monotonic()
                rest = list(lines)
        assert rest[-1] == "end"  # ended by the hook, not cut
        assert 0.9 < time.monotonic() - started < 5
        assert server.process.wait(timeout=10) == 0
        assert "exited cleanly" in server.text()
        assert "deadline" in server.text().splitlines()
    finally:
        server.close()


_HELD = """
import sys, time
from shared.stop_signals import StopSignals
signals = StopSignals.hold()
print("held", flush=True)
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    time.sleep(0.05)
    if signals.received == 2:
        print("counted", signals.received, flush=True)
        break
time.sleep(30)
"""


def test_signals_held_before_the_server_runs_are_counted_and_a_third_still_forces() -> None:
    process = subprocess.Popen([sys.executable, "-c", _HELD], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert process.stdout is not None and process.stdout.readline() == b"held\n"
        process.send_signal(signal.SIGINT)  # no KeyboardInterrupt: a count
        time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        assert process.stdout.readline() == b"counted 2\n"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=5) == 1
        assert process.stderr is not None and b"third stop signal" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=5)
