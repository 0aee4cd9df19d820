"""Pure-torch paged attention: runs anywhere and is the reference the fast backends match.

:func:`paged_attention_reference` favours obviousness over speed: one sequence at a time, the
history gathered page by page through the block table, scores and softmax in float32. The
batched torch path (:mod:`kvscope.kernels.torch_batched_attention`, what the ``torch`` backend
runs) and the fused Triton backend are tested against it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvscope.kernels.base import AttentionMetadata
from kvscope.kernels.kv_quant import FP8_DTYPE, dequantize_kv, quantize_kv
from kvscope.kernels.torch_batched_attention import PaddedBatch, attend_planned, plan_batches


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | float = 1.0,
             v_scale: torch.Tensor | float = 1.0, *, all_written: bool = False) -> None:
    """Write row ``t`` of ``k``/``v`` (``[T, Hkv, D]``) to flat slot ``slot_mapping[t]``; -1 skips.

    An fp8 pool stores them quantized with ``k_scale`` / ``v_scale``. ``all_written``: the
    caller already knows no slot is -1 (checked once per step, not once per layer).
    """
    if not all_written:
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            rows = keep.nonzero().squeeze(1)
            k, v, slot_mapping = k[rows], v[rows], slot_mapping[rows]
    _, _, hkv, d = k_cache.shape
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        x = quantize_kv(x, scale, cache.dtype)
        if cache.dtype == FP8_DTYPE:  # index_copy_ has no fp8 kernel on CPU: copy the bytes
            cache, x = cache.view(torch.uint8), x.view(torch.uint8)
        cache.view(-1, hkv, d).index_copy_(0, slot_mapping, x)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One sequence: ``q`` ``[n, Hq, D]`` are the last ``n`` positions of the ``L`` keys ``k``/``v``
    ``[L, Hkv, D]``; query row ``j`` (position ``L - n + j``) sees keys ``0 .. L - n + j``.

    Query head ``h`` reads KV head ``h // (Hq / Hkv)`` (grouped-query attention).
    """
    n, hq, d = q.shape
    length, hkv, _ = k.shape
    if hq % hkv:
        raise ValueError(f"{hq} query heads cannot share {hkv} KV heads evenly")
    if n > length:
        raise ValueError(f"{n} query rows but only {length} keys")
    qg = q.float().view(n, hkv, hq // hkv, d)
    scores = torch.einsum("nhgd,lhd->hgnl", qg, k.float()) * scale
    q_pos = torch.arange(length - n, length, device=q.device)
    k_pos = torch.arange(length, device=q.device)
    scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    probs = scores.softmax(dim=-1)
    out = torch.einsum("hgnl,lhd->nhgd", probs, v.float())
    return out.reshape(n, hq, d).to(q.dtype)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: AttentionMetadata, scale: float,
                              k_scale: torch.Tensor | float = 1.0,
                              v_scale: torch.Tensor | float = 1.0) -> torch.Tensor:
    """The read side only: attend every packed query row to its sequence's cached history.

    Sequence ``i``'s history is the first ``context_lens[i]`` slots of the pages
    ``block_tables[i]``; it must already contain this step's keys. Rows past
    ``cu_seqlens_q[-1]`` (padding) come back as zeros. An fp8 pool is dequantized as it is read.
    """
    out = torch.zeros_like(q)
    cu_q = meta.cu_seqlens_q.tolist()
    lens = meta.context_lens.tolist()
    bs = k_cache.shape[1]
    for i in range(meta.num_seqs):
        start, end, length = cu_q[i], cu_q[i + 1], lens[i]
        if end == start:
            continue
        num_pages = -(-length // bs)
        pages = meta.block_tables[i, :num_pages].long()
        if pages.numel() < num_pages or bool((pages < 0).any()):
            raise ValueError(f"sequence {i}: block table has no page for context length {length}")
        keys = dequantize_kv(k_cache[pages].flatten(0, 1)[:length], k_scale, q.dtype)
        values = dequantize_kv(v_cache[pages].flatten(0, 1)[:length], v_scale, q.dtype)
        out[start:end] = causal_attention(q[start:end], keys, values, scale)
    return out


def varlen_attention_no_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention over this step's packed k/v only, for steps where every sequence computes
    its whole history (``meta.no_prefix``) and no KV pool exists yet (the memory-profiling
    warm-up). Uses torch's fused SDPA so that warm-up peak memory resembles a real kernel's,
    not a materialised score matrix."""
    out = torch.zeros_like(q)
    cu = cu_seqlens.tolist()
    group = q.shape[1] // k.shape[1]
    for start, end in zip(cu[:-1], cu[1:]):
        if end == start:
            continue
        qs, ks, vs = (x[start:end].transpose(0, 1) for x in (q, k, v))  # [H, n, D]
        ks, vs = ks.repeat_interleave(group, dim=0), vs.repeat_interleave(group, dim=0)
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out


class TorchAttentionBackend:
    """:class:`~kvscope.kernels.base.AttentionBackend` in plain torch (CPU or GPU), batched:
    a few tensor operations per layer whatever the number of sequences."""

    name = "torch"

    def __init__(self) -> None:
        # The step layout is the same for every layer: planned at the first, reused by the rest
        # (with whether every row writes its K/V).
        self._planned: tuple[AttentionMetadata, tuple[int, int, int, int], list[PaddedBatch], bool] | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, k_scale: torch.Tensor | float = 1.0,
                v_scale: torch.Tensor | float = 1.0, kv_stored: bool = False) -> torch.Tensor:
        shape = (q.shape[0], k_cache.shape[1], q.shape[1], k_cache.shape[2])
        if self._planned is None or self._planned[0] is not meta or self._planned[1] != shape:
            self._planned = (meta, shape, plan_batches(meta, *shape), bool((meta.slot_mapping >= 0).all()))
        _, _, plan, all_written = self._planned
        if not kv_stored:
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale,
                     all_written=all_written)
        return attend_planned(q, k_cache, v_cache, plan, scale, k, v, k_scale, v_scale)


class TorchReferenceBackend:
    """The reference as a backend, one sequence at a time: the oracle the batched backend is
    tested against step for step, and the "before" arm of ``benchmarks/bench_cpu_demo.py``."""

    name = "torch_reference"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, k_scale: torch.Tensor | float = 1.0,
                v_scale: torch.Tensor | float = 1.0, kv_stored: bool = False) -> torch.Tensor:
        if not kv_stored:
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        return paged_attention_reference(q, k_cache, v_cache, meta, scale, k_scale, v_scale)
