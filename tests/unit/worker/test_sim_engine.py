"""services.worker.engines.sim.SimEngine with no latency: lengths, determinism, stops, abort; JSON
valid against the guide's schema, tool calls, logprobs, echo, exact resumption."""

import asyncio
import json
import math
import time
from typing import Any

import jsonschema
import pytest

from services.worker.constraints import required_tools_schema
from services.worker.engines.base import EngineOutput, GenerationRequest, Guide, InvalidPrompt, Resume
from services.worker.engines.sim import SimEngine, sim_word
from services.worker.tool_parsers import AutoCallsParser, RequiredCallsParser
from shared.schemas import FunctionCall, FunctionSpec, Message, Sampling, ToolCall


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
    assert engine.count_prompt_tokens(req) == 3  # what `/v1/messages/count_tokens` answers


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
    assert outputs[-1].stop_sequence == stop  # the Messages API's `stop_sequence`


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


# --- JSON, tool calls, logprobs ----------------------------------------------------------------

WEATHER = FunctionSpec(
    name="get_weather",
    parameters={
        "type": "object",
        "properties": {
            "city": {"type": "string", "minLength": 3},
            "unit": {"enum": ["c", "f"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
)
TIME = FunctionSpec(name="get_time", parameters={"type": "object", "properties": {"tz": {"type": "string"}}})
PING = FunctionSpec(name="ping")

SCHEMAS: list[dict[str, Any]] = [
    # What pydantic writes for nested models, optional fields and lists (instructor, LangChain, parse()).
    {
        "$defs": {
            "Address": {
                "properties": {"street": {"title": "Street", "type": "string"}, "zip": {"type": "string"}},
                "required": ["street", "zip"],
                "title": "Address",
                "type": "object",
                "additionalProperties": False,
            },
            "Kind": {"enum": ["home", "work"], "title": "Kind", "type": "string"},
        },
        "properties": {
            "name": {"title": "Name", "type": "string"},
            "age": {"exclusiveMinimum": 0, "maximum": 130, "title": "Age", "type": "integer"},
            "score": {"type": "number", "minimum": 0.5, "exclusiveMaximum": 1},
            "address": {"$ref": "#/$defs/Address"},
            "kind": {"$ref": "#/$defs/Kind", "default": "home"},
            "nickname": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
            "tags": {"items": {"type": "string", "maxLength": 4}, "type": "array", "minItems": 2, "maxItems": 3},
            "ids": {"type": "array", "items": {"type": "integer", "multipleOf": 5}, "uniqueItems": True},
            "active": {"type": "boolean"},
            "when": {"type": "string", "format": "date-time"},
            "token": {"type": "string", "format": "uuid"},
            "nothing": {"type": "null"},
        },
        "required": ["name", "age", "score", "address", "kind", "tags", "active", "when", "token"],
        "title": "Person",
        "type": "object",
        "additionalProperties": False,
    },
    {"type": "array", "prefixItems": [{"const": "v1"}, {"type": ["integer", "null"]}], "minItems": 2, "maxItems": 2},
    {"oneOf": [{"type": "string", "enum": ["x"]}, {"type": "integer"}]},
    {
        "allOf": [
            {"properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"properties": {"b": {"const": 1}}, "required": ["b"]},
        ]
    },
    # A recursive schema: a tree.
    {
        "$defs": {
            "Node": {
                "type": "object",
                "properties": {
                    "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}},
                    "v": {"type": "integer"},
                },
                "required": ["v", "children"],
            }
        },
        "$ref": "#/$defs/Node",
    },
]


def guided(schema: dict[str, Any] | None, **fields: Any) -> GenerationRequest:
    guide = Guide("json_object") if schema is None else Guide("json_schema", json.dumps(schema))
    sampling = {"max_tokens": 2000, "seed": 1, **fields.pop("sampling", {})}
    return GenerationRequest(request_id="g", sampling=Sampling(**sampling), prompt="make json", guide=guide, **fields)


def test_the_simulator_declares_what_it_honours() -> None:
    assert SimEngine.supports == {"tools", "response_format", "logprobs", "seed", "stop", "echo"}


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
async def test_guided_answers_are_json_valid_against_the_schema(engine: SimEngine, index: int, seed: int) -> None:
    schema = SCHEMAS[index]
    outputs = await collect(engine, guided(schema, sampling={"seed": seed}))
    jsonschema.validate(json.loads(text_of(outputs)), schema)
    assert outputs[-1].finish_reason == "stop"
    assert all(o.finish_reason is None for o in outputs[:-1])
    assert all(o.n_tokens == 1 and len(o.text) <= 7 for o in outputs)  # short pieces, one per token
    assert outputs[-1].completion_tokens == len(outputs)


async def test_json_object_answers_are_a_small_object(engine: SimEngine) -> None:
    value = json.loads(text_of(await collect(engine, guided(None))))
    assert isinstance(value, dict) and value


async def test_guided_answers_depend_on_prompt_and_seed(engine: SimEngine) -> None:
    texts = {text_of(await collect(engine, guided(SCHEMAS[0], sampling={"seed": s}))) for s in (1, 1, 2, 3)}
    assert len(texts) == 3


async def test_a_guided_answer_cut_by_max_tokens_ends_with_length(engine: SimEngine) -> None:
    whole = text_of(await collect(engine, guided(SCHEMAS[0])))
    outputs = await collect(engine, guided(SCHEMAS[0], sampling={"max_tokens": 5}))
    assert len(outputs) == 5 and outputs[-1].finish_reason == "length"
    assert whole.startswith(text_of(outputs))


# Issue 29's schema: 10^9 strings of 10^9 letters (it held the worker's event loop until killed).
ISSUE_29 = {"type": "array", "minItems": 1_000_000_000, "items": {"type": "string", "minLength": 1_000_000_000}}


@pytest.mark.parametrize(
    "make",
    [
        lambda: guided(SCHEMAS[0]),
        lambda: request(max_tokens=30, seed=4),
        lambda: guided(ISSUE_29, sampling={"max_tokens": 40}),
    ],
)
async def test_a_resumed_answer_continues_exactly(engine: SimEngine, make: Any) -> None:
    whole = await collect(engine, make())
    for done in (1, 7, len(whole) - 1):
        first = whole[:done]
        rest = make()
        resume = Resume(text_of(first), (), done)
        sampling = rest.sampling.model_copy(update={"max_tokens": rest.sampling.max_tokens - done})
        rest = GenerationRequest(
            request_id=rest.request_id, sampling=sampling, prompt=rest.prompt, guide=rest.guide, resume=resume
        )
        after = await collect(engine, rest)
        assert text_of(first) + text_of(after) == text_of(whole)
        assert after[-1].finish_reason == whole[-1].finish_reason


@pytest.mark.parametrize(
    ("schema", "max_tokens"),
    [
        (ISSUE_29, 50),
        ({"type": "string", "minLength": 1_000_000_000}, 2000),
        (
            {
                "type": "object",
                "properties": {"a": {"type": "array", "minItems": 10**9, "items": {}}},
                "required": ["a"],
            },
            300,
        ),
        # 10^15 strings through references.
        (
            {
                "$defs": {
                    **{
                        f"d{i}": {"type": "array", "minItems": 1000, "items": {"$ref": f"#/$defs/d{i + 1}"}}
                        for i in range(5)
                    },
                    "d5": {"type": "string"},
                },
                "$ref": "#/$defs/d0",
            },
            2000,
        ),
    ],
)
async def test_a_value_is_built_only_as_far_as_max_tokens_reach(
    engine: SimEngine, schema: dict[str, Any], max_tokens: int
) -> None:
    began = time.perf_counter()
    outputs = await collect(engine, guided(schema, sampling={"max_tokens": max_tokens}))
    assert time.perf_counter() - began < 2
    assert len(outputs) == max_tokens and outputs[-1].finish_reason == "length"


async def test_a_value_that_fits_still_ends_stop_and_is_valid(engine: SimEngine) -> None:
    """The cheap branch of an anyOf whose other asks for 10^9 letters: whole answers end `stop`;
    the others are cut at max_tokens."""
    schema = {"anyOf": [{"type": "string", "minLength": 1_000_000_000}, {"type": "integer"}]}
    reasons = set()
    for seed in range(8):
        outputs = await collect(engine, guided(schema, sampling={"max_tokens": 300, "seed": seed}))
        reasons.add(outputs[-1].finish_reason)
        if outputs[-1].finish_reason == "stop":
            jsonschema.validate(json.loads(text_of(outputs)), schema)
        else:
            assert len(outputs) == 300
    assert reasons == {"stop", "length"}


async def test_distinct_items_stop_when_the_values_run_out(engine: SimEngine) -> None:
    schema = {"type": "array", "uniqueItems": True, "minItems": 10**9, "items": {"enum": ["a", "b", "c"]}}
    outputs = await collect(engine, guided(schema, sampling={"max_tokens": 10_000}))
    assert sorted(json.loads(text_of(outputs))) == ["a", "b", "c"] and outputs[-1].finish_reason == "stop"


async def test_the_event_loop_runs_on_while_a_large_value_is_built() -> None:
    """A value of 300,000 tokens of nested arrays takes the simulator most of a second to build: on
    a thread, so the worker's loop (its /health, the other answers) goes on meanwhile."""
    sim = SimEngine(model_name="sim", ttft_ms=0, itl_ms=0, max_seqs=4, context_tokens=400_000)
    await sim.start()
    nested = {
        "type": "array",
        "minItems": 1000,
        "items": {"type": "array", "minItems": 1000, "items": {"type": "integer"}},
    }
    gaps: list[float] = []

    async def tick() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    began = time.perf_counter()
    first = await anext(sim.generate(guided(nested, sampling={"max_tokens": 300_000})))
    built_s = time.perf_counter() - began
    ticker.cancel()
    assert first.text == "[[" and built_s > 0.2
    assert max(gaps) < 0.2, (built_s, max(gaps))


def chat(tools: list[FunctionSpec], *messages: Message, **fields: Any) -> GenerationRequest:
    return GenerationRequest(
        request_id="t",
        sampling=Sampling(max_tokens=500, **fields),
        messages=list(messages) or [Message(role="user", content="weather?")],
        tools=tools,
    )


async def test_with_tools_the_answer_is_a_call_of_one_of_them(engine: SimEngine) -> None:
    names = set()
    for seed in range(12):
        outputs = await collect(engine, chat([WEATHER, TIME, PING], seed=seed))
        assert outputs[-1].finish_reason == "stop"
        parser = AutoCallsParser("t", single=False)
        content, deltas = parser.feed(text_of(outputs))
        more, rest = parser.finish()
        assert content + more == "" and len(deltas + rest) == 1
        function = deltas[0].function
        assert function is not None and function.name is not None and function.arguments is not None
        tool = {t.name: t for t in (WEATHER, TIME, PING)}[function.name]
        jsonschema.validate(json.loads(function.arguments), tool.parameters or {"type": "object"})
        names.add(function.name)
    assert len(names) == 3  # the tool depends on prompt and seed


async def test_after_a_tool_result_the_answer_is_words(engine: SimEngine) -> None:
    call = ToolCall(id="call_1", function=FunctionCall(name="get_time", arguments="{}"))
    outputs = await collect(
        engine,
        chat(
            [TIME],
            Message(role="user", content="time?"),
            Message(role="assistant", content="", tool_calls=[call]),
            Message(role="tool", content="12:00", tool_call_id="call_1"),
            seed=1,
        ),
    )
    assert len(outputs) == 500 and outputs[-1].finish_reason == "length"
    assert "<tool_call>" not in text_of(outputs)


async def test_a_required_call_schema_gives_calls_the_required_parser_reads(engine: SimEngine) -> None:
    schema = required_tools_schema([WEATHER, TIME], parallel=True)
    outputs = await collect(engine, guided(schema, tools=[WEATHER, TIME]))
    calls = json.loads(text_of(outputs))
    jsonschema.validate(calls, schema)
    parser = RequiredCallsParser("g", single=False)
    _, deltas = parser.feed(text_of(outputs))
    assert [d.function.name for d in deltas if d.function is not None and d.id] == [c["name"] for c in calls]


async def test_a_schema_that_is_not_json_is_an_invalid_prompt(engine: SimEngine) -> None:
    req = GenerationRequest(request_id="x", sampling=Sampling(), prompt="p", guide=Guide("json_schema", "{nope"))
    with pytest.raises(InvalidPrompt):
        await collect(engine, req)


@pytest.mark.parametrize("top", [0, 3, 20])
async def test_logprobs_are_well_formed(engine: SimEngine, top: int) -> None:
    outputs = await collect(engine, GenerationRequest("l", Sampling(max_tokens=8, seed=2), prompt="p", logprobs=top))
    for out in outputs:
        (entry,) = out.logprobs
        assert entry.token == out.text and entry.bytes == list(out.text.encode())
        assert entry.logprob < 0
        assert len(entry.top_logprobs) == top
        assert len({t.token for t in entry.top_logprobs}) == top
        if top:
            assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert sum(math.exp(t.logprob) for t in entry.top_logprobs) <= 1
        assert all(t.bytes == list(t.token.encode()) for t in entry.top_logprobs)
        assert out.prompt_logprobs == ()
    again = await collect(engine, GenerationRequest("l", Sampling(max_tokens=8, seed=2), prompt="p", logprobs=top))
    assert [o.logprobs for o in again] == [o.logprobs for o in outputs]


async def test_no_logprobs_unless_asked(engine: SimEngine) -> None:
    assert all(o.logprobs == () for o in await collect(engine, request(max_tokens=3)))


async def test_echo_gives_the_prompts_logprobs_first(engine: SimEngine) -> None:
    prompt = "Once upon  a time\n"
    req = GenerationRequest("e", Sampling(max_tokens=3), prompt=prompt, logprobs=1, echo=True)
    outputs = await collect(engine, req)
    assert "".join(t.token for t in outputs[0].prompt_logprobs) == prompt
    assert all(len(t.top_logprobs) == 1 for t in outputs[0].prompt_logprobs)
    assert all(o.prompt_logprobs == () for o in outputs[1:])


# --- prefix cache ----------------------------------------------------------------------------


def turn(request_id: str, messages: list[Message], max_tokens: int = 40) -> GenerationRequest:
    return GenerationRequest(request_id=request_id, sampling=Sampling(max_tokens=max_tokens, seed=5), messages=messages)


def words(count: int, tag: str) -> str:
    return " ".join(f"{tag}{i}" for i in range(count))


async def cached_engine(kv_blocks: int = 4096, prefill_us_per_token: float = 0) -> SimEngine:
    sim = SimEngine(
        model_name="sim",
        ttft_ms=0,
        itl_ms=0,
        max_seqs=4,
        context_tokens=1 << 20,
        kv_blocks=kv_blocks,
        prefill_us_per_token=prefill_us_per_token,
    )
    await sim.start()
    return sim


async def test_the_next_turn_finds_this_turns_prompt_and_answer_cached() -> None:
    sim = await cached_engine()
    first = [Message(role="system", content=words(30, "s")), Message(role="user", content=words(70, "u"))]
    turn1 = await collect(sim, turn("t1", first))
    assert {o.cached_tokens for o in turn1} == {0}
    answer = text_of(turn1)
    second = [*first, Message(role="assistant", content=answer), Message(role="user", content=words(50, "v"))]
    turn2 = await collect(sim, turn("t2", second))
    # Turn 1's prompt ("system:" + 30 + "user:" + 70 words), the marker and its 40-word answer:
    # 143 tokens, 8 full blocks.
    assert turn2[-1].cached_tokens == 128
    assert turn2[-1].prompt_tokens == 143 + 1 + 50
    assert {o.cached_tokens for o in turn2} == {128}


async def test_the_cache_changes_no_text() -> None:
    sim = await cached_engine()
    req = turn("same", [Message(role="user", content=words(100, "w"))])
    cold, warm = await collect(sim, req), await collect(sim, req)
    assert (cold[-1].cached_tokens, warm[-1].cached_tokens) == (0, 96)  # never the prompt's last token
    assert text_of(cold) == text_of(warm)
    plain = await cached_engine(kv_blocks=0)
    assert text_of(await collect(plain, req)) == text_of(cold)


async def test_a_completion_prompt_is_cached_block_by_block() -> None:
    sim = await cached_engine()
    await collect(sim, request(prompt=words(40, "p"), max_tokens=1))
    longer = await collect(sim, request(request_id="b", prompt=words(40, "p") + " " + words(40, "q"), max_tokens=1))
    assert longer[-1].cached_tokens == 32  # the first prompt's two full blocks; its tail is recomputed
    other = await collect(sim, request(request_id="c", prompt=words(40, "x"), max_tokens=1))
    assert other[-1].cached_tokens == 0


async def test_no_cache_and_lru_eviction() -> None:
    off = await cached_engine(kv_blocks=0)
    req = request(prompt=words(64, "p"), max_tokens=1)
    await collect(off, req)
    assert (await collect(off, req))[-1].cached_tokens == 0
    small = await cached_engine(kv_blocks=4)
    await collect(small, request(prompt=words(65, "a"), max_tokens=1))  # 4 blocks: the whole cache
    assert (await collect(small, request(prompt=words(65, "a"), max_tokens=1)))[-1].cached_tokens == 64
    await collect(small, request(prompt=words(33, "b"), max_tokens=1))  # evicts a's two last blocks
    # Its start is left (vLLM frees a prompt's blocks tail first).
    assert (await collect(small, request(prompt=words(65, "a"), max_tokens=1)))[-1].cached_tokens == 32
    assert len(small.prefix_cache) == 4


async def test_time_to_first_token_pays_only_for_uncached_tokens() -> None:
    sim = await cached_engine(prefill_us_per_token=1000)  # 1 ms per uncached token
    req = request(prompt=words(200, "t"), max_tokens=1)

    async def first_token_s() -> float:
        started = time.perf_counter()
        await collect(sim, req)
        return time.perf_counter() - started

    cold = await first_token_s()
    warm = await first_token_s()  # 192 of 200 tokens cached: 8 ms
    assert cold >= 0.2
    assert warm < 0.1
