"""Per-key rate limits held in Redis, so they hold across any number of gateway replicas.

Requests per minute and tokens per minute use GCRA (the generic cell rate algorithm: a
smooth sliding window with a burst of one full minute); concurrent requests are a set of
leases that expire on their own if a gateway dies. One Lua script checks and commits all
three atomically, with Redis' clock, so replicas never disagree.
"""

import asyncio
import math
from dataclasses import dataclass
from typing import Any

from shared.errors import RateLimited
from shared.keys import KeyLimits
from shared.names import Names
from shared.redis_pipe import Arg, PipeScript, RedisPipe

PERIOD_MS = 60_000

# KEYS: rpm state, tpm state, concurrency leases.
# ARGV: rpm limit, tpm limit, concurrency limit (0 = unlimited), token cost, lease id,
#       lease ttl ms, period ms.
_CHECK = PipeScript("""
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
end
return {denied, retry_ms, req[3], req[4], tok[3], tok[4]}
""")

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
    """The limiter's answer: `denied` is None, or which limit refused (`requests`, `tokens`,
    `concurrent`, or `too_large` for a request bigger than the whole token budget)."""

    denied: str | None
    retry_after_ms: int
    requests: WindowState
    tokens: WindowState

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

    async def check(
        self,
        key_id: str,
        limits: KeyLimits,
        *,
        token_cost: int,
        lease_id: str,
        lease_ttl_s: float,
    ) -> Decision:
        """Admit one request costing `token_cost` tokens, or say which limit refuses it.

        An admitted request holds a concurrency lease until `release` (or `lease_ttl_s`).
        """
        keys = [self._names.rate_limit(kind, key_id) for kind in ("rpm", "tpm", "conc")]
        args: list[Arg] = [
            limits.rpm or 0,
            limits.tpm or 0,
            limits.max_concurrent or 0,
            max(0, token_cost),
            lease_id,
            int(lease_ttl_s * 1000),
            PERIOD_MS,
        ]
        denied, retry_ms, req_left, req_reset, tok_left, tok_reset = await self._pipe.evalsha(_CHECK, keys, args)
        denied = denied.decode() if isinstance(denied, bytes) else denied
        return Decision(
            denied=denied or None,
            retry_after_ms=int(retry_ms),
            requests=WindowState(limits.rpm, int(req_left), int(req_reset)),
            tokens=WindowState(limits.tpm, int(tok_left), int(tok_reset)),
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
