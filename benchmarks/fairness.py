"""Fair share between tenants (issue 36): a quiet tenant beside another's burst, and backlogged
tenants' token shares, with the fair share on and off in the same run.

    .venv/bin/python benchmarks/fairness.py                         # sim engine, about 5 minutes
    .venv/bin/python benchmarks/fairness.py --picture docs/images/fair-share-ttft.svg
    .venv/bin/python benchmarks/fairness.py --engine vllm           # burst only, 32 sequences: long (below)
    .venv/bin/python benchmarks/fairness.py --engine vllm --max-seqs 8 --quiet-requests 10   # 17 minutes
    .venv/bin/python benchmarks/fairness.py --engine vllm --max-seqs 16 --fair-only         # the fair share alone

It starts one worker, and two session managers with a gateway each, with a database and Redis
namespace of their own (removed at the end): `fair share` (`AXON_FAIR_SHARE=true`, the default) and
`fifo` (`AXON_FAIR_SHARE=false`: the model's shared queue, first in, first out, as before the fair
share). Every scenario runs through the fair share's gateway first, then through the FIFO one, on
the same worker. Each tenant has its API key (`tenant` of the key); weights are set through the
gateway's admin API (`PUT /admin/tenants/{tenant}`). Requests are streamed chat completions sent
with `axon bench`'s lean HTTP/1.1 client; a tenant's tokens are counted as they arrive (the sim's
words: one a token).

- `burst` (both engines): tenant `quiet` sends one `--quiet-tokens` (16) request at a time (0.1 s
  apart), `--quiet-requests` (15) alone, then as many beside tenant `noisy`, which keeps each burst
  of `--burst` streams of `--noisy-tokens` going (from 2 s before quiet's first request until its
  last; the streams' answers in flight then finish). Printed: quiet's time to first token p50, p95
  and max, noisy's TTFT p50 and the output tokens/s of the burst. Targets: on sim, quiet's p50
  beside the burst <= its p50 alone + 150 ms; on vLLM, quiet's p50 beside 4 x max_seqs streams <=
  1.5 x its p50 beside max_seqs - 1 streams (a full batch, no queue: the engine's own cost).
  The sim worker: `--max-seqs` (8) sequences, AXON_SIM_TTFT_MS=20, AXON_SIM_ITL_MS=10, one burst of
  64 x 64 tokens; the vLLM worker: the bundled SmolLM2, AXON_MAX_SEQS=`--max-seqs` (32), bursts of
  max_seqs - 1 and 4 x max_seqs streams of 32 tokens (`ignore_eos`). On vLLM the FIFO half
  dominates the run's length (quiet waits behind the whole burst): 17 minutes at 8 sequences on
  2 loaded cores; at 32, most of an hour.
- `shares` (sim only): two tenants each keep `--streams` (24) requests in flight for `--warmup-s`
  (5) + `--window-s` (20) seconds: `long` asks 256 tokens, `short` 16 (equal weights), then `heavy`
  (weight 3) and `light` (weight 1) both 64. Printed: each tenant's share of the output tokens that
  arrived within the window (targets 0.5 +- 0.1, 0.75 +- 0.07), Jain's fairness index over their
  weighted throughput (tokens / weight) in the window, and the maximum service gap over the run:
  the largest difference of their weighted received tokens, sampled every 0.25 s from the start.

`--picture PATH.svg` draws the burst scenario's TTFT of every request over time (quiet's and
noisy's, fair share and FIFO in two panels); `--json PATH` writes every figure. The exit status is
0 when every request was answered, whether or not a target is met.
"""

import argparse
import asyncio
import json
import math
import os
import shlex
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

import httpx
import orjson
from harness import ADMIN_TOKEN, BenchEnvironment, loop_factory

from services.cli.bench.client import http_error, request_headers
from services.cli.launcher import Service
from services.worker.engines.gguf import bundled_gguf_path
from shared.http1 import Http1Pool

MODES = {"fair share": "true", "fifo": "false"}
SAMPLE_S = 0.25
QUIET_PAUSE_S = 0.1
BURST_LEAD_S = 2.0
SIM = {"AXON_ENGINE": "sim", "AXON_SIM_TTFT_MS": "20", "AXON_SIM_ITL_MS": "10"}
VLLM_NOISY_TOKENS = 32


# --------------------------------------------------------------------------------------------
# Figures (pure)
# --------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0-100) of `values`, interpolated between the closest ranks as numpy's
    default does; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def jain_index(values: Sequence[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n * sum x^2): 1 when all are equal, 1/n when one has all."""
    squares = sum(x * x for x in values)
    return sum(values) ** 2 / (len(values) * squares) if squares else math.nan


def max_service_gap(samples: Sequence[dict[str, float]], weights: dict[str, float]) -> float:
    """The largest difference, over the samples, between two tenants' served tokens divided by their
    weights (each sample: tenant -> its tokens so far)."""
    gap = 0.0
    for sample in samples:
        served = [sample.get(tenant, 0.0) / weight for tenant, weight in weights.items()]
        gap = max(gap, max(served) - min(served))
    return gap


def tokens_between(arrivals: Sequence[tuple[float, int]], start_s: float, end_s: float) -> int:
    """The tokens of `arrivals` ((time, tokens) pairs) that came within [start_s, end_s)."""
    return sum(n for at, n in arrivals if start_s <= at < end_s)


# --------------------------------------------------------------------------------------------
# The picture (pure)
# --------------------------------------------------------------------------------------------

PANEL_W, PANEL_H, MARGIN_L, MARGIN_T, MARGIN_B, GAP = 460, 300, 64, 48, 44, 40
COLOURS = {"quiet": "#1f77b4", "noisy": "#ff7f0e"}
RADII = {"quiet": 4.0, "noisy": 2.0}


def _log_ticks(low_ms: float, high_ms: float) -> list[float]:
    ticks = []
    decade = 10 ** math.floor(math.log10(low_ms))
    while decade <= high_ms:
        ticks += [t for t in (decade, 2 * decade, 5 * decade) if low_ms <= t <= high_ms]
        decade *= 10
    return ticks


def ttft_picture(panels: dict[str, dict[str, list[tuple[float, float]]]], *, title: str) -> str:
    """An SVG of each panel's points (panel -> tenant -> (seconds since the burst began, TTFT ms)),
    panels side by side on one log TTFT axis, each on a time axis of its own, one circle per point."""
    points = [p for tenants in panels.values() for series in tenants.values() for p in series]
    low = 10 ** math.floor(math.log10(max(1.0, min((ms for _, ms in points), default=10.0))))
    high = 10 ** math.ceil(math.log10(max((ms for _, ms in points), default=1000.0) * 1.05))
    width = MARGIN_L + len(panels) * (PANEL_W + GAP)
    height = MARGIN_T + PANEL_H + MARGIN_B + 24

    def y(ms: float) -> float:
        share = (math.log10(max(ms, low)) - math.log10(low)) / (math.log10(high) - math.log10(low))
        return MARGIN_T + PANEL_H * (1 - share)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{MARGIN_L}" y="20" font-size="14" font-weight="bold">{escape(title)}</text>',
    ]
    for index, (name, tenants) in enumerate(panels.items()):
        left = MARGIN_L + index * (PANEL_W + GAP)
        span_s = max((at for series in tenants.values() for at, _ in series), default=1.0) * 1.05 or 1.0

        def x(at_s: float, left: float = left, span_s: float = span_s) -> float:
            return left + PANEL_W * at_s / span_s

        out.append(f'<g class="panel" data-name="{escape(name)}">')
        out.append(f'<text x="{left}" y="{MARGIN_T - 8}" font-weight="bold">{escape(name)}</text>')
        out.append(f'<rect x="{left}" y="{MARGIN_T}" width="{PANEL_W}" height="{PANEL_H}" fill="none" stroke="#999"/>')
        for tick in _log_ticks(low, high):
            out.append(
                f'<line x1="{left}" x2="{left + PANEL_W}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" stroke="#eee"/>'
                f'<text x="{left - 4}" y="{y(tick) + 4:.1f}" text-anchor="end">{tick:g}</text>'
            )
        step = 10 ** math.floor(math.log10(span_s)) if span_s >= 1 else 0.1
        if span_s / step < 4:
            step /= 2
        tick_s = 0.0
        while tick_s <= span_s:
            out.append(
                f'<text x="{x(tick_s):.1f}" y="{MARGIN_T + PANEL_H + 16}" text-anchor="middle">{tick_s:g}</text>'
            )
            tick_s += step
        out.append(
            f'<text x="{left + PANEL_W / 2}" y="{MARGIN_T + PANEL_H + 34}" text-anchor="middle">'
            "seconds since the burst began (request sent)</text>"
        )
        for tenant, series in tenants.items():
            colour = COLOURS.get(tenant, "#666")
            radius = RADII.get(tenant, 2.5)
            for at_s, ms in series:
                out.append(
                    f'<circle class="{escape(tenant)}" cx="{x(at_s):.1f}" cy="{y(ms):.1f}" r="{radius}" '
                    f'fill="{colour}" fill-opacity="0.7"/>'
                )
        out.append("</g>")
    out.append(
        f'<text transform="translate(16 {MARGIN_T + PANEL_H / 2}) rotate(-90)" text-anchor="middle">'
        "time to first token (ms, log)</text>"
    )
    legend_y = height - 8
    for i, tenant in enumerate(COLOURS):
        lx = MARGIN_L + i * 120
        out.append(
            f'<rect x="{lx}" y="{legend_y - 9}" width="10" height="10" fill="{COLOURS[tenant]}"/>'
            f'<text x="{lx + 14}" y="{legend_y}">{tenant}</text>'
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------------------
# The client
# --------------------------------------------------------------------------------------------


@dataclass
class Answer:
    """One streamed answer; times in seconds from the scenario's start."""

    tenant: str
    sent_s: float
    ttft_s: float | None = None
    tokens: int = 0
    usage_tokens: int | None = None
    error: str | None = None


@dataclass
class Tally:
    """A tenant's tokens as they arrived: (seconds from the scenario's start, tokens) per event."""

    arrivals: list[tuple[float, int]] = field(default_factory=list)
    total: int = 0

    def add(self, at_s: float, tokens: int) -> None:
        self.arrivals.append((at_s, tokens))
        self.total += tokens


class StreamCounter:
    """Parses one SSE answer as it arrives: its first token's time and each event's tokens (the
    sim's words, one a token)."""

    def __init__(self, answer: Answer, tally: Tally, epoch: float) -> None:
        self._answer, self._tally, self._epoch = answer, tally, epoch
        self._buffer = b""

    def feed(self, data: bytes, now: float) -> None:
        lines = (self._buffer + data).split(b"\n")
        self._buffer = lines.pop()
        for line in lines:
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                self._event(orjson.loads(line[5:].strip()), now - self._epoch)

    def _event(self, event: dict[str, Any], at_s: float) -> None:
        choices = event.get("choices") or []
        content = (choices[0].get("delta") or {}).get("content") if choices else None
        if content:
            tokens = max(1, len(content.split()))
            if self._answer.ttft_s is None:
                self._answer.ttft_s = at_s - self._answer.sent_s
            self._answer.tokens += tokens
            self._tally.add(at_s, tokens)
        if event.get("usage"):
            self._answer.usage_tokens = event["usage"].get("completion_tokens")
        if "error" in event:
            self._answer.error = f"stream error: {event['error']}"


class TenantClient:
    """One tenant's streamed chat requests through a gateway, with its tally of received tokens."""

    def __init__(self, gateway_url: str, tenant: str, key: str, *, model: str, vllm: bool) -> None:
        self.tenant, self.model, self.vllm = tenant, model, vllm
        self.pool = Http1Pool(
            f"{gateway_url}/v1/chat/completions",
            headers=request_headers(key),
            max_idle_connections=None,
            connect_timeout_s=10,
        )
        self.tally = Tally()
        self.answers: list[Answer] = []

    def body(self, max_tokens: int) -> bytes:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": "go"}],
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.vllm:
            body |= {"ignore_eos": True, "temperature": 0}
        return orjson.dumps(body)

    async def ask(self, max_tokens: int, epoch: float) -> Answer:
        answer = Answer(self.tenant, time.perf_counter() - epoch)
        counter = StreamCounter(answer, self.tally, epoch)
        try:
            status, raw = await asyncio.wait_for(self.pool.post(self.body(max_tokens), sink=counter.feed), 600)
            if status != 200:
                answer.error = http_error(status, raw)
            elif answer.ttft_s is None:
                answer.error = "no token in the answer"
        except Exception as exc:  # noqa: BLE001 - a load generator records a failure and goes on
            answer.error = f"{type(exc).__name__}: {exc}"
        self.answers.append(answer)
        return answer

    async def keep_going(self, *, streams: int, max_tokens: int, epoch: float, until: Callable[[], bool]) -> None:
        """`streams` requests in flight until `until()` is true; those in flight then finish."""

        async def loop() -> None:
            while not until():
                await self.ask(max_tokens, epoch)

        await asyncio.gather(*(loop() for _ in range(streams)))

    async def aclose(self) -> None:
        await self.pool.aclose()


# --------------------------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------------------------


async def burst(
    gateway_url: str, keys: dict[str, str], *, model: str, vllm: bool, bursts: list[int], args: argparse.Namespace
) -> dict[str, Any]:
    """Quiet's requests alone, then beside each burst of noisy's streams in turn."""
    quiet = TenantClient(gateway_url, "quiet", keys["quiet"], model=model, vllm=vllm)
    noisy = TenantClient(gateway_url, "noisy", keys["noisy"], model=model, vllm=vllm)
    epoch = time.perf_counter()

    async def quiet_run() -> list[Answer]:
        answers = []
        for _ in range(args.quiet_requests):
            answers.append(await quiet.ask(args.quiet_tokens, epoch))
            await asyncio.sleep(QUIET_PAUSE_S)
        return answers

    try:
        await quiet.ask(args.quiet_tokens, epoch)  # warm-up: the connection, the session manager's caches
        phases: dict[str, Any] = {"alone": {"quiet": await quiet_run()}}
        for streams in bursts:
            stop = asyncio.Event()
            noisy.answers = []
            started_s = time.perf_counter() - epoch
            tokens_before = noisy.tally.total
            load = asyncio.create_task(
                noisy.keep_going(streams=streams, max_tokens=args.noisy_tokens, epoch=epoch, until=stop.is_set)
            )
            await asyncio.sleep(BURST_LEAD_S)
            beside = await quiet_run()
            stop.set()
            await load
            seconds = time.perf_counter() - epoch - started_s
            phases[f"{streams}"] = {
                "started_s": started_s,
                "quiet": beside,
                "noisy": list(noisy.answers),
                "noisy_tok_s": (noisy.tally.total - tokens_before) / seconds,
            }
        return phases
    finally:
        await quiet.aclose()
        await noisy.aclose()


async def shares(
    gateway_url: str,
    tenants: dict[str, tuple[str, int, float]],
    *,
    model: str,
    streams: int,
    warmup_s: float,
    window_s: float,
) -> dict[str, Any]:
    """Two backlogged tenants (tenant -> key, max_tokens, weight): each one's tokens in the window,
    Jain's index over their weighted throughput, and the largest gap of weighted tokens over the run."""
    clients = {t: TenantClient(gateway_url, t, key, model=model, vllm=False) for t, (key, _, _) in tenants.items()}
    weights = {t: w for t, (_, _, w) in tenants.items()}
    epoch = time.perf_counter()
    end_s = warmup_s + window_s

    def over() -> bool:
        return time.perf_counter() - epoch >= end_s

    async def sample(samples: list[dict[str, float]]) -> None:
        while not over():
            await asyncio.sleep(SAMPLE_S)
            samples.append({t: float(c.tally.total) for t, c in clients.items()})

    samples: list[dict[str, float]] = []
    try:
        await asyncio.gather(
            sample(samples),
            *(
                c.keep_going(streams=streams, max_tokens=tenants[t][1], epoch=epoch, until=over)
                for t, c in clients.items()
            ),
        )
    finally:
        for client in clients.values():
            await client.aclose()
    window = {t: tokens_between(c.tally.arrivals, warmup_s, end_s) for t, c in clients.items()}
    total = sum(window.values()) or 1
    return {
        "tenants": {
            t: {
                "weight": weights[t],
                "max_tokens": tenants[t][1],
                "tokens": window[t],
                "share": window[t] / total,
                "errors": sum(1 for a in c.answers if a.error),
                "answers": len(c.answers),
                "miscounted": sum(1 for a in c.answers if a.usage_tokens not in (None, a.tokens)),
            }
            for t, c in clients.items()
        },
        "jain": jain_index([window[t] / weights[t] for t in clients]),
        "max_gap": max_service_gap(samples, weights),
        "tok_s": sum(window.values()) / window_s,
    }


# --------------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------------


def ttfts_ms(answers: Sequence[Answer]) -> list[float]:
    return [a.ttft_s * 1000 for a in answers if a.ttft_s is not None and a.error is None]


def errors_of(answers: Sequence[Answer]) -> list[str]:
    return [a.error for a in answers if a.error]


def report_burst(results: dict[str, dict[str, Any]], args: argparse.Namespace, engine: str) -> list[str]:
    """Prints the burst table; returns the targets' verdicts."""
    print(
        f"\nburst: quiet sends one {args.quiet_tokens}-token request at a time; noisy's streams ask {args.noisy_tokens}"
    )
    print(
        f"{'scheduler':<11} {'quiet beside':<24} {'requests':>8} {'errors':>6} {'p50 ms':>8} {'p95 ms':>8} "
        f"{'max ms':>8}   {'noisy TTFT p50':>14} {'noisy tok/s':>11}"
    )
    verdicts = []
    for mode, phases in results.items():
        for phase, figures in phases.items():
            quiet = ttfts_ms(figures["quiet"])
            label = "nothing (alone)" if phase == "alone" else f"{phase} streams of noisy"
            noisy = (
                f"{percentile(ttfts_ms(figures['noisy']), 50):>14.0f} {figures['noisy_tok_s']:>11.0f}"
                if "noisy" in figures
                else ""
            )
            print(
                f"{mode:<11} {label:<24} {len(figures['quiet']):>8} {len(errors_of(figures['quiet'])):>6} "
                f"{percentile(quiet, 50):>8.1f} {percentile(quiet, 95):>8.1f} {max(quiet, default=math.nan):>8.1f}"
                f"   {noisy}"
            )
            for error in sorted(set(errors_of(figures["quiet"]) + errors_of(figures.get("noisy", [])))):
                print(f"{'':<11} error: {error}")
        p50 = {phase: percentile(ttfts_ms(f["quiet"]), 50) for phase, f in phases.items()}
        bursts = [phase for phase in phases if phase != "alone"]
        if engine == "sim":
            bound = p50["alone"] + 150
            verdict = (
                f"{mode}: quiet's p50 beside the burst {p50[bursts[-1]]:.0f} ms, target <= alone + 150 = {bound:.0f} ms"
            )
            met = p50[bursts[-1]] <= bound
        else:
            bound = 1.5 * p50[bursts[0]]
            verdict = (
                f"{mode}: quiet's p50 beside {bursts[-1]} streams {p50[bursts[-1]]:.0f} ms, target <= 1.5 x its p50 "
                f"beside {bursts[0]} streams = {bound:.0f} ms"
            )
            met = p50[bursts[-1]] <= bound
        verdicts.append(f"{verdict}: {'met' if met else 'NOT met'}")
    for verdict in verdicts:
        print(verdict)
    return verdicts


def report_shares(results: dict[str, dict[str, dict[str, Any]]], args: argparse.Namespace) -> list[str]:
    print(
        f"\nshares: two tenants, {args.streams} requests in flight each; tokens that arrived in the "
        f"{args.window_s:g} s after a {args.warmup_s:g} s warm-up; "
        f"the gap over the whole run, sampled every {SAMPLE_S:g} s"
    )
    print(
        f"{'scenario':<16} {'scheduler':<11} {'tenant':<6} {'weight':>6} {'max_tokens':>10} {'answers':>7} "
        f"{'errors':>6} {'tokens':>7} {'share':>6}   {'target':<12} {'Jain':>6} {'max gap (tok/w)':>16} {'tok/s':>6}"
    )
    verdicts = []
    for scenario, modes in results.items():
        for mode, figures in modes.items():
            tenants = figures["tenants"]
            weights = [t["weight"] for t in tenants.values()]
            for i, (tenant, t) in enumerate(tenants.items()):
                target_share = t["weight"] / sum(weights)
                tolerance = 0.1 if len(set(weights)) == 1 else 0.07
                target = f"{target_share:.2f} +- {tolerance:g}"
                tail = (
                    f" {figures['jain']:>6.3f} {figures['max_gap']:>16.0f} {figures['tok_s']:>6.0f}" if i == 0 else ""
                )
                print(
                    f"{scenario:<16} {mode:<11} {tenant:<6} {t['weight']:>6g} {t['max_tokens']:>10} {t['answers']:>7} "
                    f"{t['errors']:>6} {t['tokens']:>7} {t['share']:>6.3f}   {target:<12}{tail}"
                )
                if t["miscounted"]:
                    print(f"{'':<16} {t['miscounted']} answers' streamed words differ from their usage")
                if i == 0:
                    met = abs(t["share"] - target_share) <= tolerance
                    verdicts.append(
                        f"{scenario}, {mode}: {tenant}'s share {t['share']:.3f}, target {target}: "
                        f"{'met' if met else 'NOT met'}"
                    )
    for verdict in verdicts:
        print(verdict)
    return verdicts


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def set_weight(gateway_url: str, tenant: str, weight: float) -> None:
    response = httpx.put(
        f"{gateway_url}/admin/tenants/{tenant}",
        json={"weight": weight},
        headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=10,
    )
    response.raise_for_status()


def worker_env(args: argparse.Namespace) -> dict[str, str]:
    if args.engine == "sim":
        return SIM | {"AXON_MODEL": "sim-fair", "AXON_SIM_MAX_SEQS": str(args.max_seqs)}
    return {
        "AXON_ENGINE": "vllm",
        "AXON_MODEL": "smollm2-fair",
        "AXON_MODEL_PATH": str(bundled_gguf_path()),
        "AXON_MAX_SEQS": str(args.max_seqs),
    }


def start(env: BenchEnvironment, args: argparse.Namespace) -> tuple[Service, dict[str, Service]]:
    worker_settings = worker_env(args)
    env.models.add(worker_settings["AXON_MODEL"])
    worker = env.start_service("worker", env=worker_settings, ready_timeout_s=600)
    gateways = {}
    modes = {"fair share": MODES["fair share"]} if args.fair_only else MODES
    for mode, fair in modes.items():
        slug = mode.replace(" ", "-")
        sessions = env.start_service("sessions", name=f"sessions-{slug}", env={"AXON_FAIR_SHARE": fair})
        gateways[mode] = env.start_service("gateway", name=f"gateway-{slug}", env={"AXON_SESSIONS_URL": sessions.url})
    return worker, gateways


def run(args: argparse.Namespace) -> dict[str, Any]:
    vllm = args.engine == "vllm"
    settings = worker_env(args)
    model = settings["AXON_MODEL"]
    bursts = [args.max_seqs - 1, 4 * args.max_seqs] if vllm else [args.burst]
    results: dict[str, Any] = {"burst": {}, "shares": {}}
    tenant_weights = {"quiet": 1.0, "noisy": 1.0, "long": 1.0, "short": 1.0, "heavy": 3.0, "light": 1.0}
    with BenchEnvironment() as env:
        _worker, gateways = start(env, args)
        keys = {tenant: env.create_key(tenant=tenant) for tenant in tenant_weights}
        for tenant, weight in tenant_weights.items():
            set_weight(gateways["fair share"].url, tenant, weight)
        print(f"stack ready (logs in {env.log_dir})", file=sys.stderr, flush=True)
        with asyncio.Runner(loop_factory=loop_factory()) as runner:

            def go(label: str, work: Awaitable[Any]) -> Any:
                print(f"{label}...", file=sys.stderr, flush=True)
                started = time.perf_counter()
                result = runner.run(work)
                print(f"  {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
                return result

            for mode, gateway in gateways.items():
                results["burst"][mode] = go(
                    f"burst, {mode}",
                    burst(gateway.url, keys, model=model, vllm=vllm, bursts=bursts, args=args),
                )
            if not vllm:
                scenarios = {
                    "256 vs 16 tokens": {"long": (keys["long"], 256, 1.0), "short": (keys["short"], 16, 1.0)},
                    "weights 3 : 1": {"heavy": (keys["heavy"], 64, 3.0), "light": (keys["light"], 64, 1.0)},
                }
                for scenario, tenants in scenarios.items():
                    results["shares"][scenario] = {
                        mode: go(
                            f"shares {scenario}, {mode}",
                            shares(
                                gateway.url,
                                tenants,
                                model=model,
                                streams=args.streams,
                                warmup_s=args.warmup_s,
                                window_s=args.window_s,
                            ),
                        )
                        for mode, gateway in gateways.items()
                    }
    return results


def picture(results: dict[str, Any], args: argparse.Namespace) -> str:
    panels = {}
    for mode, phases in results.items():
        phase = next(p for p in phases if p != "alone")
        started_s = phases[phase]["started_s"]
        panels[mode] = {
            tenant: [(a.sent_s - started_s, a.ttft_s * 1000) for a in phases[phase][tenant] if a.ttft_s is not None]
            for tenant in ("noisy", "quiet")
        }
    title = (
        f"Time to first token, quiet (one request at a time) beside noisy ({phase} streams), "
        f"{args.engine} worker of {args.max_seqs} sequences"
    )
    return ttft_picture(panels, title=title)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["sim", "vllm"], default="sim")
    parser.add_argument("--max-seqs", type=int, help="the worker's sequences (default: sim 8, vLLM 32)")
    parser.add_argument("--quiet-requests", type=int, default=15, help="quiet's requests alone and beside each burst")
    parser.add_argument("--quiet-tokens", type=int, default=16)
    parser.add_argument("--burst", type=int, default=64, help="noisy's streams (sim)")
    parser.add_argument("--noisy-tokens", type=int, help="tokens of noisy's answers (default: sim 64, vLLM 32)")
    parser.add_argument("--streams", type=int, default=24, help="shares: requests in flight per tenant")
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--window-s", type=float, default=20.0)
    parser.add_argument("--picture", type=Path, help="write the burst's TTFT over time here (SVG)")
    parser.add_argument(
        "--fair-only", action="store_true", help="no FIFO half (on vLLM it takes most of the run); no --picture"
    )
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    args = parser.parse_args()
    args.max_seqs = args.max_seqs or (8 if args.engine == "sim" else 32)
    args.noisy_tokens = args.noisy_tokens or (64 if args.engine == "sim" else VLLM_NOISY_TOKENS)

    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = run(args)
    load_after = os.getloadavg()

    print(f"\n$ {shlex.join(['benchmarks/fairness.py', *sys.argv[1:]])}")
    settings = {k: v for k, v in worker_env(args).items() if k != "AXON_MODEL_PATH"}
    print(f"{started}; {os.cpu_count()} CPUs; worker: {' '.join(f'{k}={v}' for k, v in settings.items())}")
    print(
        "load average (1, 5, 15 min) at the start "
        + " ".join(f"{v:.2f}" for v in load_before)
        + ", at the end "
        + " ".join(f"{v:.2f}" for v in load_after)
    )
    verdicts = report_burst(results["burst"], args, args.engine)
    if results["shares"]:
        verdicts += report_shares(results["shares"], args)
    if args.picture:
        args.picture.write_text(picture(results["burst"], args))
        print(f"\npicture: {args.picture}")
    answers = [
        a
        for phases in results["burst"].values()
        for figures in phases.values()
        for tenant in ("quiet", "noisy")
        for a in figures.get(tenant, [])
    ]
    if args.json:
        summary = {
            "burst": {
                mode: {
                    phase: {"started_s": figures.get("started_s", 0.0)}
                    | {tenant: [vars(a) for a in figures[tenant]] for tenant in ("quiet", "noisy") if tenant in figures}
                    for phase, figures in phases.items()
                }
                for mode, phases in results["burst"].items()
            },
            "shares": results["shares"],
            "verdicts": verdicts,
            "load_average": {"start": load_before, "end": load_after},
        }
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    failed = sum(1 for a in answers if a.error) + sum(
        t["errors"] for modes in results["shares"].values() for f in modes.values() for t in f["tenants"].values()
    )
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
