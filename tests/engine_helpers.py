"""Builds real engines on tiny checkpoints for tests, with the invariant validator switched on."""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import pytest
import torch

from kvscope import LLM, SamplingParams
from kvscope.engine.scheduler_output import PLACEHOLDER
from tiny_models import tiny_checkpoint


def make_llm(arch: str = "qwen3", tie: bool = False, validate: bool = True, **config: Any) -> LLM:
    config.setdefault("device", "cpu")
    config.setdefault("dtype", "float32")
    llm = LLM(str(tiny_checkpoint(arch, tie)), **config)
    llm.llm_engine.validate_every_step = validate
    return llm


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    """The greedy tokens; with ``n > 1``, which greedy refuses (as vLLM does), drawn at
    ``top_k=1``, so that every completion is the greedy one."""
    if kw.get("n", 1) > 1:
        return SamplingParams(temperature=1.0, top_k=1, max_tokens=max_tokens, ignore_eos=True, **kw)
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def drain(llm: LLM) -> dict[str, Any]:
    """Step until idle; the final output of every request, by id."""
    final = {}
    for _ in range(500):
        if not llm.has_unfinished_requests():
            return final
        final.update({o.request_id: o for o in llm.step() if o.finished})
    raise AssertionError("the engine did not drain")


def watch_launches(llm: LLM) -> tuple[dict[int, dict[str, list[int]]], list[bool]]:
    """Wrap the runner's launch: the tables it holds right after each launch (those of the
    forward pass), and whether the launch carried inputs still on the device (async scheduling)."""
    engine, runner = llm.llm_engine, llm.llm_engine.executor
    tables, ahead = {}, []
    launch = runner.execute_async  # (execute goes through it)

    def watched(out):
        handle = launch(out)
        live = engine.scheduler.requests
        tables[out.step] = {live[r.seq_id].request_id: runner.block_tables.get(r.seq_id) for r in out.requests}
        ahead.append(any(PLACEHOLDER in r.token_ids for r in out.requests))
        return handle

    runner.execute_async = watched
    return tables, ahead


class NumberTokenizer:
    """A tokenizer for engines over token ids only (a ``NullExecutor``'s): id 0 is EOS, and a
    text is its ids written out."""

    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


class Cycle:
    """Garbage only the cyclic collector frees (for tests of a frozen heap)."""

    def __init__(self) -> None:
        self.me = self


def bias_logits(llm: LLM, bias: dict[int, float] | Callable[[], dict[int, float]]) -> None:
    """Add ``bias[token]`` to every logit of ``token`` the model computes from now on; ``bias``
    may be a function, called for each computation's biases."""
    model = llm.llm_engine.executor.model
    plain = model.compute_logits

    def biased(hidden):
        logits = plain(hidden)
        for token, b in (bias() if callable(bias) else bias).items():
            logits[:, token] += b
        return logits

    model.compute_logits = biased


@contextlib.contextmanager
def batch_draws_short_of_memory(llm: LLM, path: str) -> Iterator[list[int]]:
    """Make the runner's sampler ``path`` (``"_sample_by_torch"`` or ``"_sample_by_kernels"``)
    raise ``torch.OutOfMemoryError`` whenever more than one row draws at once: a fault of the
    batch that no row causes alone. Yields a one-item list counting the faults."""
    sampler = llm.llm_engine.executor.sampler
    draw = getattr(sampler, path)
    faults = [0]

    def short_of_memory(logits: torch.Tensor, *rest: Any) -> torch.Tensor:
        if logits.shape[0] > 1:
            faults[0] += 1
            raise torch.OutOfMemoryError("out of memory for the batch's draw")
        return draw(logits, *rest)

    setattr(sampler, path, short_of_memory)
    try:
        yield faults
    finally:
        delattr(sampler, path)


def assert_same_outputs(got: list, want: list, abs_tol: float) -> None:
    """Equal completions: no error, the same tokens, the same log-prob keys, values within ``abs_tol``."""
    assert [o.error for o in got] == [None] * len(want)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        assert (g.logprobs is None) == (w.logprobs is None)
        for gs, ws in zip(g.logprobs or [], w.logprobs or []):
            assert gs.keys() == ws.keys()
            assert [gs[t] for t in gs] == pytest.approx([ws[t] for t in gs], abs=abs_tol)


def run_together(fn, n: int) -> list[BaseException]:
    """``fn(k)`` in ``n`` threads released at once; whatever any of them raised."""
    barrier, errors = threading.Barrier(n), []

    def run(k: int) -> None:
        try:
            barrier.wait()
            fn(k)
        except BaseException as exc:  # any internal error fails the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return errors
