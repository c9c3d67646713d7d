"""What happens when a worker dies mid-stream.

RabbitMQ hands the dead worker's unacked jobs to another worker of the model. That worker reads
back the progress recorded with every chunk (`chunk_publisher.py`) and continues the answer where it
stopped, with what is left of its token budget. A job whose final chunk was already published is
only acked; a job delivered more than `max_deliveries` times is given up (dead-lettered).
"""

import asyncio
import time
from dataclasses import dataclass

from services.worker.engines import Resume
from shared.names import Names
from shared.redis_pipe import RedisPipe
from shared.schemas import Job, Sampling
from shared.usage import PROGRESS_COMPLETION_TOKENS, PROGRESS_PROMPT_TOKENS

# The progress hash's token counts, as Redis returns their field names.
_COMPLETION_TOKENS, _PROMPT_TOKENS = PROGRESS_COMPLETION_TOKENS.encode(), PROGRESS_PROMPT_TOKENS.encode()


@dataclass(frozen=True, slots=True)
class Progress:
    """How far earlier attempts of a job got, as recorded with their chunks (none: the defaults)."""

    # The final chunk was published: the job is answered, only its ack was lost.
    done: bool = False
    # The next chunk's number.
    seq: int = 0
    prompt_tokens: int = 0
    # Where the answer continues; None when there is nothing to continue.
    resume: Resume | None = None


class Failover:
    """Reads back what earlier deliveries of a job left in Redis, and counts its deliveries."""

    def __init__(self, pipe: RedisPipe, names: Names, *, max_deliveries: int) -> None:
        self._pipe = pipe
        self._names = names
        self._max_deliveries = max_deliveries

    async def load_progress(self, job_id: str) -> Progress:
        """Read what an earlier attempt published, if any (one round trip)."""
        fields, text, token_ids = await asyncio.gather(
            self._pipe.submit("HGETALL", self._names.job_progress(job_id)),
            self._pipe.submit("GET", self._names.job_progress_text(job_id)),
            self._pipe.submit("LRANGE", self._names.job_progress_tokens(job_id), 0, -1),
        )
        if not fields:
            return Progress()
        recorded = dict(zip(fields[::2], fields[1::2], strict=True))
        if b"done" in recorded:
            return Progress(done=True)
        if b"seq" not in recorded:
            return Progress()  # only a session manager's billed mark (`shared/usage.py`): nothing was published
        return Progress(
            seq=int(recorded[b"seq"]),
            prompt_tokens=int(recorded[_PROMPT_TOKENS]),
            resume=Resume(
                text=(text or b"").decode(),
                token_ids=tuple(int(t) for t in token_ids),
                completion_tokens=int(recorded[_COMPLETION_TOKENS]),
            ),
        )

    async def count_redelivery(self, job: Job) -> str | None:
        """Count a redelivery of `job`; past `max_deliveries`, return why it is given up."""
        key = self._names.job_deliveries(job.job_id)
        redeliveries, _ = await asyncio.gather(
            self._pipe.submit("INCR", key),
            self._pipe.submit("EXPIRE", key, max(1, int(job.deadline - time.time()) + 60)),
        )
        deliveries = int(redeliveries) + 1
        if deliveries <= self._max_deliveries:
            return None
        return f"delivered {deliveries} times without finishing (AXON_MAX_DELIVERIES={self._max_deliveries})"


def remaining_sampling(sampling: Sampling, resume: Resume) -> Sampling | None:
    """The sampling for the rest of a resumed answer: `max_tokens` less the tokens already
    generated; None when none are left (the answer ends there, with `length`)."""
    remaining = sampling.max_tokens - resume.completion_tokens
    if remaining < 1:
        return None
    return sampling.model_copy(update={"max_tokens": remaining})
