"""An executor with no model: it returns a deterministic pseudo-random token per sampled row.

It exists to exercise and time the control plane alone (property tests, the scheduler
benchmark); it still applies each step's block-table deltas and packs its inputs exactly as
the real runner does.
"""
from __future__ import annotations

import time

from kvscope.engine.executor import DoneStep, StepResult
from kvscope.engine.scheduler_output import SchedulerOutput
from kvscope.runner.inputs import BlockTables, build_step_inputs


class NullExecutor:
    def __init__(self, num_kv_blocks: int, vocab_size: int, block_size: int, eos_every: int = 0) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.eos_every = eos_every  # when > 0, token 0 (an EOS) comes out about once per eos_every draws
        self.block_tables = BlockTables()

    def execute(self, out: SchedulerOutput) -> StepResult:
        t0 = time.perf_counter()
        build_step_inputs(out, self.block_size, self.block_tables)
        cols = out.columns
        s = cols.sample
        h = (cols.seq_id[s] * 1_000_003 + cols.start[s] + cols.num_new_tokens[s] * 7919) % 2_147_483_647
        tok = 1 + h % (self.vocab_size - 1)
        if self.eos_every:
            tok[h % self.eos_every == 0] = 0
        tokens = dict(zip(cols.seq_id[s].tolist(), tok.tolist()))
        return StepResult(tokens=tokens, timings={"prepare_s": time.perf_counter() - t0})

    def execute_async(self, out: SchedulerOutput) -> DoneStep:
        return DoneStep(self.execute(out))

    def shutdown(self) -> None:
        pass
