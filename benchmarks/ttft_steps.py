"""Where the time to first token goes, step by step, read from the services' own traces: the
platform under `engine_vs_stack.py`'s load with every request traced, and each step's median over
the requests.

    .venv/bin/python benchmarks/ttft_steps.py                           # sim, 64 streams, ~1 min
    .venv/bin/python benchmarks/ttft_steps.py --streams 1 --rounds 30   # one request at a time

Starts an OTLP/HTTP receiver (`trace_picture.py`'s), then the platform (worker on the simulator
by default, session manager, gateway) with AXON_OTLP_ENDPOINT pointing at it and
AXON_TRACE_SAMPLE_RATIO 1, and drives it as `engine_vs_stack.py` drives its stack side (the same
prompts, steady arrival, `axon bench`'s lean client). Once no span has arrived for a few seconds,
each request's trace gives the times of these edges, counted from the start of the gateway's
server span:

    gateway          key checked (`authenticate` ends), admitted (`admission` ends: a Redis script)
    session manager  request begins (its server span), job built (`build job` ends: the request
                     checked, the job's channel subscribed), publish called (`publish` begins: the
                     fair share's admission, a Redis script, and the broker's confirm are in it)
    worker           job received (`job` begins: the broker's hop and the worker's consumer),
                     engine asked (`prefill` begins), first token (`prefill` ends)
    session manager  first chunk received (`first chunk` ends: the token's publish to Redis, and
                     the relay)

and prints, for each step between two edges, its median and 90th percentile over the requests,
with the client's time to first token beside them. What follows the session manager's first chunk (its event
written, the gateway's read of it and write to the client, the client's read) has no span: it is
the client's TTFT less the last edge. Tracing costs each service a little CPU and time (a span's
bookkeeping, its export in the background); docs/performance.md compares with a run timed
without it.
"""

import argparse
import asyncio
import statistics
import sys
import time
from collections import defaultdict

import engine_vs_stack
from harness import BenchEnvironment, loop_factory
from trace_picture import ReceivedSpan, SpanStore, start_receiver

# (label, service, span name, which edge of it): the edges of one request's path, in order.
EDGES = [
    ("gateway: key checked", "axon-gateway", "authenticate", "end"),
    ("gateway: admitted", "axon-gateway", "admission", "end"),
    ("session manager: request begins", "axon-sessions", "POST /v1/chat/completions", "start"),
    ("session manager: job built", "axon-sessions", "build job", "end"),
    ("session manager: publish called", "axon-sessions", "publish", "start"),
    ("worker: job received", "axon-worker", "job", "start"),
    ("worker: engine asked", "axon-worker", "prefill", "start"),
    ("worker: first token", "axon-worker", "prefill", "end"),
    ("session manager: first chunk received", "axon-sessions", "first chunk", "end"),
]
ROOT = ("axon-gateway", "POST /v1/chat/completions")


def edges_of(spans: list[ReceivedSpan]) -> list[float] | None:
    """The times (ms from the root span's start) of `EDGES` in one trace, or None if one is missing."""
    first: dict[tuple[str, str], ReceivedSpan] = {}
    for span in sorted(spans, key=lambda s: s.start_ns):
        first.setdefault((span.service, span.name), span)
    root = first.get(ROOT)
    if root is None or root.parent_id:
        return None
    times = []
    for _label, service, name, edge in EDGES:
        span = first.get((service, name))
        if span is None:
            return None
        times.append(((span.start_ns if edge == "start" else span.end_ns) - root.start_ns) / 1e6)
    return times


def wait_quiet(store: SpanStore, quiet_s: float, timeout_s: float) -> None:
    """Until no span has arrived for `quiet_s` (the exporters send a batch every few seconds)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and time.monotonic() - store.last_arrival < quiet_s:
        time.sleep(0.2)


def report(args: argparse.Namespace, traces: list[list[float]], ttfts_ms: list[float]) -> None:
    print(
        f"{args.engine} engine, {args.streams} streams x {args.rounds} requests of {args.max_tokens} tokens, "
        f"arrival steady; every request traced; {len(traces)} whole traces of {len(ttfts_ms)} requests"
    )
    print(f"{'step (to the edge named, from the one above)':<48} {'p50 ms':>8} {'p90 ms':>8} {'at p50 ms':>10}")
    previous = [0.0] * len(traces)
    for i, (label, *_rest) in enumerate(EDGES):
        steps = sorted(t[i] - p for t, p in zip(traces, previous, strict=True))
        at = statistics.median(t[i] for t in traces)
        p90 = steps[min(len(steps) - 1, int(len(steps) * 0.9))]
        print(f"{label:<48} {statistics.median(steps):>8.2f} {p90:>8.2f} {at:>10.2f}")
        previous = [t[i] for t in traces]
    labels = [label for label, *_rest in EDGES]
    asked, first = labels.index("worker: engine asked"), labels.index("worker: first token")
    engine = statistics.median(t[first] - t[asked] for t in traces)
    ttft = statistics.median(ttfts_ms)
    print(
        f"client TTFT p50 {ttft:.2f} ms; of it the engine's first token {engine:.2f} ms (the steps' `prefill`), "
        f"the platform's {ttft - engine:.2f} ms"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    engine_vs_stack.add_load_arguments(parser)
    parser.add_argument("--quiet-s", type=float, default=7.0, help="no span for this long: all have arrived")
    args = parser.parse_args()
    engine_vs_stack.load_settings(args)

    store = SpanStore()
    receiver = start_receiver(store)
    try:
        endpoint = f"http://127.0.0.1:{receiver.server_address[1]}"
        with BenchEnvironment(otlp_endpoint=endpoint, trace_sample_ratio="1") as env:
            stack = env.start_stack(engine_vs_stack.worker_env(args))
            key = env.create_key()
            print(f"platform ready (logs in {env.log_dir}); measuring through it...", file=sys.stderr, flush=True)
            with asyncio.Runner(loop_factory=loop_factory()) as runner:
                spacing_s = runner.run(engine_vs_stack.answer_duration_s(args)) / args.streams
                side = runner.run(engine_vs_stack.measure_stack(args, stack["gateway"].url, key, spacing_s, {}))
            wait_quiet(store, args.quiet_s, timeout_s=60)
    finally:
        receiver.shutdown()
    errors = [r.error for r in side.results if r.error]
    if errors:
        raise SystemExit(f"{len(errors)} requests failed, e.g. {errors[0]}")
    by_trace: dict[str, list[ReceivedSpan]] = defaultdict(list)
    for span in store.spans:
        by_trace[span.trace_id].append(span)
    # The first request was the warm-up, answered before the measured ones were sent.
    measured = sorted(by_trace.values(), key=lambda spans: min(s.start_ns for s in spans))[1:]
    traces = [times for spans in measured if (times := edges_of(spans)) is not None]
    if not traces:
        raise SystemExit("no whole trace arrived: is tracing on in the services?")
    report(args, traces, [r.ttft_s * 1000 for r in side.results])
    return 0


if __name__ == "__main__":
    sys.exit(main())
