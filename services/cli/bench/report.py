"""`axon bench`'s output: the summary as a rich table, the JSON file, and the progress bar."""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from services.cli.bench.client import RequestResult


def render_summary(summary: dict[str, Any], console: Any) -> None:
    """Print the summary as a rich table on `console`."""
    from rich.table import Table

    requests = summary["requests"]
    config = summary["config"]
    rate = config["request_rate"]
    console.print(
        f"axon bench{' (interrupted)' if summary['interrupted'] else ''}: {config['model']} at {config['url']}\n"
        f"{requests['sent']} requests, concurrency {config['max_concurrency'] or 'unlimited'}, "
        f"rate {rate if rate == 'inf' else f'{rate:g}'} req/s, {'streamed' if config['stream'] else 'not streamed'}",
        highlight=False,
        soft_wrap=True,
    )
    table = Table(show_header=True, header_style="bold")
    table.add_column("metric")
    for column in ("mean", "p50", "p90", "p99"):
        table.add_column(column, justify="right")
    for key, label in _METRIC_ROWS:
        table.add_row(label, *(_fmt(summary[key][column]) for column in ("mean", "p50", "p90", "p99")))
    console.print(table)
    lines = [
        ("duration", f"{summary['duration_s']:.2f} s"),
        (
            "requests",
            f"{requests['completed']} completed, {requests['failed']} failed"
            + (f", {requests['cancelled']} cancelled" if requests["cancelled"] else ""),
        ),
        ("request throughput", f"{summary['request_throughput_rps']:.2f} req/s"),
        ("output token throughput", f"{summary['output_token_throughput_tps']:.1f} tok/s"),
        ("output tokens", f"{summary['total_output_tokens']} (input tokens: {summary['total_input_tokens']})"),
    ]
    for label, value in lines:
        console.print(f"{label + ':':<25} {value}", highlight=False, soft_wrap=True)
    for error in summary["errors"]:
        message = f"error x{error['count']}: {error['message']}"
        console.print(message, style="red", highlight=False, markup=False, soft_wrap=True)


_METRIC_ROWS = (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("itl_ms", "ITL (ms)"), ("e2e_ms", "E2E (ms)"))


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def write_json(summary: dict[str, Any], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2) + b"\n")


class ProgressBar:
    """A rich progress bar on stderr, advanced by the `on_done` callback this context yields."""

    def __init__(self, console: Any, *, total: int, enabled: bool) -> None:
        self._console, self._total, self._enabled = console, total, enabled
        self._bar: Any = None
        self._failed = 0

    def __enter__(self) -> Callable[[RequestResult], None] | None:
        if not self._enabled:
            return None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(
            TextColumn("bench"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[failed]} failed"),
            TimeElapsedColumn(),
            console=self._console,
            refresh_per_second=4,
            transient=True,
        )
        task_id = self._bar.add_task("bench", total=self._total, failed=0)
        self._bar.start()
        bar = self._bar

        def on_done(result: RequestResult) -> None:
            if result.error is not None:
                self._failed += 1
                bar.update(task_id, advance=1, failed=self._failed)
            else:
                bar.advance(task_id)

        return on_done

    def __exit__(self, *_exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
