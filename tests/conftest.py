"""Fixtures every test layer shares: the servers, a namespace and a database of the run's own.

Tests talk to real Redis, RabbitMQ and PostgreSQL servers, in containers or already running
locally: the `AXON_TEST_SERVICES` switch (tests/services.py) picks them once per run, pytest's
header says which, and `service_urls` gives their URLs. Each run uses its own `axon_test_*`
namespace and database, so it never touches a running stack.
"""

import asyncio
import contextlib
import gc
import importlib.util
import logging
import os
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import structlog

from shared.keys import KeyLimits, KeyRepository
from shared.migrations import drop_database, migrate, split_database_url
from tests.machine import missing
from tests.processes import RUN_MARKER, started_by_this_run
from tests.services import (
    Choice,
    ServicesUnavailable,
    ServiceUrls,
    choose,
    containers,
    docker_engine_answers,
    local_urls,
)

_CHOICE = pytest.StashKey[Choice]()

# The tests of the vLLM engine run vLLM itself. Where it does not install (`make install` installs
# its CPU build on Linux x86-64 only), the worker falls back to the transformers engine and these
# modules skip, saying so; in CI on Linux x86-64 a missing vLLM fails the run (tests/machine.py).
NEEDS_VLLM = ("unit/worker/test_vllm_boundary.py", "e2e/test_vllm_engine.py", "e2e/test_vllm_parallel.py")


class _NeedsMissing(pytest.File):
    """A test module that needs what this machine lacks: collecting it skips or fails, never imports it."""

    what: str

    def collect(self) -> Iterator[pytest.Item]:
        missing(self.what)


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    tests = Path(__file__).parent
    if importlib.util.find_spec("vllm") is None and module_path in {tests / name for name in NEEDS_VLLM}:
        module = _NeedsMissing.from_parent(parent, path=module_path)
        module.what = "vLLM is not installed (its CPU build installs on Linux x86-64 only)"
        return module
    return None


def pytest_configure(config: pytest.Config) -> None:
    os.environ[RUN_MARKER] = str(os.getpid())
    try:
        config.stash[_CHOICE] = choose(os.environ, docker_engine_answers)
    except ServicesUnavailable as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that loads a real model keeps both cores busy: `make test` must not run it beside
    another (its first pass runs two modules at a time), so `model` without `alone` is an error."""
    beside = sorted(
        {
            item.nodeid.split("::")[0]
            for item in items
            if item.get_closest_marker("model") and not item.get_closest_marker("alone")
        }
    )
    if beside:
        raise pytest.UsageError(f"marked `model` but not `alone`: {', '.join(beside)}")


def pytest_report_header(config: pytest.Config) -> str:
    return config.stash[_CHOICE].header()


@pytest.fixture(scope="session", autouse=True)
def no_process_outlives_the_run() -> Iterator[None]:
    """At the end of the run (after every other fixture's teardown), no process the tests started
    may still run: any left is killed and the run fails naming it (tests/processes.py)."""
    yield
    left = started_by_this_run()
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, "processes the tests started still ran at the end of the run (now killed):\n" + "\n".join(
        f"  {pid}: {command}" for pid, command in sorted(left.items())
    )


class _Collected(logging.Handler):
    """asyncio's reports from a finalizer: what the garbage collector found, in no test's time."""

    REPORTS = ("Task was destroyed but it is pending!", "exception was never retrieved")

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        if any(report in line for report in self.REPORTS):
            self.lines.append(line)


@pytest.fixture(scope="session", autouse=True)
def no_asyncio_task_left_behind() -> Iterator[None]:
    """The run fails, naming them, if the garbage collector found a task left behind: destroyed while
    pending, or its exception never retrieved. Such a task is reported at some later collection,
    inside whatever test runs then; on Python 3.11 a collection inside `ast.parse` that logs a
    traceback fails that test with "AST constructor recursion depth mismatch" (a TcpProxy's
    connection tasks left pending did, in tests/unit/test_dead_code.py)."""
    kept = _Collected()
    asyncio_log = logging.getLogger("asyncio")
    asyncio_log.addHandler(kept)
    yield
    gc.collect()
    asyncio_log.removeHandler(kept)
    assert not kept.lines, "tasks left behind, found by the garbage collector:\n" + "\n".join(
        f"  {line[:500]}" for line in kept.lines
    )


@pytest.fixture(scope="session", autouse=True)
def structlog_never_caches_here() -> Iterator[None]:
    """In the test process, structlog never caches a logger: a module's logger cached under a test's
    `configure_logging` keeps that test's processors for good, and a later test's
    `structlog.testing.capture_logs` would not see its lines (it failed after tests/unit, never
    alone). The services the tests start cache, as in production."""
    configure = structlog.configure

    def uncached(**settings: Any) -> None:
        configure(**{**settings, "cache_logger_on_first_use": False})

    structlog.configure = uncached
    yield
    structlog.configure = configure


@pytest.fixture(autouse=True)
def logging_configuration_restored() -> Iterator[None]:
    """Each test ends with structlog and the root logger configured as they began: a test that
    configures logging (the CLI's `main` sets WARNING) would otherwise filter the next test's lines,
    which then passed or failed by which tests ran before it (`capture_logs` saw no info line after
    a CLI test)."""
    saved = structlog.get_config()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    structlog.configure(**saved)
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="session")
def service_urls(request: pytest.FixtureRequest) -> Iterator[ServiceUrls]:
    """Redis, RabbitMQ and PostgreSQL of this run: started in containers on first use, or the local ones."""
    if request.config.stash[_CHOICE].mode == "containers":
        with containers() as urls:
            yield urls
    else:
        yield local_urls(os.environ)


@pytest.fixture(scope="session")
def run_id() -> str:
    return uuid.uuid4().hex[:10]


@pytest.fixture(scope="session")
def namespace(run_id: str) -> str:
    return f"axon_test_{run_id}"


@pytest.fixture(scope="session")
def database_url(run_id: str, service_urls: ServiceUrls) -> Iterator[str]:
    """A migrated database of this run's own, dropped at the end."""
    admin_url, _ = split_database_url(service_urls.postgres)
    url = admin_url.rsplit("/", 1)[0] + f"/axon_test_{run_id}"
    asyncio.run(migrate(url))
    yield url
    asyncio.run(drop_database(url))


@pytest.fixture
async def redis_client(service_urls: ServiceUrls) -> AsyncIterator:
    from shared.clients import create_redis

    client = create_redis(service_urls.redis, timeout_s=5)
    yield client
    await client.aclose()


async def create_key(
    database_url: str, *, name: str, limits: KeyLimits, tenant: str | None = None, models: list[str] | None = None
) -> str:
    """Create an API key in the test database (`models`: its allowlist); returns the key."""
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=1)
    try:
        key, _record = await KeyRepository(pool).create(name=name, limits=limits, tenant=tenant, allowed_models=models)
        return key
    finally:
        await pool.close()


@pytest.fixture(scope="session")
def api_key(database_url: str) -> str:
    """A key with limits far above anything the tests send."""
    limits = KeyLimits(rpm=1_000_000, tpm=100_000_000, max_concurrent=10_000)
    return asyncio.run(create_key(database_url, name="tests", limits=limits, tenant="tests"))


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """An S3 endpoint for the file store's S3 tests: AXON_TEST_S3_ENDPOINT (credentials from the
    environment), else moto's S3 server started here (any credentials: the environment gets test
    ones, which the services started by the tests inherit). Skips without either."""
    endpoint = os.environ.get("AXON_TEST_S3_ENDPOINT")
    if endpoint:
        yield endpoint
        return
    server_module = pytest.importorskip("moto.server", reason="no AXON_TEST_S3_ENDPOINT and no moto to serve S3")
    from services.cli.launcher import free_port

    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ACCESS_KEY_ID", "testing")
        env.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        try:
            host, port = server.get_host_and_port()
            yield f"http://{host}:{port}"
        finally:
            server.stop()


@pytest.fixture(scope="session")
def cpu_model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model cache (`AXON_MODEL_CACHE_DIR`) of the workers the e2e tests start (`Stack`): the
    first transformers worker converts the bundled GGUF into it (about 20 s), every later one
    loads that float32 copy in under a second."""
    return tmp_path_factory.mktemp("cpu-models")


@pytest.fixture(scope="session")
def cpu_model(cpu_model_cache: Path) -> Path:
    """The bundled SmolLM2 as the transformers engine loads it: its float32 copy in the run's cache."""
    from services.worker.engines.gguf import bundled_gguf_path, converted_model

    return converted_model(bundled_gguf_path(), cpu_model_cache, dtype="float32")


@pytest.fixture(scope="session")
def vllm_model_cache(cpu_model_cache: Path, cpu_model: Path) -> Path:
    """The model cache (`AXON_MODEL_CACHE_DIR`) of the run's vLLM engines: the run's cache, with the
    bundled SmolLM2's bfloat16 copy made in it from its float32 copy (`cpu_model`: about 2 s, where
    the GGUF takes about 20), as a worker makes it at its first start beside a transformers one."""
    from services.worker.engines.gguf import bundled_gguf_path, converted_model

    converted_model(bundled_gguf_path(), cpu_model_cache)
    return cpu_model_cache
