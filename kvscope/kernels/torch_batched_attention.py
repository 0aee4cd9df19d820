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

Everything that depends only on the step's layout (:func:`plan_batches`) is computed once per
step and reused by every layer.
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
                  block_size: int, group: int) -> PaddedBatch:
    """The padded batch of sequences ``seqs`` (all if None), ``n`` query slots each, for
    ``group`` query heads per KV head."""
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
    mask = visible[:, None, None].expand(b, 1, group, n, length).reshape(b, 1, group * n, length)
    whole = seqs is None and b * n == num_rows and bool(real.all())
    out_rows = rows[real]
    return PaddedBatch(rows=rows.clamp_(max=max(num_rows - 1, 0)), real=real, out_rows=out_rows,
                       slots=slots, mask=mask, length=length, whole=whole)


def plan_batches(meta: AttentionMetadata, num_rows: int, block_size: int, group: int = 1) -> list[PaddedBatch]:
    """Lay one step out as padded batches (the same for every layer): one, or the decode rows
    apart from the longer queries when a step has both. ``group``: query heads per KV head."""
    if meta.decode_only or meta.max_seqlen_q == 1:
        return [_padded_batch(meta, None, 1, num_rows, block_size, group)]
    decode = (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]) == 1
    if not bool(decode.any()):
        return [_padded_batch(meta, None, meta.max_seqlen_q, num_rows, block_size, group)]
    return [_padded_batch(meta, decode.nonzero().squeeze(1), 1, num_rows, block_size, group),
            _padded_batch(meta, (~decode).nonzero().squeeze(1), meta.max_seqlen_q, num_rows, block_size, group)]


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PaddedBatch,
            scale: float, k: torch.Tensor, v: torch.Tensor,
            k_scale: torch.Tensor | float, v_scale: torch.Tensor | float) -> torch.Tensor:
    """One SDPA call over ``batch``: ``[b, n, Hq, D]``, padding slots included."""
    _, hq, d = q.shape
    hkv = k_cache.shape[2]
    b, n = batch.rows.shape
    group = hq // hkv
    if batch.mask.shape[2] != group * n:
        raise ValueError(f"the plan was made for {batch.mask.shape[2] // n} query heads per KV head, "
                         f"not {group}")
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
    hq, hkv = q.shape[1], k_cache.shape[2]
    if hq % hkv:
        raise ValueError(f"{hq} query heads cannot share {hkv} KV heads evenly")
    if len(plan) == 1 and plan[0].whole:  # the batch is the packed rows: nothing to scatter
        return _attend(q, k_cache, v_cache, plan[0], scale, k, v, k_scale, v_scale).reshape(q.shape).to(q.dtype)
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
    plan = plan_batches(meta, q.shape[0], k_cache.shape[1], q.shape[1] // k_cache.shape[2])
    return attend_planned(q, k_cache, v_cache, plan, scale, k, v)
