"""The arrows docs/architecture.md draws, held: each module imports only from its own layer or below.

Layers, bottom up (a module may import any module of a lower layer, and of its own):
    0  model, errors, units-like leaves (atomic, lifetime): plain Python and PyTorch
    1  ledger/: accounting; torch only, no Lightning (what a device can do: gpus, peak_flops, cpu, matmul)
    2  the data and the Lightning side: corpus, data, lit, precision, checkpointing, seeding, preemption, rundir,
       lightning_private, runlock
    3  callbacks/: Lightning adapters over ledger/
    4  fitting/: the fit CLI and its checks, run_config; accounting, planning: what account and plan compute
    5  sweep/
    6  commands/, cli: the commands, thin; nothing below imports them
Imports are read from the source (every `import` and `from ... import`, at any depth in a file), so a
lazy import inside a function counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "lmledger"

LAYERS = {
    "model": 0, "errors": 0, "atomic": 0, "lifetime": 0, "hf": 0,
    "ledger": 1,
    "corpus": 2, "lit": 2, "data": 2, "precision": 2, "checkpointing": 2, "modelparallel_checkpoints": 2,
    "lightning_private": 2, "runlock": 2,
    "bench": 2, "seeding": 2, "preemption": 2, "rundir": 2, "strategies": 2,
    "callbacks": 3,
    "fitting": 4, "run_config": 4, "accounting": 4, "planning": 4,
    "sweep": 5,
    "commands": 6, "cli": 6, "__init__": 6,
}  # fmt: skip


def _unit(module: str) -> str:
    """lmledger.ledger.dryrun.engine -> ledger; lmledger.cli -> cli; an entry point (`python -m`) -> cli."""
    parts = module.split(".")
    if parts[-1] == "__main__":
        return "cli"
    return parts[1] if len(parts) > 1 else "__init__"


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(SRC.rglob("*.py")):
        relative = path.relative_to(SRC.parent).with_suffix("")
        name = ".".join(relative.parts).removesuffix(".__init__")
        out.append((name, path))
    return out


def _imports(name: str, path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                found.append(".".join([*base, node.module] if node.module else base))
            elif node.module:
                found.append(node.module)
                found += [f"{node.module}.{alias.name}" for alias in node.names]  # `from pkg import module`
    return [m for m in found if m == "lmledger" or m.startswith("lmledger.")]


MODULES = _modules()


def test_every_unit_has_a_layer():
    assert sorted({_unit(name) for name, _ in MODULES} - set(LAYERS)) == []


@pytest.mark.parametrize("name, path", MODULES, ids=[name for name, _ in MODULES])
def test_no_arrow_points_up(name, path):
    own = LAYERS[_unit(name)]
    up = sorted(
        {m for m in _imports(name, path) if LAYERS.get(_unit(m), -1) > own and _unit(m) in LAYERS and m != "lmledger"}
    )
    assert up == [], f"{name} (layer {own}) imports from a higher layer"


@pytest.mark.parametrize("name, path", [(n, p) for n, p in MODULES if _unit(n) == "ledger"])
def test_the_ledger_imports_no_lightning(name, path):
    tree = ast.parse(path.read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    assert not [m for m in names if m.split(".")[0] in ("lightning", "pytorch_lightning")]


def test_the_callbacks_package_has_no_cycle_with_its_own_modules():
    """callbacks/__init__ imports its modules; none of them imports names back from the package itself."""
    for name, path in MODULES:
        if _unit(name) == "callbacks" and path.name != "__init__.py":
            tree = ast.parse(path.read_text())
            back = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "lmledger.callbacks"]
            from_package = [a.name for n in back for a in n.names]
            assert all((SRC / "callbacks" / f"{a}.py").exists() for a in from_package), (name, from_package)


def _module_graph() -> dict[str, set[str]]:
    """Each module's imports of other modules of the tree (`from pkg import mod` points at mod, not pkg);
    a module importing its own package's __init__ is left out, as Python runs that first anyway."""
    names = {name for name, _ in MODULES}
    graph = {}
    for name, path in MODULES:
        found = {m for m in _imports(name, path) if m in names}
        graph[name] = {m for m in found if m != name and not name.startswith(m + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, groups = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on.discard(group[-1])
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_the_cycle_finder_finds_a_lazy_cycle():
    """The check below would pass on a finder that finds nothing: it must see a two-module circle."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_no_module_is_part_of_an_import_cycle():
    """No circle of imports among the tree's modules, lazy (in-function) imports included: a module reached
    from both ends of a circle is half-initialised for one of them, and a lazy import only hides that."""
    assert _cycles(_module_graph()) == []
