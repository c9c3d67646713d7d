"""examples/quickstart.py as a newcomer runs it."""

import os
import subprocess
import sys
from pathlib import Path

QUICKSTART = Path(__file__).resolve().parents[3] / "examples" / "quickstart.py"


def test_without_a_key_it_says_to_export_axon_api_key_and_exits_2() -> None:
    env = {name: value for name, value in os.environ.items() if name != "AXON_API_KEY"}
    run = subprocess.run([sys.executable, str(QUICKSTART)], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "export AXON_API_KEY=" in run.stderr
    assert "Traceback" not in run.stderr
    assert run.stdout == ""
