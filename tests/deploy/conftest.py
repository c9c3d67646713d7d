"""Fixtures of the deployment checks: the chart rendered once per set of values."""

from pathlib import Path

import pytest

from tests.deploy.support import CHART, REQUIRED_SECRETS, helm, load_manifests, set_args

RELEASE = "axon"
NAMESPACE = "axon-prod"


@pytest.fixture(scope="session")
def helm_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("helm-home")


def _render(helm_home: Path, *args: str) -> list[dict]:
    result = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args, tmp_home=helm_home)
    assert result.returncode == 0, result.stderr
    return load_manifests(result.stdout)


@pytest.fixture(scope="session")
def default_manifests(helm_home: Path) -> list[dict]:
    """values.yaml with only the required Secret names set."""
    return _render(helm_home, *set_args(REQUIRED_SECRETS))


@pytest.fixture(scope="session")
def eks_manifests(helm_home: Path) -> list[dict]:
    """The values-eks.yaml example: ingress, KEDA, ServiceMonitor, PrometheusRule, two GPU pools."""
    return _render(helm_home, "-f", str(CHART / "values-eks.yaml"))


@pytest.fixture(scope="session", params=["default", "eks"])
def manifests(request: pytest.FixtureRequest) -> list[dict]:
    return request.getfixturevalue(f"{request.param}_manifests")


@pytest.fixture(scope="session")
def multinode_manifests(helm_home: Path) -> list[dict]:
    """examples/multinode-405b.yaml: one pool as a LeaderWorkerSet of two 8-GPU nodes per replica."""
    return _render(helm_home, "-f", str(CHART / "examples" / "multinode-405b.yaml"))


@pytest.fixture(scope="session")
def economy_manifests(helm_home: Path) -> list[dict]:
    """values-eks.yaml with examples/gpu-economy.yaml: a pool that scales to zero beside the EKS pools."""
    return _render(helm_home, "-f", str(CHART / "values-eks.yaml"), "-f", str(CHART / "examples" / "gpu-economy.yaml"))
