"""The CPU engine's request mapping, without loading the model: defaults, sampling, refusals, logprobs."""

from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import GenerationConfig

from services.worker.engines.base import GenerationRequest, InvalidPrompt
from services.worker.engines.transformers_engine import SamplingDefaults, TransformersEngine
from shared.schemas import Sampling


def engine(defaults: SamplingDefaults | None = None) -> TransformersEngine:
    engine = TransformersEngine(
        model_name="m",
        gguf_path=Path("/nonexistent.gguf"),
        max_seqs=4,
        kv_cache_blocks=8,
        max_batch_tokens=64,
        threads=1,
    )
    engine._vocab_size = 100
    engine._defaults = defaults or SamplingDefaults()
    engine._token_bytes = [b"x"] * 100
    engine._token_bytes[7] = b" caf\xc3"  # ends inside a UTF-8 character
    return engine


def request(**sampling: object) -> GenerationRequest:
    return GenerationRequest(request_id="r", sampling=Sampling(**sampling))  # type: ignore[arg-type]


def test_defaults_come_from_the_generation_config_where_it_sets_them_else_openais() -> None:
    assert SamplingDefaults.of(GenerationConfig()) == SamplingDefaults(1.0, 1.0, 0, 0.0, 1.0)  # type: ignore[no-untyped-call]
    tuned = GenerationConfig(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1)  # type: ignore[no-untyped-call]
    assert SamplingDefaults.of(tuned) == SamplingDefaults(0.6, 0.9, 20, 0.0, 1.1)
    e = engine(SamplingDefaults.of(tuned))
    assert e._sampling_kwargs(request()) == {"temperature": 0.6, "top_k": 20, "top_p": pytest.approx(0.9)}
    assert e._sampling_kwargs(request(temperature=1.5, top_k=-1, top_p=0.5)) == {
        "temperature": 1.5,
        "top_k": 100,  # no top-k: the whole vocabulary
        "top_p": 0.5,
    }


def test_temperature_0_is_greedy_and_needs_no_sampler_of_its_own() -> None:
    e = engine()
    assert e._sampling_kwargs(request(temperature=0)) == {"temperature": 1.0, "top_k": 1, "top_p": 1.0}


async def test_the_extension_is_asked_only_for_what_transformers_cannot_do() -> None:
    e = engine(SamplingDefaults(repetition_penalty=1.2))
    controls = await e._controls(request(temperature=0, seed=5), [1, 2], [])
    assert controls.greedy and controls.repetition_penalty == 1.2 and controls.active  # from the defaults
    plain = await engine()._controls(request(temperature=0.7), [1, 2], [])
    assert not plain.active  # unseeded sampling: transformers' own sampler
    assert (await engine()._controls(request(temperature=0.7, seed=1), [1], [])).active


async def test_logit_bias_outside_the_vocabulary_is_the_clients_fault() -> None:
    with pytest.raises(InvalidPrompt, match="outside the model's vocabulary"):
        await engine()._controls(request(logit_bias={100: 5.0}), [1], [])


def test_logprobs_carry_exact_bytes_and_are_floored_as_openais() -> None:
    slot = SimpleNamespace(logprobs={3: (7, -1e6, [(7, -1e6), (9, -0.5)]), 4: (9, -0.1, [])})
    first, second = engine()._logprobs(slot, 3, 5)
    assert first.logprob == -9999.0 and first.bytes == [32, 99, 97, 102, 0xC3]
    assert first.token == " caf\ufffd"
    assert [(t.token, t.logprob) for t in first.top_logprobs] == [(" caf\ufffd", -9999.0), ("x", -0.5)]
    assert (second.token, second.logprob, second.top_logprobs) == ("x", -0.1, [])
    assert slot.logprobs == {}  # taken: the slot does not keep a finished answer's scores


def test_the_engine_declares_what_it_honours() -> None:
    assert {
        "tools",
        "response_format",
        "logprobs",
        "seed",
        "logit_bias",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_p",
        "top_k",
        "min_tokens",
        "ignore_eos",
        "stop",
        "echo",
    } <= TransformersEngine.supports
