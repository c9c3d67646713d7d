"""services/sessions/completions.py: a request's end is charged even when its task is cancelled while
its answer is being stored (the client left right then)."""

import asyncio
import time
from typing import Any

import pytest

from services.sessions.active_request import ActiveRequest, Choice
from services.sessions.chat.protocol import ResponseBuilder
from services.sessions.completions import CompletionService
from services.sessions.metrics import SessionsMetrics
from services.sessions.outbox import Outbox
from services.sessions.settings import SessionsSettings
from shared.internal_headers import Caller
from shared.names import Names
from shared.schemas import Job, Sampling, Usage


class Pipe:
    """Keeps the commands submitted."""

    def __init__(self) -> None:
        self.commands: list[tuple[Any, ...]] = []

    def submit(self, *command: Any) -> asyncio.Future[Any]:
        self.commands.append(command)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        future.set_result(1)
        return future


class SlowTurns:
    """Stores an answer only when told to; says when it started."""

    def __init__(self) -> None:
        self.storing = asyncio.Event()

    async def record_answer(self, turn: object, **_: Any) -> None:
        self.storing.set()
        await asyncio.Event().wait()


class Stream:
    async def close(self) -> None:
        pass


async def test_a_finish_cancelled_while_storing_the_answer_still_charges_the_usage() -> None:
    pipe, turns, names = Pipe(), SlowTurns(), Names("t")
    service = CompletionService(
        settings=SessionsSettings(),
        catalog=None,  # type: ignore[arg-type]
        relay=None,  # type: ignore[arg-type]
        publisher=None,  # type: ignore[arg-type]
        pipe=pipe,  # type: ignore[arg-type]
        outbox=Outbox(None, names),  # type: ignore[arg-type]
        limiter=None,  # type: ignore[arg-type]
        turns=turns,  # type: ignore[arg-type]
        metrics=SessionsMetrics(),
    )
    job = Job(job_id="j", model="m", prompt="p", channel="c", deadline=time.time() + 60, sampling=Sampling())
    choice = Choice(0, job)
    choice.answer.finish_reason = "stop"
    choice.answer.usage = Usage(prompt_tokens=3, completion_tokens=2)
    active = ActiveRequest(
        choices=[choice],
        caller=Caller(tenant="t"),
        stream=Stream(),  # type: ignore[arg-type]
        builder=ResponseBuilder(kind="chat", job_id="j", model="m"),
        started=time.perf_counter(),
        turn=object(),  # type: ignore[arg-type]
    )
    active.unfinished = 0
    finishing = asyncio.create_task(service.finish(active, outcome="stop"))
    await asyncio.wait_for(turns.storing.wait(), 1)
    finishing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await finishing
    assert [c[:2] for c in pipe.commands] == [("XADD", names.outbox)]  # the usage row
    assert active.usage == Usage(prompt_tokens=3, completion_tokens=2)
