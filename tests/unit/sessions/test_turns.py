"""services/sessions/turns.py: a session counts as active exactly while a turn holds it; the
prompt replays the history, tool calls included."""

import datetime as dt

import pytest
from prometheus_client import CollectorRegistry, Gauge

from services.sessions.history import SessionInfo, StoredMessage
from services.sessions.turns import Turns, build_prompt, message_tokens
from shared.errors import Conflict
from shared.schemas import FunctionCall, Message, ToolCall


class MemoryStore:
    """The few SessionStore calls a turn makes, kept in memory."""

    def __init__(self) -> None:
        now = dt.datetime.now(dt.UTC)
        self.info = SessionInfo(id="s1", tenant="t", created_at=now, updated_at=now)
        self.locks: dict[str, str] = {}
        self.appended: list[tuple[str, str]] = []
        self.messages: list[Message] = []

    async def get(self, tenant: str, session_id: str) -> SessionInfo:
        return self.info

    async def lock(self, session_id: str, *, holder: str, ttl_s: float) -> bool:
        return self.locks.setdefault(session_id, holder) == holder

    async def unlock(self, session_id: str, *, holder: str) -> None:
        if self.locks.get(session_id) == holder:
            del self.locks[session_id]

    async def history(self, info: SessionInfo) -> list:
        return []

    async def append(self, info: SessionInfo, message: Message, *, status: str, job_id: str | None) -> None:
        self.appended.append((message.role, status))
        self.messages.append(message)


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


CALL = ToolCall(id="call_1", function=FunctionCall(name="get_weather", arguments='{"city": "Paris"}'))


def _stored(seq: int, role: str, content: str = "", **fields: object) -> StoredMessage:
    return StoredMessage.model_validate(
        {"id": f"m{seq}", "seq": seq, "role": role, "content": content, "created_at": dt.datetime.now(dt.UTC), **fields}
    )


async def test_an_answer_that_called_tools_is_stored_with_its_calls_and_a_tool_result_with_its_call_id(
    gauge: Gauge,
) -> None:
    store = MemoryStore()
    turns = _turns(store, gauge)
    result = Message(role="tool", content="22 C", tool_call_id="call_1", name="get_weather")
    turn = await turns.begin(tenant="t", session_id="s1", job_id="j1", new_messages=[result], budget_tokens=1000)
    await turns.record_question(turn)
    await turns.record_answer(turn, text="", status="complete", tool_calls=[CALL])
    assert store.messages == [result, Message(role="assistant", content="", tool_calls=[CALL])]


def test_the_prompt_replays_tool_calls_and_results() -> None:
    history = [
        _stored(1, "user", "Weather in Paris?"),
        _stored(2, "assistant", tool_calls=[CALL.model_dump()]),
        _stored(3, "tool", "22 C", tool_call_id="call_1", name="get_weather"),
        _stored(4, "assistant", "It is 22 C."),
    ]
    prompt, dropped = build_prompt(
        system_prompt=None, history=history, new_messages=[Message(role="user", content="Thanks")], budget_tokens=1000
    )
    assert dropped == 0
    assert prompt[1] == Message(role="assistant", content="", tool_calls=[CALL])
    assert prompt[2] == Message(role="tool", content="22 C", tool_call_id="call_1", name="get_weather")
    assert [m.role for m in prompt] == ["user", "assistant", "tool", "assistant", "user"]


def test_kept_history_never_starts_with_a_tool_result_whose_call_was_left_out() -> None:
    history = [
        _stored(1, "assistant", tool_calls=[CALL.model_dump()]),
        _stored(2, "tool", "r" * 40, tool_call_id="call_1"),
        _stored(3, "assistant", "Done."),
    ]
    # Room for the last two messages only: the result would lead, without its call.
    new = [Message(role="user", content="ok")]
    head_and_new = [Message(role="system", content="S"), *new]
    budget = sum(
        message_tokens(m) for m in head_and_new + [Message(role="user", content=m.content) for m in history[1:]]
    )
    assert budget < sum(message_tokens(m) for m in head_and_new) + message_tokens(
        Message(role="assistant", content="", tool_calls=[CALL])
    ) + sum(message_tokens(Message(role="user", content=m.content)) for m in history[1:])
    prompt, dropped = build_prompt(system_prompt="S", history=history, new_messages=new, budget_tokens=budget)
    assert [m.role for m in prompt] == ["system", "assistant", "user"]
    assert prompt[1].content == "Done."
    assert dropped == 2
