"""`axon-worker` refuses a configuration it cannot run: exit status 2 and one log line saying why,
before it connects to anything."""

import json
import os
import subprocess
import sys

import pytest


def run_worker(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AXON_")}
    return subprocess.run(
        [sys.executable, "-m", "services.worker.main"],
        env=clean | env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"AXON_ENGINE": "transformers", "AXON_PIPELINE_PARALLEL_SIZE": "2"}, "AXON_PIPELINE_PARALLEL_SIZE=2"),
        ({"AXON_ENGINE": "vllm", "AXON_DISTRIBUTED_EXECUTOR": "slurm"}, "AXON_DISTRIBUTED_EXECUTOR"),
    ],
)
def test_a_worker_with_unusable_settings_exits_2_naming_them(env: dict[str, str], named: str) -> None:
    done = run_worker(env)
    assert done.returncode == 2, done.stderr
    (line,) = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    assert line["event"] == "refusing_to_start"
    assert named in line["reason"]
    assert "Traceback" not in done.stderr + done.stdout
