"""docker-compose.yml, Prometheus and Grafana provisioning, checked without a Docker engine.

The file is interpolated the way compose does (defaults of `${VAR:-default}`), validated against
the Compose specification by the compose-spec package (the Rust compose_spec parser, which
rejects unknown keys and wrong types), then checked for what `docker compose up` relies on:
start order, health checks, ports and settings that exist in the code.
"""

import json
import os
import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from compose_spec import PyOptions

from tests.deploy.support import (
    COMPOSE_FILE,
    DASHBOARDS,
    DOCKER_DIR,
    ROOT,
    axon_names_in_text,
    console_scripts,
    exported_metric_names,
    metric_names_in_promql,
    parse_dockerfile,
    setting_default,
    settings_env_names,
)

# Axon's own services and the port each serves /health, /ready and /metrics on.
AXON_PORTS = {
    "gateway": ("GatewaySettings", "gateway_port"),
    "sessions": ("SessionsSettings", "sessions_port"),
    "worker": ("WorkerSettings", "worker_port"),
    "worker-gpu": ("WorkerSettings", "worker_port"),
}

_VARIABLE = re.compile(r"\$(?:\$|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable substitution: $$, $VAR, ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}."""

    def replace(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1) or match.group(4)
        op, arg = match.group(2), match.group(3)
        value = env.get(name)
        if (op in (":-", ":?") and not value) or (op in ("-", "?") and value is None):
            if op.endswith("?"):
                raise KeyError(f"{name}: {arg}")
            return arg
        return value or ""

    return _VARIABLE.sub(replace, text)


@pytest.fixture(scope="module")
def raw_text() -> str:
    return COMPOSE_FILE.read_text()


@pytest.fixture(scope="module")
def compose(raw_text: str) -> dict:
    """The compose file as `docker compose config` would see it with an empty environment."""
    return yaml.safe_load(interpolate(raw_text, {}))


@pytest.fixture(scope="module")
def services(compose: dict) -> dict[str, dict]:
    return compose["services"]


def env_of(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def healthcheck_url(service: dict) -> str | None:
    test = " ".join(service.get("healthcheck", {}).get("test", []))
    found = re.search(r"https?://[^'\" ]+", test)
    return found.group(0) if found else None


# --- the file itself -------------------------------------------------------------------------------


def test_compose_file_follows_the_compose_specification(raw_text: str) -> None:
    for env in ({}, {"AXON_TENSOR_PARALLEL_SIZE": "4", "AXON_ADMIN_TOKEN": "x" * 32}):
        project = PyOptions(apply_merge=True).from_yaml(interpolate(raw_text, env))
        project.validate()  # every network, volume, config and secret a service uses is declared
        assert set(project.service_names()) >= {
            "redis",
            "rabbitmq",
            "postgres",
            "migrate",
            "gateway",
            "sessions",
            "worker",
            "worker-gpu",
            "prometheus",
            "grafana",
            "otel-collector",
            "tempo",
            "loki",
        }


def test_compose_spec_rejects_what_compose_would(raw_text: str) -> None:
    """The validator is strict enough to be worth running: a misspelt key fails."""
    broken = interpolate(raw_text, {}).replace("stop_grace_period: 45s", "stop_grace_perod: 45s", 1)
    with pytest.raises(ValueError):
        PyOptions(apply_merge=True).from_yaml(broken)


def test_depends_on_names_services_and_waits_for_the_right_condition(services: dict) -> None:
    for name, service in services.items():
        for dependency, spec in (service.get("depends_on") or {}).items():
            assert dependency in services, f"{name} depends on unknown {dependency}"
            target = services[dependency]
            one_shot = target.get("restart") == "no"
            expected = "service_completed_successfully" if one_shot else "service_healthy"
            assert spec["condition"] == expected, f"{name} -> {dependency}"
            assert "gpu" not in target.get("profiles", []) or "gpu" in service.get("profiles", []), (
                f"{name} would need the gpu profile"
            )


# Services whose image has no shell and no HTTP client to probe with: nothing may wait for them.
WITHOUT_HEALTHCHECK = {"otel-collector"}  # the collector's scratch image; its health_check extension serves :13133


def test_every_service_has_a_healthcheck(services: dict) -> None:
    for name, service in services.items():
        if name in WITHOUT_HEALTHCHECK:
            assert "healthcheck" not in service, f"{name} now has a healthcheck: drop it from WITHOUT_HEALTHCHECK"
            waiting = [n for n, s in services.items() if name in (s.get("depends_on") or {})]
            assert not waiting, f"{waiting} would wait for {name}, which never reports healthy"
            continue
        if service.get("restart") == "no":
            # One-shot jobs (migrate) have no health: dependents wait for them to exit 0 instead.
            dependents = [n for n, s in services.items() if name in (s.get("depends_on") or {})]
            assert dependents, f"one-shot {name} is not waited for"
            continue
        check = service.get("healthcheck")
        assert check and check.get("test") and not check.get("disable"), f"{name} has no healthcheck"
        assert check["test"][0] in ("CMD", "CMD-SHELL"), name


def test_bind_mounts_and_builds_exist(services: dict) -> None:
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0] if isinstance(volume, str) else volume.get("source", "")
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"
        if "build" in service:
            build = service["build"]
            dockerfile = ROOT / build.get("context", ".") / build["dockerfile"]
            assert dockerfile.is_file(), f"{name}: {dockerfile}"
            if "target" in build:
                _, stages = parse_dockerfile(dockerfile)
                assert build["target"] in {s.name for s in stages}, f"{name}: no stage {build['target']}"


# --- drift against the code ------------------------------------------------------------------------


def test_every_axon_variable_in_compose_is_a_setting(raw_text: str, services: dict) -> None:
    known = settings_env_names()
    used = axon_names_in_text(raw_text)
    for service in services.values():
        used |= {k for k in env_of(service) if k.startswith("AXON_")}
    unknown = sorted(used - set(known))
    assert not unknown, f"AXON_* variables no settings class reads: {unknown}"


def test_commands_are_console_scripts(services: dict) -> None:
    scripts = console_scripts()
    for name, service in services.items():
        if "build" in service:
            command = service["command"]
            assert command[0] in scripts, f"{name}: {command}"


@pytest.mark.parametrize("name", sorted(AXON_PORTS))
def test_ports_match_the_settings(services: dict, name: str) -> None:
    service = services[name]
    default = setting_default(*AXON_PORTS[name])
    env = env_of(service)
    port_var = {"GatewaySettings": "AXON_GATEWAY_PORT", "SessionsSettings": "AXON_SESSIONS_PORT"}.get(
        AXON_PORTS[name][0], "AXON_WORKER_PORT"
    )
    assert int(env.get(port_var, default)) == default
    assert urlsplit(healthcheck_url(service)).port == default
    assert urlsplit(healthcheck_url(service)).path == "/ready"
    published = [str(p).rsplit(":", 1)[-1] for p in service.get("ports", [])] + [
        str(p) for p in service.get("expose", [])
    ]
    assert str(default) in published, f"{name} does not expose {default}"


def test_gateway_reaches_the_session_manager(services: dict) -> None:
    url = urlsplit(env_of(services["gateway"])["AXON_SESSIONS_URL"])
    assert url.hostname == "sessions"
    assert url.port == setting_default("SessionsSettings", "sessions_port")


def test_every_axon_process_reaches_the_compose_dependencies(services: dict) -> None:
    for name in ("migrate", "gateway", "sessions", "worker", "worker-gpu"):
        env = env_of(services[name])
        assert urlsplit(env["AXON_REDIS_URL"]).hostname == "redis"
        assert urlsplit(env["AXON_AMQP_URL"]).hostname == "rabbitmq"
        assert urlsplit(env["AXON_DATABASE_URL"]).hostname == "postgres"
        assert env["AXON_NAMESPACE"] == env_of(services["gateway"])["AXON_NAMESPACE"]


def test_migrations_run_once_before_the_services(services: dict) -> None:
    migrate = services["migrate"]
    assert migrate["command"] == ["axon", "migrate"]
    assert migrate["restart"] == "no"
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("gateway", "sessions"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"


@pytest.mark.parametrize("config_file", ["prometheus.yml", "prometheus-tls.yml"])
def test_prometheus_scrapes_every_axon_service_with_the_internal_token(
    compose: dict, services: dict, config_file: str
) -> None:
    """No Axon service's /metrics is open (the gateway's is on the published port): Prometheus
    sends the internal token, from a file holding the very token the services get."""
    for name in ("gateway", "sessions", "worker"):
        assert "AXON_METRICS_PUBLIC" not in env_of(services[name]), name
    (mounted,) = services["prometheus"]["configs"]
    token = compose["configs"][mounted["source"]]["content"]
    assert token == env_of(services["gateway"])["AXON_INTERNAL_TOKEN"]
    config = yaml.safe_load((ROOT / "infra" / "prometheus" / config_file).read_text())
    for job in config["scrape_configs"]:
        if job["job_name"] in ("gateway", "sessions", "worker"):
            assert job["authorization"] == {"credentials_file": mounted["target"]}, job["job_name"]


def test_admin_token_is_a_marked_development_value(services: dict) -> None:
    token = env_of(services["gateway"])["AXON_ADMIN_TOKEN"]
    assert "NOT-FOR-PRODUCTION" in token.upper()
    from services.gateway.settings import GatewaySettings

    settings = GatewaySettings(admin_token=token)
    problem = getattr(settings, "admin_token_problem", lambda: None)()
    assert problem is None, f"the gateway would refuse to start: {problem}"


def test_internal_token_is_a_marked_development_value_every_service_accepts(services: dict) -> None:
    from services.sessions.settings import SessionsSettings

    for name in ("gateway", "sessions", "worker"):
        token = env_of(services[name])["AXON_INTERNAL_TOKEN"]
        assert "NOT-FOR-PRODUCTION" in token.upper()
        assert SessionsSettings(internal_token=token).internal_token_problem() is None, name


# --- infrastructure services ---------------------------------------------------------------------------


def test_redis_keeps_an_append_only_file_on_a_volume(services: dict) -> None:
    redis = services["redis"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert any(v.endswith(":/data") for v in redis["volumes"])


def test_rabbitmq_has_the_management_ui(services: dict) -> None:
    assert "management" in services["rabbitmq"]["image"]


def test_postgres_keeps_its_data_on_a_volume(compose: dict, services: dict) -> None:
    volume = [v for v in services["postgres"]["volumes"] if v.endswith(":/var/lib/postgresql/data")]
    assert volume and volume[0].split(":")[0] in compose["volumes"]
    url = urlsplit(env_of(services["gateway"])["AXON_DATABASE_URL"])
    assert url.password == services["postgres"]["environment"]["POSTGRES_PASSWORD"]


def test_workers_feed_the_prefix_index_without_a_port_of_its_own(services: dict) -> None:
    assert env_of(services["sessions"])["AXON_PREFIX_ROUTING"] == "true"
    for name in ("worker", "worker-gpu"):
        assert env_of(services[name])["AXON_PREFIX_INDEX"] == "true"
        # vLLM's KV-cache events go over ipc:// sockets in the container's /tmp: only /health's port.
        assert services[name]["expose"] == ["8002"] and "ports" not in services[name]
        assert "/tmp" in services[name]["tmpfs"]


def test_cpu_worker_is_default_and_gpu_worker_needs_its_profile(services: dict) -> None:
    assert not services["worker"].get("profiles")
    assert "AXON_ENGINE" not in env_of(services["worker"])  # vLLM where the image has it, else transformers
    assert services["worker-gpu"]["profiles"] == ["gpu"]
    assert env_of(services["worker-gpu"])["AXON_ENGINE"] == "vllm"


@pytest.mark.parametrize("tp", ["1", "4"])
def test_gpu_worker_reserves_one_gpu_per_tensor_parallel_rank(raw_text: str, tp: str) -> None:
    services = yaml.safe_load(interpolate(raw_text, {"AXON_TENSOR_PARALLEL_SIZE": tp}))["services"]
    gpu = services["worker-gpu"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert str(device["count"]) == env_of(gpu)["AXON_TENSOR_PARALLEL_SIZE"] == tp
    assert gpu.get("shm_size") or gpu.get("ipc") == "host", "NCCL needs shared memory"


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"([0-9.]+)(ms|s|m|h)", duration))


@pytest.mark.parametrize("name", ["worker", "worker-gpu"])
def test_worker_stop_grace_outlasts_the_drain(services: dict, name: str) -> None:
    service = services[name]
    drain = float(env_of(service).get("AXON_DRAIN_TIMEOUT_S", setting_default("WorkerSettings", "drain_timeout_s")))
    assert _seconds(service["stop_grace_period"]) > drain + 5


def test_axon_containers_are_hardened_like_the_chart(services: dict) -> None:
    for name, service in services.items():
        if "build" not in service:
            continue
        assert service.get("read_only") is True, name
        assert service.get("cap_drop") == ["ALL"], name
        assert "/tmp" in service.get("tmpfs", []), name
        assert "user" not in service, f"{name}: the image's non-root user applies"


# --- Prometheus and Grafana -------------------------------------------------------------------------------


def test_prometheus_scrapes_every_axon_service(services: dict) -> None:
    mount = [v for v in services["prometheus"]["volumes"] if v.endswith(":/etc/prometheus/prometheus.yml:ro")]
    assert mount
    config = yaml.safe_load((ROOT / mount[0].split(":")[0]).read_text())
    scraped: dict[str, int] = {}
    for job in config["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            for host in sd["names"]:
                scraped[host] = sd["port"]
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, _, port = target.rpartition(":")
                scraped[host] = int(port)
    for name, (cls, field) in AXON_PORTS.items():
        assert scraped.get(name) == setting_default(cls, field), f"Prometheus does not scrape {name}"
    for host in scraped:
        assert host in services or host in ("127.0.0.1", "localhost"), f"Prometheus scrapes unknown {host}"


def test_grafana_provisions_the_datasource_and_the_chart_dashboards(services: dict) -> None:
    grafana = services["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"] if v.startswith(".")}
    provisioning = ROOT / mounts["/etc/grafana/provisioning"]
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert datasource["type"] == "prometheus"
    assert urlsplit(datasource["url"]).hostname == "prometheus"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "axon.yml").read_text())["providers"]
    dashboards_path = provider["options"]["path"]
    assert (ROOT / mounts[dashboards_path]).resolve() == DASHBOARDS.resolve(), (
        "compose must mount the chart's dashboards directory: one copy of each dashboard"
    )


def test_there_is_one_copy_of_each_dashboard() -> None:
    names = [p.name for p in DASHBOARDS.glob("*.json")]
    assert names
    elsewhere = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in (".git", ".venv", "node_modules", "__pycache__")]
        if Path(dirpath).resolve() != DASHBOARDS.resolve():
            elsewhere += [Path(dirpath, f) for f in filenames if f in names]
    assert not elsewhere, f"copies of chart dashboards: {elsewhere}"


@pytest.mark.parametrize("path", sorted(DASHBOARDS.glob("*.json")), ids=lambda p: p.name)
def test_dashboards_query_metrics_the_code_exports(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["panels"]
    exported = exported_metric_names() | {"up"}
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", []) if "expr" in t]
    templating = json.dumps(dashboard.get("templating", {}))
    assert exprs
    for expr in [*exprs, templating]:
        missing = metric_names_in_promql(expr) - exported
        assert not missing, f"{path.name} queries metrics the code does not export: {missing}"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_dockerfiles_referenced_by_compose_exist() -> None:
    assert (DOCKER_DIR / "Dockerfile").is_file() and (DOCKER_DIR / "Dockerfile.worker-gpu").is_file()
    assert os.path.isfile(ROOT / ".dockerignore")


# --- docker-compose.tls.yml: HTTPS served by the gateway itself ----------------------------------------

TLS_OVERRIDE = ROOT / "docker-compose.tls.yml"
TLS_ENV = {"TLS_DIR": "/srv/axon-tls"}


def merge_override(base: dict, override: dict) -> dict:
    """`docker compose -f base -f override` for what the override uses: mappings merge key by key,
    volumes by their target path, and a healthcheck's test (like any other list) is replaced."""
    merged = dict(base)
    for key, value in override.items():
        if key == "volumes" and isinstance(value, list):
            targets = {str(v).split(":")[1]: v for v in merged.get(key, [])}
            targets.update({str(v).split(":")[1]: v for v in value})
            merged[key] = list(targets.values())
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_override(merged[key], value)
        else:
            merged[key] = value
    return merged


@pytest.fixture(scope="module")
def tls_services(raw_text: str) -> dict[str, dict]:
    base = yaml.safe_load(interpolate(raw_text, TLS_ENV))
    override = yaml.safe_load(interpolate(TLS_OVERRIDE.read_text(), TLS_ENV))
    merged = merge_override(base, override)
    assert set(override["services"]) <= set(base["services"]), "the override adds no service"
    PyOptions(apply_merge=True).from_yaml(yaml.safe_dump(merged)).validate()
    return merged["services"]


def test_tls_override_needs_the_folder_of_the_certificate() -> None:
    with pytest.raises(KeyError, match="TLS_DIR"):
        interpolate(TLS_OVERRIDE.read_text(), {})


def test_tls_override_gives_the_gateway_its_certificate_and_key_read_only(tls_services: dict) -> None:
    gateway = tls_services["gateway"]
    env = env_of(gateway)
    assert {"AXON_TLS_CERTFILE", "AXON_TLS_KEYFILE"} <= set(settings_env_names())
    (mount,) = [v for v in gateway["volumes"] if v.startswith(TLS_ENV["TLS_DIR"] + ":")]
    _, target, mode = mount.split(":")
    assert mode == "ro"
    assert env["AXON_TLS_CERTFILE"] == f"{target}/cert.pem" and env["AXON_TLS_KEYFILE"] == f"{target}/key.pem"
    # Everything else the gateway had is still there.
    assert env["AXON_SESSIONS_URL"] == "http://sessions:8001" and env["AXON_ADMIN_TOKEN"]


def test_tls_override_probes_the_gateway_over_https(tls_services: dict) -> None:
    url = urlsplit(healthcheck_url(tls_services["gateway"]))
    assert (url.scheme, url.port, url.path) == ("https", setting_default("GatewaySettings", "gateway_port"), "/ready")


def test_tls_prometheus_config_differs_only_in_scraping_the_gateway_over_https(tls_services: dict) -> None:
    mount = [v for v in tls_services["prometheus"]["volumes"] if v.endswith(":/etc/prometheus/prometheus.yml:ro")]
    assert len(mount) == 1
    tls_config = yaml.safe_load((ROOT / mount[0].split(":")[0]).read_text())
    plain = yaml.safe_load((ROOT / "infra" / "prometheus" / "prometheus.yml").read_text())
    tls_jobs = {job["job_name"]: job for job in tls_config.pop("scrape_configs")}
    plain_jobs = {job["job_name"]: job for job in plain.pop("scrape_configs")}
    assert tls_config == plain and tls_jobs.keys() == plain_jobs.keys()
    gateway = tls_jobs.pop("gateway")
    assert gateway.pop("scheme") == "https" and gateway.pop("tls_config") == {"insecure_skip_verify": True}
    assert gateway == plain_jobs.pop("gateway") and tls_jobs == plain_jobs
