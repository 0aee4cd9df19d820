"""The package's import graph points one way, down the layers of docs/ARCHITECTURE.md.

The imports are read with ``ast`` and never executed, so imports inside functions and under
``TYPE_CHECKING`` count as much as top-level ones.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvscope"

# Each module belongs to the first layer whose prefix names it (longest prefix first).
LAYER_OF: dict[str, str] = {
    "kvscope": "api",                       # the top-level modules not named below (llm, magic, chat, ...)
    "kvscope.widgets": "widgets",
    "kvscope.attach": "attach",
    "kvscope.trace": "trace",
    "kvscope.engine": "engine",
    "kvscope.engine.scheduler_output": "contract",
    "kvscope.engine.executor": "contract",
    "kvscope.config": "data",
    "kvscope.sampling_params": "data",
    "kvscope.arg_checks": "data",
    "kvscope.outputs": "data",
    "kvscope.distributed": "distributed",
    "kvscope.distributed.parallel_state": "parallel_state",
    "kvscope.runner": "runner",
    "kvscope.models": "models",
    "kvscope.layers": "layers",
    "kvscope.forward_context": "forward_context",
    "kvscope.interrupts": "interrupts",
    "kvscope.kernels": "kernels",
}

# The layers each layer may import directly, besides its own. Written once; see
# docs/ARCHITECTURE.md, "Layers". "contract" is the engine's side of the runner's interface
# (SchedulerOutput, the Executor protocol): the runner sees the engine only through it.
ALLOWED: dict[str, set[str]] = {
    "api": {"widgets", "attach", "trace", "engine", "contract", "data", "distributed", "runner", "models",
            "interrupts"},
    "widgets": {"attach", "trace", "data"},
    "attach": {"trace", "engine", "data"},
    "trace": {"engine", "contract", "data"},
    "engine": {"contract", "data", "interrupts"},
    "contract": {"data"},
    "data": set(),
    "distributed": {"runner", "models", "kernels", "parallel_state", "contract", "data", "interrupts"},
    "runner": {"models", "layers", "kernels", "forward_context", "parallel_state", "contract", "data"},
    "models": {"layers", "parallel_state"},
    "layers": {"kernels", "forward_context", "parallel_state"},
    "forward_context": {"kernels"},
    "kernels": set(),
    "parallel_state": set(),
    "interrupts": set(),
}


def layer_of(module: str) -> str:
    best = max((p for p in LAYER_OF if module == p or module.startswith(p + ".")), key=len)
    return LAYER_OF[best]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, root: Path) -> list[tuple[int, str]]:
    """Every kvscope module ``path`` imports, anywhere in the file, with its line."""
    module = module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # ``from kvscope.kernels import fused`` imports a module: judge by the deeper name.
            found += [(node.lineno, f"{base}.{a.name}" if _is_module(f"{base}.{a.name}", root) else base)
                      for a in node.names]
    return [(line, m) for line, m in found if m == "kvscope" or m.startswith("kvscope.")]


def _is_module(name: str, root: Path) -> bool:
    path = root.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def violations(root: Path = PACKAGE) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        here = layer_of(module_name(path, root))
        for line, target in imports_of(path, root):
            there = layer_of(target)
            if there != here and there not in ALLOWED[here]:
                bad.append(f"{path.relative_to(root.parent)}:{line}: {here} -> {there} ({target})")
    return bad


def test_every_module_has_a_layer() -> None:
    assert set(ALLOWED) == set(LAYER_OF.values())
    for path in PACKAGE.rglob("*.py"):
        assert layer_of(module_name(path, PACKAGE)) in ALLOWED


def test_imports_point_down_the_layers() -> None:
    assert violations() == []


def test_the_architecture_docs_table_of_edges_is_allowed() -> None:
    """docs/ARCHITECTURE.md writes ALLOWED out as a table ("layer | may import"); an edge added
    to or dropped from either alone fails here."""
    doc = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text()
    table = doc.split("| layer | may import |", 1)[1].split("\n\n", 1)[0]
    name = lambda cell: {"API": "api", "plain data": "data", "forward context": "forward_context"}.get(cell, cell)  # noqa: E731
    documented: dict[str, set[str]] = {}
    for line in table.strip().splitlines()[1:]:  # (after the header's separator)
        layers, targets = (cell.strip() for cell in line.strip("| ").split("|"))
        edges = set() if targets == "nothing" else {name(t.strip()) for t in targets.split(",")}
        for layer in layers.split(","):
            documented[name(layer.strip())] = edges
    assert documented == ALLOWED


@pytest.mark.parametrize("source, where", [
    ("from kvscope.trace.trace import Trace", "engine/upward.py"),                 # engine -> trace
    ("def f():\n    from kvscope.runner import inputs\n", "engine/upward.py"),      # inside a function
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvscope.runner.model_runner import ModelRunner\n",
     "kernels/upward.py"),                                                          # under TYPE_CHECKING
    ("from kvscope.engine.llm_engine import LLMEngine", "widgets/upward.py"),       # widgets -> engine internals
    ("from ..runner import inputs", "layers/upward.py"),                            # relative
])
def test_an_upward_import_is_caught(tmp_path: Path, source: str, where: str) -> None:
    """The checker itself: a planted upward import, in each form, is reported."""
    import shutil

    copy = tmp_path / "kvscope"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "static"))
    (copy / where).write_text(source)
    found = violations(copy)
    assert len(found) == 1 and found[0].startswith(f"kvscope/{where}:")
