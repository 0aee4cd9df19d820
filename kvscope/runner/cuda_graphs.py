"""Decode under CUDA graphs: one graph per bucketed batch size, replayed on static buffers.

The graph of a bucket reads its token inputs (ids, positions, slots, context lengths,
cumulative key lengths) in place from :attr:`DecodeGraphs.inputs`, the device buffer that a
step padded to that bucket is uploaded into (:mod:`kvscope.runner.packed_inputs`), so a replay
copies only the block tables into their static buffer. Every copy runs on the one stream, after
the replay before it: a step's upload never overwrites inputs a running graph still reads.

Only decode-only steps whose batch fits a bucket and whose block tables fit the captured
width replay a graph; anything else runs eagerly (never a crash).

A steady step (the same rows as the graph step before it, each one token on, all sampled) is
not uploaded at all: :meth:`DecodeGraphs.advance` moves the last step's inputs on by one in
place (:mod:`kvscope.kernels.decode_advance`), from the tokens it sampled and the blocks the
step appends, which come up in a small buffer of their own (``new_blocks``).

With a ``head`` (the LM head and the sampler's captured draw), each bucket also has a second
graph of the whole step, from the inputs through the head to the sampled tokens, replayed
instead of the first when the step's rows can draw there
(:meth:`kvscope.runner.sampler.Sampler.sample_captured`): a steady decode step then launches
one graph and no kernel of its own. The runner passes a head only with ``CAPTURE_DRAW``, which
is off: on the H200 the kernels of a graph that holds the head start later after each cuBLAS
GEMM than those of the forward-only graph, which costs more device time than the eager head's
launches cost the host (benchmarks/RESULTS.md, sessions 16 and 17).
"""
from __future__ import annotations

import bisect
from typing import Callable

import numpy as np
import torch

from kvscope.forward_context import forward_context
from kvscope.kernels.base import AttentionMetadata
from kvscope.kernels.decode_advance import advance_decode_inputs
from kvscope.runner.inputs import StepInputs
from kvscope.runner.packed_inputs import DecodeViews, PackedLayout, decode_views, packed_decode_bytes

# Set True to capture the LM head and the draw in the decode graphs (off: the runner samples
# eagerly after each replay), for A/B runs: benchmarks/profile_decode.py --captured-draw.
CAPTURE_DRAW = False
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
_MAX_CACHED_VIEWS = 4096  # (batch, width, end) keys whose table views are kept


class DecodeGraphs:
    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        hidden_size: int,
        max_batch: int,
        max_blocks_per_seq: int,
        max_model_len: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.buckets = [b for b in BUCKETS if b <= max_batch] or [1]
        self.width = max_blocks_per_seq
        self.block_size = block_size
        self.max_model_len = max_model_len
        n = self.buckets[-1]
        self.inputs = torch.zeros(packed_decode_bytes(n, self.width), dtype=torch.uint8, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.tables = StaticTables(self.inputs, n, self.width)
        # A steady step's new blocks, int32 [3, count] flattened (rows, columns, ids): bytes, so
        # that a pinned staging buffer's bytes copy into it as they are.
        self.new_block_bytes = torch.zeros(3 * n * 4, dtype=torch.uint8, device=device)
        self._new_blocks = self.new_block_bytes.view(torch.int32)
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # The graphs of whole steps that end in the draw, by bucket, and their tokens (int64
        # [rows]); none without a head.
        self.draws: dict[int, torch.cuda.CUDAGraph] = {}
        self.tokens = torch.zeros(n, dtype=torch.int64, device=device) if head is not None else None
        self._bucket_views: dict[int, DecodeViews] = {g: decode_views(self.inputs, g) for g in self.buckets}
        self._batch: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}
        self._token_views: dict[int, torch.Tensor] = {}
        self._forward = forward
        self._head = head
        # (compiles the advance's one kernel variant now, changing nothing: no rows)
        self.advance(0, self._bucket_views[n].input_ids, None)
        self._capture_all()

    def _meta(self, g: int) -> AttentionMetadata:
        v = self._bucket_views[g]
        return AttentionMetadata(
            slot_mapping=v.slot_mapping, cu_seqlens_q=self.cu_seqlens_q[: g + 1],
            cu_seqlens_k=v.cu_seqlens_k, context_lens=v.context_lens,
            block_tables=self.tables.table[:g], max_seqlen_q=1, max_seqlen_k=self.max_model_len,
            num_seqs=g, num_tokens=g, block_size=self.block_size, decode_only=True,
        )

    def _capture_all(self) -> None:
        pool = None
        for g in reversed(self.buckets):
            v = self._bucket_views[g]
            self.inputs.zero_()
            v.slot_mapping.fill_(-1)  # (the buckets' layouts overlap: each starts from padding)
            with forward_context(self._meta(g)):
                self.graphs[g], pool = _capture(self.hidden[:g], self._forward, (v.input_ids, v.positions), pool)
                if self._head is not None:
                    self.draws[g], pool = _capture(self.tokens[:g], self._step, (v.input_ids, v.positions), pool)
        torch.cuda.synchronize()

    def _step(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._head(self._forward(input_ids, positions))

    def can_run(self, inputs: StepInputs) -> bool:
        return (
            inputs.decode_only
            and inputs.num_seqs <= self.buckets[-1]
            and inputs.block_tables.shape[1] <= self.width
        )

    def bucket(self, b: int) -> int:
        """The captured batch size a batch of ``b`` is padded to."""
        return self.buckets[bisect.bisect_left(self.buckets, b)]

    def _batch_views(self, b: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(bucket, input ids, hidden rows) of a batch of ``b``, made once: each slice is a host call."""
        v = self._batch.get(b)
        if v is None:
            g = self.bucket(b)
            v = self._batch[b] = (g, self._bucket_views[g].input_ids[:b], self.hidden[:b])
        return v

    def input_ids(self, b: int) -> torch.Tensor:
        """The input ids of a batch of ``b`` in :attr:`inputs`: the placeholders are filled there."""
        return self._batch_views(b)[1]

    def advance(self, b: int, sampled: torch.Tensor, new_blocks: np.ndarray | None) -> None:
        """Move the inputs of the last step run here (``b`` rows) on by one step, in place:
        ``sampled`` are its tokens; ``new_blocks`` the blocks this step appends (``[3, count]``:
        batch rows, columns, ids; None for none), already copied into ``new_block_bytes``."""
        v = self._bucket_views[self.bucket(b)]
        num_new = 0 if new_blocks is None else new_blocks.shape[1]
        advance_decode_inputs(v.input_ids, v.positions, v.slot_mapping, v.context_lens, v.cu_seqlens_k,
                              self.tables.table, sampled, self._new_blocks, num_new, b, self.block_size)
        if num_new:
            self.tables.grown(new_blocks[0], new_blocks[1] + 1)

    def run(self, b: int, layout: PackedLayout | None) -> torch.Tensor:
        """Replay on the step of ``b`` rows packed (``layout``) in :attr:`inputs`, or, with no
        layout, on the inputs :meth:`advance` moved on; returns hidden ``[B, H]``."""
        g, _, hidden = self._batch_views(b)
        if layout is not None:
            self.tables.write(layout)
        self.graphs[g].replay()
        return hidden

    def run_and_draw(self, b: int, layout: PackedLayout | None) -> torch.Tensor:
        """:meth:`run` of the whole step, head and draw included; returns the tokens ``[B]``."""
        g = self._batch_views(b)[0]
        if layout is not None:
            self.tables.write(layout)
        self.draws[g].replay()
        return self._tokens(b)

    def _tokens(self, b: int) -> torch.Tensor:
        v = self._token_views.get(b)
        if v is None:
            v = self._token_views[b] = self.tokens[:b]
        return v


def _capture(out: torch.Tensor, fn: Callable[..., torch.Tensor], args: tuple, pool
             ) -> tuple[torch.cuda.CUDAGraph, tuple]:
    """A graph of ``out[:] = fn(*args)`` in ``pool``, after one warm-up run (which compiles
    what the graph's kernels need); returns it and the pool for the next capture.

    The capture forbids unsafe CUDA calls (a synchronize, an allocation outside its pool) in
    this thread only: under the default global mode, another engine of the process stepping in
    another thread meanwhile failed (one of its calls was refused while this stream captured).
    Its work runs on other streams, which the capture stream does not wait on."""
    out[:] = fn(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out[:] = fn(*args)
    return graph, graph.pool()


class StaticTables:
    """The graphs' static block tables ``[rows, width]``, written from the tables of each step
    packed in ``source`` (:mod:`kvscope.runner.packed_inputs`). Every row reads -1 past its own
    table, as the attention contract says; the columns each row was last written to are kept on
    the host, so only a step narrower than what its rows last held resets the difference (none
    in steady decode, where tables only grow)."""

    def __init__(self, source: torch.Tensor, rows: int, width: int) -> None:
        self.source = source
        self.table = torch.full((rows, width), -1, dtype=torch.int32, device=source.device)
        self._written = np.zeros(rows, dtype=np.int64)
        self._views: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _views_of(self, layout: PackedLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the packed tables in the source, the static rows they go to, those rows' columns), made
        once per (batch, width, end): each slice is a host call."""
        b, w = layout.num_seqs, layout.width
        key = (b, w, layout.nbytes)
        v = self._views.get(key)
        if v is None:
            if len(self._views) >= _MAX_CACHED_VIEWS:
                self._views.clear()
            src = self.source[layout.nbytes - 4 * b * w: layout.nbytes].view(torch.int32).view(b, w)
            v = self._views[key] = (src, self.table[:b], self.table[:b, :w])
        return v

    def write(self, layout: PackedLayout) -> None:
        """Copy the tables of the step packed in the source into rows ``[0, B)``."""
        b, w = layout.num_seqs, layout.width
        src, rows, dst = self._views_of(layout)
        dst.copy_(src)
        stale = int(self._written[:b].max())
        if stale > w:
            rows[:, w:stale].fill_(-1)
        self._written[:b] = w

    def grown(self, rows: np.ndarray, widths: np.ndarray) -> None:
        """Rows ``rows`` now hold ids up to columns ``widths`` (written on the device)."""
        self._written[rows] = np.maximum(self._written[rows], widths)
