"""services/sessions/outbox.py: rows PostgreSQL can always store."""

import datetime as dt

from services.sessions.outbox import MessageRow, UsageRow

NOW = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)


def test_nul_becomes_the_replacement_character_in_both_forms_of_a_message() -> None:
    # PostgreSQL's text cannot hold U+0000; one such row used to stop its whole batch for ever.
    row = MessageRow(
        id="m", conversation_id="c", seq=1, role="user", content="a\x00b\tc", status="complete", created_at=NOW
    )
    assert row.content == "a\ufffdb\tc"
    assert row.copy_line() == "m\tc\t1\tuser\ta\ufffdb\\tc\tcomplete\t\\N\t2026-01-02T03:04:05+00:00\n".encode()
    assert b"\x00" not in row.copy_line()


def test_text_without_nul_is_unchanged() -> None:
    row = MessageRow(
        id="m", conversation_id="c", seq=1, role="user", content="plain é", status="complete", created_at=NOW
    )
    assert row.content == "plain é"
    usage = UsageRow(
        job_id="j",
        tenant="t\x00",
        key_id=None,
        model="m",
        prompt_tokens=1,
        completion_tokens=2,
        latency_ms=3,
        created_at=NOW,
    )
    assert (usage.tenant, usage.key_id, usage.model) == ("t\ufffd", None, "m")
