"""Host work of a penalized step's logits adjustments: ``Adjustments.apply`` on a steady async
decode batch whose rows all have a repetition penalty and some also bad words.

Each step every row's previous output reaches the host and its next one is in flight, as in
the runner's async decode; the rows' histories are read through a ``history_of`` made the way
the runner makes it (``ModelRunner._sample``). The penalty kernel's launch is left out (a no-op
stands in for it, as the launch is device work on a GPU), and the vocabulary is small, so what
is timed is the host's share: the history look-ups, the token counts' update and the bad words'
comparisons, and their few small tensor operations.

    python benchmarks/bench_penalized_host.py [--rows 32 256] [--steps 200] [--rounds 7]
    python benchmarks/bench_penalized_host.py --compare OTHER_TREE   # A/B, alternating

Each round is a fresh process timing ``--steps`` steps after a warm-up; it prints the median
CPU time (``time.process_time``) per step. ``--compare`` runs the rounds alternately from
OTHER_TREE (a checkout of another commit) and from this repository, and prints each tree's
median over its rounds.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


class _Tokenizer:
    """Each space-separated piece of a word is one token: ``"t12 t7"`` is ``[12, 7]``."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [int(piece[1:]) for piece in text.split()]


class _NoLaunch:
    """Stands in for :mod:`kvscope.kernels.triton_penalties`: the kernel is device work."""

    @staticmethod
    def penalize_(*args) -> None:
        pass


class _Row:
    def __init__(self, seq_id: int, history) -> None:
        self.seq_id = seq_id
        self.history = history


def time_steps(rows: int, vocab: int, steps: int, prompt: int, words_every: int, seed: int) -> float:
    """Median CPU seconds of one step's ``Adjustments.apply``."""
    from kvscope.engine.scheduler_output import TokenHistory
    from kvscope.runner.logit_adjustments import Adjustments
    from kvscope.runner.token_counts import Histories, TokenCounts, histories_of
    from kvscope.sampling_params import SamplingParams

    rng = random.Random(seed)
    device = torch.device("cpu")

    def upload(values, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(values, dtype=dtype)

    plain = SamplingParams(repetition_penalty=1.05, max_tokens=1 << 20)
    worded = SamplingParams(repetition_penalty=1.05, max_tokens=1 << 20,
                            bad_words=[f"t{rng.randrange(vocab)}", f"t{rng.randrange(vocab)} t{rng.randrange(vocab)}",
                                       " ".join(f"t{rng.randrange(vocab)}" for _ in range(3))])
    worded.update_from_tokenizer(_Tokenizer())
    params = [worded if words_every and i % words_every == 0 else plain for i in range(rows)]
    source = [_Row(i, TokenHistory([rng.randrange(vocab) for _ in range(prompt)], prompt)) for i in range(rows)]
    index = [0] * rows  # each row's output index: one past the host's outputs while one is in flight
    last_sample = torch.zeros(rows, dtype=torch.int64)  # the tokens the last step drew, by row
    sample_row = torch.arange(rows).numpy()

    def in_flight_tokens(flying: list[int]) -> torch.Tensor:
        return last_sample[upload(sample_row[flying], torch.int64)]

    def history_of(which: list[int]) -> Histories:
        return histories_of(source, which, index, in_flight_tokens)

    counts = TokenCounts(device, upload)
    adjustments = Adjustments.of(params, vocab, device, upload)
    logits = torch.randn(rows, vocab)
    times = []
    warm = 20
    for step in range(warm + steps):
        drawn = [rng.randrange(vocab) for _ in range(rows)]
        for i, r in enumerate(source):
            if step:
                r.history.token_ids.append(int(last_sample[i]))  # the last step's output reaches the host
            index[i] = len(r.history.token_ids) - prompt + 1
        last_sample.copy_(torch.tensor(drawn))
        if step == warm:
            gc.collect()
        start = time.process_time()
        adjustments.apply(logits, history_of, counts, upload, _NoLaunch)
        if step >= warm:
            times.append(time.process_time() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--words-every", type=int, default=2, help="every this many rows also have bad words (0: none)")
    ap.add_argument("--compare", default=None, metavar="TREE", help="alternate rounds with this checkout")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # one round, as JSON
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.one:
        print(json.dumps({n: time_steps(n, args.vocab, args.steps, args.prompt, args.words_every, seed=n)
                          for n in args.rows}))
        return
    here = str(Path(__file__).resolve().parents[1])
    trees = {"other": str(Path(args.compare).resolve()), "this": here} if args.compare else {"this": here}
    got: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    forwarded = ["--rows", *map(str, args.rows), "--vocab", str(args.vocab), "--prompt", str(args.prompt),
                 "--steps", str(args.steps), "--words-every", str(args.words_every), "--one"]
    for _ in range(args.rounds):
        for name, tree in trees.items():
            env = dict(os.environ, PYTHONPATH=tree)
            out = subprocess.run([sys.executable, __file__, *forwarded], env=env, cwd=tree,
                                 capture_output=True, text=True, check=True).stdout
            got[name].append(json.loads(out))
            print(name, {n: f"{1e6 * t:.1f} us" for n, t in got[name][-1].items()}, flush=True)
    for name, tree in trees.items():
        med = {n: 1e6 * statistics.median(r[str(n)] for r in got[name]) for n in args.rows}
        spread = {n: (1e6 * min(r[str(n)] for r in got[name]), 1e6 * max(r[str(n)] for r in got[name]))
                  for n in args.rows}
        print(f"{name} ({tree}): " + ", ".join(f"{n} rows {med[n]:.1f} us [{spread[n][0]:.1f}-{spread[n][1]:.1f}]"
                                               for n in args.rows))


if __name__ == "__main__":
    main()
