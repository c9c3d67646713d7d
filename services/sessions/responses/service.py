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
relaying it, even once its client left, or one that took it over (`leases.py`). Its events
are rebuilt from its job's chunk log (`chunk_log.py`) exactly as they were streamed (item ids
follow from the response id and output index), so any replica can replay and follow them.
"""

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from services.sessions.active_request import ActiveRequest, Choice, chunk_error
from services.sessions.catalog import ModelCatalog
from services.sessions.chunk_log import ChunkLog
from services.sessions.completions import CompletionService
from services.sessions.conversations.protocol import (
    conversation_id,
    conversation_not_found,
    session_id_of,
)
from services.sessions.history import SessionInfo, SessionStore
from services.sessions.responses.events import (
    ResponseEvents,
)
from services.sessions.responses.protocol import (
    RESPONSE_PREFIX,
    answer_message,
    finished_response,
    input_messages,
    message_items,
    new_id,
    previous_not_found,
    response_object,
    skeleton_of,
    status_of,
)
from services.sessions.responses.replay import DEADLINE_GRACE_S, ResponseReplays
from services.sessions.responses.store import Pending, ResponseStore, StoredResponse
from services.sessions.run_on import RunOn
from services.sessions.settings import SessionsSettings
from services.sessions.turns import build_prompt, fit_history
from shared.errors import AxonError, DeadlineExceeded, InvalidRequest, NotFound, Unavailable
from shared.internal_headers import Caller
from shared.logging import get_logger
from shared.openai_requests import ChatCompletionRequest
from shared.responses_requests import ResponseCreate, as_response_error
from shared.schemas import Message, TokenChunk, Usage
from shared.tracing import Tracing, current_traceparent, remote_parent, span

log = get_logger(__name__)
_NEVER_STARTED = "The response's job did not start before its deadline (no worker took it)."
# Storage that cannot be reached.
_STORAGE_ERRORS = (RedisError, ConnectionError, TimeoutError)


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

    def record(self, *, job_id: str, deadline: float, caller: Caller, traceparent: str | None = None) -> StoredResponse:
        """Its stored record while unfinished (`traceparent`: the span of the request that made it)."""
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
                traceparent=traceparent,
            ),
        )


@dataclass(frozen=True, slots=True)
class Prepared:
    """A checked request, ready to run: its chat request and its target."""

    body: ResponseCreate
    chat: ChatCompletionRequest
    target: Target


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
        run_on: RunOn,
        tracing: Tracing | None = None,
    ) -> None:
        self._tracing = tracing
        self._settings = settings
        self.completions = completions
        self._catalog = catalog
        self._sessions = sessions
        self.store = store
        self._log = chunk_log
        # Stored responses that run on without their clients, leased to this process.
        self.run_on = run_on
        self.leases = run_on.leases
        self.replays = ResponseReplays(
            settings=settings,
            store=store,
            chunk_log=chunk_log,
            lease_s=self.leases.lease_s if self.leases is not None else 0.0,
        )

    async def prepare(self, body: ResponseCreate, *, caller: Caller) -> Prepared:
        """Check `body` and build the chat request it runs as, on its history.

        Raises:
            InvalidRequest: a bad parameter or input item.
            NotFound: an unknown previous_response_id or conversation (or another tenant's).
            ModelNotFound, Unavailable: as a chat completion.
        """
        body.check()
        await self._check_output_fits(body)
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
        response_id = new_id(RESPONSE_PREFIX)
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

    async def _context_tokens(self, body: ResponseCreate) -> int:
        """The model's context (with no live worker, its last-seen context: whether the request
        may wait for one is `start`'s to say)."""
        _, live, _ = await self._catalog.require_or_wait(body.model, wait_s=math.inf)
        return live.context_tokens

    async def _check_output_fits(self, body: ResponseCreate) -> None:
        """Refuse a `max_output_tokens` larger than the model's whole context, naming it (a chat
        request's refusal would name its messages, which are the Responses API's `input`)."""
        if body.max_output_tokens is None:
            return
        context_tokens = await self._context_tokens(body)
        if body.max_output_tokens > context_tokens:
            raise InvalidRequest(
                f"max_output_tokens is {body.max_output_tokens}, more than this model's maximum context "
                f"length of {context_tokens} tokens.",
                param="max_output_tokens",
                code="context_length_exceeded",
            )

    async def _budget(self, body: ResponseCreate) -> int:
        """The prompt tokens the model's context leaves beside the answer."""
        return await self._context_tokens(body) - (body.max_output_tokens or self._settings.default_max_tokens)

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
            record = target.record(
                job_id=active.job.job_id,
                deadline=active.job.deadline,
                caller=caller,
                traceparent=current_traceparent() if self._tracing is not None else None,
            )
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
        task = self.run_on.hold(target.response_id, self._relay(target, active, events))
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
            elif self.run_on.abandoned(target.response_id):  # cancelled or deleted: its job stops
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
        with self.run_on.attached(target.response_id):
            try:
                return await asyncio.shield(waiting)
            except asyncio.CancelledError:
                self.run_on.hold(target.response_id, self._relay_after(target, active, waiting))
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
        with self.run_on.attached(target.response_id) if target.stored else contextlib.nullcontext():
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
                    self.run_on.hold(target.response_id, self._relay_lost(target, active))
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
                        self.run_on.hold(target.response_id, self._relay(target, active, events))
                    else:
                        await asyncio.shield(self.completions.finish(active, outcome=outcome))

    async def current(self, tenant: str, response_id: str) -> dict[str, Any]:
        """The tenant's stored response as it is now: an unfinished one with its output so far
        (from its job's chunk log), `in_progress` once a chunk came.

        Raises:
            NotFound: unknown, expired, deleted or another tenant's.
        """
        stored = await self.replays.stored(tenant, response_id)
        if stored.pending is None or stored.job_id is None:
            return stored.response
        events = ResponseEvents(skeleton_of(stored.response), quiet=True)
        for chunk in await self.replays.logged(stored.job_id):
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
        stored = await self.replays.stored(tenant, response_id)
        if stored.pending is None or stored.job_id is None:
            raise InvalidRequest(
                f"This response is {stored.response['status']} already: only an unfinished one can be cancelled.",
                param="response_id",
                code="invalid_value",
            )
        events = ResponseEvents(skeleton_of(stored.response), quiet=True)
        for chunk in await self.replays.logged(stored.job_id):
            events.chunk(chunk)
        response = finished_response(
            stored.response, status="cancelled", output=events.output("incomplete"), usage=events.usage
        )
        done = stored.model_copy(update={"response": response, "pending": None, "last_seq": events.last_seq})
        if await self.store.finish(response_id, done):
            await self.store.cancel_job(stored.job_id)
            return response
        return (await self.replays.stored(tenant, response_id)).response  # it finished meanwhile

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
        parent = remote_parent(stored.pending.traceparent)
        with span(self._tracing, "take over", context=parent, attributes={"axon.response_id": response_id}):
            return await self._take_over(stored)

    async def _take_over(self, stored: StoredResponse) -> dict[str, Any] | None:
        assert stored.pending is not None and stored.job_id is not None
        target = await self._target_of(stored)
        events = ResponseEvents(skeleton_of(stored.response), quiet=True)
        idle_s = max(0.0, stored.pending.deadline - time.time()) + DEADLINE_GRACE_S
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


def _not_stored(exc: BaseException) -> Unavailable:
    log.error("response_not_stored", error=repr(exc))
    return Unavailable(
        "The response could not be saved, so it was not kept; try again shortly.",
        retry_after_s=2,
        code="response_not_stored",
    )
