"""Streaming text cost: full decode of all output tokens every step vs incremental decoding.

One request streamed token by token (``--tokens`` random ids of the bundled tokenizer's vocabulary);
both ways decode after every token, as ``LLM.step()`` reports text after every step.

    python benchmarks/bench_detokenizer.py [--tokens 500]
"""
from __future__ import annotations

import argparse
import random
import time

from transformers import AutoTokenizer

from kvscope.engine.detokenizer import IncrementalDetokenizer
from kvscope.model_source import BUNDLED_MODEL


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=500)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(BUNDLED_MODEL, local_files_only=True)
    rng = random.Random(0)
    ids = [rng.randrange(10, tok.vocab_size) for _ in range(args.tokens)]
    t = time.perf_counter()
    for k in range(1, len(ids) + 1):
        tok.decode(ids[:k], skip_special_tokens=True)
    full = time.perf_counter() - t
    detok = IncrementalDetokenizer(tok)
    t = time.perf_counter()
    for k in range(1, len(ids) + 1):
        detok.update(ids[:k])
    incremental = time.perf_counter() - t
    assert detok.text == tok.decode(ids, skip_special_tokens=True) or tok.decode(ids).endswith("\ufffd")
    print(f"{args.tokens}-token stream: full decode every step {full * 1e3:.1f} ms, "
          f"incremental {incremental * 1e3:.1f} ms -> {full / incremental:.1f}x")


if __name__ == "__main__":
    main()
