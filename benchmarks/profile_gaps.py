"""Where the GPU idles in steady decode steps: the gaps between one kernel (or copy) and the
next, summed per step and by the pair of neighbours around them.

A decode step is a few hundred kernels; the time between them is what programmatic dependent
launch and CUDA graphs try to hide, and what a change of launch order can stretch (a graph
replayed right behind another one did: benchmarks/RESULTS.md, session 16). The script runs
``--seqs`` random prompts of ``--prompt`` tokens through their prefill, then times ``--steps``
decode steps, unprofiled (wall time per step) and again under the torch profiler, and prints
the device's busy and idle time per step and the neighbour pairs that idle the most.
``--captured-draw`` captures the LM head and the draw in the decode graphs
(``cuda_graphs.CAPTURE_DRAW``), ``--cublas`` sends every matmul to cuBLAS
(``triton_linear.USE_SKINNY_LINEAR``) and ``--sync`` steps synchronously, for A/B runs in one call.

    python benchmarks/profile_gaps.py --config benchmarks/configs/qwen3-0.6b --seqs 32
    python benchmarks/profile_gaps.py --config benchmarks/configs/qwen3-0.6b --seqs 32 --captured-draw
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from profile_decode import add_ab_flags, apply_ab_flags, prefill, write_checkpoint


def idle_gaps(events: list) -> tuple[float, float, list[tuple[float, str, str]]]:
    """(span, busy time, gaps) of device events sorted by start, in µs: a gap is the time from
    the latest end so far to the next start, with the names of the event that ended last and
    of the next one."""
    busy, gaps, end, last = 0.0, [], None, None
    for e in events:
        start, stop = e.time_range.start, e.time_range.end
        if end is not None and start > end:
            gaps.append((start - end, last, e.name))
        busy += max(0.0, stop - max(start, end if end is not None else start))
        if end is None or stop > end:
            end, last = stop, e.name
    return end - events[0].time_range.start, busy, gaps


def device_events(prof: profile) -> list:
    """The profiled run's device events (kernels and copies), sorted by start."""
    return sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)


def print_idle_pairs(gaps: list[tuple[float, str, str]], steps: int, top: int, per: str = "per step") -> None:
    """The ``top`` neighbour pairs that idle the device the most, summed over ``steps`` steps and
    divided by them."""
    pairs: dict[tuple[str, str], list[float]] = {}
    for g, a, b in gaps:
        pairs.setdefault((a[:48], b[:48]), []).append(g)
    for (a, b), gs in sorted(pairs.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"  idle {sum(gs) / steps:9.1f} us {per} over {len(gs) / steps:7.1f} gaps {per}: {a} -> {b}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="benchmarks/configs/qwen3-0.6b")
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=900)
    ap.add_argument("--steps", type=int, default=30)
    add_ab_flags(ap)
    ap.add_argument("--sync", action="store_true", help="step synchronously (default: async scheduling)")
    ap.add_argument("--pairs", type=int, default=8, help="neighbour pairs to list")
    args = ap.parse_args()
    apply_ab_flags(args)
    from kvscope import LLM, SamplingParams

    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(args.config, Path(tmp), "cuda", False, 0, 0)
        llm = LLM(tmp, skip_tokenizer_init=True, max_model_len=max(4096, args.prompt + 2 * args.steps + 32),
                  max_num_seqs=max(256, args.seqs), max_num_batched_tokens=16384, async_scheduling=not args.sync)
        engine = llm.llm_engine
        params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=2 * args.steps + 20)
        prefill(engine, [[rng.randrange(10000) for _ in range(args.prompt)] for _ in range(args.seqs)], params)
        for _ in range(10):
            engine.step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / args.steps * 1e3
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                engine.step()
            torch.cuda.synchronize()
        llm.shutdown()
    span, busy, gaps = idle_gaps(device_events(prof))
    n = args.steps
    mode = (f"{'synchronous' if args.sync else 'async scheduling'}, draw {'in the graph' if args.captured_draw else 'eager'}"
            + (", cuBLAS only" if args.cublas else ""))
    print(f"{args.config}, {args.seqs} seqs, {mode}: {wall:.3f} ms per decode step unprofiled; profiled "
          f"{span / n / 1e3:.3f} ms per step, device busy {busy / n / 1e3:.3f}, idle "
          f"{sum(g for g, _, _ in gaps) / n / 1e3:.3f} ({len(gaps) / n:.0f} gaps per step)")
    print_idle_pairs(gaps, n, args.pairs)


if __name__ == "__main__":
    main()
