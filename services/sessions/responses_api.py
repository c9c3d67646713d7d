"""OpenAI's Responses API (`/v1/responses`) on the Chat Completions machinery.

A response runs as one chat completion (`CompletionService`, the same admission, job, relay and
usage accounting): its prompt is `instructions` (a system message for this response only), then
the history, then `input` as session messages (`conversations.items_to_messages`). The history is
the chain of `previous_response_id` (each stored response keeps its `context`: its history, input
and output as messages) or the items of `conversation` (a session, to which the response's input
and output items are appended once it is answered).

A stored response (`store`, the default) is one Redis key, `<ns>:response:<id>`, holding its
tenant, its Response object, its input items and its context, expiring `AXON_RESPONSE_TTL_S` after
it was created, and a row of `responses` written behind through the outbox (read when Redis
misses). Another tenant's response, or one not stored, is 404.
"""

import asyncio
import datetime as dt
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import orjson
from pydantic import BaseModel
from redis.asyncio import Redis
from redis.exceptions import RedisError

from services.sessions.catalog import ModelCatalog
from services.sessions.conversations import (
    conversation_id,
    conversation_not_found,
    items_to_messages,
    session_id_of,
)
from services.sessions.history import SessionInfo, SessionStore
from services.sessions.outbox import Outbox, ResponseRow, postgres_text
from services.sessions.responses import Answer
from services.sessions.service import ActiveRequest, Caller, Choice, CompletionService, chunk_error
from services.sessions.settings import SessionsSettings
from services.sessions.turns import build_prompt, fit_history
from shared.errors import AxonError, InvalidRequest, NotFound, Unavailable
from shared.logging import get_logger
from shared.openai_requests import ChatCompletionRequest
from shared.responses_requests import ResponseCreate, as_response_error
from shared.schemas import Message, TokenChunk, Usage

log = get_logger(__name__)

RESPONSE_PREFIX = "resp_"


def response_not_found() -> NotFound:
    return NotFound("No such response.", param="response_id", code="response_not_found")


def previous_not_found() -> NotFound:
    return NotFound("No such response.", param="previous_response_id", code="previous_response_not_found")


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


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
        "usage": usage_object(usage) if usage is not None or status != "in_progress" else None,
        "conversation": {"id": conversation} if conversation is not None else None,
        **body.echo(),
    }


class StoredResponse(BaseModel):
    """What `<ns>:response:<id>` holds."""

    tenant: str
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    # The chain's messages up to and with this response's output: the next one's history.
    context: list[Message]


class ResponseStore:
    """Stored responses: in Redis for `ttl_s`, written behind to PostgreSQL's `responses` through
    the outbox, by tenant. A read that misses Redis (evicted, or Redis lost it) reads PostgreSQL."""

    def __init__(self, redis: Redis, db: asyncpg.Pool, outbox: Outbox, *, namespace: str, ttl_s: int) -> None:
        self._redis = redis
        self._db = db
        self._outbox = outbox
        self._namespace = namespace
        self._ttl_s = ttl_s

    def key(self, response_id: str) -> str:
        return f"{self._namespace}:response:{response_id}"

    async def save(self, response_id: str, stored: StoredResponse) -> None:
        """Keep `stored` in Redis and queue its row for PostgreSQL, both in one transaction."""
        created = dt.datetime.now(dt.UTC)
        row = ResponseRow(
            id=response_id,
            tenant=stored.tenant,
            body=stored.model_dump(mode="json", exclude_none=True),
            created_at=created,
            expires_at=created + dt.timedelta(seconds=self._ttl_s),
        )
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(self.key(response_id), stored.model_dump_json(exclude_none=True), ex=self._ttl_s)
            await self._outbox.append("response", row, pipe=pipe)
            await pipe.execute()

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The tenant's stored response, None if there is none (unknown, expired, deleted, or
        another tenant's)."""
        if not response_id.startswith(RESPONSE_PREFIX) or len(response_id) > 64:
            return None
        raw = await self._redis.get(self.key(response_id))
        if raw is None:
            raw = await self._db.fetchval(_READ_RESPONSE, response_id)
            if raw is None:
                return None
        stored = StoredResponse.model_validate_json(raw)
        return stored if stored.tenant == tenant else None

    async def delete(self, tenant: str, response_id: str) -> bool:
        """Delete the tenant's stored response: its row becomes a tombstone at once (so that its
        outbox entry, if not yet committed, cannot bring it back), then its Redis key goes."""
        stored = await self.get(tenant, response_id)
        if stored is None:
            return False
        expires = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=self._ttl_s)
        await self._db.execute(_TOMBSTONE, response_id, postgres_text(tenant), expires)
        await self._redis.delete(self.key(response_id))
        return True


_READ_RESPONSE = "SELECT body::text FROM responses WHERE id = $1 AND expires_at > now() AND body IS NOT NULL"
_TOMBSTONE = """
INSERT INTO responses (id, tenant, body, created_at, expires_at) VALUES ($1, $2, NULL, now(), $3)
ON CONFLICT (id) DO UPDATE SET body = NULL
"""


@dataclass(frozen=True, slots=True)
class Prepared:
    """A checked request, ready to run: its chat request, history, input and ids."""

    body: ResponseCreate
    tenant: str
    chat: ChatCompletionRequest
    history: list[Message]
    new: list[Message]
    session: SessionInfo | None
    response_id: str
    created_at: float

    def response(self, *, status: str, output: list[dict[str, Any]], usage: Usage | None) -> dict[str, Any]:
        return response_object(
            self.body,
            response_id=self.response_id,
            created_at=self.created_at,
            status=status,
            output=output,
            usage=usage,
            conversation=conversation_id(self.session.id) if self.session is not None else None,
        )


def _status(answer: Answer) -> str:
    return "incomplete" if answer.finish_reason == "length" else "completed"


class ResponseEvents:
    """OpenAI's Responses streaming events of one answer, numbered from 0 (`sequence_number`):
    `response.created` and `response.in_progress`; per output item, as the chunks bring it,
    `response.output_item.added` (then for a message `response.content_part.added` and
    `response.output_text.delta`s, for a call `response.function_call_arguments.delta`s); at the
    end, per item in order, `response.output_text.done` + `response.content_part.done` or
    `response.function_call_arguments.done`, then `response.output_item.done`; last
    `response.completed`, `response.incomplete` or `response.failed`."""

    def __init__(self, skeleton: dict[str, Any]) -> None:
        self._skeleton = skeleton
        self._seq = 0
        self._items: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None
        self._message_index = 0
        self._text: list[str] = []
        # Tool call index -> its function_call item (arguments accumulated in it).
        self._calls: dict[int, dict[str, Any]] = {}
        self._call_index: dict[int, int] = {}

    def _event(self, kind: str, **fields: Any) -> bytes:
        seq = self._seq
        self._seq += 1
        payload = orjson.dumps({"type": kind, "sequence_number": seq, **fields})
        return b"event: " + kind.encode() + b"\nid: " + str(seq).encode() + b"\ndata: " + payload + b"\n\n"

    def opening(self) -> list[bytes]:
        return [
            self._event("response.created", response=self._skeleton),
            self._event("response.in_progress", response=self._skeleton),
        ]

    def chunk(self, chunk: TokenChunk) -> list[bytes]:
        """The events of one chunk: its text's delta, its tool calls' pieces."""
        events: list[bytes] = []
        if chunk.text:
            if self._message is None:
                self._message = {"id": _id("msg_"), "type": "message", "role": "assistant", "status": "in_progress"}
                self._items.append(self._message)
                index = self._message_index = len(self._items) - 1
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
            events.append(
                self._event(
                    "response.output_text.delta",
                    item_id=self._message["id"],
                    output_index=self._message_index,
                    content_index=0,
                    delta=chunk.text,
                    logprobs=[],
                )
            )
        for delta in chunk.tool_calls or ():
            call = self._calls.get(delta.index)
            if call is None:
                name = delta.function.name if delta.function is not None and delta.function.name else ""
                call = {
                    "id": _id("fc_"),
                    "type": "function_call",
                    "call_id": delta.id or _id("call_"),
                    "name": name,
                    "arguments": "",
                    "status": "in_progress",
                }
                self._calls[delta.index] = call
                self._call_index[delta.index] = len(self._items)
                self._items.append(call)
                events.append(
                    self._event(
                        "response.output_item.added", output_index=self._call_index[delta.index], item=dict(call)
                    )
                )
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
        """Every open item's end, then `response.completed` (or `response.incomplete`) with `response`."""
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return [*self._items_done(response["output"]), self._event(kind, response=response)]

    def failed(self, response: dict[str, Any]) -> list[bytes]:
        """`response.failed` with `response` (its `error` set)."""
        return [self._event("response.failed", response=response)]


class ResponsesService:
    """Creates responses on `CompletionService` and keeps the stored ones."""

    def __init__(
        self,
        *,
        settings: SessionsSettings,
        completions: CompletionService,
        catalog: ModelCatalog,
        sessions: SessionStore,
        store: ResponseStore,
    ) -> None:
        self._settings = settings
        self.completions = completions
        self._catalog = catalog
        self._sessions = sessions
        self.store = store

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
        return Prepared(
            body=body,
            tenant=caller.tenant,
            chat=body.chat_request(head + history + new, self._settings.request_limits),
            history=history,
            new=new,
            session=session,
            response_id=_id(RESPONSE_PREFIX),
            created_at=time.time(),
        )

    async def _budget(self, body: ResponseCreate) -> int:
        """The prompt tokens the model's context leaves beside the answer."""
        _, live = await self._catalog.require(body.model)
        return live.context_tokens - (body.max_output_tokens or self._settings.default_max_tokens)

    async def start(self, prepared: Prepared, *, caller: Caller, request_id: str) -> ActiveRequest:
        """Publish the response's job (`CompletionService.start`); a 400 names the Responses param.

        Raises:
            ModelNotFound, Unavailable, InvalidRequest, NotFound, Conflict: as a chat completion.
        """
        try:
            return await self.completions.start(prepared.chat, kind="chat", caller=caller, request_id=request_id)
        except InvalidRequest as exc:
            raise as_response_error(exc) from None

    def skeleton(self, prepared: Prepared) -> dict[str, Any]:
        """The Response object while it is generated (`in_progress`, no output yet)."""
        return prepared.response(status="in_progress", output=[], usage=None)

    async def create(self, body: ResponseCreate, *, caller: Caller, request_id: str) -> dict[str, Any]:
        """Answer `body` (not streamed): run it, store it, append it to its conversation.

        Raises:
            InvalidRequest, NotFound: see `prepare`.
            ModelNotFound, Unavailable, UpstreamError, DeadlineExceeded: as a chat completion.
        """
        prepared = await self.prepare(body, caller=caller)
        active = await self.start(prepared, caller=caller, request_id=request_id)
        first, rest = await self.completions.first_chunk(active)
        await self.completions.collect(active, first, rest)
        answer = active.choices[0].answer
        status = _status(answer)
        output = message_items([answer_message(answer)], status=status)
        return await self.keep(prepared, answer, prepared.response(status=status, output=output, usage=active.usage))

    async def keep(self, prepared: Prepared, answer: Answer, response: dict[str, Any]) -> dict[str, Any]:
        """Append the finished response's input and answer to its conversation, store it (unless
        `store: false`); returns `response`.

        Raises:
            Unavailable: Redis could not be written: the client must not take the response for kept.
        """
        reply = answer_message(answer)
        try:
            if prepared.session is not None:
                for message in [*prepared.new, reply]:
                    await self._sessions.append(prepared.session, message, status="complete", job_id=None)
            if prepared.body.stored:
                stored = StoredResponse(
                    tenant=prepared.tenant,
                    response=response,
                    input_items=message_items(prepared.new),
                    context=[*prepared.history, *prepared.new, reply],
                )
                await self.store.save(prepared.response_id, stored)
        except (RedisError, ConnectionError, TimeoutError) as exc:
            log.error("response_not_stored", error=repr(exc))
            raise Unavailable(
                "The response could not be saved, so it was not kept; try again shortly.",
                retry_after_s=2,
                code="response_not_stored",
            ) from exc
        return response

    async def stream(
        self, prepared: Prepared, active: ActiveRequest, first: tuple[Choice, TokenChunk], rest: AsyncIterator[Any]
    ) -> AsyncIterator[bytes]:
        """Relay the answer as OpenAI's Responses events (`ResponseEvents`), each its own SSE
        event with `id:` = its `sequence_number`; the response is stored before its last event.
        A client that leaves stops the job, as a chat stream does."""
        events = ResponseEvents(self.skeleton(prepared))
        pieces = events.opening()
        outcome = "disconnected"
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
            answer = choice.answer
            status = _status(answer)
            response = prepared.response(status=status, output=events.output(status), usage=active.usage)
            await self.keep(prepared, answer, response)
            yield b"".join([*pieces, *events.closing(response)])
        except AxonError as exc:
            outcome = "error"
            log.warning("stream_failed", error=exc.message)
            await self.completions.finish(active, outcome=outcome)
            failed = prepared.response(status="failed", output=events.output("incomplete"), usage=active.usage)
            failed["error"] = {"code": "server_error", "message": exc.message}
            yield b"".join([*pieces, *events.failed(failed)])
        finally:
            if outcome == "disconnected":
                await asyncio.shield(self.completions.finish(active, outcome=outcome))
