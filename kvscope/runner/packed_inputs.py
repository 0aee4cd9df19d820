"""One step's integer inputs in one byte buffer: the layout, the host packing, the device views.

Every torch call costs host time whatever its size, so a step goes to the device as one copy
of one buffer whose views are the model's inputs. The layout puts the int64 inputs first
(``input_ids``, ``positions``, ``slot_mapping``, then ``logits_indices`` and the placeholder
rows ``fill``/``src``) and the int32 ones after (``context_lens``, ``cu_seqlens_k``,
``cu_seqlens_q``, the block tables), so no conversion runs on the device.

Every input starts 16 bytes into the buffer or a multiple of that (the int64 arrays take an
even number of elements, the int32 ones a multiple of four, the gaps unread): a Triton kernel
is compiled per pointer alignment of its arguments, so views that start wherever the previous
array ended would compile new variants of the attention kernel in the middle of a run.

A batch padded to ``rows`` sequences (a CUDA graph's bucket) has its first five inputs at
offsets that depend on ``rows`` alone (:func:`decode_views`): the graph captured for that
bucket reads them in place, so a replay needs no copy into static buffers. Its padding rows
get what a bucket's padding needs (no KV slot, no context).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

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
        n64 = _starts64(tokens, s, num_fill)[-1] if bucket is None else decode_int64_size(bucket)
        return cls(tokens, rows, b, w, s, num_fill, n64)

    @cached_property
    def starts64(self) -> tuple[int, ...]:
        """Element offsets of ids, positions, slots, logits rows, fill and src, then the end of src."""
        return _starts64(self.tokens, self.num_logits, self.num_fill)

    @cached_property
    def starts32(self) -> tuple[int, ...]:
        """Element offsets (after the int64 part) of context lengths, cumulative key lengths,
        cumulative query lengths and the block tables, then the end of the tables."""
        ctx, cu_k, cu_q = _quad(self.rows), _quad(self.rows + 1), _quad(self.num_seqs + 1)
        tables = ctx + cu_k + cu_q
        return (0, ctx, ctx + cu_k, tables, tables + self.num_seqs * self.width)

    @property
    def used64(self) -> int:
        """int64 elements taken: ids, positions, slots, then logits rows, fill and src."""
        return self.starts64[-1]

    @property
    def n32(self) -> int:
        return self.starts32[-1]

    @property
    def nbytes(self) -> int:
        return 8 * self.n64 + 4 * self.n32


def _starts64(tokens: int, num_logits: int, num_fill: int) -> tuple[int, ...]:
    t, s, f = _even(tokens), _even(num_logits), _even(num_fill)
    return (0, t, 2 * t, 3 * t, 3 * t + s, 3 * t + s + f, 3 * t + s + 2 * f)


def _even(n: int) -> int:
    return n + (n & 1)


def _quad(n: int) -> int:
    return -(-n // 4) * 4


def decode_int64_size(rows: int) -> int:
    """int64 elements before the int32 part for a batch padded to ``rows``: room for every
    row's ``logits_indices``, ``fill`` and ``src`` whatever the step's counts."""
    return _starts64(rows, rows, rows)[-1]


def _bucket_layout(rows: int, width: int) -> PackedLayout:
    """The largest step padded to ``rows`` decode rows with ``width``-column tables (every row
    sampling, every input id a placeholder)."""
    return PackedLayout(rows, rows, rows, width, rows, rows, decode_int64_size(rows))


def packed_decode_bytes(rows: int, width: int) -> int:
    """What a graph's input buffer holds: the bytes of :func:`_bucket_layout`."""
    return _bucket_layout(rows, width).nbytes


# What fills up to the next 16-byte start (never read), and the padding rows' values, by dtype:
# a concatenation of arrays of one dtype takes numpy's fast path.
_GAP = {np.dtype(np.int64): np.zeros(1, dtype=np.int64), np.dtype(np.int32): np.zeros(3, dtype=np.int32)}


def pack(x: StepInputs, fill: np.ndarray, src: np.ndarray, layout: PackedLayout, host: np.ndarray) -> None:
    """Write ``x`` (and the placeholder rows ``fill`` with their sources ``src``) into the
    bytes ``host`` as ``layout`` says; padding rows get no slot, no context, and the last
    cumulative length."""
    pad = layout.rows - layout.num_seqs
    wide = host[: 8 * layout.used64].view(np.int64)
    narrow = host[8 * layout.n64: layout.nbytes].view(np.int32)
    t, s, f, r, b = layout.tokens, layout.num_logits, layout.num_fill, layout.rows, layout.num_seqs
    o64, o32 = layout.starts64, layout.starts32
    g64, g32 = _GAP[wide.dtype], _GAP[narrow.dtype]
    zeros64, zeros32, no_slots, last = g64[:0], g32[:0], g64[:0], g32[:0]
    if pad:
        zeros64, zeros32 = np.zeros(pad, dtype=np.int64), np.zeros(pad, dtype=np.int32)
        no_slots, last = np.full(pad, -1, dtype=np.int64), np.full(pad, x.cu_seqlens_k[-1], dtype=np.int32)
    # Each array, then the gap up to the next one's start.
    to_t = g64[: o64[1] - t]
    np.concatenate((x.input_ids, zeros64, to_t, x.positions, zeros64, to_t, x.slot_mapping, no_slots, to_t,
                    x.logits_indices, g64[: o64[4] - o64[3] - s], fill, g64[: o64[5] - o64[4] - f],
                    src, g64[: o64[6] - o64[5] - f]), out=wide, casting="unsafe")
    np.concatenate((x.context_lens, zeros32, g32[: o32[1] - r], x.cu_seqlens_k, last, g32[: o32[2] - o32[1] - r - 1],
                    x.cu_seqlens_q, g32[: o32[3] - o32[2] - b - 1], x.block_tables.ravel()),
                   out=narrow, casting="unsafe")


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
    t, s, f, b = layout.tokens, layout.num_logits, layout.num_fill, layout.num_seqs
    sizes64 = (t, t, t, s, f, f)
    o64, o32 = layout.starts64, layout.starts32
    wide = flat[: 8 * layout.n64].view(torch.int64).split(_with_gaps(sizes64, o64, layout.n64))[::2]
    sizes32 = (layout.rows, layout.rows + 1, b + 1, b * layout.width)
    narrow = flat[8 * layout.n64: layout.nbytes].view(torch.int32).split(_with_gaps(sizes32, o32, layout.n32))[::2]
    ids, pos, slots, logits, fill, src = wide[:6]
    ctx, cu_k, cu_q, tables = narrow[:4]
    return DeviceInputs(ids, pos, slots, logits, fill, src, ctx, cu_k, cu_q, tables.view(b, layout.width))


def _with_gaps(sizes: tuple[int, ...], starts: tuple[int, ...], total: int) -> list[int]:
    """Split sizes that take each array at its start and the gap after it: arrays at the even
    places."""
    ends = [start + n for start, n in zip(starts, sizes)]
    gaps = [nxt - end for end, nxt in zip(ends, (*starts[1:len(sizes)], total))]
    return [n for pair in zip(sizes, gaps) for n in pair]


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
    layout = _bucket_layout(rows, 0)
    o64, o32 = layout.starts64, layout.starts32
    wide = flat[: 8 * o64[3]].view(torch.int64)
    narrow = flat[8 * layout.n64: 8 * layout.n64 + 4 * o32[2]].view(torch.int32)
    return DecodeViews(wide[:rows], wide[o64[1]: o64[1] + rows], wide[o64[2]: o64[2] + rows], narrow[:rows],
                       narrow[o32[1]: o32[1] + rows + 1])
