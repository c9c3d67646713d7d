"""Which workers are alive and which models they serve, kept in Redis.

Workers heartbeat into one hash with an expiry time inside each entry; readers
ignore (and sweep) expired entries, so a killed worker's model disappears once its
last heartbeat expires. Every model served is also remembered, which tells
"unknown model" (404) from "known model, no worker right now" (503).

What a model's live workers offered (context, supported parameters) is remembered too, for requests
that wait for a worker of a model whose pool has scaled to zero (`remember_profiles`).

A worker may also serve LoRA adapters of its model: each is a model of its own here (its
`LiveModel.parent` is the base model, whose queue its jobs go to), remembered with its base.

A model is remembered until no live worker has served it for `FORGET_MODEL_AFTER_S`: every
heartbeat records when its models were last served (`Names.models_seen_key`) and forgets, in the
same script, the models and adapters not served since (from the known models, the adapters and
the remembered profiles). Nothing the registry keeps grows without bound.
"""

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

import orjson
import redis.asyncio as redis
from redis.typing import EncodableT, FieldT

from shared.errors import Conflict, InvalidRequest
from shared.logging import get_logger
from shared.names import Names

log = get_logger(__name__)

# An entry is deleted only long after it expired, so a sweep never races a live
# worker's refresh of its own entry.
_SWEEP_GRACE_S = 60.0
# A model no live worker has served for this long is forgotten: requests for it get 404 instead of
# 503, it leaves the queue-depth and live-worker metrics (and so AxonNoLiveWorker), and a pool at
# zero waits for it as for a model never seen (AXON_COLD_START_WAITS still lists it). Long enough
# for restarts, outages and weekends at zero; short enough that retired models do not pile up.
FORGET_MODEL_AFTER_S = 7 * 86_400.0

# KEYS: workers hash, known models set, models' last-served times (sorted set), adapters hash,
# model profiles hash. ARGV: worker id, heartbeat entry (JSON), model, now (Unix s), forget models
# last served before this (Unix s), then the adapters the worker serves.
# The heartbeat; then every known model or adapter without a last-served time (remembered before
# times were kept) gets now, and those last served before ARGV[5] are forgotten.
_HEARTBEAT = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('SADD', KEYS[2], ARGV[3])
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[3])
for i = 6, #ARGV do
  redis.call('HSET', KEYS[4], ARGV[i], ARGV[3])
  redis.call('ZADD', KEYS[3], ARGV[4], ARGV[i])
end
for _, model in ipairs(redis.call('SMEMBERS', KEYS[2])) do redis.call('ZADD', KEYS[3], 'NX', ARGV[4], model) end
for _, adapter in ipairs(redis.call('HKEYS', KEYS[4])) do redis.call('ZADD', KEYS[3], 'NX', ARGV[4], adapter) end
local stale = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', '(' .. ARGV[5])
for _, model in ipairs(stale) do
  redis.call('SREM', KEYS[2], model)
  redis.call('HDEL', KEYS[4], model)
  redis.call('HDEL', KEYS[5], model)
  redis.call('ZREM', KEYS[3], model)
end
return #stale
"""


@dataclass(frozen=True, slots=True)
class LiveModel:
    """A model some live worker serves: how many workers, the smallest context among them, the
    request parameters every one of them honours (a job may go to any of them), the ids of
    those that take jobs of their own (live and not draining: a session's home may be one), and
    the engines they run (`vllm`, `transformers`, `sim`), and which of the homes keep a set in the
    prefix index (`shared/prefix_index.py`)."""

    workers: int
    context_tokens: int
    supports: frozenset[str] = frozenset()
    homes: frozenset[str] = frozenset()
    # A LoRA adapter's base model (the queue its jobs go to); None for a base model.
    parent: str | None = None
    engines: frozenset[str] = frozenset()
    indexed: frozenset[str] = frozenset()

    def joined(
        self,
        *,
        context_tokens: int,
        supports: frozenset[str],
        homes: frozenset[str],
        engines: frozenset[str],
        indexed: frozenset[str] = frozenset(),
    ) -> "LiveModel":
        """This model with one more live worker."""
        return LiveModel(
            self.workers + 1,
            min(self.context_tokens, context_tokens),
            self.supports & supports,
            self.homes | homes,
            self.parent,
            self.engines | engines,
            self.indexed | indexed,
        )

    def route(self, name: str) -> tuple[str, str | None]:
        """Where a job for this model, called `name`, goes: the model whose queue takes it, and
        the adapter the job names (None: the model itself)."""
        return (self.parent, name) if self.parent is not None else (name, None)


class WorkerRegistry:
    """Reads and writes worker heartbeats for one namespace."""

    def __init__(
        self, client: redis.Redis, names: Names, *, forget_model_after_s: float = FORGET_MODEL_AFTER_S
    ) -> None:
        self._redis = client
        self._names = names
        self._forget_model_after_s = forget_model_after_s
        self._heartbeat = client.register_script(_HEARTBEAT)

    async def heartbeat(
        self,
        *,
        worker_id: str,
        model: str,
        ttl_s: float,
        max_seqs: int,
        context_tokens: int,
        supports: Iterable[str] = (),
        draining: bool = False,
        adapters: Iterable[str] = (),
        engine: str = "",
        prefix_index: bool = False,
    ) -> None:
        """Announce that `worker_id` serves `model`, and its LoRA `adapters`, with `engine` for the
        next `ttl_s` seconds, honouring the request parameters `supports`; a `draining` worker is
        no session's home any more; with `prefix_index` it keeps a set in the prefix index. Models
        no live worker served for `forget_model_after_s` are forgotten in the same call."""
        served_adapters = sorted(adapters)
        now = time.time()
        entry = {
            "model": model,
            "expires_at": now + ttl_s,
            "max_seqs": max_seqs,
            "context_tokens": context_tokens,
            "supports": sorted(supports),
            "draining": draining,
            "adapters": served_adapters,
            "engine": engine,
            "prefix_index": prefix_index,
        }
        names = self._names
        forgotten = await self._heartbeat(
            keys=[
                names.workers_key,
                names.models_key,
                names.models_seen_key,
                names.adapters_key,
                names.model_profiles_key,
            ],
            args=[worker_id, orjson.dumps(entry), model, now, now - self._forget_model_after_s, *served_adapters],
        )
        if forgotten:
            log.info("models_forgotten", count=forgotten, unserved_for_s=self._forget_model_after_s)

    async def remove(self, worker_id: str) -> None:
        """Withdraw a worker at once (clean shutdown)."""
        await self._redis.hdel(self._names.workers_key, worker_id)

    async def live_models(self) -> dict[str, LiveModel]:
        """Return the models live workers serve, sweeping long-expired heartbeats."""
        # redis-py types replies as bytes | str; our clients never set decode_responses, so they are bytes.
        entries = cast(dict[bytes, bytes], await self._redis.hgetall(self._names.workers_key))
        now = time.time()
        live: dict[str, LiveModel] = {}
        expired: list[bytes] = []
        for worker_id, raw in entries.items():
            entry = orjson.loads(raw)
            if entry["expires_at"] < now - _SWEEP_GRACE_S:
                expired.append(worker_id)
            if entry["expires_at"] < now:
                continue
            context = entry["context_tokens"]
            supports = frozenset(entry.get("supports", ()))
            homes = frozenset() if entry.get("draining") else frozenset((worker_id.decode(),))
            engines = frozenset((entry["engine"],)) if entry.get("engine") else frozenset()
            indexed = homes if entry.get("prefix_index") else frozenset()
            for name, parent in _served(entry):
                known = live.get(name)
                live[name] = (
                    known.joined(
                        context_tokens=context, supports=supports, homes=homes, engines=engines, indexed=indexed
                    )
                    if known
                    else LiveModel(1, context, supports, homes, parent, engines, indexed)
                )
        if expired:
            await self._redis.hdel(self._names.workers_key, *expired)
        return live

    async def is_known(self, model: str) -> bool:
        """True if any worker has ever served `model` (or announced it as an adapter) in this namespace."""
        if await self._redis.sismember(self._names.models_key, model):
            return True
        return bool(await self._redis.hexists(self._names.adapters_key, model))

    async def aliases(self) -> dict[str, str]:
        """Public model name -> the served model it points at."""
        raw = cast(dict[bytes, bytes], await self._redis.hgetall(self._names.aliases_key))  # bytes: see live_models
        return {k.decode(): v.decode() for k, v in raw.items()}

    async def set_alias(self, alias: str, target: str) -> None:
        """Point `alias` at `target` in one atomic write; requests already running finish on the
        old target, new ones go to the new one.

        Raises:
            Conflict: no live worker serves `target` (switching to it would fail requests).
            InvalidRequest: `alias` is itself a served model's name.
        """
        live = await self.live_models()
        if target not in live:
            raise Conflict(
                f"No live worker serves '{target}'; an alias can only point at a served model.",
                param="target",
                code="alias_target_unavailable",
            )
        if alias in live:
            raise InvalidRequest(f"'{alias}' is a served model's name, not an alias.", param="alias")
        await self._redis.hset(self._names.aliases_key, alias, target)

    async def remove_alias(self, alias: str) -> bool:
        return bool(await self._redis.hdel(self._names.aliases_key, alias))

    async def remember_profiles(self, live: dict[str, LiveModel]) -> None:
        """Keep what the live workers of each model in `live` offer (its context and supported
        parameters) and, for an adapter, its base model, replacing what was remembered of it."""
        if live:
            profiles: dict[FieldT, EncodableT] = {
                model: orjson.dumps(
                    {"context_tokens": state.context_tokens, "supports": sorted(state.supports), "parent": state.parent}
                )
                for model, state in live.items()
            }
            await self._redis.hset(self._names.model_profiles_key, mapping=profiles)

    async def profile(self, model: str) -> LiveModel | None:
        """What the live workers of `model` offered when last seen, as a LiveModel with no worker
        (None: never seen)."""
        raw = await self._redis.hget(self._names.model_profiles_key, model)
        if raw is None:
            return None
        profile = orjson.loads(raw)
        return LiveModel(0, profile["context_tokens"], frozenset(profile["supports"]), parent=profile.get("parent"))

    async def adapter_base(self, model: str) -> str | None:
        """The base model of `model` if some worker ever announced it as a LoRA adapter (None: not one)."""
        base = cast(bytes | None, await self._redis.hget(self._names.adapters_key, model))  # bytes: see live_models
        return base.decode() if base is not None else None


def _served(entry: dict[str, object]) -> list[tuple[str, str | None]]:
    """The models a heartbeat entry serves, each with its parent: its base model, then its adapters."""
    model = str(entry["model"])
    adapters = cast(list[str], entry.get("adapters", ()))
    return [(model, None), *((adapter, model) for adapter in adapters)]
