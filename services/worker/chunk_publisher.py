"""A job's stream of chunks and its progress in Redis, written in the same round trip.

With every chunk the worker records the next `seq`, the engine's raw text (and token ids) so
far, so a worker that takes over a redelivered job resumes exactly where the dead one stopped
(`failover.py` reads it back). A job with tools has its raw text split into content and tool-call
deltas by a `ToolCallParser` on the way out; a resumed job's parser is first fed the raw text
already published, so it continues from the same state.
"""

import asyncio
import datetime as dt
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain

import orjson
from redis.exceptions import RedisError

from services.worker.engines import EngineOutput
from services.worker.engines.base import ToolCallParser
from services.worker.failover import Progress
from services.worker.tool_parsers import merge_deltas
from shared.affinity import AFFINITY_TTL_S
from shared.logging import get_logger
from shared.names import Names
from shared.redis_pipe import PipeScript, RedisPipe
from shared.schemas import (
    ChunkError,
    FinishReason,
    Job,
    PromptTokensDetails,
    TokenChunk,
    TokenLogprob,
    ToolCallDelta,
    Usage,
)
from shared.usage import BILLED_FIELD, PROGRESS_COMPLETION_TOKENS, PROGRESS_GRACE_S, PROGRESS_PROMPT_TOKENS, UsageRow

log = get_logger(__name__)

# KEYS: progress hash, text, token ids[, the job's chunk log][, a final chunk's session affinity record].
# ARGV: channel, chunk JSON, final (0/1), next seq, completion tokens, prompt tokens, new text,
#       expiry in seconds (0: leave as is), the chunk log's lifetime in seconds (0: no log) and
#       cap, then new token ids... or, for a final chunk with the affinity record, this worker's id
#       and the record's lifetime in seconds.
# A job with a chunk log (`Job.chunk_log_ttl_s`) also appends the chunk to it as entry `0-<seq + 1>`:
# a chunk republished after a failover whose seq is already logged is refused by Redis (its id is
# not past the stream's last), the refusal caught by `pcall`, so the log holds each seq once, as
# first published. An attempt's first chunk keeps the log for its lifetime past the progress's
# expiry (the job's deadline + `PROGRESS_GRACE_S`), the final chunk for its lifetime from then:
# no chunk comes between them that could outlive the first's, and an `EXPIRE` with every chunk
# cost Redis about half as much as the `XADD`.
# The final chunk replaces the progress with `done` and the job's final token counts: a job
# redelivered after its answer was complete (its ack was lost with the broker connection) is then
# acked, not generated again, and a session manager that never saw the final chunk can still
# charge what was generated. It returns 2 when nobody received it (the session manager that
# published the job is gone) and no session manager has charged the job (`BILLED_FIELD`, set by
# `shared.usage.MARK_BILLED`): the worker then records the job's usage row itself. Any other
# chunk nobody received returns 0: a job without a chunk log is then read by nobody, ever (its
# session manager subscribed before publishing it, and unsubscribes only when it stops relaying).
# A session's answer also names this worker as the session's home (`<ns>:affinity:<session>`), in
# the same call: the session manager sends the next turn to its queue, where its prefix is cached.
_PUBLISH_WITH_PROGRESS = PipeScript(f"""
local receivers = redis.call('PUBLISH', ARGV[1], ARGV[2])
local home = 4
local log_ttl = tonumber(ARGV[9])
if log_ttl > 0 then
  redis.pcall('XADD', KEYS[4], 'MAXLEN', '~', ARGV[10], '0-' .. ARGV[4], 'c', ARGV[2])
  if ARGV[3] == '1' then
    redis.call('EXPIRE', KEYS[4], log_ttl)
  elseif ARGV[8] ~= '0' then
    redis.call('EXPIRE', KEYS[4], log_ttl + tonumber(ARGV[8]))
  end
  home = 5
end
if ARGV[3] == '1' then
  local billed = redis.call('HEXISTS', KEYS[1], '{BILLED_FIELD}')
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
  redis.call('HSET', KEYS[1], 'done', '1',
    '{PROGRESS_COMPLETION_TOKENS}', ARGV[5], '{PROGRESS_PROMPT_TOKENS}', ARGV[6])
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[8]))
  if #KEYS >= home then redis.call('SET', KEYS[home], ARGV[11], 'EX', tonumber(ARGV[12])) end
  if receivers == 0 and billed == 0 then return 2 end
  return 1
end
redis.call('HSET', KEYS[1], 'seq', ARGV[4],
  '{PROGRESS_COMPLETION_TOKENS}', ARGV[5], '{PROGRESS_PROMPT_TOKENS}', ARGV[6])
if ARGV[7] ~= '' then redis.call('APPEND', KEYS[2], ARGV[7]) end
if #ARGV > 10 then redis.call('RPUSH', KEYS[3], unpack(ARGV, 11)) end
local ttl = tonumber(ARGV[8])
if ttl > 0 then
  for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ttl) end
end
if receivers == 0 then return 0 end
return 1
""")


# The chunk's JSON straight from pydantic's serializer (`model_dump_json` costs a little more).
_chunk_json = TokenChunk.__pydantic_serializer__.to_json
# Most chunks are text alone: their JSON, as `_chunk_json(..., exclude_none=True)` writes it, from
# a template with only the text encoded (a TokenChunk built and serialised costs several times more).
_TEXT_CHUNK = b'{"seq":%d,"text":%b,"n_tokens":%d}'

# What `_PUBLISH_WITH_PROGRESS` returns for a final chunk whose usage nobody recorded, and for
# any other chunk nobody received.
_UNHEARD = 2
_NOBODY = 0


# Entries a job's chunk log keeps beyond its token budget: every chunk but a final one carries at
# least one token, and a failover adds none (it continues the same seqs and budget), so the cap
# only bites on a worker gone wrong; Redis trims whole nodes of entries (`MAXLEN ~`), at most
# `stream-node-max-entries` (100) past the cap.
CHUNK_LOG_MARGIN = 64


@dataclass(frozen=True, slots=True)
class ChunkLogTarget:
    """Where a job's chunks are logged for replay (`Job.chunk_log_ttl_s`): its stream, how long it
    is kept after the last chunk, and how many entries it holds at most."""

    key: str
    ttl_s: int
    cap: int

    @classmethod
    def of(cls, job: Job, names: Names) -> "ChunkLogTarget | None":
        if job.chunk_log_ttl_s is None:
            return None
        return cls(names.chunk_log(job.job_id), job.chunk_log_ttl_s, job.sampling.max_tokens + CHUNK_LOG_MARGIN)


@dataclass(frozen=True, slots=True)
class Home:
    """The affinity record a session job's answer writes: its key and this worker's id."""

    key: str
    worker_id: str


# Decides an answer's finish reason from the engine's and whether tool calls were made.
FinishRule = Callable[[FinishReason, bool], FinishReason]


@dataclass(frozen=True, slots=True)
class UsageOwner:
    """Whom a job's usage row names (its job's tenant, API key and model: the adapter a job names,
    as the session manager's row does), for the row its worker records when nobody receives its
    final chunk."""

    tenant: str
    key_id: str | None
    model: str
    batch: bool = False

    @classmethod
    def of(cls, job: Job) -> "UsageOwner":
        return cls(tenant=job.tenant, key_id=job.key_id, model=job.adapter or job.model, batch=job.batch)


class ChunkPublisher:
    """Publishes one job's chunks, numbered on from where any earlier attempt stopped (`progress`)."""

    def __init__(
        self,
        pipe: RedisPipe,
        names: Names,
        *,
        job_id: str,
        channel: str,
        deadline: float,
        progress: Progress,
        owner: UsageOwner | None = None,
        home: Home | None = None,
        chunk_log: ChunkLogTarget | None = None,
        traceparent: str | None = None,
    ) -> None:
        self._pipe = pipe
        # Put on the final chunk: the worker's span, for the session manager's to link to.
        self._traceparent = traceparent
        self._channel = channel
        self._deadline = deadline
        self._job_id = job_id
        self._owner = owner
        self._home = home
        self._outbox = names.outbox
        self._keys: tuple[str, ...] = (
            names.job_progress(job_id),
            names.job_progress_text(job_id),
            names.job_progress_tokens(job_id),
        )
        self._log_args: tuple[int, int] = (0, 0)
        self._logged = chunk_log is not None
        if chunk_log is not None:
            self._keys += (chunk_log.key,)
            self._log_args = (chunk_log.ttl_s, chunk_log.cap)
        self.seq = progress.seq
        self.completion_tokens = progress.resume.completion_tokens if progress.resume is not None else 0
        self.prompt_tokens = progress.prompt_tokens
        self.resumed = progress.resume is not None
        self._resumed_text = progress.resume.text if progress.resume is not None else ""
        self._expiry_set = False
        # Whether the progress text and token list exist with their expiry: created by the first
        # chunk that has text (or token ids), which may come after the first chunk.
        self._text_expiring = False
        self._tokens_expiring = False
        self._parser: ToolCallParser | None = None
        self._finish_rule: FinishRule | None = None
        self._echo = ""
        # A chunk reached no subscriber and the job keeps no log: nobody can read its answer.
        self.unheard = False

    def shape(self, parser: ToolCallParser | None, finish_rule: FinishRule | None = None, *, echo: str = "") -> None:
        """How the engine's text becomes chunks: split by `parser` into content and tool calls (a
        resumed job's parser is fed what was already published first), the final reason decided by
        `finish_rule`, and `echo` (a completion's prompt) put before the first chunk's text."""
        self._parser = parser
        self._finish_rule = finish_rule
        self._echo = echo
        if parser is not None and self._resumed_text:
            parser.feed(self._resumed_text)

    async def publish(self, out: EngineOutput) -> None:
        """Publish the engine's output as the next chunk and record the progress atomically."""
        self.completion_tokens += out.n_tokens
        if not self.resumed or self.prompt_tokens == 0:
            self.prompt_tokens = out.prompt_tokens
        text, reason, tool_calls = out.text, out.finish_reason, None
        if self._parser is not None:
            text, tool_calls, reason = self._parse(text, reason)
        if self.seq == 0 and self._echo:
            text = self._echo + text
        logprobs: list[TokenLogprob] | None = None
        if out.logprobs or out.prompt_logprobs:
            logprobs = [*out.prompt_logprobs, *out.logprobs]
        if reason is None and tool_calls is None and logprobs is None:
            payload = _TEXT_CHUNK % (self.seq, orjson.dumps(text), out.n_tokens)
            await self._send(payload, final=False, text=out.text, token_ids=out.token_ids)
            return
        usage = None
        if reason is not None:
            usage = self._usage(PromptTokensDetails(cached_tokens=out.cached_tokens))
        chunk = TokenChunk(
            seq=self.seq,
            text=text,
            n_tokens=out.n_tokens,
            finish_reason=reason,
            usage=usage,
            tool_calls=tool_calls,
            logprobs=logprobs,
            stop_sequence=out.stop_sequence if reason == "stop" else None,
        )
        await self._send_chunk(chunk, text=out.text, token_ids=out.token_ids, home=self._home)

    def _parse(
        self, raw: str, reason: FinishReason | None
    ) -> tuple[str, list[ToolCallDelta] | None, FinishReason | None]:
        """The content and tool-call deltas of the engine's new text; at the end, what the parser
        held back too, and the answer's finish reason."""
        assert self._parser is not None
        text, deltas = self._parser.feed(raw)
        if reason is not None:
            more_text, more = self._parser.finish()
            text, deltas = text + more_text, merge_deltas(deltas + more)
            if self._finish_rule is not None:
                reason = self._finish_rule(reason, self._parser.called)
        return text, deltas or None, reason

    def _usage(self, details: PromptTokensDetails | None = None) -> Usage:
        """The job's tokens so far, every attempt's: what its final chunk charges."""
        return Usage(
            prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens, prompt_tokens_details=details
        )

    async def finish_with_error(
        self, message: str, error_type: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        """End the job with an error, charging the tokens published before it."""
        error = ChunkError(message=message, type=error_type, param=param, code=code)
        await self._send_chunk(TokenChunk(seq=self.seq, finish_reason="error", error=error, usage=self._usage()))

    async def finish_cancelled(self) -> None:
        """End a job cancelled before it ran here, charging what earlier attempts published."""
        await self._send_chunk(TokenChunk(seq=self.seq, finish_reason="cancelled", usage=self._usage()))

    async def _send_chunk(
        self, chunk: TokenChunk, *, text: str = "", token_ids: tuple[int, ...] = (), home: Home | None = None
    ) -> None:
        """`_send` of `chunk` (a final one carries the worker's span's `traceparent`)."""
        final = chunk.finish_reason is not None
        if final and self._traceparent is not None:
            chunk.traceparent = self._traceparent
        await self._send(_chunk_json(chunk, exclude_none=True), final=final, text=text, token_ids=token_ids, home=home)

    async def _send(
        self, payload: bytes, *, final: bool, text: str = "", token_ids: tuple[int, ...] = (), home: Home | None = None
    ) -> None:
        """One script call: publish the chunk (`payload`, its JSON), log it if the job keeps a log,
        and record the progress (or, for a `final` chunk, forget it, and name this worker the
        session's `home`), so a worker dying in between never leaves half a record. `text` is the
        engine's raw text (tool calls included), which a resumed job replays."""
        expire_s = 0
        creates = (bool(text) and not self._text_expiring) or (bool(token_ids) and not self._tokens_expiring)
        if final or not self._expiry_set or creates:
            expire_s = max(1, int(self._deadline - time.time()) + PROGRESS_GRACE_S)
            self._expiry_set = True
            self._text_expiring |= bool(text)
            self._tokens_expiring |= bool(token_ids)
        keys = list(self._keys)
        tail: list[str | int] = [*token_ids]
        if final and home is not None:  # a final chunk records no token ids
            keys.append(home.key)
            tail = [home.worker_id, AFFINITY_TTL_S]
        published = await self._pipe.evalsha(
            _PUBLISH_WITH_PROGRESS,
            keys,
            [
                self._channel,
                payload,
                int(final),
                self.seq + 1,
                self.completion_tokens,
                self.prompt_tokens,
                text,
                expire_s,
                *self._log_args,
                *tail,
            ],
        )
        self.seq += 1
        if published == _NOBODY and not self._logged:
            self.unheard = True
        elif published == _UNHEARD and self._owner is not None:
            await self._record_usage(self._owner)

    async def _record_usage(self, owner: UsageOwner) -> None:
        """Put the job's usage row in the outbox: its final chunk reached nobody. Its latency is
        unknown here (the request's, not the job's)."""
        row = UsageRow(
            job_id=self._job_id,
            tenant=owner.tenant,
            key_id=owner.key_id,
            model=owner.model,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            latency_ms=None,
            created_at=dt.datetime.now(dt.UTC),
            batch=owner.batch,
        )
        try:
            await self._pipe.execute("XADD", self._outbox, "*", *chain(*row.outbox_fields().items()))
        except (RedisError, ConnectionError, TimeoutError) as exc:
            # The answer is complete; only its record is lost (Redis is away).
            log.warning("usage_record_failed", error=repr(exc))


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

    async def gather(self, timeout_s: float) -> None:
        """Let outputs pile up for `timeout_s`, or until the last one came (closed)."""
        try:
            async with asyncio.timeout(timeout_s):
                while not self.closed:
                    self._ready.clear()
                    await self._ready.wait()
        except TimeoutError:
            return

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
            logprobs=tuple(lp for p in pending for lp in p.logprobs),
            prompt_logprobs=tuple(lp for p in pending for lp in p.prompt_logprobs),
            cached_tokens=last.cached_tokens,
            stop_sequence=last.stop_sequence,
        )
