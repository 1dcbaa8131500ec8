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


def _modules(package: str) -> dict[str, Path]:
    """Every module of ``package`` by its dotted name, with its source file."""
    return {
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
        for path in sorted((ROOT / package).rglob("*.py"))
    }


@pytest.mark.slow  # an interpreter importing torch; test_no_module_names_a_package_across_its_border is the quick look
def test_the_engine_imports_nothing_of_the_queue():
    # Every engine module, and the engine's command line (bench, generate) building its parser: one interpreter.
    imports = "; ".join(f"import {m}" for m in _modules("roseinfer"))
    code = _RECORD_IMPORTERS + (
        f"import argparse; {imports}; from roseinfer import LLM, cli; p = argparse.ArgumentParser();"
        "s = p.add_subparsers(); cli.add_parsers(s);"
        "print(json.dumps([s.choices['bench'].format_help(), sorted(sys.modules), importers]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    bench_help, modules, importers = json.loads(out.stdout)
    loaded = {name.split(".")[0] for name in modules}
    assert not loaded & {"worker", "producer"}, loaded & {"worker", "producer"}
    # A queue package may come in only through a third party's optional import (torch 2.6's compile cache tries
    # redis), never through a module of this repository. (An import of ours after a third party's finds the module
    # loaded and is not seen here: test_no_module_names_a_package_across_its_border reads the names themselves.)
    ours = {name: file for name, file in importers.items() if Path(file).resolve().is_relative_to(ROOT)}
    assert not ours, ours
    assert "--max-num-seqs" in bench_help


# Run first in the interpreter a border test starts: ``importers`` maps each queue package imported to the file whose
# import statement brought it in.
_RECORD_IMPORTERS = """
import importlib.abc, json, sys
importers = {}
class _Record(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name in ("redis", "rq", "fakeredis") and name not in importers:
            frame = sys._getframe(1)
            while frame.f_code.co_filename.startswith("<frozen") or "importlib" in frame.f_code.co_filename:
                frame = frame.f_back
            importers[name] = frame.f_code.co_filename
        return None
sys.meta_path.insert(0, _Record())
"""


@pytest.mark.slow
def test_the_producer_imports_neither_engine_nor_worker_nor_torch():
    loaded = _loaded_after("; ".join(f"import {m}" for m in _modules("producer")))
    assert not loaded & {"roseinfer", "worker", "torch", "transformers"}, loaded


def _imports_of(path: Path, module: str) -> set[str]:
    """Every roseinfer module ``module`` imports, at the top or inside a function."""
    return {name for name in _named_imports(path, module) if name.split(".")[0] == "roseinfer"}


def _named_imports(path: Path, module: str, optional: bool = True) -> set[str]:
    """Every module ``module`` names in an import (relative ones made absolute), at the top or inside a function;
    with ``optional=False``, not those tried under ``except ImportError`` (a feature that works without them)."""
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    tried: set[int] = set()
    if not optional:
        for node in ast.walk(tree):
            if isinstance(node, ast.Try) and any(_catches_import_error(h.type) for h in node.handlers):
                tried |= {id(inner) for statement in node.body for inner in ast.walk(statement)}
    for node in ast.walk(tree):
        if id(node) in tried:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return found


def _catches_import_error(handler_type: ast.expr | None) -> bool:
    names = handler_type.elts if isinstance(handler_type, ast.Tuple) else [handler_type]
    return any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in names)


BORDERS = {
    "roseinfer": {"worker", "producer", "redis", "rq", "fakeredis"},
    "producer": {"roseinfer", "worker", "torch", "transformers"},
}


@pytest.mark.parametrize("package", sorted(BORDERS))
def test_no_module_names_a_package_across_its_border(package):
    """The source's own imports, read without running them: what they pull in on import is the slow tests' look."""
    crossing = {}
    for module, path in _modules(package).items():
        names = {name.split(".")[0] for name in _named_imports(path, module, optional=False)} & BORDERS[package]
        if names:
            crossing[module] = sorted(names)
    assert crossing == {}


def test_the_engine_has_no_import_cycle():
    modules = _modules("roseinfer")
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


# The extras' packages (pyproject.toml): a plain `pip install roseinfer` has none of them.
EXTRAS_ONLY = ("torch", "transformers", "prometheus_client", "fastapi", "uvicorn", "tokenizers", "llguidance",
               "fakeredis", "safetensors", "gguf", "accelerate", "huggingface_hub", "pyarrow", "datasets")  # fmt: skip


@pytest.mark.slow  # an interpreter per command
@pytest.mark.parametrize("command", [["status"], ["submit", "hi"], ["result", "some-id"]])
def test_the_producers_commands_run_without_the_extras(command):
    """A plain ``pip install roseinfer`` is the producer's: every command raised ModuleNotFoundError
    (prometheus_client, through the worker's module the error handling imported) before it did anything."""
    blocked = repr(EXTRAS_ONLY)
    code = (
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        f"        if name.split('.')[0] in {blocked}:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from worker.cli import main\n"
        f"sys.exit(main({[*command, '--redis-url', 'redis://127.0.0.1:1/0']!r}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert "ModuleNotFoundError" not in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert out.returncode == 2 and "cannot reach Redis" in out.stderr, out.stderr


def test_every_error_the_client_raises_is_importable_from_producer():
    """The README's ``except JobIdTaken`` met an ImportError: only some of the client's errors were exported."""
    import inspect

    import producer
    from producer import job_errors

    errors = {name for name, obj in vars(job_errors).items() if inspect.isclass(obj) and issubclass(obj, Exception)}
    errors = {name for name in errors if getattr(job_errors, name).__module__ == job_errors.__name__}
    assert errors <= set(producer.__all__)
    assert all(getattr(producer, name) is getattr(job_errors, name) for name in errors)
