"""Polls, every `AXON_QUEUE_POLL_INTERVAL_S`, how many jobs wait in each model's queue and how many workers serve it
(and exports each model's cold-start wait beside them, for alerts on pools that may be at zero),
and, from the fair share's state in Redis, each tenant's waiting jobs and Jain's fairness index of
what the tenants with jobs waiting were served since the last poll (`shared/fair.py`).

RabbitMQ reports a queue's ready messages and consumers in the answer to a passive declare,
which needs no management plugin (Amazon MQ has no Prometheus endpoint). Every session manager
polls and exports the same values, so dashboards and alerts take `max by (model)`.
"""

import asyncio
import contextlib

import redis.asyncio as redis
from aio_pika.abc import AbstractRobustChannel, AbstractRobustConnection
from aiormq.exceptions import ChannelNotFoundEntity

from services.sessions.catalog import ModelCatalog
from services.sessions.metrics import SessionsMetrics
from shared.fair import BATCH, INTERACTIVE, Band, BandState, FairShare
from shared.logging import get_logger
from shared.names import Names
from shared.outages import Outage

log = get_logger(__name__)

_DECLARE_TIMEOUT_S = 5.0


class QueueDepthPoller:
    """Keeps `axon_sessions_queue_depth`, `_queue_consumers` and `_live_workers` current.

    Models polled: every model some worker served in the namespace in the last 7 days (`<ns>:models`)
    and every live one, so a model that lost its workers reports 0 live workers and its backlog.
    """

    def __init__(
        self,
        *,
        connection: AbstractRobustConnection,
        catalog: ModelCatalog,
        client: redis.Redis,
        names: Names,
        metrics: SessionsMetrics,
        fair: FairShare | None = None,
        interval_s: float,
    ) -> None:
        self._fair = fair
        # The fair share's state at the last poll, per model and band; the tenants reported waiting.
        self._fair_states: dict[tuple[str, Band], BandState] = {}
        self._waiting_reported: set[tuple[str, str, Band]] = set()
        self._connection = connection
        self._catalog = catalog
        self._redis = client
        self._names = names
        self._metrics = metrics
        self._interval_s = interval_s
        self._channel: AbstractRobustChannel | None = None
        self._reported: set[str] = set()

    async def run(self) -> None:
        """Poll until cancelled; a failed poll is counted, never fatal, and an outage (Redis or
        RabbitMQ away) logged once, then its end."""
        outage = Outage("queue_poll", first_s=self._interval_s, cap_s=self._interval_s)
        try:
            while True:
                try:
                    await self.poll()
                except Exception as exc:  # noqa: BLE001 - retried on the next tick
                    self._metrics.queue_poll_errors.inc()
                    await self._drop_channel()
                    await asyncio.sleep(outage.failed(exc))
                    continue
                outage.recovered()
                await asyncio.sleep(self._interval_s)
        finally:
            await self._drop_channel()

    async def poll(self) -> None:
        """Read live workers per model from heartbeats, then each model queue's depth."""
        live = await self._catalog.live()
        known = {m.decode() if isinstance(m, bytes) else m for m in await self._redis.smembers(self._names.models_key)}
        # Adapters have no queue of their own: their jobs wait in their base model's.
        models = known | {model for model, state in live.items() if state.parent is None}
        for model in models:
            self._metrics.live_workers.labels(model).set(live[model].workers if model in live else 0)
            self._metrics.cold_start_wait.labels(model).set(self._catalog.cold_start_wait(model))
        for model in sorted(models):
            await self._poll_queue(model)
            if self._fair is not None:
                for band in (INTERACTIVE, BATCH):
                    await self._poll_fair_share(model, band)
        for gone in self._reported - models:
            self._forget(gone)
        self._reported = models

    async def _poll_queue(self, model: str) -> None:
        channel = await self._ensure_channel()
        try:
            # robust=False: a robust channel caches passively declared queues, with their counts.
            queue = await channel.declare_queue(
                self._names.jobs_queue(model), passive=True, robust=False, timeout=_DECLARE_TIMEOUT_S
            )
        except ChannelNotFoundEntity:
            # No queue yet (no job published, no worker started): nothing waits. The broker
            # closed the channel; the next model gets a new one.
            await self._drop_channel()
            self._metrics.queue_depth.labels(model).set(0)
            self._metrics.queue_consumers.labels(model).set(0)
            return
        result = queue.declaration_result
        self._metrics.queue_depth.labels(model).set(result.message_count or 0)
        self._metrics.queue_consumers.labels(model).set(result.consumer_count or 0)

    async def _poll_fair_share(self, model: str, band: Band) -> None:
        assert self._fair is not None
        state = await self._fair.state(model, band=band)
        waiting = {(model, tenant, band) for tenant in state.waiting}
        for gone in {w for w in self._waiting_reported if w[:1] == (model,) and w[2] == band} - waiting:
            self._metrics.tenant_waiting.labels(*gone).set(0)
        for tenant, count in state.waiting.items():
            self._metrics.tenant_waiting.labels(model, tenant, band).set(count)
        self._waiting_reported |= waiting
        before = self._fair_states.get((model, band))
        self._fair_states[(model, band)] = state
        if before is not None:
            self._metrics.fairness.labels(model, band).set(jain_index(before, state))

    def _forget(self, model: str) -> None:
        gauges = (
            self._metrics.queue_depth,
            self._metrics.queue_consumers,
            self._metrics.live_workers,
            self._metrics.cold_start_wait,
        )
        for gauge in gauges:
            with contextlib.suppress(KeyError):
                gauge.remove(model)
        for band in (INTERACTIVE, BATCH):
            self._fair_states.pop((model, band), None)
            with contextlib.suppress(KeyError):
                self._metrics.fairness.remove(model, band)
        for waiting in [w for w in self._waiting_reported if w[0] == model]:
            self._waiting_reported.discard(waiting)
            with contextlib.suppress(KeyError):
                self._metrics.tenant_waiting.remove(*waiting)

    async def _ensure_channel(self) -> AbstractRobustChannel:
        if self._channel is None or self._channel.is_closed:
            self._channel = await self._connection.channel()
        return self._channel

    async def _drop_channel(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None and not channel.is_closed:
            with contextlib.suppress(Exception):
                await channel.close()


def jain_index(before: BandState, after: BandState) -> float:
    """Jain's fairness index, (sum x)^2 / (n sum x^2), of the weighted tokens served between two
    states to the tenants with jobs waiting in both (backlogged all along); 1 with fewer than two."""
    served = [
        after.served.get(tenant, 0.0) - before.served.get(tenant, 0.0)
        for tenant in after.waiting
        if tenant in before.waiting
    ]
    served = [max(0.0, x) for x in served]
    if len(served) < 2 or not any(served):
        return 1.0
    return sum(served) ** 2 / (len(served) * sum(x * x for x in served))
