"""shared/usage.py: the usage row both the worker and the session manager record, and the fields of
a job's progress hash they agree on."""

import datetime as dt

import orjson
import pytest
from pydantic import ValidationError

from services.sessions.outbox import Outbox
from shared.names import Names
from shared.settings import CommonSettings
from shared.usage import (
    BILLED_FIELD,
    MARK_BILLED,
    PROGRESS_COMPLETION_TOKENS,
    PROGRESS_PROMPT_TOKENS,
    UsageRow,
    billed_tokens,
)

NOW = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)


def _row(**changes: object) -> UsageRow:
    fields: dict[str, object] = {
        "job_id": "j",
        "tenant": "t",
        "key_id": None,
        "model": "m",
        "prompt_tokens": 1,
        "completion_tokens": 2,
        "latency_ms": 3,
        "created_at": NOW,
    }
    return UsageRow.model_validate(fields | changes)


def test_a_usage_row_holds_only_text_postgresql_can_store() -> None:
    usage = _row(tenant="t\x00")
    assert (usage.tenant, usage.key_id, usage.model) == ("t\ufffd", None, "m")


def test_the_worker_writes_a_usage_row_as_the_session_managers_outbox_does() -> None:
    row = _row(key_id="k", latency_ms=None)
    outbox = Outbox(None, Names("ns"))  # type: ignore[arg-type]  # append_command only builds the command
    assert outbox.append_command("usage", row) == ("XADD", "ns:outbox", "*", *_flat(row.outbox_fields()))
    fields = row.outbox_fields()
    assert fields["kind"] == "usage"
    assert orjson.loads(fields["row"]) == {
        "job_id": "j",
        "tenant": "t",
        "key_id": "k",
        "model": "m",
        "prompt_tokens": 1,
        "completion_tokens": 2,
        "latency_ms": None,
        "created_at": "2026-01-02T03:04:05Z",
        "batch": False,
    }


def test_the_billed_mark_and_the_token_counts_keep_their_redis_names() -> None:
    # Workers and session managers of different versions share a job's progress hash.
    assert (BILLED_FIELD, PROGRESS_COMPLETION_TOKENS, PROGRESS_PROMPT_TOKENS) == (
        "billed",
        "completion_tokens",
        "prompt_tokens",
    )
    assert "'billed', '1'" in MARK_BILLED.source


def _flat(fields: dict[str, str | bytes]) -> list[str | bytes]:
    return [part for item in fields.items() for part in item]


@pytest.mark.parametrize(
    ("tokens", "factor", "billed"),
    [(100, 1.0, 100), (7, 0.5, 4), (8, 0.5, 4), (100, 0.07, 7), (1, 0.01, 1), (0, 0.5, 0), (3, 0.1, 1)],
)
def test_batch_tokens_are_billed_at_the_factor_rounded_up(tokens: int, factor: float, billed: int) -> None:
    assert billed_tokens(tokens, factor) == billed


@pytest.mark.parametrize("factor", ["0", "-0.5", "1.5", "half"])
def test_a_billing_factor_outside_0_to_1_is_refused(factor: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AXON_BATCH_BILLING_FACTOR", factor)
    with pytest.raises(ValidationError, match="batch_billing_factor"):
        CommonSettings()
