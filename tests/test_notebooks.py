"""Every notebook runs top to bottom on CPU with the bundled model, with no error output."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

NOTEBOOK_DIR = Path(__file__).parent.parent / "notebooks"
# The README's notebook list: each one is run below, so a missing or renamed one fails.
NOTEBOOKS = ["01_quickstart", "02_prefix_caching", "03_preemption_and_chunked_prefill", "04_gpu"]


def test_the_notebooks_are_exactly_the_documented_ones():
    assert sorted(p.stem for p in NOTEBOOK_DIR.glob("*.ipynb")) == NOTEBOOKS


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_without_errors(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    # One intra-op thread in the kernel: tiny models gain nothing from more, and on a shared
    # 2-core CI machine OpenMP threads spinning against other jobs slow a run down tenfold.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = NOTEBOOK_DIR / f"{name}.ipynb"
    book = nbformat.read(path, as_version=4)
    assert book.metadata.kernelspec.name == "python3", "a notebook without a kernelspec asks for one in Jupyter"
    shutil.copy(path, tmp_path)  # files the notebook writes land in tmp_path
    client = nbclient.NotebookClient(book, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    errors = [
        f"cell {i}: {out.get('ename')}: {out.get('evalue')}" for i, cell in enumerate(book.cells)
        for out in cell.get("outputs", [])
        if out.output_type == "error" or (out.output_type == "stream" and out.name == "stderr" and "Traceback" in out.text)
    ]
    assert not errors, errors
