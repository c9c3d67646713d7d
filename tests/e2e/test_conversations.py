"""OpenAI's Conversations API through the official `openai` client, on the shared stack: a
conversation is a session, its items the session's messages, every answer in OpenAI's shape."""

import asyncio
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis.asyncio as redis
from openai import OpenAI

from services.cli.launcher import Service
from shared.keys import KeyLimits
from shared.names import Names
from tests.conftest import create_key
from tests.contract.transport import ContractTransport
from tests.e2e.conftest import SIM_MODEL
from tests.e2e.test_sessions import wait_persisted
from tests.services import ServiceUrls

pytestmark = pytest.mark.e2e

LONG = " ".join(f"word{i}" for i in range(40))
WEATHER_ARGS = '{"city": "Paris"}'


@pytest.fixture
def checked(gateway: Service, api_key: str) -> Iterator[tuple[OpenAI, ContractTransport]]:
    """The SDK client whose every answer (conversations, items, errors) is checked against OpenAI's schemas."""
    transport = ContractTransport()
    http = httpx.Client(transport=transport, timeout=30)
    yield OpenAI(base_url=f"{gateway.url}/v1", api_key=api_key, max_retries=0, http_client=http), transport
    http.close()
    assert not transport.violations


@pytest.fixture(scope="module")
def other_client(gateway: Service, database_url: str) -> OpenAI:
    key = asyncio.run(create_key(database_url, name="conversations-other", limits=KeyLimits(), tenant="conv-other"))
    return OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=30)


def session_of(conversation_id: str) -> str:
    return str(uuid.UUID(conversation_id.removeprefix("conv_")))


def test_conversation_and_items_lifecycle(
    checked: tuple[OpenAI, ContractTransport], auth: dict, gateway: Service
) -> None:
    client, transport = checked
    conversation = client.conversations.create(
        items=[
            {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Be brief."}]},
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": WEATHER_ARGS},
            {"type": "function_call_output", "call_id": "call_1", "output": "22 C"},
        ],
        metadata={"topic": "weather"},
    )
    assert conversation.id.startswith("conv_") and conversation.metadata == {"topic": "weather"}
    assert client.conversations.retrieve(conversation.id).created_at == conversation.created_at
    updated = client.conversations.update(conversation.id, metadata={"topic": "paris", "n": "2"})
    assert updated.metadata == {"topic": "paris", "n": "2"}

    # The assistant message and its call are one stored message: seq 3, parts 0 and 1.
    ids = ["msg_1", "msg_2", "msg_3", "fc_3_1", "fco_4"]
    newest_first = client.conversations.items.list(conversation.id)
    assert [i.id for i in newest_first.data] == ids[::-1] and newest_first.has_more is False
    oldest_first = client.conversations.items.list(conversation.id, order="asc")
    assert [i.id for i in oldest_first.data] == ids
    call = oldest_first.data[3]
    assert (call.type, call.call_id, call.name, call.arguments) == (
        "function_call",
        "call_1",
        "get_weather",
        WEATHER_ARGS,
    )
    assert oldest_first.data[1].content[0].type == "input_text"
    assert oldest_first.data[2].content[0].type == "output_text"
    page = client.conversations.items.list(conversation.id, order="asc", limit=2, after="msg_2")
    assert [i.id for i in page.data] == ["msg_3", "fc_3_1"] and page.has_more
    assert [i.id for i in client.conversations.items.list(conversation.id, order="asc", limit=2)] == ids  # auto-pages
    assert [i.id for i in client.conversations.items.list(conversation.id, limit=2, after="fc_3_1").data] == [
        "msg_3",
        "msg_2",
    ]

    created = client.conversations.items.create(
        conversation.id,
        items=[{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Thanks"}]}],
    )
    assert [i.id for i in created.data] == ["msg_5"] and created.first_id == created.last_id == "msg_5"
    item = client.conversations.items.retrieve("msg_5", conversation_id=conversation.id)
    assert item.type == "message" and item.role == "user" and item.content[0].text == "Thanks"

    # The same conversation through the sessions API.
    session_id = session_of(conversation.id)
    session = httpx.get(f"{gateway.url}/v1/sessions/{session_id}", headers=auth).json()
    assert session["id"] == session_id
    messages = httpx.get(f"{gateway.url}/v1/sessions/{conversation.id}/messages", headers=auth).json()["data"]
    assert [(m["seq"], m["role"]) for m in messages] == [
        (1, "system"),
        (2, "user"),
        (3, "assistant"),
        (4, "tool"),
        (5, "user"),
    ]
    assert messages[2]["content"] == "Checking." and messages[2]["tool_calls"][0]["id"] == "call_1"

    assert client.conversations.items.delete("fc_3_1", conversation_id=conversation.id).id == conversation.id
    assert [i.id for i in client.conversations.items.list(conversation.id, order="asc")] == [
        "msg_1",
        "msg_2",
        "msg_3",
        "fco_4",
        "msg_5",
    ]
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve("fc_3_1", conversation_id=conversation.id)
    messages = httpx.get(f"{gateway.url}/v1/sessions/{session_id}/messages", headers=auth).json()["data"]
    assert "tool_calls" not in messages[2]

    deleted = client.conversations.delete(conversation.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (conversation.id, True, "conversation.deleted")
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conversation.id)
    assert httpx.get(f"{gateway.url}/v1/sessions/{session_id}", headers=auth).status_code == 404
    assert {"Conversation", "ConversationItemList", "ConversationItem", "ConversationDeletedResource"} <= set(
        transport.checked
    )


def test_chat_turns_append_items_and_a_deleted_item_leaves_the_prompt(
    checked: tuple[OpenAI, ContractTransport], namespace: str, database_url: str, service_urls: ServiceUrls
) -> None:
    client, _ = checked
    conversation = client.conversations.create(items=[{"role": "user", "content": LONG}])
    session_id = session_of(conversation.id)

    def turn(text: str) -> int:
        answer = client.chat.completions.create(
            model=SIM_MODEL,
            messages=[{"role": "user", "content": text}],
            max_tokens=3,
            extra_body={"session_id": conversation.id},  # the conversation id names the session too
        )
        assert answer.usage is not None
        return answer.usage.prompt_tokens

    first = turn("hello")
    items = client.conversations.items.list(conversation.id, order="asc").data
    assert [(i.id, i.role) for i in items] == [("msg_1", "user"), ("msg_2", "user"), ("msg_3", "assistant")]
    assert items[2].content[0].type == "output_text" and items[2].status == "completed"

    client.conversations.items.delete("msg_1", conversation_id=conversation.id)
    second = turn("again")
    # The sim counts the prompt's words: the 40 deleted ones are gone, turn one came in.
    assert second < first - 30, (first, second)

    # Durable: once persisted, a history rebuilt from PostgreSQL leaves the item out too.
    wait_persisted(database_url, session_id, 5)

    async def drop_cached_history() -> None:
        client = redis.Redis.from_url(service_urls.redis)
        await client.delete(Names(namespace).history(session_id))
        await client.aclose()

    asyncio.run(drop_cached_history())
    assert [i.id for i in client.conversations.items.list(conversation.id, order="asc")] == [
        "msg_2",
        "msg_3",
        "msg_4",
        "msg_5",
    ]
    assert turn("third") < first


def _error(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    return caught.value


def test_bad_input_is_400_naming_the_param(checked: tuple[OpenAI, ContractTransport]) -> None:
    client, _ = checked
    conversation = client.conversations.create()
    cases = [
        (lambda: client.conversations.create(items=[{"type": "web_search_call", "id": "x"}]), "items[0].type"),
        (lambda: client.conversations.create(items=[{"role": "user", "content": "a"}] * 21), "items"),
        (lambda: client.conversations.create(metadata={f"k{i}": "v" for i in range(17)}), "metadata"),
        (lambda: client.conversations.update(conversation.id, metadata={"k" * 65: "v"}), "metadata"),
        (
            lambda: client.conversations.items.create(
                conversation.id, items=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]
            ),
            "items[0].content[0].type",
        ),
        (
            lambda: client.conversations.items.create(conversation.id, items=[{"type": "function_call", "name": "f"}]),
            "items[0].call_id",
        ),
        (
            lambda: client.conversations.items.create(conversation.id, items=[{"role": "tool", "content": "x"}]),
            "items[0].role",
        ),
        (lambda: client.conversations.items.list(conversation.id, order="sideways"), "query.order"),  # type: ignore[arg-type]
        (lambda: client.conversations.items.list(conversation.id, limit=0), "query.limit"),
        (lambda: client.conversations.items.list(conversation.id, limit=101), "query.limit"),
        (lambda: client.conversations.items.list(conversation.id, after="nope"), "after"),
    ]
    # Query parameters are named as the sessions API names them (`query.limit`).
    for call, param in cases:
        error = _error(call)
        assert error.status_code == 400, (param, error)
        assert error.body["param"] == param, (param, error.body)  # type: ignore[index]
    assert client.conversations.items.list(conversation.id).data == []  # nothing was stored by the refusals


def test_another_tenant_gets_404_everywhere(checked: tuple[OpenAI, ContractTransport], other_client: OpenAI) -> None:
    client, _ = checked
    conversation = client.conversations.create(items=[{"role": "user", "content": "secret plans"}], metadata={"a": "b"})
    for call in (
        lambda: other_client.conversations.retrieve(conversation.id),
        lambda: other_client.conversations.update(conversation.id, metadata={"mine": "yes"}),
        lambda: other_client.conversations.delete(conversation.id),
        lambda: other_client.conversations.items.list(conversation.id),
        lambda: other_client.conversations.items.create(conversation.id, items=[{"role": "user", "content": "x"}]),
        lambda: other_client.conversations.items.retrieve("msg_1", conversation_id=conversation.id),
        lambda: other_client.conversations.items.delete("msg_1", conversation_id=conversation.id),
        lambda: other_client.conversations.retrieve("conv_not-hex"),
        lambda: client.conversations.items.retrieve("msg_9", conversation_id=conversation.id),
        lambda: client.conversations.items.delete("fc_1_1", conversation_id=conversation.id),
    ):
        error = _error(call)
        assert error.status_code == 404 and "secret" not in str(error.body), error
        assert error.body["code"] in {"conversation_not_found", "item_not_found"}  # type: ignore[index]
    assert client.conversations.retrieve(conversation.id).metadata == {"a": "b"}
    assert [i.id for i in client.conversations.items.list(conversation.id)] == ["msg_1"]
