"""Offline throughput on nano-vLLM's benchmark workload, against transformers and the roofline.

Workload: 256 requests, ``random.seed(0)``, prompts of random token ids below 10000, input and
output lengths uniform in [100, 1024], ``temperature=0.6``, ``ignore_eos=True``. Model: a
config from ``benchmarks/configs/`` with random bf16 weights (written once to a temp dir and
loaded through kvscope's own loader).

Prints, from one run: kvscope's output tok/s; transformers' continuous batching
(``attn_implementation="paged|sdpa"``) on the first ``--hf-requests`` requests, with kvscope on
the same subset; the roofline bound (weights + KV bytes each step must read, at the measured
device-to-device copy bandwidth); and the ratios.

``--kv-cache-dtype auto,fp8`` runs kvscope once per KV cache dtype, in one call: the first is
the baseline, each next one is reported against it and against its own roofline (for fp8 the
KV bytes are halved: 1 byte per element instead of bf16's 2).

    python benchmarks/bench_throughput.py --config benchmarks/configs/qwen3-0.6b
    python benchmarks/bench_throughput.py --kv-cache-dtype auto,fp8 --hf-requests 0
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import tempfile
import time
from pathlib import Path

import torch


def workload(num_seqs: int = 256, max_in: int = 1024, max_out: int = 1024, seed: int = 0):
    random.seed(seed)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_in))] for _ in range(num_seqs)]
    outs = [random.randint(100, max_out) for _ in range(num_seqs)]
    return prompts, outs


def write_random_checkpoint(config_dir: str, out_dir: Path, device: str = "cuda") -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out_dir)
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy (read + write counted once each)."""
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    n = 10
    for _ in range(n):
        y.copy_(x)
    torch.cuda.synchronize()
    bw = 2 * x.numel() * n / (time.perf_counter() - t)
    del x, y
    torch.cuda.empty_cache()
    return bw


KV_BYTES = {"auto": 2, "fp8": 1, "fp8_e4m3": 1}  # bytes per KV element (auto: the bf16 weights' type)


def kv_bytes_per_token(cfg: dict, kv_bytes: int = 2) -> int:
    """K and V of one token in every layer (``kv_bytes`` per cached element)."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * kv_bytes


def roofline_tok_s(cfg, prompts, outs, steps: int, bw: float, kv_bytes: int = 2) -> float:
    """Output tokens per second if each step only had to read the weights and the KV history
    (``kv_bytes`` per cached element: 2 for bf16, 1 for an fp8 KV cache)."""
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_per_tok = kv_bytes_per_token(cfg, kv_bytes)
    h, i, v, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    per_layer = h * (heads * head_dim) * 2 + 2 * h * (cfg["num_key_value_heads"] * head_dim) + 3 * h * i
    weight_bytes = 2 * (L * per_layer + v * h * (1 if cfg.get("tie_word_embeddings") else 2))
    kv_reads = sum(kv_per_tok * (len(p) * o + o * (o - 1) // 2) for p, o in zip(prompts, outs))
    seconds = (steps * weight_bytes + kv_reads) / bw
    return sum(outs) / seconds


def timed_generate(llm, prompts, outs) -> float:
    """Seconds for ``llm`` to generate the workload (``outs[i]`` tokens for prompt ``i``, no
    early stop), device work included; checks every token came."""
    from kvscope import SamplingParams

    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=o) for o in outs]
    torch.cuda.synchronize()
    t = time.perf_counter()
    res = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    assert sum(len(r.outputs[0].token_ids) for r in res) == sum(outs)
    return dt


def run_kvscope(model_dir: str, prompts, outs, args, tp: int,
                kv_cache_dtype: str = "auto") -> tuple[float, int]:
    from kvscope import LLM, SamplingParams

    llm = LLM(model_dir, skip_tokenizer_init=True, max_model_len=4096, enforce_eager=args.eager,
              kv_cache_dtype=kv_cache_dtype,
              tensor_parallel_size=tp, async_scheduling=args.async_scheduling, max_num_seqs=256,
              max_num_batched_tokens=args.batched_tokens,
              gpu_memory_utilization=args.gpu_mem)
    # Warm-up on the workload's own first prompts: chunked prefill, mixed and decode steps, so
    # Triton compiles its kernel variants here, not inside the timed run.
    llm.generate(prompts[:32], SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=16), use_tqdm=False)
    llm.reset_prefix_cache()  # the timed run must not hit the warm-up's blocks
    steps0 = llm.llm_engine.scheduler.step_count
    dt = timed_generate(llm, prompts, outs)
    steps = llm.llm_engine.scheduler.step_count - steps0
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return sum(outs) / dt, steps


def run_transformers(model_dir: str, prompts, outs) -> float:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="paged|sdpa").cuda().eval()
    gen = GenerationConfig(do_sample=True, temperature=0.6, top_k=0, top_p=1.0,
                           max_new_tokens=max(outs), eos_token_id=-1, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=gen)
    manager.start()
    try:
        manager.add_request(input_ids=[1] * 16, request_id="warm", max_new_tokens=8)
        while not (r := manager.get_result(timeout=60)) or not r.is_finished():
            pass
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i, (p, o) in enumerate(zip(prompts, outs)):
            manager.add_request(input_ids=p, request_id=f"r{i}", max_new_tokens=o)
        done, produced = 0, 0
        while done < len(prompts):
            r = manager.get_result(timeout=120)
            if r is None:
                raise RuntimeError("transformers continuous batching stalled")
            if r.is_finished():
                done += 1
                produced += len(r.generated_tokens)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
    finally:
        manager.stop(block=True)
    return produced / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="benchmarks/configs/qwen3-0.6b")
    ap.add_argument("--hf-requests", type=int, default=64, help="transformers runs this many (0: skip)")
    ap.add_argument("--tp", default="1", help="tensor-parallel sizes, comma-separated (\"1,2\": ratio to the first)")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--async-scheduling", action="store_true", help="overlap step n+1's CPU work with step n (every TP size)")
    ap.add_argument("--batched-tokens", type=int, default=16384)
    ap.add_argument("--gpu-mem", type=float, default=0.9)
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="KV cache dtypes, comma-separated (\"auto,fp8\": each against the first and its roofline)")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--unfused", action="store_true", help="torch code instead of the fused Triton norm/RoPE/SiLU kernels")
    args = ap.parse_args()
    if args.unfused:
        from kvscope.kernels import fused

        fused.USE_FUSED_KERNELS = False

    kv_dtypes = args.kv_cache_dtype.split(",")
    unknown = [d for d in kv_dtypes if d not in KV_BYTES]
    if unknown:
        ap.error(f"--kv-cache-dtype: {unknown} not in {sorted(KV_BYTES)}")
    prompts, outs = workload()
    cfg = json.loads(Path(args.config, "config.json").read_text())
    print(f"workload: {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, {sum(outs)} output tokens")
    bw = copy_bandwidth()
    print(f"device-to-device copy bandwidth: {bw / 1e12:.2f} TB/s")
    with tempfile.TemporaryDirectory() as tmp:
        write_random_checkpoint(args.config, Path(tmp))
        sizes = [int(t) for t in args.tp.split(",")]
        tok_s, steps = run_kvscope(tmp, prompts, outs, args, sizes[0], kv_dtypes[0])
        roof = roofline_tok_s(cfg, prompts, outs, steps, bw, KV_BYTES[kv_dtypes[0]])
        print(f"kvscope: {tok_s:,.0f} output tok/s ({steps} steps, TP={sizes[0]}, kv_cache_dtype={kv_dtypes[0]})")
        print(f"roofline (one GPU): {roof:,.0f} tok/s -> kvscope at {tok_s / roof:.1%} of the roofline")
        figures = dict(kvscope_tok_s=tok_s, steps=steps, roofline_tok_s=roof, copy_bw=bw, tp=sizes[0],
                       kv_cache_dtype=kv_dtypes[0])
        for kv in kv_dtypes[1:]:
            t, n_steps = run_kvscope(tmp, prompts, outs, args, sizes[0], kv)
            r = roofline_tok_s(cfg, prompts, outs, n_steps, bw, KV_BYTES[kv])
            print(f"kvscope kv_cache_dtype={kv}: {t:,.0f} output tok/s ({n_steps} steps) -> {t / tok_s:.2f}x of "
                  f"{kv_dtypes[0]}; its roofline {r:,.0f} tok/s -> at {t / r:.1%}")
            figures[f"kvscope_{kv}_tok_s"], figures[f"roofline_{kv}_tok_s"] = t, r
        for tp in sizes[1:]:
            t, _ = run_kvscope(tmp, prompts, outs, args, tp)
            print(f"kvscope at TP={tp}: {t:,.0f} output tok/s -> {t / tok_s:.2f}x of TP={sizes[0]}")
            figures[f"kvscope_tp{tp}_tok_s"] = t
        n = args.hf_requests
        if n:
            sub_p, sub_o = prompts[:n], outs[:n]
            ours, _ = run_kvscope(tmp, sub_p, sub_o, args, sizes[0])
            theirs = run_transformers(tmp, sub_p, sub_o)
            print(f"first {n} requests: kvscope {ours:,.0f} tok/s, transformers paged|sdpa {theirs:,.0f} tok/s "
                  f"-> {ours / theirs:.1f}x")
            figures.update(subset=n, kvscope_subset_tok_s=ours, transformers_subset_tok_s=theirs)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
