"""The compose side of traces and logs, checked without a Docker engine: the OpenTelemetry
Collector's configuration, Tempo, Loki, Grafana's data sources and their links, Prometheus'
exemplars and the dashboards' latency panels.

No collector, Tempo or Loki binary is run: each configuration is parsed and checked for what
the others rely on (ports, hosts, pipelines, paths on volumes, uids), so a change on one side
that the other does not follow fails here.
"""

import json
import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from tests.deploy.support import COMPOSE_FILE, DASHBOARDS, ROOT, settings_env_names
from tests.deploy.test_compose import env_of, interpolate

PROVISIONING = ROOT / "infra" / "grafana" / "provisioning" / "datasources"
AXON_SERVICES = ("migrate", "gateway", "sessions", "worker", "worker-gpu")

# The latency histograms observed with an exemplar (the trace of the request being measured); a
# panel over any of them shows them. The inter-chunk latency has none: a chunk is not a request.
LATENCY_HISTOGRAMS = (
    "axon_http_request_duration_seconds",
    "axon_sessions_time_to_first_token_seconds",
    "axon_worker_time_to_first_token_seconds",
    "axon_worker_job_duration_seconds",
)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(interpolate(COMPOSE_FILE.read_text(), {}))


@pytest.fixture(scope="module")
def services(compose: dict) -> dict[str, dict]:
    return compose["services"]


def mounted(service: dict, target: str) -> Path:
    """The repository file a service mounts at `target`."""
    (source,) = [v.split(":")[0] for v in service["volumes"] if v.split(":")[1] == target]
    assert source.startswith("./"), f"{target} is not a file of the repository"
    return ROOT / source


def volume_for(service: dict, path: str) -> str:
    """The named volume a path in the container lives on."""
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if not source.startswith(("/", ".")) and (path == target or path.startswith(target.rstrip("/") + "/")):
            return source
    raise AssertionError(f"{path} is on no named volume")


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def collector(services: dict) -> dict:
    return yaml.safe_load(mounted(services["otel-collector"], "/etc/otelcol/config.yaml").read_text())


@pytest.fixture(scope="module")
def tempo(services: dict) -> dict:
    return yaml.safe_load(mounted(services["tempo"], "/etc/tempo/tempo.yaml").read_text())


@pytest.fixture(scope="module")
def loki(services: dict) -> dict:
    return yaml.safe_load(mounted(services["loki"], "/etc/loki/loki.yaml").read_text())


def grafana_expand(text: str) -> str:
    """Grafana expands $VAR and ${VAR} in provisioning files from its environment; $$ is a `$`.
    The data sources use no variable: every `$` must be escaped."""
    unescaped = re.findall(r"(?<!\$)\$(?!\$)\{?[A-Za-z_]", text.replace("$$", ""))
    assert not unescaped, f"Grafana would expand {unescaped} from its environment"
    return text.replace("$$", "$")


@pytest.fixture(scope="module")
def datasources() -> dict[str, dict]:
    found: dict[str, dict] = {}
    for path in sorted(PROVISIONING.glob("*.yml")):
        for source in yaml.safe_load(grafana_expand(path.read_text()))["datasources"]:
            assert source["uid"] not in found, f"two data sources with uid {source['uid']}"
            found[source["uid"]] = source
    return found


def by_type(datasources: dict[str, dict], kind: str) -> dict:
    (source,) = [s for s in datasources.values() if s["type"] == kind]
    return source


# --- the processes send to the collector --------------------------------------------------------


def test_every_axon_process_sends_its_spans_to_the_collector(services: dict, collector: dict) -> None:
    assert {"AXON_OTLP_ENDPOINT", "AXON_TRACE_SAMPLE_RATIO"} <= set(settings_env_names())
    http = collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    for name in AXON_SERVICES:
        env = env_of(services[name])
        url = urlsplit(env["AXON_OTLP_ENDPOINT"])
        assert (url.scheme, url.hostname, url.port) == ("http", "otel-collector", port_of(http)), name
        assert url.path in ("", "/"), "a base URL: the exporter adds /v1/traces"
        # Tail sampling needs every trace: head sampling would drop errors before the collector.
        assert float(env["AXON_TRACE_SAMPLE_RATIO"]) == 1.0, name
    exposed = {str(p) for p in services["otel-collector"]["expose"]}
    grpc = collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    assert {str(port_of(http)), str(port_of(grpc))} <= exposed


def test_nothing_waits_for_the_collector(services: dict) -> None:
    """An unreachable collector costs no request anything: no service depends on it."""
    for name, service in services.items():
        assert "otel-collector" not in (service.get("depends_on") or {}), name


# --- the collector ----------------------------------------------------------------------------------


def test_collector_pipelines_use_only_defined_components(collector: dict) -> None:
    pipelines = collector["service"]["pipelines"]
    assert set(pipelines) == {"traces", "logs"}
    for kind in ("receivers", "processors", "exporters"):
        defined = set(collector[kind])
        used = {c for p in pipelines.values() for c in p.get(kind, [])}
        assert used <= defined, f"{kind} used but not defined: {used - defined}"
        assert defined <= used, f"{kind} defined but unused: {defined - used}"
    assert set(collector["service"]["extensions"]) == set(collector["extensions"])
    for name, pipeline in pipelines.items():
        processors = pipeline["processors"]
        assert processors[0] == "memory_limiter", f"{name}: the memory limiter must come first"
        assert processors[-1] == "batch", f"{name}: batch last"


def test_collector_keeps_errors_and_slow_traces(collector: dict) -> None:
    traces = collector["service"]["pipelines"]["traces"]
    assert "tail_sampling" in traces["processors"]
    sampling = collector["processors"]["tail_sampling"]
    policies = {p["type"]: p for p in sampling["policies"]}
    assert policies["status_code"]["status_code"]["status_codes"] == ["ERROR"]
    assert policies["latency"]["latency"]["threshold_ms"] > 0
    baseline = policies["probabilistic"]["probabilistic"]["sampling_percentage"]
    assert 0 < baseline < 100, "a baseline of 100 % would make the policy keep everything"
    # Later spans of a kept trace (a long stream's relay) follow the decision.
    assert sampling["decision_cache"]["sampled_cache_size"] > 0
    assert re.fullmatch(r"[0-9]+s", sampling["decision_wait"])


def test_collector_sends_traces_to_tempo(collector: dict, tempo: dict, services: dict) -> None:
    (exporter,) = collector["service"]["pipelines"]["traces"]["exporters"]
    config = collector["exporters"][exporter]
    assert exporter.split("/")[0] == "otlp", "Tempo takes OTLP gRPC"
    host, _, port = config["endpoint"].rpartition(":")
    assert host == "tempo" and "tempo" in services
    assert int(port) == port_of(tempo["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"])
    assert port in {str(p) for p in services["tempo"]["expose"]}
    assert config["tls"]["insecure"] is True, "Tempo listens without TLS on compose's network"


def test_collector_sends_logs_to_lokis_otlp_endpoint(collector: dict, loki: dict, services: dict) -> None:
    logs = collector["service"]["pipelines"]["logs"]
    assert "filelog/docker" in logs["receivers"]
    (exporter,) = logs["exporters"]
    assert exporter.split("/")[0] == "otlphttp"
    url = urlsplit(collector["exporters"][exporter]["endpoint"])
    assert (url.hostname, url.port, url.path) == ("loki", loki["server"]["http_listen_port"], "/otlp")
    assert str(url.port) in {str(p) for p in services["loki"]["expose"]}


def test_collector_reads_this_projects_docker_logs(compose: dict, services: dict, collector: dict) -> None:
    service = services["otel-collector"]
    receiver = collector["receivers"]["filelog/docker"]
    (pattern,) = receiver["include"]
    assert "/var/lib/docker/containers:/var/lib/docker/containers:ro" in service["volumes"]
    assert pattern.startswith("/var/lib/docker/containers/") and pattern.endswith("-json.log")
    # Offsets survive a restart: the storage extension's directory is on a volume.
    assert receiver["storage"] == "file_storage"
    assert volume_for(service, collector["extensions"]["file_storage"]["directory"]) in compose["volumes"]
    assert receiver["start_at"] == "end"
    operators = {op.get("id", op["type"]): op for op in receiver["operators"]}
    # Lines of other projects on the same engine are dropped: the filter names this project.
    assert f'"{compose["name"]}"' in operators["other_projects"]["expr"]
    assert "com.docker.compose.project" in operators["other_projects"]["expr"]
    # Every service's json-file log carries the labels the filter and the service name come from.
    for name, svc in services.items():
        logging = svc.get("logging", {})
        assert logging.get("driver") == "json-file", name
        labels = set(logging["options"]["labels"].split(","))
        assert {"com.docker.compose.project", "com.docker.compose.service"} <= labels, name


def test_collector_gives_an_axon_line_its_trace_context(collector: dict) -> None:
    operators = {op.get("id", op["type"]): op for op in collector["receivers"]["filelog/docker"]["operators"]}
    axon = operators["axon"]
    assert axon["type"] == "json_parser" and axon["parse_from"] == "body"
    assert axon["on_error"] == "send_quiet", "a line that is not JSON is shipped as it came"
    target = axon["parse_to"]
    assert axon["trace"]["trace_id"]["parse_from"] == f"{target}.trace_id"
    assert axon["trace"]["span_id"]["parse_from"] == f"{target}.span_id"
    assert axon["severity"]["parse_from"] == f"{target}.level"
    # Every level structlog writes is a severity: the collector's default preset knows the
    # OpenTelemetry names (debug, info, warn, error, fatal), the mapping adds the others.
    preset = {"trace", "debug", "info", "warn", "error", "fatal"}
    mapped = {str(v) for v in axon["severity"]["mapping"].values()}
    assert {"debug", "info", "warning", "error", "critical"} <= preset | mapped
    moved = {
        op["to"]: op["from"] for op in collector["receivers"]["filelog/docker"]["operators"] if op["type"] == "move"
    }
    assert moved["body"] == "attributes.log", "the line Docker captured becomes the log body"
    assert moved['resource["service.name"]'] == 'attributes.attrs["com.docker.compose.service"]'


def split_field(field: str) -> list[str]:
    """The collector's field syntax (pkg/stanza's entry fields): dot-separated keys, or ["a.b"] for a
    key with dots in it; the first key is body, attributes or resource."""
    keys, rest = [], field
    while rest:
        if rest.startswith("["):
            quote = rest[1:2]
            assert quote in ("'", '"'), f"{field}: a bracketed key must be quoted"
            end = rest.find(quote + "]", 2)
            assert end > 0, f"{field}: unclosed bracket"
            keys.append(rest[2:end])
            rest = rest[end + 2 :]
            assert not rest or rest[0] in ".[", f"{field}: a bracketed key is followed by . or ["
            rest = rest.removeprefix(".")
        else:
            token = re.match(r"[^.\[]+", rest)
            assert token, f"{field}: empty key"
            keys.append(token.group(0))
            rest = rest[token.end() :].removeprefix(".")
    assert keys[0] in ("body", "attributes", "resource"), f"{field} names no part of a log record"
    return keys


def _fields(value: object) -> list[str]:
    """Every field an operator's configuration names (parse_from, parse_to, from, to, field)."""
    if isinstance(value, dict):
        found = [v for k, v in value.items() if k in ("parse_from", "parse_to", "from", "to", "field")]
        return found + [f for v in value.values() for f in _fields(v)]
    if isinstance(value, list):
        return [f for v in value for f in _fields(v)]
    return []


def test_collector_operators_name_valid_fields(collector: dict) -> None:
    operators = collector["receivers"]["filelog/docker"]["operators"]
    fields = _fields(operators)
    assert len(fields) >= 10
    for field in fields:
        split_field(field)
    assert split_field('attributes.attrs["com.docker.compose.service"]') == [
        "attributes",
        "attrs",
        "com.docker.compose.service",
    ]
    with pytest.raises(AssertionError):
        split_field("attributes.attrs[com.docker.compose.service]")
    ids = [op.get("id", op["type"]) for op in operators]
    assert len(ids) == len(set(ids)), "two operators with one id"


def test_collector_runs_hardened_and_restarts(services: dict) -> None:
    service = services["otel-collector"]
    assert service["read_only"] is True and service["cap_drop"] == ["ALL"]
    assert service["image"].startswith("otel/opentelemetry-collector-contrib:")


# --- Tempo and Loki ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["otel-collector", "tempo", "loki", "grafana", "prometheus"])
def test_images_are_pinned(services: dict, name: str) -> None:
    image = services[name]["image"]
    tag = image.rpartition(":")[2]
    assert re.fullmatch(r"v?[0-9]+\.[0-9]+\.[0-9]+", tag), f"{name}: {image} is not pinned to a release"


def test_tempo_keeps_traces_on_its_volume(compose: dict, services: dict, tempo: dict) -> None:
    service = services["tempo"]
    storage = tempo["storage"]["trace"]
    assert storage["backend"] == "local"
    for path in (storage["wal"]["path"], storage["local"]["path"]):
        assert volume_for(service, path) in compose["volumes"]
    assert urlsplit(" ".join(service["healthcheck"]["test"]).split()[-1]).port == tempo["server"]["http_listen_port"]
    assert tempo["compactor"]["compaction"]["block_retention"]


def test_loki_keeps_logs_with_structured_metadata(compose: dict, services: dict, loki: dict) -> None:
    service = services["loki"]
    (schema,) = loki["schema_config"]["configs"]
    # OTLP ingestion keeps trace_id and span_id as structured metadata: tsdb and schema v13 only.
    assert (schema["store"], schema["schema"]) == ("tsdb", "v13")
    assert loki["limits_config"]["allow_structured_metadata"] is True
    assert volume_for(service, loki["common"]["path_prefix"]) in compose["volumes"]
    for key in ("chunks_directory", "rules_directory"):
        assert loki["common"]["storage"]["filesystem"][key].startswith(loki["common"]["path_prefix"] + "/")
    assert loki["compactor"]["working_directory"].startswith(loki["common"]["path_prefix"] + "/")
    assert urlsplit(" ".join(service["healthcheck"]["test"]).split()[-1]).port == loki["server"]["http_listen_port"]


# --- Grafana ------------------------------------------------------------------------------------------


def test_grafana_has_prometheus_loki_and_tempo(datasources: dict, services: dict, tempo: dict, loki: dict) -> None:
    assert {s["type"] for s in datasources.values()} == {"prometheus", "loki", "tempo"}
    tempo_url = urlsplit(by_type(datasources, "tempo")["url"])
    assert (tempo_url.hostname, tempo_url.port) == ("tempo", tempo["server"]["http_listen_port"])
    loki_url = urlsplit(by_type(datasources, "loki")["url"])
    assert (loki_url.hostname, loki_url.port) == ("loki", loki["server"]["http_listen_port"])
    mounts = {v.split(":")[1]: v.split(":")[0] for v in services["grafana"]["volumes"] if v.startswith(".")}
    assert (ROOT / mounts["/etc/grafana/provisioning"] / "datasources").resolve() == PROVISIONING.resolve()


def test_every_link_between_data_sources_names_one_that_exists(datasources: dict) -> None:
    for uid, source in datasources.items():
        text = json.dumps(source.get("jsonData", {}))
        for target in re.findall(r'"datasourceUid": "([^"]+)"', text):
            assert target in datasources, f"{uid} links to unknown data source {target}"


def test_prometheus_exemplars_link_to_tempo(datasources: dict) -> None:
    prometheus = by_type(datasources, "prometheus")
    (destination,) = prometheus["jsonData"]["exemplarTraceIdDestinations"]
    assert destination["name"] == "trace_id", "the exemplar label the services put the trace id in"
    assert destination["datasourceUid"] == by_type(datasources, "tempo")["uid"]


TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.mark.parametrize(
    "line",
    [
        json.dumps({"event": "http_request", "request_id": "r1", "trace_id": TRACE_ID, "span_id": "00f067aa0ba902b7"}),
        json.dumps({"event": "job_started", "trace_id": TRACE_ID}, separators=(",", ":")),
    ],
    ids=["spaced", "compact"],
)
def test_loki_derives_the_trace_link_from_a_log_line(datasources: dict, line: str) -> None:
    loki = by_type(datasources, "loki")
    (field,) = loki["jsonData"]["derivedFields"]
    assert field["datasourceUid"] == by_type(datasources, "tempo")["uid"]
    assert field["matcherType"] == "regex"
    match = re.search(field["matcherRegex"], line)
    assert match and match.group(1) == TRACE_ID
    assert field["url"] == "${__value.raw}", "an internal link carries the trace id as the query"


def test_loki_derives_nothing_from_a_line_without_a_trace(datasources: dict) -> None:
    (field,) = by_type(datasources, "loki")["jsonData"]["derivedFields"]
    assert not re.search(field["matcherRegex"], json.dumps({"event": "startup", "request_id": TRACE_ID}))


def test_tempo_links_a_trace_to_its_log_lines(datasources: dict, collector: dict) -> None:
    tempo = by_type(datasources, "tempo")
    links = tempo["jsonData"]["tracesToLogsV2"]
    assert links["datasourceUid"] == by_type(datasources, "loki")["uid"]
    assert links["customQuery"] is True
    query = links["query"]
    assert "${__trace.traceId}" in query
    # The stream selector is the label the collector gives every Axon line.
    operators = collector["receivers"]["filelog/docker"]["operators"]
    (namespace,) = [op["value"] for op in operators if op["type"] == "add" and "service.namespace" in op["field"]]
    assert f'{{service_namespace="{namespace}"}}' in query
    # The lines of a request begin before its first span and end after its last.
    assert links["spanStartTimeShift"].startswith("-") and not links["spanEndTimeShift"].startswith("-")


# --- Prometheus and dashboards --------------------------------------------------------------------------


def test_prometheus_stores_exemplars_scraped_as_openmetrics(services: dict) -> None:
    prometheus = services["prometheus"]
    assert "--enable-feature=exemplar-storage" in prometheus["command"]
    for name in ("prometheus.yml", "prometheus-tls.yml"):
        config = yaml.safe_load((ROOT / "infra" / "prometheus" / name).read_text())
        protocols = config["global"]["scrape_protocols"]
        assert protocols[0] == "OpenMetricsText1.0.0", f"{name}: exemplars come only in OpenMetrics"


def _latency_targets(panel: dict) -> list[dict]:
    return [
        t
        for t in panel.get("targets", [])
        if "histogram_quantile" in t.get("expr", "")
        and any(f"{name}_bucket" in t["expr"] for name in LATENCY_HISTOGRAMS)
    ]


@pytest.mark.parametrize("path", sorted(DASHBOARDS.glob("*.json")), ids=lambda p: p.name)
def test_latency_panels_show_exemplars(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    for panel in dashboard["panels"]:
        targets = _latency_targets(panel)
        if not targets:
            continue
        assert panel["type"] == "timeseries", panel["title"]
        # One target per panel asks for them: the quantiles share the same buckets' exemplars.
        asking = [t for t in targets if t.get("exemplar") is True]
        assert len(asking) == 1, f"{path.name}: {panel['title']}"
        assert "exemplar" in panel["description"].lower(), f"{path.name}: {panel['title']} does not say so"


def test_some_panel_of_every_latency_histogram_shows_exemplars() -> None:
    shown = set()
    for path in DASHBOARDS.glob("*.json"):
        for panel in json.loads(path.read_text())["panels"]:
            for target in _latency_targets(panel):
                if target.get("exemplar"):
                    shown |= {name for name in LATENCY_HISTOGRAMS if f"{name}_bucket" in target["expr"]}
    assert shown == set(LATENCY_HISTOGRAMS)
