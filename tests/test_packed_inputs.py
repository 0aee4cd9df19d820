"""A step's packed upload (one buffer whose views are the model's inputs) against the arrays it
was packed from, and a CUDA graph's fixed views and static tables (on CPU tensors) against the
padding the bucket needs, over steps packed one after another into the same stale buffer."""
from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_helpers import make_llm, token_ids
from kvscope import SamplingParams
from kvscope.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from kvscope.forward_context import forward_context
from kvscope.runner.cuda_graphs import BUCKETS, DecodeGraphs, StaticTables
from kvscope.runner.inputs import BlockTables, StepInputs, build_step_inputs
from kvscope.runner.packed_inputs import PackedLayout, decode_views, pack, packed_decode_bytes, views

BLOCK = 4


def _step(rng: np.random.Generator, lens: list[tuple[int, int]], step: int) -> StepInputs:
    """A step of fresh requests with (start, new tokens) each; every row brings its whole table."""
    rows = []
    for i, (start, n) in enumerate(lens):
        table = rng.integers(0, 10_000, size=-(-(start + n) // BLOCK)).tolist()
        rows.append(ScheduledRequest(1000 * step + i, rng.integers(0, 500, size=n).tolist(), start, table,
                                     False, n > 1, bool(rng.integers(0, 4))))
    return build_step_inputs(SchedulerOutput(step=step, requests=rows), BLOCK, BlockTables())


def _assert_aligned(buf: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Every input starts a multiple of 16 bytes into the buffer: Triton compiles a kernel per
    pointer alignment of its arguments, so an input that starts anywhere else makes the next
    step compile another variant of the attention kernel in the middle of a run."""
    for t in tensors:
        assert (t.data_ptr() - buf.data_ptr()) % 16 == 0, (t.shape, t.data_ptr() - buf.data_ptr())


def _placeholders(rng: np.random.Generator, x: StepInputs) -> tuple[np.ndarray, np.ndarray]:
    fill = np.flatnonzero(rng.random(x.num_tokens) < 0.5)
    return fill, rng.permutation(max(fill.size, 1))[: fill.size].astype(np.int64)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 9)), min_size=1, max_size=12), st.integers(0, 2**32 - 1))
def test_packed_views_are_the_step_inputs(lens, seed):
    rng = np.random.default_rng(seed)
    x = _step(rng, lens, 0)
    fill, src = _placeholders(rng, x)
    layout = PackedLayout.of(x, fill.size)
    buf = torch.from_numpy(rng.integers(0, 256, size=layout.nbytes + 64, dtype=np.uint8))  # stale bytes
    pack(x, fill, src, layout, buf.numpy())
    d = views(buf, layout)
    _assert_aligned(buf, [getattr(d, f.name) for f in dataclasses.fields(d)])
    for name in ("input_ids", "positions", "slot_mapping", "logits_indices", "context_lens",
                 "cu_seqlens_k", "cu_seqlens_q", "block_tables"):
        got, want = getattr(d, name), getattr(x, name)
        assert got.dtype == (torch.int32 if want.dtype == np.int32 else torch.int64), name
        assert np.array_equal(got.numpy(), want), name
    assert np.array_equal(d.fill.numpy(), fill) and np.array_equal(d.src.numpy(), src)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.sampled_from([1, 9, 30, 60])), min_size=1, max_size=8),
       st.integers(0, 2**32 - 1))
def test_a_graph_reads_each_padded_step_in_place_over_stale_buffers(steps, seed):
    """Steps of (batch, context) decode rows, one after another into one buffer and one set of
    static tables, as the runner replays them: the bucket's fixed views must hold the step and
    the padding a bucket needs (no slot, no context, the last cumulative length), and the
    static tables the step's tables with -1 past them, whatever earlier steps left."""
    rng = np.random.default_rng(seed)
    n, width = 64, 16
    buckets = [g for g in BUCKETS if g <= n]
    flat = torch.from_numpy(rng.integers(0, 256, size=packed_decode_bytes(n, width), dtype=np.uint8))
    tables = StaticTables(flat, n, width)
    tables.table.copy_(torch.from_numpy(rng.integers(0, 99, size=(n, width), dtype=np.int32)))
    tables._written[:] = width  # (random contents: every column counts as written)
    for k, (b, ctx) in enumerate(steps):
        x = _step(rng, [(int(c) - 1, 1) for c in rng.integers(1, ctx + 1, size=b)], k)
        fill, src = _placeholders(rng, x)
        g = buckets[np.searchsorted(buckets, b)]
        layout = PackedLayout.of(x, fill.size, bucket=g)
        assert layout.nbytes <= flat.numel()
        pack(x, fill, src, layout, flat.numpy())
        v = decode_views(flat, g)
        _assert_aligned(flat, [getattr(v, f.name) for f in dataclasses.fields(v)])
        pad = g - b
        assert np.array_equal(v.input_ids[:b].numpy(), x.input_ids)
        assert np.array_equal(v.positions[:b].numpy(), x.positions)
        assert v.slot_mapping.tolist() == x.slot_mapping.tolist() + [-1] * pad
        assert v.context_lens.tolist() == x.context_lens.tolist() + [0] * pad
        assert v.cu_seqlens_k.tolist() == x.cu_seqlens_k.tolist() + [int(x.cu_seqlens_k[-1])] * pad
        d = views(flat, layout)  # the rest of the step (placeholders, logits rows) where they are read
        _assert_aligned(flat, [getattr(d, f.name) for f in dataclasses.fields(d)])
        assert np.array_equal(d.fill.numpy(), fill) and np.array_equal(d.src.numpy(), src)
        assert np.array_equal(d.logits_indices.numpy(), x.logits_indices)
        tables.write(layout)
        want = np.full((b, width), -1, dtype=np.int32)
        want[:, : x.block_tables.shape[1]] = x.block_tables
        assert np.array_equal(tables.table[:b].numpy(), want)


class _ReplayEagerly:
    """A captured bucket that, when replayed, runs the forward pass eagerly on the graph's
    static views: what a CUDA graph captured on them computes, on a machine without one."""

    def __init__(self, graphs: "_EagerGraphs", g: int) -> None:
        self.graphs, self.g, self.replays = graphs, g, 0

    def replay(self) -> None:
        graphs, g = self.graphs, self.g
        v = graphs._bucket_views[g]
        with forward_context(graphs._meta(g)):
            graphs.hidden[:g] = graphs._forward(v.input_ids, v.positions)
        self.replays += 1


class _EagerGraphs(DecodeGraphs):
    def _capture_all(self) -> None:
        self.graphs = {g: _ReplayEagerly(self, g) for g in self.buckets}
        self.batches: list[int] = []
        self.advanced = 0  # replays on inputs moved on in place, not uploaded

    def run(self, b: int, layout: PackedLayout | None) -> torch.Tensor:
        self.batches.append(b)
        self.advanced += layout is None
        return super().run(b, layout)


def _with_graphs(llm) -> _EagerGraphs:
    runner = llm.llm_engine.executor
    runner.graphs = _EagerGraphs(
        runner._forward, runner.hf_config.hidden_size, runner.config.max_num_seqs,
        -(-runner.max_model_len // runner.block_size), runner.max_model_len, runner.block_size,
        runner.dtype, runner.device)
    return runner.graphs


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_through_the_graph_inputs_gives_the_eager_tokens(async_scheduling):
    """The runner's graph path (the upload into the graphs' buffer, the placeholders filled
    there, the static tables, the bucket padding) against its eager path, on CPU: batches that
    shrink as requests end (padded buckets, rows that move), tables that grow block by block."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(1, 20))] for _ in range(7)]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=rng.randrange(3, 24), ignore_eos=True)
              for i in range(len(prompts))]
    runs = []
    for use_graphs in (False, True):
        llm = make_llm(block_size=4, max_num_seqs=8, max_model_len=64, async_scheduling=async_scheduling)
        graphs = _with_graphs(llm) if use_graphs else None
        runs.append(token_ids(llm.generate(prompts, params, use_tqdm=False)))
        llm.shutdown()
    assert runs[1] == runs[0]
    assert sum(r.replays for r in graphs.graphs.values()) == len(graphs.batches) > 10
    assert 0 < graphs.advanced < len(graphs.batches), "no step moved its inputs on in place, or every one did"
    assert {graphs.bucket(b) - b for b in graphs.batches} - {0}, "no step was padded to its bucket"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_graph_inputs_moved_on_in_place_survive_preemption_joins_and_aborts(async_scheduling):
    """The steady steps that move the graph's inputs on in place (``ModelRunner._advance``)
    between steps that break the batch: requests that join as others end, preemptions in a
    pool too small for all of them, and a request aborted by a hook mid-run. Tokens against
    the eager path's (seeded rows draw the same whatever they are batched with)."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(2, 30))] for _ in range(9)]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=rng.randrange(10, 40), ignore_eos=True)
              for i in range(len(prompts))]
    runs, preemptions = [], []
    for use_graphs in (False, True):
        llm = make_llm(block_size=4, max_num_seqs=4, max_model_len=96, num_kv_blocks=24,
                       async_scheduling=async_scheduling)
        graphs = _with_graphs(llm) if use_graphs else None
        engine = llm.llm_engine

        def abort_one(info, engine=engine):
            if info.step == 12 and "3" in engine.requests:
                engine.abort_request("3")

        llm.hooks.add("step.end", abort_one)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs])
        preemptions.append(sum(o.metrics.num_preemptions for o in outs))
        llm.shutdown()
    assert runs[1] == runs[0]
    assert runs[0][3][1] == "abort" and min(preemptions) > 0
    assert 0 < graphs.advanced < len(graphs.batches)
