"""`axon keys create|list|update|revoke`: manage API keys directly in PostgreSQL."""

import argparse
import asyncio
import datetime as dt
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import asyncpg
from pydantic import ValidationError

from services.gateway.api.admin import KeyCreate, KeyUpdate
from shared.clients import create_redis
from shared.errors import InvalidRequest, invalid_request
from shared.keys import KeyRecord, KeyRepository, evict_key, limits_with_defaults
from shared.names import Names
from shared.settings import CommonSettings

T = TypeVar("T")

_DURATION = re.compile(r"^([0-9]+)([smhdw])$")
_UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 7 * 86_400}
# What `--rpm`, `--tpm`, `--max-concurrent` and `--budget` take to remove a limit on update.
_NO_LIMIT = "none"


def parse_duration(text: str) -> dt.timedelta:
    """`30d`, `12h`, `90m`, `45s` or `2w`.

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    match = _DURATION.match(text.strip())
    if not match or int(match.group(1)) == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration such as 30d, 12h, 90m, 45s or 2w")
    return dt.timedelta(seconds=int(match.group(1)) * _UNITS_S[match.group(2)])


def parse_time(text: str) -> dt.datetime:
    """An ISO 8601 time with its offset (`2026-12-31T00:00:00Z`).

    Raises:
        argparse.ArgumentTypeError: not one, or without an offset.
    """
    try:
        value = dt.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an ISO 8601 time") from None
    if value.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{text!r} has no UTC offset (add Z or +00:00)")
    return value


def parse_models(text: str) -> list[str]:
    """A comma-separated list of model names."""
    models = [m.strip() for m in text.split(",") if m.strip()]
    if not models:
        raise argparse.ArgumentTypeError("name at least one model")
    return models


def parse_limit(text: str) -> int | None:
    """A whole number ≥ 1, or `none` (no limit)."""
    if text.lower() == _NO_LIMIT:
        return None
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1 or '{_NO_LIMIT}'")
    return int(text)


async def _with_repository(action: Callable[[KeyRepository, CommonSettings], Awaitable[T]]) -> T:
    settings = CommonSettings()
    pool = await asyncpg.create_pool(settings.database_url, min_size=1, max_size=2, timeout=10)
    try:
        return await action(KeyRepository(pool), settings)
    finally:
        await pool.close()


def _validated(model: type[KeyCreate] | type[KeyUpdate], values: dict[str, Any]) -> Any:
    """The values checked as the admin API checks them.

    Raises:
        InvalidRequest: naming the first bad one.
    """
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise invalid_request(exc.errors()) from None


def _expiry(args: argparse.Namespace) -> dt.datetime | None:
    expires_in: dt.timedelta | None = args.expires_in
    expires_at: dt.datetime | None = args.expires_at
    return dt.datetime.now(dt.UTC) + expires_in if expires_in is not None else expires_at


def _summary(record: KeyRecord) -> str:
    limits = record.limits
    budget = f"{limits.token_budget}/{limits.budget_period}" if limits.token_budget else "none"
    expires = _when(record.expires_at, "never")
    models = ",".join(record.allowed_models) if record.allowed_models is not None else "all"
    return (
        f"{record.id} ({record.name}) tenant={record.tenant} rpm={limits.rpm} tpm={limits.tpm} "
        f"max_concurrent={limits.max_concurrent} priority={limits.priority} budget={budget} "
        f"expires={expires} models={models}"
    )


def _when(moment: dt.datetime | None, otherwise: str) -> str:
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S") if moment else otherwise


def _create(args: argparse.Namespace) -> int:
    try:
        body: KeyCreate = _validated(
            KeyCreate,
            {
                "name": args.name,
                "tenant": args.tenant,
                "rpm": args.rpm,
                "tpm": args.tpm,
                "max_concurrent": args.max_concurrent,
                "priority": args.priority,
                "expires_at": _expiry(args),
                "allowed_models": args.allow_models,
                "token_budget": args.budget,
                "budget_period": args.budget_period,
            },
        )
    except InvalidRequest as exc:
        print(f"axon: {exc.message}")
        return 2

    async def action(repository: KeyRepository, settings: CommonSettings) -> str:
        limits = limits_with_defaults(
            rpm=body.rpm,
            tpm=body.tpm,
            max_concurrent=body.max_concurrent,
            priority=body.priority,
            defaults=settings,
            token_budget=body.token_budget,
            budget_period=body.budget_period,
        )
        key, record = await repository.create(
            name=body.name,
            limits=limits,
            tenant=body.tenant,
            expires_at=body.expires_at,
            allowed_models=body.allowed_models,
        )
        print(f"created {_summary(record)}")
        print("store this key now; it is not shown again:")
        return key

    print(asyncio.run(_with_repository(action)))
    return 0


def _list(_args: argparse.Namespace) -> int:
    async def action(repository: KeyRepository, _settings: CommonSettings) -> None:
        records = await repository.list()
        print(
            f"{'id':<21} {'name':<20} {'key':<13} {'rpm':>7} {'tpm':>9} {'conc':>5} {'prio':>4} "
            f"{'budget':>16}  {'expires':<19}  {'created':<19}  {'last used':<19}  {'status':<7}  models"
        )
        now = time.time()
        for r in records:
            limits = r.limits
            budget = f"{limits.token_budget}/{limits.budget_period}" if limits.token_budget else "-"
            status = "revoked" if r.revoked_at else "expired" if r.expired(now) else "active"
            models = ",".join(r.allowed_models) if r.allowed_models is not None else "all"
            print(
                f"{r.id:<21} {r.name[:20]:<20} {r.display:<13} {limits.rpm or '-':>7} "
                f"{limits.tpm or '-':>9} {limits.max_concurrent or '-':>5} {limits.priority:>4} "
                f"{budget:>16}  {_when(r.expires_at, 'never'):<19}  {_when(r.created_at, ''):<19}  "
                f"{_when(r.last_used_at, 'never'):<19}  {status:<7}  {models}"
            )

    asyncio.run(_with_repository(action))
    return 0


async def _evict(settings: CommonSettings, key_hash: bytes) -> None:
    client = create_redis(settings.redis_url, timeout_s=settings.connect_timeout_s)
    try:
        await evict_key(client, Names(settings.namespace), key_hash)
    finally:
        await client.aclose()


def _update_values(args: argparse.Namespace) -> dict[str, Any]:
    """The fields the command line sets, as `PATCH /admin/keys/{id}` takes them."""
    values: dict[str, Any] = {}
    for field in ("name", "rpm", "tpm", "max_concurrent", "priority", "budget_period"):
        if getattr(args, field) is not ...:
            values[field] = getattr(args, field)
    if args.budget is not ...:
        values["token_budget"] = args.budget
    if args.expires_in is not None or args.expires_at is not None:
        values["expires_at"] = _expiry(args)
    if args.no_expiry:
        values["expires_at"] = None
    if args.allow_models is not None:
        values["allowed_models"] = args.allow_models
    if args.all_models:
        values["allowed_models"] = None
    return values


def _update(args: argparse.Namespace) -> int:
    try:
        changes = _validated(KeyUpdate, _update_values(args)).changes()
    except InvalidRequest as exc:
        print(f"axon: {exc.message}")
        return 2

    async def action(repository: KeyRepository, settings: CommonSettings) -> KeyRecord | None:
        updated = await repository.update(args.id, changes)
        if updated is None:
            return None
        record, key_hash = updated
        await _evict(settings, key_hash)
        return record

    record = asyncio.run(_with_repository(action))
    if record is None:
        print(f"axon: no active key with id {args.id}")
        return 1
    print(f"updated {_summary(record)}")
    return 0


def _revoke(args: argparse.Namespace) -> int:
    async def action(repository: KeyRepository, settings: CommonSettings) -> bool:
        key_hash = await repository.revoke(args.id)
        if key_hash is None:
            return False
        await _evict(settings, key_hash)
        return True

    if not asyncio.run(_with_repository(action)):
        print(f"axon: no active key with id {args.id}")
        return 1
    print(f"revoked {args.id}")
    return 0


def _add_governance_options(
    parser: argparse.ArgumentParser, *, unset: Any
) -> tuple[argparse._MutuallyExclusiveGroup, argparse._MutuallyExclusiveGroup]:
    """Expiry, allowed models and budget options (create and update); returns the expiry and the
    models groups (one option of each at most)."""
    expiry = parser.add_mutually_exclusive_group()
    expiry.add_argument("--expires-in", type=parse_duration, help="expire after this long: 30d, 12h, 90m, 45s, 2w")
    expiry.add_argument("--expires-at", type=parse_time, help="expire at this ISO 8601 time, e.g. 2026-12-31T00:00Z")
    models = parser.add_mutually_exclusive_group()
    models.add_argument(
        "--allow-models",
        type=parse_models,
        metavar="MODEL[,MODEL...]",
        help="only these models (an alias allows its target and the target its aliases)",
    )
    parser.add_argument(
        "--budget",
        type=parse_limit if unset is ... else int,
        default=unset,
        metavar="TOKENS" if unset is None else "TOKENS|none",
        help="tokens (prompt + completion) per budget period" + ("" if unset is None else "; none: no budget"),
    )
    parser.add_argument(
        "--budget-period",
        choices=("day", "month"),
        default=unset if unset is ... else "month",
        help="UTC calendar day or month (default month)",
    )
    return expiry, models


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
    _add_governance_options(create, unset=None)
    create.set_defaults(func=_create)
    keys.add_parser("list", help="list keys (display form only)").set_defaults(func=_list)

    update = keys.add_parser(
        "update", help="change a key's limits, budget, expiry or models; gateways apply it within a second"
    )
    update.add_argument("id", help="the key's id, e.g. key_0123456789abcdef")
    update.add_argument("--name", default=..., help="a new name")
    for option, what in (("--rpm", "requests per minute"), ("--tpm", "tokens per minute")):
        update.add_argument(option, type=parse_limit, default=..., metavar="N|none", help=f"{what}; none: unlimited")
    update.add_argument(
        "--max-concurrent", type=parse_limit, default=..., metavar="N|none", help="requests in flight; none: unlimited"
    )
    update.add_argument("--priority", type=int, choices=range(10), default=..., metavar="0-9", help="job priority")
    expiry, models = _add_governance_options(update, unset=...)
    expiry.add_argument("--no-expiry", action="store_true", help="never expire")
    models.add_argument("--all-models", action="store_true", help="allow every model (drop the allowlist)")
    update.set_defaults(func=_update)

    revoke = keys.add_parser("revoke", help="revoke a key; gateways refuse it within a second")
    revoke.add_argument("id", help="the key's id, e.g. key_0123456789abcdef")
    revoke.set_defaults(func=_revoke)
