"""bench_trace_scale's trace memory figure: ``deep_sizeof`` against what Python actually allocated."""
from __future__ import annotations

import sys
import tracemalloc
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from bench_trace_scale import deep_sizeof  # noqa: E402


class Event(NamedTuple):  # the shape of a recorded block event
    event: str
    block_id: int
    request_id: str
    block_hash: int


def build(n: int) -> dict:
    events = [Event("block.allocated", 70_000 + i, f"req-{i % 97}-{i}", (i * 2654435761) << 20) for i in range(n)]
    return {"events": events, "tokens": np.arange(4 * n, dtype=np.int32), "meta": {"n": n}}


def test_deep_sizeof_matches_the_memory_python_allocated():
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    data = build(20_000)
    allocated = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    size, torch_objects = deep_sizeof(data)
    assert torch_objects == 0
    assert abs(size - allocated) / allocated < 0.1, (size, allocated)


def test_shared_objects_count_once_and_torch_is_not_walked():
    data = build(1000)
    alone, _ = deep_sizeof(data)
    twice, _ = deep_sizeof([data, data, data["events"]])
    assert twice - alone == sys.getsizeof([None] * 3)  # only the new outer list
    seen: set[int] = set()
    assert deep_sizeof(data, seen)[0] == alone and deep_sizeof(data["events"], seen)[0] == 0  # counted already
    size, torch_objects = deep_sizeof([data, torch.zeros(1 << 20)])
    assert torch_objects == 1 and size == twice - sys.getsizeof([None] * 3) + sys.getsizeof([None] * 2)
