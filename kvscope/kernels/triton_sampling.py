"""Sampling on the GPU in one read of the logits: temperature, softmax and the draw fused.

A random row samples by inverting its CDF: with ``p = softmax(logits / T)`` and one uniform
``U`` per row, the token is the first ``j`` whose running sum of ``p`` passes ``U``. The first
launch reads each chunk of a row's vocabulary once, in the logits' own dtype, and keeps three
numbers: the chunk's largest score (``log2(e) * logits / T``), that entry's index, and the
chunk's mass ``sum(2 ** (score - largest))``. The second launch, one program per row, weighs
the chunks' masses against the row's largest score, walks them to the chunk where ``U`` times
the total lands, and scans that one chunk again for the token. A greedy row (``scale == 0``)
takes the first largest logit instead. So the randomness is one number per row, not one per
vocabulary entry, and the pass over ``[rows, vocab]`` is a read and an ``exp2`` per entry.

The uniform is counter-based (Philox-4x32-10): a pure function of the row's *stream*
``(key, a, b)``. The sampler gives an unseeded row the stream ``(sampler key, row, step)`` and
a seeded row ``(seed, output index, SEEDED)``, so a seeded request draws the same uniform
whatever it is batched with. The step number may live in device memory (one int64), so that a
CUDA graph that samples reads the current step at each replay. Rows with min-p, top-k or
top-p go through the same kernels with the tokens outside their set masked to ``-inf`` (mass
0), so a row samples the same token whichever path its batch took.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvscope.kernels.base import LOG2E
from kvscope.kernels.launch import launcher
from kvscope.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options, pdl_options

SEEDED = 1 << 31  # a seeded row's third counter word: no unseeded step number reaches it
_CHUNK = 4096  # vocabulary entries per program of the first launch
_OPTIONS = {pdl: {"num_warps": 4, **launch_options(pdl)} for pdl in (False, True)}  # both kernels', by PDL


@triton.jit
def _scaled(logits_ptr, start, vocab, scale, CHUNK: tl.constexpr):
    """Entries ``[start, start + CHUNK)`` of a row as scores: ``logits * scale`` (the logit
    itself when ``scale == 0``, greedy), ``-inf`` past the vocabulary."""
    idx = start + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
    if scale != 0:
        x = x * scale
    return idx, x


@triton.jit(do_not_specialize=["scale"])
def _chunk_mass_kernel(logits_ptr, stride, scale_ptr, scale, summary_ptr, vocab, num_chunks,
                       PER_ROW_SCALE: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """One chunk of one row into ``summary[row, chunk]``: its largest score and that entry's
    first index, and its mass ``sum(2 ** (score - largest))`` (0 for a chunk all ``-inf``),
    stored as three int32 (the floats' bits). ``scale`` is ``log2(e) / T``, 0 for greedy."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if PER_ROW_SCALE:
        scale = tl.load(scale_ptr + row)
    idx, x = _scaled(logits_ptr + row * stride, chunk * CHUNK, vocab, scale, CHUNK)
    top, first = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    mass = tl.sum(tl.exp2(x - tl.where(top == float("-inf"), 0.0, top)), 0)
    out = summary_ptr + 3 * (row * num_chunks + chunk)
    tl.store(out, top.to(tl.int32, bitcast=True))
    tl.store(out + 1, (chunk * CHUNK + first).to(tl.int32))
    tl.store(out + 2, mass.to(tl.int32, bitcast=True))


@triton.jit
def _uniform(key, a, b):
    """A float32 in [0, 1) on a 2**-24 grid: the top 24 bits of Philox word 0 of ``(key, a, b)``."""
    zero = tl.zeros([], tl.uint32)
    w0, _, _, _ = tl.philox(key, zero, zero + a.to(tl.uint32), zero + b.to(tl.uint32), zero)
    return (w0 >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _token_in_chunk(logits_ptr, start, vocab, scale, top, residual, CHUNK: tl.constexpr):
    """The first entry of the chunk at ``start`` whose running sum of ``2 ** (score - top)``
    passes ``residual``; where rounding leaves none, the chunk's last entry of nonzero mass."""
    idx, x = _scaled(logits_ptr, start, vocab, scale, CHUNK)
    p = tl.exp2(x - top)
    hit = (tl.cumsum(p, 0) > residual) & (p > 0)
    token = tl.min(tl.where(hit, idx, vocab), 0)
    last = tl.max(tl.where(p > 0, idx, -1), 0)
    return tl.where(token == vocab, last, token)


@triton.jit(do_not_specialize=["scale", "step_key", "step"])
def _pick_kernel(logits_ptr, stride, scale_ptr, scale, streams_ptr, step_key, step, summary_ptr, out_ptr,
                 vocab, num_chunks, PER_ROW_SCALE: tl.constexpr, PER_ROW_STREAMS: tl.constexpr,
                 STEP_IN_MEMORY: tl.constexpr, BLOCK_C: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """One row: greedy, the first largest logit; random, the token where the row's uniform
    lands on its CDF (``(key, a, b)`` from ``streams[row]``, else ``(step_key, row, step)``,
    ``step`` read from ``streams_ptr[0]`` when ``STEP_IN_MEMORY``)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    if PER_ROW_SCALE:
        scale = tl.load(scale_ptr + row)
    c = tl.arange(0, BLOCK_C)
    ok = c < num_chunks
    base = summary_ptr + 3 * (row * num_chunks + c)
    top = tl.load(base, mask=ok, other=0).to(tl.float32, bitcast=True)
    top = tl.where(ok, top, float("-inf"))
    best = tl.max(top, 0)
    if scale == 0:
        index = tl.load(base + 1, mask=ok, other=0)
        token = tl.min(tl.where(ok & (top == best), index, vocab), 0)
    else:
        if PER_ROW_STREAMS:
            own = streams_ptr + 3 * row
            key, a, b = tl.load(own), tl.load(own + 1), tl.load(own + 2)
        elif STEP_IN_MEMORY:
            key, a, b = step_key.to(tl.int64), row, tl.load(streams_ptr)
        else:
            key, a, b = step_key.to(tl.int64), row, step.to(tl.int64)
        mass = tl.load(base + 2, mask=ok, other=0).to(tl.float32, bitcast=True)
        weight = tl.where(ok, mass * tl.exp2(top - best), 0.0)
        target = _uniform(key, a, b) * tl.sum(weight, 0)
        passed = (tl.cumsum(weight, 0) > target) & (weight > 0)
        chunk = tl.min(tl.where(passed, c, BLOCK_C), 0)
        chunk = tl.where(chunk == BLOCK_C, tl.max(tl.where(weight > 0, c, -1), 0), chunk)
        chunk = tl.maximum(chunk, 0)  # a row with no mass (NaN or all -inf logits): read in bounds
        residual = target - tl.sum(tl.where(c < chunk, weight, 0.0), 0)
        token = _token_in_chunk(logits_ptr + row * stride, chunk * CHUNK, vocab, scale, best, residual, CHUNK)
    tl.store(out_ptr + row, tl.minimum(tl.maximum(token, 0), vocab - 1).to(tl.int64))  # always a valid id


class Streams:
    """The uniforms' streams of a batch's rows: one ``(key, step)`` for all (row ``i`` draws
    ``(key, i, step)``; ``step`` a number, or an int64 ``[1]`` tensor on the logits' device that
    the kernel reads when it runs), or each row's own ``(key, a, b)`` when some rows are seeded."""

    def __init__(self, key: int, step: int | torch.Tensor, per_row: torch.Tensor | None = None) -> None:
        self.key, self.step = key, step
        self.per_row = per_row  # int64 [rows, 3] on the logits' device, contiguous, or None

    @property
    def step_in_memory(self) -> bool:
        return self.per_row is None and isinstance(self.step, torch.Tensor)

    def args(self, like: torch.Tensor) -> tuple:
        if self.per_row is not None:
            return self.per_row, self.key, 0
        if self.step_in_memory:
            return self.step, self.key, 0
        return like, self.key, self.step


def scale_of(temperature: float) -> float:
    """The kernels' per-row ``scale`` for ``temperature``: ``log2(e) / T``, 0 for greedy."""
    return LOG2E / temperature if temperature > 0 else 0.0


def sample(logits: torch.Tensor, scale: float | torch.Tensor, streams: Streams) -> torch.Tensor:
    """int64 ``[rows]``: one token per row of ``logits`` (``[rows, vocab]``, any float dtype,
    rows contiguous, ``vocab < 2**31``; ``-inf`` marks a token a row may not take) at ``scale``
    (:func:`scale_of` the temperature: one for all rows, or float32 ``[rows]``)."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if not rows:
        return out
    chunks = triton.cdiv(vocab, _CHUNK)
    summary = torch.empty(rows, chunks, 3, dtype=torch.int32, device=logits.device)
    per_row = isinstance(scale, torch.Tensor)
    scale_args = (scale if per_row else out, 0.0 if per_row else float(scale))
    pdl = pdl_options(logits.device)["PDL"]
    # Both through :func:`~kvscope.kernels.launch.launcher` (every argument positional): Triton's
    # own launch path costs the host more than the launch, and a decode step launches both.
    launcher(_chunk_mass_kernel, **_OPTIONS[pdl])(
        (rows, chunks), logits, logits.stride(0), *scale_args, summary, vocab, chunks, per_row, _CHUNK, pdl)
    launcher(_pick_kernel, **_OPTIONS[pdl])(
        (rows,), logits, logits.stride(0), *scale_args, *streams.args(out), summary, out, vocab, chunks, per_row,
        streams.per_row is not None, streams.step_in_memory, triton.next_power_of_2(chunks), _CHUNK, pdl)
    return out


def compile_variants(vocab: int, dtype: torch.dtype, device: torch.device) -> None:
    """Launch every kernel variant a run can take (one or per-row scales; shared streams, the
    step in memory, or per-row streams) once, so none compiles inside the first steps that use it."""
    logits = torch.zeros(2, vocab, dtype=dtype, device=device)
    for streams in (Streams(1 << 62, 0), Streams(1 << 62, torch.zeros(1, dtype=torch.int64, device=device)),
                    Streams(1 << 62, 0, torch.zeros(2, 3, dtype=torch.int64, device=device))):
        sample(logits, 1.0, streams)
        sample(logits, torch.ones(2, device=device), streams)
