"""Which models can be served now, from worker heartbeats, with a short cache, and what they
support."""

import asyncio
import time
from typing import Any

from shared.errors import InvalidRequest, ModelNotFound, Unavailable
from shared.openai_requests import ChatCompletionRequest, CompletionRequest
from shared.registry import LiveModel, WorkerRegistry

# Suggested wait before retrying a model that has no live worker.
NO_WORKER_RETRY_AFTER_S = 5


class ModelCatalog:
    def __init__(self, registry: WorkerRegistry, *, cache_ttl_s: float) -> None:
        self._registry = registry
        self._cache_ttl_s = cache_ttl_s
        self._live: dict[str, LiveModel] = {}
        self._aliases: dict[str, str] = {}
        self._fetched_at = float("-inf")
        self._fetching: asyncio.Future[None] | None = None

    async def _refresh(self) -> None:
        """Fetch again once the cache is older than its TTL. Requests that find it stale together
        share one fetch (under load, every request in flight would otherwise fetch at once)."""
        if time.monotonic() - self._fetched_at <= self._cache_ttl_s:
            return
        if self._fetching is None:
            self._fetching = asyncio.ensure_future(self._fetch())
            self._fetching.add_done_callback(self._fetched)
        await asyncio.shield(self._fetching)

    async def _fetch(self) -> None:
        live = await self._registry.live_models()
        aliases = await self._registry.aliases()
        self._live, self._aliases, self._fetched_at = live, aliases, time.monotonic()

    def _fetched(self, fetch: asyncio.Future[None]) -> None:
        self._fetching = None
        if not fetch.cancelled():
            fetch.exception()  # retrieved here: each waiter also got it

    async def live(self) -> dict[str, LiveModel]:
        """Models live workers serve, at most `cache_ttl_s` old."""
        await self._refresh()
        return self._live

    async def resolve(self, name: str) -> str:
        await self._refresh()
        return self._aliases.get(name, name)

    async def require(self, name: str) -> tuple[str, LiveModel]:
        """Return the model `name` refers to, and its live state, if a live worker serves it.

        Raises:
            ModelNotFound: no worker has ever served it.
            Unavailable: it is known but no worker serves it now.
        """
        model = await self.resolve(name)
        live = (await self.live()).get(model)
        if live is not None:
            return model, live
        if await self._registry.is_known(model):
            raise Unavailable(
                f"No worker is serving model '{model}' right now; try again shortly.",
                retry_after_s=NO_WORKER_RETRY_AFTER_S,
                code="no_worker",
            )
        raise ModelNotFound(f"The model '{name}' does not exist.", param="model")

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


def _entry(name: str, model: str, live: LiveModel) -> dict[str, Any]:
    """OpenAI's Model object (`id`, `object`, `created`, `owned_by`), plus the model an alias points
    at (`root`), the context its live workers have and the request parameters they all honour."""
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "axon",
        "root": model,
        "context_length": live.context_tokens,
        "capabilities": sorted(live.supports),
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
