"""benchmarks/ttft_steps.py: a request's path edges read from its trace's spans, and the steps
between them over several requests."""

import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[3]
SERVICE_SOURCES = {"axon-gateway": "gateway", "axon-sessions": "sessions", "axon-worker": "worker"}


@pytest.fixture(scope="module")
def steps() -> Iterator[ModuleType]:
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(ROOT / "benchmarks"))  # the script imports harness.py beside it
        import ttft_steps

        yield ttft_steps


def span(module: ModuleType, service: str, name: str, start_ms: float, end_ms: float, parent: str = "p") -> object:
    return module.ReceivedSpan(
        service=service,
        name=name,
        kind="internal",
        trace_id="t",
        span_id=f"{service}-{name}-{start_ms}",
        parent_id=parent,
        start_ns=int(1e12 + start_ms * 1e6),
        end_ns=int(1e12 + end_ms * 1e6),
        status="unset",
        links=[],
        attributes={},
    )


def request_trace(module: ModuleType, shift_ms: float = 0.0) -> list[object]:
    """One request's spans as the services send them, the engine's first token at 50 ms."""
    s = shift_ms
    return [
        span(module, "axon-worker", "publish", 60 + s, 61 + s),  # the final chunk's: not an edge
        span(module, "axon-gateway", "POST /v1/chat/completions", 0, 200, parent=""),
        span(module, "axon-gateway", "authenticate", 0.1, 0.3),
        span(module, "axon-gateway", "admission", 0.4, 0.9),
        span(module, "axon-gateway", "upstream", 1.0, 199),
        span(module, "axon-sessions", "POST /v1/chat/completions", 1.4, 199),
        span(module, "axon-sessions", "build job", 1.8, 1.9 + s),
        span(module, "axon-sessions", "publish", 2.0 + s, 4.5 + s),
        span(module, "axon-worker", "job", 3.5 + s, 190),
        span(module, "axon-worker", "prefill", 3.6 + s, 53.6 + s),
        span(module, "axon-sessions", "first chunk", 4.6 + s, 54.0 + s),
    ]


def test_a_whole_trace_gives_its_edges_in_order_from_the_gateways_span(steps: ModuleType) -> None:
    edges = steps.edges_of(request_trace(steps))
    assert edges == pytest.approx([0.3, 0.9, 1.4, 1.9, 2.0, 3.5, 3.6, 53.6, 54.0])
    assert len(edges) == len(steps.EDGES)


def test_a_trace_without_its_root_or_an_edge_is_left_out(steps: ModuleType) -> None:
    whole = request_trace(steps)
    assert steps.edges_of([s for s in whole if s.name != "first chunk"]) is None
    # The gateway's span under a caller's parent: the request's start is not in the trace.
    rooted_elsewhere = [
        span(steps, "axon-gateway", "POST /v1/chat/completions", 0, 200, parent="caller") if s.parent_id == "" else s
        for s in whole
    ]
    assert steps.edges_of(rooted_elsewhere) is None


def test_the_report_prints_each_step_and_the_platforms_share(
    steps: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    args = type("Args", (), {"engine": "sim", "streams": 2, "rounds": 1, "max_tokens": 8})()
    traces = [steps.edges_of(request_trace(steps, shift)) for shift in (0.0, 1.0)]
    steps.report(args, traces, [56.0, 58.0])
    out = capsys.readouterr().out
    received = next(line for line in out.splitlines() if line.startswith("worker: job received"))
    assert received.split()[3:6] == ["1.50", "1.50", "4.00"]  # p50 step, p90 step, at p50 (of 3.5 and 4.5)
    assert "client TTFT p50 57.00 ms; of it the engine's first token 50.00 ms" in out
    assert "the platform's 7.00 ms" in out


def test_every_edge_names_a_span_its_service_opens_or_records(steps: ModuleType) -> None:
    for _label, service, name, _edge in steps.EDGES:
        if name.startswith("POST "):
            continue  # the server span, named by the request middleware from the route
        source = "\n".join(p.read_text() for p in (ROOT / "services" / SERVICE_SOURCES[service]).rglob("*.py"))
        assert re.search(rf'(span|record)\([^)]*"{re.escape(name)}"', source), (service, name)
