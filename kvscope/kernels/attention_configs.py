"""Which tile config a paged-attention call runs: static defaults, or the winner of a small
fixed candidate set timed once per GPU and step shape and cached on disk.

Tuning compiles and times every candidate, so it runs only when asked (:func:`tune`, e.g. by
``benchmarks/bench_attention.py`` or before serving); a call then only looks its shape up in a
dict loaded once per process, which is CUDA-graph safe and costs no compile in a timed run.
The cache file is ``$KVSCOPE_CACHE_DIR/attention_configs.json`` (default
``~/.cache/kvscope``), keyed by GPU name, Triton version and shape class.
"""
from __future__ import annotations

import functools
import json
import math
import os
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch


@dataclass(frozen=True)
class KernelConfig:
    """Tile shape and launch options of the paged attention kernel."""

    block_m: int     # query rows per tile (tokens x GQA group), >= 16 for tl.dot
    block_n: int     # key positions per loop step, >= 16 for tl.dot
    num_warps: int
    num_stages: int
    # Scale q once (a tile of q scaled in registers, which Triton then feeds the QK^T dot from
    # registers) instead of fusing the scale into each score's exp2 argument (q stays in shared
    # memory as the dot's operand): equal arithmetic, different operand paths; tuning picks.
    fold_scale: bool = True
    # Load the key tiles below the causal diagonal with TMA bulk copies (Hopper+), where a tile
    # sits in one page and the head dim is a power of two; elsewhere plain loads.
    tma: bool = False
    # Cap on registers per thread (Triton's ``maxnreg``; None: the compiler's choice). A
    # 128-row prefill tile of 8 warps otherwise takes a whole SM's registers; capped at 128,
    # in 2 stages of shared memory, two programs share an SM, at the price of some spills.
    maxnreg: int | None = None
    # Run steps with prefill rows on Gluon's sm_90 kernel (``gluon_attention``: the P @ V wgmma
    # kept in flight during the next tile's softmax), where it applies; elsewhere these tiles
    # run on the Triton kernel.
    gluon: bool = False

    def __post_init__(self) -> None:
        if self.gluon and (self.num_warps not in (4, 8) or self.block_m != 16 * self.num_warps
                           or self.num_stages < 2):
            raise ValueError(f"a gluon config needs num_warps 4 or 8 (one or two warpgroups), "
                             f"block_m == 16 * num_warps (a 16-row slice per warp) and num_stages >= 2 "
                             f"(one K/V buffer in use, one loading), got block_m={self.block_m}, "
                             f"num_warps={self.num_warps}, num_stages={self.num_stages}")


# Chosen from H200 sweeps of bench_attention.py (benchmarks/RESULTS.md): decode at 3 stages
# beat 2; for prefill the scale fused into exp2 matched or beat q scaled once; mixed steps
# (decode rows next to prefill chunks) ran fastest in 64-row tiles of 4 warps.
DECODE_CONFIG = KernelConfig(block_m=16, block_n=64, num_warps=4, num_stages=3)
# Heads of 64 dims or fewer, histories not split: a 64-key tile is half the bytes a loop step
# of D=128 moves, and such decode ran well short of cuDNN in CUDA graphs on the H200; 128-key
# tiles in two buffers (DECODE_CONFIG's shared memory at D=128) closed most of the gap. Split
# histories keep 64-key tiles: a split of one 128-key tile has no next tile to load meanwhile.
NARROW_DECODE_CONFIG = KernelConfig(block_m=16, block_n=128, num_warps=4, num_stages=2)
PREFILL_CONFIG = KernelConfig(block_m=128, block_n=64, num_warps=8, num_stages=3,
                              fold_scale=False)
MIXED_CONFIG = KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)
# Where the Gluon kernel runs (sm_90), fresh prefills of every length ran fastest on it in
# 64-row tiles of one warpgroup, with rings of two K and two V buffers (two blocks per SM).
GLUON_PREFILL_CONFIG = KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2,
                                    fold_scale=False, gluon=True)
# Prefill and mixed steps (decode keeps :func:`decode_config` and its split heuristic); each
# fits one Hopper block's shared memory at D=128. TMA pays only with 128-key tiles on long
# prefills of large pages (where it does not apply it is the plain-load config again). 256-row
# tiles of 16 warps halve the programs (and their starts and ends) of a fresh prefill on small
# pages.
TUNE_CANDIDATES = (
    PREFILL_CONFIG,
    MIXED_CONFIG,
    KernelConfig(128, 64, 8, 3),
    KernelConfig(128, 64, 8, 4, fold_scale=False),
    KernelConfig(128, 128, 8, 3, fold_scale=False),
    KernelConfig(128, 128, 8, 3, fold_scale=False, tma=True),
    KernelConfig(64, 64, 4, 3, fold_scale=False),
    KernelConfig(128, 64, 8, 2, maxnreg=128),
    KernelConfig(256, 64, 16, 3, fold_scale=False),
    GLUON_PREFILL_CONFIG,
    KernelConfig(128, 128, 8, 2, fold_scale=False, gluon=True),
)

_choices: dict[str, KernelConfig] | None = None


def decode_config(head_dim: int, num_splits: int) -> KernelConfig:
    """A decode step's tiles: about the same bytes a key tile at any head size, where each
    program reads a whole history (``num_splits == 1``)."""
    return NARROW_DECODE_CONFIG if head_dim <= 64 and num_splits == 1 else DECODE_CONFIG


def cache_path() -> Path:
    root = os.environ.get("KVSCOPE_CACHE_DIR") or Path.home() / ".cache" / "kvscope"
    return Path(root) / "attention_configs.json"


@functools.lru_cache(maxsize=None)
def shape_key(device: torch.device, kind: str, block_size: int, group: int, head_dim: int,
              dtype: torch.dtype, kv_dtype: torch.dtype, max_seqlen_q: int) -> str:
    """The shape class a tuned choice holds for: what changes the best tile config (the
    longest query, in powers of two, stands for the work per sequence)."""
    import triton

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    q_class = 1 << max(0, math.ceil(math.log2(max(1, max_seqlen_q))))
    return (f"{gpu}|triton {triton.__version__}|{kind}|block_size {block_size}|group {group}|"
            f"head_dim {head_dim}|{dtype}|kv {kv_dtype}|q<={q_class}")


def _load() -> dict[str, KernelConfig]:
    """The cache file's choices; an unreadable file is reported and ignored (defaults apply)."""
    path = cache_path()
    if not path.exists():
        return {}
    try:
        return {key: KernelConfig(**fields) for key, fields in json.loads(path.read_text()).items()}
    except (OSError, ValueError, TypeError) as err:
        warnings.warn(f"ignoring the attention config cache {path}: {err}", stacklevel=3)
        return {}


def tuned_config(key: str) -> KernelConfig | None:
    """The cached choice for ``key``, or None where none was tuned."""
    global _choices
    if _choices is None:
        _choices = _load()
    return _choices.get(key)


def tune(key: str, run: Callable[[KernelConfig], object],
         timer: Callable[[Callable[[], object]], float]) -> KernelConfig:
    """Time ``run(config)`` for every one of :data:`TUNE_CANDIDATES` with ``timer`` (ms;
    compiles happen in its warm-up), cache the fastest under ``key`` on disk and in this
    process, and return it. A candidate that fails (e.g. out of shared memory on a smaller
    GPU) is skipped."""
    global _choices
    times = {}
    for config in TUNE_CANDIDATES:
        try:
            times[config] = timer(lambda config=config: run(config))
        except Exception as err:  # noqa: BLE001  (a config this GPU cannot run: skip it)
            warnings.warn(f"attention config {config} failed to run: {err}", stacklevel=2)
    if not times:
        raise RuntimeError(f"no attention config candidate ran for {key}")
    best = min(times, key=times.get)
    choices = _load()
    choices[key] = best
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({k: asdict(v) for k, v in sorted(choices.items())}, indent=1))
    tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one
    _choices = choices
    return best
