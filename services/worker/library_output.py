"""What the libraries under the worker print: vLLM, torch, transformers, Hugging Face's hub and
their progress bars. Unless `AXON_LOG_LEVEL=DEBUG`, nothing below an error: their notes, advice,
deprecation warnings and progress bars are about the libraries (GPU features, Triton, NUMA
binding, future versions), not about anything an operator of Axon can act on.

vLLM's engine core runs in processes of its own, spawned from the worker: they inherit its
environment, not its logging, so the environment is how they are told (set before the libraries
are imported; a variable the operator set stands). The worker's own process is also told
through its loggers and warning filters, since the libraries it already imported read their
variables at import."""

import logging
import warnings
from collections.abc import MutableMapping

QUIET_ENVIRONMENT = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TQDM_DISABLE": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    # vLLM's own log (its engine configuration and CPU tuning hints, some hundred lines at start).
    "VLLM_LOGGING_LEVEL": "ERROR",
    # torch's Python loggers ("Triton not available") and its C++ warnings (NUMA binding).
    "TORCH_LOGS": "-torch",
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    # The engine's processes run only vLLM's and torch's code: none of their warnings.
    "PYTHONWARNINGS": "ignore",
}
# The worker's own process: the libraries' warnings only (Axon's stay).
_LIBRARY_MODULES = r"(vllm|torch|transformers|huggingface_hub|xgrammar)(\.|$)"


def quiet_libraries(log_level: str, environ: MutableMapping[str, str]) -> bool:
    """Unless `log_level` is DEBUG, silence the libraries below errors, in this process and (through
    `environ`, this process's environment) in the processes it starts. Whether it did."""
    if log_level.upper() == "DEBUG":
        return False
    for name, value in QUIET_ENVIRONMENT.items():
        environ.setdefault(name, value)
    # vLLM's lines logged at import, before vLLM configures its logger, reach the root logger.
    logging.getLogger("vllm").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=_LIBRARY_MODULES)
    return True
