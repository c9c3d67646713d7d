"""A chat stream rebuilt from its chunk log in the real Redis (`stream_resume.py`), for the cases the
e2e test does not reach: a worker's error ending it, a job that logs nothing more, an expired log."""

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from services.sessions.chat import resume as stream_resume
from services.sessions.chat.resume import open_chat_stream
from services.sessions.chunk_log import ChunkLog, StreamMeta
from shared.clients import create_redis
from shared.errors import InvalidRequest, NotFound
from shared.names import Names
from shared.schemas import ChunkError, TokenChunk, Usage


@pytest.fixture
def names(namespace) -> Names:
    return Names(f"{namespace}-resume")


@pytest.fixture
async def client(service_urls) -> AsyncIterator:
    client = create_redis(service_urls.redis, timeout_s=5)
    yield client
    await client.aclose()


async def logged_stream(client, names: Names, chunks: list[TokenChunk], *, deadline_in_s: float = 60) -> str:
    """A resumable stream of tenant `t` whose log holds `chunks`; returns its completion id."""
    job_id = str(uuid.uuid4())
    meta = StreamMeta(
        tenant="t", model="m", created=7, include_usage=True, logprobs=False, deadline=time.time() + deadline_in_s
    )
    await client.set(names.chunk_log_meta(job_id), meta.dumps(), ex=60)
    for chunk in chunks:
        await client.xadd(
            names.chunk_log(job_id), {"c": chunk.model_dump_json(exclude_none=True)}, id=f"0-{chunk.seq + 1}"
        )
    await client.expire(names.chunk_log(job_id), 60)
    return f"chatcmpl-{job_id}"


async def events(chunk_log: ChunkLog, completion_id: str, after: str | None = None) -> list[tuple[str | None, Any]]:
    """The stream's events as (id, data), data parsed unless it is `[DONE]`."""
    stream = await open_chat_stream(chunk_log, completion_id, tenant="t", starting_after=after, last_event_id=None)
    body = b"".join([piece async for piece in stream])
    out: list[tuple[str | None, Any]] = []
    for raw in body.decode().split("\n\n")[:-1]:
        fields = dict(line.split(": ", 1) for line in raw.split("\n"))
        data = fields["data"]
        out.append((fields.get("id"), data if data == "[DONE]" else orjson.loads(data)))
    return out


async def test_a_workers_error_ends_the_replay_as_it_ended_the_stream(client, names) -> None:
    chunk_log = ChunkLog(client, names, block_s=0.2)
    error = ChunkError(message="The engine failed.", type="server_error")
    completion_id = await logged_stream(
        client,
        names,
        [
            TokenChunk(seq=0, text="Hi", n_tokens=1),
            TokenChunk(seq=1, finish_reason="error", error=error, usage=Usage()),
        ],
    )
    (first_id, first), (error_id, body), done = await events(chunk_log, completion_id)
    assert first_id == "0" and first["choices"][0]["delta"] == {"role": "assistant", "content": "Hi"}
    assert first["created"] == 7 and first["id"] == completion_id
    assert error_id is None and body["error"]["message"] == "The engine failed."
    assert done == (None, "[DONE]")


async def test_the_usage_event_follows_the_final_chunk_and_only_done_follows_it(client, names) -> None:
    chunk_log = ChunkLog(client, names, block_s=0.2)
    usage = Usage(prompt_tokens=3, completion_tokens=2)
    completion_id = await logged_stream(
        client,
        names,
        [TokenChunk(seq=0, text="a", n_tokens=1), TokenChunk(seq=1, text="b", finish_reason="stop", usage=usage)],
    )
    rest = await events(chunk_log, completion_id, after="0")
    assert [event_id for event_id, _ in rest] == ["1", "2", None]
    assert rest[1][1]["usage"]["total_tokens"] == 5
    assert [data for _, data in await events(chunk_log, completion_id, after="1")][1:] == ["[DONE]"]
    assert await events(chunk_log, completion_id, after="2") == [(None, "[DONE]")]


async def test_a_job_that_logs_nothing_more_ends_with_stream_interrupted(client, names, monkeypatch) -> None:
    monkeypatch.setattr(stream_resume, "FINAL_GRACE_S", 0.3)
    chunk_log = ChunkLog(client, names, block_s=0.1)
    completion_id = await logged_stream(client, names, [TokenChunk(seq=0, text="a", n_tokens=1)], deadline_in_s=0.2)
    started = time.monotonic()
    (_, first), (error_id, error), done = await events(chunk_log, completion_id)
    assert first["choices"][0]["delta"]["content"] == "a"
    assert error_id is None and error["error"]["code"] == "stream_interrupted"
    assert done[1] == "[DONE]" and time.monotonic() - started < 3


async def test_a_stream_past_its_deadline_without_a_log_is_not_found(client, names) -> None:
    chunk_log = ChunkLog(client, names, block_s=0.1)
    completion_id = await logged_stream(client, names, [], deadline_in_s=-60)
    with pytest.raises(NotFound):
        await open_chat_stream(chunk_log, completion_id, tenant="t", starting_after=None, last_event_id=None)
    live = await logged_stream(client, names, [TokenChunk(seq=0, text="a", n_tokens=1)])
    for stream_id, tenant in ((live, "other"), (live.replace("chatcmpl-", "cmpl-"), "t")):
        with pytest.raises(NotFound):
            await open_chat_stream(chunk_log, stream_id, tenant=tenant, starting_after=None, last_event_id=None)


@pytest.mark.parametrize("reason", ["cancelled", "error"])
async def test_a_job_called_off_or_failed_ends_the_replay_with_an_error_and_has_no_event_past_it(
    client, names, reason
) -> None:
    # A chat job is cancelled only by its session manager (its deadline passed, its relay lost the
    # stream, a detached turn's relay stopped): its stream ended with an error event, not a `stop`.
    chunk_log = ChunkLog(client, names, block_s=0.2)
    error = ChunkError(message="The engine failed.", type="server_error") if reason == "error" else None
    completion_id = await logged_stream(
        client,
        names,
        [
            TokenChunk(seq=0, text="Hi", n_tokens=1),
            TokenChunk(seq=1, finish_reason=reason, error=error, usage=Usage(prompt_tokens=3, completion_tokens=1)),
        ],
    )
    (first_id, _), (error_id, body), done = await events(chunk_log, completion_id)
    assert first_id == "0" and error_id is None and done == (None, "[DONE]")
    assert body["error"]["code"] == ("stream_interrupted" if reason == "cancelled" else "upstream_error")
    # The last event with an id was 0: there is nothing after 1 or 2 to resume.
    for past in ("1", "2"):
        with pytest.raises(InvalidRequest):
            await open_chat_stream(chunk_log, completion_id, tenant="t", starting_after=past, last_event_id=None)


async def test_a_redis_failure_during_the_replay_ends_it_with_stream_interrupted(client, names, service_urls) -> None:
    # Its XREAD BLOCK waits (1 s) outlast the client's command timeout (0.2 s): reading the live
    # part fails as a Redis that went away would, after the logged part went out.
    completion_id = await logged_stream(client, names, [TokenChunk(seq=0, text="a", n_tokens=1)])
    impatient = create_redis(service_urls.redis, timeout_s=0.2)
    try:
        async with asyncio.timeout(10):
            (_, first), (error_id, error), done = await events(ChunkLog(impatient, names, block_s=1), completion_id)
    finally:
        await impatient.aclose()
    assert first["choices"][0]["delta"]["content"] == "a"
    assert error_id is None and error["error"]["code"] == "stream_interrupted"
    assert done == (None, "[DONE]")
