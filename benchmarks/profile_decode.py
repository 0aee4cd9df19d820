"""Where a decode step's time goes on a GPU: host phases (from step.end timings) and top kernels.

Both modes print the host's work per step: in synchronous mode the sum of the host phases
(schedule, input preparation, post-processing); with ``--async-scheduling`` no hook is attached
(a hook makes the engine step synchronously), so it prints the wall time per step, the part
spent waiting for the GPU's tokens, and the rest, which is the host's; then the host calls that
cost the most CPU time (a blocking ``cudaStreamSynchronize`` / ``cudaHostAlloc`` there means the
overlap is lost).

    python benchmarks/profile_decode.py --config benchmarks/configs/qwen3-0.6b --seqs 256 --prompt 900
    python benchmarks/profile_decode.py --config benchmarks/configs/qwen3-small-kv --seqs 32 --async-scheduling
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench_throughput import write_random_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="benchmarks/configs/qwen3-0.6b")
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=900)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--async-scheduling", action="store_true")
    args = ap.parse_args()
    from kvscope import LLM, SamplingParams

    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        write_random_checkpoint(args.config, Path(tmp))
        llm = LLM(tmp, skip_tokenizer_init=True, max_model_len=4096, max_num_batched_tokens=16384,
                  enforce_eager=args.eager, async_scheduling=args.async_scheduling)
        prompts = [[rng.randrange(10000) for _ in range(args.prompt)] for _ in range(args.seqs)]
        params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=10_000 // 10)
        engine = llm.llm_engine
        for p in prompts:
            engine.add_request(p, params, final_only=True)
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
            engine.step()
        if args.async_scheduling:
            _profile_async(llm)
            return
        timings = []
        hook = llm.hooks.add("step.end", lambda info: timings.append(
            info.timings | {"dur": info.duration_s, "graph": info.cuda_graph}))
        for _ in range(10):
            engine.step()
        hook.remove()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                engine.step()
            torch.cuda.synchronize()
        keys = ["schedule_s", "prepare_s", "forward_s", "sample_s", "postprocess_s", "dur"]
        print(f"{args.seqs} seqs at context ~{args.prompt + 10}: per decode step (median of {len(timings)}), "
              f"cuda graph used: {timings[-1]['graph']}")
        for k in keys:
            print(f"  {k:14s} {statistics.median(t.get(k, 0.0) for t in timings) * 1e3:8.3f} ms")
        host = statistics.median(sum(t.get(k, 0.0) for k in ("schedule_s", "prepare_s", "postprocess_s")) for t in timings)
        print(f"  host work per step (schedule + prepare + postprocess): {host * 1e3:.3f} ms")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
        llm.shutdown()


class _TimedWaits:
    """Wraps the executor so each launched step's ``result()`` (the wait for its tokens) is timed."""

    def __init__(self, executor) -> None:
        self.launch, self.waits = executor.execute_async, []
        executor.execute_async = self._execute_async

    def _execute_async(self, out):
        handle = self.launch(out)
        waits = self.waits

        class Timed:
            def result(self):
                t = time.perf_counter()
                r = handle.result()
                waits.append(time.perf_counter() - t)
                return r
        return Timed()


def _profile_async(llm) -> None:
    step = llm.llm_engine.step
    timed = _TimedWaits(llm.llm_engine.executor)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    walls = []
    timed.waits.clear()
    for _ in range(20):
        t = time.perf_counter()
        step()
        walls.append(time.perf_counter() - t)
    host = [w - wait for w, wait in zip(walls, timed.waits)]  # each step reads back one launched step
    print(f"async scheduling: {statistics.median(walls) * 1e3:.3f} ms per decode step (median of 20), "
          f"of which waiting for the GPU's tokens {statistics.median(timed.waits) * 1e3:.3f} ms; "
          f"host work per step {statistics.median(host) * 1e3:.3f} ms")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    llm.shutdown()


if __name__ == "__main__":
    main()
