"""`axon keys create|list|revoke`: manage API keys directly in PostgreSQL."""

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import asyncpg

from shared.clients import create_redis
from shared.keys import KeyRepository, evict_key, limits_with_defaults
from shared.names import Names
from shared.settings import CommonSettings

T = TypeVar("T")


async def _with_repository(action: Callable[[KeyRepository, CommonSettings], Awaitable[T]]) -> T:
    settings = CommonSettings()
    pool = await asyncpg.create_pool(settings.database_url, min_size=1, max_size=2, timeout=10)
    try:
        return await action(KeyRepository(pool), settings)
    finally:
        await pool.close()


def _create(args: argparse.Namespace) -> int:
    async def action(repository: KeyRepository, settings: CommonSettings) -> str:
        limits = limits_with_defaults(
            rpm=args.rpm, tpm=args.tpm, max_concurrent=args.max_concurrent, priority=args.priority, defaults=settings
        )
        key, record = await repository.create(name=args.name, limits=limits, tenant=args.tenant)
        print(
            f"created {record.id} ({record.name}) tenant={record.tenant} rpm={limits.rpm} tpm={limits.tpm} "
            f"max_concurrent={limits.max_concurrent} priority={limits.priority}"
        )
        print("store this key now; it is not shown again:")
        return key

    print(asyncio.run(_with_repository(action)))
    return 0


def _list(_args: argparse.Namespace) -> int:
    async def action(repository: KeyRepository, _settings: CommonSettings) -> None:
        records = await repository.list()
        print(
            f"{'id':<21} {'name':<20} {'key':<13} {'rpm':>7} {'tpm':>9} {'conc':>5} {'prio':>4}  "
            f"{'created':<20} {'last used':<20} status"
        )
        for r in records:
            last = r.last_used_at.strftime("%Y-%m-%d %H:%M:%S") if r.last_used_at else "never"
            print(
                f"{r.id:<21} {r.name[:20]:<20} {r.display:<13} {r.limits.rpm or '-':>7} "
                f"{r.limits.tpm or '-':>9} {r.limits.max_concurrent or '-':>5} {r.limits.priority:>4}  "
                f"{r.created_at.strftime('%Y-%m-%d %H:%M:%S'):<20} {last:<20} "
                f"{'revoked' if r.revoked_at else 'active'}"
            )

    asyncio.run(_with_repository(action))
    return 0


def _revoke(args: argparse.Namespace) -> int:
    async def action(repository: KeyRepository, settings: CommonSettings) -> bool:
        key_hash = await repository.revoke(args.id)
        if key_hash is None:
            return False
        client = create_redis(settings.redis_url, timeout_s=settings.connect_timeout_s)
        try:
            await evict_key(client, Names(settings.namespace), key_hash)
        finally:
            await client.aclose()
        return True

    if not asyncio.run(_with_repository(action)):
        print(f"axon: no active key with id {args.id}")
        return 1
    print(f"revoked {args.id}")
    return 0


def add_keys_command(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    keys = commands.add_parser("keys", help="manage API keys").add_subparsers(dest="keys_command", required=True)
    create = keys.add_parser("create", help="create a key and print it once, alone on the last line")
    create.add_argument("--name", required=True, help="what the key is for")
    create.add_argument("--tenant", help="tenant owning sessions and usage (default: the key's own id)")
    create.add_argument("--rpm", type=int, help="requests per minute (default AXON_DEFAULT_RPM)")
    create.add_argument("--tpm", type=int, help="tokens per minute (default AXON_DEFAULT_TPM)")
    create.add_argument("--max-concurrent", type=int, help="requests in flight (default AXON_DEFAULT_MAX_CONCURRENT)")
    create.add_argument(
        "--priority",
        type=int,
        choices=range(10),
        default=0,
        metavar="0-9",
        help="job priority on the queue; higher is served first",
    )
    create.set_defaults(func=_create)
    keys.add_parser("list", help="list keys (display form only)").set_defaults(func=_list)
    revoke = keys.add_parser("revoke", help="revoke a key; gateways refuse it within a second")
    revoke.add_argument("id", help="the key's id, e.g. key_0123456789abcdef")
    revoke.set_defaults(func=_revoke)
