"""The design's borders: the engine knows no queue, the producer knows neither engine nor worker, and the engine's
modules import each other without a cycle."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _loaded_after(imports: str) -> set[str]:
    code = f"import sys, json; {imports}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return {name.split(".")[0] for name in json.loads(out.stdout)}


def _modules(package: str) -> list[str]:
    return [
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for path in sorted((ROOT / package).rglob("*.py"))
    ]


@pytest.mark.parametrize("package", ["roseinfer"])
def test_the_engine_imports_nothing_of_the_queue(package):
    loaded = _loaded_after("; ".join(f"import {m}" for m in _modules(package)) + "; from roseinfer import LLM")
    assert not loaded & {"worker", "producer", "redis", "rq", "fakeredis"}, loaded & {"worker", "producer", "redis"}
    # The engine's command line (bench, generate) builds its parser without them too.
    code = (
        "import argparse, sys; from roseinfer import cli; p = argparse.ArgumentParser(); s = p.add_subparsers();"
        "cli.add_parsers(s); print(s.choices['bench'].format_help());"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'worker', 'producer', 'redis', 'rq'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert "--max-num-seqs" in out.stdout and out.stdout.rstrip().endswith("[]"), out.stdout[-300:]


def test_the_producer_imports_neither_engine_nor_worker_nor_torch():
    loaded = _loaded_after("; ".join(f"import {m}" for m in _modules("producer")))
    assert not loaded & {"roseinfer", "worker", "torch", "transformers"}, loaded


def _imports_of(path: Path, module: str) -> set[str]:
    """Every roseinfer module ``module`` imports, at the top or inside a function."""
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return {name for name in found if name.split(".")[0] == "roseinfer"}


def test_the_engine_has_no_import_cycle():
    modules = {m: ROOT / (m.replace(".", "/") + ".py") for m in _modules("roseinfer")}
    for m in list(modules):
        if not modules[m].exists():
            modules[m] = ROOT / m.replace(".", "/") / "__init__.py"
    graph = {m: {i for i in _imports_of(path, m) if i in modules and i != m} for m, path in modules.items()}
    # The package's __init__ is every submodule's parent, not a dependency: edges into it would make every
    # lazy re-export look like a cycle.
    graph = {m: deps - {"roseinfer"} for m, deps in graph.items()}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path[path.index(dep) :], dep]))
            if dep not in state:
                visit(dep, [*path, dep])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert "roseinfer.kernels" in graph and graph["roseinfer.kernels"] <= {
        "roseinfer.config",
        "roseinfer.kernels.triton_kernels",
    }
    assert graph["roseinfer.kernels.triton_kernels"] == set()
