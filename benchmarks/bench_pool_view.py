"""The block-pool view at GPU pool sizes, on the CPU: export time and size, bytes per live
update, and the browser's redraw time.

Pools are made with the test suite's tiny checkpoint and ``block_size=1`` (its KV costs 1 KiB
per block in float32, so 2,000,000 blocks take 2 GiB of memory; 8,000,000 take 4 GiB in
bfloat16). Each pool size runs 16 requests recorded at ``blocks`` level, then:

* ``export``: ``export_html`` of the trace, its wall time and file size;
* ``update_bytes``: a ``BlockPoolView`` replays every recorded step as a live dashboard would,
  and the bytes of each update message it sends (binary delta + JSON) are counted;
* ``redraw_ms`` (with ``--browser``): the exported page opened in headless Chromium, the step
  slider moved, and the pool view's own draw time read back (overview of the whole pool).

With ``--lifecycle``: 256 requests (at most 32 running, 250 tokens each) recorded over about
2,000 steps; the time to build ``trace.lifecycle``, and in Chromium the lifecycle view's draw
time, and the time from a click on a row to the pool showing that request selected.

    python benchmarks/bench_pool_view.py --blocks 1000000 2000000 8000000 --browser
    python benchmarks/bench_pool_view.py --blocks --lifecycle

Prints one JSON object per measurement.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def record(num_blocks: int, num_requests: int, max_tokens: int):
    from engine_helpers import greedy, make_llm

    dtype = "bfloat16" if num_blocks > 4_000_000 else "float32"
    llm = make_llm(num_kv_blocks=num_blocks, block_size=1, validate=False, dtype=dtype)
    prompts = [f"request {i}: the quick brown fox jumps over the lazy dog" for i in range(num_requests)]
    with llm.record(level="blocks") as trace:
        llm.generate(prompts, greedy(max_tokens), use_tqdm=False)
    return trace


def update_bytes(trace) -> list[int]:
    """Bytes of each pool update after the first, replaying the trace step by step."""
    from kvscope.widgets import BlockPoolView

    view = BlockPoolView(trace, step=trace.step_ids[0])
    sizes: list[int] = []

    def wire(msg, buffers=None):
        sizes.append(len(json.dumps(msg)) + sum(len(b) for b in buffers or []))

    view._send = wire
    for step in trace.step_ids[1:]:
        view.update_from(trace, step)
    return sizes


def redraw_ms(page_path: Path) -> dict[str, float]:
    sys.path.insert(0, str(ROOT / "tests"))
    from browser.lab import chromium_page

    pool = "[data-kvscope-view=pool]"
    with chromium_page() as page:
        page.goto(page_path.as_uri())
        page.wait_for_function("() => document.body.dataset.ready === '1'", timeout=120_000)
        first = float(page.eval_on_selector(pool, "el => el.dataset.drawMs"))
        times = []
        for value in ("0", "1", "2", "3"):
            page.fill("#kvscope-slider", value)
            page.dispatch_event("#kvscope-slider", "input")
            times.append(float(page.eval_on_selector(pool, "el => el.dataset.drawMs")))
        bucket = int(page.eval_on_selector(pool, "el => el.dataset.bucket"))
    return {"first_draw_ms": first, "redraw_ms": sorted(times)[len(times) // 2], "bucket": bucket}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, nargs="*", default=[1_000_000, 2_000_000])
    ap.add_argument("--lifecycle", action="store_true", help="256 requests x ~2,000 steps in the lifecycle view")
    ap.add_argument("--screenshot", type=Path, help="with --lifecycle: save the lifecycle view as this PNG")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--browser", action="store_true", help="also time the redraw in headless Chromium")
    args = ap.parse_args()
    from kvscope.widgets import export_html

    for n in args.blocks:
        trace = record(n, args.requests, args.max_tokens)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "pool.html"
            t = time.perf_counter()
            export_html(trace, path)
            export_s = time.perf_counter() - t
            result = {"num_blocks": n, "steps": len(trace.step_ids), "export_s": round(export_s, 2),
                      "export_mb": round(path.stat().st_size / 1e6, 2)}
            sizes = update_bytes(trace)
            result.update(update_bytes_mean=round(sum(sizes) / len(sizes)), update_bytes_max=max(sizes))
            if args.browser:
                result.update(redraw_ms(path))
        print(json.dumps(result), flush=True)
        del trace
    if args.lifecycle:
        print(json.dumps(lifecycle_at_scale(args.screenshot)), flush=True)


def lifecycle_at_scale(screenshot: Path | None) -> dict:
    from engine_helpers import greedy, make_llm

    from kvscope.widgets import export_html

    llm = make_llm(num_kv_blocks=4096, block_size=16, validate=False, max_num_seqs=32, max_num_batched_tokens=512)
    prompts = [f"request {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 4) for i in range(256)]
    with llm.record(level="blocks", max_steps=5000) as trace:
        llm.generate(prompts, greedy(250), use_tqdm=False)
    t = time.perf_counter()
    life = trace.lifecycle
    result = {"requests": 256, "steps": len(trace.step_ids), "lifecycle_rows": len(life),
              "lifecycle_build_s": round(time.perf_counter() - t, 3)}
    with tempfile.TemporaryDirectory() as tmp:
        path = export_html(trace, Path(tmp) / "life.html", include_plotlyjs=False)
        from browser.lab import chromium_page

        life_sel = "[data-kvscope-view=lifecycle]"
        with chromium_page() as page:
            page.goto(path.as_uri())
            page.wait_for_function("() => document.body.dataset.ready === '1'", timeout=120_000)
            draws = []
            for value in ("0", "100", "200", "299"):
                page.fill("#kvscope-slider", value)
                page.dispatch_event("#kvscope-slider", "input")
                draws.append(float(page.eval_on_selector(life_sel, "el => el.dataset.drawMs")))
            canvas = page.locator(f"{life_sel} canvas").first
            row_h = int(page.eval_on_selector(life_sel, "el => el.dataset.rowHeight"))
            t = time.perf_counter()
            canvas.click(position={"x": 400, "y": 100 * row_h + row_h / 2})
            page.wait_for_function("() => document.querySelector('[data-kvscope-view=pool]').dataset.selectedRequest !== ''")
            result.update(draw_ms=sorted(draws)[len(draws) // 2], click_to_select_ms=round(1000 * (time.perf_counter() - t), 1),
                          row_height_px=row_h)
            if screenshot is not None:
                canvas.hover(position={"x": 400, "y": 100 * row_h + row_h / 2})
                page.locator(life_sel).screenshot(path=str(screenshot))
    return result


if __name__ == "__main__":
    main()
