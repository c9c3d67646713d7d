"""`/docs` (Swagger UI) works offline: every script, style and icon it loads comes from the gateway
itself, and in a browser that can reach nothing else it shows the API and calls it.

The browser test uses the playground test's headless Debian Chromium (skipped without it, failed
under CI)."""

import os
import re
from collections.abc import Iterator
from urllib.parse import urljoin, urlsplit

import httpx
import pytest
from playwright.sync_api import Browser, expect, sync_playwright

from services.cli.launcher import Service
from tests.e2e.conftest import SIM_MODEL
from tests.e2e.test_playground import CHROMIUM, CHROMIUM_ARGS

pytestmark = pytest.mark.e2e

# What the page's HTML points at: src=, href= and Swagger UI's `url: '...'`.
_REFERENCES = re.compile(r"""(?:\b(?:src|href)=|\burl:\s*)["']([^"']+)["']""")
_ASSET_TYPES = {".js": "text/javascript", ".css": "text/css", ".png": "image/png", ".json": "application/json"}


def test_the_page_and_every_asset_it_references_come_from_the_gateway(gateway: Service) -> None:
    page = httpx.get(f"{gateway.url}/docs", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "http://" not in page.text and "https://" not in page.text and "//cdn" not in page.text
    references = _REFERENCES.findall(page.text)
    assert {"/openapi.json", "/docs/static/swagger-ui-bundle.js", "/docs/static/swagger-ui.css"} <= set(references)
    for reference in references:
        url = urljoin(f"{gateway.url}/docs", reference)
        assert urlsplit(url).netloc == urlsplit(gateway.url).netloc, f"{reference} is off-host"
        asset = httpx.get(url, timeout=10)
        assert asset.status_code == 200, reference
        kind = _ASSET_TYPES[os.path.splitext(urlsplit(url).path)[1]]
        assert asset.headers["content-type"].startswith(kind), (reference, asset.headers["content-type"])
    # The browser may load nothing from anywhere else: no host in any source list.
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self';" in policy
    sources = [source for directive in policy.split(";") for source in directive.split()[1:]]
    assert all(s.startswith("'") or s in ("data:", "blob:") for s in sources), policy


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


def test_the_page_shows_and_calls_the_api_in_a_browser_that_reaches_only_the_gateway(
    browser: Browser, gateway: Service, api_key: str
) -> None:
    origin = f"{gateway.url}/"
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    requested: list[str] = []
    problems: list[str] = []
    # Offline: whatever is not the gateway fails, as it would on a machine without internet.
    context.route(lambda url: not url.startswith(origin), lambda route: route.abort())
    page = context.new_page()
    page.set_default_timeout(15_000)
    page.on("request", lambda request: requested.append(request.url))
    page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
    page.on("console", lambda msg: problems.append(msg.text) if msg.type == "error" else None)
    try:
        page.goto(f"{gateway.url}/docs")
        expect(page.locator(".opblock-summary-path[data-path='/v1/chat/completions']")).to_be_visible()
        # Sections by API, the admin routes among them; none left under "default".
        sections = (
            "Chat",
            "Completions",
            "Responses",
            "Conversations",
            "Messages",
            "Sessions",
            "Models",
            "Files",
            "Batches",
        )
        for tag in (*sections, "Admin", "Operations"):
            expect(page.locator(f"#operations-tag-{tag}")).to_be_visible()
        expect(page.locator("#operations-tag-default")).to_have_count(0)
        expect(page.locator(".opblock-summary-path[data-path='/admin/keys']").first).to_be_visible()
        # "Authorize" with a key, then "Try it out" on GET /v1/models: the page calls the API.
        page.click("button.authorize")
        # The key's schemes: the bearer one, and `x-api-key` (Anthropic's routes); the bearer's form.
        title = page.locator("h4", has_text="apiKey (http, Bearer)")
        bearer = page.locator(".modal-ux .auth-container").filter(has=title)
        bearer.locator("input[type=text]").fill(api_key)
        bearer.locator("button.authorize").click()
        page.locator(".modal-ux button.close-modal").first.click()
        models = page.locator("#operations-Models-list_models_v1_models_get")
        models.locator(".opblock-summary").click()
        models.locator("button.try-out__btn").click()
        models.locator("button.execute").click()
        expect(models.locator(".live-responses-table tbody .response-col_status")).to_have_text("200")
        expect(models.locator(".live-responses-table tbody .response-col_description")).to_contain_text(SIM_MODEL)
    finally:
        context.close()
    assert requested and all(url.startswith(origin) for url in requested), requested
    assert f"{gateway.url}/openapi.json" in requested and f"{gateway.url}/v1/models" in requested
    assert problems == []
