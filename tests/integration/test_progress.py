"""JobStream against the real Redis: progress recorded with each chunk, resumed after a crash,
and a finished job recognised on redelivery."""

import time
import uuid

import pytest

from services.worker.engines import EngineOutput
from services.worker.progress import JobStream
from shared.names import Names
from shared.redis_pipe import RedisPipe
from tests.conftest import REDIS_URL


@pytest.fixture
async def pipe():
    pipe = RedisPipe(REDIS_URL, timeout_s=5)
    yield pipe
    await pipe.aclose()


def _stream(pipe: RedisPipe, names: Names, job_id: str) -> JobStream:
    return JobStream(pipe, names, job_id=job_id, channel=names.tokens_channel(job_id), deadline=time.time() + 60)


async def test_a_crashed_attempt_is_resumed_and_a_finished_one_is_recognised(pipe, namespace) -> None:
    names, job_id = Names(f"{namespace}-progress"), str(uuid.uuid4())
    first = _stream(pipe, names, job_id)
    await first.publish(EngineOutput("Hello", 1, 7, 1, token_ids=(11,)))
    await first.publish(EngineOutput(" world", 1, 7, 2, token_ids=(12,)))

    again = _stream(pipe, names, job_id)  # the worker died: another one takes the job over
    resume = await again.load()
    assert resume is not None and (resume.text, resume.token_ids, resume.completion_tokens) == (
        "Hello world",
        (11, 12),
        2,
    )
    assert (again.seq, again.done) == (2, False)
    await again.publish(EngineOutput("!", 1, 7, 3, finish_reason="stop", token_ids=(13,)))

    # Its ack was lost with the broker connection: the job comes once more, and is known done.
    third = _stream(pipe, names, job_id)
    assert await third.load() is None and third.done
    ttl = await pipe.execute("TTL", names.job_progress(job_id))
    assert 0 < ttl <= 60 + 60
    assert await pipe.execute("EXISTS", names.job_progress_text(job_id), names.job_progress_tokens(job_id)) == 0
