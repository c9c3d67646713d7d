"""Fair share: a model's free sequences go to the tenant with the least weighted served tokens.

This is virtual token counting (VTC: Sheng et al., "Fairness in Serving Large Language Models",
OSDI 2024) held in Redis, so that every session manager and every worker of a model applies one
order. Per model and band (`interactive`; `batch`, the batch lines', shared by the same rule
among themselves) Redis holds:

- `served`: tenant -> the tokens it was served, prompt and output each at their cost
  (`AXON_FAIR_PROMPT_TOKEN_COST`, `AXON_FAIR_OUTPUT_TOKEN_COST`), divided by its weight. Workers
  add what they really served as they serve it (`ServiceMeter`, every `SETTLE_INTERVAL_S`), so a
  long answer counts while it runs;
- `waiting`: tenant -> its jobs waiting in its own queue (`Names.tenant_queue`);
- `backlog`: the tenants with jobs waiting, scored by `served`;
- `vtime`: the score of the tenant picked last;
- `active`: tenant -> when it was last served or queued a job (Redis' clock, ms);
- `free` (interactive band only): worker -> its sequences free of interactive jobs, and until
  when that figure holds. While nothing waits, `admit` reserves one and the job goes straight to
  the model's shared queue, pushed to a worker as before the fair share: a lone tenant's job below
  the workers' capacity never waits for a pull.

The jobs themselves wait in RabbitMQ, one durable queue per tenant, so nothing a session manager
or a worker holds is lost when it dies. The steps:

1. A session manager, before it publishes a job, asks `admit`: a tenant may have at most its
   weight's share of `AXON_MAX_QUEUED_JOBS` waiting (429 past it, before anyone within theirs
   is refused), and a session's job may go to its home worker only while nothing waits at all
   (affinity never jumps a queue). While nothing waits the job may not wait at all (a free
   sequence, its session's home), so `admit` lifts an idle tenant then, as step 2 does.
2. Once the broker confirmed the job in the tenant's queue, `enqueued`: the tenant's count goes
   up; a tenant that had nothing waiting and was neither served nor queued anything for
   `IDLE_AFTER_MS` starts at the least score of those waiting (or at the last pick's when none
   waits): idle time earns no credit. If it had none waiting, the workers' doorbell rings.
3. A worker with a free sequence `claim`s the waiting tenant with the least score and takes one
   job from its queue (`services/worker/pulling.py`).

A count that went wrong (a process died between the broker and Redis) costs at most an empty
take (too high) or a wait until a worker reconciles it with the queue (too low): never a job.
Redis away, session managers publish to the model's shared queue, first in first out.
"""

import asyncio
import contextlib
import dataclasses
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

from shared.logging import get_logger
from shared.names import Names
from shared.redis_pipe import PipeScript, RedisPipe

log = get_logger(__name__)

Band = Literal["interactive", "batch"]
INTERACTIVE: Band = "interactive"
BATCH: Band = "batch"

# Every key of the fair share expires this long after its last write: a model or band unused for a
# week starts afresh.
FAIR_TTL_S = 7 * 24 * 3600
# How often a worker adds the tokens it served to the tenants' counters.
SETTLE_INTERVAL_S = 0.1
# A tenant neither served nor queuing for this long is idle: its next job lifts its counter. A
# tenant whose clients send the next request as the last answer ends is not: its jobs in flight
# keep it active while none waits for a moment.
IDLE_AFTER_MS = 1000

# A tenant's weight, 1 where none is set or it is not a positive number.
_WEIGHT = """
local function weight(key, tenant)
  local w = tonumber(redis.call('HGET', key, tenant) or '1')
  if w == nil or w <= 0 or w ~= w then return 1 end
  return w
end
"""

# The current time in ms by Redis' clock (every replica reads the same one).
_NOW_MS = """
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
"""

# After `_NOW_MS`: a tenant neither served nor queuing for `idle_ms` (by `active`) starts at `floor`
# if that is above its `served` counter (no credit for idle time); returns its counter.
_LIFT = """
local function lift(served, active, tenant, floor, idle_ms)
  local score = tonumber(redis.call('HGET', served, tenant) or '0')
  local last = tonumber(redis.call('HGET', active, tenant) or '0')
  if now_ms - last > idle_ms and floor > score then
    score = floor
    redis.call('HSET', served, tenant, tostring(score))
  end
  return score
end
"""

# KEYS: waiting, weights, free, served, vtime, active. ARGV: tenant, limit, whether the job may go
# straight to a free sequence (1/0), idle_ms, ttl_s. Returns {within its share (1/0), nothing waits
# (1/0), its allowance, a free sequence reserved for it (1/0)}. While nothing waits the job may not
# wait at all (a free sequence, its session's home), so an idle tenant is lifted here, as
# `_ENQUEUED` lifts one whose job waits: to the last pick's score (nothing waits: no least).
_ADMIT = PipeScript(
    _WEIGHT
    + _NOW_MS
    + _LIFT
    + """
local waiting = redis.call('HGETALL', KEYS[1])
local tenant = ARGV[1]
local total, wsum, mine = 0, 0, 0
for i = 1, #waiting, 2 do
  local n = tonumber(waiting[i + 1])
  if n > 0 then
    total = total + n
    wsum = wsum + weight(KEYS[2], waiting[i])
    if waiting[i] == tenant then mine = n end
  end
end
local own = weight(KEYS[2], tenant)
if mine == 0 then wsum = wsum + own end
local allowance = math.max(1, math.floor(tonumber(ARGV[2]) * own / wsum))
local within = 0
if mine < allowance then within = 1 end
local idle = 0
if total == 0 then
  idle = 1
  lift(KEYS[4], KEYS[6], tenant, tonumber(redis.call('GET', KEYS[5]) or '0'), tonumber(ARGV[4]))
  redis.call('HSET', KEYS[6], tenant, now_ms)
  redis.call('EXPIRE', KEYS[4], ARGV[5])
  redis.call('EXPIRE', KEYS[6], ARGV[5])
end
local reserved = 0
if idle == 1 and ARGV[3] == '1' then
  local free = redis.call('HGETALL', KEYS[3])
  local best, most, expires = nil, 0, 0
  for i = 1, #free, 2 do
    local n, until_ms = string.match(free[i + 1], '^(%d+):(%d+)$')
    n, until_ms = tonumber(n), tonumber(until_ms)
    if n and until_ms and until_ms > now_ms and n > most then best, most, expires = free[i], n, until_ms end
  end
  if best then
    redis.call('HSET', KEYS[3], best, string.format('%d:%d', most - 1, expires))
    reserved = 1
  end
end
return {within, idle, allowance, reserved}
"""
)

# KEYS: waiting, backlog, served, vtime, active. ARGV: tenant, how many, ttl_s, doorbell channel, idle_ms.
_ENQUEUED = PipeScript(
    _NOW_MS
    + _LIFT
    + """
local tenant = ARGV[1]
local n = redis.call('HINCRBY', KEYS[1], tenant, tonumber(ARGV[2]))
if not redis.call('ZSCORE', KEYS[2], tenant) then
  local floor
  local least = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  if #least > 0 then floor = tonumber(least[2]) else floor = tonumber(redis.call('GET', KEYS[4]) or '0') end
  redis.call('ZADD', KEYS[2], lift(KEYS[3], KEYS[5], tenant, floor, tonumber(ARGV[5])), tenant)
end
redis.call('HSET', KEYS[5], tenant, now_ms)
for i = 1, 5 do redis.call('EXPIRE', KEYS[i], ARGV[3]) end
if n == tonumber(ARGV[2]) then redis.call('PUBLISH', ARGV[4], '1') end
return n
"""
)

# KEYS: free. ARGV: worker id, its free sequences, how long the figure holds (ms).
_FREE = PipeScript(
    _NOW_MS
    + """
redis.call('HSET', KEYS[1], ARGV[1], string.format('%d:%d', tonumber(ARGV[2]), now_ms + tonumber(ARGV[3])))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""
)

# KEYS: waiting, backlog, vtime. ARGV: ttl_s, whether only a tenant as little served as the least
# may be picked (1/0), then tenants not to pick. Returns the tenant picked, or nil.
_CLAIM = PipeScript("""
local excluded = {}
for i = 3, #ARGV do excluded[ARGV[i]] = true end
local tenant, score, lowest
local first = 0
while tenant == nil do
  local least = redis.call('ZRANGE', KEYS[2], first, first + 31, 'WITHSCORES')
  if #least == 0 then return false end
  lowest = lowest or tonumber(least[2])
  for i = 1, #least, 2 do
    if not excluded[least[i]] then
      tenant, score = least[i], least[i + 1]
      break
    end
  end
  first = first + 32
end
if ARGV[2] == '1' and tonumber(score) > lowest then return false end
redis.call('SET', KEYS[3], score, 'EX', ARGV[1])
local n = redis.call('HINCRBY', KEYS[1], tenant, -1)
if n <= 0 then
  redis.call('HDEL', KEYS[1], tenant)
  redis.call('ZREM', KEYS[2], tenant)
end
return tenant
""")

# KEYS: served, backlog, weights, active. ARGV: ttl_s, then tenant and tokens pairs.
_SETTLE = PipeScript(
    _WEIGHT
    + _NOW_MS
    + """
for i = 2, #ARGV, 2 do
  local tenant = ARGV[i]
  local score = redis.call('HINCRBYFLOAT', KEYS[1], tenant, tonumber(ARGV[i + 1]) / weight(KEYS[3], tenant))
  if redis.call('ZSCORE', KEYS[2], tenant) then redis.call('ZADD', KEYS[2], score, tenant) end
  redis.call('HSET', KEYS[4], tenant, now_ms)
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[4], ARGV[1])
return 1
"""
)


@dataclass(frozen=True, slots=True)
class Admission:
    """What `FairShare.admit` decided for one job."""

    # The tenant has fewer jobs waiting than its share of the queue's length.
    within_share: bool
    # Nothing waits for the model: a session's job may go to its home worker.
    idle: bool
    # How many of the tenant's jobs may wait (its share).
    allowance: int
    # Nothing waits and a worker had a free sequence, now reserved: the job goes straight to the
    # model's shared queue, whose consumers are pushed it at once.
    reserved: bool = False


@dataclass(frozen=True, slots=True)
class BandState:
    """One model's band as Redis holds it (for metrics and tests)."""

    waiting: dict[str, int]
    served: dict[str, float]
    # Every tenant that queued a job or was served in the last week.
    known: frozenset[str] = frozenset()


class FairShare:
    """The fair share's Redis side, for session managers and workers alike."""

    def __init__(self, pipe: RedisPipe, names: Names) -> None:
        self._pipe = pipe
        self._names = names

    def _keys(self, model: str, band: Band, *parts: str) -> list[str]:
        return [self._names.fair(model, band, part) for part in parts]

    async def admit(self, model: str, tenant: str, *, band: Band, limit: int) -> Admission:
        """Whether a job of `tenant` may wait for `model` (at most `limit` x its weight's share),
        and, for an interactive job while nothing waits, a free sequence reserved for it.

        Raises:
            redis errors: Redis is unreachable (the caller falls back to first in, first out).
        """
        keys = [
            self._names.fair(model, band, "waiting"),
            self._names.tenant_weights,
            self._free_key(model),
            *self._keys(model, band, "served", "vtime", "active"),
        ]
        within, idle, allowance, reserved = await self._pipe.evalsha(
            _ADMIT, keys, [tenant, limit, int(band == INTERACTIVE), IDLE_AFTER_MS, FAIR_TTL_S]
        )
        return Admission(within_share=bool(within), idle=bool(idle), allowance=int(allowance), reserved=bool(reserved))

    def _free_key(self, model: str) -> str:
        return self._names.fair(model, INTERACTIVE, "free")

    def report_free(self, model: str, worker_id: str, free: int, *, valid_ms: int) -> "asyncio.Future[object]":
        """A worker's sequences free of interactive jobs, valid for `valid_ms` unless said again."""
        return self._pipe.submit_script(_FREE, [self._free_key(model)], [worker_id, free, valid_ms])

    async def withdraw(self, model: str, worker_id: str) -> None:
        """The worker takes no more jobs pushed to it (it drains)."""
        await self._pipe.execute("HDEL", self._free_key(model), worker_id)

    async def enqueued(self, model: str, tenant: str, *, band: Band, count: int = 1) -> int:
        """`count` more jobs of `tenant` wait in its queue; returns how many wait now."""
        keys = self._keys(model, band, "waiting", "backlog", "served", "vtime", "active")
        args: list[str | int] = [tenant, count, FAIR_TTL_S, self._names.fair_ready(model), IDLE_AFTER_MS]
        return int(await self._pipe.evalsha(_ENQUEUED, keys, args))

    async def claim(
        self, model: str, *, band: Band, excluded: Collection[str] = (), least_only: bool = False
    ) -> str | None:
        """The tenant whose job a free sequence takes next (its count taken down), or None;
        never one of `excluded`, and with `least_only` only one served no more than the least
        served of all waiting (a worker's headroom: it never takes a tenant out of turn)."""
        keys = self._keys(model, band, "waiting", "backlog", "vtime")
        tenant = await self._pipe.evalsha(_CLAIM, keys, [FAIR_TTL_S, int(least_only), *excluded])
        return tenant.decode() if isinstance(tenant, bytes) else tenant

    async def waiting(self, model: str, tenant: str, *, band: Band) -> int:
        """How many jobs of `tenant` Redis counts waiting."""
        return int(await self._pipe.execute("HGET", self._names.fair(model, band, "waiting"), tenant) or 0)

    async def state(self, model: str, *, band: Band) -> BandState:
        """How many jobs each tenant has waiting, what each was served (weighted), and who queued
        or was served lately."""
        waiting, served, active = await asyncio.gather(
            self._pipe.execute("HGETALL", self._names.fair(model, band, "waiting")),
            self._pipe.execute("HGETALL", self._names.fair(model, band, "served")),
            self._pipe.execute("HKEYS", self._names.fair(model, band, "active")),
        )
        state = BandState(
            waiting={tenant: int(n) for tenant, n in _pairs(waiting).items()},
            served={tenant: float(v) for tenant, v in _pairs(served).items()},
        )
        known = frozenset(state.waiting) | frozenset(state.served) | {t.decode() for t in active}
        return dataclasses.replace(state, known=known)

    def settle(self, model: str, band: Band, served: dict[str, float]) -> "asyncio.Future[object]":
        """Add `served` (tenant -> tokens at their cost, before weighting) to the counters."""
        keys = [*self._keys(model, band, "served", "backlog"), self._names.tenant_weights]
        keys.append(self._names.fair(model, band, "active"))
        args: list[str | int] = [FAIR_TTL_S]
        for tenant, tokens in served.items():
            args += [tenant, repr(tokens)]
        return self._pipe.submit_script(_SETTLE, keys, args)


def _pairs(flat: list[bytes]) -> dict[str, str]:
    """A Redis hash's HGETALL reply as a dict."""
    return {flat[i].decode(): flat[i + 1].decode() for i in range(0, len(flat), 2)}


class ServiceMeter:
    """A worker's tokens served per tenant, added to the fair share's counters every
    `SETTLE_INTERVAL_S` (one script call per model and band, whatever the number of jobs)."""

    def __init__(self, fair: FairShare, *, prompt_cost: float, output_cost: float) -> None:
        self._fair = fair
        self.prompt_cost = prompt_cost
        self.output_cost = output_cost
        self._owed: dict[tuple[str, Band], dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._task: asyncio.Task[None] | None = None

    def prompt(self, model: str, band: Band, tenant: str, tokens: float) -> None:
        """`tokens` prompt tokens served (negative: an estimate corrected)."""
        if tokens:
            self._owed[(model, band)][tenant] += tokens * self.prompt_cost

    def output(self, model: str, band: Band, tenant: str, tokens: int) -> None:
        """`tokens` output tokens served."""
        if tokens:
            self._owed[(model, band)][tenant] += tokens * self.output_cost

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop, after adding what is owed (if Redis takes it)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        with contextlib.suppress(Exception):
            await self.flush()

    async def flush(self) -> None:
        """Add what is owed now. What Redis did not take is lost (a counter a little low)."""
        owed, self._owed = self._owed, defaultdict(lambda: defaultdict(float))
        sent = [self._fair.settle(model, band, dict(served)) for (model, band), served in owed.items() if served]
        for outcome in await asyncio.gather(*sent, return_exceptions=True):
            if isinstance(outcome, BaseException):
                log.debug("fair_settle_failed", error=repr(outcome))

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(SETTLE_INTERVAL_S)
            await self.flush()
