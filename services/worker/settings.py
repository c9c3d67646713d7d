"""Inference worker settings (`AXON_*` environment variables)."""

import importlib.util
import os
import socket
import uuid
from typing import Literal

from pydantic import Field, model_validator

from shared.settings import DEFAULT_MODEL, CommonSettings

EngineName = Literal["transformers", "vllm", "sim"]


def _default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def default_engine() -> EngineName:
    """vLLM wherever it is installed (`make install` puts its CPU build on x86-64 Linux, the GPU
    image the official one); the transformers engine, the portable fallback, elsewhere."""
    return "vllm" if importlib.util.find_spec("vllm") is not None else "transformers"


class WorkerSettings(CommonSettings):
    host: str = "127.0.0.1"
    worker_port: int = Field(8002, ge=1, le=65535)
    worker_id: str = Field(default_factory=_default_worker_id)

    engine: EngineName = Field(default_factory=default_engine)
    model: str = DEFAULT_MODEL
    # GGUF file (transformers), or model directory, hub id or GGUF file (vllm). Empty: the bundled
    # SmolLM2 GGUF (vllm: converted once into `model_cache_dir`).
    model_path: str = ""
    # Where the vllm and transformers engines keep the models they converted from GGUF. Empty:
    # $XDG_STATE_HOME/axon/models, else ~/.local/state/axon/models.
    model_cache_dir: str = ""
    # Sequences one engine runs at once; also the queue prefetch. 0: the engine's default.
    max_seqs: int = Field(0, ge=0)
    # Sequences kept free of batch lines: an interactive job arriving takes one without preempting
    # a line (`pulling.py`). At most max_seqs - 1 count.
    batch_reserved_seqs: int = Field(1, ge=0)
    # The fair share counts each tenant's served tokens at these costs (prompt, output), divided by
    # its weight (`shared/fair.py`): output tokens cost twice a prompt token's by default, as in VTC.
    fair_prompt_token_cost: float = Field(1.0, ge=0, le=1000)
    fair_output_token_cost: float = Field(2.0, gt=0, le=1000)
    # Sequences beyond max_seqs a worker runs for the least served waiting tenant when it has no
    # job running on it, so a quiet tenant's request starts at once beside another tenant's burst
    # instead of waiting for one of its answers to end (`pulling.py`); vLLM's max_num_seqs is
    # max_seqs plus these.
    fair_headroom_seqs: int = Field(1, ge=0, le=64)

    # transformers engine
    kv_cache_blocks: int = Field(64, ge=1)
    max_batch_tokens: int = Field(512, ge=16)
    torch_threads: int = Field(0, ge=0)
    # Constrained decoding (response_format, forced tool calls), transformers and vllm with xgrammar:
    # a new JSON schema is compiled in a child process first, killed past this time or memory;
    # longer schemas are refused outright.
    grammar_compile_timeout_s: float = Field(5.0, gt=0)
    grammar_compile_memory_mb: int = Field(1024, ge=16)
    grammar_max_schema_bytes: int = Field(64 * 1024, ge=64)
    # Compiled grammars kept (by schema text), in MB.
    grammar_cache_mb: int = Field(256, ge=1)

    # vllm engine
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(
        1,
        ge=1,
        description=(
            "vLLM's pipeline_parallel_size: stages the model's layers are split into, each of "
            "tensor_parallel_size GPUs (one stage per node in a multi-node pool); vllm engine only"
        ),
    )
    distributed_executor: Literal["mp", "ray", "uni"] | None = Field(
        None,
        description=(
            "vLLM's distributed_executor_backend: mp (processes on this node), ray (a Ray cluster, needed "
            "to span nodes) or uni (one process); unset: vLLM's own choice"
        ),
    )
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    max_model_len: int | None = Field(None, ge=16)
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="vLLM's dtype for weights and activations; auto: the model's own (bfloat16 for the bundled model)",
    )
    kv_cache_gib: float | None = Field(
        None,
        gt=0,
        description=(
            "vLLM's KV cache size in GiB (kv_cache_memory_bytes); unset: 1 GiB on CPU, and on GPU what "
            "gpu_memory_utilization leaves after the weights"
        ),
    )
    enforce_eager: bool | None = Field(
        None,
        description=(
            "vLLM's enforce_eager: run the model eagerly, without torch.compile and CUDA graphs; unset: eager on "
            "CPU (starts in 25 s instead of 116 s; compiled gives 1 % more tokens/s at one stream, 25 % at 16), "
            "compiled on GPU"
        ),
    )
    cpu_threads_bind: str = Field(
        "",
        pattern=r"^$|^nobind$|^[0-9][0-9,\-]*(\|[0-9][0-9,\-]*)*$",
        description=(
            "vLLM on CPU: the cores each rank's threads are bound to, ranks separated by | (0-1, or 0|1 for "
            "two ranks), or nobind; empty: the cores this process may use, split evenly between the ranks"
        ),
    )
    engine_nice: int = Field(
        10,
        ge=0,
        le=19,
        description=(
            "vLLM on CPU: the niceness of the engine's processes, so the services sharing its cores run first when "
            "they wake; 0: the same priority as the services"
        ),
    )
    # vLLM's structured-output backend (`StructuredOutputsConfig.backend`) for response_format and
    # required or named tool calls; xgrammar is the library the transformers engine uses too.
    structured_outputs_backend: Literal["auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer"] = "xgrammar"
    # vLLM's tool parser (`ToolParserManager`) for tool_choice auto: it must read what the model's
    # chat template asks the model to write (hermes: `<tool_call>{…}</tool_call>`, Qwen2.5, Hermes).
    tool_parser: str = Field("hermes", min_length=1)

    # The prefix index (vllm and sim): the engine publishes its KV-cache events (vLLM's
    # kv_events_config, on ipc:// sockets of the worker's own) and the worker keeps its part of
    # the index session managers route on (`services/worker/kv_index.py`).
    prefix_index: bool = Field(
        True,
        description=(
            "publish the engine's KV-cache events (vLLM's kv_events_config; the simulator's own) and keep this "
            "worker's part of the prefix index session managers route on; vllm and sim engines"
        ),
    )
    prefix_index_pending_anchors: int = Field(
        8192,
        ge=1,
        description="prompt anchors tied to blocks the engine has not stored (yet) that the worker remembers, "
        "oldest forgotten first",
    )

    # sim engine
    sim_ttft_ms: float = Field(50.0, ge=0)
    sim_itl_ms: float = Field(10.0, ge=0)
    sim_max_seqs: int = Field(64, ge=1)
    sim_context_tokens: int = Field(32768, ge=16)
    # The simulated prefix cache: its capacity in 16-token blocks (0: no cache), and the time to
    # first token added per prompt token not found in it.
    sim_kv_blocks: int = Field(4096, ge=0)
    sim_prefill_us_per_token: float = Field(50.0, ge=0)
    # The simulator's KV-cache events: batches kept for replay, and (fault injection) every n-th
    # batch not delivered, as if the message were lost (0: none lost).
    sim_kv_events_replay: int = Field(1000, ge=0)
    sim_kv_events_drop_every: int = Field(0, ge=0)
    # Fault injection for platform tests: the simulated engine reports itself dead this
    # many seconds after start (0: never).
    sim_fail_after_s: float = Field(0.0, ge=0)

    # LoRA adapters (every engine; the simulator takes the names only)
    lora_adapters: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "LoRA adapters served beside the model, as a JSON object: adapter name (a model name of its own "
            "in /v1/models) -> path of a peft adapter directory (vLLM: or a hub id, where downloads are allowed)"
        ),
    )
    max_loras: int = Field(4, ge=1, description="vLLM: adapters in one batch at once (its max_loras)")
    max_lora_rank: int = Field(16, ge=1, description="vLLM: the largest adapter rank it makes room for (max_lora_rank)")

    heartbeat_interval_s: float = Field(3.0, gt=0)
    heartbeat_ttl_s: float = Field(10.0, gt=0)
    # A job redelivered more often than this (it keeps killing workers) is dead-lettered.
    max_deliveries: int = Field(3, ge=1)

    @model_validator(mode="after")
    def _pipeline_parallel_needs_vllm(self) -> "WorkerSettings":
        if self.pipeline_parallel_size > 1 and self.engine != "vllm":
            raise ValueError(
                f"AXON_PIPELINE_PARALLEL_SIZE={self.pipeline_parallel_size} needs AXON_ENGINE=vllm: "
                f"the {self.engine} engine runs the whole model in one process"
            )
        return self

    @model_validator(mode="after")
    def _adapter_names(self) -> "WorkerSettings":
        for name, path in self.lora_adapters.items():
            if not name.strip() or name != name.strip() or name == self.model:
                raise ValueError(
                    f"AXON_LORA_ADAPTERS: {name!r} is not a usable adapter name (empty, padded, or the model's own)"
                )
            if not path:
                raise ValueError(f"AXON_LORA_ADAPTERS: adapter {name!r} has no path")
        return self
