"""End-to-end fixtures: the three services as real processes, on the sim engine unless a test says otherwise."""

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import AsyncOpenAI, OpenAI

from services.cli.launcher import Service
from shared.settings import DEFAULT_MODEL
from tests.e2e.stack import Stack
from tests.models import random_lora
from tests.services import ServiceUrls

SIM_MODEL = "sim-model"
SIM_ENV = {"AXON_ENGINE": "sim", "AXON_MODEL": SIM_MODEL, "AXON_SIM_TTFT_MS": "20", "AXON_SIM_ITL_MS": "5"}
# The default engine's worker (vLLM's CPU build here) serves the default model under its own name.
VLLM_MODEL = DEFAULT_MODEL
VLLM_ADAPTER = "smollm2-e2e-lora"


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("service-logs")


@pytest.fixture(scope="session")
def stack(namespace: str, database_url: str, service_urls: ServiceUrls, log_dir: Path) -> Iterator[Stack]:
    """Processes shared by the e2e tests: one sim worker, one session manager, one gateway."""
    stack = Stack(
        namespace=namespace,
        database_url=database_url,
        redis_url=service_urls.redis,
        amqp_url=service_urls.amqp,
        log_dir=log_dir,
    )
    try:
        stack.start("worker:sim", env=SIM_ENV)
        sessions = stack.start("sessions")
        stack.start("gateway", env={"AXON_SESSIONS_URL": sessions.url})
        yield stack
    finally:
        stack.close()


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


@pytest.fixture(scope="session")
def vllm_worker(stack: Stack, vllm_model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Service:
    """The run's one worker on the default engine and model, with nothing chosen: vLLM (its CPU build
    here) serving the bundled SmolLM2, plus a random LoRA adapter of it. Started by the first module
    that asks for it (about 30 s) and shared by every module that drives the real vLLM through the
    stack; the modules that kill or stop a worker start their own."""
    adapter = random_lora(tmp_path_factory.mktemp("lora") / VLLM_ADAPTER)
    env = {
        "AXON_MODEL_CACHE_DIR": str(vllm_model_cache),
        "AXON_LORA_ADAPTERS": json.dumps({VLLM_ADAPTER: str(adapter)}),
        "AXON_MAX_SEQS": "16",
    }
    return stack.start("worker:vllm", env=env, ready_timeout_s=300)
