"""Publishes jobs to RabbitMQ with publisher confirms."""

import asyncio
import time

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractRobustConnection
from aio_pika.exceptions import AMQPError, DeliveryError
from aiormq import spec
from aiormq.exceptions import ChannelInvalidStateError

from shared.errors import Unavailable
from shared.logging import get_logger
from shared.names import Names
from shared.schemas import Job
from shared.topology import MAX_JOB_PRIORITY, declare_job_queue

log = get_logger(__name__)


class JobPublisher:
    """Sends a job to its model's durable queue; returns only once the broker has it."""

    def __init__(
        self,
        connection: AbstractRobustConnection,
        names: Names,
        *,
        max_queued_jobs: int,
        publish_timeout_s: float,
    ) -> None:
        self._connection = connection
        self._names = names
        self._max_queued_jobs = max_queued_jobs
        self._publish_timeout_s = publish_timeout_s
        self._channel: AbstractChannel | None = None
        self._declared: set[str] = set()
        self._declare_lock = asyncio.Lock()

    async def start(self) -> None:
        channel = await self._connection.channel(publisher_confirms=True)
        await channel.declare_exchange(self._names.jobs_exchange, aio_pika.ExchangeType.DIRECT, durable=True)
        self._channel = channel

    async def _ensure_queue(self, channel: AbstractChannel, model: str) -> None:
        if model in self._declared:
            return
        async with self._declare_lock:
            if model not in self._declared:
                await declare_job_queue(channel, self._names, model, max_queued_jobs=self._max_queued_jobs)
                self._declared.add(model)

    async def publish(self, job: Job, *, priority: int, request_id: str) -> None:
        """Publish `job` persistently; the broker drops it unread once its deadline passes.

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
        properties = spec.Basic.Properties(
            content_type="application/json",
            delivery_mode=2,  # persistent
            message_id=job.job_id,
            priority=max(0, min(priority, MAX_JOB_PRIORITY)),
            headers={"x-request-id": request_id},
            expiration=str(max(1, int((job.deadline - time.time()) * 1000))),
        )
        try:
            await self._ensure_queue(self._channel, job.model)
            channel = await self._channel.get_underlay_channel()
            confirmation = await channel.basic_publish(
                job.model_dump_json().encode(),
                exchange=self._names.jobs_exchange,
                routing_key=job.model,
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
            self._declared.discard(job.model)
            log.warning("job_returned", model=job.model)
            raise Unavailable(f"The job queue of model '{job.model}' was missing; try again.", retry_after_s=1)
