"""A peft LoRA adapter of the bundled SmolLM2 served end to end by the CPU engine: the test makes a
tiny adapter whose answer starts with a word of its choosing (`tests.models.steering_lora`, so it
differs from the base model's by construction), asks peft's own `generate` what it and the base
model answer (greedy), then serves both from one worker and compares through the official client."""

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from services.cli.launcher import Service
from tests.e2e.stack import Stack
from tests.e2e.test_workers import wait_listed
from tests.models import steering_lora

# `alone` (make test runs it with no other test beside it): the real model keeps both cores busy.
pytestmark = [pytest.mark.e2e, pytest.mark.model, pytest.mark.timeout(600), pytest.mark.alone]

# A model name of this module's own: no other worker of the run consumes its queue.
BASE = "smollm2-lora-base"
ADAPTER = "smollm2-tiny-lora"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 24
# The adapter's first answer token (the base model answers "The capital of France is Paris.").
STEERED = "London"


def make_adapter(folder: Path, base: Path) -> dict[str, str]:
    """Save a tiny LoRA adapter of the bundled model (`base`: as the worker loads it) in `folder` that
    answers QUESTION starting with STEERED (`tests.models.steering_lora`); return the greedy answers
    to QUESTION of peft's `generate` with the adapter (`adapter`) and without it (`base`)."""
    import torch
    from transformers import AutoTokenizer

    peft_model = steering_lora(folder, messages=QUESTION, token=STEERED, base=base)
    tokenizer = AutoTokenizer.from_pretrained(base)
    encoded = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
    prompt = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)

    def greedy() -> str:
        out = peft_model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
        return str(tokenizer.decode(out[0][len(prompt) :], skip_special_tokens=True))

    with torch.no_grad():
        adapted = greedy()
        with peft_model.disable_adapter():
            base = greedy()
    return {"adapter": adapted, "base": base}


@pytest.fixture(scope="module")
def expected(tmp_path_factory: pytest.TempPathFactory, cpu_model: Path) -> tuple[Path, dict[str, str]]:
    folder = tmp_path_factory.mktemp("lora") / ADAPTER
    answers = make_adapter(folder, cpu_model)
    # What the adapter was built to do (the tests below tell the two apart by it).
    assert answers["adapter"].startswith(STEERED) and not answers["base"].startswith(STEERED), answers
    return folder, answers


@pytest.fixture(scope="module")
def lora_worker(stack: Stack, expected: tuple[Path, dict[str, str]]) -> Iterator[Service]:
    folder, _ = expected
    worker = stack.start(
        "worker:smollm2-lora",
        env={
            "AXON_ENGINE": "transformers",
            "AXON_MODEL": BASE,
            "AXON_MAX_SEQS": "4",
            "AXON_LORA_ADAPTERS": json.dumps({ADAPTER: str(folder)}),
        },
        ready_timeout_s=300,
    )
    yield worker
    worker.stop()  # its 2 GB and its batching loops are not the later modules' to share


@pytest.fixture
def lora_client(lora_worker: Service, client: OpenAI) -> OpenAI:
    wait_listed(client, ADAPTER)
    return client


def test_the_adapter_is_listed_as_a_model_of_its_base(lora_client: OpenAI) -> None:
    listed = {m.id: m.model_dump() for m in lora_client.models.list().data}
    assert listed[ADAPTER]["parent"] == BASE
    assert listed[BASE]["parent"] is None


async def test_adapter_and_base_answer_as_peft_does_side_by_side(
    lora_client: OpenAI, gateway: Service, api_key: str, expected: tuple[Path, dict[str, str]]
) -> None:
    _, answers = expected
    client = AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=api_key, max_retries=0, timeout=120)
    adapted, base = await asyncio.gather(
        *(
            client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=MAX_TOKENS)
            for model in (ADAPTER, BASE)
        )
    )
    assert adapted.model == ADAPTER
    assert adapted.choices[0].message.content == answers["adapter"]
    assert base.choices[0].message.content == answers["base"]


def test_an_unknown_adapter_is_404(lora_client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        lora_client.chat.completions.create(model=f"{ADAPTER}-v2", messages=QUESTION, max_tokens=4)
    assert info.value.code == "model_not_found"
