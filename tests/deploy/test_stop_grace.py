"""The gateway's and the session manager's pods and containers are given longer to stop than their
stop takes (shared/serving.py): a pre-stop sleep, then AXON_DRAIN_TIMEOUT_S plus a margin per hop
behind them, plus the time their last writes take. Less, and the orchestrator kills them while
streams they would have ended cleanly are still open."""

import math

import pytest
import yaml

from shared.serving import grace_s
from tests.deploy.support import ROOT, setting_default

# What uvicorn still gives the ends written at the deadline (shared/serving.py:_CUT_MARGIN_S).
_CUT_MARGIN_S = 2
_HOPS_BEHIND = {"gateway": 2, "sessions": 1}


def _stop_s(component: str, env: dict[str, str]) -> float:
    drain = float(env.get("AXON_DRAIN_TIMEOUT_S", setting_default("CommonSettings", "drain_timeout_s")))
    return grace_s(drain, hops_behind=_HOPS_BEHIND[component]) + _CUT_MARGIN_S


@pytest.mark.parametrize("component", ["gateway", "sessions"])
def test_the_chart_gives_api_pods_longer_than_their_stop(default_manifests: list[dict], component: str) -> None:
    (deployment,) = [
        m for m in default_manifests if m["kind"] == "Deployment" and m["metadata"]["name"].endswith(f"-{component}")
    ]
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e.get("value", "") for e in container.get("env", [])}
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    assert pod["terminationGracePeriodSeconds"] > pre_stop + _stop_s(component, env)


@pytest.mark.parametrize("component", ["gateway", "sessions"])
def test_compose_gives_api_containers_longer_than_their_stop(component: str) -> None:
    service = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"][component]
    grace = service["stop_grace_period"]
    assert grace.endswith("s") and float(grace[:-1]) > math.ceil(_stop_s(component, service.get("environment", {})))
