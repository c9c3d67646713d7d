"""`axon`: the operator's command line."""

import argparse
import asyncio
import sys

from services.cli.batches import add_batches_command
from services.cli.bench import add_bench_command
from services.cli.checks import check_dependencies, how_to_start, rabbitmq_binding_note
from services.cli.keys import add_keys_command
from services.cli.models import add_models_command
from services.cli.tenants import add_tenants_command
from services.cli.up import run_up
from shared.logging import configure_logging
from shared.migrations import migrate
from shared.settings import CommonSettings


def _migrate(_args: argparse.Namespace) -> int:
    settings = CommonSettings()
    try:
        applied = asyncio.run(migrate(settings.database_url))
    except (OSError, TimeoutError) as exc:
        start = how_to_start("PostgreSQL", settings.database_url)
        print(f"axon: PostgreSQL is not reachable ({exc}); start it with: {start}")
        return 1
    print(f"axon: {len(applied)} migration(s) applied" + (f": {', '.join(applied)}" if applied else ""))
    return 0


def _check(_args: argparse.Namespace) -> int:
    settings = CommonSettings()
    results = asyncio.run(check_dependencies(settings))
    for result in results:
        print(f"{result.name:<10} {result.url:<50} {'ok' if result.ok else result.error}")
    note = rabbitmq_binding_note(settings.amqp_url)
    if note is not None:
        print(f"note: {note}")
    return 0 if all(r.ok for r in results) else 1


def _up(args: argparse.Namespace) -> int:
    return run_up(ready_timeout_s=args.ready_timeout, new_key=args.new_key)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="axon", description="Operate an Axon platform.")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="check dependencies, migrate, and run all services locally")
    up.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for readiness")
    up.add_argument(
        "--new-key",
        action="store_true",
        help="revoke the local API key kept from earlier runs and make a new one",
    )
    up.set_defaults(func=_up)
    commands.add_parser("migrate", help="create the database if missing and apply migrations").set_defaults(
        func=_migrate
    )
    commands.add_parser("check", help="check that Redis, RabbitMQ and PostgreSQL are reachable").set_defaults(
        func=_check
    )
    add_keys_command(commands)
    add_tenants_command(commands)
    add_models_command(commands)
    add_batches_command(commands)
    add_bench_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(service="cli", level="WARNING", log_format="console")
    status: int = args.func(args)  # every command's `func` returns its exit status
    return status


if __name__ == "__main__":
    sys.exit(main())
