"""One turn of a conversation: lock the session, build the prompt from its history,
store the user's message and, once it exists, the answer.

Rule for concurrent requests on one session: the second gets 409 while the first is
being answered (turns never interleave; the client retries or waits).
"""

import asyncio
import time
from dataclasses import dataclass
from typing import get_args

from prometheus_client import Gauge

from services.sessions.history import SessionInfo, SessionStore, StoredMessage
from shared.errors import Conflict
from shared.logging import get_logger
from shared.schemas import Message, Role, ToolCall
from shared.tasks import BackgroundTasks
from shared.tokens import estimate_tokens

log = get_logger(__name__)
# Between retries of a session lock's release while Redis is away.
_UNLOCK_RETRY_S = 1.0

# Assistant answers that ended like this carry no text worth sending back to the model.
_SKIPPED_STATUSES = frozenset({"failed"})
# The stored roles a prompt takes (a stored role is a plain string), each as the `Role` it is.
_PROMPT_ROLES: dict[str, Role] = {role: role for role in get_args(Role)}


def message_tokens(message: Message) -> int:
    chars = len(message.content)
    for call in message.tool_calls or ():
        chars += len(call.function.name) + len(call.function.arguments)
    return estimate_tokens(chars=chars, messages=1)


def build_prompt(
    *,
    system_prompt: str | None,
    history: list[StoredMessage],
    new_messages: list[Message],
    budget_tokens: int,
) -> tuple[list[Message], int]:
    """System prompt + as much recent history as fits + the new messages.

    History replays tool calls: an assistant answer with its `tool_calls`, a tool's result with
    its `tool_call_id`. The kept history never starts with a tool result, whose call was left out.

    Returns:
        The prompt, and how many history messages were left out (oldest first).
    """
    head = [Message(role="system", content=system_prompt)] if system_prompt else []
    usable = [
        Message(role=role, content=m.content, name=m.name, tool_calls=m.tool_calls, tool_call_id=m.tool_call_id)
        for m in history
        if m.status not in _SKIPPED_STATUSES and (role := _PROMPT_ROLES.get(m.role)) is not None
    ]
    kept = fit_history(usable, fixed=head + new_messages, budget_tokens=budget_tokens)
    return head + kept + new_messages, len(usable) - len(kept)


def fit_history(history: list[Message], *, fixed: list[Message], budget_tokens: int) -> list[Message]:
    """The most recent messages of `history` that fit in `budget_tokens` beside `fixed`, never
    starting with a tool's result (its call would be gone)."""
    used = sum(message_tokens(m) for m in fixed)
    kept: list[Message] = []
    for message in reversed(history):
        cost = message_tokens(message)
        if used + cost > budget_tokens:
            break
        kept.append(message)
        used += cost
    while kept and kept[-1].role == "tool":
        kept.pop()
    kept.reverse()
    return kept


@dataclass
class Turn:
    """A locked session turn in progress."""

    info: SessionInfo
    holder: str
    job_id: str
    prompt: list[Message]
    dropped: int
    new_messages: list[Message]
    # The worker that served the session's last turn (None: unknown, or affinity is off).
    home: str | None = None
    closed: bool = False


class Turns:
    """Begins and ends session turns against the store.

    Keeps a gauge of open turns (`axon_sessions_active_sessions`): +1 once a session is locked
    for a turn, -1 when its answer is stored or the turn is abandoned. Each open turn holds its
    session's lock, so this is the number of sessions being answered.

    A turn's lock must not outlive its turn: a release that fails (Redis away) is retried in the
    background until it succeeds or the lock has expired anyway. Otherwise a Redis restart in
    the middle of a turn would leave its session answering 409 for the whole lock TTL.
    """

    def __init__(
        self, store: SessionStore, *, instance_id: str, lock_ttl_s: float, gauge: Gauge, affinity: bool = False
    ) -> None:
        self._store = store
        # Whether to read the session's home worker with its history.
        self._affinity = affinity
        self._instance_id = instance_id
        self._lock_ttl_s = lock_ttl_s
        self._gauge = gauge
        self._background = BackgroundTasks()

    async def begin(
        self, *, tenant: str, session_id: str, job_id: str, new_messages: list[Message], budget_tokens: int
    ) -> Turn:
        """Lock the session and build the prompt.

        Raises:
            NotFound: no such session for this tenant.
            Conflict: another request is being answered in this session.
        """
        info = await self._store.get(tenant, session_id)
        holder = f"{self._instance_id}|{job_id}"
        if not await self._store.lock(info.id, holder=holder, ttl_s=self._lock_ttl_s):
            raise Conflict(
                "Another request is being answered in this session; retry when it has finished.",
                param="session_id",
                code="session_busy",
            )
        home: str | None = None
        try:
            if self._affinity:
                history, home = await self._store.history_and_home(info)
            else:
                history = await self._store.history(info)
        except BaseException:
            await self._release(info.id, holder)
            raise
        prompt, dropped = build_prompt(
            system_prompt=info.system_prompt, history=history, new_messages=new_messages, budget_tokens=budget_tokens
        )
        turn = Turn(
            info=info,
            holder=holder,
            job_id=job_id,
            prompt=prompt,
            dropped=dropped,
            new_messages=new_messages,
            home=home,
        )
        self._gauge.inc()
        return turn

    async def record_question(self, turn: Turn) -> None:
        """Store the new messages (after the job was accepted by the broker)."""
        for message in turn.new_messages:
            await self._store.append(turn.info, message, status="complete", job_id=turn.job_id)

    async def record_answer(
        self, turn: Turn, *, text: str, status: str, tool_calls: list[ToolCall] | None = None
    ) -> None:
        """Store the answer (complete, cancelled or failed), with the tools it called, and
        release the session."""
        if turn.closed:
            return
        turn.closed = True
        answer = Message(role="assistant", content=text, tool_calls=tool_calls)
        try:
            await self._store.append(turn.info, answer, status=status, job_id=turn.job_id)
        finally:
            await self._end(turn)

    async def abandon(self, turn: Turn) -> None:
        """Release the session without storing anything (the job never started)."""
        if not turn.closed:
            turn.closed = True
            await self._end(turn)

    async def _end(self, turn: Turn) -> None:
        """Release a turn's session and stop counting the turn (once: its caller closed it)."""
        try:
            await self._release(turn.info.id, turn.holder)
        finally:
            self._gauge.dec()

    async def _release(self, session_id: str, holder: str) -> None:
        try:
            await self._store.unlock(session_id, holder=holder)
        except Exception as exc:  # noqa: BLE001 - retried until it takes
            log.warning("session_unlock_failed", session_id=session_id, error=repr(exc))
            self._background.spawn(self._release_later(session_id, holder))

    async def _release_later(self, session_id: str, holder: str) -> None:
        deadline = time.monotonic() + self._lock_ttl_s
        while time.monotonic() < deadline:
            await asyncio.sleep(_UNLOCK_RETRY_S)
            try:
                await self._store.unlock(session_id, holder=holder)
                return
            except Exception:  # noqa: BLE001 - Redis is still away: the next try, or the lock's expiry
                continue
