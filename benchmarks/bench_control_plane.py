"""Control-plane cost per step: schedule + block manager + input packing + post-processing.

256 sequences run with a model that does no compute (NullExecutor), so the time per step is
exactly what the CPU side of the engine adds to every forward pass.

    python benchmarks/bench_control_plane.py [--seqs 256] [--prompt 512] [--steps 200] [--profile 25]

On a shared machine wall time swings with the neighbours' load, so besides the mean it prints
the median over windows of ``block_size`` steps (each window holds one step where every
sequence crosses into a new block) and the process's CPU time per step. It also prints the
lower-quartile window on this thread's clock, split into the scheduler's ``schedule`` and
``update_from_output``, and the host reference (``profile_decode.reference_loop_s``) before and
after the timed steps: the 2-core machine's speed has swung by 2x between processes, and this
is the figure to compare across them. A full garbage collection owed to the setup is run before
the clock starts, so it does not land in the timed steps; the collections the steps themselves
cause are counted in.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

from kvscope.config import EngineConfig
from kvscope.engine.llm_engine import LLMEngine
from kvscope.runner.null_executor import NullExecutor
from kvscope.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from profile_decode import describe_reference, reference_loop_s  # noqa: E402


class _NoTokenizer:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return ""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--hooks", action="store_true", help="attach a no-op step.end hook")
    ap.add_argument("--record", default=None, choices=("summary", "blocks", "full"),
                    help="record a trace at this level while timing (its cost per step)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="cProfile the timed steps and print the N functions with the most own time")
    args = ap.parse_args()

    max_len = args.prompt + args.steps + 64
    blocks = args.seqs * (-(-max_len // args.block_size)) + 64
    config = EngineConfig.from_kwargs(block_size=args.block_size, max_num_seqs=args.seqs,
                                      max_num_batched_tokens=args.seqs * args.prompt)
    engine = LLMEngine(config, NullExecutor(blocks, 32000, args.block_size), _NoTokenizer(), max_len)
    if args.hooks:
        engine.hooks.add("step.end", lambda info: None)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.steps + 32, ignore_eos=True)
    for _ in range(args.seqs):
        engine.add_request([rng.randrange(1, 32000) for _ in range(args.prompt)], params, final_only=True)
    engine.step()  # admit and prefill everyone
    assert len(engine.scheduler.running) == args.seqs
    recorder = None
    if args.record:
        from kvscope.trace.recorder import Recorder

        recorder = Recorder(engine, args.record)
        recorder.start()
    phases = _thread_phases(engine.scheduler, ("schedule", "update_from_output"))
    gc.collect()
    reference_before = reference_loop_s(time.thread_time)
    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        profiler.enable()
    windows, thread_windows = [], []
    c0 = time.process_time()
    t0 = time.perf_counter()
    for start in range(0, args.steps, args.block_size):
        tw, tt, before = time.perf_counter(), time.thread_time(), dict(phases)
        n = min(args.block_size, args.steps - start)
        for _ in range(n):
            engine.step()
        windows.append((time.perf_counter() - tw) / n)
        thread_windows.append(((time.thread_time() - tt) / n, *((phases[k] - before[k]) / n for k in phases)))
    dt = (time.perf_counter() - t0) / args.steps
    cpu = (time.process_time() - c0) / args.steps
    if profiler is not None:
        profiler.disable()
    if recorder is not None:
        recorder.stop()
    print(f"control plane: {dt * 1e6:.0f} us/step with {args.seqs} running sequences "
          f"(decode, block_size {args.block_size}, prompt {args.prompt})"
          + (f", recording at {args.record!r}" if args.record else ""))
    print(f"  median of {len(windows)} windows: {statistics.median(windows) * 1e6:.0f} us/step; "
          f"cpu time {cpu * 1e6:.0f} us/step")
    step, schedule, update = sorted(thread_windows)[len(thread_windows) // 4]
    print(f"  thread clock, lower-quartile window: {step * 1e6:.0f} us/step (schedule {schedule * 1e6:.0f}, "
          f"update {update * 1e6:.0f})")
    print("  " + describe_reference(reference_before, reference_loop_s(time.thread_time), step))
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)


def _thread_phases(scheduler, names: tuple[str, ...]) -> dict[str, float]:
    """Wrap ``scheduler``'s methods ``names`` to add their thread-clock seconds to the dict returned."""
    spent = dict.fromkeys(names, 0.0)
    for name in names:
        def timed(*a, _fn=getattr(scheduler, name), _name=name, **kw):
            t = time.thread_time()
            try:
                return _fn(*a, **kw)
            finally:
                spent[_name] += time.thread_time() - t
        setattr(scheduler, name, timed)
    return spent


if __name__ == "__main__":
    main()
