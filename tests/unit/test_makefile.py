"""`make install` (and so `make up`) on a fresh clone says what each long step is doing, while pip
itself stays quiet."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1].parent


def test_each_pip_step_of_a_fresh_install_is_announced_and_pip_stays_quiet(tmp_path: Path) -> None:
    # A virtualenv that does not exist yet: every step of the install would run (-n: none does).
    planned = subprocess.run(
        # --no-print-directory: under `make test` this make is a sub-make, which would add its
        # "Entering/Leaving directory" lines.
        ["make", "-n", "--no-print-directory", "install", f"VENV={tmp_path / 'venv'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    pip_steps = [i for i, line in enumerate(planned) if " -m pip install " in line]
    assert len(pip_steps) >= 2
    for i in pip_steps:
        assert "--quiet" in planned[i]
        assert planned[i - 1].startswith('echo "make: installing') or planned[i - 2].startswith(
            'echo "make: creating'
        ), planned[i - 2 : i + 1]
    assert planned[-2] == f'echo "make: {tmp_path / "venv"} is ready"'
