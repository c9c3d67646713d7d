"""The Batch API's speed (issue 28), two modes:

    .venv/bin/python benchmarks/batch.py validate                 # a 200 MB, 50,000-line file
    .venv/bin/python benchmarks/batch.py validate --lines 10000

`validate`: in this process, against a database of its own, uploads a file of `--lines` chat lines
(`--prompt-chars` characters of prompt each: 3,900 make 50,000 lines about 200 MB) through the
PostgreSQL file store, then times the batch's validation path stage by stage, each over the whole
file: reading it back in pieces; reading and checking every line (`validation.py`); and the whole
of it as a batch's owner runs it, the valid lines stored in `batch_lines` (one transaction, COPY).
For each stage it prints lines/s and how much this process's peak resident memory grew over what
it held before the stage (the issue: validation at 20,000 lines/s or more, growing less than 64 MB).
"""

import argparse
import asyncio
import datetime as dt
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import asyncpg
import orjson
from harness import BenchEnvironment

from services.sessions.batches.store import BatchRecord, BatchStore
from services.sessions.batches.validation import BatchLine, Validator, numbered_lines
from services.sessions.files.store import DatabaseFileStore, PostgresContent

ENDPOINT = "/v1/chat/completions"
TENANT = "bench"


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_subparsers(dest="mode", required=True)
    check = modes.add_parser("validate", help="validation speed and memory (no services)")
    check.add_argument("--lines", type=int, default=50_000)
    check.add_argument("--prompt-chars", type=int, default=3_900, help="characters of each line's prompt")
    check.add_argument("--rounds", type=int, default=1, help="times each stage is run")
    args = parser.parse_args()
    with BenchEnvironment() as env:
        print(f"RSS at start {rss_mb():.0f} MB", flush=True)
        asyncio.run(validate(env, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
