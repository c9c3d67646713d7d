"""A simulated engine for load tests of the platform itself (never the default).

It emits exactly `max_tokens` short words after `ttft_ms`, one every `itl_ms`, with
`finish_reason="length"`. Word `i` depends only on the prompt, the seed and `i`, so a
resumed job continues exactly where it stopped.

Tokens that are already due (a zero or very short `itl_ms`, or a sequence that fell behind)
are emitted without waiting, yielding to the event loop once every `_TOKENS_PER_STEP` of them,
as a batching engine hands out many tokens per step; so at near-zero latency the simulator
costs the worker little and the platform's own cost is what a load test measures.
"""

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator

from services.worker.engines.base import Engine, EngineError, EngineOutput, GenerationRequest
from services.worker.engines.text import StopMatcher

_TOKENS_PER_STEP = 64

_WORDS = (
    "the",
    "a",
    "model",
    "token",
    "stream",
    "queue",
    "worker",
    "fast",
    "data",
    "axon",
    "batch",
    "cache",
    "reply",
    "light",
    "river",
    "stone",
    "cloud",
    "green",
    "north",
    "quiet",
)


def prompt_text(request: GenerationRequest) -> str:
    if request.messages is not None:
        return "\n".join(f"{m.role}: {m.content}" for m in request.messages)
    return request.prompt or ""


def sim_word(prompt: str, seed: int | None, index: int) -> str:
    """The `index`-th word the simulator emits for this prompt and seed."""
    digest = hashlib.blake2b(f"{seed}|{index}|{prompt}".encode(), digest_size=2).digest()
    return _WORDS[int.from_bytes(digest, "big") % len(_WORDS)]


class SimEngine(Engine):
    """Deterministic word generator with configurable latency and concurrency."""

    def __init__(
        self,
        *,
        model_name: str,
        ttft_ms: float,
        itl_ms: float,
        max_seqs: int,
        context_tokens: int,
        fail_after_s: float = 0.0,
    ) -> None:
        self.model_name = model_name
        self.max_seqs = max_seqs
        self.context_tokens = context_tokens
        self._ttft_s = ttft_ms / 1000
        self._itl_s = itl_ms / 1000
        self._running_ids: set[str] = set()
        self._aborted: set[str] = set()
        self._running = False
        self._fail_after_s = fail_after_s
        self._started_at = 0.0

    async def start(self) -> None:
        self._running = True
        self._started_at = time.monotonic()

    async def stop(self) -> None:
        self._running = False

    async def abort(self, request_id: str) -> None:
        if request_id in self._running_ids:
            self._aborted.add(request_id)

    reports_kv_cache = True

    def kv_cache_usage(self) -> float | None:
        # The simulator's "cache" holds one slot per running sequence.
        return len(self._running_ids) / self.max_seqs

    async def check_health(self) -> None:
        if self._fail_after_s and time.monotonic() - self._started_at > self._fail_after_s:
            raise EngineError("simulated engine failure (AXON_SIM_FAIL_AFTER_S)")

    async def generate(self, request: GenerationRequest) -> AsyncIterator[EngineOutput]:
        prompt = prompt_text(request)
        prompt_tokens = max(1, len(prompt.split()))
        sampling = request.sampling
        stops = StopMatcher(sampling.stop)
        started = time.monotonic()
        offset = request.resume.completion_tokens if request.resume else 0
        self._running_ids.add(request.request_id)
        try:
            for count in range(sampling.max_tokens):
                due = started + self._ttft_s + count * self._itl_s
                wait_s = due - time.monotonic()
                if wait_s > 0:
                    await asyncio.sleep(wait_s)
                elif count % _TOKENS_PER_STEP == 0:
                    await asyncio.sleep(0)  # tokens already due come in steps, like a batch engine's
                if request.request_id in self._aborted:
                    yield EngineOutput("", 0, prompt_tokens, count, finish_reason="cancelled")
                    return
                index = offset + count
                word = sim_word(prompt, sampling.seed, index)
                text = stops.feed(word if index == 0 else " " + word)
                if stops.stopped:
                    yield EngineOutput(text, 1, prompt_tokens, count + 1, finish_reason="stop")
                    return
                last = count == sampling.max_tokens - 1
                if last:
                    text += stops.flush()
                yield EngineOutput(text, 1, prompt_tokens, count + 1, finish_reason="length" if last else None)
        finally:
            self._running_ids.discard(request.request_id)
            self._aborted.discard(request.request_id)
