"""Create the database if missing and apply versioned SQL migrations (`axon migrate`).

Migrations are files `NNNN_name.sql` in this package's `sql/` directory; each runs once, in
its own transaction, recorded in `schema_migrations`. An advisory lock lets several
migrators start at once (e.g. a Helm hook and a developer) without racing.

The SQL files are package data (pyproject.toml, `[tool.setuptools.package-data]`), read through
`importlib.resources`, so `axon migrate` finds them from a wheel or `pip install .` as well as
from an editable install or a source tree on PYTHONPATH.
"""

import re
from importlib.resources import files
from importlib.resources.abc import Traversable
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from shared.logging import get_logger

DEFAULT_MIGRATIONS_DIR: Traversable = files(__name__) / "sql"
_MIGRATION_FILE = re.compile(r"([0-9]{4}_.+)\.sql")
_LOCK_KEY = 0x6178_6F6E  # "axon"

log = get_logger(__name__)


def split_database_url(url: str) -> tuple[str, str]:
    """Return (URL of the maintenance database `postgres`, name of the target database)."""
    parts = urlsplit(url)
    name = parts.path.lstrip("/") or "postgres"
    return urlunsplit(parts._replace(path="/postgres")), name


async def ensure_database(url: str, *, timeout_s: float = 10.0) -> bool:
    """Create the database named in `url` if it does not exist. Returns True if it was created."""
    admin_url, name = split_database_url(url)
    conn = await asyncpg.connect(admin_url, timeout=timeout_s)
    try:
        exists = await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name)
        if exists:
            return False
        quoted = '"' + name.replace('"', '""') + '"'
        try:
            await conn.execute(f"CREATE DATABASE {quoted}")
        except (asyncpg.DuplicateDatabaseError, asyncpg.UniqueViolationError):
            # Another migrator created it between our check and our CREATE.
            return False
        log.info("database_created", database=name)
        return True
    finally:
        await conn.close()


async def drop_database(url: str, *, timeout_s: float = 10.0) -> None:
    """Drop the database named in `url` if it exists, closing its connections (tests and
    benchmarks remove the databases they made with this)."""
    admin_url, name = split_database_url(url)
    conn = await asyncpg.connect(admin_url, timeout=timeout_s)
    try:
        quoted = '"' + name.replace('"', '""') + '"'
        await conn.execute(f"DROP DATABASE IF EXISTS {quoted} WITH (FORCE)")
    finally:
        await conn.close()


def pending_files(migrations_dir: Traversable = DEFAULT_MIGRATIONS_DIR) -> list[tuple[str, Traversable]]:
    """List (version, file) for every migration file `NNNN_name.sql` in `migrations_dir`, in order.

    `migrations_dir` is a `pathlib.Path` or an `importlib.resources` Traversable; a missing
    directory lists nothing.
    """
    if not migrations_dir.is_dir():
        return []
    found: list[tuple[str, Traversable]] = []
    for entry in migrations_dir.iterdir():
        match = _MIGRATION_FILE.fullmatch(entry.name)
        if match and entry.is_file():
            found.append((match.group(1), entry))
    return sorted(found, key=lambda item: item[0])


async def migrate(
    url: str,
    *,
    migrations_dir: Traversable = DEFAULT_MIGRATIONS_DIR,
    timeout_s: float = 10.0,
) -> list[str]:
    """Create the database if needed and apply every migration not yet applied.

    Returns:
        The versions applied by this call, in order.
    """
    migrations = pending_files(migrations_dir)
    if not migrations:
        # A package built without its data files would otherwise "succeed" with an empty schema.
        raise RuntimeError(f"no migration files NNNN_*.sql in {migrations_dir}")
    await ensure_database(url, timeout_s=timeout_s)
    conn = await asyncpg.connect(url, timeout=timeout_s)
    applied: list[str] = []
    try:
        await conn.execute("SELECT pg_advisory_lock($1)", _LOCK_KEY)
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations ("
            " version text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = {row["version"] for row in await conn.fetch("SELECT version FROM schema_migrations")}
        for version, path in migrations:
            if version in done:
                continue
            async with conn.transaction():
                await conn.execute(path.read_text(encoding="utf-8"))
                await conn.execute("INSERT INTO schema_migrations (version) VALUES ($1)", version)
            log.info("migration_applied", version=version)
            applied.append(version)
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", _LOCK_KEY)
        await conn.close()
    return applied
