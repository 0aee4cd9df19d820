"""Throughput with a live dashboard attached vs none, measured interleaved in one run.

The measurement runs inside a real Jupyter kernel (started with jupyter_client), so every
widget update is serialized and sent over ZMQ exactly as in a notebook; only the browser is
missing. Three arms alternate in rotating order, each on the same LLM and workload:

* ``none``: plain ``llm.generate``;
* ``record``: inside ``llm.record(level=...)``, what the dashboard records (``--level``);
* ``dashboard``: a displayed ``kvscope.dashboard(llm)`` with its default throttling (timed
  after the one-time cost of displaying it has drained).

    python benchmarks/bench_dashboard_overhead.py                  # bundled model, CPU
    python benchmarks/bench_dashboard_overhead.py --device cuda --prompts 64 --max-tokens 256 --num-kv-blocks 2048

Prints one JSON object: per-arm median tokens/s, each arm's slowdown against ``none`` (median
of per-round ratios), and the dashboard's update rate.
"""
from __future__ import annotations

import argparse
import json
import textwrap

KERNEL_CODE = """
import json, statistics, time
import torch
import kvscope
from kvscope import LLM, SamplingParams
from kvscope.demo import demo_prompts
from IPython.display import display

args = json.loads({args!r})
if args["threads"]:
    torch.set_num_threads(args["threads"])
engine = dict(block_size=16, max_num_batched_tokens=args["budget"], max_num_seqs=args["max_seqs"],
              num_kv_blocks=args["num_kv_blocks"], device=args["device"])
llm = LLM(args["model"], **engine)
prompts = demo_prompts(args["prompts"])
params = SamplingParams(temperature=0, max_tokens=args["max_tokens"], ignore_eos=True)

steps = []

def run():
    llm.reset_prefix_cache()
    first = llm.llm_engine.scheduler.step_count
    t = time.perf_counter()
    out = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    steps.append(llm.llm_engine.scheduler.step_count - first)
    return sum(len(o.outputs[0].token_ids) for o in out) / dt

def arm_none():
    return run(), None

def arm_record():
    with llm.record(level=args["level"]):
        return run(), None

def arm_dashboard():
    dash = kvscope.dashboard(llm, level=args["level"], **{{k: args[k] for k in ("interval", "max_load") if args[k] is not None}})
    display(dash)
    # Displaying sends each view's front-end code once (plotly's FigureWidget alone is ~5 MB);
    # let the kernel's IOPub thread finish that before timing the steady state.
    time.sleep(2.0)
    before = dash.num_updates
    t = time.perf_counter()
    tps = run()
    rate = (dash.num_updates - before) / (time.perf_counter() - t)
    dash.detach()
    return tps, rate

arms = dict(none=arm_none, record=arm_record, dashboard=arm_dashboard)
for fn in arms.values():  # warm-up: first-call costs of every arm
    fn()
tps = {{k: [] for k in arms}}
rates = []
names = list(arms)
for r in range(args["rounds"]):
    order = names[r % 3:] + names[:r % 3]  # rotate, so drift hits every arm alike
    for k in order:
        value, rate = arms[k]()
        tps[k].append(value)
        if rate is not None:
            rates.append(rate)
ratio = lambda k: statistics.median(a / b for a, b in zip(tps["none"], tps[k]))
print("RESULT" + json.dumps(dict(
    args=args, torch=torch.__version__,
    gpu=torch.cuda.get_device_name() if args["device"].startswith("cuda") else None,
    steps_per_run=statistics.median(steps),
    tokens_per_s={{k: round(statistics.median(v), 1) for k, v in tps.items()}},
    slowdown_pct={{k: round(100 * (ratio(k) - 1), 2) for k in ("record", "dashboard")}},
    dashboard_updates_per_s=round(statistics.median(rates), 2),
    raw_tokens_per_s={{k: [round(x, 1) for x in v] for k, v in tps.items()}},
)))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the bundled demo model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-kv-blocks", type=int, default=48)
    ap.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens")
    ap.add_argument("--max-seqs", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6, help="rounds of the three arms")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads in the kernel (0: leave)")
    ap.add_argument("--level", default="blocks", choices=("blocks", "full"), help="recording level of both arms")
    ap.add_argument("--interval", type=float, default=None, help="dashboard interval (default: the dashboard's)")
    ap.add_argument("--max-load", type=float, default=None, help="dashboard max_load (default: the dashboard's)")
    args = ap.parse_args()

    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    lines: list[str] = []

    def hook(msg: dict) -> None:
        content = msg["content"]
        if msg["msg_type"] == "stream":
            lines.extend(content["text"].splitlines())
        elif msg["msg_type"] == "error":
            raise RuntimeError("\n".join(content["traceback"]))

    try:
        code = textwrap.dedent(KERNEL_CODE).format(args=json.dumps(vars(args)))
        reply = kc.execute_interactive(code, output_hook=hook, timeout=3600)
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"benchmark failed in the kernel: {reply['content']}")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    result = next(line[len("RESULT"):] for line in lines if line.startswith("RESULT"))
    print(json.dumps(json.loads(result), indent=1))


if __name__ == "__main__":
    main()
