"""Ctrl+C on `axon up`, as the README promises it: SIGINT to the process group of `axon up` (what a
terminal sends) while a stream runs. The stream ends normally, every process exits 0, no job is left
in the queue, and nothing is logged at error level."""

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aio_pika
import openai
import pytest
from openai import OpenAI

from services.cli.launcher import environment_with, free_port
from shared.names import Names
from tests.e2e.stack import Stack
from tests.services import ServiceUrls

MODEL = "sim-model"
MAX_TOKENS = 80
# 80 tokens 30 ms apart: a stream of about 2.4 s, well inside the drain timeout.
_ITL_MS = 30
_STARTED_WITHIN_S = 60
# The stream's remaining ~2 s, the services' shutdown, and `axon up` reporting them.
_STOPPED_WITHIN_S = 20


@dataclass
class Up:
    process: subprocess.Popen[bytes]
    output: Path
    namespace: str
    gateway_url: str
    key_file: Path

    def text(self) -> str:
        return self.output.read_text(errors="replace")

    def key(self) -> str:
        return self.key_file.read_text().strip()


def _wait_until_serving(up: Up) -> None:
    """Until `axon up` has said it is up; by then the gateway lists the model, at the first ask."""
    deadline = time.monotonic() + _STARTED_WITHIN_S
    while "Press Ctrl+C to stop" not in up.text():
        assert up.process.poll() is None, f"axon up exited early:\n{up.text()}"
        assert time.monotonic() < deadline, f"axon up not up within {_STARTED_WITHIN_S}s:\n{up.text()}"
        time.sleep(0.05)
    client = OpenAI(base_url=f"{up.gateway_url}/v1", api_key=up.key(), max_retries=0, timeout=5)
    assert MODEL in [model.id for model in client.models.list()], up.text()


def _start_up(
    tmp_path: Path,
    namespace: str,
    database_url: str,
    service_urls: ServiceUrls,
    own_namespace: str | None = None,
    **settings: str,
) -> Up:
    """`axon up` on the simulator, in a process group of its own as a terminal runs it, with its
    own namespace (`own_namespace`: one an earlier run used), ports and key file; `settings`
    override the defaults."""
    own_namespace = own_namespace or f"{namespace}_up_{uuid.uuid4().hex[:6]}"
    ports = {kind: free_port() for kind in ("GATEWAY", "SESSIONS", "WORKER")}
    env = environment_with(
        {
            "AXON_NAMESPACE": own_namespace,
            "AXON_DATABASE_URL": database_url,
            "AXON_REDIS_URL": service_urls.redis,
            "AXON_AMQP_URL": service_urls.amqp,
            "AXON_ENGINE": "sim",
            "AXON_MODEL": MODEL,
            "AXON_SIM_ITL_MS": str(_ITL_MS),
            **{f"AXON_{kind}_PORT": str(port) for kind, port in ports.items()},
            **settings,
        }
    )
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    output = tmp_path / "axon-up.log"
    with output.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "services.cli.main", "up"],
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            process_group=0,
        )
    key_file = tmp_path / "state" / "axon" / f"{own_namespace}.key"
    return Up(process, output, own_namespace, f"http://127.0.0.1:{ports['GATEWAY']}", key_file)


def _children(pid: int) -> list[int]:
    """The processes `pid` started that still run (each a session leader: `axon up`'s children)."""
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def _kill(up: Up) -> None:
    """`axon up` and its children, each of which leads a process group of its own."""
    for group in (*_children(up.process.pid), up.process.pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        up.process.wait(timeout=10)


@pytest.fixture
def up(
    request: pytest.FixtureRequest, tmp_path: Path, namespace: str, database_url: str, service_urls: ServiceUrls
) -> Iterator[Up]:
    """`axon up` serving the simulator's model; the test's parameter holds settings to override."""
    up = _start_up(tmp_path, namespace, database_url, service_urls, **getattr(request, "param", {}))
    try:
        _wait_until_serving(up)
        yield up
    finally:
        _kill(up)


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


async def _queued_jobs(amqp_url: str, queue: str) -> int:
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, passive=True)
        count = declared.declaration_result.message_count
        assert count is not None
        return count
    finally:
        await connection.close()


def test_ctrl_c_mid_stream_drains_it_and_every_process_exits_0(up: Up, service_urls: ServiceUrls) -> None:
    assert up.key_file.stat().st_mode & 0o777 == 0o600
    # Its console is a file here, as a log is: the secrets are in files of their own, not in it.
    admin_token = up.key_file.with_name(f"{up.namespace}.admin-token")
    assert admin_token.stat().st_mode & 0o777 == 0o600
    assert up.key() not in up.text() and admin_token.read_text().strip() not in up.text()
    assert f"export AXON_ADMIN_TOKEN=$(cat {admin_token})" in up.text()
    client = OpenAI(base_url=f"{up.gateway_url}/v1", api_key=up.key(), max_retries=0, timeout=30)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    children = _children(up.process.pid)
    assert len(children) == 3
    pieces, finish_reason, usage, interrupted_at = [], None, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish_reason = choice.finish_reason or finish_reason
        if interrupted_at is None and len(pieces) >= 5:
            os.killpg(up.process.pid, signal.SIGINT)  # Ctrl+C in the terminal
            interrupted_at = time.monotonic()
    assert interrupted_at is not None
    assert finish_reason == "length"
    assert usage is not None and usage.completion_tokens == MAX_TOKENS
    assert len("".join(pieces).split()) == MAX_TOKENS  # the simulator's answer is one word per token

    assert up.process.wait(timeout=_STOPPED_WITHIN_S) == 0, up.text()
    assert time.monotonic() - interrupted_at < _STOPPED_WITHIN_S
    deadline = time.monotonic() + 5
    while not all(_group_gone(group) for group in (up.process.pid, *children)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_group_gone(group) for group in (up.process.pid, *children)), "a child of axon up outlived it"
    text = up.text()
    for name in ("worker", "sessions", "gateway"):
        assert f"axon: {name} exited with code 0" in text, text
        assert f"{name:<8} | " in text  # every child's lines carry its name
    # The terminal's SIGINT reached axon up alone; each child got its one SIGTERM: one request each.
    assert text.count("stop_requested") == 3 and text.count("signal=SIGTERM") == 3, text
    assert "stop_already_requested" not in text and "signal=SIGINT" not in text, text
    assert "drain_timeout_s=30.0" in text  # the worker names its real bound
    assert "handed_back=0" in text
    for sign in ("[error", "[critical", "Traceback", "CancelledError"):
        assert sign not in text, text
    assert asyncio.run(_queued_jobs(service_urls.amqp, Names(up.namespace).jobs_queue(MODEL))) == 0


@pytest.mark.parametrize("up", [{"AXON_SIM_ITL_MS": "100"}], indirect=True)
def test_a_third_ctrl_c_stops_the_services_at_once(up: Up) -> None:
    """Mid-drain (a 30 s stream, a 30 s drain timeout), a second Ctrl+C is only counted and a third
    kills the children: axon up is gone within seconds, and so are they."""
    children = _children(up.process.pid)
    client = OpenAI(base_url=f"{up.gateway_url}/v1", api_key=up.key(), max_retries=0, timeout=30)
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=300, stream=True)
    next(iter(stream))
    os.killpg(up.process.pid, signal.SIGINT)
    deadline = time.monotonic() + _STOPPED_WITHIN_S
    while "axon: stopping:" not in up.text():
        assert time.monotonic() < deadline, up.text()
        time.sleep(0.05)
    assert "Ctrl+C twice more stops them at once" in up.text()
    os.killpg(up.process.pid, signal.SIGINT)
    time.sleep(1)
    assert up.process.poll() is None and not any(_group_gone(child) for child in children), up.text()
    os.killpg(up.process.pid, signal.SIGINT)
    stopped_at = time.monotonic()
    assert up.process.wait(timeout=10) == 1, up.text()  # its children were killed: not a clean stop
    assert time.monotonic() - stopped_at < 5
    assert all(_group_gone(child) for child in children), "a child of axon up outlived it"
    assert "axon: third stop signal: killing the services" in up.text()


@pytest.mark.parametrize("up", [{"AXON_DRAIN_TIMEOUT_S": "1", "AXON_SIM_ITL_MS": "100"}], indirect=True)
def test_a_stream_longer_than_the_drain_ends_with_stream_interrupted(
    up: Up, tmp_path: Path, namespace: str, database_url: str, service_urls: ServiceUrls
) -> None:
    """Past the drain timeout the worker hands the job back (here no other worker takes it) and the
    session manager, at its own deadline, ends the stream with a clean error event. The next `axon
    up` drops the job at once: nobody can read its answer any more."""
    client = OpenAI(base_url=f"{up.gateway_url}/v1", api_key=up.key(), max_retries=0, timeout=30)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a long story."}], max_tokens=MAX_TOKENS, stream=True
    )
    pieces: list[str] = []
    with pytest.raises(openai.APIError, match="stream was interrupted"):
        for chunk in stream:
            pieces.extend(choice.delta.content or "" for choice in chunk.choices)
            if len(pieces) == 3:
                os.killpg(up.process.pid, signal.SIGINT)
    assert 3 <= len("".join(pieces).split()) < MAX_TOKENS

    assert up.process.wait(timeout=_STOPPED_WITHIN_S) == 0, up.text()
    text = up.text()
    assert "handed_back=1" in text
    for sign in ("[error", "[critical", "Traceback", "CancelledError"):
        assert sign not in text, text
    # Handed back for another worker to resume: it is in the queue, not lost.
    queue = Names(up.namespace).jobs_queue(MODEL)
    assert asyncio.run(_queued_jobs(service_urls.amqp, queue)) == 1

    # Its client and session manager are gone: the next run's worker ends it at once instead of
    # generating the rest of it for nobody.
    (tmp_path / "again").mkdir()
    again = _start_up(
        tmp_path / "again", namespace, database_url, service_urls, own_namespace=up.namespace, AXON_SIM_ITL_MS="100"
    )
    try:
        _wait_until_serving(again)
        deadline = time.monotonic() + 10
        while "outcome=unheard" not in again.text():
            assert time.monotonic() < deadline, again.text()
            time.sleep(0.1)
    finally:
        _kill(again)
    assert asyncio.run(_queued_jobs(service_urls.amqp, queue)) == 0


def test_ctrl_c_while_the_services_start_stops_them_cleanly(
    tmp_path: Path, namespace: str, database_url: str, service_urls: ServiceUrls
) -> None:
    """Ctrl+C while the children are still importing their code: one stop request, no
    KeyboardInterrupt, every process exits 0."""
    up = _start_up(tmp_path, namespace, database_url, service_urls)
    try:
        deadline = time.monotonic() + _STARTED_WITHIN_S
        while "database ready" not in up.text():
            assert time.monotonic() < deadline and up.process.poll() is None, up.text()
            time.sleep(0.02)
        time.sleep(0.3)  # the children are started, and busy importing
        os.killpg(up.process.pid, signal.SIGINT)
        assert up.process.wait(timeout=_STOPPED_WITHIN_S) == 0, up.text()
    finally:
        _kill(up)
    text = up.text()
    assert "Axon is up" not in text
    for name in ("worker", "sessions", "gateway"):
        assert f"axon: {name} exited with code 0" in text, text
    for sign in ("[error", "Traceback", "KeyboardInterrupt"):
        assert sign not in text, text


def test_a_gateway_stopped_alone_ends_a_long_stream_with_stream_interrupted(
    tmp_path: Path, namespace: str, database_url: str, service_urls: ServiceUrls, api_key: str
) -> None:
    """A gateway's own stop (a rolling update): past its wait, AXON_DRAIN_TIMEOUT_S + 10 s, a stream
    it still relays ends with a clean error event, and the gateway exits 0 without an error line."""
    stack = Stack(
        namespace=f"{namespace}_gw_{uuid.uuid4().hex[:6]}",
        database_url=database_url,
        redis_url=service_urls.redis,
        amqp_url=service_urls.amqp,
        log_dir=tmp_path,
    )
    try:
        stack.start("worker:sim", env={"AXON_ENGINE": "sim", "AXON_MODEL": MODEL, "AXON_SIM_ITL_MS": "100"})
        sessions = stack.start("sessions")
        gateway = stack.start("gateway", env={"AXON_SESSIONS_URL": sessions.url, "AXON_DRAIN_TIMEOUT_S": "0"})
        client = OpenAI(base_url=f"{gateway.url}/v1", api_key=api_key, max_retries=0, timeout=30)
        deadline = time.monotonic() + 15
        while not any(model.id == MODEL for model in client.models.list()):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=300, stream=True)
        stopped_at = None
        with pytest.raises(openai.APIError, match="stream was interrupted"):
            for _chunk in stream:
                if stopped_at is None:
                    gateway.terminate()
                    stopped_at = time.monotonic()
        assert stopped_at is not None
        assert 9 < time.monotonic() - stopped_at < 14  # its wait: 0 + 10 s
        assert gateway.process.wait(timeout=10) == 0
        log = gateway.log_text()
        assert '"event":"stop_deadline_passed"' in log
        assert '"level":"error"' not in log and "Traceback" not in log, log
    finally:
        stack.close()
