"""The layering of src/lazytrain, read from the source (every import statement: top-level, TYPE_CHECKING and
function-local alike): no import cycle; costmodel/ at the bottom and plan/ above it import nothing of runtime/
or train/; no JobConfig in plan/ (it takes plan options and plain values, job/inputs.py makes them); no function
over 120 lines; and `lazytrain plan` runs without importing torch."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
MAX_FUNCTION_LINES = 120


@cache
def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


@cache
def imports(module: str) -> frozenset[str]:
    """The lazytrain modules `module` imports anywhere in its file (`from pkg import submodule` names the
    submodule; `from pkg.mod import name` the module)."""
    path, known = modules()[module], modules()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package up
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names)
    return frozenset(name for name in found if name in known)


def cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), or a module importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in imports(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1 or v in imports(v):
                found.append(sorted(component))

    for module in modules():
        if module not in index:
            visit(module)
    return found


def test_the_import_reader_sees_every_kind_of_import() -> None:
    """The graph below is only as good as its reader: a TYPE_CHECKING import (train/build.py's CostModel) and a
    function-local one (job/inputs.py reads runtime.weights inside model_spec) are in it."""
    assert "lazytrain.costmodel.cost" in imports("lazytrain.train.build")
    assert "lazytrain.runtime.weights" in imports("lazytrain.job.inputs")


def test_no_import_cycle() -> None:
    assert cycles() == []


def test_costmodel_and_plan_import_nothing_above_them() -> None:
    """costmodel/ imports only costmodel/ (and errors, units); plan/ adds plan/ and its options' type (config)."""
    above = ("lazytrain.runtime", "lazytrain.train", "lazytrain.job", "lazytrain.data", "lazytrain.distributed",
             "lazytrain.optim")
    for module in modules():
        if module.startswith("lazytrain.costmodel"):
            bad = sorted(m for m in imports(module) if m.startswith((*above, "lazytrain.plan", "lazytrain.config")))
            assert bad == [], f"{module} (the bottom layer) imports {bad}"
        if module.startswith("lazytrain.plan"):
            bad = sorted(m for m in imports(module) if m.startswith(above))
            assert bad == [], f"{module} imports {bad}"


def test_no_job_config_in_plan() -> None:
    for module, path in modules().items():
        if module.startswith("lazytrain.plan"):
            assert "JobConfig" not in path.read_text(), f"{path} names JobConfig: give plan/ options or values"


def test_no_function_over_120_lines() -> None:
    long = []
    for module, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                    long.append((module, node.name, node.end_lineno - node.lineno + 1))
    assert long == [], f"over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_plan_command_does_not_import_torch() -> None:
    """`lazytrain plan` of a preset model: torch and transformers are never imported (a second of start-up)."""
    code = ("import sys; from lazytrain.cli import main; rc = main(['plan', '--model', 'qwen2.5-7b', '--hardware', "
            "'h800', '--batch-size', '4', '--seq-len', '512']); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules)); sys.exit(rc)")
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout[-2000:]
