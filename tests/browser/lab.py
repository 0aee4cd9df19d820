"""A throw-away JupyterLab server and a headless Chromium page on it, for real-browser tests.

The recipe (measured on this project's CPU machine): Debian's ``/usr/bin/chromium`` driven by
Python Playwright (never ``playwright install``),
one fresh server per test with an isolated config directory, and "ready" meaning the kernel is
connected and idle, not the toolbar's indicator.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[2]
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--no-first-run", "--disable-sync", "--disable-quic"]


def missing() -> str | None:
    """Why a browser test cannot run here, or None."""
    if not Path(CHROMIUM).exists() and not shutil.which("chromium"):
        return "Debian's chromium is not installed (apt-get install -y chromium)"
    for module in ("playwright", "jupyterlab"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed (pip install jupyterlab playwright)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def jupyterlab(root: Path, tmp: Path) -> Iterator[str]:
    """Run JupyterLab on ``root`` with no token; yields its base URL."""
    config = tmp / "jupyter-config"
    settings = config / "lab" / "user-settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    port = _free_port()
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(config), "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1",  # see tests/test_notebooks.py
           # the kernel imports this checkout's kvscope (and the tests' helpers), whatever is installed
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    log = open(tmp / "jupyterlab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={port}",
         "--ServerApp.port_retries=0", f"--ServerApp.root_dir={root}", "--IdentityProvider.token=",
         "--ServerApp.password=", "--LabApp.expose_app_in_browser=True",
         "--KernelManager.shutdown_wait_time=1"],  # the test is over: do not wait on the kernel
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"JupyterLab did not start; see {tmp / 'jupyterlab.log'}") from None
                time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@contextlib.contextmanager
def chromium_page(width: int = 1400, height: int = 1700) -> Iterator["playwright.sync_api.Page"]:  # noqa: F821
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport={"width": width, "height": height})
        finally:
            browser.close()


KERNEL_READY = """() => {
  const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return !!k && k.connectionStatus === 'connected' && k.status === 'idle';
}"""


def open_notebook(page: "playwright.sync_api.Page", url: str, name: str, timeout_ms: int = 60_000) -> None:  # noqa: F821
    """Open ``name`` in Lab and wait until its kernel is really ready."""
    page.goto(f"{url}/lab/tree/{name}")
    page.wait_for_function(KERNEL_READY, timeout=timeout_ms)


def write_notebook(path: Path, cells: list[str]) -> Path:
    """A notebook of code cells, with the kernelspec Lab needs to start a kernel."""
    nb = {"cells": [{"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [], "source": c}
                    for c in cells],
          "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
          "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(nb))
    return path


def run_all(page: "playwright.sync_api.Page") -> None:  # noqa: F821
    """Start "Run All" and return at once (so the test can watch outputs as they arrive)."""
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")


def run_all_above_last(page: "playwright.sync_api.Page", timeout_ms: int = 180_000) -> None:  # noqa: F821
    """Run every cell but the last, and return once the kernel has run them all."""
    cells = "window.jupyterapp.shell.currentWidget.content"
    # (a notebook whose cells are not all drawn yet would run the cells above another one)
    page.wait_for_function(f"() => {cells}.widgets.length > 1 && {cells}.widgets.length === {cells}.model.cells.length",
                           timeout=timeout_ms)
    page.evaluate(f"""() => {{
      const nb = {cells};
      nb.activeCellIndex = nb.widgets.length - 1;
      window.kvsAboveRan = null;
      window.jupyterapp.commands.execute('notebook:run-all-above').then((ran) => {{ window.kvsAboveRan = ran; }});
    }}""")
    page.wait_for_function("() => window.kvsAboveRan !== null", timeout=timeout_ms)
    if page.evaluate("() => window.kvsAboveRan") is not True:
        raise RuntimeError("JupyterLab did not run the cells above the last one")


def run_last(page: "playwright.sync_api.Page") -> None:  # noqa: F821
    """Start the last cell and return at once."""
    page.evaluate("""() => {
      const nb = window.jupyterapp.shell.currentWidget.content;
      nb.activeCellIndex = nb.widgets.length - 1;
      nb.deselectAll();  // (the command runs the selected cells)
      window.jupyterapp.commands.execute('notebook:run-cell');
    }""")
