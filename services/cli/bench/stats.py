"""`axon bench`'s statistics: percentiles, TPOT, the mean/p50/p90/p99 distributions and the
run's summary (every figure the table and the JSON show)."""

import math
import os
import platform
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

from services.cli.bench.client import RequestResult, RunOutcome
from services.cli.bench.workload import BenchConfig

MAX_DISTINCT_ERRORS = 5


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) of already sorted values, interpolating linearly (as numpy does)."""
    if not sorted_values:
        raise ValueError("no values")
    rank = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def tpot_s(result: RequestResult) -> float | None:
    """Time per output token after the first: (E2E - TTFT) / (tokens - 1); None below two tokens."""
    if result.ttft_s is None or result.output_tokens < 2:
        return None
    return (result.e2e_s - result.ttft_s) / (result.output_tokens - 1)


def distribution_ms(values_s: Iterable[float]) -> dict[str, float | None]:
    """Mean, p50, p90 and p99 in milliseconds (None when there is nothing to measure)."""
    values = sorted(values_s)
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    return {
        "mean": sum(values) / len(values) * 1000.0,
        "p50": percentile(values, 50) * 1000.0,
        "p90": percentile(values, 90) * 1000.0,
        "p99": percentile(values, 99) * 1000.0,
    }


def distinct_errors(results: Iterable[RequestResult], *, limit: int = MAX_DISTINCT_ERRORS) -> list[dict[str, Any]]:
    """The first `limit` distinct error messages in order of first appearance, with their counts."""
    counts = Counter(r.error for r in results if r.error is not None)
    return [{"message": message, "count": count} for message, count in list(counts.items())[:limit]]


def summarize(outcome: RunOutcome, config: BenchConfig) -> dict[str, Any]:
    """Every summary figure of a run, plus its configuration, ready for JSON."""
    ok = [r for r in outcome.results if r.ok]
    failed = len(outcome.results) - len(ok)
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    duration_s = outcome.duration_s
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": {"name": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "config": _config_dict(config),
        "interrupted": outcome.interrupted,
        "duration_s": duration_s,
        "requests": {
            "sent": len(outcome.results) + outcome.cancelled,
            "completed": len(ok),
            "failed": failed,
            "cancelled": outcome.cancelled,
        },
        "request_throughput_rps": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_token_throughput_tps": output_tokens / duration_s if duration_s > 0 else 0.0,
        "total_output_tokens": output_tokens,
        "total_input_tokens": prompt_tokens,
        "ttft_ms": distribution_ms(r.ttft_s for r in ok if r.ttft_s is not None),
        # Unstreamed, the first token arrives with the last: there is no time per output token.
        "tpot_ms": distribution_ms(t for r in ok if config.stream and (t := tpot_s(r)) is not None),
        "itl_ms": distribution_ms(itl for r in ok for itl in r.itls_s),
        "e2e_ms": distribution_ms(r.e2e_s for r in ok),
        "errors": distinct_errors(outcome.results),
    }


def _config_dict(config: BenchConfig) -> dict[str, Any]:
    data = asdict(config)
    data["url"] = config.url
    if math.isinf(config.request_rate):
        data["request_rate"] = "inf"  # JSON has no infinity
    return data
