"""The schema's words: each key's docstring (the --help text) and the key reference of docs/config.md."""

from __future__ import annotations

import ast
import inspect
import json
from dataclasses import MISSING, fields
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from lazytrain.config import foreign
from lazytrain.config.load import ALIASES, DEFAULT_JOB_FILE
from lazytrain.config.schema import SECTION_OF, SECTIONS, JobConfig


@cache
def field_docs() -> dict[str, str]:
    """{key: its docstring, on one line}, read from schema.py's source (the text people see in --help)."""
    tree = ast.parse(Path(inspect.getfile(JobConfig)).read_text())
    docs: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in {c.__name__ for c in SECTIONS.values()}:
            body = node.body
            for stmt, nxt in zip(body, body[1:], strict=False):
                if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                        and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
                    docs[stmt.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def default_of(key: str) -> Any:
    f = next(f for f in fields(SECTIONS[SECTION_OF[key]]) if f.name == key)
    return f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]


@cache
def default_job_values() -> dict[str, Any]:
    """The default job's own values (default_job.yaml), shown beside the schema's defaults."""
    return yaml.safe_load(DEFAULT_JOB_FILE.read_text())


def default_text(key: str) -> str:
    """`5e-05` or, where the default job has its own, `5e-05 (default job: 0.003)`."""
    text = repr(default_of(key))
    if key in default_job_values():
        text += f" (default job: {json.dumps(default_job_values()[key])})"
    return text


def markdown_table() -> str:
    """The key reference of docs/config.md, one table per section (a test keeps the page equal to this)."""
    aliases: dict[str, list[str]] = {}
    for alias, key in ALIASES.items():
        aliases.setdefault(key, []).append(alias)
    docs = field_docs()
    out = []
    for name, section in SECTIONS.items():
        out += [f"### `{name}`: {section.__doc__.strip()}", "", "| key | default | meaning |", "|---|---|---|"]
        for f in fields(section):
            also = "".join(f" (also `{a}`)" for a in aliases.get(f.name, []))
            default = default_text(f.name).replace(" (default job: ", "` (default job: `").replace("|", "/")
            out.append(f"| `{f.name}`{also} | `{default.removesuffix(')')}`{')' if '(' in default else ''} "
                       f"| {docs[f.name].replace('|', '/')} |")
        out.append("")
    return "\n".join(out)


def foreign_markdown() -> str:
    """docs/config.md's "Coming from LLaMA-Factory / HF Trainer" table, from the table the loader uses."""
    out = ["| their key | from | in LazyTrain |", "|---|---|---|"]
    for key, entry in sorted(foreign.TABLE.items()):
        out.append(f"| `{key}` | {entry.source} | {entry.does.replace('|', '/')} |")
    return "\n".join(out) + "\n"
