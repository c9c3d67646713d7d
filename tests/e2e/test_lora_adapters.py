"""LoRA adapters on one pool, on the simulator (which serves adapters by name, answering each with
words of its own): every adapter is a model in `/v1/models` with its base model as `parent`, its
requests go to the base model's queue with the adapter named in the job, reach the engine, and are
charged to the adapter; a session on an adapter keeps its home worker; an unknown adapter is 404
like any unknown model."""

import json

import httpx
import openai
import pytest
import redis
from openai import OpenAI

from services.cli.launcher import Service
from services.worker.engines.sim import sim_word
from shared.names import Names
from tests.e2e.stack import Stack
from tests.e2e.test_affinity import routed
from tests.e2e.test_usage_accounting import job_of, usage_row
from tests.e2e.test_workers import sim_worker, wait_listed

pytestmark = pytest.mark.e2e

MODEL = "lora-pool-sim"
# The simulator never reads the paths.
ADAPTERS = {"lora-sim-sql": "/adapters/sql", "lora-sim-fr": "/adapters/fr"}
HELLO = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def pool(stack: Stack) -> list[Service]:
    """The pool's two workers: no queue of the adapters' own exists for anything else to consume."""
    return [sim_worker(stack, f"lora-pool-{i}", MODEL, AXON_LORA_ADAPTERS=json.dumps(ADAPTERS)) for i in range(2)]


@pytest.fixture
def pool_client(pool: list[Service], client: OpenAI) -> OpenAI:
    for name in (MODEL, *ADAPTERS):
        wait_listed(client, name)
    return client


def test_adapters_are_listed_with_their_base_model_as_parent(pool_client: OpenAI) -> None:
    listed = {m.id: m.model_dump() for m in pool_client.models.list().data}
    assert listed[MODEL]["parent"] is None
    for name in ADAPTERS:
        assert listed[name]["parent"] == MODEL
        assert listed[name]["context_length"] == listed[MODEL]["context_length"]
    assert pool_client.models.retrieve("lora-sim-fr").model_dump()["parent"] == MODEL


def test_each_adapter_answers_with_its_own_words_through_the_base_models_queue(
    pool_client: OpenAI, database_url: str
) -> None:
    answers = {}
    for name in (MODEL, *ADAPTERS):
        response = pool_client.chat.completions.create(model=name, messages=HELLO, max_tokens=6, seed=3)
        assert response.model == name
        answers[name] = response.choices[0].message.content
    # The simulator's words depend on the adapter it was asked for: the engine got the job's adapter.
    for name in ADAPTERS:
        assert answers[name] == " ".join(sim_word(f"{name}|user: Hello there", 3, i) for i in range(6))
    assert answers[MODEL] == " ".join(sim_word("user: Hello there", 3, i) for i in range(6))
    assert len(set(answers.values())) == 3
    assert usage_row(database_url, job_of(response.id))["model"] == "lora-sim-fr"


def test_a_session_on_an_adapter_keeps_its_home_worker(
    pool_client: OpenAI, gateway: Service, auth: dict[str, str], stack: Stack
) -> None:
    created = httpx.post(f"{gateway.url}/v1/sessions", json={"title": "lora"}, headers=auth, timeout=10)
    assert created.status_code == 201, created.text
    session_id = created.json()["id"]
    homed_before = routed(stack, "home", MODEL)
    homes = set()
    for turn in range(4):
        pool_client.chat.completions.create(
            model="lora-sim-sql",
            messages=[{"role": "user", "content": f"turn {turn}"}],
            max_tokens=3,
            extra_body={"session_id": session_id},
        )
        with redis.Redis.from_url(stack.redis_url) as client:
            homes.add(client.get(Names(stack.namespace).affinity(session_id)))
    assert len(homes) == 1 and None not in homes
    # Every turn after the first went to its home's own queue, a queue of the pool's model.
    assert routed(stack, "home", MODEL) - homed_before == 3


def test_an_unknown_adapter_is_404_model_not_found(pool_client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        pool_client.chat.completions.create(model="lora-sim-nope", messages=HELLO, max_tokens=2)
    assert info.value.code == "model_not_found"
