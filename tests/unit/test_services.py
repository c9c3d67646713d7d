"""tests/services.py: how `AXON_TEST_SERVICES` picks the servers the tests use, with a fake Docker probe."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.services import (
    LOCAL_DEFAULTS,
    POSTGRES_IMAGE,
    RABBITMQ_IMAGE,
    REDIS_IMAGE,
    Choice,
    ServicesUnavailable,
    ServiceUrls,
    choose,
    containers,
    docker_engine_answers,
    local_urls,
)

ROOT = Path(__file__).resolve().parents[2]


class Probe:
    """A Docker engine that answers or not, counting how often it was asked."""

    def __init__(self, answers: bool) -> None:
        self.answers = answers
        self.calls = 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.answers


@pytest.mark.parametrize("engine", [True, False])
def test_unset_means_containers_exactly_when_an_engine_answers(engine: bool) -> None:
    probe = Probe(engine)
    choice = choose({}, probe)
    assert choice.mode == ("containers" if engine else "local")
    assert probe.calls == 1
    expected = "a Docker engine answered" if engine else "no Docker engine answered"
    assert choice.header() == f"axon test services: {choice.mode} ({expected})"


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_value_is_unset(value: str) -> None:
    assert choose({"AXON_TEST_SERVICES": value}, Probe(False)) == Choice("local", "no Docker engine answered")


@pytest.mark.parametrize("value", ["local", "LOCAL", " local "])
def test_local_never_asks_docker(value: str) -> None:
    probe = Probe(True)
    assert choose({"AXON_TEST_SERVICES": value}, probe).mode == "local"
    assert probe.calls == 0


def test_containers_with_an_engine() -> None:
    choice = choose({"AXON_TEST_SERVICES": "containers"}, Probe(True))
    assert choice == Choice("containers", "AXON_TEST_SERVICES=containers")


def test_containers_without_an_engine_is_an_error_that_says_what_to_do() -> None:
    with pytest.raises(ServicesUnavailable, match="no Docker engine answered") as caught:
        choose({"AXON_TEST_SERVICES": "containers", "DOCKER_HOST": "tcp://nowhere:2375"}, Probe(False))
    assert "tcp://nowhere:2375" in str(caught.value)
    assert "AXON_TEST_SERVICES=local" in str(caught.value)


@pytest.mark.parametrize("value", ["docker", "auto", "1", "local,containers"])
def test_an_unknown_value_is_an_error(value: str) -> None:
    probe = Probe(True)
    with pytest.raises(ServicesUnavailable, match="expected one of containers, local"):
        choose({"AXON_TEST_SERVICES": value}, probe)
    assert probe.calls == 0


def test_a_url_override_keeps_the_default_local_and_containers_still_wins_when_asked() -> None:
    environ = {"AXON_TEST_POSTGRES_URL": "postgresql://postgres@db.example:5432/postgres"}
    probe = Probe(True)
    assert choose(environ, probe) == Choice("local", "AXON_TEST_POSTGRES_URL is set")
    assert probe.calls == 0
    assert choose({**environ, "AXON_TEST_SERVICES": "containers"}, probe).mode == "containers"


def test_local_urls_are_todays_defaults_unless_overridden() -> None:
    assert local_urls({}) == ServiceUrls(
        redis="redis://127.0.0.1:6379/0",
        amqp="amqp://guest:guest@127.0.0.1:5672/",
        postgres="postgresql://postgres@127.0.0.1:5432/postgres",
    )
    assert local_urls({"AXON_TEST_REDIS_URL": "redis://cache:6380/2"}).redis == "redis://cache:6380/2"
    assert local_urls({"AXON_TEST_REDIS_URL": ""}).redis == LOCAL_DEFAULTS["AXON_TEST_REDIS_URL"]


def test_container_images_are_the_ones_docker_compose_runs() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    assert {services[name]["image"] for name in ("redis", "rabbitmq", "postgres")} == {
        REDIS_IMAGE,
        RABBITMQ_IMAGE,
        POSTGRES_IMAGE,
    }


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_probe_says_no_quickly_when_nothing_listens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"tcp://127.0.0.1:{_closed_port()}")
    started = time.monotonic()
    assert docker_engine_answers(timeout_s=1) is False
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(
    ("value", "returncode", "expected"),
    [
        ("local", 0, "axon test services: local (AXON_TEST_SERVICES=local)"),
        ("containers", 4, "ERROR: AXON_TEST_SERVICES=containers, but no Docker engine answered"),
        ("podman", 4, "ERROR: AXON_TEST_SERVICES='podman': expected one of containers, local"),
    ],
)
def test_pytest_prints_the_choice_or_stops_with_a_usage_error(value: str, returncode: int, expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AXON_TEST_", "PYTEST_"))}
    env |= {"AXON_TEST_SERVICES": value, "DOCKER_HOST": f"tcp://127.0.0.1:{_closed_port()}"}
    node = f"{Path(__file__).relative_to(ROOT)}::test_containers_with_an_engine"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-p", "no:cacheprovider", node],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == returncode, result.stdout + result.stderr
    assert expected in result.stdout + result.stderr


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # importing testcontainers' rabbitmq module
def test_containers_hand_out_urls_of_the_mapped_ports_and_remove_all_three(monkeypatch: pytest.MonkeyPatch) -> None:
    """testcontainers' classes replaced by fakes with the same surface (no Docker engine here)."""
    events: list[str] = []

    class Fake:
        default_port = 0

        def __init__(self, image: str, **kwargs: object) -> None:
            self.image, self.port = image, self.default_port
            for name, value in kwargs.items():
                setattr(self, name, value)

        def __enter__(self) -> "Fake":
            events.append(f"start {self.image}")
            return self

        def __exit__(self, *exc: object) -> None:
            events.append(f"stop {self.image}")

        def get_container_host_ip(self) -> str:
            return "docker-host"

        def get_exposed_port(self, port: int) -> int:
            return 40000 + port

    class FakeRedis(Fake):
        default_port = 6379

    class FakeRabbitMq(Fake):
        default_port = 5672

    class FakePostgres(Fake):
        default_port = 5432

        def get_connection_url(self, driver: str | None = "psycopg2") -> str:
            assert driver is None
            return f"postgresql://{self.username}:{self.password}@docker-host:{40000 + self.port}/{self.dbname}"

    monkeypatch.setattr("testcontainers.community.redis.RedisContainer", FakeRedis)
    monkeypatch.setattr("testcontainers.community.rabbitmq.RabbitMqContainer", FakeRabbitMq)
    monkeypatch.setattr("testcontainers.community.postgres.PostgresContainer", FakePostgres)
    with containers() as urls:
        assert urls == ServiceUrls(
            redis="redis://docker-host:46379/0",
            amqp="amqp://guest:guest@docker-host:45672/",
            postgres="postgresql://postgres:postgres@docker-host:45432/postgres",
        )
        assert events == [f"start {image}" for image in (REDIS_IMAGE, RABBITMQ_IMAGE, POSTGRES_IMAGE)]
    assert events[3:] == [f"stop {image}" for image in (POSTGRES_IMAGE, RABBITMQ_IMAGE, REDIS_IMAGE)]
