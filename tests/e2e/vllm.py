"""Workers on the real vLLM engine for end-to-end tests, and what a test needs to kill them and check
that nothing of them is left."""

import contextlib
import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
from openai import OpenAI

from services.cli import launcher
from services.cli.launcher import Service
from tests.e2e.stack import Stack
from tests.e2e.test_workers import holder, metric
from tests.processes import processes_whose_environment_has


class VllmWorkers:
    """A module's workers of one model on the vLLM engine (started with `env`), each with an
    `AXON_WORKER_ID` of its own, which its processes (vLLM's too) carry in their environment."""

    def __init__(self, stack: Stack, name: str, env: dict[str, str]) -> None:
        self.stack = stack
        self._name = name
        self._env = env
        self.started: list[Service] = []
        self.ids: dict[int, str] = {}  # by pid
        # Every worker id given, in order (a worker that failed to start has no pid here).
        self.worker_ids: list[str] = []

    def start(self, *, ready_path: str = "/ready", **env: str) -> Service:
        """One more worker (with `env` on top of the module's), once `ready_path` answers."""
        worker_id = f"{self._name}-{uuid.uuid4().hex[:8]}"
        self.worker_ids.append(worker_id)
        worker = self.stack.start(
            f"worker:{self._name}-{len(self.worker_ids)}",
            env={**self._env, **env, "AXON_WORKER_ID": worker_id},
            ready_timeout_s=300,
            ready_path=ready_path,
        )
        self.started.append(worker)
        self.ids[worker.process.pid] = worker_id
        return worker

    def alive(self) -> list[Service]:
        return [w for w in self.started if w.process.poll() is None]

    def start_together(self, *envs: dict[str, str]) -> list[Service]:
        """One more worker for each of `envs`, started at once (each answers /health while vLLM
        loads, so their loads overlap), once all are ready."""
        starting = [self.start(ready_path="/health", **env) for env in envs]
        launcher.wait_ready(starting, timeout_s=300)
        return starting

    def at_least(self, count: int) -> list[Service]:
        """The live workers, `count` or more (those missing started together)."""
        self.start_together(*({} for _ in range(count - len(self.alive()))))
        return self.alive()

    def stop(self) -> None:
        for worker in self.alive():
            worker.stop()


def processes_of(worker_id: str) -> list[int]:
    """Processes whose environment names this worker id: the worker and every process it started."""
    return processes_whose_environment_has(f"AXON_WORKER_ID={worker_id}")


def no_process_left(worker_id: str, *, timeout_s: float = 15) -> None:
    """Until no process of the worker is left (vLLM's engine core would outlive a SIGKILLed worker
    but for services/worker/engines/orphans.py)."""
    deadline = time.monotonic() + timeout_s
    while processes_of(worker_id):
        assert time.monotonic() < deadline, f"processes of worker {worker_id} still run: {processes_of(worker_id)}"
        time.sleep(0.2)


def engine_core_of(worker: Service) -> int:
    """The pid of the worker's vLLM engine-core child process."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{entry}/comm") as comm:
                    name = comm.read().strip()
            except OSError:
                continue
            if int(fields[1]) == worker.process.pid and name.startswith("VLLM::EngineCor"):
                return int(entry)
    raise AssertionError("no engine-core process")


def stream_killing(client: OpenAI, pool: VllmWorkers, kill: Callable[[Service], None], **body: Any) -> str:
    """Stream a greedy chat answer of `body["model"]` from `pool`'s live workers, calling
    `kill(worker)` on the worker generating it once its first token is published; the whole text
    received.

    The kill must land mid-answer, and an answer of a small model on vLLM takes a few hundred
    milliseconds: on a loaded machine the first text could reach the client, through the session
    manager and the gateway, after the last token was generated. So every worker's vLLM processes
    run in short slices until the first token is caught where the worker publishes it (its job's
    channel in Redis), and stay stopped (no token is generated while the test finds the one
    generating and kills it), then are continued. Fails unless the kill landed mid-answer as the
    servers count it: the other workers generated tokens of it after the kill."""
    model = body["model"]
    workers = pool.alive()
    frozen = _FrozenAtFirstToken(pool, workers)
    pieces: list[str] = []
    victim: Service | None = None
    generated: dict[int, float] = {}  # the other workers' tokens generated, by port, before the kill
    try:
        for chunk in client.chat.completions.create(temperature=0, stream=True, **body):
            pieces.append(chunk.choices[0].delta.content or "")
            if victim is None and pieces[-1]:
                frozen.wait()
                victim = holder(workers, model)
                generated = {w.port: tokens_generated(w, model) for w in workers if w is not victim}
                kill(victim)
                frozen.thaw()
    finally:
        frozen.thaw()
    text = "".join(pieces)
    assert victim is not None, "the stream ended without any text: kill() was never called"
    after = sum(tokens_generated(w, model) - generated[w.port] for w in workers if w.port in generated)
    assert after >= 1, f"no other worker generated any of {text!r} after the kill: the answer was complete before it"
    return text


class _FrozenAtFirstToken:
    """Runs the vLLM processes of `workers` (every process of theirs but the worker's own, which keeps
    answering) in slices, `SLICE_S` of every `SLICE_S + BETWEEN_S` (SIGCONT, then SIGSTOP), until a
    chunk with text is published on any job channel of the pool's namespace, then keeps them
    stopped; `thaw` continues them (and a killed worker's, so they can exit).

    In slices, because a vLLM engine running freely keeps every core busy and starves the worker
    that publishes and the test that watches: on a fast machine a 64-token answer was generated
    whole before its first chunk was seen (the worker published it as 2 chunks, and the watcher
    stopped the engines after the end). Between slices both have the cores, so the first token is
    seen while the engines are stopped, at most one slice's tokens after it was generated."""

    SLICE_S = 0.01
    BETWEEN_S = 0.04

    def __init__(self, pool: VllmWorkers, workers: list[Service]) -> None:
        self._engines = [
            pid for worker in workers for pid in processes_of(pool.ids[worker.process.pid]) if pid != worker.process.pid
        ]
        assert self._engines, "no vLLM process found to stop"
        self._seen = threading.Event()
        self._done = threading.Event()
        self._pubsub = redis.Redis.from_url(pool.stack.redis_url).pubsub()
        self._pubsub.psubscribe(pool.stack.namespace + ":tokens:*")
        deadline = time.monotonic() + 10
        while (message := self._pubsub.get_message(timeout=1)) is None or message["type"] != "psubscribe":
            assert time.monotonic() < deadline, "no confirmation of the subscription to the job channels"
        self._signal(signal.SIGSTOP)
        self._thread = threading.Thread(target=self._run_in_slices, daemon=True)
        self._thread.start()

    def _signal(self, signum: int) -> None:
        for pid in self._engines:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def _run_in_slices(self) -> None:
        while not self._done.is_set():
            self._signal(signal.SIGCONT)
            time.sleep(self.SLICE_S)
            self._signal(signal.SIGSTOP)
            deadline = time.monotonic() + self.BETWEEN_S
            while (left := deadline - time.monotonic()) > 0:
                message = self._pubsub.get_message(timeout=left)
                if message is not None and message["type"] == "pmessage" and json.loads(message["data"]).get("text"):
                    self._seen.set()
                    return

    def wait(self) -> None:
        """Until the first token's chunk was seen, the vLLM processes stopped."""
        assert self._seen.wait(60), "the first token's chunk was not seen on the job channels"

    def thaw(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)
        self._signal(signal.SIGCONT)
        self._pubsub.close()


def tokens_generated(worker: Service, model: str) -> float:
    return metric(worker, "axon_worker_output_tokens_total", model=model)
