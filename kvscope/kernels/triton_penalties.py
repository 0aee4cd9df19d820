"""vLLM's presence, frequency and repetition penalties in one pass over each penalized row.

In torch the penalties are a dozen element-wise passes over ``[rows, vocab]`` float32 tensors
(a factor per token, the division or product, the counts' terms), plus the gathers that copy each
row's prompt mask and output counts out of the pool that keeps them between steps. This kernel
reads a row's logits, its pool row's mask and counts, and its output still in flight (one token,
counted here and not in the pool), and writes the penalized logits back in place: one read of
each and one write.

It computes what :func:`kvscope.runner.logit_adjustments.apply_penalties` does, operation for
operation in float32: the division correctly rounded (``div_rn``, as torch's) and no
multiply-add fused (``enable_fp_fusion=False``), so both give the same bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvscope.kernels.launch import launcher

_BLOCK = 2048  # vocabulary entries per program


@triton.jit
def _penalize_kernel(logits_ptr, logits_stride, at_ptr, mask_ptr, counts_ptr, pool_stride, pool_rows_ptr,
                     in_flight_ptr, repetition_ptr, frequency_ptr, presence_ptr, vocab, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < vocab
    out = logits_ptr + tl.load(at_ptr + i) * logits_stride + cols
    pool = tl.load(pool_rows_ptr + i) * pool_stride + cols
    x = tl.load(out, mask=ok, other=0.0)
    in_prompt = tl.load(mask_ptr + pool, mask=ok, other=0) != 0
    count = tl.load(counts_ptr + pool, mask=ok, other=0.0) + (cols == tl.load(in_flight_ptr + i)).to(tl.float32)
    generated = count > 0
    factor = tl.where(in_prompt | generated, tl.load(repetition_ptr + i), 1.0)
    x = tl.where(x > 0, tl.math.div_rn(x, factor), x * factor)
    x = x - tl.load(frequency_ptr + i) * count
    x = x - tl.load(presence_ptr + i) * generated.to(tl.float32)
    tl.store(out, x, mask=ok)


def penalize_(logits: torch.Tensor, at: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
              pool_rows: torch.Tensor, in_flight: torch.Tensor, repetition: torch.Tensor, frequency: torch.Tensor,
              presence: torch.Tensor) -> None:
    """Penalize rows ``at`` (int64 ``[p]``) of float32 ``logits`` (``[rows, vocab]``, rows
    contiguous) in place. Row ``at[k]``'s tokens are pool row ``pool_rows[k]`` of
    ``prompt_mask`` (bool) and ``output_counts`` (float32, both ``[pool rows, vocab]``), plus
    the output ``in_flight[k]`` (-1: none); its settings are ``repetition[k]``, ``frequency[k]``
    and ``presence[k]`` (float32)."""
    p, vocab = at.numel(), logits.shape[1]
    if not p:
        return
    launcher(_penalize_kernel, num_warps=4, enable_fp_fusion=False)(
        (p, triton.cdiv(vocab, _BLOCK)), logits, logits.stride(0), at, prompt_mask.view(torch.uint8), output_counts,
        output_counts.stride(0), pool_rows, in_flight, repetition, frequency, presence, vocab, _BLOCK)


def compile_variants(vocab: int, device: torch.device) -> None:
    """Launch the kernel once, so that it does not compile inside the first penalized step."""
    one = torch.zeros(1, dtype=torch.int64, device=device)
    ones = torch.ones(1, device=device)
    penalize_(torch.zeros(1, vocab, device=device), one, torch.zeros(1, vocab, dtype=torch.bool, device=device),
              torch.zeros(1, vocab, device=device), one, one - 1, ones, ones, ones)
