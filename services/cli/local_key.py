"""The API key `axon up` gives its operator: made once, kept in a file only its owner can read, and
reused by every later `axon up` while the database still holds it as an active key."""

import dataclasses
import os
import time
from pathlib import Path

import asyncpg

from shared.clients import create_redis
from shared.keys import KEY_PREFIX, KeyLimits, KeyRepository, evict_key, hash_key
from shared.names import Names
from shared.settings import CommonSettings

_KEY_NAME = "axon-up local"
_TENANT = "local"


def local_key_path(namespace: str, environ: dict[str, str] | None = None) -> Path:
    """`$XDG_STATE_HOME/axon/<namespace>.key`, or `~/.local/state/axon/<namespace>.key` when
    XDG_STATE_HOME is unset: one key per namespace, as each namespace is one platform."""
    environ = dict(os.environ) if environ is None else environ
    state = environ.get("XDG_STATE_HOME") or str(Path(environ.get("HOME") or Path.home()) / ".local" / "state")
    return Path(state) / "axon" / f"{namespace}.key"


def _read(path: Path) -> str | None:
    try:
        key = path.read_text().strip()
    except FileNotFoundError:
        return None
    return key if key.startswith(KEY_PREFIX) else None


def admin_token_path(namespace: str, environ: dict[str, str] | None = None) -> Path:
    """Where `axon up` keeps the admin token it made for its run: beside the key, `<namespace>.admin-token`."""
    return local_key_path(namespace, environ).with_name(f"{namespace}.admin-token")


def write_secret(path: Path, key: str) -> None:
    """Write `key` to `path` with mode 0600 (its folder 0700), never readable by others even for an instant."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(descriptor, 0o600)  # a file that existed keeps its mode through O_CREAT
    with os.fdopen(descriptor, "w") as file:
        file.write(key + "\n")


@dataclasses.dataclass(frozen=True, slots=True)
class LocalKey:
    key: str
    path: Path
    # Made by this run (none was kept, the kept one is no longer valid, or `--new-key`).
    created: bool

    @classmethod
    async def obtain(cls, settings: CommonSettings, path: Path, *, replace: bool) -> "LocalKey":
        """The key kept in `path` if this database holds it as active and unexpired; otherwise (or
        with `replace`, which revokes it first) a new one, written to `path`."""
        kept = _read(path)
        pool = await asyncpg.create_pool(settings.database_url, min_size=1, max_size=1, timeout=10)
        try:
            repository = KeyRepository(pool)
            record = await repository.find_by_hash(hash_key(kept)) if kept else None
            if record is not None and not record.expired(time.time()) and not replace:
                if path.stat().st_mode & 0o077:
                    path.chmod(0o600)
                return cls(kept or "", path, created=False)
            if record is not None and replace:
                await _revoke(repository, settings, record.id)
            limits = KeyLimits(
                rpm=settings.default_rpm, tpm=settings.default_tpm, max_concurrent=settings.default_max_concurrent
            )
            key, _record = await repository.create(name=_KEY_NAME, limits=limits, tenant=_TENANT)
        finally:
            await pool.close()
        write_secret(path, key)
        return cls(key, path, created=True)


async def _revoke(repository: KeyRepository, settings: CommonSettings, key_id: str) -> None:
    """Revoke the key and drop it from Redis' key cache, so no gateway accepts it from now on."""
    key_hash = await repository.revoke(key_id)
    if key_hash is None:
        return
    client = create_redis(settings.redis_url, timeout_s=settings.connect_timeout_s)
    try:
        await evict_key(client, Names(settings.namespace), key_hash)
    finally:
        await client.aclose()
