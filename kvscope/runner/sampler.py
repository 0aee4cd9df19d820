"""Token sampling for the rows that need a next token: adjusted logits, greedy, temperature,
min-p, top-k, top-p, seeds.

An adjusted row's logits are changed first (vLLM's allowed tokens, logit bias, and presence,
frequency and repetition penalties from the tokens it has so far: :mod:`logit_adjustments`);
they then go to whichever path draws. Random rows sample from ``softmax(logits / T)`` exactly,
each seeded row from its own random stream. A seeded row's randomness depends only on ``(seed,
output index)``, so the same request gives the same tokens whatever it was batched with, and
after a preemption. On CPU that is the exponential race in log space (``argmax(logits / T -
log E)``, ``E = -log U ~ Exp(1)`` from torch's generator's uniforms). On CUDA :mod:`kvscope.kernels.triton_sampling` samples every
batch in one read of the logits, inverting each row's CDF at one counter-based uniform (rows
with min-p, top-k or top-p on logits masked outside their set; log-probs come from a
``log_softmax`` beside it). A temperature under ``GREEDY_BELOW`` is greedy.

A decode CUDA graph bucket can have a second graph, the LM head and the draw
(:meth:`Sampler.draw_captured`), so a steady decode step launches graphs and no sampling
kernel: the rows' scales and the step number are read from device memory, and the tokens equal
those of an eager draw.

Sampling never waits for the device: :meth:`Sampler.sample` returns device tensors, and
:class:`DeviceSample` copies them to the host asynchronously; only ``to_output()`` waits, and
only for those copies (so a next step can already be running).
"""
from __future__ import annotations

import functools
import operator
import weakref
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from kvscope.kernels.fused import penalty_kernels, sampling_kernels
from kvscope.outputs import Logprob
from kvscope.runner.logit_adjustments import Adjustments
from kvscope.runner.token_counts import HistoryOf, TokenCounts
from kvscope.sampling_params import ADJUSTED, MASKED, SEEDED, SamplingParams


@dataclass
class SampleOutput:
    tokens: list[int]
    logprobs: list[dict[int, Logprob]] | None  # per row, when any row asked for logprobs


class HostReadback:
    """Pinned host memory that sampled tokens are copied back into, and the events that say
    the copies are done, reused from step to step instead of allocated per step.

    A slot is handed out again only once the sample holding it was read (``to_output``) or
    dropped, so a copy never lands on tokens not read yet: under async scheduling step n+1's
    copy is queued before step n's tokens are read, and the two alternate between two slots.
    """

    def __init__(self, pin: bool) -> None:
        self._pin = pin
        self._slots: list[_ReadbackSlot] = []

    def take(self, owner: "DeviceSample") -> "_ReadbackSlot":
        """A slot no unread sample holds, held for ``owner`` until it releases it or is dropped."""
        slot = next((s for s in self._slots if s.free()), None)
        if slot is None:
            slot = _ReadbackSlot(self._pin)
            self._slots.append(slot)
        slot.owner = weakref.ref(owner)
        return slot


class _ReadbackSlot:
    def __init__(self, pin: bool) -> None:
        self._pin = pin
        self._tokens = torch.empty(0, dtype=torch.int64)
        self._views: dict[int, torch.Tensor] = {}
        self._event = torch.cuda.Event() if pin else None
        self.owner: weakref.ref | None = None

    def free(self) -> bool:
        return self.owner is None or self.owner() is None

    def release(self) -> None:
        self.owner = None

    def copy(self, parts: tuple[torch.Tensor, ...]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """Queue ``parts`` (int64 tokens first, then any log-prob tensors) for the host; returns
        the host tensors and the event to wait on before reading them."""
        tokens, *rest = parts
        n = tokens.numel()
        host = self._views.get(n)
        if host is None:
            if self._tokens.numel() < n:
                self._tokens = torch.empty(2 * n, dtype=torch.int64, pin_memory=self._pin)
                self._views.clear()
            host = self._views[n] = self._tokens[:n]
        host.copy_(tokens, non_blocking=self._pin)
        out = [host] + [torch.empty(p.shape, dtype=p.dtype, pin_memory=self._pin).copy_(p, non_blocking=self._pin)
                        for p in rest]
        if self._event is not None:  # (on the tokens' device's stream, named: see ModelRunner._upload)
            self._event.record(torch.cuda.current_stream(tokens.device))
        return out, self._event


class DeviceSample:
    """One step's sampled tokens (and log-probs) on the device, on their way to the host
    (through ``readback``'s memory; without one, ``tokens`` are read where they are)."""

    def __init__(self, tokens: torch.Tensor, params: list[SamplingParams],
                 logprob_parts: tuple[torch.Tensor, ...] | None, readback: HostReadback | None = None) -> None:
        self.tokens = tokens  # int64 [n] on the device: a next step may read it there
        self._params = params
        parts = (tokens, *(logprob_parts or ()))
        self._slot = readback.take(self) if readback is not None else None
        if self._slot is not None:
            self._host, self._ready = self._slot.copy(parts)
        else:
            self._host, self._ready = list(parts), None
        self._has_logprobs = logprob_parts is not None
        self._output: SampleOutput | None = None

    def to_output(self) -> SampleOutput:
        """The tokens (and log-probs) on the host; the first call waits for their copies."""
        if self._output is None:
            self._output = self._read()
        return self._output

    def _read(self) -> SampleOutput:
        if self._ready is not None:
            self._ready.synchronize()
        tokens = self._host[0].tolist()
        logprobs = [p.tolist() for p in self._host[1:]] if self._has_logprobs else None
        if self._slot is not None:  # read: the slot may take the next step's copies
            self._slot.release()
        if logprobs is None:
            return SampleOutput(tokens, None)
        chosen, values, ids, ranks = logprobs
        rows = [logprob_row(tokens[i], chosen[i], ranks[i], values[i], ids[i], p.logprobs)
                if p.logprobs is not None else {} for i, p in enumerate(self._params)]
        return SampleOutput(tokens, rows)


def logprob_row(token: int, logprob: float, rank: int, top_values: list[float], top_ids: list[int],
                k: int) -> dict[int, Logprob]:
    """One position's log-probs as vLLM gives them: ``token``'s own first (its rank counted over
    the vocabulary), then the top ``k`` ranked 1..k by place, which is the rank a top token
    keeps, ``token`` too."""
    row = {token: Logprob(logprob, rank)}
    row.update((t, Logprob(v, r)) for r, (t, v) in enumerate(zip(top_ids[:k], top_values[:k]), start=1))
    return row


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


def chosen_and_top(logprobs: torch.Tensor, chosen: torch.Tensor, k: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of ``logprobs``: the ``chosen`` token's log-prob, the top ``max(k, 1)`` values and
    ids, and the chosen token's rank: as vLLM counts it, the tokens at least as likely, itself
    included (tokens that tie share the worse rank)."""
    value = logprobs.gather(1, chosen.unsqueeze(1))
    top = logprobs.topk(max(k, 1), dim=-1)
    return value.squeeze(1), top.values, top.indices, (logprobs >= value).sum(dim=-1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask with -inf the logits whose probability is under ``min_p[i]`` times their row's
    largest (vLLM's and transformers' min-p); ``min_p[i] == 0`` keeps every token of row ``i``.
    ``logits`` are already divided by the temperature, as min-p reads the distribution drawn from."""
    probs = logits.softmax(dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < floor, float("-inf"))


def exponential_(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Fill ``x`` in place with Exp(1) draws, as ``-log U`` of ``generator``'s uniforms on
    [0, 1): the law of ``Tensor.exponential_``, several times faster on CPU at vocabulary sizes
    (benchmarks/RESULTS.md). A draw is never 0, so ``log E`` is never ``-inf`` and no token wins
    the race by a zero draw; ``U = 0`` gives ``E = inf``, which only loses it."""
    return x.uniform_(generator=generator).log_().neg_()


def _seeded_noise(seed: int, index: int, vocab: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + index) & ((1 << 63) - 1))
    return exponential_(torch.empty(vocab, device=device), gen)


GREEDY_BELOW = 1e-5  # a temperature under this samples greedily (vLLM's _SAMPLING_EPS): 1 / T would overflow


class Sampler:
    """Samples one token per row: on CUDA by the fused kernels of
    :mod:`kvscope.kernels.triton_sampling`, on CPU by torch with torch's generator."""

    def __init__(self, seed: int, device: torch.device, use_triton: bool | None = None) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        # None: the Triton kernels where they run (CUDA); True also runs them on CPU tensors
        # under Triton's interpreter (the tests).
        self.kernels = sampling_kernels(device, use_triton)
        self.penalty_kernels = penalty_kernels(device, use_triton)
        self._key = (seed * 0x9E3779B97F4A7C15 & ((1 << 62) - 1)) | (1 << 62)  # always int64 to Triton
        self._step = 0  # the unseeded rows' stream number: one per call
        self._last_rows: _Rows | None = None  # the last call's rows, read from its params list
        self._temperatures: dict[float, torch.Tensor] = {}  # one device scalar per temperature seen
        # The torch path's exponential race noise, redrawn in place each step (a later step's draw
        # is queued after the last step's use of it on the device's one stream).
        self._noise: torch.Tensor | None = None
        self._captured: _CapturedDraws | None = None  # made by enable_captured_draws
        # On CUDA the tokens come back through reused pinned memory; on CPU they are already there.
        self.readback = HostReadback(pin=True) if device.type == "cuda" else None
        # The penalized sequences' prompt masks and output counts, kept between steps; the
        # runner forgets each sequence once it finishes.
        self.token_counts = TokenCounts(device, self.upload)

    def upload(self, values, dtype: torch.dtype) -> torch.Tensor:
        """A small host list or array as a device tensor, through pinned memory and a
        non-blocking copy: a copy from pageable memory would first wait for all the work the
        device has queued (the step before, under async scheduling)."""
        t = torch.as_tensor(values, dtype=dtype)
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

    def compile_kernels(self, vocab: int, dtype: torch.dtype) -> None:
        """Compile the Triton sampling kernels' variants now (start-up), not in the first steps:
        for the model's logits, and for the float32 logits that adjusted rows draw from."""
        if self.kernels is not None:
            for logits_dtype in dict.fromkeys((dtype, torch.float32)):
                self.kernels.compile_variants(vocab, logits_dtype, self.device)
        if self.penalty_kernels is not None:
            self.penalty_kernels.compile_variants(vocab, self.device)

    def _streams(self, rows: "_Rows"):
        """This call's random streams (:class:`~kvscope.kernels.triton_sampling.Streams`): row ``i``
        draws ``(key, i, step)``; a seeded row ``(seed, output index, SEEDED)``."""
        self._step += 1
        if not rows.seeded:
            return self.kernels.Streams(self._key, self._step)
        params, output_index = rows.params, rows.output_index
        n = len(params)
        cols = np.empty((n, 3), dtype=np.int64)
        cols[:, 0], cols[:, 1], cols[:, 2] = self._key, np.arange(n), self._step
        for i, p in enumerate(params):
            if p.seed is not None:
                cols[i] = (np.uint64(p.seed & (2**64 - 1)).view(np.int64), output_index[i], self.kernels.SEEDED)
        return self.kernels.Streams(self._key, self._step, self.upload(cols, torch.int64))

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], output_index: list[int],
        stop_token_ids_of: Callable[[int], frozenset[int]] | None = None,
        history_of: HistoryOf | None = None,
    ) -> DeviceSample:
        """Sample one token per row. When every row shares one ``SamplingParams`` object (what
        ``LLM.generate`` sends), its settings are read once and nothing per row goes to the
        device; the tokens are the same as when each row brings its own equal copy. Passing
        the very ``params`` list of the last call (the same rows, one token further, as the
        runner does in steady decode) reuses what that call read from it.

        A row short of its ``min_tokens`` never draws one of ``stop_token_ids_of(row)`` (as with
        vLLM's min-tokens logits processor); its log-probs stay those of the model, as they do
        for an adjusted row, whose penalties read its tokens from ``history_of(rows)`` (see
        :data:`~kvscope.runner.token_counts.HistoryOf`; without it, a row has none yet)."""
        tokens, logprob_parts = self._draw(logits, params, output_index, stop_token_ids_of, history_of)
        return DeviceSample(tokens, params, logprob_parts, self.readback)

    def sample_each(
        self, logits: torch.Tensor, params: list[SamplingParams], output_index: list[int],
        stop_token_ids_of: Callable[[int], frozenset[int]], fallback: SamplingParams,
        history_of: HistoryOf | None = None,
    ) -> tuple[DeviceSample, dict[int, Exception]]:
        """What :meth:`sample` draws, one row at a time, for a batch whose draw failed as a whole:
        so a fault of the batch (memory short for all its rows at once) costs no row, and a row
        whose own settings fail is found and drawn by ``fallback`` instead. Returns the joined
        sample and, by row, the errors of the rows that failed. Seeded and greedy rows draw what
        they draw in the batch."""
        params = list(params)  # (the caller's list, which a next steady step reuses, keeps every row's own)
        failed: dict[int, Exception] = {}
        drawn: list[tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]] = []
        for i in range(len(params)):
            row = logits[i:i + 1]
            try:
                drawn.append(self._draw(row, [params[i]], [output_index[i]], lambda _, i=i: stop_token_ids_of(i),
                                        None if history_of is None else lambda _, i=i: history_of([i])))
            except Exception as exc:
                failed[i], params[i] = exc, fallback
                drawn.append(self._draw(row, [fallback], [output_index[i]]))
        tokens = torch.cat([t for t, _ in drawn])
        widths = [max(p.logprobs, 1) for p in params if p.logprobs is not None]
        if not widths:
            return DeviceSample(tokens, params, None, self.readback), failed
        width = max(widths)

        def part(j: int, parts: tuple[torch.Tensor, ...] | None, dtype: torch.dtype) -> torch.Tensor:
            """Row's log-prob part ``j`` (0: the chosen token's, 1 and 2: the top values and ids,
            3: the chosen token's rank), zeros past what the row asked for (``DeviceSample`` reads
            no further)."""
            shape = (1,) if j in (0, 3) else (1, width)
            out = torch.zeros(shape, dtype=dtype, device=tokens.device)
            if parts is not None:
                out[..., : parts[j].shape[-1]] = parts[j]
            return out

        joined = tuple(torch.cat([part(j, parts, dtype) for _, parts in drawn])
                       for j, dtype in enumerate((torch.float32, torch.float32, torch.int64, torch.int64)))
        return DeviceSample(tokens, params, joined, self.readback), failed

    def _draw(
        self, logits: torch.Tensor, params: list[SamplingParams], output_index: list[int],
        stop_token_ids_of: Callable[[int], frozenset[int]] | None = None,
        history_of: HistoryOf | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """:meth:`sample`'s tokens and, when a row asks for them, its log-prob parts (the chosen
        tokens', the top values, the top ids), all on the device."""
        rows = self._rows_of(params, output_index)
        want_lp = rows.want_logprobs
        # float32 logits, cast once for whichever of log-probs, masks, penalties and the torch
        # path needs them.
        as_float = logits.float() if self.kernels is None or want_lp >= 0 or rows.masked or rows.adjusted else None
        raw_logprobs = as_float.log_softmax(dim=-1) if want_lp >= 0 else None
        if rows.adjusted:  # (the kernels then draw from these float32 logits, every row's the same)
            logits = as_float = self._adjusted(as_float, rows, history_of)
        held = self._held_back(rows, output_index, stop_token_ids_of)
        if held is not None:
            # (-inf made on the device: a tensor copied from the host would wait for its queued work)
            logits = logits.index_put(held, logits.new_full((), float("-inf")))
            if as_float is not None:
                as_float = as_float.index_put(held, as_float.new_full((), float("-inf")))
        if self.kernels is not None:
            tokens = self._sample_by_kernels(logits, as_float, rows)
        else:
            tokens = self._sample_by_torch(as_float, rows)
        if raw_logprobs is None:
            return tokens, None
        chosen, *top, rank = chosen_and_top(raw_logprobs, tokens, want_lp)
        return tokens, (chosen, *top, rank)

    def enable_captured_draws(self, max_rows: int) -> None:
        """Make the device state a CUDA graph's draw reads (:meth:`draw_captured`): the rows'
        scales and the step number. Only where the kernels run."""
        self._captured = _CapturedDraws(
            scale=torch.zeros(max_rows, dtype=torch.float32, device=self.device),
            step=torch.zeros(1, dtype=torch.int64, device=self.device))

    def draw_captured(self, logits: torch.Tensor) -> torch.Tensor:
        """The draw a decode graph captures after the LM head: the kernels at each row's scale
        and the next step number, both read from device memory at replay (the graph bumps the
        step itself), so a replay draws what :meth:`sample` would for the same rows and step."""
        c = self._captured
        c.step.add_(1)
        return self.kernels.sample(logits, c.scale[: logits.shape[0]], self.kernels.Streams(self._key, c.step))

    def sample_captured(self, params: list[SamplingParams], output_index: list[int],
                        replay: Callable[[], torch.Tensor]) -> DeviceSample | None:
        """Sample these rows by ``replay`` (a decode graph ending in :meth:`draw_captured`;
        returns its tokens), as :meth:`sample` would; ``None``, having changed nothing, for rows
        that need what only :meth:`sample` does: log-probs, min-p / top-k / top-p masks,
        adjusted logits (penalties, bias, allowed tokens), seeds, rows short of their
        ``min_tokens``."""
        rows = self._rows_of(params, output_index)
        if (rows.want_logprobs >= 0 or rows.masked or rows.adjusted or rows.seeded
                or self._short_rows(rows, output_index)):
            return None
        c = self._captured
        if c.rows is not rows:  # (a steady batch keeps its rows: its scales are in place)
            scale = self._kernel_scale(rows)
            if isinstance(scale, torch.Tensor):
                c.scale[: scale.numel()].copy_(scale)
            else:
                c.scale.fill_(scale)
            c.rows = rows
        self._step += 1
        if c.step_value != self._step - 1:  # eager draws ran since the last replay (or none did yet)
            c.step.fill_(self._step - 1)
        c.step_value = self._step
        return DeviceSample(replay(), params, None, self.readback)

    @staticmethod
    def _short_rows(rows: "_Rows", output_index: list[int]) -> list[int]:
        """The rows whose next token comes before their ``min_tokens``-th."""
        if not rows.min_tokens:
            return []
        return [i for i, p in enumerate(rows.params) if output_index[i] < p.min_tokens]

    def _held_back(self, rows: "_Rows", output_index: list[int],
                   stop_token_ids_of: Callable[[int], frozenset[int]] | None
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, tokens) of the stop tokens that rows short of their ``min_tokens`` may not
        draw, as index tensors; ``None`` for none."""
        short = self._short_rows(rows, output_index) if stop_token_ids_of is not None else []
        pairs = [(i, t) for i in short for t in stop_token_ids_of(i)]
        if not pairs:
            return None
        r, c = zip(*pairs)
        return self.upload(r, torch.int64), self.upload(c, torch.int64)

    def _rows_of(self, params: list[SamplingParams], output_index: list[int]) -> "_Rows":
        last = self._last_rows
        if last is not None and last.params is params:
            last.output_index = output_index
            return last
        first = params[0]
        shared = all(p is first for p in params)
        settings = (first,) if shared else params  # what the per-step checks need to look at
        asked = [p.logprobs for p in settings if p.logprobs is not None]
        temps = [first.temperature] if shared else [p.temperature for p in params]
        if min(temps) < GREEDY_BELOW:
            temps = [t if t >= GREEDY_BELOW else 0.0 for t in temps]
        flags = functools.reduce(operator.or_, [p.sampling_flags for p in settings])
        rows = self._last_rows = _Rows(
            params, output_index, temps=temps, want_logprobs=max(asked) if asked else -1,
            masked=bool(flags & MASKED), seeded=bool(flags & SEEDED), adjusted=bool(flags & ADJUSTED),
            min_tokens=max(p.min_tokens for p in settings),
        )
        return rows

    def _adjusted(self, logits: torch.Tensor, rows: "_Rows", history_of: HistoryOf | None) -> torch.Tensor:
        """float32 ``logits`` with the adjusted rows' allowed tokens, logit bias and penalties
        applied (:mod:`kvscope.runner.logit_adjustments`); their settings go to the device once
        per ``_Rows``, the penalized rows' tokens come from :attr:`token_counts`."""
        if rows.adjustments is None:
            rows.adjustments = Adjustments.of(rows.params, logits.shape[1], logits.device, self.upload)
        return rows.adjustments.apply(logits, history_of, self.token_counts, self.upload, self.penalty_kernels)

    def _scaled(self, logits: torch.Tensor, rows: "_Rows") -> torch.Tensor:
        """float32 ``logits / T`` per row (a greedy row by 1), min-p then top-k / top-p masked
        to ``-inf`` (vLLM's order). The per-row tensors go to the device once per ``_Rows`` (a
        steady batch reuses them)."""
        if rows.one_temp:
            scaled = logits / self._temperature(rows.temps[0] if rows.temps[0] > 0 else 1.0)
        else:
            if rows.divisor is None:
                rows.divisor = self.upload([t if t > 0 else 1.0 for t in rows.temps], torch.float32).unsqueeze(1)
            scaled = logits / rows.divisor
        if rows.masked:
            if rows.masks is None:  # (a top-k past the vocabulary keeps every token, as in vLLM)
                vocab = logits.shape[-1]
                min_p = [float(p.min_p) for p in rows.params]
                rows.masks = (self.upload(min_p, torch.float32) if any(min_p) else None,
                              self.upload([min(p.top_k, vocab) for p in rows.params], torch.int64),
                              self.upload([float(p.top_p) for p in rows.params], torch.float32))
            min_p, top_k, top_p = rows.masks
            if min_p is not None:
                scaled = apply_min_p(scaled, min_p)
            scaled = apply_top_k_top_p(scaled, top_k, top_p)
        return scaled

    def _sample_by_kernels(self, logits: torch.Tensor, as_float: torch.Tensor | None, rows: "_Rows") -> torch.Tensor:
        """The fused kernels on ``logits`` as they are; rows with min-p, top-k or top-p take the
        same kernels on logits whose tokens outside their set are ``-inf`` (found on ``as_float``,
        the float32 cast), so every row draws the same as without a neighbour that masks."""
        if rows.masked:
            logits = logits.masked_fill(self._scaled(as_float, rows).isinf(), float("-inf"))
        return self.kernels.sample(logits, self._kernel_scale(rows), self._streams(rows))

    def _kernel_scale(self, rows: "_Rows") -> float | torch.Tensor:
        """The kernels' scale of ``rows``: one number, or float32 per row on the device (made
        once per ``_Rows``, read by this step's launch and the next ones')."""
        if rows.scale is None:
            scale_of = self.kernels.scale_of
            if rows.one_temp:
                rows.scale = scale_of(rows.temps[0])
            else:
                rows.scale = self.upload([scale_of(t) for t in rows.temps], torch.float32)
        return rows.scale

    def _sample_by_torch(self, logits: torch.Tensor, rows: "_Rows") -> torch.Tensor:
        """The exponential race on float32 ``logits`` with noise from torch's generator (a seeded
        row from its own, keyed by seed and output index)."""
        greedy = [t == 0 for t in rows.temps]
        if all(greedy):
            return logits.argmax(dim=-1)
        scaled = self._scaled(logits, rows)
        if self._noise is None or self._noise.shape != scaled.shape:
            self._noise = torch.empty(scaled.shape, device=self.device)
        noise = exponential_(self._noise, self.generator)
        if rows.seeded:
            for i, p in enumerate(rows.params):
                if p.seed is not None:
                    noise[i] = _seeded_noise(p.seed, rows.output_index[i], scaled.shape[1], self.device)
        tokens = (scaled - noise.log()).argmax(dim=-1)
        if any(greedy):  # (a mixed batch: rows of their own)
            tokens = torch.where(self.upload(greedy, torch.bool), logits.argmax(dim=-1), tokens)
        return tokens


@dataclass
class _CapturedDraws:
    """What a decode graph's draw reads from device memory, and what the host knows of it."""

    scale: torch.Tensor  # float32 [max rows]: the kernels' scale of each row
    step: torch.Tensor  # int64 [1]: the step number, bumped by each replay before its draw
    rows: "_Rows | None" = None  # the rows whose scales ``scale`` holds
    step_value: int | None = None  # ``step`` after the last replay (None: not known)


@dataclass
class _Rows:
    """What one ``sample`` call needs to know of its rows' settings, read once."""

    params: list[SamplingParams]
    output_index: list[int]  # (the one field a reusing call updates)
    temps: list[float]  # one per row, or one for all when every row shares one params object
    want_logprobs: int  # the most log-probs a row asks for, -1 for none
    masked: bool  # some row asks for top-k, top-p or min-p
    seeded: bool  # some row has a seed
    adjusted: bool  # some row has a penalty, a logit bias or allowed tokens
    min_tokens: int  # the largest min_tokens of a row (0: no row holds back its stop tokens)
    scale: float | torch.Tensor | None = None  # the kernels' scale, once computed
    divisor: torch.Tensor | None = None  # float32 [rows, 1]: each row's temperature (1 for greedy)
    # per-row min-p (None when no row has one), top-k and top-p, when masked
    masks: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] | None = None
    adjustments: Adjustments | None = None  # the adjusted rows' settings on the device, when adjusted

    @functools.cached_property
    def one_temp(self) -> bool:
        return self.temps.count(self.temps[0]) == len(self.temps)
