"""Token sampling for the rows that need a next token: greedy, temperature, top-k, top-p, seeds.

Random rows use the exponential race (``argmax(p / E)``, ``E ~ Exp(1)``), which samples from
``p`` exactly and lets each seeded row draw its noise from its own generator. A seeded row's
noise depends only on ``(seed, output index)``, so the same request gives the same tokens
whatever it was batched with, and after a preemption.

Sampling never waits for the device: :meth:`Sampler.sample` returns device tensors, and
:class:`DeviceSample` copies them to the host asynchronously; only ``to_output()`` waits, and
only for those copies (so a next step can already be running).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvscope.sampling_params import SamplingParams


@dataclass
class SampleOutput:
    tokens: list[int]
    logprobs: list[dict[int, float]] | None  # per row, when any row asked for logprobs


class DeviceSample:
    """One step's sampled tokens (and log-probs) on the device, on their way to the host."""

    def __init__(self, tokens: torch.Tensor, params: list[SamplingParams],
                 logprob_parts: tuple[torch.Tensor, ...] | None) -> None:
        self.tokens = tokens  # int64 [n] on the device: a next step may read it there
        self._params = params
        parts = (tokens, *(logprob_parts or ()))
        if tokens.is_cuda:
            self._host = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True).copy_(p, non_blocking=True)
                          for p in parts]
            self._ready: torch.cuda.Event | None = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = list(parts), None
        self._has_logprobs = logprob_parts is not None

    def to_output(self) -> SampleOutput:
        if self._ready is not None:
            self._ready.synchronize()
        tokens = self._host[0].tolist()
        if not self._has_logprobs:
            return SampleOutput(tokens, None)
        chosen, *top = (p.tolist() for p in self._host[1:])
        rows: list[dict[int, float]] = []
        for i, p in enumerate(self._params):
            row: dict[int, float] = {}
            if p.logprobs:
                row = dict(zip(top[1][i][: p.logprobs], top[0][i][: p.logprobs]))
            if p.logprobs is not None:
                row[tokens[i]] = chosen[i]
            rows.append(row)
        return SampleOutput(tokens, rows)


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
        self._temperatures: dict[float, torch.Tensor] = {}  # one device scalar per temperature seen

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A small per-row tensor on the device without a blocking copy (pinned, non-blocking)."""
        t = torch.tensor(values, dtype=dtype)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def _temperature(self, value: float) -> torch.Tensor:
        """``value`` as a ``[1, 1]`` float32 device tensor, made once: dividing by it is the same
        true division as by a per-row column (a Python scalar divisor may become a multiply by
        its reciprocal on CUDA)."""
        t = self._temperatures.get(value)
        if t is None:
            t = self._temperatures[value] = torch.full((1, 1), value, dtype=torch.float32, device=self.device)
        return t

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], output_index: list[int]
    ) -> DeviceSample:
        """Sample one token per row. When every row shares one ``SamplingParams`` object (what
        ``LLM.generate`` sends), its settings are read once and nothing per row goes to the
        device; the tokens are the same as when each row brings its own equal copy."""
        first = params[0]
        shared = all(p is first for p in params)
        settings = (first,) if shared else params  # what the per-step checks need to look at
        logits = logits.float()
        vocab = logits.shape[-1]
        asked = [p.logprobs for p in settings if p.logprobs is not None]
        want_lp = max(asked) if asked else -1
        raw_logprobs = logits.log_softmax(dim=-1) if want_lp >= 0 else None

        greedy = [p.temperature == 0 for p in settings]
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            if shared:
                scaled = logits / self._temperature(first.temperature)
            else:
                temps = self._tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], torch.float32)
                scaled = logits / temps.unsqueeze(1)
            if any(p.top_k > 0 or p.top_p < 1.0 for p in settings):
                top_k = self._tensor([p.top_k for p in params], torch.int64)
                top_p = self._tensor([float(p.top_p) for p in params], torch.float32)
                scaled = apply_top_k_top_p(scaled, top_k, top_p)
            probs = scaled.softmax(dim=-1)
            noise = torch.empty_like(probs).exponential_(generator=self.generator)
            if any(p.seed is not None for p in settings):
                for i, p in enumerate(params):
                    if p.seed is not None and p.temperature != 0:
                        noise[i] = _seeded_noise(p.seed, output_index[i], vocab, logits.device)
            tokens = (probs / noise).argmax(dim=-1)
            if any(greedy):  # (a mixed batch: rows of their own)
                mask = self._tensor(greedy, torch.bool)
                tokens = torch.where(mask, logits.argmax(dim=-1), tokens)
        if raw_logprobs is None:
            return DeviceSample(tokens, params, None)
        chosen = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        top_v, top_i = raw_logprobs.topk(max(want_lp, 1), dim=-1)
        return DeviceSample(tokens, params, (chosen, top_v, top_i))
