"""HTTP metrics' labels take no value a client chooses freely (`shared/metrics.py`)."""

from prometheus_client import CollectorRegistry

from shared.metrics import HttpMetrics


def test_a_method_outside_http_s_own_is_labelled_other() -> None:
    registry = CollectorRegistry()
    metrics = HttpMetrics(registry)
    for method in ("GET", "POST", "BREW", "X" * 300, "get"):
        metrics.observe({"type": "http", "method": method}, 404, 0.01)
    samples = [sample for family in registry.collect() for sample in family.samples]
    labelled = {sample.labels["method"] for sample in samples if "method" in sample.labels}
    assert labelled == {"GET", "POST", "other"}
