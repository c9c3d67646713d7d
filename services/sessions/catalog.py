"""Which models can be served now, from worker heartbeats, with a short cache, and what they
support; and how long a request may wait for a worker of a model that has none (scale to zero)."""

import asyncio
import dataclasses
import math
import time
from collections.abc import Mapping
from typing import Any, get_args

from redis.exceptions import RedisError

from shared.errors import InvalidRequest, ModelNotFound, Unavailable
from shared.logging import get_logger
from shared.openai_requests import ChatCompletionRequest, CompletionRequest
from shared.registry import LiveModel, WorkerRegistry
from shared.schemas import Capability

log = get_logger(__name__)

# Suggested wait before retrying a model that has no live worker.
NO_WORKER_RETRY_AFTER_S = 5
# What a request waiting for a worker of a model never seen live assumes of it: every parameter
# supported (its worker refuses what it does not honour, `Job.requires`) and no context bound (the
# worker refuses a prompt longer than its context).
UNSEEN_MODEL = LiveModel(0, 2**31 - 1, frozenset(get_args(Capability)))
# How old the cached view may be and still be trusted when it lacks a session's home (`with_home`):
# turns of sessions whose home died read the registry again at most this often.
RECHECK_HOME_AFTER_S = 0.1


class ModelCatalog:
    def __init__(
        self,
        registry: WorkerRegistry,
        *,
        cache_ttl_s: float,
        cold_start_wait_s: float = 0.0,
        cold_start_waits: Mapping[str, float] | None = None,
        cold_start_adapters: Mapping[str, str] | None = None,
    ) -> None:
        self._registry = registry
        self._cache_ttl_s = cache_ttl_s
        self._cold_start_wait_s = cold_start_wait_s
        self._cold_start_waits = dict(cold_start_waits or {})
        # LoRA adapter -> base model, for adapters of pools at zero that no worker may have announced.
        self._cold_start_adapters = dict(cold_start_adapters or {})
        # What this process last remembered of each live model (`WorkerRegistry.remember_profiles`).
        self._remembered: dict[str, LiveModel] = {}
        self._live: dict[str, LiveModel] = {}
        self._aliases: dict[str, str] = {}
        self._fetched_at = float("-inf")
        self._fetching: asyncio.Future[None] | None = None

    async def _refresh(self, max_age_s: float | None = None) -> None:
        """Fetch again once the cache is older than its TTL (or `max_age_s`). Requests that find it
        stale together share one fetch (under load, every request in flight would otherwise fetch
        at once)."""
        if time.monotonic() - self._fetched_at <= (self._cache_ttl_s if max_age_s is None else max_age_s):
            return
        if self._fetching is None:
            self._fetching = asyncio.ensure_future(self._fetch())
            self._fetching.add_done_callback(self._fetched)
        await asyncio.shield(self._fetching)

    async def _fetch(self) -> None:
        live = await self._registry.live_models()
        aliases = await self._registry.aliases()
        self._live, self._aliases, self._fetched_at = live, aliases, time.monotonic()
        await self._remember(live)

    async def _remember(self, live: dict[str, LiveModel]) -> None:
        """Remember the profile of each live model whose profile changed since this process last did,
        for requests that will wait for one of its workers once it has none. A model that was not
        live meanwhile is remembered again (its profile may have been forgotten with it,
        `shared/registry.py`). Best effort: a failed write only delays it to the next refresh, and
        never fails the refresh itself."""
        self._remembered = {model: state for model, state in self._remembered.items() if model in live}
        changed = {
            model: state
            for model, state in live.items()
            if (seen := self._remembered.get(model)) is None
            or (seen.context_tokens, seen.supports, seen.parent) != (state.context_tokens, state.supports, state.parent)
        }
        if changed:
            try:
                await self._registry.remember_profiles(changed)
            except (RedisError, ConnectionError, TimeoutError) as exc:
                log.warning("model_profiles_not_remembered", error=repr(exc))
                return
            self._remembered.update(changed)

    def _fetched(self, fetch: asyncio.Future[None]) -> None:
        self._fetching = None
        if not fetch.cancelled():
            fetch.exception()  # retrieved here: each waiter also got it

    async def live(self) -> dict[str, LiveModel]:
        """Models live workers serve, at most `cache_ttl_s` old."""
        await self._refresh()
        return self._live

    async def with_home(self, model: str, live: LiveModel, home: str | None) -> LiveModel:
        """`live` (`model`'s state), read again if it lacks `home`, a session's home worker, and is
        older than `RECHECK_HOME_AFTER_S`: a worker that started after the cached view was read
        stays its sessions' home from their next turn, not passed over (and the sessions moved off
        it) until the cache expires. A home that is gone is still missing; the state read now, or
        `live` if the model has no live worker any more, is returned. No home (not a session's
        turn, or its first): `live`, no I/O."""
        if home is None or home in live.homes:
            return live
        await self._refresh(min(self._cache_ttl_s, RECHECK_HOME_AFTER_S))
        return self._live.get(model, live)

    async def aliases(self) -> dict[str, str]:
        """Public name -> served model, at most `cache_ttl_s` old."""
        await self._refresh()
        return self._aliases

    async def resolve(self, name: str) -> str:
        await self._refresh()
        return self._aliases.get(name, name)

    async def require(self, name: str) -> tuple[str, LiveModel]:
        """Return the model `name` refers to, and its live state, if a live worker serves it.

        Raises:
            ModelNotFound: no worker has served it (in the last 7 days: `shared/registry.py`).
            Unavailable: it is known but no worker serves it now.
        """
        model = await self.resolve(name)
        live = (await self.live()).get(model)
        if live is not None:
            return model, live
        if await self._registry.is_known(model):
            raise no_worker(model)
        raise ModelNotFound(f"The model '{name}' does not exist.", param="model")

    def cold_start_wait(self, model: str) -> float:
        """How long a request for `model` waits for a worker when none is live (0: refused at once)."""
        return self._cold_start_waits.get(model, self._cold_start_wait_s)

    async def require_or_wait(self, name: str, *, wait_s: float | None = None) -> tuple[str, LiveModel, float]:
        """Return the model `name` refers to, its live state, and how long its request may wait for
        a worker: 0 when a live worker serves it. When none does and the wait is above 0 (`wait_s`,
        else the model's `cold_start_wait`), the state is what its workers offered when last seen
        (`UNSEEN_MODEL` for a model never seen live, known from `AXON_COLD_START_WAITS` or the
        registry, with its base model if it is an adapter of `AXON_COLD_START_ADAPTERS` or one a
        worker announced), with no worker and no home.

        Raises:
            ModelNotFound: no worker has served it (in the last 7 days) and `AXON_COLD_START_WAITS`
                does not list it.
            Unavailable: `no_worker`, it is known, no worker serves it now, and its wait is 0.
        """
        model = await self.resolve(name)
        live = (await self.live()).get(model)
        if live is not None:
            return model, live, 0.0
        wait = self.cold_start_wait(model) if wait_s is None else wait_s
        listed = model in self._cold_start_waits
        if wait > 0:
            profile = await self._registry.profile(model)
            if profile is not None:
                return model, profile, wait
            base = self._cold_start_adapters.get(model) or await self._registry.adapter_base(model)
            if base is not None:  # an adapter: its jobs go to its base model's queue
                return model, dataclasses.replace(UNSEEN_MODEL, parent=base), wait
            if listed or await self._registry.is_known(model):
                return model, UNSEEN_MODEL, wait
        elif listed:
            raise no_worker(model)
        model, live = await self.require(name)
        return model, live, 0.0

    def label(self, name: str) -> str:
        """`name` as a metric label's value: the model it refers to if a live worker served it at the
        last refresh, else `unknown` (a client's string would grow /metrics without bound). No I/O."""
        model = self._aliases.get(name, name)
        return model if model in self._live else "unknown"

    async def served_name(self, name: str) -> str | None:
        """The model `name` refers to if this deployment serves it, live now or not (a request for
        it may wait for a worker: `require_or_wait`); None if it does not exist here."""
        try:
            model, _, _ = await self.require_or_wait(name, wait_s=math.inf)
        except ModelNotFound:
            return None
        return model

    async def listing(self) -> list[dict[str, Any]]:
        """OpenAI `/v1/models` entries: live models and the aliases that point at them."""
        live = await self.live()
        names = sorted(live) + sorted(a for a, target in self._aliases.items() if target in live and a not in live)
        return [_entry(name, self._aliases.get(name, name), live[self._aliases.get(name, name)]) for name in names]

    async def entry(self, name: str) -> dict[str, Any]:
        """The `/v1/models/{name}` entry of a live model or of an alias pointing at one.

        Raises:
            ModelNotFound: no live worker serves it.
        """
        model = await self.resolve(name)
        live = (await self.live()).get(model)
        if live is None:
            raise ModelNotFound(f"The model '{name}' does not exist or no worker serves it now.")
        return _entry(name, model, live)


def no_worker(model: str) -> Unavailable:
    """503 `no_worker` with Retry-After: no worker serves `model` now."""
    return Unavailable(
        f"No worker is serving model '{model}' right now; try again shortly.",
        retry_after_s=NO_WORKER_RETRY_AFTER_S,
        code="no_worker",
    )


def _entry(name: str, model: str, live: LiveModel) -> dict[str, Any]:
    """OpenAI's Model object (`id`, `object`, `created`, `owned_by`), plus the model an alias points
    at (`root`), a LoRA adapter's base model (`parent`, as vLLM lists adapters; null for a base
    model), the context its live workers have, the request parameters they all honour and the
    engines that serve it."""
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "axon",
        "root": model,
        "parent": live.parent,
        "context_length": live.context_tokens,
        "capabilities": sorted(live.supports),
        "engines": sorted(live.engines),
    }


def require_supported(body: ChatCompletionRequest | CompletionRequest, model: str, live: LiveModel) -> None:
    """Refuse a request that sets a parameter not every live worker of `model` honours (its job may
    go to any of them): nothing a client asks for is silently dropped.

    Raises:
        InvalidRequest: naming the first such parameter.
    """
    for capability in body.capabilities_used():
        if capability not in live.supports:
            raise InvalidRequest(
                f"{capability} is not supported by the engine serving model {model}.",
                param=capability,
                code="unsupported_parameter",
            )
