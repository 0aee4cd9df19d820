"""Where a decode step's time goes: the host's work per step, phase by phase, and (on a GPU)
the top kernels.

Both modes print the host's work per step: wall time per step less the time spent waiting
for the device's tokens, split into the engine's phases (timed by wrapping the scheduler's
and the executor's entry points, so the script also runs against older checkouts):
``schedule`` (``Scheduler.schedule``), ``launch`` (``execute_async``/``execute``: packing
and uploading the inputs, the forward pass's launch, the sampler's launch; the runner's own
``prepare_s``/``forward_s``/``sample_s`` split it), ``read back`` (``result()``: the wait for
the tokens and turning them into Python), ``update`` (``Scheduler.update_from_output``) and
``engine`` (the rest of ``LLMEngine.step``: outputs, text, hooks).

``--tiny`` keeps the config's KV geometry but shrinks the model to one thin layer (and the
vocabulary to ``--vocab``), so the forward pass costs next to nothing and what is left is the
host's work: on CPU this is the harness for the runner's launch path without a GPU (there the
model's forward, timed as the ``forward`` phase around ``ModelRunner._forward``, is left out of
the host work, as a GPU would run it asynchronously; attention over the history still costs
milliseconds on CPU; ``--clock thread`` keeps a busy machine's neighbours out of the figures);
on a GPU it measures the same host work with a device that is never the bottleneck.

The script needs nothing from its folder, so one copy of it can time two checkouts alternately
(before/after in one call): ``cd CHECKOUT && PYTHONPATH=$PWD python /tmp/profile_decode.py ...``.
On CUDA the runner's ``sample_s`` includes the read back (the wait for the tokens).
``--captured-draw`` captures the LM head and the draw in the decode graphs
(``kvscope.runner.cuda_graphs.CAPTURE_DRAW``) and ``--cublas`` sends every matmul to cuBLAS
(``kvscope.kernels.triton_linear.USE_SKINNY_LINEAR``), for A/B runs of one tree in one call. It also
counts the steps whose graph inputs the runner moved on in place instead of uploading them
(``ModelRunner._advance``; 0 on CPU, where no graph runs, and on trees without it).
It times a fixed pure-Python loop on the same clock (``host reference``) before and after the
timed steps and gives the host work per step in units of their mean, which stays comparable
across hosts of different speed; when the two differ by more than a fifth, the host changed
speed during the run, and it says so. ``--cprofile N`` then runs as many steps again under
cProfile (after the timed ones, which it would slow) and prints the N functions with the most
own time (``--cprofile-sort cumulative``: with the most time including their callees).

    python benchmarks/profile_decode.py --config benchmarks/configs/qwen3-0.6b --seqs 256 --prompt 900
    python benchmarks/profile_decode.py --config benchmarks/configs/qwen3-small-kv --seqs 32 --async-scheduling
    python benchmarks/profile_decode.py --config benchmarks/configs/qwen3-small-kv --tiny --vocab 64 \\
        --device cpu --clock thread --seqs 256 --prompt 128 --steps 60 --async-scheduling --no-profile
    python benchmarks/profile_decode.py --config benchmarks/configs/qwen3-small-kv --seqs 256 --prompt 1024 \\
        --async-scheduling --no-profile --repetition-penalty 1.05
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import random
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

RUNNER_TIMINGS = ("prepare_s", "forward_s", "sample_s")


def add_ab_flags(ap: argparse.ArgumentParser) -> None:
    """The A/B flags the profiling scripts share: each turns one engine default around."""
    ap.add_argument("--captured-draw", action="store_true",
                    help="capture the LM head and the draw in the decode graphs (CAPTURE_DRAW)")
    ap.add_argument("--cublas", action="store_true",
                    help="every matmul through F.linear, none through kvscope's own for few rows "
                         "(triton_linear.USE_SKINNY_LINEAR)")


def apply_ab_flags(args: argparse.Namespace) -> None:
    """Set the switches :func:`add_ab_flags`'s flags ask for, before an engine is built."""
    if args.captured_draw:
        from kvscope.runner import cuda_graphs
        cuda_graphs.CAPTURE_DRAW = True
    if args.cublas:
        from kvscope.kernels import triton_linear
        triton_linear.USE_SKINNY_LINEAR = False


def write_checkpoint(config_dir: str, out_dir: Path, device: str, tiny: bool, vocab: int, layers: int) -> None:
    """Random weights for ``config_dir``'s architecture; ``tiny``: one thin layer, same KV heads."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(config_dir)
    if tiny:
        cfg = AutoConfig.from_pretrained(
            config_dir, num_hidden_layers=layers, hidden_size=64, intermediate_size=64, vocab_size=vocab,
            num_attention_heads=cfg.num_key_value_heads, max_window_layers=layers, layer_types=["full_attention"] * layers)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    model.save_pretrained(out_dir)
    del model
    gc.collect()


def prefill(engine, prompts: list[list[int]], params) -> None:
    """Add ``prompts`` to ``engine`` and step until every prompt is computed: what follows are
    decode steps of all of them."""
    for p in prompts:
        engine.add_request(p, params, final_only=True)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()


class _Phases:
    """Times the engine's phases by wrapping their entry points on the live objects, with
    ``clock`` (wall time, or this thread's CPU time, which the neighbours of a shared machine
    do not inflate). On CPU the model's forward (``ModelRunner._forward``) is timed too: it is
    compute a GPU would run asynchronously, so it is left out of the host work."""

    def __init__(self, engine, cuda: bool, clock, async_scheduling: bool) -> None:
        self.t: dict[str, list[float]] = defaultdict(list)
        self.runner: dict[str, list[float]] = defaultdict(list)
        self.recording = False
        self.clock = clock
        sched, ex = engine.scheduler, engine.executor
        sched.schedule = self._timed("schedule", sched.schedule)
        sched.update_from_output = self._timed("update", sched.update_from_output)
        self.advanced = 0  # steps whose graph inputs moved on in place (trees with ModelRunner._advance)
        if hasattr(ex, "_advance"):
            ex._advance = self._counted(ex._advance)
        if not cuda and hasattr(ex, "_forward"):
            ex._forward = self._timed("forward", ex._forward)
        if not async_scheduling:  # (execute calls execute_async: wrap only the one the engine calls)
            ex.execute = self._timed("launch", ex.execute, self._keep_timings)
            return
        launch = self._timed("launch", ex.execute_async)

        def execute_async(out):
            return _TimedHandle(self._timed("read back", launch(out).result, self._keep_timings))
        ex.execute_async = execute_async

    def _keep_timings(self, result) -> None:
        for k in RUNNER_TIMINGS:
            if k in result.timings:
                self.runner[k].append(result.timings[k])

    def _counted(self, advance):
        def wrapper(*a, **kw):
            step = advance(*a, **kw)
            self.advanced += self.recording and step is not None
            return step
        return wrapper

    def _timed(self, name, fn, then=None):
        def wrapper(*a, **kw):
            t = self.clock()
            r = fn(*a, **kw)
            if self.recording:
                self.t[name].append(self.clock() - t)
                if then is not None:
                    then(r)
            return r
        return wrapper


class _TimedHandle:
    """A launched step whose ``result()`` is timed as the read back."""

    def __init__(self, result) -> None:
        self.result = result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="benchmarks/configs/qwen3-0.6b")
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=900)
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--repetition-penalty", type=float, default=1.0,
                    help="every row's repetition_penalty: the penalties' token counts, kept per sequence")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="one thin layer: the forward costs next to nothing")
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary size with --tiny")
    ap.add_argument("--layers", type=int, default=1, help="decoder layers with --tiny")
    ap.add_argument("--eager", action="store_true")
    add_ab_flags(ap)
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--no-profile", action="store_true", help="skip the torch profiler's table")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="then run as many steps again under cProfile and print the N functions "
                         "with the most own time (the host's hot spots)")
    ap.add_argument("--cprofile-sort", default="tottime", choices=("tottime", "cumulative"),
                    help="order --cprofile's functions by own time or by time including their callees")
    ap.add_argument("--clock", default="wall", choices=("wall", "thread"),
                    help="thread: time phases in this thread's CPU time (CPU runs on a shared machine)")
    args = ap.parse_args()
    apply_ab_flags(args)
    from kvscope import LLM, SamplingParams

    cuda = args.device == "cuda"
    rng = random.Random(0)
    decode_steps = args.steps * (2 if args.cprofile else 1)
    max_len = args.prompt + decode_steps + 64
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(args.config, Path(tmp), args.device, args.tiny, args.vocab, args.layers)
        llm = LLM(tmp, skip_tokenizer_init=True, max_model_len=max(max_len, 4096 if cuda else 0),
                  max_num_batched_tokens=16384, device=args.device, enforce_eager=args.eager,
                  async_scheduling=args.async_scheduling, max_num_seqs=max(256, args.seqs),
                  num_kv_blocks=None if cuda else args.seqs * -(-max_len // 16) + 64)
        prompts = [[rng.randrange(10000) % llm.hf_config.vocab_size for _ in range(args.prompt)]
                   for _ in range(args.seqs)]
        params = SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=decode_steps + 32,
                                repetition_penalty=args.repetition_penalty)
        engine = llm.llm_engine
        prefill(engine, prompts, params)
        clock = time.perf_counter if args.clock == "wall" else time.thread_time
        phases = _Phases(engine, cuda, clock, args.async_scheduling)
        for _ in range(5):
            engine.step()
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        sync()
        gc.collect()
        reference_before = reference_loop_s(clock)
        phases.recording = True
        steps = phases.t["step"]
        step = phases._timed("step", engine.step)
        for _ in range(args.steps):
            step()
        phases.recording = False
        _report(args, steps, phases, cuda, reference_before)
        if args.cprofile:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args.steps):
                engine.step()
            sync()
            profiler.disable()
            pstats.Stats(profiler).sort_stats(args.cprofile_sort).print_stats(args.cprofile)
        if not args.no_profile:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=activities) as prof:
                for _ in range(10):
                    engine.step()
                sync()
            key = "cuda_time_total" if cuda and not args.async_scheduling else "self_cpu_time_total"
            print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))
        llm.shutdown()


def _report(args, steps: list[float], phases: _Phases, cuda: bool, reference_before: float) -> None:
    ms = lambda xs: statistics.median(xs) * 1e3
    t = phases.t
    # What is not the host's own work: on CUDA the wait for the device, known only as a whole
    # (under async scheduling the read back of the step launched before, all of it counted as
    # waiting; synchronously the runner's ``sample_s``, the sampler's launch and then the wait);
    # on CPU the model's forward, which a GPU would run asynchronously.
    if not cuda:
        waits, what = t["forward"], "the model's forward on CPU"
    elif args.async_scheduling:
        waits, what = t["read back"], "waiting for the device"
    else:
        waits, what = phases.runner["sample_s"], "sampling and waiting for the device"
    host = [s - w for s, w in zip(steps, waits)]
    mode = "async scheduling" if args.async_scheduling else "synchronous"
    print(f"{mode}, {args.seqs} seqs, {args.device}{', tiny model' if args.tiny else ''}, {args.clock} clock: "
          f"{ms(steps):.3f} ms per decode step (median of {len(steps)}), {what} {ms(waits):.3f} ms; "
          f"host work per step {ms(host):.3f} ms (mean {statistics.mean(host) * 1e3:.3f})")
    named = {k: t[k] for k in ("schedule", "launch", "forward", "read back", "update") if len(t[k]) == len(steps)}
    if "forward" in named:
        named["launch"] = [a - b for a, b in zip(named["launch"], named["forward"])]
    named["engine"] = [s - sum(v[i] for v in named.values()) for i, s in enumerate(steps)]
    print(f"{args.seqs} seqs, phases (median ms): " + ", ".join(f"{k} {ms(v):.3f}" for k, v in named.items())
          + "; runner's own timings: " + ", ".join(f"{k} {ms(v):.3f}" for k, v in phases.runner.items())
          + f"; graph inputs advanced in place in {phases.advanced} of {len(steps)} steps")
    print(describe_reference(reference_before, reference_loop_s(phases.clock), statistics.median(host)))


REFERENCE_ADDS = 10**6


def reference_loop_s(clock: Callable[[], float]) -> float:
    """Median time, on ``clock``, of seven runs of ``REFERENCE_ADDS`` Python additions: the host's
    speed at the kind of work the control plane does, so host work per step compares across hosts,
    and across processes of one host, whose speed differs (bench_control_plane.py uses it too)."""
    times = []
    for _ in range(7):
        t, x = clock(), 0
        for i in range(REFERENCE_ADDS):
            x += i
        times.append(clock() - t)
    return statistics.median(times)


def describe_reference(before: float, after: float, per_step: float) -> str:
    """One line: the reference before and after the measured steps (flagged when they differ
    by more than a fifth) and ``per_step`` seconds in units of their mean."""
    changed = max(before, after) > 1.2 * min(before, after)
    return (f"host reference: {REFERENCE_ADDS:,} Python additions take {before * 1e3:.3f} ms on this clock "
            f"before the timed steps, {after * 1e3:.3f} ms after"
            + (" (the host changed speed during the run)" if changed else "")
            + f"; host work per step = {per_step / ((before + after) / 2):.3f} of their mean")


if __name__ == "__main__":
    main()
