"""services/sessions/turns.py: a session counts as active exactly while a turn holds it."""

import datetime as dt

import pytest
from prometheus_client import CollectorRegistry, Gauge

from services.sessions.history import SessionInfo
from services.sessions.turns import Turns
from shared.errors import Conflict
from shared.schemas import Message


class MemoryStore:
    """The few SessionStore calls a turn makes, kept in memory."""

    def __init__(self) -> None:
        now = dt.datetime.now(dt.UTC)
        self.info = SessionInfo(id="s1", tenant="t", created_at=now, updated_at=now)
        self.locks: dict[str, str] = {}
        self.appended: list[tuple[str, str]] = []

    async def get(self, tenant: str, session_id: str) -> SessionInfo:
        return self.info

    async def lock(self, session_id: str, *, holder: str, ttl_s: float) -> bool:
        return self.locks.setdefault(session_id, holder) == holder

    async def unlock(self, session_id: str, *, holder: str) -> None:
        if self.locks.get(session_id) == holder:
            del self.locks[session_id]

    async def history(self, info: SessionInfo) -> list:
        return []

    async def append(self, info: SessionInfo, *, role: str, content: str, status: str, job_id: str | None) -> None:
        self.appended.append((role, status))


@pytest.fixture
def gauge() -> Gauge:
    return Gauge("active", "test", registry=CollectorRegistry())


def _value(gauge: Gauge) -> float:
    return gauge.collect()[0].samples[0].value


def _turns(store: MemoryStore, gauge: Gauge) -> Turns:
    return Turns(store, instance_id="i1", lock_ttl_s=30, gauge=gauge)  # type: ignore[arg-type]


async def _begin(turns: Turns, job_id: str):
    return await turns.begin(
        tenant="t",
        session_id="s1",
        job_id=job_id,
        new_messages=[Message(role="user", content="hi")],
        budget_tokens=1000,
    )


async def test_a_turn_counts_until_its_answer_is_stored(gauge: Gauge) -> None:
    store = MemoryStore()
    turns = _turns(store, gauge)
    turn = await _begin(turns, "j1")
    assert _value(gauge) == 1
    await turns.record_answer(turn, text="hello", status="complete")
    await turns.record_answer(turn, text="hello", status="complete")  # a second end changes nothing
    assert _value(gauge) == 0
    assert store.appended == [("assistant", "complete")]


async def test_an_abandoned_turn_stops_counting(gauge: Gauge) -> None:
    turns = _turns(MemoryStore(), gauge)
    turn = await _begin(turns, "j1")
    await turns.abandon(turn)
    await turns.abandon(turn)
    assert _value(gauge) == 0


async def test_a_refused_turn_never_counts(gauge: Gauge) -> None:
    turns = _turns(MemoryStore(), gauge)
    await _begin(turns, "j1")
    with pytest.raises(Conflict):
        await _begin(turns, "j2")  # the session is busy
    assert _value(gauge) == 1


async def test_a_failed_store_still_stops_counting(gauge: Gauge) -> None:
    store = MemoryStore()
    turns = _turns(store, gauge)
    turn = await _begin(turns, "j1")

    async def broken(*_args, **_kwargs) -> None:
        raise ConnectionError("redis down")

    store.append = broken  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):
        await turns.record_answer(turn, text="x", status="complete")
    assert _value(gauge) == 0
