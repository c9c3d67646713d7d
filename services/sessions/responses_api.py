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

import datetime as dt
import time
import uuid
from typing import Any

import asyncpg
from pydantic import BaseModel
from redis.asyncio import Redis

from services.sessions.catalog import ModelCatalog
from services.sessions.conversations import (
    conversation_id,
    conversation_not_found,
    items_to_messages,
    session_id_of,
)
from services.sessions.history import SessionStore
from services.sessions.outbox import Outbox, ResponseRow, postgres_text
from services.sessions.responses import Answer
from services.sessions.service import ActiveRequest, Caller, CompletionService
from services.sessions.settings import SessionsSettings
from services.sessions.turns import build_prompt
from shared.errors import NotFound
from shared.responses_requests import ResponseCreate
from shared.schemas import Message, Usage

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
        self._completions = completions
        self._catalog = catalog
        self._sessions = sessions
        self.store = store

    async def create(self, body: ResponseCreate, *, caller: Caller, request_id: str) -> dict[str, Any]:
        """Answer `body` (not streamed): run it, store it, append it to its conversation.

        Raises:
            InvalidRequest: a bad parameter or input item.
            NotFound: an unknown previous_response_id or conversation (or another tenant's).
            ModelNotFound, Unavailable, UpstreamError, DeadlineExceeded: as a chat completion.
        """
        body.check()
        new = input_messages(body)
        history: list[Message] = []
        session = None
        if body.previous_response_id is not None:
            previous = await self.store.get(caller.tenant, body.previous_response_id)
            if previous is None:
                raise previous_not_found()
            history = previous.context
        conversation = body.conversation_id
        if conversation is not None:
            try:
                session = await self._sessions.get(caller.tenant, session_id_of(conversation))
            except NotFound:
                raise conversation_not_found() from None
            _, live = await self._catalog.require(body.model)
            budget = live.context_tokens - (body.max_output_tokens or self._settings.default_max_tokens)
            prompt, _ = build_prompt(
                system_prompt=session.system_prompt,
                history=await self._sessions.history(session),
                new_messages=new,
                budget_tokens=budget,
            )
            history, new = prompt[: len(prompt) - len(new)], prompt[len(prompt) - len(new) :]
        head = [Message(role="system", content=body.instructions)] if body.instructions else []
        chat = body.chat_request(head + history + new, self._settings.request_limits)
        created_at = time.time()
        active = await self._completions.start(chat, kind="chat", caller=caller, request_id=request_id)
        answer = await self._answer(active)
        status = "incomplete" if answer.finish_reason == "length" else "completed"
        reply = answer_message(answer)
        output = message_items([reply], status=status)
        response_id = _id(RESPONSE_PREFIX)
        conv_id = conversation_id(session.id) if session is not None else None
        response = response_object(
            body,
            response_id=response_id,
            created_at=created_at,
            status=status,
            output=output,
            usage=active.usage,
            conversation=conv_id,
        )
        if session is not None:
            for message in [*new, reply]:
                await self._sessions.append(session, message, status="complete", job_id=None)
        if body.stored:
            stored = StoredResponse(
                tenant=caller.tenant, response=response, input_items=message_items(new), context=[*history, *new, reply]
            )
            await self.store.save(response_id, stored)
        return response

    async def _answer(self, active: ActiveRequest) -> Answer:
        """The whole answer of the request's one choice."""
        first, rest = await self._completions.first_chunk(active)
        await self._completions.collect(active, first, rest)
        return active.choices[0].answer
