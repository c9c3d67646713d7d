"""What the worker's `AXON_*` settings become in vLLM: its engine arguments and the few settings vLLM
reads only from its own environment variables (set here, for the engine's processes, never by hand).

Nothing here imports vLLM; `on_cpu` says which platform vLLM found. Defaults on CPU (measured on 2
cores, benchmarks/RESULTS.md): a 1 GiB KV cache (vLLM's CPU backend otherwise reads
`gpu_memory_utilization` as a share of the host's RAM), eager execution (torch.compile takes the
start from 25 s to 116 s for 1 % more tokens/s at one stream and 25 % at 16: a worker that must
come up quickly, as `make up`'s, is better eager; set AXON_ENFORCE_EAGER=false for a long-running
one under load), float32 for `AXON_DTYPE=auto` on a CPU without bfloat16 arithmetic (no AVX-512
BF16 or AMX: vLLM's CPU kernels then emulate bfloat16, a quarter of float32's tokens/s at 16
streams on an AVX2 EPYC), and every core this process may use bound to the
engine's threads, split evenly between its ranks (vLLM's own `auto` keeps a core back, and fails
tensor parallelism on a machine with one NUMA node).
"""

import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.worker.engines.base import EngineError

GIB = 1 << 30
CPU_KV_CACHE_GIB = 1.0


@dataclass(frozen=True, slots=True)
class VllmOptions:
    """The worker's settings for its vLLM engine (`WorkerSettings`, vllm section)."""

    model_name: str
    # A model directory or a hub id (a GGUF file is converted into a directory first).
    model_path: str
    max_seqs: int | None = None  # None: vLLM's default for its platform
    # Sequences vLLM may run beyond `max_seqs`, for tenants with no job running on the worker
    # (`AXON_FAIR_HEADROOM_SEQS`): vLLM's max_num_seqs is their sum.
    headroom_seqs: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor: str | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    dtype: str = "auto"
    kv_cache_gib: float | None = None
    enforce_eager: bool | None = None
    cpu_threads_bind: str = ""
    # vLLM on CPU: the niceness of the engine's processes (`AXON_ENGINE_NICE`, `cpu_share.py`).
    engine_nice: int = 0
    structured_outputs_backend: str = "xgrammar"
    tool_parser: str = "hermes"
    lora_adapters: Mapping[str, str] = field(default_factory=dict)
    max_loras: int = 4
    max_lora_rank: int = 16
    # The OTLP/HTTP collector's base URL (`AXON_OTLP_ENDPOINT`): vLLM exports its own request
    # spans there, as children of the worker's job span; None: vLLM traces nothing.
    otlp_endpoint: str | None = None
    # vLLM's KV-cache events for the prefix index (`AXON_PREFIX_INDEX`): published on the ipc://
    # endpoints the engine makes at start (`kv_events.kv_events_endpoints`), never on a TCP port.
    kv_events: bool = False
    # vLLM's progress bar while it loads the weights (AXON_LOG_LEVEL=DEBUG): it ignores TQDM_DISABLE.
    progress_bars: bool = False

    @property
    def ranks(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


def engine_kwargs(options: VllmOptions, *, on_cpu: bool) -> dict[str, Any]:
    """`vllm.engine.arg_utils.AsyncEngineArgs` keyword arguments (the structured-output config
    aside); settings left unset are left out, so vLLM picks its own default."""
    kv_cache_gib = options.kv_cache_gib if options.kv_cache_gib is not None or not on_cpu else CPU_KV_CACHE_GIB
    eager = options.enforce_eager if options.enforce_eager is not None else on_cpu
    chosen: dict[str, Any] = {
        "model": options.model_path,
        "served_model_name": [options.model_name],
        "tensor_parallel_size": options.tensor_parallel_size,
        "pipeline_parallel_size": options.pipeline_parallel_size,
        # None (left out): vLLM picks mp when the devices are on this node.
        "distributed_executor_backend": options.distributed_executor,
        "max_num_seqs": options.max_seqs + options.headroom_seqs if options.max_seqs else None,
        "max_model_len": options.max_model_len,
        "dtype": cpu_dtype(options.dtype, cpu_flags()) if on_cpu else options.dtype,
        "gpu_memory_utilization": options.gpu_memory_utilization,
        "kv_cache_memory_bytes": int(kv_cache_gib * GIB) if kv_cache_gib is not None else None,
        "enforce_eager": eager,
        "use_tqdm_on_load": options.progress_bars,
        "otlp_traces_endpoint": f"{options.otlp_endpoint.rstrip('/')}/v1/traces" if options.otlp_endpoint else None,
    } | lora_engine_kwargs(options.lora_adapters, max_loras=options.max_loras, max_lora_rank=options.max_lora_rank)
    return {name: value for name, value in chosen.items() if value is not None}


# CPU flags of bfloat16 arithmetic that vLLM's CPU kernels use (without one, they emulate it).
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This machine's CPU flags (Linux' /proc/cpuinfo; none where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def cpu_dtype(dtype: str, flags: frozenset[str]) -> str:
    """vLLM's `dtype` on a CPU with `flags`: `auto` is float32 where the CPU has no bfloat16
    arithmetic (`BF16_FLAGS`), since vLLM's `auto` would take the model's bfloat16 and emulate it
    (measured on an AVX2 EPYC, 2 cores: 40.8 tok/s at 16 streams against float32's 163.6); any
    other value is kept."""
    return "float32" if dtype == "auto" and not flags & BF16_FLAGS else dtype


# The topic vLLM publishes the worker's KV-cache events under.
KV_EVENTS_TOPIC = "kv"


def kv_events_kwargs(endpoint: str, replay_endpoint: str) -> dict[str, Any]:
    """`vllm.config.KVEventsConfig` keyword arguments: events on, published by ZeroMQ on
    `endpoint`, the last batches replayed on `replay_endpoint` (vLLM's `buffer_steps`)."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "replay_endpoint": replay_endpoint,
        "topic": KV_EVENTS_TOPIC,
    }


def check_platform(options: VllmOptions, *, on_cpu: bool) -> None:
    """Refuse, at start, what vLLM's platform would accept and then fail at the first request.

    Raises:
        EngineError: pipeline parallelism on the CPU (vLLM 0.32's CPU build starts it, but its second
            stage has no buffer for the first stage's activations and dies at the first request).
    """
    if on_cpu and options.pipeline_parallel_size > 1:
        raise EngineError(
            f"AXON_PIPELINE_PARALLEL_SIZE={options.pipeline_parallel_size}: vLLM's CPU build runs no pipeline "
            "parallelism (its second stage fails at the first request); split the model with "
            "AXON_TENSOR_PARALLEL_SIZE instead."
        )


def lora_engine_kwargs(adapters: Mapping[str, str], *, max_loras: int, max_lora_rank: int) -> dict[str, Any]:
    """`AsyncEngineArgs` keyword arguments for serving `adapters` (none without adapters: LoRA
    support costs memory)."""
    if not adapters:
        return {}
    return {"enable_lora": True, "max_loras": max_loras, "max_lora_rank": max_lora_rank}


def cpu_threads_bind(configured: str, *, ranks: int, cores: Sequence[int]) -> str:
    """vLLM's `VLLM_CPU_OMP_THREADS_BIND`: `configured` if set, else `cores` split evenly between
    `ranks` (`0-1` for one rank on two cores, `0|1` for two).

    Raises:
        EngineError: fewer cores than ranks.
    """
    if configured:
        return configured
    ordered = sorted(cores)
    if len(ordered) < ranks:
        raise EngineError(
            f"The vLLM engine runs {ranks} ranks (AXON_TENSOR_PARALLEL_SIZE x AXON_PIPELINE_PARALLEL_SIZE) "
            f"on the CPU, one core each at least, but this process may use {len(ordered)} core(s)."
        )
    share = len(ordered) // ranks
    return "|".join(_core_list(ordered[rank * share : (rank + 1) * share]) for rank in range(ranks))


def _core_list(cores: Sequence[int]) -> str:
    """`0-3` for consecutive cores, else `0,2,5`."""
    if list(cores) == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0])
    return ",".join(map(str, cores))


def vllm_environment(options: VllmOptions, *, on_cpu: bool, cores: Sequence[int]) -> dict[str, str]:
    """The environment variables the engine's processes need (they inherit this process's).

    Raises:
        EngineError: too few cores for the engine's ranks.
    """
    env = {
        # The engine's processes are spawned, not forked from a process whose event loop and
        # threads are running.
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        # vLLM's usage statistics go to a server of vLLM's: a platform sends nothing anywhere.
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    if os.path.isdir(options.model_path):
        # A model on disk needs nothing from the hub: no lookup, however short, at start.
        env["HF_HUB_OFFLINE"] = "1"
    if on_cpu:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(options.cpu_threads_bind, ranks=options.ranks, cores=cores)
    if options.otlp_endpoint:
        # vLLM's exporter speaks gRPC unless told otherwise; Axon's collector endpoint is OTLP/HTTP.
        env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
    return env
