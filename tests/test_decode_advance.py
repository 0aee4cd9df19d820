"""A decode graph's inputs moved on by one step on the device (``kvscope.kernels.decode_advance``)
against the host packer's own inputs for that next step: two steady steps of the same rows are
packed as the runner packs them, the first into a bucket's buffer, which is then moved on and
compared with the second. Torch ops on CPU; the Triton kernel in the interpreter and on CUDA."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvscope.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from kvscope.kernels.decode_advance import advance_by_torch, advance_by_triton
from kvscope.runner.cuda_graphs import BUCKETS, StaticTables
from kvscope.runner.inputs import BlockTables, build_step_inputs
from kvscope.runner.packed_inputs import PackedLayout, decode_views, pack, packed_decode_bytes
from triton_testing import interpreted_only, needs_cuda, run_interpreted_tests

BLOCK = 4
WIDTH = 16


def _steady_pair(rng: np.random.Generator, b: int):
    """Two decode steps of the same ``b`` rows, the second one token on (a row whose next token
    starts a block gets one), packed through one BlockTables as the runner does."""
    starts = rng.integers(0, WIDTH * BLOCK - 1, size=b)
    tables = [rng.integers(0, 10_000, size=s // BLOCK + 1).tolist() for s in starts]
    tables_seen = BlockTables()
    first = [ScheduledRequest(7 + i, [int(rng.integers(0, 500))], int(s), t, False, False, True)
             for i, (s, t) in enumerate(zip(starts, tables))]
    x0 = build_step_inputs(SchedulerOutput(step=1, requests=first), BLOCK, tables_seen)
    second = [ScheduledRequest(7 + i, [int(rng.integers(0, 500))], int(s) + 1,
                               [int(rng.integers(0, 10_000))] if (s + 1) % BLOCK == 0 else [], False, False, True)
              for i, s in enumerate(starts)]
    x1 = build_step_inputs(SchedulerOutput(step=2, requests=second), BLOCK, tables_seen)
    index, column = tables_seen.appended
    new = np.stack([index, column, x1.block_tables[index, column]]).astype(np.int32)
    return x0, x1, new


def _check_advance(advance, device: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 320
    flat = torch.from_numpy(rng.integers(0, 256, size=packed_decode_bytes(n, WIDTH), dtype=np.uint8))
    tables = StaticTables(flat, n, WIDTH)
    for b in (1, 3, 29, 300, 16, 150):  # (the kernel takes rows 128 at a time)
        x0, x1, new = _steady_pair(rng, b)
        g = BUCKETS[np.searchsorted(BUCKETS, b)]
        layout = PackedLayout.of(x0, 0, bucket=g)
        pack(x0, x0.input_ids[:0], x0.input_ids[:0], layout, flat.numpy())
        tables.write(layout)
        inputs, table = flat.to(device), tables.table.to(device)
        v = decode_views(inputs, g)
        sampled = torch.from_numpy(rng.integers(0, 500, size=b)).to(device)
        # (stale entries past the new blocks, as in the runner's staging buffer)
        new_blocks = np.concatenate([new.reshape(-1), rng.integers(-9, 9, size=5, dtype=np.int32)])
        advance(v.input_ids, v.positions, v.slot_mapping, v.context_lens, v.cu_seqlens_k, table, sampled,
                torch.from_numpy(new_blocks).to(device), new.shape[1], b, BLOCK)
        pad = g - b
        assert v.input_ids[:b].tolist() == sampled.tolist()
        assert v.positions[:b].tolist() == x1.positions.tolist()
        assert v.slot_mapping.tolist() == x1.slot_mapping.tolist() + [-1] * pad
        assert v.context_lens.tolist() == x1.context_lens.tolist() + [0] * pad
        assert v.cu_seqlens_k.tolist() == x1.cu_seqlens_k.tolist() + [int(x1.cu_seqlens_k[-1])] * pad
        want = np.full((b, WIDTH), -1, dtype=np.int32)
        want[:, : x1.block_tables.shape[1]] = x1.block_tables
        assert np.array_equal(table[:b].cpu().numpy(), want)
        # The static tables carry over to the next (narrower or wider) step, as the runner's do.
        tables.table.copy_(table.cpu())
        tables.grown(new[0], new[1] + 1)


@pytest.mark.parametrize("seed", range(4))
def test_torch_advance_gives_the_next_packed_step(seed):
    _check_advance(advance_by_torch, "cpu", seed)


@interpreted_only
@pytest.mark.parametrize("seed", range(2))
def test_interpreted_advance_gives_the_next_packed_step(seed):
    _check_advance(advance_by_triton, "cpu", seed)


def test_interpreter_suite() -> None:
    run_interpreted_tests(__file__)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(4))
def test_gpu_advance_gives_the_next_packed_step(seed):
    _check_advance(advance_by_triton, "cuda", seed)
