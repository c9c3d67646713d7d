"""May the caller call now: a key's rate and concurrency limits and its token budget applied to
each request, the lease a request holds until its answer ends, and the models a key may use."""

import asyncio
import datetime as dt
import secrets
import time
from dataclasses import dataclass

from redis.exceptions import RedisError

from services.gateway.metrics import GatewayMetrics
from shared.errors import Forbidden, InvalidRequest, Unavailable
from shared.keys import KeyRecord, model_allowed
from shared.logging import get_logger
from shared.ratelimit import (
    BudgetReservation,
    Decision,
    RateLimiter,
    budget_refusal,
    budget_window,
    rate_limit_headers,
    refusal,
)
from shared.registry import WorkerRegistry

log = get_logger(__name__)


@dataclass
class Admission:
    """An admitted request: its limiter state (for headers), and what it holds until it is
    settled: its lease, its charge against the key's tokens per minute and its reservation of the
    key's token budget (none of them when Redis was down and the limiter failed open)."""

    record: KeyRecord
    decision: Decision | None

    def headers(self) -> dict[str, str]:
        return rate_limit_headers(self.decision) if self.decision else {}

    @property
    def lease_id(self) -> str | None:
        return self.decision.lease_id if self.decision else None

    @property
    def tpm_charged(self) -> int:
        return self.decision.tpm_charged if self.decision else 0

    @property
    def reservation(self) -> BudgetReservation | None:
        return self.decision.reservation if self.decision else None


class Admitter:
    """Applies a key's limits to each request."""

    def __init__(self, *, limiter: RateLimiter, metrics: GatewayMetrics, fail_open: bool, lease_s: float) -> None:
        self._limiter = limiter
        self._metrics = metrics
        self._fail_open = fail_open
        self._lease_s = lease_s

    async def admit(self, record: KeyRecord, *, tokens: int) -> Admission:
        """Admit the request or refuse it. A completion may use `tokens` (its most: its prompt
        estimate and `n` x `max_tokens`): they are charged against the key's tokens per minute
        and reserved of its token budget, and settled to its real usage when the answer ends; a
        call of 0 tokens is not held to the budget.

        Raises:
            RateLimited: a limit or the budget is exhausted (429 with accurate Retry-After).
            InvalidRequest: the request alone may use more than the key's tokens per minute.
            Unavailable: Redis is unreachable and the limiter fails closed.
        """
        limits = record.limits
        budgeted = bool(limits.token_budget and tokens)
        # Periods are UTC calendar days or months by this gateway's clock.
        now = dt.datetime.now(dt.UTC) if budgeted else None
        period_id = budget_window(limits.budget_period, now)[0] if now is not None else ""
        try:
            decision = await self._limiter.check(
                record.id,
                limits,
                tokens=tokens,
                lease_id=secrets.token_hex(8),
                lease_ttl_s=self._lease_s,
                period_id=period_id,
            )
        except RedisError as exc:
            log.warning("rate_limiter_unavailable", error=repr(exc))
            if self._fail_open:
                self._metrics.limiter_unavailable.labels("open").inc()
                return Admission(record, None)
            self._metrics.limiter_unavailable.labels("closed").inc()
            raise Unavailable("Rate limiting is unavailable; try again shortly.", retry_after_s=2) from exc
        if decision.denied == "too_large":
            raise InvalidRequest(
                f"The request may use about {tokens} tokens (its prompt and n x max_tokens), more than this "
                f"key's limit of {limits.tpm} tokens per minute; ask for fewer with max_tokens or n.",
                code="request_too_large_for_limit",
            )
        if decision.denied == "budget" and now is not None:
            self._metrics.rate_limited.labels("budget").inc()
            raise budget_refusal(limits, decision.budget_used, now)
        if decision.denied is not None:
            self._metrics.rate_limited.labels(decision.denied).inc()
            raise refusal(decision)
        return Admission(record, decision)

    async def release(self, admission: Admission) -> None:
        """Give back what the request holds, in one command: its lease, its tokens-per-minute
        charge and its budget reservation (a settlement to 0 tokens: after the session manager's
        settlement it changes nothing). Redis down, it is sent again once Redis is back."""
        if admission.lease_id is None and admission.reservation is None:
            return
        try:
            await self._limiter.submit_settle(
                admission.record.id,
                lease_id=admission.lease_id,
                tpm_limit=admission.record.limits.tpm or 0,
                tpm_charged=admission.tpm_charged,
                budget=admission.reservation,
                used=0,
            )
        except RedisError as exc:
            log.warning("release_failed", error=repr(exc))


class ModelAccess:
    """Which models a key may use: its allowlist, with aliases resolved (`model_allowed`) from
    Redis' alias hash, cached in-process for `cache_ttl_s` like the session manager's catalog."""

    def __init__(self, registry: WorkerRegistry, *, cache_ttl_s: float) -> None:
        self._registry = registry
        self._cache_ttl_s = cache_ttl_s
        self._aliases: dict[str, str] = {}
        self._fetched_at = float("-inf")
        self._fetching: asyncio.Future[dict[str, str]] | None = None

    async def require(self, record: KeyRecord, model: object) -> None:
        """Refuse a model the key may not use. A key without an allowlist, or a body without a
        model name (the session manager refuses it), passes at once; a listed name too.

        Raises:
            Forbidden: 403 `model_not_allowed`.
            Unavailable: the aliases are needed and Redis cannot give them.
        """
        allowed = record.allowed_models
        if allowed is None or not isinstance(model, str) or model in allowed:
            return
        if not model_allowed(model, allowed, await self._aliases_now()):
            raise Forbidden(f"This API key may not use model '{model}'.", param="model", code="model_not_allowed")

    async def _aliases_now(self) -> dict[str, str]:
        """The alias map, at most `cache_ttl_s` old; requests that find it stale share one fetch."""
        if time.monotonic() - self._fetched_at <= self._cache_ttl_s:
            return self._aliases
        if self._fetching is None:
            self._fetching = asyncio.ensure_future(self._fetch())
            self._fetching.add_done_callback(self._fetched)
        try:
            return await asyncio.shield(self._fetching)
        except RedisError as exc:
            log.warning("aliases_unavailable", error=repr(exc))
            raise Unavailable("The model catalog is unavailable; try again shortly.", retry_after_s=2) from exc

    async def _fetch(self) -> dict[str, str]:
        aliases = await self._registry.aliases()
        self._aliases, self._fetched_at = aliases, time.monotonic()
        return aliases

    def _fetched(self, fetch: asyncio.Future[dict[str, str]]) -> None:
        self._fetching = None
        if not fetch.cancelled():
            fetch.exception()  # retrieved here: each waiter also got it
