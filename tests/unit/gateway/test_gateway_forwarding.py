"""What the gateway forwards: the upstream path of a request, and its prompt-token estimate,
whatever the client sent."""

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from services.gateway.auth import anthropic_authorization
from services.gateway.proxy import _stream_end, estimate_prompt_tokens, upstream_target
from services.sessions.messages.protocol import MessageEvents, error_event
from shared.errors import UpstreamError
from shared.url_params import ANY


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = FastAPI()

    @app.get("/v1/sessions")
    @app.get("/v1/sessions/{session_id}")
    @app.get("/v1/sessions/{session_id}/messages")
    @app.get(f"/v1/models/{{model_id:{ANY}}}")
    async def target(request: Request) -> dict:
        return {"target": upstream_target(request)}

    return TestClient(app)


@pytest.mark.parametrize(
    ("sent", "forwarded"),
    [
        ("/v1/sessions", "/v1/sessions"),
        ("/v1/sessions?limit=5&after=abc", "/v1/sessions?limit=5&after=abc"),
        ("/v1/sessions/3f1c9a2e-0000-4000-8000-000000000000", "/v1/sessions/3f1c9a2e-0000-4000-8000-000000000000"),
        # A control character stays escaped (it used to make an invalid upstream URL: a 500).
        ("/v1/sessions/%0F", "/v1/sessions/%0F"),
        ("/v1/sessions/%0A%C2%85/messages", "/v1/sessions/%0A%C2%85/messages"),
        # `..` and `.` stay one parameter (they used to be normalised into another upstream path).
        ("/v1/sessions/%2E%2E/messages", "/v1/sessions/%2E%2E/messages"),
        ("/v1/sessions/%2E", "/v1/sessions/%2E"),
        ("/v1/sessions/a%25b%20c", "/v1/sessions/a%25b%20c"),
        ("/v1/sessions/%C3%A9?after=%C3%A9&x=%0A", "/v1/sessions/%C3%A9?after=%C3%A9&x=%0A"),
        # A model id is one parameter whatever it holds: `/` (as the SDK escapes it, or not), a newline.
        ("/v1/models/org%2Fmodel", "/v1/models/org%2Fmodel"),
        ("/v1/models/org/model", "/v1/models/org%2Fmodel"),
        ("/v1/models/a%0Ab", "/v1/models/a%0Ab"),
    ],
)
def test_upstream_target_keeps_each_parameter_one_escaped_segment(
    client: TestClient, sent: str, forwarded: str
) -> None:
    assert client.get(sent).json()["target"] == forwarded


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 1.5}]}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": ["a"]}, "part", None]}]},
        {"messages": ["not a message", None, {"content": {"a": 1}}]},
        {"messages": {"role": "user"}, "prompt": [1, None, "abcd"]},
        {"prompt": 12},
    ],
)
def test_prompt_estimate_takes_any_shape(body: dict) -> None:
    """The gateway does not validate bodies (the session manager does); its estimate must not
    crash on shapes the session manager will refuse (it used to: a 500)."""
    assert estimate_prompt_tokens(body) >= 0


def test_prompt_estimate_counts_text() -> None:
    body = {
        "messages": [
            {"role": "user", "content": "x" * 40},
            {"role": "user", "content": [{"type": "text", "text": "y" * 8}]},
        ]
    }
    assert estimate_prompt_tokens(body) == 12 + 2 * 4


@pytest.mark.parametrize(
    ("n", "factor"), [(None, 1), (1, 1), (3, 3), (128, 128), (129, 1), (0, 1), (True, 1), ("4", 1)]
)
def test_prompt_estimate_is_charged_once_per_choice(n: object, factor: int) -> None:
    """Each of `n` choices is a job that reads the prompt; an `n` the session manager will refuse
    (out of range, not an integer) counts once."""
    body = {"messages": [{"role": "user", "content": "x" * 40}], "n": n}
    assert estimate_prompt_tokens(body) == (10 + 4) * factor


def test_a_messages_body_is_estimated_with_its_system_prompt() -> None:
    text = [{"role": "user", "content": [{"type": "text", "text": "y" * 8}]}]
    assert estimate_prompt_tokens({"system": "x" * 40, "messages": text}) == 12 + 2 * 4
    assert estimate_prompt_tokens({"system": [{"type": "text", "text": "x" * 40}, 3], "messages": text}) == 12 + 4


@pytest.mark.parametrize(
    ("piece", "end"),
    [
        (b"".join(MessageEvents(job_id="j", model="m").closing(reason="stop", usage=None, stop_sequence=None)), True),
        (error_event(UpstreamError("The worker failed.")), True),
        (b"".join(MessageEvents(job_id="j", model="m").opening()), False),
        (b'event: content_block_delta\ndata: {"delta": {"text": "event: message_stop\\n"}}\n\n', False),
    ],
)
def test_the_gateway_sees_where_a_messages_stream_ends(piece: bytes, end: bool) -> None:
    assert _stream_end(piece) is end


@pytest.mark.parametrize(
    ("authorization", "x_api_key", "checked"),
    [
        (None, "axk_1", "Bearer axk_1"),
        ("Bearer axk_2", "axk_1", "Bearer axk_2"),
        ("Bearer axk_2", None, "Bearer axk_2"),
        (None, None, None),
    ],
)
def test_anthropics_clients_send_the_key_in_x_api_key(
    authorization: str | None, x_api_key: str | None, checked: str | None
) -> None:
    assert anthropic_authorization(authorization, x_api_key) == checked
