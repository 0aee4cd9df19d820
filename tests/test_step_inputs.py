"""Input packing (``build_step_inputs``) against a per-token reference, over random runs of
steps: chunked prefills, decode-only steps (their own packing path), preemptions and rollbacks
that restart a table, finished requests, and tables that outgrow the runner's initial width."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from kvscope.runner.inputs import BlockTables, build_step_inputs


def _reference(rows: list[ScheduledRequest], tables: dict[int, list[int]], bs: int) -> dict[str, list]:
    """Token by token, from the rows and the full tables: what the packed arrays must hold."""
    ref: dict[str, list] = {k: [] for k in ("input_ids", "positions", "slot_mapping", "logits_indices")}
    cu_q, cu_k, ctx = [0], [0], []
    for r in rows:
        table = tables[r.seq_id]
        for j, tok in enumerate(r.token_ids):
            p = r.start + j
            ref["input_ids"].append(tok)
            ref["positions"].append(p)
            ref["slot_mapping"].append(table[p // bs] * bs + p % bs)
        if r.sample:
            ref["logits_indices"].append(cu_q[-1] + len(r.token_ids) - 1)
        cu_q.append(cu_q[-1] + len(r.token_ids))
        ctx.append(r.start + len(r.token_ids))
        cu_k.append(cu_k[-1] + ctx[-1])
    ref.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, context_lens=ctx)
    return ref


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4]),
    steps=st.lists(st.tuples(
        st.booleans(),                                             # a decode-only step
        st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6), st.sampled_from(["run", "preempt", "rollback", "finish"])),
                 min_size=1, max_size=6),                          # (request, chunk, what happens after)
    ), min_size=1, max_size=12),
)
def test_packing_matches_a_per_token_reference(block_size, steps):
    runner = BlockTables(capacity=2, width=2)  # small, so rows and width must grow
    tables: dict[int, list[int]] = {}     # the scheduler's side: each live request's full table
    computed: dict[int, int] = {}
    sent: dict[int, int] = {}
    next_block = iter(range(10**6))
    restart: set[int] = set()
    dropped: list[int] = []
    for decode_only, picks in steps:
        rows, seen = [], set()
        for seq_id, chunk, then in picks:
            if seq_id in seen:
                continue
            seen.add(seq_id)
            start = computed.get(seq_id, 0)
            n = 1 if decode_only else chunk
            table = tables.setdefault(seq_id, [])
            while len(table) * block_size < start + n:
                table.append(next(next_block))
            delta = table[sent.get(seq_id, 0):]
            rows.append(ScheduledRequest(seq_id, [1000 * seq_id + start + j for j in range(n)], start, delta,
                                         seq_id in restart, not decode_only, bool((start + seq_id) % 2)))
            restart.discard(seq_id)
            sent[seq_id] = len(table)
            computed[seq_id] = start + n
        out = SchedulerOutput(step=0, requests=rows, finished_seq_ids=dropped)
        x = build_step_inputs(out, block_size, runner)
        ref = _reference(rows, tables, block_size)
        for name, want in ref.items():
            assert getattr(x, name).tolist() == want, name
        assert x.decode_only == all(len(r.token_ids) == 1 for r in rows)
        assert x.no_prefix == all(r.start == 0 for r in rows)
        for i, r in enumerate(rows):
            packed = x.block_tables[i].tolist()
            assert packed[:len(tables[r.seq_id])] == tables[r.seq_id]
            assert set(packed[len(tables[r.seq_id]):]) <= {-1}
        dropped = []
        for seq_id, _, then in picks:  # after the step: some restart from scratch, some end
            if then != "run" and seq_id in tables:
                del tables[seq_id], computed[seq_id], sent[seq_id]
                if then != "finish":
                    restart.add(seq_id)
                if then != "rollback":  # (a rolled-back step's runner keeps the row it had)
                    dropped.append(seq_id)
    assert np.all(runner.lengths[list(runner.rows.values())] > 0)
