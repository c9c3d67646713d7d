"""The CPU engine with the bundled SmolLM2 model, called directly (no services): constrained decoding,
forced tool calls, seeds, logit bias, logprobs and a constrained answer resumed mid-way.

One engine for the module, loading the model from its float32 copy in the run's model cache (as a
worker does; converted once per run); answers are short."""

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import jsonschema
import pytest

from services.worker.constraints import guide_for
from services.worker.engines.base import EngineOutput, GenerationRequest, Guide, InvalidPrompt, Resume
from services.worker.engines.gguf import bundled_gguf_path
from services.worker.engines.transformers_engine import TransformersEngine
from shared.schemas import FunctionSpec, Job, Message, NamedToolChoice, Sampling

# `alone` (make test runs it with no other test beside it): the real model keeps both cores busy.
pytestmark = [pytest.mark.model, pytest.mark.timeout(600), pytest.mark.alone]

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
}
ALICE = [Message(role="user", content="Describe Alice, who is 30 years old, as JSON with the keys name and age.")]
SEA = [Message(role="user", content="Write one sentence about the sea.")]
WEATHER = FunctionSpec(
    name="get_weather",
    description="The current weather in a city.",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
    },
)


@pytest.fixture(scope="module")
async def engine(cpu_model_cache: Path) -> AsyncIterator[TransformersEngine]:
    engine = TransformersEngine(
        model_name="SmolLM2-135M-Instruct",
        gguf_path=bundled_gguf_path(),
        max_seqs=8,
        kv_cache_blocks=64,
        max_batch_tokens=512,
        threads=None,
        model_cache_dir=cpu_model_cache,
    )
    await engine.start()
    yield engine
    await engine.stop()


async def answer(engine: TransformersEngine, request_id: str, **fields: object) -> list[EngineOutput]:
    return [out async for out in engine.generate(GenerationRequest(request_id=request_id, **fields))]  # type: ignore[arg-type]


def text_of(outputs: list[EngineOutput]) -> str:
    return "".join(out.text for out in outputs)


def test_the_model_loads_from_its_float32_copy_in_the_cache(engine: TransformersEngine, cpu_model_cache: Path) -> None:
    # The run's cache (beside, maybe, vLLM's bfloat16 copy: tests/conftest.py, vllm_model_cache).
    (copy,) = [p for p in cpu_model_cache.iterdir() if p.name.endswith("-float32")]
    assert copy.name.startswith(bundled_gguf_path().stem)
    assert engine._source() == {"pretrained_model_name_or_path": str(copy)}


async def test_a_json_schema_answer_parses_and_validates(engine: TransformersEngine) -> None:
    guide = Guide("json_schema", json.dumps(PERSON))
    outputs = await answer(
        engine, "schema", messages=ALICE, sampling=Sampling(temperature=0, max_tokens=64), guide=guide
    )
    person = json.loads(text_of(outputs))
    jsonschema.validate(person, PERSON)
    assert outputs[-1].finish_reason == "stop"


async def test_a_tool_forced_by_name_gets_valid_arguments(engine: TransformersEngine) -> None:
    job = Job(
        job_id="forced",
        model="m",
        channel="c",
        deadline=0,
        messages=[Message(role="user", content="What is the weather like in Paris?")],
        tools=[WEATHER],
        tool_choice=NamedToolChoice(name="get_weather"),
    )
    outputs = await answer(
        engine,
        "forced",
        messages=job.messages,
        tools=job.tools,
        guide=guide_for(job),
        sampling=Sampling(temperature=0, max_tokens=64),
    )
    arguments = json.loads(text_of(outputs))
    jsonschema.validate(arguments, WEATHER.parameters or {})


async def test_a_seed_gives_the_same_text_alone_and_in_a_batch_and_another_seed_another(
    engine: TransformersEngine,
) -> None:
    def seeded(seed: int) -> Sampling:
        return Sampling(temperature=1.0, seed=seed, max_tokens=24)

    alone = text_of(await answer(engine, "seed-a", messages=SEA, sampling=seeded(1234)))
    batched, _ = await asyncio.gather(
        answer(engine, "seed-b", messages=SEA, sampling=seeded(1234)),
        answer(engine, "seed-other", messages=ALICE, sampling=Sampling(temperature=1.0, max_tokens=24)),
    )
    other = text_of(await answer(engine, "seed-c", messages=SEA, sampling=seeded(99)))
    assert text_of(batched) == alone
    assert other != alone


async def test_logit_bias_of_minus_100_keeps_a_token_out(engine: TransformersEngine) -> None:
    plain = await answer(engine, "bias-plain", messages=SEA, sampling=Sampling(temperature=0, max_tokens=12))
    ids = [t for out in plain for t in out.token_ids]
    banned = ids[1]  # "sea"'s token in "The sea is ...": the greedy answer without it differs
    biased = await answer(
        engine, "bias", messages=SEA, sampling=Sampling(temperature=0, max_tokens=12, logit_bias={banned: -100.0})
    )
    biased_ids = [t for out in biased for t in out.token_ids]
    assert banned not in biased_ids
    assert text_of(biased) != text_of(plain)


async def test_logprobs_are_one_per_token_with_the_alternatives_asked_for(engine: TransformersEngine) -> None:
    outputs = await answer(
        engine, "logprobs", messages=SEA, sampling=Sampling(temperature=0, max_tokens=10), logprobs=3
    )
    logprobs = [lp for out in outputs for lp in out.logprobs]
    ids = [t for out in outputs for t in out.token_ids]
    assert len(logprobs) == len(ids) - (1 if outputs[-1].finish_reason == "stop" else 0)
    assert "".join(lp.token for lp in logprobs) == text_of(outputs)
    for lp in logprobs:
        assert -9999.0 <= lp.logprob <= 0.0
        assert bytes(lp.bytes or []).decode() == lp.token
        assert len(lp.top_logprobs) == 3
        assert [t.logprob for t in lp.top_logprobs] == sorted((t.logprob for t in lp.top_logprobs), reverse=True)
        assert lp.top_logprobs[0].token == lp.token  # greedy: the most likely token is the one taken
        assert lp.top_logprobs[0].logprob == pytest.approx(lp.logprob)


async def test_a_constrained_answer_resumed_from_its_first_tokens_is_the_uninterrupted_one(
    engine: TransformersEngine,
) -> None:
    guide = Guide("json_schema", json.dumps(PERSON))
    whole = await answer(
        engine, "resume-ref", messages=ALICE, sampling=Sampling(temperature=0, max_tokens=64), guide=guide
    )
    ids = [t for out in whole for t in out.token_ids]
    k = len(ids) // 2
    rest = await answer(
        engine,
        "resume-rest",
        messages=ALICE,
        sampling=Sampling(temperature=0, max_tokens=64 - k),
        guide=guide,
        resume=Resume(text="", token_ids=tuple(ids[:k]), completion_tokens=k),
    )
    assert ids[:k] + [t for out in rest for t in out.token_ids] == ids
    assert engine._decode(ids[:k]) + text_of(rest) == text_of(whole)


async def test_echo_with_logprobs_scores_the_prompt_as_generation_scores_its_tokens(engine: TransformersEngine) -> None:
    prompt = "The capital of France is"
    generated = await answer(engine, "gen", prompt=prompt, sampling=Sampling(temperature=0, max_tokens=6), logprobs=2)
    echoed = await answer(
        engine, "echo", prompt=prompt, sampling=Sampling(temperature=0, max_tokens=6), logprobs=2, echo=True
    )
    prompt_ids = engine._encode(GenerationRequest(request_id="x", sampling=Sampling(), prompt=prompt))
    first = echoed[0].prompt_logprobs
    assert len(first) == len(prompt_ids) - 1  # the first token has nothing before it
    assert prompt.endswith("".join(lp.token for lp in first))
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in first)
    assert all(not out.prompt_logprobs for out in echoed[1:])
    assert text_of(echoed) == text_of(generated)
    # The prompt's scores come from another forward pass than generation's: the same model, the same
    # numbers. Scored as a prompt, the generated tokens get the logprobs generation gave them.
    ids = [t for out in generated for t in out.token_ids]
    rescored = engine._lanes[None].scorer.score(prompt_ids + ids, 2)[len(prompt_ids) - 1 :]
    generation = [lp.logprob for out in generated for lp in out.logprobs]
    assert [token for token, _, _ in rescored][: len(generation)] == ids[: len(generation)]
    assert [logprob for _, logprob, _ in rescored][: len(generation)] == pytest.approx(generation, abs=1e-3)


async def test_a_prompt_that_leaves_no_room_is_openais_context_length_exceeded(engine: TransformersEngine) -> None:
    words, few = "sea " * (engine.context_tokens + 10), Sampling(max_tokens=4)
    with pytest.raises(InvalidPrompt) as refused:
        await answer(engine, "too-long-chat", messages=[Message(role="user", content=words)], sampling=few)
    assert (refused.value.param, refused.value.code) == ("messages", "context_length_exceeded")
    assert str(engine.context_tokens) in str(refused.value)
    with pytest.raises(InvalidPrompt) as refused:
        await answer(engine, "too-long-prompt", prompt=words, sampling=few)
    assert (refused.value.param, refused.value.code) == ("prompt", "context_length_exceeded")
