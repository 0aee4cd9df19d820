"""Accuracy of the fp8 KV cache (``kv_cache_dtype="fp8"``) against an unquantized one, on CPU.

(a) Qwen3-0.6B head shapes (hidden 1024, 16 query / 8 KV heads of 128, q/k norms), random
    weights; reduced to ``--layers`` layers and a ``--vocab``-token vocabulary so that it runs on
    a CPU in minutes. Random token sequences, teacher-forced: the log-prob of each next token
    under both engines (mean and p99 of the absolute difference), and how often their greedy
    choices agree.
(b) The bundled demo model (``assets/kvscope-demo``): perplexity of held-out documents (the
    test split of ``tools/train_demo_model.py``, rebuilt from ``tools/demo_corpus.py``), each
    document + EOS, the first token not scored, as in its training script.

Teacher forcing goes through the engine itself: every prefix is a prompt that generates one
token with ``logprobs`` = the vocabulary, so the target's log-prob can be read; prefix caching
makes the prefixes cheap, and cached blocks are read back from the (fp8) pool.

    python benchmarks/bench_kv_fp8_accuracy.py
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
# The unquantized baseline, then fp8 with vLLM's default scales of 1.0 and with scales from the
# first prefill.
VARIANTS = {"auto": {}, "fp8": dict(kv_cache_dtype="fp8"),
            "fp8_calculated": dict(kv_cache_dtype="fp8", calculate_kv_scales=True)}


def teacher_forced(llm, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """For every position ``t >= 1`` of every sequence: (log-prob of ``seq[t]`` given
    ``seq[:t]``, the greedy token there), concatenated over the sequences."""
    from kvscope import SamplingParams

    vocab = llm.llm_engine.vocab_size
    prompts = [{"prompt_token_ids": s[:t]} for s in seqs for t in range(1, len(s))]
    targets = [s[t] for s in seqs for t in range(1, len(s))]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=vocab)
    outs = llm.generate(prompts, params, use_tqdm=False)
    logprobs = torch.tensor([o.outputs[0].logprobs[0][y] for o, y in zip(outs, targets)])
    greedy = torch.tensor([o.outputs[0].token_ids[0] for o in outs])
    return logprobs, greedy


def compare(ref: tuple[torch.Tensor, torch.Tensor], fp8: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
    """Log-prob difference (mean, p99) and greedy agreement of two :func:`teacher_forced` runs."""
    diff = (fp8[0] - ref[0]).abs()
    return dict(logprob_diff_mean=diff.mean().item(), logprob_diff_p99=diff.quantile(0.99).item(),
                greedy_agreement=(fp8[1] == ref[1]).float().mean().item(), positions=diff.numel())


def qwen3_shaped(layers: int, vocab: int, seqs: int, seq_len: int) -> dict[str, float]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvscope import LLM

    cfg = AutoConfig.from_pretrained(REPO / "benchmarks" / "configs" / "qwen3-0.6b")
    cfg.num_hidden_layers, cfg.vocab_size = layers, vocab
    cfg.layer_types = cfg.layer_types[:layers]
    cfg.bos_token_id = cfg.eos_token_id = 0  # inside the reduced vocabulary
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, vocab, (seqs, seq_len), generator=gen).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(tmp)
        runs = {}
        for name, kv in VARIANTS.items():
            llm = LLM(tmp, skip_tokenizer_init=True, device="cpu", dtype="float32",
                      kv_cache_memory_bytes=64 << 20, max_logprobs=-1, **kv)
            runs[name] = teacher_forced(llm, data)
            llm.shutdown()
    return {name: compare(runs["auto"], runs[name]) for name in list(VARIANTS)[1:]}


def heldout_documents(tokenizer, max_docs: int) -> list[list[int]]:
    """The demo model's test-split documents, tokenized as its training did (text + EOS)."""
    sys.path.insert(0, str(REPO / "tools"))
    from train_demo_model import build_documents, split_of

    docs = [d for d in build_documents() if split_of(d) == "test"][:max_docs]
    ids = tokenizer([d.text for d in docs], add_special_tokens=False)["input_ids"]
    return [x + [tokenizer.eos_token_id] for x in ids]


def demo_perplexity(max_docs: int) -> dict[str, float]:
    from kvscope import LLM

    figures: dict[str, float] = {}
    runs = {}
    for name, kv in VARIANTS.items():
        llm = LLM(str(REPO / "assets" / "kvscope-demo"), device="cpu", dtype="float32",
                  kv_cache_memory_bytes=64 << 20, max_logprobs=-1, **kv)
        docs = heldout_documents(llm.get_tokenizer(), max_docs)
        runs[name] = teacher_forced(llm, docs)
        figures[f"perplexity_{name}"] = torch.exp(-runs[name][0].mean()).item()
        llm.shutdown()
    figures["documents"], figures["tokens_scored"] = len(docs), runs["auto"][0].numel()
    for name in list(VARIANTS)[1:]:
        figures[name] = dict(perplexity_ratio=figures[f"perplexity_{name}"] / figures["perplexity_auto"],
                             **compare(runs["auto"], runs[name]))
    return figures


def _summary(f: dict[str, float]) -> str:
    return (f"|dlogprob| mean {f['logprob_diff_mean']:.2e}, p99 {f['logprob_diff_p99']:.2e}, "
            f"greedy agreement {f['greedy_agreement']:.2%} over {f['positions']} positions")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=96)
    ap.add_argument("--docs", type=int, default=60, help="held-out documents for the demo model")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t = time.perf_counter()
    shaped = qwen3_shaped(args.layers, args.vocab, args.seqs, args.seq_len)
    print(f"(a) Qwen3-0.6B head shapes, {args.layers} layers, vocab {args.vocab}, random weights, "
          f"{args.seqs} random sequences of {args.seq_len} tokens, against fp32 KV:")
    for name, f in shaped.items():
        print(f"    {name}: {_summary(f)}")
    demo = demo_perplexity(args.docs)
    print(f"(b) demo model, {demo['documents']} held-out documents, {demo['tokens_scored']} tokens scored, "
          f"perplexity with fp32 KV {demo['perplexity_auto']:.3f}:")
    for name in list(VARIANTS)[1:]:
        f = demo[name]
        print(f"    {name}: perplexity {demo[f'perplexity_{name}']:.3f} ({f['perplexity_ratio'] - 1:+.2%}), "
              f"{_summary(f)}")
    print(f"{time.perf_counter() - t:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(qwen3_shaped=shaped, demo=demo), indent=2))


if __name__ == "__main__":
    main()
