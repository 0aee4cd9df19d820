"""What one engine step did, handed to ``step.end`` hooks (control-plane facts only, no tensors)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvscope.engine.scheduler_output import SchedulerOutput


@dataclass
class StepInfo:
    step: int
    time_s: float                       # perf_counter at the start of the step (async: or the previous step's end)
    duration_s: float                   # to this step's end; durations add up to wall time
    scheduler_output: SchedulerOutput
    request_ids: dict[int, str]         # seq_id -> request_id for every scheduled/preempted seq
    sampled: dict[int, int]             # seq_id -> token sampled this step
    finished: list[str]                 # request ids that finished this step
    waiting: list[str]                  # queue contents after the step, head first
    running: list[str]
    timings: dict[str, float] = field(default_factory=dict)  # schedule_s, prepare_s, forward_s, sample_s, postprocess_s
    cuda_graph: bool = False
