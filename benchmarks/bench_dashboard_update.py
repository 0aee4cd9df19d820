"""What one live dashboard update costs at GPU scale, on any machine.

The live dashboard's updater thread shares the interpreter lock with the engine, so the CPU
time of an update is time the engine can lose. This times ``Dashboard``'s update (the same
``_refresh`` its updater thread runs, with the default views, headless) over nano-vLLM's
benchmark workload at the H200's scale: 256 requests of random token ids, lengths uniform in
[100, 1024], a 72,367-block pool, ``max_num_batched_tokens`` 16384, async scheduling. The
engine, scheduler, block manager and recorder are the real ones; the model is a
``NullExecutor`` (no compute), which schedules exactly as the GPU run does, because a step's
scheduling depends on lengths and budgets only.

Reported: the CPU time of the first update after ``--warmup`` steps (it replays those steps
into the views), then the median over ``--updates`` updates each after ``--every`` more steps,
and the bytes each view put on the wire per timed update (mean): every message's JSON plus its
binary buffers, as ipywidgets hands them to the comm (headless, nothing is sent).

    python benchmarks/bench_dashboard_update.py [--warmup 500] [--every 5] [--updates 20]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from typing import Iterator

from bench_control_plane import _NoTokenizer
from bench_throughput import workload

from kvscope.config import EngineConfig
from kvscope.engine.llm_engine import LLMEngine
from kvscope.runner.null_executor import NullExecutor
from kvscope.sampling_params import SamplingParams


class EngineSource:
    """What ``kvscope.dashboard`` needs of an ``LLM`` to follow it live: ``record``."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    @contextlib.contextmanager
    def record(self, level: str = "blocks", max_steps: int = 10_000) -> Iterator:
        from kvscope.trace.recorder import Recorder

        with Recorder(self.engine, level, max_steps) as trace:
            yield trace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--num-kv-blocks", type=int, default=72_367)
    ap.add_argument("--warmup", type=int, default=500, help="steps before the first update")
    ap.add_argument("--every", type=int, default=5, help="steps between the timed updates")
    ap.add_argument("--updates", type=int, default=20)
    args = ap.parse_args()

    from kvscope.widgets.dashboard import Dashboard

    config = EngineConfig.from_kwargs(block_size=16, max_num_seqs=256, max_num_batched_tokens=16384,
                                      async_scheduling=True)
    engine = LLMEngine(config, NullExecutor(args.num_kv_blocks, 151_936, 16), _NoTokenizer(), 2048)
    dash = Dashboard(EngineSource(engine))
    prompts, outs = workload(args.requests, 1024, 1024)
    for prompt, n in zip(prompts, outs):
        engine.add_request(prompt, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n), final_only=True)

    sent = {name: 0 for name in dash.views}
    for name, view in dash.views.items():
        def wire(msg: dict, buffers: list | None = None, name: str = name, send=view._send) -> None:
            sent[name] += len(json.dumps(msg, default=repr)) + sum(memoryview(b).nbytes for b in buffers or [])
            send(msg, buffers)
        view._send = wire

    def update() -> float:
        t = time.thread_time()
        dash._refresh(follow=True)
        return time.thread_time() - t

    for _ in range(args.warmup):
        engine.step()
    first = update()
    times = []
    sent.update(dict.fromkeys(sent, 0))
    for _ in range(args.updates):
        for _ in range(args.every):
            engine.step()
        times.append(update())
    dash.detach()
    print(f"{args.requests} requests, {args.num_kv_blocks:,} blocks: first update after {args.warmup} steps "
          f"{first * 1e3:.1f} ms CPU; then one every {args.every} steps: median {statistics.median(times) * 1e3:.1f} ms "
          f"(min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f}) over {len(times)}")
    print("bytes per update (mean): " + ", ".join(f"{name} {n / len(times) / 1024:.1f} KiB" for name, n in sent.items())
          + f"; all {sum(sent.values()) / len(times) / 1024:.1f} KiB")


if __name__ == "__main__":
    main()
