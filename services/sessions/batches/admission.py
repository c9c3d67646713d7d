"""A batch line's admission, as the gateway admits an online request of the batch's key: the key
still valid (not revoked, not expired), allowed the line's model, and with token budget left
(reserved, then settled to the line's real usage when it ends, as any request's, both at
`AXON_BATCH_BILLING_FACTOR`). The key's rates
(requests and tokens per minute, concurrency) do not apply: batch lines are paced by the
dispatcher (`runner.py`), as OpenAI's batches do not count against the online rate limits.
"""

import datetime as dt
import secrets
import time

from services.sessions.catalog import ModelCatalog
from shared.errors import Forbidden, Unauthorized
from shared.internal_headers import Caller
from shared.keys import KeyLimits, KeyRecord, KeyRepository, model_allowed
from shared.ratelimit import RateLimiter, budget_refusal, budget_window
from shared.usage import billed_tokens

# A key read once serves a batch's lines for this long (a revocation or a new limit applies
# to its lines this much later at most).
KEY_CACHE_S = 5.0


class LineAdmission:
    """Admits batch lines (see the module's docstring)."""

    def __init__(
        self, *, keys: KeyRepository, catalog: ModelCatalog, limiter: RateLimiter, lease_s: float, billing_factor: float
    ) -> None:
        self._keys = keys
        self._billing_factor = billing_factor
        self._catalog = catalog
        self._limiter = limiter
        self._lease_s = lease_s
        self._cached: dict[str, tuple[float, KeyRecord | None]] = {}

    async def _key(self, key_id: str) -> KeyRecord | None:
        now = time.monotonic()
        cached = self._cached.get(key_id)
        if cached is None or now - cached[0] > KEY_CACHE_S:
            cached = (now, await self._keys.get(key_id))
            self._cached[key_id] = cached
        return cached[1]

    async def admit(self, *, tenant: str, key_id: str | None, model: str, tokens: int) -> Caller:
        """The caller a line of key `key_id` runs as, `tokens` (its most) reserved of the key's budget
        at the billing factor.

        Raises:
            Unauthorized: 401, the key was revoked or has expired.
            Forbidden: 403 `model_not_allowed`.
            RateLimited: 429 `budget_exceeded`.
        """
        if key_id is None:  # a deployment without keys (tests' internal calls)
            return Caller(tenant=tenant, batch=True)
        record = await self._key(key_id)
        if record is None or record.revoked_at is not None:
            raise Unauthorized("The batch's API key was revoked.", code="invalid_api_key")
        if record.expired(time.time()):
            raise Unauthorized("The batch's API key has expired.", code="key_expired")
        allowed = record.allowed_models
        if allowed is not None and not model_allowed(model, allowed, await self._catalog.aliases()):
            raise Forbidden(f"This API key may not use model '{model}'.", param="model", code="model_not_allowed")
        limits = record.limits
        if not limits.token_budget:
            return Caller(tenant=tenant, batch=True, key_id=key_id)
        now = dt.datetime.now(dt.UTC)
        # The budget alone: no rate applies to a batch line (see the module's docstring).
        decision = await self._limiter.check(
            key_id,
            KeyLimits(token_budget=limits.token_budget, budget_period=limits.budget_period),
            tokens=billed_tokens(tokens, self._billing_factor),
            lease_id=secrets.token_hex(8),
            lease_ttl_s=self._lease_s,
            period_id=budget_window(limits.budget_period, now)[0],
        )
        if decision.denied is not None:
            raise budget_refusal(limits, decision.budget_used, now)
        return Caller(tenant=tenant, batch=True, key_id=key_id, budget=decision.reservation)
