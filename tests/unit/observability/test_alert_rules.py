"""helm/axon/alerts/axon-alerts.yml: one rules file that docker-compose's Prometheus loads and the
Helm chart's PrometheusRule is built from, so the two can never say different things."""

import fnmatch
import re
from pathlib import Path

import yaml

from tests.deploy.support import CHART, COMPOSE_FILE, ROOT, helm, load_manifests
from tests.metric_names import ALERT_RULES, alert_rules, metric_jobs, metric_names

REQUIRED_ALERTS = {
    "AxonNoLiveWorker",
    "AxonQueueDepthGrowing",
    "AxonTimeToFirstTokenP95High",
    "AxonGatewayHigh5xxRatio",
    "AxonOutboxLagHigh",
    "AxonRateLimiterFailingOpen",
}
# Alert -> the values.yaml key (monitoring.prometheusRule.*) the chart takes its threshold from.
CHART_THRESHOLDS = {
    "AxonGatewayHigh5xxRatio": "gatewayErrorRatio",
    "AxonTimeToFirstTokenP95High": "ttftP95Seconds",
    "AxonWorkersSaturated": "workerSaturation",
}
NAMESPACE = "axon-observability"


def test_rules_are_complete_and_well_formed() -> None:
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    assert REQUIRED_ALERTS <= set(names)
    for rule in rules:
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        assert rule["expr"].count("(") == rule["expr"].count(")"), rule["alert"]


def test_every_selector_names_its_scrape_job() -> None:
    """The chart scopes rules to its namespace next to each job matcher: one missing would watch every namespace."""
    for rule in alert_rules():
        selected = {metric for metric, _job in metric_jobs(rule["expr"])}
        assert metric_names(rule["expr"]) <= selected, f"{rule['alert']}: a selector without job=..."
        assert {job for _metric, job in metric_jobs(rule["expr"])} <= {"gateway", "sessions", "worker"}


def test_chart_thresholds_are_the_numbers_the_file_ends_with() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())["monitoring"]["prometheusRule"]
    by_name = {r["alert"]: r for r in alert_rules()}
    for alert, key in CHART_THRESHOLDS.items():
        threshold = re.search(r">\s*([0-9.]+)\s*$", by_name[alert]["expr"])
        assert threshold, f"{alert} must end with '> <number>' for the chart to override it"
        assert float(threshold.group(1)) == float(values[key]), f"{alert}: file and values.yaml ({key}) differ"


def _rendered_rules(tmp_path: Path, *extra: str) -> list[dict]:
    result = helm(
        "template",
        "axon",
        str(CHART),
        "--namespace",
        NAMESPACE,
        "-f",
        str(CHART / "values-eks.yaml"),
        *extra,
        tmp_home=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    (rule,) = [m for m in load_manifests(result.stdout) if m["kind"] == "PrometheusRule"]
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def test_prometheus_rule_is_the_file_scoped_to_the_release_namespace(tmp_path: Path) -> None:
    rendered = _rendered_rules(tmp_path)
    source = alert_rules()
    assert [r["alert"] for r in rendered] == [r["alert"] for r in source]
    for got, want in zip(rendered, source, strict=True):
        scoped = re.sub(r'job="(\w+)"', rf'job="\1", namespace="{NAMESPACE}"', want["expr"].strip())
        assert got["expr"] == scoped
        assert {k: v for k, v in got.items() if k != "expr"} == {k: v for k, v in want.items() if k != "expr"}


def test_prometheus_rule_takes_thresholds_from_values(tmp_path: Path) -> None:
    overrides = {"AxonGatewayHigh5xxRatio": 0.2, "AxonTimeToFirstTokenP95High": 3.5, "AxonWorkersSaturated": 0.8}
    args = [
        arg
        for alert, value in overrides.items()
        for arg in ("--set-json", f"monitoring.prometheusRule.{CHART_THRESHOLDS[alert]}={value}")
    ]
    rendered = {r["alert"]: r["expr"] for r in _rendered_rules(tmp_path, *args)}
    for alert, value in overrides.items():
        assert rendered[alert].endswith(f"> {value}"), rendered[alert]


def test_compose_prometheus_loads_the_same_file() -> None:
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    mounts = dict(
        (v.split(":")[1], v.split(":")[0]) for v in compose["services"]["prometheus"]["volumes"] if v.startswith("./")
    )
    config_path = ROOT / mounts["/etc/prometheus/prometheus.yml"]
    patterns = yaml.safe_load(config_path.read_text())["rule_files"]
    loaded = [
        (ROOT / source).resolve()
        for target, source in mounts.items()
        if any(fnmatch.fnmatch(target, p) for p in patterns)
    ]
    assert loaded == [ALERT_RULES.resolve()], f"Prometheus in compose loads {loaded}"
