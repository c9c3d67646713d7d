"""benchmarks/fairness.py's figures: percentiles, the service gap between tenants, Jain's index, the
tokens counted off a stream, and the picture (well-formed SVG, one circle per request)."""

import math
import xml.dom.minidom
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import orjson
import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def fairness() -> Iterator[ModuleType]:
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(ROOT / "benchmarks"))  # the script imports harness.py beside it
        import fairness

        yield fairness


def test_percentiles_interpolate_between_ranks(fairness: ModuleType) -> None:
    values = [40.0, 10.0, 30.0, 20.0]
    assert fairness.percentile(values, 50) == 25.0
    assert fairness.percentile(values, 0) == 10.0
    assert fairness.percentile(values, 100) == 40.0
    assert fairness.percentile(values, 95) == pytest.approx(38.5)
    assert fairness.percentile([7.0], 95) == 7.0
    assert math.isnan(fairness.percentile([], 50))


def test_jain_index_is_one_when_equal_and_one_over_n_when_one_has_all(fairness: ModuleType) -> None:
    assert fairness.jain_index([5.0, 5.0, 5.0]) == pytest.approx(1.0)
    assert fairness.jain_index([9.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    assert fairness.jain_index([3.0, 1.0]) == pytest.approx(16 / 20)
    assert math.isnan(fairness.jain_index([0.0, 0.0]))


def test_the_service_gap_is_the_largest_difference_of_weighted_tokens(fairness: ModuleType) -> None:
    samples = [{"a": 0.0, "b": 0.0}, {"a": 30.0, "b": 4.0}, {"a": 60.0, "b": 30.0}, {"a": 90.0}]
    assert fairness.max_service_gap(samples, {"a": 1.0, "b": 1.0}) == 90.0
    # Weighted 3 : 1, a's 60 tokens are 20 of b's: b leads by 10, less than the last sample's 30.
    assert fairness.max_service_gap(samples, {"a": 3.0, "b": 1.0}) == 30.0
    assert fairness.max_service_gap(samples[:3], {"a": 3.0, "b": 1.0}) == 10.0
    assert fairness.max_service_gap([], {"a": 1.0, "b": 1.0}) == 0.0


def test_tokens_between_counts_the_window_only(fairness: ModuleType) -> None:
    arrivals = [(0.5, 1), (1.0, 2), (1.5, 3), (2.0, 4)]
    assert fairness.tokens_between(arrivals, 1.0, 2.0) == 5
    assert fairness.tokens_between(arrivals, 0.0, 10.0) == 10


def sse(*events: dict | str) -> bytes:
    return b"".join(b"data: " + (e.encode() if isinstance(e, str) else orjson.dumps(e)) + b"\n\n" for e in events)


def test_a_stream_counts_words_as_tokens_and_times_the_first(fairness: ModuleType) -> None:
    answer = fairness.Answer("quiet", sent_s=1.0)
    tally = fairness.Tally()
    counter = fairness.StreamCounter(answer, tally, epoch=100.0)
    raw = sse(
        {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"delta": {"content": "the"}}]},
        {"choices": [{"delta": {"content": " model a"}}]},
        {"choices": [], "usage": {"completion_tokens": 3}},
        "[DONE]",
    )
    counter.feed(raw[:50], 101.25)  # an event cut in two reads
    counter.feed(raw[50:], 101.5)
    assert answer.ttft_s == pytest.approx(0.5)
    assert (answer.tokens, answer.usage_tokens, answer.error) == (3, 3, None)
    assert tally.arrivals == [(1.5, 1), (1.5, 2)]  # seconds from the epoch
    assert tally.total == 3


def test_the_picture_is_svg_with_a_circle_per_request_in_each_panel(fairness: ModuleType) -> None:
    panels = {
        "fair share": {"noisy": [(0.1, 700.0), (0.2, 4800.0), (3.0, 5100.0)], "quiet": [(2.0, 25.0), (2.3, 31.0)]},
        "fifo": {"noisy": [(0.1, 650.0)], "quiet": [(2.0, 5064.0), (7.1, 4600.0), (12.0, 5200.0)]},
    }
    document = xml.dom.minidom.parseString(fairness.ttft_picture(panels, title="quiet & noisy <burst>"))
    svg = document.documentElement
    assert svg.tagName == "svg"
    groups = {g.getAttribute("data-name"): g for g in svg.getElementsByTagName("g")}
    assert set(groups) == {"fair share", "fifo"}
    for name, tenants in panels.items():
        circles = groups[name].getElementsByTagName("circle")
        for tenant, points in tenants.items():
            assert len([c for c in circles if c.getAttribute("class") == tenant]) == len(points)
    # Slower is higher up the picture: a smaller y.
    fifo_quiet = [c for c in groups["fifo"].getElementsByTagName("circle") if c.getAttribute("class") == "quiet"]
    fair_quiet = [c for c in groups["fair share"].getElementsByTagName("circle") if c.getAttribute("class") == "quiet"]
    assert float(fifo_quiet[0].getAttribute("cy")) < float(fair_quiet[0].getAttribute("cy"))
    assert "quiet &amp; noisy &lt;burst&gt;" in fairness.ttft_picture(panels, title="quiet & noisy <burst>")
