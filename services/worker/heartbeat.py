"""The worker's heartbeat: its entry in the registry of live workers (`shared/registry.py`), kept fresh
while its engine is healthy, which session managers read to route jobs and sessions to it. While
Redis is unreachable it waits at the worker's `RedisGate` and beats again the moment Redis answers,
so the worker is listed again at once."""

import asyncio
from collections.abc import Callable

from services.worker.engines import Engine, EngineError
from services.worker.redis_gate import RedisGate
from shared.logging import get_logger
from shared.outages import redis_unreachable
from shared.registry import WorkerRegistry

log = get_logger(__name__)


class Heartbeat:
    """Keeps this worker's entry in the registry fresh while its engine is healthy."""

    def __init__(
        self,
        registry: WorkerRegistry,
        *,
        worker_id: str,
        engine: Engine,
        interval_s: float,
        ttl_s: float,
        on_engine_failure: Callable[[str], None],
        gate: RedisGate,
        prefix_index: bool = False,
    ) -> None:
        self._registry = registry
        self._worker_id = worker_id
        self._engine = engine
        self._interval_s = interval_s
        self._ttl_s = ttl_s
        self._on_engine_failure = on_engine_failure
        self._gate = gate
        # Announced with every beat: session managers read this worker's set of the prefix index.
        self._prefix_index = prefix_index
        # Announced with every beat: a draining worker is no session's home any more.
        self._draining = False

    async def run(self) -> None:
        while True:
            try:
                await self._engine.check_health()
            except EngineError as exc:
                log.error("engine_unhealthy", error=str(exc))
                await self.withdraw()
                self._on_engine_failure(str(exc))
                return
            if await self._beat():
                await asyncio.sleep(self._interval_s)
            else:
                await self._gate.wait_until_up()

    async def draining(self) -> None:
        """Announce at once that this worker drains: session managers stop sending it sessions' jobs
        (within their registry cache's lifetime) while it stays listed for its model."""
        self._draining = True
        await self._beat()

    async def _beat(self) -> bool:
        """Write the entry; False if Redis was unreachable (reported to the gate)."""
        try:
            await self._registry.heartbeat(
                worker_id=self._worker_id,
                model=self._engine.model_name,
                ttl_s=self._ttl_s,
                max_seqs=self._engine.max_seqs,
                context_tokens=self._engine.context_tokens,
                supports=self._engine.supports,
                draining=self._draining,
                adapters=self._engine.adapters,
                engine=self._engine.name,
                prefix_index=self._prefix_index,
            )
        except Exception as exc:  # noqa: BLE001 - a failed beat must not end the loop
            if redis_unreachable(exc):
                self._gate.report(exc)
                return False
            log.warning("heartbeat_failed", error=repr(exc))
        return True

    async def withdraw(self) -> None:
        try:
            await self._registry.remove(self._worker_id)
        except Exception as exc:  # noqa: BLE001 - the entry expires on its own anyway
            log.warning("withdraw_failed", error=repr(exc))
