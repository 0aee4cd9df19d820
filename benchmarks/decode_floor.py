"""A floor under nano-vLLM's benchmark workload for a forward pass made of separate kernels, as
kvscope's is: the decode steps' GEMMs and LM head at cuBLAS's speed, the KV history at the copy
bandwidth, and nothing else (no norm, RoPE, SiLU·mul, KV store, sampling, idle gap or host time).

Issue 16 asks for a share of the roofline (weights once per decode step plus every token's KV
history, at the copy bandwidth). A GEMM at a decode step's few rows costs far more than its
weights' bytes, whoever writes it (benchmarks/RESULTS.md, session 13), so this floor says how
much of that share any engine of separate kernels can reach, before its other kernels cost a
thing. For each decode step of the workload (``bench_throughput.workload``; step ``t`` has a
row for every request with more than ``t`` output tokens) it takes:

- every layer's four GEMMs (qkv, o, gate/up, down) and the LM head at that many rows, timed on
  the GPU as CUDA-graph replays, each layer with its own weights so that L2 holds none of them,
  on a grid of row counts and interpolated between them;
- the step's KV history at the copy bandwidth, as the roofline counts it;

and adds ``--prefill-s``, the prefill and mixed steps' time (``profile_step_kinds.py`` measures
it in the workload). It prints each part, the floor's tok/s and its share of the roofline, the
decode steps' floor in ``profile_step_kinds.py``'s row buckets (so a measured run's excess can
be read off bucket by bucket), and what a ``--target`` share of the roofline leaves per decode
step for everything the floor leaves out.

    python benchmarks/decode_floor.py --config benchmarks/configs/qwen3-small-kv --prefill-s 0.285
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from bench_throughput import copy_bandwidth, kv_bytes_per_token, roofline_tok_s, workload  # noqa: E402
from profile_step_kinds import describe_decode_steps  # noqa: E402

ROWS = (1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 224, 256)


def decode_steps(prompts: list[list[int]], outs: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per decode step ``t`` (as many as the longest output): its rows, and the tokens of KV
    history its rows read (each request's prompt plus the ``t`` tokens before this one)."""
    lens, outs_a = np.array([len(p) for p in prompts]), np.array(outs)
    steps = np.arange(max(outs))
    live = outs_a[None, :] > steps[:, None]  # [steps, requests]
    return live.sum(1), (live * (lens[None, :] + steps[:, None])).sum(1)


def _graph_ms(fn, replays: int = 20) -> float:
    """Milliseconds per replay of a CUDA graph of ``fn``."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def time_gemms(cfg: dict, rows: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Seconds of all layers' four GEMMs, and of the LM head, at each row count."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    w = dict(dtype=torch.bfloat16, device="cuda")
    weights = [(torch.randn(q + 2 * kv, h, **w), torch.randn(h, q, **w), torch.randn(2 * inter, h, **w),
                torch.randn(h, inter, **w)) for _ in range(layers)]
    lm_head = torch.randn(cfg["vocab_size"], h, **w)
    gemms, head = [], []
    for m in rows:
        x, xa, xi = torch.randn(m, h, **w), torch.randn(m, q, **w), torch.randn(m, inter, **w)

        def forward() -> None:
            for qkv, o, gate_up, down in weights:
                F.linear(x, qkv)
                F.linear(xa, o)
                F.linear(x, gate_up)
                F.linear(xi, down)

        gemms.append(_graph_ms(forward) / 1e3)
        head.append(_graph_ms(lambda: F.linear(x, lm_head)) / 1e3)
    return np.array(gemms), np.array(head)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="benchmarks/configs/qwen3-small-kv")
    ap.add_argument("--prefill-s", type=float, default=0.0,
                    help="seconds of the workload's prefill and mixed steps (profile_step_kinds.py)")
    ap.add_argument("--target", type=float, default=0.4, help="a share of the roofline (issue 16: 0.4 on small-KV)")
    args = ap.parse_args()
    cfg = json.loads(Path(args.config, "config.json").read_text())
    prompts, outs = workload()
    rows, history = decode_steps(prompts, outs)
    bw = copy_bandwidth()
    gemm_s, head_s = time_gemms(cfg, ROWS)
    for m, g, hd in zip(ROWS, gemm_s, head_s):
        print(f"{m:4d} rows: the layers' GEMMs {g * 1e3:.3f} ms, the LM head {hd * 1e3:.3f} ms")
    per_step = (np.interp(rows, ROWS, gemm_s), np.interp(rows, ROWS, head_s),
                history * kv_bytes_per_token(cfg) / bw)
    gemms, heads, kv = (float(part.sum()) for part in per_step)
    floor = gemms + heads + kv + args.prefill_s
    roof = roofline_tok_s(cfg, prompts, outs, len(rows), bw)
    tokens = sum(outs)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; {len(rows)} decode steps; roofline {roof:,.0f} tok/s")
    print(f"decode GEMMs {gemms:.3f} s, LM head {heads:.3f} s, KV at the copy bandwidth {kv:.3f} s, "
          f"prefill and mixed steps {args.prefill_s:.3f} s")
    print(f"floor {floor:.3f} s -> {tokens / floor:,.0f} tok/s, {tokens / floor / roof:.1%} of the roofline")
    print("decode floor by rows (as profile_step_kinds.py files the measured steps): "
          + describe_decode_steps(rows.tolist(), sum(per_step).tolist()))
    left = tokens / (args.target * roof) - floor
    print(f"{args.target:.0%} of the roofline leaves {left:.3f} s for all else: {left / len(rows) * 1e6:.0f} µs "
          "per decode step")


if __name__ == "__main__":
    main()
