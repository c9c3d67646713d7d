"""services.worker.engines.vllm_engine and vllm_tools: what crosses into vLLM and back.

vLLM is not installed here (and needs a GPU): the tests put small fakes of the vLLM modules the
engine imports into `sys.modules` for the duration of a test, shaped after vLLM's public API
(`AsyncLLM`, `AsyncEngineArgs`, `StructuredOutputsConfig`, `SamplingParams`,
`StructuredOutputsParams`, `RequestOutputKind`, `ToolParserManager`, `ChatCompletionRequest`,
`Logprob`, `LoRARequest`), and check what the engine hands them and what it makes of their answers.
"""

import asyncio
import enum
import importlib.util
import json
import os
import random
import re
import sys
import time
import types
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, get_args

import pytest

from services.worker.engines.base import Engine, EngineError, GenerationRequest, Guide, InvalidPrompt, Resume
from services.worker.engines.factory import create_engine
from services.worker.engines.vllm_engine import (
    PrefixReplay,
    ReplayDiverged,
    VllmEngine,
    chat_conversation,
    finish_reason,
    replay_seed,
    sampling_kwargs,
    structured_outputs_kwargs,
    token_logprob,
)
from services.worker.engines.vllm_tools import Segmenter, Specials, VllmToolCallParser
from services.worker.settings import WorkerSettings
from services.worker.tools import tool_call_id
from shared.schemas import (
    Capability,
    FunctionCall,
    FunctionSpec,
    Job,
    Message,
    NamedToolChoice,
    Sampling,
    ToolCall,
    ToolCallDelta,
)

# --- fakes of vLLM's classes -------------------------------------------------------------------

START, END, EOS = "<tool_call>", "</tool_call>", "<|im_end|>"
BOS = 1
ADDED = {START: 1000, END: 1001, EOS: 1002}


@dataclass
class FakeLogprob:
    """vllm.logprobs.Logprob."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class FakeTokenizer:
    """One token per character (its code point), the added tokens whole, BOS = 1."""

    def __init__(self, added: dict[str, int] | None = None) -> None:
        self.added = ADDED if added is None else added
        self.templates: list[dict[str, Any]] = []
        self.template_error: Exception | None = None
        self.unfit = False

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [BOS] if add_special_tokens else []
        pos = 0
        while pos < len(text):
            special = next((s for s in self.added if text.startswith(s, pos)), None)
            if special is not None:
                ids.append(self.added[special])
                pos += len(special)
            else:
                ids.append(ord(text[pos]))
                pos += 1
        return ids

    def decode(self, ids: list[int]) -> str:
        names = {v: k for k, v in self.added.items()} | {BOS: "<s>"}
        return "".join(names.get(i, chr(i)) for i in ids)

    def get_added_vocab(self) -> dict[str, int]:
        return dict(self.added)

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> str:
        if self.template_error is not None:
            raise self.template_error
        self.templates.append({"conversation": conversation, **kwargs})
        tools = json.dumps(kwargs.get("tools"))
        turns = "".join(f"<{m['role']}>{m['content']}" for m in conversation)
        return f"<tools>{tools}{turns}<assistant>"


class FakeSamplingParams:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


class FakeStructuredOutputsParams:
    def __init__(self, **kwargs: Any) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object", "structural_tag") if k in kwargs]
        if len(kinds) != 1:
            raise ValueError("You must use exactly one kind of structured outputs constraint")
        self.kwargs = kwargs


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class FakeEngineArgs:
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class FakeLoRARequest:
    """vllm.lora.request.LoRARequest (its keyword arguments)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""


@dataclass
class FakeStructuredOutputsConfig:
    backend: str = "auto"


@dataclass
class Piece:
    """vllm.outputs.CompletionOutput (DELTA: this step's text, token ids and logprobs)."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, FakeLogprob]] | None
    finish_reason: str | None


@dataclass
class Output:
    """vllm.outputs.RequestOutput."""

    prompt_token_ids: list[int]
    outputs: list[Piece]
    finished: bool
    prompt_logprobs: list[dict[int, FakeLogprob] | None] | None = None
    num_cached_tokens: int | None = None


def steps(*texts: str) -> list[tuple[str, list[int]]]:
    """One output per text, each text's characters its tokens."""
    return [(text, [ord(c) for c in text]) for text in texts]


def step_logprobs(token_id: int) -> dict[int, FakeLogprob]:
    """The sampled token (rank 2) after the most likely one (rank 1), as vLLM's dict orders them."""
    return {
        token_id: FakeLogprob(-1.5, rank=2, decoded_token=chr(token_id)),
        ord("#"): FakeLogprob(-0.25, rank=1, decoded_token="#"),
    }


@dataclass
class FakeAsyncLLM:
    """vllm.v1.engine.async_llm.AsyncLLM: answers each request with the next scripted answer."""

    args: FakeEngineArgs
    answers: list[list[tuple[str, list[int]]]] = field(default_factory=list)
    finish: str = "stop"
    refuse: str | None = None
    defaults: dict[str, Any] = field(default_factory=dict)
    calls: list[tuple[dict[str, Any], FakeSamplingParams, str]] = field(default_factory=list)
    lora_requests: list[FakeLoRARequest | None] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    closed: int = 0
    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    shut_down: bool = False

    def __post_init__(self) -> None:
        self.model_config = types.SimpleNamespace(max_model_len=4096, get_diff_sampling_param=lambda: self.defaults)

    async def get_tokenizer(self) -> FakeTokenizer:
        return self.tokenizer

    async def generate(
        self,
        prompt: dict[str, Any],
        params: FakeSamplingParams,
        request_id: str,
        *,
        lora_request: FakeLoRARequest | None = None,
    ) -> AsyncIterator[Output]:
        self.calls.append((prompt, params, request_id))
        self.lora_requests.append(lora_request)
        if self.refuse is not None:
            raise ValueError(self.refuse)
        answer = self.answers.pop(0)
        prompt_ids = prompt["prompt_token_ids"]
        try:
            for i, (text, ids) in enumerate(answer):
                last = i == len(answer) - 1
                logprobs = [step_logprobs(t) for t in ids] if params.kwargs.get("logprobs") is not None else None
                prompt_lps = None
                if i == 0 and params.kwargs.get("prompt_logprobs") is not None:
                    prompt_lps = [None] + [{t: FakeLogprob(-2.0, rank=1, decoded_token=chr(t))} for t in prompt_ids[1:]]
                piece = Piece(text, ids, logprobs, self.finish if last else None)
                yield Output(prompt_ids, [piece], last, prompt_lps, num_cached_tokens=7)
        finally:
            self.closed += 1

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        self.shut_down = True


@dataclass
class DeltaToolCall:
    index: int
    id: str | None = None
    type: str | None = None
    function: Any = None


@dataclass
class DeltaMessage:
    content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


class FakeHermesParser:
    """A Hermes-style streaming parser with vLLM's ToolParser state and interface: content until
    `<tool_call>`, then the call's name (with a random id, as vLLM's make_tool_call_id), then its
    arguments as they grow, the last character held back until the tag closes."""

    instances: ClassVar[list["FakeHermesParser"]] = []

    def __init__(self, tokenizer: FakeTokenizer) -> None:
        if tokenizer.unfit:
            raise RuntimeError("could not locate the tool call token in the tokenizer")
        self.model_tokenizer = tokenizer
        self.tool_call_start_token, self.tool_call_end_token = START, END
        self.prev_tool_call_arr: list[dict[str, Any]] = []
        self.streamed_args_for_tool: list[str] = []
        self.current_tool_id = -1
        self.name_sent = False
        self.seen: list[tuple[str, tuple[int, ...]]] = []
        self.fail = False
        FakeHermesParser.instances.append(self)

    def adjust_request(self, request: Any) -> Any:
        if request.tools and request.tool_choice != "none":
            request.skip_special_tokens = False
        return request

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: list[int],
        current_token_ids: list[int],
        delta_token_ids: list[int],
        request: Any,
    ) -> DeltaMessage | None:
        assert current_text == previous_text + delta_text
        assert current_token_ids == previous_token_ids + delta_token_ids
        assert request.tool_choice == "auto"
        if self.fail:
            raise RuntimeError("parser broke")
        self.seen.append((delta_text, tuple(delta_token_ids)))
        if delta_text == START:
            self.current_tool_id += 1
            self.name_sent = False
            self.prev_tool_call_arr.append({})
            self.streamed_args_for_tool.append("")
            return None
        index = self.current_tool_id
        if delta_text == END:
            return self._arguments(index, final=True)
        if current_text.count(START) == current_text.count(END):
            return DeltaMessage(content=delta_text)
        portion = current_text.rsplit(START, 1)[1]
        match = re.match(r'\s*\{"name":\s*"([^"]+)",\s*"arguments":\s*', portion)
        if match is None:
            return None
        if not self.name_sent:
            self.name_sent = True
            self.prev_tool_call_arr[index] = {"name": match.group(1)}
            call = DeltaToolCall(index, f"chatcmpl-tool-{uuid.uuid4().hex}", "function", {"name": match.group(1)})
            return DeltaMessage(tool_calls=[call])
        raw = portion[match.end() :].rstrip()
        if raw.endswith("}}"):
            raw = raw[:-1]  # the call object's brace, not the arguments'
        try:
            self.prev_tool_call_arr[index]["arguments"] = json.loads(raw)
        except ValueError:
            pass
        self._raw = raw
        return self._arguments(index, final=False)

    def _arguments(self, index: int, *, final: bool) -> DeltaMessage | None:
        raw = getattr(self, "_raw", "")
        sendable = raw if final else raw[:-1]
        piece = sendable[len(self.streamed_args_for_tool[index]) :]
        if not piece:
            return None
        self.streamed_args_for_tool[index] += piece
        function = types.SimpleNamespace(name=None, arguments=piece)  # an object, as well as dicts
        return DeltaMessage(tool_calls=[DeltaToolCall(index, function=function)])


class FakeToolParserManager:
    @classmethod
    def get_tool_parser(cls, name: str) -> type[FakeHermesParser]:
        if name == "hermes":
            return FakeHermesParser
        raise KeyError(f"Tool parser '{name}' not found.")

    @classmethod
    def list_registered(cls) -> list[str]:
        return ["hermes"]


class FakeChatCompletionRequest:
    def __init__(self, **kwargs: Any) -> None:
        for tool in kwargs.get("tools") or []:
            if not tool["function"]["name"]:
                raise ValueError("a tool needs a name")
        self.__dict__.update(kwargs)
        self.skip_special_tokens = True


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Fake vLLM modules in `sys.modules` for one test; yields the engines `AsyncLLM` built."""
    built: dict[str, Any] = {}

    def from_engine_args(args: FakeEngineArgs) -> FakeAsyncLLM:
        time.sleep(built.get("load_s", 0))  # the model's load, synchronous as vLLM's
        built["engine"] = FakeAsyncLLM(args, tokenizer=built.get("tokenizer") or FakeTokenizer())
        return built["engine"]

    contents: dict[str, dict[str, Any]] = {
        "vllm": {},
        "vllm.config": {"StructuredOutputsConfig": FakeStructuredOutputsConfig},
        "vllm.engine": {},
        "vllm.engine.arg_utils": {"AsyncEngineArgs": lambda **kwargs: FakeEngineArgs(kwargs)},
        "vllm.v1": {},
        "vllm.v1.engine": {},
        "vllm.v1.engine.async_llm": {"AsyncLLM": types.SimpleNamespace(from_engine_args=from_engine_args)},
        "vllm.sampling_params": {
            "SamplingParams": FakeSamplingParams,
            "StructuredOutputsParams": FakeStructuredOutputsParams,
            "RequestOutputKind": RequestOutputKind,
        },
        "vllm.tool_parsers": {"ToolParserManager": FakeToolParserManager},
        "vllm.lora": {},
        "vllm.lora.request": {"LoRARequest": FakeLoRARequest},
        "vllm.entrypoints": {},
        "vllm.entrypoints.openai": {},
        "vllm.entrypoints.openai.chat_completion": {},
        "vllm.entrypoints.openai.chat_completion.protocol": {"ChatCompletionRequest": FakeChatCompletionRequest},
    }
    for name, attributes in contents.items():
        module = types.ModuleType(name)
        module.__dict__.update(attributes)
        monkeypatch.setitem(sys.modules, name, module)
    FakeHermesParser.instances.clear()
    # The engine's start sets vLLM's environment (VLLM_WORKER_MULTIPROC_METHOD): in a copy, this test's only.
    monkeypatch.setattr(os, "environ", dict(os.environ))
    yield built


def new_engine(**kwargs: Any) -> VllmEngine:
    options: dict[str, Any] = {
        "model_name": "m",
        "model_path": "/models/m",
        "tensor_parallel_size": 1,
        "max_seqs": 2,
        "gpu_memory_utilization": 0.9,
        "max_model_len": None,
    }
    return VllmEngine(**(options | kwargs))


async def started(fake_vllm: dict[str, Any], **kwargs: Any) -> tuple[VllmEngine, FakeAsyncLLM]:
    engine = new_engine(**kwargs)
    await engine.start()
    return engine, fake_vllm["engine"]


async def run(engine: VllmEngine, request: GenerationRequest) -> list[Any]:
    return [out async for out in engine.generate(request)]


WEATHER = FunctionSpec(
    name="get_weather",
    description="Weather in a city",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}},
)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


# --- without vLLM ------------------------------------------------------------------------------


def test_module_does_not_import_vllm() -> None:
    # The worker module is importable on machines without vLLM (the CPU image).
    assert "vllm" not in sys.modules
    new_engine()
    assert "vllm" not in sys.modules


def test_vllm_honours_every_request_parameter() -> None:
    assert VllmEngine.supports == set(get_args(Capability))
    assert {"tools", "response_format", "logprobs", "logit_bias", "echo"} <= VllmEngine.supports


def test_sampling_kwargs_carry_every_field() -> None:
    every = {  # Sampling's fields, in alphabetical order
        "frequency_penalty": -0.5,
        "ignore_eos": True,
        "logit_bias": {42: -100.0, 7: 5.0},
        "max_tokens": 17,
        "min_p": 0.05,
        "min_tokens": 3,
        "presence_penalty": 0.5,
        "repetition_penalty": 1.1,
        "seed": 9,
        "stop": ["\n", "END"],
        "temperature": 0.0,
        "top_k": 40,
        "top_p": 0.5,
    }
    assert set(every) == set(Sampling.model_fields)  # the whole contract
    assert sampling_kwargs(Sampling.model_validate(every)) == every


@pytest.mark.parametrize("top_k", [-1, 0, 1, 50])
def test_top_k_is_passed_as_given(top_k: int) -> None:
    # vLLM reads both 0 and -1 as "no top-k".
    assert sampling_kwargs(Sampling(top_k=top_k))["top_k"] == top_k


def test_sampling_kwargs_copy_the_stop_list_and_bias() -> None:
    sampling = Sampling(stop=["x"], logit_bias={1: 1.0})
    kwargs = sampling_kwargs(sampling)
    kwargs["stop"].append("y")
    kwargs["logit_bias"][2] = 2.0
    assert sampling.stop == ["x"]
    assert sampling.logit_bias == {1: 1.0}


def test_unset_parameters_take_the_generation_config_else_vllms_defaults() -> None:
    defaults = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 9}
    kwargs = sampling_kwargs(Sampling(top_p=0.5), defaults)
    assert (kwargs["temperature"], kwargs["top_p"], kwargs["top_k"], kwargs["repetition_penalty"]) == (
        0.7,
        0.5,
        20,
        1.05,
    )
    assert "min_p" not in kwargs  # neither the request nor the model sets it: vLLM's own default
    assert kwargs["max_tokens"] == 256  # the request's budget, never the model's
    bare = sampling_kwargs(Sampling())
    assert not {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "logit_bias"} & set(bare)


def test_structured_outputs_from_the_guide() -> None:
    assert structured_outputs_kwargs(Guide("json_object")) == {"json_object": True}
    assert structured_outputs_kwargs(Guide("json_schema", json.dumps(SCHEMA))) == {"json": SCHEMA}
    with pytest.raises(InvalidPrompt):
        structured_outputs_kwargs(Guide("json_schema", "{not json"))


@pytest.mark.parametrize(
    ("vllm_reason", "expected"),
    [(None, None), ("stop", "stop"), ("length", "length"), ("abort", "cancelled")],
)
def test_finish_reason_mapping(vllm_reason: str | None, expected: str | None) -> None:
    assert finish_reason(vllm_reason) == expected


@pytest.mark.parametrize("vllm_reason", ["error", "something_new", ""])
def test_unknown_finish_reason_is_error(vllm_reason: str) -> None:
    assert finish_reason(vllm_reason) == "error"


def test_replay_seed_is_fixed_by_the_job_and_differs_between_jobs() -> None:
    assert replay_seed("job-1") == replay_seed("job-1")
    assert replay_seed("job-1") != replay_seed("job-2")
    assert 0 <= replay_seed("job-1") < 2**63


def test_chat_conversation_as_vllm_passes_it_to_templates() -> None:
    call = ToolCall(id="call_1", function=FunctionCall(name="get_weather", arguments='{"city": "Paris"}'))
    messages = [
        Message(role="user", content="Weather?", name="ann"),
        Message(role="assistant", content="", tool_calls=[call]),
        Message(
            role="assistant", content="", tool_calls=[ToolCall(id="c2", function=FunctionCall(name="f", arguments=""))]
        ),
        Message(role="tool", content="18C", tool_call_id="call_1", name="get_weather"),
    ]
    assert chat_conversation(messages) == [
        {"role": "user", "content": "Weather?", "name": "ann"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c2", "type": "function", "function": {"name": "f", "arguments": {}}}],
        },
        {"role": "tool", "content": "18C", "name": "get_weather", "tool_call_id": "call_1"},
    ]
    broken = ToolCall(id="c", function=FunctionCall(name="f", arguments="{oops"))
    with pytest.raises(InvalidPrompt, match="not JSON"):
        chat_conversation([Message(role="assistant", content="", tool_calls=[broken])])


def decode_one(token_id: int) -> str:
    return f"<{token_id}>"


def test_token_logprob_as_vllms_openai_server_builds_it() -> None:
    step = {
        5: FakeLogprob(-3.0, rank=3, decoded_token="é"),
        9: FakeLogprob(-0.5, rank=1, decoded_token="a"),
        8: FakeLogprob(-1.0, rank=2, decoded_token=None),
    }
    lp = token_logprob(5, step, 2, decode_one)
    assert (lp.token, lp.logprob, lp.bytes) == ("é", -3.0, [0xC3, 0xA9])
    # The 2 most likely, most likely first (not vLLM's dict order, which puts the sampled one first).
    assert [(t.token, t.logprob) for t in lp.top_logprobs] == [("a", -0.5), ("<8>", -1.0)]
    assert lp.top_logprobs[1].bytes == list(b"<8>")
    assert token_logprob(5, step, 0, decode_one).top_logprobs == []


def test_token_logprob_floors_and_fills_in() -> None:
    floored = token_logprob(3, {3: FakeLogprob(float("-inf"), rank=1, decoded_token="x")}, 1, decode_one)
    assert floored.logprob == -9999.0
    assert floored.top_logprobs[0].logprob == -9999.0
    missing = token_logprob(3, None, 2, decode_one)
    assert (missing.token, missing.logprob, missing.top_logprobs) == ("<3>", -9999.0, [])


def test_prefix_replay_skips_the_sent_start_and_checks_it() -> None:
    replay = PrefixReplay(Resume(text='{"a"', token_ids=(1, 2, 3), completion_tokens=3))
    assert replay.take('{"', [1, 2]) == ("", 2)
    assert not replay.done
    assert replay.take('a": 1', [3, 4, 5]) == (": 1", 1)
    assert replay.done
    with pytest.raises(ReplayDiverged, match="token 1"):
        PrefixReplay(Resume(text="ab", token_ids=(1, 2), completion_tokens=2)).take("ab", [1, 9])
    with pytest.raises(ReplayDiverged, match="text"):
        PrefixReplay(Resume(text="ab", token_ids=(), completion_tokens=2)).take("ax", [1, 2])


# --- the tool parser adapter -------------------------------------------------------------------

ANSWER = (
    'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
)


class Request:
    """vLLM's ChatCompletionRequest as the adapter passes it on."""

    tools: ClassVar[list[dict[str, Any]]] = [{"type": "function", "function": {"name": "get_weather"}}]
    tool_choice = "auto"


def adapter(job_id: str = "job-1", **kwargs: Any) -> tuple[VllmToolCallParser, FakeHermesParser]:
    tokenizer = FakeTokenizer()
    parser = FakeHermesParser(tokenizer)
    return VllmToolCallParser(parser, Request(), tokenizer, job_id=job_id, specials=Specials(ADDED), **kwargs), parser


def render(outputs: list[tuple[str, list[ToolCallDelta]]]) -> tuple[str, list[dict[str, str | None]]]:
    """What a client assembles from the outputs: the content and the calls."""
    content = "".join(text for text, _ in outputs)
    calls: dict[int, dict[str, str | None]] = {}
    for _, deltas in outputs:
        for delta in deltas:
            call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            if delta.id is not None:
                assert call["id"] is None, "a call opened twice"
                call["id"] = delta.id
            if delta.function is not None:
                if delta.function.name is not None:
                    call["name"] = delta.function.name
                call["arguments"] = (call["arguments"] or "") + (delta.function.arguments or "")
    return content, [calls[i] for i in sorted(calls)]


def feed_all(parser: VllmToolCallParser, pieces: list[str]) -> list[tuple[str, list[ToolCallDelta]]]:
    return [parser.feed(piece) for piece in pieces] + [parser.finish()]


def cut(text: str, rng: random.Random, count: int) -> list[str]:
    points = sorted(rng.sample(range(1, len(text)), count))
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


def test_segmenter_pieces() -> None:
    segmenter = Segmenter(Specials(ADDED))
    assert segmenter.push("Hi  there<tool_ca") == ["Hi", "  ", "there"]  # "<tool_ca" may be a tag
    assert segmenter.push('ll>{"a": 12') == [START, "{", '"', "a", '"', ":", " "]  # "12" may go on
    assert segmenter.push("<b") == ["12", "<"]  # "<b" can no longer be a tag; "b" may go on
    assert segmenter.flush() == ["b"]


def test_segmenter_ignores_added_tokens_that_start_like_words() -> None:
    segmenter = Segmenter(Specials(["assistant", "<x>"]))
    assert segmenter.push("assistant<x> ") == ["assistant", "<x>"]


@pytest.mark.parametrize("seed", range(8))
def test_segmenter_pieces_depend_only_on_the_text(seed: int) -> None:
    rng = random.Random(seed)
    whole = Segmenter(Specials(ADDED))
    expected = whole.push(ANSWER) + whole.flush()
    segmenter = Segmenter(Specials(ADDED))
    pieces = [p for chunk in cut(ANSWER, rng, 25) for p in segmenter.push(chunk)] + segmenter.flush()
    assert pieces == expected
    assert "".join(pieces) == ANSWER


def test_adapter_turns_vllms_deltas_into_content_and_calls() -> None:
    parser, vllm_parser = adapter()
    outputs = feed_all(parser, [ANSWER])
    content, calls = render(outputs)
    assert content == "Let me check."
    assert calls == [
        {"id": tool_call_id("job-1", 0), "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"id": tool_call_id("job-1", 1), "name": "get_time", "arguments": '{"tz": "CET"}'},
    ]
    assert parser.called
    # vLLM's random ids never reach the client; the first delta of each call is OpenAI's shape.
    firsts = [d for _, deltas in outputs for d in deltas if d.id is not None]
    assert [(d.type, d.function and d.function.name) for d in firsts] == [
        ("function", "get_weather"),
        ("function", "get_time"),
    ]
    # The tags reached vLLM's parser whole, with their single token id, as vLLM's engine sends them.
    assert (START, (ADDED[START],)) in vllm_parser.seen
    assert (END, (ADDED[END],)) in vllm_parser.seen


def test_adapter_without_calls_is_content() -> None:
    parser, _ = adapter()
    outputs = feed_all(parser, ["Just ", "words, ", "no <tools>."])
    assert render(outputs) == ("Just words, no <tools>.", [])
    assert not parser.called


@pytest.mark.parametrize("seed", range(6))
def test_vllms_parser_sees_the_same_pieces_however_the_text_arrives(seed: int) -> None:
    rng = random.Random(seed)
    whole, whole_parser = adapter()
    expected = render(feed_all(whole, [ANSWER]))
    chopped, chopped_parser = adapter()
    assert render(feed_all(chopped, cut(ANSWER, rng, 30))) == expected
    assert chopped_parser.seen == whole_parser.seen


@pytest.mark.parametrize("published", [5, 13, 14, 30, 60, 95, len(ANSWER) - 3])
def test_a_resumed_answer_continues_exactly(published: int) -> None:
    """A worker dies after publishing the first `published` characters' worth of outputs; the next
    one feeds a fresh parser the published raw text (its output was already sent), then the rest."""
    uninterrupted = render(feed_all(adapter()[0], list(ANSWER)))
    first, _ = adapter()
    sent = [first.feed(c) for c in ANSWER[:published]]
    second, _ = adapter()
    second.feed(ANSWER[:published])
    rest = feed_all(second, list(ANSWER[published:]))
    assert render(sent + rest) == uninterrupted


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    parser, _ = adapter(parallel_tool_calls=False)
    _, calls = render(feed_all(parser, [ANSWER]))
    assert [c["name"] for c in calls] == ["get_weather"]
    assert calls[0]["arguments"] == '{"city": "Paris"}'


def test_arguments_parsed_but_not_streamed_are_sent_at_the_end() -> None:
    # The answer stops inside the call (no closing tag): vLLM's parser held back the last
    # character; the end of the answer sends it, as vLLM's server does.
    parser, vllm_parser = adapter()
    text = 'x<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    outputs = feed_all(parser, [text])
    assert vllm_parser.streamed_args_for_tool == ['{"city": "Oslo"']
    assert render(outputs)[1][0]["arguments"] == '{"city": "Oslo"}'


def test_a_failing_vllm_parser_is_an_engine_error() -> None:
    parser, vllm_parser = adapter()
    vllm_parser.fail = True
    with pytest.raises(EngineError, match="tool parser"):
        feed_all(parser, ["some words "])


# --- the engine against fake vLLM modules ------------------------------------------------------


async def test_start_configures_vllm(fake_vllm: dict[str, Any]) -> None:
    engine, llm = await started(fake_vllm, structured_outputs_backend="guidance", max_model_len=2048)
    kwargs = llm.args.kwargs
    assert kwargs["structured_outputs_config"] == FakeStructuredOutputsConfig(backend="guidance")
    assert kwargs["model"] == "/models/m"
    assert kwargs["served_model_name"] == ["m"]
    assert kwargs["max_model_len"] == 2048
    assert engine.context_tokens == 4096  # what vLLM settled on


async def test_the_model_loads_while_the_event_loop_runs_on(fake_vllm: dict[str, Any]) -> None:
    """/health and /metrics answer while vLLM loads a model for minutes: the load is on a thread,
    and vLLM's engine processes are spawned, not forked from it, unless the operator chose."""
    os.environ.pop("VLLM_WORKER_MULTIPROC_METHOD", None)
    fake_vllm["load_s"] = 0.5
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    try:
        await started(fake_vllm)
    finally:
        ticker.cancel()
    assert ticks >= 10
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
    fake_vllm["load_s"] = 0
    await started(fake_vllm)
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"


async def test_without_adapters_lora_stays_off(fake_vllm: dict[str, Any]) -> None:
    engine, llm = await started(fake_vllm)
    assert not {"enable_lora", "max_loras", "max_lora_rank"} & set(llm.args.kwargs)
    assert engine.adapters == frozenset()
    llm.answers = [steps("Hi")]
    await run(engine, GenerationRequest(request_id="r", sampling=Sampling(), prompt="x"))
    assert llm.lora_requests == [None]


async def test_adapters_enable_lora_and_each_request_names_its_own(fake_vllm: dict[str, Any]) -> None:
    adapters = {"sql": "/adapters/sql", "chat-fr": "org/chat-fr-lora"}
    engine, llm = await started(fake_vllm, lora_adapters=adapters, max_loras=2, max_lora_rank=64)
    kwargs = llm.args.kwargs
    assert (kwargs["enable_lora"], kwargs["max_loras"], kwargs["max_lora_rank"]) == (True, 2, 64)
    assert engine.adapters == {"sql", "chat-fr"}
    llm.answers = [steps("a"), steps("b"), steps("c")]
    for adapter in ("sql", None, "chat-fr"):
        request = GenerationRequest(request_id=f"r-{adapter}", sampling=Sampling(), prompt="x", adapter=adapter)
        await run(engine, request)
    # ids are positive, one per adapter, fixed by the names' order
    assert llm.lora_requests == [
        FakeLoRARequest("sql", 2, "/adapters/sql"),
        None,
        FakeLoRARequest("chat-fr", 1, "org/chat-fr-lora"),
    ]


async def test_an_adapter_the_engine_lacks_is_an_engine_error(fake_vllm: dict[str, Any]) -> None:
    engine, llm = await started(fake_vllm, lora_adapters={"sql": "/adapters/sql"})
    with pytest.raises(EngineError, match="adapter 'other'"):
        await run(engine, GenerationRequest(request_id="r", sampling=Sampling(), prompt="x", adapter="other"))
    assert llm.calls == []


async def test_the_adapter_settings_reach_vllm(fake_vllm: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AXON_LORA_ADAPTERS", '{"sql": "/adapters/sql"}')
    settings = WorkerSettings(engine="vllm", model="base", max_loras=3, max_lora_rank=8)
    engine = create_engine(settings)
    await engine.start()
    kwargs = fake_vllm["engine"].args.kwargs
    assert (kwargs["enable_lora"], kwargs["max_loras"], kwargs["max_lora_rank"]) == (True, 3, 8)
    assert engine.adapters == {"sql"}


@pytest.mark.parametrize("adapters", ['{"base": "/a"}', '{"": "/a"}', '{"sql": ""}', '["sql"]'])
def test_unusable_adapter_settings_are_refused(adapters: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AXON_LORA_ADAPTERS", adapters)
    with pytest.raises(ValueError, match=r"lora_adapters|AXON_LORA_ADAPTERS"):
        WorkerSettings(model="base")


async def test_an_unknown_tool_parser_fails_before_loading(fake_vllm: dict[str, Any]) -> None:
    with pytest.raises(EngineError, match=r"AXON_TOOL_PARSER='nope'.*hermes"):
        await started(fake_vllm, tool_parser="nope")
    assert "engine" not in fake_vllm


async def test_chat_with_tools_through_the_template(fake_vllm: dict[str, Any]) -> None:
    engine, llm = await started(fake_vllm)
    llm.defaults = {"temperature": 0.6, "top_k": 20}
    engine._defaults = llm.defaults  # read at start; set here to show it fills unset parameters
    llm.answers = [steps("Hi", "!")]
    call = ToolCall(id="call_1", function=FunctionCall(name="get_weather", arguments='{"city": "Paris"}'))
    messages = [
        Message(role="user", content="Weather?"),
        Message(role="assistant", content="", tool_calls=[call]),
        Message(role="tool", content="18C", tool_call_id="call_1"),
    ]
    request = GenerationRequest("job-1", Sampling(max_tokens=5, top_p=0.9), messages=messages, tools=[WEATHER])
    outs = await run(engine, request)
    assert "".join(o.text for o in outs) == "Hi!"
    template = llm.tokenizer.templates[-1]
    assert template["tools"] == [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER.parameters},
        }
    ]
    assert template["conversation"][1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert template["conversation"][2]["tool_call_id"] == "call_1"
    assert template["add_generation_prompt"] is True and template["tokenize"] is False
    prompt, params, request_id = llm.calls[-1]
    rendered = llm.tokenizer.apply_chat_template(template["conversation"], tools=template["tools"])
    assert prompt == {"prompt_token_ids": llm.tokenizer.encode(rendered, add_special_tokens=False)}
    assert request_id == "job-1"
    kwargs = params.kwargs
    assert kwargs["output_kind"] is RequestOutputKind.DELTA
    assert (kwargs["temperature"], kwargs["top_p"], kwargs["top_k"]) == (0.6, 0.9, 20)
    assert kwargs["skip_special_tokens"] is False  # the hermes parser's adjust_request
    assert "structured_outputs" not in kwargs and "logprobs" not in kwargs and "seed" not in kwargs


async def test_a_completion_prompt_gets_the_tokenizers_special_tokens(fake_vllm: dict[str, Any]) -> None:
    engine, llm = await started(fake_vllm)
    llm.answers = [steps("x")]
    await run(engine, GenerationRequest("j", Sampling(), prompt="abc"))
    prompt, params, _ = llm.calls[-1]
    assert prompt == {"prompt_token_ids": [BOS, ord("a"), ord("b"), ord("c")]}
    assert "skip_special_tokens" not in params.kwargs


@pytest.mark.parametrize(
    ("guide", "expected"),
    [(Guide("json_schema", json.dumps(SCHEMA)), {"json": SCHEMA}), (Guide("json_object"), {"json_object": True})],
)
async def test_a_guide_becomes_structured_outputs(
    fake_vllm: dict[str, Any], guide: Guide, expected: dict[str, Any]
) -> None:
    engine, llm = await started(fake_vllm)
    llm.answers = [steps("{}"), steps("{}")]
    await run(engine, GenerationRequest("job-7", Sampling(), prompt="p", guide=guide))
    kwargs = llm.calls[-1][1].kwargs
    assert kwargs["structured_outputs"].kwargs == expected
    assert kwargs["seed"] == replay_seed("job-7")  # fixed, so a resumed attempt can replay it
    await run(engine, GenerationRequest("job-8", Sampling(seed=3), prompt="p", guide=guide))
    assert llm.calls[-1][1].kwargs["seed"] == 3


async def test_outputs_carry_text_tokens_logprobs_and_cache(fake_vllm: dict[str, Any]) -> None:
    engine, llm = await started(fake_vllm)
    # vLLM holds a token's text back (an incomplete character): its id and logprob wait for the text.
    llm.answers = [[("", [200]), ("ab", [201, 202]), ("c", [203])]]
    llm.finish = "length"
    outs = await run(engine, GenerationRequest("j", Sampling(max_tokens=4), prompt="xy", logprobs=1))
    assert [(o.text, o.n_tokens, o.completion_tokens, o.token_ids) for o in outs] == [
        ("ab", 3, 3, (200, 201, 202)),
        ("c", 1, 4, (203,)),
    ]
    assert [o.finish_reason for o in outs] == [None, "length"]
    assert {o.prompt_tokens for o in outs} == {3}
    assert {o.cached_tokens for o in outs} == {7}
    assert [lp.token for lp in outs[0].logprobs] == [chr(200), chr(201), chr(202)]
    first = outs[0].logprobs[0]
    assert (first.logprob, [(t.token, t.logprob) for t in first.top_logprobs]) == (-1.5, [("#", -0.25)])
    assert llm.calls[-1][1].kwargs["logprobs"] == 1
    assert "prompt_logprobs" not in llm.calls[-1][1].kwargs


async def test_echo_with_logprobs_sends_the_prompts_once(fake_vllm: dict[str, Any]) -> None:
    engine, llm = await started(fake_vllm)
    llm.answers = [steps("a", "b")]
    outs = await run(engine, GenerationRequest("j", Sampling(), prompt="xy", logprobs=0, echo=True))
    assert llm.calls[-1][1].kwargs["prompt_logprobs"] == 0
    # BOS has no logprob (nothing precedes it); the prompt's text tokens follow.
    assert [(lp.token, lp.logprob, lp.top_logprobs) for lp in outs[0].prompt_logprobs] == [
        ("x", -2.0, []),
        ("y", -2.0, []),
    ]
    assert outs[1].prompt_logprobs == ()


async def test_vllm_refusals_are_invalid_prompts(fake_vllm: dict[str, Any]) -> None:
    engine, llm = await started(fake_vllm)
    llm.refuse = "token_id(s) [999999] in logit_bias contain out-of-vocab token ids"
    with pytest.raises(InvalidPrompt, match="logit_bias"):
        await run(engine, GenerationRequest("j", Sampling(logit_bias={999999: 1.0}), prompt="p"))
    llm.tokenizer.template_error = ValueError("tools are not supported")
    with pytest.raises(InvalidPrompt, match="chat template"):
        await run(engine, GenerationRequest("j", Sampling(), messages=[Message(role="user", content="hi")]))
    with pytest.raises(InvalidPrompt, match="refused the tools"):
        await run(engine, GenerationRequest("j", Sampling(), prompt="p", tools=[FunctionSpec(name="")]))


async def test_a_resumed_answer_continues_after_its_tokens(fake_vllm: dict[str, Any]) -> None:
    engine, llm = await started(fake_vllm)
    llm.answers = [steps(" world")]
    resume = Resume(text="Hello", token_ids=(72, 101, 108, 108, 111), completion_tokens=5)
    sampling = Sampling(max_tokens=10, min_tokens=8)  # the service passes the remaining budget
    outs = await run(engine, GenerationRequest("j", sampling, prompt="p", resume=resume))
    prompt, params, _ = llm.calls[-1]
    assert prompt["prompt_token_ids"] == [BOS, ord("p"), 72, 101, 108, 108, 111]
    assert params.kwargs["max_tokens"] == 10
    assert params.kwargs["min_tokens"] == 3  # less the 5 tokens already generated
    assert [(o.text, o.completion_tokens) for o in outs] == [(" world", 6)]


async def test_a_resumed_constrained_answer_is_regenerated_and_its_sent_start_skipped(
    fake_vllm: dict[str, Any],
) -> None:
    engine, llm = await started(fake_vllm)
    answer = steps("{", '"city', '": "', "Paris", '"}')
    llm.answers = [answer, answer]
    guide = Guide("json_schema", json.dumps(SCHEMA))
    first = await run(engine, GenerationRequest("job-3", Sampling(max_tokens=50), prompt="p", guide=guide, logprobs=0))
    full = "".join(o.text for o in first)
    # The first attempt died after sending '{"ci': 4 tokens.
    sent_ids = tuple(t for _, ids in answer for t in ids)[:4]
    resume = Resume(text='{"ci', token_ids=sent_ids, completion_tokens=4)
    outs = await run(
        engine, GenerationRequest("job-3", Sampling(max_tokens=46), prompt="p", guide=guide, logprobs=0, resume=resume)
    )
    assert '{"ci' + "".join(o.text for o in outs) == full
    prompt, params, _ = llm.calls[-1]
    assert prompt["prompt_token_ids"] == [BOS, ord("p")]  # from the start, under the constraint
    assert params.kwargs["max_tokens"] == 50
    assert params.kwargs["seed"] == llm.calls[0][1].kwargs["seed"] == replay_seed("job-3")
    assert sum(o.n_tokens for o in outs) == outs[-1].completion_tokens == len(full) - 4
    assert [lp.token for o in outs for lp in o.logprobs] == list(full[4:])
    assert outs[-1].finish_reason == "stop"


async def test_a_resumed_constrained_answer_that_comes_out_different_fails(fake_vllm: dict[str, Any]) -> None:
    engine, llm = await started(fake_vllm)
    llm.answers = [steps("{", '"town": 1}')]
    resume = Resume(text='{"ci', token_ids=tuple(map(ord, '{"ci')), completion_tokens=4)
    request = GenerationRequest("job-4", Sampling(max_tokens=46), prompt="p", guide=Guide("json_object"), resume=resume)
    with pytest.raises(EngineError, match="could not be resumed"):
        await run(engine, request)
    assert llm.aborted == ["job-4"]
    assert llm.closed == 1


async def test_tool_choice_auto_gets_vllms_parser(fake_vllm: dict[str, Any]) -> None:
    engine, _ = await started(fake_vllm)
    job = Job(job_id="job-9", model="m", messages=[], channel="c", deadline=0.0, tools=[WEATHER], tool_choice="auto")
    parser = engine.tool_call_parser(job)
    assert isinstance(parser, VllmToolCallParser)
    _, calls = render(feed_all(parser, [ANSWER]))
    assert calls[0]["id"] == tool_call_id("job-9", 0)
    assert FakeHermesParser.instances[-1].seen  # vLLM's parser did the parsing


async def test_the_parsers_tags_reach_it_whole_when_they_are_not_one_token(fake_vllm: dict[str, Any]) -> None:
    # A model whose tokenizer spells <tool_call> in several tokens: the tag still reaches vLLM's
    # parser as one delta (with its token ids), as the parser expects it.
    fake_vllm["tokenizer"] = FakeTokenizer(added={EOS: 1002})
    engine, _ = await started(fake_vllm)
    job = Job(job_id="j", model="m", messages=[], channel="c", deadline=0.0, tools=[WEATHER])
    parser = engine.tool_call_parser(job)
    assert parser is not None
    _, calls = render(feed_all(parser, [ANSWER]))
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert (START, tuple(map(ord, START))) in FakeHermesParser.instances[-1].seen


async def test_a_tool_parser_that_does_not_fit_the_model_fails_the_start(fake_vllm: dict[str, Any]) -> None:
    fake_vllm["tokenizer"] = FakeTokenizer()
    fake_vllm["tokenizer"].unfit = True
    with pytest.raises(EngineError, match="does not fit the model"):
        await started(fake_vllm)
    assert fake_vllm["engine"].shut_down


@pytest.mark.parametrize("choice", ["required", NamedToolChoice(name="get_weather")])
async def test_constrained_tool_calls_use_axons_parsers(
    fake_vllm: dict[str, Any], monkeypatch: pytest.MonkeyPatch, choice: Any
) -> None:
    engine, _ = await started(fake_vllm)
    sentinel = object()
    monkeypatch.setattr(Engine, "tool_call_parser", lambda self, job: sentinel)
    job = Job(job_id="j", model="m", messages=[], channel="c", deadline=0.0, tools=[WEATHER], tool_choice=choice)
    assert engine.tool_call_parser(job) is sentinel
    no_tools = Job(job_id="j", model="m", messages=[], channel="c", deadline=0.0)
    assert engine.tool_call_parser(no_tools) is sentinel


async def test_engine_refuses_work_before_start() -> None:
    engine = new_engine()
    with pytest.raises(EngineError):
        await engine.check_health()
    await engine.abort("not-running")  # a no-op, never an AttributeError
    await engine.stop()
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(EngineError, match="vLLM"):
            await engine.start()


def test_factory_passes_the_vllm_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AXON_STRUCTURED_OUTPUTS_BACKEND", raising=False)
    monkeypatch.delenv("AXON_TOOL_PARSER", raising=False)
    assert (WorkerSettings().structured_outputs_backend, WorkerSettings().tool_parser) == ("xgrammar", "hermes")
    monkeypatch.setenv("AXON_STRUCTURED_OUTPUTS_BACKEND", "guidance")
    monkeypatch.setenv("AXON_TOOL_PARSER", "xlam")
    engine = create_engine(WorkerSettings(engine="vllm", model="m"))
    assert isinstance(engine, VllmEngine)
    assert (engine._structured_outputs_backend, engine._tool_parser_name) == ("guidance", "xlam")


def _cuda_and_vllm() -> bool:
    """Both vLLM and a CUDA device; torch is imported only when vLLM is installed."""
    if importlib.util.find_spec("vllm") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_and_vllm(), reason="needs vLLM and a CUDA device")
def test_vllm_accepts_axon_sampling_params() -> None:
    vllm = pytest.importorskip("vllm")
    from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

    sampling = Sampling(
        max_tokens=8, temperature=0.0, top_p=0.9, top_k=0, stop=["\n"], seed=1, logit_bias={5: -100.0}, min_tokens=1
    )
    params = SamplingParams(
        **sampling_kwargs(sampling),
        output_kind=RequestOutputKind.DELTA,
        structured_outputs=StructuredOutputsParams(**structured_outputs_kwargs(Guide("json_object"))),
        logprobs=2,
    )
    assert params.max_tokens == 8
    assert params.temperature == 0.0
    assert params.stop == ["\n"]
    assert params.seed == 1
    assert params.top_k in (-1, 0)  # disabled, however this vLLM spells it
    assert params.structured_outputs is not None and params.structured_outputs.json_object
    assert vllm.__version__


# --- tensor and pipeline parallelism -----------------------------------------------------------


async def test_pipeline_and_tensor_parallel_reach_vllms_engine_arguments(fake_vllm: dict[str, Any]) -> None:
    """Two 8-GPU nodes: 8-way tensor parallel inside a node, 2 pipeline stages across, on Ray."""
    _, llm = await started(fake_vllm, tensor_parallel_size=8, pipeline_parallel_size=2, distributed_executor="ray")
    kwargs = llm.args.kwargs
    assert kwargs["tensor_parallel_size"] == 8
    assert kwargs["pipeline_parallel_size"] == 2
    assert kwargs["distributed_executor_backend"] == "ray"


async def test_one_stage_and_vllms_own_executor_by_default(fake_vllm: dict[str, Any]) -> None:
    _, llm = await started(fake_vllm)
    assert llm.args.kwargs["pipeline_parallel_size"] == 1
    # Left out, not None: vLLM then picks mp on one node by itself.
    assert "distributed_executor_backend" not in llm.args.kwargs


async def test_factory_passes_the_parallel_settings(fake_vllm: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AXON_TENSOR_PARALLEL_SIZE", "4")
    monkeypatch.setenv("AXON_PIPELINE_PARALLEL_SIZE", "3")
    monkeypatch.setenv("AXON_DISTRIBUTED_EXECUTOR", "mp")
    await create_engine(WorkerSettings(engine="vllm", model="m")).start()
    kwargs = fake_vllm["engine"].args.kwargs
    assert (kwargs["tensor_parallel_size"], kwargs["pipeline_parallel_size"]) == (4, 3)
    assert kwargs["distributed_executor_backend"] == "mp"


@pytest.mark.parametrize("engine", ["transformers", "sim"])
def test_pipeline_parallel_needs_the_vllm_engine(engine: str) -> None:
    with pytest.raises(ValueError, match="AXON_PIPELINE_PARALLEL_SIZE=2 needs AXON_ENGINE=vllm"):
        WorkerSettings(engine=engine, pipeline_parallel_size=2)
    assert WorkerSettings(engine="vllm", pipeline_parallel_size=2).pipeline_parallel_size == 2


def test_vllm_accepts_axons_parallel_engine_arguments() -> None:
    """Against the real `AsyncEngineArgs` where vLLM is installed (the GPU image): the names exist."""
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import AsyncEngineArgs

    engine = new_engine(tensor_parallel_size=8, pipeline_parallel_size=2, distributed_executor="ray")
    args = AsyncEngineArgs(**{k: v for k, v in engine._engine_kwargs.items() if v is not None})
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (8, 2)
    assert args.distributed_executor_backend == "ray"
