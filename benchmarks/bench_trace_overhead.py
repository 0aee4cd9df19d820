"""What recording costs: generation throughput with no recorder and at each trace level.

One engine, one workload (requests sharing a system prompt, so prefix caching, block sharing
and hashing all fire), runs interleaved level by level and repeated, the prefix cache reset
before each run so every run schedules identically. Per level it reports the median
throughput, the median of the per-round ratios to the unrecorded run, the ratio of the best
runs (interference only ever slows a run down), and the share of wall time spent inside the
trace's hooks in one instrumented run. Goals: <= 3% slower at ``summary``, <= 10% at ``full``.
On CPU the throughput is per CPU-second of this process (``--threads 1``), which keeps a shared
machine's other jobs out of the ratios.

Model: ``--model DIR``; or ``--config DIR`` (one of ``benchmarks/configs/``, random bf16
weights: the GPU benchmark's model); else the bundled demo model, else a tiny random Qwen3
checkpoint written to a temp dir (prompts are token ids, so no tokenizer is needed).

    python benchmarks/bench_trace_overhead.py [--device cuda] [--model DIR | --config DIR] [--repeats 15]
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from kvscope import LLM, SamplingParams
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


def hook_share(llm: LLM, prompts: list[list[int]], params: SamplingParams, level: str) -> float:
    """Fraction of one recorded run's wall time spent inside the trace's hooks.

    A second, low-noise view of the cost: it does not depend on comparing two runs on a machine
    whose other jobs come and go (the engine's own payload building is not included).
    """
    llm.reset_prefix_cache()
    hooks = llm.llm_engine.hooks
    spent = 0.0

    def timed(fn: Callable[..., None]) -> Callable[..., None]:
        def wrapper(*args: object, **payload: object) -> None:
            nonlocal spent
            t = time.perf_counter()
            fn(*args, **payload)
            spent += time.perf_counter() - t
        return wrapper

    hooks.fire, hooks.emit_block = timed(hooks.fire), timed(hooks.emit_block)  # hooks, and block sinks
    try:
        t = time.perf_counter()
        with llm.record(level=level):
            llm.generate(prompts, params, use_tqdm=False)
        return spent / (time.perf_counter() - t)
    finally:
        del hooks.fire, hooks.emit_block


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
                    help="engine with async scheduling: 'summary' keeps it, 'blocks'/'full' step synchronously")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

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
        inside = "" if level is None else f"; {share[level]:.2%} of wall time inside trace hooks"
        print(f"{level or 'no recorder':>12}: {statistics.median(tok_s[level]):9.1f} {unit} (median), "
              f"{ratio:.3f}x of unrecorded ({(1 - ratio) * 100:+.1f}% slower), best-of {best:.3f}x{inside}")


if __name__ == "__main__":
    main()
