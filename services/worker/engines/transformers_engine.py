"""CPU (and development) engine: transformers' continuous batching on a local GGUF model.

The GGUF is loaded from its float32 copy in the model cache (`gguf.converted_model`: made at the
first start, about 20 s; every later start loads it in under a second); without a cache, or one
that cannot be written, from the GGUF itself (about 20 s at every start), the same weights.

The model runs in transformers' own background generation thread; this class only
moves requests in and token ids out, so the worker's event loop never blocks.
Everything a request asks of the sampler (temperature, top_k, top_p, min_p, a grammar, logit
bias, penalties, min_tokens, ignore_eos, a seed, logprobs) goes through `cpu_sampling.py`, which
does the sampling inside transformers' batching; grammars come from `grammar.py`. Parameters a request leaves
unset take the model's generation config where it sets them, else OpenAI's defaults.
Tools are written into the prompt by `prompts.tool_prompt_messages` (the bundled model's chat
template knows nothing of tools). Completions' `echo` with `logprobs` scores the prompt with
`PromptScorer`. Stop strings are cut here.

LoRA adapters (`lora_adapters`) are served through peft, each in a lane of its own: a second
instance of the model that shares every base weight (`sharing_weights`), with the adapter's LoRA
layers injected by `PeftModel.from_pretrained` (unmerged, as peft's own generate runs them), and
its own batching manager, sampling extension and prompt scorer. Requests of one adapter batch
together; different adapters (and the base model) run side by side in their own generation
threads. A lane costs the adapter's weights, one KV cache of `kv_cache_blocks` and one thread,
and each LoRA layer adds two small matrix products per step. Prefix sharing stays within a lane,
where it is correct: an adapter on the attention's projections changes the keys and values a
prompt leaves in the cache.
"""

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, get_args

from services.worker.engines.base import (
    Engine,
    EngineError,
    EngineOutput,
    EngineStopped,
    GenerationRequest,
    InvalidPrompt,
    context_exceeded,
)
from services.worker.engines.gguf import converted_model
from services.worker.engines.grammar import GrammarLimits
from services.worker.engines.text import IncrementalDetokenizer, StopMatcher
from services.worker.prompts import tool_prompt_messages
from shared.logging import get_logger
from shared.schemas import Capability, FinishReason, TokenLogprob, TopLogprob

log = get_logger(__name__)

_CANCELLED = object()
# Put in the queue of every request still running when the engine stops.
_STOPPED = object()
# OpenAI's floor for a logprob too small to report.
_LOGPROB_FLOOR = -9999.0


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """What a request's unset sampling parameters mean: the model's generation config where it
    sets them (as vLLM reads `generation_config.json`), else OpenAI's (temperature 1, top_p 1)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @classmethod
    def of(cls, generation_config: Any) -> "SamplingDefaults":
        found: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            value = getattr(generation_config, f.name, None)
            if value is not None:
                found[f.name] = int(value) if f.name == "top_k" else float(value)
        return cls(**found)


def sharing_weights(model: Any) -> Any:
    """A second instance of `model` that shares its weights: `deepcopy` with the parameters and
    buffers in the memo, so only the modules and the config are new."""
    import copy

    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, shared)


def with_adapter(model: Any, name: str, path: Path) -> Any:
    """A second instance of `model` (sharing its weights) with the peft LoRA adapter at `path`
    injected and active.

    Raises:
        EngineError: the adapter is missing or does not fit the model.
    """
    from peft import PeftModel

    if not (path / "adapter_config.json").is_file():
        raise EngineError(f"LoRA adapter {name!r}: no peft adapter (adapter_config.json) in {path}")
    instance = sharing_weights(model)
    try:
        PeftModel.from_pretrained(instance, str(path), adapter_name=name, is_trainable=False)
    except (ValueError, OSError, KeyError, RuntimeError) as exc:
        raise EngineError(f"LoRA adapter {name!r} at {path} does not fit the model: {exc}") from exc
    return instance


@dataclasses.dataclass(frozen=True, slots=True)
class _Lane:
    """One generation loop: the base model's, or one adapter's (`with_adapter`)."""

    manager: Any  # transformers' ContinuousBatchingManager
    # A cpu_sampling.SamplingExtension: it holds the rows of its manager's current batch.
    extension: Any
    scorer: "PromptScorer"


class PromptScorer:
    """The log probabilities of a prompt's tokens (completions' `echo` with `logprobs`).

    A forward pass of the prompt through a second instance of the model that shares its weights
    (`sharing_weights`), made before the batching manager changes anything of the model. It runs
    on a worker thread beside the generation thread; both only read the weights, and one prompt is
    scored at a time. The logits are computed 256 positions at a time, so a long prompt does not
    hold a positions x vocabulary matrix.
    """

    _CHUNK = 256

    def __init__(self, model: Any) -> None:
        self._model = sharing_weights(model)
        self._lock = threading.Lock()

    def score(self, token_ids: Sequence[int], top: int) -> list[tuple[int, float, list[tuple[int, float]]]]:
        """(token, logprob, top alternatives) for each prompt token but the first (nothing precedes it)."""
        import torch

        with self._lock, torch.inference_mode():
            ids = torch.tensor([list(token_ids)], dtype=torch.long)
            hidden = self._model.get_decoder()(input_ids=ids).last_hidden_state[0]
            head = self._model.get_output_embeddings()
            scores: list[tuple[int, float, list[tuple[int, float]]]] = []
            for start in range(0, len(token_ids) - 1, self._CHUNK):
                targets = list(token_ids[start + 1 : start + 1 + self._CHUNK])
                logprobs = torch.log_softmax(head(hidden[start : start + len(targets)]).float(), dim=-1)
                chosen = logprobs.gather(1, torch.tensor(targets).unsqueeze(1)).squeeze(1).tolist()
                if top:
                    values, indices = torch.topk(logprobs, top, dim=-1)
                    alternatives = [
                        list(zip(i, v, strict=True)) for i, v in zip(indices.tolist(), values.tolist(), strict=True)
                    ]
                else:
                    alternatives = [[] for _ in targets]
                scores.extend(zip(targets, chosen, alternatives, strict=True))
            return scores


class TransformersEngine(Engine):
    """transformers `ContinuousBatchingManager` behind the `Engine` interface."""

    name = "transformers"

    supports: ClassVar[frozenset[Capability]] = frozenset(get_args(Capability))

    def __init__(
        self,
        *,
        model_name: str,
        gguf_path: Path,
        max_seqs: int,
        kv_cache_blocks: int,
        max_batch_tokens: int,
        threads: int | None,
        grammar_limits: GrammarLimits | None = None,
        lora_adapters: dict[str, Path] | None = None,
        model_cache_dir: Path | None = None,
    ) -> None:
        self.model_name = model_name
        self._model_cache_dir = model_cache_dir
        self.max_seqs = max_seqs
        self._lora_adapters = dict(lora_adapters or {})
        self.adapters = frozenset(self._lora_adapters)
        self._gguf_path = gguf_path
        self._kv_cache_blocks = kv_cache_blocks
        self._max_batch_tokens = max_batch_tokens
        self._threads = threads
        self._grammar_limits = grammar_limits or GrammarLimits()
        # The base model's lane (key None) and each adapter's, once loaded.
        self._lanes: dict[str | None, _Lane] = {}
        self._grammars: Any = None  # grammar.Grammars, once loaded
        self._token_bytes: list[bytes] = []
        self._defaults = SamplingDefaults()
        self._tokenizer: Any = None
        self._eos_ids: set[int] = set()
        self._vocab_size = 0
        self.context_tokens = 0
        # Per request: transformers' outputs (untyped), or `_CANCELLED`; and the lane it runs in.
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._lane_of: dict[str, _Lane] = {}
        # Prompt tokens each request found in transformers' prefix cache (`cpu_sampling.prefix_hits`).
        self._prefix_hits: dict[str, int] = {}
        # Set by `stop()`: requests still running fail with `EngineStopped`, not as engine errors.
        self._stopping = False

    async def start(self) -> None:
        await asyncio.to_thread(self._load)

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from services.worker.engines.cpu_sampling import prefix_hits
        from services.worker.engines.grammar import Grammars

        if not self._gguf_path.is_file():
            raise EngineError(f"Model file not found: {self._gguf_path}")
        if self._threads:
            torch.set_num_threads(self._threads)
        log.info("model_loading", path=str(self._gguf_path))
        source = self._source()
        self._tokenizer = AutoTokenizer.from_pretrained(**source)
        model = AutoModelForCausalLM.from_pretrained(**source)
        eos = self._tokenizer.eos_token_id
        self._eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
        self._vocab_size = int(model.config.vocab_size)
        self.context_tokens = int(getattr(model.config, "max_position_embeddings", 2048))
        self._defaults = SamplingDefaults.of(model.generation_config)
        self._grammars = Grammars.for_tokenizer(
            self._tokenizer, vocab_size=self._vocab_size, eos_ids=self._eos_ids, limits=self._grammar_limits
        )
        self._token_bytes = self._grammars.token_bytes
        # Every instance of the model is made before a batching manager changes anything of it.
        instances = {None: model} | {
            name: with_adapter(model, name, path) for name, path in self._lora_adapters.items()
        }
        scorers = {adapter: PromptScorer(instance) for adapter, instance in instances.items()}
        self._prefix_hits = prefix_hits
        for adapter, instance in instances.items():
            self._lanes[adapter] = self._start_lane(instance, scorers[adapter], eos)
        self._grammars.wait_ready()  # started with the grammars: the first new schema need not wait for it
        log.info(
            "model_loaded",
            model=self.model_name,
            context_tokens=self.context_tokens,
            adapters=sorted(self.adapters),
        )

    def _source(self) -> dict[str, str]:
        """`from_pretrained`'s arguments: the GGUF's float32 copy in the model cache, made if it is not
        there yet; the GGUF itself without a cache, or when the copy cannot be made."""
        if self._model_cache_dir is not None:
            try:
                copy = converted_model(self._gguf_path, self._model_cache_dir, dtype="float32")
            except EngineError as exc:
                log.info("model_cache_not_used", reason=str(exc), loads="the GGUF file, about 20 s at every start")
            else:
                return {"pretrained_model_name_or_path": str(copy)}
        return {"pretrained_model_name_or_path": str(self._gguf_path.parent), "gguf_file": self._gguf_path.name}

    def _start_lane(self, model: Any, scorer: PromptScorer, eos: Any) -> _Lane:
        """Start a batching manager on `model` with a sampling extension of its own."""
        from transformers import ContinuousBatchingConfig

        from services.worker.engines.cpu_sampling import SamplingExtension, manager_generation_config

        extension = SamplingExtension(
            self._vocab_size, sorted(self._eos_ids), blocked_in_grammar=self._grammars.blocked_ids
        )
        # transformers' own sampler only ever sees the extension's one-hot rows.
        generation_config = manager_generation_config(
            eos_token_id=eos, pad_token_id=self._tokenizer.pad_token_id or eos
        )
        cb_config = ContinuousBatchingConfig(
            per_request_processors=True,
            num_blocks=self._kv_cache_blocks,
            max_batch_tokens=self._max_batch_tokens,
            max_requests_per_batch=self.max_seqs,
            # The extension's grammar state must see each batch's tokens before the next is prepared.
            use_async_batching=False,
            # Prefix sharing: a prompt's leading full pages already in the cache are not computed again
            # (transformers' default, named because `cached_tokens` reports it).
            allow_block_sharing=True,
        )
        manager = model.init_continuous_batching(
            generation_config=generation_config, continuous_batching_config=cb_config
        )
        extension.install(manager)  # between init_continuous_batching and start
        manager.start()
        return _Lane(manager, extension, scorer)

    async def stop(self) -> None:
        self._stopping = True
        lanes, self._lanes = list(self._lanes.values()), {}
        await asyncio.gather(
            *(asyncio.to_thread(lane.manager.stop, block=True, timeout=10, hard_stop=True) for lane in lanes)
        )
        for queue in list(self._queues.values()):  # requests the stopped loop left unanswered
            queue.put_nowait(_STOPPED)
        if self._grammars is not None:
            grammars, self._grammars = self._grammars, None
            await asyncio.to_thread(grammars.close)

    async def check_health(self) -> None:
        if not self._lanes:
            raise EngineError("The generation loop is not running.")
        for adapter, lane in self._lanes.items():
            if not lane.manager.is_running():
                which = "" if adapter is None else f" of adapter {adapter!r}"
                raise EngineError(f"The generation loop{which} is not running.")

    reports_kv_cache = True

    def kv_cache_usage(self) -> float | None:
        """The fullest lane's (the first to refuse work)."""
        usages = []
        for lane in self._lanes.values():
            cache = getattr(lane.manager.batch_processor, "cache", None)
            if cache is not None:
                usages.append(1.0 - float(cache.compute_free_capacity(relative=True)))
        return max(usages, default=None)

    async def abort(self, request_id: str) -> None:
        queue = self._queues.get(request_id)
        lane = self._lane_of.get(request_id)
        if queue is not None and lane is not None:
            lane.manager.cancel_request(request_id)
            queue.put_nowait(_CANCELLED)

    def _encode(self, request: GenerationRequest) -> list[int]:
        if request.messages is not None:
            messages = tool_prompt_messages(request.messages, request.tools)
            encoded = self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
        return list(self._tokenizer.encode(request.prompt or ""))

    def count_prompt_tokens(self, request: GenerationRequest) -> int:
        return len(self._encode(request))

    def _decode(self, token_ids: Sequence[int]) -> str:
        text: str = self._tokenizer.decode(token_ids, skip_special_tokens=True)
        return text

    async def _controls(self, request: GenerationRequest, prompt_ids: list[int], resumed: list[int]) -> Any:
        """The extension's controls for `request` (a `cpu_sampling.Controls`); compiles its grammar."""
        from services.worker.engines.cpu_sampling import Controls

        sampling, defaults = request.sampling, self._defaults
        outside = sorted(t for t in sampling.logit_bias if not 0 <= t < self._vocab_size)
        if outside:
            raise InvalidPrompt(
                f"logit_bias names token ids outside the model's vocabulary (0 to {self._vocab_size - 1}): "
                + ", ".join(map(str, outside[:5]))
            )
        matcher = await self._grammars.matcher(request.guide) if request.guide is not None else None
        top_k = defaults.top_k if sampling.top_k is None else sampling.top_k
        return Controls(
            temperature=defaults.temperature if sampling.temperature is None else sampling.temperature,
            top_k=max(top_k, 0),  # -1 and 0: none
            top_p=defaults.top_p if sampling.top_p is None else sampling.top_p,
            seed=sampling.seed,
            matcher=matcher,
            logit_bias=sampling.logit_bias,
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            repetition_penalty=(
                defaults.repetition_penalty if sampling.repetition_penalty is None else sampling.repetition_penalty
            ),
            min_p=defaults.min_p if sampling.min_p is None else sampling.min_p,
            min_tokens=sampling.min_tokens,
            ignore_eos=sampling.ignore_eos,
            logprobs=request.logprobs,
            context=prompt_ids,
            replay=resumed,
        )

    def _resumed_ids(self, request: GenerationRequest) -> list[int]:
        resume = request.resume
        if resume is None:
            return []
        if resume.token_ids:
            return list(resume.token_ids)
        return list(self._tokenizer.encode(resume.text, add_special_tokens=False)) if resume.text else []

    async def generate(self, request: GenerationRequest) -> AsyncIterator[EngineOutput]:
        if not self._lanes:
            raise (
                EngineStopped("The engine was stopped.")
                if self._stopping
                else EngineError("The engine is not started.")
            )
        lane = self._lanes.get(request.adapter)
        if lane is None:
            raise EngineError(f"This worker does not serve the adapter '{request.adapter}'.")
        prompt_ids = self._encode(request)
        resumed = self._resumed_ids(request)
        max_tokens = min(request.sampling.max_tokens, self.context_tokens - len(prompt_ids) - len(resumed))
        if max_tokens < 1:
            raise context_exceeded(
                len(prompt_ids) + len(resumed), self.context_tokens, chat=request.messages is not None
            )
        controls = await self._controls(request, prompt_ids, resumed)
        echoed: tuple[TokenLogprob, ...] = ()
        if request.echo and request.logprobs is not None:
            scores = await asyncio.to_thread(lane.scorer.score, prompt_ids, request.logprobs)
            echoed = tuple(self._token_logprob(score) for score in scores)
        rid = request.request_id
        slot = lane.extension.register(rid, controls)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[rid] = queue
        self._lane_of[rid] = lane
        try:
            lane.manager.register_result_handler(rid, queue.put_nowait)
            added = lane.manager.add_request(
                prompt_ids + resumed,
                request_id=rid,
                max_new_tokens=max_tokens,
                streaming=True,
            )
            if added is None:
                raise EngineError("The engine is not accepting requests.")
            async for output in self._outputs(rid, queue, len(prompt_ids), request.sampling.stop, resumed, slot):
                if echoed:
                    output, echoed = dataclasses.replace(output, prompt_logprobs=echoed), ()
                yield output
        finally:
            self._queues.pop(rid, None)
            self._lane_of.pop(rid, None)
            self._prefix_hits.pop(rid, None)
            lane.extension.release(rid)
            _forget_handler(lane.manager, rid)

    async def _outputs(
        self,
        rid: str,
        queue: asyncio.Queue[Any],
        prompt_tokens: int,
        stop: list[str],
        resumed: list[int],
        slot: Any,
    ) -> AsyncIterator[EngineOutput]:
        detokenizer = IncrementalDetokenizer(self._decode, prefix_len=len(resumed))
        stops = StopMatcher(stop)
        wants_logprobs = slot.controls.logprobs is not None
        sent = 0  # generated tokens already reported
        while True:
            result = await queue.get()
            if result is _CANCELLED:
                yield EngineOutput("", 0, prompt_tokens, sent, finish_reason="cancelled")
                return
            if result is _STOPPED:
                raise EngineStopped("The engine was stopped.")
            if result.error:
                if self._stopping:  # the generation loop was stopped under it (shutdown)
                    raise EngineStopped(f"The engine was stopped: {result.error}")
                raise EngineError(f"Generation failed: {result.error}")
            tokens = result.generated_tokens
            finished = result.is_finished()
            ended_by_eos = finished and bool(tokens) and tokens[-1] in self._eos_ids
            text = stops.feed(detokenizer.step(resumed + (tokens[:-1] if ended_by_eos else tokens)))
            new_ids = tuple(tokens[sent:])
            reason: FinishReason | None = None
            if stops.stopped:
                self._lane_of[rid].manager.cancel_request(rid)
                reason = "stop"
            elif finished:
                text += stops.flush()
                reason = "stop" if ended_by_eos else "length"
            elif not text:
                continue
            logprobs: tuple[TokenLogprob, ...] = ()
            if wants_logprobs:  # one per token of the text: not the final EOS
                shown = len(tokens) - 1 if ended_by_eos else len(tokens)
                logprobs = self._logprobs(slot, len(resumed) + sent, len(resumed) + shown)
            cached = min(self._prefix_hits.get(rid, 0), prompt_tokens)
            yield EngineOutput(
                text,
                len(new_ids),
                prompt_tokens,
                len(tokens),
                reason,
                new_ids,
                logprobs,
                cached_tokens=cached,
                stop_sequence=stops.matched,
            )
            if reason is not None:
                return
            sent = len(tokens)

    def _logprobs(self, slot: Any, start: int, end: int) -> tuple[TokenLogprob, ...]:
        """The extension's scores of answer positions [start, end), as OpenAI's logprobs."""
        scores = slot.logprobs
        out = []
        for step in range(start, end):
            score = scores.pop(step, None)
            if score is not None:  # None: the request ended before this token was scored
                out.append(self._token_logprob(score))
        return tuple(out)

    def _token_logprob(self, score: tuple[int, float, list[tuple[int, float]]]) -> TokenLogprob:
        token, logprob, top = score
        text, raw = self._token_text(token)
        return TokenLogprob.model_construct(
            token=text,
            logprob=max(logprob, _LOGPROB_FLOOR),
            bytes=raw,
            top_logprobs=[self._top_logprob(t, lp) for t, lp in top],
        )

    def _top_logprob(self, token: int, logprob: float) -> TopLogprob:
        text, raw = self._token_text(token)
        return TopLogprob.model_construct(token=text, logprob=max(logprob, _LOGPROB_FLOOR), bytes=raw)

    def _token_text(self, token: int) -> tuple[str, list[int]]:
        """A token's text and its exact bytes (a token may hold part of a UTF-8 character)."""
        raw = self._token_bytes[token] if 0 <= token < len(self._token_bytes) else b""
        return raw.decode("utf-8", errors="replace"), list(raw)


def _forget_handler(manager: Any, rid: str) -> None:
    # transformers drops a result handler only when its request finishes; a cancelled
    # request's handler would stay registered forever.
    router = getattr(manager, "output_router", None)
    if router is not None:
        with router._lock:
            router.result_handlers.pop(rid, None)
