"""May the caller call now: a key's rate and concurrency limits applied to each request, and the
lease a request holds until its answer ends."""

import secrets
from dataclasses import dataclass

from redis.exceptions import RedisError

from services.gateway.metrics import GatewayMetrics
from shared.errors import InvalidRequest, Unavailable
from shared.keys import KeyRecord
from shared.logging import get_logger
from shared.ratelimit import Decision, RateLimiter, rate_limit_headers, refusal

log = get_logger(__name__)


@dataclass
class Admission:
    """An admitted request: its limiter state (for headers) and its concurrency lease."""

    record: KeyRecord
    lease_id: str
    decision: Decision | None

    def headers(self) -> dict[str, str]:
        return rate_limit_headers(self.decision) if self.decision else {}

    @property
    def holds_lease(self) -> bool:
        return self.decision is not None and self.record.limits.max_concurrent is not None


class Admitter:
    """Applies a key's limits to each request."""

    def __init__(self, *, limiter: RateLimiter, metrics: GatewayMetrics, fail_open: bool, lease_s: float) -> None:
        self._limiter = limiter
        self._metrics = metrics
        self._fail_open = fail_open
        self._lease_s = lease_s

    async def admit(self, record: KeyRecord, *, token_cost: int) -> Admission:
        """Admit the request or refuse it.

        Raises:
            RateLimited: a limit is exhausted (429 with accurate Retry-After).
            InvalidRequest: the request alone is larger than the key's token budget.
            Unavailable: Redis is unreachable and the limiter fails closed.
        """
        lease_id = secrets.token_hex(8)
        try:
            decision = await self._limiter.check(
                record.id, record.limits, token_cost=token_cost, lease_id=lease_id, lease_ttl_s=self._lease_s
            )
        except RedisError as exc:
            log.warning("rate_limiter_unavailable", error=repr(exc))
            if self._fail_open:
                self._metrics.limiter_unavailable.labels("open").inc()
                return Admission(record, lease_id, None)
            self._metrics.limiter_unavailable.labels("closed").inc()
            raise Unavailable("Rate limiting is unavailable; try again shortly.", retry_after_s=2) from exc
        if decision.denied == "too_large":
            raise InvalidRequest(
                f"The request needs about {token_cost} tokens, more than this key's limit of "
                f"{record.limits.tpm} tokens per minute.",
                code="request_too_large_for_limit",
            )
        if decision.denied is not None:
            self._metrics.rate_limited.labels(decision.denied).inc()
            raise refusal(decision)
        return Admission(record, lease_id, decision)

    async def release(self, admission: Admission) -> None:
        if not admission.holds_lease:
            return
        try:
            await self._limiter.release(admission.record.id, admission.lease_id)
        except RedisError as exc:
            log.warning("lease_release_failed", error=repr(exc))
