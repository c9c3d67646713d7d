"""tests/machine.py: which machine kind must run every test."""

import pytest

from tests.machine import must_run_everything


@pytest.mark.parametrize(
    ("environ", "expected"),
    [({"CI": "true"}, True), ({"CI": "1"}, True), ({"CI": "false"}, False), ({"CI": "0"}, False), ({}, False)],
)
def test_ci_on_linux_x86_64_must_run_everything(
    environ: dict[str, str], expected: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.platform", "linux")
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    assert must_run_everything(environ) is expected


@pytest.mark.parametrize(("platform_name", "machine"), [("darwin", "arm64"), ("linux", "aarch64"), ("win32", "AMD64")])
def test_ci_elsewhere_skips(platform_name: str, machine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.platform", platform_name)
    monkeypatch.setattr("platform.machine", lambda: machine)
    assert not must_run_everything({"CI": "true"})
