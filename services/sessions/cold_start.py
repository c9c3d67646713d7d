"""A request for a model with no live worker (a pool at zero, or starting): its jobs are queued,
and it waits for a worker to start and take them, up to its cold-start wait, telling its client
every `KEEPALIVE_INTERVAL_S` that it still waits. The catalog says how long it may wait
(`ModelCatalog.require_or_wait`), the job carries it (`start_by`: a worker taking the job later
skips it) and the parameters it uses (`requires`: a worker that does not honour them refuses it).
"""

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from services.sessions.active_request import ActiveRequest, Choice
from services.sessions.catalog import NO_WORKER_RETRY_AFTER_S
from services.sessions.metrics import SessionsMetrics
from shared.errors import Unavailable
from shared.logging import get_logger
from shared.openai_requests import ChatCompletionRequest, CompletionRequest
from shared.schemas import Job, TokenChunk

log = get_logger(__name__)

# How often a request waiting for a worker of its model to start is told (`on_wait`: a streaming
# one sends an SSE comment), so no proxy on the way closes its idle connection.
KEEPALIVE_INTERVAL_S = 5.0


def cold_start_job(job: Job, body: ChatCompletionRequest | CompletionRequest, wait_s: float) -> Job:
    """`job` queued while its model has no live worker: its requester waits `wait_s` (at most until
    its deadline) for one to start and take it, and the parameters it uses go with it, since no live
    worker could be asked whether it honours them (a worker that does not refuses the job)."""
    start_by = min(job.deadline, time.time() + wait_s)
    return job.model_copy(update={"start_by": start_by, "requires": sorted(body.capabilities_used())})


async def first_after_cold_start(
    active: ActiveRequest,
    chunks: AsyncIterator[tuple[Choice, TokenChunk]],
    *,
    on_wait: Callable[[], Awaitable[None]] | None,
    metrics: SessionsMetrics,
) -> tuple[Choice, TokenChunk]:
    """The first of `chunks` of a request queued while its model had no live worker, waited for
    until its job's `start_by` (a worker taking the job later skips it), calling `on_wait` every
    `KEEPALIVE_INTERVAL_S` meanwhile.

    Raises:
        Unavailable: `no_worker` with Retry-After, no chunk came by `start_by`.
    """
    job = active.job
    assert job.start_by is not None
    waiting = asyncio.ensure_future(anext(chunks))
    metrics.cold_start_waiting.labels(job.model).inc()
    outcome = "error"
    try:
        while (left_s := job.start_by - time.time()) > 0 and not waiting.done():
            await asyncio.wait((waiting,), timeout=min(left_s, KEEPALIVE_INTERVAL_S))
            if not waiting.done() and on_wait is not None and job.start_by > time.time():
                await on_wait()
        if not waiting.done():
            outcome = "timed_out"
            raise Unavailable(
                f"No worker of model '{job.model}' started within its cold-start wait; try again shortly.",
                retry_after_s=NO_WORKER_RETRY_AFTER_S,
                code="no_worker",
            )
        first = waiting.result()
        outcome = "served"
        return first
    except asyncio.CancelledError:
        outcome = "disconnected"
        raise
    finally:
        if not waiting.done():
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
        metrics.cold_start_waiting.labels(job.model).dec()
        metrics.cold_start_waits.labels(job.model, outcome).inc()
        log.info("cold_start_wait_ended", outcome=outcome)
