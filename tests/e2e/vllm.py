"""Workers on the real vLLM engine for end-to-end tests, and what a test needs to kill them and check
that nothing of them is left."""

import os
import time
import uuid
from collections.abc import Callable
from typing import Any

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
        self._stack = stack
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
        worker = self._stack.start(
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


def stream_killing(client: OpenAI, workers: list[Service], kill: Callable[[Service], None], **body: Any) -> str:
    """Stream a greedy chat answer of `body["model"]`, calling `kill(worker)` on the worker generating
    it as soon as its first text arrives; the whole text received.

    The first text, not the n-th chunk: a loaded worker merges tokens into fewer chunks, so a count
    of chunks may never be reached, while the first text goes out as soon as it exists. Fails
    unless the kill landed mid-answer as the servers count it: the other workers generated tokens
    of it after the kill. (Text the client reads after the kill proves nothing: the dead worker may
    have produced all of it before, buffered on the way.)"""
    model = body["model"]
    pieces: list[str] = []
    victim: Service | None = None
    generated: dict[int, float] = {}  # the other workers' tokens generated, by port, before the kill
    for chunk in client.chat.completions.create(temperature=0, stream=True, **body):
        pieces.append(chunk.choices[0].delta.content or "")
        if victim is None and pieces[-1]:
            victim = holder(workers, model)
            generated = {w.port: tokens_generated(w, model) for w in workers if w is not victim}
            kill(victim)
    text = "".join(pieces)
    assert victim is not None, "the stream ended without any text: kill() was never called"
    after = sum(tokens_generated(w, model) - generated[w.port] for w in workers if w.port in generated)
    assert after >= 1, f"no other worker generated any of {text!r} after the kill: the answer was complete before it"
    return text


def tokens_generated(worker: Service, model: str) -> float:
    return metric(worker, "axon_worker_output_tokens_total", model=model)
