"""GPU economy in the chart (helm/axon/examples/gpu-economy.yaml): a pool that KEDA scales to zero,
the cold-start waits the session manager reads for it, and a pool serving LoRA adapters, rendered
and checked offline (the rendered settings read back through the settings classes)."""

import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.deploy.conftest import RELEASE
from tests.deploy.support import (
    CHART,
    KUBERNETES_VERSION,
    REQUIRED_SECRETS,
    assert_counts_the_models_queues,
    component,
    env_of,
    helm,
    load_manifests,
    of_kind,
    set_args,
    setting_default,
)

EXAMPLE = CHART / "examples" / "gpu-economy.yaml"
POOLS = yaml.safe_load(EXAMPLE.read_text())["worker"]["pools"]
CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule", "ScaledObject", "TriggerAuthentication"}


def sessions_env(manifests: list[dict]) -> dict[str, object]:
    (deployment,) = component(manifests, "Deployment", "sessions")
    return env_of(deployment["spec"]["template"]["spec"]["containers"][0])


def scaled_object(manifests: list[dict], pool: str) -> dict:
    (found,) = [s for s in of_kind(manifests, "ScaledObject") if s["metadata"]["labels"]["axon.io/pool"] == pool]
    return found


def test_the_example_is_valid_for_the_pinned_kubernetes(economy_manifests: list[dict]) -> None:
    for manifest in economy_manifests:
        if manifest["kind"] in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{manifest['kind']}/{manifest['metadata']['name']}: {exc.message} at {list(exc.path)}")


def test_helm_lint_gpu_economy_example(helm_home: Path) -> None:
    result = helm(
        "lint", "--strict", str(CHART), "-f", str(CHART / "values-eks.yaml"), "-f", str(EXAMPLE), tmp_home=helm_home
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_pool_scales_to_zero_and_wakes_on_one_queued_job(economy_manifests: list[dict]) -> None:
    spec = scaled_object(economy_manifests, "qwen-32b")["spec"]
    assert spec["minReplicaCount"] == 0
    assert spec["cooldownPeriod"] == POOLS["qwen-32b"]["keda"]["cooldownPeriod"]
    trigger, batch = spec["triggers"]
    metadata = trigger["metadata"]
    assert (trigger["type"], metadata["mode"]) == ("rabbitmq", "QueueLength")
    # KEDA activates (0 -> 1) while the queue length is above the activation value.
    assert metadata["activationValue"] == "0"
    assert_counts_the_models_queues(trigger, "axon", POOLS["qwen-32b"]["model"], batch=False)
    # A waiting batch line wakes the pool too (one pod at most: its queue holds a few lines only).
    assert_counts_the_models_queues(batch, "axon", POOLS["qwen-32b"]["model"], batch=True)
    assert batch["metadata"]["activationValue"] == "0"
    assert int(batch["metadata"]["value"]) >= 1000 * int(metadata["value"])
    assert batch["authenticationRef"] == trigger["authenticationRef"]
    (deployment,) = [
        d for d in of_kind(economy_manifests, "Deployment") if d["metadata"]["name"] == spec["scaleTargetRef"]["name"]
    ]
    assert "replicas" not in deployment["spec"], "replicas would fight KEDA"
    # Pools that keep a pod never wait for one: no activation threshold of their own.
    for other in of_kind(economy_manifests, "ScaledObject"):
        if other["spec"]["minReplicaCount"] >= 1:
            (only,) = other["spec"]["triggers"]
            assert "activationValue" not in only["metadata"]


def test_the_session_manager_waits_for_exactly_the_pools_at_zero(
    economy_manifests: list[dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.sessions.settings import SessionsSettings

    env = sessions_env(economy_manifests)
    monkeypatch.setenv("AXON_COLD_START_WAITS", str(env["AXON_COLD_START_WAITS"]))
    monkeypatch.setenv("AXON_COLD_START_WAIT_S", str(env["AXON_COLD_START_WAIT_S"]))
    settings = SessionsSettings()
    assert settings.cold_start_waits == {"Qwen2.5-32B-Instruct": 240.0}
    assert settings.cold_start_wait_s == 0
    # A request's wait ends with its deadline; the ALB must not cut a silent non-streaming one first.
    wait = max(settings.cold_start_waits.values())
    assert wait < setting_default("SessionsSettings", "request_timeout_s")
    (ingress,) = of_kind(economy_manifests, "Ingress")
    idle = int(ingress["metadata"]["annotations"]["alb.ingress.kubernetes.io/load-balancer-attributes"].split("=")[1])
    assert wait < idle


def test_without_a_pool_at_zero_the_session_manager_waits_for_none(default_manifests: list[dict]) -> None:
    assert "AXON_COLD_START_WAITS" not in sessions_env(default_manifests)
    assert "AXON_COLD_START_ADAPTERS" not in sessions_env(default_manifests)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {
                "worker.defaults.keda.enabled": "true",
                "secrets.rabbitmqManagementUrl.name": "m",
                "worker.defaults.keda.minReplicas": "0",
                "worker.defaults.coldStartWaitSeconds": "400",
                "ingress.enabled": "true",
                "ingress.certificateArn": "arn:aws:acm:eu-west-1:123456789012:certificate/x",
            },
            "coldStartWaitSeconds (400) must be below ingress.idleTimeoutSeconds (360)",
        ),
        ({"worker.defaults.coldStartWaitSeconds": "-5"}, "coldStartWaitSeconds"),
    ],
)
def test_a_cold_start_wait_the_load_balancer_would_cut_is_refused(helm_home: Path, values: dict, message: str) -> None:
    args = set_args(REQUIRED_SECRETS)
    for key, value in values.items():
        flag = "--set" if value.lstrip("-").isdigit() or value in ("true", "false") else "--set-string"
        args += [flag, f"{key}={value}"]
    result = helm("template", RELEASE, str(CHART), *args, tmp_home=helm_home)
    assert result.returncode != 0, f"rendered despite {values}"
    assert message in result.stderr, result.stderr


# --- LoRA adapters ----------------------------------------------------------------------------------


def worker_env(manifests: list[dict], pool: str) -> dict[str, object]:
    (deployment,) = [
        d for d in component(manifests, "Deployment", "worker") if d["metadata"]["labels"]["axon.io/pool"] == pool
    ]
    return env_of(deployment["spec"]["template"]["spec"]["containers"][0])


def test_a_lora_pool_hands_its_adapters_to_the_worker(
    economy_manifests: list[dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.worker.settings import WorkerSettings

    env = worker_env(economy_manifests, "qwen-7b")
    for name in ("AXON_MODEL", "AXON_ENGINE", "AXON_LORA_ADAPTERS", "AXON_MAX_LORAS", "AXON_MAX_LORA_RANK"):
        monkeypatch.setenv(name, str(env[name]))
    settings = WorkerSettings()
    assert settings.lora_adapters == {
        a["path"].rsplit("/", 1)[1]: a["path"] for a in POOLS["qwen-7b"]["lora"]["adapters"]
    }
    assert (settings.max_loras, settings.max_lora_rank) == (2, 64)
    assert "AXON_LORA_ADAPTERS" not in worker_env(economy_manifests, "qwen-72b")


def test_a_pool_at_zero_lets_requests_for_its_adapters_wait_too(
    helm_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In its base model's queue, which wakes the pool, even before a worker announced them."""
    from services.sessions.settings import SessionsSettings

    result = helm(
        "template",
        RELEASE,
        str(CHART),
        "-f",
        str(CHART / "values-eks.yaml"),
        "-f",
        str(EXAMPLE),
        "--set-json",
        'worker.pools.qwen-32b.lora.adapters=[{"name": "qwen-32b-legal", "path": "/cache/adapters/legal"}]',
        tmp_home=helm_home,
    )
    assert result.returncode == 0, result.stderr
    env = sessions_env(load_manifests(result.stdout))
    monkeypatch.setenv("AXON_COLD_START_WAITS", str(env["AXON_COLD_START_WAITS"]))
    monkeypatch.setenv("AXON_COLD_START_ADAPTERS", str(env["AXON_COLD_START_ADAPTERS"]))
    settings = SessionsSettings()
    assert settings.cold_start_waits == {"Qwen2.5-32B-Instruct": 240, "qwen-32b-legal": 240}
    assert settings.cold_start_adapters == {"qwen-32b-legal": "Qwen2.5-32B-Instruct"}


@pytest.mark.parametrize(
    ("adapters", "message"),
    [
        ('[{"name": "Qwen2.5-7B-Instruct", "path": "/a"}]', "is used twice, or is the pool's model"),
        ('[{"name": "sql", "path": "/a"}, {"name": "sql", "path": "/b"}]', "is used twice"),
        ('[{"name": "has space", "path": "/a"}]', "name"),
        ('[{"name": "sql", "path": ""}]', "path"),
    ],
)
def test_unusable_adapters_are_refused(helm_home: Path, adapters: str, message: str) -> None:
    result = helm(
        "template",
        RELEASE,
        str(CHART),
        *set_args(REQUIRED_SECRETS),
        "--set-string",
        "worker.pools.default.model=Qwen2.5-7B-Instruct",
        "--set-json",
        f"worker.pools.default.lora.adapters={adapters}",
        tmp_home=helm_home,
    )
    assert result.returncode != 0, f"rendered despite {adapters}"
    assert message in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("pools", "message"),
    [
        (
            {"a": {"model": "m-a", "lora": {"adapters": [{"name": "m-b", "path": "/x"}]}}, "b": {"model": "m-b"}},
            "lora adapter m-b is the model of pool b",
        ),
        (
            {
                "a": {"model": "m-a", "lora": {"adapters": [{"name": "sql", "path": "/x"}]}},
                "b": {"model": "m-b", "lora": {"adapters": [{"name": "sql", "path": "/y"}]}},
            },
            "lora adapter sql runs on m-b here and on m-a in pool a",
        ),
    ],
)
def test_an_adapter_name_that_means_two_models_across_pools_is_refused(
    helm_home: Path, pools: dict, message: str
) -> None:
    """The registry would merge them into one model whose jobs go to one pool's queue."""
    result = helm(
        "template",
        RELEASE,
        str(CHART),
        *set_args(REQUIRED_SECRETS),
        "--set-json",
        f"worker.pools={json.dumps(pools)}",
        tmp_home=helm_home,
    )
    assert result.returncode != 0, "rendered despite an ambiguous adapter name"
    assert message in result.stderr, result.stderr


def test_pools_of_one_model_may_serve_the_same_adapters(helm_home: Path) -> None:
    adapters = {"lora": {"adapters": [{"name": "sql", "path": "/x"}]}}
    pools = {"a": {"model": "m", **adapters}, "b": {"model": "m", **adapters}}
    result = helm(
        "template",
        RELEASE,
        str(CHART),
        *set_args(REQUIRED_SECRETS),
        "--set-json",
        f"worker.pools={json.dumps(pools)}",
        tmp_home=helm_home,
    )
    assert result.returncode == 0, result.stderr
