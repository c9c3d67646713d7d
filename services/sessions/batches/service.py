"""OpenAI's Batch API on the session managers: a batch is created `validating` and leased to the
session manager that took it (`leases.py`, with a set of its own); its owner validates its file
(`validation.py`), runs its lines as ordinary jobs at the lowest priority, a bounded number at a
time, and writes its output and error files, then ends it. A session manager that dies leaves its
lease to expire and another one takes the batch over: it runs the lines still unanswered, each
answered exactly once (`store.py`).

Each line goes through the online endpoint's own path (`CompletionService`, `ChatService.collect`,
`ResponsesService.create`) after the key's admission (`admission.py`): a body it refuses, a model
the key may not use, a spent budget are that line's 4xx in the error file. A line that finds no
capacity (503: no worker yet, a full queue) is tried again until the window ends; one that fails
on the server's side (5xx) up to `AXON_BATCH_LINE_ATTEMPTS` times. A line naming a model that
does not exist in this deployment is released at once, whatever the slack, and so answered at
once with the 404 `model_not_found` an online request gets.

Anthropic's Message Batches are batches of this machinery too (`messages.py`): created with their
lines (`create_messages`), each line run through the Messages API's translation onto the chat
path, their answers Anthropic's result lines, written at the end as one results file.
"""

import asyncio
import contextlib
import datetime as dt
import math
import time
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError

from services.sessions.batches.admission import LineAdmission
from services.sessions.batches.messages import (
    WINDOW,
    message_batch_not_found,
    message_lines,
    new_message_batch_id,
    result_line,
)
from services.sessions.batches.protocol import WINDOWS_S, batch_not_found, new_batch_id, output_line
from services.sessions.batches.slack import QueueSlack
from services.sessions.batches.store import (
    MESSAGES_ENDPOINT,
    BatchRecord,
    BatchStore,
    PendingLine,
    QueueFull,
    line_request_id,
)
from services.sessions.batches.validation import BatchLine, LineError, TooManyErrors, Validator, numbered_lines
from services.sessions.catalog import ModelCatalog
from services.sessions.chat.service import ChatService
from services.sessions.completions import CompletionService
from services.sessions.files.store import FileGone, FileStore
from services.sessions.leases import ResponseLeases
from services.sessions.messages.service import MessagesService
from services.sessions.metrics import SessionsMetrics
from services.sessions.responses.service import ResponsesService
from services.sessions.settings import SessionsSettings
from shared.anthropic_errors import anthropic_error
from shared.batch_requests import BatchCreate
from shared.errors import AxonError, InvalidRequest, NotFound, RateLimited, Unavailable, invalid_request
from shared.internal_headers import Caller
from shared.logging import bind_contextvars, get_logger
from shared.message_batch_requests import MessageBatchCreate
from shared.messages_requests import parse_message_create
from shared.openai_requests import ChatCompletionRequest, Kind, parse_request
from shared.outages import Outage
from shared.responses_requests import ResponseCreate
from shared.tokens import estimate_tokens

log = get_logger(__name__)

# How often an owner looks at its batch's row (a cancel, the window's end) and releases lines.
TICK_S = 1.0
# The least time between two rounds of releasing lines: lines that ended meanwhile are replaced
# together (one query), not one query each (AXON_BATCH_QUEUE_AHEAD lines wait in the queue anyway).
ROUND_S = 0.1
# How often every session manager leases again the unfinished batches whose leases Redis lost.
RECONCILE_S = 30.0
# How often every session manager deletes what ended batches no longer need (`BatchStore.sweep`).
RETAIN_EVERY_S = 300.0
# Output and error files are not held to the upload limit (a batch's answers may be larger).
_OUTPUT_MAX_BYTES = 1 << 40
_EXPIRED = "This request could not be executed before the completion window expired."
_CANCELLED = "This request was not executed: the batch was cancelled."


class _Invalid(Exception):
    """The batch's file broke a rule (the validator holds the errors)."""


class BatchService:
    """The Batch API's calls and the running of the batches this process owns."""

    def __init__(
        self,
        *,
        settings: SessionsSettings,
        store: BatchStore,
        files: FileStore,
        completions: CompletionService,
        chat: ChatService,
        responses: ResponsesService,
        messages: MessagesService,
        admission: LineAdmission,
        leases: ResponseLeases,
        slack: QueueSlack,
        catalog: ModelCatalog,
        metrics: SessionsMetrics,
    ) -> None:
        self._settings = settings
        self.store = store
        self._files = files
        self._completions = completions
        self._chat = chat
        self._responses = responses
        self._messages = messages
        self._admission = admission
        self.leases = leases
        self._slack = slack
        self._catalog = catalog
        self._metrics = metrics

    # The API.

    async def create(self, body: BatchCreate, *, caller: Caller) -> BatchRecord:
        """Create a batch of the caller's file `body.input_file_id` and start validating it.

        Raises:
            NotFound: no such file (or another tenant's).
            InvalidRequest: the file's purpose is not `batch`.
        """
        file = await self._files.get(caller.tenant, body.input_file_id)
        if file is None:
            raise NotFound(f"No such File object: {body.input_file_id}", param="input_file_id", code="file_not_found")
        await self._refuse_if_queue_full(caller)
        if file.purpose != "batch":
            raise InvalidRequest(
                f"The input file's purpose is '{file.purpose}'; a batch's must be 'batch'.",
                param="input_file_id",
                code="invalid_file_purpose",
            )
        now = dt.datetime.now(dt.UTC)
        record = BatchRecord(
            id=new_batch_id(),
            tenant=caller.tenant,
            key_id=caller.key_id,
            endpoint=body.endpoint,
            input_file_id=body.input_file_id,
            completion_window=body.completion_window,
            status="validating",
            metadata=body.metadata,
            errors=None,
            output_file_id=None,
            error_file_id=None,
            total=0,
            completed=0,
            failed=0,
            created_at=now,
            expires_at=now + dt.timedelta(seconds=WINDOWS_S[body.completion_window]),
        )
        # Leased first: a batch stored but not leased would wait for the reconciler.
        await self.leases.open(record.id)
        await self.store.create(record)
        self.leases.hold(record.id, self.run(record.id))
        return record

    async def create_messages(self, body: MessageBatchCreate, *, caller: Caller) -> BatchRecord:
        """Create a message batch of `body`'s requests, stored with its lines, and start running it.

        Raises:
            InvalidRequest: a request the batch cannot take (`message_lines`).
            RateLimited: the caller's key's batch queue is full (`AXON_BATCH_QUEUE_TOKENS`).
        """
        lines = message_lines(
            body,
            max_requests=self._settings.batch_max_requests,
            default_max_tokens=self._settings.default_max_tokens,
        )
        await self._refuse_if_queue_full(caller)
        now = dt.datetime.now(dt.UTC)
        record = BatchRecord(
            id=new_message_batch_id(),
            tenant=caller.tenant,
            key_id=caller.key_id,
            endpoint=MESSAGES_ENDPOINT,
            input_file_id=None,
            completion_window=WINDOW,
            status="in_progress",
            metadata=None,
            errors=None,
            output_file_id=None,
            error_file_id=None,
            total=len(lines),
            completed=0,
            failed=0,
            created_at=now,
            expires_at=now + dt.timedelta(seconds=WINDOWS_S[WINDOW]),
            in_progress_at=now,
        )
        # Leased first, as `create`'s.
        await self.leases.open(record.id)
        try:
            await self.store.create_filled(record, lines, queue_tokens=self._settings.batch_queue_tokens)
        except QueueFull as full:
            await self.leases.drop(record.id)
            retry_s = str(int(RECONCILE_S))
            raise RateLimited(full.message, code="token_limit_exceeded", headers={"Retry-After": retry_s}) from None
        self.leases.hold(record.id, self.run(record.id))
        log.info("message_batch_created", batch_id=record.id, lines=len(lines))
        return record

    async def get_messages(self, tenant: str, batch_id: str) -> BatchRecord:
        """Raises: NotFound (unknown, another tenant's, or not a message batch)."""
        record = await self.store.get(tenant, batch_id)
        if record is None or record.endpoint != MESSAGES_ENDPOINT:
            raise message_batch_not_found(batch_id)
        return record

    async def cancel_messages(self, tenant: str, batch_id: str) -> BatchRecord:
        """Ask the message batch's owner to cancel it (`canceling`; `ended` once its running lines
        stopped and its results are written); one whose lines are all answered already is as it is.

        Raises:
            NotFound: unknown, another tenant's, or not a message batch.
            InvalidRequest: it has ended.
        """
        record = await self.get_messages(tenant, batch_id)
        if record.status == "cancelling":
            return record
        moved = await self.store.transition(batch_id, "cancelling", from_=("in_progress",))
        if moved is not None:
            return moved
        current = await self.get_messages(tenant, batch_id)
        # Every line answered, its results being written: nothing is left to cancel.
        if current.status in {"cancelling", "finalizing"}:
            return current
        raise InvalidRequest(f"Message batch {batch_id} has ended: it cannot be canceled.", param="message_batch_id")

    async def delete_messages(self, tenant: str, batch_id: str) -> None:
        """Delete an ended message batch and its results file.

        Raises:
            NotFound: unknown, another tenant's, or not a message batch.
            InvalidRequest: it has not ended (cancel it first).
        """
        record = await self.get_messages(tenant, batch_id)
        deleted = await self.store.delete_ended(tenant, batch_id) if record.terminal else None
        if deleted is None:
            raise InvalidRequest(
                f"Message batch {batch_id} is still processing: cancel it, then delete it once it has ended.",
                param="message_batch_id",
            )
        if deleted.output_file_id is not None:
            await self._files.delete(tenant, deleted.output_file_id)
        log.info("message_batch_deleted", batch_id=batch_id)

    async def results(self, tenant: str, record: BatchRecord) -> tuple[int, AsyncIterator[bytes]] | None:
        """An ended message batch's results file: its size and its bytes, in pieces; None if it is
        gone (deleted through the Files API, or expired)."""
        file = await self._files.get(tenant, record.output_file_id) if record.output_file_id is not None else None
        if file is None:
            return None
        return file.bytes, self._files.read(tenant, file.id)

    async def _refuse_if_queue_full(self, caller: Caller) -> None:
        """Raises: RateLimited, the caller's key has its batch queue limit's worth of tokens
        enqueued for a model already (`AXON_BATCH_QUEUE_TOKENS`)."""
        limit = self._settings.batch_queue_tokens
        if caller.key_id is None or not limit:
            return
        full = await self.store.queue_full(caller.key_id, limit)
        if full is not None:
            retry_s = str(int(RECONCILE_S))
            raise RateLimited(full.message, code="token_limit_exceeded", headers={"Retry-After": retry_s})

    async def get(self, tenant: str, batch_id: str) -> BatchRecord:
        """Raises: NotFound (unknown, or another tenant's)."""
        record = await self.store.get(tenant, batch_id)
        if record is None:
            raise batch_not_found(batch_id)
        return record

    async def cancel(self, tenant: str, batch_id: str) -> BatchRecord:
        """Ask the batch's owner to cancel it (`cancelling`; `cancelled` once its running lines
        stopped and its files are written).

        Raises:
            NotFound: unknown, or another tenant's.
            InvalidRequest: it has ended (or is finalizing) and cannot be cancelled.
        """
        record = await self.get(tenant, batch_id)
        if record.status in {"cancelling", "cancelled"}:
            return record
        moved = await self.store.transition(batch_id, "cancelling", from_=("validating", "in_progress"))
        if moved is not None:
            return moved
        current = await self.get(tenant, batch_id)
        if current.status in {"cancelling", "cancelled"}:
            return current
        raise InvalidRequest(
            f"Cannot cancel a batch with status '{current.status}'.", param="batch_id", code="batch_not_cancellable"
        )

    # The batches this process owns.

    async def sweep(self) -> None:
        """Renew this process's batch leases and take over expired ones; every `RECONCILE_S`, lease
        again the unfinished batches the lease set lost (Redis' data lost); every `RETAIN_EVERY_S`,
        delete what ended batches no longer need; for ever."""
        tasks = [asyncio.create_task(self.leases.run(self.run)), asyncio.create_task(self._retain())]
        outage = Outage("batch_reconcile", cap_s=RECONCILE_S)
        try:
            while True:
                try:
                    await self.leases.offer(await self.store.unfinished())
                except Exception as exc:  # noqa: BLE001 - PostgreSQL or Redis away: tried again
                    await asyncio.sleep(outage.failed(exc))
                    continue
                outage.recovered()
                await asyncio.sleep(RECONCILE_S)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _retain(self) -> None:
        """Now and every `RETAIN_EVERY_S`: the lines of ended batches and the ended batches past
        `AXON_BATCH_RETENTION_DAYS` deleted (`BatchStore.sweep`); PostgreSQL away, again with
        capped backoff."""
        outage = Outage("batch_retention")
        while True:
            try:
                while await self.store.sweep(retention_days=self._settings.batch_retention_days):
                    pass
            except Exception as exc:  # noqa: BLE001 - retried with backoff
                await asyncio.sleep(outage.failed(exc))
                continue
            outage.recovered()
            await asyncio.sleep(RETAIN_EVERY_S)

    async def export_gauges(self) -> None:
        """Set the lines waiting and the oldest waiting batch's age per model (at a scrape): 0 for
        each live model without any; a model no worker serves now is `unknown` (label values
        come from clients' files)."""
        now = dt.datetime.now(dt.UTC)
        counts = dict.fromkeys(await self._catalog.live(), (0, 0.0))
        for model, lines, since in await self.store.waiting():
            label = model if model in counts else "unknown"
            before_lines, before_age = counts.get(label, (0, 0.0))
            counts[label] = (before_lines + lines, max(before_age, (now - since).total_seconds()))
        waiting, oldest = self._metrics.batch_lines_waiting, self._metrics.batch_oldest_waiting
        waiting.clear()
        oldest.clear()
        for label, (lines, age_s) in counts.items():
            waiting.labels(label).set(lines)
            oldest.labels(label).set(age_s)

    async def run(self, batch_id: str) -> None:
        """Run batch `batch_id` (leased to this process) to its end, from wherever it is."""
        bind_contextvars(batch_id=batch_id)
        record = await self.store.load(batch_id)
        if record is not None and record.status == "validating":
            record = await self._validate(record)
        if record is not None and record.status in {"in_progress", "cancelling"}:
            record = await self._run_lines(record)
        if record is not None and record.status == "finalizing":
            record = await self._finalize(record, end="completed")
        if record is None or record.terminal:
            # Its files hold the answers: its lines (with their bodies) are deleted at once.
            await self.store.forget_lines(batch_id)
            await self.leases.drop(batch_id)
            log.info("batch_ended", status=record.status if record else None)

    async def _validate(self, record: BatchRecord) -> BatchRecord | None:
        """Check the batch's file and store its lines (`in_progress`), or fail it with its errors."""
        validator = Validator(
            endpoint=record.endpoint,
            max_lines=self._settings.batch_max_requests,
            default_max_tokens=self._settings.default_max_tokens,
        )

        # Only an OpenAI batch, made of a file, is ever `validating` (a message batch starts `in_progress`).
        assert record.input_file_id is not None
        file_id = record.input_file_id

        async def lines() -> AsyncIterator[BatchLine]:
            async for number, raw in numbered_lines(self._files.read(record.tenant, file_id)):
                line = validator.check(number, raw)
                if line is not None:
                    yield line
            validator.finish()
            if validator.errors:
                raise _Invalid

        try:
            total = await self.store.validated(
                record.id, lines(), key_id=record.key_id, queue_tokens=self._settings.batch_queue_tokens
            )
        except QueueFull as full:
            error = LineError("token_limit_exceeded", full.message)
            return await self._moved(record, "failed", from_=("validating",), errors=_errors([error]))
        except (_Invalid, TooManyErrors):
            return await self._moved(record, "failed", from_=("validating",), errors=_errors(validator.errors))
        except FileGone:
            gone = LineError("file_not_found", "The input file was deleted.")
            return await self._moved(record, "failed", from_=("validating",), errors=_errors([gone]))
        log.info("batch_validated", lines=total)
        return await self._moved(record, "in_progress", from_=("validating",))

    async def _moved(
        self, record: BatchRecord, to: str, *, from_: tuple[str, ...], **fields: Any
    ) -> BatchRecord | None:
        """The batch moved to `to`, or as it is now if it had moved elsewhere (a cancel)."""
        moved = await self.store.transition(record.id, to, from_=from_, **fields)
        return moved if moved is not None else await self.store.load(record.id)

    async def _run_lines(self, record: BatchRecord) -> BatchRecord | None:
        """Release the unanswered lines into the models' slack (`slack.py`), at most
        `AXON_BATCH_LINES_IN_FLIGHT` at a time, until every one is answered (`finalizing`), the
        batch is cancelled or its window ends."""
        running: dict[int, asyncio.Task[None]] = {}
        # Lines read but not released: their model had no slack.
        held: list[PendingLine] = []
        cursor, exhausted = 0, False
        loaded = -math.inf
        try:
            while True:
                began = time.monotonic()
                # Every line read was answered: the row is reread before the batch can end.
                drained = exhausted and not running and not held
                if began - loaded >= TICK_S or drained:
                    current = await self.store.load(record.id)
                    if current is None:
                        return None
                    record, loaded = current, began
                if record.status == "cancelling":
                    return await self._end_early(record, running, end="cancelled", code="batch_cancelled")
                if dt.datetime.now(dt.UTC) >= record.expires_at:
                    return await self._end_early(record, running, end="expired", code="batch_expired")
                if drained:
                    if not await self.store.unanswered(record.id, after_line=0, limit=1):
                        moved = await self._moved(record, "finalizing", from_=("in_progress",))
                        if moved is None or moved.status != "cancelling":
                            return moved
                        continue
                    cursor, exhausted = 0, False
                free = self._settings.batch_lines_in_flight - len(running)
                if free > len(held) and not exhausted:
                    pending = await self.store.unanswered(record.id, after_line=cursor, limit=free - len(held))
                    exhausted = len(pending) < free - len(held)
                    cursor = pending[-1].line if pending else cursor
                    held += pending
                held = await self._release(record, held, running, free)
                if running:
                    await asyncio.wait(running.values(), timeout=TICK_S, return_when=asyncio.FIRST_COMPLETED)
                    await asyncio.sleep(max(0.0, began + ROUND_S - time.monotonic()))
                    for number in [n for n, task in running.items() if task.done()]:
                        _retrieve(running.pop(number))
                elif held or not exhausted:
                    await asyncio.sleep(TICK_S)
        finally:
            await _stop(running)

    async def _release(
        self, record: BatchRecord, lines: list[PendingLine], running: dict[int, "asyncio.Task[None]"], free: int
    ) -> list[PendingLine]:
        """Start up to `free` of `lines` whose model has slack or does not exist (answered 404 at
        once); the others, held."""
        held: list[PendingLine] = []
        for line in lines:
            if free <= 0:
                held.append(line)
                continue
            served = await self._catalog.served_name(line.model)
            if served is None or await self._slack.take(served, record.tenant):
                running[line.line] = asyncio.create_task(self._line(record, line, served=served))
                free -= 1
            else:
                held.append(line)
        return held

    async def _end_early(
        self, record: BatchRecord, running: dict[int, "asyncio.Task[None]"], *, end: str, code: str
    ) -> BatchRecord | None:
        """Stop the running lines (their jobs are called off within an engine step), answer the
        rest with `code` in the error file, write the files and end the batch as `end`."""
        await _stop(running)
        if record.endpoint == MESSAGES_ENDPOINT:
            await self.store.answer_rest_as_messages(
                record.id, result_type="expired" if end == "expired" else "canceled"
            )
        else:
            await self.store.answer_rest(record.id, code=code, message=_EXPIRED if end == "expired" else _CANCELLED)
        return await self._finalize(record, end=end)

    async def _finalize(self, record: BatchRecord, *, end: str) -> BatchRecord | None:
        """Write the output and error files (those with lines; a message batch's: its one results
        file, as its `output_file_id`), then end the batch as `end`."""
        current = await self.store.load(record.id)
        if current is None:
            return None
        output_id, error_id = current.output_file_id, current.error_file_id
        if current.endpoint == MESSAGES_ENDPOINT:
            if current.total and output_id is None:
                output_id = await self._write(current, ok=None)
        else:
            if current.completed and output_id is None:
                output_id = await self._write(current, ok=True)
            if current.failed and error_id is None:
                error_id = await self._write(current, ok=False)
        await self.store.set_files(record.id, output_file_id=output_id, error_file_id=error_id)
        return await self._moved(current, end, from_=(current.status,))

    async def _write(self, record: BatchRecord, *, ok: bool | None) -> str:
        """Write the batch's output (`ok`), error (not `ok`) or results (None: every line) file."""
        name = "results" if ok is None else "output" if ok else "error"
        created = await self._files.create(
            tenant=record.tenant,
            purpose="batch_output",
            filename=f"{record.id}_{name}.jsonl",
            chunks=self.store.results(record.id, ok=ok),
            max_bytes=_OUTPUT_MAX_BYTES,
        )
        return created.id

    # One line.

    async def _line(self, record: BatchRecord, line: PendingLine, *, served: str | None) -> None:
        """Answer one line (trying again what capacity or the server refused) and record it once;
        `served`: the model its `model` refers to, None if it does not exist here."""
        self._metrics.batch_lines_running.inc()
        try:
            await self._answer_line(record, line, served=served)
        finally:
            self._metrics.batch_lines_running.dec()

    async def _answer_line(self, record: BatchRecord, line: PendingLine, *, served: str | None) -> None:
        request_id = line_request_id(record.id, line.line)
        attempts = 0
        while True:
            try:
                status, body = 200, await self._answer(record, line, request_id)
            except Unavailable as exc:  # no capacity now: tried again until the window ends
                await asyncio.sleep(max(1, exc.retry_after_s))
                continue
            except AxonError as exc:
                status, body = self._error(record, exc)
            except Exception as exc:
                log.exception("batch_line_failed", line=line.line)
                status, body = self._error(record, AxonError(repr(exc)))
            attempts += 1
            if status >= 500 and attempts < self._settings.batch_line_attempts:
                await asyncio.sleep(attempts)
                continue
            break
        if record.endpoint == MESSAGES_ENDPOINT:
            result = result_line(line.custom_id, request_id=request_id, status=status, body=body)
        else:
            result = output_line(request_id, line.custom_id, status, body)
        # A label's value is the model served, never a client's string (that would grow /metrics).
        self._metrics.batch_lines.labels(served or "unknown", "completed" if status == 200 else "failed").inc()
        outage = Outage("batch_line_record")
        while True:
            try:
                if not await self.store.answer(record.id, line.line, ok=status == 200, result=result):
                    log.warning("batch_line_answered_twice", line=line.line, status=status)
                return
            except Exception as exc:  # noqa: BLE001 - PostgreSQL away: the answer waits for it
                await asyncio.sleep(outage.failed(exc))

    @staticmethod
    def _error(record: BatchRecord, exc: AxonError) -> tuple[int, dict[str, Any]]:
        """A refused or failed line's status and error body: OpenAI's, or a message batch's Anthropic's."""
        if record.endpoint == MESSAGES_ENDPOINT:
            status, body, _headers = anthropic_error(exc)
            return status, body
        return exc.status_code, exc.body()

    async def _answer(self, record: BatchRecord, line: PendingLine, request_id: str) -> dict[str, Any]:
        """The line's answer, as its online endpoint gives it.

        Raises:
            AxonError: the endpoint's (or the admission's) refusal or failure.
        """
        raw = line.body.encode()
        if record.endpoint == MESSAGES_ENDPOINT:
            return await self._answer_message(record, line, raw, request_id)
        if record.endpoint == "/v1/responses":
            try:
                response = ResponseCreate.model_validate_json(raw)
            except ValidationError as exc:
                raise invalid_request(exc.errors(include_url=False)) from None
            if response.stream or response.background:
                raise InvalidRequest("A batch's request cannot stream or run in the background.", param="stream")
            caller = await self._admit(record, line, tokens=response.max_output_tokens)
            try:
                return await self._responses.create(response, caller=caller, request_id=request_id)
            except BaseException:
                await self._completions.settle(caller, None)
                raise
        kind: Kind = "chat" if record.endpoint == "/v1/chat/completions" else "completion"
        body = parse_request(kind, raw, self._settings.request_limits)
        if body.stream:
            raise InvalidRequest("A batch's request cannot stream.", param="stream")
        if isinstance(body, ChatCompletionRequest) and body.session_id is not None:
            raise InvalidRequest("A batch's request cannot be a session turn.", param="session_id")
        max_tokens = body.requested_max_tokens or self._settings.default_max_tokens
        caller = await self._admit(record, line, tokens=max_tokens * body.choices)
        try:
            active = await self._completions.start(
                body,
                kind=kind,
                caller=caller,
                request_id=request_id,
                cold_start_wait_s=math.inf,
                timeout_s=self._settings.background_timeout_s,
            )
        except BaseException:
            await self._completions.settle(caller, None)
            raise
        first, rest = await self._completions.first_chunk(active)
        return await self._chat.collect(active, first, rest)

    async def _answer_message(
        self, record: BatchRecord, line: PendingLine, raw: bytes, request_id: str
    ) -> dict[str, Any]:
        """A message batch's line answered as `POST /v1/messages` answers it: its `Message`.

        Raises:
            AxonError: the Messages API's (or the admission's) refusal or failure.
        """
        body = parse_message_create(raw)
        if body.stream:
            raise InvalidRequest("stream: a batch's request cannot stream.", param="stream")
        caller = await self._admit(record, line, tokens=body.max_tokens)
        try:
            return await self._messages.create(
                body,
                caller=caller,
                request_id=request_id,
                cold_start_wait_s=math.inf,
                timeout_s=self._settings.background_timeout_s,
            )
        except BaseException:
            await self._completions.settle(caller, None)
            raise

    async def _admit(self, record: BatchRecord, line: PendingLine, *, tokens: int | None) -> Caller:
        """The line's caller, its most tokens (its body's characters and `tokens` of answer)
        reserved of its key's budget (`LineAdmission`)."""
        most = estimate_tokens(chars=len(line.body)) + (tokens or self._settings.default_max_tokens)
        return await self._admission.admit(tenant=record.tenant, key_id=record.key_id, model=line.model, tokens=most)


def _errors(errors: list[LineError]) -> dict[str, Any]:
    """A failed batch's `errors`, as OpenAI lists them."""
    return {"object": "list", "data": [e.to_openai() for e in errors]}


async def _stop(running: dict[int, "asyncio.Task[None]"]) -> None:
    """Cancel the running lines and wait for them (each calls its job off as a client that left)."""
    for task in running.values():
        task.cancel()
    with contextlib.suppress(Exception):
        await asyncio.gather(*running.values(), return_exceptions=True)
    running.clear()


def _retrieve(task: "asyncio.Task[None]") -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("batch_line_task_failed", error=repr(task.exception()))
