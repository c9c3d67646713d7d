"""The libraries under the worker are quiet unless AXON_LOG_LEVEL=DEBUG (services/worker/library_output.py)."""

import os
import subprocess
import sys

from services.worker.library_output import QUIET_ENVIRONMENT, quiet_libraries

# What vLLM's engine process does at start on a CPU machine: torch's logger warns that Triton is
# missing, a library raises a FutureWarning.
_NOISY_CHILD = (
    "import warnings, torch._library.triton as triton\n"
    "triton.logger.warning('Triton not available')\n"
    "warnings.warn('torch.distributed.reduce_op is deprecated', FutureWarning)\n"
)


def _child_stderr(env: dict[str, str]) -> str:
    return subprocess.run(
        [sys.executable, "-c", _NOISY_CHILD], env=env, capture_output=True, text=True, timeout=120
    ).stderr


def test_the_processes_the_worker_starts_are_quiet_unless_debug() -> None:
    environ = {name: value for name, value in os.environ.items() if name not in QUIET_ENVIRONMENT}
    loud = _child_stderr(dict(environ))
    assert "Triton not available" in loud and "FutureWarning" in loud
    debug = dict(environ)
    assert not quiet_libraries("debug", debug) and debug == environ
    quiet = dict(environ)
    assert quiet_libraries("INFO", quiet)
    assert _child_stderr(quiet) == ""


def test_a_variable_the_operator_set_stands() -> None:
    environ = {"TRANSFORMERS_VERBOSITY": "info"}
    quiet_libraries("WARNING", environ)
    assert environ["TRANSFORMERS_VERBOSITY"] == "info" and environ["VLLM_LOGGING_LEVEL"] == "ERROR"
