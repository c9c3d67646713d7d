"""The headers the gateway sets on what it forwards to the session manager, and the caller they
describe (placeholder until the shared contract module lands)."""

from dataclasses import dataclass

from shared.ratelimit import BudgetReservation


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is asking, as the gateway vouches for it, and what its admission was charged."""

    tenant: str
    priority: int = 0
    key_id: str | None = None
    tpm_limit: int = 0
    prompt_estimate: int = 0
    # The gateway's concurrency lease for this request, released when the answer ends.
    lease_id: str | None = None
    # What the gateway reserved of the key's token budget, settled to the usage when the answer ends.
    budget: BudgetReservation | None = None
