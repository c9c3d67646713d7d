"""services.worker.engines.vllm_*: what crosses into vLLM and back, against vLLM's own classes.

No engine runs here (the real engine runs behind the whole stack in tests/e2e/test_vllm_engine.py
and tests/e2e/test_vllm_parallel.py): what Axon hands vLLM is built with
vLLM's real `SamplingParams`, `StructuredOutputsParams`, `AsyncEngineArgs` and `LoRARequest`, what
vLLM hands back is read from its real `RequestOutput`, `CompletionOutput` and `Logprob`, and the
tool-call adapter drives vLLM's real hermes parser with the bundled model's tokenizer.
"""

import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.config import KVEventsConfig, StructuredOutputsConfig
from vllm.distributed.kv_events import AllBlocksCleared as VllmAllBlocksCleared
from vllm.distributed.kv_events import BlockRemoved as VllmBlockRemoved
from vllm.distributed.kv_events import BlockStored as VllmBlockStored
from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.logprobs import Logprob
from vllm.lora.request import LoRARequest
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

from services.worker.engines.base import EngineError, GenerationRequest, Guide, InvalidPrompt, Resume
from services.worker.engines.factory import create_engine
from services.worker.engines.gguf import bundled_gguf_path
from services.worker.engines.grammar import GrammarLimits, SchemaGate
from services.worker.engines.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    RenderedPrompt,
    VllmKvEvents,
    kv_events_endpoints,
)
from services.worker.engines.vllm_config import (
    GIB,
    KV_EVENTS_TOPIC,
    VllmOptions,
    check_platform,
    cpu_dtype,
    cpu_flags,
    cpu_threads_bind,
    engine_kwargs,
    kv_events_kwargs,
    vllm_environment,
)
from services.worker.engines.vllm_engine import (
    VllmEngine,
    chat_conversation,
    context_exceeded,
    lora_request_kwargs,
    parser_tags,
    refusal,
    replay_seed,
    sampling_kwargs,
    structured_outputs_kwargs,
    template_renders_tools,
    tool_parser_class,
)
from services.worker.engines.vllm_outputs import (
    AnswerOutputs,
    PrefixReplay,
    ReplayDiverged,
    finish_reason,
    token_logprob,
)
from services.worker.engines.vllm_tools import Segmenter, Specials, VllmToolCallParser
from services.worker.kv_index import KvIndex, block_key, root_key
from services.worker.settings import WorkerSettings
from services.worker.tool_parsers import tool_call_id
from shared.names import Names
from shared.prefix_index import anchors
from shared.schemas import FunctionCall, Message, Sampling, ToolCall, ToolCallDelta

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
START, END = "<tool_call>", "</tool_call>"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The bundled SmolLM2's tokenizer (as the vLLM engine has it after converting the model)."""
    from transformers import AutoTokenizer

    gguf = bundled_gguf_path()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def options(**overrides: Any) -> VllmOptions:
    return VllmOptions(**({"model_name": "m", "model_path": "/models/m"} | overrides))


# --- engine arguments and environment ----------------------------------------------------------


def test_the_engine_module_does_not_import_vllm() -> None:
    # The worker imports it on machines without vLLM too: vLLM loads when the engine starts.
    code = (
        "import sys, services.worker.engines.vllm_engine, services.worker.engines.factory; print('vllm' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_cpu_defaults_are_a_kv_cache_of_a_gib_and_eager_execution() -> None:
    kwargs = engine_kwargs(options(), on_cpu=True)
    assert (kwargs["kv_cache_memory_bytes"], kwargs["enforce_eager"]) == (GIB, True)
    assert kwargs["dtype"] == cpu_dtype("auto", cpu_flags())
    assert not {"max_num_seqs", "max_model_len", "distributed_executor_backend", "enable_lora"} & set(kwargs)


def test_auto_dtype_on_a_cpu_without_bfloat16_arithmetic_is_float32() -> None:
    avx2 = frozenset({"sse4_2", "avx", "avx2", "fma"})
    assert cpu_dtype("auto", avx2) == "float32"
    assert cpu_dtype("auto", avx2 | {"avx512f", "avx512_bf16"}) == "auto"
    assert cpu_dtype("auto", avx2 | {"amx_bf16"}) == "auto"
    assert cpu_dtype("bfloat16", avx2) == "bfloat16"  # asked for: kept
    # Not on a GPU, whatever the host's CPU.
    assert engine_kwargs(options(), on_cpu=False)["dtype"] == "auto"


def test_vllms_loading_progress_bar_shows_only_when_asked() -> None:
    # vLLM passes its own `disable=` to tqdm, so TQDM_DISABLE does not reach this bar.
    assert AsyncEngineArgs(**engine_kwargs(options(), on_cpu=True)).use_tqdm_on_load is False
    assert AsyncEngineArgs(**engine_kwargs(options(progress_bars=True), on_cpu=True)).use_tqdm_on_load is True


def test_gpu_defaults_leave_the_cache_to_gpu_memory_utilization_and_compile() -> None:
    kwargs = engine_kwargs(options(gpu_memory_utilization=0.8), on_cpu=False)
    assert "kv_cache_memory_bytes" not in kwargs
    assert (kwargs["gpu_memory_utilization"], kwargs["enforce_eager"]) == (0.8, False)


def test_every_setting_reaches_vllms_own_engine_arguments() -> None:
    """Two 8-GPU nodes: 8-way tensor parallel inside a node, 2 pipeline stages across, on Ray."""
    chosen = options(
        max_seqs=32,
        tensor_parallel_size=8,
        pipeline_parallel_size=2,
        distributed_executor="ray",
        max_model_len=4096,
        dtype="float32",
        kv_cache_gib=2.5,
        enforce_eager=False,
        lora_adapters={"sql": "/a/sql"},
        max_loras=3,
        max_lora_rank=8,
    )
    args = AsyncEngineArgs(**engine_kwargs(chosen, on_cpu=True))
    assert (args.model, args.served_model_name, args.max_num_seqs, args.max_model_len) == ("/models/m", ["m"], 32, 4096)
    assert (args.tensor_parallel_size, args.pipeline_parallel_size, args.distributed_executor_backend) == (8, 2, "ray")
    assert (args.dtype, args.kv_cache_memory_bytes, args.enforce_eager) == ("float32", int(2.5 * GIB), False)
    assert (args.enable_lora, args.max_loras, args.max_lora_rank) == (True, 3, 8)


@pytest.mark.parametrize(
    ("configured", "ranks", "cores", "expected"),
    [
        ("", 1, [0, 1], "0-1"),
        ("", 2, [1, 0], "0|1"),
        ("", 2, [0, 1, 2, 3, 4], "0-1|2-3"),
        ("", 1, [0, 2, 5], "0,2,5"),
        ("", 1, [3], "3"),
        ("0|1", 2, [0, 1], "0|1"),
        ("nobind", 1, [0], "nobind"),
    ],
)
def test_threads_are_bound_to_the_allowed_cores_split_between_ranks(
    configured: str, ranks: int, cores: list[int], expected: str
) -> None:
    assert cpu_threads_bind(configured, ranks=ranks, cores=cores) == expected


def test_pipeline_parallelism_is_refused_on_the_cpu_only() -> None:
    with pytest.raises(EngineError, match="no pipeline parallelism"):
        check_platform(options(pipeline_parallel_size=2), on_cpu=True)
    check_platform(options(pipeline_parallel_size=2), on_cpu=False)
    check_platform(options(tensor_parallel_size=2), on_cpu=True)


def test_more_ranks_than_cores_is_refused() -> None:
    with pytest.raises(EngineError, match="4 ranks"):
        cpu_threads_bind("", ranks=4, cores=[0, 1])


def test_the_environment_binds_threads_on_cpu_and_keeps_a_local_model_off_the_hub(tmp_path: Path) -> None:
    env = vllm_environment(options(model_path=str(tmp_path), tensor_parallel_size=2), on_cpu=True, cores=[0, 1])
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert (env["HF_HUB_OFFLINE"], env["VLLM_WORKER_MULTIPROC_METHOD"], env["VLLM_NO_USAGE_STATS"]) == (
        "1",
        "spawn",
        "1",
    )
    on_gpu = vllm_environment(options(model_path="Qwen/Qwen2.5-7B-Instruct"), on_cpu=False, cores=[0])
    assert not {"VLLM_CPU_OMP_THREADS_BIND", "HF_HUB_OFFLINE"} & set(on_gpu)


def test_the_factory_passes_every_vllm_setting(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    settings = {
        "AXON_ENGINE": "vllm",
        "AXON_MODEL": "m",
        "AXON_MODEL_PATH": "/models/m",
        "AXON_MODEL_CACHE_DIR": str(tmp_path),
        "AXON_MAX_SEQS": "12",
        "AXON_TENSOR_PARALLEL_SIZE": "4",
        "AXON_PIPELINE_PARALLEL_SIZE": "3",
        "AXON_DISTRIBUTED_EXECUTOR": "mp",
        "AXON_DTYPE": "bfloat16",
        "AXON_KV_CACHE_GIB": "3",
        "AXON_ENFORCE_EAGER": "false",
        "AXON_CPU_THREADS_BIND": "0|1|2|3",
        "AXON_ENGINE_NICE": "5",
        "AXON_STRUCTURED_OUTPUTS_BACKEND": "guidance",
        "AXON_TOOL_PARSER": "xlam",
        "AXON_GRAMMAR_COMPILE_TIMEOUT_S": "2.5",
        "AXON_GRAMMAR_COMPILE_MEMORY_MB": "512",
        "AXON_GRAMMAR_MAX_SCHEMA_BYTES": "4096",
        "AXON_OTLP_ENDPOINT": "http://collector:4318",
        "AXON_FAIR_HEADROOM_SEQS": "2",
        "AXON_PREFIX_INDEX": "false",
    }
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    engine = create_engine(WorkerSettings())
    assert isinstance(engine, VllmEngine)
    assert engine._grammar_limits == GrammarLimits(compile_timeout_s=2.5, compile_memory_mb=512, max_schema_bytes=4096)
    assert engine._options == options(
        max_seqs=12,
        headroom_seqs=2,
        tensor_parallel_size=4,
        pipeline_parallel_size=3,
        distributed_executor="mp",
        dtype="bfloat16",
        kv_cache_gib=3.0,
        enforce_eager=False,
        cpu_threads_bind="0|1|2|3",
        engine_nice=5,
        structured_outputs_backend="guidance",
        tool_parser="xlam",
        otlp_endpoint="http://collector:4318",
        kv_events=False,
    )


def test_the_collector_endpoint_reaches_vllm_over_otlp_http() -> None:
    traced = options(otlp_endpoint="http://collector:4318/")
    args = AsyncEngineArgs(**engine_kwargs(traced, on_cpu=True))
    assert args.otlp_traces_endpoint == "http://collector:4318/v1/traces"
    env = vllm_environment(traced, on_cpu=True, cores=[0])
    assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"  # vLLM's default is gRPC
    assert "otlp_traces_endpoint" not in engine_kwargs(options(), on_cpu=True)
    assert "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" not in vllm_environment(options(), on_cpu=True, cores=[0])


def test_the_default_model_is_the_bundled_gguf_and_another_name_a_hub_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AXON_MODEL_PATH", raising=False)
    monkeypatch.delenv("AXON_MODEL", raising=False)
    bundled = create_engine(WorkerSettings(engine="vllm"))
    assert isinstance(bundled, VllmEngine) and bundled._options.model_path == str(bundled_gguf_path())
    named = create_engine(WorkerSettings(engine="vllm", model="Qwen/Qwen2.5-0.5B-Instruct"))
    assert isinstance(named, VllmEngine) and named._options.model_path == "Qwen/Qwen2.5-0.5B-Instruct"


def test_vllm_is_the_default_engine_where_it_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AXON_ENGINE", raising=False)
    assert WorkerSettings().engine == "vllm"


@pytest.mark.parametrize("bind", ["0-1;2", "auto", "a|b", "|0"])
def test_a_malformed_thread_binding_is_refused(bind: str) -> None:
    with pytest.raises(ValueError, match="cpu_threads_bind"):
        WorkerSettings(engine="vllm", cpu_threads_bind=bind)


@pytest.mark.parametrize("engine", ["transformers", "sim"])
def test_pipeline_parallel_needs_the_vllm_engine(engine: str) -> None:
    with pytest.raises(ValueError, match="AXON_PIPELINE_PARALLEL_SIZE=2 needs AXON_ENGINE=vllm"):
        WorkerSettings(engine=engine, pipeline_parallel_size=2)
    assert WorkerSettings(engine="vllm", pipeline_parallel_size=2).pipeline_parallel_size == 2


@pytest.mark.parametrize("adapters", ['{"base": "/a"}', '{"": "/a"}', '{"sql": ""}', '["sql"]'])
def test_unusable_adapter_settings_are_refused(adapters: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AXON_LORA_ADAPTERS", adapters)
    with pytest.raises(ValueError):
        WorkerSettings(engine="vllm", model="base")


# --- requests in: vLLM's own classes take what Axon builds --------------------------------------


def test_sampling_kwargs_carry_every_field_into_vllms_sampling_params() -> None:
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
        "temperature": 0.7,  # not 0: vLLM resets top_p, top_k and min_p of a greedy request
        "top_k": 40,
        "top_p": 0.5,
    }
    assert set(every) == set(Sampling.model_fields)  # the whole contract
    kwargs = sampling_kwargs(Sampling.model_validate(every))
    assert kwargs == every
    params = SamplingParams(**kwargs, output_kind=RequestOutputKind.DELTA)
    for name, value in every.items():
        assert getattr(params, name) == value, name


def test_sampling_kwargs_copy_the_stop_list_and_bias() -> None:
    sampling = Sampling(stop=["x"], logit_bias={1: 1.0})
    kwargs = sampling_kwargs(sampling)
    kwargs["stop"].append("y")
    kwargs["logit_bias"][2] = 2.0
    assert (sampling.stop, sampling.logit_bias) == (["x"], {1: 1.0})


def test_unset_parameters_take_the_generation_config_else_vllms_defaults() -> None:
    defaults = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 9}
    kwargs = sampling_kwargs(Sampling(top_p=0.5), defaults)
    assert [kwargs[k] for k in ("temperature", "top_p", "top_k", "repetition_penalty")] == [0.7, 0.5, 20, 1.05]
    assert "min_p" not in kwargs  # neither the request nor the model sets it: vLLM's own default
    assert kwargs["max_tokens"] == 256  # the request's budget, never the model's
    bare = SamplingParams(**sampling_kwargs(Sampling()))
    assert (bare.temperature, bare.top_p, bare.seed, bare.logit_bias) == (1.0, 1.0, None, None)


def test_guides_become_vllms_structured_outputs() -> None:
    assert StructuredOutputsParams(**structured_outputs_kwargs(Guide("json_object"))).json_object is True
    assert StructuredOutputsParams(**structured_outputs_kwargs(Guide("json_schema", json.dumps(SCHEMA)))).json == SCHEMA
    with pytest.raises(InvalidPrompt) as info:
        structured_outputs_kwargs(Guide("json_schema", "{not json", "tools"))
    assert info.value.param == "tools"


def test_each_adapter_gets_a_lora_request_with_an_id_of_its_own() -> None:
    requests = {name: LoRARequest(**kwargs) for name, kwargs in lora_request_kwargs({"sql": "/a", "fr": "/b"}).items()}
    assert [(r.lora_name, r.lora_int_id, r.lora_path) for r in requests.values()] == [("fr", 1, "/b"), ("sql", 2, "/a")]


def test_replay_seed_is_fixed_by_the_job_and_differs_between_jobs() -> None:
    assert replay_seed("job-1") == replay_seed("job-1") != replay_seed("job-2")
    assert SamplingParams(seed=replay_seed("job-1")).seed == replay_seed("job-1")


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
    weather = {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert chat_conversation(messages) == [
        {"role": "user", "content": "Weather?", "name": "ann"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": weather}]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c2", "type": "function", "function": {"name": "f", "arguments": {}}}],
        },
        {"role": "tool", "content": "18C", "name": "get_weather", "tool_call_id": "call_1"},
    ]
    broken = ToolCall(id="c", function=FunctionCall(name="f", arguments="{oops"))
    with pytest.raises(InvalidPrompt, match="not JSON") as info:
        chat_conversation([Message(role="assistant", content="", tool_calls=[broken])])
    assert info.value.param == "messages"


def test_the_bundled_models_template_knows_nothing_of_tools(tokenizer: Any) -> None:
    # So the engine writes the tools into the conversation itself, as the transformers engine does.
    assert not template_renders_tools(tokenizer)
    assert template_renders_tools(type("T", (), {"chat_template": "{% if tools %}{{ tools }}{% endif %}"})())


# --- refusals ------------------------------------------------------------------------------------


def request(**kwargs: Any) -> GenerationRequest:
    return GenerationRequest(request_id="r", sampling=Sampling(), **kwargs)


CHAT = [Message(role="user", content="hi")]


@pytest.mark.parametrize(
    ("parameter", "chat", "param"),
    [
        ("logit_bias", True, "logit_bias"),
        ("logprobs", True, "top_logprobs"),
        ("logprobs", False, "logprobs"),
        ("x", True, None),
    ],
)
def test_vllms_validation_errors_name_the_requests_parameter(parameter: str, chat: bool, param: str | None) -> None:
    error = VLLMValidationError("out of range", parameter=parameter, value=list(range(1000)))
    refused = refusal(error, request(messages=CHAT) if chat else request(prompt="p"))
    assert (str(refused), refused.param, refused.code) == ("out of range", param, None)


def test_a_schema_the_structured_output_backend_refuses_names_the_guides_parameter() -> None:
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

    params = SamplingParams(
        structured_outputs=StructuredOutputsParams(json={"type": "string", "pattern": "(?<=a)b"}),
    )
    with pytest.raises(VLLMValidationError) as info:
        validate_xgrammar_grammar(params)
    guided = request(messages=CHAT, guide=Guide("json_schema", "{}", "tools"))
    assert refusal(info.value, guided).param == "tools"
    assert refusal(info.value, request(messages=CHAT)).param is None  # no guide: nothing to blame
    # SamplingParams' own check of a schema as vLLM verifies a request: nested deeper than 64 levels.
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"x": deep}}
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=deep))
    with pytest.raises(VLLMValidationError, match="nested too deeply") as info:
        params._validate_structured_outputs(SimpleNamespace(is_diffusion=False), StructuredOutputsConfig(), object())
    assert refusal(info.value, request(messages=CHAT, guide=Guide("json_schema", "{}"))).param == "response_format"


async def test_a_schema_reaches_vllm_only_once_it_compiled_in_the_probe_in_time(tmp_path: Path) -> None:
    """The gate before vLLM's xgrammar backend (which compiles with no time limit, one schema at a
    time): a schema xgrammar refuses, or one that does not compile within the limit, is the
    client's 400 naming the guide's parameter, before vLLM (here: nothing) sees the request."""
    import xgrammar as xgr

    vocab = ["<eos>", "{", "}", '"', "a", ":", " ", "1", ",", "[", "]", "true", "null"]
    engine = VllmEngine(options(), model_cache_dir=tmp_path)
    engine._engine = object()  # started, as far as generate can tell: anything past the gate would fail
    engine._gate = SchemaGate(xgr.TokenizerInfo(vocab, stop_token_ids=[0]).serialize_json(), GrammarLimits())
    try:
        guided = request(messages=CHAT, guide=Guide("json_schema", '{"type": "objec"}', "tools"))
        with pytest.raises(InvalidPrompt, match='Unsupported type "objec"') as refused:
            await anext(engine.generate(guided))
        assert refused.value.param == "tools"
        engine._gate.limits = GrammarLimits(compile_timeout_s=0.0)  # past it before any reply can come
        slow = request(messages=CHAT, guide=Guide("json_schema", json.dumps(SCHEMA)))
        with pytest.raises(InvalidPrompt, match="did not compile within") as refused:
            await anext(engine.generate(slow))
        assert refused.value.param == "response_format"
    finally:
        engine._gate.close()


def test_a_prompt_over_the_context_is_openais_context_length_exceeded() -> None:
    chat = context_exceeded(9000, 8192, chat=True)
    assert (chat.param, chat.code) == ("messages", "context_length_exceeded")
    assert "8192" in str(chat) and "9000" in str(chat)
    assert context_exceeded(10, 10, chat=False).param == "prompt"


# --- answers out: read from vLLM's own output classes ------------------------------------------


@pytest.mark.parametrize(
    ("vllm_reason", "expected"),
    [
        (None, None),
        ("stop", "stop"),
        ("length", "length"),
        ("abort", "cancelled"),
        ("error", "error"),
        ("new", "error"),
    ],
)
def test_finish_reason_mapping(vllm_reason: str | None, expected: str | None) -> None:
    assert finish_reason(vllm_reason) == expected


def decode_one(token_id: int) -> str:
    return f"<{token_id}>"


def test_token_logprob_as_vllms_openai_server_builds_it() -> None:
    step = {
        5: Logprob(-3.0, rank=3, decoded_token="é"),
        9: Logprob(-0.5, rank=1, decoded_token="a"),
        8: Logprob(-1.0, rank=2, decoded_token=None),
    }
    lp = token_logprob(5, step, 2, decode_one)
    assert (lp.token, lp.logprob, lp.bytes) == ("é", -3.0, [0xC3, 0xA9])
    # The 2 most likely, most likely first (not vLLM's dict order, which puts the sampled one first).
    assert [(t.token, t.logprob) for t in lp.top_logprobs] == [("a", -0.5), ("<8>", -1.0)]
    assert lp.top_logprobs[1].bytes == list(b"<8>")
    assert token_logprob(5, step, 0, decode_one).top_logprobs == []


def test_token_logprob_floors_and_fills_in() -> None:
    floored = token_logprob(3, {3: Logprob(float("-inf"), rank=1, decoded_token="x")}, 1, decode_one)
    assert floored.logprob == floored.top_logprobs[0].logprob == -9999.0
    missing = token_logprob(3, None, 2, decode_one)
    assert (missing.token, missing.logprob, missing.top_logprobs) == ("<3>", -9999.0, [])


def output(
    text: str, ids: Sequence[int], *, finish: str | None = None, logprobs: bool = False, prompt_logprobs: bool = False
) -> RequestOutput:
    """One of vLLM's DELTA outputs for a 3-token prompt [1, 2, 3]."""
    steps = [{i: Logprob(-1.5, rank=1, decoded_token=chr(i))} for i in ids] if logprobs else None
    piece = CompletionOutput(0, text, list(ids), None, steps, finish_reason=finish)
    prompt_lps = [None, {2: Logprob(-2.0, rank=1, decoded_token="b")}, {3: Logprob(-3.0, rank=1, decoded_token="c")}]
    return RequestOutput(
        "r", None, [1, 2, 3], prompt_lps if prompt_logprobs else None, [piece], finish is not None, num_cached_tokens=2
    )


def test_outputs_carry_text_tokens_logprobs_and_the_cache() -> None:
    answer = AnswerOutputs(replay=None, top_logprobs=0, echo=False, decode=decode_one)
    first = answer.step(output("ab", [97, 98], logprobs=True))
    held = answer.step(output("", [99], logprobs=True))  # vLLM holds the text back (a stop string may start)
    last = answer.step(output("cd", [100], finish="length", logprobs=True))
    assert first is not None and held is None and last is not None
    assert [(o.text, o.n_tokens, o.completion_tokens, o.token_ids) for o in (first, last)] == [
        ("ab", 2, 2, (97, 98)),
        ("cd", 2, 4, (99, 100)),
    ]
    assert [lp.token for lp in last.logprobs] == ["c", "d"]  # the held-back token's logprob came with its text
    assert (last.finish_reason, last.prompt_tokens, last.cached_tokens) == ("length", 3, 2)


def test_echo_sends_the_prompts_logprobs_once_without_its_first_token() -> None:
    answer = AnswerOutputs(replay=None, top_logprobs=0, echo=True, decode=decode_one)
    first = answer.step(output("a", [97], logprobs=True, prompt_logprobs=True))
    second = answer.step(output("b", [98], finish="stop", logprobs=True, prompt_logprobs=True))
    assert first is not None and second is not None
    assert [(lp.token, lp.logprob) for lp in first.prompt_logprobs] == [("b", -2.0), ("c", -3.0)]
    assert second.prompt_logprobs == ()


def test_a_resumed_constrained_answer_skips_what_was_sent_and_checks_it() -> None:
    answer = AnswerOutputs(
        replay=PrefixReplay(Resume(text='{"a', token_ids=(1, 2, 3), completion_tokens=3)),
        top_logprobs=None,
        echo=False,
        decode=decode_one,
    )
    assert answer.step(output('{"', [1, 2])) is None
    rest = answer.step(output('a": 1}', [3, 4, 5], finish="stop"))
    assert rest is not None and (rest.text, rest.n_tokens, rest.completion_tokens) == ('": 1}', 2, 2)
    diverging = AnswerOutputs(
        replay=PrefixReplay(Resume(text="ab", token_ids=(1, 2), completion_tokens=2)),
        top_logprobs=None,
        echo=False,
        decode=decode_one,
    )
    with pytest.raises(ReplayDiverged, match="token 1"):
        diverging.step(output("ab", [1, 9]))


def test_prefix_replay_compares_the_text_where_no_token_ids_were_kept() -> None:
    replay = PrefixReplay(Resume(text='{"a"', token_ids=(1, 2, 3), completion_tokens=3))
    assert replay.take('{"', [1, 2]) == ("", 2)
    assert replay.take('a": 1', [3, 4, 5]) == (": 1", 1)
    assert replay.done
    with pytest.raises(ReplayDiverged, match="text"):
        PrefixReplay(Resume(text="ab", token_ids=(), completion_tokens=2)).take("ax", [1, 2])


# --- tool calls through vLLM's own hermes parser -----------------------------------------------

ANSWER = (
    'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
)
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("get_weather", "get_time")
]


class RecordingHermes(Hermes2ProToolParser):
    """vLLM's hermes parser, recording the deltas it is fed."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.seen: list[tuple[str, tuple[int, ...]]] = []

    def extract_tool_calls_streaming(self, *args: Any, **kwargs: Any) -> Any:
        self.seen.append((kwargs["delta_text"], tuple(kwargs["delta_token_ids"])))
        return super().extract_tool_calls_streaming(*args, **kwargs)


def adapter(tokenizer: Any, job_id: str = "job-1", **kwargs: Any) -> tuple[VllmToolCallParser, RecordingHermes]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": ""}], tools=TOOLS, tool_choice="auto")
    parser = RecordingHermes(tokenizer, chat.tools)
    specials = Specials([*tokenizer.get_added_vocab(), *parser_tags(parser)])
    wrapped = VllmToolCallParser(
        parser, parser.adjust_request(chat), tokenizer, job_id=job_id, specials=specials, **kwargs
    )
    return wrapped, parser


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


def test_hermes_tags_are_class_attributes_and_still_found() -> None:
    assert "tool_call_start_token" not in vars(Hermes2ProToolParser(_VOCAB, None))
    assert parser_tags(Hermes2ProToolParser(_VOCAB, None)) == [END, START]


class _Vocab:
    """The least a tokenizer must have for vLLM's hermes parser to build."""

    def get_vocab(self) -> dict[str, int]:
        return {START: 1, END: 2}


_VOCAB = _Vocab()


def test_an_unknown_tool_parser_names_the_known_ones() -> None:
    with pytest.raises(EngineError, match="hermes"):
        tool_parser_class("no-such-parser")
    assert tool_parser_class("hermes") is Hermes2ProToolParser


def test_segmenter_pieces() -> None:
    segmenter = Segmenter(Specials([START, END]))
    assert segmenter.push("Hi  there<tool_ca") == ["Hi", "  ", "there"]  # "<tool_ca" may be a tag
    assert segmenter.push('ll>{"a": 12') == [START, "{", '"', "a", '"', ":", " "]  # "12" may go on
    assert segmenter.push("<b") == ["12", "<"]  # "<b" can no longer be a tag; "b" may go on
    assert segmenter.flush() == ["b"]


def test_segmenter_ignores_added_tokens_that_start_like_words() -> None:
    segmenter = Segmenter(Specials(["assistant", "<x>"]))
    assert segmenter.push("assistant<x> ") == ["assistant", "<x>"]


@pytest.mark.parametrize("seed", range(4))
def test_segmenter_pieces_depend_only_on_the_text(seed: int) -> None:
    rng = random.Random(seed)
    whole = Segmenter(Specials([START, END]))
    expected = whole.push(ANSWER) + whole.flush()
    segmenter = Segmenter(Specials([START, END]))
    pieces = [p for chunk in cut(ANSWER, rng, 25) for p in segmenter.push(chunk)] + segmenter.flush()
    assert pieces == expected
    assert "".join(pieces) == ANSWER


def test_vllms_hermes_parser_turns_the_answer_into_content_and_calls(tokenizer: Any) -> None:
    parser, hermes = adapter(tokenizer)
    outputs = feed_all(parser, [ANSWER])
    content, calls = render(outputs)
    assert content == "Let me check."
    assert calls == [
        {"id": tool_call_id("job-1", 0), "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"id": tool_call_id("job-1", 1), "name": "get_time", "arguments": '{"tz": "CET"}'},
    ]
    assert parser.called
    firsts = [d for _, deltas in outputs for d in deltas if d.id is not None]
    assert [(d.type, d.function and d.function.name) for d in firsts] == [
        ("function", "get_weather"),
        ("function", "get_time"),
    ]
    # The tags reached vLLM's parser whole, with their token ids, as vLLM's engine sends an added token.
    assert (START, tuple(tokenizer.encode(START, add_special_tokens=False))) in hermes.seen


def test_an_answer_without_calls_is_content(tokenizer: Any) -> None:
    parser, _ = adapter(tokenizer)
    assert render(feed_all(parser, ["Just ", "words, ", "no <tools>."])) == ("Just words, no <tools>.", [])
    assert not parser.called


@pytest.mark.parametrize("seed", range(3))
def test_vllms_parser_sees_the_same_pieces_however_the_text_arrives(tokenizer: Any, seed: int) -> None:
    whole, whole_hermes = adapter(tokenizer)
    expected = render(feed_all(whole, [ANSWER]))
    chopped, chopped_hermes = adapter(tokenizer)
    assert render(feed_all(chopped, cut(ANSWER, random.Random(seed), 30))) == expected
    assert chopped_hermes.seen == whole_hermes.seen


@pytest.mark.parametrize("published", [5, 14, 30, 60, 95, len(ANSWER) - 3])
def test_a_resumed_answer_continues_exactly(tokenizer: Any, published: int) -> None:
    """A worker dies after publishing the first `published` characters' worth of outputs; the next
    one feeds a fresh parser the published raw text (its output was already sent), then the rest."""
    uninterrupted = render(feed_all(adapter(tokenizer)[0], list(ANSWER)))
    first, _ = adapter(tokenizer)
    sent = [first.feed(c) for c in ANSWER[:published]]
    second, _ = adapter(tokenizer)
    second.feed(ANSWER[:published])
    assert render(sent + feed_all(second, list(ANSWER[published:]))) == uninterrupted


def test_parallel_tool_calls_false_keeps_the_first_call(tokenizer: Any) -> None:
    parser, _ = adapter(tokenizer, parallel_tool_calls=False)
    _, calls = render(feed_all(parser, [ANSWER]))
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "Paris"}')]


def test_a_call_cut_off_by_the_end_of_the_answer_still_gets_its_arguments(tokenizer: Any) -> None:
    # No closing tag (max_tokens ran out): vLLM's server sends what the parser parsed but had not
    # streamed when the answer ends; so does the adapter.
    parser, _ = adapter(tokenizer)
    _, calls = render(feed_all(parser, ['x<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}']))
    assert json.loads(calls[0]["arguments"] or "") == {"city": "Oslo"}


def test_a_failing_vllm_parser_is_an_engine_error(tokenizer: Any) -> None:
    parser, hermes = adapter(tokenizer)

    def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("parser broke")

    hermes.extract_tool_calls_streaming = broken  # type: ignore[method-assign]
    with pytest.raises(EngineError, match="tool parser"):
        feed_all(parser, ["some words "])


async def test_an_engine_refuses_work_before_it_starts() -> None:
    engine = VllmEngine(options(lora_adapters={"sql": "/a"}), model_cache_dir=Path("/nonexistent"))
    with pytest.raises(EngineError, match="not started"):
        await engine.check_health()
    with pytest.raises(EngineError, match="not started"):
        [out async for out in engine.generate(request(prompt="p"))]
    with pytest.raises(EngineError, match="adapter 'fr'"):
        engine._lora_request("fr")
    assert engine._lora_request(None) is None


def test_the_prefix_index_turns_on_vllms_kv_events_on_ipc_sockets_only() -> None:
    endpoint, replay = kv_events_endpoints()
    config = KVEventsConfig(**kv_events_kwargs(endpoint, replay))
    assert config.enable_kv_cache_events and config.publisher == "zmq"
    # No TCP port: the worker reads its own engine's events on its own sockets.
    assert config.endpoint.startswith("ipc://") and config.replay_endpoint.startswith("ipc://")
    assert config.topic == KV_EVENTS_TOPIC
    assert create_engine(WorkerSettings(engine="vllm", model="m", model_path="/models/m"))._options.kv_events


async def test_vllms_published_events_are_read_live_and_replayed() -> None:
    endpoint, replay = kv_events_endpoints()
    publisher = ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay, topic=KV_EVENTS_TOPIC)
    source = VllmKvEvents(endpoint, replay, topic=KV_EVENTS_TOPIC)
    try:
        stored = VllmBlockStored(
            block_hashes=[b"h1", b"h2"],
            parent_block_hash=None,
            token_ids=list(range(32)),
            block_size=16,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
        offloaded = VllmBlockRemoved(block_hashes=[b"h9"], medium="CPU")
        # PUB/SUB drops what is sent before the subscription lands: publish until one arrives.
        first = None
        while first is None:
            publisher.publish(KVEventBatch(ts=1.0, events=[stored]))
            with contextlib.suppress(TimeoutError):
                first = await asyncio.wait_for(source.next_batch(), 0.2)
        assert first.events == [BlockStored([b"h1", b"h2"], None, list(range(32)), 16, None)]
        removed = VllmBlockRemoved(block_hashes=[b"h1"], medium="GPU")
        publisher.publish(KVEventBatch(ts=2.0, events=[removed, offloaded]))
        publisher.publish(KVEventBatch(ts=3.0, events=[VllmAllBlocksCleared()]))
        second, third = await source.next_batch(), await source.next_batch()
        assert (second.seq, third.seq) == (first.seq + 1, first.seq + 2)
        # A removal from an offloading tier is not the engine's own cache.
        assert second.events == [BlockRemoved([b"h1"]), BlockRemoved(())]
        assert third.events == [AllBlocksCleared()]
        replayed = await asyncio.wait_for(source.replay(second.seq), 5)
        assert [b.seq for b in replayed] == [second.seq, third.seq]
        assert replayed[1].events == [AllBlocksCleared()]
    finally:
        publisher.shutdown()
        source.close()
    assert not os.path.exists(replay.removeprefix("ipc://"))  # the sockets' directory went with it


def test_a_rendered_chat_prompt_is_told_to_the_index_with_each_tokens_place(tokenizer: Any, tmp_path: Path) -> None:
    """One tokenization gives vLLM its ids and the prefix index their places: each anchor of the
    document is tied to the last whole block before it in the rendered template."""
    engine = VllmEngine(options(), model_cache_dir=tmp_path)
    engine._tokenizer = tokenizer
    seen: list[tuple[GenerationRequest, RenderedPrompt]] = []
    engine.prompt_observer = lambda req, prompt: seen.append((req, prompt))
    document = "Document 7. " + "the river town market bridge " * 120
    chat = request(messages=[Message(role="user", content=f"{document}\n\nQuestion: why?")])
    ids = engine._prompt_ids(chat, continued=None)
    ((_, prompt),) = seen
    assert list(prompt.token_ids) == ids == tokenizer.encode(prompt.text, add_special_tokens=False)
    assert len(prompt.token_ends) == len(ids) and list(prompt.token_ends) == sorted(prompt.token_ends)
    index = KvIndex(None, Names("t"), model="m", worker_id="w", block_size=16, max_pending=100)  # type: ignore[arg-type]
    index.observe(chat, prompt)
    found = anchors(messages=chat.messages, prompt=None)
    start = prompt.text.index(document)
    for anchor in found[:-1]:
        tokens = sum(1 for end in prompt.token_ends if end <= start + anchor.end)
        assert index._anchor_block[anchor.key] == block_keys_of(ids)[tokens // 16 - 1]
    # A resumed request is not told: its prompt holds an answer already.
    engine._prompt_ids(request(messages=chat.messages), continued=Resume(text="x", token_ids=(), completion_tokens=1))
    assert len(seen) == 1


def block_keys_of(ids: Sequence[int], size: int = 16) -> list[bytes]:
    keys, parent = [], root_key(None)
    for end in range(size, len(ids) + 1, size):
        parent = block_key(parent, ids[end - size : end])
        keys.append(parent)
    return keys
