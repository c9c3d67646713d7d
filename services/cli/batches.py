"""`axon batches list|show|cancel`: the Batch API's batches, read and cancelled in PostgreSQL.

A cancel here is the API's: the batch goes `cancelling`, and its owner (the session manager
holding its lease) stops its lines, writes its files and ends it `cancelled` within a second.
"""

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import asyncpg
import orjson

from services.sessions.batches.protocol import batch_object
from services.sessions.batches.store import BatchStore
from shared.settings import CommonSettings

T = TypeVar("T")


async def _with_store(action: Callable[[BatchStore], Awaitable[T]]) -> T:
    settings = CommonSettings()
    pool = await asyncpg.create_pool(settings.database_url, min_size=1, max_size=1)
    try:
        return await action(BatchStore(pool, namespace=settings.namespace))
    finally:
        await pool.close()


def _list(args: argparse.Namespace) -> int:
    records = asyncio.run(_with_store(lambda store: store.recent(tenant=args.tenant, limit=args.limit)))
    for r in records:
        counts = f"{r.completed}+{r.failed}/{r.total}"
        print(f"{r.id}  {r.tenant:<20} {r.status:<11} {counts:<17} {r.endpoint:<21} {r.created_at:%Y-%m-%d %H:%M:%S}")
    return 0


def _show(args: argparse.Namespace) -> int:
    record = asyncio.run(_with_store(lambda store: store.load(args.batch_id)))
    if record is None:
        print(f"axon: no batch {args.batch_id}")
        return 1
    print(orjson.dumps({"tenant": record.tenant, **batch_object(record)}, option=orjson.OPT_INDENT_2).decode())
    return 0


def _cancel(args: argparse.Namespace) -> int:
    async def action(store: BatchStore) -> str | None:
        moved = await store.transition(args.batch_id, "cancelling", from_=("validating", "in_progress"))
        if moved is not None:
            return moved.status
        current = await store.load(args.batch_id)
        return current.status if current is not None else None

    status = asyncio.run(_with_store(action))
    if status is None:
        print(f"axon: no batch {args.batch_id}")
        return 1
    if status not in {"cancelling", "cancelled"}:
        print(f"axon: batch {args.batch_id} is {status}: it cannot be cancelled")
        return 1
    print(f"{args.batch_id} {status}")
    return 0


def add_batches_command(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    batches = commands.add_parser("batches", help="Batch API batches").add_subparsers(
        dest="batches_command", required=True
    )
    listing = batches.add_parser("list", help="the newest batches: status, answered/total lines")
    listing.add_argument("--tenant", help="only this tenant's")
    listing.add_argument("--limit", type=int, default=20, help="how many (default 20)")
    listing.set_defaults(func=_list)
    show = batches.add_parser("show", help="one batch, as the API answers it (with its tenant)")
    show.add_argument("batch_id")
    show.set_defaults(func=_show)
    cancel = batches.add_parser("cancel", help="cancel a batch (its owner stops its lines and ends it)")
    cancel.add_argument("batch_id")
    cancel.set_defaults(func=_cancel)
