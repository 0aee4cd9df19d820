"""Sampling on the GPU in one pass over the logits: temperature, noise and argmax fused.

A random row samples by the exponential race in log space: the token is
``argmax(logits / T - log E)``, ``E ~ Exp(1)`` drawn per vocabulary entry, which picks each
token with probability ``softmax(logits / T)``; a greedy row (``T == 0``) takes
``argmax(logits)``. Unfused, that is a cast, a division, a softmax, a noise draw, a division and
an argmax, each a launch and a round trip through ``[rows, vocab]`` float32 memory; here it is
one launch that reads the logits once, in their own dtype, and draws the noise in registers.

The noise is counter-based (Philox): the value at vocabulary entry ``j`` of a row is a pure
function of the row's *stream*, ``(key, a, b)``, and ``j``. The sampler gives an unseeded row
the stream ``(sampler key, row, step)`` and a seeded row ``(seed, output index, SEEDED)``, so a
seeded request draws the same noise whatever it is batched with. :func:`log_exponential_noise`
writes the same values to memory, for the torch path that masks top-k / top-p first: a row
samples the same token on both paths.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SEEDED = 1 << 31  # a seeded row's third counter word: no unseeded step number reaches it
_BLOCK = 2048  # vocabulary entries per loop iteration


@triton.jit
def _log_exponential(key, a, b, cols):
    """``log E`` with ``E ~ Exp(1)`` for vocabulary entries ``cols`` of the stream ``(key, a, b)``.

    The uniform takes the top 24 bits of a Philox word plus half a step, so it lies strictly
    inside (0, 1): ``E`` is finite and nonzero, and no entry wins or loses regardless of its logit.
    """
    zero = tl.zeros_like(cols).to(tl.uint32)
    r, _, _, _ = tl.philox(key, cols.to(tl.uint32), zero + a.to(tl.uint32), zero + b.to(tl.uint32), zero)
    u = ((r >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    return tl.log(-tl.log(u))


@triton.jit
def _row_stream(row, streams_ptr, step_key, step, PER_ROW_STREAMS: tl.constexpr):
    if PER_ROW_STREAMS:
        own = streams_ptr + 3 * row
        key, a, b = tl.load(own), tl.load(own + 1), tl.load(own + 2)
    else:
        key, a, b = step_key.to(tl.int64), row, step.to(tl.int64)
    return key, a, b


@triton.jit(do_not_specialize=["temp", "step_key", "step"])
def _sample_kernel(logits_ptr, stride, temp_ptr, temp, streams_ptr, step_key, step, out_ptr,
                   vocab, PER_ROW_TEMP: tl.constexpr, PER_ROW_STREAMS: tl.constexpr, BLOCK: tl.constexpr):
    """One row: the index of the largest ``logits / T - log E`` (of ``logits`` when ``T == 0``),
    the first one on ties, as ``torch.argmax``."""
    row = tl.program_id(0).to(tl.int64)
    if PER_ROW_TEMP:
        temp = tl.load(temp_ptr + row)
    key, a, b = _row_stream(row, streams_ptr, step_key, step, PER_ROW_STREAMS)
    cols = tl.arange(0, BLOCK)
    best = tl.full((), float("-inf"), tl.float32)
    best_index = tl.full((), 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        idx = start + cols
        mask = idx < vocab
        x = tl.load(logits_ptr + row * stride + idx, mask=mask, other=float("-inf")).to(tl.float32)
        if temp != 0:
            x = tl.div_rn(x, temp) - _log_exponential(key, a, b, idx)
        m = tl.max(x, axis=0)
        i = tl.argmax(x, axis=0, tie_break_left=True)
        if m > best:
            best = m
            best_index = start + i.to(tl.int64)
    tl.store(out_ptr + row, best_index)


@triton.jit(do_not_specialize=["step_key", "step"])
def _noise_kernel(out_ptr, stride, streams_ptr, step_key, step, vocab,
                  PER_ROW_STREAMS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key, a, b = _row_stream(row, streams_ptr, step_key, step, PER_ROW_STREAMS)
    tl.store(out_ptr + row * stride + idx, _log_exponential(key, a, b, idx), mask=idx < vocab)


class Streams:
    """The noise streams of a batch's rows: one ``(key, step)`` for all (row ``i`` draws
    ``(key, i, step)``), or each row's own ``(key, a, b)`` when some rows are seeded."""

    def __init__(self, key: int, step: int, per_row: torch.Tensor | None = None) -> None:
        self.key, self.step = key, step
        self.per_row = per_row  # int64 [rows, 3] on the logits' device, contiguous, or None

    def args(self, like: torch.Tensor) -> tuple:
        return (like if self.per_row is None else self.per_row), self.key, self.step


def sample(logits: torch.Tensor, temperature: float | torch.Tensor, streams: Streams) -> torch.Tensor:
    """int64 ``[rows]``: one token per row of ``logits`` (``[rows, vocab]``, any float dtype,
    rows contiguous) at ``temperature`` (one for all rows, or float32 ``[rows]``; 0 is greedy)."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    per_row_temp = isinstance(temperature, torch.Tensor)
    if rows:
        _sample_kernel[(rows,)](
            logits, logits.stride(0), temperature if per_row_temp else out, 0.0 if per_row_temp else float(temperature),
            *streams.args(out), out, vocab,
            PER_ROW_TEMP=per_row_temp, PER_ROW_STREAMS=streams.per_row is not None, BLOCK=_BLOCK, num_warps=8,
        )
    return out


def compile_variants(vocab: int, dtype: torch.dtype, device: torch.device) -> None:
    """Launch every kernel variant a run can take (one or per-row temperatures, shared or per-row
    streams) once, so none compiles inside the first steps that use it."""
    logits = torch.zeros(2, vocab, dtype=dtype, device=device)
    for streams in (Streams(1 << 62, 0), Streams(1 << 62, 0, torch.zeros(2, 3, dtype=torch.int64, device=device))):
        sample(logits, 1.0, streams)
        sample(logits, torch.ones(2, device=device), streams)
        log_exponential_noise(2, vocab, streams, device)


def log_exponential_noise(rows: int, vocab: int, streams: Streams, device: torch.device) -> torch.Tensor:
    """float32 ``[rows, vocab]``: the ``log E`` that :func:`sample` draws for the same streams."""
    out = torch.empty(rows, vocab, dtype=torch.float32, device=device)
    if rows:
        _noise_kernel[(rows, triton.cdiv(vocab, _BLOCK))](
            out, out.stride(0), *streams.args(out), vocab,
            PER_ROW_STREAMS=streams.per_row is not None, BLOCK=_BLOCK, num_warps=4,
        )
    return out
