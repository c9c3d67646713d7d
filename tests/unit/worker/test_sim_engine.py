"""services.worker.engines.sim.SimEngine with no latency: lengths, determinism, stops, abort."""

import asyncio

import pytest

from services.worker.engines.base import EngineOutput, GenerationRequest
from services.worker.engines.sim import SimEngine, sim_word
from shared.schemas import Message, Sampling


@pytest.fixture
async def engine() -> SimEngine:
    sim = SimEngine(model_name="sim", ttft_ms=0, itl_ms=0, max_seqs=4, context_tokens=4096)
    await sim.start()
    return sim


def request(*, request_id: str = "job-1", prompt: str = "tell me a story", **sampling: object) -> GenerationRequest:
    return GenerationRequest(request_id=request_id, sampling=Sampling(**sampling), prompt=prompt)


async def collect(engine: SimEngine, req: GenerationRequest) -> list[EngineOutput]:
    return [output async for output in engine.generate(req)]


def text_of(outputs: list[EngineOutput]) -> str:
    return "".join(o.text for o in outputs)


@pytest.mark.parametrize("max_tokens", [1, 2, 17])
async def test_emits_exactly_max_tokens_with_length_on_the_last(engine: SimEngine, max_tokens: int) -> None:
    outputs = await collect(engine, request(max_tokens=max_tokens, seed=1))
    assert len(outputs) == max_tokens
    assert sum(o.n_tokens for o in outputs) == max_tokens
    assert outputs[-1].finish_reason == "length"
    assert all(o.finish_reason is None for o in outputs[:-1])
    assert len(text_of(outputs).split(" ")) == max_tokens


async def test_completion_tokens_are_running_totals(engine: SimEngine) -> None:
    outputs = await collect(engine, request(max_tokens=6, seed=3))
    assert [o.completion_tokens for o in outputs] == [1, 2, 3, 4, 5, 6]
    assert {o.prompt_tokens for o in outputs} == {4}  # "tell me a story"


async def test_chat_messages_count_as_prompt(engine: SimEngine) -> None:
    req = GenerationRequest(
        request_id="chat",
        sampling=Sampling(max_tokens=2, seed=0),
        messages=[Message(role="user", content="hi there")],
    )
    outputs = await collect(engine, req)
    assert outputs[0].prompt_tokens == 3  # "user: hi there"


async def test_same_prompt_and_seed_give_the_same_text(engine: SimEngine) -> None:
    first = text_of(await collect(engine, request(request_id="a", max_tokens=12, seed=7)))
    second = text_of(await collect(engine, request(request_id="b", max_tokens=12, seed=7)))
    assert first == second


async def test_different_seed_or_prompt_gives_different_text(engine: SimEngine) -> None:
    base = text_of(await collect(engine, request(max_tokens=12, seed=7)))
    # 12 words from 20: a collision by chance is ~20**-12.
    assert text_of(await collect(engine, request(max_tokens=12, seed=8))) != base
    assert text_of(await collect(engine, request(max_tokens=12, seed=7, prompt="other"))) != base


async def test_text_is_the_documented_word_sequence(engine: SimEngine) -> None:
    # Word i depends only on prompt, seed and i: a resumed job continues where it stopped.
    outputs = await collect(engine, request(max_tokens=5, seed=11))
    words = [sim_word("tell me a story", 11, i) for i in range(5)]
    assert text_of(outputs) == " ".join(words)


def stop_word(prompt: str, seed: int, limit: int) -> tuple[str, int]:
    """A stop string " <word>" whose first match in the sim's output is word `index` (> 1)."""
    words = [sim_word(prompt, seed, i) for i in range(limit)]
    full = " ".join(words)
    for index in range(2, limit):
        stop = " " + words[index]
        start_of_word = len(" ".join(words[:index]))
        if full.find(stop) == start_of_word and full[start_of_word + len(stop) :][:1] in (" ", ""):
            return stop, index
    raise AssertionError("no usable stop word")  # pragma: no cover


@pytest.mark.parametrize("seed", [5, 6, 7])
async def test_stop_string_ends_with_stop_and_is_not_emitted(engine: SimEngine, seed: int) -> None:
    prompt = "tell me a story"
    stop, index = stop_word(prompt, seed, 40)
    outputs = await collect(engine, request(max_tokens=40, seed=seed, stop=[stop]))
    assert outputs[-1].finish_reason == "stop"
    assert all(o.finish_reason is None for o in outputs[:-1])
    assert text_of(outputs) == " ".join(sim_word(prompt, seed, i) for i in range(index))
    assert outputs[-1].completion_tokens == index + 1
    assert len(outputs) == index + 1


async def test_unmatched_stop_releases_held_text_at_the_end(engine: SimEngine) -> None:
    plain = text_of(await collect(engine, request(request_id="p", max_tokens=8, seed=2)))
    outputs = await collect(engine, request(request_id="s", max_tokens=8, seed=2, stop=["no such text here"]))
    assert outputs[-1].finish_reason == "length"
    assert text_of(outputs) == plain


async def test_abort_mid_stream_ends_with_cancelled(engine: SimEngine) -> None:
    outputs: list[EngineOutput] = []
    async for output in engine.generate(request(request_id="job-x", max_tokens=1000, seed=1)):
        outputs.append(output)
        if len(outputs) == 3:
            await engine.abort("job-x")
    assert len(outputs) == 4
    assert outputs[-1].finish_reason == "cancelled"
    assert outputs[-1].text == ""
    assert outputs[-1].n_tokens == 0
    assert outputs[-1].completion_tokens == 3
    assert all(o.finish_reason is None for o in outputs[:-1])


async def test_abort_from_another_task_affects_only_that_request() -> None:
    sim = SimEngine(model_name="sim", ttft_ms=0, itl_ms=1, max_seqs=4, context_tokens=4096)
    long = asyncio.create_task(collect(sim, request(request_id="victim", max_tokens=10_000, seed=1)))
    other = asyncio.create_task(collect(sim, request(request_id="bystander", max_tokens=20, seed=1)))
    await asyncio.sleep(0.01)
    await sim.abort("victim")
    victim_out, bystander_out = await asyncio.wait_for(asyncio.gather(long, other), timeout=5)
    assert victim_out[-1].finish_reason == "cancelled"
    assert len(victim_out) < 10_000
    assert bystander_out[-1].finish_reason == "length"
    assert len(bystander_out) == 20


async def test_request_id_can_be_reused_after_abort(engine: SimEngine) -> None:
    async for _ in engine.generate(request(request_id="again", max_tokens=50)):
        await engine.abort("again")
    outputs = await collect(engine, request(request_id="again", max_tokens=3))
    assert outputs[-1].finish_reason == "length"
    assert len(outputs) == 3
