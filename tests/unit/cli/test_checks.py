"""services/cli/checks.py: a dependency `axon up` cannot reach is named with how to start it where
the settings point, on their port."""

import pytest

from services.cli import up
from services.cli.checks import how_to_start
from services.cli.launcher import free_port
from shared.settings import CommonSettings
from tests.services import ServiceUrls


@pytest.mark.parametrize(
    ("name", "url", "hint"),
    [
        ("Redis", "redis://127.0.0.1:6380/0", "redis-server --daemonize yes --port 6380"),
        (
            "RabbitMQ",
            "amqp://guest:***@127.0.0.1:5673/",
            "RABBITMQ_NODE_PORT=5673 RABBITMQ_SCHEDULER_BIND_TYPE=u rabbitmq-server -detached",
        ),
        ("PostgreSQL", "postgresql://postgres@127.0.0.1:5433/axon", "port = 5433"),
    ],
)
def test_the_hint_starts_the_dependency_on_the_configured_port_and_not_compose_then(
    name: str, url: str, hint: str
) -> None:
    start = how_to_start(name, url)
    assert hint in start
    assert "docker compose" not in start  # compose publishes the default port only


def test_on_the_default_port_compose_is_offered_too() -> None:
    start = how_to_start("Redis", "redis://127.0.0.1/0")
    assert "--port 6379" in start and "docker compose up -d redis" in start


def test_axon_up_names_the_unreachable_dependency_with_its_port(service_urls: ServiceUrls) -> None:
    port = free_port()
    said: list[str] = []
    settings = CommonSettings(
        redis_url=f"redis://127.0.0.1:{port}/0", amqp_url=service_urls.amqp, database_url=service_urls.postgres
    )
    assert not up._check_or_explain(settings, said.append)
    assert f"  start it with: redis-server --daemonize yes --port {port}" in said, said
    assert sum("start it with" in line for line in said) == 1, said
