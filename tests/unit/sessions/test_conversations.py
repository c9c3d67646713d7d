"""services/sessions/conversations/protocol.py: conversation and item ids, session messages <-> OpenAI
items both ways, deleted items, and the 400s for items and metadata Axon cannot store."""

import datetime as dt
import uuid
from typing import Any

import pytest
from pydantic import ValidationError

from services.sessions.conversations.protocol import (
    MAX_SEQ,
    conversation_id,
    conversation_public,
    item_position,
    items_to_messages,
    message_items,
    session_id_of,
)
from services.sessions.history import SessionInfo, StoredMessage
from shared.conversation_requests import ConversationCreate, ConversationItemsCreate, ConversationUpdate
from shared.errors import InvalidRequest, NotFound
from shared.schemas import FunctionCall, Message, ToolCall
from tests.contract.openai_shapes import assert_openai_shape

NOW = dt.datetime(2026, 1, 2, tzinfo=dt.UTC)
CALL = ToolCall(id="call_1", function=FunctionCall(name="get_weather", arguments='{"city": "Paris"}'))
CALL_2 = ToolCall(id="call_2", function=FunctionCall(name="get_time", arguments="{}"))


def stored(seq: int, role: str, content: str, **fields: Any) -> StoredMessage:
    return StoredMessage(id=str(uuid.uuid4()), seq=seq, role=role, content=content, created_at=NOW, **fields)


def ids(message: StoredMessage) -> list[str]:
    return [item["id"] for _, item in message_items(message)]


def test_a_conversation_id_is_its_session_id_in_hex_and_maps_back() -> None:
    session = str(uuid.uuid4())
    conversation = conversation_id(session)
    assert conversation == "conv_" + uuid.UUID(session).hex
    assert session_id_of(conversation) == session_id_of(session) == session
    for bad in ("conv_", "conv_xyz", "msg_1", ""):
        with pytest.raises(NotFound) as caught:
            session_id_of(bad)
        assert caught.value.code == "conversation_not_found"


def test_the_conversation_object_is_openais() -> None:
    info = SessionInfo(id=str(uuid.uuid4()), tenant="t", created_at=NOW, updated_at=NOW, metadata={"a": "b"})
    body = conversation_public(info)
    assert body["created_at"] == int(NOW.timestamp()) and body["metadata"] == {"a": "b"}
    assert_openai_shape("Conversation", body)


def test_each_message_is_its_items_with_ids_from_its_seq() -> None:
    assert message_items(stored(1, "user", "hi")) == [
        (0, {"id": "msg_1", "type": "message", "role": "user", "status": "completed", "content": [
            {"type": "input_text", "text": "hi"}
        ]})
    ]  # fmt: skip
    answer = stored(2, "assistant", "Checking.", tool_calls=[CALL, CALL_2], status="cancelled")
    items = message_items(answer)
    assert [(part, item["id"]) for part, item in items] == [(0, "msg_2"), (1, "fc_2_1"), (2, "fc_2_2")]
    assert items[0][1]["content"] == [{"type": "output_text", "text": "Checking.", "annotations": []}]
    assert items[1][1] == {
        "id": "fc_2_1",
        "type": "function_call",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
        "status": "incomplete",
    }
    # An answer that is only tool calls has no text item.
    assert ids(stored(3, "assistant", "", tool_calls=[CALL])) == ["fc_3_1"]
    result = message_items(stored(4, "tool", "22 C", tool_call_id="call_1", name="get_weather"))
    assert result == [
        (0, {"id": "fco_4", "type": "function_call_output", "call_id": "call_1", "output": "22 C",
             "status": "completed", "name": "get_weather"})
    ]  # fmt: skip
    for _, item in [*items, *result, *message_items(stored(5, "system", "Be brief."))]:
        assert_openai_shape("ConversationItem", item)


def test_item_ids_map_back_to_their_message_and_part() -> None:
    assert item_position("msg_7") == (7, 0)
    assert item_position("fco_7") == (7, 0)
    assert item_position("fc_7_2") == (7, 2)
    for bad in ("msg_", "msg_x", "fc_7", "fc_7_", "item_1", "msg_1 ", f"msg_{MAX_SEQ + 1}", "msg_99999999999"):
        assert item_position(bad) is None, bad


def test_deleted_items_leave_their_message_and_its_visible_form() -> None:
    answer = stored(2, "assistant", "Checking.", tool_calls=[CALL, CALL_2], deleted=[1])
    assert ids(answer) == ["msg_2", "fc_2_2"]  # the other ids stay as they were
    visible = answer.visible()
    assert visible is not None and visible.content == "Checking." and visible.tool_calls == [CALL_2]
    text_gone = answer.model_copy(update={"deleted": [0]}).visible()
    assert text_gone is not None and text_gone.content == "" and text_gone.tool_calls == [CALL, CALL_2]
    assert answer.model_copy(update={"deleted": [0, 1, 2]}).visible() is None
    assert stored(3, "assistant", "", tool_calls=[CALL], deleted=[1]).visible() is None
    assert stored(4, "user", "hi", deleted=[0]).visible() is None
    plain = stored(5, "user", "hi")
    assert plain.visible() is plain


def test_items_become_the_messages_a_chat_would_store() -> None:
    messages = items_to_messages(
        [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be "},
                                                                   {"type": "input_text", "text": "brief."}]},
            {"role": "user", "content": "Weather?"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}", "id": "fc_x"},
            {"type": "function_call_output", "call_id": "call_1", "output": "22 C"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "noon"}]},
            {"type": "function_call", "call_id": "call_3", "name": "get_time", "arguments": "{}"},
        ]
    )  # fmt: skip
    assert messages == [
        Message(role="developer", content="Be brief."),
        Message(role="user", content="Weather?"),
        Message(role="assistant", content="Checking.", tool_calls=[CALL, CALL_2]),
        Message(role="tool", content="22 C", tool_call_id="call_1"),
        Message(role="tool", content="noon", tool_call_id="call_2"),
        Message(role="assistant", content="", tool_calls=[CALL_2.model_copy(update={"id": "call_3"})]),
    ]


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ({"type": "item_reference", "id": "msg_1"}, "items[0].type"),
        ({"type": "reasoning", "summary": []}, "items[0].type"),
        ({"content": "no role or type"}, "items[0].type"),
        ({"role": "tool", "content": "x"}, "items[0].role"),
        ({"role": ["user"], "content": "x"}, "items[0].role"),
        ({"role": "user"}, "items[0].content"),
        ({"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}, "items[0].content[0].type"),
        ({"role": "user", "content": ["text"]}, "items[0].content[0]"),
        ({"role": "user", "content": [{"type": "input_text"}]}, "items[0].content[0].text"),
        ({"type": "function_call", "name": "f", "arguments": "{}"}, "items[0].call_id"),
        ({"type": "function_call", "call_id": "c", "arguments": "{}"}, "items[0].name"),
        ({"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}, "items[0].arguments"),
        ({"type": "function_call_output", "call_id": "c"}, "items[0].output"),
        ({"type": "function_call_output", "output": "x"}, "items[0].call_id"),
    ],
)
def test_an_item_axon_cannot_store_is_a_400_naming_it(item: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        items_to_messages([item])
    assert caught.value.param == param and caught.value.message.startswith(param)


def test_bodies_hold_openais_limits() -> None:
    ConversationCreate(items=[{"role": "user", "content": "x"}] * 20, metadata={f"k{i}": "v" * 512 for i in range(16)})
    ConversationUpdate(metadata=None)
    for bad in (
        {"items": [{"role": "user", "content": "x"}] * 21},
        {"metadata": {f"k{i}": "v" for i in range(17)}},
        {"metadata": {"k" * 65: "v"}},
        {"metadata": {"": "v"}},
        {"metadata": {"k": "v" * 513}},
        {"metadata": {"k": "a\x00b"}},
        {"metadata": {"k": 1}},
        {"unknown": 1},
    ):
        with pytest.raises(ValidationError):
            ConversationCreate.model_validate(bad)
    with pytest.raises(ValidationError):
        ConversationItemsCreate(items=[])
    with pytest.raises(ValidationError):
        ConversationUpdate.model_validate({})  # metadata is required (null clears it)
