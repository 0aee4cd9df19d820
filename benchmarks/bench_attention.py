"""Paged Triton attention vs dense SDPA (flash / cuDNN / efficient) on equal shapes.

Decode: K+V bytes read per second (the kernel is memory-bound; SDPA reads the same bytes from a
dense [B, L, H_kv, D] cache). Prefill: causal TFLOP/s (2 * B * Hq * L^2 * D). Ratios are ours
over the best SDPA backend that runs the shape. ``--sweep`` also times other kernel configs, so
one device call can pick the defaults.

    python benchmarks/bench_attention.py [--sweep]
"""
from __future__ import annotations

import argparse
import subprocess
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from kvscope.kernels import triton_attention as ta
from kvscope.kernels.base import AttentionMetadata

HQ, HKV, D, DTYPE = 16, 8, 128, torch.bfloat16
SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION}
DECODE_SWEEP = [ta.KernelConfig(16, n, w, s) for n, w, s in ((32, 4, 4), (64, 4, 4), (128, 4, 2))]
PREFILL_SWEEP = [ta.KernelConfig(m, n, w, s) for m, n, w, s in
                 ((128, 64, 8, 2), (64, 64, 4, 3), (64, 32, 4, 3), (128, 128, 8, 2))]


@dataclass
class Shape:
    batch: int
    length: int
    block_size: int
    decode: bool


def paged_inputs(shape: Shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                        AttentionMetadata]:
    """Random q and a full pool whose pages are a random permutation (a fragmented cache)."""
    b, n, bs = shape.batch, shape.length, shape.block_size
    pages = -(-n // bs)
    k_cache = torch.randn(b * pages, bs, HKV, D, device="cuda", dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(b * pages, device="cuda").to(torch.int32).view(b, pages)
    q_len = 1 if shape.decode else n
    q = torch.randn(b * q_len, HQ, D, device="cuda", dtype=DTYPE)
    arange = torch.arange(b + 1, device="cuda", dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.full((b * q_len,), -1, device="cuda", dtype=torch.int64),
        cu_seqlens_q=arange * q_len, cu_seqlens_k=arange * n,
        context_lens=torch.full((b,), n, device="cuda", dtype=torch.int32), block_tables=tables,
        max_seqlen_q=q_len, max_seqlen_k=n, num_seqs=b, num_tokens=b * q_len, block_size=bs,
        decode_only=shape.decode, no_prefix=not shape.decode,
    )
    return q, k_cache, v_cache, meta


def sdpa_ms(shape: Shape) -> dict[str, float]:
    """Median ms of each SDPA backend that accepts the dense GQA problem of ``shape``."""
    b, n = shape.batch, shape.length
    q_len = 1 if shape.decode else n
    q = torch.randn(b, q_len, HQ, D, device="cuda", dtype=DTYPE).transpose(1, 2)
    k = torch.randn(b, n, HKV, D, device="cuda", dtype=DTYPE).transpose(1, 2)
    v = torch.randn_like(k)
    times = {}
    def run() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=not shape.decode, enable_gqa=True)

    for name, backend in SDPA_BACKENDS.items():
        with sdpa_kernel(backend), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "kernel not used because ..." spam
            try:
                run()
            except RuntimeError as err:  # this backend does not take the shape or GQA here
                print(f"  sdpa[{name}] unavailable: {str(err).splitlines()[0][:100]}")
                continue
            times[name] = do_bench(run, warmup=25, rep=200, return_mode="median")
    return times


def work(shape: Shape) -> float:
    """Bytes of K+V (decode) or causal FLOPs (prefill) of one call."""
    b, n = shape.batch, shape.length
    if shape.decode:
        return 2 * b * n * HKV * D * DTYPE.itemsize
    return 2 * b * HQ * n * n * D


def rate(shape: Shape, ms: float) -> float:
    """GB/s for decode, TFLOP/s for prefill."""
    return work(shape) / (ms * 1e-3) / (1e9 if shape.decode else 1e12)


def bench_shape(shape: Shape, configs: list[ta.KernelConfig | None],
                splits: list[int | None]) -> list[tuple[str, float, float]]:
    """Rows (label, ms, rate): every SDPA backend, then our kernel per config and split count."""
    q, k_cache, v_cache, meta = paged_inputs(shape)
    scale = D ** -0.5
    rows = [(f"sdpa[{name}]", ms, rate(shape, ms)) for name, ms in sdpa_ms(shape).items()]
    for config in configs:
        for num_splits in splits:
            def run() -> torch.Tensor:
                return ta.paged_attention(q, k_cache, v_cache, meta, scale, config=config,
                                          num_splits=num_splits)
            ms = do_bench(run, warmup=25, rep=200, return_mode="median")
            label = "default" if config is None else (
                f"m{config.block_m}n{config.block_n}w{config.num_warps}s{config.num_stages}")
            if len(splits) > 1:
                chosen = num_splits or ta.choose_num_splits(meta, HKV, q.device)
                label += f" splits={chosen}"
            rows.append((label, ms, rate(shape, ms)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time other kernel configs")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "? (no git here)"
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  commit {commit}  "
          f"Hq={HQ} Hkv={HKV} D={D} {DTYPE}")
    summary = []
    cases = [(Shape(256, n, bs, True), DECODE_SWEEP, [None])
             for n in (1024, 4096) for bs in (16, 256)]
    cases += [(Shape(4, 32768, 16, True), [], [1, None, 8, 16]),  # split-KV territory
              (Shape(16, 8192, 16, True), [], [1, None, 4, 16])]
    cases += [(Shape(b, n, bs, False), PREFILL_SWEEP, [None])
              for b, n in ((4, 4096), (16, 1024)) for bs in (16, 256)]
    for shape, sweep, splits in cases:
        unit = "GB/s" if shape.decode else "TFLOP/s"
        print(f"\n{'decode' if shape.decode else 'prefill'} B={shape.batch} L={shape.length} "
              f"block_size={shape.block_size}")
        configs = [None] + (sweep if args.sweep else [])
        rows = bench_shape(shape, configs, splits)
        sdpa_best = max((r for r in rows if r[0].startswith("sdpa")), key=lambda r: r[2],
                        default=None)
        for label, ms, r in rows:
            ratio = f"{r / sdpa_best[2]:6.2f}x" if sdpa_best else ""
            print(f"  {label:28s} {ms * 1e3:9.1f} us {r:9.1f} {unit} {ratio}")
        ours = [r for r in rows if not r[0].startswith("sdpa")]
        default, best = ours[0], max(ours, key=lambda r: r[2])
        summary.append((shape, unit, sdpa_best, default, best))
    print("\nsummary (rate; ratio to best SDPA)")
    for shape, unit, sdpa, default, best in summary:
        kind = "decode " if shape.decode else "prefill"
        ref = f"{sdpa[0]} {sdpa[2]:8.1f}" if sdpa else "sdpa n/a"
        ratio = (lambda r: f"{r / sdpa[2]:.2f}x") if sdpa else (lambda r: "")
        print(f"{kind} B={shape.batch:3d} L={shape.length:5d} bs={shape.block_size:3d} {unit:7s} "
              f"{ref} | default {default[2]:8.1f} {ratio(default[2])} | best {best[0]} "
              f"{best[2]:8.1f} {ratio(best[2])}")


if __name__ == "__main__":
    main()
