"""The bundled model on a CPU against transformers, in one process: kvscope's ``LLM()`` and
``AutoModelForCausalLM.generate`` on the same prompts, tokens per second and their ratio.

Workload: ``demo_prompts(--requests)``, ``--max-tokens`` greedy new tokens each (kvscope with
``ignore_eos``; transformers with ``min_new_tokens`` and a left-padded batch), fp32. Every arm
is timed ``--repeats`` times after a warm-up, the arms taking turns round by round so that load
from other jobs on the machine falls on all of them alike; the median is reported, with the best
run and the median CPU time of the process (less sensitive to other jobs taking the cores).

Arms: kvscope for each ``--kvscope BACKEND:THREADS[:noprefix]`` (``torch``: the batched backend;
``torch_reference``: the one-sequence-at-a-time reference, the backend before issue 19;
``auto`` threads: kvscope's automatic ``cpu_threads``; ``noprefix``: prefix caching off, so
every prompt token is computed, as before in-batch prefix sharing let the prompts that share
blocks compute them once); transformers for each ``--hf-threads``.
Finally it checks that kvscope's tokens equal transformers' up to kvscope's first EOS.

    python benchmarks/bench_cpu_demo.py [--kvscope torch:auto torch:2:noprefix torch_reference:auto]
                                        [--hf-threads 1 2] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch


def kvscope_arm(prompts: list[str], max_tokens: int, backend: str, cpu_threads: int | None,
                prefix_caching: bool = True) -> tuple[str, Callable[[], list[list[int]]]]:
    from kvscope import LLM, SamplingParams
    from kvscope.kernels.torch_attention import TorchReferenceBackend

    llm = LLM(device="cpu", cpu_threads=cpu_threads, attention_backend="torch",
              enable_prefix_caching=prefix_caching)
    runner = llm.llm_engine.executor
    if backend == "torch_reference":
        for layer in runner.attn_layers:
            layer.backend = TorchReferenceBackend()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def run() -> list[list[int]]:
        llm.reset_prefix_cache()
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    threads = f"cpu_threads={cpu_threads}" if cpu_threads else f"cpu_threads=auto ({runner.cpu_threads})"
    return f"kvscope {backend}, {threads}{'' if prefix_caching else ', no prefix caching'}", run


def transformers_arm(prompts: list[str], max_tokens: int,
                     threads: int) -> tuple[str, Callable[[], list[list[int]]]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvscope.model_source import BUNDLED_MODEL

    tok = AutoTokenizer.from_pretrained(BUNDLED_MODEL, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL, dtype=torch.float32).eval()
    batch = tok(prompts, return_tensors="pt", padding=True)

    def run() -> list[list[int]]:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with torch.inference_mode():
                out = model.generate(**batch, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                     do_sample=False, pad_token_id=tok.pad_token_id)
        finally:
            torch.set_num_threads(previous)
        return out[:, batch.input_ids.shape[1]:].tolist()

    return f"transformers, {threads} thread{'s' * (threads > 1)}", run


def agree_to_first_eos(ours: list[list[int]], theirs: list[list[int]], eos: int) -> int:
    """How many sequences match up to (not including) kvscope's first EOS: past it, kvscope went
    on with ``ignore_eos`` while ``min_new_tokens`` made transformers pick another token."""
    same = 0
    for a, b in zip(ours, theirs):
        cut = a.index(eos) if eos in a else len(a)
        same += a[:cut] == b[:cut]
    return same


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--kvscope", nargs="+", metavar="BACKEND:THREADS[:noprefix]",
                    default=["torch:auto", "torch:auto:noprefix", "torch:1", "torch_reference:auto"])
    ap.add_argument("--hf-threads", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from kvscope.demo import demo_prompts

    prompts = demo_prompts(args.requests)
    load = os.getloadavg()  # other jobs on the machine: the timings depend on it
    arms = []
    for spec in args.kvscope:
        backend, _, rest = spec.partition(":")
        threads, _, option = rest.partition(":")
        if (backend not in ("torch", "torch_reference") or not (threads == "auto" or threads.isdigit())
                or option not in ("", "noprefix")):
            ap.error(f"--kvscope takes BACKEND:THREADS[:noprefix], BACKEND torch or torch_reference and "
                     f"THREADS auto or a number, got {spec!r}")
        arms.append(kvscope_arm(prompts, args.max_tokens, backend, None if threads == "auto" else int(threads),
                                prefix_caching=option != "noprefix"))
    arms += [transformers_arm(prompts, args.max_tokens, t) for t in args.hf_threads]
    tokens = {name: run() for name, run in arms}  # warm-up, and the tokens compared below
    times: dict[str, list[float]] = {name: [] for name, _ in arms}
    cpu: dict[str, list[float]] = {name: [] for name, _ in arms}
    for r in range(args.repeats):
        for name, run in arms[r % len(arms):] + arms[: r % len(arms)]:
            t, c = time.perf_counter(), time.process_time()
            run()
            times[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)

    new_tokens = args.requests * args.max_tokens
    rate = {name: new_tokens / statistics.median(ts) for name, ts in times.items()}
    best_hf = max((n for n in rate if n.startswith("transformers")), key=rate.get)
    print(f"{args.requests} x demo_prompts, {args.max_tokens} greedy new tokens each, fp32, "
          f"median of {args.repeats}, torch {torch.__version__}, {os.cpu_count()} cores, "
          f"load average {load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    print("| arm | median wall time | tok/s | vs transformers' best | best wall time | median CPU time |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.2f} s | {rate[name]:,.0f} | "
              f"{rate[name] / rate[best_hf]:.2f}x | {min(ts):.2f} s | {statistics.median(cpu[name]):.2f} s |")

    from transformers import AutoTokenizer

    from kvscope.model_source import BUNDLED_MODEL

    eos = AutoTokenizer.from_pretrained(BUNDLED_MODEL).eos_token_id
    for name, _ in arms[: len(arms) - len(args.hf_threads)]:
        same = agree_to_first_eos(tokens[name], tokens[best_hf], eos)
        print(f"{name}: tokens equal transformers' up to the first EOS in {same}/{args.requests} sequences")


if __name__ == "__main__":
    main()
