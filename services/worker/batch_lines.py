"""Batch lines into a worker's free sequences, and out of them when interactive work needs them.

Interactive jobs are delivered (`basic.consume`, prefetch = the engine's sequences): RabbitMQ
pushes them as fast as the worker has room. Batch lines' jobs wait in the model's batch queue
(`shared/topology.py`), which no worker consumes: `BatchLines` takes one at a time
(`basic.get`) while the worker runs fewer jobs than its engine has sequences, less
`AXON_BATCH_RESERVED_SEQS` kept free for interactive arrivals, and looks again
when a job ends here, or every `POLL_S` while the queue is empty. So a batch line only ever
starts in a sequence nothing else wanted, and the workers do not idle while lines wait.

An interactive job delivered while batch lines hold the rest of the sequences takes one of
theirs: the newest line's job is stopped and handed back to the batch queue, from which a worker
with a free sequence resumes it from its published tokens, as after a failover
(`JobRunner.on_message`). Its answer is the same, only later.
"""

import asyncio
import contextlib

from aio_pika.abc import AbstractQueue

from services.worker.job_runner import JobRunner
from shared.logging import get_logger
from shared.outages import Outage

log = get_logger(__name__)

# How often a worker with a free sequence looks at an empty batch queue again.
POLL_S = 0.25


class BatchLines:
    """Takes batch lines' jobs from one model's batch queue into the worker's free sequences."""

    def __init__(self, runner: JobRunner, queue: AbstractQueue, *, timeout_s: float, reserved: int) -> None:
        self._runner = runner
        self._queue = queue
        self._timeout_s = timeout_s
        self._reserved = reserved
        self._paused = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def resume(self) -> None:
        """Start taking lines (again)."""
        self._paused.clear()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._take())

    async def pause(self) -> None:
        """Stop taking lines: returns once none is being taken (the lines taken run on)."""
        self._paused.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _take(self) -> None:
        outage = Outage("worker_batch_lines")
        while not self._paused.is_set():
            if not self._runner.has_free_sequence(self._reserved):
                await self._runner.sequence_freed(POLL_S)
                continue
            try:
                message = await self._queue.get(no_ack=False, fail=False, timeout=self._timeout_s)
            except Exception as exc:  # noqa: BLE001 - the broker is away: look again once it is back
                await asyncio.sleep(min(POLL_S * 4, outage.failed(exc)))
                continue
            outage.recovered()
            if message is None:
                await asyncio.sleep(POLL_S)
            elif not self._paused.is_set():
                self._runner.start(message)
            else:
                # Paused while it was being taken: back to the queue, first in line.
                with contextlib.suppress(Exception):
                    await message.nack(requeue=True)
