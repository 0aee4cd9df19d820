"""Sampling on the GPU in one pass over the logits: temperature, noise and argmax fused.

A random row samples by the Gumbel-max trick: the token is ``argmax(logits / T + G)`` with
``G = -log(-log U)`` drawn per vocabulary entry, which picks each token with probability
``softmax(logits / T)``; a greedy row takes ``argmax(logits)``. The kernel works in base 2
(``argmax(log2(e) * logits / T - log2(-log2 U))``, the same argmax), so the noise costs two
fast ``log2``. Unfused, that is a cast, a division, a softmax, a noise draw, a division and an
argmax, each a launch and a round trip through ``[rows, vocab]`` float32 memory; here it is one
pass that reads the logits once, in their own dtype, and draws the noise in registers: each
program takes one chunk of a row's vocabulary (so a small batch still fills the GPU), and a
second launch picks each row's best chunk.

The noise is counter-based (Philox-4x32-10): the value at vocabulary entry ``j`` of a row is a
pure function of the row's *stream*, ``(key, a, b)``, and ``j`` (one Philox call gives four
words, for four entries ``_QUARTER`` apart in a chunk). The sampler gives an unseeded row the
stream ``(sampler key, row, step)`` and a seeded row ``(seed, output index, SEEDED)``, so a
seeded request draws the same noise whatever it is batched with. Rows with top-k or top-p go
through the same kernel with the tokens outside their set masked to ``-inf``, so a row samples
the same token whichever path its batch took.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SEEDED = 1 << 31  # a seeded row's third counter word: no unseeded step number reaches it
LOG2E = 1.4426950408889634
_CHUNK = 4096  # vocabulary entries per program
_QUARTER = _CHUNK // 4


@triton.jit
def _log2_exponential(word):
    """``log2(-log2 U)`` from one Philox word: ``log2 E`` for ``E ~ Exp(1)`` up to a constant
    (which no argmax sees). The uniform takes the word's top 23 bits plus half a step: every such
    value is a float32 strictly inside (0, 1), so the noise is finite and no entry wins or loses
    whatever its logit (with 24 bits the top value rounds up to 1.0, and its entry always won)."""
    u = ((word >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    return tl.log2(-tl.log2(u))


@triton.jit
def _chunk_noise(row, chunk, streams_ptr, step_key, step, PER_ROW_STREAMS: tl.constexpr, QUARTER: tl.constexpr):
    """The noise for the four quarters of vocabulary chunk ``chunk`` of ``row``: entry
    ``chunk * 4 * QUARTER + k * QUARTER + q`` takes word ``k`` of counter ``chunk * QUARTER + q``
    of the row's stream ``(key, a, b)`` (``(step_key, row, step)`` unless streams are per row)."""
    if PER_ROW_STREAMS:
        own = streams_ptr + 3 * row
        key, a, b = tl.load(own), tl.load(own + 1), tl.load(own + 2)
    else:
        key, a, b = step_key.to(tl.int64), row, step.to(tl.int64)
    counter = (chunk * QUARTER + tl.arange(0, QUARTER)).to(tl.uint32)
    zero = tl.zeros_like(counter)
    w0, w1, w2, w3 = tl.philox(key, counter, zero + a.to(tl.uint32), zero + b.to(tl.uint32), zero)
    return _log2_exponential(w0), _log2_exponential(w1), _log2_exponential(w2), _log2_exponential(w3)


@triton.jit
def _quarter_best(logits_ptr, start, vocab, scale, noise, QUARTER: tl.constexpr):
    """(largest score, its first index) over entries ``[start, start + QUARTER)``: the score is
    ``logits * scale - noise``, or the logit itself when ``scale == 0`` (greedy)."""
    idx = start + tl.arange(0, QUARTER)
    x = tl.load(logits_ptr + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
    if scale != 0:
        x = x * scale - noise
    return tl.max(x, axis=0), start + tl.argmax(x, axis=0, tie_break_left=True)


@triton.jit(do_not_specialize=["scale", "step_key", "step"])
def _sample_chunks_kernel(logits_ptr, stride, scale_ptr, scale, streams_ptr, step_key, step, best_ptr, vocab,
                          num_chunks, PER_ROW_SCALE: tl.constexpr, PER_ROW_STREAMS: tl.constexpr,
                          QUARTER: tl.constexpr):
    """One chunk of one row: its best score and that entry's index, into ``best[row, chunk]``
    (the score's bits and the index, as two int32). ``scale`` is ``log2(e) / T``, 0 for greedy."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if PER_ROW_SCALE:
        scale = tl.load(scale_ptr + row)
    n0, n1, n2, n3 = _chunk_noise(row, chunk, streams_ptr, step_key, step, PER_ROW_STREAMS, QUARTER)
    row_ptr = logits_ptr + row * stride
    start = chunk * 4 * QUARTER
    best, best_i = _quarter_best(row_ptr, start, vocab, scale, n0, QUARTER)
    m, i = _quarter_best(row_ptr, start + QUARTER, vocab, scale, n1, QUARTER)
    best_i = tl.where(m > best, i, best_i)  # (a later quarter wins only by more: first index on ties)
    best = tl.maximum(m, best)
    m, i = _quarter_best(row_ptr, start + 2 * QUARTER, vocab, scale, n2, QUARTER)
    best_i = tl.where(m > best, i, best_i)
    best = tl.maximum(m, best)
    m, i = _quarter_best(row_ptr, start + 3 * QUARTER, vocab, scale, n3, QUARTER)
    best_i = tl.where(m > best, i, best_i)
    best = tl.maximum(m, best)
    out = best_ptr + 2 * (row * num_chunks + chunk)
    tl.store(out, best.to(tl.int32, bitcast=True))
    tl.store(out + 1, best_i.to(tl.int32))


@triton.jit
def _pick_chunk_kernel(best_ptr, out_ptr, num_chunks, vocab, BLOCK: tl.constexpr):
    """One row: the index of its best chunk's best entry, the first one on ties, as ``torch.argmax``."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < num_chunks
    pairs = best_ptr + 2 * (row * num_chunks + c)
    score = tl.load(pairs, mask=mask, other=0).to(tl.float32, bitcast=True)
    score = tl.where(mask, score, float("-inf"))
    index = tl.load(pairs + 1, mask=mask, other=0)
    top = tl.max(score, axis=0)
    first = tl.min(tl.where(mask & (score == top), index, vocab), axis=0)
    tl.store(out_ptr + row, tl.minimum(first, vocab - 1).to(tl.int64))


class Streams:
    """The noise streams of a batch's rows: one ``(key, step)`` for all (row ``i`` draws
    ``(key, i, step)``), or each row's own ``(key, a, b)`` when some rows are seeded."""

    def __init__(self, key: int, step: int, per_row: torch.Tensor | None = None) -> None:
        self.key, self.step = key, step
        self.per_row = per_row  # int64 [rows, 3] on the logits' device, contiguous, or None

    def args(self, like: torch.Tensor) -> tuple:
        return (like if self.per_row is None else self.per_row), self.key, self.step


def scale_of(temperature: float) -> float:
    """The kernel's per-row ``scale`` for ``temperature``: ``log2(e) / T``, 0 for greedy."""
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
    best = torch.empty(rows, chunks, 2, dtype=torch.int32, device=logits.device)
    per_row = isinstance(scale, torch.Tensor)
    _sample_chunks_kernel[(rows, chunks)](
        logits, logits.stride(0), scale if per_row else out, 0.0 if per_row else float(scale),
        *streams.args(out), best, vocab, chunks,
        PER_ROW_SCALE=per_row, PER_ROW_STREAMS=streams.per_row is not None, QUARTER=_QUARTER, num_warps=4,
    )
    _pick_chunk_kernel[(rows,)](best, out, chunks, vocab, BLOCK=triton.next_power_of_2(chunks), num_warps=1)
    return out


def compile_variants(vocab: int, dtype: torch.dtype, device: torch.device) -> None:
    """Launch every kernel variant a run can take (one or per-row scales, shared or per-row
    streams) once, so none compiles inside the first steps that use it."""
    logits = torch.zeros(2, vocab, dtype=dtype, device=device)
    for streams in (Streams(1 << 62, 0), Streams(1 << 62, 0, torch.zeros(2, 3, dtype=torch.int64, device=device))):
        sample(logits, 1.0, streams)
        sample(logits, torch.ones(2, device=device), streams)
