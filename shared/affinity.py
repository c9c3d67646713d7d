"""Affinity: which worker a job goes to first, so a conversation's turns meet their prefix in one
worker's KV cache. The whole rule, across the three services:

1. A worker that answers a session's turn names itself the session's home: its final chunk's
   publish sets `<ns>:affinity:<session>` to its id for `AFFINITY_TTL_S`
   (`services/worker/chunk_publisher.py`; past that the prefix would be evicted anyway).
2. The session manager reads that record with the session's history (`SessionStore.history_and_home`)
   and picks the job's home (`job_home`): a session's home while that worker is live and not
   draining (`LiveModel.homes`); for a sessionless chat that resends its own history (most API
   traffic is such), the worker its first exchange hashes to (`conversation_home`); else none.
3. A job with a home goes to that worker's own queue (`Names.worker_queue`) with a per-message TTL
   of `AXON_AFFINITY_WAIT_MS`; expired there, RabbitMQ dead-letters it to the model's shared queue
   (`shared/topology.py`), so a busy home spills its job to any worker, the broker's timer, not
   ours (`JobPublisher.publish`). A home whose queue is gone gets the job returned and published
   to the shared queue at once.
4. Each worker consumes its own queue beside the model's; a draining worker leaves `homes` first,
   and what waits in its queue expires into the shared one within the affinity wait.

5. Where workers keep a prefix index (`shared/prefix_index.py`), a request's home is rather the
   worker whose KV cache holds the longest prefix of its prompt, weighed against its load
   (`prefix_route`): a session's home while it holds as much as any; spilled to the least loaded
   worker once its home runs `spill_seqs` more of this session manager's jobs than that one. No
   worker holding any prefix of it, or the index unread (short prompt, Redis away, no indexed
   worker): the rules above.

`AXON_AFFINITY_WAIT_MS=0` turns it all off: every job goes to the shared queue.
"""

import hashlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from shared.schemas import Message

# How long a session's affinity record names the worker that answered its last turn: past an
# hour of silence its prefix has most likely left that worker's cache anyway.
AFFINITY_TTL_S = 3600


def job_home(
    *,
    session_home: str | None,
    session: bool,
    messages: Sequence[Message] | None,
    choices: int,
    homes: Collection[str],
    prefix_affinity: bool,
) -> str | None:
    """The worker whose own queue a request's job goes to first (None: the shared queue).

    Args:
        session_home: the worker that served the session's last turn (a session turn; None: none known).
        session: the request is a session turn.
        messages: the request's messages (None: a text completion).
        choices: the request's `n` (several choices go to the shared queue: they would queue on one worker).
        homes: the model's live workers that take jobs of their own.
        prefix_affinity: `AXON_PREFIX_AFFINITY`, sessionless conversations hashed to a worker.
    """
    if session:
        return session_home if session_home in homes else None
    if choices == 1 and messages is not None and prefix_affinity:
        return conversation_home(messages, homes)
    return None


def conversation_home(messages: Sequence[Message], homes: Collection[str]) -> str | None:
    """The worker a sessionless chat that resends its own history goes to first, so its turns meet
    their prefix in one worker's cache as a session's do (None: not such a request, or no worker).

    The key is what stays the same across the conversation's turns: its system messages, first
    user message and first answer. A request without an answer yet (most API traffic: one-shot
    questions) shares nothing but its system prompt with others, which every worker caches
    anyway, so it keeps going to the shared queue. Rendezvous hashing picks the worker: when one
    joins or leaves, only the conversations it gains or had move.
    """
    if not homes:
        return None
    answer = _first_answer(messages)
    if answer is None:
        return None
    head = hashlib.blake2b(digest_size=16)
    for message in messages[:answer]:
        head.update(f"{message.role}\x00{message.content}\x00".encode())
    first = messages[answer]
    head.update(first.content.encode())
    for call in first.tool_calls or ():
        head.update(f"\x00{call.function.name}\x00{call.function.arguments}".encode())
    key = head.digest()
    return max(homes, key=lambda worker: hashlib.blake2b(key + worker.encode(), digest_size=8).digest())


def _first_answer(messages: Sequence[Message]) -> int | None:
    """The index of the first assistant message if it answers the first user message (and only
    that one), else None; by roles alone, before any text is hashed."""
    seen_user = False
    for index, message in enumerate(messages):
        if message.role == "user":
            if seen_user:
                return None  # several questions before any answer: not a resent conversation
            seen_user = True
        elif message.role == "assistant" and seen_user:
            return index
    return None


# Why a request went where it did (`axon_sessions_prefix_routes_total`'s `reason`): the worker
# holding its longest cached prefix; a less loaded worker than that one; its session's home; none
# of these (the shared queue).
RouteReason = Literal["cached_prefix", "load_spill", "session", "none"]


@dataclass(frozen=True, slots=True)
class Route:
    """Where the prefix index sends a job (`home`: that worker's own queue first)."""

    home: str
    reason: RouteReason


def prefix_route(
    *,
    matches: Mapping[str, int],
    loads: Mapping[str, int],
    session_home: str | None,
    spill_seqs: int,
) -> Route | None:
    """The worker a request goes to first, by the prefix index (None: no worker holds any prefix
    of it, and today's rules route it, `job_home`).

    Args:
        matches: for each live indexed worker, how far into the prompt's anchors it holds it.
        loads: this session manager's jobs in flight on each worker.
        session_home: the worker that served the session's last turn (None: none).
        spill_seqs: a home running this many more jobs than the least loaded worker spills to it.
    """
    best = max(matches.values(), default=0)
    if best == 0:
        return None
    holders = [worker for worker, held in matches.items() if held == best]
    target: str
    reason: RouteReason
    if session_home in holders:
        target, reason = session_home, "session"
    else:
        target, reason = min(holders, key=lambda w: (loads.get(w, 0), w)), "cached_prefix"
    least = min(matches, key=lambda w: (loads.get(w, 0), -matches[w], w))
    if loads.get(target, 0) - loads.get(least, 0) >= spill_seqs:
        return Route(least, "load_spill")
    return Route(target, reason)
