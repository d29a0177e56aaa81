"""The package layout of STYLE.md sec. 1: imports go one way through the pipeline stages and no
module imports itself back through a cycle (function-level imports included)."""

from __future__ import annotations

import ast

from conftest import REPO_DIR

ROOT = REPO_DIR / "src" / "trainmem"

#: pipeline stage of each top-level module or package; a module may import only its own stage
#: or an earlier one, and the three engines never import each other
RANK = {
    "errors": 0,
    "units": 0,
    "memo": 0,
    "breakdown": 0,
    "timeline": 0,
    "schedule": 0,
    "data": 0,
    "specs": 1,
    "analytic": 2,
    "trace": 2,
    "allocator": 2,
    "estimate": 3,
    "traced_transforms": 3,
    "traced_options": 3,
    "traced_megatron": 3,
    "traced_activations": 3,
    "traced_quantized": 3,
    "traced_unsloth": 3,
    "traced_releases": 3,
    "uncertainty": 3,
    "planner": 4,
    "report": 5,
    "web": 6,
    "cli": 7,
    "__main__": 7,
}


def _graph() -> dict[str, set[str]]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(("trainmem", *parts)).removesuffix(".__init__")
        modules[name] = path
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trainmem"):
                target = node.module or ""
                subs = {f"{target}.{a.name}" for a in node.names} & modules.keys()
                graph[name] |= subs or ({target} & modules.keys())
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names} & modules.keys()
    return graph


def _stage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_module_has_a_stage() -> None:
    stages = {_stage(m) for m in _graph()} - {"__init__"}
    assert stages <= RANK.keys(), stages - RANK.keys()


def test_imports_go_one_way() -> None:
    bad = []
    for module, deps in _graph().items():
        here = _stage(module)
        if here == "__init__":
            continue
        for dep in deps:
            there = _stage(dep)
            if there == "__init__":
                continue
            sideways = RANK[there] == RANK[here] == 2 and there != here
            if RANK[there] > RANK[here] or sideways:
                bad.append(f"{module} -> {dep}")
    assert not bad, bad


def test_no_import_cycles() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append([*path[path.index(dep) :], dep] if dep in path else [node, dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles
