"""Prompt log-probs (vLLM's ``SamplingParams.prompt_logprobs``): the log-probability of each
prompt token after the first given the tokens before it, and the top-k at its position.

A row owed them has ``num_prompt_logits`` leading positions whose logits predict the prompt
token after each. The runner gathers those positions' hidden states, every tensor-parallel rank
runs the LM head on them (it is a collective), and rank 0 turns its logits into log-probs on
the device; they reach the host when the step's result is read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kvscope.engine.scheduler_output import ScheduledRequest


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
    targets: list[int]  # the next prompt token of each position

    @classmethod
    def of(cls, logits: torch.Tensor, rows: Sequence[ScheduledRequest], which: np.ndarray) -> "PromptLogprobs":
        """From the logits of :func:`prompt_positions`' positions: the targets are each row's
        own next tokens, the last one's the prompt token after the row (from its history)."""
        picked = [rows[i] for i in which.tolist()]
        targets: list[int] = []
        for r in picked:
            targets += r.history.token_ids[r.start + 1:r.start + 1 + r.num_prompt_logits]
        ks = [r.history.prompt_logprobs for r in picked]
        logprobs = logits.float().log_softmax(dim=-1)
        index = torch.tensor(targets, dtype=torch.int64).to(logits.device, non_blocking=True)
        top = logprobs.topk(max(max(ks), 1), dim=-1)
        return cls([r.seq_id for r in picked], [r.num_prompt_logits for r in picked], ks,
                   logprobs.gather(1, index.unsqueeze(1)).squeeze(1), top.values, top.indices, targets)

    def to_host(self) -> dict[int, list[dict[int, float]]]:
        """seq id -> one dict per position, ``{next token: log-prob}`` plus the top-k, as the
        generated tokens' ``logprobs`` are."""
        chosen, values, ids = self.chosen.tolist(), self.top_values.tolist(), self.top_ids.tolist()
        out: dict[int, list[dict[int, float]]] = {}
        at = 0
        for seq_id, count, k in zip(self.seq_ids, self.counts, self.ks):
            dicts = []
            for p in range(at, at + count):
                d = dict(zip(ids[p][:k], values[p][:k]))
                d[self.targets[p]] = chosen[p]
                dicts.append(d)
            out[seq_id] = dicts
            at += count
        return out
