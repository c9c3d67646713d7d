"""Waiting jobs into a worker's free sequences, in the fair share's order, and batch lines into the
sequences nobody else wants.

Jobs pushed to the worker (`basic.consume`, prefetch = the engine's sequences) are those that do
not wait for a share: while nothing waits, a job sent to a free sequence a session manager
reserved (`_report_free`) or a session's turn to its home worker; a job handed back or spilled from
a worker's queue; every job while the fair share is off or Redis away. One pushed after this
puller filled the sequence reserved for it waits in the runner for the next (`JobRunner.on_message`). The
others wait in their tenant's queue (`shared/topology.py`), which no worker consumes: `Puller`
asks the fair share which tenant's job comes next (`FairShare.claim`, `shared/fair.py`) and takes
one from that tenant's queue (`basic.get`) whenever the worker has a free sequence (or a batch
line's to take), and again at once while that lasts. It looks when a job ends here, when a
session manager rings the model's doorbell (`Names.fair_ready`: a tenant that had no job waiting
has one now), and every `POLL_S`; it asks Redis only after a ring or a poll, until a claim finds
nothing waiting. While the
worker is full it takes the fair share's next pick ahead, to start the moment a sequence frees:
the pull's round trips then cost no sequence any time.

Batch lines are taken the same way from the tenants' batch queues, but only while the worker runs
fewer jobs than its engine has sequences less `AXON_BATCH_RESERVED_SEQS`, so a batch line only
starts in a sequence nothing else wanted; a line handed back (preempted or drained), or queued
first in, first out, waits in the model's batch queue and is taken first. An interactive job
taken while batch lines hold the rest of the sequences takes one of theirs: the newest line's job
is stopped and handed back, and resumes later from its published tokens
(`JobRunner.on_message`).

A tenant's count in Redis may disagree with its queue (a process died between the broker and
Redis; a worker died with jobs it had taken, which the broker puts back at the head of their
queues): too high costs an empty take; too low is mended by `reconcile`, at a worker's first look
and then every `RECONCILE_S` while the worker has room and finds nothing to take (what two
reconciles in a row found missing). (A job put back
at the head of its tenant's queue is the next one taken for that tenant anyway: only the
tenant's last waiting job can be left uncounted.)
"""

import asyncio
import contextlib
import math
import time
from collections.abc import Collection

from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue, AbstractRobustConnection

from services.worker.job_runner import JobRunner, stay_subscribed
from services.worker.redis_gate import RedisGate
from shared.fair import BATCH, INTERACTIVE, Band, FairShare
from shared.logging import get_logger
from shared.names import Names
from shared.outages import Outage
from shared.redis_pipe import RedisSubscriber
from shared.schemas import Job
from shared.topology import declare_tenant_queue

log = get_logger(__name__)

# How often a worker with a free sequence looks again when nothing rang.
POLL_S = 0.25
# How often a worker with room and nothing to take checks the tenants' queues against their counts
# (a worker that just started does at once: it may be taking over a dead worker's jobs, which the
# broker put back in their queues while Redis had counted them taken).
RECONCILE_S = 2.0
# How soon a reconcile that found a queue holding more than its count looks again to confirm it.
RECONFIRM_S = 0.5
# Empty takes in a row (counts too high) before a look waits for the next ring or poll.
_MAX_MISSES = 64
# How long the free sequences a worker reports hold unless it reports again (it does at every
# change, and every `FREE_REFRESH_S`): a worker that died stops counting within this.
FREE_VALID_MS = 3000
FREE_REFRESH_S = 1.0
FREE_REPORT_S = 0.05


class Puller:
    """Takes waiting jobs of one model into the worker's free sequences."""

    def __init__(
        self,
        runner: JobRunner,
        connection: AbstractRobustConnection,
        names: Names,
        *,
        model: str,
        worker_id: str,
        fair: FairShare,
        batch_queue: AbstractQueue,
        doorbell: asyncio.Event,
        timeout_s: float,
        reserved: int,
        headroom: int,
        max_queued_jobs: int,
    ) -> None:
        self._runner = runner
        self._connection = connection
        self._names = names
        self._model = model
        self._worker_id = worker_id
        # The free sequences last reported, and when.
        self._reported: tuple[int, float] = (-1, -math.inf)
        self._fair = fair
        self._batch_queue = batch_queue
        self._doorbell = doorbell
        self._timeout_s = timeout_s
        self._reserved = reserved
        self._headroom = headroom
        self._max_queued_jobs = max_queued_jobs
        self._channel: AbstractChannel | None = None
        self._queues: dict[str, AbstractQueue] = {}
        self._paused = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._reconciled = -math.inf
        # Whether a band may have jobs waiting (Redis is asked only then): set by the doorbell and
        # every poll, cleared when a claim finds none.
        self._waiting: dict[Band, bool] = {INTERACTIVE: True, BATCH: True}
        self._polled = False
        # Whether the model's batch queue (lines handed back) may hold a line: looked at every poll.
        self._handed_back = True
        # The job taken to start the moment a sequence frees here (taken while the worker is full).
        self._next: AbstractIncomingMessage | None = None
        # What each tenant's queue held beyond its count at the last reconcile.
        self._missing: dict[tuple[str, Band], int] = {}

    def resume(self) -> None:
        """Start taking jobs (again)."""
        self._paused.clear()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._take())

    async def pause(self) -> None:
        """Stop taking jobs: returns once none is being taken (the jobs taken run on), and no
        session manager counts on this worker's free sequences any more."""
        self._paused.set()
        if self._task is not None:
            # A take ends by itself while the broker answers. With the broker away (for good,
            # maybe) it would wait for the reconnect: it is cancelled then, which loses nothing (a
            # job it got unacked goes back to its queue with the channel), where cancelling it
            # beside a live broker could strand a job it got on the open channel.
            while not self._task.done():
                if not self._connection.connected.is_set():
                    self._task.cancel()
                    break
                await asyncio.wait({self._task}, timeout=POLL_S)
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._reported = (-1, -math.inf)
        with contextlib.suppress(Exception):  # Redis away: the figure expires by itself
            await self._fair.withdraw(self._model, self._worker_id)
        await self._give_back_next()

    async def _give_back_next(self) -> None:
        """The job taken to start next goes back to its tenant's queue, first in line, counted again."""
        message, self._next = self._next, None
        if message is None:
            return
        tenant = Job.model_validate_json(message.body).tenant
        with contextlib.suppress(Exception):  # the broker is away: it gets the job back with the channel
            await message.nack(requeue=True)
        with contextlib.suppress(Exception):  # Redis away: the reconcile counts it
            await self._fair.enqueued(self._model, tenant, band=INTERACTIVE)

    async def _take(self) -> None:
        outage = Outage("worker_pulling")
        while not self._paused.is_set():
            # A ring (a tenant has jobs waiting that had none) or a poll: look in Redis again.
            if self._doorbell.is_set() or self._polled:
                self._waiting = {INTERACTIVE: True, BATCH: True}
            if self._polled:
                self._handed_back = True
            # Cleared before looking, so a ring or a freed sequence during the look is not missed.
            self._doorbell.clear()
            self._runner.freed.clear()
            self._polled = False
            try:
                took = await self._take_one()
            except Exception as exc:  # noqa: BLE001 - the broker or Redis is away: look again once it is back
                if self._channel is None or self._channel.is_closed:
                    self._queues = {}
                await asyncio.sleep(min(POLL_S * 4, outage.failed(exc)))
                continue
            outage.recovered()
            self._report_free()
            if not took:
                self._polled = not await self._rung(POLL_S)

    def _report_free(self) -> None:
        """Tell the session managers how many sequences are free here, when it changed or every
        `FREE_REFRESH_S`: while nothing waits, they send a job straight to a free sequence."""
        free, now = self._runner.free_sequences, time.monotonic()
        reported, since = self._reported[0], now - self._reported[1]
        # At every change between none and some at once; other changes at most every
        # `FREE_REPORT_S` (the session managers count their reservations down meanwhile).
        if since < FREE_REFRESH_S and (free == reported or ((free > 0) == (reported > 0) and since < FREE_REPORT_S)):
            return
        self._reported = (free, now)
        self._fair.report_free(self._model, self._worker_id, free, valid_ms=FREE_VALID_MS)

    async def _take_one(self) -> bool:
        """Start one waiting job if there is room for it; whether one started."""
        runner = self._runner
        if runner.has_room_for_interactive():
            message, self._next = self._next, None
            if message is None:
                message = await self._take_fair(INTERACTIVE)
            if message is not None:
                await runner.on_message(message)
                return True
        elif runner.running < runner.max_seqs + self._headroom:
            # Full: the least served tenant, if it has no job running here, still starts at once,
            # in the headroom (jobs that start together end together: it would wait for a wave).
            message = await self._take_fair(INTERACTIVE, excluded=runner.tenants_running, least_only=True)
            if message is not None:
                runner.start(message)
                return True
        if self._next is None and not runner.has_room_for_interactive():
            # Full: the fair share's next pick is taken now, to start the moment a sequence frees
            # (a pull's round trips then cost no sequence any time).
            self._next = await self._take_fair(INTERACTIVE)
            if self._next is not None:
                return False
        if runner.has_free_sequence(self._reserved):
            message = None
            if self._handed_back:
                message = await self._batch_queue.get(no_ack=False, fail=False, timeout=self._timeout_s)
                self._handed_back = message is not None
            if message is None:
                message = await self._take_fair(BATCH)
            if message is not None:
                if self._paused.is_set():
                    with contextlib.suppress(Exception):  # paused while it was taken: back, first in line
                        await message.nack(requeue=True)
                    return False
                runner.start(message)
                return True
        if runner.has_free_sequence() and time.monotonic() - self._reconciled > RECONCILE_S:
            await self.reconcile()
        return False

    async def _take_fair(
        self, band: Band, excluded: Collection[str] = (), *, least_only: bool = False
    ) -> AbstractIncomingMessage | None:
        """One job of the tenant the fair share picks (not one of `excluded`; with `least_only`,
        only the least served), or None when no tenant has one waiting."""
        if not self._waiting[band]:
            return None
        for _ in range(_MAX_MISSES):
            tenant = await self._fair.claim(self._model, band=band, excluded=excluded, least_only=least_only)
            if tenant is None:
                if not excluded:
                    self._waiting[band] = False  # until the doorbell rings or the next poll
                return None
            queue = await self._queue(tenant, band)
            message = await queue.get(no_ack=False, fail=False, timeout=self._timeout_s)
            if message is not None:
                return message
            log.debug("fair_take_missed", tenant=tenant, band=band)
        return None

    async def reconcile(self) -> None:
        """Count what waits in each known tenant's queue that Redis does not (a session manager
        died between the broker's confirm and its count, or a job was redelivered there).

        A job is in its queue a moment before it is counted (the session manager counts it once
        the broker confirmed it), so each queue is read before its count, and only what was
        missing at two reconciles in a row (the lesser figure) is added: a count added twice
        would leave a tenant waiting for jobs that are not there."""
        self._reconciled = time.monotonic()
        missing_before, self._missing = self._missing, {}
        for band in (INTERACTIVE, BATCH):
            self._queues = {}  # declared again: a fresh count
            for tenant in (await self._fair.state(self._model, band=band)).known:
                ready = (await self._queue(tenant, band)).declaration_result.message_count or 0
                counted = await self._fair.waiting(self._model, tenant, band=band)
                if ready > counted:
                    self._missing[(tenant, band)] = missing = ready - counted
                    confirmed = min(missing, missing_before.get((tenant, band), 0))
                    if confirmed > 0:
                        log.info("fair_reconciled", tenant=tenant, band=band, jobs=confirmed)
                        await self._fair.enqueued(self._model, tenant, band=band, count=confirmed)
                        del self._missing[(tenant, band)]
        if self._missing:  # look again soon, to confirm
            self._reconciled -= RECONCILE_S - RECONFIRM_S

    async def _queue(self, tenant: str, band: Band) -> AbstractQueue:
        name = self._names.tenant_queue(self._model, tenant, batch=band == BATCH)
        queue = self._queues.get(name)
        if queue is None:
            if self._channel is None or self._channel.is_closed:
                self._channel = await self._connection.channel()
            queue = await declare_tenant_queue(
                self._channel,
                self._names,
                self._model,
                tenant,
                batch=band == BATCH,
                max_queued_jobs=self._max_queued_jobs,
            )
            self._queues[name] = queue
        return queue

    async def _rung(self, timeout_s: float) -> bool:
        """Wait for the doorbell, a freed sequence, or `timeout_s`; whether one came in time."""
        waits = [asyncio.ensure_future(self._doorbell.wait()), asyncio.ensure_future(self._runner.freed.wait())]
        try:
            done, _pending = await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        return bool(done)


async def listen_for_doorbell(
    url: str, channel: str, doorbell: asyncio.Event, gate: RedisGate, *, timeout_s: float
) -> None:
    """Set `doorbell` whenever a session manager says a job waits for the model (`channel`),
    subscribed again after each lost connection (`stay_subscribed`)."""
    lost = asyncio.Event()
    subscriber = RedisSubscriber(
        url, timeout_s=timeout_s, on_message=lambda _channel, _body: doorbell.set(), on_lost=lost.set
    )
    try:
        await stay_subscribed(subscriber, channel, lost, gate, "fair_doorbell")
    finally:
        await subscriber.aclose()
