"""Leases on answers that run on without their clients and that any session manager can finish
(stored responses, held by `run_on.py`, and batches, held by `batches/service.py`, each kind with
a set of its own), so that each is finished by exactly one live session manager, whichever dies.

An unfinished stored response is a member of the sorted set `<ns>:responses:running`, scored by
the time (ms) its lease expires, and `<ns>:responses:owners` maps it to the instance holding the
lease: the session manager relaying its job. That one renews every lease it holds every third of
`AXON_RESPONSE_LEASE_S`; every session manager, as often, claims the leases that expired (their
holder was killed; one that stops hands its leases over expired) in one script call, and takes
each over: it rebuilds the response
from its job's chunk log, follows the log to the final chunk and stores the response
(`ResponsesService.take_over`). Finishing a response removes it from the set in the same script
that stores it (`ResponseStore.finish`), so only one finisher stores it.
"""

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import redis.asyncio as redis
from prometheus_client import Counter, Gauge

from shared.logging import get_logger
from shared.names import Names
from shared.outages import MAX_DELAY_S, Outage

log = get_logger(__name__)


# Responses one sweep claims at most (the next sweep takes the rest).
_CLAIM_BATCH = 64

# KEYS: running set, owners hash. ARGV: owner, new expiry (ms), response ids...
# Renews the leases `owner` still holds; returns, per id, 1 (renewed), 0 (finished: no longer
# running) or -1 (another instance took it over).
_RENEW = """
local result = {}
for i = 3, #ARGV do
  local id = ARGV[i]
  if redis.call('ZSCORE', KEYS[1], id) == false then
    result[#result + 1] = 0
  elseif redis.call('HGET', KEYS[2], id) ~= ARGV[1] then
    result[#result + 1] = -1
  else
    redis.call('ZADD', KEYS[1], 'XX', ARGV[2], id)
    result[#result + 1] = 1
  end
end
return result
"""
# KEYS: running set, owners hash. ARGV: owner, now (ms), new expiry (ms), batch.
# Claims up to `batch` responses whose lease expired; returns their ids.
_CLAIM = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[2], 'LIMIT', 0, tonumber(ARGV[4]))
for _, id in ipairs(ids) do
  redis.call('ZADD', KEYS[1], ARGV[3], id)
  redis.call('HSET', KEYS[2], id, ARGV[1])
end
return ids
"""


class ResponseLeases:
    """This process's leases on unfinished stored responses, and the sweep that claims expired ones.

    `hold(id, coro)` runs the relay of a response this process leased (`ResponseStore.open` took
    the lease) as a task of its own, `attached(id)` marks one relayed by a client's request; `run`
    renews them and claims the expired ones, starting `take_over(id)` for each. A task whose
    response was finished elsewhere (cancelled, deleted) is cancelled, and `abandoned(id)` then
    says so; one whose lease another instance took is cancelled too (that one finishes it).
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        namespace: str,
        instance_id: str,
        lease_s: float,
        leased: Gauge | None = None,
        taken_over: Counter | None = None,
        keys: tuple[str, str] | None = None,
        kind: str = "response",
    ) -> None:
        self._client = client
        # `axon_sessions_responses_leased` and `axon_sessions_responses_taken_over_total`.
        self._leased = leased
        self.taken_over = taken_over
        names = Names(namespace)
        # The running set and the owners hash (default: the stored responses').
        self.running_key, self.owners_key = keys or (names.responses_running, names.responses_owners)
        # What is leased, in log events (`response_taken_over`, `batch_taken_over`).
        self._kind = kind
        self.owner = instance_id
        self.lease_s = lease_s
        # Leased response -> the task relaying it (None: a client's request relays it).
        self._tasks: dict[str, asyncio.Task[Any] | None] = {}
        self._abandoned: set[str] = set()
        self._renew = client.register_script(_RENEW)
        self._claim = client.register_script(_CLAIM)

    def expiry_ms(self) -> int:
        return int((time.time() + self.lease_s) * 1000)

    async def open(self, answer_id: str) -> None:
        """Lease `answer_id` to this process (it then `hold`s it)."""
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.zadd(self.running_key, {answer_id: self.expiry_ms()})
            pipe.hset(self.owners_key, answer_id, self.owner)
            await pipe.execute()

    async def drop(self, answer_id: str) -> None:
        """`answer_id` is finished: nobody holds it any more."""
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.zrem(self.running_key, answer_id)
            pipe.hdel(self.owners_key, answer_id)
            await pipe.execute()

    async def offer(self, answer_ids: list[str]) -> None:
        """Lease those of `answer_ids` that nobody holds as expired, so that the next sweep of some
        session manager claims them (their leases were lost with Redis' data)."""
        if answer_ids:
            await self._client.zadd(self.running_key, dict.fromkeys(answer_ids, 0), nx=True)

    def hold(self, response_id: str, coro: Coroutine[Any, Any, Any]) -> "asyncio.Task[Any]":
        """Run `coro`, the relay of leased `response_id`, as a task of its own (its lease is renewed
        until it ends)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks[response_id] = task
        task.add_done_callback(lambda done: self._release(response_id, done))
        return task

    @contextlib.contextmanager
    def attached(self, response_id: str) -> Iterator[None]:
        """Renew `response_id`'s lease while the block (a client's request relaying it) runs."""
        self._tasks.setdefault(response_id, None)
        try:
            yield
        finally:
            if response_id in self._tasks and self._tasks[response_id] is None:
                del self._tasks[response_id]
                self._abandoned.discard(response_id)

    def _release(self, response_id: str, task: "asyncio.Task[Any]") -> None:
        if self._tasks.get(response_id) is task:
            del self._tasks[response_id]
        self._abandoned.discard(response_id)
        if not task.cancelled() and task.exception() is not None:
            log.warning(f"{self._kind}_relay_failed", **{f"{self._kind}_id": response_id}, error=repr(task.exception()))

    def holding(self, response_id: str) -> bool:
        return response_id in self._tasks

    def abandoned(self, response_id: str) -> bool:
        """Whether `response_id`'s relay was cancelled because the response was finished elsewhere."""
        return response_id in self._abandoned

    async def run(self, take_over: Callable[[str], Coroutine[Any, Any, object]]) -> None:
        """Every third of the lease: renew the leases held, then claim the expired ones. While
        Redis is away, sooner (capped exponential backoff, `shared/outages.py`), so the leases held
        are renewed as soon as it is back, before another instance could claim them."""
        outage = Outage("response_lease_sweep", cap_s=min(MAX_DELAY_S, self.lease_s / 3))
        while True:
            try:
                await self._renew_held()
                for response_id in await self._claim_expired():
                    log.info(f"{self._kind}_taken_over", **{f"{self._kind}_id": response_id})
                    if self.taken_over is not None:
                        self.taken_over.labels("lease_expired").inc()
                    self.hold(response_id, take_over(response_id))
            except Exception as exc:  # noqa: BLE001 - Redis away: retried with backoff
                await asyncio.sleep(outage.failed(exc))
                continue
            outage.recovered()
            await asyncio.sleep(self.lease_s / 3)

    async def _renew_held(self) -> None:
        if self._leased is not None:
            self._leased.set(len(self._tasks))
        ids = list(self._tasks)
        if not ids:
            return
        results = await self._renew(keys=[self.running_key, self.owners_key], args=[self.owner, self.expiry_ms(), *ids])
        for response_id, result in zip(ids, results, strict=True):
            if result == 1 or response_id not in self._tasks:
                continue
            if result == 0:
                self._abandoned.add(response_id)
            log.info(f"{self._kind}_lease_lost", **{f"{self._kind}_id": response_id}, finished=result == 0)
            task = self._tasks[response_id]
            if task is not None:
                task.cancel()

    async def _claim_expired(self) -> list[str]:
        now_ms = int(time.time() * 1000)
        ids = await self._claim(
            keys=[self.running_key, self.owners_key], args=[self.owner, now_ms, self.expiry_ms(), _CLAIM_BATCH]
        )
        return [raw.decode() if isinstance(raw, bytes) else str(raw) for raw in ids]

    async def stop(self) -> None:
        """Cancel every relay, then hand the leases still held over at once (expired now), so
        another instance takes their responses over at its next sweep, not a lease later."""
        ids = list(self._tasks)
        tasks = [task for task in self._tasks.values() if task is not None]
        for task in tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*tasks, return_exceptions=True)
        if ids:
            try:
                await self._renew(keys=[self.running_key, self.owners_key], args=[self.owner, 0, *ids])
            except Exception as exc:  # noqa: BLE001 - they then expire a lease later
                log.warning(f"{self._kind}_leases_not_handed_over", error=repr(exc))
