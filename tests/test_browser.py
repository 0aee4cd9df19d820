"""The quickstart notebook in a real JupyterLab, driven by Playwright in Debian's Chromium.

It runs all cells, then checks in the page itself that the block-pool view draws the
configured number of blocks, that it changes while generation runs, and that Pause / Step /
Resume hold the background run between engine steps. Screenshots go to assets/screenshots/.
Skipped when chromium, playwright or jupyterlab is missing.
"""
from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest

from browser.lab import chromium_page, jupyterlab, missing, open_notebook, run_all

pytestmark = [pytest.mark.browser, pytest.mark.skipif(missing() is not None, reason=str(missing()))]

ROOT = Path(__file__).parent.parent
NOTEBOOK = ROOT / "notebooks" / "01_quickstart.ipynb"
SHOTS = ROOT / "assets" / "screenshots"

POOL = "[data-kvscope-view=pool]"
STATUS = ".kvscope-status"


def pool_step(page) -> int:
    return int(page.eval_on_selector(POOL, "el => el.dataset.step"))


def status(page) -> str:
    return page.inner_text(STATUS)


def wait_until(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def steady_step(page, quiet: float = 0.5, timeout: float = 15.0) -> int:
    """The pool's step once it has not changed for ``quiet`` seconds."""
    end = time.monotonic() + timeout
    last, since = pool_step(page), time.monotonic()
    while time.monotonic() - since < quiet:
        if time.monotonic() > end:
            raise AssertionError("the pool view never settled")
        time.sleep(0.05)
        now = pool_step(page)
        if now != last:
            last, since = now, time.monotonic()
    return last


def test_quickstart_dashboard_live_in_jupyterlab(tmp_path: Path):
    num_blocks = int(re.search(r"NUM_KV_BLOCKS = (\d+)", NOTEBOOK.read_text()).group(1))
    work = tmp_path / "nb"
    work.mkdir()
    shutil.copy(NOTEBOOK, work)
    SHOTS.mkdir(parents=True, exist_ok=True)
    with jupyterlab(work, tmp_path) as url, chromium_page() as page:
        open_notebook(page, url, NOTEBOOK.name)
        run_all(page)

        # The pool draws every configured block, one canvas cell each.
        page.wait_for_selector(f".jp-OutputArea-output {POOL}", state="attached", timeout=60_000)
        page.wait_for_function(
            f"() => Number(document.querySelector('{POOL}').dataset.numBlocks) === {num_blocks}", timeout=30_000)

        # The last cell starts a background run: the pool changes while it runs ...
        wait_until(lambda: "background run" in status(page), 90, "the background run")
        seen = {pool_step(page)}
        wait_until(lambda: seen.add(pool_step(page)) or len(seen) >= 2, 30, "the pool to change during the run")
        dashboard = page.locator(".kvscope-dashboard").first
        dashboard.screenshot(path=str(SHOTS / "quickstart_live.png"))

        # ... Pause holds it between two steps ...
        page.locator("button.kvscope-pause").first.click()
        wait_until(lambda: "paused at step" in status(page), 10, "the paused status")
        held = steady_step(page)
        assert f"paused at step {held}" in status(page)
        time.sleep(1.0)
        assert pool_step(page) == held, "the engine kept running while paused"

        # ... Step runs exactly one engine step ...
        for k in (1, 2):
            page.locator("button.kvscope-step").first.click()
            wait_until(lambda: pool_step(page) == held + k, 10, f"step {held + k}")
            assert steady_step(page, quiet=0.8) == held + k
            assert f"paused at step {held + k}" in status(page)
        # Selecting a request in the block tables highlights its blocks in the pool (linked in
        # the browser, no kernel round trip).
        row = page.locator("[data-kvscope-view=tables] tr").first
        request = row.locator(".kvs-rid").inner_text()
        row.click()
        page.wait_for_function(
            f"() => document.querySelector('{POOL}').dataset.selectedRequest === '{request}'", timeout=10_000)
        assert int(page.eval_on_selector(POOL, "el => el.dataset.selectedBlocks")) > 0
        dashboard.screenshot(path=str(SHOTS / "quickstart_paused.png"))

        # ... and with the kernel free, hovering a block asks it for the block's tokens.
        canvas = page.locator(f"{POOL} canvas").first
        canvas.hover(position={"x": 2, "y": 2})  # block 0: the shared system prompt's first block
        page.wait_for_function(f"() => document.querySelector('{POOL} .kvs-tip').textContent.includes('tokens (')",
                               timeout=10_000)
        tip = page.inner_text(f"{POOL} .kvs-tip")
        assert tip.startswith("block 0") and "owners" in tip

        # Resume lets it go on.
        page.locator("button.kvscope-resume").first.click()
        wait_until(lambda: pool_step(page) > held + 2 and "running" in status(page), 10, "the run to go on")

        # The static export the notebook wrote opens without a kernel and draws the pool.
        page.goto((work / "kvscope_quickstart.html").as_uri())
        page.wait_for_function("() => document.body.dataset.ready === '1'", timeout=30_000)
        assert page.eval_on_selector(POOL, "el => Number(el.dataset.numBlocks)") == num_blocks
        page.screenshot(path=str(SHOTS / "export.png"), full_page=True)


def test_pool_view_draws_131072_blocks_quickly(tmp_path: Path):
    """A 128k-block pool stays responsive: one canvas cell per block, drawn in milliseconds."""
    from engine_helpers import greedy, make_llm

    from kvscope.widgets import export_html

    num_blocks = 131072
    llm = make_llm(num_kv_blocks=num_blocks, block_size=1, validate=False)
    with llm.record() as trace:
        llm.generate(["the quick brown fox jumps over the lazy dog"] * 4, greedy(3), use_tqdm=False)
    page_path = export_html(trace, tmp_path / "big.html", include_plotlyjs=False)
    with chromium_page() as page:
        page.goto(page_path.as_uri())
        page.wait_for_function("() => document.body.dataset.ready === '1'", timeout=30_000)
        data = page.eval_on_selector(POOL, "el => ({...el.dataset})")
        assert int(data["numBlocks"]) == num_blocks and int(data["used"]) + int(data["cached"]) > 0
        page.fill("#kvscope-slider", "0")
        page.dispatch_event("#kvscope-slider", "input")
        redraw = page.eval_on_selector(POOL, "el => ({...el.dataset})")
        assert int(redraw["step"]) == trace.step_ids[0] and int(redraw["draws"]) > int(data["draws"])
        page.screenshot(path=str(SHOTS / "pool_131072_blocks.png"))
    assert float(redraw["drawMs"]) < 250, f"drawing {num_blocks} blocks took {redraw['drawMs']} ms"
