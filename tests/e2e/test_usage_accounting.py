"""Usage is exact and never lost: a request is charged the tokens its jobs generated, once, whether
its client left, its worker died and another finished it, its job was given up, or its session
manager died. Rows are read from PostgreSQL after the persister flushed them; what the worker
generated is read from the worker's own chunks and progress on Redis."""

import asyncio
import time
from collections.abc import Iterator

import asyncpg
import openai
import pytest
import redis
from openai import OpenAI

from services.cli.launcher import Service
from shared.keys import KeyLimits
from shared.names import Names
from shared.schemas import TokenChunk
from tests.conftest import create_key
from tests.e2e.conftest import SIM_MODEL
from tests.e2e.stack import Stack
from tests.e2e.test_workers import holder, sim_worker, wait_listed

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "count the stars one by one"}]


@pytest.fixture(scope="module")
def usage_key(database_url: str) -> str:
    """A key of this module's own, so its rows are told apart."""
    limits = KeyLimits(rpm=1_000_000, tpm=100_000_000, max_concurrent=10_000)
    return asyncio.run(create_key(database_url, name="usage", limits=limits, tenant="usage"))


def client_for(gateway: Service, key: str) -> OpenAI:
    return OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(gateway: Service, usage_key: str) -> OpenAI:
    return client_for(gateway, usage_key)


@pytest.fixture(scope="module")
def prompt_tokens(client: OpenAI) -> int:
    """What the prompt costs on the simulator (its words), from a complete answer."""
    answer = client.chat.completions.create(model=SIM_MODEL, messages=MESSAGES, max_tokens=1)
    assert answer.usage is not None
    return answer.usage.prompt_tokens


def usage_row(database_url: str, job_id: str, timeout_s: float = 15) -> asyncpg.Record:
    """The usage row of job `job_id`, once the persister has written it."""

    async def poll() -> asyncpg.Record:
        conn = await asyncpg.connect(database_url)
        try:
            deadline = time.monotonic() + timeout_s
            while (row := await conn.fetchrow("SELECT * FROM usage WHERE job_id = $1", job_id)) is None:
                assert time.monotonic() < deadline, f"no usage row for job {job_id}"
                await asyncio.sleep(0.1)
            return row
        finally:
            await conn.close()

    return asyncio.run(poll())


def job_of(response_id: str) -> str:
    return response_id.removeprefix("chatcmpl-")


class WorkerChunks:
    """The chunks a worker publishes for one job, read from Redis as the session manager reads them."""

    def __init__(self, redis_url: str, channel: str) -> None:
        self._client = redis.Redis.from_url(redis_url)
        self._pubsub = self._client.pubsub(ignore_subscribe_messages=True)
        self._pubsub.subscribe(channel)
        while self._pubsub.get_message(ignore_subscribe_messages=False, timeout=1) is None:
            pass  # until Redis confirms the subscription

    def final(self, timeout_s: float = 10) -> TokenChunk:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            message = self._pubsub.get_message(timeout=0.5)
            if message is not None:
                chunk = TokenChunk.model_validate_json(message["data"])
                if chunk.finish_reason is not None:
                    return chunk
        raise AssertionError("the worker published no final chunk")

    def close(self) -> None:
        self._pubsub.close()
        self._client.close()


@pytest.fixture
def worker_chunks(stack: Stack) -> Iterator[list[WorkerChunks]]:
    opened: list[WorkerChunks] = []
    yield opened
    for chunks in opened:
        chunks.close()


def words(pieces: list[str]) -> int:
    """Tokens of a simulator answer: one word each."""
    return len("".join(pieces).split())


def test_disconnected_stream_is_charged_exactly_what_its_worker_generated(
    client: OpenAI,
    stack: Stack,
    namespace: str,
    database_url: str,
    prompt_tokens: int,
    worker_chunks: list[WorkerChunks],
) -> None:
    stream = client.chat.completions.create(model=SIM_MODEL, messages=MESSAGES, max_tokens=2000, stream=True)
    chunks = iter(stream)
    first = next(chunks)
    job_id = job_of(first.id)
    published = WorkerChunks(stack.redis_url, Names(namespace).tokens_channel(job_id))
    worker_chunks.append(published)
    pieces = [first.choices[0].delta.content or ""]
    for chunk in chunks:
        pieces.append(chunk.choices[0].delta.content or "")
        if len(pieces) == 20:
            break
    stream.close()  # the client leaves; the worker goes on until the cancel reaches it
    final = published.final()
    assert final.finish_reason == "cancelled"
    assert final.usage is not None
    generated = final.usage.completion_tokens
    assert words(pieces) <= generated < 2000
    row = usage_row(database_url, job_id)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (prompt_tokens, generated)
    assert row["key_id"] is not None
    assert row["latency_ms"] is not None


def test_disconnected_choices_are_each_charged_their_own_tokens(
    client: OpenAI, database_url: str, prompt_tokens: int
) -> None:
    stream = client.chat.completions.create(model=SIM_MODEL, messages=MESSAGES, max_tokens=2000, n=2, stream=True)
    pieces: dict[int, list[str]] = {0: [], 1: []}
    job_id = ""
    for chunk in stream:
        job_id = job_of(chunk.id)
        for choice in chunk.choices:
            pieces[choice.index].append(choice.delta.content or "")
        if min(len(p) for p in pieces.values()) >= 10:
            break
    stream.close()
    row = usage_row(database_url, job_id)
    # Both jobs read the prompt; each generated at least what its client received, and stopped early.
    assert row["prompt_tokens"] == 2 * prompt_tokens
    assert words(pieces[0]) + words(pieces[1]) <= row["completion_tokens"] < 2 * 2000


def test_stream_resumed_by_another_worker_is_charged_once(
    client: OpenAI, stack: Stack, database_url: str, prompt_tokens: int
) -> None:
    model = "usage-failover"
    workers = [sim_worker(stack, f"usage-failover-{i}", model, AXON_SIM_ITL_MS="20") for i in range(2)]
    wait_listed(client, model)
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=120, stream=True, stream_options={"include_usage": True}
    )
    received, job_id, reported, killed = 0, "", None, False
    for chunk in stream:
        job_id = job_of(chunk.id)
        if chunk.usage is not None:
            reported = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            received += words([chunk.choices[0].delta.content])  # a chunk may carry several tokens
            if received >= 30 and not killed:
                holder(workers, model).kill()
                killed = True
    assert killed and reported is not None
    assert reported.completion_tokens == 120
    row = usage_row(database_url, job_id)
    # The 30-odd tokens the dead worker published are counted once, not again by the one that resumed.
    assert (row["prompt_tokens"], row["completion_tokens"]) == (prompt_tokens, 120)


def test_job_given_up_after_its_worker_died_is_charged_what_was_published(
    client: OpenAI, stack: Stack, database_url: str, prompt_tokens: int
) -> None:
    model = "usage-poison"
    env = {"AXON_SIM_ITL_MS": "20", "AXON_MAX_DELIVERIES": "1"}
    worker = sim_worker(stack, "usage-poison-0", model, **env)
    wait_listed(client, model)
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2000, stream=True)
    pieces: list[str] = []
    job_id = ""
    with pytest.raises(openai.APIError, match="could not be completed"):
        for chunk in stream:
            job_id = job_of(chunk.id)
            pieces.append(chunk.choices[0].delta.content or "")
            if len(pieces) == 15:
                worker.kill()
                # Its redelivery is one too many: the next worker ends the job with an error.
                sim_worker(stack, "usage-poison-1", model, **env)
    row = usage_row(database_url, job_id)
    # Every token published before the worker died reached the client, and nothing after.
    assert (row["prompt_tokens"], row["completion_tokens"]) == (prompt_tokens, words(pieces))


def test_client_gone_and_worker_dead_is_charged_what_the_worker_published(
    client: OpenAI, stack: Stack, namespace: str, database_url: str, prompt_tokens: int
) -> None:
    model = "usage-orphan"
    worker = sim_worker(stack, "usage-orphan-0", model, AXON_SIM_ITL_MS="20")
    wait_listed(client, model)
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2000, stream=True)
    pieces: list[str] = []
    job_id = ""
    for chunk in stream:
        job_id = job_of(chunk.id)
        pieces.append(chunk.choices[0].delta.content or "")
        if len(pieces) == 10:
            break
    worker.kill()  # no final chunk will come: the job waits in the queue for a worker of its model
    stream.close()
    started = time.monotonic()
    row = usage_row(database_url, job_id)
    waited_s = time.monotonic() - started
    # The session manager waited for a final chunk, then charged the worker's recorded progress.
    with redis.Redis.from_url(stack.redis_url) as client_of_redis:
        progress = client_of_redis.hgetall(Names(namespace).job_progress(job_id))
    assert progress[b"billed"] == b"1"
    published = int(progress[b"completion_tokens"])
    assert words(pieces) <= published < 2000
    assert (row["prompt_tokens"], row["completion_tokens"]) == (prompt_tokens, published)
    assert 3 < waited_s < 15


def test_answer_whose_session_manager_died_is_stopped_and_charged_what_was_generated(
    stack: Stack, usage_key: str, namespace: str, database_url: str, prompt_tokens: int
) -> None:
    victim = stack.start("sessions:usage-victim")
    gateway = stack.start("gateway:usage-victim", env={"AXON_SESSIONS_URL": victim.url})
    client = client_for(gateway, usage_key)
    stream = client.chat.completions.create(model=SIM_MODEL, messages=MESSAGES, max_tokens=300, stream=True)
    job_id = ""
    with pytest.raises(openai.APIError, match="interrupted"):
        for chunk in stream:
            if not job_id:
                job_id = job_of(chunk.id)
                victim.kill()  # nobody cancels the job, but nobody hears it either: its worker stops it
    # The worker records the row itself; the stack's other session manager persists it.
    row = usage_row(database_url, job_id, timeout_s=20)
    with redis.Redis.from_url(stack.redis_url) as client_of_redis:
        progress = client_of_redis.hgetall(Names(namespace).job_progress(job_id))
    assert progress[b"done"] == b"1"
    generated = int(progress[b"completion_tokens"])
    assert 1 <= generated < 300
    assert (row["prompt_tokens"], row["completion_tokens"]) == (prompt_tokens, generated)
    assert row["latency_ms"] is None
