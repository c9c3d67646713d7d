"""`axon bench`'s command line: its options, and the run from parsed arguments (warm-up, the
measured requests, Ctrl+C, the summary printed and written)."""

import argparse
import asyncio
import math
import os
import signal
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from services.cli.bench.client import (
    CLOSE_TIMEOUT_S,
    Poster,
    RunOutcome,
    http_error,
    make_poster,
    request_headers,
    run_requests,
)
from services.cli.bench.report import ProgressBar, render_summary, write_json
from services.cli.bench.stats import distinct_errors, summarize
from services.cli.bench.workload import (
    DEFAULT_BASE_URL,
    DEFAULT_SYNTHETIC_REQUESTS,
    BenchConfig,
    PromptEntry,
    PromptsFileError,
    arrival_offsets_s,
    build_bodies,
    load_prompts_file,
    synthetic_prompts,
)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


_EPILOG = """\
Metrics: TTFT = send to first non-empty content (or tool-call piece); TPOT = (E2E - TTFT) / (output tokens - 1), per
request; ITL = gap between consecutive content-bearing events (an event may carry several tokens);
E2E = send to last byte. Output tokens come from the final usage chunk (stream_options.include_usage
is sent), else one per content event. Throughputs count completed requests only, over the
benchmark's duration. Exit status: 0 when every request succeeded, 1 when any failed, 130 when
interrupted with Ctrl+C (the figures measured so far are still printed and written).
"""


def add_bench_command(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    """Register `axon bench` on the CLI's subparsers and return its parser."""
    bench = commands.add_parser(
        "bench",
        help="load-test an OpenAI-compatible server and report latency and throughput",
        description="Load-test any OpenAI-compatible server (an Axon gateway, vLLM, ...) and report\n"
        "TTFT, TPOT, ITL and end-to-end latency (mean/p50/p90/p99), throughput and errors.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    target = bench.add_argument_group("target")
    target.add_argument(
        "--base-url", default=DEFAULT_BASE_URL, help="OpenAI-compatible base URL (default: %(default)s)"
    )
    target.add_argument(
        "--api-key",
        default=default_api_key(os.environ),
        help="bearer API key (default: $AXON_API_KEY, else $OPENAI_API_KEY, else 'unused')",
    )
    target.add_argument("--model", help="model name (default: the first model GET /models lists)")
    target.add_argument(
        "--endpoint",
        choices=("chat", "completions", "messages"),
        default="chat",
        help="/chat/completions, /completions or /messages (Anthropic's Messages API) (default: %(default)s)",
    )
    load = bench.add_argument_group("load")
    load.add_argument(
        "--num-requests",
        type=_positive_int,
        help="requests to measure (default: one per line of --prompts-file, "
        f"else {DEFAULT_SYNTHETIC_REQUESTS}); "
        "prompts are reused in turn when there are fewer",
    )
    load.add_argument(
        "--max-concurrency",
        type=_positive_int,
        help="most requests in flight at once, also the connection pool size (default: no limit)",
    )
    load.add_argument(
        "--request-rate",
        type=_positive_float,
        default=math.inf,
        help="mean requests/s, Poisson arrivals; 'inf' sends all at once (default: inf)",
    )
    load.add_argument(
        "--warmup",
        type=_non_negative_int,
        default=0,
        help="requests sent first and not measured (default: %(default)s)",
    )
    load.add_argument(
        "--seed", type=int, default=0, help="seed for synthetic prompts and arrival times (default: %(default)s)"
    )
    load.add_argument(
        "--timeout-s",
        type=_positive_float,
        default=300.0,
        help="deadline for each request, send to last byte (default: %(default)s)",
    )
    work = bench.add_argument_group("workload")
    work.add_argument(
        "--input-len",
        type=_positive_int,
        default=128,
        help="words per synthetic prompt, about one token each (default: %(default)s)",
    )
    work.add_argument(
        "--output-len",
        type=_positive_int,
        default=128,
        help="max_tokens per request unless the prompts file sets it (default: %(default)s)",
    )
    work.add_argument(
        "--prompts-file",
        metavar="JSONL",
        help='one {"prompt": "..."} or {"messages": [...]} object per line, optional "max_tokens" and '
        'any other request field ("tools", "response_format", ...); replaces the synthetic prompts',
    )
    work.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stream the answers as server-sent events (default: stream); without streaming, "
        "TTFT is the whole latency and there is no TPOT/ITL",
    )
    work.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: %(default)s)")
    out = bench.add_argument_group("output")
    out.add_argument(
        "--json", metavar="PATH", help="write every summary figure and the configuration to this JSON file"
    )
    out.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="show a progress bar on stderr (default: on)",
    )
    bench.set_defaults(func=bench_command)
    return bench


def default_api_key(environ: Mapping[str, str]) -> str:
    """`--api-key` when none is given: `AXON_API_KEY` (the key `axon up` prints), else
    `OPENAI_API_KEY` (another OpenAI-compatible server's), else `unused` (a server that takes none)."""
    return environ.get("AXON_API_KEY") or environ.get("OPENAI_API_KEY") or "unused"


def bench_command(args: argparse.Namespace) -> int:
    """Run `axon bench` from parsed arguments; returns the exit status."""
    from rich.console import Console

    err = Console(stderr=True)
    try:
        entries = load_prompts_file(args.prompts_file) if args.prompts_file else None
    except (OSError, PromptsFileError) as exc:
        _say(f"{exc}")
        return 2
    num_requests = args.num_requests or (len(entries) if entries else DEFAULT_SYNTHETIC_REQUESTS)
    _raise_open_files_limit((args.max_concurrency or num_requests + args.warmup) + 64)
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            return runner.run(_bench_main(args, entries, num_requests, err))
    except PromptsFileError as exc:
        _say(f"{exc}")
        return 2
    except (KeyboardInterrupt, asyncio.CancelledError):
        _say("interrupted")
        return 130


def _raise_open_files_limit(needed: int) -> None:
    """One socket per request in flight: lift the soft descriptor limit towards the hard one."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < needed:
            target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, ValueError, OSError):  # not POSIX, or not allowed: sockets fail visibly later
        pass


def _say(message: str) -> None:
    print(f"axon bench: {message}", file=sys.stderr, flush=True)


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


async def _bench_main(args: argparse.Namespace, entries: list[PromptEntry] | None, num_requests: int, err: Any) -> int:
    from rich.console import Console

    config = BenchConfig(
        base_url=args.base_url,
        model=args.model or "",
        endpoint=args.endpoint,
        num_requests=num_requests,
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        input_len=args.input_len,
        output_len=args.output_len,
        prompts_file=args.prompts_file,
        stream=args.stream,
        seed=args.seed,
        temperature=args.temperature,
        timeout_s=args.timeout_s,
        warmup=args.warmup,
    )
    stop = asyncio.Event()
    with _stop_on_sigint(stop):
        if not config.model:
            try:
                model = await first_model(config.base_url, api_key=args.api_key, timeout_s=min(config.timeout_s, 30.0))
            except ModelsRefused as exc:
                _say(f"{exc} (give the key with --api-key or export AXON_API_KEY)")
                return 2
            if model is None:
                _say(f"no --model given and none listed at {config.base_url.rstrip('/')}/models")
                return 2
            config = replace(config, model=model)
        count = config.warmup + num_requests
        entries = entries or synthetic_prompts(count, input_len=config.input_len, seed=config.seed)
        bodies = build_bodies(config, entries, count)
        progress = ProgressBar(err, total=num_requests, enabled=args.progress)
        poster = make_poster(config, api_key=args.api_key)
        try:
            outcome = await _warm_up_and_measure(poster, config, bodies, stop=stop, progress=progress)
        finally:
            await asyncio.wait_for(poster.aclose(), CLOSE_TIMEOUT_S)
    summary = summarize(outcome, config)
    render_summary(summary, Console())
    if args.json:
        write_json(summary, args.json)
        _say(f"results written to {args.json}")
    if outcome.interrupted:
        return 130
    return 0 if summary["requests"]["failed"] == 0 else 1


async def _warm_up_and_measure(
    poster: Poster, config: BenchConfig, bodies: list[bytes], *, stop: asyncio.Event, progress: "ProgressBar"
) -> RunOutcome:
    warmup, measured = bodies[: config.warmup], bodies[config.warmup :]
    if warmup:
        _say(f"{len(warmup)} warm-up request(s)...")
        warm = await run_requests(poster, config, warmup, stop=stop)
        if errors := distinct_errors(warm.results, limit=1):
            failed = sum(not r.ok for r in warm.results)
            _say(f"{failed} warm-up request(s) failed, first: {errors[0]['message']}")
    if stop.is_set():
        return RunOutcome(results=[], duration_s=0.0, interrupted=True)
    offsets_s = arrival_offsets_s(len(measured), request_rate=config.request_rate, seed=config.seed)
    with progress as on_done:
        return await run_requests(poster, config, measured, offsets_s=offsets_s, on_done=on_done, stop=stop)


class ModelsRefused(Exception):
    """`GET /models` answered 401 or 403: the key is missing, wrong or not allowed."""


async def first_model(base_url: str, *, api_key: str, timeout_s: float) -> str | None:
    """The first model id that `GET {base_url}/models` lists, or None.

    Raises:
        ModelsRefused: the server refused the key (401 or 403), with its status and message.
    """
    import httpx

    url = base_url.rstrip("/") + "/models"
    try:
        async with httpx.AsyncClient(headers=request_headers(api_key), timeout=timeout_s, trust_env=False) as client:
            response = await client.get(url)
            if response.status_code in (401, 403):
                raise ModelsRefused(
                    f"GET {url} refused the API key: {http_error(response.status_code, response.content)}"
                )
            data = response.json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return data[0].get("id") if data and isinstance(data[0], dict) else None


@contextmanager
def _stop_on_sigint(stop: asyncio.Event) -> Iterator[None]:
    """First Ctrl+C: stop and report what was measured. Second: cancel everything at once."""
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()

    def handler() -> None:
        if stop.is_set() and main_task is not None:
            main_task.cancel()
        stop.set()

    try:
        loop.add_signal_handler(signal.SIGINT, handler)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
        yield
        return
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGINT)
