"""The penalties' token counts kept on the device between steps (kvscope.runner.token_counts):
every read against masks and counts built afresh from whole histories, through outputs
arriving on the host and in flight, repeated reads, lost outputs and finished sequences; in the
engine, against a torch reference as requests come, finish and are aborted at different steps."""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from engine_helpers import greedy, make_llm
from kvscope.runner.token_counts import Histories, TokenCounts
from test_logit_adjustments import reference_tokens
from tiny_models import load_hf_model, tiny_checkpoint

VOCAB = 37


@dataclass
class _Seq:
    token_ids: list[int]
    num_prompt_tokens: int
    flying: int | None = None  # an output the device sampled that the host does not have yet


def _fresh(seqs: list[_Seq]) -> tuple[torch.Tensor, torch.Tensor]:
    """What the penalties read, built from each whole history (the output in flight included)."""
    mask = torch.zeros(len(seqs), VOCAB, dtype=torch.bool)
    counts = torch.zeros(len(seqs), VOCAB)
    for i, s in enumerate(seqs):
        mask[i, s.token_ids[:s.num_prompt_tokens]] = True
        for t in s.token_ids[s.num_prompt_tokens:] + ([] if s.flying is None else [s.flying]):
            counts[i, t] += 1
    return mask, counts


@pytest.mark.parametrize("seed", range(6))
def test_every_read_equals_counts_built_from_whole_histories(seed):
    """Random rounds over a changing set of sequences: each round some get an output on the
    host, some sample one still in flight (which a later round hands to the host, or loses, as
    a rolled-back step does), some finish and are forgotten, new ones come; in some rounds every
    one has an output in flight; a random batch of the live ones, in random order, is read,
    sometimes twice."""
    rng = random.Random(seed)
    counts = TokenCounts(torch.device("cpu"), lambda values, dtype: torch.as_tensor(values, dtype=dtype))
    live: dict[int, _Seq] = {}
    next_key = 0
    for _ in range(60):
        for _ in range(rng.randrange(3)):
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
            live[next_key] = _Seq(prompt, len(prompt))
            next_key += 1
        for key in list(live):
            s, roll = live[key], rng.random()
            if roll < 0.1:
                counts.forget([key])
                del live[key]
            elif s.flying is not None:
                if roll < 0.2:
                    s.flying = None  # lost
                elif roll < 0.8:
                    s.token_ids.append(s.flying)  # the host has it now
                    s.flying = None if rng.random() < 0.5 else rng.randrange(VOCAB)
            elif roll < 0.5:
                s.token_ids += [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 3))]
            elif roll < 0.8:
                s.flying = rng.randrange(VOCAB)
        if not live:
            continue
        if rng.random() < 0.3:  # every row with an output in flight, as at each async decode step
            for s in live.values():
                s.flying = rng.randrange(VOCAB) if s.flying is None else s.flying
        batch = rng.sample(sorted(live), rng.randrange(1, len(live) + 1))
        seqs = [live[k] for k in batch]
        flying = [i for i, s in enumerate(seqs) if s.flying is not None]
        tokens = torch.tensor([seqs[i].flying for i in flying]) if flying else None
        for _ in range(rng.choice((1, 1, 2))):
            mask, got = counts.read(Histories(batch, seqs, flying, tokens), VOCAB)
            want_mask, want = _fresh(seqs)
            assert torch.equal(mask, want_mask)
            assert torch.equal(got, want)
    counts.forget(list(live))
    assert len(counts) == 0


@pytest.mark.parametrize("seed", range(6))
def test_a_part_of_a_batch_reads_as_those_rows_alone(seed):
    """Rows ``part`` of a batch (what a batch reads when its rows with bad words are not all
    its penalized rows): each read equals counts built afresh for those rows alone, whether
    every row, some or none has an output in flight, and a row left out of one read is right
    when a later one reads it."""
    rng = random.Random(seed)
    counts = TokenCounts(torch.device("cpu"), lambda values, dtype: torch.as_tensor(values, dtype=dtype))
    seqs = []
    for _ in range(10):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6))]
        seqs.append(_Seq(prompt, len(prompt)))
    for _ in range(40):
        everyone = rng.random() < 0.3
        for s in seqs:
            if s.flying is not None and rng.random() < 0.7:
                s.token_ids.append(s.flying)  # the host has it now (or else it is lost)
            s.token_ids += [rng.randrange(VOCAB) for _ in range(rng.choice((0, 0, 1, 2)))]
            s.flying = rng.randrange(VOCAB) if everyone or rng.random() < 0.5 else None
        order = rng.sample(range(len(seqs)), rng.randrange(1, len(seqs) + 1))
        part = sorted(rng.sample(range(len(order)), rng.randrange(1, len(order) + 1)))
        flying = [i for i, k in enumerate(order) if seqs[k].flying is not None]
        tokens = torch.tensor([seqs[order[i]].flying for i in flying]) if flying else None
        batch = Histories(order, [seqs[k] for k in order], flying, tokens)
        mask, got = counts.read(batch, VOCAB, part)
        want_mask, want = _fresh([seqs[order[i]] for i in part])
        assert torch.equal(mask, want_mask)
        assert torch.equal(got, want)


CONFIGS = [dict(), dict(async_scheduling=True), dict(num_kv_blocks=14, max_num_seqs=3, async_scheduling=True)]


@pytest.mark.parametrize("config", CONFIGS, ids=["sync", "async", "preempting"])
def test_penalties_follow_each_sequence_as_requests_come_finish_and_are_aborted(config):
    """Penalized requests of different lengths, some added while others run and one aborted
    midway, each against the torch reference of its own; the counts of finished and aborted
    sequences are let go once the runner hears of them."""
    llm = make_llm(block_size=4, **config)
    rng = random.Random(3)
    kinds = [dict(frequency_penalty=1.5), dict(presence_penalty=2.0, repetition_penalty=1.3),
             dict(repetition_penalty=1.8), dict(frequency_penalty=-0.5, presence_penalty=1.0)]
    plan = [([rng.randrange(3, 300) for _ in range(rng.randrange(2, 14))], greedy(rng.randrange(3, 20), **kinds[i % 4]))
            for i in range(9)]
    engine = llm.llm_engine
    ids = {}
    for step in range(400):
        if step % 3 == 0 and len(ids) < len(plan):
            prompt, params = plan[len(ids)]
            ids[llm.add_request(prompt, params)] = len(ids)
        if step == 6:
            llm.abort_request(list(ids)[1])
        outputs = {o.request_id: o for o in llm.step() if o.finished} if llm.has_unfinished_requests() else {}
        for rid, out in outputs.items():
            ids[rid] = (ids[rid], out.outputs[0])
        if len(ids) == len(plan) and not llm.has_unfinished_requests():
            break
    model = load_hf_model(tiny_checkpoint("qwen3"))
    for rid, (i, out) in ids.items():
        prompt, params = plan[i]
        want = reference_tokens(model, prompt, params, max_new=params.max_tokens)
        if out.finish_reason == "abort":
            assert want[:len(out.token_ids)] == list(out.token_ids)
        else:
            assert list(out.token_ids) == want, (i, params)
    assert sum(o.finish_reason == "abort" for _, o in ids.values()) == 1
    llm.generate([[5, 6, 7]], greedy(4, frequency_penalty=1.0), use_tqdm=False)
    assert len(engine.executor.sampler.token_counts) <= 1  # (the last one, until a next step)
