"""Publishes jobs to RabbitMQ with publisher confirms."""

import asyncio
import time

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractRobustConnection
from aio_pika.exceptions import AMQPError, DeliveryError

from shared.clients import MAX_JOB_PRIORITY, declare_job_queue
from shared.errors import Unavailable
from shared.logging import get_logger
from shared.names import Names
from shared.schemas import Job

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
        self._exchange: AbstractExchange | None = None
        self._declared: set[str] = set()
        self._declare_lock = asyncio.Lock()

    async def start(self) -> None:
        self._channel = await self._connection.channel(publisher_confirms=True)
        self._exchange = await self._channel.declare_exchange(
            self._names.jobs_exchange, aio_pika.ExchangeType.DIRECT, durable=True
        )

    async def _ensure_queue(self, model: str) -> None:
        if model in self._declared:
            return
        async with self._declare_lock:
            if model not in self._declared:
                await declare_job_queue(
                    self._channel, self._names, model, max_queued_jobs=self._max_queued_jobs
                )
                self._declared.add(model)

    async def publish(self, job: Job, *, priority: int, request_id: str) -> None:
        """Publish `job` persistently; the broker drops it unread once its deadline passes.

        Raises:
            Unavailable: the model's queue is full, or the broker did not confirm in time.
        """
        if self._exchange is None:
            raise Unavailable("The job broker is not connected yet.", retry_after_s=2)
        ttl_ms = max(1, int((job.deadline - time.time()) * 1000))
        message = aio_pika.Message(
            body=job.model_dump_json().encode(),
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=job.job_id,
            priority=max(0, min(priority, MAX_JOB_PRIORITY)),
            headers={"x-request-id": request_id},
            expiration=ttl_ms / 1000,
        )
        try:
            await self._ensure_queue(job.model)
            await self._exchange.publish(
                message, routing_key=job.model, timeout=self._publish_timeout_s
            )
        except DeliveryError as exc:
            raise Unavailable(
                f"Too many requests are queued for model '{job.model}'; try again shortly.",
                retry_after_s=2,
                code="queue_full",
            ) from exc
        except (TimeoutError, AMQPError, ConnectionError) as exc:
            log.warning("job_publish_failed", error=repr(exc))
            raise Unavailable("The job broker is unavailable; try again shortly.", retry_after_s=2) from exc
