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
    visible: torch.Tensor         # [b, 1, 1, n, L] query slot may see key slot
    length: int                   # L


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
                  block_size: int) -> PaddedBatch:
    """The padded batch of sequences ``seqs`` (all if None), ``n`` query slots each."""
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
    out_rows = rows[real]
    return PaddedBatch(rows=rows.clamp_(max=max(num_rows - 1, 0)), real=real, out_rows=out_rows,
                       slots=slots, visible=visible[:, None, None], length=length)


def plan_batches(meta: AttentionMetadata, num_rows: int, block_size: int) -> list[PaddedBatch]:
    """Lay one step out as padded batches (the same for every layer): one, or the decode rows
    apart from the longer queries when a step has both."""
    if meta.decode_only or meta.max_seqlen_q == 1:
        return [_padded_batch(meta, None, 1, num_rows, block_size)]
    decode = (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]) == 1
    if not bool(decode.any()):
        return [_padded_batch(meta, None, meta.max_seqlen_q, num_rows, block_size)]
    return [_padded_batch(meta, decode.nonzero().squeeze(1), 1, num_rows, block_size),
            _padded_batch(meta, (~decode).nonzero().squeeze(1), meta.max_seqlen_q, num_rows, block_size)]


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PaddedBatch,
            scale: float, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            k_scale: torch.Tensor | float, v_scale: torch.Tensor | float) -> None:
    """One SDPA call over ``batch``; its real rows are written into ``out``."""
    _, hq, d = q.shape
    hkv = k_cache.shape[2]
    b, n = batch.rows.shape
    group = hq // hkv
    if batch.slots is None:
        keys, values = k[batch.rows], v[batch.rows]                   # [b, n, Hkv, D]
        # An fp8 pool: what a read of the pool would give, so chunking never changes the result.
        keys = dequantize_kv(quantize_kv(keys, k_scale, k_cache.dtype), k_scale, q.dtype)
        values = dequantize_kv(quantize_kv(values, v_scale, v_cache.dtype), v_scale, q.dtype)
    else:
        keys = k_cache.view(-1, hkv, d).index_select(0, batch.slots).view(b, batch.length, hkv, d)
        values = v_cache.view(-1, hkv, d).index_select(0, batch.slots).view(b, batch.length, hkv, d)
        keys, values = dequantize_kv(keys, k_scale, q.dtype), dequantize_kv(values, v_scale, q.dtype)
    # [b, n, Hq, D] -> [b, Hkv, G*n, D]: a KV head's query heads as extra query rows
    queries = q[batch.rows].view(b, n, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, group * n, d)
    mask = batch.visible.expand(b, 1, group, n, batch.length).reshape(b, 1, group * n, batch.length)
    o = F.scaled_dot_product_attention(queries, keys.transpose(1, 2), values.transpose(1, 2),
                                       attn_mask=mask, scale=scale)
    o = o.view(b, hkv, group, n, d).permute(0, 3, 1, 2, 4).reshape(b, n, hq, d)
    out[batch.out_rows] = o[batch.real].to(out.dtype)


def attend_planned(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   plan: list[PaddedBatch], scale: float, k: torch.Tensor, v: torch.Tensor,
                   k_scale: torch.Tensor | float = 1.0, v_scale: torch.Tensor | float = 1.0) -> torch.Tensor:
    """Attention of every real query row under ``plan``; padding rows come back as zeros. An
    fp8 pool is dequantized as it is gathered."""
    hq, hkv = q.shape[1], k_cache.shape[2]
    if hq % hkv:
        raise ValueError(f"{hq} query heads cannot share {hkv} KV heads evenly")
    out = torch.zeros_like(q)
    for batch in plan:
        _attend(q, k_cache, v_cache, batch, scale, k, v, out, k_scale, v_scale)
    return out


def paged_attention_batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The reference's contract, batched: packed rows ``q`` ``[T, Hq, D]`` attend causally to
    their sequence's history in the pool, which already holds this step's ``k``/``v``
    ``[T, Hkv, D]`` (read from those directly when ``meta.no_prefix``); rows past
    ``cu_seqlens_q[-1]`` come back as zeros."""
    plan = plan_batches(meta, q.shape[0], k_cache.shape[1])
    return attend_planned(q, k_cache, v_cache, plan, scale, k, v)
