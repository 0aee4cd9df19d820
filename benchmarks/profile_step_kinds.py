"""Where nano-vLLM's benchmark workload spends its time, by kind of step.

The workload of ``bench_throughput.py`` (256 requests, lengths uniform in [100, 1024]) on a
random-weight checkpoint, after the same warm-up. Each ``engine.step()`` is timed and filed under
the kind of step the device was running: the one it launched itself when stepping
synchronously, the one launched a step earlier under ``--async-scheduling`` (a step's wall time
is then mostly the wait for that one). Kinds: ``prefill`` (every row a prompt chunk), ``mixed``
(prompt chunks beside decode rows) and ``decode``; decode steps are also split by their number
of rows, as medians, with each bucket's step count and total (``decode_floor.py`` prints its
floor in the same buckets).

``--no-pdl`` launches the Triton kernels without programmatic dependent launch, for A/B runs in
one call (``kvscope.kernels.pdl.USE_PDL``); ``--captured-draw`` captures the LM head and the
draw in the decode graphs (``kvscope.runner.cuda_graphs.CAPTURE_DRAW``); ``--cublas`` sends
every matmul to cuBLAS (``kvscope.kernels.triton_linear.USE_SKINNY_LINEAR``).

``--runs N`` times the workload N times in the one process, each run with its five slowest
steps: the benchmarks time one run after a short warm-up, and whatever a first run pays once
(a compilation, a graph's first launch, a collection) shows as a run slower than the next.

``--busy`` then runs the workload once more (on an emptied prefix cache) under the torch profiler and prints how much of the
run the device was busy, and its idle time split into gaps shorter than ``--host-gap-us`` (the
boundaries between kernels) and longer ones (the device waiting for the host). The profiler
slows the host, so the busy share it reports is a lower bound: it says whether the control
plane keeps the device fed, and therefore whether a faster run needs faster kernels or a faster
host. It ends with the bound that busy time sets (the workload's tokens over it) as a share of
the roofline (``bench_throughput.roofline_tok_s`` at the copy bandwidth, over the timed run's
steps), and how much of that bound the last timed run reached.

    python benchmarks/profile_step_kinds.py --config benchmarks/configs/qwen3-0.6b --async-scheduling
    python benchmarks/profile_step_kinds.py --config benchmarks/configs/qwen3-small-kv --async-scheduling --no-pdl
    python benchmarks/profile_step_kinds.py --config benchmarks/configs/qwen3-small-kv --async-scheduling --busy
    python benchmarks/profile_step_kinds.py --config benchmarks/configs/qwen3-0.6b --async-scheduling --runs 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).parent))
from bench_throughput import (copy_bandwidth, roofline_tok_s, timed_generate, workload,  # noqa: E402
                              write_random_checkpoint)
from profile_decode import add_ab_flags, apply_ab_flags  # noqa: E402
from profile_gaps import device_events, idle_gaps, print_idle_pairs  # noqa: E402

ROW_BUCKETS = ((200, 1 << 30), (128, 199), (64, 127), (32, 63), (8, 31), (1, 7))


class StepKinds:
    """Wraps a live engine's ``schedule`` and ``step`` to file each step's wall time under the
    kind of step the device ran meanwhile."""

    def __init__(self, engine, async_scheduling: bool) -> None:
        self.kinds: list[tuple[str, int]] = []
        self.times: list[tuple[tuple[str, int], float]] = []
        lag = 2 if async_scheduling else 1  # how many schedules back the step being waited for is
        schedule, step = engine.scheduler.schedule, engine.step

        def timed_schedule():
            out = schedule()
            prefill = sum(r.is_prefill for r in out.requests)
            kind = "decode" if not prefill else ("prefill" if prefill == len(out.requests) else "mixed")
            self.kinds.append((kind, len(out.requests)))
            return out

        def timed_step():
            t = time.perf_counter()
            result = step()
            if self.kinds:
                self.times.append((self.kinds[max(0, len(self.kinds) - lag)], time.perf_counter() - t))
            return result

        engine.scheduler.schedule, engine.step = timed_schedule, timed_step

    def report(self) -> str:
        by_kind: dict[str, list[float]] = {}
        decode_rows, decode_s = [], []
        for (kind, rows), dt in self.times:
            by_kind.setdefault(kind, []).append(dt)
            if kind == "decode":
                decode_rows.append(rows)
                decode_s.append(dt)
        kinds = ", ".join(f"{k} {len(v)} steps {sum(v):.3f} s" for k, v in by_kind.items())
        slowest = ", ".join(f"{k} of {rows} rows {dt * 1e3:.1f} ms"
                            for (k, rows), dt in sorted(self.times, key=lambda t: -t[1])[:5])
        return (f"{kinds}\ndecode step medians: {describe_decode_steps(decode_rows, decode_s)}\n"
                f"slowest steps: {slowest}")

    def clear(self) -> None:
        self.kinds.clear()
        self.times.clear()


def describe_decode_steps(rows: Sequence[int], seconds: Sequence[float]) -> str:
    """Decode steps (``rows`` and ``seconds`` per step) by ``ROW_BUCKETS``: each bucket's median
    step, step count and total; ``decode_floor.py`` words its floor with it too."""
    by_rows: dict[tuple[int, int], list[float]] = {}
    for n, dt in zip(rows, seconds):
        by_rows.setdefault(next(b for b in ROW_BUCKETS if b[0] <= n <= b[1]), []).append(dt)
    return ", ".join(f"{lo}{'+' if hi >= 1 << 30 else f'-{hi}'} rows {statistics.median(v) * 1e3:.2f} ms "
                     f"({len(v)} steps, {sum(v):.3f} s)"
                     for (lo, hi), v in sorted(by_rows.items(), reverse=True))


def print_device_busy(llm, prompts, outs, host_gap_us: float) -> float:
    """Run the workload under the profiler; print the device's busy share of the run and where
    it idled. Returns the device's busy seconds."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    llm.reset_prefix_cache()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        seconds = timed_generate(llm, prompts, outs)
    torch.cuda.synchronize()
    span, busy, gaps = idle_gaps(device_events(prof))
    long_gaps = [g for g, _, _ in gaps if g >= host_gap_us]
    short_idle = sum(g for g, _, _ in gaps) - sum(long_gaps)
    print(f"profiled run {seconds:.3f} s; device busy {busy / 1e6:.3f} s of its {span / 1e6:.3f} s span "
          f"({busy / span:.1%}); idle {short_idle / 1e6:.3f} s in {len(gaps) - len(long_gaps):,} gaps under "
          f"{host_gap_us:g} us, {sum(long_gaps) / 1e6:.3f} s in {len(long_gaps):,} longer ones")
    print_idle_pairs([g for g in gaps if g[0] >= host_gap_us], 1, 6, per="in the run")
    return busy / 1e6


def print_busy_bound(busy_s: float, timed_tok_s: float, roofline: float, bw: float, tokens: int) -> None:
    """What the device's own work allows: the workload's tokens over its busy seconds, against
    the roofline and the timed run. A run near this bound is the kernels' to speed up, not the
    control plane's."""
    bound = tokens / busy_s
    print(f"the device's own work allows at most {bound:,.0f} tok/s: {bound / roofline:.1%} of the "
          f"{roofline:,.0f} tok/s roofline ({bw / 1e12:.2f} TB/s); the last timed run reached {timed_tok_s / bound:.1%} "
          "of it")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="benchmarks/configs/qwen3-0.6b")
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--no-pdl", action="store_true", help="launch the Triton kernels without PDL")
    ap.add_argument("--runs", type=int, default=1,
                    help="time the workload this many times in the process (what the first run pays once)")
    ap.add_argument("--busy", action="store_true", help="profile a second run: the device's busy and idle time")
    ap.add_argument("--host-gap-us", type=float, default=20.0, help="an idle gap this long or longer is a wait for the host")
    add_ab_flags(ap)
    args = ap.parse_args()
    if args.no_pdl:
        from kvscope.kernels import pdl
        pdl.USE_PDL = False
    apply_ab_flags(args)
    from kvscope import LLM, SamplingParams

    prompts, outs = workload()
    warm, _ = workload(num_seqs=32, seed=1)
    bw = copy_bandwidth() if args.busy else 0.0  # (before the engine takes the device's memory)
    with tempfile.TemporaryDirectory() as tmp:
        write_random_checkpoint(args.config, Path(tmp))
        llm = LLM(tmp, skip_tokenizer_init=True, max_model_len=4096, max_num_seqs=256,
                  max_num_batched_tokens=16384, async_scheduling=args.async_scheduling)
        llm.generate(warm, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=16), use_tqdm=False)
        kinds = StepKinds(llm.llm_engine, args.async_scheduling)
        mode = "async scheduling" if args.async_scheduling else "synchronous"
        knobs = ((", no PDL" if args.no_pdl else "") + (", captured draw" if args.captured_draw else "")
                 + (", cuBLAS only" if args.cublas else ""))
        for run in range(1, args.runs + 1):
            kinds.clear()
            llm.reset_prefix_cache()  # (a run after the first would find every prompt cached)
            seconds = timed_generate(llm, prompts, outs)
            print(f"{args.config}, {mode}{knobs}, run {run}: {sum(outs) / seconds:,.0f} output tok/s, "
                  f"{seconds:.3f} s, {len(kinds.times)} steps")
            print(kinds.report())
        if args.busy:
            steps = len(kinds.times)  # the timed run's (the profiled run adds its own)
            busy_s = print_device_busy(llm, prompts, outs, args.host_gap_us)
            cfg = json.loads(Path(args.config, "config.json").read_text())
            roofline = roofline_tok_s(cfg, prompts, outs, steps, bw)
            print_busy_bound(busy_s, sum(outs) / seconds, roofline, bw, sum(outs))
        llm.shutdown()


if __name__ == "__main__":
    main()
