"""`axon bench`: a load generator for any OpenAI-compatible server, in the spirit of `vllm bench serve`.

It sends `--num-requests` chat or text completions at a Poisson `--request-rate` with at most
`--max-concurrency` in flight, and reports time to first token (TTFT), time per output token
(TPOT), inter-token latency (ITL) and end-to-end latency (E2E), request and output-token
throughput and errors.

The measuring client is deliberately lean so that it is not the bottleneck at tens of thousands of
tokens/s on a small machine: request bodies are serialised before the clock starts; plain-http
targets get the small keep-alive client of `shared.http1` (asyncio + httptools' C parser,
body bytes handed over in the socket callback), https targets get httpx; each server-sent event
costs one `orjson.loads` and a few dict look-ups (no pydantic, no openai SDK); uvloop is used when
installed. Measured on 2 cores against a trivial server: about 10 µs of client CPU per event and
50 µs per request on top (benchmarks/README.md has the figures).

The package: `workload` (configuration, prompts, bodies, arrival times), `client` (one request
timed, the SSE parser, the posters, the run), `stats` (percentiles and the summary), `report`
(the table, the JSON, the progress bar) and `command` (the options and the entry point). The names
below are those the CLI, the benchmarks and the tests import.
"""

from services.cli.bench.client import (
    HttpxPoster,
    Poster,
    RequestResult,
    RunOutcome,
    StreamParser,
    error_message,
    http_error,
    make_poster,
    request_headers,
    run_requests,
    send_one,
)
from services.cli.bench.command import add_bench_command, bench_command, first_model
from services.cli.bench.report import render_summary, write_json
from services.cli.bench.stats import distinct_errors, distribution_ms, percentile, summarize, tpot_s
from services.cli.bench.workload import (
    DEFAULT_BASE_URL,
    DEFAULT_SYNTHETIC_REQUESTS,
    BenchConfig,
    Endpoint,
    PromptEntry,
    PromptsFileError,
    arrival_offsets_s,
    build_bodies,
    load_prompts_file,
    synthetic_prompts,
)

__all__ = [
    "DEFAULT_BASE_URL",
    "DEFAULT_SYNTHETIC_REQUESTS",
    "BenchConfig",
    "Endpoint",
    "HttpxPoster",
    "Poster",
    "PromptEntry",
    "PromptsFileError",
    "RequestResult",
    "RunOutcome",
    "StreamParser",
    "add_bench_command",
    "arrival_offsets_s",
    "bench_command",
    "build_bodies",
    "distinct_errors",
    "distribution_ms",
    "error_message",
    "first_model",
    "http_error",
    "load_prompts_file",
    "make_poster",
    "percentile",
    "render_summary",
    "request_headers",
    "run_requests",
    "send_one",
    "summarize",
    "synthetic_prompts",
    "tpot_s",
    "write_json",
]
