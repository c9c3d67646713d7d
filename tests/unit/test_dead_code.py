"""No module of the services or `shared/` defines a private function (`_name`, at module level)
that nothing in it uses: such a copy is read, and edited, as if it ran (`_cold_start` in
`services/sessions/cold_start.py` was an uncalled copy of `cold_start_job`)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _unused_private_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    defined = {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("_")
        if not node.name.startswith("__")
    }
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    used |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    return sorted(f"{path.relative_to(ROOT)}: {name}" for name in defined - used)


def test_every_private_function_is_used_in_its_module() -> None:
    unused = [
        found
        for package in ("services", "shared")
        for path in sorted((ROOT / package).rglob("*.py"))
        for found in _unused_private_functions(path)
    ]
    assert unused == []
