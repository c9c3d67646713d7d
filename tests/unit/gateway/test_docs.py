"""`/docs` is served from the gateway's own copy of Swagger UI (services/gateway/api/docs.py)."""

import base64
import hashlib
import re

from fastapi import FastAPI
from fastapi.testclient import TestClient

from services.gateway.api import docs
from shared.http_errors import install_error_handlers


def client() -> TestClient:
    app = FastAPI(title="Axon", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.include_router(docs.router)
    return TestClient(app)


def test_every_served_asset_is_in_the_installed_package() -> None:
    for name in docs.ASSET_TYPES:
        assert (docs.ASSETS_DIR / name).stat().st_size > 1000, name
    # Swagger UI 5 or later: the gateway's document is OpenAPI 3.1, which 4.x cannot show.
    bundle = (docs.ASSETS_DIR / "swagger-ui-bundle.js").read_text()
    major = re.search(r'PACKAGE_VERSION:"(\d+)\.', bundle)
    assert major and int(major.group(1)) >= 5


def test_the_page_allows_exactly_its_own_inline_script() -> None:
    page = client().get("/docs")
    assert page.status_code == 200
    (script,) = re.findall(r"<script>(.*?)</script>", page.text, re.DOTALL)
    assert '"validatorUrl": null' in script  # no badge from validator.swagger.io
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    policy = page.headers["content-security-policy"]
    assert f"script-src 'self' 'sha256-{digest}';" in policy
    assert "default-src 'none'" in policy and "frame-ancestors 'none'" in policy


def test_only_the_known_assets_are_served() -> None:
    http = client()
    css = http.get("/docs/static/swagger-ui.css")
    assert css.status_code == 200 and css.headers["content-type"] == "text/css; charset=utf-8"
    assert css.headers["x-content-type-options"] == "nosniff"
    for path in ["/docs/static/redoc.standalone.js", "/docs/static/..%2Fcore.py", "/docs/static/index.html", "/redoc"]:
        missing = http.get(path)
        assert missing.status_code == 404 and missing.json()["error"]["message"], path
