"""The installed package carries its SQL migrations: `pip install .` (not only `pip install -e .`)
gives a working `axon migrate`.

The project is built and installed offline (`--no-index --no-build-isolation`, with the setuptools
of the running environment) into a temporary target, from a copy of the sources so the checkout
gets no build/ or egg-info; the installed copy is then imported on its own and asked for its files.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.support import MIGRATIONS, ROOT

SOURCES = ("pyproject.toml", "README.md", "shared", "services")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`pip install --no-deps --target` of the project: the directory holding its packages."""
    base = tmp_path_factory.mktemp("package")
    source, target = base / "src", base / "target"
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.py[co]"))
        else:
            source.mkdir(exist_ok=True)
            shutil.copyfile(ROOT / name, source / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    env |= {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index"]
    command += ["--no-build-isolation", "--no-cache-dir", "--target", str(target), str(source)]
    result = subprocess.run(command, cwd=base, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return target


def test_the_installed_package_holds_the_sql_migrations(installed: Path) -> None:
    expected = sorted(p.name for p in MIGRATIONS.glob("[0-9][0-9][0-9][0-9]_*.sql"))
    assert expected
    shipped = installed / "shared" / "migrations" / "sql"
    assert sorted(p.name for p in shipped.glob("*.sql")) == expected
    for name in expected:
        assert (shipped / name).read_bytes() == (MIGRATIONS / name).read_bytes()
    (record,) = installed.glob("axon-*.dist-info/RECORD")
    recorded = {line.split(",")[0] for line in record.read_text().splitlines()}
    assert {f"shared/migrations/sql/{name}" for name in expected} <= recorded, "not in the wheel"


def test_the_installed_copy_lists_its_own_migrations(installed: Path, tmp_path: Path) -> None:
    probe = (
        "import shared.migrations as m; "
        "print(m.__file__); print(m.DEFAULT_MIGRATIONS_DIR); "
        "print('\\n'.join(v for v, _ in m.pending_files()))"
    )
    # Only the installed copy on the path, ahead of the checkout's editable install; cwd outside the checkout.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | {"PYTHONPATH": str(installed)}
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    module_file, migrations_dir, *versions = result.stdout.split()
    assert Path(module_file).is_relative_to(installed), "imported the checkout, not the installed copy"
    assert Path(migrations_dir) == installed / "shared" / "migrations" / "sql"
    assert versions == sorted(p.stem for p in MIGRATIONS.glob("[0-9][0-9][0-9][0-9]_*.sql"))
