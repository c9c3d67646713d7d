"""Where the tests find Redis, RabbitMQ and PostgreSQL: the `AXON_TEST_SERVICES` switch.

    AXON_TEST_SERVICES=containers  start the three in containers (testcontainers), once per run
    AXON_TEST_SERVICES=local       use servers already running: 127.0.0.1 on the default ports,
                                   or AXON_TEST_REDIS_URL, AXON_TEST_AMQP_URL, AXON_TEST_POSTGRES_URL
    unset                          `containers` if a Docker engine answers, else `local`; `local`
                                   also when one of the AXON_TEST_*_URL overrides is set

`containers` asked for with no engine is a usage error, not a hang. tests/conftest.py decides once
per run (`pytest_configure`), prints the choice in pytest's header and gives the URLs to every test
through the session fixture `service_urls`: the fixtures, and the service processes the e2e tests
start (AXON_REDIS_URL, AXON_AMQP_URL, AXON_DATABASE_URL), all use them. Either way each run keeps
to its own `axon_test_*` namespace and database.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

MODE_VAR = "AXON_TEST_SERVICES"
MODES = ("containers", "local")
Mode = Literal["containers", "local"]

# Today's local servers, and the variables that point the `local` mode elsewhere.
LOCAL_DEFAULTS = {
    "AXON_TEST_REDIS_URL": "redis://127.0.0.1:6379/0",
    "AXON_TEST_AMQP_URL": "amqp://guest:guest@127.0.0.1:5672/",
    "AXON_TEST_POSTGRES_URL": "postgresql://postgres@127.0.0.1:5432/postgres",
}

# The images docker-compose.yml runs (tests/unit/test_services.py keeps them equal).
REDIS_IMAGE = "redis:7.4-alpine"
RABBITMQ_IMAGE = "rabbitmq:4.1-management"
POSTGRES_IMAGE = "postgres:17-alpine"

DOCKER_PROBE_TIMEOUT_S = 2.0


class ServicesUnavailable(Exception):
    """The switch cannot be honoured (unknown value, or no Docker engine for `containers`)."""


@dataclass(frozen=True)
class ServiceUrls:
    """The servers of this run. `postgres` is the maintenance database (`/postgres`); the tests
    create and drop their own `axon_test_*` databases next to it."""

    redis: str
    amqp: str
    postgres: str


@dataclass(frozen=True)
class Choice:
    mode: Mode
    reason: str

    def header(self) -> str:
        return f"axon test services: {self.mode} ({self.reason})"


def choose(environ: Mapping[str, str], engine_answers: Callable[[], bool]) -> Choice:
    """Read the switch from `environ`; `engine_answers` is called only when the answer depends on it.

    Raises:
        ServicesUnavailable: an unknown value, or `containers` with no Docker engine answering.
    """
    raw = environ.get(MODE_VAR, "").strip()
    value = raw.lower()
    if value and value not in MODES:
        raise ServicesUnavailable(f"{MODE_VAR}={raw!r}: expected one of {', '.join(MODES)} (or unset)")
    if value == "local":
        return Choice("local", f"{MODE_VAR}=local")
    if value == "containers":
        if not engine_answers():
            raise ServicesUnavailable(
                f"{MODE_VAR}=containers, but no Docker engine answered within {DOCKER_PROBE_TIMEOUT_S:g} s "
                f"(DOCKER_HOST={environ.get('DOCKER_HOST') or 'unset, the default socket'}). Start one, or run "
                f"with {MODE_VAR}=local against local servers."
            )
        return Choice("containers", f"{MODE_VAR}=containers")
    overrides = sorted(name for name in LOCAL_DEFAULTS if environ.get(name))
    if overrides:
        return Choice("local", f"{overrides[0]} is set")
    if engine_answers():
        return Choice("containers", "a Docker engine answered")
    return Choice("local", "no Docker engine answered")


def docker_engine_answers(timeout_s: float = DOCKER_PROBE_TIMEOUT_S) -> bool:
    """Whether the Docker engine testcontainers would use answers a ping within `timeout_s`."""
    try:
        import docker
        from docker.errors import DockerException
        from testcontainers.core.docker_client import get_docker_host
    except ImportError:
        return False
    try:
        host = get_docker_host()  # testcontainers' own rule: tc.host, DOCKER_HOST, then the docker context
        environment = {**os.environ, "DOCKER_HOST": host} if host else None
        use_ssh = bool(host and host.startswith("ssh://"))
        client = docker.from_env(timeout=timeout_s, environment=environment, use_ssh_client=use_ssh)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (DockerException, OSError):  # requests' errors are OSErrors
        return False


def local_urls(environ: Mapping[str, str]) -> ServiceUrls:
    """The `local` servers: the AXON_TEST_*_URL variables, else the local default addresses."""

    def url(name: str) -> str:
        return environ.get(name) or LOCAL_DEFAULTS[name]

    return ServiceUrls(
        redis=url("AXON_TEST_REDIS_URL"), amqp=url("AXON_TEST_AMQP_URL"), postgres=url("AXON_TEST_POSTGRES_URL")
    )


@contextlib.contextmanager
def containers() -> Iterator[ServiceUrls]:
    """Redis, RabbitMQ and PostgreSQL in containers, removed on exit (testcontainers' Ryuk reaps
    them too if the run is killed)."""
    # testcontainers' own deprecations (its modules moved under testcontainers.community in 4.15,
    # a decorator RabbitMqContainer uses) are not ours to act on.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            from testcontainers.community.postgres import PostgresContainer
            from testcontainers.community.rabbitmq import RabbitMqContainer
            from testcontainers.community.redis import RedisContainer
        except ImportError:
            from testcontainers.postgres import PostgresContainer
            from testcontainers.rabbitmq import RabbitMqContainer
            from testcontainers.redis import RedisContainer

    with contextlib.ExitStack() as stack:
        # Each `with` waits until its server is ready: PING, an AMQP connection, `select version()`.
        redis = stack.enter_context(RedisContainer(REDIS_IMAGE))
        rabbitmq = stack.enter_context(RabbitMqContainer(RABBITMQ_IMAGE, username="guest", password="guest"))
        postgres = stack.enter_context(
            PostgresContainer(POSTGRES_IMAGE, username="postgres", password="postgres", dbname="postgres", driver=None)
        )
        redis_address = f"{redis.get_container_host_ip()}:{redis.get_exposed_port(redis.port)}"
        amqp_address = f"{rabbitmq.get_container_host_ip()}:{rabbitmq.get_exposed_port(rabbitmq.port)}"
        yield ServiceUrls(
            redis=f"redis://{redis_address}/0",
            amqp=f"amqp://{rabbitmq.username}:{rabbitmq.password}@{amqp_address}/",
            postgres=postgres.get_connection_url(driver=None),
        )
