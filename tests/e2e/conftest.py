"""End-to-end fixtures: the three services as real processes, on the sim engine unless a test says otherwise."""

from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import AsyncOpenAI, OpenAI

from services.cli.launcher import Service
from tests.contract.transport import ContractTransport
from tests.e2e.stack import Stack
from tests.services import ServiceUrls

SIM_MODEL = "sim-model"
# Greedy, every token of the answer ("The capital of France is Paris.") leads the next by about
# 1 nat in float32 and bfloat16 alike. "What is the capital of France?" starts "The" at -1.88
# against "L" at -1.97: vLLM in bfloat16 (AVX-512 BF16 or AMX CPUs) answers "L'Étoile, la ...".
FRANCE = [{"role": "user", "content": "Name the capital of France."}]
# The shared stack's three services (by id), which live for the session; every other service a
# module's tests start is stopped when the module ends (`services_stopped_with_the_module`).
SESSION_SERVICES: set[int] = set()
SIM_ENV = {"AXON_ENGINE": "sim", "AXON_MODEL": SIM_MODEL, "AXON_SIM_TTFT_MS": "20", "AXON_SIM_ITL_MS": "5"}
# The shared session manager polls its queue-depth and fair-share gauges every second, so a test
# sees a backlog of a few seconds counted by the gauges (the default, 5 s, could miss it).
SESSIONS_ENV = {"AXON_QUEUE_POLL_INTERVAL_S": "1"}


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("service-logs")


@pytest.fixture(scope="session")
def stack(
    namespace: str, database_url: str, service_urls: ServiceUrls, log_dir: Path, cpu_model_cache: Path
) -> Iterator[Stack]:
    """Processes shared by the e2e tests: one sim worker, one session manager, one gateway."""
    stack = Stack(
        namespace=namespace,
        database_url=database_url,
        redis_url=service_urls.redis,
        amqp_url=service_urls.amqp,
        log_dir=log_dir,
        model_cache_dir=cpu_model_cache,
    )
    try:
        stack.start("worker:sim", env=SIM_ENV)
        sessions = stack.start("sessions", env=SESSIONS_ENV)
        stack.start("gateway", env={"AXON_SESSIONS_URL": sessions.url})
        SESSION_SERVICES.update(id(service) for service in stack.services)
        yield stack
    finally:
        stack.close()


@pytest.fixture(scope="module", autouse=True)
def services_stopped_with_the_module() -> Iterator[None]:
    """Stop what the module's tests started and left running (after its own fixtures' teardown),
    so no process of one module loads the machine, or takes work, in the next."""
    first = len(Stack.started)
    yield
    for service in reversed(Stack.started[first:]):
        if id(service) not in SESSION_SERVICES and service.process.poll() is None:
            service.stop(timeout_s=15)


@pytest.fixture(scope="session")
def gateway(stack: Stack) -> Service:
    return next(s for s in stack.services if s.name == "gateway")


@pytest.fixture(scope="session")
def sessions(stack: Stack) -> Service:
    return next(s for s in stack.services if s.name == "sessions")


@pytest.fixture(scope="session")
def sim_worker(stack: Stack) -> Service:
    return next(s for s in stack.services if s.name == "worker:sim")


@pytest.fixture
def client(gateway: Service, api_key: str) -> OpenAI:
    return OpenAI(base_url=f"{gateway.url}/v1", api_key=api_key, max_retries=0, timeout=30)


@pytest.fixture
def aclient(gateway: Service, api_key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=api_key, max_retries=0, timeout=30)


@pytest.fixture
def auth(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"}


@pytest.fixture(scope="module")
def checked() -> Iterator[ContractTransport]:
    """An httpx transport that checks every answer and chunk against OpenAI's schemas; the module
    fails if any did not match."""
    transport = ContractTransport()
    yield transport
    assert transport.violations == []
