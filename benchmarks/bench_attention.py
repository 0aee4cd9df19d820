"""Paged Triton attention vs dense SDPA (flash / cuDNN / efficient) on equal shapes.

Decode: K+V bytes read per second (the kernel is memory-bound; SDPA reads the same bytes from a
dense [B, L, H_kv, D] cache), timed as CUDA-graph replays like the engine's decode steps
(launched one by one, a small decode's time is the host's launch path, not the kernel's).
Prefill: causal TFLOP/s (2 * B * Hq * L^2 * D). A mixed step (decode rows and fresh prefills in
one launch) counts both parts' FLOPs, and SDPA runs its two parts as two calls. Ratios are ours
over cuDNN (else the best SDPA backend that runs the shape). ``--heads`` sets the head shape
(query heads, KV heads, head dim; default Qwen3-0.6B's).

``--sweep`` also times other kernel configs per shape, so one device call can pick the
defaults. ``--tune`` first tunes each prefill/mixed shape's default (``tune_paged_attention``,
cached on disk), so "default" is the tuned choice. ``--before REV`` (default: the commit
before the prefill rework) adds that git revision's kernel module as the "before" row, where
git is available.

    python benchmarks/bench_attention.py [--sweep] [--tune] [--before REV] [--heads 14,2,64]
"""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench, do_bench_cudagraph

from kvscope.kernels import triton_attention as ta
from kvscope.kernels.base import AttentionMetadata

DTYPE = torch.bfloat16
SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION}
DECODE_SWEEP = [ta.KernelConfig(16, n, w, s) for n, w, s in
                ((32, 4, 4), (64, 4, 3), (64, 4, 4), (64, 2, 3), (128, 4, 2))]
OLD_PREFILL_CONFIG = ta.KernelConfig(64, 64, 4, 2)  # the default before the prefill rework
PREFILL_SWEEP = [OLD_PREFILL_CONFIG] + [ta.KernelConfig(m, n, w, s, fold) for m, n, w, s, fold in (
    (128, 64, 8, 3, True), (128, 64, 8, 4, False), (128, 128, 8, 3, False), (64, 64, 4, 3, True),
    (64, 64, 4, 3, False), (256, 64, 16, 3, False))] + [
    c for c in ta.attention_configs.TUNE_CANDIDATES if c.gluon]  # the Gluon kernel's, as tuning has them
# Mixed steps compile their own kernel variants: sweep fewer configs there.
MIXED_SWEEP = [OLD_PREFILL_CONFIG] + [ta.KernelConfig(m, n, w, s, fold) for m, n, w, s, fold in (
    (128, 64, 8, 3, False), (64, 64, 4, 3, False), (64, 64, 4, 4, True))]
# TMA loads (tiles inside one page: block_size 256), timed last: no faster than plain loads so
# far on the H200, kept in view.
TMA_SWEEP = [ta.KernelConfig(128, 64, 8, 3, False, tma=True)]
BEFORE_REV = "14cca3e"
KERNEL_PATH = "kvscope/kernels/triton_attention.py"


@dataclass(frozen=True)
class Heads:
    """Query heads, KV heads and head dim of every case."""

    q: int = 16
    kv: int = 8
    dim: int = 128


HEADS = Heads()  # main() sets it from --heads


@dataclass(frozen=True)
class Part:
    """``count`` sequences of context ``length``: decode rows (one query each) or fresh
    prefills (the whole context is this step's query)."""

    count: int
    length: int
    decode: bool

    def flops(self) -> float:
        if self.decode:
            return 4 * self.count * HEADS.q * self.length * HEADS.dim
        return 2 * self.count * HEADS.q * self.length ** 2 * HEADS.dim

    def kv_bytes(self) -> float:
        return 2 * self.count * self.length * HEADS.kv * HEADS.dim * DTYPE.itemsize


@dataclass(frozen=True)
class Shape:
    parts: tuple[Part, ...]
    block_size: int

    @property
    def decode(self) -> bool:
        return all(p.decode for p in self.parts)

    @property
    def unit(self) -> str:
        return "GB/s" if self.decode else "TFLOP/s"

    def rate(self, ms: float) -> float:
        """GB/s of K+V for decode, TFLOP/s otherwise."""
        if self.decode:
            return sum(p.kv_bytes() for p in self.parts) / (ms * 1e-3) / 1e9
        return sum(p.flops() for p in self.parts) / (ms * 1e-3) / 1e12

    def title(self) -> str:
        kinds = " + ".join(f"{'decode' if p.decode else 'prefill'} B={p.count} L={p.length}"
                           for p in self.parts)
        return f"{'mixed: ' if len(self.parts) > 1 else ''}{kinds} block_size={self.block_size}"


def paged_inputs(shape: Shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                        AttentionMetadata]:
    """Random q and a full pool whose pages are a random permutation (a fragmented cache)."""
    bs = shape.block_size
    seqs = [(p.length, 1 if p.decode else p.length) for p in shape.parts for _ in range(p.count)]
    pages = [-(-ctx // bs) for ctx, _ in seqs]
    k_cache = torch.randn(sum(pages), bs, HEADS.kv, HEADS.dim, device="cuda", dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(sum(pages), device="cuda").to(torch.int32)
    tables = torch.full((len(seqs), max(pages)), -1, device="cuda", dtype=torch.int32)
    for i, chunk in enumerate(perm.split(pages)):
        tables[i, :len(chunk)] = chunk
    ctx = torch.tensor([c for c, _ in seqs], device="cuda", dtype=torch.int32)
    q_lens = torch.tensor([n for _, n in seqs], device="cuda", dtype=torch.int32)
    zero = torch.zeros(1, device="cuda", dtype=torch.int32)
    num_tokens = int(q_lens.sum())
    q = torch.randn(num_tokens, HEADS.q, HEADS.dim, device="cuda", dtype=DTYPE)
    meta = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, device="cuda", dtype=torch.int64),
        cu_seqlens_q=torch.cat([zero, q_lens.cumsum(0).int()]),
        cu_seqlens_k=torch.cat([zero, ctx.cumsum(0).int()]),
        context_lens=ctx, block_tables=tables,
        max_seqlen_q=max(n for _, n in seqs), max_seqlen_k=max(c for c, _ in seqs),
        num_seqs=len(seqs), num_tokens=num_tokens, block_size=bs,
        decode_only=shape.decode, no_prefix=not any(p.decode for p in shape.parts),
    )
    return q, k_cache, v_cache, meta


def sdpa_part_fn(part: Part) -> Callable[[], torch.Tensor]:
    """One dense SDPA call doing ``part``'s attention (causal for prefill)."""
    q_len = 1 if part.decode else part.length
    q = torch.randn(part.count, q_len, HEADS.q, HEADS.dim, device="cuda", dtype=DTYPE).transpose(1, 2)
    k = torch.randn(part.count, part.length, HEADS.kv, HEADS.dim, device="cuda",
                    dtype=DTYPE).transpose(1, 2)
    v = torch.randn_like(k)
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=not part.decode,
                                                  enable_gqa=True)


def median_ms(fn: Callable[[], object], decode: bool) -> float:
    """Median ms of ``fn``: replayed from a CUDA graph for decode, launched eagerly otherwise."""
    if decode:
        return do_bench_cudagraph(fn, rep=50, return_mode="median")
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def sdpa_ms(shape: Shape) -> dict[str, float]:
    """Median ms of each SDPA backend that accepts every part of ``shape`` (parts summed)."""
    fns = [sdpa_part_fn(p) for p in shape.parts]
    times = {}
    for name, backend in SDPA_BACKENDS.items():
        with sdpa_kernel(backend), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "kernel not used because ..." spam
            try:
                for fn in fns:
                    fn()
            except RuntimeError as err:  # this backend does not take the shape or GQA here
                print(f"  sdpa[{name}] unavailable: {str(err).splitlines()[0][:100]}")
                continue
            times[name] = sum(median_ms(fn, shape.decode) for fn in fns)
    return times


def load_before(rev: str) -> ModuleType | None:
    """The Triton attention module as of git revision ``rev``, or None where git or the
    revision is not available (e.g. a copied working tree without .git)."""
    src = subprocess.run(["git", "show", f"{rev}:{KERNEL_PATH}"], capture_output=True, text=True)
    if src.returncode != 0:
        print(f"no 'before' row: git show {rev} failed ({src.stderr.strip()[:80]})")
        return None
    path = Path(tempfile.mkdtemp()) / f"triton_attention_{rev}.py"
    path.write_text(src.stdout)  # @triton.jit reads the source back from the file
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def label_of(config: ta.KernelConfig) -> str:
    name = f"m{config.block_m}n{config.block_n}w{config.num_warps}s{config.num_stages}"
    name += ("" if config.fold_scale else " scale-in-exp2") + (" tma" if config.tma else "")
    name += " gluon" if config.gluon else ""
    name += "" if config.maxnreg is None else f" maxnreg={config.maxnreg}"
    return name + (" (old default)" if config == OLD_PREFILL_CONFIG else "")


def bench_shape(shape: Shape, configs: list[ta.KernelConfig | None], splits: list[int | None],
                before: ModuleType | None, tune: bool) -> list[tuple[str, float, float]]:
    """Rows (label, ms, rate): every SDPA backend, then our kernel per config (None: the
    default, tuned first with ``tune``) and split count, then the ``before`` module's default.
    A config that fails (e.g. out of shared memory) is reported and skipped."""
    q, k_cache, v_cache, meta = paged_inputs(shape)
    scale = HEADS.dim ** -0.5
    rows = [(f"sdpa[{name}]", ms, shape.rate(ms)) for name, ms in sdpa_ms(shape).items()]
    if tune and not shape.decode:
        ta.tune_paged_attention(q, k_cache, v_cache, meta, scale)
    default = ta.default_config(q, k_cache, meta)
    runs = [((f"default={label_of(default)}" if c is None else label_of(c))
             + (f" splits={n or ta.choose_num_splits(meta, HEADS.kv, q.device)}"
                if len(splits) > 1 else ""),
             lambda c=c, n=n: ta.paged_attention(q, k_cache, v_cache, meta, scale, config=c,
                                                 num_splits=n))
            for c in configs for n in splits]
    if before is not None:
        runs.append((f"before@{BEFORE_REV} default",
                     lambda: before.paged_attention(q, k_cache, v_cache, meta, scale)))
    expect = None
    for label, run in runs:
        try:
            out = run()
            ms = median_ms(run, shape.decode)
        except Exception as err:  # noqa: BLE001  (a config the GPU cannot run: report, go on)
            print(f"  {label}: failed: {str(err).splitlines()[0][:120]}")
            continue
        expect = out if expect is None else expect
        diff = (out.float() - expect.float()).abs().max().item()
        rows.append((f"{label}{'' if diff < 2e-2 else f' MISMATCH {diff:.3f}'}", ms,
                     shape.rate(ms)))
    return rows


def cases(sweep: bool) -> list[tuple[Shape, list, list]]:
    """(shape, configs, split counts) of every timed case."""
    decode = [None] + (DECODE_SWEEP if sweep else [])
    prefill = [None] + (PREFILL_SWEEP if sweep else [])
    out = [(Shape((Part(256, n, True),), bs), decode, [None]) for n in (1024, 4096)
           for bs in (16, 256)]
    out += [(Shape((Part(b, 1024, True),), 16), decode, [None]) for b in (64, 8)]
    out += [(Shape((Part(4, 32768, True),), 16), [None], [1, None, 8, 16]),  # split-KV territory
            (Shape((Part(16, 8192, True),), 16), [None], [1, None, 4, 16])]
    out += [(Shape((Part(b, n, False),), bs), prefill, [None])
            for b, n in ((4, 4096), (16, 1024)) for bs in (16, 256)]
    out += [(Shape((Part(64, 1024, True), Part(2, 2048, False)), bs),
             [None] + (MIXED_SWEEP if sweep else []), [None]) for bs in (16, 256)]
    if sweep:
        out += [(Shape((Part(b, n, False),), 256), [None] + TMA_SWEEP, [None])
                for b, n in ((4, 4096), (16, 1024))]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time other kernel configs")
    parser.add_argument("--tune", action="store_true",
                        help="tune prefill/mixed defaults first (cached on disk for later runs)")
    parser.add_argument("--before", default=BEFORE_REV,
                        help="git revision whose kernel module is the 'before' row ('' = none)")
    parser.add_argument("--heads", default=f"{Heads.q},{Heads.kv},{Heads.dim}", metavar="HQ,HKV,D",
                        help="query heads, KV heads, head dim (default Qwen3-0.6B's)")
    args = parser.parse_args()
    global HEADS
    HEADS = Heads(*(int(n) for n in args.heads.split(",")))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "? (no git here)"
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  commit {commit}  "
          f"Hq={HEADS.q} Hkv={HEADS.kv} D={HEADS.dim} {DTYPE}")
    before = load_before(args.before) if args.before else None
    summary = []
    for shape, configs, splits in cases(args.sweep):
        print(f"\n{shape.title()}")
        rows = bench_shape(shape, configs, splits, before if len(splits) == 1 else None,
                           args.tune)
        sdpa = {r[0]: r for r in rows if r[0].startswith("sdpa")}
        ref = sdpa.get("sdpa[cudnn]") or max(sdpa.values(), key=lambda r: r[2], default=None)
        for label, ms, r in rows:
            ratio = f"{r / ref[2]:6.2f}x" if ref else ""
            print(f"  {label:36s} {ms * 1e3:9.1f} us {r:9.1f} {shape.unit} {ratio}")
        ours = [r for r in rows if not r[0].startswith("sdpa")]
        if ours:
            summary.append((shape, ref, ours[0], max(ours, key=lambda r: r[2])))
    print("\nsummary (rate; ratio to cuDNN, else the best SDPA)")
    for shape, ref, default, best in summary:
        ratio = (lambda r: f"{r / ref[2]:.2f}x") if ref else (lambda r: "")
        ref_text = f"{ref[0]} {ref[2]:8.1f}" if ref else "sdpa n/a"
        print(f"{shape.title():58s} {shape.unit:7s} {ref_text} | default {default[2]:8.1f} "
              f"{ratio(default[2])} | best {best[0]} {best[2]:8.1f} {ratio(best[2])}")


if __name__ == "__main__":
    main()
