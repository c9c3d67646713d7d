"""The CPU engine's request mapping, without loading the model: defaults, sampling, refusals, logprobs;
LoRA adapters on a tiny randomly initialised model."""

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from transformers import GenerationConfig

from services.worker.engines.base import EngineError, GenerationRequest, InvalidPrompt
from services.worker.engines.gguf import _digest
from services.worker.engines.transformers_engine import SamplingDefaults, TransformersEngine, with_adapter
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


async def test_defaults_come_from_the_generation_config_where_it_sets_them_else_openais() -> None:
    assert SamplingDefaults.of(GenerationConfig()) == SamplingDefaults(1.0, 1.0, 0, 0.0, 1.0)  # type: ignore[no-untyped-call]
    tuned = GenerationConfig(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1)  # type: ignore[no-untyped-call]
    assert SamplingDefaults.of(tuned) == SamplingDefaults(0.6, 0.9, 20, 0.0, 1.1)
    e = engine(SamplingDefaults.of(tuned))
    unset = await e._controls(request(), [1, 2], [])
    assert (unset.temperature, unset.top_k, unset.top_p, unset.repetition_penalty) == (0.6, 20, 0.9, 1.1)
    given = await e._controls(request(temperature=1.5, top_k=-1, top_p=0.5, repetition_penalty=1.0), [1], [])
    assert (given.temperature, given.top_k, given.top_p, given.repetition_penalty) == (1.5, 0, 0.5, 1.0)
    assert (await e._controls(request(temperature=0), [1], [])).greedy


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


def tiny_model() -> Any:
    """A randomly initialised two-layer Llama (SmolLM2's architecture), built from its config."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config).eval()


def test_an_adapter_is_injected_into_an_instance_sharing_the_base_weights(tmp_path: Path) -> None:
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model

    trained = get_peft_model(tiny_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, weight in trained.named_parameters():
            if "lora_B" in name:
                weight.normal_(std=0.5)
    trained.save_pretrained(tmp_path / "a")

    base = tiny_model()
    adapted = with_adapter(base, "a", tmp_path / "a")
    assert not any("lora" in name for name, _ in base.named_parameters())  # the base model is untouched
    attention = adapted.model.layers[0].self_attn
    assert attention.q_proj.base_layer.weight is base.model.layers[0].self_attn.q_proj.weight
    assert adapted.model.embed_tokens.weight is base.model.embed_tokens.weight
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        expected = PeftModel.from_pretrained(tiny_model(), tmp_path / "a").eval()(ids).logits
        assert torch.allclose(adapted(ids).logits, expected)
        assert not torch.allclose(base(ids).logits, expected)


def test_a_missing_adapter_fails_the_start_naming_it(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match=r"LoRA adapter 'sql': no peft adapter"):
        with_adapter(object(), "sql", tmp_path)


async def test_a_request_for_an_adapter_the_engine_lacks_is_an_engine_error() -> None:
    e = engine()
    e._lanes = {None: SimpleNamespace()}  # type: ignore[dict-item]
    outputs = e.generate(GenerationRequest(request_id="r", sampling=Sampling(), prompt="x", adapter="sql"))
    with pytest.raises(EngineError, match="adapter 'sql'"):
        await anext(outputs)


def engine_of(gguf: Path, model_cache_dir: Path | None) -> TransformersEngine:
    return TransformersEngine(
        model_name="m",
        gguf_path=gguf,
        max_seqs=1,
        kv_cache_blocks=1,
        max_batch_tokens=16,
        threads=1,
        model_cache_dir=model_cache_dir,
    )


def test_the_gguf_loads_from_its_float32_copy_in_the_model_cache(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF not really")
    cache = tmp_path / "cache"
    # Converted at an earlier start (as gguf.converted_model names it): loaded from there.
    copy = cache / f"m-{_digest(gguf)}-float32"
    copy.mkdir(parents=True)
    assert engine_of(gguf, cache)._source() == {"pretrained_model_name_or_path": str(copy)}


def test_without_a_cache_or_with_one_that_cannot_be_written_the_gguf_loads_itself(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF not really")
    itself = {"pretrained_model_name_or_path": str(tmp_path), "gguf_file": "m.gguf"}
    (tmp_path / "file").write_text("a file where the cache's folder would be")
    for cache in (None, tmp_path / "file" / "cache"):
        assert engine_of(gguf, cache)._source() == itself
