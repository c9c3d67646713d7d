"""Where the platform's CPU per token goes: each service sampled by py-spy under the load of
`engine_vs_stack.py`'s stack side, its samples split into the stages of a token's way, and that
split applied to the CPU the service spent per generated token in the same run.

    .venv/bin/python benchmarks/profile_stack.py --output-dir /tmp/profile                # sim, 64 streams
    .venv/bin/python benchmarks/profile_stack.py --engine vllm --streams 32 --output-dir /tmp/profile-vllm

It starts the platform (its own database, Redis namespace and queues, removed at the end), attaches
`py-spy record --nonblocking --format raw` to the gateway, the session manager and the worker (py-spy
reads their memory without stopping them, so they run as unprofiled), drives the gateway with
`engine_vs_stack.py`'s streams, stops the profilers, and prints:

- each service's CPU milliseconds per generated token over the measured requests (`/proc`), as
  `engine_vs_stack.py` prints them;
- the share of that CPU spent in the kernel (system time: mostly the sockets' reads and writes,
  which py-spy does not see as such: a sample there shows the Python frame that made the call);
- per service and stage (`STAGES`), the share of the service's samples and that share of its CPU
  per token, in microseconds. A sample belongs to the stage of its innermost frame that names one
  (so the relay's parse of a chunk, called from the SSE writer's loop, counts as relay); a sample
  with none is the event loop's own work (uvloop's callbacks, the selector) or the service's
  other work (`other`).

In `--output-dir` it writes each service's samples (`<service>.txt`, py-spy's collapsed stacks)
and a flame graph of each (`<service>.svg`), every frame colored by its stage.
docs/performance.md has the figures and the pictures.
"""

import argparse
import asyncio
import html
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engine_vs_stack import (
    SERVICES,
    Side,
    add_load_arguments,
    answer_duration_s,
    cpu_ms_per_token,
    load_settings,
    measure_stack,
    stack_pids,
    worker_env,
)
from harness import BenchEnvironment, loop_factory

PY_SPY = Path(sys.executable).with_name("py-spy")


@dataclass(frozen=True)
class Stage:
    """A stage of a token's way through one service: the frames that name it (a function name
    and a piece of its file's path; an empty name: any function of that file)."""

    name: str
    service: str
    frames: tuple[tuple[str, str], ...]
    color: str

    def names(self, function: str, path: str) -> bool:
        """Whether a frame is one of the stage's (`function` as py-spy names it: `Class.method`,
        `outer.<locals>.inner`)."""
        return any(
            (not name or function == name or function.endswith("." + name)) and part in path
            for name, part in self.frames
        )


# What the relay and the gateway's client do for each chunk (the rest of their modules: per request).
_RELAY_PER_CHUNK = ("_dispatch", "put_nowait", "get_nowait", "get", "next", "ready", "_check_deadline")
_HTTP1_PER_PIECE = (
    *("data_received", "on_body", "on_message_complete", "_wake", "wait", "take_body", "pieces"),
    "_check_read_deadline",
)

# The stages of each service; a sample is the stage of its innermost frame that one names (so
# the Redis call inside a chunk's publish is `publish`, the publish inside the pump is not the pump's).
STAGES: tuple[Stage, ...] = (
    Stage(
        "publish (the Redis script)",
        "worker",
        (("", "shared/redis_pipe.py"), ("_send", "services/worker/chunk_publisher.py")),
        "#e6550d",
    ),
    Stage(
        "chunk building",
        "worker",
        (
            *((name, "services/worker/chunk_publisher.py") for name in ("publish", "_parse", "_usage", "_send_chunk")),
            ("", "services/worker/tool_parsers.py"),
        ),
        "#fd8d3c",
    ),
    Stage(
        "engine output handling",
        "worker",
        (
            ("", "services/worker/engines/"),
            ("", "vllm/"),
            ("_generate", "services/worker/job_runner.py"),
            ("_pump", "services/worker/job_runner.py"),
            *((name, "services/worker/chunk_publisher.py") for name in ("add", "take", "close", "gather")),
        ),
        "#fdd0a2",
    ),
    Stage(
        "job start and end (per request)",
        "worker",
        (("", "services/worker/"), ("", "aio_pika/"), ("", "aiormq/"), ("", "pamqp/")),
        "#9e9ac8",
    ),
    Stage(
        "relay (pub/sub in, chunk parsed)",
        "sessions",
        (
            *((name, "shared/redis_pipe.py") for name in ("_SubscriberProtocol.data_received", "_push")),
            *((name, "services/sessions/relay.py") for name in _RELAY_PER_CHUNK),
            *((name, "services/sessions/active_request.py") for name in ("chunks", "receive", "finals")),
        ),
        "#3182bd",
    ),
    Stage(
        "SSE framing",
        "sessions",
        (("sse", "services/sessions/chat/service.py"), ("", "services/sessions/chat/protocol.py"), ("", "sse.py")),
        "#6baed6",
    ),
    Stage(
        "HTTP out (to the gateway)",
        "sessions",
        (
            ("_complete", "services/sessions/chat/router.py"),
            ("tracking_send", "shared/hot_routes.py"),
            ("send_with_id", "shared/middleware.py"),
            ("_send", "starlette/"),
            ("send", "uvicorn/protocols/http/"),
        ),
        "#c6dbef",
    ),
    Stage(
        "request start and end (per request)",
        "sessions",
        (("", "services/sessions/"), ("", "shared/"), ("", "aio_pika/"), ("", "aiormq/"), ("", "uvicorn/")),
        "#9e9ac8",
    ),
    Stage(
        "pass-through in (from the session manager)",
        "gateway",
        tuple((name, "shared/http1.py") for name in _HTTP1_PER_PIECE),
        "#31a354",
    ),
    Stage(
        "pass-through out (to the client)",
        "gateway",
        (
            ("_relay", "services/gateway/proxy.py"),
            ("tracking_send", "shared/hot_routes.py"),
            ("send_with_id", "shared/middleware.py"),
            ("_send", "starlette/"),
            ("send", "uvicorn/protocols/http/"),
        ),
        "#a1d99b",
    ),
    Stage(
        "request start and end (per request)",
        "gateway",
        (("", "services/gateway/"), ("", "shared/"), ("", "uvicorn/")),
        "#9e9ac8",
    ),
)
LOOP, OTHER = "event loop", "other"
COLORS = {LOOP: "#c8c8c8", OTHER: "#e0d8c0"}
# Frames every sample of a service has under it (its start, uvicorn, the loop's `run`): a sample
# whose innermost frame is one of them is the event loop's own work (uvloop has no Python frames).
_BOOTSTRAP = (
    "<frozen runpy>",
    "asyncio/runners.py",
    "uvicorn/_compat.py",
    "uvicorn/server.py",
    "shared/serving.py",
    *(f"services/{service}/main.py" for service in ("gateway", "sessions", "worker")),
)

_FRAME = re.compile(r"^(?P<function>.*) \((?P<path>[^()]*?)(?::\d+)?\)$")


def parse_frame(frame: str) -> tuple[str, str]:
    """`function (path:line)` as py-spy names a frame: the function and the path."""
    match = _FRAME.match(frame)
    return (match["function"], match["path"]) if match else (frame, "")


def read_collapsed(path: Path) -> Counter[tuple[str, ...]]:
    """py-spy's raw output: each distinct stack (outermost frame first) and its samples, line
    numbers dropped (a function's samples count together)."""
    stacks: Counter[tuple[str, ...]] = Counter()
    for line in path.read_text().splitlines():
        frames, _, count = line.rpartition(" ")
        if not frames.strip() or not count.isdigit():
            continue
        stacks[tuple(_without_line(f) for f in frames.split(";"))] += int(count)
    return stacks


def _without_line(frame: str) -> str:
    function, path = parse_frame(frame)
    return f"{function} ({path})" if path else function


def stage_of(service: str, stack: Sequence[str]) -> str:
    """The stage of one sample: the event loop's if its innermost frame is the service's start
    (`_BOOTSTRAP`), else that of its innermost frame that names one of `service`'s stages, else
    `other`."""
    own = [s for s in STAGES if s.service == service]
    if not stack or _bootstrap(stack[-1]):
        return LOOP
    for frame in reversed(stack):
        if _bootstrap(frame):
            break  # below the loop: the service's start
        function, path = parse_frame(frame)
        for stage in own:
            if stage.names(function, path):
                return stage.name
    return OTHER


def _bootstrap(frame: str) -> bool:
    function, path = parse_frame(frame)
    return function == "<module>" or path.endswith(_BOOTSTRAP)


def stage_shares(service: str, stacks: Counter[tuple[str, ...]]) -> dict[str, float]:
    """Each stage's share of `service`'s samples (0-1), stages in `STAGES` order then the rest."""
    counts: Counter[str] = Counter()
    for stack, n in stacks.items():
        counts[stage_of(service, stack)] += n
    total = sum(counts.values()) or 1
    order = [s.name for s in STAGES if s.service == service] + [LOOP, OTHER]
    return {name: counts[name] / total for name in order}


# --------------------------------------------------------------------------------------------
# Flame graphs
# --------------------------------------------------------------------------------------------

_WIDTH_PX, _ROW_PX, _CHAR_PX, _MIN_PX = 1200, 16, 6.6, 0.6


@dataclass
class _Node:
    samples: int = 0
    stage: str = OTHER
    children: "dict[str, _Node] | None" = None


def flame_graph_svg(service: str, stacks: Counter[tuple[str, ...]], title: str) -> str:
    """A static flame graph (outermost frame at the bottom) of `stacks`: a frame of the service's
    start is the event loop's color, one that names a stage that stage's, any other that of the
    stage most of the samples under it are in; frames narrower than a pixel are left out."""
    root = _Node(children={})
    for stack, n in stacks.items():
        stage = stage_of(service, stack)
        root.samples += n
        node = root
        for frame in stack:
            assert node.children is not None
            child = node.children.get(frame)
            if child is None:
                child = node.children[frame] = _Node(children={})
            child.samples += n
            node = child
        node.stage = stage
    _settle_stages(service, "all", root)
    depth = _depth(root)
    height = (depth + 3) * _ROW_PX
    rects: list[str] = []
    _draw(root, "all", 0.0, depth + 1, _WIDTH_PX / max(1, root.samples), root.samples, rects)
    legend = _legend(service, height)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH_PX}" height="{height + 2 * _ROW_PX}" '
        f'font-family="monospace" font-size="11">\n<rect width="100%" height="100%" fill="#ffffff"/>\n'
        f'<text x="4" y="13" font-size="13">{html.escape(title)}</text>\n'
        + "\n".join(rects)
        + "\n"
        + legend
        + "</svg>\n"
    )


def _settle_stages(service: str, frame: str, node: _Node) -> Counter[str]:
    """Give each frame its color's stage (see `flame_graph_svg`); returns the samples under it by stage."""
    counts: Counter[str] = Counter()
    own = node.samples - sum(c.samples for c in (node.children or {}).values())
    if own > 0:
        counts[node.stage] += own
    for name, child in (node.children or {}).items():
        counts += _settle_stages(service, name, child)
    function, path = parse_frame(frame)
    named = next((s.name for s in STAGES if s.service == service and s.names(function, path)), None)
    if frame == "all" or _bootstrap(frame):
        node.stage = LOOP
    elif named is not None:
        node.stage = named
    elif counts:
        node.stage = counts.most_common(1)[0][0]
    return counts


def _depth(node: _Node) -> int:
    return 1 + max((_depth(c) for c in (node.children or {}).values()), default=0)


def _draw(node: _Node, name: str, x: float, row: int, px_per_sample: float, total: int, out: list[str]) -> None:
    width = node.samples * px_per_sample
    if width < _MIN_PX:
        return
    y = (row + 1) * _ROW_PX
    share = 100 * node.samples / total
    label = name if len(name) * _CHAR_PX < width - 4 else name[: max(0, int((width - 4) / _CHAR_PX) - 2)] + ".."
    color = _color(node.stage)
    out.append(
        f"<g><title>{html.escape(name)}: {node.samples} samples, {share:.1f} %</title>"
        f'<rect x="{x:.1f}" y="{y}" width="{width:.1f}" height="{_ROW_PX - 1}" fill="{color}"/>'
        + (f'<text x="{x + 2:.1f}" y="{y + 11}">{html.escape(label)}</text>' if width > 3 * _CHAR_PX else "")
        + "</g>"
    )
    for child_name, child in sorted((node.children or {}).items()):
        _draw(child, child_name, x, row - 1, px_per_sample, total, out)
        x += child.samples * px_per_sample


def _color(stage: str) -> str:
    for s in STAGES:
        if s.name == stage:
            return s.color
    return COLORS.get(stage, COLORS[OTHER])


def _legend(service: str, height: int) -> str:
    names = [s.name for s in STAGES if s.service == service] + [LOOP, OTHER]
    parts, x = [], 4.0
    for name in names:
        parts.append(
            f'<rect x="{x:.0f}" y="{height + 4}" width="12" height="12" fill="{_color(name)}"/>'
            f'<text x="{x + 16:.0f}" y="{height + 14}">{html.escape(name)}</text>'
        )
        x += 16 + len(name) * _CHAR_PX + 14
    return "\n".join(parts) + "\n"


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def start_profilers(pids: dict[str, int], output_dir: Path, rate_hz: int) -> dict[str, subprocess.Popen[bytes]]:
    """A py-spy sampling each of `pids` into `<name>.txt` until it is sent SIGINT."""
    return {
        name: subprocess.Popen(
            [
                *(str(PY_SPY), "record", "--pid", str(pid), "--nonblocking", "--format", "raw"),
                *("--rate", str(rate_hz), "--output", str(output_dir / f"{name}.txt")),
            ],
            stdout=subprocess.DEVNULL,
            stderr=(output_dir / f"{name}.py-spy.log").open("wb"),
        )
        for name, pid in pids.items()
    }


def stop_profilers(profilers: dict[str, subprocess.Popen[bytes]], timeout_s: float = 60) -> None:
    """Stop each py-spy (SIGINT: it writes what it sampled first) and wait for it."""
    for process in profilers.values():
        process.send_signal(signal.SIGINT)
    for name, process in profilers.items():
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            raise RuntimeError(f"py-spy of the {name} did not stop in {timeout_s:g} s") from None


def kernel_seconds(pid: int) -> float:
    """System CPU time a process (all its threads) has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[12]) / os.sysconf("SC_CLK_TCK")


def report(
    args: argparse.Namespace, side: Side, shares: dict[str, dict[str, float]], kernel_s: dict[str, float]
) -> None:
    cpu = cpu_ms_per_token(_no_direct(), side)
    figures = side.figures()
    print(
        f"\n{args.engine} engine, {args.streams} streams x {args.rounds} requests of {args.max_tokens} tokens: "
        f"{figures['tokens']} tokens, {figures['output_tok_s']:.1f} tok/s, {figures['errors']} errors; "
        f"py-spy at {args.rate} Hz; load average {os.getloadavg()[0]:.2f}; {os.cpu_count()} CPUs"
    )
    print(f"{'service':<9} {'stage':<28} {'share':>6} {'CPU us/token':>12}")
    for service in SERVICES:
        for stage, share in shares[service].items():
            print(f"{service:<9} {stage:<28} {100 * share:>5.1f}% {1000 * cpu[service] * share:>12.1f}")
        in_kernel = kernel_s[service] / side.cpu_s[service] if side.cpu_s[service] else float("nan")
        print(
            f"{service:<9} {'all':<28} {100.0:>5.1f}% {1000 * cpu[service]:>12.1f}"
            f"  ({100 * in_kernel:.0f}% of it in the kernel)"
        )
    print(f"the three services: {1000 * cpu['services']:.1f} us of CPU per generated token")


def _no_direct() -> Side:
    """A direct side with no figures (this script measures the stack only)."""
    return Side("direct engine", cpu_s={"direct engine": 0.0})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_load_arguments(parser, engines=("sim", "vllm"), other_streams=32)
    parser.add_argument("--rate", type=int, default=200, help="py-spy's samples per second (default: 200)")
    parser.add_argument("--output-dir", type=Path, required=True, help="where the samples and flame graphs go")
    args = parser.parse_args()
    load_settings(args, other_streams=32)
    args.output_dir.mkdir(parents=True, exist_ok=True)

    loop = loop_factory()
    with asyncio.Runner(loop_factory=loop) as runner:
        spacing_s = runner.run(answer_duration_s(args)) / args.streams
    with BenchEnvironment() as env:
        stack = env.start_stack(worker_env(args))
        key = env.create_key()
        print(f"platform ready (logs in {env.log_dir}); profiling it...", file=sys.stderr, flush=True)
        profilers = start_profilers({name: stack[name].pid for name in SERVICES}, args.output_dir, args.rate)
        time.sleep(1)  # attached before the first request
        kernel_before = {name: kernel_seconds(stack[name].pid) for name in SERVICES}
        try:
            with asyncio.Runner(loop_factory=loop) as runner:
                side = runner.run(measure_stack(args, stack["gateway"].url, key, spacing_s, stack_pids(stack)))
            kernel_s = {name: kernel_seconds(stack[name].pid) - kernel_before[name] for name in SERVICES}
        finally:
            stop_profilers(profilers)
    shares = {}
    for service in SERVICES:
        stacks = read_collapsed(args.output_dir / f"{service}.txt")
        shares[service] = stage_shares(service, stacks)
        title = f"{service}: {args.engine} engine, {args.streams} streams, {sum(stacks.values())} samples"
        (args.output_dir / f"{service}.svg").write_text(flame_graph_svg(service, stacks, title))
    report(args, side, shares, kernel_s)
    print(f"samples and flame graphs in {args.output_dir}", file=sys.stderr)
    return 0 if side.figures()["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
