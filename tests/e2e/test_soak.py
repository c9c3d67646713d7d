"""The soak's short variant: `benchmarks/soak.py --minutes 1` (its own processes, at 70% of the
capacity it measures on them first) must end with zero errors and flat memory. The 10-minute runs
are in docs/resilience.md."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

# `alone` (make test runs it with no other test beside it):
# it measures its own stack's capacity, then holds 70 % of it for a minute.
pytestmark = [pytest.mark.e2e, pytest.mark.alone]

SOAK = Path(__file__).parents[2] / "benchmarks" / "soak.py"


@pytest.mark.timeout(300)
def test_one_minute_at_seventy_percent_of_capacity_without_errors_or_memory_growth(tmp_path: Path) -> None:
    figures = tmp_path / "soak.json"
    run = subprocess.run(
        [sys.executable, str(SOAK), "--minutes", "1", "--json", str(figures)],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    result = json.loads(figures.read_text())
    assert result["capacity_rps"] > 0 and result["config"]["rate"] == round(0.7 * result["capacity_rps"], 1)
    assert result["bench"]["requests"]["failed"] == 0
    assert result["bench"]["requests"]["completed"] >= 0.9 * 60 * result["config"]["rate"]
    assert all(growth < 0.10 for growth in result["growth"].values()), result["growth"]
