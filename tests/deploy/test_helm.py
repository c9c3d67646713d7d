"""The Helm chart (helm/axon): lint, render, validate offline against Kubernetes' schemas, and
check the facts a deployment depends on.

No cluster is needed: `helm template` renders, kubernetes-validate checks every manifest against
the pinned Kubernetes release, and the custom resources it has no schema for (Prometheus
Operator, KEDA) are checked field by field here.
"""

import json
import re
from pathlib import Path

import kubernetes_validate
import pytest

from tests.deploy.conftest import NAMESPACE, RELEASE
from tests.deploy.support import (
    CHART,
    DASHBOARDS,
    KUBERNETES_VERSION,
    REQUIRED_SECRETS,
    assert_counts_the_models_queues,
    axon_names_in_text,
    axon_workloads,
    component,
    console_scripts,
    env_of,
    exported_metric_names,
    helm,
    load_manifests,
    metric_names_in_promql,
    named,
    of_kind,
    selects,
    set_args,
    setting_default,
    settings_env_names,
    workloads,
)

# Kinds of custom resources the chart renders; kubernetes-validate has no schema for them.
CUSTOM_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("keda.sh/v1alpha1", "TriggerAuthentication"),
}


# --- helpers -----------------------------------------------------------------------------------


def pod_labels(deployment: dict) -> dict:
    return deployment["spec"]["template"]["metadata"]["labels"]


def worker_deployments(manifests: list[dict]) -> list[dict]:
    workers = component(manifests, "Deployment", "worker")
    assert workers, "no worker Deployment rendered"
    return workers


# --- lint and render ---------------------------------------------------------------------------


def test_helm_lint_default_values(helm_home: Path) -> None:
    result = helm("lint", "--strict", str(CHART), *set_args(REQUIRED_SECRETS), tmp_home=helm_home)
    assert result.returncode == 0, result.stdout + result.stderr


def test_helm_lint_eks_values(helm_home: Path) -> None:
    result = helm("lint", "--strict", str(CHART), "-f", str(CHART / "values-eks.yaml"), tmp_home=helm_home)
    assert result.returncode == 0, result.stdout + result.stderr


def test_chart_refuses_to_render_without_the_admin_token_secret(helm_home: Path) -> None:
    values = {k: v for k, v in REQUIRED_SECRETS.items() if k != "secrets.adminToken.name"}
    result = helm("template", RELEASE, str(CHART), *set_args(values), tmp_home=helm_home)
    assert result.returncode != 0
    assert "secrets.adminToken.name" in result.stderr


def test_chart_refuses_to_render_without_the_internal_token_secret(helm_home: Path) -> None:
    values = {k: v for k, v in REQUIRED_SECRETS.items() if k != "secrets.internalToken.name"}
    result = helm("template", RELEASE, str(CHART), *set_args(values), tmp_home=helm_home)
    assert result.returncode != 0
    assert "secrets.internalToken.name" in result.stderr


def test_chart_refuses_to_render_without_any_required_secret(helm_home: Path) -> None:
    result = helm("template", RELEASE, str(CHART), tmp_home=helm_home)
    assert result.returncode != 0
    for key in REQUIRED_SECRETS:
        assert key in result.stderr, f"no error names {key}:\n{result.stderr}"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"worker.pools.default.tensorParallelSize": "0"}, "tensorParallelSize"),
        ({"worker.pools.default.engine": "tgi"}, "engine"),
        (
            {"worker.pools.default.engine": "transformers", "worker.pools.default.tensorParallelSize": "2"},
            "needs engine vllm",
        ),
        ({"worker.defaults.terminationGracePeriodSeconds": "30"}, "terminationGracePeriodSeconds"),
        ({"ingress.enabled": "true"}, "certificateArn"),
        ({"ingress.enabled": "true", "ingress.certificateArn": "not-an-arn"}, "certificateArn"),
        ({"worker.defaults.keda.enabled": "true"}, "rabbitmqManagementUrl"),
        ({"worker.defaults.keda.minReplicas": "-1"}, "minReplicas"),
        ({"gateway.env.axon_lowercase": "x"}, "axon_lowercase"),
        # An unquoted number would reach the process as 3e+02: env values must be strings.
        ({"sessions.env.AXON_REQUEST_TIMEOUT_S": "300"}, "AXON_REQUEST_TIMEOUT_S"),
        ({"config.namespace": "bad namespace!"}, "config.namespace"),
        ({"gatway.port": "8000"}, "gatway"),
        ({"files.store": "s3"}, "files.s3.bucket"),
        ({"files.store": "disk"}, "files.store"),
        ({"batch.linesInFlight": "0"}, "linesInFlight"),
        ({"batch.billingFactor": "0"}, "billingFactor"),
        # The chart's own value would win over an env map's without a word: refused there.
        ({"config.env.AXON_BATCH_BILLING_FACTOR": "0.5"}, "AXON_BATCH_BILLING_FACTOR, which the chart writes"),
        ({"sessions.env.AXON_FILE_STORE": "s3"}, "remove it from sessions.env"),
        ({"gateway.env.AXON_BATCH_BILLING_FACTOR": "0.5"}, "remove it from gateway.env"),
    ],
)
def test_bad_values_fail_at_install_time(helm_home: Path, values: dict, message: str) -> None:
    typed = {k: v for k, v in values.items() if v.isdigit() or v in ("true", "false")}
    strings = {k: v for k, v in values.items() if k not in typed}
    args = set_args({**REQUIRED_SECRETS, **strings}) + [a for k, v in typed.items() for a in ("--set", f"{k}={v}")]
    result = helm("template", RELEASE, str(CHART), *args, tmp_home=helm_home)
    assert result.returncode != 0, f"rendered despite {values}"
    assert message in result.stderr, result.stderr


# --- offline schema validation -----------------------------------------------------------------


def test_every_manifest_is_valid_for_the_pinned_kubernetes(manifests: list[dict]) -> None:
    unknown = []
    for manifest in manifests:
        ident = f"{manifest['kind']}/{manifest['metadata']['name']}"
        try:
            kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            if (manifest["apiVersion"], manifest["kind"]) not in CUSTOM_KINDS:
                unknown.append(ident)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{ident} is invalid for Kubernetes {KUBERNETES_VERSION}: {exc.message} at {list(exc.path)}")
    assert not unknown, f"no schema and not a known custom resource: {unknown}"


def test_every_manifest_has_a_name_and_chart_labels(manifests: list[dict]) -> None:
    for manifest in manifests:
        labels = manifest["metadata"].get("labels", {})
        assert labels.get("app.kubernetes.io/instance") == RELEASE, manifest["metadata"]["name"]
        assert labels.get("app.kubernetes.io/part-of") == "axon"


def test_chart_creates_no_secret(manifests: list[dict]) -> None:
    assert not of_kind(manifests, "Secret"), "Secrets are external: the chart only references them"


# --- settings drift ------------------------------------------------------------------------------


def test_every_axon_variable_in_the_chart_is_a_setting(manifests: list[dict]) -> None:
    known = settings_env_names()
    used: dict[str, str] = {}
    for path in sorted(CHART.rglob("*")):
        if path.is_file() and path.suffix in (".yaml", ".tpl", ".json", ".txt") and "dashboards" not in path.parts:
            for name in axon_names_in_text(path.read_text()):
                used.setdefault(name, str(path.relative_to(CHART)))
    for manifest in workloads(manifests):
        for container in manifest["spec"]["template"]["spec"]["containers"]:
            for name in env_of(container):
                if name.startswith("AXON_"):
                    used.setdefault(name, f"{manifest['kind']}/{manifest['metadata']['name']}")
    unknown = {name: where for name, where in used.items() if name not in known}
    assert not unknown, f"AXON_* variables no settings class reads: {unknown}"


def test_every_axon_variable_in_the_eks_guide_is_a_setting() -> None:
    guide = (CHART.parents[1] / "docs" / "deploy-eks.md").read_text()
    unknown = sorted(axon_names_in_text(guide) - set(settings_env_names()))
    assert not unknown, f"docs/deploy-eks.md names settings the code does not read: {unknown}"


def test_commands_are_console_scripts(manifests: list[dict]) -> None:
    scripts = console_scripts()
    for manifest in axon_workloads(manifests):
        for container in manifest["spec"]["template"]["spec"]["containers"]:
            assert container["command"][0] in scripts, f"{manifest['metadata']['name']}: {container['command']}"


@pytest.mark.parametrize(
    ("component_name", "port_setting", "settings_class", "field"),
    [
        ("gateway", "AXON_GATEWAY_PORT", "GatewaySettings", "gateway_port"),
        ("sessions", "AXON_SESSIONS_PORT", "SessionsSettings", "sessions_port"),
        ("worker", "AXON_WORKER_PORT", "WorkerSettings", "worker_port"),
    ],
)
def test_ports_match_the_settings(
    default_manifests: list[dict], component_name: str, port_setting: str, settings_class: str, field: str
) -> None:
    default_port = setting_default(settings_class, field)
    for deployment in component(default_manifests, "Deployment", component_name):
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == "http"]
        assert port == default_port, "the chart's default port differs from the code's"
        assert env_of(container)[port_setting] == str(port), "the process would listen elsewhere"


def test_gateway_finds_the_session_manager_service(manifests: list[dict]) -> None:
    (gateway,) = component(manifests, "Deployment", "gateway")
    url = env_of(gateway["spec"]["template"]["spec"]["containers"][0])["AXON_SESSIONS_URL"]
    (service,) = component(manifests, "Service", "sessions")
    assert url == f"http://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"


def test_services_point_at_named_container_ports(manifests: list[dict]) -> None:
    for service in of_kind(manifests, "Service"):
        targets = [
            d
            for d in of_kind(manifests, "Deployment")
            if selects({"matchLabels": service["spec"]["selector"]}, pod_labels(d))
        ]
        assert targets, f"Service {service['metadata']['name']} selects no Deployment"
        for deployment in targets:
            names = {
                p["name"] for c in deployment["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])
            }
            for port in service["spec"]["ports"]:
                assert port["targetPort"] in names


# --- pod security and lifecycle --------------------------------------------------------------------


def test_every_pod_runs_non_root_read_only_without_capabilities(manifests: list[dict]) -> None:
    for workload in workloads(manifests):
        pod = workload["spec"]["template"]["spec"]
        name = workload["metadata"]["name"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] != 0, name
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in pod["containers"]:
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, name
            assert sc["allowPrivilegeEscalation"] is False, name
            assert sc["capabilities"]["drop"] == ["ALL"], name
            assert not sc["capabilities"].get("add"), name
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert "emptyDir" in volumes[mounts["/tmp"]], f"{name}: /tmp must be writable"


def test_workers_have_a_writable_cache_for_model_files(manifests: list[dict]) -> None:
    for worker in worker_deployments(manifests):
        pod = worker["spec"]["template"]["spec"]
        mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert "emptyDir" in volumes[mounts["/cache"]] or "persistentVolumeClaim" in volumes[mounts["/cache"]]
        assert "emptyDir" in volumes[mounts["/home/axon"]], "libraries write under ~ (the image's HOME)"


def test_every_deployment_probes_health_and_readiness(manifests: list[dict]) -> None:
    for deployment in of_kind(axon_workloads(manifests), "Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
            assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}


def test_workers_are_not_killed_while_their_model_loads(manifests: list[dict]) -> None:
    for worker in worker_deployments(manifests):
        (container,) = worker["spec"]["template"]["spec"]["containers"]
        startup = container["startupProbe"]
        assert startup["httpGet"] == {"path": "/health", "port": "http"}
        # Liveness waits for the first answer, for as long as the rollout waits for the pod.
        assert startup["periodSeconds"] * startup["failureThreshold"] >= worker["spec"]["progressDeadlineSeconds"]


def test_worker_grace_period_outlasts_the_drain(manifests: list[dict]) -> None:
    for worker in worker_deployments(manifests):
        pod = worker["spec"]["template"]["spec"]
        drain = float(env_of(pod["containers"][0])["AXON_DRAIN_TIMEOUT_S"])
        # uvicorn's own shutdown allows drain + 5 s (services/worker/main.py).
        assert pod["terminationGracePeriodSeconds"] > drain + 5, worker["metadata"]["name"]


def test_default_drain_matches_the_code(default_manifests: list[dict]) -> None:
    (worker,) = worker_deployments(default_manifests)
    drain = env_of(worker["spec"]["template"]["spec"]["containers"][0])["AXON_DRAIN_TIMEOUT_S"]
    assert float(drain) == setting_default("WorkerSettings", "drain_timeout_s")


def test_workers_get_their_identity_from_the_pod_name(manifests: list[dict]) -> None:
    for worker in worker_deployments(manifests):
        env = env_of(worker["spec"]["template"]["spec"]["containers"][0])
        assert env["AXON_WORKER_ID"] == ("field", "metadata.name")


# --- GPUs and tensor parallelism ---------------------------------------------------------------------


def test_gpu_workers_request_one_gpu_per_rank(manifests: list[dict]) -> None:
    gpu_workers = 0
    for worker in worker_deployments(manifests):
        pod = worker["spec"]["template"]["spec"]
        container = pod["containers"][0]
        env = env_of(container)
        if env["AXON_ENGINE"] != "vllm":
            assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
            continue
        gpu_workers += 1
        gpus = int(env["AXON_TENSOR_PARALLEL_SIZE"]) * int(env["AXON_PIPELINE_PARALLEL_SIZE"])
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == gpus
        assert (
            "nvidia.com/gpu" not in container["resources"].get("requests", {})
            or int(container["resources"]["requests"]["nvidia.com/gpu"]) == gpus
        )
        # NCCL's shared memory: a memory-backed emptyDir on /dev/shm.
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        shm = {v["name"]: v for v in pod["volumes"]}[mounts["/dev/shm"]]
        assert shm["emptyDir"]["medium"] == "Memory"
        assert shm["emptyDir"].get("sizeLimit")
        # On the GPU node group.
        assert pod["nodeSelector"], "GPU workers need a node selector"
        assert any(t.get("key") == "nvidia.com/gpu" for t in pod["tolerations"])
        assert container["image"].split("/")[-1].startswith("axon-worker-gpu:")
    assert gpu_workers, "no GPU worker rendered"


def test_eks_example_sizes_the_large_model_for_four_gpus(eks_manifests: list[dict]) -> None:
    tps = {}
    for worker in worker_deployments(eks_manifests):
        env = env_of(worker["spec"]["template"]["spec"]["containers"][0])
        tps[env["AXON_MODEL"]] = int(env["AXON_TENSOR_PARALLEL_SIZE"])
    assert tps == {"Qwen2.5-72B-Instruct": 4, "Qwen2.5-7B-Instruct": 1}


def test_cpu_pool_uses_the_cpu_image_without_gpus(helm_home: Path) -> None:
    result = helm(
        "template",
        RELEASE,
        str(CHART),
        *set_args(REQUIRED_SECRETS),
        "--set-string",
        "worker.pools.cpu.model=SmolLM2-135M-Instruct",
        "--set-string",
        "worker.pools.cpu.engine=transformers",
        tmp_home=helm_home,
    )
    assert result.returncode == 0, result.stderr
    cpu = named(load_manifests(result.stdout), "Deployment", f"{RELEASE}-worker-cpu")
    pod = cpu["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"].startswith("axon-worker:")
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    assert "/dev/shm" not in {m["mountPath"] for m in container["volumeMounts"]}
    assert "AXON_TENSOR_PARALLEL_SIZE" not in env_of(container)


def _api_env(manifests: list[dict], name: str) -> dict[str, object]:
    (deployment,) = component(manifests, "Deployment", name)
    return env_of(deployment["spec"]["template"]["spec"]["containers"][0])


def _sessions_fields(*prefixes: str) -> list[str]:
    from services.sessions.settings import SessionsSettings

    return sorted(f for f in SessionsSettings.model_fields if f.startswith(prefixes))


def test_files_settings_reach_the_gateway_and_the_session_manager(
    helm_home: Path, default_manifests: list[dict]
) -> None:
    gateway, sessions = (_api_env(default_manifests, name) for name in ("gateway", "sessions"))
    limit = str(setting_default("SessionsSettings", "file_max_bytes"))
    assert limit == str(setting_default("GatewaySettings", "file_max_bytes"))
    assert gateway["AXON_FILE_MAX_BYTES"] == sessions["AXON_FILE_MAX_BYTES"] == limit
    assert sessions["AXON_FILE_STORE"] == "postgres" and "AXON_FILE_S3_BUCKET" not in sessions
    s3 = {
        "files.store": "s3",
        "files.s3.bucket": "axon-files",
        "files.s3.region": "eu-west-1",
        "files.s3.endpoint": "https://minio.storage:9000",
    }
    result = helm("template", RELEASE, str(CHART), *set_args({**REQUIRED_SECRETS, **s3}), tmp_home=helm_home)
    assert result.returncode == 0, result.stderr
    sessions = _api_env(load_manifests(result.stdout), "sessions")
    assert {k: v for k, v in sessions.items() if k.startswith("AXON_FILE_S3_") or k == "AXON_FILE_STORE"} == {
        "AXON_FILE_STORE": "s3",
        "AXON_FILE_S3_BUCKET": "axon-files",
        "AXON_FILE_S3_PREFIX": "axon/files/",
        "AXON_FILE_S3_REGION": "eu-west-1",
        "AXON_FILE_S3_ENDPOINT": "https://minio.storage:9000",
    }
    s3_settings = {f"AXON_{f.upper()}" for f in _sessions_fields("file_s3_")}
    assert s3_settings <= set(sessions), f"files.s3 writes none of {s3_settings - set(sessions)}"


def test_every_batch_and_file_setting_reaches_the_session_manager_at_the_codes_default(
    default_manifests: list[dict],
) -> None:
    """The chart's `batch` and `files` values write every batch_* and file_* setting the session
    manager reads (the S3 bucket's with files.store s3: above), each at the code's default."""
    sessions = _api_env(default_manifests, "sessions")
    fields = [f for f in _sessions_fields("batch_", "file_") if not f.startswith("file_s3_")]
    assert "batch_billing_factor" in fields and "batch_lines_in_flight" in fields
    for field in fields:
        name, default = f"AXON_{field.upper()}", setting_default("SessionsSettings", field)
        assert name in sessions, f"the chart gives the session manager no {name}"
        assert type(default)(sessions[name]) == default, f"{name}: the chart's {sessions[name]}, the code's {default}"
    gateway = _api_env(default_manifests, "gateway")
    assert float(gateway["AXON_BATCH_BILLING_FACTOR"]) == setting_default("GatewaySettings", "batch_billing_factor")


def test_batch_values_reach_the_session_manager_and_the_billing_factor_the_gateway(
    helm_home: Path, tmp_path: Path
) -> None:
    # A values file, as an operator's: YAML numbers reach the templates as floats, and a large one
    # must still be written as an integer (not 5e+07).
    values = tmp_path / "batch.yaml"
    values.write_text(
        "batch:\n  maxRequests: 1000\n  linesInFlight: 8\n  queueAhead: 4\n  queueTokens: 50000000\n"
        "  lineAttempts: 5\n  retentionDays: 7\n  billingFactor: 0.5\n"
    )
    result = helm("template", RELEASE, str(CHART), *set_args(REQUIRED_SECRETS), "-f", str(values), tmp_home=helm_home)
    assert result.returncode == 0, result.stderr
    manifests = load_manifests(result.stdout)
    sessions, gateway = (_api_env(manifests, name) for name in ("sessions", "gateway"))
    assert {k: v for k, v in sessions.items() if k.startswith("AXON_BATCH_")} == {
        "AXON_BATCH_MAX_REQUESTS": "1000",
        "AXON_BATCH_LINES_IN_FLIGHT": "8",
        "AXON_BATCH_QUEUE_AHEAD": "4",
        "AXON_BATCH_QUEUE_TOKENS": "50000000",
        "AXON_BATCH_LINE_ATTEMPTS": "5",
        "AXON_BATCH_RETENTION_DAYS": "7",
        "AXON_BATCH_BILLING_FACTOR": "0.5",
    }
    assert {k: v for k, v in gateway.items() if k.startswith("AXON_BATCH_")} == {"AXON_BATCH_BILLING_FACTOR": "0.5"}


# --- scaling and disruption --------------------------------------------------------------------------


def test_the_prefix_index_reaches_the_workers_and_the_session_managers(
    helm_home: Path, tmp_path: Path, default_manifests: list[dict]
) -> None:
    sessions = _api_env(default_manifests, "sessions")
    assert sessions["AXON_PREFIX_ROUTING"] == "true"
    assert int(str(sessions["AXON_PREFIX_SPILL_SEQS"])) == setting_default("SessionsSettings", "prefix_spill_seqs")
    for worker in worker_deployments(default_manifests):
        assert env_of(worker["spec"]["template"]["spec"]["containers"][0])["AXON_PREFIX_INDEX"] == "true"
    values = tmp_path / "prefix.yaml"
    values.write_text("prefixIndex:\n  enabled: false\n  spillSeqs: 3\n")
    result = helm("template", RELEASE, str(CHART), *set_args(REQUIRED_SECRETS), "-f", str(values), tmp_home=helm_home)
    assert result.returncode == 0, result.stderr
    manifests = load_manifests(result.stdout)
    sessions = _api_env(manifests, "sessions")
    assert (sessions["AXON_PREFIX_ROUTING"], sessions["AXON_PREFIX_SPILL_SEQS"]) == ("false", "3")
    for worker in worker_deployments(manifests):
        assert env_of(worker["spec"]["template"]["spec"]["containers"][0])["AXON_PREFIX_INDEX"] == "false"


def test_gateway_and_sessions_autoscale(manifests: list[dict]) -> None:
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h for h in of_kind(manifests, "HorizontalPodAutoscaler")}
    for name in ("gateway", "sessions"):
        (deployment,) = component(manifests, "Deployment", name)
        assert deployment["metadata"]["name"] in hpas, f"no HPA for {name}"
        assert "replicas" not in deployment["spec"], "replicas would fight the HPA"


def test_every_deployment_has_a_disruption_budget(manifests: list[dict]) -> None:
    pdbs = of_kind(manifests, "PodDisruptionBudget")
    for deployment in of_kind(manifests, "Deployment"):
        assert any(selects(p["spec"]["selector"], pod_labels(deployment)) for p in pdbs), deployment["metadata"]["name"]


def test_keda_scales_each_pool_on_its_own_queue(eks_manifests: list[dict]) -> None:
    scaled = {s["spec"]["scaleTargetRef"]["name"]: s for s in of_kind(eks_manifests, "ScaledObject")}
    auths = {a["metadata"]["name"]: a for a in of_kind(eks_manifests, "TriggerAuthentication")}
    for worker in worker_deployments(eks_manifests):
        name = worker["metadata"]["name"]
        assert name in scaled, f"no ScaledObject for {name}"
        assert "replicas" not in worker["spec"], "replicas would fight KEDA"
        spec = scaled[name]["spec"]
        assert spec["scaleTargetRef"]["kind"] == "Deployment"
        assert spec["minReplicaCount"] >= 1
        assert spec["maxReplicaCount"] >= spec["minReplicaCount"]
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "rabbitmq"
        assert trigger["metadata"]["mode"] == "QueueLength"
        assert int(trigger["metadata"]["value"]) >= 1
        auth = auths[trigger["authenticationRef"]["name"]]
        (ref,) = auth["spec"]["secretTargetRef"]
        assert ref["parameter"] == "host" and ref["name"] and ref["key"]


def test_keda_counts_the_models_queue_and_its_tenants_queues(eks_manifests: list[dict]) -> None:
    """The fair share keeps a tenant's jobs in its own queue until a worker takes them: a pool
    scaled on the model's queue alone would never scale out."""
    for worker in worker_deployments(eks_manifests):
        env = env_of(worker["spec"]["template"]["spec"]["containers"][0])
        (scaled,) = [
            s
            for s in of_kind(eks_manifests, "ScaledObject")
            if s["spec"]["scaleTargetRef"]["name"] == worker["metadata"]["name"]
        ]
        (trigger,) = scaled["spec"]["triggers"]
        assert_counts_the_models_queues(trigger, str(env["AXON_NAMESPACE"]), str(env["AXON_MODEL"]), batch=False)


# --- migrations --------------------------------------------------------------------------------------


def test_migrations_run_as_a_pre_install_and_pre_upgrade_hook(manifests: list[dict]) -> None:
    (job,) = of_kind(manifests, "Job")
    annotations = job["metadata"]["annotations"]
    assert set(annotations["helm.sh/hook"].split(",")) == {"pre-install", "pre-upgrade"}
    assert "before-hook-creation" in annotations["helm.sh/hook-delete-policy"]
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    # A pre-install hook runs before the release's ServiceAccount exists.
    assert "serviceAccountName" not in pod
    (container,) = pod["containers"]
    assert container["command"] == ["axon", "migrate"]
    assert env_of(container)["AXON_DATABASE_URL"] == ("secret", "axon-postgres", "url")
    assert job["spec"]["activeDeadlineSeconds"] > 0


def test_secrets_reach_only_the_components_that_need_them(default_manifests: list[dict]) -> None:
    envs = {
        d["metadata"]["labels"]["app.kubernetes.io/component"]: env_of(d["spec"]["template"]["spec"]["containers"][0])
        for d in workloads(default_manifests)
    }
    assert envs["gateway"]["AXON_ADMIN_TOKEN"] == ("secret", "axon-admin", "token")
    assert all("AXON_ADMIN_TOKEN" not in env for name, env in envs.items() if name != "gateway")
    for name in ("gateway", "sessions"):
        assert envs[name]["AXON_REDIS_URL"] == ("secret", "axon-redis", "url")
        assert envs[name]["AXON_AMQP_URL"] == ("secret", "axon-rabbitmq", "url")
        assert envs[name]["AXON_DATABASE_URL"] == ("secret", "axon-postgres", "url")
    assert envs["worker"]["AXON_REDIS_URL"] == ("secret", "axon-redis", "url")
    assert envs["worker"]["AXON_AMQP_URL"] == ("secret", "axon-rabbitmq", "url")
    # Every process holds the internal token; the internal ones listen beyond 127.0.0.1 in the pod.
    for name in ("gateway", "sessions", "worker"):
        assert envs[name]["AXON_INTERNAL_TOKEN"] == ("secret", "axon-internal", "token")
    assert envs["sessions"]["AXON_HOST"] == envs["worker"]["AXON_HOST"] == "0.0.0.0"


# --- network -----------------------------------------------------------------------------------------


def _policy_for(manifests: list[dict], name: str) -> dict:
    (deployment, *_) = component(manifests, "Deployment", name)
    policies = [
        p for p in of_kind(manifests, "NetworkPolicy") if selects(p["spec"]["podSelector"], pod_labels(deployment))
    ]
    assert len(policies) == 1, f"{name}: {len(policies)} NetworkPolicies"
    assert policies[0]["spec"]["policyTypes"] == ["Ingress"]
    return policies[0]


def _peers(policy: dict) -> list[dict]:
    return [peer for rule in policy["spec"].get("ingress") or [] for peer in rule.get("from", [])]


def test_only_the_gateway_is_reachable_from_outside(manifests: list[dict]) -> None:
    gateway_peers = _peers(_policy_for(manifests, "gateway"))
    assert any("ipBlock" in peer for peer in gateway_peers), "the load balancer cannot reach the gateway"
    for name in ("sessions", "worker"):
        assert not any("ipBlock" in peer for peer in _peers(_policy_for(manifests, name))), name
    exposed = [
        s["metadata"]["name"]
        for s in of_kind(manifests, "Service")
        if s["spec"].get("type", "ClusterIP") != "ClusterIP"
    ]
    assert not exposed, f"only the Ingress exposes the gateway: {exposed}"


def test_session_manager_accepts_only_the_gateway_and_prometheus(manifests: list[dict]) -> None:
    (gateway,) = component(manifests, "Deployment", "gateway")
    peers = _peers(_policy_for(manifests, "sessions"))
    in_namespace = [p for p in peers if set(p) == {"podSelector"}]
    assert len(in_namespace) == 1 and selects(in_namespace[0]["podSelector"], pod_labels(gateway))
    others = [p for p in peers if p not in in_namespace]
    assert all("namespaceSelector" in p for p in others), "anything else must be Prometheus' namespace"


def test_workers_accept_only_prometheus(manifests: list[dict]) -> None:
    for worker in worker_deployments(manifests):
        peers = _peers(_policy_for(manifests, "worker"))
        assert peers and all("namespaceSelector" in p for p in peers), worker["metadata"]["name"]


def test_ingress_is_an_https_alb_in_front_of_the_gateway(eks_manifests: list[dict]) -> None:
    (ingress,) = of_kind(eks_manifests, "Ingress")
    annotations = ingress["metadata"]["annotations"]
    assert ingress["spec"]["ingressClassName"] == "alb"
    assert annotations["alb.ingress.kubernetes.io/certificate-arn"].startswith("arn:aws:acm:")
    assert '"HTTPS": 443' in annotations["alb.ingress.kubernetes.io/listen-ports"]
    assert annotations["alb.ingress.kubernetes.io/ssl-redirect"] == "443"
    assert annotations["alb.ingress.kubernetes.io/target-type"] == "ip"
    assert annotations["alb.ingress.kubernetes.io/healthcheck-path"] == "/ready"
    idle = int(annotations["alb.ingress.kubernetes.io/load-balancer-attributes"].split("=")[1])
    assert idle > setting_default("SessionsSettings", "request_timeout_s"), "a quiet request would be cut by the ALB"
    (rule,) = ingress["spec"]["rules"]
    assert rule["host"] == "api.example.com"
    paths = {p["path"]: p["backend"]["service"] for p in rule["http"]["paths"]}
    (gateway_service,) = component(eks_manifests, "Service", "gateway")
    assert paths["/"] == {"name": gateway_service["metadata"]["name"], "port": {"name": "http"}}
    # The admin API is answered 404 by the ALB itself, before the catch-all rule.
    assert next(iter(paths)) == "/admin"
    assert paths["/admin"]["port"] == {"name": "use-annotation"}
    action = json.loads(annotations[f"alb.ingress.kubernetes.io/actions.{paths['/admin']['name']}"])
    assert action["type"] == "fixed-response"
    assert action["fixedResponseConfig"]["statusCode"] == "404"
    assert json.loads(action["fixedResponseConfig"]["messageBody"])["error"]["code"] == "not_found"


# --- monitoring --------------------------------------------------------------------------------------


def test_service_monitor_scrapes_every_component(eks_manifests: list[dict]) -> None:
    (monitor,) = of_kind(eks_manifests, "ServiceMonitor")
    spec = monitor["spec"]
    assert spec["namespaceSelector"]["matchNames"] == [NAMESPACE]
    assert spec["jobLabel"] == "app.kubernetes.io/component"
    (endpoint,) = spec["endpoints"]
    assert endpoint["path"] == "/metrics"
    credentials = endpoint["authorization"]["credentials"]
    assert (endpoint["authorization"]["type"], credentials["name"], credentials["key"]) == (
        "Bearer",
        "axon-internal",
        "token",
    )
    scraped = {
        s["metadata"]["labels"]["app.kubernetes.io/component"]
        for s in of_kind(eks_manifests, "Service")
        if selects(spec["selector"], s["metadata"]["labels"])
        and endpoint["port"] in {p["name"] for p in s["spec"]["ports"]}
    }
    assert scraped == {"gateway", "sessions", "worker"}


def test_alerts_use_metrics_the_code_exports(eks_manifests: list[dict]) -> None:
    (rule,) = of_kind(eks_manifests, "PrometheusRule")
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert {"AxonNoLiveWorker", "AxonGatewayHigh5xxRatio", "AxonTimeToFirstTokenP95High"} <= set(alerts)
    assert "absent(up{" in alerts["AxonNoLiveWorker"]["expr"]
    assert 'status=~"5.."' in alerts["AxonGatewayHigh5xxRatio"]["expr"]
    assert "axon_sessions_time_to_first_token_seconds_bucket" in alerts["AxonTimeToFirstTokenP95High"]["expr"]
    exported = exported_metric_names()
    for group in rule["spec"]["groups"]:
        for r in group["rules"]:
            assert r["labels"]["severity"] in ("critical", "warning")
            assert r["for"]
            missing = metric_names_in_promql(r["expr"]) - exported
            assert not missing, f"{r['alert']} uses metrics the code does not export: {missing}"
    services = {s["metadata"]["name"] for s in of_kind(eks_manifests, "Service")}
    for r in alerts.values():
        for service in re.findall(r'service="([^"]+)"', r["expr"]):
            assert service in services, f"{r['alert']} watches a Service that does not exist: {service}"


def test_dashboards_configmap_is_built_from_the_one_copy_of_each_dashboard(manifests: list[dict]) -> None:
    (configmap,) = [
        c for c in of_kind(manifests, "ConfigMap") if c["metadata"]["labels"].get("grafana_dashboard") == "1"
    ]
    files = {p.name: p.read_text() for p in DASHBOARDS.glob("*.json")}
    assert files, "no dashboard in helm/axon/dashboards"
    assert configmap["data"] == files
