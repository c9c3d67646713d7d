"""services/sessions/outbox.py: rows PostgreSQL can always store."""

import datetime as dt

import orjson

from services.sessions.history import StoredMessage
from services.sessions.outbox import MESSAGE_COLUMNS, MessageRow, _entry_fields
from shared.schemas import FunctionCall, ToolCall

NOW = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)


def test_nul_becomes_the_replacement_character_in_both_forms_of_a_message() -> None:
    # PostgreSQL's text cannot hold U+0000; one such row used to stop its whole batch for ever.
    row = MessageRow(
        id="m", conversation_id="c", seq=1, role="user", content="a\x00b\tc", status="complete", created_at=NOW
    )
    assert row.content == "a\ufffdb\tc"
    assert row.copy_line() == (
        "m\tc\t1\tuser\ta\ufffdb\\tc\tcomplete\t\\N\t2026-01-02T03:04:05+00:00\t\\N\t\\N\t\\N\n".encode()
    )
    assert b"\x00" not in row.copy_line()


def test_text_without_nul_is_unchanged() -> None:
    row = MessageRow(
        id="m", conversation_id="c", seq=1, role="user", content="plain é", status="complete", created_at=NOW
    )
    assert row.content == "plain é"


def test_tool_calls_travel_as_json_text_that_jsonb_can_store() -> None:
    # jsonb refuses the escape \u0000 as text refuses U+0000: the NUL becomes U+FFFD inside the JSON.
    call = ToolCall(id="c\x00", function=FunctionCall(name="f", arguments='{"a": "x\x00y\tz"}'))
    stored = StoredMessage(
        id="m", seq=2, role="assistant", content="", created_at=NOW, tool_calls=[call], tool_call_id=None, name=None
    )
    row = MessageRow.of(stored, conversation_id="c")
    assert row.tool_calls is not None and "\\u0000" not in row.tool_calls
    assert orjson.loads(row.tool_calls) == [
        {"id": "c\ufffd", "type": "function", "function": {"name": "f", "arguments": '{"a": "x\ufffdy\tz"}'}}
    ]
    fields = row.copy_line().decode().rstrip("\n").split("\t")
    assert len(fields) == len(MESSAGE_COLUMNS)
    assert fields[MESSAGE_COLUMNS.index("tool_calls")].startswith('[{"id":')
    assert _entry_fields("message", row)["format"] == "2"  # the persister pads entries without it


def test_a_tool_result_keeps_its_call_id_and_name() -> None:
    stored = StoredMessage(id="m", seq=3, role="tool", content="ok", created_at=NOW, tool_call_id="c1", name="f\x00")
    row = MessageRow.of(stored, conversation_id="c")
    fields = row.copy_line().decode().rstrip("\n").split("\t")
    assert fields[-3:] == ["\\N", "c1", "f\ufffd"]
