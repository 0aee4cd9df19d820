"""A trace of real length: nano-vLLM's benchmark workload recorded at ``blocks`` level, then
what it costs to keep, open, export, save and load.

Workload as ``bench_throughput.py`` (256 requests of random token ids, input and output lengths
uniform in [100, 1024], ``ignore_eos``), on a config's shapes with random bf16 weights, under
async scheduling, with ``llm.record(level="blocks")``. Reported (issue 15, part 6):

* steps and block events recorded;
* trace memory per block event: the whole recorded trace (every object reachable from it,
  measured before any table is built) over the number of block events, and the
  ``trace.block_events`` DataFrame's own memory per row;
* time to open ``kvscope.dashboard(trace)`` (headless: the widgets exist without a browser), on
  the recorded trace (the first dashboard of the process, after the widget libraries were
  imported: ``widgets_import_s``) and again on the trace loaded back;
* ``save`` / ``Trace.load`` time and the saved folder's size; ``to_html`` time and file size.

Every figure is written to ``--json`` as soon as it exists, so a run cut short keeps the rest.

    python benchmarks/bench_trace_scale.py --device cuda --config benchmarks/configs/qwen3-0.6b --json trace_scale.json
    python benchmarks/bench_trace_scale.py --device cpu --config assets/kvscope-demo --requests 8 --max-input 128 --max-output 128
    python benchmarks/bench_trace_scale.py --device cpu --config benchmarks/configs/qwen3-0.6b --null-model 72367
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from bench_throughput import workload, write_random_checkpoint

_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def deep_sizeof(root: Any, seen: set[int] | None = None) -> tuple[int, int]:
    """Bytes of every object reachable from ``root``, each counted once, and how many torch
    objects were met (anything from torch means the trace holds engine state: expect 0).

    Types, modules and functions are shared code, not data, and are not counted; numpy arrays
    and pandas objects count their own ``__sizeof__`` (their buffers) and are not walked into,
    nor are torch objects. ``seen`` (object ids) carries over between calls, so parts of one
    structure measured one after another never count a shared object twice.
    """
    seen = set() if seen is None else seen
    stack = [root]
    total = torch_objects = 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _OPAQUE):
            continue
        seen.add(id(obj))
        if type(obj).__module__.startswith("torch"):
            torch_objects += 1
            continue
        total += sys.getsizeof(obj)
        if isinstance(obj, np.ndarray):
            if obj.base is not None:
                stack.append(obj.base)
        elif not isinstance(obj, (pd.DataFrame, pd.Series, pd.Index)):
            stack.extend(gc.get_referents(obj))
    return total, torch_objects


def trace_memory_split(trace: Any) -> dict[str, int]:
    """Bytes of a recorded trace's parts, each object counted once, in this order: the pool
    baseline replays start from, the per-step scheduled rows (with the launches that reuse
    them), the packed block events, the queues. Reads the recording's own records and baseline
    (the trace's source), so it measures what is held, not a table built from it."""
    source = trace._source
    seen: set[int] = set()
    records = list(source.records)

    def part(objects: Any) -> int:
        return sum(deep_sizeof(o, seen)[0] for o in objects)

    return {
        "baseline": part([source.baseline]),
        "scheduled_rows": part(x for r in records for x in (r.scheduled, r.launches)),
        "block_events": part(r.block_events for r in records),
        "queues": part(x for r in records for x in (r.running, r.waiting, r.preempted, r.finished)),
    }


def saved_sizes(path: Path) -> dict[str, Any]:
    """The saved trace folder's total bytes and each file's."""
    files = {str(f.relative_to(path)): f.stat().st_size for f in sorted(path.rglob("*")) if f.is_file()}
    return {"saved_bytes": sum(files.values()), "saved_files": files}


ENGINE = dict(async_scheduling=True, max_num_seqs=256, max_num_batched_tokens=16384)


def record_model(args: argparse.Namespace, ckpt: Path, prompts: list[list[int]], params: list) -> tuple[Any, float]:
    """The workload on ``--config``'s shapes with random weights, recorded at ``blocks``."""
    from kvscope import LLM, SamplingParams

    write_random_checkpoint(args.config, ckpt, args.device)
    llm = LLM(str(ckpt), device=args.device, skip_tokenizer_init=True, max_model_len=args.max_input + args.max_output,
              gpu_memory_utilization=args.gpu_mem, **ENGINE)
    # Warm-up on the workload's first prompts (Triton compiles here), then a clean cache.
    llm.generate(prompts[:32], SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=16), use_tqdm=False)
    llm.reset_prefix_cache()
    t = time.perf_counter()
    with llm.record(level="blocks", max_steps=args.max_steps) as trace:
        llm.generate(prompts, params, use_tqdm=False)
    run_s = time.perf_counter() - t
    llm.shutdown()
    return trace, run_s


def record_null_model(args: argparse.Namespace, _: Path, prompts: list[list[int]], params: list) -> tuple[Any, float]:
    """The same workload through the real engine and recorder over a ``NullExecutor``."""
    from bench_control_plane import _NoTokenizer

    from kvscope.config import EngineConfig
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.runner.null_executor import NullExecutor
    from kvscope.trace.recorder import Recorder

    vocab = json.loads(Path(args.config, "config.json").read_text())["vocab_size"]
    engine = LLMEngine(EngineConfig.from_kwargs(block_size=16, **ENGINE), NullExecutor(args.null_model, vocab, 16),
                       _NoTokenizer(), args.max_input + args.max_output)
    t = time.perf_counter()
    with Recorder(engine, "blocks", args.max_steps) as trace:
        for prompt, p in zip(prompts, params):
            engine.add_request(prompt, p, final_only=True)
        while engine.has_unfinished_requests():
            engine.step()
    return trace, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="benchmarks/configs/qwen3-0.6b", help="HF config dir (random weights)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-input", type=int, default=1024, help="input lengths uniform in [100, this]")
    ap.add_argument("--max-output", type=int, default=1024, help="output lengths uniform in [100, this]")
    ap.add_argument("--max-steps", type=int, default=10_000, help="the recording's ring buffer")
    ap.add_argument("--gpu-mem", type=float, default=0.9, help="gpu_memory_utilization")
    ap.add_argument("--json", default=None, help="write the figures here (after each one)")
    ap.add_argument("--keep", default=None, help="save the trace and the HTML page here (default: a temp dir)")
    ap.add_argument("--null-model", type=int, default=0, metavar="NUM_KV_BLOCKS",
                    help="no model: the engine and recorder over a NullExecutor with this many blocks "
                         "(the H200 run's pool: 72367), on any machine; the schedule, and so the trace's "
                         "steps and block events, are the GPU run's (they depend on lengths and budgets only)")
    args = ap.parse_args()
    if min(args.max_input, args.max_output) < 100:
        ap.error("--max-input and --max-output must be >= 100 (lengths are uniform in [100, max])")

    import kvscope
    from kvscope import SamplingParams, Trace

    figures: dict[str, Any] = {"args": vars(args), "torch": torch.__version__,
                               "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None}

    def note(**kv: Any) -> None:
        figures.update(kv)
        for k, v in kv.items():
            print(f"{k}: {v:,.4g}" if isinstance(v, float) else f"{k}: {v}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=1))

    vocab = json.loads(Path(args.config, "config.json").read_text())["vocab_size"]
    prompts, outs = workload(args.requests, args.max_input, args.max_output)
    prompts = [[t % vocab for t in p] for p in prompts]  # the same ids wherever the vocabulary holds 10000
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=o) for o in outs]
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(args.keep or tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        note(requests=len(prompts), prompt_tokens=sum(map(len, prompts)), output_tokens=sum(outs))
        run = record_null_model if args.null_model else record_model
        trace, run_s = run(args, Path(tmp, "model"), prompts, params)
        note(num_blocks=trace.num_blocks, block_size=trace.block_size, steps=len(trace.step_ids),
             record_run_s=run_s, record_run_tok_s=sum(outs) / run_s)

        trace_bytes, torch_objects = deep_sizeof(trace)  # before any table is built and cached on the trace
        split = trace_memory_split(trace)
        split["rest"] = trace_bytes - sum(split.values())
        t = time.perf_counter()
        events = trace.block_events
        note(block_events=len(events), block_events_frame_s=time.perf_counter() - t, trace_bytes=trace_bytes,
             trace_torch_objects=torch_objects,
             trace_bytes_per_block_event=trace_bytes / len(events),
             trace_bytes_per_block_event_by_part={k: round(v / len(events), 1) for k, v in split.items()},
             block_events_frame_bytes_per_event=int(events.memory_usage(deep=True).sum()) / len(events),
             block_events_by_kind=events["event"].value_counts().to_dict())

        t = time.perf_counter()
        import kvscope.widgets  # noqa: F401  (ipywidgets, anywidget, plotly: once per process)
        note(widgets_import_s=time.perf_counter() - t)
        t = time.perf_counter()
        kvscope.dashboard(trace)
        note(dashboard_open_s=time.perf_counter() - t)

        saved = out_dir / "trace"
        t = time.perf_counter()
        trace.save(saved)
        note(save_s=time.perf_counter() - t, **saved_sizes(saved))
        t = time.perf_counter()
        loaded = Trace.load(saved)
        note(load_s=time.perf_counter() - t)
        t = time.perf_counter()
        dash = kvscope.dashboard(loaded)
        note(dashboard_open_loaded_s=time.perf_counter() - t)
        note(round_trip_exact=bool(loaded.block_events.equals(events) and loaded.steps.equals(trace.steps)))

        page = out_dir / "trace.html"
        t = time.perf_counter()
        dash.to_html(page)
        note(to_html_s=time.perf_counter() - t, html_bytes=page.stat().st_size)


if __name__ == "__main__":
    main()
