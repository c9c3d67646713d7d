"""What API keys and rate limits cost the gateway: requests/s and added latency of the
authenticated, rate-limited path (A) against the same app with both switched off (B), in one run.

    .venv/bin/python benchmarks/gateway_auth_overhead.py            # about 80 s
    .venv/bin/python benchmarks/gateway_auth_overhead.py --rounds 4 --seconds 2 --json auth.json

Three processes besides this one: a stub session manager (a bare ASGI app answering
`POST /v1/chat/completions` with a canned answer, so the gateway is the bottleneck), and two
gateways built by the real app factory (`services.gateway.app.create_app`) and run by uvicorn as
`axon-gateway` runs them, both pointed at the stub:

- A: unchanged. Every request is authenticated (SHA-256 of the key, then the in-process, Redis and
  PostgreSQL caches) and admitted by the rate limiter (one Lua script in Redis checking requests,
  tokens and concurrency); the stub gives the concurrency lease back when it answers, as the
  session manager does when an answer ends.
- B: auth and limits switched off *inside this benchmark only*: the gateway service's
  authenticator is replaced by one returning a fixed key record, and its admitter by one that
  admits everything without touching Redis. There is no production setting that turns
  authentication off.

Load comes from the lean HTTP/1.1 client of `axon bench` (`shared/http1.py`): a fixed number
of concurrent keep-alive connections, each sending its next request as soon as the previous one is
answered. Rounds alternate A, B, B, A, A, B, ... so slow drift (CPU frequency, Redis, the page
cache) falls on both equally, and the ratio is also given as the median over the pairs of adjacent
rounds, which shrugs off a burst of load from other processes. On a shared machine the most stable
figure is the gateway's own CPU time per request (from /proc, Linux only): its B/A ratio is the
throughput ratio a saturated gateway with a core of its own would show.

Two phases:
1. throughput, `--concurrency` requests in flight (the gateway saturated): requests/s of each, and
   their ratio A/B (target >= 0.85). Latency here is mostly queueing (Little's law: concurrency /
   throughput), so it is shown but is not the added-latency figure.
2. latency, one request in flight (`--latency-concurrency 1`, nothing queued): p50 and p99 of each
   and the p50 latency A adds (target <= 1 ms).

It uses real Redis and PostgreSQL: a fresh database `axon_bench_<id>` (migrated with
`shared.migrations.migrate`, dropped at the end) holding one key with limits far above the load, and
its own Redis namespace (its keys are deleted at the end).
"""

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from harness import UNLIMITED, BenchEnvironment, cpu_seconds, loop_factory

from services.cli.launcher import Service, free_port, wait_ready
from shared.http1 import Http1Pool
from shared.names import Names
from shared.redis_pipe import RedisPipe

MODEL = "bench-model"
BODY = json.dumps(
    {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "Say hello in five words."}]}
).encode()
# Limits far above anything this benchmark sends, so every request is admitted, but all three
# (requests, tokens, concurrency) are checked on every request.
LIMITS = UNLIMITED


# --------------------------------------------------------------------------------------------
# The processes under test (this file run as `... gateway_auth_overhead.py --serve ROLE PORT`)
# --------------------------------------------------------------------------------------------

_CANNED = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1763790000,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello there, how are you?"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 6, "total_tokens": 18},
    }
).encode()
_READY = b'{"status":"ready"}'


_stub_pipe: RedisPipe | None = None


async def _release_lease(scope) -> None:
    """What the session manager does with the caller's concurrency lease when an answer ends:
    give it back (one ZREM, auto-pipelined as there). Without it, A's leases would pile up to
    the key's limit."""
    global _stub_pipe
    headers = dict(scope["headers"])
    lease_id, key_id = headers.get(b"x-axon-lease-id"), headers.get(b"x-axon-key-id")
    if lease_id is None or key_id is None:
        return
    if _stub_pipe is None:
        _stub_pipe = RedisPipe(os.environ["AXON_REDIS_URL"], timeout_s=5)
    names = Names(os.environ["AXON_NAMESPACE"])
    await _stub_pipe.execute("ZREM", names.rate_limit("conc", key_id.decode()), lease_id.decode())


async def stub_sessions(scope, receive, send) -> None:
    """A session manager that answers at once: `/ready`, and a canned non-streamed completion
    (releasing the caller's concurrency lease, as the real one does)."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    more = True
    while more:  # drain the request body
        message = await receive()
        more = message.get("more_body", False)
    if scope["path"] == "/ready":
        status, body = 200, _READY
    elif scope["method"] == "POST" and scope["path"] in ("/v1/chat/completions", "/v1/completions"):
        status, body = 200, _CANNED
        await _release_lease(scope)
    else:
        status, body = 404, b'{"error":{"message":"not found","type":"invalid_request_error","param":null,"code":null}}'
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _switch_off_auth_and_limits(app) -> None:
    """B: the same app, with the caller fixed and the admitter admitting everything.

    Benchmark-only surgery on one process's objects; production has no such switch.
    """
    import datetime as dt

    from services.gateway.admission import Admission
    from shared.keys import KeyRecord

    record = KeyRecord(
        id="key_0123456789abcdef",
        name="bench",
        tenant="key_0123456789abcdef",
        display="axk_be…ench",
        limits=LIMITS,
        created_at=dt.datetime.now(dt.UTC),
    )

    class FixedCaller:
        async def authenticate(self, authorization: str | None) -> KeyRecord:
            return record

    class AdmitEverything:
        async def admit(self, record: KeyRecord, *, tokens: int) -> Admission:
            return Admission(record, None)  # decision None: no headers, nothing to release

        async def release(self, admission: Admission) -> None:
            return None

    original = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async with original(app) as state:
            app.state.gateway._authenticator = FixedCaller()
            app.state.gateway._admitter = AdmitEverything()
            yield state

    app.router.lifespan_context = lifespan


def serve(role: str, port: int) -> None:
    """Run one process under test until it is terminated."""
    import uvicorn

    if role == "stub":
        uvicorn.run(stub_sessions, host="127.0.0.1", port=port, log_level="warning", access_log=False)
        return
    from services.gateway.app import create_app
    from services.gateway.settings import GatewaySettings
    from shared.guarded_http import ConnectionLimits, guarded_protocol
    from shared.logging import configure_logging

    # As services/gateway/main.py runs it (logging included: it is part of every request's cost).
    settings = GatewaySettings()
    configure_logging(service="gateway", level=settings.log_level, log_format=settings.log_format)
    app = create_app(settings)
    if role == "gateway-open":
        _switch_off_auth_and_limits(app)
    limits = ConnectionLimits(
        head_timeout_s=settings.request_head_timeout_s,
        max_head_bytes=settings.max_header_bytes,
        stall_timeout_s=settings.client_stall_timeout_s,
        send_buffer_bytes=settings.client_send_buffer_bytes,
    )
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        http=guarded_protocol(limits),
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=10,
    )


# --------------------------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------------------------


def start(role: str, env: BenchEnvironment, extra: dict[str, str] | None = None) -> Service:
    port = free_port()
    return env.start(role, [sys.executable, __file__, "--serve", role, str(port)], env=extra, port=port)


@dataclass
class Samples:
    """Everything measured for one variant in one phase, summed over its rounds."""

    latencies_s: list[float] = field(default_factory=list)
    seconds: float = 0.0
    cpu_s: float | None = 0.0  # the gateway's CPU time (all threads) during the rounds
    errors: dict[str, int] = field(default_factory=dict)
    round_rps: list[float] = field(default_factory=list)
    round_p50_ms: list[float] = field(default_factory=list)

    @property
    def cpu_us_per_request(self) -> float:
        if self.cpu_s is None or not self.latencies_s:
            return float("nan")
        return self.cpu_s / len(self.latencies_s) * 1e6

    @property
    def rps(self) -> float:
        return len(self.latencies_s) / self.seconds if self.seconds else 0.0

    def percentile_ms(self, q: float) -> float:
        return percentile_ms(self.latencies_s, q)


def percentile_ms(latencies_s: list[float], q: float) -> float:
    ordered = sorted(latencies_s)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] * 1000


async def drive(url: str, key: str, *, concurrency: int, seconds: float, into: Samples | None) -> None:
    """Keep `concurrency` requests in flight for `seconds`; record each latency (`into=None`: warm-up)."""
    pool = Http1Pool(
        url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        max_idle_connections=concurrency,
        connect_timeout_s=5,
    )
    latencies: list[float] = []
    errors: dict[str, int] = {}
    clock = time.perf_counter
    stop_at = clock() + seconds

    async def one_connection() -> None:
        while clock() < stop_at:
            sent = clock()
            try:
                status, body = await asyncio.wait_for(pool.post(BODY), timeout=30)
            except Exception as exc:  # noqa: BLE001 - counted, then the run is refused
                errors[repr(exc)[:120]] = errors.get(repr(exc)[:120], 0) + 1
                continue
            if status == 200:
                latencies.append(clock() - sent)
            else:
                text = f"HTTP {status}: {body[:120]!r}"
                errors[text] = errors.get(text, 0) + 1

    started = clock()
    await asyncio.gather(*(one_connection() for _ in range(concurrency)))
    elapsed = clock() - started
    await pool.aclose()
    if into is not None:
        into.latencies_s += latencies
        into.seconds += elapsed
        into.round_rps.append(len(latencies) / elapsed)
        into.round_p50_ms.append(percentile_ms(latencies, 50))
        for text, count in errors.items():
            into.errors[text] = into.errors.get(text, 0) + count


def check_variants(auth: Service, open_: Service, key: str) -> None:
    """Refuse to measure unless A really authenticates and limits, and B really does neither.

    Raises:
        RuntimeError: a variant does not behave as it should.
    """
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    a = httpx.post(f"{auth.url}/v1/chat/completions", content=BODY, headers=headers, timeout=10)
    anonymous = httpx.post(f"{auth.url}/v1/chat/completions", content=BODY, timeout=10)
    b = httpx.post(f"{open_.url}/v1/chat/completions", content=BODY, timeout=10)
    problems = [
        (a.status_code != 200, f"A refuses a valid key: {a.status_code} {a.text}"),
        ("x-ratelimit-remaining-requests" not in a.headers, "A sends no rate-limit headers"),
        (anonymous.status_code != 401, f"A answers {anonymous.status_code} without a key"),
        (b.status_code != 200, f"B refuses a request without a key: {b.status_code} {b.text}"),
        ("x-ratelimit-remaining-requests" in b.headers, "B still rate-limits"),
    ]
    failed = [message for bad, message in problems if bad]
    if failed:
        raise RuntimeError("; ".join(failed))


async def measure(args: argparse.Namespace, variants: dict[str, Service], key: str) -> dict[str, dict[str, Samples]]:
    results: dict[str, dict[str, Samples]] = {"throughput": {}, "latency": {}}
    for process in variants.values():  # warm-up: connections, key caches, lazily built routes
        await drive(process.url, key, concurrency=args.concurrency, seconds=args.warmup, into=None)
    phases = [
        ("throughput", args.concurrency, args.seconds),
        ("latency", args.latency_concurrency, args.latency_seconds),
    ]
    for phase, concurrency, seconds in phases:
        for name in variants:
            results[phase][name] = Samples()
        order = list(variants)
        for round_no in range(args.rounds):
            # A B, B A, A B, ...: linear drift falls on both variants equally.
            for name in order if round_no % 2 == 0 else reversed(order):
                samples, pid = results[phase][name], variants[name].pid
                cpu_before = cpu_seconds(pid)
                await drive(variants[name].url, key, concurrency=concurrency, seconds=seconds, into=samples)
                cpu_after = cpu_seconds(pid)
                if samples.cpu_s is not None and cpu_before is not None and cpu_after is not None:
                    samples.cpu_s += cpu_after - cpu_before
                else:
                    samples.cpu_s = None
                print(
                    f"  {phase:<10} round {round_no + 1:>2}/{args.rounds} {name}: {samples.round_rps[-1]:7.0f} req/s, "
                    f"p50 {samples.round_p50_ms[-1]:6.2f} ms",
                    file=sys.stderr,
                    flush=True,
                )
    return results


def report(args: argparse.Namespace, results: dict[str, dict[str, Samples]]) -> dict:
    t_a, t_b = results["throughput"]["A"], results["throughput"]["B"]
    l_a, l_b = results["latency"]["A"], results["latency"]["B"]
    ratio = t_a.rps / t_b.rps
    # Each round of A ran next to a round of B: the median of their ratios shrugs off a burst of
    # load from other processes that hit a few rounds.
    pair_ratio = statistics.median(a / b for a, b in zip(t_a.round_rps, t_b.round_rps, strict=True))
    cpu_ratio = t_b.cpu_us_per_request / t_a.cpu_us_per_request
    added_p50 = l_a.percentile_ms(50) - l_b.percentile_ms(50)
    pair_added_p50 = statistics.median(a - b for a, b in zip(l_a.round_p50_ms, l_b.round_p50_ms, strict=True))
    print()
    print(
        f"gateway auth overhead: {args.rounds} alternating rounds per variant and phase; "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, gateway log level {args.log_level}"
    )
    print()
    header = f"{'':<26}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'requests':>10}{'gateway CPU µs/req':>20}"
    for phase, title in (
        ("throughput", f"throughput: {args.concurrency} in flight, {args.rounds} x {args.seconds:g} s each"),
        ("latency", f"latency: {args.latency_concurrency} in flight, {args.rounds} x {args.latency_seconds:g} s each"),
    ):
        print(title)
        print(header)
        for name, label in (("A", "A  auth + rate limits"), ("B", "B  auth and limits off")):
            s = results[phase][name]
            print(
                f"{label:<26}{s.rps:>9.0f}{s.percentile_ms(50):>9.2f}{s.percentile_ms(99):>9.2f}"
                f"{len(s.latencies_s):>10}{s.cpu_us_per_request:>20.0f}"
            )
        print()

    def line(label: str, value: float, note: str) -> None:
        print(f"{label:<48}{value:>8.3f}   {note}")

    line("throughput ratio A/B (all rounds)", ratio, f"target >= 0.85  {'ok' if ratio >= 0.85 else 'MISSED'}")
    line(
        "throughput ratio A/B (median of round pairs)",
        pair_ratio,
        f"target >= 0.85  {'ok' if pair_ratio >= 0.85 else 'MISSED'}",
    )
    line("gateway CPU per request, B/A", cpu_ratio, "(the ratio a saturated, otherwise idle gateway would show)")
    line(
        f"p50 added latency, {args.latency_concurrency} in flight (ms)",
        added_p50,
        f"target <= 1 ms  {'ok' if added_p50 <= 1 else 'MISSED'}",
    )
    line(
        "p50 added latency, median of round pairs (ms)",
        pair_added_p50,
        f"target <= 1 ms  {'ok' if pair_added_p50 <= 1 else 'MISSED'}",
    )
    line(
        f"p50 added latency, {args.concurrency} in flight (ms)",
        t_a.percentile_ms(50) - t_b.percentile_ms(50),
        "(queueing: in-flight / throughput)",
    )
    errors = {
        f"{phase} {name}: {text}": count
        for phase in results
        for name, s in results[phase].items()
        for text, count in s.errors.items()
    }
    for text, count in errors.items():
        print(f"error x{count}: {text}")

    def figures(s: Samples) -> dict:
        return {
            "requests": len(s.latencies_s),
            "rps": s.rps,
            "p50_ms": s.percentile_ms(50),
            "p99_ms": s.percentile_ms(99),
            "cpu_us_per_request": s.cpu_us_per_request,
            "round_rps": s.round_rps,
            "round_p50_ms": s.round_p50_ms,
        }

    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "serve"},
        "host": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "throughput": {n: figures(s) for n, s in results["throughput"].items()},
        "latency": {n: figures(s) for n, s in results["latency"].items()},
        "ratio": ratio,
        "ratio_median_of_pairs": pair_ratio,
        "cpu_ratio": cpu_ratio,
        "added_p50_ms": added_p50,
        "added_p50_ms_median_of_pairs": pair_added_p50,
        "errors": errors,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight, throughput phase")
    parser.add_argument("--seconds", type=float, default=3.0, help="length of one throughput round")
    parser.add_argument("--latency-concurrency", type=int, default=1, help="requests in flight, latency phase")
    parser.add_argument("--latency-seconds", type=float, default=1.5, help="length of one latency round")
    parser.add_argument("--rounds", type=int, default=8, help="rounds per variant and phase")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of warm-up per variant")
    parser.add_argument(
        "--postgres", default=os.environ.get("AXON_BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    )
    parser.add_argument("--redis", default=os.environ.get("AXON_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--log-level", default="INFO", help="the gateways' AXON_LOG_LEVEL (production: INFO)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--serve", nargs=2, metavar=("ROLE", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return 0

    with BenchEnvironment(postgres_url=args.postgres, redis_url=args.redis) as env:
        key = env.create_key(LIMITS)
        stub = start("stub", env)
        wait_ready([stub], timeout_s=120)
        gateway_env = {"AXON_SESSIONS_URL": stub.url, "AXON_LOG_LEVEL": args.log_level}
        variants = {"A": start("gateway-auth", env, gateway_env), "B": start("gateway-open", env, gateway_env)}
        wait_ready(list(variants.values()), timeout_s=120)
        check_variants(variants["A"], variants["B"], key)
        print(f"measuring (logs in {env.log_dir})", file=sys.stderr, flush=True)
        # The driver is not what is measured: keep it cheap.
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            results = runner.run(measure(args, variants, key))
        summary = report(args, results)
        if args.json:
            args.json.write_text(json.dumps(summary, indent=2) + "\n")
        return 1 if summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
