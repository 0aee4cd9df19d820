"""The quickstart notebook in a real JupyterLab, driven by Playwright in Debian's Chromium.

It runs all cells, then checks in the page itself that the block-pool view draws the
configured number of blocks, that it changes while generation runs, and that Pause / Step /
Resume hold the background run between engine steps. Screenshots go to a temp dir, or to
assets/screenshots/ (the README's images) with KVSCOPE_UPDATE_SCREENSHOTS=1, so a test run never
leaves the working tree dirty.
Skipped when chromium, playwright or jupyterlab is missing.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from browser.lab import (chromium_page, jupyterlab, missing, open_notebook, run_all, run_all_above_last, run_last,
                         write_notebook)
from browser.views import open_view, tables_state
from pool_reference import bucket_summary

pytestmark = [pytest.mark.browser, pytest.mark.skipif(missing() is not None, reason=str(missing()))]

ROOT = Path(__file__).parent.parent
NOTEBOOK = ROOT / "notebooks" / "01_quickstart.ipynb"
SHOTS = (ROOT / "assets" / "screenshots" if os.environ.get("KVSCOPE_UPDATE_SCREENSHOTS") == "1"
         else Path(tempfile.gettempdir()) / "kvscope-screenshots")

POOL = "[data-kvscope-view=pool]"
LIFE = "[data-kvscope-view=lifecycle]"
STATUS = ".kvscope-status"


def pool_step(page) -> int:
    return int(page.eval_on_selector(POOL, "el => el.dataset.step"))


def status(page) -> str:
    return page.inner_text(STATUS)


def wait_until(cond, timeout: float, what: str, page=None) -> None:
    """Wait for ``cond``; on a timeout, say what, and what the dashboard's status line says."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}" + (f"; status: {status(page)!r}" if page else ""))
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
        # The last cell starts a background run, which the test pauses: the pause must land before
        # the run ends, and the run's length is not the test's (a loaded machine stretches it, a
        # free core runs it in seconds). So that cell runs once the browser has drawn what the
        # cells before it sent, and Pause is clicked as soon as the run has started. (Run All let
        # the kernel start the run while the browser was still drawing the first dashboard, and the
        # test paused only after watching the pool change and taking a screenshot: near the run's
        # end, or after it.)
        run_all_above_last(page)

        # The pool draws every configured block, one canvas cell each.
        page.wait_for_selector(f".jp-OutputArea-output {POOL}", state="attached", timeout=60_000)
        page.wait_for_function(
            f"() => Number(document.querySelector('{POOL}').dataset.numBlocks) === {num_blocks}", timeout=30_000)
        steady_step(page, quiet=1.0, timeout=60)
        run_last(page)

        # Pause holds the run between two steps (the button is enabled once the run has started:
        # the click waits for it) ...
        page.locator("button.kvscope-pause").first.click()
        wait_until(lambda: "paused at step" in status(page), 10, "the paused status", page)
        held = steady_step(page)
        assert f"paused at step {held}" in status(page)
        time.sleep(1.0)
        assert pool_step(page) == held, "the engine kept running while paused"
        dashboard = page.locator(".kvscope-dashboard").first

        # ... Step runs exactly one engine step ...
        for k in (1, 2):
            page.locator("button.kvscope-step").first.click()
            wait_until(lambda: pool_step(page) == held + k, 10, f"step {held + k}", page)
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

        # Resume lets it go on: the pool changes while it runs.
        page.locator("button.kvscope-resume").first.click()
        wait_until(lambda: "running" in status(page), 10, "the running status", page)
        wait_until(lambda: pool_step(page) > held + 2, 10, "the pool to change during the run", page)
        dashboard.screenshot(path=str(SHOTS / "quickstart_live.png"))

        # The static export the notebook wrote opens without a kernel and draws the pool.
        page.goto((work / "kvscope_quickstart.html").as_uri())
        page.wait_for_function("() => document.body.dataset.ready === '1'", timeout=30_000)
        assert page.eval_on_selector(POOL, "el => Number(el.dataset.numBlocks)") == num_blocks
        page.screenshot(path=str(SHOTS / "export.png"), full_page=True)


DROPPED_STEP_CELLS = [
    """import json
import numpy as np
from IPython.display import display
from engine_helpers import make_llm, greedy
from kvscope.widgets import BlockPoolView
llm = make_llm(num_kv_blocks=12, block_size=8, max_num_batched_tokens=32)
with llm.record("blocks", max_steps=2) as trace:
    for p in ([5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]):
        llm.add_request(p, greedy(8))
    for _ in range(3):
        llm.step()
    shown = trace.step_ids[-1]
    used = int(np.flatnonzero(trace.pool_arrays(shown)["state"] == 1)[0])
    view = BlockPoolView(trace, step=shown)
    display(view)
    while llm.has_unfinished_requests():
        llm.step()
json.dump({"shown": shown, "used": used, "held": trace.step_ids}, open("dropped.json", "w"))""",
]


def test_a_hover_on_a_step_the_trace_dropped_says_so(tmp_path: Path):
    """A pool view left on a step that the live trace's ring buffer dropped since: hovering a
    used block asks the kernel, which no longer holds the step, and the tooltip says so (it
    said "asking the kernel..." for ever)."""
    work = tmp_path / "nb"
    work.mkdir()
    write_notebook(work / "dropped.ipynb", DROPPED_STEP_CELLS)
    with jupyterlab(work, tmp_path) as url, chromium_page() as page:
        open_notebook(page, url, "dropped.ipynb")
        run_all(page)
        wait_until(lambda: (work / "dropped.json").exists(), 120, "the run to finish")
        time.sleep(0.5)
        facts = json.loads((work / "dropped.json").read_text())
        shown, used = facts["shown"], facts["used"]
        assert shown not in facts["held"]  # the kernel's trace dropped the step the view shows
        page.wait_for_function(f"() => document.querySelector('{POOL}')?.dataset.step === '{shown}'", timeout=60_000)
        page.mouse.move(*cell_center(page, used))
        tip = f"{POOL} .kvs-tip"
        page.wait_for_function(f"() => document.querySelector('{tip}').textContent.includes('no longer held')",
                               timeout=10_000)
        text = page.inner_text(tip)
        assert text.startswith(f"block {used}") and f"step {shown} is no longer held" in text
        assert "asking the kernel" not in text


GPU_SCALE_CELLS = [
    """import numpy as np
import kvscope
from kvscope import SamplingParams
from engine_helpers import make_llm
# A pool the size of a GPU's: one million blocks of one token each.
llm = make_llm(num_kv_blocks=1_000_000, block_size=1, validate=False, max_num_seqs=8, max_num_batched_tokens=48)
dash = kvscope.dashboard(llm)
dash""",
    """prompts = [f"request {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 2) for i in range(16)]
params = [SamplingParams(temperature=0, max_tokens=2 + (3 * i) % 7, ignore_eos=True) for i in range(16)]
llm.generate(prompts, params, use_tqdm=False)
dash.detach()
trace = dash.trace
mid = trace.step_ids[len(trace.step_ids) // 2]
dash.slider.value = mid
a = trace.pool_arrays(mid)
dash.to_html("scale.html")
np.savez("pool.npz", state=a["state"], ref_count=a["ref_count"], step=mid)""",
]
FREE = (0xE9, 0xEC, 0xEF)  # KVS_COLORS.free


def cell_center(page, k: int) -> tuple[float, float]:
    box = page.locator(f"{POOL} canvas").first.bounding_box()
    d = page.eval_on_selector(POOL, "el => ({...el.dataset})")
    cell, cols = int(d["cell"]), int(d["cols"])
    return box["x"] + (k % cols) * cell + cell / 2, box["y"] + (k // cols) * cell + cell / 2


def pool_data(page) -> dict:
    return page.eval_on_selector(POOL, "el => ({...el.dataset})")


def test_million_block_pool_and_lifecycle_in_jupyterlab(tmp_path: Path):
    """A GPU-sized pool live in JupyterLab: the overview shows every used block (read back from
    the canvas' pixels), zooming reaches single blocks with hover and click, "live only"
    compacts, and the lifecycle view selects requests in the pool and back."""
    work = tmp_path / "nb"
    work.mkdir()
    write_notebook(work / "scale.ipynb", GPU_SCALE_CELLS)
    SHOTS.mkdir(parents=True, exist_ok=True)
    with jupyterlab(work, tmp_path) as url, chromium_page() as page:
        open_notebook(page, url, "scale.ipynb")
        run_all(page)
        wait_until(lambda: (work / "pool.npz").exists(), 240, "the run to finish")
        time.sleep(0.5)
        saved = np.load(work / "pool.npz")
        state, refs, mid = saved["state"], saved["ref_count"], int(saved["step"])
        page.wait_for_function(f"() => document.querySelector('{POOL}').dataset.step === '{mid}'", timeout=60_000)
        data = pool_data(page)
        assert int(data["numBlocks"]) == 1_000_000 and int(data["bucket"]) > 1
        assert int(data["used"]) == int((state == 1).sum()) > 0

        # The overview's buckets are the numpy reference's, over the whole pool ...
        ov = page.eval_on_selector(POOL, "el => el.kvsOverview()")
        top, busy = bucket_summary(state, refs, ov["bucket"])
        assert ov["lo"] == 0 and ov["count"] == 1_000_000
        assert ov["top"] == top.tolist() and ov["busy"] == busy.tolist()
        # ... and every cell holding a used, cached or shared block is drawn in a colour apart from free.
        cells = np.flatnonzero(top).tolist()
        idle = np.flatnonzero(top == 0)[:: max(1, len(top) // 500)].tolist()
        pixels = page.eval_on_selector(POOL, """(el, cells) => {
            const c = el.querySelector("canvas"), ctx = c.getContext("2d");
            const cell = +el.dataset.cell, cols = +el.dataset.cols;
            return cells.map((k) => Array.from(ctx.getImageData((k % cols) * cell, Math.floor(k / cols) * cell, 1, 1).data));
        }""", cells + idle)
        for k, px in zip(cells, pixels):
            assert max(abs(a - b) for a, b in zip(px[:3], FREE)) >= 24, f"cell {k} (code {top[k]}) is not visible: {px}"
        assert all(tuple(px[:3]) == FREE for px in pixels[len(cells):])
        page.locator("[data-kvscope-view=lifecycle]").first.scroll_into_view_if_needed()
        page.locator(POOL).first.scroll_into_view_if_needed()
        page.locator(".kvscope-dashboard").first.screenshot(path=str(SHOTS / "pool_1000000_blocks.png"))
        draw_ms = float(data["drawMs"])

        # A click on an overview cell zooms to single blocks around it; hover asks the kernel for tokens.
        used = int(np.flatnonzero(state == 1)[0])
        page.mouse.click(*cell_center(page, used // ov["bucket"]))
        page.wait_for_function(f"() => document.querySelector('{POOL}').dataset.bucket === '1'", timeout=10_000)
        data = pool_data(page)
        lo, hi = int(data["viewLo"]), int(data["viewHi"])
        assert lo <= used < hi
        page.mouse.move(*cell_center(page, used - lo))
        page.wait_for_function(f"() => document.querySelector('{POOL} .kvs-tip').textContent.includes('tokens (')",
                               timeout=10_000)
        assert page.inner_text(f"{POOL} .kvs-tip").startswith(f"block {used}")
        page.mouse.click(*cell_center(page, used - lo))  # selects its request, everywhere
        page.wait_for_function(f"() => document.querySelector('{POOL}').dataset.selectedRequest !== ''", timeout=10_000)
        chosen = pool_data(page)["selectedRequest"]
        page.wait_for_function(
            f"() => document.querySelector('{LIFE}').dataset.selectedRequest === '{chosen}'", timeout=10_000)
        page.locator(".kvscope-dashboard").first.screenshot(path=str(SHOTS / "pool_zoomed.png"))

        # Drag over a range of the overview: that range, down to single blocks.
        page.locator(f"{POOL} .kvs-zoom-reset").first.click()
        page.mouse.move(*cell_center(page, 0))
        page.mouse.down()
        page.mouse.move(*cell_center(page, 30), steps=5)
        page.mouse.up()
        data = pool_data(page)
        assert (int(data["viewLo"]), int(data["viewHi"])) == (0, 31 * ov["bucket"]) and data["bucket"] == "1"

        # "live only": just the used and cached blocks, side by side.
        page.locator(f"{POOL} .kvs-live-only").first.check()
        data = pool_data(page)
        assert data["liveOnly"] == "1" and int(data["cells"]) == int((state != 0).sum())

        # The lifecycle: a row per request; clicking one selects it in the pool and the tables.
        life = pool_data_of(page, LIFE)
        assert int(life["numRequests"]) == 16 and int(life["step"]) == mid
        canvas = page.locator(f"{LIFE} canvas").first
        row_h, width = int(life["rowHeight"]), canvas.bounding_box()["width"]
        in_tables = page.locator("[data-kvscope-view=tables] .kvs-rid").all_inner_texts()

        def row_of(r: int) -> str:  # the request a row shows, read from its hover tip
            canvas.hover(position={"x": width * 0.5, "y": r * row_h + row_h / 2})
            return page.inner_text(f"{LIFE} .kvs-tip").split(" ")[1]

        row = next(r for r in range(16) if row_of(r) not in (chosen, "") and row_of(r) in in_tables)
        canvas.click(position={"x": width * 0.5, "y": row * row_h + row_h / 2})
        picked = row_of(row)
        page.wait_for_function(
            f"() => document.querySelector('{POOL}').dataset.selectedRequest === '{picked}'", timeout=10_000)
        assert page.locator("[data-kvscope-view=tables] tr.kvs-selected .kvs-rid").inner_text() == picked
        assert int(pool_data(page)["selectedBlocks"]) > 0
        tip = page.inner_text(f"{LIFE} .kvs-tip")
        assert tip.startswith(f"request {picked}") and "TTFT" in tip and "preemptions" in tip
        page.locator(LIFE).first.screenshot(path=str(SHOTS / "lifecycle.png"))

        # "zoom to live": from the first to the last block in use, whatever the pool's size.
        page.locator(f"{POOL} .kvs-live-only").first.uncheck()
        page.locator(f"{POOL} .kvs-zoom-live").first.click()
        live = np.flatnonzero(state)
        data = pool_data(page)
        assert (int(data["viewLo"]), int(data["viewHi"])) == (live[0], live[-1] + 1)

        # The static export: the pool rebuilt from block deltas, moving the slider either way.
        page.goto((work / "scale.html").as_uri())
        page.wait_for_function("() => document.body.dataset.ready === '1'", timeout=60_000)
        steps = json.loads(page.eval_on_selector("#kvscope-slider", "el => JSON.stringify([+el.max])"))[0] + 1
        for i in (steps - 1, 0, 1, mid - 1, mid - 2, mid - 1):  # 0-based slider positions; step ids start at 1
            page.fill("#kvscope-slider", str(i))
            page.dispatch_event("#kvscope-slider", "input")
        data = pool_data(page)
        assert int(data["step"]) == mid and int(data["used"]) == int((state == 1).sum())
        assert int(data["cached"]) == int((state == 2).sum())
        assert pool_data_of(page, LIFE)["numRequests"] == "16"
    assert draw_ms < 1000, f"drawing the 1,000,000-block overview took {draw_ms} ms"


def pool_data_of(page, selector: str) -> dict:
    return page.eval_on_selector(selector, "el => ({...el.dataset})")


# ----------------------------------------------------------------------------- views alone
# GPU-sized states fed to one view in a plain page (tests/browser/views.py): no kernel, a
# second or so each.

@pytest.fixture(scope="module")
def plain_page():
    with chromium_page(1000, 900) as page:
        yield page


def gpu_tables(num_requests: int = 256, prefix: int = 32, length: int = 300) -> list[dict]:
    """Block tables as at a GPU's decode: every request holds a shared prefix (ref 2) and a
    contiguous run of its own blocks, with one stray block in the middle of the run."""
    rows = []
    for r in range(num_requests):
        own = list(range(1000 + 400 * r, 1000 + 400 * r + length))
        own[length // 2] = 900_000 + r
        blocks = list(range(prefix)) + own
        rows.append({"id": str(r), "blocks": blocks, "refs": [2] * prefix + [1] * length, "num_tokens": 16 * len(blocks)})
    return rows


def elements(view) -> int:
    return view.evaluate("el => el.getElementsByTagName('*').length")


def test_block_tables_at_gpu_scale_fold_runs_of_consecutive_blocks(plain_page, tmp_path):
    """256 requests of 332 blocks: each row folds runs of consecutive blocks into one chip, so the
    view builds a few thousand elements (it built one or two per block, some 130,000, and took
    seconds per step), and the chips still name exactly the row's blocks, shared ones marked."""
    rows = gpu_tables()
    view = open_view(plain_page, tmp_path, "tables", {**tables_state(rows), "step": 7, "selected_request": ""},
                     int32=("tables",))
    assert elements(view) < 8_000
    shown = view.evaluate("""el => Array.from(el.querySelectorAll("tr")).map((tr) => [tr.dataset.rid,
        Array.from(tr.querySelectorAll("[data-physical]")).map((c) =>
          [+c.dataset.logical, +c.dataset.physical, +c.dataset.count, c.classList.contains("kvs-shared")])])""")
    assert [rid for rid, _ in shown] == [r["id"] for r in rows]
    for row, (_, chips) in zip(rows, shown):
        logical = [i for first, _, n, _ in chips for i in range(first, first + n)]
        physical = [b for _, start, n, _ in chips for b in range(start, start + n)]
        shared = [s for _, _, n, s in chips for _ in range(n)]
        assert logical == list(range(len(row["blocks"]))) and physical == row["blocks"]
        assert shared == [ref > 1 for ref in row["refs"]]
        assert len(chips) == 4  # the shared prefix, the run's halves, and the stray block between them


def test_a_short_block_table_keeps_one_chip_per_block(plain_page, tmp_path):
    rows = [{"id": "a", "blocks": [3, 4, 5, 9], "refs": [2, 1, 1, 1], "num_tokens": 60}]
    view = open_view(plain_page, tmp_path, "tables", {**tables_state(rows), "step": 1, "selected_request": ""},
                     int32=("tables",))
    chips = view.evaluate("""el => Array.from(el.querySelectorAll("[data-physical]")).map((c) =>
        [+c.dataset.physical, +c.dataset.count])""")
    assert chips == [[3, 1], [4, 1], [5, 1], [9, 1]]


def gpu_queues(running: int = 256, waiting: int = 1500) -> dict:
    return {"running": [str(i) for i in range(running)], "waiting": [str(running + i) for i in range(waiting)],
            "preempted": [], "finished": ["x"], "scheduled_tokens": 4000, "prefill_tokens": 3744,
            "decode_tokens": 256, "token_budget": 4096, "kv_usage": 0.6, "num_blocks": 150_000,
            "used": 90_000, "cached": 40_000, "kv_shards": []}


def test_the_scheduler_view_at_gpu_scale_stays_one_screen_high(plain_page, tmp_path):
    """256 running and 1,500 waiting requests: each lane scrolls within a few lines and draws at
    most its first chips, saying how many more it holds (the view drew every chip and grew some
    4,000 px tall, pushing the other views off screen)."""
    q = gpu_queues()
    view = open_view(plain_page, tmp_path, "queues", {"queues": q, "step": 3, "selected_request": ""})
    assert view.bounding_box()["height"] < 500
    lanes = view.evaluate("""el => Array.from(el.querySelectorAll(".kvs-lane")).map((lane) =>
        [Array.from(lane.querySelectorAll(".kvs-chip")).map((c) => c.textContent), lane.textContent])""")
    for (chips, text), name in zip(lanes, ("running", "waiting")):
        assert chips == q[name][:len(chips)] and len(chips) <= 256
        more = len(q[name]) - len(chips)
        assert f"{name} ({len(q[name])})" in text and (more == 0 or f"+{more} more" in text)
    # a selected request past the chips drawn is drawn too, marked
    plain_page.evaluate("() => kvsSet('selected_request', '1700')")
    assert view.evaluate("el => el.querySelector('.kvs-chip.kvs-selected').textContent") == "1700"


@pytest.mark.parametrize("name", ["tables", "queues", "slots"])
def test_a_selection_restyles_the_view_without_rebuilding_it(plain_page, tmp_path, name):
    """Selecting a request (a click anywhere: the views are linked) marks it in place; the views
    rebuilt every element for it, seconds at GPU scale, and lost their scroll position."""
    states = {
        "tables": tables_state(gpu_tables(64)),
        "queues": {"queues": gpu_queues(64, 64)},
        "slots": {"block_size": 16, "groups": [{"id": str(r), "kind": "decode", "num_tokens": 1,
                                                 "tokens": [[40, 7, "a", 16 * r, r, 0]]} for r in range(64)]},
    }
    view = open_view(plain_page, tmp_path, name, {**states[name], "step": 5, "selected_request": ""},
                     int32=("tables",) if name == "tables" else ())
    view.evaluate("el => { el.querySelectorAll('*').forEach((e) => { e.kvsBefore = true; }); }")
    for rid in ("12", "40", ""):
        plain_page.evaluate(f"() => kvsSet('selected_request', '{rid}')")
        marked = view.evaluate("el => Array.from(el.querySelectorAll('.kvs-selected')).map((e) => e.dataset.rid)")
        assert marked == ([rid] if rid else [])
    assert view.evaluate("el => Array.from(el.querySelectorAll('*')).every((e) => e.kvsBefore)")


DARK = ("background: #111111; --jp-layout-color0: #111111; --jp-layout-color1: #111111; "
        "--jp-layout-color2: #2a2a2a; --jp-border-color1: #616161; --jp-border-color2: #424242; "
        "--jp-content-font-color1: rgba(255, 255, 255, 1); --jp-content-font-color2: rgba(255, 255, 255, 0.72); "
        "--jp-content-font-color3: rgba(255, 255, 255, 0.54)")


def contrast(fg: list[float], bg: list[float]) -> float:
    """WCAG contrast ratio of two sRGB colours (0-255)."""
    def lum(c):
        v = [x / 255 for x in c]
        v = [x / 12.92 if x <= 0.03928 else ((x + 0.055) / 1.055) ** 2.4 for x in v]
        return 0.2126 * v[0] + 0.7152 * v[1] + 0.0722 * v[2]
    a, b = sorted((lum(fg), lum(bg)), reverse=True)
    return (a + 0.05) / (b + 0.05)


TEXT_COLOURS = """el => Array.from(el.querySelectorAll("*")).filter((e) =>
    Array.from(e.childNodes).some((n) => n.nodeType === 3 && n.textContent.trim())).map((e) => {
  const style = getComputedStyle(e), c = (e instanceof SVGElement ? style.fill : style.color).match(/[\\d.]+/g).map(Number);
  let bg = e, b;  // the first ancestor with an opaque background
  while (bg && (b = getComputedStyle(bg).backgroundColor.match(/[\\d.]+/g).map(Number)) && (b.length > 3 && b[3] < 1)) bg = bg.parentElement;
  const alpha = c.length > 3 ? c[3] : 1;
  const back = bg ? b.slice(0, 3) : [17, 17, 17];
  return [e.getAttribute("class") || e.tagName, e.textContent.slice(0, 30), c.slice(0, 3).map((x, i) => alpha * x + (1 - alpha) * back[i]), back];
})"""


@pytest.mark.parametrize("name", ["tables", "queues", "slots"])
def test_text_is_readable_in_a_dark_theme(plain_page, tmp_path, name):
    """Under JupyterLab's dark theme (its CSS variables), every text of the view contrasts with
    what it is drawn on (the views wrote #222 and #777 on Lab's near-black background)."""
    states = {
        "tables": tables_state(gpu_tables(3)),
        "queues": {"queues": gpu_queues(3, 3)},
        "slots": {"block_size": 16, "groups": [{"id": "0", "kind": "prefill", "num_tokens": 2,
                                                 "tokens": [[0, 7, "a", 0, 0, 0], [1, 8, "b", 1, 0, 1]]}]},
    }
    view = open_view(plain_page, tmp_path, name, {**states[name], "step": 5, "selected_request": ""}, body_style=DARK,
                     int32=("tables",) if name == "tables" else ())
    texts = view.evaluate(TEXT_COLOURS)
    assert texts
    faint = [(cls, text, round(contrast(fg, bg), 1)) for cls, text, fg, bg in texts if contrast(fg, bg) < 3]
    assert not faint


def test_lifecycle_labels_are_readable_in_a_dark_theme(plain_page, tmp_path):
    """The request ids the lifecycle writes on its canvas take the theme's text colour (they
    were #333, near-black on Lab's dark background)."""
    requests = [{"id": f"req-{r}", "prompt_len": 9, "output_len": 3, "num_cached_tokens": 0, "num_preemptions": 0,
                 "ttft_s": None, "mean_itl_s": None, "finish_reason": "length"} for r in range(4)]
    intervals = [v for r in range(4) for v in (r, 3, 1, 9, 1, 0)]  # each row: decode over steps 1-9
    state = {"requests": requests, "intervals": intervals, "states": ["waiting", "prefill", "recompute", "decode"],
             "first_step": 1, "last_step": 9, "step": 5, "selected_request": ""}
    view = open_view(plain_page, tmp_path, "lifecycle", state, body_style=DARK, int32=("intervals",))
    assert view.evaluate("el => +el.dataset.rowHeight") >= 9  # tall enough rows to carry their ids
    brightest = view.evaluate("""el => { const c = el.querySelector("canvas");
        const px = c.getContext("2d").getImageData(0, 0, 60, c.height).data;  // the ids' gutter
        let best = 0; for (let i = 0; i < px.length; i += 4) if (px[i + 3] > 0) best = Math.max(best, px[i]); return best; }""")
    assert brightest > 180
