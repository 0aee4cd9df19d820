"""Memory over a long live run with a bounded trace: does anything grow once the ring buffer is full?

The tiny test model (tests/engine_helpers.make_llm) generates continuously: before each step,
requests are added until ``--in-flight`` are unfinished, so requests keep arriving and finishing
and the steady state is what most steps see. The engine is recorded at ``blocks`` level with a
ring buffer of ``--window`` steps, by ``llm.record`` alone (``--mode record``, reading
``trace.lifecycle`` and ``trace.steps`` every ``--read-every`` steps as a live view would), by a
live ``kvscope.widgets.Dashboard`` (``--mode dashboard``: its updater thread reads the trace), or
not at all (``--mode none``: the engine's own baseline).

Every ``--every`` steps it prints the RSS, the RSS after ``malloc_trim(0)`` (glibc's free heap
handed back: what is left is live or fragmented), the bytes malloc has handed out and not had
back (``mallinfo2``: live, native code's included), the GC-tracked objects, and what the trace
holds: bytes reachable from the recorder (``bench_trace_scale.deep_sizeof``), its records,
request rows, and the request ids its tables have interned (all tables reachable from it);
the step records alive anywhere in the process (a holder outside the ring buffer shows here);
with the dashboard, its updates and the records its step series has queued and not taken in.
With ``--tracemalloc A B`` it also takes ``tracemalloc`` snapshots at steps ``A`` and ``B``
(after a full collection) and prints the allocations that grew most between them, by traceback.

    python benchmarks/bench_trace_memory.py --mode record --steps 8000
    python benchmarks/bench_trace_memory.py --mode dashboard --steps 6000 --tracemalloc 2000 6000
    python benchmarks/bench_trace_memory.py --mode dashboard --window 2000 --steps 7500 --in-flight 4000 \
        --prompt-len 50 250 --output-len 30 150 --num-kv-blocks 100000 --max-num-seqs 64 --max-num-batched-tokens 1024
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import random
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from bench_trace_scale import deep_sizeof  # noqa: E402
from engine_helpers import greedy, make_llm  # noqa: E402

from kvscope.trace.record import StepRecord  # noqa: E402

_LIBC = ctypes.CDLL("libc.so.6")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


_LIBC.mallinfo2.restype = _MallInfo2


def malloc_in_use() -> int:
    """Bytes glibc's malloc has handed out and not had back (every arena, and its own mmaps):
    what grows here is held by someone, native code included; what RSS has beyond it is free
    heap that fragmentation keeps."""
    info = _LIBC.mallinfo2()
    return info.uordblks + info.hblkhd


def interned_ids(recorder: Any) -> tuple[int, int]:
    """How many request-id tables the recorder's records and encoder reach, and the ids they name."""
    tables = {id(recorder._request_ids): recorder._request_ids}
    for rec in list(recorder.records):
        if rec.block_events is not None:
            tables[id(rec.block_events.requests)] = rec.block_events.requests
        if rec.scheduled is not None:
            tables[id(rec.scheduled.table.requests)] = rec.scheduled.table.requests
    return len(tables), sum(len(t.names) for t in tables.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("none", "record", "dashboard"), default="record")
    ap.add_argument("--steps", type=int, default=8000)
    ap.add_argument("--window", type=int, default=500, help="the recording's max_steps")
    ap.add_argument("--in-flight", type=int, default=40, help="unfinished requests kept before each step")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(8, 40), help="own prompt tokens, min and max+1")
    ap.add_argument("--output-len", type=int, nargs=2, default=(4, 24), help="output tokens, min and max+1")
    ap.add_argument("--num-kv-blocks", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--every", type=int, default=1000, help="print a line every this many steps")
    ap.add_argument("--read-every", type=int, default=50, help="--mode record: read the trace this often")
    ap.add_argument("--tracemalloc", type=int, nargs=2, metavar=("A", "B"))
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()

    llm = make_llm(num_kv_blocks=args.num_kv_blocks, block_size=args.block_size, validate=False,
                   max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    rng = random.Random(0)
    system = [rng.randrange(3, 300) for _ in range(48)]
    trace = dash = None
    if args.mode == "dashboard":
        from kvscope.widgets import Dashboard
        dash = Dashboard(llm, max_steps=args.window)
        trace = dash.trace
    elif args.mode == "record":
        recording = llm.record("blocks", max_steps=args.window)
        trace = recording.__enter__()
    recorder = trace._source if trace is not None else None
    if args.tracemalloc:
        tracemalloc.start(12)
    proc, snaps, n, t0 = psutil.Process(), {}, 0, time.perf_counter()
    print(f"mode {args.mode}, window {args.window}, {args.in_flight} in flight, "
          f"{args.num_kv_blocks} blocks of {args.block_size}", flush=True)
    while n < args.steps:
        while len(llm.llm_engine.requests) < args.in_flight:
            prompt = system[: rng.choice([0, 16, 48])] + [rng.randrange(3, 300) for _ in range(rng.randrange(*args.prompt_len))]
            llm.add_request(prompt, greedy(rng.randrange(*args.output_len)))
        llm.step()
        n += 1
        if args.mode == "record" and n % args.read_every == 0:
            trace.lifecycle, trace.steps  # noqa: B018 (a live view's reads)
        if args.tracemalloc and n in args.tracemalloc:
            gc.collect()
            snaps[n] = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        if n % args.every == 0:
            rss = proc.memory_info().rss
            _LIBC.malloc_trim(0)
            line = (f"step {n:6d} {time.perf_counter() - t0:6.0f} s  rss {rss / 2**20:7.1f} MB  "
                    f"trimmed {proc.memory_info().rss / 2**20:7.1f} MB  malloc in use {malloc_in_use() / 2**20:7.1f} MB  "
                    f"gc objects {len(gc.get_objects()):7d}")
            if recorder is not None:
                with recorder.lock:
                    size = deep_sizeof(recorder.records)[0] + deep_sizeof(recorder._request_rows)[0]
                    tables, ids = interned_ids(recorder)
                line += (f"  trace {size / 2**20:6.2f} MB  records {len(recorder.records)}  "
                         f"request rows {len(recorder._request_rows)}  id tables {tables}  ids {ids}")
                alive = sum(isinstance(o, StepRecord) for o in gc.get_objects())
                line += f"  records alive {alive}"
            if dash is not None:
                line += f"  updates {dash.num_updates}  series pending {len(dash.series._pending)}"
            print(line, flush=True)
    if dash is not None:
        dash.detach()
    if args.tracemalloc:
        a, b = args.tracemalloc
        print(f"tracemalloc: growth from step {a} to step {b}, by traceback")
        for stat in snaps[b].compare_to(snaps[a], "traceback")[:args.top]:
            print(f"{stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+7d} blocks (now {stat.size / 1024:.1f} KiB)")
            for frame in stat.traceback.format()[-8:]:
                print("      ", frame)


if __name__ == "__main__":
    main()
