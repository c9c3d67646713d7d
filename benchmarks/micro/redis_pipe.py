"""CPU per Redis command of `shared.redis_pipe.RedisPipe` against redis-py's asyncio client and coredis,
with 100 commands in flight.

    .venv/bin/python benchmarks/micro/redis_pipe.py                 # about 20 s
    .venv/bin/python benchmarks/micro/redis_pipe.py --calls 5000 --command admit

The commands are the two the hot path sends most, with their real scripts and argument shapes:

- `admit`: the gateway's rate-limit check, once per completion request (`shared.ratelimit`'s check
  script by `EVALSHA`: 3 keys, 7 arguments, a 6-element reply). The key's limits are far above the
  load and it has no concurrency limit, so every call is admitted and no lease piles up.
- `publish`: the worker's per-chunk script, once per chunk of every answer
  (`services.worker.chunk_publisher`: `PUBLISH` of the chunk plus its progress record, 3 keys, 11 arguments;
  a job without a chunk log).

Each of the 100 coroutines uses keys of its own (as 100 API keys or 100 jobs would), and the
arguments are built before the clock starts, so what is measured is the client's work: packing,
writing, reading, parsing, handing the reply back. The contenders:

- `redis_pipe`: one `RedisPipe`, as the gateway, session manager and worker each hold one;
  `evalsha(script, keys, args)`.
- `redis-py`: `shared.clients.create_redis`, the project's pooled redis-py client (a blocking
  connection pool of up to 256 connections, per-command timeouts, retries on connection errors),
  as every other Redis call of the project uses it.
- `coredis`: `coredis.Redis.from_url` with its defaults.

The libraries call the script through their script objects (`register_script`), which, like
`RedisPipe.evalsha`, send `EVALSHA` and load the script and retry once if Redis answers `NOSCRIPT`
(a `SCRIPT FLUSH` or a restart meanwhile).

Only this process's CPU is counted (Redis runs in its own). Keys live under `axon_micro_<random>:`
and are deleted at the end.
"""

import argparse
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: `benchmarks.micro` from the repo

import coredis
import orjson

from benchmarks.micro.common import Comparison, Contender, add_arguments, close_all, compare, report, run
from services.worker.chunk_publisher import _PUBLISH_WITH_PROGRESS
from shared.clients import create_redis
from shared.ratelimit import _CHECK, PERIOD_MS
from shared.redis_pipe import Arg, PipeScript, RedisPipe

REDIS_URL = "redis://127.0.0.1:6379/0"
TIMEOUT_S = 5.0
# A key far above the load (as benchmarks/harness.py's), without a concurrency limit; a completion
# charged against its tokens per minute still holds a lease (the record of that charge).
RPM, TPM, MAX_CONCURRENT = 1_000_000_000, 2_000_000_000, 0
COMMANDS = ("admit", "publish")
LABELS = {
    "admit": "admit (the gateway's rate-limit EVALSHA)",
    "publish": "publish (the worker's per-chunk EVALSHA)",
}


def command_arguments(command: str, namespace: str, lanes: int) -> tuple[PipeScript, list[tuple[list[str], list[Arg]]]]:
    """The script and, for each lane, its keys and arguments."""
    if command == "admit":
        calls: list[tuple[list[str], list[Arg]]] = [
            (
                # A key without a token budget: its budget key is named but never touched.
                [f"{namespace}ratelimit:{kind}:key{lane}" for kind in ("rpm", "tpm", "conc", "budget")],
                [RPM, TPM, MAX_CONCURRENT, 42, f"lease{lane}", 600_000, PERIOD_MS, 0, 0, 1],
            )
            for lane in range(lanes)
        ]
        return _CHECK, calls
    chunk = orjson.dumps({"seq": 7, "text": " token", "n_tokens": 1})
    calls = [
        (
            [
                f"{namespace}progress:job{lane}",
                f"{namespace}progress-text:job{lane}",
                f"{namespace}progress-tokens:job{lane}",
            ],
            # No chunk log (0, 0), as for most jobs; then the chunk's token id.
            [f"{namespace}tokens:job{lane}", chunk, 0, 8, 8, 40, " token", 0, 0, 0, 1234],
        )
        for lane in range(lanes)
    ]
    return _PUBLISH_WITH_PROGRESS, calls


async def contenders(script: PipeScript, calls: Sequence[tuple[list[str], list[Arg]]], url: str) -> list[Contender]:
    """The three clients, each calling `script` with the lane's keys and arguments."""
    lanes = len(calls)
    pipe = RedisPipe(url, timeout_s=TIMEOUT_S)
    redis_py = create_redis(url, timeout_s=TIMEOUT_S)
    core: Any = coredis.Redis.from_url(url)
    await core.__aenter__()  # coredis 6 clients are async context managers
    redis_py_script = redis_py.register_script(script.source)
    coredis_script = core.register_script(script.source)

    async def pipe_call(index: int) -> object:
        keys, args = calls[index % lanes]
        return await pipe.evalsha(script, keys, args)

    async def redis_py_call(index: int) -> object:
        keys, args = calls[index % lanes]
        return await redis_py_script(keys=keys, args=args)

    async def coredis_call(index: int) -> object:
        keys, args = calls[index % lanes]
        return await coredis_script(keys=keys, args=args)

    async def close_core() -> None:
        await core.__aexit__(None, None, None)

    return [
        Contender("redis_pipe", pipe_call, pipe.aclose),
        Contender("redis-py", redis_py_call, redis_py.aclose),
        Contender("coredis", coredis_call, close_core),
    ]


async def delete_namespace(url: str, namespace: str) -> int:
    """Delete every key under `namespace`; returns how many there were."""
    client = create_redis(url, timeout_s=TIMEOUT_S)
    deleted = 0
    try:
        batch: list[bytes] = []
        async for key in client.scan_iter(match=f"{namespace}*", count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                deleted += await client.unlink(*batch)
                batch = []
        if batch:
            deleted += await client.unlink(*batch)
    finally:
        await client.aclose()
    return deleted


async def bench(args: argparse.Namespace) -> list[Comparison]:
    comparisons = []
    try:
        for command in args.command:
            script, calls = command_arguments(command, args.namespace, args.concurrency)
            clients = await contenders(script, calls, args.url)
            try:
                replies = [await client.call(0) for client in clients]  # also loads the script
                shapes = {(type(reply), len(reply) if isinstance(reply, list) else reply) for reply in replies}
                if len(shapes) != 1:
                    raise RuntimeError(f"the clients disagree on {command}'s reply: {replies!r}")
                comparisons.append(await compare(LABELS[command], clients, args))
            finally:
                await close_all(clients)
    finally:
        await delete_namespace(args.url, args.namespace)
    return comparisons


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Run the benchmark and print its report; returns CPU µs per call by comparison and client."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser, calls=40_000, warmup=2_000)
    parser.add_argument("--command", nargs="+", choices=COMMANDS, default=list(COMMANDS), help="commands to measure")
    parser.add_argument("--url", default=REDIS_URL, help="Redis URL (default %(default)s)")
    parser.add_argument("--namespace", default=f"axon_micro_{secrets.token_hex(4)}:", help="key prefix")
    args = parser.parse_args(argv)
    comparisons = run(bench(args), args.loop)
    report(
        "Redis: the hot path's commands through RedisPipe, redis-py and coredis",
        args,
        ["redis", "hiredis", "coredis"],
        comparisons,
    )
    return {comparison.label: comparison.as_dict() for comparison in comparisons}


if __name__ == "__main__":
    main()
