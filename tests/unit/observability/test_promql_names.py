"""tests/metric_names.py: metric names are read out of PromQL exactly, so the e2e check can trust them."""

import pytest

from tests.metric_names import Scrape, metric_jobs, metric_names


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("up", {"up"}),
        ('sum(up{job="worker"})', {"up"}),
        ('absent(up{job="gateway"} == 1)', {"up"}),
        (
            'sum by (status) (rate(axon_http_requests_total{job="gateway", route=~"/v1/.*"}[$__rate_interval]))',
            {"axon_http_requests_total"},
        ),
        (
            "histogram_quantile(0.95, sum by (le, model) (rate(axon_sessions_time_to_first_token_seconds_bucket"
            '{job="sessions", model=~"$model"}[10m]))) > 10',
            {"axon_sessions_time_to_first_token_seconds_bucket"},
        ),
        (
            "sum by (model) (axon_worker_running_sequences) / on (model) group_left sum by (model) "
            "(axon_worker_max_sequences) > 0.95",
            {"axon_worker_running_sequences", "axon_worker_max_sequences"},
        ),
        (
            "max by (model) (axon_sessions_queue_depth) > 10"
            " and max by (model) (deriv(axon_sessions_queue_depth[10m])) > 0",
            {"axon_sessions_queue_depth"},
        ),
        ("rate(x_total[5m] offset 1h) * 1e3 unless ignoring (instance) y", {"x_total", "y"}),
        ('sum without (instance) (z{route="/v1/{id}", a="b,c"})', {"z"}),  # braces and commas inside strings
        ("${metric_prefix}_total", set()),  # a Grafana variable is not a metric name
        ("label_values(axon_sessions_live_workers, model)", {"axon_sessions_live_workers"}),
        ('label_values(axon_worker_max_sequences{job="worker"}, model)', {"axon_worker_max_sequences"}),
        ("label_values(model)", set()),
    ],
)
def test_metric_names(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_metric_jobs_pairs_each_selector_with_its_scrape_job() -> None:
    expr = 'sum(rate(a_total{job="gateway", x="1"}[5m])) / sum(b{job="sessions"}) + c{model="m"}'
    assert metric_jobs(expr) == {("a_total", "gateway"), ("b", "sessions")}


def test_a_scrape_declares_the_names_promql_selects_families_by() -> None:
    text = """# HELP c_total A counter.
# TYPE c_total counter
c_total{kind="a"} 2.0
# HELP h_seconds A histogram.
# TYPE h_seconds histogram
h_seconds_bucket{le="1.0"} 1.0
h_seconds_bucket{le="+Inf"} 1.0
h_seconds_count 1.0
h_seconds_sum 0.5
# HELP g A gauge with no series yet.
# TYPE g gauge
"""
    scrape = Scrape(text)
    assert {"c_total", "h_seconds_bucket", "h_seconds_sum", "h_seconds_count", "g"} <= scrape.declared
    assert "g" not in scrape.sampled and "c_total" in scrape.sampled
    assert scrape.value("c_total", kind="a") == 2 and scrape.value("c_total", kind="b") is None
