"""One step's integer inputs in one byte buffer: the layout, the host packing, the device views.

Every torch call costs host time whatever its size, so a step goes to the device as one copy
of one buffer whose views are the model's inputs. The layout puts the int64 inputs first
(``input_ids``, ``positions``, ``slot_mapping``, then ``logits_indices`` and the placeholder
rows ``fill``/``src``) and the int32 ones after (``context_lens``, ``cu_seqlens_k``,
``cu_seqlens_q``, the block tables), so no conversion runs on the device.

A batch padded to ``rows`` sequences (a CUDA graph's bucket) has its first five inputs at
offsets that depend on ``rows`` alone (:func:`decode_views`): the graph captured for that
bucket reads them in place, so a replay needs no copy into static buffers. Its padding rows
get what a bucket's padding needs (no KV slot, no context).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvscope.runner.inputs import StepInputs


@dataclass(frozen=True)
class PackedLayout:
    """Where one step's inputs lie in its buffer (element counts; offsets follow from them)."""

    tokens: int      # T plus the padding rows
    rows: int        # B plus the padding rows
    num_seqs: int    # B
    width: int       # block-table columns
    num_logits: int  # S
    num_fill: int    # F: placeholder input ids
    n64: int         # int64 elements: ``used64``, or more where a fixed int32 start is wanted

    @classmethod
    def of(cls, x: StepInputs, num_fill: int, bucket: int | None = None) -> "PackedLayout":
        """The layout of ``x``; ``bucket`` pads a decode-only step to that many rows, laid out
        where :func:`decode_views` expects them."""
        b = x.num_seqs
        rows = b if bucket is None else bucket
        tokens = x.num_tokens + rows - b
        s, w = x.logits_indices.size, x.block_tables.shape[1]
        n64 = 3 * tokens + s + 2 * num_fill if bucket is None else decode_int64_size(bucket)
        return cls(tokens, rows, b, w, s, num_fill, n64)

    @property
    def used64(self) -> int:
        """int64 elements written: ids, positions, slots, then logits rows, fill and src."""
        return 3 * self.tokens + self.num_logits + 2 * self.num_fill

    @property
    def n32(self) -> int:
        return 2 * self.rows + 1 + self.num_seqs + 1 + self.num_seqs * self.width

    @property
    def nbytes(self) -> int:
        return 8 * self.n64 + 4 * self.n32


def decode_int64_size(rows: int) -> int:
    """int64 elements before the int32 part for a batch padded to ``rows``: room for every
    row's ``logits_indices``, ``fill`` and ``src`` whatever the step's counts."""
    return 6 * rows


def packed_decode_bytes(rows: int, width: int) -> int:
    """The bytes of the largest step padded to ``rows`` decode rows with ``width``-column tables
    (every row sampling, every input id a placeholder): what a graph's input buffer holds."""
    return PackedLayout(rows, rows, rows, width, rows, rows, decode_int64_size(rows)).nbytes


def pack(x: StepInputs, fill: np.ndarray, src: np.ndarray, layout: PackedLayout, host: np.ndarray) -> None:
    """Write ``x`` (and the placeholder rows ``fill`` with their sources ``src``) into the
    bytes ``host`` as ``layout`` says; padding rows get no slot, no context, and the last
    cumulative length."""
    pad = layout.rows - layout.num_seqs
    wide = host[: 8 * layout.used64].view(np.int64)
    narrow = host[8 * layout.n64: layout.nbytes].view(np.int32)
    tables = x.block_tables.ravel()
    if pad:
        zeros = np.zeros(pad, dtype=np.int64)
        np.concatenate((x.input_ids, zeros, x.positions, zeros, x.slot_mapping, np.full(pad, -1),
                        x.logits_indices, fill, src), out=wide, casting="unsafe")
        np.concatenate((x.context_lens, zeros, x.cu_seqlens_k, np.full(pad, x.cu_seqlens_k[-1]),
                        x.cu_seqlens_q, tables), out=narrow, casting="unsafe")
    else:
        np.concatenate((x.input_ids, x.positions, x.slot_mapping, x.logits_indices, fill, src),
                       out=wide, casting="unsafe")
        np.concatenate((x.context_lens, x.cu_seqlens_k, x.cu_seqlens_q, tables), out=narrow, casting="unsafe")


@dataclass
class DeviceInputs:
    """A packed step's views on the device, and where its placeholder ids come from."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor
    fill: torch.Tensor
    src: torch.Tensor
    context_lens: torch.Tensor
    cu_seqlens_k: torch.Tensor
    cu_seqlens_q: torch.Tensor
    block_tables: torch.Tensor


def views(flat: torch.Tensor, layout: PackedLayout) -> DeviceInputs:
    """``flat`` (the packed bytes, anywhere) as the step's tensors."""
    t, b = layout.tokens, layout.num_seqs
    ids, pos, slots, logits, fill, src, _ = flat[: 8 * layout.n64].view(torch.int64).split(
        [t, t, t, layout.num_logits, layout.num_fill, layout.num_fill, layout.n64 - layout.used64])
    ctx, cu_k, cu_q, tables = flat[8 * layout.n64: layout.nbytes].view(torch.int32).split(
        [layout.rows, layout.rows + 1, b + 1, b * layout.width])
    return DeviceInputs(ids, pos, slots, logits, fill, src, ctx, cu_k, cu_q, tables.view(b, layout.width))


@dataclass(frozen=True)
class DecodeViews:
    """The inputs a decode graph of ``rows`` reads, as views of the packed buffer."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    context_lens: torch.Tensor
    cu_seqlens_k: torch.Tensor


def decode_views(flat: torch.Tensor, rows: int) -> DecodeViews:
    """Where a step padded to ``rows`` (``PackedLayout.of(x, f, bucket=rows)``) keeps its first
    five inputs in ``flat``: the same for every step padded to that bucket."""
    wide = flat[: 8 * 3 * rows].view(torch.int64)
    start = 8 * decode_int64_size(rows)
    narrow = flat[start: start + 4 * (2 * rows + 1)].view(torch.int32)
    return DecodeViews(wide[:rows], wide[rows: 2 * rows], wide[2 * rows:], narrow[:rows], narrow[rows:])
