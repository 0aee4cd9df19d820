"""README figure: four kvscope replicas publish their KV events; ``kvscope.attach`` watches them all.

Each replica is an ``LLM()`` on the bundled model publishing on loopback
(``kv_events_config``); requests are spread round-robin, all behind one system prompt, and two
questions go to two replicas each. The attach dashboard's cache view is written with
``to_html`` and photographed in Debian's Chromium.

    python tools/attach_figure.py [--out assets/screenshots/attach_replicas.png]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

import kvscope
from kvscope import LLM, SamplingParams
from kvscope.demo import demo_prompts

LOOPBACK = "tcp://127.0.0.1:*"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="assets/screenshots/attach_replicas.png")
    args = ap.parse_args()
    config = {"enable_kv_cache_events": True, "endpoint": LOOPBACK, "replay_endpoint": LOOPBACK, "topic": "kv-events"}
    replicas = [LLM(num_kv_blocks=64, kv_events_config=config) for _ in range(4)]
    pubs = {f"replica{i}": llm.kv_events.publisher for i, llm in enumerate(replicas)}
    src = kvscope.attach({n: p.endpoint for n, p in pubs.items()},
                         replay_endpoints={n: p.replay_endpoint for n, p in pubs.items()})
    time.sleep(0.5)
    prompts = demo_prompts(8)
    routes = {i: [prompts[i], prompts[i + 4]] for i in range(4)}
    routes[0].append(prompts[1])  # a router without KV awareness sends a repeat elsewhere
    routes[2].append(prompts[3])
    params = SamplingParams(temperature=0, max_tokens=24)
    for i, llm in enumerate(replicas):
        llm.generate(routes[i], params, use_tqdm=False)
    for name, pub in pubs.items():
        stream = next(s for s in src.streams if s.name == name)
        while stream.next_seq != pub._seq:
            time.sleep(0.01)
    dash = kvscope.dashboard(src, views=("cache",), tokenizer=replicas[0].get_tokenizer())
    dash.detach()
    with tempfile.TemporaryDirectory() as tmp:
        page_path = dash.to_html(Path(tmp) / "attach.html")
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 760, "height": 600}, device_scale_factor=2)
            page.goto(page_path.as_uri())
            page.wait_for_selector("body[data-done='1']")
            page.hover("canvas.kvs-forest-canvas >> nth=0", position={"x": 60, "y": 10})
            page.screenshot(path=args.out, full_page=True)
            browser.close()
    print(src.duplication(), "->", args.out)
    src.close()
    for llm in replicas:
        llm.shutdown()


if __name__ == "__main__":
    main()
