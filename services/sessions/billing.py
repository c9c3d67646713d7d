"""What a request costs and who is charged: its usage row, and the settlement of what the
gateway's admission charged (against the key's TPM, of its token budget, its lease) to its real
usage, in one Redis write when its answer ends.

A request whose jobs were still running when it ended (its client left, a choice failed, a
deadline) is settled in the background once its workers' final chunks say what they generated
(`settle_later`); a job whose final chunk never comes is charged what its worker recorded as
published, and marked billed so that worker does not record it again (`shared/usage.py`).
"""

import asyncio
import datetime as dt
import time
from typing import Any

from services.sessions.active_request import ActiveRequest, Choice
from services.sessions.chat.protocol import request_usage, work_usage
from services.sessions.metrics import SessionsMetrics
from services.sessions.outbox import Outbox
from shared.internal_headers import Caller
from shared.logging import get_logger
from shared.names import Names
from shared.ratelimit import RateLimiter
from shared.redis_pipe import RedisPipe
from shared.schemas import Usage
from shared.tasks import BackgroundTasks
from shared.usage import MARK_BILLED, PROGRESS_GRACE_S, UsageRow, billed_tokens

log = get_logger(__name__)

# How long a request that ended before its jobs did waits for their final chunks, which carry the
# tokens they generated, before charging what their progress records (`Billing.settle_later`).
USAGE_SETTLE_WAIT_S = 5.0


class Billing:
    """Charges and settles requests (see the module's docstring)."""

    def __init__(
        self,
        *,
        pipe: RedisPipe,
        names: Names,
        outbox: Outbox,
        limiter: RateLimiter,
        metrics: SessionsMetrics,
        batch_factor: float = 1.0,
    ) -> None:
        self._pipe = pipe
        # A batch line's tokens count this share of them against its key's budget.
        self._batch_factor = batch_factor
        self._names = names
        self._outbox = outbox
        self._limiter = limiter
        self._metrics = metrics
        self._background = BackgroundTasks()

    async def charge(self, active: ActiveRequest, cancels: list[asyncio.Future[Any]]) -> None:
        """Record and charge the usage every choice's answer carries."""
        usages = [c.answer.usage for c in active.choices]
        active.usage = request_usage(usages)
        work = work_usage(usages)
        if work is not None:
            self._metrics.output_tokens.labels(active.job.model).inc(work.completion_tokens)
        await self._bill_and_release(active, cancels, work)

    def settle_later(self, active: ActiveRequest, unfinished: list[Choice], cancels: list[asyncio.Future[Any]]) -> None:
        """Charge, in a task of its own, a request that ended before the final chunks of its
        `unfinished` choices came (`_settle`)."""
        self._background.spawn(self._settle(active, unfinished, cancels))

    async def _settle(
        self, active: ActiveRequest, unfinished: list[Choice], cancels: list[asyncio.Future[Any]]
    ) -> None:
        """Their workers were told to stop, and a stopped (or failed) job's final chunk carries every
        token it generated, over all its attempts: it is awaited for up to `USAGE_SETTLE_WAIT_S`.
        A choice whose final chunk does not come (its worker died, or the job is still queued) is
        charged what its worker recorded as published (`<ns>:progress:<job>`), or at least what
        was received."""
        try:
            missing = await active.finals(unfinished, USAGE_SETTLE_WAIT_S)
        finally:
            await active.stream.close()
        if missing:
            await self._recorded_usage(missing)
        for choice in unfinished:
            if choice.answer.usage is None:
                choice.answer.usage = Usage(completion_tokens=choice.tokens)
        await self.charge(active, cancels)

    async def _recorded_usage(self, choices: list[Choice]) -> None:
        """Set each choice's usage from its job's progress in Redis: the tokens its attempts
        published (at least those received), and the prompt's. The progress is marked `billed`
        at the same time, so a final chunk its worker publishes later does not record the job's
        usage again (`services/worker/chunk_publisher.py`)."""
        now = time.time()
        reads = [
            self._pipe.submit_script(
                MARK_BILLED,
                [self._names.job_progress(c.job.job_id)],
                [max(1, int(c.job.deadline - now) + PROGRESS_GRACE_S)],
            )
            for c in choices
        ]
        results = await asyncio.gather(*reads, return_exceptions=True)
        for choice, result in zip(choices, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("usage_progress_read_failed", error=repr(result))
                continue
            completion, prompt = result
            choice.answer.usage = Usage(
                prompt_tokens=int(prompt or 0), completion_tokens=max(int(completion or 0), choice.tokens)
            )

    async def _bill_and_release(
        self, active: ActiveRequest, cancels: list[asyncio.Future[Any]], usage: Usage | None
    ) -> None:
        """The request's bookkeeping, in one Redis write: its usage row and the settlement of its
        admission to its real token use `usage` (every choice's job, once for the whole request);
        then the outcome of those and of the cancel notices. None of it may fail the answer."""
        writes: list[tuple[str, asyncio.Future[Any]]] = [("cancel_publish", cancel) for cancel in cancels]
        job, caller = active.job, active.caller
        if usage is not None:
            row = UsageRow(
                job_id=job.job_id,
                tenant=caller.tenant,
                key_id=caller.key_id,
                model=job.adapter or job.model,
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                latency_ms=int((time.perf_counter() - active.started) * 1000),
                created_at=dt.datetime.now(dt.UTC),
                batch=caller.batch,
            )
            writes.append(("usage_record", self._pipe.submit(*self._outbox.append_command("usage", row))))
        writes += self._settlement(caller, usage)
        await _written(writes)

    def _settlement(self, caller: Caller, usage: Usage | None) -> list[tuple[str, asyncio.Future[Any]]]:
        """The write that settles `caller`'s admission to its real token use `usage` (None: not
        known, settled as 0; a batch line's counted at `AXON_BATCH_BILLING_FACTOR`): the gateway's
        charge against the key's tokens per minute replaced by the use, its token budget
        reservation likewise, its lease released, in one command (`RateLimiter.submit_settle`:
        Redis down, it is sent again once Redis is back)."""
        if caller.key_id is None:
            return []
        used = usage.prompt_tokens + usage.completion_tokens if usage is not None else 0
        if caller.batch:
            used = billed_tokens(used, self._batch_factor)
        if caller.lease_id is None and caller.budget is None and not (caller.tpm_limit and used != caller.tpm_charged):
            return []
        settlement = self._limiter.submit_settle(
            caller.key_id,
            lease_id=caller.lease_id,
            tpm_limit=caller.tpm_limit,
            tpm_charged=caller.tpm_charged,
            budget=caller.budget,
            used=used,
        )
        return [("settlement", settlement)]

    async def settle(self, caller: Caller, usage: Usage | None) -> None:
        """Settle the admission of a request whose relay handed it over to its real token use
        `usage`, as `charge` does. Its usage row is its worker's: nobody received its final
        chunk. None of it may fail the caller."""
        await _written(self._settlement(caller, usage))


async def _written(writes: list[tuple[str, asyncio.Future[Any]]]) -> None:
    """Await `writes` (what, future), logging those that failed."""
    results = await asyncio.gather(*(future for _, future in writes), return_exceptions=True)
    for (what, _), result in zip(writes, results, strict=True):
        if isinstance(result, Exception):
            log.warning(f"{what}_failed", error=repr(result))
