"""Per-key rate limits held in Redis, so they hold across any number of gateway replicas.

Requests per minute and tokens per minute use GCRA (the generic cell rate algorithm: a
smooth sliding window with a burst of one full minute); concurrent requests are a set of
leases that expire on their own if a gateway dies. One Lua script checks and commits all
three atomically, with Redis' clock, so replicas never disagree.

A completion is charged against tokens per minute the most it may use (its prompt estimate and
`n` x its `max_tokens`) at admission, so that a burst cannot run past the limit; the charge is
corrected to the real usage when the answer ends. A token budget per UTC calendar day or month
is checked in the same script and reserved the same way. A request is admitted while the
period's spent and reserved tokens are below the budget, so concurrent requests on any number
of gateways overspend by at most one request's reservation.

What an admission holds (its lease, which is also the record of its tokens-per-minute charge,
and its budget reservation) is given back in one script call, `RateLimiter.submit_settle`: by the
session manager with the real usage when the answer ends, or by the gateway with nothing when it
did not hand the answer over. Whichever comes first replaces the charge and the reservation by
its usage; the other adds only its own (nothing, or the usage), so the two may come in either
order. A settlement Redis could not take (it was unreachable) is sent again until Redis takes it
(`_Unsettled`): a Redis blip leaves no lease or reservation behind.
"""

import asyncio
import contextvars
import datetime as dt
import math
import re
import time
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError, ResponseError

from shared.errors import RateLimited
from shared.keys import BudgetPeriod, KeyLimits
from shared.logging import get_logger
from shared.names import Names
from shared.redis_pipe import Arg, NotSent, PipeScript, RedisPipe

log = get_logger(__name__)

PERIOD_MS = 60_000

# KEYS: rpm state, tpm state, leases (a sorted set: lease id -> expiry, ms), token budget of the
#       period (a hash: `used`, the spent and reserved tokens, and `r:<reservation id>`, each
#       reservation not yet settled).
# ARGV: rpm limit, tpm limit, concurrency limit (0 = unlimited), tokens (charged against tpm and
#       reserved of the budget), lease id (also the reservation's id), lease ttl ms, period ms,
#       token budget (0 = none, or nothing to reserve), Unix time at which the budget's state
#       expires, whether to hold a lease (1: the key has a concurrency limit, or tokens are
#       charged against its tpm: the lease is the record of that charge until it is settled).
_CHECK = PipeScript("""
local budget, cost = tonumber(ARGV[8]), tonumber(ARGV[4])
local used = 0
if budget > 0 then
  used = tonumber(redis.call('HGET', KEYS[4], 'used') or '0')
  if used >= budget then return {'budget', 0, 0, 0, 0, 0, used} end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local period = tonumber(ARGV[7])

local function gcra(key, limit, tokens)
  if limit <= 0 then return {1, 0, -1, 0, 0} end
  local interval = period / limit
  local tat = tonumber(redis.call('GET', key) or now)
  if tat < now then tat = now end
  local new_tat = tat + tokens * interval
  local allow_at = new_tat - period
  if allow_at > now then
    return {0, tat, math.max(0, math.floor((period - (tat - now)) / interval)), math.ceil(tat - now),
            math.ceil(allow_at - now)}
  end
  return {1, new_tat, math.max(0, math.floor((period - (new_tat - now)) / interval)), math.ceil(new_tat - now), 0}
end

local rpm_limit, tpm_limit, conc_limit = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local hold = ARGV[10] == '1'
local req = gcra(KEYS[1], rpm_limit, 1)
local tok = gcra(KEYS[2], tpm_limit, cost)
local denied, retry_ms = '', 0
if hold then redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now) end
if conc_limit > 0 and redis.call('ZCARD', KEYS[3]) >= conc_limit then
  -- A slot frees when one of the requests ends, which no clock predicts, and at the latest when
  -- the oldest lease expires: that is the wait that is certain.
  local oldest = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
  denied, retry_ms = 'concurrent', math.max(1, math.ceil(tonumber(oldest[2]) - now))
end
if denied == '' and req[1] == 0 then denied, retry_ms = 'requests', req[5] end
if denied == '' and tok[1] == 0 then
  if tpm_limit > 0 and cost > tpm_limit then denied = 'too_large' else denied, retry_ms = 'tokens', tok[5] end
end
if denied == '' then
  if rpm_limit > 0 then redis.call('SET', KEYS[1], req[2], 'PX', math.max(1, math.ceil(req[2] - now))) end
  if tpm_limit > 0 and cost > 0 then redis.call('SET', KEYS[2], tok[2], 'PX', math.max(1, math.ceil(tok[2] - now))) end
  if hold then
    redis.call('ZADD', KEYS[3], now + tonumber(ARGV[6]), ARGV[5])
    redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[6]))
  end
  if budget > 0 then
    used = redis.call('HINCRBY', KEYS[4], 'used', cost)
    redis.call('HSET', KEYS[4], 'r:' .. ARGV[5], cost)
    redis.call('EXPIREAT', KEYS[4], ARGV[9])
  end
end
return {denied, retry_ms, req[3], req[4], tok[3], tok[4], used}
""")

# KEYS: leases, tpm state, token budget of the reservation's period.
# ARGV: lease id ('' = none), tokens really used, tpm limit, tokens charged against tpm at
#       admission, the budget reservation's id ('' = none), Unix time at which the budget's state
#       expires, period ms, only if still held (1: do nothing unless the lease or the reservation
#       is still there).
# The first settlement (its lease is still there) replaces the admission's tpm charge and budget
# reservation by the tokens used; a later one adds only the tokens it is given (the gateway's,
# after the session manager's, gives nothing; the session manager's, after the gateway's, the
# usage). Returns the tpm and the budget correction.
_SETTLE = PipeScript("""
local first = ARGV[1] ~= '' and redis.call('ZREM', KEYS[1], ARGV[1]) == 1
local field = 'r:' .. ARGV[5]
local reserved = false
if ARGV[5] ~= '' then reserved = redis.call('HGET', KEYS[3], field) end
if ARGV[8] == '1' and not first and not reserved then return {0, 0} end
local used, limit = tonumber(ARGV[2]), tonumber(ARGV[3])
local delta = used
if first then delta = used - tonumber(ARGV[4]) end
if limit > 0 and delta ~= 0 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local tat = tonumber(redis.call('GET', KEYS[2]) or now)
  if tat < now then tat = now end
  local new_tat = tat + delta * tonumber(ARGV[7]) / limit
  if new_tat <= now then redis.call('DEL', KEYS[2])
  else redis.call('SET', KEYS[2], new_tat, 'PX', math.ceil(new_tat - now)) end
end
local budget_delta = 0
if ARGV[5] ~= '' then
  budget_delta = used
  if reserved then
    redis.call('HDEL', KEYS[3], field)
    budget_delta = used - tonumber(reserved)
  end
  if budget_delta ~= 0 then
    redis.call('HINCRBY', KEYS[3], 'used', budget_delta)
    redis.call('EXPIREAT', KEYS[3], ARGV[6])
  end
end
return {delta, budget_delta}
""")

# A settlement Redis could not take is sent again for this long at most, and this many wait per
# process at most; past either it is dropped (and logged): its lease lapses with its expiry
# (`AXON_CONCURRENCY_LEASE_S`) and its budget reservation counts as spent.
SETTLE_RETRY_FOR_S = 600.0
MAX_UNSETTLED = 10_000
# What waits is sent again this often: once Redis is back, it is settled within about this long.
_RETRY_S = 0.1

# A period's budget state outlives the period by this much, so that answers that end after it
# (a request's deadline is minutes) still settle against it.
_BUDGET_GRACE_S = 2 * 86_400
_PERIOD_ID = re.compile(r"^(d[0-9]{8}|m[0-9]{6})$")


def budget_window(period: BudgetPeriod, now: dt.datetime) -> tuple[str, dt.datetime]:
    """The UTC calendar period containing `now`: its id (`d20261124`, `m202611`) and when the next
    one starts."""
    now = now.astimezone(dt.UTC)
    if period == "day":
        start = dt.datetime(now.year, now.month, now.day, tzinfo=dt.UTC)
        return f"d{now:%Y%m%d}", start + dt.timedelta(days=1)
    next_start = dt.datetime(now.year + now.month // 12, now.month % 12 + 1, 1, tzinfo=dt.UTC)
    return f"m{now:%Y%m}", next_start


def period_end(period_id: str) -> dt.datetime:
    """When the period with this id (`budget_window`'s) ends.

    Raises:
        ValueError: not a period id.
    """
    if not _PERIOD_ID.match(period_id):
        raise ValueError(f"not a budget period: {period_id!r}")
    if period_id[0] == "d":
        day = dt.datetime.strptime(period_id[1:], "%Y%m%d").replace(tzinfo=dt.UTC)
        return budget_window("day", day)[1]
    month = dt.datetime.strptime(period_id[1:], "%Y%m").replace(tzinfo=dt.UTC)
    return budget_window("month", month)[1]


@dataclass(frozen=True, slots=True)
class BudgetReservation:
    """Tokens reserved against a key's budget at admission, settled when the answer ends. The
    gateway passes it to the session manager as `x-axon-budget-reservation: <period>:<id>:<tokens>`."""

    period_id: str
    reservation_id: str
    tokens: int

    def header(self) -> str:
        return f"{self.period_id}:{self.reservation_id}:{self.tokens}"

    @classmethod
    def parse(cls, value: str) -> "BudgetReservation":
        """Read the header.

        Raises:
            ValueError: not `<period>:<id>:<tokens>`.
        """
        period_id, reservation_id, tokens = value.split(":")
        period_end(period_id)
        if not (0 < len(reservation_id) <= 64 and reservation_id.isalnum() and tokens.isdigit()):
            raise ValueError(f"not a budget reservation: {value!r}")
        return cls(period_id, reservation_id, int(tokens))

    @property
    def expires_at(self) -> int:
        """When the budget state of its period may be dropped (Unix time)."""
        return int(period_end(self.period_id).timestamp()) + _BUDGET_GRACE_S


@dataclass(frozen=True, slots=True)
class WindowState:
    """One limit's state as OpenAI's `x-ratelimit-*` headers report it."""

    limit: int | None
    remaining: int
    reset_ms: int


@dataclass(frozen=True, slots=True)
class Decision:
    """The limiter's answer: `denied` is None, or which limit refused (`budget`, `requests`,
    `tokens`, `concurrent`, or `too_large` for a request that may use more tokens than the key's
    whole tokens per minute)."""

    denied: str | None
    retry_after_ms: int
    requests: WindowState
    tokens: WindowState
    # The budget's spent and reserved tokens in the period (this request's reservation included
    # when it was admitted), and the reservation to settle; 0 and None without a budget.
    budget_used: int = 0
    reservation: BudgetReservation | None = None
    # What an admitted request holds until it is settled (`RateLimiter.submit_settle`): its lease
    # (None: it holds none) and the tokens charged against the key's tokens per minute.
    lease_id: str | None = None
    tpm_charged: int = 0

    @property
    def allowed(self) -> bool:
        return self.denied is None


def format_duration(ms: int) -> str:
    """OpenAI's reset format: `20ms`, `1s`, `6m0s`."""
    if ms < 1000:
        return f"{ms}ms"
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s"


def rate_limit_headers(decision: Decision) -> dict[str, str]:
    """`x-ratelimit-*` headers for the limits a key has (none for an unlimited dimension)."""
    headers: dict[str, str] = {}
    for kind, state in (("requests", decision.requests), ("tokens", decision.tokens)):
        if state.limit is None:
            continue
        headers[f"x-ratelimit-limit-{kind}"] = str(state.limit)
        headers[f"x-ratelimit-remaining-{kind}"] = str(state.remaining)
        headers[f"x-ratelimit-reset-{kind}"] = format_duration(state.reset_ms)
    return headers


def budget_refusal(limits: KeyLimits, used: int, now: dt.datetime) -> RateLimited:
    """The 429 `budget_exceeded` of a key whose budget is used up, with `Retry-After` at the
    start of the next period."""
    _, next_start = budget_window(limits.budget_period, now)
    retry_s = max(1, math.ceil((next_start - now).total_seconds()))
    return RateLimited(
        f"This key's token budget of {limits.token_budget} tokens per {limits.budget_period} is used up "
        f"({used} tokens spent or reserved); it renews at {next_start:%Y-%m-%dT%H:%M:%SZ}.",
        code="budget_exceeded",
        headers={"Retry-After": str(retry_s), "retry-after-ms": str(retry_s * 1000)},
    )


_LIMIT_NAMES = {"requests": "requests per minute", "tokens": "tokens per minute"}


def refusal(decision: Decision) -> RateLimited:
    """The 429 for a refused decision, with `Retry-After` (s) and `retry-after-ms` from the
    limiter's state: when the request would be admitted (requests and tokens per minute), or,
    for concurrent requests, when the oldest lease expires, the latest a slot frees (one frees
    sooner when one of the requests in flight ends)."""
    retry_ms = max(1, decision.retry_after_ms)
    if decision.denied == "concurrent":
        message = (
            "Rate limit reached for concurrent requests: a slot frees when one of this key's requests in flight "
            f"ends, at the latest in {math.ceil(retry_ms / 1000)} s."
        )
    else:
        message = (
            f"Rate limit reached for {_LIMIT_NAMES.get(decision.denied or '', decision.denied)}; "
            f"retry in {retry_ms} ms."
        )
    return RateLimited(
        message,
        headers={
            **rate_limit_headers(decision),
            "Retry-After": str(max(1, math.ceil(retry_ms / 1000))),
            "retry-after-ms": str(retry_ms),
        },
    )


class RateLimiter:
    """Checks and charges per-key limits with one command each, on the process's Redis pipe."""

    def __init__(self, pipe: RedisPipe, names: Names) -> None:
        self._pipe = pipe
        self._names = names
        self._unsettled = _Unsettled(pipe)

    def _budget_key(self, key_id: str, period_id: str) -> str:
        return self._names.rate_limit("budget", f"{key_id}:{period_id}")

    async def check(
        self,
        key_id: str,
        limits: KeyLimits,
        *,
        tokens: int,
        lease_id: str,
        lease_ttl_s: float,
        period_id: str = "",
    ) -> Decision:
        """Admit one request that may use `tokens` tokens, or say which limit refuses it.

        An admitted request is charged `tokens` against the key's tokens per minute and, with a
        `token_budget`, is admitted only while the budget of period `period_id`
        (`budget_window`'s) is not used up and reserves `tokens` of it under `lease_id`. It holds
        a lease (`Decision.lease_id`) when the key has a concurrency limit or it was charged
        tokens per minute, until `submit_settle` (or `lease_ttl_s`).
        """
        tokens = max(0, tokens)
        budget = (limits.token_budget or 0) if tokens else 0
        reservation = BudgetReservation(period_id, lease_id, tokens) if budget else None
        tpm_charged = tokens if limits.tpm else 0
        hold = bool(limits.max_concurrent) or tpm_charged > 0
        keys = [self._names.rate_limit(kind, key_id) for kind in ("rpm", "tpm", "conc")]
        keys.append(self._budget_key(key_id, period_id or "-"))
        args: list[Arg] = [
            limits.rpm or 0,
            limits.tpm or 0,
            limits.max_concurrent or 0,
            tokens,
            lease_id,
            int(lease_ttl_s * 1000),
            PERIOD_MS,
            budget,
            reservation.expires_at if reservation else 0,
            1 if hold else 0,
        ]
        reply = await self._pipe.evalsha(_CHECK, keys, args)
        denied, retry_ms, req_left, req_reset, tok_left, tok_reset, used = reply
        denied = denied.decode() if isinstance(denied, bytes) else denied
        return Decision(
            denied=denied or None,
            retry_after_ms=int(retry_ms),
            requests=WindowState(limits.rpm, int(req_left), int(req_reset)),
            tokens=WindowState(limits.tpm, int(tok_left), int(tok_reset)),
            budget_used=int(used),
            reservation=reservation if not denied else None,
            lease_id=lease_id if hold and not denied else None,
            tpm_charged=tpm_charged if not denied else 0,
        )

    def submit_settle(
        self,
        key_id: str,
        *,
        lease_id: str | None,
        tpm_limit: int,
        tpm_charged: int,
        budget: BudgetReservation | None,
        used: int,
    ) -> asyncio.Future[Any]:
        """Give back what an admission holds, its real token use being `used`: release its lease,
        correct its tokens-per-minute charge `tpm_charged` and settle its budget reservation to
        `used` (the first settlement; a later one adds `used`: see `_SETTLE`), in one command.

        Returns the future of the command's reply (the tpm and budget corrections), or of None
        when Redis could not take it: then it is sent again until Redis does (`_Unsettled`).
        """
        keys: list[Arg] = [
            self._names.rate_limit("conc", key_id),
            self._names.rate_limit("tpm", key_id),
            self._budget_key(key_id, budget.period_id if budget else "-"),
        ]
        args: list[Arg] = [
            lease_id or "",
            max(0, used),
            tpm_limit,
            tpm_charged,
            budget.reservation_id if budget else "",
            budget.expires_at if budget else 0,
            PERIOD_MS,
            0,
        ]
        return self._unsettled.submit(keys, args)


def _chain_to(result: asyncio.Future[Any], attempt: asyncio.Future[Any], error: BaseException | None) -> None:
    """Give `result` the outcome of `attempt`: cancelled, `error`, or its reply (None for a failure
    that is retried)."""
    if attempt.cancelled():
        result.cancel()
    elif error is not None:
        result.set_exception(error)
    else:
        result.set_result(None if attempt.exception() else attempt.result())


class _Unsettled:
    """Settlements Redis did not take, sent again every `_RETRY_S` until it takes them, for up to
    `SETTLE_RETRY_FOR_S` (at most `MAX_UNSETTLED` of them). One whose command was never sent goes
    again as it was; one that may have run (its connection dropped after sending it, or no reply
    came in time) goes again only if what it settles is still held, so it never counts twice."""

    def __init__(self, pipe: RedisPipe) -> None:
        self._pipe = pipe
        self._waiting: list[tuple[list[Arg], list[Arg], float]] = []
        self._retrying: asyncio.Task[None] | None = None
        self._dropped = 0

    def submit(self, keys: list[Arg], args: list[Arg]) -> asyncio.Future[Any]:
        result: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        def settled(attempt: asyncio.Future[Any]) -> None:
            error = None if attempt.cancelled() else attempt.exception()
            if isinstance(error, RedisError) and not isinstance(error, ResponseError):
                self._wait(keys, args, error, time.monotonic() + SETTLE_RETRY_FOR_S)
                error = None
            if not result.done():
                _chain_to(result, attempt, error)

        self._pipe.submit_script(_SETTLE, keys, args).add_done_callback(settled)
        return result

    def _wait(self, keys: list[Arg], args: list[Arg], error: RedisError, give_up_at: float) -> None:
        if not isinstance(error, NotSent):
            args = [*args[:-1], 1]
        if len(self._waiting) >= MAX_UNSETTLED:
            self._dropped += 1
            return
        self._waiting.append((keys, args, give_up_at))
        if self._retrying is None:
            log.warning("settlements_waiting_for_redis", error=repr(error))
            # A context of its own: it works for every request that waits, not for this one.
            self._retrying = asyncio.get_running_loop().create_task(self._retry(), context=contextvars.Context())

    async def _retry(self) -> None:
        started, done = time.monotonic(), 0
        try:
            while self._waiting:
                await asyncio.sleep(_RETRY_S)
                now = time.monotonic()
                due = [entry for entry in self._waiting if entry[2] > now]
                self._dropped += len(self._waiting) - len(due)
                # While Redis is away, a round costs one command: the others go once it took that one.
                self._waiting = due[1:]
                if due and (taken := await self._send(due[:1])):
                    batch, self._waiting = self._waiting, []
                    done += taken + await self._send(batch)
        finally:
            self._retrying = None
            dropped, self._dropped = self._dropped, 0
            log.info("settlements_retried", settled=done, dropped=dropped, after_s=round(time.monotonic() - started, 2))

    async def _send(self, batch: list[tuple[list[Arg], list[Arg], float]]) -> int:
        """Send `batch` again; returns how many Redis took (the others wait again)."""
        results = await asyncio.gather(
            *(self._pipe.submit_script(_SETTLE, keys, args) for keys, args, _ in batch), return_exceptions=True
        )
        taken = 0
        for (keys, args, give_up_at), result in zip(batch, results, strict=True):
            if isinstance(result, RedisError) and not isinstance(result, ResponseError):
                self._wait(keys, args, result, give_up_at)
                continue
            taken += 1
            if isinstance(result, BaseException):
                log.warning("settlement_failed", error=repr(result))
        return taken
