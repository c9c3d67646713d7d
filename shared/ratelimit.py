"""Per-key rate limits held in Redis, so they hold across any number of gateway replicas.

Requests per minute and tokens per minute use GCRA (the generic cell rate algorithm: a
smooth sliding window with a burst of one full minute); concurrent requests are a set of
leases that expire on their own if a gateway dies. One Lua script checks and commits all
three atomically, with Redis' clock, so replicas never disagree.

A token budget per UTC calendar day or month is checked in the same script: a completion
reserves what it may use (its `max_tokens` and its prompt estimate) at admission, and the
reservation is settled to the real usage when the answer ends (`submit_budget_settle`). A
request is admitted while the period's spent and reserved tokens are below the budget, so
concurrent requests on any number of gateways overspend by at most one request's reservation.
"""

import asyncio
import datetime as dt
import math
import re
from dataclasses import dataclass
from typing import Any

from shared.errors import RateLimited
from shared.keys import BudgetPeriod, KeyLimits
from shared.names import Names
from shared.redis_pipe import Arg, PipeScript, RedisPipe

PERIOD_MS = 60_000

# KEYS: rpm state, tpm state, concurrency leases, token budget of the period (a hash: `used`,
#       the spent and reserved tokens, and `r:<reservation id>`, each reservation not yet settled).
# ARGV: rpm limit, tpm limit, concurrency limit (0 = unlimited), token cost, lease id (also the
#       reservation's id), lease ttl ms, period ms, token budget (0 = none), tokens to reserve
#       (0 = no budget check), Unix time at which the budget's state expires.
_CHECK = PipeScript("""
local budget, reserve = tonumber(ARGV[8]), tonumber(ARGV[9])
local used = 0
if budget > 0 and reserve > 0 then
  used = tonumber(redis.call('HGET', KEYS[4], 'used') or '0')
  if used >= budget then return {'budget', 0, 0, 0, 0, 0, used} end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local period = tonumber(ARGV[7])

local function gcra(key, limit, cost)
  if limit <= 0 then return {1, 0, -1, 0, 0} end
  local interval = period / limit
  local tat = tonumber(redis.call('GET', key) or now)
  if tat < now then tat = now end
  local new_tat = tat + cost * interval
  local allow_at = new_tat - period
  if allow_at > now then
    return {0, tat, math.max(0, math.floor((period - (tat - now)) / interval)), math.ceil(tat - now),
            math.ceil(allow_at - now)}
  end
  return {1, new_tat, math.max(0, math.floor((period - (new_tat - now)) / interval)), math.ceil(new_tat - now), 0}
end

local rpm_limit, tpm_limit, conc_limit = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local cost = tonumber(ARGV[4])
local req = gcra(KEYS[1], rpm_limit, 1)
local tok = gcra(KEYS[2], tpm_limit, cost)
local denied, retry_ms = '', 0
if conc_limit > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= conc_limit then
    -- A slot frees when some request ends, which no clock predicts: suggest a short wait.
    denied, retry_ms = 'concurrent', 1000
  end
end
if denied == '' and req[1] == 0 then denied, retry_ms = 'requests', req[5] end
if denied == '' and tok[1] == 0 then
  if tpm_limit > 0 and cost > tpm_limit then denied = 'too_large' else denied, retry_ms = 'tokens', tok[5] end
end
if denied == '' then
  if rpm_limit > 0 then redis.call('SET', KEYS[1], req[2], 'PX', math.max(1, math.ceil(req[2] - now))) end
  if tpm_limit > 0 and cost > 0 then redis.call('SET', KEYS[2], tok[2], 'PX', math.max(1, math.ceil(tok[2] - now))) end
  if conc_limit > 0 then
    redis.call('ZADD', KEYS[3], now + tonumber(ARGV[6]), ARGV[5])
    redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[6]))
  end
  if budget > 0 and reserve > 0 then
    used = redis.call('HINCRBY', KEYS[4], 'used', reserve)
    redis.call('HSET', KEYS[4], 'r:' .. ARGV[5], reserve)
    redis.call('EXPIREAT', KEYS[4], ARGV[10])
  end
end
return {denied, retry_ms, req[3], req[4], tok[3], tok[4], used}
""")

# KEYS: token budget of the reservation's period. ARGV: reservation id, tokens really used,
# Unix time at which the budget's state expires. The reservation is replaced by the real usage
# once: settling again (or the gateway's release, a settlement of 0 tokens, after the session
# manager's) adds only the tokens given, so the two sides may settle in either order.
_SETTLE = PipeScript("""
local field = 'r:' .. ARGV[1]
local delta = tonumber(ARGV[2])
local reserved = redis.call('HGET', KEYS[1], field)
if reserved then
  redis.call('HDEL', KEYS[1], field)
  delta = delta - tonumber(reserved)
end
if delta ~= 0 then
  redis.call('HINCRBY', KEYS[1], 'used', delta)
  redis.call('EXPIREAT', KEYS[1], ARGV[3])
end
return delta
""")

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


# KEYS: tpm state. ARGV: tpm limit, token cost (may be negative: a refund), period ms.
_CHARGE = PipeScript("""
local limit = tonumber(ARGV[1])
if limit <= 0 then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local interval = tonumber(ARGV[3]) / limit
local tat = tonumber(redis.call('GET', KEYS[1]) or now)
if tat < now then tat = now end
local new_tat = tat + tonumber(ARGV[2]) * interval
if new_tat <= now then redis.call('DEL', KEYS[1]) return 0 end
redis.call('SET', KEYS[1], new_tat, 'PX', math.ceil(new_tat - now))
return 1
""")


@dataclass(frozen=True, slots=True)
class WindowState:
    """One limit's state as OpenAI's `x-ratelimit-*` headers report it."""

    limit: int | None
    remaining: int
    reset_ms: int


@dataclass(frozen=True, slots=True)
class Decision:
    """The limiter's answer: `denied` is None, or which limit refused (`budget`, `requests`,
    `tokens`, `concurrent`, or `too_large` for a request bigger than the whole token budget)."""

    denied: str | None
    retry_after_ms: int
    requests: WindowState
    tokens: WindowState
    # The budget's spent and reserved tokens in the period (this request's reservation included
    # when it was admitted), and the reservation to settle; 0 and None without a budget.
    budget_used: int = 0
    reservation: BudgetReservation | None = None

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


_LIMIT_NAMES = {"requests": "requests per minute", "tokens": "tokens per minute", "concurrent": "concurrent requests"}


def refusal(decision: Decision) -> RateLimited:
    """The 429 for a refused decision, with `Retry-After` (s) and `retry-after-ms` from the limiter's state."""
    retry_ms = max(1, decision.retry_after_ms)
    return RateLimited(
        f"Rate limit reached for {_LIMIT_NAMES.get(decision.denied or '', decision.denied)}; retry in {retry_ms} ms.",
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

    def _budget_key(self, key_id: str, period_id: str) -> str:
        return self._names.rate_limit("budget", f"{key_id}:{period_id}")

    async def check(
        self,
        key_id: str,
        limits: KeyLimits,
        *,
        token_cost: int,
        lease_id: str,
        lease_ttl_s: float,
        reserve: int = 0,
        period_id: str = "",
    ) -> Decision:
        """Admit one request costing `token_cost` tokens, or say which limit refuses it.

        An admitted request holds a concurrency lease until `release` (or `lease_ttl_s`). With a
        key's `token_budget` and `reserve` > 0, it is admitted only while the budget of period
        `period_id` (`budget_window`'s) is not used up, and reserves `reserve` tokens of it
        under `lease_id` until `submit_budget_settle`.
        """
        budget = (limits.token_budget or 0) if reserve > 0 else 0
        reservation = BudgetReservation(period_id, lease_id, reserve) if budget else None
        keys = [self._names.rate_limit(kind, key_id) for kind in ("rpm", "tpm", "conc")]
        keys.append(self._budget_key(key_id, period_id or "-"))
        args: list[Arg] = [
            limits.rpm or 0,
            limits.tpm or 0,
            limits.max_concurrent or 0,
            max(0, token_cost),
            lease_id,
            int(lease_ttl_s * 1000),
            PERIOD_MS,
            budget,
            reserve if budget else 0,
            reservation.expires_at if reservation else 0,
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
        )

    def submit_budget_settle(self, key_id: str, reservation: BudgetReservation, used: int) -> asyncio.Future[Any]:
        """Replace a budget reservation by the tokens really used (0 gives it all back); the
        reservation counts once whichever side settles first. Returns the command's future."""
        return self._pipe.submit_script(
            _SETTLE,
            [self._budget_key(key_id, reservation.period_id)],
            [reservation.reservation_id, max(0, used), reservation.expires_at],
        )

    def submit_charge(self, key_id: str, tpm: int, cost: int) -> asyncio.Future[Any]:
        """Charge (or refund, if negative) tokens after the fact, e.g. real usage vs the estimate;
        returns the command's future without waiting, so it can share a write with others."""
        return self._pipe.submit_script(_CHARGE, [self._names.rate_limit("tpm", key_id)], [tpm, cost, PERIOD_MS])

    def submit_release(self, key_id: str, lease_id: str) -> asyncio.Future[Any]:
        """Give a concurrency lease back (idempotent); returns the command's future."""
        return self._pipe.submit("ZREM", self._names.rate_limit("conc", key_id), lease_id)

    async def release(self, key_id: str, lease_id: str) -> None:
        await self.submit_release(key_id, lease_id)
