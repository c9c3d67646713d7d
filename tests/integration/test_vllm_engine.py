"""The vLLM engine for real: vLLM's CPU build serving the bundled SmolLM2 (converted from its GGUF) in
this process, one engine for the module, with a random LoRA adapter made by peft.

What crosses the engine's boundary is checked against what vLLM does with it: the outputs'
running totals, logprobs and prefix-cache hits, refusals naming the parameter at fault, an answer
resumed from its tokens continuing exactly, vLLM's hermes parser reading a tool call the model
really writes, cancellation within a step. The whole stack around it: tests/e2e/test_vllm_engine.py.
"""

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.worker.engines.base import EngineError, EngineOutput, GenerationRequest, Guide, InvalidPrompt, Resume
from services.worker.engines.gguf import bundled_gguf_path, converted_model
from services.worker.engines.vllm_config import VllmOptions
from services.worker.engines.vllm_engine import VllmEngine
from services.worker.engines.vllm_tools import VllmToolCallParser
from shared.schemas import FunctionCall, FunctionSpec, Job, Message, Sampling, ToolCall
from tests.models import random_lora

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

MODEL = "smollm2-vllm-engine"
ADAPTER = "smollm2-vllm-engine-lora"
FRANCE = [Message(role="user", content="What is the capital of France?")]
CITY = {"type": "object", "properties": {"city": {"type": "string"}, "rank": {"type": "integer"}}, "required": ["city"]}
WEATHER = FunctionSpec(
    name="get_weather",
    description="The weather in a city.",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)


def weather_call(index: int, city: str) -> Message:
    arguments = json.dumps({"city": city})
    call = ToolCall(id=f"call_{index}", function=FunctionCall(name="get_weather", arguments=arguments))
    return Message(role="assistant", content="", tool_calls=[call])


# Hand-written assistant turns that called the tool: the 135M model then writes a call of its own.
FEW_SHOT = [
    *(
        m
        for i, city in enumerate(["Paris", "Rome", "Oslo"])
        for m in (Message(role="user", content=f"Weather in {city}?"), weather_call(i, city))
    ),
    Message(role="user", content="Weather in Berlin?"),
]


class Started:
    def __init__(self, engine: VllmEngine, ticks_while_loading: int, start_s: float) -> None:
        self.engine = engine
        self.ticks_while_loading = ticks_while_loading
        self.start_s = start_s


@pytest.fixture(scope="module")
async def started(vllm_model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Started]:
    adapter = random_lora(tmp_path_factory.mktemp("lora") / ADAPTER)
    options = VllmOptions(
        model_name=MODEL, model_path=str(bundled_gguf_path()), max_seqs=8, lora_adapters={ADAPTER: str(adapter)}
    )
    engine = VllmEngine(options, model_cache_dir=vllm_model_cache)
    ticks = 0
    began = time.monotonic()
    start = asyncio.create_task(engine.start())
    while not start.done():  # the event loop keeps running while vLLM loads (a worker answers /health)
        await asyncio.sleep(0.1)
        ticks += 1
    await start
    try:
        yield Started(engine, ticks, time.monotonic() - began)
    finally:
        await engine.stop()


@pytest.fixture
def engine(started: Started) -> VllmEngine:
    return started.engine


_ids = iter(range(10**6))


def request(**kwargs: object) -> GenerationRequest:
    sampling = kwargs.pop("sampling", Sampling(max_tokens=24, temperature=0))
    return GenerationRequest(request_id=f"r{next(_ids)}", sampling=sampling, **kwargs)  # type: ignore[arg-type]


async def run(engine: VllmEngine, req: GenerationRequest) -> list[EngineOutput]:
    return [out async for out in engine.generate(req)]


def text_of(outs: list[EngineOutput]) -> str:
    return "".join(o.text for o in outs)


def test_start_reads_what_vllm_settled_on(started: Started, vllm_model_cache: Path) -> None:
    engine = started.engine
    assert (engine.context_tokens, engine.max_seqs) == (8192, 8)
    assert engine.adapters == {ADAPTER} and engine.reports_kv_cache and engine.name == "vllm"
    assert started.ticks_while_loading >= 0.5 * started.start_s / 0.1
    names = {family.name for family in engine.metrics()}
    assert {"vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits"} <= names
    # The bundled GGUF was converted once, into the cache; asking again converts nothing.
    (converted,) = [p for p in vllm_model_cache.iterdir() if not p.name.startswith(".")]
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= {
        p.name for p in converted.iterdir()
    }
    began = time.monotonic()
    assert converted_model(bundled_gguf_path(), vllm_model_cache) == converted
    assert time.monotonic() - began < 2


async def test_a_greedy_answer_streams_with_running_totals(engine: VllmEngine) -> None:
    outs = await run(engine, request(messages=FRANCE))
    assert "Paris" in text_of(outs)
    assert outs[-1].finish_reason == "stop" and all(o.finish_reason is None for o in outs[:-1])
    assert [o.completion_tokens for o in outs] == list(__import__("itertools").accumulate(o.n_tokens for o in outs))
    assert sum(len(o.token_ids) for o in outs) == outs[-1].completion_tokens
    assert outs[-1].prompt_tokens > 20  # the chat template's system turn and markers


async def test_logprobs_come_with_each_token_and_echo_with_the_prompts_once(engine: VllmEngine) -> None:
    outs = await run(engine, request(messages=FRANCE, logprobs=2))
    for out in outs:
        assert len(out.logprobs) == out.n_tokens
        for lp in out.logprobs:
            assert len(lp.top_logprobs) == 2 and lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob
            assert lp.logprob <= 0 and lp.bytes == list(lp.token.encode())
    # Every token's, the end-of-turn token's too (its text is not in the answer), as vLLM's server has it.
    assert "".join(lp.token for o in outs for lp in o.logprobs) == text_of(outs) + "<|im_end|>"
    echoed = await run(engine, request(prompt="The capital of France is", logprobs=1, echo=True))
    assert len(echoed[0].prompt_logprobs) == echoed[0].prompt_tokens - 1  # none for the first token
    assert all(o.prompt_logprobs == () for o in echoed[1:])


async def test_a_repeated_long_prompt_comes_from_vllms_prefix_cache(engine: VllmEngine) -> None:
    long = [Message(role="user", content="Summarise: " + "The river runs to the sea. " * 60)]
    first = await run(engine, request(messages=long, sampling=Sampling(max_tokens=2, temperature=0)))
    again = await run(engine, request(messages=long, sampling=Sampling(max_tokens=2, temperature=0)))
    assert first[-1].prompt_tokens > 400
    assert again[-1].cached_tokens >= 256  # whole 128-token blocks of the prompt


async def test_vllms_refusals_name_the_parameter_at_fault(engine: VllmEngine) -> None:
    cases = [
        (request(messages=[Message(role="user", content="hi " * 9000)]), "messages", "context_length_exceeded"),
        (request(prompt="hi " * 9000), "prompt", "context_length_exceeded"),
        (request(messages=FRANCE, sampling=Sampling(logit_bias={10**6: 5.0})), "logit_bias", None),
        (
            request(messages=FRANCE, guide=Guide("json_schema", '{"type": "string", "pattern": "(?<=a)b"}')),
            "response_format",
            None,
        ),
        (
            request(messages=FRANCE, guide=Guide("json_schema", '{"type": "string", "pattern": "(?<=a)b"}', "tools")),
            "tools",
            None,
        ),
    ]
    for req, param, code in cases:
        with pytest.raises(InvalidPrompt) as info:
            await run(engine, req)
        assert (info.value.param, info.value.code) == (param, code), str(info.value)


async def test_a_hostile_schema_is_generated_within_the_request_budget(engine: VllmEngine) -> None:
    hostile = {"type": "array", "minItems": 1000000000, "items": {"type": "string", "minLength": 1000000000}}
    outs = await asyncio.wait_for(
        run(engine, request(messages=FRANCE, guide=Guide("json_schema", json.dumps(hostile)))), timeout=60
    )
    assert outs[-1].finish_reason == "length" and outs[-1].completion_tokens == 24


@pytest.mark.parametrize("guided", [False, True])
async def test_an_answer_resumed_from_its_tokens_continues_exactly(engine: VllmEngine, guided: bool) -> None:
    guide = Guide("json_schema", json.dumps(CITY)) if guided else None
    whole = await run(engine, request(messages=FRANCE, guide=guide, sampling=Sampling(max_tokens=40, temperature=0)))
    tokens = [t for o in whole for t in o.token_ids]
    cut = len(tokens) // 2
    sent = engine._tokenizer.decode(tokens[:cut])
    resume = Resume(text=sent, token_ids=tuple(tokens[:cut]), completion_tokens=cut)
    rest = await run(
        engine,
        request(messages=FRANCE, guide=guide, resume=resume, sampling=Sampling(max_tokens=40 - cut, temperature=0)),
    )
    assert sent + text_of(rest) == text_of(whole)
    assert [t for o in rest for t in o.token_ids] == tokens[cut:]
    assert rest[-1].completion_tokens == len(tokens) - cut
    assert rest[-1].finish_reason == whole[-1].finish_reason


async def test_a_resumed_constrained_answer_that_comes_out_different_fails(engine: VllmEngine) -> None:
    resume = Resume(text='{"nowhere', token_ids=(), completion_tokens=3)
    with pytest.raises(EngineError, match="could not be resumed"):
        await run(engine, request(messages=FRANCE, guide=Guide("json_schema", json.dumps(CITY)), resume=resume))


async def test_tool_choice_auto_is_read_by_vllms_hermes_parser(engine: VllmEngine) -> None:
    job = Job(
        job_id="job-tools", model=MODEL, channel="c", deadline=time.time() + 60, messages=FEW_SHOT, tools=[WEATHER]
    )
    parser = engine.tool_call_parser(job)
    assert isinstance(parser, VllmToolCallParser)
    outs = await run(
        engine, request(messages=FEW_SHOT, tools=[WEATHER], sampling=Sampling(max_tokens=60, temperature=0))
    )
    assert outs[-1].finish_reason == "stop"
    content, deltas = parser.feed(text_of(outs))
    rest, last = parser.finish()
    calls = deltas + last
    assert (content + rest).strip() == "" and parser.called
    assert calls[0].function is not None and calls[0].function.name == "get_weather"
    arguments = "".join(d.function.arguments or "" for d in calls if d.function is not None)
    assert json.loads(arguments) == {"city": "Berlin"}


async def test_the_lora_adapter_changes_the_answer(engine: VllmEngine) -> None:
    # One after the other: in bfloat16 a batch's composition may change a greedy answer by itself.
    story = [Message(role="user", content="Tell me a story about a dog.")]
    base = await run(engine, request(messages=story, logprobs=0))
    adapted = await run(engine, request(messages=story, logprobs=0, adapter=ADAPTER))
    assert text_of(adapted) != text_of(base)
    assert adapted[0].logprobs[0].logprob != base[0].logprobs[0].logprob
    again = await run(engine, request(messages=story, logprobs=0, adapter=ADAPTER))
    assert text_of(again) == text_of(adapted)


async def test_abort_ends_the_answer_within_a_step(engine: VllmEngine) -> None:
    req = request(messages=FRANCE, sampling=Sampling(max_tokens=2000, temperature=0, ignore_eos=True))
    outs: list[EngineOutput] = []
    aborted_at = 0.0
    async for out in engine.generate(req):
        outs.append(out)
        if len(outs) == 3:
            aborted_at = time.monotonic()
            await engine.abort(req.request_id)
    assert outs[-1].finish_reason == "cancelled"
    assert time.monotonic() - aborted_at < 1.0
    assert outs[-1].completion_tokens < 100
