"""The wheel's package list in pyproject.toml covers every subpackage, and maps the bundled demo
model into the package (``.ci/run`` builds the wheel, installs it into a fresh venv and runs the
demo from there)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvscope.model_source import BUNDLED_MODEL

REPO = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib") if sys.version_info >= (3, 11) else pytest.importorskip("tomli")


def test_every_subpackage_and_the_demo_model_are_in_the_wheel_configuration() -> None:
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "kvscope").rglob("__init__.py")}
    listed = set(setuptools["packages"])
    assert on_disk - listed == set(), "add these subpackages to [tool.setuptools] packages"
    demo_dir = REPO / setuptools["package-dir"]["kvscope._demo_model"]
    assert "kvscope._demo_model" in listed and demo_dir == BUNDLED_MODEL
    patterns = setuptools["package-data"]["kvscope._demo_model"]
    shipped = {f.name for f in demo_dir.iterdir() if any(f.match(p) for p in patterns)}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= shipped
