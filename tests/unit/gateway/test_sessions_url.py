"""The gateway finds the session manager at AXON_SESSIONS_URL, else on AXON_SESSIONS_PORT of this host."""

import pytest

from services.gateway.settings import GatewaySettings


def test_the_default_url_follows_the_sessions_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AXON_SESSIONS_URL", raising=False)
    monkeypatch.delenv("AXON_SESSIONS_PORT", raising=False)
    assert GatewaySettings().sessions_url == "http://127.0.0.1:8001"
    monkeypatch.setenv("AXON_SESSIONS_PORT", "18101")
    assert GatewaySettings().sessions_url == "http://127.0.0.1:18101"


def test_an_explicit_url_wins_over_the_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AXON_SESSIONS_PORT", "18101")
    monkeypatch.setenv("AXON_SESSIONS_URL", "http://sessions.internal:9000")
    assert GatewaySettings().sessions_url == "http://sessions.internal:9000"
