"""The CPU engine's sampling extension (services/worker/engines/cpu_sampling.py), without the bundled model.

Two levels: the processors driven through transformers' own `ContinuousBatchingLogitsProcessorList`
(exact numbers on hand-made logits), and a tiny random Llama generating through a real
`ContinuousBatchingManager` (the extension installed between init and start, as the engine does).
"""

import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import xgrammar as xgr
from transformers import ContinuousBatchingConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessorList
from transformers.generation.continuous_batching.requests import FutureRequestState, RequestState
from transformers.generation.logits_process import LogitsProcessorList

from services.worker.engines.cpu_sampling import Controls, SamplingExtension, check_internals, manager_generation_config
from services.worker.engines.grammar import compile_schema

EOS, SPECIAL = 0, 17
VOCAB = ["<eos>", "{", "}", '"', "a", "b", ":", " ", "1", "2", ",", "[", "]", "x", "true", "null", "\n", "<special>"]
VOCAB += [f"w{i}" for i in range(64 - len(VOCAB))]
V = len(VOCAB)
SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
INF = float("-inf")


@pytest.fixture(scope="module")
def compiler() -> Any:
    return xgr.GrammarCompiler(xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS]), max_threads=1)


@pytest.fixture(scope="module")
def grammar(compiler: Any) -> Any:
    return compile_schema(compiler, SCHEMA)


def test_transformers_still_has_what_the_extension_relies_on() -> None:
    # Raises naming what moved: the extension reaches into a few transformers internals.
    check_internals()


class Batch:
    """transformers' processor list with the extension installed, fed by hand as its model runner does."""

    def __init__(self) -> None:
        self.processors = ContinuousBatchingLogitsProcessorList(LogitsProcessorList(), per_request_processors=True)
        self.ext = SamplingExtension(V, [EOS], blocked_in_grammar=[SPECIAL])
        manager = SimpleNamespace(
            logit_processor=self.processors,
            batch_processor=None,
            continuous_batching_config=SimpleNamespace(use_async_batching=False),
        )
        self.ext.install(manager)
        self.states: dict[str, RequestState] = {}

    @classmethod
    def with_(cls, controls: Controls) -> "Batch":
        batch = cls()
        batch.add("r", controls)
        return batch

    def add(self, rid: str, controls: Controls, prompt: list[int] | None = None) -> None:
        self.ext.register(rid, controls)
        self.states[rid] = RequestState(request_id=rid, initial_tokens=prompt or [5, 6, 7])

    def step(self, logits: dict[str, torch.Tensor]) -> torch.Tensor:
        """One decode step of the requests named in `logits` (in that row order); returns the processed scores."""
        futures = [FutureRequestState(self.states[rid], True, {}, 1) for rid in logits]
        storage = torch.zeros((self.processors.tensors_required, len(futures)), dtype=torch.int32)
        args = self.processors.prepare_tensor_args(futures, storage)
        scores = torch.stack([logits[rid].clone() for rid in logits])
        return self.processors(torch.zeros(len(futures), dtype=torch.long), scores, args)

    def pre(self, logits: dict[str, torch.Tensor]) -> torch.Tensor:
        """PRE alone: the rows as the sampler gets them (POST turns them one-hot)."""
        self.ext._prepare([FutureRequestState(self.states[rid], True, {}, 1) for rid in logits])
        scores = torch.stack([logits[rid].clone() for rid in logits])
        self.ext._pre(scores)
        return scores

    def accept(self, rid: str, token: int) -> None:
        self.states[rid].generated_tokens.append(token)


def ramp(top: int | None = None) -> torch.Tensor:
    """Distinct logits; `top` (if given) is the most likely token."""
    logits = torch.linspace(-3.0, 3.0, V)
    if top is not None:
        logits[top] = 5.0
    return logits


def chosen(row: torch.Tensor) -> int:
    finite = torch.isfinite(row).nonzero().flatten().tolist()
    assert len(finite) == 1, "POST leaves exactly one token for transformers' sampler"
    return int(finite[0])


def test_rows_without_controls_are_left_alone_and_grammar_rows_only_allow_the_grammar(
    compiler: Any, grammar: Any
) -> None:
    batch = Batch()
    batch.add("json", Controls(temperature=0, matcher=xgr.GrammarMatcher(grammar)))
    batch.states["free"] = RequestState(request_id="free", initial_tokens=[5])
    free = ramp(top=SPECIAL)
    out = batch.step({"free": free, "json": ramp(top=SPECIAL)})
    assert torch.equal(out[0], free)  # no entry: transformers' own processing and argmax
    assert chosen(out[1]) == VOCAB.index("{")
    allowed = torch.isfinite(
        Batch.with_(Controls(temperature=0, matcher=xgr.GrammarMatcher(grammar))).pre({"r": ramp()})[0]
    )
    assert allowed.nonzero().flatten().tolist() == [
        VOCAB.index("{")
    ]  # only `{` starts the object (whitespace first is not JSON here)
    text = Batch()
    schema = json.dumps({"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]})
    start = [VOCAB.index(t) for t in ["{", '"', "x", '"', ":", '"']]
    text.add(
        "json", Controls(temperature=0, matcher=xgr.GrammarMatcher(compile_schema(compiler, schema)), replay=start)
    )
    out = text.pre({"json": ramp(top=SPECIAL)})  # inside a JSON string: text tokens, not the added one
    assert out[0][SPECIAL] == INF
    assert all(out[0][VOCAB.index(t)] != INF for t in ["a", "w3", '"'])


def test_eos_is_masked_until_min_tokens_and_always_with_ignore_eos_unless_the_grammar_is_complete(
    grammar: Any,
) -> None:
    batch = Batch()
    batch.add("min", Controls(temperature=0, min_tokens=2))
    batch.add("ignore", Controls(temperature=0, ignore_eos=True))
    eos_first = ramp(top=EOS)
    for step in range(3):
        out = batch.step({"min": eos_first, "ignore": eos_first})
        assert (out[0][EOS] == INF) == (step < 2)
        assert out[1][EOS] == INF
        batch.accept("min", 4)
        batch.accept("ignore", 4)
    done = Batch()
    matcher = xgr.GrammarMatcher(grammar)
    answer = [VOCAB.index(t) for t in ["{", '"', "a", '"', ":", "1", "}"]]
    done.add("json", Controls(temperature=0, matcher=matcher, ignore_eos=True, replay=answer))
    out = done.step({"json": eos_first})
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [EOS]  # the answer is complete: it may end


def test_logit_bias_penalties_and_repetition_shift_the_logits_as_vllm_does() -> None:
    batch = Batch()
    logits = torch.zeros(V)
    logits[4], logits[5] = 2.0, -2.0
    batch.add("bias", Controls(seed=1, logit_bias={4: -100.0, 9: 3.0}))
    batch.add("penalties", Controls(seed=1, presence_penalty=0.5, frequency_penalty=0.25, replay=[4, 4, 5]))
    batch.add("repetition", Controls(seed=1, repetition_penalty=2.0, context=[4], replay=[5]))
    rows = batch.pre({"bias": logits, "penalties": logits, "repetition": logits})
    assert rows[0][4] == pytest.approx(-98.0) and rows[0][9] == pytest.approx(3.0)
    assert rows[1][4] == pytest.approx(2.0 - 0.5 - 2 * 0.25)  # presence once, frequency per occurrence
    assert rows[1][5] == pytest.approx(-2.0 - 0.5 - 0.25)
    assert rows[1][6] == 0.0
    assert rows[2][4] == pytest.approx(1.0) and rows[2][5] == pytest.approx(-4.0)  # prompt and answer tokens


def test_a_seed_draws_the_same_tokens_in_any_batch_and_after_a_resume() -> None:
    logits = torch.zeros(V)  # uniform: every draw is the seed's doing

    def draws(rows_before: int, seed: int, steps: int, replay: list[int] | None = None) -> list[int]:
        batch = Batch()
        for n in range(rows_before):
            batch.add(f"other{n}", Controls(seed=100 + n))
        batch.add("me", Controls(seed=seed, replay=replay or []))
        tokens = []
        for _ in range(steps):
            rows = {f"other{n}": logits for n in range(rows_before)} | {"me": logits}
            out = batch.step(rows)
            tokens.append(chosen(out[rows_before]))
            for rid, row in zip(rows, out, strict=True):
                batch.accept(rid, chosen(row))
        return tokens

    alone = draws(0, seed=42, steps=12)
    assert draws(3, seed=42, steps=12) == alone
    assert draws(0, seed=43, steps=12) != alone
    assert draws(0, seed=42, steps=7, replay=alone[:5]) == alone[5:]


def test_min_p_keeps_only_tokens_near_the_most_likely() -> None:
    logits = torch.full((V,), -10.0)
    logits[3], logits[8] = 2.0, 1.9  # close to each other, everything else far below
    batch = Batch()
    batch.add("p", Controls(seed=0, min_p=0.5))
    seen = set()
    for _ in range(40):
        token = chosen(batch.step({"p": logits})[0])
        seen.add(token)
        batch.accept("p", token)
    assert seen == {3, 8}


def draws_of(controls: Controls, logits: torch.Tensor, steps: int = 60) -> set[int]:
    batch = Batch.with_(controls)
    seen = set()
    for _ in range(steps):
        token = chosen(batch.step({"r": logits})[0])
        seen.add(token)
        batch.accept("r", token)
    return seen


def test_top_k_top_p_and_temperature_keep_vllms_meanings() -> None:
    probs = torch.full((V,), 1e-4)
    probs[[3, 8, 9]] = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log()
    assert draws_of(Controls(seed=1), logits) >= {3, 8, 9}
    assert draws_of(Controls(seed=1, top_k=2), logits) == {3, 8}
    # top_p: the fewest most likely tokens whose mass reaches it (0.5 + 0.3 >= 0.75)
    assert draws_of(Controls(seed=1, top_p=0.75), logits) == {3, 8}
    assert draws_of(Controls(seed=1, top_k=3, top_p=0.75), logits) == {3, 8}
    assert draws_of(Controls(seed=1, temperature=0.05), logits) == {3}
    assert draws_of(Controls(temperature=0), logits, steps=3) == {3}


def test_logprobs_are_raw_after_the_grammar_with_the_top_alternatives(grammar: Any) -> None:
    batch = Batch()
    batch.add("free", Controls(temperature=0, logprobs=3, logit_bias={7: 50.0}))
    logits = ramp(top=12)
    out = batch.step({"free": logits})
    slot = batch.ext._slots["free"]
    token, logprob, top = slot.logprobs[0]
    assert token == chosen(out[0]) == 7  # the bias decided the token...
    raw = torch.log_softmax(logits, dim=-1)
    assert logprob == pytest.approx(float(raw[7]))  # ...but the logprob is the unbiased one (vLLM's raw_logprobs)
    assert [t for t, _ in top] == [12, V - 1, V - 2]
    assert [v for _, v in top] == pytest.approx(raw[[12, V - 1, V - 2]].tolist())
    constrained = Batch()
    constrained.add("json", Controls(temperature=0, logprobs=5, matcher=xgr.GrammarMatcher(grammar)))
    constrained.step({"json": logits})
    token, logprob, top = constrained.ext._slots["json"].logprobs[0]
    assert token == VOCAB.index("{") and logprob == pytest.approx(0.0, abs=1e-6)  # the only allowed token
    assert top == [(token, pytest.approx(0.0, abs=1e-6))]  # masked tokens are not alternatives


def test_install_refuses_a_started_manager_or_async_batching() -> None:
    ext = SamplingExtension(V, [EOS])
    processors = ContinuousBatchingLogitsProcessorList(LogitsProcessorList())
    with pytest.raises(RuntimeError, match="before start"):
        ext.install(SimpleNamespace(logit_processor=processors, batch_processor=object()))
    with pytest.raises(RuntimeError, match="use_async_batching=False"):
        ext.install(
            SimpleNamespace(
                logit_processor=processors,
                batch_processor=None,
                continuous_batching_config=SimpleNamespace(use_async_batching=True),
            )
        )


# --- through a real ContinuousBatchingManager, with a tiny random model --------------------------


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
        max_position_embeddings=256,
        eos_token_id=EOS,
        pad_token_id=EOS,
        bos_token_id=EOS,
    )
    model = LlamaForCausalLM(config)
    generation = manager_generation_config(eos_token_id=EOS, pad_token_id=EOS, max_new_tokens=16)
    cb = ContinuousBatchingConfig(
        per_request_processors=True,
        num_blocks=32,
        max_batch_tokens=128,
        max_requests_per_batch=8,
        use_async_batching=False,
    )
    m = model.init_continuous_batching(generation_config=generation, continuous_batching_config=cb)
    ext = SamplingExtension(V, [EOS], blocked_in_grammar=[SPECIAL])
    ext.install(m)
    m.start()
    yield m, ext
    m.stop(block=True, timeout=10)


def generate(manager: tuple[Any, SamplingExtension], requests: dict[str, Controls]) -> dict[str, list[int]]:
    m, ext = manager
    for rid, controls in requests.items():
        ext.register(rid, controls)
        m.add_request([5, 6, 7, 8], request_id=rid, max_new_tokens=16)
    out: dict[str, list[int]] = {}
    while len(out) < len(requests):
        result = m.get_result(timeout=30)
        assert result is not None, "the manager stopped answering"
        if result.is_finished():
            out[result.request_id] = list(result.generated_tokens)
            ext.release(result.request_id)
    return out


def test_in_a_real_manager_the_grammar_holds_and_a_seed_is_its_own(manager: Any, grammar: Any) -> None:
    out = generate(
        manager,
        {
            "json": Controls(temperature=0, matcher=xgr.GrammarMatcher(grammar)),
            "seeded": Controls(seed=9),
            "free": Controls(),
        },
    )
    check = xgr.GrammarMatcher(grammar)
    assert all(check.accept_token(t) for t in out["json"]), "every token the grammar allowed"
    assert SPECIAL not in out["json"]
    alone = generate(manager, {"seeded2": Controls(seed=9)})
    assert alone["seeded2"] == out["seeded"]
    other = generate(manager, {"seeded3": Controls(seed=10)})
    assert other["seeded3"] != out["seeded"]


def test_in_a_real_manager_logit_bias_bans_the_greedy_token(manager: Any) -> None:
    plain = generate(manager, {"plain": Controls(temperature=0)})["plain"]
    banned = plain[0]
    biased = generate(manager, {"biased": Controls(temperature=0, logit_bias={banned: -100.0})})["biased"]
    assert banned not in biased
