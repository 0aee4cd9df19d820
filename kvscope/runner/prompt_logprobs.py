"""Prompt log-probs (vLLM's ``SamplingParams.prompt_logprobs``): the log-probability of each
prompt token after the first given the tokens before it, and the top-k at its position.

A row owed them has ``num_prompt_logits`` leading positions whose logits predict the prompt
token after each. The runner gathers those positions' hidden states, every tensor-parallel rank
runs the LM head on them in slices of at most the rows a step samples (the head is a
collective, and the slices keep a long prompt's logits within the memory start-up measured for
sampling), and rank 0 turns each slice's logits into log-probs on the device; they reach the
host when the step's result is read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch

from kvscope.engine.scheduler_output import ScheduledRequest
from kvscope.outputs import Logprob
from kvscope.runner.sampler import chosen_and_top, logprob_row
from kvscope.runner.token_counts import Upload


def prompt_positions(cu_seqlens_q: np.ndarray, rows: Sequence[ScheduledRequest], which: np.ndarray) -> np.ndarray:
    """The packed positions (rows of the step's hidden states) whose logits give prompt
    log-probs: each of the rows ``which``'s first ``num_prompt_logits``, in row order."""
    firsts = cu_seqlens_q[which].astype(np.int64)
    counts = np.array([rows[i].num_prompt_logits for i in which.tolist()], dtype=np.int64)
    return np.repeat(firsts - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))


@dataclass
class PromptLogprobs:
    """One step's prompt log-probs on the device, by row, until :meth:`to_host` reads them."""

    seq_ids: list[int]
    counts: list[int]  # positions of each row
    ks: list[int]  # each row's top-k
    chosen: torch.Tensor  # float32 [M]: each position's next prompt token's log-prob
    top_values: torch.Tensor  # float32 [M, K]
    top_ids: torch.Tensor  # int64 [M, K]
    ranks: torch.Tensor  # int64 [M]: each next prompt token's rank
    targets: list[int]  # the next prompt token of each position

    @classmethod
    def of(cls, logits: Iterable[torch.Tensor | None], rows: Sequence[ScheduledRequest], which: np.ndarray,
           upload: Upload) -> "PromptLogprobs | None":
        """From the logits of :func:`prompt_positions`' positions, slice after slice (each is
        reduced before the next is computed, so a long prompt never holds all its logits at
        once); None on a worker rank, which only takes every slice (each is a collective).
        The targets are each row's own next tokens, the last one's the prompt token after the
        row (from its history). ``upload`` takes the targets to the device without waiting for
        the work it has queued (the step before, under async scheduling)."""
        picked = [rows[i] for i in which.tolist()]
        if picked[0].history is None:  # a worker rank: it takes part in the slices' collectives only
            for _ in logits:
                pass
            return None
        targets: list[int] = []
        for r in picked:
            targets += r.history.token_ids[r.start + 1:r.start + 1 + r.num_prompt_logits]
        ks = [r.history.prompt_logprobs for r in picked]
        parts: list[tuple[torch.Tensor, ...]] = []
        at = 0
        for chunk in logits:
            index = upload(targets[at:at + chunk.shape[0]], torch.int64)
            parts.append(chosen_and_top(chunk.float().log_softmax(dim=-1), index, max(ks)))
            at += chunk.shape[0]
        chosen, values, ids, ranks = (torch.cat(p) for p in zip(*parts))
        return cls([r.seq_id for r in picked], [r.num_prompt_logits for r in picked], ks, chosen, values, ids,
                   ranks, targets)

    def to_host(self) -> dict[int, list[dict[int, Logprob]]]:
        """seq id -> one dict per position, the next token's log-prob and the top-k, as the
        generated tokens' ``logprobs`` are."""
        chosen, values, ids, ranks = (t.tolist() for t in (self.chosen, self.top_values, self.top_ids, self.ranks))
        out: dict[int, list[dict[int, Logprob]]] = {}
        at = 0
        for seq_id, count, k in zip(self.seq_ids, self.counts, self.ks):
            out[seq_id] = [logprob_row(self.targets[p], chosen[p], ranks[p], values[p], ids[p], k)
                           for p in range(at, at + count)]
            at += count
        return out
