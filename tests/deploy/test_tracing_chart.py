"""Traces and logs in the Helm chart and the EKS values beside it: AXON_OTLP_ENDPOINT and
AXON_TRACE_SAMPLE_RATIO reach every process, the optional OpenTelemetry Collector renders a
configuration whose pipelines hold together, and the Fluent Bit and Grafana values for EKS
(infra/eks) link logs, traces and exemplars to each other. Rendered offline, like test_helm.py.
"""

from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from tests.deploy.conftest import RELEASE
from tests.deploy.support import (
    CHART,
    REQUIRED_SECRETS,
    ROOT,
    axon_workloads,
    component,
    env_of,
    helm,
    load_manifests,
    named,
    of_kind,
    selects,
    set_args,
)

EKS = ROOT / "infra" / "eks"
COLLECTOR = f"{RELEASE}-otel-collector"
TEMPO = "tempo-distributor.monitoring:4317"


def render(helm_home: Path, *args: str) -> list[dict]:
    result = helm("template", RELEASE, str(CHART), *set_args(REQUIRED_SECRETS), *args, tmp_home=helm_home)
    assert result.returncode == 0, result.stderr
    return load_manifests(result.stdout)


def refused(helm_home: Path, *args: str) -> str:
    result = helm("template", RELEASE, str(CHART), *set_args(REQUIRED_SECRETS), *args, tmp_home=helm_home)
    assert result.returncode != 0, f"rendered despite {args}"
    return result.stderr


def axon_envs(manifests: list[dict]) -> dict[str, dict]:
    envs = {}
    for workload in axon_workloads(manifests):
        (container, *_) = workload["spec"]["template"]["spec"]["containers"]
        envs[workload["metadata"]["name"]] = env_of(container)
    assert envs
    return envs


def collector_config(manifests: list[dict]) -> dict:
    return yaml.safe_load(named(manifests, "ConfigMap", COLLECTOR)["data"]["config.yaml"])


@pytest.fixture(scope="module")
def with_collector(helm_home: Path) -> list[dict]:
    return render(
        helm_home,
        "--set",
        "tracing.collector.enabled=true",
        "--set-string",
        f"tracing.collector.tracesEndpoint={TEMPO}",
    )


# --- the processes' settings ------------------------------------------------------------------------


def test_no_tracing_by_default(default_manifests: list[dict]) -> None:
    for name, env in axon_envs(default_manifests).items():
        assert "AXON_OTLP_ENDPOINT" not in env and "AXON_TRACE_SAMPLE_RATIO" not in env, name
    assert not component(default_manifests, "Deployment", "otel-collector")


def test_every_process_sends_to_the_charts_collector(with_collector: list[dict]) -> None:
    service = named(with_collector, "Service", COLLECTOR)
    (http,) = [p for p in service["spec"]["ports"] if p["name"] == "otlp-http"]
    for name, env in axon_envs(with_collector).items():
        url = urlsplit(env["AXON_OTLP_ENDPOINT"])
        assert (url.scheme, url.hostname, url.port, url.path) == ("http", COLLECTOR, http["port"], ""), name
        assert env["AXON_TRACE_SAMPLE_RATIO"] == "0.01", name
    names = set(axon_envs(with_collector))
    assert {f"{RELEASE}-gateway", f"{RELEASE}-sessions", f"{RELEASE}-worker-default"} <= names


def test_an_external_collector_needs_no_collector_of_the_chart(helm_home: Path) -> None:
    endpoint = "http://otel-collector.monitoring:4318"
    manifests = render(
        helm_home, "--set-string", f"tracing.endpoint={endpoint}", "--set-string", "tracing.sampleRatio=0.05"
    )
    for name, env in axon_envs(manifests).items():
        assert (env["AXON_OTLP_ENDPOINT"], env["AXON_TRACE_SAMPLE_RATIO"]) == (endpoint, "0.05"), name
    assert not component(manifests, "Deployment", "otel-collector")


def test_a_components_env_overrides_the_ratio(helm_home: Path) -> None:
    manifests = render(
        helm_home,
        "--set-string",
        "tracing.endpoint=http://otel:4318",
        "--set-string",
        "sessions.env.AXON_TRACE_SAMPLE_RATIO=0.5",
    )
    envs = axon_envs(manifests)
    assert envs[f"{RELEASE}-sessions"]["AXON_TRACE_SAMPLE_RATIO"] == "0.5"
    assert envs[f"{RELEASE}-gateway"]["AXON_TRACE_SAMPLE_RATIO"] == "0.01"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "tracing.collector.enabled=true"], "tracing.collector.tracesEndpoint is required"),
        (["--set-string", "tracing.sampleRatio=2"], "sampleRatio"),
        (["--set-string", "tracing.sampleRatio=all"], "sampleRatio"),
        (["--set-string", "tracing.endpoint=otel:4318"], "endpoint"),
        (["--set-string", "tracing.collector.tracesEndpoint=http://tempo:4317"], "tracesEndpoint"),
        (["--set", "tracing.collector.tailSampling.baselinePercent=150"], "baselinePercent"),
    ],
)
def test_bad_tracing_values_fail_at_install_time(helm_home: Path, args: list[str], message: str) -> None:
    assert message in refused(helm_home, *args)


# --- the collector ----------------------------------------------------------------------------------


def test_collector_config_holds_together(with_collector: list[dict]) -> None:
    config = collector_config(with_collector)
    (pipeline,) = config["service"]["pipelines"].values()
    assert pipeline["processors"] == ["memory_limiter", "tail_sampling", "batch"]
    for kind in ("receivers", "processors", "exporters"):
        assert set(pipeline[kind]) == set(config[kind]), kind
    assert set(config["service"]["extensions"]) == set(config["extensions"])
    (exporter,) = pipeline["exporters"]
    assert config["exporters"][exporter]["endpoint"] == TEMPO
    policies = {p["type"]: p for p in config["processors"]["tail_sampling"]["policies"]}
    assert policies["status_code"]["status_code"]["status_codes"] == ["ERROR"]
    assert policies["latency"]["latency"]["threshold_ms"] == 5000
    assert policies["probabilistic"]["probabilistic"]["sampling_percentage"] == 10


def test_collector_without_tail_sampling_keeps_every_trace(helm_home: Path) -> None:
    manifests = render(
        helm_home,
        "--set",
        "tracing.collector.enabled=true",
        "--set-string",
        f"tracing.collector.tracesEndpoint={TEMPO}",
        "--set",
        "tracing.collector.tailSampling.enabled=false",
    )
    config = collector_config(manifests)
    assert "tail_sampling" not in config["processors"]
    assert config["service"]["pipelines"]["traces"]["processors"] == ["memory_limiter", "batch"]


def test_collector_listens_where_its_config_says(with_collector: list[dict]) -> None:
    config = collector_config(with_collector)
    deployment = named(with_collector, "Deployment", COLLECTOR)
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    protocols = config["receivers"]["otlp"]["protocols"]
    assert ports["otlp-grpc"] == int(protocols["grpc"]["endpoint"].rsplit(":", 1)[1])
    assert ports["otlp-http"] == int(protocols["http"]["endpoint"].rsplit(":", 1)[1])
    assert ports["health"] == int(config["extensions"]["health_check"]["endpoint"].rsplit(":", 1)[1])
    assert container["livenessProbe"]["httpGet"]["port"] == container["readinessProbe"]["httpGet"]["port"] == "health"
    # The config file it is started with is the ConfigMap's.
    (arg,) = container["args"]
    path = Path(arg.removeprefix("--config="))
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volume = {v["name"]: v for v in pod["volumes"]}[mounts[str(path.parent)]]
    assert volume["configMap"]["name"] == COLLECTOR and path.name == "config.yaml"
    assert container["image"].startswith("otel/opentelemetry-collector-contrib:")
    # Tail sampling needs each trace in one collector.
    assert deployment["spec"]["replicas"] == 1


def test_only_the_releases_pods_reach_the_collector(with_collector: list[dict]) -> None:
    deployment = named(with_collector, "Deployment", COLLECTOR)
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    (policy,) = [p for p in of_kind(with_collector, "NetworkPolicy") if selects(p["spec"]["podSelector"], pod_labels)]
    (rule,) = policy["spec"]["ingress"]
    assert {p["port"] for p in rule["ports"]} == {"otlp-grpc", "otlp-http"}
    (peer,) = rule["from"]
    for workload in axon_workloads(with_collector):
        assert selects(peer["podSelector"], workload["spec"]["template"]["metadata"]["labels"])


def test_eks_example_traces_every_request_into_tail_sampling(eks_manifests: list[dict]) -> None:
    config = collector_config(eks_manifests)
    assert "tail_sampling" in config["service"]["pipelines"]["traces"]["processors"]
    for name, env in axon_envs(eks_manifests).items():
        assert env["AXON_TRACE_SAMPLE_RATIO"] == "1", f"{name}: the collector would not see every error"
        assert urlsplit(env["AXON_OTLP_ENDPOINT"]).hostname == COLLECTOR


def test_service_monitor_asks_for_openmetrics_first(eks_manifests: list[dict]) -> None:
    (monitor,) = of_kind(eks_manifests, "ServiceMonitor")
    assert monitor["spec"]["scrapeProtocols"][0] == "OpenMetricsText1.0.0"


# --- EKS: Fluent Bit to OpenSearch, Grafana's links ------------------------------------------------------


@pytest.fixture(scope="module")
def fluent_bit() -> dict:
    return yaml.safe_load((EKS / "fluent-bit-opensearch.yaml").read_text())


@pytest.fixture(scope="module")
def grafana_values() -> dict:
    text = (EKS / "grafana-values.yaml").read_text()
    # Grafana expands $VAR in provisioning files; $$ is a literal `$`.
    return yaml.safe_load(text.replace("$$", "$"))


def test_fluent_bit_ships_the_axon_namespace_to_opensearch_with_irsa(fluent_bit: dict) -> None:
    assert fluent_bit["serviceAccount"]["annotations"]["eks.amazonaws.com/role-arn"].startswith("arn:aws:iam::")
    assert "_axon_" in fluent_bit["input"]["path"], "only the namespace the chart is installed in"
    opensearch = fluent_bit["opensearch"]
    assert opensearch["enabled"] is True and opensearch["awsAuth"] == "On" and opensearch["tls"] == "On"
    assert opensearch["host"].endswith(".es.amazonaws.com")
    assert opensearch["match"] == fluent_bit["filter"]["match"]
    for output in ("cloudWatch", "cloudWatchLogs", "firehose", "kinesis", "elasticsearch"):
        assert fluent_bit[output]["enabled"] is False, output
    assert fluent_bit["filter"]["mergeLog"] == "On"


def test_eks_grafana_links_exemplars_traces_and_logs(fluent_bit: dict, grafana_values: dict) -> None:
    grafana = grafana_values["grafana"]
    sources = {s["uid"]: s for s in grafana["additionalDataSources"]}
    exemplars = grafana["sidecar"]["datasources"]["exemplarTraceIdDestinations"]
    assert exemplars["traceIdLabelName"] == "trace_id"
    tempo = sources[exemplars["datasourceUid"]]
    assert tempo["type"] == "tempo"
    field = f"{fluent_bit['filter']['mergeLogKey']}.trace_id"
    logs = tempo["jsonData"]["tracesToLogsV2"]
    opensearch = sources[logs["datasourceUid"]]
    assert opensearch["type"] == "grafana-opensearch-datasource"
    assert opensearch["type"] in grafana["plugins"]
    assert f'{field}:"${{__trace.traceId}}"' == logs["query"]
    (link,) = opensearch["jsonData"]["dataLinks"]
    assert (link["field"], link["datasourceUid"], link["url"]) == (field, tempo["uid"], "${__value.raw}")
    assert opensearch["jsonData"]["database"] == f"{fluent_bit['opensearch']['logstashPrefix']}-*"
    assert urlsplit(opensearch["url"]).hostname == fluent_bit["opensearch"]["host"]
    assert opensearch["jsonData"]["sigV4Region"] == fluent_bit["opensearch"]["awsRegion"]
    assert "exemplar-storage" in grafana_values["prometheus"]["prometheusSpec"]["enableFeatures"]


def test_eks_collector_sends_to_the_tempo_grafana_reads(eks_manifests: list[dict], grafana_values: dict) -> None:
    config = collector_config(eks_manifests)
    endpoint = config["exporters"]["otlp"]["endpoint"]
    (tempo,) = [s for s in grafana_values["grafana"]["additionalDataSources"] if s["type"] == "tempo"]
    # tempo-distributed: the distributor takes spans, the query frontend answers Grafana.
    distributor, _, namespace_port = endpoint.partition(".")
    frontend = urlsplit(tempo["url"]).hostname
    assert distributor.removesuffix("-distributor") == frontend.split(".")[0].removesuffix("-query-frontend")
    assert namespace_port.split(":")[0] == frontend.split(".", 1)[1]
