"""OpenAI's Responses API through the official `openai` client, on the shared stack (sim engine):
create (string and items input, instructions), retrieve, delete, input items, a
`previous_response_id` chain, a `conversation` it appends to, a function tool round trip, bad
input, a stored response read back from PostgreSQL once Redis lost it, background responses
(polled, streamed, cancelled), a stored foreground stream cancelled, a stored stream resumed
after its client left, and a resumed stream holding its key's concurrency until it ends. Every
answer is checked against the SDK's models on the way (`tests/contract/transport.py`). Kill tests:
`test_responses_takeover.py`."""

import asyncio
import json
import time
from collections.abc import Iterator

import asyncpg
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
from tests.e2e.test_workers import metric
from tests.services import ServiceUrls

pytestmark = pytest.mark.e2e

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.fixture
def checked(gateway: Service, api_key: str) -> Iterator[tuple[OpenAI, ContractTransport]]:
    """The SDK client whose every answer is checked against the SDK's Response models."""
    transport = ContractTransport()
    http = httpx.Client(transport=transport, timeout=30)
    yield OpenAI(base_url=f"{gateway.url}/v1", api_key=api_key, max_retries=0, http_client=http), transport
    http.close()
    assert not transport.violations


@pytest.fixture(scope="module")
def other_client(gateway: Service, database_url: str) -> OpenAI:
    key = asyncio.run(create_key(database_url, name="responses-other", limits=KeyLimits(), tenant="resp-other"))
    return OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=30)


def _error(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    return caught.value


def test_create_retrieve_input_items_delete(checked: tuple[OpenAI, ContractTransport]) -> None:
    client, transport = checked
    response = client.responses.create(
        model=SIM_MODEL, input="Tell me a story.", instructions="Be brief.", max_output_tokens=5, metadata={"k": "v"}
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text and response.output[0].type == "message"
    assert response.usage is not None and response.usage.output_tokens == 5
    assert response.usage.total_tokens == response.usage.input_tokens + 5
    assert response.instructions == "Be brief." and response.metadata == {"k": "v"} and response.store is True

    again = client.responses.retrieve(response.id)
    assert again.model_dump() == response.model_dump()
    items = client.responses.input_items.list(response.id)
    assert [(i.type, i.role) for i in items.data] == [("message", "user")]  # instructions are no input item
    assert items.data[0].content[0].text == "Tell me a story."

    client.responses.delete(response.id)
    assert _error(lambda: client.responses.retrieve(response.id)).status_code == 404
    assert _error(lambda: client.responses.delete(response.id)).status_code == 404
    assert {"Response", "ResponseItemList"} <= set(transport.checked)


def test_items_input_and_a_previous_response_id_chain(checked: tuple[OpenAI, ContractTransport]) -> None:
    client, _ = checked
    first = client.responses.create(
        model=SIM_MODEL,
        input=[
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Answer shortly."}]},
            {"role": "user", "content": "Name a colour."},
        ],
        max_output_tokens=4,
        temperature=0.5,
        top_p=0.9,
    )
    assert first.usage is not None and (first.temperature, first.top_p) == (0.5, 0.9)
    items = client.responses.input_items.list(first.id, order="asc")
    assert [i.role for i in items.data] == ["developer", "user"]
    page = client.responses.input_items.list(first.id, order="asc", limit=1)
    assert page.has_more and [i.role for i in client.responses.input_items.list(first.id, after=page.last_id)] == []

    second = client.responses.create(
        model=SIM_MODEL, input="And another?", previous_response_id=first.id, max_output_tokens=4
    )
    assert second.previous_response_id == first.id and second.usage is not None
    # The sim counts the prompt's words: the second prompt holds the first's input and its answer.
    grown = second.usage.input_tokens - first.usage.input_tokens
    assert grown >= len(first.output_text.split()) + 2, (first.usage, second.usage)
    # Input items are this response's own input.
    assert [i.content[0].text for i in client.responses.input_items.list(second.id).data] == ["And another?"]

    unstored = client.responses.create(model=SIM_MODEL, input="x", store=False, max_output_tokens=2)
    assert unstored.store is False
    for call in (
        lambda: client.responses.retrieve(unstored.id),
        lambda: client.responses.create(model=SIM_MODEL, input="y", previous_response_id=unstored.id),
    ):
        assert _error(call).status_code == 404


def test_conversation_gets_the_input_and_output_items(checked: tuple[OpenAI, ContractTransport]) -> None:
    client, _ = checked
    conversation = client.conversations.create(items=[{"role": "user", "content": "My name is Ada."}])
    first = client.responses.create(
        model=SIM_MODEL, input="What is my name?", conversation=conversation.id, max_output_tokens=3
    )
    assert first.conversation is not None and first.conversation.id == conversation.id
    items = client.conversations.items.list(conversation.id, order="asc").data
    assert [(i.type, i.role) for i in items] == [("message", "user"), ("message", "user"), ("message", "assistant")]
    assert items[2].content[0].text == first.output_text
    second = client.responses.create(
        model=SIM_MODEL,
        input="Again?",
        conversation={"id": conversation.id},
        instructions="Be kind.",
        max_output_tokens=3,
    )
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens
    items = client.conversations.items.list(conversation.id, order="asc").data
    assert len(items) == 5 and all(i.role != "system" for i in items)  # instructions stay out of the conversation


def test_function_tool_round_trip(checked: tuple[OpenAI, ContractTransport]) -> None:
    client, _ = checked
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = client.responses.create(model=SIM_MODEL, input=ask, tools=[WEATHER], tool_choice="required")
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and called.status == "completed"
    assert set(json.loads(calls[0].arguments)) == {"city"}
    assert called.tool_choice == "required" and called.tools[0].name == "get_weather"

    answered = client.responses.create(
        model=SIM_MODEL,
        previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "22 C and sunny"}],
        tools=[WEATHER],
        max_output_tokens=8,
    )
    assert answered.output_text and not [item for item in answered.output if item.type == "function_call"]
    # The same round trip with the call sent back as input items.
    explicit = client.responses.create(
        model=SIM_MODEL,
        input=[
            *ask,
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": "get_weather",
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "22 C and sunny"},
        ],
        tools=[WEATHER],
        max_output_tokens=8,
    )
    assert explicit.output_text


def test_json_schema_text_format(checked: tuple[OpenAI, ContractTransport]) -> None:
    client, _ = checked
    schema = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"]}
    response = client.responses.create(
        model=SIM_MODEL,
        input="A colour as JSON.",
        text={"format": {"type": "json_schema", "name": "colour", "schema": schema, "strict": True}},
    )
    assert set(json.loads(response.output_text)) == {"colour"}
    assert response.text is not None and response.text.format is not None and response.text.format.type == "json_schema"


def test_bad_input(checked: tuple[OpenAI, ContractTransport], other_client: OpenAI) -> None:
    client, _ = checked
    conversation = client.conversations.create()
    stored = client.responses.create(model=SIM_MODEL, input="mine", max_output_tokens=2)
    cases = [
        (
            lambda: client.responses.create(model=SIM_MODEL, input=[{"type": "web_search_call", "id": "x"}]),
            400,
            "input[0].type",
        ),
        (
            lambda: client.responses.create(
                model=SIM_MODEL, input="x", previous_response_id=stored.id, conversation=conversation.id
            ),
            400,
            "previous_response_id",
        ),
        (
            lambda: client.responses.create(model=SIM_MODEL, input="x", background=True, store=False),
            400,
            "background",
        ),
        (
            lambda: client.responses.create(model=SIM_MODEL, input="x", max_output_tokens=10**7),
            400,
            "max_output_tokens",
        ),
        (lambda: client.responses.create(model=SIM_MODEL, input=[]), 400, "input"),
        (
            lambda: client.responses.create(model=SIM_MODEL, input="x", previous_response_id="resp_nope"),
            404,
            "previous_response_id",
        ),
        (lambda: client.responses.cancel(stored.id), 400, "response_id"),
        (lambda: other_client.responses.retrieve(stored.id), 404, "response_id"),
        (lambda: other_client.responses.delete(stored.id), 404, "response_id"),
        (lambda: other_client.responses.input_items.list(stored.id), 404, "response_id"),
        (lambda: other_client.responses.cancel(stored.id), 404, "response_id"),
        (
            lambda: other_client.responses.create(model=SIM_MODEL, input="x", previous_response_id=stored.id),
            404,
            "previous_response_id",
        ),
        (
            lambda: other_client.responses.create(model=SIM_MODEL, input="x", conversation=conversation.id),
            404,
            "conversation_id",
        ),
    ]
    for call, status, param in cases:
        error = _error(call)
        assert (error.status_code, error.body["param"]) == (status, param), (param, error.body)  # type: ignore[index]
    assert client.responses.retrieve(stored.id).id == stored.id
    assert client.conversations.items.list(conversation.id).data == []  # nothing was appended by the refusals
    # max_output_tokens out of bounds, with OpenAI's codes: below 1, and past the whole context.
    for max_output_tokens, code in ((0, "integer_below_min_value"), (10**7, "context_length_exceeded")):
        error = _error(
            lambda n=max_output_tokens: client.responses.create(model=SIM_MODEL, input="x", max_output_tokens=n)
        )
        assert (error.body["param"], error.body["code"]) == ("max_output_tokens", code), error.body  # type: ignore[index]


def _persisted(database_url: str, response_id: str, timeout_s: float = 10) -> bool:
    async def row() -> bool:
        conn = await asyncpg.connect(database_url)
        try:
            return bool(await conn.fetchval("SELECT body IS NOT NULL FROM responses WHERE id = $1", response_id))
        finally:
            await conn.close()

    deadline = time.monotonic() + timeout_s
    while not asyncio.run(row()):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_stored_response_outlives_its_redis_copy(
    checked: tuple[OpenAI, ContractTransport], database_url: str, namespace: str, service_urls: ServiceUrls
) -> None:
    client, _ = checked
    first = client.responses.create(model=SIM_MODEL, input="Remember this.", max_output_tokens=4)
    assert _persisted(database_url, first.id)

    async def drop() -> None:
        r = redis.Redis.from_url(service_urls.redis)
        assert await r.delete(Names(namespace).response(first.id)) == 1
        await r.aclose()

    asyncio.run(drop())
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(model=SIM_MODEL, input="And?", previous_response_id=first.id, max_output_tokens=2)
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens
    client.responses.delete(first.id)
    assert _error(lambda: client.responses.retrieve(first.id)).status_code == 404


def test_streamed_events_in_order_with_sequence_numbers(checked: tuple[OpenAI, ContractTransport]) -> None:
    client, transport = checked
    events = list(client.responses.create(model=SIM_MODEL, input="Stream a story.", max_output_tokens=12, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 2
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # max_output_tokens cut it
    ]
    assert events[0].response.status == "in_progress"  # type: ignore[union-attr]
    final = events[-1].response  # type: ignore[union-attr]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert text == final.output_text == events[-4].text  # type: ignore[union-attr]
    assert final.usage is not None and final.usage.output_tokens == 12
    assert client.responses.retrieve(final.id).output_text == text  # stored before its last event
    assert transport.checked.get("ResponseStreamEvent", 0) == len(events)


def test_the_stream_helper_and_sse_ids(checked: tuple[OpenAI, ContractTransport], gateway: Service, auth: dict) -> None:
    client, _ = checked
    # The helper's final response is that of `response.completed`: an answer that ends on its own
    # (the sim's plain answers run to max_output_tokens; a JSON one stops once complete).
    schema = {"type": "object", "properties": {"greeting": {"type": "string"}}, "required": ["greeting"]}
    text_format = {"format": {"type": "json_schema", "name": "greeting", "schema": schema}}
    with client.responses.stream(model=SIM_MODEL, input="Hello there.", text=text_format) as stream:  # type: ignore[arg-type]
        texts = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text and final.status == "completed"

    body = {"model": SIM_MODEL, "input": "Hi.", "max_output_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{gateway.url}/v1/responses", json=body, headers=auth, timeout=30) as raw:
        assert raw.headers["content-type"].startswith("text/event-stream")
        blocks = [b for b in raw.read().decode().split("\n\n") if b]
    for number, block in enumerate(blocks):
        kind, sse_id, data = block.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {payload['type']}" and sse_id == f"id: {number}" == f"id: {payload['sequence_number']}"


def test_streamed_function_call(checked: tuple[OpenAI, ContractTransport]) -> None:
    client, _ = checked
    events = list(
        client.responses.create(
            model=SIM_MODEL, input="Weather in Paris?", tools=[WEATHER], tool_choice="required", stream=True
        )
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[-1] == "response.completed" and "response.function_call_arguments.done" in kinds
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    for call in done:  # each call's argument pieces add up to its arguments
        pieces = [
            e.delta for e in events if e.type == "response.function_call_arguments.delta" and e.item_id == call.item_id
        ]  # type: ignore[union-attr]
        assert "".join(pieces) == call.arguments and set(json.loads(call.arguments)) == {"city"}  # type: ignore[union-attr]
    final = events[-1].response  # type: ignore[union-attr]
    calls = [item for item in final.output if item.type == "function_call"]
    assert [(c.id, c.arguments, c.name) for c in calls] == [(d.item_id, d.arguments, "get_weather") for d in done]  # type: ignore[union-attr]


def test_a_client_that_leaves_an_unstored_stream_stops_it(
    checked: tuple[OpenAI, ContractTransport], sessions: Service
) -> None:
    client, _ = checked
    labels = {"model": SIM_MODEL, "outcome": "disconnected"}
    before = metric(sessions, "axon_sessions_requests_total", **labels)
    stream = client.responses.create(
        model=SIM_MODEL, input="A long story.", max_output_tokens=2000, stream=True, store=False
    )
    events = iter(stream)
    created = next(events)
    for _ in range(10):
        next(events)
    stream.close()
    deadline = time.monotonic() + 10
    while metric(sessions, "axon_sessions_requests_total", **labels) < before + 1:
        assert time.monotonic() < deadline, "the job was not stopped"
        time.sleep(0.1)
    # An unstored response is not kept.
    assert _error(lambda: client.responses.retrieve(created.response.id)).status_code == 404  # type: ignore[union-attr]


def test_a_streamed_response_extends_its_conversation_and_chain(checked: tuple[OpenAI, ContractTransport]) -> None:
    client, _ = checked
    conversation = client.conversations.create(items=[{"role": "user", "content": "Hello."}])
    events = list(
        client.responses.create(
            model=SIM_MODEL, input="Go on.", conversation=conversation.id, max_output_tokens=4, stream=True
        )
    )
    final = events[-1].response  # type: ignore[union-attr]
    items = client.conversations.items.list(conversation.id, order="asc").data
    assert [i.role for i in items] == ["user", "user", "assistant"]  # type: ignore[union-attr]
    assert items[2].content[0].text == final.output_text  # type: ignore[union-attr]
    chained = client.responses.create(model=SIM_MODEL, input="More.", previous_response_id=final.id, stream=True)
    last = list(chained)[-1].response  # type: ignore[union-attr]
    assert last.previous_response_id == final.id and last.usage.input_tokens > final.usage.input_tokens


def wait_status(
    client: OpenAI, response_id: str, statuses: set[str], timeout_s: float = 20
) -> openai.types.responses.Response:
    """The response once its status is one of `statuses`, polled every 50 ms for `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = client.responses.retrieve(response_id)
        if response.status in statuses:
            return response
        assert time.monotonic() < deadline, f"still {response.status}"
        time.sleep(0.05)


def test_background_polling_to_completed(checked: tuple[OpenAI, ContractTransport], other_client: OpenAI) -> None:
    client, _ = checked
    queued = client.responses.create(model=SIM_MODEL, input="Background story.", max_output_tokens=150, background=True)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    running = wait_status(client, queued.id, {"in_progress"})
    assert running.output_text  # the output so far, from the job's chunk log
    done = wait_status(client, queued.id, {"incomplete", "completed"})
    assert done.usage is not None and done.usage.output_tokens == 150
    assert done.output_text.startswith(running.output_text) and len(done.output_text) > len(running.output_text)
    cancel_finished = _error(lambda: client.responses.cancel(queued.id))
    assert (cancel_finished.status_code, cancel_finished.body["param"]) == (400, "response_id")  # type: ignore[index]
    # The whole stream, replayed from its chunk log, ends with the stored response.
    events = list(client.responses.retrieve(queued.id, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "queued" and events[-1].response == done  # type: ignore[union-attr]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert text == done.output_text
    for call in (
        lambda: other_client.responses.retrieve(queued.id),
        lambda: other_client.responses.retrieve(queued.id, stream=True),
        lambda: other_client.responses.cancel(queued.id),
        lambda: other_client.responses.input_items.list(queued.id),
    ):
        assert _error(call).status_code == 404


def test_background_cancel_and_stream(checked: tuple[OpenAI, ContractTransport]) -> None:
    client, _ = checked
    queued = client.responses.create(model=SIM_MODEL, input="A very long one.", max_output_tokens=4000, background=True)
    wait_status(client, queued.id, {"in_progress"})
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled" and cancelled.output_text
    assert client.responses.retrieve(queued.id).status == "cancelled"
    assert _error(lambda: client.responses.cancel(queued.id)).status_code == 400

    streamed = list(
        client.responses.create(model=SIM_MODEL, input="Go.", max_output_tokens=8, background=True, stream=True)
    )
    assert [e.sequence_number for e in streamed] == list(range(len(streamed)))
    assert streamed[0].type == "response.created" and streamed[0].response.status == "queued"  # type: ignore[union-attr]
    final = streamed[-1].response  # type: ignore[union-attr]
    assert streamed[-1].type == "response.incomplete" and final.usage.output_tokens == 8
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_a_stored_foreground_stream_is_cancelled_and_left_out_of_its_conversation(
    checked: tuple[OpenAI, ContractTransport],
) -> None:
    """Cancel stops any unfinished stored response, not only a background one (an Axon
    extension): the stream still reading it ends `cancelled`, and its conversation gets nothing."""
    client, _ = checked
    conversation = client.conversations.create(items=[{"role": "user", "content": "Hello."}])
    stream = client.responses.create(
        model=SIM_MODEL, input="A very long one.", max_output_tokens=4000, conversation=conversation.id, stream=True
    )
    events = []
    for event in stream:
        events.append(event)
        if event.type == "response.output_text.delta":
            break
    response_id = events[0].response.id  # type: ignore[union-attr]
    cancelled = client.responses.cancel(response_id)
    assert cancelled.status == "cancelled" and cancelled.output_text
    events += list(stream)
    assert events[-1].type == "response.failed" and events[-1].response.status == "cancelled"  # type: ignore[union-attr]
    assert client.responses.retrieve(response_id).status == "cancelled"
    items = client.conversations.items.list(conversation.id, order="asc").data
    assert [i.content[0].text for i in items] == ["Hello."]  # type: ignore[union-attr]
    assert _error(lambda: client.responses.cancel(response_id)).status_code == 400


def test_a_stored_stream_outlives_its_client_and_resumes(checked: tuple[OpenAI, ContractTransport]) -> None:
    client, _ = checked
    stream = client.responses.create(model=SIM_MODEL, input="Resume me.", max_output_tokens=120, stream=True)
    seen = []
    for event in stream:
        seen.append(event)
        if len(seen) == 12:
            break
    stream.close()
    response_id = seen[0].response.id  # type: ignore[union-attr]
    last = seen[-1].sequence_number
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=last))
    assert [e.sequence_number for e in rest] == list(range(last + 1, last + 1 + len(rest)))
    events = seen + rest
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    stored = client.responses.retrieve(response_id)
    assert stored.status == "incomplete" and stored.usage is not None and stored.usage.output_tokens == 120
    assert text == stored.output_text and rest[-1].response == stored  # type: ignore[union-attr]
    # Replayed whole, the stream is the same one.
    again = list(client.responses.retrieve(response_id, stream=True))
    assert [e.model_dump() for e in again[: len(seen)]] == [e.model_dump() for e in seen]
    past = _error(lambda: list(client.responses.retrieve(response_id, stream=True, starting_after=len(again) - 1)))
    assert (past.status_code, past.body["param"]) == (400, "starting_after")  # type: ignore[index]


def test_a_resumed_stream_holds_its_keys_concurrency(
    checked: tuple[OpenAI, ContractTransport], gateway: Service, database_url: str
) -> None:
    """A stream of a response's events (GET ?stream=true) counts against its key's max_concurrent
    until it ends, as a completion stream does: the gateway held neither its slot nor its lease."""
    client, _ = checked
    limits = KeyLimits(max_concurrent=1)
    key = asyncio.run(create_key(database_url, name="responses-one-at-a-time", limits=limits, tenant="tests"))
    one = {"Authorization": f"Bearer {key}"}
    queued = client.responses.create(model=SIM_MODEL, input="A very long one.", max_output_tokens=4000, background=True)
    url = f"{gateway.url}/v1/responses/{queued.id}"
    try:
        with httpx.stream("GET", url, params={"stream": "true"}, headers=one, timeout=30) as streamed:
            assert streamed.status_code == 200
            pieces = streamed.iter_bytes()  # kept: a generator let go closes the stream
            assert next(pieces).startswith(b"event: response.created\n")
            assert httpx.get(url, headers=one, timeout=30).status_code == 429
        deadline = time.monotonic() + 5  # the stream's lease goes once the gateway saw it end
        while (status := httpx.get(url, headers=one, timeout=30).status_code) == 429:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert status == 200
    finally:
        client.responses.cancel(queued.id)
