"""What the micro-benchmarks share: the command-line options, the N-in-flight driver, CPU timing in
interleaved rounds, and the report (a table and one summary line per comparison).

Every figure is CPU time of this process (`time.process_time()`: user + system, all threads) per
call, so whatever runs in another process (Redis, the upstream HTTP server) is not counted, and
other jobs on the machine slow the wall clock but hardly the CPU figure. The contenders of one
comparison are measured in the same run, in rounds that alternate their order (A B C, C B A, ...),
so drift between rounds falls on all of them; each contender's figure is the median of its rounds.
"""

import argparse
import asyncio
import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TypeVar

T = TypeVar("T")

TIMES = "\N{MULTIPLICATION SIGN}"

Call = Callable[[int], Awaitable[object]]
"""One call of the operation measured; its argument is the call's index (0, 1, 2, ...)."""


@dataclass
class Contender:
    """One client (or route) measured: `call(i)` does one call; `close()` releases what it holds."""

    name: str
    call: Call
    close: Callable[[], Awaitable[None]] | None = None


@dataclass
class Figures:
    """One contender's rounds: CPU seconds (and how much of it in the garbage collector), wall
    seconds and calls of each."""

    name: str
    cpu_s: list[float] = field(default_factory=list)
    gc_s: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)

    @property
    def per_round_us(self) -> list[float]:
        return [cpu / calls * 1e6 for cpu, calls in zip(self.cpu_s, self.calls, strict=True)]

    @property
    def cpu_us_per_call(self) -> float:
        """The median over the rounds of CPU µs per call."""
        return statistics.median(self.per_round_us)

    @property
    def gc_us_per_call(self) -> float:
        """The median over the rounds of CPU µs per call spent collecting garbage (included above)."""
        return statistics.median(gc / calls * 1e6 for gc, calls in zip(self.gc_s, self.calls, strict=True))

    @property
    def calls_per_s(self) -> float:
        return sum(self.calls) / sum(self.wall_s)


@dataclass
class Comparison:
    """The contenders of one comparison; the first is the project's own fast path (the baseline)."""

    label: str
    figures: list[Figures]

    def as_dict(self) -> dict[str, float]:
        return {figures.name: figures.cpu_us_per_call for figures in self.figures}


def add_arguments(parser: argparse.ArgumentParser, *, calls: int, warmup: int) -> None:
    """The options every micro-benchmark takes."""
    parser.add_argument("--calls", type=int, default=calls, help="calls measured per contender (default %(default)s)")
    parser.add_argument("--concurrency", type=int, default=100, help="calls in flight (default %(default)s)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds the calls are split into, alternating order (default %(default)s)"
    )
    parser.add_argument(
        "--warmup", type=int, default=warmup, help="unmeasured calls per contender first (default %(default)s)"
    )
    parser.add_argument(
        "--loop",
        choices=("uvloop", "asyncio"),
        default="uvloop",
        help="event loop; the services run on uvloop (uvicorn's default) (default %(default)s)",
    )


def run(main: Coroutine[Any, Any, T], loop: str) -> T:
    """Run `main` on a fresh event loop of the kind asked for."""
    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    if loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


async def in_flight(call: Call, calls: int, concurrency: int) -> None:
    """`calls` calls, `concurrency` of them in flight at any time: that many coroutines, each
    starting the next call as soon as its previous one is done."""
    indexes = iter(range(calls))

    async def lane() -> None:
        for index in indexes:  # shared: each lane takes the next index
            await call(index)

    await asyncio.gather(*(lane() for _ in range(max(1, min(concurrency, calls)))))


class GcClock:
    """CPU seconds spent in the cyclic garbage collector while installed (`gc.callbacks`)."""

    def __init__(self) -> None:
        self.cpu_s = 0.0
        self._started = 0.0

    def __call__(self, phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.process_time()
        else:
            self.cpu_s += time.process_time() - self._started

    def __enter__(self) -> "GcClock":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *_exc: object) -> None:
        gc.callbacks.remove(self)


async def measure(call: Call, calls: int, concurrency: int) -> tuple[float, float, float]:
    """CPU seconds, of which in the garbage collector, and wall seconds of `calls` calls with
    `concurrency` in flight."""
    gc.collect()
    with GcClock() as gc_clock:
        wall, cpu = time.perf_counter(), time.process_time()
        await in_flight(call, calls, concurrency)
        cpu_s, wall_s = time.process_time() - cpu, time.perf_counter() - wall
    return cpu_s, gc_clock.cpu_s, wall_s


async def compare(label: str, contenders: Sequence[Contender], args: argparse.Namespace) -> Comparison:
    """Warm every contender up, then measure `args.calls` calls of each in `args.rounds` rounds
    that alternate the order. Before each measured round a contender makes `concurrency`
    unmeasured calls, so its connections are open and warm whatever the others did meanwhile."""
    rounds = max(1, args.rounds)
    per_round = max(1, args.calls // rounds)
    for contender in contenders:
        await in_flight(contender.call, max(args.warmup, args.concurrency), args.concurrency)
    figures = [Figures(contender.name) for contender in contenders]
    for round_ in range(rounds):
        order = list(range(len(contenders)))
        if round_ % 2:
            order.reverse()
        for index in order:
            contender = contenders[index]
            await in_flight(contender.call, args.concurrency, args.concurrency)
            cpu_s, gc_s, wall_s = await measure(contender.call, per_round, args.concurrency)
            figures[index].cpu_s.append(cpu_s)
            figures[index].gc_s.append(gc_s)
            figures[index].wall_s.append(wall_s)
            figures[index].calls.append(per_round)
    return Comparison(label, figures)


async def close_all(contenders: Sequence[Contender]) -> None:
    for contender in contenders:
        if contender.close is not None:
            await contender.close()


def header(title: str, args: argparse.Namespace, packages: Sequence[str]) -> str:
    """The first lines of a report: what ran, on what."""
    versions = ", ".join(f"{name} {_version(name)}" for name in packages)
    return (
        f"{title}\n"
        f"{args.calls} calls per contender in {args.rounds} rounds, {args.concurrency} in flight, "
        f"{args.warmup} warm-up calls; {args.loop} loop; CPU µs per call of this process (median of rounds)\n"
        f"Python {platform.python_version()}, {os.cpu_count()} CPUs; {versions}"
    )


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "?"


def table(comparison: Comparison) -> str:
    """One row per contender: CPU µs per call (median, min and max of its rounds, and the median
    part of it spent in the garbage collector), wall-clock rate, ratio to the baseline."""
    base = comparison.figures[0].cpu_us_per_call
    width = max(len(figures.name) for figures in comparison.figures) + 2
    lines = [
        f"{comparison.label}",
        f"  {'contender':<{width}}{'calls':>8}{'CPU µs/call':>13}{'min':>9}{'max':>9}{'of it GC':>10}"
        f"{'calls/s':>10}{'ratio':>8}",
    ]
    for figures in comparison.figures:
        rounds = figures.per_round_us
        lines.append(
            f"  {figures.name:<{width}}{sum(figures.calls):>8}{figures.cpu_us_per_call:>13.1f}"
            f"{min(rounds):>9.1f}{max(rounds):>9.1f}{figures.gc_us_per_call:>10.1f}{figures.calls_per_s:>10.0f}"
            f"{figures.cpu_us_per_call / base:>7.1f}{TIMES}"
        )
    return "\n".join(lines)


def summary(comparison: Comparison) -> str:
    """`label: baseline 4.1 µs/call; other 41.0 (10.0 times); ...` (with a multiplication sign): each
    other contender's figure and its ratio to the baseline's."""
    base, *others = comparison.figures
    parts = [f"{comparison.label}: {base.name} {base.cpu_us_per_call:.1f} µs/call"]
    parts += [
        f"{figures.name} {figures.cpu_us_per_call:.1f} ({figures.cpu_us_per_call / base.cpu_us_per_call:.1f}{TIMES})"
        for figures in others
    ]
    return "; ".join(parts)


def report(title: str, args: argparse.Namespace, packages: Sequence[str], comparisons: Sequence[Comparison]) -> None:
    """Print the header, a table per comparison, then the summary lines together."""
    print(header(title, args, packages))
    for comparison in comparisons:
        print()
        print(table(comparison))
    print()
    for comparison in comparisons:
        print(summary(comparison))
    sys.stdout.flush()
