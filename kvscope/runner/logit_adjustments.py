"""What changes a row's logits before any draw, greedy rows' too: vLLM's ``allowed_token_ids``,
``bad_words``, ``logit_bias`` and presence, frequency and repetition penalties, applied in
vLLM's order.

The settings of a batch's adjusted rows become device tensors once per batch
(:class:`Adjustments`); the penalties read each row's prompt tokens and output counts from
:class:`~kvscope.runner.token_counts.TokenCounts`, which keeps them on the device between steps,
and the bad words each row's newest outputs (:mod:`~kvscope.runner.bad_words`).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Sequence

import torch

from kvscope.runner.bad_words import BadWords
from kvscope.runner.token_counts import HistoryOf, TokenCounts, Upload
from kvscope.sampling_params import SamplingParams


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """vLLM's penalties on float32 ``logits`` (a new tensor): ``repetition[i]`` divides the
    positive logits of row ``i``'s tokens in its prompt (``prompt_mask``) or output
    (``output_counts`` > 0) and multiplies the negative ones; then ``frequency[i]`` times each
    token's output count and ``presence[i]`` for each token generated at all are subtracted."""
    generated = output_counts > 0
    factor = torch.where(prompt_mask | generated, repetition.unsqueeze(1), torch.ones_like(logits))
    logits = torch.where(logits > 0, logits / factor, logits * factor)
    return logits - frequency.unsqueeze(1) * output_counts - presence.unsqueeze(1) * generated


@dataclass
class Adjustments:
    """The adjusted rows of one batch and their settings on the device."""

    which: list[int]  # the rows, in batch order
    index: torch.Tensor  # int64 [m]: the same rows
    looked_up: list[int]  # the rows whose tokens are read (penalties, bad words), in batch order
    penalized: list[int] | None  # the rows with penalties: their positions in ``looked_up`` (None: all)
    penalized_at: torch.Tensor  # int64 [p]: their positions in ``which``
    worded: list[int] | None  # the rows with bad words: their positions in ``looked_up`` (None: all)
    worded_at: torch.Tensor  # int64 [w]: their positions in ``which``
    words: BadWords | None  # those rows' bad words (None: no row has any)
    allowed: torch.Tensor | None  # bool [m, vocab]: the tokens each may draw (None: no row limits them)
    bias: torch.Tensor | None  # float32 [m, vocab] (None: no row has a logit bias)
    penalties: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # repetition, frequency, presence [p]
    every_row: bool  # ``which`` is every row of the batch, in order

    @classmethod
    def of(cls, params: Sequence[SamplingParams], vocab: int, device: torch.device, upload: Upload) -> "Adjustments":
        which = [i for i, p in enumerate(params) if p.adjusts_logits]
        mine = [params[i] for i in which]
        allowed = bias = penalties = None
        limited = [k for k, p in enumerate(mine) if p.allowed_token_ids]
        if limited:  # (every token allowed, then the limited rows cleared and given theirs)
            allowed = torch.ones(len(mine), vocab, dtype=torch.bool, device=device)
            allowed.index_put_((upload(limited, torch.int64),), allowed.new_zeros(()))
            rows, tokens = _pairs([p.allowed_token_ids or () for p in mine])
            allowed.index_put_((upload(rows, torch.int64), upload(tokens, torch.int64)), allowed.new_ones(()))
        if any(p.logit_bias for p in mine):
            bias = torch.zeros(len(mine), vocab, dtype=torch.float32, device=device)
            rows, tokens = _pairs([list(p.logit_bias or ()) for p in mine])
            values = [float(v) for p in mine for v in (p.logit_bias or {}).values()]
            bias[upload(rows, torch.int64), upload(tokens, torch.int64)] = upload(values, torch.float32)
        at = [k for k, p in enumerate(mine) if p.penalizes]
        if at:
            penalties = tuple(upload([float(getattr(mine[k], name)) for k in at], torch.float32)
                              for name in ("repetition_penalty", "frequency_penalty", "presence_penalty"))
        worded = [k for k, p in enumerate(mine) if p.bad_words_token_ids]
        looked_up = sorted({*at, *worded})  # (a row with both has its tokens looked up once)
        return cls(which, upload(which, torch.int64), [which[k] for k in looked_up], _positions(at, looked_up),
                   upload(at, torch.int64), _positions(worded, looked_up), upload(worded, torch.int64),
                   BadWords([mine[k].bad_words_token_ids for k in worded], upload) if worded else None,
                   allowed, bias, penalties, len(which) == len(params))

    def apply(self, logits: torch.Tensor, history_of: HistoryOf | None, counts: TokenCounts,
              upload: Upload, kernels: ModuleType | None = None) -> torch.Tensor:
        """float32 ``logits`` with these rows adjusted (a new tensor), in vLLM's order: tokens
        outside their allowed set at -inf, then the bad words' banned tokens, then the bias
        added, then the penalties on the rows' tokens (``history_of``, through ``counts``).
        ``history_of`` is asked once, for the rows with bad words or penalties or both: a look-up
        costs the host per row. Without it, a row has no tokens yet: its bad words of one token
        are banned, and its penalties change nothing. ``kernels``
        (:mod:`kvscope.kernels.triton_penalties`) penalizes the rows in one pass, reading the
        counts where they are kept; without it, torch does."""
        rows = logits[self.index]
        if self.allowed is not None:
            rows = rows.masked_fill(~self.allowed, float("-inf"))
        batch = history_of(self.looked_up) if history_of is not None and self.looked_up else None
        if self.words is not None:
            at = self.worded_at
            rows = rows.index_put((at,), self.words.ban(rows[at], batch, upload, self.worded))
        if self.bias is not None:
            rows = rows + self.bias
        if self.penalties is not None and batch is not None:
            at = self.penalized_at
            if kernels is not None:  # (in place: ``rows`` is this call's own copy)
                seen = counts.locate(batch, rows.shape[1], self.penalized)
                kernels.penalize_(rows, at, seen.prompt_mask, seen.output_counts, seen.pool_rows, seen.in_flight,
                                  *self.penalties)
            else:
                seen = counts.read(batch, rows.shape[1], self.penalized)
                rows = rows.index_put((at,), apply_penalties(rows[at], *seen, *self.penalties))
        return rows if self.every_row else logits.index_put((self.index,), rows)


def _positions(some: list[int], every: list[int]) -> list[int] | None:
    """Where the entries of ``some`` are in ``every`` (both ascending); None when they are all of it."""
    if len(some) == len(every):
        return None
    place = {k: i for i, k in enumerate(every)}
    return [place[k] for k in some]


def _pairs(per_row: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """(row, token) of every token of every row, as two flat lists."""
    rows: list[int] = []
    tokens: list[int] = []
    for k, row in enumerate(per_row):
        rows += [k] * len(row)
        tokens += list(row)
    return rows, tokens
