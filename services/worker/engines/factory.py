"""Build the engine `AXON_ENGINE` names; heavy libraries load only for the chosen one."""

from pathlib import Path

from services.worker.engines.base import Engine
from services.worker.engines.grammar import GrammarLimits
from services.worker.settings import WorkerSettings
from shared.logging import get_logger
from shared.settings import DEFAULT_MODEL

log = get_logger(__name__)

_DEFAULT_MAX_SEQS = {"transformers": 16}


def create_engine(settings: WorkerSettings) -> Engine:
    if "engine" not in settings.model_fields_set and settings.engine != "vllm":
        log.warning(
            "engine_fallback",
            engine=settings.engine,
            reason="vLLM is not installed here (make install installs its CPU build on Linux x86-64 only)",
        )
    if settings.engine == "sim":
        from services.worker.engines.kv_events import SimKvEvents
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
            kv_events=SimKvEvents(buffer=settings.sim_kv_events_replay, drop_every=settings.sim_kv_events_drop_every)
            if settings.prefix_index
            else None,
        )
    if settings.engine == "vllm":
        return _vllm_engine(settings)
    from services.worker.engines.gguf import bundled_gguf_path
    from services.worker.engines.transformers_engine import TransformersEngine

    return TransformersEngine(
        model_name=settings.model,
        gguf_path=Path(settings.model_path) if settings.model_path else bundled_gguf_path(),
        max_seqs=settings.max_seqs or _DEFAULT_MAX_SEQS["transformers"],
        kv_cache_blocks=settings.kv_cache_blocks,
        max_batch_tokens=settings.max_batch_tokens,
        threads=settings.torch_threads or None,
        grammar_limits=_grammar_limits(settings),
        lora_adapters={name: Path(path) for name, path in settings.lora_adapters.items()},
        model_cache_dir=_model_cache_dir(settings),
    )


def _vllm_engine(settings: WorkerSettings) -> Engine:
    """The vLLM engine; without `AXON_MODEL_PATH` the default model is the bundled GGUF (converted
    for vLLM at start) and any other model name is a hub id."""
    from services.worker.engines.gguf import bundled_gguf_path
    from services.worker.engines.vllm_config import VllmOptions
    from services.worker.engines.vllm_engine import VllmEngine

    model_path = settings.model_path
    if not model_path:
        model_path = str(bundled_gguf_path()) if settings.model == DEFAULT_MODEL else settings.model
    options = VllmOptions(
        model_name=settings.model,
        model_path=model_path,
        max_seqs=settings.max_seqs or None,
        headroom_seqs=settings.fair_headroom_seqs,
        tensor_parallel_size=settings.tensor_parallel_size,
        pipeline_parallel_size=settings.pipeline_parallel_size,
        distributed_executor=settings.distributed_executor,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        max_model_len=settings.max_model_len,
        dtype=settings.dtype,
        kv_cache_gib=settings.kv_cache_gib,
        enforce_eager=settings.enforce_eager,
        cpu_threads_bind=settings.cpu_threads_bind,
        engine_nice=settings.engine_nice,
        structured_outputs_backend=settings.structured_outputs_backend,
        tool_parser=settings.tool_parser,
        lora_adapters=settings.lora_adapters,
        max_loras=settings.max_loras,
        max_lora_rank=settings.max_lora_rank,
        otlp_endpoint=settings.otlp_endpoint or None,
        progress_bars=settings.log_level.upper() == "DEBUG",
        kv_events=settings.prefix_index,
    )
    return VllmEngine(options, model_cache_dir=_model_cache_dir(settings), grammar_limits=_grammar_limits(settings))


def _model_cache_dir(settings: WorkerSettings) -> Path:
    from services.worker.engines.gguf import default_model_cache_dir

    return Path(settings.model_cache_dir) if settings.model_cache_dir else default_model_cache_dir()


def _grammar_limits(settings: WorkerSettings) -> GrammarLimits:
    return GrammarLimits(
        compile_timeout_s=settings.grammar_compile_timeout_s,
        max_schema_bytes=settings.grammar_max_schema_bytes,
        cache_mb=settings.grammar_cache_mb,
        compile_memory_mb=settings.grammar_compile_memory_mb,
    )
