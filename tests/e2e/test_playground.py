"""The playground page in a real browser: headless Debian Chromium, driven by Playwright, against
the e2e stack (sim engine).

Chromium must be at /usr/bin/chromium (`infra/scripts/install-chromium.sh`, run by `make test`);
Playwright never downloads a browser. Without it the browser tests skip, except under CI, where
they fail. Every browser test saves a screenshot of its page at the end, pass or fail, in the
run's `artifacts/playground` folder under pytest's base temporary directory (see `--basetemp`).
"""

import itertools
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from playwright.sync_api import Browser, Dialog, Locator, Page, Request, expect, sync_playwright

from services.cli.launcher import Service
from tests.e2e.conftest import SIM_MODEL
from tests.e2e.stack import ADMIN_TOKEN
from tests.e2e.test_workers import metric

pytestmark = pytest.mark.e2e

CHROMIUM = Path("/usr/bin/chromium")
# As root Chromium needs --no-sandbox; the rest keep it from calling out of this closed network.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Long enough to stop mid-stream: 4000 sim tokens take 20 s at the e2e stack's 5 ms per token.
LONG_ANSWER_TOKENS = 4000


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        message = f"{CHROMIUM} is missing; run infra/scripts/install-chromium.sh"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.getbasetemp() / "artifacts" / "playground"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def page(browser: Browser, gateway: Service, artifacts: Path, request: pytest.FixtureRequest) -> Iterator[Page]:
    """A fresh tab (empty session storage) on the playground; fails the test on any page error or
    Content-Security-Policy violation, and saves a screenshot at the end."""
    context = browser.new_context(base_url=gateway.url, viewport={"width": 1280, "height": 800})
    page = context.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
    page.on("console", lambda msg: problems.append(msg.text) if "Content Security Policy" in msg.text else None)
    page.set_default_timeout(10_000)
    page.goto("/playground")
    try:
        yield page
    finally:
        page.screenshot(path=artifacts / f"{request.node.name}.png", full_page=True)
        context.close()
    assert problems == []


def use_key(page: Page, key: str) -> None:
    page.fill("#api-key", key)
    page.click("#key-save")


def pick_model(page: Page, model: str) -> None:
    """Choose `model` once listed: other tests' workers serve other models, listed before it."""
    expect(page.locator("#model")).to_contain_text(model)
    page.select_option("#model", model)


def send(page: Page, text: str, *, max_tokens: int) -> None:
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def current_conversation_id(page: Page) -> str:
    match = re.fullmatch(r"#conversation=(conv_[0-9a-f]{32})", page.evaluate("location.hash"))
    assert match, page.evaluate("location.hash")
    return match.group(1)


def record_api_calls(page: Page) -> list[tuple[str, str, Any]]:
    """Every API request the page makes from now on, as (method, path and query, JSON body)."""
    calls: list[tuple[str, str, Any]] = []

    def record(request: Request) -> None:
        url = request.url.split("/", 3)[3]
        if url.startswith("v1/"):
            calls.append((request.method, f"/{url}", request.post_data_json if request.post_data else None))

    page.on("request", record)
    return calls


def items(api: httpx.Client, conversation_id: str) -> list[dict[str, Any]]:
    """The conversation's items, oldest first."""
    response = api.get(f"/v1/conversations/{conversation_id}/items", params={"order": "asc", "limit": 100})
    assert response.status_code == 200, response.text
    data: list[dict[str, Any]] = response.json()["data"]
    return data


@pytest.fixture
def api(gateway: Service, api_key: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {api_key}"}, timeout=10) as client:
        yield client


def test_page_and_assets_are_served_with_a_strict_content_security_policy(gateway: Service) -> None:
    page = httpx.get(f"{gateway.url}/playground", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "connect-src 'self'" in csp
    assert "unsafe" not in csp
    assert page.headers["x-content-type-options"] == "nosniff" and page.headers["x-frame-options"] == "DENY"
    for src in re.findall(r'<script src="([^"]+)"', page.text):
        asset = httpx.get(f"{gateway.url}{src}", timeout=10)
        assert asset.status_code == 200 and asset.headers["content-type"].startswith("text/javascript"), src
        assert asset.headers["content-security-policy"] == csp
    assert page.text.count("<script") == len(re.findall(r'<script src="[^"]+"', page.text)), "no inline script"
    # Only the page's own scripts and styles are served: not the licenses, nor anything outside.
    for path in ["nope.js", "..%2F..%2Fplayground.py", "vendor/purify.LICENSE"]:
        missing = httpx.get(f"{gateway.url}/playground/static/{path}", timeout=10)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found", path


def test_chat_streams_an_answer_with_its_timings_and_the_history_survives_a_reload(
    page: Page, api_key: str, api: httpx.Client
) -> None:
    use_key(page, api_key)
    pick_model(page, SIM_MODEL)
    assert page.evaluate("sessionStorage.getItem('axon.apiKey')") == api_key
    assert page.evaluate("localStorage.length") == 0

    calls = record_api_calls(page)
    send(page, "Hello from the playground test", max_tokens=24)
    answer = page.locator(".message.assistant").last
    expect(answer.locator(".meta")).to_contain_text(
        re.compile(r"TTFT \d+\.\d\d s · [\d.]+ tokens/s · 24 tokens · status: incomplete \(max_output_tokens\)")
    )
    text = answer.locator(".body").inner_text()
    assert len(text.split()) == 24
    conversation_id = current_conversation_id(page)
    expect(page.locator(f'.session[data-id="{conversation_id}"] .open')).to_have_text("Hello from the playground test")
    # One conversation for the chat, titled in its metadata; the answer from the Responses API.
    posts = [(path, body) for method, path, body in calls if method == "POST"]
    assert posts[0] == ("/v1/conversations", {"metadata": {"title": "Hello from the playground test"}})
    response_body = next(body for path, body in posts if path == "/v1/responses")
    assert response_body == {
        "model": SIM_MODEL,
        "input": "Hello from the playground test",
        "stream": True,
        "max_output_tokens": 24,
        "temperature": 0.7,
        "conversation": conversation_id,
    }
    assert api.get(f"/v1/conversations/{conversation_id}").json()["metadata"] == {
        "title": "Hello from the playground test"
    }
    stored = items(api, conversation_id)
    assert [(i["type"], i["role"], i["status"]) for i in stored] == [
        ("message", "user", "completed"),
        ("message", "assistant", "completed"),
    ]
    assert stored[1]["content"][0]["text"] == text

    calls.clear()
    page.reload()  # the key stays in the tab's session storage, the conversation in the address
    expect(page.locator(".message.user")).to_have_text(["Hello from the playground test"])
    expect(page.locator(".message.assistant .body")).to_have_text([text])
    expect(page.locator(f'.session[data-id="{conversation_id}"]')).to_have_class(re.compile(r"\bactive\b"))
    assert ("GET", f"/v1/conversations/{conversation_id}/items?limit=100&order=asc", None) in calls


def box(page: Page, selector: str) -> dict[str, float]:
    """The element's border box in CSS pixels (x, y, width, height)."""
    found = page.locator(selector).bounding_box()
    assert found is not None, f"{selector} is not shown"
    return dict(found)


def test_a_phone_gets_one_full_width_column_with_the_controls_stacked(page: Page, api_key: str) -> None:
    # 390 x 844 CSS pixels: an iPhone 12 to 15. The sessions come above the chat, not beside it.
    page.set_viewport_size({"width": 390, "height": 844})
    use_key(page, api_key)
    pick_model(page, SIM_MODEL)
    send(page, "A question from a phone, with_a_long_unbroken_word_that_must_wrap_inside_the_column", max_tokens=40)
    answer = page.locator(".message.assistant").last
    expect(answer.locator(".meta")).to_contain_text("40 tokens")

    chat, sidebar = box(page, ".chat"), box(page, ".sidebar")
    assert chat["width"] >= 380, chat  # the whole width, not the ~40 px left beside a fixed sidebar
    assert sidebar["y"] + sidebar["height"] <= chat["y"] + 1, (sidebar, chat)
    for selector in (".message.user", ".message.assistant", "#prompt", "#send", "#api-key"):
        shown = box(page, selector)
        assert shown["x"] >= 0 and shown["x"] + shown["width"] <= 390 + 0.5, (selector, shown)
    assert page.evaluate("document.documentElement.scrollWidth") <= 390, "the page scrolls sideways"
    # Each control on a row of its own, in order.
    rows = [box(page, s) for s in ("#max-tokens", "#temperature", "#response-format", "#send", "#stop")]
    assert all(above["y"] + above["height"] <= below["y"] for above, below in itertools.pairwise(rows)), rows


def test_stop_cancels_the_response_and_the_generation_on_the_worker(
    page: Page, api_key: str, api: httpx.Client, sim_worker: Service
) -> None:
    """Stop cancels the stored response being streamed (which leaving its stream does not stop),
    then aborts the stream: the response ends `cancelled` and its conversation keeps nothing, as
    the page says."""
    cancelled_before = metric(sim_worker, "axon_worker_jobs_total", model=SIM_MODEL, outcome="cancelled")
    use_key(page, api_key)
    pick_model(page, SIM_MODEL)
    calls = record_api_calls(page)
    send(page, "Tell me a very long story", max_tokens=LONG_ANSWER_TOKENS)

    streaming = page.locator(".message.assistant.streaming .body")
    expect(streaming).to_contain_text(re.compile(r"(\S+\s+){10}"))  # words arrive before the answer ends
    page.click("#stop")
    answer = page.locator(".message.assistant").last
    expect(answer.locator(".meta")).to_contain_text(
        re.compile(r"^Stopped · TTFT \d+\.\d\d s.* · not kept in the conversation$")
    )
    expect(page.locator("#stop")).to_be_disabled()
    expect(page.locator("#send")).to_be_enabled()
    shown = len(answer.locator(".body").inner_text().split())
    assert 10 <= shown < LONG_ANSWER_TOKENS

    deadline = time.monotonic() + 10
    while metric(sim_worker, "axon_worker_jobs_total", model=SIM_MODEL, outcome="cancelled") <= cancelled_before:
        assert time.monotonic() < deadline, "the worker did not abort the stopped generation"
        time.sleep(0.1)
    cancels = [path for method, path, _ in calls if method == "POST" and path.endswith("/cancel")]
    assert len(cancels) == 1, calls
    response_id = re.fullmatch(r"/v1/responses/(resp_\w+)/cancel", cancels[0])
    assert response_id is not None, cancels
    stopped = api.get(f"/v1/responses/{response_id.group(1)}").json()
    assert stopped["status"] == "cancelled" and stopped["output"][0]["content"][0]["text"]
    assert items(api, current_conversation_id(page)) == []


def test_sessions_are_renamed_and_deleted_from_the_list(page: Page, api_key: str, api: httpx.Client) -> None:
    session_id = api.post("/v1/sessions", json={"title": "Before rename"}).json()["id"]
    conversation_id = "conv_" + session_id.replace("-", "")
    use_key(page, api_key)
    item = page.locator(f'.session[data-id="{conversation_id}"]')
    expect(item.locator(".open")).to_have_text("Before rename")

    item.locator(".rename").click()
    item.locator(".title-input").fill("Renamed in the browser")
    item.locator(".title-input").press("Enter")
    expect(item.locator(".open")).to_have_text("Renamed in the browser")
    assert api.get(f"/v1/sessions/{session_id}").json()["title"] == "Renamed in the browser"
    assert api.get(f"/v1/conversations/{conversation_id}").json()["metadata"] == {"title": "Renamed in the browser"}

    questions: list[str] = []

    def accept(dialog: Dialog) -> None:
        questions.append(dialog.message)
        dialog.accept()

    page.once("dialog", accept)
    item.locator(".delete").click()
    expect(item).to_have_count(0)
    assert questions == ['Delete "Renamed in the browser" and all its messages?']
    assert api.get(f"/v1/conversations/{conversation_id}").status_code == 404
    assert api.get(f"/v1/sessions/{session_id}").status_code == 404


def test_answers_render_as_sanitised_markdown(page: Page) -> None:
    # The page renders every answer with DOMPurify.sanitize(marked.parse(text)): both vendored
    # scripts load under the page's policy, code blocks keep their language, script is dropped.
    markdown = "# Title\n\n```python\nprint(1)\n```\n\n<script>alert(1)</script>\n\n[link](javascript:alert(1))"
    html = page.evaluate("text => DOMPurify.sanitize(marked.parse(text))", markdown)
    assert "<h1>Title</h1>" in html and '<pre><code class="language-python">print(1)' in html
    assert "<script" not in html and "javascript:" not in html and ">link</a>" in html


@pytest.mark.parametrize(
    ("status", "headers", "body", "shown"),
    [
        (
            503,
            {"Retry-After": "7", "Content-Type": "application/json"},
            '{"error": {"message": "No worker is serving model \'sim-model\' right now.", "type": "server_error",'
            ' "param": null, "code": "no_worker"}}',
            "The service is unavailable (503): No worker is serving model 'sim-model' right now. Try again in 7 s.",
        ),
        (
            200,
            {"Content-Type": "text/event-stream"},
            'data: {"type": "response.failed", "sequence_number": 2, "response": {"status": "failed", "error":'
            ' {"code": "server_error", "message": "The stream was interrupted."}}}\n\n',
            "The answer failed: The stream was interrupted.",
        ),
    ],
    ids=["503-no-worker", "failed-event-in-stream"],
)
def test_a_failed_answer_is_explained_in_words(
    page: Page, api_key: str, status: int, headers: dict, body: str, shown: str
) -> None:
    # The failure is played by the browser's network layer: no worker is harmed for it.
    page.route("**/v1/responses", lambda route: route.fulfill(status=status, headers=headers, body=body))
    use_key(page, api_key)
    pick_model(page, SIM_MODEL)
    send(page, "this one fails", max_tokens=4)
    expect(page.locator("#alert")).to_have_text(shown)
    expect(page.locator("#send")).to_be_enabled()
    expect(page.locator("#prompt")).to_have_value("this one fails")  # ready to send again


def test_a_refused_key_is_explained_in_words(page: Page) -> None:
    use_key(page, "axk_not-a-key-anyone-has")
    expect(page.locator("#alert")).to_contain_text("The API key was refused (401)")
    expect(page.locator("#alert")).to_contain_text("Enter a valid key.")


def test_a_rate_limit_is_explained_with_its_retry_time(page: Page, gateway: Service) -> None:
    # Two requests a minute: the page's start-up (models and sessions) spends both. The key comes
    # from the admin API: Playwright's event loop runs in this thread, so no asyncio.run here.
    created = httpx.post(
        f"{gateway.url}/admin/keys",
        json={"name": "playground-rpm", "rpm": 2},
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=10,
    )
    assert created.status_code == 201, created.text
    use_key(page, created.json()["key"])
    pick_model(page, SIM_MODEL)
    send(page, "one too many", max_tokens=4)
    expect(page.locator("#alert")).to_contain_text(re.compile(r"Rate limited \(429\): .+ Try again in \d+ s\."))


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}


def assert_pretty_json(block: Locator) -> object:
    """`block` shows one JSON value pretty-printed in a monospace font; returns the value."""
    shown = block.inner_text()
    value = json.loads(shown)
    if value:
        assert shown == json.dumps(value, indent=2, ensure_ascii=False)
    assert "monospace" in block.evaluate("element => getComputedStyle(element).fontFamily")
    return value


def test_tool_calls_show_their_name_and_pretty_arguments_live_and_from_history(
    page: Page, api_key: str, api: httpx.Client
) -> None:
    use_key(page, api_key)
    pick_model(page, SIM_MODEL)
    page.click("#tools-panel summary")
    page.fill("#tools", json.dumps([WEATHER_TOOL]))
    page.select_option("#tool-choice", "required")
    send(page, "What is the weather in Paris?", max_tokens=200)
    answer = page.locator(".message.assistant").last
    expect(answer.locator(".meta")).to_contain_text("status: completed")
    stored = [i for i in items(api, current_conversation_id(page)) if i["type"] == "function_call"]
    assert stored  # `required`: one call or more, each of the one tool
    calls = answer.locator(".tool-call")
    expect(calls.locator(".tool-name")).to_have_text(["get_weather"] * len(stored))
    shown = [assert_pretty_json(calls.nth(i).locator("pre.json")) for i in range(len(stored))]
    for arguments in shown:
        jsonschema.validate(arguments, WEATHER_TOOL["function"]["parameters"])
    assert shown == [json.loads(call["arguments"]) for call in stored]

    page.reload()  # the calls are shown again from the conversation's items
    calls = page.locator(".message.assistant .tool-call")
    expect(calls.locator(".tool-name")).to_have_text(["get_weather"] * len(stored))
    assert [assert_pretty_json(calls.nth(i).locator("pre.json")) for i in range(len(stored))] == shown


def test_a_json_answer_is_pretty_printed_in_monospace(page: Page, api_key: str, api: httpx.Client) -> None:
    use_key(page, api_key)
    pick_model(page, SIM_MODEL)
    page.select_option("#response-format", "json_object")
    send(page, "Describe Paris as JSON", max_tokens=300)
    answer = page.locator(".message.assistant").last
    expect(answer.locator(".meta")).to_contain_text("status: completed")
    value = assert_pretty_json(answer.locator(".body > pre.json"))
    assert isinstance(value, dict)
    stored = items(api, current_conversation_id(page))[1]["content"][0]["text"]
    assert json.loads(stored) == value


def test_tools_that_are_not_json_are_explained_before_anything_is_sent(page: Page, api_key: str) -> None:
    use_key(page, api_key)
    pick_model(page, SIM_MODEL)
    page.click("#tools-panel summary")
    page.fill("#tools", "[{not json")
    send(page, "call something", max_tokens=4)
    expect(page.locator("#alert")).to_contain_text("Tools: not JSON")
    expect(page.locator(".message")).to_have_count(0)
    expect(page.locator("#prompt")).to_have_value("call something")


def test_a_tool_call_streamed_in_pieces_is_assembled_before_it_is_shown(page: Page, api_key: str) -> None:
    # OpenAI's Responses events, played by the browser's network layer: the function_call item
    # comes with its call id and name, its arguments follow in pieces that are not JSON on their own.
    def event(kind: str, seq: int, **fields: object) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **fields})}\n\n"

    call = {"id": "fc_1", "type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": ""}
    pieces = ['{"city": "Pa', 'ris", "unit', '": "c"}']
    done = {"status": "completed", "incomplete_details": None, "usage": {"output_tokens": 9}}
    body = (
        event("response.created", 0, response={"status": "in_progress"})
        + event("response.output_item.added", 1, output_index=0, item={**call, "status": "in_progress"})
        + "".join(
            event("response.function_call_arguments.delta", 2 + i, item_id="fc_1", output_index=0, delta=piece)
            for i, piece in enumerate(pieces)
        )
        + event("response.completed", 5, response=done)
    )
    page.route(
        "**/v1/responses",
        lambda route: route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=body),
    )
    use_key(page, api_key)
    pick_model(page, SIM_MODEL)
    send(page, "What is the weather in Paris?", max_tokens=50)
    answer = page.locator(".message.assistant").last
    expect(answer.locator(".meta")).to_contain_text("9 tokens · status: completed")
    expect(answer.locator(".tool-call .tool-name")).to_have_text(["get_weather"])
    assert assert_pretty_json(answer.locator(".tool-call pre.json")) == {"city": "Paris", "unit": "c"}
