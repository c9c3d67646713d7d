"""The playground's files ship in the wheel, the gateway serves its scripts and styles only, and its script
speaks the Conversations and Responses APIs."""

import tomllib
from pathlib import Path, PurePosixPath

from fastapi import FastAPI
from fastapi.testclient import TestClient

from services.gateway import playground
from shared.http_errors import install_error_handlers

ROOT = Path(__file__).resolve().parents[3]


def test_every_playground_file_is_package_data() -> None:
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "services.gateway"
    ]
    package = playground.STATIC_DIR.parents[1]
    files = [p.relative_to(package).as_posix() for p in playground.STATIC_DIR.rglob("*") if p.is_file()]
    assert files
    for name in files:
        path = PurePosixPath(name)
        assert any(len(path.parts) == len(PurePosixPath(p).parts) and path.match(p) for p in patterns), name


def test_the_page_and_its_assets_carry_the_security_headers() -> None:
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(playground.create_router())
    client = TestClient(app)
    page = client.get("/playground")
    assert page.status_code == 200 and 'src="/playground/static/app.js"' in page.text
    for path in [
        "/playground",
        "/playground/static/app.js",
        "/playground/static/app.css",
        "/playground/static/vendor/purify.min.js",
    ]:
        response = client.get(path)
        assert response.status_code == 200, path
        for name, value in playground.SECURITY_HEADERS.items():
            assert response.headers[name] == value, (path, name)
    assert client.get("/playground/static/app.css").headers["content-type"] == "text/css; charset=utf-8"
    assert client.get("/playground/static/vendor/README.md").status_code == 404


def test_the_page_talks_conversations_and_responses_not_chat_completions() -> None:
    # The e2e test records the requests the page makes; this is the quick check of its script.
    script = (playground.STATIC_DIR / "app.js").read_text()
    for call in [
        '"/v1/responses"',
        '"/v1/conversations"',
        "`/v1/conversations/${id}/items?${query}`",
        '`/v1/conversations/${id}`, { method: "DELETE" }',
        "body.conversation = state.conversationId",
        '"response.output_text.delta"',
        '"response.function_call_arguments.delta"',
        "body.max_output_tokens",
        "body.text = { format:",
        "/v1/sessions?",  # the sidebar: OpenAI has no list of conversations
    ]:
        assert call in script, call
    for gone in ["/v1/chat/completions", "session_id", "/messages"]:
        assert gone not in script, gone
