"""Production GPU engine: vLLM's async engine with tensor parallelism.

vLLM is imported only when this engine starts, so nothing else in Axon needs it.
Written against vLLM's public API (`AsyncLLM`, `AsyncEngineArgs`, `SamplingParams`).
"""

from collections.abc import AsyncIterator
from typing import Any

from services.worker.engines.base import Engine, EngineError, EngineOutput, GenerationRequest, InvalidPrompt
from shared.logging import get_logger
from shared.schemas import FinishReason, Sampling

log = get_logger(__name__)

_FINISH_REASONS: dict[str | None, FinishReason | None] = {
    None: None,
    "stop": "stop",
    "length": "length",
    "abort": "cancelled",
}


def sampling_kwargs(sampling: Sampling) -> dict[str, Any]:
    """Axon's sampling parameters as `vllm.SamplingParams` keyword arguments; a parameter left unset
    is left out, so vLLM takes the model's default (its generation config)."""
    chosen = {
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "stop": list(sampling.stop),
        "seed": sampling.seed,
    }
    return {name: value for name, value in chosen.items() if value is not None}


def finish_reason(vllm_reason: str | None) -> FinishReason | None:
    return _FINISH_REASONS.get(vllm_reason, "error")


class VllmEngine(Engine):
    """`vllm.v1.engine.async_llm.AsyncLLM` behind the `Engine` interface."""

    def __init__(
        self,
        *,
        model_name: str,
        model_path: str,
        tensor_parallel_size: int,
        max_seqs: int,
        gpu_memory_utilization: float,
        max_model_len: int | None,
    ) -> None:
        self.model_name = model_name
        self.max_seqs = max_seqs
        self._engine_kwargs = {
            "model": model_path,
            "served_model_name": [model_name],
            "tensor_parallel_size": tensor_parallel_size,
            "max_num_seqs": max_seqs,
            "gpu_memory_utilization": gpu_memory_utilization,
            "max_model_len": max_model_len,
        }
        self._engine: Any = None
        self._tokenizer: Any = None
        self.context_tokens = max_model_len or 0

    async def start(self) -> None:
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise EngineError("AXON_ENGINE=vllm needs vLLM installed (the GPU image has it).") from exc
        args = AsyncEngineArgs(**{k: v for k, v in self._engine_kwargs.items() if v is not None})
        self._engine = AsyncLLM.from_engine_args(args)
        self._tokenizer = await self._engine.get_tokenizer()
        self.context_tokens = int(self._engine.model_config.max_model_len)
        log.info("vllm_engine_started", **self._engine_kwargs)

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

    def _prompt(self, request: GenerationRequest) -> str:
        """The prompt text; a resumed answer continues after the text already published."""
        if request.messages is not None:
            messages = [m.model_dump() for m in request.messages]
            prompt: str = self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            prompt = request.prompt or ""
        return prompt + (request.resume.text if request.resume else "")

    async def generate(self, request: GenerationRequest) -> AsyncIterator[EngineOutput]:
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        if self._engine is None:
            raise EngineError("The vLLM engine is not started.")
        params = SamplingParams(**sampling_kwargs(request.sampling), output_kind=RequestOutputKind.DELTA)
        prompt = self._prompt(request)
        completion_tokens = 0
        unsent_tokens = 0
        unsent_ids: tuple[int, ...] = ()
        try:
            outputs = self._engine.generate(prompt, params, request.request_id)
            first = await anext(outputs)
        except ValueError as exc:  # vLLM refuses prompts it cannot take (e.g. longer than the context)
            raise InvalidPrompt(str(exc)) from exc
        except StopAsyncIteration:
            raise EngineError("vLLM ended the request without output.") from None
        async for output in _chain(first, outputs):
            piece = output.outputs[0]
            completion_tokens += len(piece.token_ids)
            unsent_tokens += len(piece.token_ids)
            prompt_tokens = len(output.prompt_token_ids or ())
            reason = finish_reason(piece.finish_reason) if output.finished else None
            unsent_ids += tuple(piece.token_ids)
            if piece.text or reason is not None:
                yield EngineOutput(piece.text, unsent_tokens, prompt_tokens, completion_tokens, reason, unsent_ids)
                unsent_tokens, unsent_ids = 0, ()


async def _chain(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for item in rest:
        yield item
