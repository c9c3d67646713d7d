"""The CPU engine's prefix-cache hits: transformers' continuous batching shares a new request's
leading full pages already in its paged cache, and `cpu_sampling.record_prefix_hits` notes how many
prompt tokens that was per request (reported as `cached_tokens`). A tiny random Llama through a
real `ContinuousBatchingManager`, with 16-token pages."""

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import ContinuousBatchingConfig, LlamaConfig, LlamaForCausalLM

from services.worker.engines.cpu_sampling import Controls, SamplingExtension, manager_generation_config, prefix_hits

EOS, V, PAGE = 0, 64, 16


@pytest.fixture(scope="module")
def manager() -> Iterator[tuple[Any, SamplingExtension]]:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=EOS,
        pad_token_id=EOS,
        bos_token_id=EOS,
    )
    model = LlamaForCausalLM(config)
    cb = ContinuousBatchingConfig(
        per_request_processors=True,
        num_blocks=64,
        page_size=PAGE,
        max_batch_tokens=256,
        max_requests_per_batch=4,
        use_async_batching=False,
        allow_block_sharing=True,
    )
    m = model.init_continuous_batching(
        generation_config=manager_generation_config(eos_token_id=EOS, pad_token_id=EOS, max_new_tokens=16),
        continuous_batching_config=cb,
    )
    ext = SamplingExtension(V, [EOS])
    ext.install(m)
    m.start()
    yield m, ext
    m.stop(block=True, timeout=10)


def generate(manager: tuple[Any, SamplingExtension], rid: str, prompt: list[int]) -> list[int]:
    m, ext = manager
    ext.register(rid, Controls(temperature=0, ignore_eos=True))
    m.add_request(prompt, request_id=rid, max_new_tokens=16)
    while True:
        result = m.get_result(timeout=30)
        assert result is not None, "the manager stopped answering"
        if result.request_id == rid and result.is_finished():
            ext.release(rid)
            return list(result.generated_tokens)


def test_a_prompt_starting_with_an_earlier_prompt_and_its_answer_reuses_their_full_pages(manager: Any) -> None:
    first = [1 + (i % 50) for i in range(40)]
    answer = generate(manager, "first", first)
    assert "first" not in prefix_hits  # nothing cached yet: no match recorded
    # The same prompt again: its two full pages before the last token (which is always computed).
    generate(manager, "again", first)
    assert prefix_hits.pop("again") == 2 * PAGE
    # The next turn: prompt, answer (16 tokens, the last never computed) and new tokens. The
    # first request computed 40 + 15 tokens: three full pages.
    generate(manager, "next", first + answer + [7] * 10)
    assert prefix_hits.pop("next") == 3 * PAGE
    generate(manager, "other", [51 + (i % 10) for i in range(40)])
    assert "other" not in prefix_hits
