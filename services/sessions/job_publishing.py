"""Publishes jobs to RabbitMQ with publisher confirms: to its tenant's queue of the model, from which
workers take jobs in the fair share's order (`shared/fair.py`); or, while nothing waits for the
model, a session's job to its home worker's own queue, from which RabbitMQ moves it to the shared
queue once it has waited `AXON_AFFINITY_WAIT_MS` there (per-message TTL and dead-lettering: the
broker spills it, not a timer of ours). A batch line's job goes to its tenant's batch queue. With
the fair share off (`AXON_FAIR_SHARE=false`) or Redis unreachable, jobs go to the model's shared
queue and batch lines to its batch queue, first in, first out (`shared/topology.py`)."""

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractRobustConnection
from aio_pika.exceptions import AMQPError, DeliveryError
from aiormq import spec
from aiormq.exceptions import ChannelInvalidStateError
from prometheus_client import Counter

from shared.errors import RateLimited, Unavailable
from shared.fair import BATCH, INTERACTIVE, Admission, FairShare
from shared.internal_headers import ENQUEUED_AT_HEADER
from shared.logging import get_logger
from shared.names import Names
from shared.outages import Outage
from shared.schemas import Job
from shared.topology import MAX_JOB_PRIORITY, declare_batch_queue, declare_job_queue, declare_tenant_queue

log = get_logger(__name__)


class JobPublisher:
    """Sends a job to its model's durable queue, or to its session's home worker's queue; returns
    only once the broker has it."""

    def __init__(
        self,
        connection: AbstractRobustConnection,
        names: Names,
        *,
        max_queued_jobs: int,
        publish_timeout_s: float,
        affinity_wait_ms: int = 0,
        routed: Counter | None = None,
        fair: FairShare | None = None,
    ) -> None:
        self._connection = connection
        # None: the fair share is off, every job goes to its model's shared (or batch) queue.
        self._fair = fair
        self._fair_outage = Outage("fair_share", first_s=0.5, cap_s=0.5)
        self._names = names
        # 0: affinity off, every job goes to the shared queue.
        self._affinity_wait_ms = affinity_wait_ms
        # Confirmed jobs by model and route (`axon_sessions_jobs_routed_total`).
        self._routed = routed
        self._max_queued_jobs = max_queued_jobs
        self._publish_timeout_s = publish_timeout_s
        self._channel: AbstractChannel | None = None
        self._declared: set[str] = set()
        self._declare_lock = asyncio.Lock()

    async def start(self) -> None:
        channel = await self._connection.channel(publisher_confirms=True)
        await channel.declare_exchange(self._names.jobs_exchange, aio_pika.ExchangeType.DIRECT, durable=True)
        self._channel = channel

    async def _ensure_queue(self, channel: AbstractChannel, model: str, *, batch: bool, tenant: str | None) -> str:
        """Declare the queue a job of `model` goes to (once): its tenant's (`tenant`), else the
        model's shared or batch queue; returns its routing key."""
        if tenant is not None:
            key = self._names.tenant_queue(model, tenant, batch=batch)
        else:
            key = self._names.batch_queue(model) if batch else model
        if key in self._declared:
            return key
        async with self._declare_lock:
            if key not in self._declared:
                if tenant is not None:
                    await declare_tenant_queue(
                        channel, self._names, model, tenant, batch=batch, max_queued_jobs=self._max_queued_jobs
                    )
                else:
                    declare = declare_batch_queue if batch else declare_job_queue
                    await declare(channel, self._names, model, max_queued_jobs=self._max_queued_jobs)
                self._declared.add(key)
        return key

    async def _admit(self, job: Job) -> Admission | None:
        """Ask the fair share whether `job` may wait (`shared/fair.py`): None when it is off or
        Redis did not answer (the job goes first in, first out: said once per outage), else its
        admission (nothing waits for the model: a session's job may go to its home worker, and a
        free sequence may have been reserved for it).

        Raises:
            RateLimited: the job's tenant has its share of the model's queue waiting already.
        """
        if self._fair is None or job.start_by is not None:
            # A job waiting for a pool at zero goes to the queue its autoscaler watches.
            return None
        try:
            admission = await self._fair.admit(
                job.model, job.tenant, band=BATCH if job.batch else INTERACTIVE, limit=self._max_queued_jobs
            )
        except Exception as exc:  # noqa: BLE001 - Redis away: first in, first out until it is back
            self._fair_outage.failed(exc, fallback="first in, first out")
            return None
        self._fair_outage.recovered()
        if not admission.within_share and not job.batch:
            raise RateLimited(
                f"Too many requests of your tenant are waiting for model '{job.model}' (its share of the"
                f" queue is {admission.allowance}); try again shortly.",
                code="tenant_queue_full",
                headers={"Retry-After": "1"},
            )
        return admission

    async def _enqueued(self, job: Job) -> None:
        """Count a job the broker confirmed in its tenant's queue (a failure is left to the
        workers' reconciling with the queue, `services/worker/pulling.py`)."""
        assert self._fair is not None
        try:
            await self._fair.enqueued(job.model, job.tenant, band=BATCH if job.batch else INTERACTIVE)
        except Exception as exc:  # noqa: BLE001 - the job waits in its queue all the same
            log.warning("fair_enqueue_failed", model=job.model, error=repr(exc))

    @property
    def affinity(self) -> bool:
        """Whether a session's jobs go to the worker that served its last turn first."""
        return self._affinity_wait_ms > 0

    async def publish(
        self,
        job: Job,
        *,
        priority: int,
        request_id: str,
        home: str | None = None,
        headers: Mapping[str, Any] | None = None,
    ) -> str:
        """Publish `job` persistently; the broker drops it unread once its deadline passes. Returns
        the route it took (`axon_sessions_jobs_routed_total`'s: `home` when it went to `home`'s queue).

        A job goes to its tenant's queue (a batch line's to its tenant's batch queue), unless
        nothing waits for the model and a worker had a free sequence (reserved for it): then to
        the model's queue, pushed to a worker at once. With `home` (a live worker that served the
        session's last turn, affinity on, and nothing waiting), the job goes to that worker's own
        queue with a per-message TTL of `affinity_wait_ms` (or what is left to its deadline, if
        less); expired there, RabbitMQ dead-letters it to the model's queue. That queue gone (its
        worker died a while ago), the broker returns the job and it is published to the model's
        queue instead.

        `headers`: more message headers (the trace context, `shared/tracing.py`).

        Published on the underlying aiormq channel: aio-pika's `Exchange.publish` adds a
        `Message` object and checks per call, and its robust channel still recovers the
        channel after a broker restart. `mandatory` makes the broker return a job no queue
        takes (its queue was deleted) instead of dropping it.

        Raises:
            Unavailable: the model's queue is full or missing, or the broker did not confirm in time.
        """
        if self._channel is None or not self._connection.connected.is_set():
            # Refused at once while the robust connection reconnects: its channel would make the
            # request wait for the broker's return, however long that takes.
            raise Unavailable("The job broker is unavailable; try again shortly.", retry_after_s=2)
        admission = await self._admit(job)
        # Waits in its tenant's queue: admitted, and no free sequence reserved for it.
        fair = admission is not None and not admission.reserved
        left_ms = max(1, int((job.deadline - time.time()) * 1000))
        properties = _properties(job, priority=priority, request_id=request_id, expiration_ms=left_ms, headers=headers)
        body = job.model_dump_json().encode()
        try:
            routing_key = await self._ensure_queue(
                self._channel, job.model, batch=job.batch, tenant=job.tenant if fair else None
            )
            channel = await self._channel.get_underlay_channel()
            if home is not None and self.affinity and not job.batch and (admission is None or admission.idle):
                wait_ms = min(left_ms, self._affinity_wait_ms)
                confirmation = await channel.basic_publish(
                    body,
                    exchange=self._names.jobs_exchange,
                    routing_key=self._names.worker_queue(job.model, home),
                    properties=_properties(
                        job, priority=priority, request_id=request_id, expiration_ms=wait_ms, headers=headers
                    ),
                    mandatory=True,
                    timeout=self._publish_timeout_s,
                )
                if isinstance(confirmation, spec.Basic.Ack):
                    self._count(job.model, "home")
                    return "home"
                log.info("job_home_missing", model=job.model, worker_id=home)
                route = "home_missing"
            elif fair:
                route = "tenant_batch" if job.batch else "tenant"
            else:
                route = "batch" if job.batch else "shared"
            confirmation = await channel.basic_publish(
                body,
                exchange=self._names.jobs_exchange,
                routing_key=routing_key,
                properties=properties,
                mandatory=True,
                timeout=self._publish_timeout_s,
            )
        except DeliveryError as exc:
            raise Unavailable(
                f"Too many requests are queued for model '{job.model}'; try again shortly.",
                retry_after_s=2,
                code="queue_full",
            ) from exc
        except TimeoutError as exc:
            log.warning("job_publish_failed", error=repr(exc), connected=self._connection.connected.is_set())
            if self._connection.connected.is_set():
                # The broker is up but did not confirm in time: overloaded, not away. The caller
                # calls the job off (`publish_all`), so it does not run for a client told no.
                raise Unavailable(
                    f"The platform is overloaded: the job broker did not take the job within"
                    f" {self._publish_timeout_s:g} s; try again shortly.",
                    retry_after_s=2,
                    code="overloaded",
                ) from exc
            raise Unavailable("The job broker is unavailable; try again shortly.", retry_after_s=2) from exc
        except (AMQPError, ChannelInvalidStateError, ConnectionError) as exc:
            log.warning("job_publish_failed", error=repr(exc))
            raise Unavailable("The job broker is unavailable; try again shortly.", retry_after_s=2) from exc
        if not isinstance(confirmation, spec.Basic.Ack):
            # Returned unrouted: the queue is gone. Declare it again for the next request.
            self._declared.discard(routing_key)
            log.warning("job_returned", model=job.model)
            raise Unavailable(f"The job queue of model '{job.model}' was missing; try again.", retry_after_s=1)
        if fair:
            await self._enqueued(job)
        self._count(job.model, route)
        return route

    def _count(self, model: str, route: str) -> None:
        if self._routed is not None:
            self._routed.labels(model, route).inc()


def _properties(
    job: Job, *, priority: int, request_id: str, expiration_ms: int, headers: Mapping[str, Any] | None = None
) -> spec.Basic.Properties:
    """A job message's AMQP properties: persistent, its id, its caller's priority, expiring after
    `expiration_ms` (RabbitMQ then dead-letters it), with `headers` beside its request id."""
    return spec.Basic.Properties(
        content_type="application/json",
        delivery_mode=2,  # persistent
        message_id=job.job_id,
        priority=max(0, min(priority, MAX_JOB_PRIORITY)),
        headers={"x-request-id": request_id, ENQUEUED_AT_HEADER: int(time.time() * 1000), **(headers or {})},
        expiration=str(expiration_ms),
    )


async def publish_all(
    publisher: JobPublisher,
    jobs: list[Job],
    *,
    priority: int,
    request_id: str,
    home: str | None,
    cancel: Callable[[str], "asyncio.Future[Any]"],
    headers: Mapping[str, Any] | None = None,
) -> str | None:
    """Publish every job of a request (one per choice), or none: when one fails, the others are
    called off (`cancel`). `home`: the worker whose own queue a single job goes to first;
    `headers`: more message headers (`JobPublisher.publish`). Returns a single job's route
    (`JobPublisher.publish`; None for several).

    Raises:
        Unavailable: a job could not be queued.
    """
    publishes = [
        publisher.publish(job, priority=priority, request_id=request_id, home=home, headers=headers) for job in jobs
    ]
    if len(publishes) == 1:
        try:
            return await publishes[0]
        except Unavailable as exc:
            results: list[BaseException | str] = [exc]
    else:
        results = await asyncio.gather(*publishes, return_exceptions=True)
    failure = next((r for r in results if isinstance(r, BaseException)), None)
    if failure is None:
        return None
    for job, result in zip(jobs, results, strict=True):
        # Unconfirmed (the broker went away before its confirm) or published, a job may be
        # queued: workers skip a job they were told was cancelled, so none answers it for nobody.
        if not (isinstance(result, Unavailable) and result.code == "queue_full"):
            cancel(job.job_id).add_done_callback(_cancel_sent)
    raise failure


def _cancel_sent(future: "asyncio.Future[Any]") -> None:
    """A cancel notice's outcome: an error is only logged."""
    if not future.cancelled() and future.exception() is not None:
        log.warning("cancel_publish_failed", error=repr(future.exception()))
