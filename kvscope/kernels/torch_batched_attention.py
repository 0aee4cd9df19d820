"""Batched paged attention in plain torch: what ``attention_backend="torch"`` runs.

The reference (:func:`~kvscope.kernels.torch_attention.paged_attention_reference`) walks the
sequences in Python; for a small model on a CPU that walk, not the arithmetic, was most of a
step. Here a step costs the same few tensor operations whatever the batch: the query rows are
padded into a ``[B, n]`` batch, every history is gathered through its block table into one
``[B, L]`` batch of keys, and one ``scaled_dot_product_attention`` call attends all of it under
a mask that carries each sequence's length and the causal offset of its query rows.

Where one step mixes decode rows with prefill chunks, padding every sequence to the longest
chunk would multiply the decode rows' work by the chunk length; the decode rows then form a
batch of their own (two calls per layer, still no loop over sequences).

Grouped-query heads are never repeated: the ``G`` query heads that share a KV head become
``G * n`` query rows of that head, so each key is read once per KV head.

A decode batch (one query row per sequence) that reads the pool gathers its keys head-major
instead, ``[B * Hkv, L, D]``, and scores them with one batched matmul and a softmax under an
additive ``-inf`` bias (at this size SDPA's general kernel costs more than the arithmetic);
a float32 pool's values are summed straight from the pool by ``F.embedding_bag``, weighted by
the probabilities, so they are never copied out.

Everything that depends only on the step's layout (:func:`plan_batches`: slots, masks, biases,
whether the batch is the packed rows themselves, so nothing needs gathering or scattering) is
computed once per step and reused by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvscope.kernels.base import AttentionMetadata
from kvscope.kernels.kv_quant import dequantize_kv, quantize_kv


@dataclass
class PaddedBatch:
    """Where some sequences' query rows and keys sit in one padded batch."""

    rows: torch.Tensor            # [b, n] packed query row of each padded slot (clamped: gather only)
    real: torch.Tensor            # [b, n] the slot holds a real query row
    out_rows: torch.Tensor        # packed rows of the real slots, in ``real``'s order
    slots: torch.Tensor | None    # [b * L] pool slot of each padded key; None: keys are this step's k/v
    mask: torch.Tensor            # [b, 1, G * n, L] query row (of each of a KV head's G query heads) may see key
    length: int                   # L
    whole: bool                   # slot (i, j) is packed row i * n + j, and every row is one: no gather, no scatter
    heads: tuple[int, int]        # (G query heads per KV head, Hkv) the batch was laid out for
    # Decode batches (n = 1) read from the pool: row of each key in the pool seen as [N * bs * Hkv, D],
    # in [b, Hkv, L] order, and the mask as an additive bias [b * Hkv, 1, L] (0 or -inf).
    key_rows: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    # The same rows once per query head, flat, and where each head's bag of L rows starts: what
    # F.embedding_bag sums the values over, weighted by the probabilities.
    value_bags: torch.Tensor | None = None
    value_offsets: torch.Tensor | None = None


def _history_slots(tables: torch.Tensor, context_lens: torch.Tensor, length: int, block_size: int,
                   seqs: torch.Tensor | None) -> torch.Tensor:
    """``[b, length]`` flat pool slot of each key position; 0 past a sequence's history, where
    the mask hides the key anyway. ``seqs``: the step's sequence index of each row (for errors)."""
    if tables.shape[1] * block_size < length:
        raise ValueError(f"block_tables has {tables.shape[1]} pages per sequence, too few for "
                         f"max_seqlen_k={length} at block_size={block_size}")
    pos = torch.arange(length, device=tables.device)
    in_history = pos < context_lens[:, None]
    pages = tables.long()[:, pos // block_size]
    missing = (pages < 0) & in_history
    if bool(missing.any()):
        i = int(missing.any(dim=1).nonzero()[0])
        seq = i if seqs is None else int(seqs[i])
        raise ValueError(f"sequence {seq}: block table has no page for context length {int(context_lens[i])}")
    return torch.where(in_history, pages * block_size + pos % block_size, 0)


def _padded_batch(meta: AttentionMetadata, seqs: torch.Tensor | None, n: int, num_rows: int,
                  block_size: int, heads: tuple[int, int]) -> PaddedBatch:
    """The padded batch of sequences ``seqs`` (all if None), ``n`` query slots each, for
    ``heads`` = (query heads per KV head, KV heads)."""
    starts, ends = meta.cu_seqlens_q[:-1].long(), meta.cu_seqlens_q[1:].long()
    context_lens, tables = meta.context_lens.long(), meta.block_tables
    if seqs is not None:
        starts, ends, context_lens, tables = starts[seqs], ends[seqs], context_lens[seqs], tables[seqs]
    j = torch.arange(n, device=starts.device)
    real = j < (ends - starts)[:, None]
    rows = starts[:, None] + j
    if meta.no_prefix:  # the history is this step's rows: index them, not the pool
        length, slots, first_pos = n, None, torch.zeros_like(starts)
    else:
        length = meta.max_seqlen_k
        slots = _history_slots(tables, context_lens, length, block_size, seqs).view(-1)
        first_pos = context_lens - (ends - starts)
    # Query slot j of a sequence sits at position first_pos + j and sees the keys up to it;
    # that also keeps every real row inside its own history.
    visible = torch.arange(length, device=starts.device) <= (first_pos[:, None] + j)[:, :, None]
    b = visible.shape[0]
    group, hkv = heads
    mask = visible[:, None, None].expand(b, 1, group, n, length).reshape(b, 1, group * n, length)
    whole = seqs is None and b * n == num_rows and bool(real.all())
    out_rows = rows[real]
    batch = PaddedBatch(rows=rows.clamp_(max=max(num_rows - 1, 0)), real=real, out_rows=out_rows,
                        slots=slots, mask=mask, length=length, whole=whole, heads=heads)
    if n == 1 and slots is not None:
        kv_head = torch.arange(hkv, device=slots.device)
        key_rows = slots.view(b, 1, length) * hkv + kv_head[:, None]
        batch.key_rows = key_rows.view(-1)
        batch.value_bags = key_rows.view(b * hkv, 1, length).expand(b * hkv, group, length).reshape(-1)
        batch.value_offsets = torch.arange(0, batch.value_bags.numel(), length, device=slots.device)
        hidden = torch.zeros(b, 1, length, device=slots.device).masked_fill_(~visible, float("-inf"))
        batch.bias = hidden.repeat_interleave(hkv, dim=0)
    return batch


def plan_batches(meta: AttentionMetadata, num_rows: int, block_size: int, num_heads: int,
                 num_kv_heads: int) -> list[PaddedBatch]:
    """Lay one step out as padded batches (the same for every layer): one, or the decode rows
    apart from the longer queries when a step has both."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
    heads = (num_heads // num_kv_heads, num_kv_heads)
    if meta.decode_only or meta.max_seqlen_q == 1:
        return [_padded_batch(meta, None, 1, num_rows, block_size, heads)]
    decode = (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]) == 1
    if not bool(decode.any()):
        return [_padded_batch(meta, None, meta.max_seqlen_q, num_rows, block_size, heads)]
    return [_padded_batch(meta, decode.nonzero().squeeze(1), 1, num_rows, block_size, heads),
            _padded_batch(meta, (~decode).nonzero().squeeze(1), meta.max_seqlen_q, num_rows, block_size, heads)]


def _float32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()


def _decode_attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PaddedBatch,
                   scale: float, k_scale: torch.Tensor | float, v_scale: torch.Tensor | float) -> torch.Tensor:
    """One query row per sequence, keys from the pool: ``[b, 1, Hq, D]``. The keys are gathered
    head-major, so each KV head's history is one contiguous matrix and the scores are one
    batched matmul, which on a CPU costs less than SDPA's general kernel at this size. A float32
    pool's values are not gathered at all: ``F.embedding_bag`` sums the pool rows the
    probabilities weight, in one pass."""
    _, hq, d = q.shape
    group, hkv = batch.heads
    b, length = batch.rows.shape[0], batch.length
    keys = k_cache.view(-1, d).index_select(0, batch.key_rows).view(b * hkv, length, d)
    # Scores and softmax in float32 whatever the model's dtype, as SDPA and the reference do.
    keys = _float32(dequantize_kv(keys, k_scale, torch.float32))
    queries = _float32((q if batch.whole else q[batch.rows[:, 0]]).reshape(b * hkv, group, d))
    probs = torch.baddbmm(batch.bias, queries, keys.transpose(1, 2), alpha=scale).softmax(dim=-1)
    if v_cache.dtype == torch.float32:
        out = F.embedding_bag(batch.value_bags, v_cache.view(-1, d), batch.value_offsets, mode="sum",
                              per_sample_weights=probs.view(-1))
        return out.view(b, 1, hq, d)
    values = v_cache.view(-1, d).index_select(0, batch.key_rows).view(b * hkv, length, d)
    values = _float32(dequantize_kv(values, v_scale, torch.float32))
    return torch.bmm(probs, values).view(b, 1, hq, d)


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PaddedBatch,
            scale: float, k: torch.Tensor, v: torch.Tensor,
            k_scale: torch.Tensor | float, v_scale: torch.Tensor | float) -> torch.Tensor:
    """Attention over ``batch``: ``[b, n, Hq, D]``, padding slots included."""
    _, hq, d = q.shape
    hkv = k_cache.shape[2]
    if batch.heads != (hq // hkv, hkv):
        raise ValueError(f"the plan was made for {batch.heads[0] * batch.heads[1]} query and "
                         f"{batch.heads[1]} KV heads, not {hq} and {hkv}")
    if batch.key_rows is not None:
        return _decode_attend(q, k_cache, v_cache, batch, scale, k_scale, v_scale)
    b, n = batch.rows.shape
    group = hq // hkv
    if batch.slots is None:
        keys, values = (k.view(b, n, hkv, d), v.view(b, n, hkv, d)) if batch.whole else (k[batch.rows], v[batch.rows])
        # An fp8 pool: what a read of the pool would give, so chunking never changes the result.
        keys = dequantize_kv(quantize_kv(keys, k_scale, k_cache.dtype), k_scale, q.dtype)
        values = dequantize_kv(quantize_kv(values, v_scale, v_cache.dtype), v_scale, q.dtype)
    else:
        keys = k_cache.view(-1, hkv, d).index_select(0, batch.slots).view(b, batch.length, hkv, d)
        values = v_cache.view(-1, hkv, d).index_select(0, batch.slots).view(b, batch.length, hkv, d)
        keys, values = dequantize_kv(keys, k_scale, q.dtype), dequantize_kv(values, v_scale, q.dtype)
    # [b, n, Hq, D] -> [b, Hkv, G*n, D]: a KV head's query heads as extra query rows
    rows = q.view(b, n, hq, d) if batch.whole else q[batch.rows]
    queries = rows.view(b, n, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, group * n, d)
    o = F.scaled_dot_product_attention(queries, keys.transpose(1, 2), values.transpose(1, 2),
                                       attn_mask=batch.mask, scale=scale)
    return o.view(b, hkv, group, n, d).permute(0, 3, 1, 2, 4).reshape(b, n, hq, d)


def attend_planned(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   plan: list[PaddedBatch], scale: float, k: torch.Tensor, v: torch.Tensor,
                   k_scale: torch.Tensor | float = 1.0, v_scale: torch.Tensor | float = 1.0) -> torch.Tensor:
    """Attention of every real query row under ``plan``; padding rows come back as zeros. An
    fp8 pool is dequantized as it is gathered."""
    if len(plan) == 1 and plan[0].whole:  # the batch is the packed rows: nothing to scatter
        out = _attend(q, k_cache, v_cache, plan[0], scale, k, v, k_scale, v_scale).reshape(q.shape)
        return out if out.dtype == q.dtype else out.to(q.dtype)
    out = torch.zeros_like(q)
    for batch in plan:
        o = _attend(q, k_cache, v_cache, batch, scale, k, v, k_scale, v_scale)
        out[batch.out_rows] = o[batch.real].to(out.dtype)
    return out


def paged_attention_batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The reference's contract, batched: packed rows ``q`` ``[T, Hq, D]`` attend causally to
    their sequence's history in the pool, which already holds this step's ``k``/``v``
    ``[T, Hkv, D]`` (read from those directly when ``meta.no_prefix``); rows past
    ``cu_seqlens_q[-1]`` come back as zeros."""
    plan = plan_batches(meta, q.shape[0], k_cache.shape[1], q.shape[1], k_cache.shape[2])
    return attend_planned(q, k_cache, v_cache, plan, scale, k, v)
