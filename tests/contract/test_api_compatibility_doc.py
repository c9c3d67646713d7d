"""docs/api-compatibility.md's parameter-by-engine table says what each engine's `supports` says."""

import re
import typing
from pathlib import Path

import pytest

from services.worker.engines.sim import SimEngine
from services.worker.engines.transformers_engine import TransformersEngine
from services.worker.engines.vllm_engine import VllmEngine
from shared.schemas import Capability

DOC = Path(__file__).parents[2] / "docs" / "api-compatibility.md"
ENGINES = {"transformers": TransformersEngine, "vllm": VllmEngine, "sim": SimEngine}


def table_rows() -> list[dict[str, str]]:
    """Every row of the doc's parameter tables, as {column: cell}."""
    rows, header = [], None
    for line in DOC.read_text().splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if header is None:
            header = cells
        elif not set(line) <= set("|-: "):
            rows.append(dict(zip(header, cells, strict=True)))
    return rows


ROWS = table_rows()


def test_the_tables_have_every_engine_as_a_column() -> None:
    assert ROWS and all(set(ENGINES) <= row.keys() for row in ROWS)


@pytest.mark.parametrize("row", [r for r in ROWS if r["capability"]], ids=lambda r: r["parameter"])
def test_each_capability_row_matches_the_engines_supports(row: dict[str, str]) -> None:
    capability = row["capability"].strip("`")
    for engine, cls in ENGINES.items():
        expected = "honoured" if capability in cls.supports else "400"
        assert row[engine] == expected, f"{row['parameter']} on {engine}: the doc says {row[engine]}"


def test_every_capability_has_a_row() -> None:
    documented = {row["capability"].strip("`") for row in ROWS}
    assert set(typing.get_args(Capability)) <= documented


def test_rows_without_a_capability_are_honoured_by_every_engine() -> None:
    for row in ROWS:
        if not row["capability"]:
            assert {row[e] for e in ENGINES} == {"honoured"}, row["parameter"]


def test_the_readme_links_the_document() -> None:
    readme = (DOC.parents[1] / "README.md").read_text()
    assert re.search(r"\]\(docs/api-compatibility\.md\)", readme)
