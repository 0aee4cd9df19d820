"""Input packing per decode step (``build_step_inputs``), the runner's host work before upload.

256 decoding sequences whose tables hold ~58 blocks (context ~930 at block_size 16) and gain a
block every 16 steps; median over 5 rounds of ``--steps`` steps. Runs against older kvscope
checkouts too (before the block-table cache, ``build_step_inputs`` took no cache), so the same
script measures a change: ``PYTHONPATH=<old checkout> python benchmarks/bench_step_inputs.py``.

    python benchmarks/bench_step_inputs.py [--seqs 256] [--blocks 58] [--steps 200]
"""
from __future__ import annotations

import argparse
import statistics
import time

from kvscope.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from kvscope.runner import inputs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=58)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    bs = 16
    tables = [list(range(i * 4096, i * 4096 + args.blocks)) for i in range(args.seqs)]
    steps = []
    for s in range(args.steps):
        if s % bs == 0:
            for t in tables:
                t.append(t[-1] + 1)
        steps.append(SchedulerOutput(step=s, requests=[
            ScheduledRequest(seq_id=i, token_ids=[5], start=bs * len(t) - 3, block_table=t,
                             is_prefill=False, sample=True) for i, t in enumerate(tables)]))
    cache = (inputs.BlockTableCache(),) if hasattr(inputs, "BlockTableCache") else ()
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for out in steps:
            inputs.build_step_inputs(out, bs, *cache)
        rounds.append((time.perf_counter() - t) / len(steps) * 1e6)
    print(f"{inputs.__file__}: {statistics.median(rounds):.0f} us/step packing {args.seqs} decode rows "
          f"of ~{args.blocks} blocks")


if __name__ == "__main__":
    main()
