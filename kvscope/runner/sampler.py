"""Token sampling for the rows that need a next token: greedy, temperature, top-k, top-p, seeds.

Random rows use the exponential race (``argmax(p / E)``, ``E ~ Exp(1)``), which samples from
``p`` exactly and lets each seeded row draw its noise from its own generator. A seeded row's
noise depends only on ``(seed, output index)``, so the same request gives the same tokens
whatever it was batched with, and after a preemption.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvscope.sampling_params import SamplingParams


@dataclass
class SampleOutput:
    tokens: list[int]
    logprobs: list[dict[int, float]] | None  # per row, when any row asked for logprobs


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k set and top-p nucleus with -inf.

    ``top_k[i] <= 0`` disables top-k for row ``i``; ``top_p[i] == 1`` disables top-p. The
    nucleus is the smallest set of highest-probability tokens whose mass reaches ``top_p``.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    drop = ranks >= k.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def _seeded_noise(seed: int, index: int, vocab: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + index) & ((1 << 63) - 1))
    return torch.empty(vocab, device=device).exponential_(generator=gen)


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], output_index: list[int]
    ) -> SampleOutput:
        logits = logits.float()
        n, vocab = logits.shape
        asked = [p.logprobs for p in params if p.logprobs is not None]
        want_lp = max(asked) if asked else -1
        raw_logprobs = logits.log_softmax(dim=-1) if want_lp >= 0 else None

        greedy = [p.temperature == 0 for p in params]
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params],
                                 device=logits.device)
            scaled = logits / temps.unsqueeze(1)
            if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
                top_k = torch.tensor([p.top_k for p in params], device=logits.device)
                top_p = torch.tensor([float(p.top_p) for p in params], device=logits.device)
                scaled = apply_top_k_top_p(scaled, top_k, top_p)
            probs = scaled.softmax(dim=-1)
            noise = torch.empty_like(probs).exponential_(generator=self.generator)
            for i, p in enumerate(params):
                if p.seed is not None and not greedy[i]:
                    noise[i] = _seeded_noise(p.seed, output_index[i], vocab, logits.device)
            sampled = (probs / noise).argmax(dim=-1)
            if any(greedy):
                mask = torch.tensor(greedy, device=logits.device)
                sampled = torch.where(mask, logits.argmax(dim=-1), sampled)
            tokens = sampled
        token_list = tokens.tolist()
        if raw_logprobs is None:
            return SampleOutput(token_list, None)
        return SampleOutput(token_list, self._logprobs(raw_logprobs, tokens, params, want_lp))

    @staticmethod
    def _logprobs(
        lp: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams], k_max: int
    ) -> list[dict[int, float]]:
        chosen = lp.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        top_v, top_i = (lp.topk(k_max, dim=-1) if k_max > 0 else (None, None))
        rows: list[dict[int, float]] = []
        for i, p in enumerate(params):
            row: dict[int, float] = {}
            if p.logprobs:
                row = dict(zip(top_i[i, : p.logprobs].tolist(), top_v[i, : p.logprobs].tolist()))
            if p.logprobs is not None:
                row[int(tokens[i])] = chosen[i]
            rows.append(row)
        return rows
