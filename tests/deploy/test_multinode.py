"""Multi-node pools (helm/axon/examples/multinode-405b.yaml): a LeaderWorkerSet whose groups span
two 8-GPU nodes, rendered and validated offline.

The LeaderWorkerSet is checked against the CRD schema vendored in tests/deploy/schemas (strictly:
a field the CRD does not know is an error, as with `kubectl apply --validate=strict`), its pod
templates against the pinned Kubernetes release's PodTemplateSpec, and the facts a group depends
on field by field. Nothing here runs a group: that needs the LWS controller, two GPU nodes and EFA.
"""

from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.conftest import RELEASE
from tests.deploy.support import (
    CHART,
    KUBERNETES_VERSION,
    REQUIRED_SECRETS,
    env_of,
    helm,
    of_kind,
    selects,
    set_args,
    setting_default,
)

LWS_CRD = Path(__file__).parent / "schemas" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
EXAMPLE = yaml.safe_load((CHART / "examples" / "multinode-405b.yaml").read_text())
POOL = EXAMPLE["worker"]["pools"]["llama-405b"]
CUSTOM_KINDS = {
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("keda.sh/v1alpha1", "TriggerAuthentication"),
}


# --- the vendored CRD schema ------------------------------------------------------------------------


def _strict(schema: Any) -> Any:
    """A CRD's structural schema as JSON Schema that also refuses unknown fields."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _strict(value) for key, value in schema.items() if not key.startswith("x-")}
    if "properties" in schema and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _kubernetes_typed(schema: dict, data: Any, path: tuple = ()) -> list[tuple[tuple, str, Any]]:
    """The parts of `data` whose schema says `x-axon-kubernetes-schema`: (path, Kubernetes type, value)."""
    found: list[tuple[tuple, str, Any]] = []
    if "x-axon-kubernetes-schema" in schema and data is not None:
        found.append((path, schema["x-axon-kubernetes-schema"], data))
    if isinstance(data, dict):
        for key, value in data.items():
            if key in schema.get("properties", {}):
                found += _kubernetes_typed(schema["properties"][key], value, (*path, key))
    if isinstance(data, list) and "items" in schema:
        for index, value in enumerate(data):
            found += _kubernetes_typed(schema["items"], value, (*path, index))
    return found


def validate_leaderworkerset(manifest: dict) -> None:
    crd = yaml.safe_load(LWS_CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == manifest["apiVersion"].split("/")[1]]
    assert manifest["apiVersion"].split("/")[0] == crd["spec"]["group"]
    assert manifest["kind"] == crd["spec"]["names"]["kind"]
    schema = version["schema"]["openAPIV3Schema"]
    jsonschema.validate(manifest, _strict(schema))
    wrappers = {"PodTemplateSpec": ("PodTemplate", "template"), "PersistentVolumeClaim": (None, None)}
    for path, kind, value in _kubernetes_typed(schema, manifest):
        wrapper_kind, field = wrappers[kind]
        document = (
            {"apiVersion": "v1", "kind": wrapper_kind, "metadata": {"name": "t"}, field: value}
            if wrapper_kind
            else {"apiVersion": "v1", "kind": kind, **value}
        )
        try:
            kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{'.'.join(map(str, path))} is not a valid {kind}: {exc.message} at {list(exc.path)}")


def test_the_vendored_schema_refuses_what_the_crd_refuses(multinode_manifests: list[dict]) -> None:
    (lws,) = of_kind(multinode_manifests, "LeaderWorkerSet")
    for change, where in [
        (lambda s: s.__setitem__("startupPolicy", "LeaderRunning"), "startupPolicy"),
        (lambda s: s["leaderWorkerTemplate"].__setitem__("restartPolicy", "Always"), "restartPolicy"),
        (lambda s: s["leaderWorkerTemplate"].__setitem__("groupSize", 2), "groupSize"),
        (lambda s: s["leaderWorkerTemplate"]["workerTemplate"]["spec"].__setitem__("containerz", []), "containerz"),
    ]:
        broken = yaml.safe_load(yaml.safe_dump(lws))
        change(broken["spec"])
        with pytest.raises((jsonschema.ValidationError, pytest.fail.Exception), match=where):
            validate_leaderworkerset(broken)


def test_the_leaderworkerset_is_valid_for_its_crd(multinode_manifests: list[dict]) -> None:
    (lws,) = of_kind(multinode_manifests, "LeaderWorkerSet")
    validate_leaderworkerset(lws)


def test_every_other_manifest_is_valid_for_the_pinned_kubernetes(multinode_manifests: list[dict]) -> None:
    for manifest in multinode_manifests:
        if (manifest["apiVersion"], manifest["kind"]) in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{manifest['kind']}/{manifest['metadata']['name']}: {exc.message} at {list(exc.path)}")


# --- the group -----------------------------------------------------------------------------------------


@pytest.fixture
def lws(multinode_manifests: list[dict]) -> dict:
    (found,) = of_kind(multinode_manifests, "LeaderWorkerSet")
    assert not of_kind(multinode_manifests, "Deployment") or all(
        d["metadata"]["labels"]["app.kubernetes.io/component"] != "worker"
        for d in of_kind(multinode_manifests, "Deployment")
    ), "a multi-node pool renders no worker Deployment"
    return found


def pods(lws: dict) -> dict[str, dict]:
    template = lws["spec"]["leaderWorkerTemplate"]
    return {"leader": template["leaderTemplate"]["spec"], "follower": template["workerTemplate"]["spec"]}


def test_a_group_holds_the_engines_tensor_times_pipeline_gpus(lws: dict) -> None:
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    leader_env = env_of(pods(lws)["leader"]["containers"][0])
    tp, pp = int(leader_env["AXON_TENSOR_PARALLEL_SIZE"]), int(leader_env["AXON_PIPELINE_PARALLEL_SIZE"])
    assert (size, tp, pp) == (POOL["multiNode"]["nodes"], 8, 2)
    for spec in pods(lws).values():
        gpus = int(spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
        assert gpus == POOL["multiNode"]["gpusPerNode"]
    assert size * gpus == tp * pp
    assert leader_env["AXON_DISTRIBUTED_EXECUTOR"] == "ray"
    assert leader_env["AXON_ENGINE"] == "vllm"


def test_the_leaders_settings_give_vllm_the_groups_shape(lws: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rendered environment, read by the worker's own settings, as the engine hands it to vLLM."""
    from services.worker.settings import WorkerSettings

    for name, value in env_of(pods(lws)["leader"]["containers"][0]).items():
        if isinstance(value, str):
            monkeypatch.setenv(name, value)
    settings = WorkerSettings()
    assert (settings.engine, settings.tensor_parallel_size, settings.pipeline_parallel_size) == ("vllm", 8, 2)
    assert settings.distributed_executor == "ray"
    assert settings.model_path == POOL["modelPath"]


def test_the_group_restarts_whole_and_its_followers_start_with_the_leader(lws: dict) -> None:
    assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    # LeaderReady would deadlock: the leader is ready only once its engine has the followers' GPUs.
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"
    leader = pods(lws)["leader"]["containers"][0]
    assert leader["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    # Loading 810 GB over two nodes: liveness waits for the first answer, up to the pool's deadline.
    startup = leader["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= POOL["progressDeadlineSeconds"]


def test_the_leader_runs_a_ray_head_then_the_worker_and_followers_join_it(lws: dict) -> None:
    leader = pods(lws)["leader"]["containers"][0]
    follower = pods(lws)["follower"]["containers"][0]
    leader_script, follower_script = leader["command"][-1], follower["command"][-1]
    assert leader["command"][:2] == follower["command"][:2] == ["/bin/sh", "-c"]
    assert leader_script.startswith("ray start --head --port=6379 ")
    assert leader_script.endswith("exec axon-worker"), "axon-worker must get the pod's SIGTERM to drain"
    assert 'head="$LWS_LEADER_ADDRESS:6379"' in follower_script
    assert "ray health-check" in follower_script
    assert 'exec ray start --address="$head" --block' in follower_script
    # The same object store, below /dev/shm's size.
    store = int(leader_script.split("--object-store-memory=")[1].split()[0])
    assert store == int(follower_script.split("--object-store-memory=")[1].split()[0])
    shm = {v["name"]: v for v in pods(lws)["leader"]["volumes"]}["dshm"]["emptyDir"]
    assert shm["medium"] == "Memory" and store < int(shm["sizeLimit"].removesuffix("Gi")) * 2**30


def test_followers_hold_no_axon_credentials_and_outlive_the_leaders_drain(lws: dict) -> None:
    spec = pods(lws)["follower"]
    (container,) = spec["containers"]
    env = env_of(container)
    assert not [name for name in env if name.startswith("AXON_")]
    assert "ports" not in container and "readinessProbe" not in container
    drain = float(env_of(pods(lws)["leader"]["containers"][0])["AXON_DRAIN_TIMEOUT_S"])
    assert drain == setting_default("WorkerSettings", "drain_timeout_s")
    stay = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert drain < stay < spec["terminationGracePeriodSeconds"]


def test_every_pod_of_a_group_gets_efa_and_the_nccl_settings(lws: dict) -> None:
    for role, spec in pods(lws).items():
        (container,) = spec["containers"]
        limits = container["resources"]["limits"]
        assert limits["vpc.amazonaws.com/efa"] == POOL["multiNode"]["efa"]["devices"] == 32, role
        assert limits["hugepages-2Mi"] == "5120Mi", role
        env = env_of(container)
        assert (env["FI_PROVIDER"], env["FI_EFA_USE_DEVICE_RDMA"]) == ("efa", "1"), role
        assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0", role
        assert env["HF_TOKEN"] == ("secret", "axon-hf-token", "token"), role
        assert {m["mountPath"] for m in container["volumeMounts"]} >= {"/dev/shm", "/cache", "/tmp"}, role
        assert container["securityContext"]["readOnlyRootFilesystem"] is True, role
        assert not container["securityContext"]["capabilities"].get("add"), role


def test_a_groups_pods_share_a_zone(lws: dict) -> None:
    for spec in pods(lws).values():
        (term,) = spec["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "topology.kubernetes.io/zone"
        assert term["matchLabelKeys"] == ["leaderworkerset.sigs.k8s.io/group-key"]
        assert term["labelSelector"]["matchLabels"]["axon.io/pool"] == "llama-405b"


def test_group_pods_reach_each_other_and_prometheus_scrapes_the_leader(
    multinode_manifests: list[dict], lws: dict
) -> None:
    labels = {
        role: lws["spec"]["leaderWorkerTemplate"][f"{t}Template"]["metadata"]["labels"]
        for role, t in (("leader", "leader"), ("follower", "worker"))
    }
    group_rules = [
        rule
        for policy in of_kind(multinode_manifests, "NetworkPolicy")
        if selects(policy["spec"]["podSelector"], labels["follower"])
        for rule in policy["spec"].get("ingress") or []
        if any(selects(peer.get("podSelector", {}), labels["leader"]) for peer in rule.get("from", []))
        and "ports" not in rule
    ]
    assert group_rules, "Ray and NCCL need every port between a group's pods"
    (service,) = [s for s in of_kind(multinode_manifests, "Service") if s["metadata"]["labels"].get("axon.io/pool")]
    assert service["metadata"]["name"] != lws["metadata"]["name"], "the LWS controller owns a Service of that name"
    assert selects({"matchLabels": service["spec"]["selector"]}, labels["leader"])
    assert not selects({"matchLabels": service["spec"]["selector"]}, labels["follower"])


def test_keda_scales_whole_groups(multinode_manifests: list[dict], lws: dict) -> None:
    (scaled,) = of_kind(multinode_manifests, "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"] == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "name": lws["metadata"]["name"],
    }
    assert "replicas" not in lws["spec"], "replicas would fight KEDA"


# --- refusals --------------------------------------------------------------------------------------------


def test_same_zone_groups_need_an_api_server_that_keeps_match_label_keys(helm_home: Path) -> None:
    example = str(CHART / "examples" / "multinode-405b.yaml")
    older = helm("template", RELEASE, str(CHART), "-f", example, "--kube-version", "1.30.0", tmp_home=helm_home)
    assert older.returncode != 0
    assert "multiNode.sameZone needs Kubernetes 1.31" in older.stderr
    args = ("-f", example, "--kube-version", "1.30.0", "--set", "worker.pools.llama-405b.multiNode.sameZone=false")
    assert helm("template", RELEASE, str(CHART), *args, tmp_home=helm_home).returncode == 0


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {
                "multiNode.enabled": "true",
                "tensorParallelSize": "8",
                "pipelineParallelSize": "2",
                "multiNode.nodes": "3",
            },
            "tensorParallelSize x pipelineParallelSize (8 x 2 = 16) must equal "
            "multiNode.nodes x multiNode.gpusPerNode (3 x 8 = 24)",
        ),
        ({"multiNode.enabled": "true", "engine": "transformers"}, "multiNode needs engine vllm"),
        ({"engine": "sim", "pipelineParallelSize": "2"}, "pipelineParallelSize 2 needs engine vllm"),
        ({"multiNode.enabled": "true", "multiNode.nodes": "1"}, "nodes"),
        ({"multiNode.env.AXON_MODEL": "x"}, "AXON_MODEL"),
    ],
)
def test_a_pool_that_does_not_fit_its_gpus_is_refused(helm_home: Path, values: dict, message: str) -> None:
    args = set_args(REQUIRED_SECRETS)
    for key, value in values.items():
        flag = "--set" if value.isdigit() or value in ("true", "false") else "--set-string"
        args += [flag, f"worker.pools.default.{key}={value}"]
    result = helm("template", RELEASE, str(CHART), *args, tmp_home=helm_home)
    assert result.returncode != 0, f"rendered despite {values}"
    assert message in result.stderr, result.stderr


def test_helm_lint_multinode_example(helm_home: Path) -> None:
    example = str(CHART / "examples" / "multinode-405b.yaml")
    result = helm("lint", "--strict", str(CHART), "-f", example, tmp_home=helm_home)
    assert result.returncode == 0, result.stdout + result.stderr
