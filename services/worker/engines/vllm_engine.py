"""Production GPU engine: vLLM's async engine with tensor and pipeline parallelism, on one node or,
with vLLM's Ray executor, several (`AXON_PIPELINE_PARALLEL_SIZE`, `AXON_DISTRIBUTED_EXECUTOR`).

vLLM is imported only when this engine starts, so nothing else in Axon needs it. Everything a
request asks for is mapped onto vLLM's own machinery, written against its public API:

- sampling: `vllm.SamplingParams` (penalties, `logit_bias`, `seed`, `stop`, `min_tokens`,
  `ignore_eos`, `logprobs`, `prompt_logprobs`); a parameter the request leaves unset takes the
  model's generation config (`ModelConfig.get_diff_sampling_param()`, as vLLM's OpenAI server does);
- constraints: `StructuredOutputsParams(json=…)` / `(json_object=True)`, enforced by the backend
  `AXON_STRUCTURED_OUTPUTS_BACKEND` (`StructuredOutputsConfig`, xgrammar by default);
- tools: the model's chat template gets `tools=`, history keeps `tool_calls` (arguments as parsed
  JSON, as vLLM passes them) and `tool_call_id`; under `tool_choice: auto` the answer is parsed by
  vLLM's tool parser `AXON_TOOL_PARSER` (`vllm_tools.py`);
- logprobs: vLLM's `Logprob`s converted as its OpenAI server converts them;
- LoRA adapters (`AXON_LORA_ADAPTERS`): the engine starts with `enable_lora`, `max_loras` and
  `max_lora_rank`, and a request for an adapter carries its `LoRARequest` (name, a fixed id per
  adapter, path), which vLLM loads on first use and batches with the others.

A resumed constrained answer cannot continue its grammar from the text already sent (vLLM has no
way to start a structured-output request in a given state), so it is generated again from the
start with the same seed and the already-sent part is checked and skipped; if it comes out
different, the job fails rather than send text the constraint never saw (`PrefixReplay`).
"""

import asyncio
import hashlib
import json
import math
import os
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, ClassVar, get_args

from services.worker.engines.base import (
    Engine,
    EngineError,
    EngineOutput,
    GenerationRequest,
    Guide,
    InvalidPrompt,
    Resume,
    ToolCallParser,
)
from services.worker.engines.vllm_tools import Specials, VllmToolCallParser
from shared.logging import get_logger
from shared.schemas import Capability, FinishReason, FunctionSpec, Job, Message, Sampling, TokenLogprob, TopLogprob

log = get_logger(__name__)

_FINISH_REASONS: dict[str | None, FinishReason | None] = {
    None: None,
    "stop": "stop",
    "length": "length",
    "abort": "cancelled",
}

# Parameters whose unset value is the model's generation config, when it sets them.
_MODEL_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# OpenAI's (and vLLM's) logprob for a token outside the returned ones.
_LOGPROB_FLOOR = -9999.0

Decode = Callable[[int], str]


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
        raise InvalidPrompt(f"The answer's JSON schema is not JSON: {exc}") from exc
    return {"json": schema}


def lora_engine_kwargs(adapters: Mapping[str, str], *, max_loras: int, max_lora_rank: int) -> dict[str, Any]:
    """`AsyncEngineArgs` keyword arguments for serving `adapters` (none without adapters: LoRA
    support costs GPU memory)."""
    if not adapters:
        return {}
    return {"enable_lora": True, "max_loras": max_loras, "max_lora_rank": max_lora_rank}


def lora_request_kwargs(adapters: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Each adapter's `vllm.lora.request.LoRARequest` keyword arguments: its name, its path and an
    id of its own (vLLM keys its adapter cache by the id, which must be positive), fixed by the
    names' order."""
    return {
        name: {"lora_name": name, "lora_int_id": number, "lora_path": adapters[name]}
        for number, name in enumerate(sorted(adapters), start=1)
    }


def finish_reason(vllm_reason: str | None) -> FinishReason | None:
    return _FINISH_REASONS.get(vllm_reason, "error")


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
        raise InvalidPrompt(f"A tool call's arguments in the messages are not JSON: {exc}") from exc


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


def token_logprob(token_id: int, step: Mapping[int, Any] | None, top: int, decode: Decode) -> TokenLogprob:
    """One position of vLLM's logprobs (`{token id: Logprob}`) as OpenAI's, as vLLM's server builds
    it: the token's text is vLLM's `decoded_token`, its logprob floored at -9999, `bytes` its UTF-8;
    `top_logprobs` the `top` most likely tokens (by vLLM's `rank`), most likely first."""
    chosen = step.get(token_id) if step else None
    if chosen is None:  # vLLM returned nothing for the sampled token
        text = decode(token_id)
        return TokenLogprob(token=text, logprob=_LOGPROB_FLOOR, bytes=_utf8(text))
    text = _decoded(token_id, chosen, decode)
    return TokenLogprob(
        token=text,
        logprob=_floored(chosen.logprob),
        bytes=_utf8(text),
        top_logprobs=_top_logprobs(step, top, decode) if step and top > 0 else [],
    )


def prompt_logprobs(
    token_ids: Sequence[int], steps: Sequence[Mapping[int, Any] | None], top: int, decode: Decode
) -> tuple[TokenLogprob, ...]:
    """vLLM's prompt logprobs for `echo`. The first prompt token has none (nothing precedes it);
    it is left out."""
    return tuple(
        token_logprob(tid, step, top, decode) for tid, step in zip(token_ids, steps, strict=False) if step is not None
    )


def _top_logprobs(step: Mapping[int, Any], top: int, decode: Decode) -> list[TopLogprob]:
    # vLLM's dict holds the sampled token (with its true rank) and the ranks 1..k.
    ranked = sorted((lp.rank, tid) for tid, lp in step.items() if lp.rank is not None and 1 <= lp.rank <= top)
    ids = [tid for _, tid in ranked] if ranked else list(step)[:top]
    entries = []
    for tid in ids:
        text = _decoded(tid, step[tid], decode)
        entries.append(TopLogprob(token=text, logprob=_floored(step[tid].logprob), bytes=_utf8(text)))
    return entries


def _decoded(token_id: int, logprob: Any, decode: Decode) -> str:
    text = logprob.decoded_token
    return text if text is not None else decode(token_id)


def _floored(logprob: float) -> float:
    return _LOGPROB_FLOOR if math.isnan(logprob) else max(logprob, _LOGPROB_FLOOR)


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


class ReplayDiverged(Exception):
    """A resumed constrained answer, generated again, differs from what was already sent."""


class PrefixReplay:
    """Checks the already-sent start of a regenerated answer and cuts it off.

    Fed vLLM's outputs in order, `take` returns the text after the already-sent text and the
    index of the first new token in each output. The token ids are compared (when the earlier
    attempt recorded them) and so is the text; any difference raises `ReplayDiverged`.
    """

    def __init__(self, resume: Resume) -> None:
        self._text = resume.text
        self._ids = resume.token_ids
        self._tokens = len(resume.token_ids) if resume.token_ids else resume.completion_tokens
        self._seen_text = ""
        self._seen_tokens = 0
        self.done = not self._text and self._tokens == 0

    def take(self, text: str, token_ids: Sequence[int]) -> tuple[str, int]:
        for offset, token_id in enumerate(token_ids[: max(0, len(self._ids) - self._seen_tokens)]):
            if token_id != self._ids[self._seen_tokens + offset]:
                raise ReplayDiverged(f"token {self._seen_tokens + offset} differs")
        first_new = min(len(token_ids), max(0, self._tokens - self._seen_tokens))
        self._seen_tokens += len(token_ids)
        self._seen_text += text
        if len(self._seen_text) < len(self._text):
            if not self._text.startswith(self._seen_text):
                raise ReplayDiverged("the text differs")
            return "", first_new
        if not self._seen_text.startswith(self._text):
            raise ReplayDiverged("the text differs")
        new_text = self._seen_text[len(self._text) :]
        self._seen_text = self._text
        self.done = self._seen_tokens >= self._tokens
        return new_text, first_new


class _Answer:
    """Turns the `RequestOutputKind.DELTA` outputs of one vLLM request into `EngineOutput`s.

    Tokens whose text vLLM holds back (an incomplete character, a possible stop string) wait for
    the next output with text, with their logprobs; a resumed constrained answer's regenerated
    start is skipped (`PrefixReplay`).
    """

    def __init__(self, *, replay: PrefixReplay | None, top_logprobs: int | None, echo: bool, decode: Decode) -> None:
        self._replay = replay
        self._top = top_logprobs
        self._want_prompt_logprobs = echo and top_logprobs is not None
        self._decode = decode
        self._prompt_tokens = 0
        self._completion_tokens = 0
        self._unsent_ids: list[int] = []
        self._unsent_logprobs: list[TokenLogprob] = []

    def step(self, output: Any) -> EngineOutput | None:
        if output.prompt_token_ids:
            self._prompt_tokens = len(output.prompt_token_ids)
        piece = output.outputs[0]
        token_ids = list(piece.token_ids)
        text, first_new = piece.text, 0
        if self._replay is not None and not self._replay.done:
            text, first_new = self._replay.take(text, token_ids)
        self._completion_tokens += len(token_ids) - first_new
        self._unsent_ids.extend(token_ids[first_new:])
        if self._top is not None and piece.logprobs is not None:
            self._unsent_logprobs.extend(
                token_logprob(token_ids[i], piece.logprobs[i], self._top, self._decode)
                for i in range(first_new, len(token_ids))
            )
        prompt_lps: tuple[TokenLogprob, ...] = ()
        if self._want_prompt_logprobs and output.prompt_logprobs:
            assert self._top is not None
            prompt_lps = prompt_logprobs(output.prompt_token_ids, output.prompt_logprobs, self._top, self._decode)
            self._want_prompt_logprobs = False
        reason = finish_reason(piece.finish_reason) if output.finished else None
        if reason in ("stop", "length") and self._replay is not None and not self._replay.done:
            raise ReplayDiverged("the answer ended before the text already sent")
        if not text and reason is None and not prompt_lps:
            return None
        out = EngineOutput(
            text,
            len(self._unsent_ids),
            self._prompt_tokens,
            self._completion_tokens,
            reason,
            tuple(self._unsent_ids),
            tuple(self._unsent_logprobs),
            prompt_lps,
            cached_tokens=getattr(output, "num_cached_tokens", None) or 0,
        )
        self._unsent_ids, self._unsent_logprobs = [], []
        return out


def _added_tokens(tokenizer: Any) -> list[str]:
    added = getattr(tokenizer, "get_added_vocab", None)
    return list(added()) if added is not None else []


def tool_parser_class(name: str) -> Any:
    """vLLM's tool parser class registered as `name` (`ToolParserManager`)."""
    try:
        from vllm.tool_parsers import ToolParserManager
    except ImportError:  # vLLM before the parsers moved to vllm.tool_parsers
        from vllm.entrypoints.openai.tool_parsers import ToolParserManager
    try:
        return ToolParserManager.get_tool_parser(name)
    except KeyError:
        known = ", ".join(ToolParserManager.list_registered()) if hasattr(ToolParserManager, "list_registered") else ""
        raise EngineError(f"AXON_TOOL_PARSER={name!r} is not a vLLM tool parser (known: {known}).") from None


def _chat_request_class() -> Any:
    try:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    except ImportError:  # vLLM before the OpenAI protocol was split by endpoint
        from vllm.entrypoints.openai.protocol import ChatCompletionRequest
    return ChatCompletionRequest


class VllmEngine(Engine):
    """`vllm.v1.engine.async_llm.AsyncLLM` behind the `Engine` interface."""

    # Every request parameter: each maps onto vLLM's own machinery (a new `Capability` must be
    # mapped here before the engine claims it).
    supports: ClassVar[frozenset[Capability]] = frozenset(get_args(Capability))

    def __init__(
        self,
        *,
        model_name: str,
        model_path: str,
        tensor_parallel_size: int,
        max_seqs: int,
        gpu_memory_utilization: float,
        max_model_len: int | None,
        structured_outputs_backend: str = "xgrammar",
        tool_parser: str = "hermes",
        pipeline_parallel_size: int = 1,
        distributed_executor: str | None = None,
        lora_adapters: Mapping[str, str] | None = None,
        max_loras: int = 4,
        max_lora_rank: int = 16,
    ) -> None:
        self.model_name = model_name
        self.max_seqs = max_seqs
        self._lora_adapters = dict(lora_adapters or {})
        self.adapters = frozenset(self._lora_adapters)
        self._engine_kwargs = {
            "model": model_path,
            "served_model_name": [model_name],
            "tensor_parallel_size": tensor_parallel_size,
            "max_num_seqs": max_seqs,
            "gpu_memory_utilization": gpu_memory_utilization,
            "max_model_len": max_model_len,
            "pipeline_parallel_size": pipeline_parallel_size,
            # None (left out below): vLLM picks mp when the GPUs are on this node.
            "distributed_executor_backend": distributed_executor,
        } | lora_engine_kwargs(self._lora_adapters, max_loras=max_loras, max_lora_rank=max_lora_rank)
        self._structured_outputs_backend = structured_outputs_backend
        self._tool_parser_name = tool_parser
        self._engine: Any = None
        # Each adapter's `LoRARequest`, made at start.
        self._lora_requests: dict[str, Any] = {}
        self._tokenizer: Any = None
        self._tool_parser: Any = None
        self._request_class: Any = None
        # The model's generation config: defaults for sampling parameters a request leaves unset.
        self._defaults: dict[str, Any] = {}
        # The tokenizer's added tokens and the tool parser's tags (`<tool_call>`, …): the tool
        # parser gets them whole, as one delta, as from vLLM's engine when they are one token.
        self._specials = Specials()
        self.context_tokens = max_model_len or 0

    async def start(self) -> None:
        try:
            from vllm.config import StructuredOutputsConfig
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise EngineError("AXON_ENGINE=vllm needs vLLM installed (the GPU image has it).") from exc
        self._tool_parser = tool_parser_class(self._tool_parser_name)  # a wrong name fails before loading
        self._lora_requests = self._make_lora_requests()
        self._request_class = _chat_request_class()
        args = AsyncEngineArgs(
            **{k: v for k, v in self._engine_kwargs.items() if v is not None},
            structured_outputs_config=StructuredOutputsConfig(backend=self._structured_outputs_backend),
        )
        # The load takes minutes for a large model: it runs on a thread so the worker's event loop
        # keeps answering /health and /metrics. AsyncLLM is made to be built outside a running
        # loop (it starts its output handler at the first request); its engine core processes are
        # spawned rather than forked from this thread, which the loop's thread runs beside.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        self._engine = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
        self._tokenizer = await self._engine.get_tokenizer()
        self.context_tokens = int(self._engine.model_config.max_model_len)
        self._defaults = dict(self._engine.model_config.get_diff_sampling_param() or {})
        self._specials = Specials([*_added_tokens(self._tokenizer), *self._parser_tags()])
        log.info(
            "vllm_engine_started",
            **self._engine_kwargs,
            structured_outputs_backend=self._structured_outputs_backend,
            tool_parser=self._tool_parser_name,
            generation_defaults=self._defaults,
        )

    def _make_lora_requests(self) -> dict[str, Any]:
        if not self._lora_adapters:
            return {}
        from vllm.lora.request import LoRARequest

        return {name: LoRARequest(**kwargs) for name, kwargs in lora_request_kwargs(self._lora_adapters).items()}

    async def stop(self) -> None:
        if self._engine is not None:
            engine, self._engine = self._engine, None
            engine.shutdown()

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

    def _parser_tags(self) -> list[str]:
        """The tags the tool parser looks for (its `…_token` text attributes: hermes'
        `tool_call_start_token`, mistral's `bot_token`, …). A parser that does not fit the
        model's tokenizer fails here, at start."""
        try:
            probe = self._tool_parser(self._tokenizer)
        except Exception as exc:
            self._engine.shutdown()
            self._engine = None
            raise EngineError(f"vLLM's tool parser {self._tool_parser_name!r} does not fit the model: {exc}") from exc
        return [v for k, v in vars(probe).items() if k.endswith("_token") and isinstance(v, str)]

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
        """A fresh vLLM tool parser and the `ChatCompletionRequest` it adjusted (`adjust_request`,
        as vLLM's server does for every request: the hermes parser keeps special tokens in the
        text, for instance). vLLM's parsers read the request's tools and tool_choice, not its
        messages, so the messages are a placeholder."""
        if self._tokenizer is None:
            raise EngineError("The vLLM engine is not started.")
        parser = self._tool_parser(self._tokenizer)
        try:
            request = self._request_class(
                model=self.model_name,
                messages=[{"role": "user", "content": ""}],
                tools=tool_dicts(tools),
                tool_choice="auto",
                parallel_tool_calls=parallel_tool_calls,
            )
        except ValueError as exc:  # pydantic's ValidationError included
            raise InvalidPrompt(f"vLLM refused the tools: {exc}") from exc
        return parser, parser.adjust_request(request)

    def _prompt_ids(self, request: GenerationRequest, *, continued: Resume | None) -> list[int]:
        """The prompt's token ids: a chat rendered by the model's template (with the tools) and
        tokenized without added special tokens, as vLLM's chat endpoint does; a completion prompt
        tokenized with them. `continued`: the answer so far follows (its recorded token ids)."""
        from jinja2 import TemplateError

        tokenizer = self._tokenizer
        if request.messages is not None:
            conversation = chat_conversation(request.messages)
            try:
                text: str = tokenizer.apply_chat_template(
                    conversation, tokenize=False, add_generation_prompt=True, tools=tool_dicts(request.tools)
                )
            except (ValueError, TypeError, RuntimeError, TemplateError) as exc:
                raise InvalidPrompt(f"The model's chat template refused the messages: {exc}") from exc
            ids = list(tokenizer.encode(text, add_special_tokens=False))
        else:
            ids = list(tokenizer.encode(request.prompt or "", add_special_tokens=True))
        if continued is not None:
            ids += continued.token_ids or tokenizer.encode(continued.text, add_special_tokens=False)
        return ids

    def _params(self, request: GenerationRequest, *, replay: bool) -> dict[str, Any]:
        """`SamplingParams` keyword arguments for `request` (the constraint excepted)."""
        sampling = request.sampling
        kwargs = sampling_kwargs(sampling, self._defaults)
        resume = request.resume
        if resume is not None and replay:  # generated again from the start: the whole budget
            kwargs["max_tokens"] = sampling.max_tokens + resume.completion_tokens
        elif resume is not None and sampling.min_tokens:
            kwargs["min_tokens"] = max(0, sampling.min_tokens - resume.completion_tokens)
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

    async def generate(self, request: GenerationRequest) -> AsyncIterator[EngineOutput]:
        if self._engine is None:
            raise EngineError("The vLLM engine is not started.")
        from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

        replay = PrefixReplay(request.resume) if request.resume is not None and request.guide is not None else None
        try:
            prompt_ids = self._prompt_ids(request, continued=request.resume if replay is None else None)
            kwargs = self._params(request, replay=replay is not None)
            if request.guide is not None:
                kwargs["structured_outputs"] = StructuredOutputsParams(**structured_outputs_kwargs(request.guide))
            params = SamplingParams(**kwargs, output_kind=RequestOutputKind.DELTA)
            outputs = self._engine.generate(
                {"prompt_token_ids": prompt_ids},
                params,
                request.request_id,
                lora_request=self._lora_request(request.adapter),
            )
            first = await anext(outputs)
        except ValueError as exc:  # vLLM refuses what it cannot take (too long, a bad schema or bias)
            raise InvalidPrompt(str(exc)) from exc
        except StopAsyncIteration:
            raise EngineError("vLLM ended the request without output.") from None
        answer = _Answer(
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


async def _chain(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for item in rest:
        yield item
