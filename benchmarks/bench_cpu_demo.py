"""The bundled model on a CPU: 32 requests x 64 new tokens, wall time and tokens per second.

Runs once per ``--cpu-threads`` setting in one process (0 = kvscope's automatic choice), so the
settings are compared under the same machine load.

    python benchmarks/bench_cpu_demo.py [--cpu-threads 0 2] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--cpu-threads", type=int, nargs="+", default=[0, os.cpu_count() or 1])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    for threads in args.cpu_threads:
        run(args, threads or None)


def run(args: argparse.Namespace, cpu_threads: int | None) -> None:
    from kvscope import LLM, SamplingParams

    llm = LLM(device="cpu", cpu_threads=cpu_threads)
    tok = llm.get_tokenizer()
    # Corpus-style prompts: help-page headers of a few modules, so some share prefixes.
    names = ["os.path", "json", "re", "itertools", "functools", "collections", "typing", "pathlib"]
    prompts = [f"Help on function {f} in module {m}:\n\n" for m in names for f in ("load", "join", "split", "open")]
    prompts = prompts[: args.requests]
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=args.max_tokens, seed=0)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    times, tokens, stopped = [], 0, 0
    for _ in range(args.repeats):
        llm.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        stopped = sum(o.outputs[0].finish_reason == "stop" for o in outs)
    best, med = min(times), statistics.median(times)
    used = llm.llm_engine.executor.cpu_threads
    label = f"cpu_threads={cpu_threads}" if cpu_threads else f"cpu_threads=auto ({used})"
    print(f"{len(prompts)} requests x up to {args.max_tokens} new tokens, {label}: "
          f"median {med:.2f}s, best {best:.2f}s ({tokens} tokens, {tokens / med:.0f} tok/s; "
          f"{stopped}/{len(prompts)} stopped on EOS)")
    print(f"example: {prompts[0]!r} -> {tok.decode(outs[0].outputs[0].token_ids, skip_special_tokens=True)!r}")


if __name__ == "__main__":
    main()
