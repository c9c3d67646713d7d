"""OpenAI's Responses API (`/v1/responses`) on the Chat Completions machinery.

A response runs as one chat completion (`CompletionService`, the same admission, job, relay and
usage accounting): its prompt is `instructions` (a system message for this response only), then
the history, then `input` as session messages (`conversations.items_to_messages`). The history is
the chain of `previous_response_id` (each stored response keeps its `context`: its history, input
and output as messages) or the items of `conversation` (a session, to which the response's input
and output items are appended once it is answered).

A stored response (`store`, the default) is one Redis key, `<ns>:response:<id>`, holding its
tenant, its Response object, its input items, its context and its job's id, expiring
`AXON_RESPONSE_TTL_S` after it was created, and a row of `responses` written behind through the
outbox once it is finished (read when Redis misses). Another tenant's response, or one not
stored, is 404. It is written when its job is published (`pending`: what finishing it needs) and
again when finished, by whoever finishes it first (`ResponseStore.finish`): the session manager
relaying it, even once its client left, or one that took it over (`response_runs.py`). Its events
are rebuilt from its job's chunk log (`chunk_log.py`) exactly as they were streamed (item ids
follow from the response id and output index), so any replica can replay and follow them.
"""

import asyncio
import contextlib
import datetime as dt
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import asyncpg
import orjson
from pydantic import BaseModel
from redis.asyncio import Redis
from redis.exceptions import RedisError

from services.sessions.api.routes import SSE_KEEPALIVE
from services.sessions.catalog import ModelCatalog
from services.sessions.chunk_log import PAGE, ChunkLog
from services.sessions.conversations import (
    conversation_id,
    conversation_not_found,
    items_to_messages,
    session_id_of,
)
from services.sessions.history import SessionInfo, SessionStore
from services.sessions.outbox import Outbox, ResponseRow, postgres_text
from services.sessions.response_runs import ResponseLeases
from services.sessions.responses import Answer
from services.sessions.service import (
    KEEPALIVE_INTERVAL_S,
    ActiveRequest,
    Caller,
    Choice,
    CompletionService,
    chunk_error,
)
from services.sessions.settings import SessionsSettings
from services.sessions.turns import build_prompt, fit_history
from shared.errors import AxonError, DeadlineExceeded, InvalidRequest, NotFound, Unavailable
from shared.logging import get_logger
from shared.names import Names
from shared.openai_requests import ChatCompletionRequest
from shared.redis_pipe import PipeScript, RedisPipe
from shared.responses_requests import ResponseCreate, as_response_error
from shared.schemas import FunctionCall, Message, TokenChunk, ToolCall, Usage

log = get_logger(__name__)

RESPONSE_PREFIX = "resp_"
# A finished response's status; before it is `queued` (background, no chunk yet) or `in_progress`.
FINISHED = frozenset({"completed", "incomplete", "failed", "cancelled"})
# The status a job's finish reason gives (any other: `completed`).
_STATUS_OF = {"length": "incomplete", "cancelled": "cancelled", "error": "failed"}
# The error of a response whose job no worker took before its deadline.
_NEVER_STARTED = "The response's job did not start before its deadline (no worker took it)."
# How long a follower past a job's deadline waits for its last chunk (a worker's error chunk).
_DEADLINE_GRACE_S = 5.0
# Events a replay sends in one piece.
_REPLAY_PAGE = 512
# A text delta event's fixed bytes (`ResponseEvents._text_delta`: what `_event` makes of it).
_DELTA_HEAD = b"event: response.output_text.delta\nid: "
_DELTA_DATA = b'\ndata: {"type":"response.output_text.delta","sequence_number":'
_DELTA_TAIL = b',"logprobs":[]}\n\n'
# Storage that cannot be reached.
_STORAGE_ERRORS = (RedisError, ConnectionError, TimeoutError)


def response_not_found() -> NotFound:
    return NotFound("No such response.", param="response_id", code="response_not_found")


def previous_not_found() -> NotFound:
    return NotFound("No such response.", param="previous_response_id", code="previous_response_not_found")


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def output_id(response_id: str, prefix: str, index: int) -> str:
    """The id of output item `index` of a response (`msg_<response hex>_<index>`): the same on
    every replica that rebuilds the response from its chunks."""
    return f"{prefix}{response_id.removeprefix(RESPONSE_PREFIX)}_{index}"


def status_of(finish_reason: str | None) -> str:
    """A finished response's status by its job's finish reason."""
    return _STATUS_OF.get(finish_reason or "stop", "completed")


def input_messages(body: ResponseCreate) -> list[Message]:
    """`input` as session messages (a string is one user message).

    Raises:
        InvalidRequest: an item of a type Axon does not take, or a malformed one (`input[0].type`).
    """
    if isinstance(body.input, str):
        return [Message(role="user", content=body.input)]
    return items_to_messages(body.input, param="input")


def message_items(messages: list[Message], *, status: str = "completed") -> list[dict[str, Any]]:
    """OpenAI items of `messages`, each with an id of its own: a message (input_text, or
    output_text for an assistant's), an assistant's tool calls as function_call items, a tool's
    result as a function_call_output."""
    items: list[dict[str, Any]] = []
    for message in messages:
        if message.role == "tool":
            items.append(
                {
                    "id": _id("fco_"),
                    "type": "function_call_output",
                    "call_id": message.tool_call_id or "",
                    "output": message.content,
                    "status": status,
                }
            )
            continue
        if message.content or not message.tool_calls:
            assistant = message.role == "assistant"
            part: dict[str, Any] = (
                {"type": "output_text", "text": message.content, "annotations": [], "logprobs": []}
                if assistant
                else {"type": "input_text", "text": message.content}
            )
            items.append(
                {"id": _id("msg_"), "type": "message", "role": message.role, "status": status, "content": [part]}
            )
        items.extend(
            {
                "id": _id("fc_"),
                "type": "function_call",
                "call_id": call.id,
                "name": call.function.name,
                "arguments": call.function.arguments,
                "status": status,
            }
            for call in message.tool_calls or ()
        )
    return items


def answer_message(answer: Answer) -> Message:
    return Message(role="assistant", content=answer.content, tool_calls=answer.tool_calls)


def usage_object(usage: Usage | None) -> dict[str, Any]:
    """OpenAI's ResponseUsage of a chat completion's usage."""
    usage = usage or Usage()
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def response_object(
    body: ResponseCreate,
    *,
    response_id: str,
    created_at: float,
    status: str,
    output: list[dict[str, Any]],
    usage: Usage | None,
    conversation: str | None,
) -> dict[str, Any]:
    """OpenAI's Response object (`output_text` is left to the SDK, which computes it)."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(created_at),
        "status": status,
        "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": body.model,
        "output": output,
        "usage": usage_object(usage) if usage is not None or status in FINISHED else None,
        "conversation": {"id": conversation} if conversation is not None else None,
        **body.echo(),
    }


def finished_response(
    initial: dict[str, Any],
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: Usage | None,
    error: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The Response object `initial` (as created) once finished with `status`."""
    return {
        **initial,
        "status": status,
        "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "output": output,
        "usage": usage_object(usage),
    }


def skeleton_of(response: dict[str, Any]) -> dict[str, Any]:
    """The Response object a stream's first events carry (`in_progress`, no output), the same
    for any state of `response`: a replay's first events equal the original's."""
    return {
        **response,
        "status": "in_progress",
        "completed_at": None,
        "error": None,
        "incomplete_details": None,
        "output": [],
        "usage": None,
    }


class Pending(BaseModel):
    """What finishing an unfinished stored response needs, kept in its record until it is finished."""

    # The first `history` messages of its context are its history, the rest its input.
    history: int
    # The conversation's session it is appended to once answered.
    session_id: str | None = None
    # Its job's deadline (epoch seconds): past it, nothing more is generated.
    deadline: float
    # What its request's admission charged (key, estimate, budget reservation, concurrency
    # lease): settled by whoever stores it when its relay handed it over (`take_over`).
    caller: Caller | None = None


class StoredResponse(BaseModel):
    """What `<ns>:response:<id>` holds."""

    tenant: str
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    # The chain's messages up to and with this response's output: the next one's history.
    context: list[Message]
    # Its job (whose chunk log replays its events); None for responses stored before logs.
    job_id: str | None = None
    # The seq of the last chunk of its answer, once finished (-1: none).
    last_seq: int | None = None
    # Set while it is unfinished.
    pending: Pending | None = None


class ResponseStore:
    """Stored responses: in Redis for `ttl_s`, written behind to PostgreSQL's `responses` through
    the outbox once finished, by tenant. A read that misses Redis (evicted, or Redis lost it)
    reads PostgreSQL. An unfinished one is leased (`response_runs.py`)."""

    def __init__(
        self, redis: Redis, db: asyncpg.Pool, outbox: Outbox, *, namespace: str, ttl_s: int, pipe: RedisPipe
    ) -> None:
        self._redis = redis
        # Each response's two writes (`open`, `finish`) go through the hot path's pipe.
        self._pipe = pipe
        self._db = db
        self._outbox = outbox
        self._names = Names(namespace)
        self._ttl_s = ttl_s
        self._running = self._names.responses_running
        self._owners = self._names.responses_owners
        self._cancel_channel = self._names.cancel_channel

    def key(self, response_id: str) -> str:
        return self._names.response(response_id)

    def _row(self, response_id: str, stored: StoredResponse) -> ResponseRow:
        created = dt.datetime.now(dt.UTC)
        return ResponseRow(
            id=response_id,
            tenant=stored.tenant,
            body=stored.model_dump(mode="json", exclude_none=True),
            created_at=created,
            expires_at=created + dt.timedelta(seconds=self._ttl_s),
        )

    async def open(self, response_id: str, stored: StoredResponse, *, owner: str, lease_expiry_ms: int) -> None:
        """Keep unfinished `stored` in Redis (not yet in PostgreSQL) and lease it to `owner`, in one
        script call."""
        await self._pipe.submit_script(
            _OPEN,
            [self.key(response_id), self._running, self._owners],
            [stored.model_dump_json(exclude_none=True), self._ttl_s, lease_expiry_ms, response_id, owner],
        )

    async def finish(self, response_id: str, stored: StoredResponse) -> bool:
        """Store finished `stored` and queue its row for PostgreSQL, if the response is still
        unfinished (running), in one script: False when another finisher was first."""
        _, outbox, _, *fields = self._outbox.append_command("response", self._row(response_id, stored))
        result = await self._pipe.submit_script(
            _FINISH,
            [self.key(response_id), self._running, self._owners, outbox],
            [response_id, stored.model_dump_json(exclude_none=True), self._ttl_s, *fields],
        )
        return bool(result)

    async def drop_lease(self, response_id: str) -> None:
        """The response is no longer running (its record is gone or finished)."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.zrem(self._running, response_id)
            pipe.hdel(self._owners, response_id)
            await pipe.execute()

    async def cancel_job(self, job_id: str) -> None:
        """Tell the workers to stop generating (or skip) `job_id`."""
        await self._redis.publish(self._cancel_channel, job_id)

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The tenant's stored response, None if there is none (unknown, expired, deleted, or
        another tenant's)."""
        stored = await self.get_any(response_id)
        return stored if stored is not None and stored.tenant == tenant else None

    async def get_any(self, response_id: str) -> StoredResponse | None:
        """A stored response, whoever's it is."""
        if not response_id.startswith(RESPONSE_PREFIX) or len(response_id) > 64:
            return None
        raw = await self._redis.get(self.key(response_id))
        if raw is None:
            raw = await self._db.fetchval(_READ_RESPONSE, response_id)
            if raw is None:
                return None
        return StoredResponse.model_validate_json(raw)

    async def delete(self, tenant: str, response_id: str) -> bool:
        """Delete the tenant's stored response: its row becomes a tombstone at once (so that its
        outbox entry, if not yet committed, cannot bring it back), then its Redis key goes. An
        unfinished one is no longer running and its job is cancelled."""
        stored = await self.get(tenant, response_id)
        if stored is None:
            return False
        expires = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=self._ttl_s)
        await self._db.execute(_TOMBSTONE, response_id, postgres_text(tenant), expires)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.key(response_id))
            pipe.zrem(self._running, response_id)
            pipe.hdel(self._owners, response_id)
            await pipe.execute()
        if stored.pending is not None and stored.job_id is not None:
            await self.cancel_job(stored.job_id)
        return True


_READ_RESPONSE = "SELECT body::text FROM responses WHERE id = $1 AND expires_at > now() AND body IS NOT NULL"
_TOMBSTONE = """
INSERT INTO responses (id, tenant, body, created_at, expires_at) VALUES ($1, $2, NULL, now(), $3)
ON CONFLICT (id) DO UPDATE SET body = NULL
"""
# KEYS: the response, running set, owners hash. ARGV: record, ttl (s), lease expiry (ms), id, owner.
# Stores an unfinished response and leases it to its relay.
_OPEN = PipeScript("""
redis.call('SET', KEYS[1], ARGV[1], 'EX', tonumber(ARGV[2]))
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[4])
redis.call('HSET', KEYS[3], ARGV[4], ARGV[5])
return 1
""")
# KEYS: the response, running set, owners hash, outbox. ARGV: id, record, ttl (s), outbox fields...
# The first finisher of a running response stores it; 0 for any later one.
_FINISH = PipeScript("""
if redis.call('ZREM', KEYS[2], ARGV[1]) == 0 then return 0 end
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('SET', KEYS[1], ARGV[2], 'EX', tonumber(ARGV[3]))
redis.call('XADD', KEYS[4], '*', unpack(ARGV, 4))
return 1
""")


@dataclass(frozen=True, slots=True)
class Target:
    """A response being answered, and where it goes once finished."""

    response_id: str
    tenant: str
    # The Response object as created (`queued` or `in_progress`, no output).
    initial: dict[str, Any]
    history: list[Message]
    new: list[Message]
    input_items: list[dict[str, Any]]
    session: SessionInfo | None
    stored: bool

    def record(self, *, job_id: str, deadline: float, caller: Caller) -> StoredResponse:
        """Its stored record while unfinished."""
        return StoredResponse(
            tenant=self.tenant,
            response=self.initial,
            input_items=self.input_items,
            context=[*self.history, *self.new],
            job_id=job_id,
            pending=Pending(
                history=len(self.history),
                session_id=self.session.id if self.session is not None else None,
                deadline=deadline,
                caller=caller,
            ),
        )


@dataclass(frozen=True, slots=True)
class Prepared:
    """A checked request, ready to run: its chat request and its target."""

    body: ResponseCreate
    chat: ChatCompletionRequest
    target: Target


class ResponseEvents:
    """OpenAI's Responses streaming events of one answer, numbered from 0 (`sequence_number`):
    `response.created` (`queued` for a background response) and `response.in_progress`; per
    output item, as the chunks bring it, `response.output_item.added` (then for a message
    `response.content_part.added` and `response.output_text.delta`s, for a call
    `response.function_call_arguments.delta`s); at the end, per item in order,
    `response.output_text.done` + `response.content_part.done` or
    `response.function_call_arguments.done`, then `response.output_item.done`; last
    `response.completed` or `response.incomplete`, or `response.failed` (a failed or cancelled
    response).

    The events are a function of the skeleton and the chunks (ids from the response id and the
    output index), so a replica that feeds it the same chunks from the job's log gets the same
    bytes. `quiet`: keep the answer's state without building the events' bytes (each is b"").
    """

    def __init__(self, skeleton: dict[str, Any], *, quiet: bool = False) -> None:
        self._skeleton = skeleton
        self._response_id: str = skeleton["id"]
        # Count events without building their bytes (each is b"").
        self.quiet = quiet
        # The number of events so far (the next one's sequence_number).
        self.seq = 0
        # The last chunk applied, its finish reason, usage and error message.
        self.last_seq = -1
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.error: str | None = None
        self._items: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None
        self._message_index = 0
        # The message's delta events' bytes between the sequence number and the delta's JSON.
        self._delta_fields = b""
        self._text: list[str] = []
        # Tool call index -> its function_call item (arguments accumulated in it).
        self._calls: dict[int, dict[str, Any]] = {}
        self._call_index: dict[int, int] = {}

    def _event(self, kind: str, **fields: Any) -> bytes:
        seq = self.seq
        self.seq += 1
        if self.quiet:
            return b""
        payload = orjson.dumps({"type": kind, "sequence_number": seq, **fields})
        return b"event: " + kind.encode() + b"\nid: " + str(seq).encode() + b"\ndata: " + payload + b"\n\n"

    def _text_delta(self, text: str) -> bytes:
        """`_event("response.output_text.delta", item_id=..., output_index=..., content_index=0,
        delta=text, logprobs=[])`, the same bytes, built from its fixed parts (the event of
        nearly every chunk)."""
        seq = self.seq
        self.seq += 1
        if self.quiet:
            return b""
        number = str(seq).encode()
        return b"".join((_DELTA_HEAD, number, _DELTA_DATA, number, self._delta_fields, orjson.dumps(text), _DELTA_TAIL))

    def opening(self) -> list[bytes]:
        created = {**self._skeleton, "status": "queued"} if self._skeleton.get("background") else self._skeleton
        return [
            self._event("response.created", response=created),
            self._event("response.in_progress", response=self._skeleton),
        ]

    def chunk(self, chunk: TokenChunk) -> list[bytes]:
        """The events of one chunk: its text's delta, its tool calls' pieces (none for a chunk
        already applied, or an error chunk)."""
        if chunk.seq <= self.last_seq:
            return []
        self.last_seq = chunk.seq
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            self.usage = chunk.usage
            if chunk.finish_reason == "error":
                self.error = chunk.error.message if chunk.error else "The worker failed to generate an answer."
                return []
        events: list[bytes] = []
        if chunk.text:
            if self._message is None:
                index = self._message_index = len(self._items)
                self._message = {
                    "id": output_id(self._response_id, "msg_", index),
                    "type": "message",
                    "role": "assistant",
                    "status": "in_progress",
                }
                self._items.append(self._message)
                self._delta_fields = (
                    b',"item_id":"'
                    + self._message["id"].encode()
                    + b'","output_index":'
                    + str(index).encode()
                    + b',"content_index":0,"delta":'
                )
                events.append(
                    self._event("response.output_item.added", output_index=index, item={**self._message, "content": []})
                )
                events.append(
                    self._event(
                        "response.content_part.added",
                        item_id=self._message["id"],
                        output_index=index,
                        content_index=0,
                        part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                    )
                )
            self._text.append(chunk.text)
            events.append(self._text_delta(chunk.text))
        for delta in chunk.tool_calls or ():
            call = self._calls.get(delta.index)
            if call is None:
                index = len(self._items)
                name = delta.function.name if delta.function is not None and delta.function.name else ""
                call = {
                    "id": output_id(self._response_id, "fc_", index),
                    "type": "function_call",
                    "call_id": delta.id or output_id(self._response_id, "call_", index),
                    "name": name,
                    "arguments": "",
                    "status": "in_progress",
                }
                self._calls[delta.index] = call
                self._call_index[delta.index] = index
                self._items.append(call)
                events.append(self._event("response.output_item.added", output_index=index, item=dict(call)))
            elif delta.function is not None and delta.function.name:
                call["name"] += delta.function.name
            if delta.function is not None and delta.function.arguments:
                call["arguments"] += delta.function.arguments
                events.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=call["id"],
                        output_index=self._call_index[delta.index],
                        delta=delta.function.arguments,
                    )
                )
        return events

    def output(self, status: str) -> list[dict[str, Any]]:
        """The output items so far, each with `status`."""
        items = []
        for item in self._items:
            if item is self._message:
                part = {"type": "output_text", "text": "".join(self._text), "annotations": [], "logprobs": []}
                items.append({**item, "status": status, "content": [part]})
            else:
                items.append({**item, "status": status})
        return items

    def reply(self) -> Message:
        """The answer so far as an assistant message (its text and tool calls)."""
        calls = [
            ToolCall(id=call["call_id"], function=FunctionCall(name=call["name"], arguments=call["arguments"]))
            for _, call in sorted(self._calls.items())
        ]
        return Message(role="assistant", content="".join(self._text), tool_calls=calls or None)

    def _items_done(self, output: list[dict[str, Any]]) -> list[bytes]:
        events: list[bytes] = []
        for index, item in enumerate(output):
            if item["type"] == "message":
                part = item["content"][0]
                events.append(
                    self._event(
                        "response.output_text.done",
                        item_id=item["id"],
                        output_index=index,
                        content_index=0,
                        text=part["text"],
                        logprobs=[],
                    )
                )
                events.append(
                    self._event(
                        "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part
                    )
                )
            else:
                events.append(
                    self._event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=index,
                        name=item["name"],
                        arguments=item["arguments"],
                    )
                )
            events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events

    def closing(self, response: dict[str, Any]) -> list[bytes]:
        """The end of finished `response`: for a completed or incomplete one, every item's end,
        then `response.completed` or `response.incomplete`; for a failed or cancelled one,
        `response.failed` (OpenAI's events have no `response.cancelled`)."""
        status = response["status"]
        if status in ("failed", "cancelled"):
            return [self._event("response.failed", response=response)]
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return [*self._items_done(response["output"]), self._event(kind, response=response)]


class ResponsesService:
    """Creates responses on `CompletionService`, keeps the stored ones, replays their events, and
    finishes those whose relay was lost (`take_over`)."""

    def __init__(
        self,
        *,
        settings: SessionsSettings,
        completions: CompletionService,
        catalog: ModelCatalog,
        sessions: SessionStore,
        store: ResponseStore,
        chunk_log: ChunkLog,
        leases: ResponseLeases,
    ) -> None:
        self._settings = settings
        self.completions = completions
        self._catalog = catalog
        self._sessions = sessions
        self.store = store
        self._log = chunk_log
        self.leases = leases
        # A followed response's stream sends a keep-alive comment when nothing came for this long
        # (a queued job, a worker starting): the gateway's and a load balancer's idle timeouts.
        self.keepalive_s = KEEPALIVE_INTERVAL_S

    async def prepare(self, body: ResponseCreate, *, caller: Caller) -> Prepared:
        """Check `body` and build the chat request it runs as, on its history.

        Raises:
            InvalidRequest: a bad parameter or input item.
            NotFound: an unknown previous_response_id or conversation (or another tenant's).
            ModelNotFound, Unavailable: as a chat completion.
        """
        body.check()
        new = input_messages(body)
        head = [Message(role="system", content=body.instructions)] if body.instructions else []
        history: list[Message] = []
        session = None
        if body.previous_response_id is not None:
            previous = await self.store.get(caller.tenant, body.previous_response_id)
            if previous is None:
                raise previous_not_found()
            if previous.pending is not None:
                raise InvalidRequest(
                    "previous_response_id names a response that is not finished yet.",
                    param="previous_response_id",
                    code="invalid_value",
                )
            history = fit_history(previous.context, fixed=head + new, budget_tokens=await self._budget(body))
        conversation = body.conversation_id
        if conversation is not None:
            try:
                session = await self._sessions.get(caller.tenant, session_id_of(conversation))
            except NotFound:
                raise conversation_not_found() from None
            prompt, _ = build_prompt(
                system_prompt=session.system_prompt,
                history=await self._sessions.history(session),
                new_messages=new,
                budget_tokens=await self._budget(body),
            )
            history, new = prompt[: len(prompt) - len(new)], prompt[len(prompt) - len(new) :]
        response_id = _id(RESPONSE_PREFIX)
        initial = response_object(
            body,
            response_id=response_id,
            created_at=time.time(),
            status="queued" if body.background else "in_progress",
            output=[],
            usage=None,
            conversation=conversation_id(session.id) if session is not None else None,
        )
        target = Target(
            response_id=response_id,
            tenant=caller.tenant,
            initial=initial,
            history=history,
            new=new,
            input_items=message_items(new) if body.stored else [],
            session=session,
            stored=body.stored,
        )
        return Prepared(
            body=body, chat=body.chat_request(head + history + new, self._settings.request_limits), target=target
        )

    async def _budget(self, body: ResponseCreate) -> int:
        """The prompt tokens the model's context leaves beside the answer (with no live worker, its
        last-seen context: whether the request may wait for one is `start`'s to say)."""
        _, live, _ = await self._catalog.require_or_wait(body.model, wait_s=math.inf)
        return live.context_tokens - (body.max_output_tokens or self._settings.default_max_tokens)

    async def start(self, prepared: Prepared, *, caller: Caller, request_id: str) -> ActiveRequest:
        """Publish the response's job (`CompletionService.start`; a stored response's keeps its
        chunk log, a background one has `AXON_BACKGROUND_TIMEOUT_S`), then store a stored one as
        unfinished, leased to this process. A 400 names the Responses param.

        Raises:
            ModelNotFound, Unavailable, InvalidRequest, NotFound, Conflict: as a chat completion.
            Unavailable: the response could not be stored (its job is called off).
        """
        target = prepared.target
        timeout_s = self._settings.background_timeout_s if prepared.body.background else None
        try:
            active = await self.completions.start(
                prepared.chat,
                kind="chat",
                caller=caller,
                request_id=request_id,
                resumable=target.stored,
                timeout_s=timeout_s,
                # A background response waits for a worker of a model with none (scale to zero)
                # until its deadline; any other waits its model's cold-start wait.
                cold_start_wait_s=math.inf if prepared.body.background else None,
            )
        except InvalidRequest as exc:
            raise as_response_error(exc) from None
        if target.stored:
            record = target.record(job_id=active.job.job_id, deadline=active.job.deadline, caller=caller)
            try:
                await self.store.open(
                    target.response_id, record, owner=self.leases.owner, lease_expiry_ms=self.leases.expiry_ms()
                )
            except _STORAGE_ERRORS as exc:
                await self.completions.finish(active, outcome="error")
                raise _not_stored(exc) from exc
        return active

    async def create(self, body: ResponseCreate, *, caller: Caller, request_id: str) -> dict[str, Any]:
        """Answer `body` (not streamed): run it, store it, append it to its conversation. A stored
        one is relayed by a task of its own, so it is finished and stored even if its client
        leaves; a background one is answered at once (`queued`).

        Raises:
            InvalidRequest, NotFound: see `prepare`.
            ModelNotFound, Unavailable, UpstreamError, DeadlineExceeded: as a chat completion.
        """
        prepared = await self.prepare(body, caller=caller)
        active = await self.start(prepared, caller=caller, request_id=request_id)
        target = prepared.target
        events = ResponseEvents(skeleton_of(target.initial), quiet=True)
        if not target.stored:
            return await self._relay(target, active, events)
        task = self.leases.hold(target.response_id, self._relay(target, active, events))
        if body.background:
            return target.initial
        return await asyncio.shield(task)

    async def _relay(
        self,
        target: Target,
        active: ActiveRequest,
        events: ResponseEvents,
        *,
        first: tuple[Choice, TokenChunk] | None = None,
    ) -> dict[str, Any]:
        """Feed the job's chunks (after `first`, if given) into `events` until the final one,
        finish the request (usage) and keep the response; returns it.

        Cancelled: an unstored response's client left (its job is cancelled); a stored one's
        relay was stopped (shutdown, or its lease was lost: another process finishes it) or its
        response was finished elsewhere (cancelled, deleted: its job is cancelled).

        Raises:
            AxonError: the answer failed (a stored response is kept as `failed`).
        """
        chunks = active.chunks()
        try:
            choice, chunk = first if first is not None else await self.completions.first_of(active, chunks)
            while True:
                if chunk.finish_reason == "error":
                    raise chunk_error(chunk)
                events.chunk(chunk)
                if not active.unfinished:
                    break
                choice, chunk = await anext(chunks)
        except asyncio.CancelledError:
            if not target.stored:
                await asyncio.shield(self.completions.finish(active, outcome="disconnected"))
            elif self.leases.abandoned(target.response_id):  # cancelled or deleted: its job stops
                await asyncio.shield(self.completions.finish(active, outcome="cancelled"))
            else:  # the job runs on, for whoever takes the response over (and settles it)
                await asyncio.shield(self.completions.hand_over(active))
            raise
        except AxonError as exc:
            if active.lost and target.stored:
                final = await self._relay_lost(target, active)
                if final is not None:
                    return final
                raise
            await self.completions.finish(active, outcome="error")
            await self._keep_failed(target, active, events, exc)
            raise
        reason = chunk.finish_reason or "stop"
        await self.completions.finish(active, outcome=reason)
        status = status_of(reason)
        response = finished_response(target.initial, status=status, output=events.output(status), usage=active.usage)
        return await self.keep(
            target, answer_message(choice.answer), response, job_id=active.job.job_id, last_seq=events.last_seq
        )

    async def first_chunk(
        self, prepared: Prepared, active: ActiveRequest, *, on_wait: Callable[[], Awaitable[None]] | None = None
    ) -> tuple[tuple[Choice, TokenChunk], AsyncIterator[tuple[Choice, TokenChunk]]]:
        """Wait for the answer's first chunk (`CompletionService.first_chunk`, `on_wait` its
        keep-alive: a failure before any token is still an HTTP status). A stored response's
        lease is renewed meanwhile, and if its client leaves, a task waits on and relays it to its
        end; one that fails is kept failed.

        Raises:
            AxonError: the answer failed before its first chunk.
        """
        target = prepared.target
        if not target.stored:
            return await self.completions.first_chunk(active, on_wait=on_wait)
        waiting = asyncio.ensure_future(self.completions.first_chunk(active, on_wait=on_wait))
        with self.leases.attached(target.response_id):
            try:
                return await asyncio.shield(waiting)
            except asyncio.CancelledError:
                self.leases.hold(target.response_id, self._relay_after(target, active, waiting))
                raise
            except AxonError as exc:
                await self._keep_failed(target, active, ResponseEvents(skeleton_of(target.initial), quiet=True), exc)
                raise

    async def _relay_after(
        self,
        target: Target,
        active: ActiveRequest,
        waiting: "asyncio.Future[tuple[tuple[Choice, TokenChunk], AsyncIterator[tuple[Choice, TokenChunk]]]]",
    ) -> dict[str, Any]:
        """Relay a stored response whose client left before its first chunk, once it comes."""
        events = ResponseEvents(skeleton_of(target.initial), quiet=True)
        try:
            first, _ = await waiting
        except AxonError as exc:
            return await self._keep_failed(target, active, events, exc)
        return await self._relay(target, active, events, first=first)

    async def _relay_lost(self, target: Target, active: ActiveRequest) -> dict[str, Any] | None:
        """A stored response whose chunks stopped arriving (the relay's Redis connection dropped,
        a slow reader's buffer overflowed, or the stop's deadline passed): its job runs on (its
        worker records its usage, as nobody receives its final chunk), and it is followed to its
        end in its chunk log, as a takeover does."""
        log.warning("response_relay_lost", response_id=target.response_id)
        if self.leases.taken_over is not None:
            self.leases.taken_over.labels("stream_lost").inc()
        await self.completions.hand_over(active)
        return await self.take_over(target.response_id)

    async def _keep_failed(
        self, target: Target, active: ActiveRequest, events: ResponseEvents, exc: AxonError
    ) -> dict[str, Any]:
        """Keep the response as `failed` with `exc`'s message, or, for a deadline that passed
        before any chunk, one that says its job never started (a storage failure is only logged:
        the failure itself is what its client gets)."""
        log.warning("response_failed", response_id=target.response_id, error=exc.message)
        never_started = isinstance(exc, DeadlineExceeded) and events.last_seq < 0
        failed = finished_response(
            target.initial,
            status="failed",
            output=events.output("incomplete"),
            usage=active.usage,
            error={"code": "server_error", "message": _NEVER_STARTED if never_started else exc.message},
        )
        with contextlib.suppress(Unavailable):
            failed = await self.keep(target, None, failed, job_id=active.job.job_id, last_seq=events.last_seq)
        return failed

    async def keep(
        self,
        target: Target,
        reply: Message | None,
        response: dict[str, Any],
        *,
        job_id: str | None,
        last_seq: int,
        settle: tuple[Caller, Usage | None] | None = None,
    ) -> dict[str, Any]:
        """Store the finished response (if stored and no other finisher was first: then that one's
        is returned), then append its input and `reply` to its conversation if it was answered;
        returns the response kept. `settle`: the request's admission and its usage, settled by
        the finisher that stores it (`CompletionService.settle`), so once.

        Raises:
            Unavailable: Redis could not be written: the client must not take the response for kept.
        """
        try:
            if target.stored:
                stored = StoredResponse(
                    tenant=target.tenant,
                    response=response,
                    input_items=target.input_items,
                    context=[*target.history, *target.new, *([reply] if reply is not None else [])],
                    job_id=job_id,
                    last_seq=last_seq,
                )
                if not await self.store.finish(target.response_id, stored):
                    again = await self.store.get_any(target.response_id)
                    return again.response if again is not None else response
                if settle is not None:
                    await self.completions.settle(*settle)
            if target.session is not None and reply is not None and response["status"] in ("completed", "incomplete"):
                for message in [*target.new, reply]:
                    await self._sessions.append(target.session, message, status="complete", job_id=None)
        except _STORAGE_ERRORS as exc:
            raise _not_stored(exc) from exc
        return response

    def failure(self, prepared: Prepared, exc: AxonError) -> bytes:
        """The whole event stream of a response that failed before its first chunk once its head had
        gone out (it waited for a worker of its model to start): `response.created`,
        `response.in_progress`, `response.failed` with `exc`'s message."""
        target = prepared.target
        events = ResponseEvents(skeleton_of(target.initial))
        error = {"code": "server_error", "message": exc.message}
        failed = finished_response(target.initial, status="failed", output=[], usage=None, error=error)
        return b"".join([*events.opening(), *events.closing(failed)])

    async def stream(
        self, prepared: Prepared, active: ActiveRequest, first: tuple[Choice, TokenChunk], rest: AsyncIterator[Any]
    ) -> AsyncGenerator[bytes]:
        """Relay the answer as OpenAI's Responses events (`ResponseEvents`), each its own SSE
        event with `id:` = its `sequence_number`; the response is stored before its last event.
        A client that leaves stops an unstored response's job; a stored one is relayed on to its
        end by a task of its own (and stored, and resumable)."""
        target = prepared.target
        events = ResponseEvents(skeleton_of(target.initial))
        pieces = events.opening()
        outcome = "disconnected"
        with self.leases.attached(target.response_id) if target.stored else contextlib.nullcontext():
            try:
                choice, chunk = first
                while True:
                    if chunk.finish_reason == "error":
                        raise chunk_error(chunk)
                    pieces += events.chunk(chunk)
                    if not active.unfinished:
                        break
                    if not active.stream.ready:
                        yield b"".join(pieces)
                        pieces = []
                    choice, chunk = await anext(rest)
                outcome = chunk.finish_reason or "stop"
                await self.completions.finish(active, outcome=outcome)
                status = status_of(outcome)
                response = finished_response(
                    target.initial, status=status, output=events.output(status), usage=active.usage
                )
                response = await self.keep(
                    target, answer_message(choice.answer), response, job_id=active.job.job_id, last_seq=events.last_seq
                )
                yield b"".join([*pieces, *events.closing(response)])
            except AxonError as exc:
                if active.lost and target.stored:  # its end is followed in its log; the client may resume
                    outcome = "lost"
                    self.leases.hold(target.response_id, self._relay_lost(target, active))
                    yield b"".join(pieces)
                    return
                outcome = "error"
                log.warning("stream_failed", error=exc.message)
                await self.completions.finish(active, outcome=outcome)
                failed = await self._keep_failed(target, active, events, exc)
                yield b"".join([*pieces, *events.closing(failed)])
            finally:
                if outcome == "disconnected":
                    if target.stored:
                        self.leases.hold(target.response_id, self._relay(target, active, events))
                    else:
                        await asyncio.shield(self.completions.finish(active, outcome=outcome))

    async def _logged(self, job_id: str) -> list[TokenChunk]:
        """Every chunk of `job_id`'s log so far, in order."""
        chunks: list[TokenChunk] = []
        after = -1
        while True:
            page = await self._log.read(job_id, after, PAGE)
            chunks += page
            if len(page) < PAGE:
                return chunks
            after = page[-1].seq

    async def _stored(self, tenant: str, response_id: str) -> StoredResponse:
        stored = await self.store.get(tenant, response_id)
        if stored is None:
            raise response_not_found()
        return stored

    async def current(self, tenant: str, response_id: str) -> dict[str, Any]:
        """The tenant's stored response as it is now: an unfinished one with its output so far
        (from its job's chunk log), `in_progress` once a chunk came.

        Raises:
            NotFound: unknown, expired, deleted or another tenant's.
        """
        stored = await self._stored(tenant, response_id)
        if stored.pending is None or stored.job_id is None:
            return stored.response
        events = ResponseEvents(skeleton_of(stored.response), quiet=True)
        for chunk in await self._logged(stored.job_id):
            events.chunk(chunk)
        if events.last_seq < 0:
            return stored.response
        return {**skeleton_of(stored.response), "output": events.output("in_progress")}

    async def cancel(self, tenant: str, response_id: str) -> dict[str, Any]:
        """Cancel the tenant's unfinished stored response, background or not (OpenAI cancels only
        background ones): it is stored `cancelled` with its output so far, its job is cancelled,
        and nothing of it is appended to its conversation.

        Raises:
            NotFound: unknown, expired, deleted or another tenant's.
            InvalidRequest: finished.
        """
        stored = await self._stored(tenant, response_id)
        if stored.pending is None or stored.job_id is None:
            raise InvalidRequest(
                f"This response is {stored.response['status']} already: only an unfinished one can be cancelled.",
                param="response_id",
                code="invalid_value",
            )
        events = ResponseEvents(skeleton_of(stored.response), quiet=True)
        for chunk in await self._logged(stored.job_id):
            events.chunk(chunk)
        response = finished_response(
            stored.response, status="cancelled", output=events.output("incomplete"), usage=events.usage
        )
        done = stored.model_copy(update={"response": response, "pending": None, "last_seq": events.last_seq})
        if await self.store.finish(response_id, done):
            await self.store.cancel_job(stored.job_id)
            return response
        return (await self._stored(tenant, response_id)).response  # it finished meanwhile

    async def replay(self, tenant: str, response_id: str, *, starting_after: int | None) -> AsyncGenerator[bytes]:
        """The stored response's events with a sequence_number past `starting_after` (all without
        it), rebuilt from its job's chunk log, then, while it is unfinished, followed live to its
        end. The checks are done before the first piece is asked for.

        Raises:
            NotFound: unknown, expired, deleted or another tenant's.
            InvalidRequest: its events are not kept (expired log, or stored before logs), or
                `starting_after` is at or past the end of one whose end is known: a finished
                one, or one whose log holds its final chunk (its finisher is storing it). Past
                the end of one that ends only later, the stream is an `error` event alone.
        """
        stored = await self._stored(tenant, response_id)
        if stored.job_id is None:
            raise InvalidRequest(
                "This response's events were not kept, so it cannot be streamed; retrieve it without stream.",
                param="stream",
                code="stream_unavailable",
            )
        chunks = await self._logged(stored.job_id)
        after = -1 if starting_after is None else starting_after
        if stored.pending is not None:
            if after >= 0 and (chunks and chunks[-1].finish_reason is not None):  # its end is known
                counted = _counted(stored.response, chunks)
                status = status_of(counted.finish_reason)
                output = counted.output(status)
                counted.closing(finished_response(stored.response, status=status, output=output, usage=None))
                _check_after(after, counted.seq)
            return self._events(response_id, stored, chunks, after)
        last_seq = stored.last_seq if stored.last_seq is not None else -1
        chunks = [chunk for chunk in chunks if chunk.seq <= last_seq]
        counted = _counted(stored.response, chunks)
        if counted.last_seq < last_seq:
            raise InvalidRequest(
                f"This response's events are kept for {self._settings.stream_log_ttl_s} s after its last "
                "one, and they are gone; retrieve it without stream.",
                param="stream",
                code="stream_expired",
            )
        counted.closing(stored.response)
        _check_after(after, counted.seq)
        return self._events(response_id, stored, chunks, after)

    async def _events(
        self, response_id: str, stored: StoredResponse, chunks: list[TokenChunk], after: int
    ) -> AsyncGenerator[bytes]:
        """The events past `after` of the response whose logged chunks are `chunks`, a piece per
        `_REPLAY_PAGE` events (the events up to `after` are counted, not built); then, for an
        unfinished one, its chunks as they are logged, and its end once it is stored finished."""
        events = ResponseEvents(skeleton_of(stored.response))
        out = _past(events, events.opening(), after)
        for chunk in chunks:
            events.quiet = events.seq + _most_events(chunk) <= after
            out += _past(events, events.chunk(chunk), after)
            if len(out) >= _REPLAY_PAGE:
                yield b"".join(out)
                out = []
        events.quiet = False
        if stored.pending is None:
            yield b"".join([*out, *_past(events, events.closing(stored.response), after)])
            return
        assert stored.job_id is not None
        if out:
            yield b"".join(out)
        idle_s = max(0.0, stored.pending.deadline - time.time()) + _DEADLINE_GRACE_S
        with contextlib.suppress(TimeoutError):
            if events.finish_reason is None:  # the log may hold the final chunk already
                pages = self._log.pages(stored.job_id, events.last_seq, idle_timeout_s=idle_s)
                async for page in _beating(pages, self.keepalive_s):
                    if page is None:
                        yield SSE_KEEPALIVE
                        continue
                    new = []
                    for chunk in page:
                        new += _past(events, events.chunk(chunk), after)
                    if new:
                        yield b"".join(new)
        final = await self._finished(response_id)
        if final is None:
            return
        if end := _past(events, events.closing(final), after):
            yield b"".join(end)
        else:  # nothing was past `after`: the 400 of a finished one, as an event (the head went out)
            yield _error_event(_past_the_end(after, events.seq), events.seq)

    async def _finished(self, response_id: str) -> dict[str, Any] | None:
        """The response once its finisher stored it (whoever relays it, or takes it over once its
        lease expires), or None if that does not happen within three leases."""
        until = time.monotonic() + 3 * self.leases.lease_s + _DEADLINE_GRACE_S
        while time.monotonic() < until:
            stored = await self.store.get_any(response_id)
            if stored is None:
                return None
            if stored.pending is None:
                return stored.response
            await asyncio.sleep(0.05)
        return None

    async def take_over(self, response_id: str) -> dict[str, Any] | None:
        """Finish a stored response whose relay was lost (its session manager died): rebuild it
        from its job's chunk log, follow the log to the final chunk (the job runs on, or is taken
        over by another worker) and keep it, failed if its job never ended before its deadline;
        returns it (None: deleted or finished meanwhile). Storing it, it settles its request's
        admission from the record (`CompletionService.settle`: the relay that handed it over did
        not); its usage row was recorded by its worker (nobody received the final chunk)."""
        stored = await self.store.get_any(response_id)
        if stored is None or stored.pending is None or stored.job_id is None:
            await self.store.drop_lease(response_id)  # deleted, or finished meanwhile
            return None
        target = await self._target_of(stored)
        events = ResponseEvents(skeleton_of(stored.response), quiet=True)
        idle_s = max(0.0, stored.pending.deadline - time.time()) + _DEADLINE_GRACE_S
        try:
            async for chunk in self._log.follow(stored.job_id, -1, idle_timeout_s=idle_s):
                events.chunk(chunk)
        except TimeoutError:
            events.error = (
                _NEVER_STARTED if events.last_seq < 0 else "The response's job did not finish before its deadline."
            )
        if events.error is not None:
            response = finished_response(
                stored.response,
                status="failed",
                output=events.output("incomplete"),
                usage=events.usage,
                error={"code": "server_error", "message": events.error},
            )
            reply = None
        else:
            status = status_of(events.finish_reason)
            response = finished_response(
                stored.response, status=status, output=events.output(status), usage=events.usage
            )
            reply = events.reply()
        caller = stored.pending.caller
        settled = (caller, events.usage) if caller is not None else None
        return await self.keep(target, reply, response, job_id=stored.job_id, last_seq=events.last_seq, settle=settled)

    async def _target_of(self, stored: StoredResponse) -> Target:
        """The target of an unfinished stored response, as its record keeps it."""
        assert stored.pending is not None
        session = None
        if stored.pending.session_id is not None:
            with contextlib.suppress(NotFound):  # deleted meanwhile: nothing to append to
                session = await self._sessions.get(stored.tenant, stored.pending.session_id)
        split = stored.pending.history
        return Target(
            response_id=stored.response["id"],
            tenant=stored.tenant,
            initial=stored.response,
            history=stored.context[:split],
            new=stored.context[split:],
            input_items=stored.input_items,
            session=session,
            stored=True,
        )


def _past(events: ResponseEvents, pieces: list[bytes], after: int) -> list[bytes]:
    """Those of `pieces`, the events `events` just made (numbered up to its `seq`), numbered past
    `after`."""
    first = events.seq - len(pieces)
    return pieces[max(0, after + 1 - first) :]


async def _beating(pages: AsyncIterator[list[TokenChunk]], interval_s: float) -> AsyncIterator[list[TokenChunk] | None]:
    """`pages`, with None each time `interval_s` passes without one (the next page is awaited in
    a task, which a wait that ends does not cancel)."""
    next_page = asyncio.ensure_future(anext(pages))
    try:
        while True:
            done, _ = await asyncio.wait({next_page}, timeout=interval_s)
            if not done:
                yield None
                continue
            try:
                page = next_page.result()
            except StopAsyncIteration:
                return
            yield page
            next_page = asyncio.ensure_future(anext(pages))
    finally:
        next_page.cancel()


def _counted(response: dict[str, Any], chunks: list[TokenChunk]) -> ResponseEvents:
    """`response`'s events up to its closing ones, of logged `chunks`, counted (quiet)."""
    counted = ResponseEvents(skeleton_of(response), quiet=True)
    counted.opening()
    for chunk in chunks:
        counted.chunk(chunk)
    return counted


def _past_the_end(after: int, count: int) -> InvalidRequest:
    return InvalidRequest(
        f"starting_after is {after}, past the end of this response (its last event is {count - 1}).",
        param="starting_after",
        code="invalid_value",
    )


def _check_after(after: int, count: int) -> None:
    """Raise `_past_the_end` if `after` is at or past the last of a response's `count` events."""
    if after >= count - 1:
        raise _past_the_end(after, count)


def _error_event(exc: AxonError, seq: int) -> bytes:
    """OpenAI's `error` streaming event of `exc` (no SSE id: a client resumes after the event it
    got before)."""
    payload = {"type": "error", "code": exc.code, "message": exc.message, "param": exc.param, "sequence_number": seq}
    return b"event: error\ndata: " + orjson.dumps(payload) + b"\n\n"


def _most_events(chunk: TokenChunk) -> int:
    """The most events one chunk can make: a message's first text makes three, each tool call
    delta two."""
    return (3 if chunk.text else 0) + 2 * len(chunk.tool_calls or ())


def _not_stored(exc: BaseException) -> Unavailable:
    log.error("response_not_stored", error=repr(exc))
    return Unavailable(
        "The response could not be saved, so it was not kept; try again shortly.",
        retry_after_s=2,
        code="response_not_stored",
    )
