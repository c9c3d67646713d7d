"""vLLM's request outputs as the engine's `EngineOutput`s: finish reasons, logprobs converted as vLLM's
OpenAI server converts them, text held back until it is whole, and the replayed start of a resumed
constrained answer checked and cut off (`PrefixReplay`).

Nothing here imports vLLM: it reads the attributes of vLLM's `RequestOutput`, `CompletionOutput`
and `Logprob` objects.
"""

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from services.worker.engines.base import EngineOutput, Resume
from shared.schemas import FinishReason, TokenLogprob, TopLogprob

_FINISH_REASONS: dict[str | None, FinishReason | None] = {
    None: None,
    "stop": "stop",
    "length": "length",
    "abort": "cancelled",
}

# OpenAI's (and vLLM's) logprob for a token outside the returned ones.
_LOGPROB_FLOOR = -9999.0

Decode = Callable[[int], str]


def finish_reason(vllm_reason: str | None) -> FinishReason | None:
    return _FINISH_REASONS.get(vllm_reason, "error")


def token_logprob(token_id: int, step: Mapping[int, Any] | None, top: int, decode: Decode) -> TokenLogprob:
    """One position of vLLM's logprobs (`{token id: Logprob}`) as OpenAI's, as vLLM's server builds
    it: the token's text is vLLM's `decoded_token`, its logprob floored at -9999, `bytes` its UTF-8;
    `top_logprobs` the `top` most likely tokens (by vLLM's `rank`), most likely first."""
    chosen = step.get(token_id) if step else None
    if chosen is None:  # vLLM returned nothing for the sampled token
        text = decode(token_id)
        return TokenLogprob(token=text, logprob=_LOGPROB_FLOOR, bytes=_utf8(text))
    text = _decoded(token_id, chosen, decode)
    return TokenLogprob(
        token=text,
        logprob=_floored(chosen.logprob),
        bytes=_utf8(text),
        top_logprobs=_top_logprobs(step, top, decode) if step and top > 0 else [],
    )


def prompt_logprobs(
    token_ids: Sequence[int], steps: Sequence[Mapping[int, Any] | None], top: int, decode: Decode
) -> tuple[TokenLogprob, ...]:
    """vLLM's prompt logprobs for `echo`. The first prompt token has none (nothing precedes it);
    it is left out."""
    return tuple(
        token_logprob(tid, step, top, decode) for tid, step in zip(token_ids, steps, strict=False) if step is not None
    )


def _top_logprobs(step: Mapping[int, Any], top: int, decode: Decode) -> list[TopLogprob]:
    # vLLM's dict holds the sampled token (with its true rank) and the ranks 1..k.
    ranked = sorted((lp.rank, tid) for tid, lp in step.items() if lp.rank is not None and 1 <= lp.rank <= top)
    ids = [tid for _, tid in ranked] if ranked else list(step)[:top]
    entries = []
    for tid in ids:
        text = _decoded(tid, step[tid], decode)
        entries.append(TopLogprob(token=text, logprob=_floored(step[tid].logprob), bytes=_utf8(text)))
    return entries


def _decoded(token_id: int, logprob: Any, decode: Decode) -> str:
    text = logprob.decoded_token
    return text if text is not None else decode(token_id)


def _floored(logprob: float) -> float:
    return _LOGPROB_FLOOR if math.isnan(logprob) else max(logprob, _LOGPROB_FLOOR)


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


class ReplayDiverged(Exception):
    """A resumed constrained answer, generated again, differs from what was already sent."""


class PrefixReplay:
    """Checks the already-sent start of a regenerated answer and cuts it off.

    Fed vLLM's outputs in order, `take` returns the text after the already-sent text and the
    index of the first new token in each output. The token ids are compared (when the earlier
    attempt recorded them) and so is the text; any difference raises `ReplayDiverged`.
    """

    def __init__(self, resume: Resume) -> None:
        self._text = resume.text
        self._ids = resume.token_ids
        self._tokens = len(resume.token_ids) if resume.token_ids else resume.completion_tokens
        self._seen_text = ""
        self._seen_tokens = 0
        self.done = not self._text and self._tokens == 0

    def take(self, text: str, token_ids: Sequence[int]) -> tuple[str, int]:
        for offset, token_id in enumerate(token_ids[: max(0, len(self._ids) - self._seen_tokens)]):
            if token_id != self._ids[self._seen_tokens + offset]:
                raise ReplayDiverged(f"token {self._seen_tokens + offset} differs")
        first_new = min(len(token_ids), max(0, self._tokens - self._seen_tokens))
        self._seen_tokens += len(token_ids)
        self._seen_text += text
        if len(self._seen_text) < len(self._text):
            if not self._text.startswith(self._seen_text):
                raise ReplayDiverged("the text differs")
            return "", first_new
        if not self._seen_text.startswith(self._text):
            raise ReplayDiverged("the text differs")
        new_text = self._seen_text[len(self._text) :]
        self._seen_text = self._text
        self.done = self._seen_tokens >= self._tokens
        return new_text, first_new


class AnswerOutputs:
    """Turns the `RequestOutputKind.DELTA` outputs of one vLLM request into `EngineOutput`s.

    Tokens whose text vLLM holds back (an incomplete character, a possible stop string) wait for
    the next output with text, with their logprobs; a resumed constrained answer's regenerated
    start is skipped (`PrefixReplay`).
    """

    def __init__(self, *, replay: PrefixReplay | None, top_logprobs: int | None, echo: bool, decode: Decode) -> None:
        self._replay = replay
        self._top = top_logprobs
        self._want_prompt_logprobs = echo and top_logprobs is not None
        self._decode = decode
        self._prompt_tokens = 0
        self._completion_tokens = 0
        self._unsent_ids: list[int] = []
        self._unsent_logprobs: list[TokenLogprob] = []

    def step(self, output: Any) -> EngineOutput | None:
        if output.prompt_token_ids:
            self._prompt_tokens = len(output.prompt_token_ids)
        piece = output.outputs[0]
        token_ids = list(piece.token_ids)
        text, first_new = piece.text, 0
        if self._replay is not None and not self._replay.done:
            text, first_new = self._replay.take(text, token_ids)
        self._completion_tokens += len(token_ids) - first_new
        self._unsent_ids.extend(token_ids[first_new:])
        if self._top is not None and piece.logprobs is not None:
            self._unsent_logprobs.extend(
                token_logprob(token_ids[i], piece.logprobs[i], self._top, self._decode)
                for i in range(first_new, len(token_ids))
            )
        prompt_lps: tuple[TokenLogprob, ...] = ()
        if self._want_prompt_logprobs and output.prompt_logprobs:
            assert self._top is not None
            prompt_lps = prompt_logprobs(output.prompt_token_ids, output.prompt_logprobs, self._top, self._decode)
            self._want_prompt_logprobs = False
        reason = finish_reason(piece.finish_reason) if output.finished else None
        if reason in ("stop", "length") and self._replay is not None and not self._replay.done:
            raise ReplayDiverged("the answer ended before the text already sent")
        if not text and reason is None and not prompt_lps:
            return None
        out = EngineOutput(
            text,
            len(self._unsent_ids),
            self._prompt_tokens,
            self._completion_tokens,
            reason,
            tuple(self._unsent_ids),
            tuple(self._unsent_logprobs),
            prompt_lps,
            cached_tokens=getattr(output, "num_cached_tokens", None) or 0,
            # vLLM's stop_reason: the stop string that matched (a stop token id is not one).
            stop_sequence=piece.stop_reason if reason == "stop" and isinstance(piece.stop_reason, str) else None,
        )
        self._unsent_ids, self._unsent_logprobs = [], []
        return out
