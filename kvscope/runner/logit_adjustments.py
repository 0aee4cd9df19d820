"""What changes a row's logits before any draw, greedy rows' too: vLLM's ``allowed_token_ids``,
``logit_bias`` and presence, frequency and repetition penalties, applied in vLLM's order.

The settings of a batch's adjusted rows become device tensors once per batch
(:class:`Adjustments`); the penalties' token counts are built at every step from each row's
tokens (:data:`HistoryOf`), the newest of which may still be on the device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from kvscope.sampling_params import SamplingParams

# A row's tokens for its penalties: its prompt, its outputs on the host, and an output still
# on the device (a one-element tensor: the step in flight sampled it) or None.
HistoryOf = Callable[[int], tuple[Sequence[int], Sequence[int], "torch.Tensor | None"]]
Upload = Callable[[list, torch.dtype], torch.Tensor]  # a host list as a device tensor


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
    penalized: list[int]  # those of them with penalties, by position in ``which``
    allowed: torch.Tensor | None  # bool [m, vocab]: the tokens each may draw (None: no row limits them)
    bias: torch.Tensor | None  # float32 [m, vocab] (None: no row has a logit bias)
    penalties: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # repetition, frequency, presence [m]

    @classmethod
    def of(cls, params: Sequence[SamplingParams], vocab: int, device: torch.device, upload: Upload) -> "Adjustments":
        which = [i for i, p in enumerate(params) if p.adjusts_logits]
        mine = [params[i] for i in which]
        allowed = bias = penalties = None
        if any(p.allowed_token_ids for p in mine):
            allowed = torch.zeros(len(mine), vocab, dtype=torch.bool, device=device)
            rows, tokens = _pairs([p.allowed_token_ids or range(vocab) for p in mine])
            allowed[upload(rows, torch.int64), upload(tokens, torch.int64)] = True
        if any(p.logit_bias for p in mine):
            bias = torch.zeros(len(mine), vocab, dtype=torch.float32, device=device)
            rows, tokens = _pairs([list(p.logit_bias or ()) for p in mine])
            values = [float(v) for p in mine for v in (p.logit_bias or {}).values()]
            bias[upload(rows, torch.int64), upload(tokens, torch.int64)] = upload(values, torch.float32)
        if any(p.penalizes for p in mine):
            penalties = tuple(upload([float(getattr(p, name)) for p in mine], torch.float32)
                              for name in ("repetition_penalty", "frequency_penalty", "presence_penalty"))
        penalized = [k for k, p in enumerate(mine) if p.penalizes]
        return cls(which, upload(which, torch.int64), penalized, allowed, bias, penalties)

    def apply(self, logits: torch.Tensor, history_of: HistoryOf | None, upload: Upload) -> torch.Tensor:
        """float32 ``logits`` with these rows adjusted (a new tensor): tokens outside their
        allowed set at -inf, then the bias added, then the penalties (vLLM's order). Without
        ``history_of``, a row has no tokens yet."""
        rows = logits[self.index]
        if self.allowed is not None:
            rows = rows.masked_fill(~self.allowed, float("-inf"))
        if self.bias is not None:
            rows = rows + self.bias
        if self.penalties is not None:
            rows = apply_penalties(rows, *self._seen(rows.shape, history_of, upload), *self.penalties)
        return logits.index_put((self.index,), rows)

    def _seen(self, shape: torch.Size, history_of: HistoryOf | None, upload: Upload
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's prompt tokens (a mask) and output tokens (counts), the one still on the
        device included."""
        device = self.index.device
        prompt_mask = torch.zeros(shape, dtype=torch.bool, device=device)
        counts = torch.zeros(shape, dtype=torch.float32, device=device)
        if history_of is None:
            return prompt_mask, counts
        prompts: list[Sequence[int]] = [()] * len(self.which)
        outputs: list[Sequence[int]] = [()] * len(self.which)
        pending_rows, pending = [], []
        for k in self.penalized:
            prompts[k], outputs[k], in_flight = history_of(self.which[k])
            if in_flight is not None:
                pending_rows.append(k)
                pending.append(in_flight.reshape(1))
        rows, tokens = _pairs(prompts)
        prompt_mask[upload(rows, torch.int64), upload(tokens, torch.int64)] = True
        one = torch.ones((), device=device)
        rows, tokens = _pairs(outputs)
        counts.index_put_((upload(rows, torch.int64), upload(tokens, torch.int64)), one, accumulate=True)
        if pending:
            counts.index_put_((upload(pending_rows, torch.int64), torch.cat(pending)), one, accumulate=True)
        return prompt_mask, counts


def _pairs(per_row: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """(row, token) of every token of every row, as two flat lists."""
    rows: list[int] = []
    tokens: list[int] = []
    for k, row in enumerate(per_row):
        rows += [k] * len(row)
        tokens += list(row)
    return rows, tokens
