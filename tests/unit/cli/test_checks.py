"""services/cli/checks.py: a dependency `axon up` cannot reach is named with how to start it where
the settings point, on their port; a RabbitMQ on this machine with its schedulers bound to the
cores is named with the restart that unbinds them."""

from pathlib import Path

import pytest

from services.cli import up
from services.cli.checks import how_to_start, local_rabbitmq_binding, rabbitmq_binding_note
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


def _proc_with(tmp_path: Path, *cmdlines: list[str]) -> Path:
    """A stand-in for /proc holding processes with these command lines."""
    for pid, argv in enumerate(cmdlines, start=100):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    return tmp_path


RABBIT_BOUND = ["/usr/lib/erlang/erts-13.1.5/bin/beam.smp", "-W", "w", "-stbt", "db", "--", "-s", "rabbit", "boot"]
OTHER_ERLANG = ["/usr/lib/erlang/erts-13.1.5/bin/beam.smp", "-stbt", "db", "--", "-s", "couch", "boot"]


def test_a_local_rabbitmq_bound_to_the_cores_is_named_with_the_restart_that_unbinds_it(tmp_path: Path) -> None:
    proc = _proc_with(tmp_path, ["python3", "-m", "x"], OTHER_ERLANG, RABBIT_BOUND)
    assert local_rabbitmq_binding(proc) == "db"
    note = rabbitmq_binding_note("amqp://guest:guest@127.0.0.1:5672/", proc)
    assert note is not None and "+stbt db" in note and "RABBITMQ_SCHEDULER_BIND_TYPE=u" in note
    assert rabbitmq_binding_note("amqp://guest:guest@localhost/", proc) is not None


@pytest.mark.parametrize(
    ("cmdlines", "url"),
    [
        ([[*RABBIT_BOUND[:3], "-stbt", "u", *RABBIT_BOUND[5:]]], "amqp://guest:guest@127.0.0.1:5672/"),
        ([[arg for arg in RABBIT_BOUND if arg not in ("-stbt", "db")]], "amqp://guest:guest@127.0.0.1:5672/"),
        ([OTHER_ERLANG], "amqp://guest:guest@127.0.0.1:5672/"),
        ([RABBIT_BOUND], "amqp://axon:secret@rabbitmq.internal:5672/"),
    ],
    ids=["unbound", "erlang-default", "no-rabbitmq-here", "remote-broker"],
)
def test_nothing_is_said_unless_the_broker_in_use_runs_here_bound(
    tmp_path: Path, cmdlines: list[list[str]], url: str
) -> None:
    assert rabbitmq_binding_note(url, _proc_with(tmp_path, *cmdlines)) is None


def test_axon_up_says_the_note_exactly_when_this_machines_rabbitmq_is_bound(service_urls: ServiceUrls) -> None:
    said: list[str] = []
    settings = CommonSettings(
        redis_url=service_urls.redis, amqp_url=service_urls.amqp, database_url=service_urls.postgres
    )
    assert up._check_or_explain(settings, said.append)
    expected = rabbitmq_binding_note(service_urls.amqp)
    assert [line for line in said if line.startswith("note: ")] == ([f"note: {expected}"] if expected else [])
