"""``python -m kvscope demo``: run the bundled model and show what the engine did."""
from __future__ import annotations

import argparse
import contextlib
import time
from typing import Callable, NoReturn

# Help-page headers in the bundled model's format; several share a module line, so their
# first blocks come from the prefix cache.
DEMO_PROMPTS = [
    "Help on topic assert:\n\n",
    "Help on method str.split in module builtins:\n\nsplit(self, /, sep=None, maxsplit=-1)\n\n",
    "Help on method str.join in module builtins:\n\njoin(self, iterable, /)\n\n",
    "Help on function join in module posixpath:\n\njoin(a, *p)\n\n",
    "Help on function split in module posixpath:\n\nsplit(p)\n\n",
    "Help on class Thread in module threading:\n\nclass Thread\n\n",
    "Help on method BaseTransport.close in module asyncio.transports:\n\nclose(self)\n\n",
    "Help on function dumps in module json:\n\n",
]


def demo(args: argparse.Namespace, usage_error: Callable[[str], NoReturn]) -> None:
    """Run the demo; a bad option (an engine config or sampling value the engine refuses, a
    model directory that is not there or whose files do not read) goes to ``usage_error`` as a
    one-line message."""
    from kvscope import LLM, SamplingParams

    t0 = time.perf_counter()
    try:
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
        llm = LLM(args.model, device=args.device, block_size=args.block_size)
    except (ValueError, TypeError, OSError) as e:
        usage_error(str(e))
    # (the engine refuses a request past max_model_len only once generate adds it: a traceback)
    longest = max(len(llm.get_tokenizer().encode(p)) for p in DEMO_PROMPTS)  # (as generate tokenizes them)
    room = llm.llm_engine.max_model_len - longest
    if args.max_tokens > room:
        usage_error(f"--max-tokens must be at most {room} (the longest demo prompt has {longest} tokens, "
                    f"max_model_len is {llm.llm_engine.max_model_len}), got {args.max_tokens}")
    print(f"loaded {llm.model_dir} on {llm.llm_engine.executor.device} in {time.perf_counter() - t0:.1f}s; "
          f"{llm.llm_engine.block_manager.num_blocks} KV blocks of {args.block_size} tokens")
    steps: list[int] = []
    llm.hooks.add("step.end", lambda info: steps.append(info.step))
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        try:  # the per-step table needs pandas (the notebook extra); a bare install runs without it
            trace = stack.enter_context(llm.record(level="blocks"))
        except ImportError:
            trace = None
        outs = llm.generate(DEMO_PROMPTS, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    for o in outs:
        c = o.outputs[0]
        print(f"\n[{o.request_id}] {o.prompt!r} -> ({c.finish_reason}, {len(c.token_ids)} tokens, "
              f"{o.num_cached_tokens} cached)\n    {c.text.strip()!r}")
    n_tok = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"\n{len(outs)} requests, {n_tok} tokens in {dt:.2f}s ({n_tok / dt:.0f} tok/s), {len(steps)} steps")
    if trace is None:
        print("\n(the per-step table needs pandas: pip install 'kvscope[notebook]')")
    else:
        print("\nfirst steps (trace.steps):")
        cols = ["step", "num_prefill_tokens", "num_decode_tokens", "num_requests_running",
                "num_requests_waiting", "num_used_blocks", "prefix_cache_hits"]
        print(trace.steps[cols].head(6).to_string(index=False))
    again = llm.generate(DEMO_PROMPTS, params, use_tqdm=False)
    cached = sum(o.num_cached_tokens for o in again)
    total = sum(len(o.prompt_token_ids) for o in again)
    print(f"\nthe same prompts again: {cached} of {total} prompt tokens came from the prefix cache "
          f"(full {llm.llm_engine.block_manager.block_size}-token blocks, matched by content hash)")
    print("open notebooks/01_quickstart.ipynb (or `%load_ext kvscope` then `%kvscope demo`) to watch it live")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="kvscope")
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="generate with the bundled model and summarise the engine's steps")
    d.add_argument("--model", default=None, help="a local HF model directory (default: the bundled model)")
    d.add_argument("--device", default="auto")
    d.add_argument("--block-size", type=int, default=16)
    d.add_argument("--max-tokens", type=int, default=48)
    d.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args(argv)
    if args.command == "demo":
        demo(args, d.error)


if __name__ == "__main__":
    main()
