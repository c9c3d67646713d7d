"""`axon models list|alias|unalias`: live models and public aliases (zero-downtime swaps)."""

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from shared.clients import create_redis
from shared.errors import AxonError
from shared.names import Names
from shared.registry import WorkerRegistry
from shared.settings import CommonSettings

T = TypeVar("T")


async def _with_registry(action: Callable[[WorkerRegistry], Awaitable[T]]) -> T:
    settings = CommonSettings()
    client = create_redis(settings.redis_url, timeout_s=settings.connect_timeout_s)
    try:
        return await action(WorkerRegistry(client, Names(settings.namespace)))
    finally:
        await client.aclose()


def _list(_args: argparse.Namespace) -> int:
    async def action(registry: WorkerRegistry) -> None:
        live = await registry.live_models()
        for model, state in sorted(live.items()):
            adapter = f" adapter of {state.parent}" if state.parent is not None else ""
            print(f"{model:<40} workers={state.workers} context={state.context_tokens}{adapter}")
        for alias, target in sorted((await registry.aliases()).items()):
            print(f"{alias:<40} -> {target}{'' if target in live else '  (no live worker)'}")

    asyncio.run(_with_registry(action))
    return 0


def _alias(args: argparse.Namespace) -> int:
    try:
        asyncio.run(_with_registry(lambda registry: registry.set_alias(args.name, args.target)))
    except AxonError as exc:
        print(f"axon: {exc.message}")
        return 1
    print(f"{args.name} -> {args.target}")
    return 0


def _unalias(args: argparse.Namespace) -> int:
    if not asyncio.run(_with_registry(lambda registry: registry.remove_alias(args.name))):
        print(f"axon: no alias {args.name}")
        return 1
    print(f"removed {args.name}")
    return 0


def add_models_command(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    models = commands.add_parser("models", help="live models and aliases").add_subparsers(
        dest="models_command", required=True
    )
    models.add_parser("list", help="models live workers serve, and aliases").set_defaults(func=_list)
    alias = models.add_parser("alias", help="point a public model name at a served model (atomic switch)")
    alias.add_argument("name", help="the public name clients use")
    alias.add_argument("target", help="a model a live worker serves")
    alias.set_defaults(func=_alias)
    unalias = models.add_parser("unalias", help="remove an alias")
    unalias.add_argument("name")
    unalias.set_defaults(func=_unalias)
