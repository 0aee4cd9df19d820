"""``Trace.lifecycle`` read live after each step, once the ring buffer has wrapped, with a long
waiting queue: this checkout's read against the lifecycle builder of another commit (``--before``)
read the way that commit's trace read it (a fresh builder over every held step whenever the
oldest step changed), alternating in one process, each read checked to give the same table.

The engine is the tiny test model at a GPU-sized pool (tests/engine_helpers.make_llm, as
``/tmp/kvs40/longrun.py`` drove the dashboard); it runs ``--max-steps + --reads`` steps once,
recorded, and the reads then slide a window of ``--max-steps`` over those records.

    python benchmarks/bench_lifecycle.py --before 3b41ac8
"""
from __future__ import annotations

import argparse
import bisect
import random
import statistics
import subprocess
import sys
import time
import types
from operator import attrgetter
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from engine_helpers import greedy, make_llm  # noqa: E402

from kvscope.trace import Trace  # noqa: E402
from kvscope.trace.tables import frame  # noqa: E402

_STEP = attrgetter("step")


def workload(num_requests: int, seed: int = 0) -> tuple[list[list[int]], list]:
    """Prompts of 50-346 tokens, two thirds sharing some of a 96-token system prompt; 30-149 outputs."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 300) for _ in range(96)]
    prompts = [system[: rng.choice([0, 32, 96])] + [rng.randrange(3, 300) for _ in range(rng.randrange(50, 250))]
               for _ in range(num_requests)]
    return prompts, [greedy(rng.randrange(30, 150)) for _ in prompts]


def record(num_requests: int, num_steps: int) -> tuple[dict, list]:
    llm = make_llm(num_kv_blocks=150_000, block_size=1, max_num_seqs=256, max_num_batched_tokens=4096,
                   validate=False)
    for prompt, params in zip(*workload(num_requests)):
        llm.add_request(prompt, params)
    with llm.record("blocks", max_steps=num_steps) as trace:
        for _ in range(num_steps):
            llm.step()
    return trace.meta, trace._records()


class Window:
    """A trace source holding the records of a ring buffer of ``size`` after ``records[k]``."""

    def __init__(self, records: list, size: int) -> None:
        self.records, self.size, self.k = records, size, 0

    def view(self, with_baseline: bool = False) -> tuple[list, None, int | None]:
        lo = max(0, self.k + 1 - self.size)
        return self.records[lo:self.k + 1], None, self.records[lo - 1].step if lo else None


class BeforeRead:
    """``Trace.lifecycle`` as the ``--before`` commit read it, with that commit's builder."""

    def __init__(self, commit: str) -> None:
        source = subprocess.run(["git", "show", f"{commit}:kvscope/trace/lifecycle.py"], cwd=ROOT,
                                check=True, capture_output=True, text=True).stdout
        module = types.ModuleType("lifecycle_before")
        exec(compile(source, f"{commit}:kvscope/trace/lifecycle.py", "exec"), module.__dict__)
        self.builder_class, self.builder = module.LifecycleBuilder, None

    def read(self, recs: list) -> pd.DataFrame:
        b = self.builder
        if b is None or b.first_step != recs[0].step or (b.last_step or -1) > recs[-1].step:
            b = self.builder = self.builder_class()
        for rec in recs[bisect.bisect_right(recs, b.last_step, key=_STEP) if b.last_step is not None else 0:]:
            b.add(rec)
        return frame("lifecycle", b.rows())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the commit whose builder is the 'before'")
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--max-steps", type=int, default=2000, help="the ring buffer (the dashboard's default)")
    ap.add_argument("--reads", type=int, default=20, help="live reads timed after the ring buffer wrapped")
    args = ap.parse_args()
    t = time.perf_counter()
    meta, records = record(args.requests, args.max_steps + args.reads)
    print(f"recorded {len(records)} steps in {time.perf_counter() - t:.0f} s", flush=True)
    window = Window(records, args.max_steps)
    after, before = Trace(meta, window), BeforeRead(args.before)
    window.k = args.max_steps - 1  # both builders take in the first full window (untimed)
    recs = window.view()[0]
    before.read(recs)
    after.lifecycle  # noqa: B018
    times: dict[str, list[float]] = {"before": [], "after": []}
    for i in range(args.reads):
        window.k = args.max_steps + i  # the ring buffer drops a step each time
        recs = window.view()[0]
        tables = {}
        for name in (("before", "after") if i % 2 else ("after", "before")):
            t = time.perf_counter()
            tables[name] = before.read(recs) if name == "before" else after.lifecycle
            times[name].append(time.perf_counter() - t)
        pd.testing.assert_frame_equal(tables["before"], tables["after"])
        print(f"step {recs[-1].step}: {len(recs)} held, {len(recs[-1].waiting)} waiting, "
              f"{len(tables['after'])} rows; before {1000 * times['before'][-1]:.1f} ms, "
              f"after {1000 * times['after'][-1]:.1f} ms", flush=True)
    for name, ts in times.items():
        print(f"{name}: median {1000 * statistics.median(ts):.1f} ms, min {1000 * min(ts):.1f}, "
              f"max {1000 * max(ts):.1f} ({len(ts)} reads)")


if __name__ == "__main__":
    main()
