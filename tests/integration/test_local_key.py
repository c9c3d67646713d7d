"""`axon up`'s local key against a real PostgreSQL and Redis: reused while valid, replaced when it is
not, revoked and replaced with `--new-key`."""

import dataclasses
from pathlib import Path

import asyncpg

from services.cli.local_key import LocalKey
from shared.keys import KeyRepository, hash_key
from shared.settings import CommonSettings
from tests.services import ServiceUrls


def _settings(database_url: str, service_urls: ServiceUrls, namespace: str) -> CommonSettings:
    return CommonSettings(database_url=database_url, redis_url=service_urls.redis, namespace=namespace)


async def _active(database_url: str, key: str) -> bool:
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=1)
    try:
        return await KeyRepository(pool).find_by_hash(hash_key(key)) is not None
    finally:
        await pool.close()


async def test_the_key_is_reused_while_valid_and_replaced_when_revoked_or_asked(
    tmp_path: Path, database_url: str, service_urls: ServiceUrls, namespace: str
) -> None:
    settings = _settings(database_url, service_urls, namespace)
    path = tmp_path / "axon" / f"{namespace}.key"

    first = await LocalKey.obtain(settings, path, replace=False)
    assert first.created and path.read_text().strip() == first.key
    again = await LocalKey.obtain(settings, path, replace=False)
    assert dataclasses.replace(again, created=True) == first  # the same key, not a new one

    replaced = await LocalKey.obtain(settings, path, replace=True)  # --new-key
    assert replaced.created and replaced.key != first.key
    assert not await _active(database_url, first.key)
    assert await _active(database_url, replaced.key)
    assert path.read_text().strip() == replaced.key

    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=1)
    try:
        record = await KeyRepository(pool).find_by_hash(hash_key(replaced.key))
        assert record is not None
        await KeyRepository(pool).revoke(record.id)  # `axon keys revoke` by someone else
    finally:
        await pool.close()
    after_revoke = await LocalKey.obtain(settings, path, replace=False)
    assert after_revoke.created and after_revoke.key not in {first.key, replaced.key}


async def test_a_key_file_from_another_database_is_replaced(
    tmp_path: Path, database_url: str, service_urls: ServiceUrls, namespace: str
) -> None:
    path = tmp_path / "axon" / "stale.key"
    path.parent.mkdir(parents=True)
    path.write_text("axk_not-a-key-this-database-knows\n")
    fresh = await LocalKey.obtain(_settings(database_url, service_urls, namespace), path, replace=False)
    assert fresh.created and fresh.key != "axk_not-a-key-this-database-knows"
    assert await _active(database_url, fresh.key)
