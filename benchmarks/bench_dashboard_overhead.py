"""Throughput with a live dashboard attached vs none, measured interleaved in one run.

The measurement runs inside a real Jupyter kernel (started with jupyter_client), so every
widget update is serialized and sent over ZMQ exactly as in a notebook; only the browser is
missing. The arms (``--arms``, by default all three) alternate in rotating order, each on the
same LLM and workload:

* ``none``: plain ``llm.generate``;
* ``record``: inside ``llm.record(level=...)``, what the dashboard records (``--level``);
* ``dashboard``: a displayed ``kvscope.dashboard(llm)`` with its default throttling (timed
  after the one-time cost of displaying it has drained).

With ``--requests N`` the workload is nano-vLLM's benchmark (``bench_throughput.py``: N
requests of random token ids, input and output lengths uniform in [100, 1024]) instead of the
demo prompts; ``--config`` loads random bf16 weights of a config's shapes. The dashboard's
updates are counted by its ``num_updates`` (one per batch of widget messages it pushed).

    python benchmarks/bench_dashboard_overhead.py                  # bundled model, CPU
    python benchmarks/bench_dashboard_overhead.py --device cuda --config benchmarks/configs/qwen3-0.6b \
        --requests 256 --num-kv-blocks 0 --budget 16384 --max-seqs 256 --async-scheduling --arms none,dashboard --rounds 4

Prints one JSON object (and writes it to ``--json``): per-arm median tokens/s, each arm's
slowdown against ``none`` (median of per-round ratios), and the dashboard's update rate.
"""
from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent

KERNEL_CODE = """
import json, shutil, statistics, sys, tempfile, time
from pathlib import Path
import torch
import kvscope
from kvscope import LLM, SamplingParams
from kvscope.demo import demo_prompts
from IPython.display import display

args = json.loads({args!r})
if args["threads"]:
    torch.set_num_threads(args["threads"])
engine = dict(block_size=16, max_num_batched_tokens=args["budget"], max_num_seqs=args["max_seqs"],
              num_kv_blocks=args["num_kv_blocks"] or None, device=args["device"],
              async_scheduling=args["async_scheduling"])
sys.path.insert(0, args["benchmarks_dir"])
from bench_throughput import workload, write_random_checkpoint
model = args["model"]
if args["config"]:
    model = tempfile.mkdtemp()
    write_random_checkpoint(args["config"], Path(model), args["device"])
if args["requests"]:
    prompts, outs = workload(args["requests"], args["max_input"], args["max_output"])
    vocab = json.loads(Path(model, "config.json").read_text())["vocab_size"]
    prompts = [[t % vocab for t in p] for p in prompts]
    params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for o in outs]
    engine.update(skip_tokenizer_init=True, max_model_len=args["max_input"] + args["max_output"])
else:
    prompts = demo_prompts(args["prompts"])
    params = SamplingParams(temperature=0, max_tokens=args["max_tokens"], ignore_eos=True)
llm = LLM(model, **engine)
if args["config"]:
    shutil.rmtree(model)  # loaded
# Warm-up of the engine (Triton compiles its kernel variants here, not in a timed run).
llm.generate(prompts[:32], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)

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

arms = {{k: dict(none=arm_none, record=arm_record, dashboard=arm_dashboard)[k] for k in args["arms"].split(",")}}
for fn in arms.values():  # warm-up: first-call costs of every arm
    fn()
tps = {{k: [] for k in arms}}
rates = []
names = list(arms)
for r in range(args["rounds"]):
    order = names[r % len(names):] + names[:r % len(names)]  # rotate, so drift hits every arm alike
    for k in order:
        value, rate = arms[k]()
        tps[k].append(value)
        if rate is not None:
            rates.append(rate)
    print(f"round {{r}}: " + ", ".join(f"{{k}} {{v[-1]:.1f}} tok/s" for k, v in tps.items()), flush=True)
ratio = lambda k: statistics.median(a / b for a, b in zip(tps["none"], tps[k]))
print("RESULT" + json.dumps(dict(
    args=args, torch=torch.__version__, num_kv_blocks=llm.llm_engine.block_manager.num_blocks,
    gpu=torch.cuda.get_device_name() if args["device"].startswith("cuda") else None,
    steps_per_run=statistics.median(steps),
    tokens_per_s={{k: round(statistics.median(v), 1) for k, v in tps.items()}},
    slowdown_pct={{k: round(100 * (ratio(k) - 1), 2) for k in names if k != "none"}},
    dashboard_updates_per_s=round(statistics.median(rates), 2) if rates else None,
    raw_tokens_per_s={{k: [round(x, 1) for x in v] for k, v in tps.items()}},
)))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the bundled demo model)")
    ap.add_argument("--config", default=None, help="HF config dir: random bf16 weights of its shapes instead of --model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=8, help="demo prompts (when --requests is 0)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per demo prompt")
    ap.add_argument("--requests", type=int, default=0, help="nano-vLLM's workload of this many requests (0: demo prompts)")
    ap.add_argument("--max-input", type=int, default=1024, help="--requests: input lengths uniform in [100, this]")
    ap.add_argument("--max-output", type=int, default=1024, help="--requests: output lengths uniform in [100, this]")
    ap.add_argument("--async-scheduling", action="store_true", help="in every arm")
    ap.add_argument("--num-kv-blocks", type=int, default=48, help="0: sized by the device's memory")
    ap.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens")
    ap.add_argument("--max-seqs", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6, help="rounds of the arms")
    ap.add_argument("--arms", default="none,record,dashboard",
                    help="comma-separated, from none, record, dashboard (none must be one)")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads in the kernel (0: leave)")
    ap.add_argument("--level", default="blocks", choices=("blocks", "full"), help="recording level of both arms")
    ap.add_argument("--interval", type=float, default=None, help="dashboard interval (default: the dashboard's)")
    ap.add_argument("--max-load", type=float, default=None, help="dashboard max_load (default: the dashboard's)")
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args()
    if args.config and args.model:
        ap.error("--config (random weights) and --model exclude each other")
    if args.requests and not (args.config or args.model):
        ap.error("--requests needs --config or --model: the bundled model's context is too short for its lengths")
    arms = args.arms.split(",")
    if "none" not in arms or not set(arms) <= {"none", "record", "dashboard"} or len(set(arms)) != len(arms):
        ap.error(f"--arms: distinct names from none, record, dashboard, none among them; got {args.arms!r}")
    if min(args.max_input, args.max_output) < 100:
        ap.error("--max-input and --max-output must be >= 100 (lengths are uniform in [100, max])")
    result = run_in_kernel(args)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def run_in_kernel(args: argparse.Namespace) -> dict:
    """Run the benchmark in a fresh Jupyter kernel; returns its result."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    lines: list[str] = []

    def hook(msg: dict) -> None:
        content = msg["content"]
        if msg["msg_type"] == "stream":
            print(content["text"], end="", flush=True)  # progress, in the log as it comes
            lines.extend(content["text"].splitlines())
        elif msg["msg_type"] == "error":
            raise RuntimeError("\n".join(content["traceback"]))

    try:
        code = textwrap.dedent(KERNEL_CODE).format(args=json.dumps(dict(vars(args), benchmarks_dir=str(HERE))))
        reply = kc.execute_interactive(code, output_hook=hook, timeout=3600)
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"benchmark failed in the kernel: {reply['content']}")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return json.loads(next(line[len("RESULT"):] for line in lines if line.startswith("RESULT")))


if __name__ == "__main__":
    main()
