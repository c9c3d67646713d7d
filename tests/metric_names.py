"""Which metrics the dashboards and alert rules query, and which a `/metrics` scrape offers.

Shared by the end-to-end check that no panel or alert points at nothing
(tests/e2e/test_observability.py) and its unit tests (tests/unit/observability/).
"""

import json
import re
from collections.abc import Iterator
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = ROOT / "helm" / "axon" / "dashboards"
ALERT_RULES = ROOT / "helm" / "axon" / "alerts" / "axon-alerts.yml"

# Series Prometheus makes itself rather than scraping them.
SYNTHETIC_METRICS = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped", "ALERTS"})

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GRAFANA_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+")
_VARIABLE_MARK = "__grafana_variable__"
_LABEL_VALUES = re.compile(r"label_values\(\s*(?:([^,()]*?)\s*,)?\s*\w+\s*\)")
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
# An identifier that does not continue a number (0.95, 1e3, 5m) and is not a function call.
_IDENTIFIER = re.compile(r"(?<![\w.:])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()")
_KEYWORDS = frozenset(
    {
        "and",
        "or",
        "unless",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "offset",
        "bool",
        "inf",
        "nan",
        "atan2",
    }
)
_SELECTOR_WITH_JOB = re.compile(r'([A-Za-z_:][\w:]*)\s*\{[^{}]*\bjob\s*=\s*"([^"]+)"')
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression (or a Grafana `label_values(...)` query) selects.

    Strings, label matchers, ranges, grouping clauses, numbers, durations, function names and
    keywords are stripped; what is left are the selectors' metric names. A name built from a
    Grafana variable is left out (it is only known when the dashboard is shown).
    """
    text = _LABEL_VALUES.sub(lambda m: m.group(1) or "", expr)
    text = _GRAFANA_VARIABLE.sub(_VARIABLE_MARK, _STRING.sub('""', text))
    text = _RANGE.sub(" ", _MATCHERS.sub(" ", text))
    text = _GROUPING.sub(" ", text)
    return {name for name in _IDENTIFIER.findall(text) if name not in _KEYWORDS and _VARIABLE_MARK not in name}


def metric_jobs(expr: str) -> set[tuple[str, str]]:
    """(metric, job) for every selector that names its scrape job, e.g. `x{job="gateway"}`."""
    return set(_SELECTOR_WITH_JOB.findall(expr))


def _panels(panels: list[dict]) -> Iterator[dict]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # rows, collapsed or not


def dashboard_queries(path: Path) -> list[str]:
    """Every PromQL expression of a dashboard: panel targets (rows included) and variable queries."""
    dashboard = json.loads(path.read_text())
    queries = [t["expr"] for p in _panels(dashboard["panels"]) for t in p.get("targets", []) if t.get("expr")]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable.get("query")
            queries.append(query["query"] if isinstance(query, dict) else query)
    return queries


def alert_rules(path: Path = ALERT_RULES) -> list[dict]:
    return [rule for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]


def queried_metrics() -> dict[str, set[str]]:
    """Metric name -> where it is queried (dashboard files and alert names)."""
    found: dict[str, set[str]] = {}
    for path in sorted(DASHBOARDS.glob("*.json")):
        for expr in dashboard_queries(path):
            for name in metric_names(expr):
                found.setdefault(name, set()).add(path.name)
    for rule in alert_rules():
        for name in metric_names(rule["expr"]):
            found.setdefault(name, set()).add(rule["alert"])
    return found


def queried_metric_jobs() -> set[tuple[str, str]]:
    exprs = [e for p in sorted(DASHBOARDS.glob("*.json")) for e in dashboard_queries(p)]
    exprs += [r["expr"] for r in alert_rules()]
    return {pair for expr in exprs for pair in metric_jobs(expr)}


class Scrape:
    """One `/metrics` answer: the series names it declares and those it has samples for.

    A family declares the names PromQL selects it by: `x_total` for a counter `x`; `x_bucket`,
    `x_sum` and `x_count` (and `x`) for a histogram `x`.
    """

    def __init__(self, text: str) -> None:
        self.declared: set[str] = set()
        self.sampled: set[str] = set()
        self.samples: list = []
        for family in text_string_to_metric_families(text):
            if family.type == "counter":
                self.declared |= {f"{family.name}_total", f"{family.name}_created"}
            elif family.type in ("histogram", "summary"):
                self.declared |= {family.name, *(family.name + s for s in _HISTOGRAM_SUFFIXES)}
            else:
                self.declared.add(family.name)
            for sample in family.samples:
                self.sampled.add(sample.name)
                self.samples.append(sample)

    def value(self, name: str, **labels: str) -> float | None:
        """Sum of the samples of `name` whose labels include `labels`, or None if there is none."""
        values = [s.value for s in self.samples if s.name == name and labels.items() <= s.labels.items()]
        return sum(values) if values else None
