"""``Trace.load`` of one saved trace with two versions of kvscope in one process, alternating.

The old version is a tree exported from an earlier commit; both are imported side by side (each
under its own ``sys.modules`` entries, set aside once imported), so each runs its own code from
reading the files to the last check. Before any timing, both loads must give the same records
and the same public tables, columns and dtypes included. Reported per version: the whole load's
median and min over the rounds (the versions alternate, the old one first in odd rounds), and
the median of each phase (reading the tables, ``check_frames``, ``records_from_frames``,
``check_replay``, ...).

Each load starts after a full collection (untimed), so that no load pays for the garbage of the
one before, and its time includes the young collection right after it (``gc.collect(0)``): a
version that keeps the collector off while it builds pays for the objects it made there. Also
reported: the time the cyclic collector ran within each load, and the collection after.

    git archive f5f03d1 kvscope | tar -x -C /tmp/s40old
    python benchmarks/bench_trace_load.py /tmp/fzD/big --old /tmp/s40old --rounds 7
    python benchmarks/bench_trace_load.py /tmp/fzD/big --old /tmp/s40old --new /tmp/s40new  # both exported
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parent.parent
# The functions Trace.load calls from trace.py, timed as phases where a version has them.
PHASES = ("read_frame", "check_frames", "records_from_frames", "check_queues", "read_baseline",
          "baseline_from_frames", "check_tokens", "check_replay", "check_checksums")
QUEUES = ("running", "waiting", "preempted", "finished")
ROW_COLUMNS = ("request_ids", "start", "num_new_tokens", "num_cached_tokens", "is_prefill", "sample", "token_ids")
EVENT_COLUMNS = ("event", "block_id", "request", "ref_count", "block_hash", "engine_step")
TABLES = ("steps", "requests", "block_events", "lifecycle")  # properties
PER_STEP = ("scheduled", "queues", "block_tables")  # methods, of every step or one


def import_tree(root: Path) -> dict[str, ModuleType]:
    """The ``kvscope`` modules ``Trace.load`` needs, imported from the tree at ``root``, then
    taken out of ``sys.modules`` (they keep their own globals) so another tree can be imported."""
    def ours() -> list[str]:
        return [k for k in sys.modules if k == "kvscope" or k.startswith("kvscope.")]

    before = {k: sys.modules.pop(k) for k in ours()}
    sys.path.insert(0, str(root))
    try:
        import kvscope.trace.trace  # noqa: F401
    finally:
        sys.path.remove(str(root))
        modules = {k: sys.modules.pop(k) for k in ours()}
        sys.modules.update(before)
    file = Path(modules["kvscope.trace.trace"].__file__).resolve()
    if file != (root / "kvscope/trace/trace.py").resolve():
        raise SystemExit(f"imported {file}, not the tree at {root}")
    return modules


def timed(module: ModuleType, phases: dict[str, float]) -> None:
    """Wrap the phases ``module`` calls so that each call adds its time to ``phases``."""
    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phases[name] += time.perf_counter() - t
        return run

    for name in PHASES:
        if hasattr(module, name):
            setattr(module, name, wrap(name, getattr(module, name)))


def assert_same(a: Any, b: Any, step_columns: tuple[str, ...]) -> None:
    """Two loads of one save give equal records and equal public tables."""
    ra, rb = a._records(), b._records()
    assert len(ra) == len(rb)
    for x, y in zip(ra, rb):
        assert [getattr(x, c) for c in step_columns] == [getattr(y, c) for c in step_columns], x.step
        assert all(getattr(x, q) == getattr(y, q) for q in QUEUES), x.step
        assert x.num_pre_forward_events == y.num_pre_forward_events, x.step
        assert [(l.step, l.num_events_before) for l in x.launches] == [(l.step, l.num_events_before) for l in y.launches]
        for s, t in [(x.scheduled, y.scheduled)] + [(l.rows, m.rows) for l, m in zip(x.launches, y.launches)]:
            assert all(np.array_equal(np.asarray(getattr(s, c)), np.asarray(getattr(t, c))) for c in ROW_COLUMNS), x.step
        assert all(np.array_equal(x.block_events.column(c), y.block_events.column(c)) for c in EVENT_COLUMNS), x.step
    for name in TABLES:
        pd.testing.assert_frame_equal(getattr(a, name), getattr(b, name), check_exact=True)
    last = a.step_ids[-1]
    for name in PER_STEP:
        pd.testing.assert_frame_equal(getattr(a, name)(), getattr(b, name)(), check_exact=True)
        pd.testing.assert_frame_equal(getattr(a, name)(last), getattr(b, name)(last), check_exact=True)
    pd.testing.assert_frame_equal(a.blocks(last), b.blocks(last), check_exact=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path, help="a directory Trace.save wrote")
    ap.add_argument("--old", type=Path, required=True, help="a tree holding the old version's kvscope/")
    ap.add_argument("--new", type=Path, default=REPO, help="a tree holding the new version's kvscope/ (default: this one)")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()

    trees = {"old": import_tree(args.old), "new": import_tree(args.new)}
    current = {v: dict.fromkeys(PHASES, 0.0) for v in trees}
    for version, modules in trees.items():
        timed(modules["kvscope.trace.trace"], current[version])
    totals: dict[str, list[float]] = {v: [] for v in trees}
    cpu: dict[str, list[float]] = {v: [] for v in trees}  # the process's CPU time (a shared machine's steadier clock)
    phases: dict[str, dict[str, list[float]]] = {v: {p: [] for p in PHASES} for v in trees}
    collecting: dict[str, list[float]] = {v: [] for v in trees}  # the collector's time within each load
    after: dict[str, list[float]] = {v: [] for v in trees}  # the young collection right after it
    clock = {"start": 0.0, "spent": 0.0}

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            clock["start"] = time.perf_counter()
        else:
            clock["spent"] += time.perf_counter() - clock["start"]

    def load(version: str) -> Any:
        current[version].update(dict.fromkeys(PHASES, 0.0))
        gc.collect()
        gc.callbacks.append(on_gc)
        clock["spent"] = 0.0
        c, t = time.process_time(), time.perf_counter()
        trace = trees[version]["kvscope.trace.trace"].Trace.load(args.trace)
        loaded = time.perf_counter()
        gc.callbacks.remove(on_gc)
        gc.collect(0)
        totals[version].append(time.perf_counter() - t)
        cpu[version].append(time.process_time() - c)
        after[version].append(time.perf_counter() - loaded)
        collecting[version].append(clock["spent"])
        for name, s in current[version].items():
            phases[version][name].append(s)
        return trace

    assert_same(load("old"), load("new"), tuple(trees["new"]["kvscope.trace.record"].STEP_COLUMNS))
    print(f"{args.trace}: both versions give the same records and tables")
    for i in range(args.rounds):
        for version in (("old", "new") if i % 2 == 0 else ("new", "old")):
            load(version)
    for version, ts in totals.items():
        ts = ts[1:]  # (the first load of each was the check's)
        print(f"{version}: whole load median {statistics.median(ts):.3f} s  min {min(ts):.3f} s  "
              f"all {' '.join(f'{t:.3f}' for t in ts)}")
    old, new = totals["old"][1:], totals["new"][1:]
    print(f"old/new: median {statistics.median(old) / statistics.median(new):.2f}x  min {min(old) / min(new):.2f}x")
    for version, ts in cpu.items():
        print(f"{version}: process CPU time median {statistics.median(ts[1:]):.3f} s  min {min(ts[1:]):.3f} s")
    for version in trees:
        print(f"{version}: collector within the load median {statistics.median(collecting[version][1:]):.3f} s, "
              f"young collection after it median {statistics.median(after[version][1:]):.3f} s")
    print("phase medians (s)       old     new")
    for name in PHASES:
        print(f"  {name:22}" + "".join(f"{statistics.median(phases[v][name][1:]):8.3f}" for v in trees))


if __name__ == "__main__":
    main()
