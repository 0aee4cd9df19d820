"""A decode graph's inputs moved on by one step on the device, instead of packed and uploaded.

In steady decode (the same sequences as the step before, in the same order, each one token
further on, all of them sampled) a decode graph's inputs change in a way the device can work
out alone: every row's position and context length grow by one, the cumulative key lengths by
the row's index, the input ids are the tokens the last step sampled, and a row that crosses into
a new block gets that block appended to its table. One launch of :func:`advance_decode_inputs`
does all of it in place, given only the new blocks, so such a step needs neither the host's
packing nor its upload (vLLM V1 keeps its persistent batch on the device for the same reason).
Slots are recomputed from the updated tables, as the host packer computes them. CPU tensors
(the tests' stand-in graphs) take the same steps in torch ops.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvscope.kernels.launch import launcher

_BLOCK = 128  # rows per loop step of the one program


# One compiled variant serves every step: no integer argument is specialised on its value.
@triton.jit(do_not_specialize=["table_stride", "num_new", "rows", "bucket"])
def _advance_kernel(ids_ptr, pos_ptr, slot_ptr, ctx_ptr, cu_k_ptr, table_ptr, table_stride, sampled_ptr,
                    new_blocks_ptr, num_new, rows, bucket, block_size, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    # The new blocks first: the slots below read them back.
    for start in range(0, num_new, BLOCK):
        j = start + i
        live = j < num_new
        row = tl.load(new_blocks_ptr + j, mask=live, other=0).to(tl.int64)
        col = tl.load(new_blocks_ptr + num_new + j, mask=live, other=0).to(tl.int64)
        block = tl.load(new_blocks_ptr + 2 * num_new + j, mask=live, other=0)
        tl.store(table_ptr + row * table_stride + col, block, mask=live)
    tl.debug_barrier()
    for start in range(0, rows, BLOCK):
        j = start + i
        live = j < rows
        pos = tl.load(pos_ptr + j, mask=live, other=0) + 1
        tl.store(pos_ptr + j, pos, mask=live)
        ctx = tl.load(ctx_ptr + j, mask=live, other=0)
        tl.store(ctx_ptr + j, ctx + 1, mask=live)
        tl.store(ids_ptr + j, tl.load(sampled_ptr + j, mask=live, other=0), mask=live)
        block = tl.load(table_ptr + j.to(tl.int64) * table_stride + pos // block_size, mask=live, other=0)
        tl.store(slot_ptr + j, block.to(tl.int64) * block_size + pos % block_size, mask=live)
    # cu_seqlens_k[j] for j in [0, bucket]: each of the first ``rows`` rows adds one key; the
    # padding rows repeat the total.
    for start in range(0, bucket + 1, BLOCK):
        j = start + i
        cu = tl.load(cu_k_ptr + j, mask=j <= bucket, other=0)
        tl.store(cu_k_ptr + j, cu + tl.minimum(j, rows), mask=j <= bucket)


def advance_decode_inputs(input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                          context_lens: torch.Tensor, cu_seqlens_k: torch.Tensor, block_tables: torch.Tensor,
                          sampled: torch.Tensor, new_blocks: torch.Tensor, num_new: int, rows: int,
                          block_size: int) -> None:
    """Move a decode graph's inputs on by one step, in place.

    ``input_ids``, ``positions``, ``slot_mapping`` (int64) and ``context_lens`` (int32) hold the
    bucket's entries (``context_lens``' length is the bucket), ``cu_seqlens_k`` (int32) one more;
    ``block_tables`` is ``[≥ rows, width]`` int32 with unit column stride; ``sampled`` (int64)
    the last step's tokens of the first ``rows`` rows, in order. ``new_blocks`` (int32) starts
    with ``[3, num_new]`` flattened: each new block's row, column and id (columns past each
    row's table so far). Rows past ``rows`` are the bucket's padding: only their cumulative key
    length changes (it is the total)."""
    advance = advance_by_torch if input_ids.device.type == "cpu" else advance_by_triton
    advance(input_ids, positions, slot_mapping, context_lens, cu_seqlens_k, block_tables, sampled, new_blocks,
            num_new, rows, block_size)


def advance_by_triton(input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                      context_lens: torch.Tensor, cu_seqlens_k: torch.Tensor, block_tables: torch.Tensor,
                      sampled: torch.Tensor, new_blocks: torch.Tensor, num_new: int, rows: int,
                      block_size: int) -> None:
    """:func:`advance_decode_inputs` in one Triton program (CUDA, or the interpreter in tests)."""
    launcher(_advance_kernel, num_warps=4)(
        (1,), input_ids, positions, slot_mapping, context_lens, cu_seqlens_k, block_tables,
        block_tables.stride(0), sampled, new_blocks, num_new, rows, context_lens.shape[0], block_size, _BLOCK,
    )


def advance_by_torch(input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                     context_lens: torch.Tensor, cu_seqlens_k: torch.Tensor, block_tables: torch.Tensor,
                     sampled: torch.Tensor, new_blocks: torch.Tensor, num_new: int, rows: int,
                     block_size: int) -> None:
    """:func:`advance_decode_inputs` in torch ops (CPU tensors: the tests' stand-in graphs)."""
    new = new_blocks[: 3 * num_new].view(3, num_new).long()
    block_tables[new[0], new[1]] = new[2].to(block_tables.dtype)
    positions[:rows] += 1
    context_lens[:rows] += 1
    input_ids[:rows] = sampled[:rows]
    pos = positions[:rows]
    block = block_tables[:rows].gather(1, (pos // block_size)[:, None]).squeeze(1)
    slot_mapping[:rows] = block.long() * block_size + pos % block_size
    bucket = context_lens.shape[0]
    cu_seqlens_k += torch.arange(bucket + 1, dtype=cu_seqlens_k.dtype).clamp_(max=rows)
