"""What recording costs: generation throughput with no recorder and at each trace level.

One engine, one workload (requests sharing a system prompt, so prefix caching, block sharing
and hashing all fire), runs interleaved level by level and repeated, the prefix cache reset
before each run so every run schedules identically. Per level it reports the median
throughput, the median of the per-round ratios to the unrecorded run, the ratio of the best
runs (interference only ever slows a run down), and the share of wall time spent inside the
trace's hooks in one instrumented run, and whether the engine really planned ahead at that
level (``--async-scheduling``: the share of launches made before the previous step's tokens
came back; block-level recording must not turn it off). Goals: <= 3% slower at ``summary``,
<= 10% at ``blocks`` (against the async engine unrecorded) and at ``full``. On CPU the
throughput is per CPU-second of this process (``--threads 1``), which keeps a shared machine's
other jobs out of the ratios.

``--host`` times the recorder alone, with no model (the control plane over a ``NullExecutor``):
``--requests`` decoding sequences, each crossing into a new block every ``block_size`` steps,
so a step carries the block events of a real decode batch. It prints the CPU time per step at
each level and the block events per step: what recording adds to the host's work per step.

Model: ``--model DIR``; or ``--config DIR`` (one of ``benchmarks/configs/``, random bf16
weights: the GPU benchmark's model); else the bundled demo model, else a tiny random Qwen3
checkpoint written to a temp dir (prompts are token ids, so no tokenizer is needed).

    python benchmarks/bench_trace_overhead.py [--device cuda] [--model DIR | --config DIR] [--repeats 15]
    python benchmarks/bench_trace_overhead.py --host [--requests 256] [--async-scheduling]
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

from kvscope import LLM, SamplingParams
from kvscope.engine.hooks import HookRegistry
from kvscope.engine.scheduler_output import PLACEHOLDER
from kvscope.model_source import BUNDLED_MODEL
from kvscope.trace import LEVELS

RUNS = (None, *LEVELS)  # None: no recorder attached


def tiny_random_checkpoint(path: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, intermediate_size=128, vocab_size=512, max_position_embeddings=2048)
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def workload(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    system = [rng.randrange(3, vocab) for _ in range(args.prompt_len // 2)]
    return [system + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, args.prompt_len // 2))]
            for _ in range(args.requests)]


def timed_generate(llm: LLM, prompts: list[list[int]], params: SamplingParams, level: str | None,
                   cuda: bool) -> float:
    """Output tokens per second of one run (recording at ``level`` if given).

    On CPU the clock is this process's CPU time, so other jobs on a shared machine do not
    count; on CUDA it is wall time after a synchronisation.
    """
    llm.reset_prefix_cache()
    clock = time.perf_counter if cuda else time.process_time
    if cuda:
        torch.cuda.synchronize()
    t = clock()
    if level is None:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    else:
        with llm.record(level=level):
            outputs = llm.generate(prompts, params, use_tqdm=False)
    if cuda:
        torch.cuda.synchronize()
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (clock() - t)


@contextlib.contextmanager
def timing_hooks(hooks: HookRegistry) -> Iterator[list[float]]:
    """Seconds spent inside every hook call and block-sink append while in the block (one
    entry, growing): the recorder's own cost, free of the noise of comparing two runs."""
    spent = [0.0]

    def timed(fn: Callable[..., None]) -> Callable[..., None]:
        def wrapper(*args: object, **payload: object) -> None:
            t = time.perf_counter()
            fn(*args, **payload)
            spent[0] += time.perf_counter() - t
        return wrapper

    names = ("fire", "emit_block", "emit_blocks")  # hooks, and block sinks' events and batches
    for name in names:
        setattr(hooks, name, timed(getattr(hooks, name)))
    try:
        yield spent
    finally:
        for name in names:
            delattr(hooks, name)


def hook_share(llm: LLM, prompts: list[list[int]], params: SamplingParams, level: str) -> tuple[float, float]:
    """Fraction of one recorded run's wall time spent inside the trace's hooks, and the fraction
    of its launches planned ahead (decode inputs still on the device: async scheduling at work).

    A second, low-noise view of the cost: it does not depend on comparing two runs on a machine
    whose other jobs come and go (the engine's own payload building is not included).
    """
    llm.reset_prefix_cache()
    executor = llm.llm_engine.executor
    ahead: list[bool] = []
    launch = executor.execute_async

    def watched(out):  # (execute goes through execute_async)
        ahead.append(any(PLACEHOLDER in r.token_ids for r in out.requests))
        return launch(out)

    executor.execute_async = watched
    try:
        with timing_hooks(llm.llm_engine.hooks) as spent:
            t = time.perf_counter()
            with llm.record(level=level):
                llm.generate(prompts, params, use_tqdm=False)
            return spent[0] / (time.perf_counter() - t), sum(ahead) / len(ahead)
    finally:
        del executor.execute_async


def host_cost(args: argparse.Namespace) -> None:
    """``--host``: CPU time per decode step of the control plane, unrecorded and at each level."""
    from bench_control_plane import _NoTokenizer  # this script's folder is on sys.path
    from kvscope.config import EngineConfig
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.runner.null_executor import NullExecutor
    from kvscope.trace.recorder import Recorder

    steps, bs = args.max_tokens, args.block_size
    max_len = args.prompt_len + steps + 64
    config = EngineConfig.from_kwargs(block_size=bs, max_num_seqs=args.requests, async_scheduling=args.async_scheduling,
                                      max_num_batched_tokens=args.requests * args.prompt_len)
    params = SamplingParams(temperature=0, max_tokens=steps + 32, ignore_eos=True)
    cpu: dict[str | None, list[float]] = {r: [] for r in RUNS}
    inside: dict[str | None, list[float]] = {r: [] for r in RUNS}
    events: dict[str, float] = {}
    for i in range(args.repeats):
        for level in RUNS[i % len(RUNS):] + RUNS[:i % len(RUNS)]:
            engine = LLMEngine(config, NullExecutor(args.requests * (-(-max_len // bs)) + 64, 32000, bs),
                               _NoTokenizer(), max_len)
            for prompt in workload(args, 32000):
                engine.add_request(prompt, params, final_only=True)
            for _ in range(3):  # admit, prefill, and (async) fill the pipeline
                engine.step()
            recorder = Recorder(engine, level) if level else None
            if recorder is not None:
                recorder.start()
            gc.collect()
            c0 = time.process_time()
            if i == args.repeats - 1:  # the last round: time inside the hooks instead
                with timing_hooks(engine.hooks) as spent:
                    for _ in range(steps):
                        engine.step()
                inside[level].append(spent[0] / steps)
            else:
                for _ in range(steps):
                    engine.step()
                cpu[level].append((time.process_time() - c0) / steps)
            if recorder is not None:
                events[level] = sum(len(r.block_events or ()) for r in recorder.records) / len(recorder.records)
                recorder.stop()
    print(f"host only (NullExecutor): {args.requests} decoding sequences, prompt <= {args.prompt_len}, "
          f"{steps} steps, block_size {bs}, {args.repeats} rounds"
          + (", async scheduling" if args.async_scheduling else ""))
    base = statistics.median(cpu[None])
    for level in RUNS:
        t = statistics.median(cpu[level])
        extra = "" if level is None else (f", +{(t - base) * 1e6:.0f} us/step recording; inside hooks "
                                          f"{inside[level][0] * 1e6:.0f} us/step, {events[level]:.1f} block events/step")
        print(f"{level or 'no recorder':>12}: {t * 1e6:7.0f} us CPU/step (median){extra}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF model directory (default: bundled demo model)")
    ap.add_argument("--config", default=None, help="a benchmarks/configs/ directory: random bf16 weights (CUDA)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="engine with async scheduling (every level keeps it)")
    ap.add_argument("--host", action="store_true", help="time the recorder alone, with no model (see above)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.host:
        host_cost(args)
        return

    with tempfile.TemporaryDirectory() as tmp:
        if args.config:
            from bench_throughput import write_random_checkpoint  # this script's folder is on sys.path

            write_random_checkpoint(args.config, Path(tmp))
            model = tmp
        else:
            model = args.model or (str(BUNDLED_MODEL) if (BUNDLED_MODEL / "config.json").exists()
                                   else str(tiny_random_checkpoint(Path(tmp))))
        llm = LLM(model, device=args.device, block_size=args.block_size, skip_tokenizer_init=True,
                  dtype="float32" if args.device == "cpu" else "auto", async_scheduling=args.async_scheduling)
        prompts = workload(args, llm.llm_engine.vocab_size)
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        cuda = args.device == "cuda"
        timed_generate(llm, prompts, params, None, cuda)  # warm-up (and CUDA graph capture)
        tok_s: dict[str | None, list[float]] = {r: [] for r in RUNS}
        for i in range(args.repeats):
            for level in RUNS[i % len(RUNS):] + RUNS[:i % len(RUNS)]:  # rotate the order each round
                tok_s[level].append(timed_generate(llm, prompts, params, level, cuda))
        share = {level: hook_share(llm, prompts, params, level) for level in LEVELS}
        llm.shutdown()

    print(f"model {args.config or model} on {args.device}: {args.requests} requests, prompt <= {args.prompt_len}, "
          f"{args.max_tokens} output tokens each, block_size {args.block_size}, {args.repeats} rounds"
          + (", async scheduling" if args.async_scheduling else ""))
    unit = "tok/s" if cuda else "tok per CPU-s"
    for level in RUNS:
        ratio = statistics.median(t / b for t, b in zip(tok_s[level], tok_s[None]))
        best = max(tok_s[level]) / max(tok_s[None])
        inside = "" if level is None else (f"; {share[level][0]:.2%} of wall time inside trace hooks, "
                                           f"{share[level][1]:.0%} of launches planned ahead")
        print(f"{level or 'no recorder':>12}: {statistics.median(tok_s[level]):9.1f} {unit} (median), "
              f"{ratio:.3f}x of unrecorded ({(1 - ratio) * 100:+.1f}% slower), best-of {best:.3f}x{inside}")


if __name__ == "__main__":
    main()
