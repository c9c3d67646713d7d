"""Counts the sessions this process is answering a turn in (`axon_sessions_active_sessions`)."""

from prometheus_client import Gauge

from services.sessions.history import SessionStore
from services.sessions.turns import Turn, Turns
from shared.schemas import Message


class CountedTurns(Turns):
    """`Turns` that keeps a gauge of open turns: +1 once a session is locked for a turn, -1
    when its answer is stored or the turn is abandoned. Each open turn holds its session's
    lock, so this is the number of sessions being answered."""

    def __init__(self, store: SessionStore, *, instance_id: str, lock_ttl_s: float, gauge: Gauge) -> None:
        super().__init__(store, instance_id=instance_id, lock_ttl_s=lock_ttl_s)
        self._gauge = gauge

    async def begin(
        self, *, tenant: str, session_id: str, job_id: str, new_messages: list[Message], budget_tokens: int
    ) -> Turn:
        turn = await super().begin(
            tenant=tenant, session_id=session_id, job_id=job_id, new_messages=new_messages, budget_tokens=budget_tokens
        )
        self._gauge.inc()
        return turn

    async def record_answer(self, turn: Turn, *, text: str, status: str) -> None:
        was_open = not turn.closed
        try:
            await super().record_answer(turn, text=text, status=status)
        finally:
            if was_open:
                self._gauge.dec()

    async def abandon(self, turn: Turn) -> None:
        was_open = not turn.closed
        try:
            await super().abandon(turn)
        finally:
            if was_open:
                self._gauge.dec()
