"""Build the engine `AXON_ENGINE` names; heavy libraries load only for the chosen one."""

from pathlib import Path

from services.worker.engines.base import Engine
from services.worker.settings import WorkerSettings

_DEFAULT_MAX_SEQS = {"transformers": 16, "vllm": 256}


def create_engine(settings: WorkerSettings) -> Engine:
    if settings.engine == "sim":
        from services.worker.engines.sim import SimEngine

        return SimEngine(
            model_name=settings.model,
            ttft_ms=settings.sim_ttft_ms,
            itl_ms=settings.sim_itl_ms,
            max_seqs=settings.max_seqs or settings.sim_max_seqs,
            context_tokens=settings.sim_context_tokens,
            fail_after_s=settings.sim_fail_after_s,
            kv_blocks=settings.sim_kv_blocks,
            prefill_us_per_token=settings.sim_prefill_us_per_token,
            adapters=settings.lora_adapters,
        )
    max_seqs = settings.max_seqs or _DEFAULT_MAX_SEQS[settings.engine]
    if settings.engine == "vllm":
        from services.worker.engines.vllm_engine import VllmEngine

        return VllmEngine(
            model_name=settings.model,
            model_path=settings.model_path or settings.model,
            tensor_parallel_size=settings.tensor_parallel_size,
            pipeline_parallel_size=settings.pipeline_parallel_size,
            distributed_executor=settings.distributed_executor,
            max_seqs=max_seqs,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            max_model_len=settings.max_model_len,
            structured_outputs_backend=settings.structured_outputs_backend,
            tool_parser=settings.tool_parser,
            lora_adapters=settings.lora_adapters,
            max_loras=settings.max_loras,
            max_lora_rank=settings.max_lora_rank,
        )
    from services.worker.engines.grammar import GrammarLimits
    from services.worker.engines.transformers_engine import TransformersEngine, bundled_gguf_path

    return TransformersEngine(
        model_name=settings.model,
        gguf_path=Path(settings.model_path) if settings.model_path else bundled_gguf_path(),
        max_seqs=max_seqs,
        kv_cache_blocks=settings.kv_cache_blocks,
        max_batch_tokens=settings.max_batch_tokens,
        threads=settings.torch_threads or None,
        grammar_limits=GrammarLimits(
            compile_timeout_s=settings.grammar_compile_timeout_s,
            max_schema_bytes=settings.grammar_max_schema_bytes,
            cache_mb=settings.grammar_cache_mb,
            compile_memory_mb=settings.grammar_compile_memory_mb,
        ),
        lora_adapters={name: Path(path) for name, path in settings.lora_adapters.items()},
    )
