"""The sweep package's modules import one way: each only the ones before it in ORDER (no cycles)."""

from __future__ import annotations

import ast
from pathlib import Path

import lmledger.sweep

ORDER = (
    "spec",
    "collect",
    "check",
    "plots",
    "report",
    "launch",
    "slurmscript",
    "slurmfit",
    "slurm",
    "slurmtask",
    "listing",
)


def sweep_imports(path: Path) -> set[str]:
    """The lmledger.sweep.* modules a file imports, at the top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lmledger.sweep."):
            names.add(node.module.removeprefix("lmledger.sweep."))
        elif isinstance(node, ast.ImportFrom) and node.module == "lmledger.sweep":
            names.update(alias.name for alias in node.names)
    return names


def test_each_sweep_module_imports_only_earlier_ones():
    package = Path(lmledger.sweep.__file__).parent
    modules = {p.stem for p in package.glob("*.py")} - {"__init__", "__main__"}
    assert modules == set(ORDER)  # a new module takes its place in ORDER
    for i, name in enumerate(ORDER):
        later = sweep_imports(package / f"{name}.py") - set(ORDER[:i])
        assert not later, f"sweep/{name}.py imports {sorted(later)}, which come after it"


def test_the_checker_sees_a_backward_import(tmp_path):
    bad = tmp_path / "spec.py"
    bad.write_text("def f():\n    from lmledger.sweep.launch import run_sweep\n")
    assert sweep_imports(bad) == {"launch"}
