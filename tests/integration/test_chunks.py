"""The worker's chunks as the session manager receives them from the real Redis: content and tool
calls split from the engine's raw text, the final reason and usage, logprobs and echo, and a
tool-calling answer resumed mid-call on another worker giving what an uninterrupted run gives."""

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from functools import partial

import orjson
import pytest

from services.worker.chunk_publisher import ChunkPublisher
from services.worker.engines import EngineOutput
from services.worker.failover import Failover, Progress
from services.worker.tool_parsers import answer_finish_reason, parser_for, tool_call_id
from shared.names import Names
from shared.redis_pipe import RedisPipe, RedisSubscriber
from shared.schemas import FunctionSpec, Job, NamedToolChoice, TokenChunk, TokenLogprob, ToolChoice

OUTPUTS = [
    EngineOutput("Let me check.", 3, 9, 3),
    EngineOutput("\n<tool_", 2, 9, 5),
    EngineOutput('call>{"name": "get_time", "arguments": {"tz": ', 8, 9, 13),
    EngineOutput('"UTC"}}</tool_call>', 4, 9, 17, finish_reason="stop", cached_tokens=4),
]


@pytest.fixture
async def pipe(service_urls) -> AsyncIterator[RedisPipe]:
    pipe = RedisPipe(service_urls.redis, timeout_s=5)
    yield pipe
    await pipe.aclose()


class Channel:
    """The raw chunks published on one job's channel, in order."""

    def __init__(self, url: str, channel: str) -> None:
        self.name = channel
        self.raw: list[bytes] = []
        self._arrived = asyncio.Event()
        self._subscriber = RedisSubscriber(url, timeout_s=5, on_message=self._on_message, on_lost=lambda: None)

    def _on_message(self, _channel: bytes, data: bytes) -> None:
        self.raw.append(data)
        self._arrived.set()

    async def __aenter__(self) -> "Channel":
        await self._subscriber.subscribe(self.name)
        return self

    async def __aexit__(self, *_: object) -> None:
        await self._subscriber.aclose()

    async def chunks(self, count: int) -> list[TokenChunk]:
        async with asyncio.timeout(5):
            while len(self.raw) < count:
                self._arrived.clear()
                await self._arrived.wait()
        return [TokenChunk.model_validate_json(raw) for raw in self.raw]


def tool_job(job_id: str, tool_choice: ToolChoice = "auto") -> Job:
    return Job(
        job_id=job_id,
        model="m",
        channel="c",
        deadline=time.time() + 60,
        messages=[],
        tools=[FunctionSpec(name="get_time")],
        tool_choice=tool_choice,
    )


def publisher_for(pipe: RedisPipe, names: Names, job: Job, progress: Progress) -> ChunkPublisher:
    publisher = ChunkPublisher(
        pipe,
        names,
        job_id=job.job_id,
        channel=names.tokens_channel(job.job_id),
        deadline=job.deadline,
        progress=progress,
    )
    publisher.shape(parser_for(job), partial(answer_finish_reason, job))
    return publisher


async def test_tool_calls_are_split_from_content_and_the_answer_ends_tool_calls(pipe, namespace, service_urls) -> None:
    names, job = Names(f"{namespace}-chunks"), tool_job(str(uuid.uuid4()))
    publisher = publisher_for(pipe, names, job, Progress())
    async with Channel(service_urls.redis, names.tokens_channel(job.job_id)) as channel:
        for out in OUTPUTS:
            await publisher.publish(out)
        chunks = await channel.chunks(4)
    assert [c.seq for c in chunks] == [0, 1, 2, 3]
    assert [c.text for c in chunks] == ["Let me check.", "", "", ""]  # the tag's start is held, then a call
    assert [c.tool_calls for c in chunks[:3]] == [None, None, None]  # a call is read once its tag closes
    (call,) = chunks[3].tool_calls or []
    assert (call.index, call.id, call.type) == (0, tool_call_id(job.job_id, 0), "function")
    assert call.function is not None and (call.function.name, call.function.arguments) == ("get_time", '{"tz": "UTC"}')
    assert [c.finish_reason for c in chunks] == [None, None, None, "tool_calls"]
    usage = chunks[3].usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (9, 17)
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens == 4
    # Only what a chunk carries is on the wire (no nulls).
    assert orjson.loads(channel.raw[0]) == {"seq": 0, "text": "Let me check.", "n_tokens": 3}


async def test_a_text_chunk_is_the_json_its_token_chunk_serialises_to(pipe, namespace, service_urls) -> None:
    names, job_id = Names(f"{namespace}-chunks"), str(uuid.uuid4())
    channel_name = names.tokens_channel(job_id)
    publisher = ChunkPublisher(
        pipe, names, job_id=job_id, channel=channel_name, deadline=time.time() + 60, progress=Progress()
    )
    texts = [' "quoted" \\ back', "\n\t\r\b\f\x00\x1f\x7f", "é漢字😀\u2028", "", "</script>"]
    async with Channel(service_urls.redis, channel_name) as channel:
        for i, text in enumerate(texts):
            await publisher.publish(EngineOutput(text, 2, 3, 2 * i + 2))
        await channel.chunks(len(texts))
    expected = [
        TokenChunk(seq=i, text=text, n_tokens=2).model_dump_json(exclude_none=True).encode()
        for i, text in enumerate(texts)
    ]
    assert channel.raw == expected


# A call forced by name: the answer is the arguments, streamed as they come.
NAMED_OUTPUTS = [
    EngineOutput('{"tz"', 3, 9, 3),
    EngineOutput(': "Europe/', 3, 9, 6),
    EngineOutput('Paris"}', 3, 9, 9, finish_reason="stop"),
]


@pytest.mark.parametrize(
    ("tool_choice", "outputs", "reason"),
    [("auto", OUTPUTS, "tool_calls"), (NamedToolChoice(name="get_time"), NAMED_OUTPUTS, "stop")],
)
async def test_a_tool_call_resumed_mid_call_on_another_worker_is_the_uninterrupted_one(
    pipe, namespace, service_urls, tool_choice: ToolChoice, outputs: list[EngineOutput], reason: str
) -> None:
    names = Names(f"{namespace}-chunks")
    whole_job, cut_job = tool_job(str(uuid.uuid4()), tool_choice), tool_job(str(uuid.uuid4()), tool_choice)
    async with Channel(service_urls.redis, names.tokens_channel(whole_job.job_id)) as channel:
        whole = publisher_for(pipe, names, whole_job, Progress())
        for out in outputs:
            await whole.publish(out)
        uninterrupted = await channel.chunks(len(outputs))
    async with Channel(service_urls.redis, names.tokens_channel(cut_job.job_id)) as channel:
        first = publisher_for(pipe, names, cut_job, Progress())
        for out in outputs[:-1]:  # the worker dies mid-call, its arguments half published
            await first.publish(out)
        progress = await Failover(pipe, names, max_deliveries=3).load_progress(cut_job.job_id)
        assert progress.resume is not None and progress.resume.text == "".join(o.text for o in outputs[:-1])
        second = publisher_for(pipe, names, cut_job, progress)
        await second.publish(outputs[-1])
        resumed = await channel.chunks(len(outputs))

    def answer(chunks: list[TokenChunk], job_id: str) -> tuple[object, ...]:
        deltas = [d.model_dump() for c in chunks for d in c.tool_calls or []]
        for delta in deltas:  # the same ids as the job's own
            assert delta["id"] in (None, tool_call_id(job_id, delta["index"]))
            delta["id"] = delta["id"] and "id"
        return "".join(c.text for c in chunks), deltas, chunks[-1].finish_reason, chunks[-1].usage

    assert answer(resumed, cut_job.job_id) == answer(uninterrupted, whole_job.job_id)
    assert resumed[-1].finish_reason == reason
    assert any(c.tool_calls for c in resumed[:-1]) == (tool_choice != "auto")  # named calls stream


async def test_echo_and_logprobs_lead_the_first_chunk(pipe, namespace, service_urls) -> None:
    names, job_id = Names(f"{namespace}-chunks"), str(uuid.uuid4())
    channel_name = names.tokens_channel(job_id)
    publisher = ChunkPublisher(
        pipe, names, job_id=job_id, channel=channel_name, deadline=time.time() + 60, progress=Progress()
    )
    publisher.shape(None, echo="Say hi:")
    said, hi, bang = (TokenLogprob(token=t, logprob=-0.5, bytes=list(t.encode())) for t in ("Say hi:", " hi", "!"))
    async with Channel(service_urls.redis, channel_name) as channel:
        await publisher.publish(EngineOutput(" hi", 1, 3, 1, logprobs=(hi,), prompt_logprobs=(said,)))
        await publisher.publish(EngineOutput("!", 1, 3, 2, finish_reason="length", logprobs=(bang,)))
        chunks = await channel.chunks(2)
    assert [c.text for c in chunks] == ["Say hi: hi", "!"]
    assert [c.logprobs for c in chunks] == [[said, hi], [bang]]
    assert chunks[1].finish_reason == "length"
    # The progress holds the engine's own text: a resumed job is not echoed twice.
    assert await pipe.execute("GET", names.job_progress_text(job_id)) is None  # the final chunk cleared it


async def test_error_and_cancel_chunks(pipe, namespace, service_urls) -> None:
    names = Names(f"{namespace}-chunks")
    for finish, expected in (
        (
            lambda p: p.finish_with_error("Too long.", "invalid_request_error"),
            {
                "seq": 0,
                "finish_reason": "error",
                "error": {"message": "Too long.", "type": "invalid_request_error"},
                "text": "",
                "n_tokens": 0,
                "usage": {"prompt_tokens": 0, "completion_tokens": 0},
            },
        ),
        (
            lambda p: p.finish_cancelled(),
            {
                "seq": 0,
                "finish_reason": "cancelled",
                "text": "",
                "n_tokens": 0,
                "usage": {"prompt_tokens": 0, "completion_tokens": 0},
            },
        ),
    ):
        job_id = str(uuid.uuid4())
        channel_name = names.tokens_channel(job_id)
        publisher = ChunkPublisher(
            pipe, names, job_id=job_id, channel=channel_name, deadline=time.time() + 60, progress=Progress()
        )
        async with Channel(service_urls.redis, channel_name) as channel:
            await finish(publisher)
            await channel.chunks(1)
        assert orjson.loads(channel.raw[0]) == expected


@pytest.mark.parametrize("ending", ["error", "cancelled"])
async def test_a_job_ended_early_charges_every_attempts_tokens_once(pipe, namespace, service_urls, ending) -> None:
    """A job that fails or is cancelled after a failover: its final chunk's usage counts the tokens
    the dead attempt published and those of this one, and its progress keeps those counts."""
    names = Names(f"{namespace}-chunks")
    job_id = str(uuid.uuid4())
    channel_name = names.tokens_channel(job_id)

    def publisher_from(progress: Progress) -> ChunkPublisher:
        return ChunkPublisher(
            pipe, names, job_id=job_id, channel=channel_name, deadline=time.time() + 60, progress=progress
        )

    first = publisher_from(Progress())
    await first.publish(EngineOutput("one two", 2, 7, 2))
    await first.publish(EngineOutput(" three", 1, 7, 3))  # then the worker dies
    progress = await Failover(pipe, names, max_deliveries=3).load_progress(job_id)
    second = publisher_from(progress)
    async with Channel(service_urls.redis, channel_name) as channel:
        await second.publish(EngineOutput(" four", 1, 0, 1))
        if ending == "error":
            await second.finish_with_error("The engine failed.", "server_error")
        else:
            await second.finish_cancelled()
        chunks = await channel.chunks(2)
    assert chunks[1].finish_reason == ending
    assert chunks[1].usage is not None
    assert (chunks[1].usage.prompt_tokens, chunks[1].usage.completion_tokens) == (7, 4)
    recorded = await pipe.execute("HGETALL", names.job_progress(job_id))
    assert dict(zip(recorded[::2], recorded[1::2], strict=True)) == {
        b"done": b"1",
        b"completion_tokens": b"4",
        b"prompt_tokens": b"7",
    }
    assert (await Failover(pipe, names, max_deliveries=3).load_progress(job_id)).done


async def test_progress_keys_a_later_chunk_creates_expire_with_the_progress(pipe, namespace) -> None:
    """A first chunk with no text and no token ids (an engine holding back part of a character)
    creates neither the progress text nor the token list; the chunk that does gives them the
    progress's expiry, so a job that never ends (it expires in a queue) leaves none of them behind."""
    names, job_id = Names(f"{namespace}-chunks"), str(uuid.uuid4())
    publisher = ChunkPublisher(
        pipe, names, job_id=job_id, channel=names.tokens_channel(job_id), deadline=time.time() + 60, progress=Progress()
    )
    await publisher.publish(EngineOutput("", 1, 3, 1))
    await publisher.publish(EngineOutput("héllo", 1, 3, 2, token_ids=(7,)))
    await publisher.publish(EngineOutput(" there", 1, 3, 3, token_ids=(8,)))
    keys = (names.job_progress(job_id), names.job_progress_text(job_id), names.job_progress_tokens(job_id))
    ttls = [await pipe.execute("TTL", key) for key in keys]
    assert all(60 < ttl <= 120 for ttl in ttls), ttls
    await pipe.execute("DEL", *keys)
