"""shared.migrations without a database: which files count as migrations, and in what order."""

from pathlib import Path

import pytest

from shared.migrations import DEFAULT_MIGRATIONS_DIR, migrate, pending_files


def test_the_packaged_migrations_start_at_0001() -> None:
    versions = [version for version, _ in pending_files()]
    assert versions[0] == "0001_initial"
    assert versions == sorted(versions)
    assert pending_files() == pending_files(DEFAULT_MIGRATIONS_DIR)


def test_only_numbered_sql_files_count_in_version_order(tmp_path: Path) -> None:
    for name in ("0010_late.sql", "0002_b.sql", "0001_a.sql", "README.md", "01_short.sql", "0003_c.sql.bak"):
        (tmp_path / name).write_text("SELECT 1;")
    (tmp_path / "0004_dir.sql").mkdir()
    assert [version for version, _ in pending_files(tmp_path)] == ["0001_a", "0002_b", "0010_late"]
    assert pending_files(tmp_path / "missing") == []


async def test_no_migration_files_is_an_error_before_any_connection(tmp_path: Path) -> None:
    # Port 9 (discard) would fail to connect: the error must come first, naming the directory.
    with pytest.raises(RuntimeError, match="no migration files"):
        await migrate("postgresql://postgres@127.0.0.1:9/none", migrations_dir=tmp_path)
