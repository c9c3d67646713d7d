"""A job's stream of chunks and its progress in Redis, written in the same round trip.

With every chunk the worker records the next `seq`, the text (and token ids) so far, so
a worker that takes over a redelivered job resumes exactly where the dead one stopped
(`failover.py` reads it back).
"""

import asyncio
import time

import orjson

from services.worker.engines import EngineOutput
from services.worker.failover import Progress
from shared.names import Names
from shared.redis_pipe import PipeScript, RedisPipe

# Progress outlives the job's deadline by this much, then Redis forgets it.
_PROGRESS_GRACE_S = 60

# KEYS: progress hash, text, token ids.
# ARGV: channel, chunk JSON, final (0/1), next seq, completion tokens, prompt tokens, new text,
#       expiry in seconds (0: leave as is), new token ids...
# The final chunk replaces the progress with `done`: a job redelivered after its answer was
# complete (its ack was lost with the broker connection) is then acked, not generated again.
_PUBLISH_WITH_PROGRESS = PipeScript("""
redis.call('PUBLISH', ARGV[1], ARGV[2])
if ARGV[3] == '1' then
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
  redis.call('HSET', KEYS[1], 'done', '1')
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[8]))
  return 1
end
redis.call('HSET', KEYS[1], 'seq', ARGV[4], 'completion_tokens', ARGV[5], 'prompt_tokens', ARGV[6])
if ARGV[7] ~= '' then redis.call('APPEND', KEYS[2], ARGV[7]) end
if #ARGV > 8 then redis.call('RPUSH', KEYS[3], unpack(ARGV, 9)) end
local ttl = tonumber(ARGV[8])
if ttl > 0 then
  for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ttl) end
end
return 1
""")


class ChunkPublisher:
    """Publishes one job's chunks, numbered on from where any earlier attempt stopped (`progress`)."""

    def __init__(
        self, pipe: RedisPipe, names: Names, *, job_id: str, channel: str, deadline: float, progress: Progress
    ) -> None:
        self._pipe = pipe
        self._channel = channel
        self._deadline = deadline
        self._keys = (names.job_progress(job_id), names.job_progress_text(job_id), names.job_progress_tokens(job_id))
        self.seq = progress.seq
        self.completion_tokens = progress.resume.completion_tokens if progress.resume is not None else 0
        self.prompt_tokens = progress.prompt_tokens
        self.resumed = progress.resume is not None
        self._expiry_set = False

    async def publish(self, out: EngineOutput) -> None:
        """Publish the engine's output as the next chunk and record the progress atomically."""
        self.completion_tokens += out.n_tokens
        if not self.resumed or self.prompt_tokens == 0:
            self.prompt_tokens = out.prompt_tokens
        chunk: dict[str, object] = {"seq": self.seq, "text": out.text, "n_tokens": out.n_tokens}
        if out.finish_reason is not None:
            chunk["finish_reason"] = out.finish_reason
            chunk["usage"] = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens}
        await self._send(chunk, text=out.text, token_ids=out.token_ids)

    async def finish_with_error(self, message: str, error_type: str) -> None:
        await self._send({"seq": self.seq, "finish_reason": "error", "error": {"message": message, "type": error_type}})

    async def finish_cancelled(self) -> None:
        await self._send({"seq": self.seq, "finish_reason": "cancelled"})

    async def _send(self, chunk: dict[str, object], *, text: str = "", token_ids: tuple[int, ...] = ()) -> None:
        """One script call: publish the chunk and record the progress (or, for a final chunk,
        forget it), so a worker dying in between never leaves half a record."""
        final = "finish_reason" in chunk
        expire_s = 0
        if final or not self._expiry_set:
            expire_s = max(1, int(self._deadline - time.time()) + _PROGRESS_GRACE_S)
            self._expiry_set = True
        await self._pipe.evalsha(
            _PUBLISH_WITH_PROGRESS,
            list(self._keys),
            [
                self._channel,
                orjson.dumps(chunk),
                int(final),
                self.seq + 1,
                self.completion_tokens,
                self.prompt_tokens,
                text,
                expire_s,
                *token_ids,
            ],
        )
        self.seq += 1


class Coalescer:
    """Collects engine outputs while the previous chunk is being published, so that under
    load one chunk carries several tokens instead of per-message overhead capping throughput.
    At low load every output goes out on its own, as soon as it exists."""

    def __init__(self) -> None:
        self._pending: list[EngineOutput] = []
        self._ready = asyncio.Event()
        self.closed = False

    def add(self, out: EngineOutput) -> None:
        self._pending.append(out)
        self._ready.set()

    def close(self) -> None:
        self.closed = True
        self._ready.set()

    async def take(self) -> EngineOutput | None:
        """Everything added since the last take, merged; None once closed and empty."""
        while not self._pending:
            if self.closed:
                return None
            self._ready.clear()
            await self._ready.wait()
        pending, self._pending = self._pending, []
        if len(pending) == 1:
            return pending[0]
        last = pending[-1]
        return EngineOutput(
            text="".join(p.text for p in pending),
            n_tokens=sum(p.n_tokens for p in pending),
            prompt_tokens=last.prompt_tokens,
            completion_tokens=last.completion_tokens,
            finish_reason=last.finish_reason,
            token_ids=tuple(t for p in pending for t in p.token_ids),
        )
