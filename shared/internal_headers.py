"""The `x-axon-*` headers: who is asking (`Caller`), as the gateway vouches for it to the session
manager, and the two other headers the platform sets.

The gateway authenticates and admits each call, then forwards it with `encode(caller)`; the
session manager reads the caller back with `decode(scope)`. The gateway builds these headers
itself, so an `x-axon-*` header a client sends never reaches the session manager, which trusts
them only from a holder of the internal token (`shared/internal_auth.py`).
"""

from dataclasses import dataclass

from starlette.types import Scope

from shared.errors import InvalidRequest
from shared.hot_routes import header
from shared.ratelimit import BudgetReservation

# Gateway -> session manager: the caller.
TENANT_HEADER = "x-axon-tenant"
PRIORITY_HEADER = "x-axon-priority"
KEY_ID_HEADER = "x-axon-key-id"
TPM_LIMIT_HEADER = "x-axon-tpm-limit"
# The tokens a completion's admission charged against its key's tokens per minute (the most it may
# use: its prompt estimate and n x max_tokens): corrected to the real usage when the answer ends.
TPM_CHARGED_HEADER = "x-axon-tpm-charged"
# The lease a completion holds (a concurrency slot, and the record of its tokens-per-minute
# charge): the session manager releases it when the answer ends.
LEASE_HEADER = "x-axon-lease-id"
# The tokens of the key's budget the gateway reserved: settled to the real usage when the answer ends.
BUDGET_HEADER = "x-axon-budget-reservation"

# Gateway -> session manager: the address the client called the gateway at (`https://host:port`),
# for the URLs an answer gives back (a message batch's `results_url`).
PUBLIC_URL_HEADER = "x-axon-public-url"

# Session manager -> client: how many history messages a session turn's prompt left out.
HISTORY_DROPPED_HEADER = "x-axon-history-dropped"
# Worker -> the dead-letter queue: why a job was dead-lettered (a header of its RabbitMQ message).
DEAD_REASON_HEADER = "x-axon-dead-reason"
# Worker -> the next worker: the job was handed back unfinished at shutdown, republished with the
# id of the worker that gave it up: its progress is read back, and this is not a redelivery that
# counts against it (no worker died with it).
HANDED_BACK_HEADER = "x-axon-handed-back"
# Session manager -> worker: when the job was published (Unix time in ms, an integer: AMQP carries
# a float header as single precision), for the queue wait the worker reports per tenant.
ENQUEUED_AT_HEADER = "x-axon-enqueued-at"

# The most characters a tenant, a key id and a lease id may have.
MAX_TENANT = 128
MAX_ID = 64
# The highest priority a key may have.
MAX_PRIORITY = 9


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is asking, as the gateway vouches for it, and what its admission was charged."""

    tenant: str
    priority: int = 0
    key_id: str | None = None
    tpm_limit: int = 0
    # What the gateway's admission charged against the key's tokens per minute.
    tpm_charged: int = 0
    # The gateway's lease for this request, released when the answer ends.
    lease_id: str | None = None
    # What the gateway reserved of the key's token budget, settled to the usage when the answer ends.
    budget: BudgetReservation | None = None
    # A line of a batch (never sent in a header: the session manager's batches make these callers).
    batch: bool = False


def encode(caller: Caller) -> dict[str, str]:
    """The headers that tell the session manager who `caller` is (the gateway's side)."""
    headers = {TENANT_HEADER: caller.tenant, PRIORITY_HEADER: str(caller.priority)}
    if caller.key_id is not None:
        headers[KEY_ID_HEADER] = caller.key_id
    headers[TPM_LIMIT_HEADER] = str(caller.tpm_limit)
    headers[TPM_CHARGED_HEADER] = str(caller.tpm_charged)
    if caller.lease_id is not None:
        headers[LEASE_HEADER] = caller.lease_id
    if caller.budget is not None:
        headers[BUDGET_HEADER] = caller.budget.header()
    return headers


# The names as the ASGI scope holds them.
_TENANT = TENANT_HEADER.encode()
_PRIORITY = PRIORITY_HEADER.encode()
_KEY_ID = KEY_ID_HEADER.encode()
_TPM_LIMIT = TPM_LIMIT_HEADER.encode()
_TPM_CHARGED = TPM_CHARGED_HEADER.encode()
_LEASE = LEASE_HEADER.encode()
_BUDGET = BUDGET_HEADER.encode()


def decode(scope: Scope) -> Caller:
    """Who is asking, from the headers of the request `scope` (the session manager's side).

    Raises:
        InvalidRequest: a header is missing or out of range (`param` names it).
    """
    tenant = header(scope, _TENANT)
    if not tenant or len(tenant) > MAX_TENANT:
        raise InvalidRequest(
            f"{TENANT_HEADER}: a tenant of 1 to {MAX_TENANT} characters is required.", param=TENANT_HEADER
        )
    key_id = header(scope, _KEY_ID)
    if key_id is not None and len(key_id) > MAX_ID:
        raise InvalidRequest(f"{KEY_ID_HEADER}: at most {MAX_ID} characters.", param=KEY_ID_HEADER)
    lease_id = header(scope, _LEASE)
    if lease_id is not None and len(lease_id) > MAX_ID:
        raise InvalidRequest(f"{LEASE_HEADER}: at most {MAX_ID} characters.", param=LEASE_HEADER)
    budget = None
    reservation = header(scope, _BUDGET)
    if reservation is not None:
        try:
            budget = BudgetReservation.parse(reservation)
        except ValueError:
            raise InvalidRequest(f"{BUDGET_HEADER}: must be <period>:<id>:<tokens>.", param=BUDGET_HEADER) from None
    return Caller(
        tenant=tenant,
        priority=_int_header(scope, _PRIORITY, high=MAX_PRIORITY),
        key_id=key_id,
        tpm_limit=_int_header(scope, _TPM_LIMIT),
        tpm_charged=_int_header(scope, _TPM_CHARGED),
        lease_id=lease_id,
        budget=budget,
    )


def _int_header(scope: Scope, name: bytes, *, high: int | None = None) -> int:
    raw = header(scope, name)
    if raw is None:
        return 0
    if not raw.isdigit() or (high is not None and int(raw) > high):
        bounds = f"0 to {high}" if high is not None else "a whole number of at least 0"
        raise InvalidRequest(f"{name.decode()}: must be {bounds}.", param=name.decode())
    return int(raw)
