"""What the engine needs from whatever runs the model (one process, or tensor-parallel ranks)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvscope.engine.scheduler_output import SchedulerOutput


@dataclass
class StepResult:
    """Sampled tokens for the rows the scheduler marked ``sample``, keyed by ``seq_id``."""

    tokens: dict[int, int]
    logprobs: dict[int, dict[int, float]] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)  # prepare_s, forward_s, sample_s
    cuda_graph: bool = False


class Executor(Protocol):
    num_kv_blocks: int
    vocab_size: int

    def execute(self, out: SchedulerOutput) -> StepResult: ...

    def shutdown(self) -> None: ...
