"""The Batch API's speed (issue 28), two modes:

    .venv/bin/python benchmarks/batch.py load                     # a 20,000-line batch, about 3 minutes
    .venv/bin/python benchmarks/batch.py load --lines 5000
    .venv/bin/python benchmarks/batch.py load --kill --lines 1000   # about 3 minutes
    .venv/bin/python benchmarks/batch.py load --kill --lines 20000  # about 25 minutes, up to --timeout-s (3600 s)
    .venv/bin/python benchmarks/batch.py validate                 # a 200 MB, 50,000-line file
    .venv/bin/python benchmarks/batch.py validate --lines 10000
    .venv/bin/python benchmarks/batch.py validate --stack         # the same through the services

`load`: the platform (3 `sim` workers of `--max-seqs` sequences each, a session manager and a
gateway, with a database and Redis namespace of their own) measures its capacity first (`axon
bench` at as many streams as the workers have sequences), then sends interactive streamed chat
requests at `--load` (0.5) of that capacity's requests/s (Poisson arrivals), once with no batch
and once while a batch of `--lines` lines waits (uploaded and created through the official
`openai` client, its lines asking as many tokens as the interactive requests). It prints the
interactive TTFT p50 and p99 with the batch over without (the issue: 1.1 at most), the total
output tokens/s while the batch runs (interactive, and the batch's answered lines times their
tokens: the simulator answers each line with exactly its `max_tokens`) over the measured capacity
(the issue: 0.9 at least), and the batch's progress; then cancels the batch.

`load --kill`: two session managers, each with a gateway; the capacity measured as `load` does
through `gateway-0`, then `load`'s interactive load (the same streamed chat bodies and Poisson
arrivals at `--load` of capacity, built by `axon bench`'s functions but sent from this process so
that each request's gateway and outcome are known) started through `gateway-0`, and a batch of
`--lines` lines created through it beside the load. Once `--kill-at` (0.3) of the batch's lines are
answered, `worker-0` and the batch's owner (`sessions-0`, the session manager it was created
through) are SIGKILLed; from then on the interactive requests go through `gateway-1` (the surviving
session manager), and the batch is followed through it until it ends or `--timeout-s` (3600) from
its upload, when the load stops sending (the requests in flight are answered first). It prints:
- the interactive requests in three groups, each with how many were sent, answered OK and failed,
  the OK ones' TTFT p50 and p99, and the failures' distinct errors (HTTP status and message) with
  their counts: those sent before the kill through `gateway-0`; those in flight through the killed
  session manager at the kill (they fail: a 503 from the gateway, or their stream interrupted); those
  sent after the kill through `gateway-1`;
- the batch's total time from its upload to its end (and lines/s);
- every `custom_id` of its output and error files counted: lines lost, duplicated, or not in the
  file (the issue: 0; else the exit status is 1).
Its duration is the batch's: on this 2-core machine 20,000 lines took 25 minutes (about 34 lines/s
before the kill, 10 after it, on the 2 workers left beside the same interactive load);
`--timeout-s` bounds it.

`validate`: in this process, against a database of its own, uploads a file of `--lines` chat lines
(`--prompt-chars` characters of prompt each: 3,900 make 50,000 lines about 200 MB) through the
PostgreSQL file store, then times the batch's validation path stage by stage, each over the whole
file: reading it back in pieces; reading and checking every line (`validation.py`); and the whole
of it as a batch's owner runs it, the valid lines stored in `batch_lines` (one transaction, COPY).
For each stage it prints lines/s and how much this process's peak resident memory grew over what
it held before the stage (the issue: validation at 20,000 lines/s or more, growing less than 64 MB).
`validate --stack` does it as a client does instead, through a gateway and a session manager (and
one sim worker): the file uploaded with the `openai` client, the batch created and polled every
0.1 s until `in_progress`, then cancelled (its unanswered lines written to its error file), with
the session manager's resident memory before, after and at its peak.
"""

import argparse
import asyncio
import datetime as dt
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path

import asyncpg
import openai
import orjson
from capacity import INPUT_LEN, MODEL, run_level
from harness import BenchEnvironment, loop_factory
from openai.types import Batch

from services.cli.bench import (
    BenchConfig,
    RequestResult,
    arrival_offsets_s,
    build_bodies,
    distinct_errors,
    distribution_ms,
    make_poster,
    send_one,
    synthetic_prompts,
)
from services.cli.launcher import Service
from services.sessions.batches.store import BatchRecord, BatchStore
from services.sessions.batches.validation import BatchLine, Validator, numbered_lines
from services.sessions.files.store import DatabaseFileStore, PostgresContent

ENDPOINT = "/v1/chat/completions"
TENANT = "bench"
# The seed of the interactive load's prompts and Poisson arrival times.
SEED = 7
FINAL = ("completed", "failed", "expired", "cancelled")


def rss_mb(field: str = "VmRSS") -> float:
    """This process's resident memory now (`VmRSS`) or at its peak (`VmHWM`), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def reset_peak() -> None:
    """Start counting the peak resident memory again from now (Linux's clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def input_line(number: int, prompt: str) -> bytes:
    return orjson.dumps(
        {
            "custom_id": f"request-{number}",
            "method": "POST",
            "url": ENDPOINT,
            "body": {"model": "sim", "messages": [{"role": "user", "content": prompt}], "max_tokens": 16},
        }
    )


async def file_chunks(lines: int, prompt_chars: int) -> AsyncIterator[bytes]:
    """The file, made as it is uploaded (never whole in memory), in 1 MB chunks."""
    prompt = ("lorem ipsum dolor sit amet " * (prompt_chars // 27 + 1))[:prompt_chars]
    chunk = bytearray()
    for number in range(1, lines + 1):
        chunk += input_line(number, prompt) + b"\n"
        if len(chunk) >= 1024 * 1024:
            yield bytes(chunk)
            chunk.clear()
    if chunk:
        yield bytes(chunk)


async def timed(name: str, lines: int, stage: Callable[[], Awaitable[int]]) -> dict:
    """Run `stage` (it returns how many lines it passed), print and return its figures."""
    before = rss_mb()
    reset_peak()
    started = time.perf_counter()
    counted = await stage()
    elapsed = time.perf_counter() - started
    growth = rss_mb("VmHWM") - before
    print(
        f"{name:<34} {counted:>7} lines {elapsed:>7.2f} s {counted / elapsed:>9.0f} lines/s"
        f"   RSS peak +{growth:.1f} MB",
        flush=True,
    )
    if counted != lines:
        print(f"  expected {lines} lines", flush=True)
    return {"stage": name, "lines": counted, "seconds": elapsed, "lines_per_s": counted / elapsed, "rss_mb": growth}


async def validate(env: BenchEnvironment, args: argparse.Namespace) -> None:
    pool = await asyncpg.create_pool(env.database_url, min_size=2, max_size=4)
    assert pool is not None
    try:
        files = DatabaseFileStore(pool, PostgresContent(pool))
        started = time.perf_counter()
        record = await files.create(
            tenant=TENANT,
            purpose="batch",
            filename="batch.jsonl",
            chunks=file_chunks(args.lines, args.prompt_chars),
            max_bytes=1 << 40,
        )
        print(
            f"uploaded {record.bytes / 1e6:.1f} MB, {args.lines} lines, in {time.perf_counter() - started:.1f} s; "
            f"RSS {rss_mb():.0f} MB",
            flush=True,
        )
        store = BatchStore(pool)

        async def read() -> int:
            count = 0
            async for _number, _raw in numbered_lines(files.read(TENANT, record.id)):
                count += 1
            return count

        def checked() -> tuple[Validator, AsyncIterator[BatchLine]]:
            validator = Validator(endpoint=ENDPOINT, max_lines=args.lines, default_max_tokens=256)

            async def lines() -> AsyncIterator[BatchLine]:
                async for number, raw in numbered_lines(files.read(TENANT, record.id)):
                    line = validator.check(number, raw)
                    if line is not None:
                        yield line
                validator.finish()
                assert not validator.errors, validator.errors[:3]

            return validator, lines()

        async def check() -> int:
            _validator, lines = checked()
            return sum([1 async for _line in lines])

        async def stored() -> int:
            now = dt.datetime.now(dt.UTC)
            batch = BatchRecord(
                id=f"batch_bench{time.monotonic_ns()}",
                tenant=TENANT,
                key_id=None,
                endpoint=ENDPOINT,
                input_file_id=record.id,
                completion_window="24h",
                status="validating",
                metadata=None,
                errors=None,
                output_file_id=None,
                error_file_id=None,
                total=0,
                completed=0,
                failed=0,
                created_at=now,
                expires_at=now + dt.timedelta(days=1),
            )
            await store.create(batch)
            _validator, lines = checked()
            return await store.validated(batch.id, lines, key_id=None, queue_tokens=0)

        for _round in range(args.rounds):
            await timed("read the file (file store)", args.lines, read)
            await timed("read + check every line", args.lines, check)
            await timed("read + check + store (validation)", args.lines, stored)
    finally:
        await pool.close()


def start_platform(env: BenchEnvironment, args: argparse.Namespace, *, sessions: int = 1) -> dict[str, Service]:
    """`--workers` sim workers, `sessions` session managers each with a gateway (`gateway-0` in
    front of `sessions-0`, ...)."""
    env.models.add("sim")
    worker_env = {
        "AXON_ENGINE": "sim",
        "AXON_MODEL": "sim",
        "AXON_SIM_TTFT_MS": str(args.ttft_ms),
        "AXON_SIM_ITL_MS": str(args.itl_ms),
        "AXON_SIM_MAX_SEQS": str(args.max_seqs),
    }
    services = {}
    for index in range(args.workers):
        services[f"worker-{index}"] = env.start_service("worker", env=worker_env, name=f"worker-{index}")
    # The settings' defaults unless given.
    batch_env = {
        name: str(value)
        for name, value in (
            ("AXON_BATCH_LINES_IN_FLIGHT", args.lines_in_flight),
            ("AXON_BATCH_QUEUE_AHEAD", args.queue_ahead),
        )
        if value is not None
    }
    for index in range(sessions):
        manager = env.start_service("sessions", name=f"sessions-{index}", env=batch_env)
        services[f"sessions-{index}"] = manager
        services[f"gateway-{index}"] = env.start_service(
            "gateway", name=f"gateway-{index}", env={"AXON_SESSIONS_URL": manager.url}
        )
    return services


def start_batch(client: openai.OpenAI, args: argparse.Namespace) -> Batch:
    """Upload the batch's file and create the batch; once it is no longer validating."""
    started = time.perf_counter()
    uploaded = client.files.create(file=("batch.jsonl", batch_file(args.lines, args.tokens)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=ENDPOINT, completion_window="24h")
    while batch.status == "validating":
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    print(f"batch of {args.lines} lines {batch.status} {time.perf_counter() - started:.1f} s after the upload began")
    return batch


def batch_file(lines: int, tokens: int) -> bytes:
    return b"".join(
        orjson.dumps(
            {
                "custom_id": f"line-{number}",
                "method": "POST",
                "url": ENDPOINT,
                "body": {
                    "model": "sim",
                    "messages": [{"role": "user", "content": f"Summarise document {number} in a few words."}],
                    "max_tokens": tokens,
                },
            }
        )
        + b"\n"
        for number in range(1, lines + 1)
    )


def interactive(env: BenchEnvironment, url: str, key: str, args: argparse.Namespace, rate: float) -> dict:
    """Interactive streamed requests at `rate` requests/s for about `--phase-s` seconds."""
    requests = max(50, int(rate * args.phase_s))
    level = run_level(
        env,
        url,
        key,
        {},
        concurrency=10_000,
        requests=requests,
        output_tokens=args.tokens,
        warmup=0,
        bench_args=["--request-rate", f"{rate:.2f}", "--seed", str(SEED)],
    )
    return dict(level["summary"])


def measure_capacity(env: BenchEnvironment, url: str, key: str, args: argparse.Namespace) -> dict:
    """`axon bench` at as many streams as the workers have sequences: its summary."""
    seqs = args.workers * args.max_seqs
    print(f"platform ready: {args.workers} sim workers x {args.max_seqs} sequences (logs in {env.log_dir})", flush=True)
    capacity = run_level(
        env, url, key, {}, concurrency=seqs, requests=args.capacity_requests, output_tokens=args.tokens, warmup=seqs
    )["summary"]
    print(
        f"capacity ({seqs} streams, {args.tokens}-token answers): {capacity['request_throughput_rps']:.1f} req/s, "
        f"{capacity['output_token_throughput_tps']:.0f} output tok/s, {capacity['requests']['failed']} errors",
        flush=True,
    )
    return dict(capacity)


def load(env: BenchEnvironment, args: argparse.Namespace) -> int:
    url = start_platform(env, args)["gateway-0"].url
    key = env.create_key()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, timeout=120, max_retries=0)
    capacity = measure_capacity(env, url, key, args)
    capacity_rps, capacity_tps = capacity["request_throughput_rps"], capacity["output_token_throughput_tps"]
    rate = capacity_rps * args.load

    without = interactive(env, url, key, args, rate)
    print(f"without a batch: {rate:.1f} req/s offered, {without['output_token_throughput_tps']:.0f} tok/s", flush=True)

    batch = start_batch(client, args)
    if batch.status != "in_progress":
        print(f"the batch did not start: {batch.errors}")
        return 1
    time.sleep(args.settle_s)

    done_before = client.batches.retrieve(batch.id).request_counts
    phase_started = time.perf_counter()
    with_batch = interactive(env, url, key, args, rate)
    phase_s = time.perf_counter() - phase_started
    done_after = client.batches.retrieve(batch.id).request_counts
    assert done_before is not None and done_after is not None
    answered = (done_after.completed + done_after.failed) - (done_before.completed + done_before.failed)
    batch_tps = (done_after.completed - done_before.completed) * args.tokens / phase_s
    total_tps = batch_tps + with_batch["total_output_tokens"] / phase_s
    client.batches.cancel(batch.id)

    print(f"\n{'interactive':<24} {'req/s':>7} {'tok/s':>7} {'errors':>7} {'TTFT p50':>9} {'TTFT p99':>9}")
    for name, run in (("without a batch", without), ("with the batch", with_batch)):
        print(
            f"{name:<24} {run['request_throughput_rps']:>7.1f} {run['output_token_throughput_tps']:>7.0f} "
            f"{run['requests']['failed']:>7} {run['ttft_ms']['p50']:>9.1f} {run['ttft_ms']['p99']:>9.1f}"
        )
    p50 = with_batch["ttft_ms"]["p50"] / without["ttft_ms"]["p50"]
    p99 = with_batch["ttft_ms"]["p99"] / without["ttft_ms"]["p99"]
    print(f"TTFT with / without the batch: p50 {p50:.2f}, p99 {p99:.2f} (target <= 1.1)")
    print(
        f"while the batch ran ({phase_s:.0f} s): batch {batch_tps:.0f} tok/s ({answered / phase_s:.1f} lines/s), "
        f"total {total_tps:.0f} tok/s = {total_tps / capacity_tps:.2f} x capacity (target >= 0.9)"
    )
    print(
        f"batch progress: {done_after.completed} completed, {done_after.failed} failed of {done_after.total} "
        f"when the interactive load ended; cancelled then"
    )
    return 0


@dataclass
class Sent:
    """One interactive request: the gateway it went through (0: the batch owner's, until the kill)."""

    gateway: int
    answer: "asyncio.Task[RequestResult]"
    # Still in flight through the owner's gateway when its session manager was killed.
    at_kill: bool = False


async def steady_load(
    urls: list[str],
    key: str,
    args: argparse.Namespace,
    rate: float,
    sent: list[Sent],
    *,
    killed: asyncio.Event,
    stop: asyncio.Event,
) -> None:
    """The interactive load of `interactive` (the same bodies and Poisson arrivals, built by `axon
    bench`'s own functions) sent in this process, until `stop`: through `urls[0]` until `killed`, then
    through `urls[1]`; each request's answer awaited to its end (nothing in flight cancelled)."""
    count = int(rate * args.timeout_s) + 1
    config = BenchConfig(
        base_url=urls[0],
        model=MODEL,
        num_requests=count,
        request_rate=rate,
        input_len=INPUT_LEN,
        output_len=args.tokens,
        seed=SEED,
    )
    bodies = build_bodies(config, synthetic_prompts(count, input_len=INPUT_LEN, seed=SEED), count)
    posters = [make_poster(replace(config, base_url=url), api_key=key) for url in urls]
    started = time.perf_counter()
    try:
        for body, offset_s in zip(bodies, arrival_offsets_s(count, request_rate=rate, seed=SEED), strict=True):
            await asyncio.sleep(max(0.0, started + offset_s - time.perf_counter()))
            if stop.is_set():
                break
            gateway = 1 if killed.is_set() else 0
            answer = asyncio.create_task(send_one(posters[gateway], body, stream=True, timeout_s=config.timeout_s))
            sent.append(Sent(gateway, answer))
        if sent:
            await asyncio.wait([request.answer for request in sent])
    finally:
        for poster in posters:
            await poster.aclose()


async def kill_under_load(
    services: dict[str, Service], key: str, args: argparse.Namespace, rate: float, sent: list[Sent]
) -> tuple[Batch | None, float]:
    """The interactive load started, then the batch through `gateway-0`; a worker and the batch's
    owner killed once `--kill-at` of its lines are answered; the batch followed through `gateway-1`
    to its end. The batch as last seen (None: nothing was killed, the batch not in progress or out of
    time first) and its seconds from the upload."""
    urls = [f"{services[f'gateway-{index}'].url}/v1" for index in (0, 1)]
    owner, survivor = (openai.OpenAI(base_url=url, api_key=key, timeout=120, max_retries=0) for url in urls)
    killed, stop = asyncio.Event(), asyncio.Event()
    load = asyncio.create_task(steady_load(urls, key, args, rate, sent, killed=killed, stop=stop))
    started = time.monotonic()
    deadline = started + args.timeout_s
    try:
        batch = await asyncio.to_thread(start_batch, owner, args)
        while batch.request_counts is None or batch.request_counts.completed < args.kill_at * args.lines:
            if time.monotonic() > deadline or batch.status != "in_progress":
                print(f"the batch is {batch.status} with {batch.request_counts}: not killed")
                return None, time.monotonic() - started
            await asyncio.sleep(0.2)
            batch = await asyncio.to_thread(owner.batches.retrieve, batch.id)
        # In one step of the loop: no request is sent between the switch and the kill.
        killed.set()
        for request in sent:
            request.at_kill = request.gateway == 0 and not request.answer.done()
        services["worker-0"].kill()
        services["sessions-0"].kill()
        killed_at = time.monotonic()
        print(
            f"killed worker-0 and the batch's owner (sessions-0) at {batch.request_counts.completed} lines answered, "
            f"{killed_at - started:.1f} s after the upload began; interactive load through gateway-1 from then on",
            flush=True,
        )
        while batch.status not in FINAL and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            batch = await asyncio.to_thread(survivor.batches.retrieve, batch.id)
        print(
            f"batch {batch.status} {time.monotonic() - killed_at:.1f} s after the kill: {batch.request_counts}",
            flush=True,
        )
        return batch, time.monotonic() - started
    finally:
        stop.set()
        await load


def print_outcomes(sent: list[Sent]) -> None:
    """The interactive requests' outcomes: before the kill, in flight through the killed session
    manager, after it."""
    groups = {
        "before the kill (gateway-0)": [request for request in sent if request.gateway == 0 and not request.at_kill],
        "through the killed session manager": [request for request in sent if request.at_kill],
        "after the kill (gateway-1)": [request for request in sent if request.gateway == 1],
    }
    print(f"\n{'interactive requests':<36} {'sent':>6} {'OK':>6} {'failed':>6} {'TTFT p50':>9} {'TTFT p99':>9}")
    for name, group in groups.items():
        results = [request.answer.result() for request in group]
        ttft = distribution_ms(result.ttft_s for result in results if result.ok and result.ttft_s is not None)
        ok = sum(result.ok for result in results)
        p50, p99 = (f"{ttft[q]:.1f}" if ttft[q] is not None else "-" for q in ("p50", "p99"))
        print(f"{name:<36} {len(results):>6} {ok:>6} {len(results) - ok:>6} {p50:>9} {p99:>9}")
        for error in distinct_errors(results):
            print(f"    {error['count']} x {error['message']}")


def kill(env: BenchEnvironment, args: argparse.Namespace) -> int:
    """The interactive load at `--load` of capacity beside a batch whose worker and owner are killed
    mid-run; then the requests' outcomes and every line's output counted."""
    services = start_platform(env, args, sessions=2)
    key = env.create_key()
    rate = measure_capacity(env, services["gateway-0"].url, key, args)["request_throughput_rps"] * args.load
    print(f"interactive load: {rate:.1f} req/s offered (Poisson), streamed", flush=True)
    sent: list[Sent] = []
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        batch, batch_s = runner.run(kill_under_load(services, key, args, rate, sent))
    print_outcomes(sent)
    if batch is None:
        return 1
    answered = batch.request_counts.completed + batch.request_counts.failed if batch.request_counts else 0
    print(
        f"\nbatch {batch.status} {batch_s:.1f} s after its upload began: {answered} of {args.lines} lines answered "
        f"({answered / batch_s:.1f} lines/s)"
    )
    if batch.status not in FINAL:
        print(f"the batch did not end within --timeout-s {args.timeout_s:.0f} s")
        return 1
    survivor = openai.OpenAI(base_url=f"{services['gateway-1'].url}/v1", api_key=key, timeout=120, max_retries=0)
    seen: Counter[str] = Counter()
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id is not None:
            seen.update(
                orjson.loads(line)["custom_id"] for line in survivor.files.content(file_id).content.splitlines()
            )
    expected = {f"line-{number}" for number in range(1, args.lines + 1)}
    lost = len(expected - seen.keys())
    duplicated = sum(1 for count in seen.values() if count > 1)
    foreign = len(seen.keys() - expected)
    print(f"lines lost: {lost}, lines duplicated: {duplicated}, lines not in the file: {foreign} (target 0)")
    return 0 if lost == duplicated == foreign == 0 else 1


def rss_of(pid: int, field: str = "VmRSS") -> float:
    """A process's resident memory now (`VmRSS`) or at its peak (`VmHWM`), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def through_stack(env: BenchEnvironment, args: argparse.Namespace) -> int:
    """The file uploaded, validated and its batch ended through a session manager and a gateway,
    with the session manager's resident memory."""
    args.workers, args.lines_in_flight, args.queue_ahead, args.ttft_ms, args.itl_ms, args.max_seqs = (
        1,
        None,
        None,
        50.0,
        10.0,
        16,
    )
    services = start_platform(env, args)
    sessions = services["sessions-0"].pid
    client = openai.OpenAI(
        base_url=f"{services['gateway-0'].url}/v1", api_key=env.create_key(), timeout=300, max_retries=0
    )
    with tempfile.TemporaryFile() as upload:

        async def write() -> None:
            async for chunk in file_chunks(args.lines, args.prompt_chars):
                upload.write(chunk)

        asyncio.run(write())
        size = upload.tell()
        upload.seek(0)
        before = rss_of(sessions)
        Path(f"/proc/{sessions}/clear_refs").write_text("5")
        started = time.perf_counter()
        uploaded = client.files.create(file=("batch.jsonl", upload), purpose="batch")
    print(f"uploaded {size / 1e6:.1f} MB, {args.lines} lines, in {time.perf_counter() - started:.1f} s", flush=True)
    started = time.perf_counter()
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=ENDPOINT, completion_window="24h")
    while batch.status == "validating":
        time.sleep(0.1)
        batch = client.batches.retrieve(batch.id)
    validated = time.perf_counter() - started
    print(
        f"POST /v1/batches to {batch.status} in {validated:.1f} s ({args.lines / validated:.0f} lines/s, polled every"
        f" 0.1 s); session manager RSS {before:.0f} MB before the upload, {rss_of(sessions):.0f} MB now, peak"
        f" {rss_of(sessions, 'VmHWM'):.0f} MB",
        flush=True,
    )
    started = time.perf_counter()
    batch = client.batches.cancel(batch.id)
    while batch.status == "cancelling":
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    peak = rss_of(sessions, "VmHWM")
    print(
        f"cancelled: {batch.status} in {time.perf_counter() - started:.1f} s, {batch.request_counts}; session manager "
        f"RSS {rss_of(sessions):.0f} MB, peak {peak:.0f} MB (+{peak - before:.0f} MB over before the upload;"
        " the issue: less than 64)",
        flush=True,
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_subparsers(dest="mode", required=True)
    check = modes.add_parser("validate", help="validation speed and memory (no services)")
    check.add_argument("--lines", type=int, default=50_000)
    check.add_argument("--prompt-chars", type=int, default=3_900, help="characters of each line's prompt")
    check.add_argument("--rounds", type=int, default=1, help="times each stage is run")
    check.add_argument(
        "--stack", action="store_true", help="instead: through a gateway and a session manager, with the latter's RSS"
    )
    run = modes.add_parser("load", help="interactive TTFT and total throughput with and without a batch")
    run.add_argument("--lines", type=int, default=20_000, help="the batch's lines")
    run.add_argument("--workers", type=int, default=3)
    run.add_argument("--max-seqs", type=int, default=16, help="each sim worker's AXON_SIM_MAX_SEQS")
    run.add_argument("--ttft-ms", type=float, default=50.0, help="AXON_SIM_TTFT_MS")
    run.add_argument("--itl-ms", type=float, default=20.0, help="AXON_SIM_ITL_MS")
    run.add_argument("--tokens", type=int, default=32, help="tokens each request and line asks (max_tokens)")
    run.add_argument("--lines-in-flight", type=int, help="AXON_BATCH_LINES_IN_FLIGHT (its default)")
    run.add_argument("--queue-ahead", type=int, help="AXON_BATCH_QUEUE_AHEAD (its default)")
    run.add_argument("--load", type=float, default=0.5, help="interactive requests/s as a share of capacity's")
    run.add_argument("--capacity-requests", type=int, default=1500)
    run.add_argument("--phase-s", type=float, default=40.0, help="seconds of interactive load in each phase")
    run.add_argument("--settle-s", type=float, default=3.0, help="wait after the batch starts before measuring")
    run.add_argument("--kill", action="store_true", help="instead: kill a worker and the batch's owner mid-run")
    run.add_argument("--kill-at", type=float, default=0.3, help="with --kill: the share of lines answered first")
    run.add_argument(
        "--timeout-s", type=float, default=3600.0, help="with --kill: the most to wait for the batch, from its upload"
    )
    args = parser.parse_args()
    with BenchEnvironment() as env:
        if args.mode == "load":
            return kill(env, args) if args.kill else load(env, args)
        if args.stack:
            return through_stack(env, args)
        print(f"RSS at start {rss_mb():.0f} MB", flush=True)
        asyncio.run(validate(env, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
