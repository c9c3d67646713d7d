"""Dependency checks that tell an operator which service is missing and how to start it."""

import asyncio
import ipaddress
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import redis.asyncio as redis

from shared.clients import connect_amqp
from shared.migrations import split_database_url
from shared.settings import CommonSettings

# Each dependency's default port (where docker-compose.yml publishes it), how to start it on a
# port, and its compose service. RabbitMQ's Erlang schedulers float across the cores: bound to
# them (its default), one starves for seconds beside vLLM's CPU engine threads, holding the jobs
# it serves (docs/performance.md, "RabbitMQ's schedulers beside the engine").
_HOW_TO_START = {
    "Redis": (6379, "redis-server --daemonize yes --port {port}", "redis"),
    "RabbitMQ": (
        5672,
        "RABBITMQ_NODE_PORT={port} RABBITMQ_SCHEDULER_BIND_TYPE=u rabbitmq-server -detached",
        "rabbitmq",
    ),
    "PostgreSQL": (5432, "pg_ctlcluster <version> main start   (its postgresql.conf saying port = {port})", "postgres"),
}


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine by its loopback interface (`localhost` or a loopback address)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


def local_rabbitmq_binding(proc: Path = Path("/proc")) -> str | None:
    """How the RabbitMQ running on this machine binds its Erlang schedulers to cores: its `+stbt`
    (`db`, bound, is RabbitMQ's default; `u` unbound, Erlang's own default), read from its command
    line; None when none runs here (or there is no `/proc`)."""
    for cmdline in proc.glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if not args[0].endswith(b"beam.smp") or b"rabbit" not in args:
            continue
        if b"-stbt" in args[:-1]:
            return args[args.index(b"-stbt") + 1].decode(errors="replace")
        return "u"
    return None


def rabbitmq_binding_note(amqp_url: str, proc: Path = Path("/proc")) -> str | None:
    """What to say when the RabbitMQ at `amqp_url` runs on this machine with its schedulers bound to
    the cores: beside vLLM's CPU engine, whose threads are bound too, one of them starves and the
    jobs it holds wait seconds (docs/performance.md); None otherwise."""
    host = urlsplit(amqp_url).hostname
    if host is None or not is_loopback(host):
        return None
    binding = local_rabbitmq_binding(proc)
    if binding in (None, "u"):
        return None
    return (
        f"the local RabbitMQ binds its schedulers to the cores (+stbt {binding}): beside vLLM's CPU engine"
        " a job can wait seconds for it; restart RabbitMQ with RABBITMQ_SCHEDULER_BIND_TYPE=u (docs/performance.md)"
    )


def how_to_start(name: str, url: str) -> str:
    """How to start dependency `name` (Redis, RabbitMQ, PostgreSQL) where its configured `url`
    points: on that URL's port, or with compose when the port is compose's."""
    default_port, command, compose_service = _HOW_TO_START[name]
    port = urlsplit(url).port or default_port
    if port != default_port:
        return command.format(port=port)
    return f"{command.format(port=port)}   (or: docker compose up -d {compose_service})"


@dataclass(frozen=True, slots=True)
class CheckResult:
    name: str
    url: str
    error: str | None

    @property
    def ok(self) -> bool:
        return self.error is None


async def _check_redis(url: str, timeout_s: float) -> None:
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        await client.ping()
    finally:
        await client.aclose()


async def _check_amqp(url: str, timeout_s: float) -> None:
    connection = await connect_amqp(url, timeout_s=timeout_s)
    await connection.close()


async def _check_postgres(url: str, timeout_s: float) -> None:
    admin_url, _name = split_database_url(url)
    conn = await asyncpg.connect(admin_url, timeout=timeout_s)
    await conn.close()


async def check_dependencies(settings: CommonSettings, *, timeout_s: float = 3.0) -> list[CheckResult]:
    """Try each dependency once, concurrently, within `timeout_s`."""
    checks = [
        ("Redis", settings.redis_url, _check_redis),
        ("RabbitMQ", settings.amqp_url, _check_amqp),
        ("PostgreSQL", settings.database_url, _check_postgres),
    ]

    async def run(name: str, url: str, check: Callable[[str, float], Awaitable[None]]) -> CheckResult:
        try:
            await asyncio.wait_for(check(url, timeout_s), timeout_s + 1)
        except Exception as exc:  # noqa: BLE001 - any failure is reported, not raised
            return CheckResult(name, _redact(url), f"{type(exc).__name__}: {exc}".strip())
        return CheckResult(name, _redact(url), None)

    return list(await asyncio.gather(*(run(*c) for c in checks)))


def _redact(url: str) -> str:
    """Hide the password part of a URL for printing."""
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    credentials, host = rest.rsplit("@", 1)
    user = credentials.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}" if ":" in credentials else url
