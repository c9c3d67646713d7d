"""Per-request sampling inside transformers' continuous batching (the CPU engine).

transformers' continuous batching has per-request temperature, top-k and top-p, and nothing else:
no grammar, no penalties, no logit bias, no per-request seed, no top-k logprobs. Its top-k and top-p
also sort every row of the logits at every step, whatever the request asked (35 to 40 ms a step
for 16 rows of SmolLM2's 49,152 on this project's CPU: a quarter of the step). So this module does
all of the sampling itself, through the one extension point the batching has,
`ContinuousBatchingLogitsProcessor` (the public base of its per-request processors): two
processors put into the manager's processor list between `init_continuous_batching()` and
`start()`, with a generation config that creates none of transformers' own
(`manager_generation_config`: greedy, no warpers).

* PRE (first): brings each request's state up to date with the tokens sampled so far (grammar
  matcher, token counts), then, on the raw logits: the grammar mask (plus the added tokens xgrammar
  would let through inside JSON strings), EOS masked until `min_tokens` (always with `ignore_eos`),
  the raw logprobs (vLLM's default `raw_logprobs`: after the grammar, before bias, penalties and
  temperature), `logit_bias`, repetition penalty, presence and frequency penalties.
* POST (last): picks the token. Temperature 0: the most likely (one argmax for the batch). Else
  temperature, top-k (`torch.topk`, no sort of the row), top-p (a sort of what top-k kept, or of
  the row when there is no top-k), min_p, then a draw with the request's own `torch.Generator`,
  reseeded from (seed, position) at every step, so a seed gives the same text alone, in any batch,
  and after a failover resume. Records the token's logprob and the top alternatives. Leaves a
  one-hot row, so transformers' own argmax picks that token.

A request's state lives in a registry keyed by request id, not in `add_request`'s kwargs (those are
deep-copied and pickled; grammar matchers are neither). PRE sees the scheduled requests in the same
order as the rows of the logits, which is how a row finds its request. A row without an entry
(none, in the engine: every request registers) gets transformers' argmax.

Prefix sharing: transformers' paged cache keeps the pages (256 tokens by default) a request
completed, keyed by a hash chain of their tokens, and a new request's leading full pages found
there are shared instead of computed (`allow_block_sharing`, on by default; full-attention models
such as SmolLM2). `record_prefix_hits` has its search (`PagedAttentionCache.search_prefix_match`)
note each request's match in `prefix_hits`, which the engine reports as `cached_tokens`.

This needs synchronous batching (`use_async_batching=False`): in async mode batch N+1 is prepared
before batch N's tokens are known, so the grammar state would lag one token. It also relies on a few
transformers internals (`check_internals` lists them; a unit test runs it, so an upgrade that moves
them fails loudly).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import ContinuousBatchingConfig
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessor,
    ContinuousBatchingLogitsProcessorList,
)
from transformers.generation.continuous_batching.requests import FutureRequestState, RequestState

_NEG_INF = float("-inf")
_SEED_MASK = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15

# (token id, its logprob, the top alternatives as (token id, logprob), most likely first)
TokenScore = tuple[int, float, list[tuple[int, float]]]


@dataclass(frozen=True, slots=True)
class Controls:
    """What one request asks of the sampler."""

    # 0: greedy (the most likely token).
    temperature: float = 1.0
    # 0: no top-k.
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    # An `xgrammar.GrammarMatcher` at the start of the answer (replayed over `replay` here).
    matcher: Any = None
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False
    # None: no logprobs; k: the sampled token's and the k most likely alternatives.
    logprobs: int | None = None
    # The prompt's token ids (the repetition penalty counts them).
    context: Sequence[int] = ()
    # Answer tokens generated before a failover, already at the end of the prompt: the grammar,
    # the penalties, `min_tokens` and the seeded draws continue from them.
    replay: Sequence[int] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Slot:
    """One request's controls and where its answer stands; read and updated by the generation thread."""

    def __init__(self, controls: Controls, vocab_size: int) -> None:
        c = controls
        self.controls = c
        self.matcher = c.matcher
        self.replayed = len(c.replay)
        self.consumed = 0  # tokens of this run already fed to the matcher and the counts
        self.step = self.replayed  # position in the answer of the token about to be sampled
        self.rejected = 0  # tokens the grammar refused (none, unless a resumed text does not fit)
        self.mask_eos = c.ignore_eos or c.min_tokens > self.replayed
        self.seed = c.seed if c.seed is not None else random.getrandbits(63)
        self.generator = torch.Generator() if not c.greedy else None
        self.bias_ids = torch.tensor(list(c.logit_bias), dtype=torch.long) if c.logit_bias else None
        self.bias_values = torch.tensor(list(c.logit_bias.values()), dtype=torch.float32) if c.logit_bias else None
        # presence/frequency: the amount taken off each token's logit, kept up to date token by token
        self.penalty = torch.zeros(vocab_size) if c.presence_penalty or c.frequency_penalty else None
        self._seen_counts: dict[int, int] = {}
        # repetition: tokens of the prompt and the answer
        self._repeated: set[int] | None = set(c.context) if c.repetition_penalty != 1.0 else None
        self._repeated_ids: torch.Tensor | None = None
        self.raw_logprobs: torch.Tensor | None = None
        self.logprobs: dict[int, TokenScore] = {}  # answer position -> score, until the engine takes it
        self._feed(c.replay)

    def _feed(self, tokens: Sequence[int]) -> None:
        c = self.controls
        for token in tokens:
            if self.matcher is not None and not self.matcher.is_terminated() and not self.matcher.accept_token(token):
                self.rejected += 1
            if self.penalty is not None:
                seen = self._seen_counts.get(token, 0)
                self._seen_counts[token] = seen + 1
                self.penalty[token] += c.frequency_penalty + (c.presence_penalty if seen == 0 else 0.0)
            if self._repeated is not None and token not in self._repeated:
                self._repeated.add(token)
                self._repeated_ids = None

    def catch_up(self, generated: Sequence[int]) -> None:
        """Account for the tokens sampled since the last step (`generated`: this run's answer so far)."""
        if len(generated) > self.consumed:
            self._feed(generated[self.consumed :])
            self.consumed = len(generated)
        self.step = self.replayed + self.consumed
        self.mask_eos = self.controls.ignore_eos or self.step < self.controls.min_tokens

    def repeated_ids(self) -> torch.Tensor | None:
        if self._repeated is None:
            return None
        if self._repeated_ids is None:
            self._repeated_ids = torch.tensor(sorted(self._repeated), dtype=torch.long)
        return self._repeated_ids

    def draw_seed(self) -> int:
        """The generator's seed for this step: a function of (seed, position) only, so resumable."""
        return (self.seed ^ (self.step * _GOLDEN)) & _SEED_MASK


def manager_generation_config(*, eos_token_id: Any, pad_token_id: Any, max_new_tokens: int = 256) -> Any:
    """The `GenerationConfig` a manager with this extension gets: transformers' sampler greedy (it
    only ever sees one-hot rows) and none of its own warpers (POST does temperature, top-k, top-p)."""
    from transformers import GenerationConfig

    return GenerationConfig(  # type: ignore[no-untyped-call]  # its __init__ is unannotated
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=pad_token_id
    )


def _clear_bits(words: int, token_ids: Sequence[int]) -> torch.Tensor:
    """int32 words of all ones but the bits of `token_ids` (xgrammar's layout: LSB first)."""
    keep = [0xFFFFFFFF] * words
    for token in token_ids:
        keep[token // 32] &= ~(1 << (token % 32)) & 0xFFFFFFFF
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in keep], dtype=torch.int32)


def generated_of(state: RequestState) -> list[int]:
    """A request's answer so far, also after transformers soft-reset it (offloading folds the
    generated tokens into the prompt: `_true_initial_tokens` marks where the answer starts)."""
    if state._true_initial_tokens:
        return state.initial_tokens[state._true_initial_tokens :] + state.generated_tokens
    return state.generated_tokens


# Prompt tokens each request found in transformers' prefix cache, by request id: written by the
# generation thread when it schedules a new request, read and forgotten by the engine.
prefix_hits: dict[str, int] = {}
_recording_prefix_hits = False


def record_prefix_hits() -> None:
    """Have transformers' prefix search record every match in `prefix_hits` (once per process)."""
    global _recording_prefix_hits
    if _recording_prefix_hits:
        return
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    search = PagedAttentionCache.search_prefix_match

    def recording(cache: PagedAttentionCache, request_id: str, prompt_ids: list[int]) -> int:
        matched: int = search(cache, request_id, prompt_ids)
        if matched:
            prefix_hits[request_id] = matched
        return matched

    PagedAttentionCache.search_prefix_match = recording  # type: ignore[method-assign,assignment]
    _recording_prefix_hits = True


class SamplingExtension:
    """The registry of per-request controls, and the two processors that apply them."""

    def __init__(self, vocab_size: int, eos_ids: Sequence[int], blocked_in_grammar: Sequence[int] = ()) -> None:
        self.vocab_size = vocab_size
        self._slots: dict[str, Slot] = {}
        self._rows: list[Slot | None] = []  # the current batch's rows, set by PRE, read by POST
        self._eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long)
        self._fallback_token = min(eos_ids) if eos_ids else 0
        import xgrammar

        self._xgr = xgrammar
        words = (vocab_size + 31) // 32
        self._bitmask = torch.zeros((0, words), dtype=torch.int32)
        # Bitmask words that clear the blocked tokens' bits, and EOS's too.
        self._keep = _clear_bits(words, blocked_in_grammar)
        self._keep_no_eos = _clear_bits(words, [*blocked_in_grammar, *eos_ids])

    # -- the engine's side (event loop) ---------------------------------------------------------

    def register(self, request_id: str, controls: Controls) -> Slot:
        slot = Slot(controls, self.vocab_size)
        self._slots[request_id] = slot
        return slot

    def release(self, request_id: str) -> None:
        self._slots.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._slots)

    def install(self, manager: Any) -> None:
        """Put PRE first and POST last in `manager`'s processor list; before `manager.start()`."""
        check_internals()
        if manager.batch_processor is not None:
            raise RuntimeError("install the sampling extension before start(): its argument rows are sized then")
        if manager.continuous_batching_config.use_async_batching:
            raise RuntimeError("the sampling extension needs use_async_batching=False")
        processors: ContinuousBatchingLogitsProcessorList = manager.logit_processor
        processors.logits_processor.insert(0, _Stage(self._prepare, self._pre))
        processors.logits_processor.append(_Stage(None, self._post))
        processors.tensors_required += 2  # one int32 argument row each in the batch's bulk tensor
        processors._retrieve_processors_kwargs()
        processors.do_processing = True
        record_prefix_hits()

    # -- the generation thread's side -------------------------------------------------------------

    def _prepare(self, requests: list[FutureRequestState]) -> None:
        rows: list[Slot | None] = []
        if self._slots:
            for future in requests:  # the order of the logits' rows
                slot = self._slots.get(future.state.request_id)
                if slot is not None:
                    slot.catch_up(generated_of(future.state))
                rows.append(slot)
        self._rows = rows

    def _pre(self, scores: torch.Tensor) -> None:
        rows = self._rows
        if not rows:
            return
        # Whole-batch operations where the rows allow: each torch call on a vocabulary-wide row
        # costs a thread-pool round trip, and the generation thread waits for every one.
        grammar = [i for i, s in enumerate(rows) if s is not None and s.matcher is not None]
        if grammar:
            self._apply_grammar(scores, grammar)
        no_eos = [i for i, s in enumerate(rows) if s is not None and s.matcher is None and s.mask_eos]
        if no_eos:
            scores[torch.tensor(no_eos).unsqueeze(1), self._eos] = _NEG_INF
        wants_logprobs = [i for i, s in enumerate(rows) if s is not None and s.controls.logprobs is not None]
        if wants_logprobs:
            raw = torch.log_softmax(scores[torch.tensor(wants_logprobs)], dim=-1)
            for j, i in enumerate(wants_logprobs):
                slot = rows[i]
                assert slot is not None
                slot.raw_logprobs = raw[j]
        for i, slot in enumerate(rows):
            if slot is not None:
                self._adjust(scores[i], slot)

    def _apply_grammar(self, scores: torch.Tensor, grammar: list[int]) -> None:
        """The grammar's allowed tokens, less the added tokens xgrammar takes for text, and less
        EOS while `min_tokens` is not reached (unless the grammar allows nothing else)."""
        if self._bitmask.size(0) < len(self._rows):
            self._bitmask = torch.zeros((len(self._rows), self._bitmask.size(1)), dtype=torch.int32)
        bitmask = self._bitmask
        for i in grammar:
            slot = self._rows[i]
            assert slot is not None
            slot.matcher.fill_next_token_bitmask(bitmask, i)
            bits = bitmask[i]
            bits.bitwise_and_(self._keep)
            if slot.mask_eos:
                without_eos = bits & self._keep_no_eos
                if bool(without_eos.any()):
                    bits.copy_(without_eos)
        self._xgr.apply_token_bitmask_inplace(
            scores, bitmask, vocab_size=self.vocab_size, indices=grammar, backend="cpu"
        )

    @staticmethod
    def _adjust(row: torch.Tensor, slot: Slot) -> None:
        c = slot.controls
        if slot.bias_ids is not None and slot.bias_values is not None:
            row.index_add_(0, slot.bias_ids, slot.bias_values)
        repeated = slot.repeated_ids()
        if repeated is not None and repeated.numel():
            values = row[repeated]
            row[repeated] = torch.where(values > 0, values / c.repetition_penalty, values * c.repetition_penalty)
        if slot.penalty is not None:
            row.sub_(slot.penalty)

    def _post(self, scores: torch.Tensor) -> None:
        picked = [i for i, s in enumerate(self._rows) if s is not None]
        if not picked:
            return
        slots = [s for s in self._rows if s is not None]
        index = torch.tensor(picked)
        rows = scores[index]
        tokens = rows.argmax(dim=-1).tolist()  # the greedy rows' tokens: one call for the batch
        dead = (rows.amax(dim=-1) == _NEG_INF).tolist()  # nothing allowed (cannot happen with a sound grammar)
        for j, slot in enumerate(slots):
            if dead[j]:
                tokens[j] = self._fallback_token
            elif not slot.controls.greedy:
                tokens[j] = self._draw(rows[j], slot)
        self._record_logprobs(slots, tokens)
        scores[index] = _NEG_INF
        scores[index, torch.tensor(tokens)] = 0.0  # transformers' argmax can only pick these

    @staticmethod
    def _draw(logits: torch.Tensor, slot: Slot) -> int:
        """Temperature, top-k, top-p and min_p (vLLM's meanings), then a draw of the request's own."""
        c = slot.controls
        logits = logits / c.temperature
        ids: torch.Tensor | None = None
        if 0 < c.top_k < logits.numel():
            logits, ids = torch.topk(logits, c.top_k)  # most likely first
        elif c.top_p < 1.0:
            logits, ids = torch.sort(logits, descending=True)
        probs = torch.softmax(logits, dim=-1)
        if c.top_p < 1.0:  # the fewest most likely tokens whose mass reaches top_p
            probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= c.top_p, 0.0)
        if c.min_p > 0.0:
            probs = probs.masked_fill(probs < c.min_p * probs.max(), 0.0)
        assert slot.generator is not None
        slot.generator.manual_seed(slot.draw_seed())
        pick = int(torch.multinomial(probs, 1, generator=slot.generator))
        return int(ids[pick]) if ids is not None else pick

    @staticmethod
    def _record_logprobs(slots: list[Slot], tokens: list[int]) -> None:
        scored = [(j, s) for j, s in enumerate(slots) if s.raw_logprobs is not None]
        if not scored:
            return
        raw = torch.stack([s.raw_logprobs for _, s in scored if s.raw_logprobs is not None])
        chosen = raw.gather(1, torch.tensor([[tokens[j]] for j, _ in scored])).squeeze(1).tolist()
        k = max(s.controls.logprobs or 0 for _, s in scored)
        top_values: list[list[float]] = []
        top_ids: list[list[int]] = []
        if k:
            values, ids = torch.topk(raw, k, dim=-1)
            top_values, top_ids = values.tolist(), ids.tolist()
        for n, (j, slot) in enumerate(scored):
            want = slot.controls.logprobs or 0
            top = (
                [(t, v) for t, v in zip(top_ids[n][:want], top_values[n][:want], strict=True) if v != _NEG_INF]
                if want
                else []
            )
            slot.logprobs[slot.step] = (tokens[j], chosen[n], top)
            slot.raw_logprobs = None


class _Stage(ContinuousBatchingLogitsProcessor):
    """PRE or POST: a processor in transformers' list that hands the batch to the extension."""

    supported_kwargs: dict[str, type] = {}  # noqa: RUF012  # the base class's declared shape
    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self, prepare: Any, apply: Any) -> None:
        self._prepare = prepare
        self._apply = apply

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(0)

    def prepare_tensor_args(self, requests_with_new_token: list[FutureRequestState]) -> torch.Tensor:
        if self._prepare is not None:
            self._prepare(requests_with_new_token)
        return torch.zeros(len(requests_with_new_token), dtype=torch.int32)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        self._apply(scores)
        return scores


def check_internals() -> None:
    """Raise `RuntimeError` naming what is gone if transformers no longer has what this module uses."""
    import inspect
    from dataclasses import fields

    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

    missing: list[str] = []
    processor_list = inspect.getsource(ContinuousBatchingLogitsProcessorList)
    for name in ("self.logits_processor", "self.tensors_required", "self.do_processing", "has_new_token"):
        if name not in processor_list:
            missing.append(f"ContinuousBatchingLogitsProcessorList: {name}")
    if not callable(getattr(ContinuousBatchingLogitsProcessorList, "_retrieve_processors_kwargs", None)):
        missing.append("ContinuousBatchingLogitsProcessorList._retrieve_processors_kwargs")
    abstract: frozenset[str] = getattr(ContinuousBatchingLogitsProcessor, "__abstractmethods__", frozenset())
    if set(abstract) != {"fill_defaults", "prepare_tensor_args", "__call__"}:
        missing.append(f"ContinuousBatchingLogitsProcessor's abstract methods are now {sorted(abstract)}")
    state_fields = {f.name for f in fields(RequestState)}
    for name in ("request_id", "initial_tokens", "generated_tokens", "_true_initial_tokens"):
        if name not in state_fields:
            missing.append(f"RequestState.{name}")
    for name in ("state", "has_new_token"):
        if name not in FutureRequestState.__slots__:
            missing.append(f"FutureRequestState.{name}")
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    search = getattr(PagedAttentionCache, "search_prefix_match", None)
    if search is None or list(inspect.signature(search).parameters)[1:] != ["request_id", "prompt_ids"]:
        missing.append("PagedAttentionCache.search_prefix_match(self, request_id, prompt_ids)")
    config_fields = {f.name for f in fields(ContinuousBatchingConfig)}
    for name in ("use_async_batching", "per_request_processors", "allow_block_sharing"):
        if name not in config_fields:
            missing.append(f"ContinuousBatchingConfig.{name}")
    manager = inspect.getsource(ContinuousBatchingManager)
    for name in ("self.logit_processor", "self.batch_processor", "self.continuous_batching_config"):
        if name not in manager:
            missing.append(f"ContinuousBatchingManager: {name}")
    if missing:
        raise RuntimeError(
            "transformers changed what services/worker/engines/cpu_sampling.py relies on: " + "; ".join(missing)
        )
