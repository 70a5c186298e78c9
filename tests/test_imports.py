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


ARCHITECTURE = SRC.parent / "docs" / "architecture.md"
# The one up-arrow docs/architecture.md names: plan/planner.py names config's PlanConfig under TYPE_CHECKING.
UP_ARROWS = {("lazytrain.plan.planner", "lazytrain.config")}


@cache
def layers() -> dict[str, int]:
    """Module prefix -> layer number, read from the layer table of docs/architecture.md (`| 2. ... | `costmodel/`,
    `optim/` | ... |`)."""
    out = {}
    for line in ARCHITECTURE.read_text().splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) > 3 and parts[1][:1].isdigit() and ". " in parts[1]:
            number = int(parts[1].split(".")[0])
            for name in parts[2].replace("`", "").split(","):
                out["lazytrain." + name.strip().removesuffix("/").removesuffix(".py").replace("/", ".")] = number
    return out


def layer_of(module: str) -> int:
    """The layer of a module: its package's row of the table; `lazytrain` itself and `__main__` are the top."""
    for prefix, number in sorted(layers().items(), key=lambda kv: -len(kv[0])):
        if module == prefix or module.startswith(prefix + "."):
            return number
    assert module in ("lazytrain", "lazytrain.__main__"), f"{module} is in no layer of docs/architecture.md"
    return max(layers().values())


def test_the_layer_table_names_eight_layers() -> None:
    assert sorted(set(layers().values())) == list(range(1, 9)), layers()


def test_every_import_goes_down_the_eight_layers() -> None:
    """A module imports only its own layer and the ones below it (docs/architecture.md's table, the whole graph
    read from the source: top-level, TYPE_CHECKING and function-local imports alike), but the one named up-arrow."""
    up = []
    for module in modules():
        for imported in imports(module):
            if layer_of(imported) > layer_of(module) and not any(
                    module.startswith(a) and imported.startswith(b) for a, b in UP_ARROWS):
                up.append(f"{module} (layer {layer_of(module)}) imports {imported} (layer {layer_of(imported)})")
    assert up == [], "\n".join(up)


def folder_map() -> set[str]:
    """The paths the folder map of docs/architecture.md lists under src/lazytrain/ (`config/`, `config/schema.py`,
    `plan/milp/`, ...)."""
    text = ARCHITECTURE.read_text().split("## Folder map", 1)[1].split("```")[1]
    listed, package = set(), ""
    for line in text.splitlines()[2:]:
        indent = len(line) - len(line.lstrip())
        names = line.strip().split("  ")[0]
        if not names or indent not in (2, 4) or names.startswith("("):
            continue
        if indent == 2:
            package = ""
        for name in (n.strip() for n in names.split(",")):
            listed.add(package + name)
        if indent == 2 and names.endswith("/"):
            package = names
    return listed


def test_the_folder_map_matches_the_tree() -> None:
    """Every module, config file and folder of src/lazytrain/ and of its packages is in docs/architecture.md's
    folder map, and everything the map lists exists."""
    root = SRC / "lazytrain"

    def entries(folder: Path, prefix: str = "") -> set[str]:
        out = set()
        for path in folder.iterdir():
            if path.is_dir() and path.name != "__pycache__":
                out.add(f"{prefix}{path.name}/")
            elif path.suffix in (".py", ".yaml") and not (prefix and path.name == "__init__.py"):
                out.add(prefix + path.name)
        return out

    tree = entries(root)
    for package in [p for p in tree if p.endswith("/")]:
        tree |= entries(root / package, package)
    listed = folder_map()
    assert sorted(tree - listed) == [], "in the tree, not in the folder map"
    assert sorted(listed - tree) == [], "in the folder map, not in the tree"


def test_package_docstrings_list_their_modules_or_none() -> None:
    """A package docstring that names one of its modules (`plan.py`, `` `sft` ``) names every one: a partial list
    reads as the whole package."""
    import re

    partial = []
    for package in sorted(p for p in (SRC / "lazytrain").iterdir() if (p / "__init__.py").exists()):
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
        names = sorted({p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
                       | {p.name for p in package.iterdir() if (p / "__init__.py").exists()})
        named = [n for n in names if re.search(rf"(\b{n}\.py\b|`{n}`|\b{n}/)", doc)]
        if named and named != names:
            partial.append(f"{package.name}: names {named}, not {sorted(set(names) - set(named))}")
    assert partial == [], partial
