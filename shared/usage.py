"""A job's usage row, and how its worker and its session manager agree on who records it.

A job's usage is recorded once, as a `UsageRow` in the outbox (a persister commits it to
PostgreSQL's `usage` table):
- by the session manager that relayed the answer, with the request's latency, when it received
  the job's final chunk (which carries the job's usage) or, when it stopped waiting for that chunk,
  from the job's progress hash (`Names.job_progress`), which it marks billed (`MARK_BILLED`) in the
  same call;
- by the job's worker (`services/worker/chunk_publisher.py`) when nobody received its final chunk (the
  session manager that published the job is gone) and the progress carries no billed mark.

The progress hash is the worker's (it records `PROGRESS_COMPLETION_TOKENS` and
`PROGRESS_PROMPT_TOKENS` with every chunk); the session manager only adds `BILLED_FIELD` to it and
reads the token counts back.
"""

import datetime as dt
import math

import orjson
from pydantic import BaseModel, field_validator

from shared.postgres_text import postgres_text
from shared.redis_pipe import PipeScript

# The kind of a usage row's outbox entry (the entry's `kind` field; its `row` field is the JSON row).
USAGE_KIND = "usage"


def billed_tokens(tokens: int, factor: float) -> int:
    """What `tokens` of batch usage count at the billing factor `factor` (`AXON_BATCH_BILLING_FACTOR`),
    rounded up (to 6 decimals first, so that 100 x 0.07 is 7, not 8)."""
    return math.ceil(round(tokens * factor, 6))


# The fields of a job's progress hash that both sides read.
PROGRESS_COMPLETION_TOKENS = "completion_tokens"
PROGRESS_PROMPT_TOKENS = "prompt_tokens"
# Set by a session manager that charged the job from its progress: its worker then records no row.
BILLED_FIELD = "billed"

# A job's progress, and so its billed mark, outlives the job's deadline by this much, then Redis
# forgets it.
PROGRESS_GRACE_S = 60

# KEYS: a job's progress hash. ARGV: expiry (s) if the hash has none (the job has not started).
# Marks the job charged by a session manager and returns its published completion and prompt tokens.
MARK_BILLED = PipeScript(f"""
redis.call('HSET', KEYS[1], '{BILLED_FIELD}', '1')
if redis.call('TTL', KEYS[1]) < 0 then redis.call('EXPIRE', KEYS[1], tonumber(ARGV[1])) end
return redis.call('HMGET', KEYS[1], '{PROGRESS_COMPLETION_TOKENS}', '{PROGRESS_PROMPT_TOKENS}')
""")


class UsageRow(BaseModel):
    """A row of PostgreSQL's `usage` table: one job's tokens, charged to its tenant and API key."""

    job_id: str
    tenant: str
    key_id: str | None
    model: str
    prompt_tokens: int
    completion_tokens: int
    # None in a row its worker recorded: the latency is the request's, which the worker never sees.
    latency_ms: int | None
    created_at: dt.datetime
    # A batch line's usage (`/admin/usage` reports it apart as well).
    batch: bool = False

    @field_validator("tenant", "key_id", "model")
    @classmethod
    def _storable(cls, value: str | None) -> str | None:
        return postgres_text(value)

    def outbox_fields(self) -> dict[str, str | bytes]:
        """The row's outbox entry, as the persister reads it: its kind, and the row as JSON."""
        return {"kind": USAGE_KIND, "row": orjson.dumps(self.model_dump(mode="json"))}
