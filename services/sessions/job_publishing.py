"""Publishes jobs to RabbitMQ with publisher confirms: to the model's shared queue, or a session's
job to its home worker's own queue, from which RabbitMQ moves it to the shared queue once it has
waited `AXON_AFFINITY_WAIT_MS` there (per-message TTL and dead-lettering: the broker spills it, not
a timer of ours), or a batch line's job to the model's batch queue (`shared/topology.py`)."""

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

from shared.errors import Unavailable
from shared.logging import get_logger
from shared.names import Names
from shared.schemas import Job
from shared.topology import MAX_JOB_PRIORITY, declare_batch_queue, declare_job_queue

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
    ) -> None:
        self._connection = connection
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

    async def _ensure_queue(self, channel: AbstractChannel, model: str, *, batch: bool) -> str:
        """Declare the queue a job of `model` goes to (once); returns its routing key."""
        key = self._names.batch_queue(model) if batch else model
        if key in self._declared:
            return key
        async with self._declare_lock:
            if key not in self._declared:
                declare = declare_batch_queue if batch else declare_job_queue
                await declare(channel, self._names, model, max_queued_jobs=self._max_queued_jobs)
                self._declared.add(key)
        return key

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
    ) -> None:
        """Publish `job` persistently; the broker drops it unread once its deadline passes.

        A batch line's job (`job.batch`) goes to the model's batch queue. With `home` (a live
        worker that served the session's last turn, and affinity on), the job
        goes to that worker's own queue with a per-message TTL of `affinity_wait_ms` (or what is
        left to its deadline, if less); expired there, RabbitMQ dead-letters it to the model's
        queue. That queue gone (its worker died a while ago), the broker returns the job and it is
        published to the model's queue instead.

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
        left_ms = max(1, int((job.deadline - time.time()) * 1000))
        properties = _properties(job, priority=priority, request_id=request_id, expiration_ms=left_ms, headers=headers)
        body = job.model_dump_json().encode()
        try:
            routing_key = await self._ensure_queue(self._channel, job.model, batch=job.batch)
            channel = await self._channel.get_underlay_channel()
            if home is not None and self.affinity and not job.batch:
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
                    return
                log.info("job_home_missing", model=job.model, worker_id=home)
                route = "home_missing"
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
        except (TimeoutError, AMQPError, ChannelInvalidStateError, ConnectionError) as exc:
            log.warning("job_publish_failed", error=repr(exc))
            raise Unavailable("The job broker is unavailable; try again shortly.", retry_after_s=2) from exc
        if not isinstance(confirmation, spec.Basic.Ack):
            # Returned unrouted: the queue is gone. Declare it again for the next request.
            self._declared.discard(routing_key)
            log.warning("job_returned", model=job.model)
            raise Unavailable(f"The job queue of model '{job.model}' was missing; try again.", retry_after_s=1)
        self._count(job.model, route)

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
        headers={"x-request-id": request_id, **headers} if headers else {"x-request-id": request_id},
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
) -> None:
    """Publish every job of a request (one per choice), or none: when one fails, the others are
    called off (`cancel`). `home`: the worker whose own queue a session's (single) job goes to
    first; `headers`: more message headers (`JobPublisher.publish`).

    Raises:
        Unavailable: a job could not be queued.
    """
    publishes = [
        publisher.publish(job, priority=priority, request_id=request_id, home=home, headers=headers) for job in jobs
    ]
    results: list[BaseException | None]
    if len(publishes) == 1:
        try:
            await publishes[0]
            return
        except Unavailable as exc:
            results = [exc]
    else:
        results = await asyncio.gather(*publishes, return_exceptions=True)
    failure = next((r for r in results if r is not None), None)
    if failure is None:
        return
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
