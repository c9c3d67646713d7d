"""`axon tenants set|list`: tenants' fair-share weights, in PostgreSQL and Redis as the admin API
writes them (`shared/tenants.py`)."""

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

import asyncpg

from shared.clients import create_redis
from shared.errors import InvalidRequest
from shared.names import Names
from shared.settings import CommonSettings
from shared.tenants import TenantStore, checked_tenant, weight_from_text, weight_text

T = TypeVar("T")


async def _with_store(action: Callable[[TenantStore], Awaitable[T]]) -> T:
    settings = CommonSettings()
    pool = await asyncpg.create_pool(settings.database_url, min_size=1, max_size=2, timeout=10)
    client = create_redis(settings.redis_url, timeout_s=settings.connect_timeout_s)
    try:
        return await action(TenantStore(pool, client, Names(settings.namespace)))
    finally:
        await client.aclose()
        await pool.close()


def _set(args: argparse.Namespace) -> int:
    try:
        tenant = checked_tenant(args.tenant)
        weight = weight_from_text(args.weight)
    except InvalidRequest as exc:
        print(f"axon: {exc.message}", file=sys.stderr)
        return 2
    stored, in_redis = asyncio.run(_with_store(lambda store: store.set_weight(tenant, weight)))
    print(f"{stored.tenant} weight={weight_text(stored.weight)} keys={stored.keys}")
    if not in_redis:
        print(
            "axon: Redis is unreachable; every gateway applies the weight within AXON_TENANT_WEIGHTS_SYNC_S"
            " once it is back",
            file=sys.stderr,
        )
    return 0


def _list(_args: argparse.Namespace) -> int:
    tenants = asyncio.run(_with_store(lambda store: store.list()))
    print(f"{'tenant':<40} {'weight':>10} {'keys':>6}")
    for t in tenants:
        print(f"{t.tenant:<40} {weight_text(t.weight):>10} {t.keys:>6}")
    return 0


def add_tenants_command(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    tenants = commands.add_parser("tenants", help="tenants' fair-share weights").add_subparsers(
        dest="tenants_command", required=True
    )
    set_weight = tenants.add_parser(
        "set", help="set a tenant's weight: its share of the workers relative to other tenants' (default 1)"
    )
    set_weight.add_argument("tenant", help="the tenant, as `axon keys create --tenant` names it (or a key's id)")
    set_weight.add_argument("--weight", required=True, metavar="W", help="a number > 0 and <= 1000000, e.g. 3 or 0.5")
    set_weight.set_defaults(func=_set)
    tenants.add_parser(
        "list", help="tenants of API keys and those given a weight, with their weight and active keys"
    ).set_defaults(func=_list)
