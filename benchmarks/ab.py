"""A/B of the hot path between two commits: each checked out into a temporary git worktree and
measured by its own `benchmarks/engine_vs_stack.py` and `benchmarks/capacity.py`, the two trees
alternating, for `--rounds` rounds; prints every round's figures of both trees, each tree's mean,
min and max, and head against base, under the command line, the two commits and the date.

    .venv/bin/python benchmarks/ab.py df8ece0 4dd1cf1                      # 3 rounds, about 5 minutes
    .venv/bin/python benchmarks/ab.py BASE HEAD --rounds 5 --benchmarks capacity \\
        --capacity-args="--workload both --concurrency 64 128 256"

Each tree runs with this interpreter (`--python`, default the one running this script: one
virtualenv for both), `PYTHONPATH` set to the tree and the tree as the working directory, so its
own scripts, harness and services are what run (each benchmark starts its platform from the code
it is run with). Round 1 runs base then head, round 2 head then base, and so on, each benchmark in
turn. Arguments after `--engine-vs-stack-args=` and `--capacity-args=` go to every run of that
script (defaults: the simulator at 64 streams; the requests workload at 64 and 128 streams).

The figures are read from what the scripts print, the same lines at every commit since 42ee1e9
(the first with capacity.py; older ones have no figures for it): for engine_vs_stack the
throughput ratio stack/direct, the TTFT and ITL the stack adds, the stack's output tokens/s and
the CPU milliseconds per generated token of the three services (together and each) and of the
direct engine (printed since issue 40; an older commit's are shown as `-`); for
capacity, per workload, the requests/s and output tokens/s at the best level with zero errors and
the CPU milliseconds per request of all processes and of the gateway, the session manager and the
worker. Each run's output is kept in `--output-dir` (default:
a new folder under the system's temporary folder, named on stderr at the end); the load average
before each run is printed with its figures, since other work on the machine moves them; with
`--max-load`, each run first waits (at most `--max-wait-s`) for the load average to fall that low.

`head vs base` is the ratio of the means (head / base), or, for a figure that is already a
difference (TTFT added, ITL added), head's mean minus base's.
"""

import argparse
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

DEFAULT_ENGINE_VS_STACK_ARGS = "--engine sim"
DEFAULT_CAPACITY_ARGS = "--workload requests --concurrency 64 128 --requests 4000"
BENCHMARKS = ("engine_vs_stack", "capacity")
PROCESSES = ("gateway", "sessions", "worker")
_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|nan|inf)"


class ParseError(ValueError):
    """A benchmark's output has none of the lines its figures are read from."""


# --------------------------------------------------------------------------------------------
# Reading the scripts' output
# --------------------------------------------------------------------------------------------


def parse_engine_vs_stack(text: str) -> dict[str, float]:
    """The figures of one `engine_vs_stack.py` run from what it printed (the last report in it).

    Raises:
        ParseError: the output has no report.
    """
    figures: dict[str, float] = {}
    row = re.compile(
        rf"^(direct engine|full stack)\s+(\d+)\s+(\d+)\s+(\d+)\s+({_NUMBER})\s+({_NUMBER})\s+({_NUMBER})\s+"
        rf"({_NUMBER})\s+({_NUMBER})\s*$"
    )
    for line in text.splitlines():
        if match := row.match(line):
            side = "direct" if match[1] == "direct engine" else "stack"
            figures[f"{side}_errors"] = float(match[3])
            figures[f"{side}_ttft_p50_ms"] = float(match[5])
            figures[f"{side}_ttft_p99_ms"] = float(match[6])
            figures[f"{side}_itl_p50_ms"] = float(match[7])
            figures[f"{side}_tok_s"] = float(match[9])
        elif match := re.match(rf"^stack/direct output tok/s = ({_NUMBER})", line):
            figures["ratio"] = float(match[1])
        elif match := re.match(rf"^TTFT added: p50 ({_NUMBER}) ms .*p99 ({_NUMBER}) ms", line):
            figures["ttft_added_p50_ms"] = float(match[1])
            figures["ttft_added_p99_ms"] = float(match[2])
        elif match := re.match(rf"^ITL added: p50 ({_NUMBER}) ms", line):
            figures["itl_added_p50_ms"] = float(match[1])
        elif match := re.match(r"^CPU ms per generated token: (.*)$", line):
            figures |= _cpu_per_token(match[1])
    needed = {"ratio", "ttft_added_p50_ms", "ttft_added_p99_ms", "itl_added_p50_ms", "stack_tok_s"}
    if missing := sorted(needed - figures.keys()):
        raise ParseError(f"engine_vs_stack output lacks {', '.join(missing)}")
    return figures


def _cpu_per_token(text: str) -> dict[str, float]:
    """`cpu_ms_per_token.<process>` of each `<process> <ms>` of the CPU line, the three services'
    sum as `cpu_ms_per_token.services`, the direct side's as `cpu_ms_per_token.direct_engine`."""
    figures = {}
    for part in re.split(r"[;,]", text):
        part = part.strip().removeprefix("full stack: ").removeprefix("beside them ").removeprefix("the three ")
        if match := re.match(rf"^(.+?) ({_NUMBER})(?: \(.*\))?$", part):
            figures[f"cpu_ms_per_token.{match[1].replace(' ', '_')}"] = float(match[2])
    return figures


def parse_capacity(text: str) -> dict[str, float]:
    """The figures of one `capacity.py` run from what it printed: per workload (`requests`,
    `tokens`), `<workload>.rps` and `<workload>.tps` at the best level with zero errors,
    `<workload>.cpu_ms` (all processes) and `<workload>.cpu_ms.<process>` per request at the level
    of the best requests/s, and `<workload>.answer_tokens`. A workload with no clean level has
    only its answer length.

    Raises:
        ParseError: the output has no workload's report.
    """
    figures: dict[str, float] = {}
    workload: str | None = None
    for line in text.splitlines():
        if match := re.match(r"^(\w+): (\d+)-token answers, streamed\s*$", line):
            workload = match[1]
            figures[f"{workload}.answer_tokens"] = float(match[2])
        elif workload is None:
            continue
        elif match := re.match(
            rf"^capacity with zero errors: ({_NUMBER}) req/s \((\d+) streams\), ({_NUMBER}) output tok/s", line
        ):
            figures[f"{workload}.rps"] = float(match[1])
            figures[f"{workload}.tps"] = float(match[3])
        elif match := re.match(rf"^CPU ms per request at that level: (.*), total ({_NUMBER})\s*$", line):
            figures[f"{workload}.cpu_ms"] = float(match[2])
            for part in match[1].split(", "):
                name, _, value = part.rpartition(" ")
                figures[f"{workload}.cpu_ms.{name}"] = float(value)
    if workload is None:
        raise ParseError("capacity output has no workload's report")
    return figures


def capacity_workloads(figures: dict[str, float]) -> list[tuple[str, int]]:
    """The workloads a capacity run reported, in order, with their answer length in tokens."""
    return [(key.split(".")[0], int(value)) for key, value in figures.items() if key.endswith(".answer_tokens")]


# --------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Figure:
    """One row pair of a table: `key` in the parsed figures, shown with `digits` decimals; a
    `difference` compares trees by subtraction instead of a ratio, and is shown signed."""

    key: str
    label: str
    digits: int
    difference: bool = False

    def show(self, value: float) -> str:
        if math.isnan(value):
            return "nan"
        return f"{value:+.{self.digits}f}" if self.difference else f"{value:,.{self.digits}f}"


ENGINE_VS_STACK_FIGURES = (
    Figure("ratio", "stack/direct output tok/s", 3),
    Figure("ttft_added_p50_ms", "TTFT added p50 (ms)", 1, difference=True),
    Figure("ttft_added_p99_ms", "TTFT added p99 (ms)", 1, difference=True),
    Figure("itl_added_p50_ms", "ITL added p50 (ms)", 2, difference=True),
    Figure("stack_tok_s", "full stack output tok/s", 1),
    Figure("cpu_ms_per_token.services", "CPU ms per token, 3 services", 4),
    *(Figure(f"cpu_ms_per_token.{p}", f"  of it {p}", 4) for p in PROCESSES),
    Figure("cpu_ms_per_token.direct_engine", "CPU ms per token, direct", 4),
)


def capacity_figures(workloads: Sequence[tuple[str, int]]) -> list[Figure]:
    figures = []
    for name, tokens in workloads:
        figures += [
            Figure(f"{name}.rps", f"{name} ({tokens} tokens): req/s", 1),
            Figure(f"{name}.tps", f"{name} ({tokens} tokens): tok/s", 0),
            Figure(f"{name}.cpu_ms", "  CPU ms per request, all", 2),
            *(Figure(f"{name}.cpu_ms.{p}", f"    of it {p}", 2) for p in PROCESSES),
        ]
    return figures


@dataclass
class Run:
    """One benchmark run of one tree: its figures, or why there are none."""

    tree: str
    round: int
    load_before: float
    seconds: float = 0.0
    returncode: int | None = None
    figures: dict[str, float] = field(default_factory=dict)
    problem: str | None = None


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def render_table(title: str, figures: Sequence[Figure], runs: Sequence[Run], trees: Sequence[str]) -> list[str]:
    """The lines of one benchmark's table: per figure a line per tree with each round's value, the
    mean, min and max, and on the last tree's line head (`trees[-1]`) against base (`trees[0]`)."""
    rounds = sorted({run.round for run in runs})
    label_width = max([len(f.label) for f in figures] + [len("load average before the run")])
    tree_width = max(len(tree) for tree in trees)
    columns = [f"round {r}" for r in rounds] + ["mean", "min", "max"]
    width = max(9, *(len(c) for c in columns))
    header = f"{'':<{label_width}}  {'':<{tree_width}}" + "".join(f" {c:>{width}}" for c in columns)
    lines = [title, header + (f" {'head vs base':>12}" if len(trees) == 2 else "")]

    def of(tree: str, r: int) -> Run | None:
        return next((run for run in runs if run.tree == tree and run.round == r), None)

    for figure in figures:
        means = {}
        for i, tree in enumerate(trees):
            cells, values = [], []
            for r in rounds:
                run = of(tree, r)
                value = None if run is None else run.figures.get(figure.key)
                cells.append("-" if value is None else figure.show(value))
                if value is not None and not math.isnan(value):
                    values.append(value)
            means[tree] = _mean(values)
            stats = [figure.show(means[tree]), figure.show(min(values)), figure.show(max(values))] if values else []
            cells += stats or ["-", "-", "-"]
            label = figure.label if i == 0 else ""
            line = f"{label:<{label_width}}  {tree:<{tree_width}}" + "".join(f" {c:>{width}}" for c in cells)
            if i == len(trees) - 1 and len(trees) == 2:
                line += f" {compare(figure, means[trees[0]], means[trees[1]]):>12}"
            lines.append(line.rstrip())
    for i, tree in enumerate(trees):
        cells = []
        for r in rounds:
            run = of(tree, r)
            cells.append("-" if run is None else f"{run.load_before:.2f}")
        label = "load average before the run" if i == 0 else ""
        lines.append(f"{label:<{label_width}}  {tree:<{tree_width}}" + "".join(f" {c:>{width}}" for c in cells))
    return lines


def compare(figure: Figure, base: float, head: float) -> str:
    """Head against base: the ratio of the means, or their difference for a difference."""
    if math.isnan(base) or math.isnan(head):
        return "-"
    if figure.difference:
        return f"{head - base:+.{figure.digits}f}"
    return f"{head / base:.3f}" if base else "-"


# --------------------------------------------------------------------------------------------
# Trees and runs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tree:
    label: str  # "base" or "head"
    rev: str  # as given
    sha: str
    date: str
    subject: str
    path: Path


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


def describe(repo: Path, label: str, rev: str) -> Tree:
    sha = git(repo, "rev-parse", "--verify", f"{rev}^{{commit}}")
    date, subject = git(repo, "log", "-1", "--format=%cd%x00%s", "--date=format:%Y-%m-%d %H:%M", sha).split("\0", 1)
    return Tree(label, rev, sha, date, subject, Path())


@contextmanager
def worktrees(repo: Path, trees: Sequence[Tree]) -> Iterator[list[Tree]]:
    """Each tree's commit checked out (detached) into a new folder under the temporary folder,
    removed at the end; two trees of one commit share one worktree."""
    made: dict[str, Path] = {}
    try:
        for tree in trees:
            if tree.sha not in made:
                path = Path(tempfile.mkdtemp(prefix=f"ab-{tree.sha[:12]}-"))
                made[tree.sha] = path
                git(repo, "worktree", "add", "--detach", str(path), tree.sha)
        yield [Tree(t.label, t.rev, t.sha, t.date, t.subject, made[t.sha]) for t in trees]
    finally:
        for path in made.values():
            subprocess.run(
                ["git", "-C", str(repo), "worktree", "remove", "--force", str(path)], capture_output=True, check=False
            )
        subprocess.run(["git", "-C", str(repo), "worktree", "prune"], capture_output=True, check=False)


PARSERS: dict[str, Callable[[str], dict[str, float]]] = {
    "engine_vs_stack": parse_engine_vs_stack,
    "capacity": parse_capacity,
}


def run_benchmark(
    tree: Tree,
    benchmark: str,
    args: Sequence[str],
    *,
    python: str,
    round_: int,
    output: Path,
    timeout_s: float,
    extra_env: dict[str, str] | None = None,
) -> Run:
    """One run of the tree's own `benchmarks/<benchmark>.py`, its output kept in `output`, with
    `extra_env` added to its environment."""
    run = Run(tree=tree.label, round=round_, load_before=os.getloadavg()[0])
    script = tree.path / "benchmarks" / f"{benchmark}.py"
    if not script.exists():
        run.problem = f"{tree.sha[:7]} has no benchmarks/{benchmark}.py"
        return run
    env = {**os.environ, **(extra_env or {}), "PYTHONPATH": str(tree.path)}
    argv = [python, str(script), *args]
    started = time.monotonic()
    try:
        done = subprocess.run(
            argv, cwd=tree.path, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        stdout, stderr, run.returncode = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        run.problem = f"timed out after {timeout_s:g} s"
    run.seconds = time.monotonic() - started
    output.write_text(f"$ {shlex.join(argv)}\n# cwd {tree.path}\n\n{stdout}\n# stderr\n{stderr}")
    try:
        run.figures = PARSERS[benchmark](stdout)
    except ParseError as exc:
        run.problem = run.problem or f"{exc} (exit status {run.returncode})"
    if run.problem is None and run.returncode:
        run.problem = f"exit status {run.returncode}"
    return run


def wait_for_quiet(max_load: float, max_wait_s: float, *, poll_s: float = 5.0) -> float:
    """Wait until the 1-minute load average is at most `max_load`, or `max_wait_s` has passed;
    returns how long it waited."""
    started = time.monotonic()
    while os.getloadavg()[0] > max_load and time.monotonic() - started < max_wait_s:
        time.sleep(poll_s)
    return time.monotonic() - started


def order(round_: int, trees: Sequence[Tree]) -> list[Tree]:
    """Base first in odd rounds, head first in even ones."""
    return list(trees) if round_ % 2 else list(reversed(trees))


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", help="the commit to compare against (any git revision)")
    parser.add_argument("head", help="the commit measured against it")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each benchmark per tree (default: 3)")
    parser.add_argument(
        "--benchmarks", nargs="+", choices=BENCHMARKS, default=list(BENCHMARKS), help="which to run (default: both)"
    )
    parser.add_argument(
        "--engine-vs-stack-args",
        default=DEFAULT_ENGINE_VS_STACK_ARGS,
        help=f"engine_vs_stack.py's arguments, one string (default: {DEFAULT_ENGINE_VS_STACK_ARGS!r})",
    )
    parser.add_argument(
        "--capacity-args",
        default=DEFAULT_CAPACITY_ARGS,
        help=f"capacity.py's arguments, one string (default: {DEFAULT_CAPACITY_ARGS!r})",
    )
    for label in ("base", "head"):
        parser.add_argument(
            f"--{label}-env",
            default="",
            metavar="'NAME=VALUE ...'",
            help=f"environment variables of the {label} tree's runs, one string (e.g. the harness's "
            "AXON_BENCH_OTLP_ENDPOINT: the same commit twice, tracing off against on)",
        )
    parser.add_argument("--python", default=sys.executable, help="the interpreter of both trees (default: this one)")
    parser.add_argument("--repo", type=Path, help="the git repository (default: the one holding this script)")
    parser.add_argument("--output-dir", type=Path, help="where each run's output is kept (default: a new folder)")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="longest one run may take (default: 1800)")
    parser.add_argument(
        "--max-load",
        type=float,
        help="before each run, wait until the 1-minute load average is at most this (default: do not wait)",
    )
    parser.add_argument(
        "--max-wait-s", type=float, default=300.0, help="longest wait for --max-load before a run (default: 300)"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    repo = args.repo or Path(git(Path(__file__).resolve().parent, "rev-parse", "--show-toplevel"))
    output_dir = args.output_dir or Path(tempfile.mkdtemp(prefix="ab-output-"))
    output_dir.mkdir(parents=True, exist_ok=True)
    bench_args = {
        "engine_vs_stack": shlex.split(args.engine_vs_stack_args),
        "capacity": shlex.split(args.capacity_args),
    }
    try:
        tree_env = {"base": _assignments(args.base_env), "head": _assignments(args.head_env)}
    except ValueError as exc:
        parser.error(str(exc))
    try:
        described = [describe(repo, "base", args.base), describe(repo, "head", args.head)]
    except subprocess.CalledProcessError as exc:
        parser.error(f"not a commit: {exc.stderr.strip()}")
    started = datetime.now(UTC)
    runs: dict[str, list[Run]] = {name: [] for name in args.benchmarks}
    with worktrees(repo, described) as trees:
        for round_ in range(1, args.rounds + 1):
            for benchmark in args.benchmarks:
                for tree in order(round_, trees):
                    if args.max_load is not None:
                        waited = wait_for_quiet(args.max_load, args.max_wait_s)
                        if waited >= 1:
                            _say(f"waited {waited:.0f} s for the load average ({os.getloadavg()[0]:.2f} now)")
                    _say(f"round {round_}: {benchmark} on {tree.label} ({tree.sha[:7]})...")
                    output = output_dir / f"round{round_}-{tree.label}-{benchmark}.txt"
                    run = run_benchmark(
                        tree,
                        benchmark,
                        bench_args[benchmark],
                        python=args.python,
                        round_=round_,
                        output=output,
                        timeout_s=args.timeout_s,
                        extra_env=tree_env[tree.label],
                    )
                    _say(f"  {run.seconds:.0f} s" + (f"; {run.problem}" if run.problem else ""))
                    runs[benchmark].append(run)
    finished = datetime.now(UTC)
    command = shlex.join(["benchmarks/ab.py", *(sys.argv[1:] if argv is None else argv)])
    print(report(command, described, runs, bench_args, started, finished, args.python))
    _say(f"each run's output is in {output_dir}")
    return 0 if all(run.problem is None for per in runs.values() for run in per) else 1


def report(
    command: str,
    trees: Sequence[Tree],
    runs: dict[str, list[Run]],
    bench_args: dict[str, list[str]],
    started: datetime,
    finished: datetime,
    python: str,
) -> str:
    """Everything the A/B prints: the header, a table per benchmark and the runs that failed."""
    lines = [
        f".venv/bin/python {command}",
        "",
        *(f"{t.label} {t.sha[:10]} ({t.date}) {t.subject[:80].rstrip()}" for t in trees),
        f"run {started:%Y-%m-%d %H:%M}-{finished:%H:%M} UTC on {platform.node()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}; base first in odd rounds, head first in even ones",
    ]
    labels = [t.label for t in trees]
    for benchmark, per in runs.items():
        if benchmark == "engine_vs_stack":
            figures: Sequence[Figure] = ENGINE_VS_STACK_FIGURES
        else:
            workloads = next((capacity_workloads(run.figures) for run in per if run.figures), [])
            figures = capacity_figures(workloads)
        title = shlex.join([f"{benchmark}.py", *bench_args[benchmark]])
        lines += ["", *render_table(title, figures, per, labels)]
    problems = [(b, run) for b, per in runs.items() for run in per if run.problem]
    if problems:
        lines += ["", "runs without all their figures:"]
        lines += [f"  round {run.round} {run.tree} {b}: {run.problem}" for b, run in problems]
    lines += [
        "",
        "head vs base: the ratio of the means (head / base); for TTFT and ITL added, head's mean minus base's",
    ]
    return "\n".join(lines)


def _assignments(text: str) -> dict[str, str]:
    """`NAME=VALUE` words of `text` as a dict.

    Raises:
        ValueError: a word without `=`.
    """
    env = {}
    for word in shlex.split(text):
        name, sep, value = word.partition("=")
        if not sep or not name:
            raise ValueError(f"not NAME=VALUE: {word!r}")
        env[name] = value
    return env


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
