"""LoRA adapters on one pool, on the simulator (which serves adapters by name, answering each with
words of its own): every adapter is a model in `/v1/models` with its base model as `parent`, its
requests go to the base model's queue with the adapter named in the job, reach the engine, and are
charged to the adapter; an unknown adapter is 404 like any unknown model."""

import json

import openai
import pytest
from openai import OpenAI

from services.cli.launcher import Service
from services.worker.engines.sim import sim_word
from tests.e2e.stack import Stack
from tests.e2e.test_usage_accounting import job_of, usage_row
from tests.e2e.test_workers import sim_worker, wait_listed

pytestmark = pytest.mark.e2e

MODEL = "lora-pool-sim"
# The simulator never reads the paths.
ADAPTERS = {"lora-sim-sql": "/adapters/sql", "lora-sim-fr": "/adapters/fr"}
HELLO = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def pool(stack: Stack) -> Service:
    """The pool's one worker: no queue of the adapters' own exists for anything else to consume."""
    return sim_worker(stack, "lora-pool", MODEL, AXON_LORA_ADAPTERS=json.dumps(ADAPTERS))


@pytest.fixture
def pool_client(pool: Service, client: OpenAI) -> OpenAI:
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


def test_an_unknown_adapter_is_404_model_not_found(pool_client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        pool_client.chat.completions.create(model="lora-sim-nope", messages=HELLO, max_tokens=2)
    assert info.value.code == "model_not_found"
