"""Nothing a caller does from a hook, a thread or the keyboard breaks the engine (issue #14).

Every test ends by checking the engine is healthy: nothing unfinished, the invariant validator
passes, and greedy tokens equal a fresh engine's.
"""
from __future__ import annotations

import contextlib
import gc
import signal
import threading
import warnings
import weakref
from typing import Any, Iterator

import pytest

import kvscope.llm as llm_module
from engine_helpers import (assert_same_outputs, batch_draws_short_of_memory, drain, greedy, make_llm, run_together,
                            token_ids)
from kvscope.engine.hooks import HOOK_POINTS
from kvscope.interrupts import deferred_interrupts
from kvscope.engine.validator import InvariantError
from kvscope.sampling_params import SamplingParams

# Two requests reuse and share the first one's prefix block, the pool is small enough to evict
# and preempt, and prompts are chunked: every hook point fires during PROMPTS.
PREFIX = [3, 4, 5, 6]
PROMPTS = [PREFIX + [7, 8], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20, 21], PREFIX + [9], PREFIX + [30, 31, 32, 33]]
CONFIG = dict(block_size=4, num_kv_blocks=8, max_num_batched_tokens=12, max_num_seqs=3)
_FRESH: dict[str, list[list[int]]] = {}
PENALIZED = dict(frequency_penalty=2.0, presence_penalty=-1.5, repetition_penalty=1.9)


def fresh_tokens(prompts: list[list[int]], n: int = 6, **params: Any) -> list[list[int]]:
    """Greedy tokens (with ``params``) from an engine nothing happened to (greedy tokens do not
    depend on batching)."""
    key = repr((prompts, n, params))
    if key not in _FRESH:
        _FRESH[key] = token_ids(make_llm(**CONFIG).generate(prompts, greedy(n, **params), use_tqdm=False))
    return _FRESH[key]


def assert_healthy(llm) -> None:
    engine = llm.llm_engine
    assert not llm.has_unfinished_requests()
    llm.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert token_ids(llm.generate(PROMPTS, greedy(6), use_tqdm=False)) == fresh_tokens(PROMPTS)


# ------------------------------------------------------------------ case 2
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_whose_sampling_fails_fails_alone(async_scheduling: bool) -> None:
    llm = make_llm(async_scheduling=async_scheduling, **CONFIG)
    ids = [llm.add_request(p, greedy(6)) for p in PROMPTS]
    bad = llm.llm_engine.requests[ids[1]]
    bad.params = greedy(6, logprobs=llm.llm_engine.vocab_size + 5)  # slipped past validation
    final = drain(llm)
    assert set(final) == set(ids)
    out = final[ids[1]].outputs[0]
    assert out.finish_reason == "error" and "out of range" in out.error  # (vLLM's request-level error)
    good = [p for i, p in enumerate(PROMPTS) if i != 1]
    assert [final[i].outputs[0].token_ids for i in ids if i != ids[1]] == fresh_tokens(good)
    assert all(final[i].outputs[0].error is None for i in ids if i != ids[1])
    assert_healthy(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_top_k_past_int64_keeps_every_token_beside_a_row_that_masks(async_scheduling: bool) -> None:
    """A top-k past the vocabulary, even past int64, keeps every token, as vLLM's does. A batch
    with a row that masks builds every row's top-k, a greedy row's too, though alone that row
    never reads its own: so a greedy and a seeded row with top-k 2**63 beside a top-k-3 row
    draw what they draw with top-k off."""
    llm = make_llm(async_scheduling=async_scheduling, **CONFIG)

    def run(top_k: int) -> list[list[int]]:
        params = [greedy(6, top_k=top_k),
                  SamplingParams(temperature=0.8, top_k=top_k, seed=7, max_tokens=6, ignore_eos=True),
                  SamplingParams(temperature=0.8, top_k=3, seed=8, max_tokens=6, ignore_eos=True)]
        return token_ids(llm.generate(PROMPTS[:3], params, use_tqdm=False))

    assert run(2**63) == run(0)
    assert_healthy(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_batch_whose_draw_fails_as_a_whole_loses_no_row(async_scheduling: bool) -> None:
    """A fault that no row causes alone, here memory that runs out whenever more than one row
    draws at once, costs no request: the rows are drawn one at a time, so greedy and seeded rows
    draw the tokens and log-probs of a run without the fault, and the engine serves on."""
    llm = make_llm(async_scheduling=async_scheduling, **CONFIG)
    params = [greedy(6, logprobs=2),
              SamplingParams(temperature=0.8, seed=7, max_tokens=6, ignore_eos=True, logprobs=0),
              SamplingParams(temperature=0.8, top_k=3, seed=8, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=9, max_tokens=6, ignore_eos=True)]

    def run() -> list:
        return [o.outputs[0] for o in llm.generate(PROMPTS[:4], params, use_tqdm=False)]

    # The third row's own stop tokens are those it draws unconstrained, held back for 4 tokens.
    drawn = run()[2].token_ids
    params[2] = SamplingParams(temperature=0.8, top_k=3, seed=8, max_tokens=6, ignore_eos=True, min_tokens=4,
                               stop_token_ids=drawn[:4])
    want = run()
    assert want[2].token_ids[:4] != drawn[:4]
    with batch_draws_short_of_memory(llm, "_sample_by_torch") as faults:
        got = run()
    assert faults[0] > 0
    assert_same_outputs(got, want, abs_tol=1e-5)
    assert_healthy(llm)


# ------------------------------------------------------------------ case 3
def test_validator_catches_an_aborted_request_still_running_and_one_in_no_queue() -> None:
    llm = make_llm(validate=False, **CONFIG)
    engine = llm.llm_engine
    ids = [llm.add_request(p, greedy(6)) for p in PROMPTS]
    llm.step()
    running, waiting = engine.scheduler.running[0], engine.scheduler.waiting[0]
    running.status, status = type(running.status).FINISHED, running.status
    with pytest.raises(InvariantError, match="finished but queued as running"):
        llm.check_invariants()
    running.status = status
    engine.scheduler.waiting.remove(waiting)
    with pytest.raises(InvariantError, match="in no queue"):
        llm.check_invariants()
    engine.scheduler.waiting.appendleft(waiting)
    llm.check_invariants()
    assert set(drain(llm)) == set(ids)


@pytest.mark.parametrize("point", [p for p in HOOK_POINTS if p != "step.end"] + ["step.end"])
def test_abort_add_and_reset_from_every_hook_point(point: str) -> None:
    """At the first firing of ``point`` a hook aborts the request the event is about (or the
    first one), adds a new request and resets the prefix cache. Every request still finishes
    exactly once, the others with a fresh engine's tokens."""
    llm = make_llm(**CONFIG)
    ids: list[str] = []
    added: list[str] = []

    def hook(**payload) -> None:
        if added or not ids:
            return
        added.append(None)  # (the abort fires hooks itself: act once)
        candidates = [payload.get("request_id")] + ids  # the event's request, else the first unfinished
        added[0] = next(r for r in candidates if r in ids and llm.llm_engine.abort_request(r))
        added.append(llm.add_request([22, 23, 24], greedy(6)))
        llm.reset_prefix_cache()

    with llm.hooks({point: hook}):
        for p in PROMPTS:
            ids.append(llm.add_request(p, greedy(6)))
        final = drain(llm)
    assert added, f"{point} never fired"
    victim, new = added
    assert set(final) == set(ids) | {new}
    assert final[victim].outputs[0].finish_reason == "abort"
    for i, p in zip(ids, PROMPTS):
        if i != victim:
            assert final[i].outputs[0].token_ids == fresh_tokens([p])[0]
    assert final[new].outputs[0].token_ids == fresh_tokens([[22, 23, 24]])[0]
    assert_healthy(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_hook_that_aborts_the_only_scheduled_row_leaves_a_held_back_request_to_the_next_step(
        async_scheduling: bool) -> None:
    """The second prompt waits for the first one's prefix block (in-batch sharing); a
    ``step.scheduled`` hook aborts the first, leaving the step empty. That is not a stalled
    scheduler: the next step runs the second prompt (found by the state machine in CI)."""
    llm = make_llm(async_scheduling=async_scheduling, **CONFIG)
    first = llm.add_request(PREFIX, greedy(1))
    aborted: list[str] = []

    def hook(**_) -> None:
        if not aborted:
            aborted.append(first)
            llm.abort_request(first)

    with llm.hooks({"step.scheduled": hook}):
        out = llm.generate([PREFIX + [7]], greedy(1), use_tqdm=False)
    assert aborted and token_ids(out) == fresh_tokens([PREFIX + [7]], 1)
    assert drain(llm)[first].outputs[0].finish_reason == "abort"
    assert_healthy(llm)


# ------------------------------------------------------------------ case 4
@pytest.mark.parametrize("point", [p for p in HOOK_POINTS if p != "step.end"])
def test_generate_from_inside_a_hook_is_refused_and_touches_nothing(point: str) -> None:
    llm = make_llm(**CONFIG)
    refused: list[Exception] = []

    def hook(**_) -> None:
        try:
            llm.generate([[5, 6, 7]], greedy(3), use_tqdm=False)
        except RuntimeError as exc:
            refused.append(exc)

    with llm.hooks({point: hook}):
        outs = llm.generate(PROMPTS, greedy(6), use_tqdm=False)
    assert refused and all("inside a kvscope hook" in str(e) for e in refused)
    assert token_ids(outs) == fresh_tokens(PROMPTS)
    assert_healthy(llm)


def test_generate_from_step_end_works() -> None:
    llm = make_llm(**CONFIG)
    nested = []

    def hook(info) -> None:
        if not nested:
            nested.append(None)
            nested[0] = llm.generate([[5, 6, 7]], greedy(3), use_tqdm=False)

    with llm.hooks({"step.end": hook}):
        outs = llm.generate(PROMPTS, greedy(6), use_tqdm=False)
    assert token_ids(outs) == fresh_tokens(PROMPTS)
    assert token_ids(nested[0]) == fresh_tokens([[5, 6, 7]], 3)
    assert_healthy(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_steps_from_step_end_report_each_request_finished_once_under_its_own_id(async_scheduling: bool) -> None:
    """Streaming with a ``step.end`` hook that steps the engine again at every other step: the
    caller gets each request's final output once, under the id it added (a request with ``n=2``
    merged, never as its children), and the tokens of an engine nothing happened to."""
    llm = make_llm(async_scheduling=async_scheduling, **CONFIG)
    delivered = []

    def step_again(info) -> None:
        if info.step % 2:
            delivered.extend(llm.step())

    ids = [llm.add_request(p, greedy(6)) for p in PROMPTS]
    pair = llm.add_request(PROMPTS[0], greedy(6, n=2))
    with llm.hooks({"step.end": step_again}):
        for _ in range(500):
            if not llm.has_unfinished_requests():
                break
            delivered.extend(llm.step())
    final = [o for o in delivered if o.finished]
    assert sorted(o.request_id for o in final) == sorted([*ids, pair])
    assert {o.request_id for o in delivered} == {*ids, pair}
    by_id = {o.request_id: o for o in final}
    assert [by_id[i].outputs[0].token_ids for i in ids] == fresh_tokens(PROMPTS)
    assert [c.token_ids for c in by_id[pair].outputs] == fresh_tokens(PROMPTS[:1]) * 2
    assert_healthy(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_generate_leaves_no_step_in_flight_when_its_requests_stop_early(async_scheduling: bool) -> None:
    """A stop token ends the last request before its max_tokens, after async scheduling has
    launched the step past it: generate reads that step back before it returns, so nothing is
    unfinished, every launched step got its step.end, and the tokens are the free run's cut at
    the stop token."""
    free = fresh_tokens(PROMPTS)
    stops = {t[2] for t in free}  # (every request stops by its third token)
    launched, ended = [], []
    llm = make_llm(async_scheduling=async_scheduling, **CONFIG)
    with llm.hooks({"step.scheduled": lambda **kw: launched.append(kw["step"]),
                    "step.end": lambda info: ended.append(info.step)}):
        outs = llm.generate(PROMPTS, greedy(6, stop_token_ids=sorted(stops)), use_tqdm=False)
        assert not llm.has_unfinished_requests()
        assert ended == launched
    assert token_ids(outs) == [t[: min(t.index(s) for s in stops if s in t) + 1] for t in free]
    assert llm.step() == []
    assert_healthy(llm)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("point", ["step.scheduled", "step.end", "request.finished"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_abort_unreported_from_a_hook_is_never_reported(async_scheduling: bool, point: str, n: int) -> None:
    """``abort_request(rid, report=False)`` from a hook, in the step that runs ``rid`` (at the
    third firing, or when another request finishes): no output of ``rid``, nor of its children,
    comes out of that step or any later one; the others get a fresh engine's tokens."""
    llm = make_llm(async_scheduling=async_scheduling, **CONFIG)
    engine = llm.llm_engine
    calls, reported = [], []

    def hook(**kw) -> None:
        calls.append(kw.get("request_id"))
        if (len(calls) == 3) if point != "request.finished" else (kw["request_id"] == "short"):
            engine.abort_request("p", report=False)
            calls.append("aborted")

    llm.add_request(PROMPTS[0], greedy(6, n=n), request_id="p")
    llm.add_request(PROMPTS[1], greedy(2), request_id="short")
    llm.add_request(PROMPTS[2], greedy(6), request_id="long")
    with llm.hooks({point: hook}):
        while llm.has_unfinished_requests():
            outs = llm.step()
            reported += [o.request_id for o in outs] if "aborted" in calls else []
            final = {o.request_id: o for o in outs if o.finished}
            if "long" in final:
                assert final["long"].outputs[0].token_ids == fresh_tokens([PROMPTS[2]])[0]
    assert "aborted" in calls
    assert set(reported) <= {"short", "long"}
    assert_healthy(llm)


@pytest.mark.parametrize("point", ["request.finished", "step.end"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_abort_unreported_of_a_request_the_step_just_finished_takes_its_report_back(
        async_scheduling: bool, point: str) -> None:
    """A hook in the step that finishes ``short`` aborts it with ``report=False``: the abort
    returns False (it had finished) and no step reports it; ``long`` gets a fresh engine's tokens."""
    llm = make_llm(async_scheduling=async_scheduling, **CONFIG)
    engine = llm.llm_engine
    aborts = []

    def hook(**kw) -> None:
        if not aborts and engine.requests.get("short") is not None and engine.requests["short"].is_finished:
            aborts.append(engine.abort_request("short", report=False))

    llm.add_request(PROMPTS[1], greedy(2), request_id="short")
    llm.add_request(PROMPTS[2], greedy(6), request_id="long")
    reported = []
    with llm.hooks({point: hook}):
        while llm.has_unfinished_requests():
            reported += llm.step()
    assert aborts == [False]
    assert {o.request_id for o in reported if o.finished} == {"long"}
    assert [o.outputs[0].token_ids for o in reported if o.finished] == fresh_tokens([PROMPTS[2]])
    assert_healthy(llm)


@pytest.mark.parametrize("via", ["LLM.step", "LLMEngine.step"])
def test_an_abort_unreported_takes_back_an_output_a_ctrl_c_kept(via: str) -> None:
    """A Ctrl-C during a step keeps that step's outputs for the next one; aborting a streamed
    request with ``report=False`` before then takes its kept output back too."""
    llm = make_llm(**CONFIG)
    engine = llm.llm_engine
    stepper = llm if via == "LLM.step" else engine
    llm.add_request(PROMPTS[2], greedy(6), request_id="gone")
    llm.add_request(PROMPTS[1], greedy(6), request_id="kept")
    stepper.step()
    with llm.hooks({"step.scheduled": lambda **_: signal.raise_signal(signal.SIGINT)}), \
            pytest.raises(KeyboardInterrupt):
        stepper.step()
    assert engine.abort_request("gone", report=False)
    reported = []
    while llm.has_unfinished_requests():
        reported += stepper.step()
    assert {o.request_id for o in reported} == {"kept"}
    assert [o.outputs[0].token_ids for o in reported if o.finished] == fresh_tokens([PROMPTS[1]])
    assert_healthy(llm)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_abort_unreported_asked_inside_a_transition_holds_when_the_request_finishes_in_it(
        async_scheduling: bool, n: int) -> None:
    """A ``block.freed`` hook, as ``a`` finishes, aborts ``b`` with ``report=False`` while the
    scheduler's transition is under way: the abort waits for its end, by when ``b`` has finished
    too. Nothing of ``b`` (nor of its children) is reported."""
    llm = make_llm(async_scheduling=async_scheduling, **CONFIG)
    engine = llm.llm_engine
    aborts = []

    def freed(request_id, **_) -> None:
        if request_id == "a" and not aborts:
            aborts.append(engine.abort_request("b", report=False))

    llm.add_request(PROMPTS[1], greedy(1), request_id="a")
    llm.add_request(PROMPTS[0], greedy(1, n=n), request_id="b")
    reported = []
    with llm.hooks({"block.freed": freed}):
        while llm.has_unfinished_requests():
            reported += llm.step()
    assert aborts == [True]
    assert [o.request_id for o in reported] == ["a"]
    assert reported[0].outputs[0].token_ids == fresh_tokens([PROMPTS[1]], 1)[0]
    assert_healthy(llm)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_abort_unreported_from_a_hook_of_another_abort_takes_back_the_first_ones_report(
        async_scheduling: bool, n: int) -> None:
    """Aborts of ``a`` and ``b`` asked inside a transition are applied at its end; ``b``'s
    ``request.finished`` hook, which runs while ``a``'s abort is applied, aborts ``a`` with
    ``report=False``: only ``b``'s abort is reported."""
    llm = make_llm(async_scheduling=async_scheduling, **CONFIG)
    engine = llm.llm_engine
    asked, silent = [], []

    def scheduled(**_) -> None:
        if not asked:
            asked.append(llm.abort_request(["a", "b"]))

    def finished(request_id, **_) -> None:
        if request_id == "b" and not silent:
            silent.append(engine.abort_request("a", report=False))

    llm.add_request(PROMPTS[0], greedy(4, n=n), request_id="a")
    llm.add_request(PROMPTS[1], greedy(4), request_id="b")
    reported = []
    with llm.hooks({"step.scheduled": scheduled, "request.finished": finished}):
        while llm.has_unfinished_requests():
            reported += llm.step()
    assert silent and [(o.request_id, o.outputs[0].finish_reason) for o in reported] == [("b", "abort")]
    assert_healthy(llm)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("kept_by", ["generate", "Ctrl-C"])
def test_an_abort_unreported_takes_back_an_output_llm_holds(kept_by: str, n: int) -> None:
    """A streamed request's output waits in the LLM: its final one (it finished while
    generate() ran the engine), or one a Ctrl-C kept from a step's caller (it runs on).
    ``abort_request(report=False)`` takes it back: no step reports the request, and its id is
    free again."""
    llm = make_llm(**CONFIG)
    engine = llm.llm_engine
    if kept_by == "generate":
        llm.add_request([10, 11, 12], greedy(2, n=n), request_id="s")
        llm.generate([PROMPTS[2]], greedy(6), use_tqdm=False)
    else:
        llm.add_request([10, 11, 12], greedy(6, n=n), request_id="s")
        llm.step()
        with llm.hooks({"step.end": lambda info: signal.raise_signal(signal.SIGINT)}), \
                pytest.raises(KeyboardInterrupt):
            llm.step()
    assert engine.abort_request("s", report=False) == (kept_by == "Ctrl-C")
    assert not llm.has_unfinished_requests() and llm.step() == []
    llm.add_request(PROMPTS[1], greedy(6), request_id="s")
    final = drain(llm)
    assert list(final) == ["s"] and final["s"].outputs[0].token_ids == fresh_tokens([PROMPTS[1]])[0]
    assert_healthy(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_aborted_requests_id_stays_taken_until_its_abort_is_reported(async_scheduling: bool) -> None:
    """Between ``abort_request(rid)`` and the step that reports it, adding ``rid`` again is
    refused and generate()'s automatic ids pass over it, so its 'abort' output is never taken
    for another request's."""
    llm = make_llm(async_scheduling=async_scheduling, **CONFIG)
    first = llm.generate([PROMPTS[1]], greedy(6), use_tqdm=False)[0].request_id
    rid = str(int(first) + 1)  # the next automatic id
    llm.add_request([10, 11, 12], greedy(6), request_id=rid)
    llm.step()
    llm.abort_request(rid)
    with pytest.raises(ValueError, match=f"request_id '{rid}' is already in use"):
        llm.add_request(PROMPTS[0], greedy(6), request_id=rid)
    assert token_ids(llm.generate(PROMPTS, greedy(6), use_tqdm=False)) == fresh_tokens(PROMPTS)
    final = drain(llm)
    assert list(final) == [rid] and final[rid].outputs[0].finish_reason == "abort"
    assert_healthy(llm)


class _FailingReadBack:
    """A launched step whose read-back raises, as an asynchronous device error surfaces there."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def result(self):
        raise RuntimeError("injected device error")


@pytest.mark.parametrize("params", [{}, PENALIZED], ids=["plain", "penalized"])
@pytest.mark.parametrize("where", ["forward", "read-back"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_device_error_at_any_step_costs_no_request_its_tokens(async_scheduling: bool, where: str,
                                                                 params: dict[str, float]) -> None:
    """A device error in the k-th step's forward pass, or at its read-back after a launch that
    went through, for every k of a run with chunked prefill: that step raises and is rolled
    back, and every request still ends with a fresh engine's tokens. Penalized rows count no
    token the rolled-back steps sampled (their counts stay on the device between steps)."""
    want = fresh_tokens(PROMPTS, **params)
    for k in range(1, 16):
        llm = make_llm(async_scheduling=async_scheduling, **CONFIG)
        runner = llm.llm_engine.executor
        calls = []
        if where == "forward":
            forward = runner._forward_rows

            def fails_once(step, *rest, forward=forward, calls=calls, k=k):
                calls.append(1)
                if len(calls) == k:
                    raise RuntimeError("injected device error")
                return forward(step, *rest)

            runner._forward_rows = fails_once
        else:
            launch = runner.execute_async

            def reads_back_an_error_once(out, launch=launch, calls=calls, k=k):
                handle = launch(out)
                calls.append(1)
                return _FailingReadBack(handle) if len(calls) == k else handle

            runner.execute_async = reads_back_an_error_once
            runner.execute = lambda out, launch=reads_back_an_error_once: launch(out).result()
        ids = [llm.add_request(p, greedy(6, **params)) for p in PROMPTS]
        final, failed = {}, 0
        for _ in range(200):
            if not llm.has_unfinished_requests():
                break
            try:
                final.update({o.request_id: o for o in llm.step() if o.finished})
            except RuntimeError as exc:
                assert "injected" in str(exc)
                failed += 1
        assert failed == (len(calls) >= k) and [final[i].outputs[0].token_ids for i in ids] == want
        for name in ("_forward_rows", "execute_async", "execute"):
            runner.__dict__.pop(name, None)
        assert_healthy(llm)


# ------------------------------------------------------------------ case 5
def test_threads_calling_generate_on_one_llm_run_one_after_another() -> None:
    llm = make_llm(**CONFIG)
    results = {}

    def run(k: int) -> None:
        for _ in range(3):
            prompts = PROMPTS[k:] + PROMPTS[:k]
            results.setdefault(k, []).append(token_ids(llm.generate(prompts, greedy(6), use_tqdm=False)))
            llm.add_request([5, 6, 7], greedy(2))
            llm.abort_request(llm.add_request([8, 9], greedy(2)))

    errors = run_together(run, 4)
    assert not errors, errors
    for k, runs in results.items():
        assert runs == [fresh_tokens(PROMPTS[k:] + PROMPTS[:k])] * 3
    drain(llm)
    assert_healthy(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("point", ["step.scheduled", "block.allocated", "step.end"])
def test_shutdown_from_another_thread_mid_step_waits_for_the_step_and_generate_says_so(
        point: str, async_scheduling: bool) -> None:
    """``llm.shutdown()`` from another thread while ``generate`` is inside a step: the shutdown
    waits for that step to end (it tore the model and pool down under the step, which then
    failed with a NoneType error from inside the model), then ``generate`` raises that the LLM
    was shut down, and every call after it says the same."""
    llm = make_llm(async_scheduling=async_scheduling, **CONFIG)
    fired, done, shut_mid_step = [0], threading.Event(), []
    shut = threading.Thread(target=lambda: (llm.shutdown(), done.set()))

    def hook(**_) -> None:
        fired[0] += 1
        if fired[0] == 3:
            shut.start()
            shut_mid_step.append(done.wait(0.3))  # (False: the shutdown waits for this step)

    with llm.hooks({point: hook}), pytest.raises(RuntimeError, match=r"^this LLM was shut down"):
        llm.generate(PROMPTS, greedy(6), use_tqdm=False)
    shut.join(10)
    assert shut_mid_step == [False] and done.is_set()
    for call in (lambda: llm.generate([[5, 6]], use_tqdm=False), llm.step, lambda: llm.add_request([5, 6]),
                 lambda: llm.abort_request("0"), llm.reset_prefix_cache):
        with pytest.raises(RuntimeError, match=r"^this LLM was shut down"):
            call()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_call_between_steps_runs_once_the_step_has_let_the_engine_go(
        async_scheduling: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``step.end`` hook asks for a function between steps: it runs on the stepping thread
    after that step and before the next, with the engine free (another thread's add_request
    made while it runs goes through; inside the step it waited for the step, and failed), also
    when the hook stepped the engine again itself; outside a step it runs at once."""
    monkeypatch.setattr(llm_module, "STEP_WAIT_S", 0.5)
    llm = make_llm(async_scheduling=async_scheduling, **CONFIG)
    events, added = [], []

    def let_another_thread_add() -> None:
        thread = threading.Thread(target=lambda: added.append(llm.add_request([5, 6, 7], greedy(2))))
        thread.start()
        thread.join(10)
        events.append("between")

    def end(info) -> None:
        events.append("end")
        if events.count("end") in (2, 4):
            llm.call_between_steps(let_another_thread_add)
        if events.count("end") == 4:
            llm.step()  # (nested: the function still waits for the outer step to end)

    with llm.hooks({"step.end": end}):
        assert token_ids(llm.generate(PROMPTS, greedy(6), use_tqdm=False)) == fresh_tokens(PROMPTS)
    assert events[:7] == ["end", "end", "between", "end", "end", "end", "between"]
    assert len(added) == 2
    llm.call_between_steps(lambda: events.append("at once"))
    assert events[-1] == "at once"
    drain(llm)
    assert_healthy(llm)


def test_a_request_added_from_another_thread_while_the_llm_shuts_down_is_refused() -> None:
    """A notebook's ``add_request`` waits for the step of a background run whose ``step.end``
    hook shuts the LLM down: once let in, it raises that the LLM was shut down, rather than
    queueing a request on an engine without a model (it returned an id that never ran)."""
    llm = make_llm(**CONFIG)
    waiting, added = threading.Event(), []

    def add() -> None:
        waiting.set()
        try:
            added.append(llm.add_request([5, 6, 7], greedy(2)))
        except RuntimeError as exc:
            added.append(exc)

    adder = threading.Thread(target=add)

    def shut_down(info) -> None:
        adder.start()
        assert waiting.wait(10)
        threading.Event().wait(0.5)  # (long enough for the adder to block on the step)
        llm.shutdown()

    with llm.hooks({"step.end": shut_down}), pytest.raises(RuntimeError, match=r"^this LLM was shut down"):
        llm.generate(PROMPTS, greedy(6), use_tqdm=False)
    adder.join(10)
    assert len(added) == 1 and isinstance(added[0], RuntimeError), added
    assert str(added[0]).startswith("this LLM was shut down")


@pytest.mark.parametrize("point", ["step.scheduled", "block.allocated", "step.end"])
def test_shutdown_from_a_hook_is_refused_inside_a_step_and_works_from_step_end(point: str) -> None:
    llm = make_llm(**CONFIG)
    refused: list[Exception] = []

    def hook(**_) -> None:
        try:
            llm.shutdown()
        except RuntimeError as exc:
            refused.append(exc)

    if point != "step.end":
        with llm.hooks({point: hook}):
            outs = llm.generate(PROMPTS, greedy(6), use_tqdm=False)
        assert refused and all("inside a kvscope hook" in str(e) for e in refused)
        assert token_ids(outs) == fresh_tokens(PROMPTS)
        assert_healthy(llm)
        return
    with llm.hooks({point: hook}), pytest.raises(RuntimeError, match=r"^this LLM was shut down"):
        llm.generate(PROMPTS, greedy(6), use_tqdm=False)
    assert not refused


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_check_invariants_from_another_thread_reads_the_engine_between_steps(async_scheduling: bool) -> None:
    """A notebook checks the invariants while a background generate runs: the check waits for
    the step under way instead of reading the engine half-way through a transition (a block
    twice in the free pool, a hash that did not map back: broken invariants that were not)."""
    llm = make_llm(async_scheduling=async_scheduling, validate=False, **CONFIG)
    stop, checks, errors = threading.Event(), [0], []

    def check() -> None:
        while not stop.is_set():
            try:
                llm.check_invariants()
                checks[0] += 1
            except Exception as exc:  # (an InvariantError, or a dict changed during iteration)
                errors.append(exc)

    checker = threading.Thread(target=check)
    checker.start()
    try:
        for _ in range(10):
            assert token_ids(llm.generate(PROMPTS, greedy(6), use_tqdm=False)) == fresh_tokens(PROMPTS)
    finally:
        stop.set()
        checker.join()
    assert not errors, errors[:3]
    assert checks[0] > 0


def test_two_llms_generating_in_two_threads_at_once_each_give_their_own_tokens() -> None:
    """Two engines of one process stepping at the same time (a notebook's background demo
    beside the user's ``LLM``): each forward pass reads its own step's attention metadata. The
    block sizes and budgets differ, so metadata read across engines fails or changes tokens."""
    engines = [make_llm(**CONFIG), make_llm(block_size=16, num_kv_blocks=16, max_num_batched_tokens=24)]
    results = {}

    def run(k: int) -> None:
        results[k] = [token_ids(engines[k].generate(PROMPTS, greedy(6), use_tqdm=False)) for _ in range(6)]

    errors = run_together(run, 2)
    assert not errors, errors
    assert results == {0: [fresh_tokens(PROMPTS)] * 6, 1: [fresh_tokens(PROMPTS)] * 6}
    for llm in engines:
        assert_healthy(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("moment", ["start", "stop"])
@pytest.mark.parametrize("point", ["step.scheduled", "block.allocated"])
def test_a_recording_started_or_stopped_from_another_thread_mid_step_waits_for_the_step(
        point: str, moment: str, async_scheduling: bool) -> None:
    """A dashboard attached to (or detached from) an LLM that a background thread drives, at a
    moment when that thread is inside a step (held there by a hook at ``point``): the
    recording starts or stops once the step is over, so none of its hooks meets a step it saw
    only half of, and the pool its block events replay equals a ``full`` recording's snapshots."""
    llm = make_llm(**CONFIG, async_scheduling=async_scheduling)
    inside, leave, errors, opened, ended = threading.Event(), threading.Event(), [], [], []

    def hold(**_: object) -> None:  # (once two steps have ended: a recording stopped then has steps)
        if len(ended) >= 2 and not leave.is_set():
            inside.set()
            leave.wait(10)

    def drive() -> None:
        try:
            assert token_ids(llm.generate(PROMPTS, greedy(6), use_tqdm=False)) == fresh_tokens(PROMPTS)
        except BaseException as exc:
            errors.append(exc)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with llm.record("full") as full:
            blocks_recording = llm.record("blocks")
            if moment == "stop":
                blocks = blocks_recording.__enter__()
            handles = [llm.hooks.add(point, hold), llm.hooks.add("step.end", lambda **_: ended.append(1))]
            driver = threading.Thread(target=drive)
            driver.start()
            assert inside.wait(10)
            switch = threading.Thread(target=(lambda: opened.append(blocks_recording.__enter__())) if moment == "start"
                                      else lambda: blocks_recording.__exit__(None, None, None))
            switch.start()
            switch.join(0.2)  # (long enough to attach or detach mid-step, were it let)
            leave.set()
            switch.join(10)
            driver.join(60)
            for h in handles:
                h.remove()
            if moment == "start":
                (blocks,) = opened
                llm.generate(PROMPTS, greedy(6), use_tqdm=False)
                blocks_recording.__exit__(None, None, None)
    assert not errors, errors
    assert not [w for w in caught if "raised and was detached" in str(w.message)], [str(w.message) for w in caught]
    step = blocks.step_ids[-1]
    snap, replay = full.pool_arrays(step), blocks.pool_arrays(step)
    for k in ("ref_count", "block_hash", "num_tokens"):
        assert (snap[k] == replay[k]).all(), (k, step)
    assert_healthy(llm)


@contextlib.contextmanager
def a_run_held_inside_a_step(llm) -> Iterator[list]:
    """A ``generate(PROMPTS)`` in another thread, held inside its step by a hook that waits
    for the block's duration, then let go and joined; yields the list
    its tokens land in."""
    inside, leave, got = threading.Event(), threading.Event(), []

    def hold(**_: object) -> None:
        inside.set()
        leave.wait(10)

    handle = llm.hooks.add("step.scheduled", hold)
    driver = threading.Thread(target=lambda: got.append(token_ids(llm.generate(PROMPTS, greedy(6), use_tqdm=False))))
    driver.start()
    assert inside.wait(10)
    try:
        yield got
    finally:
        handle.remove()
        leave.set()
        driver.join(60)


def test_a_recording_asked_for_while_another_thread_stays_inside_a_step_is_refused_not_hung(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A background run is held inside its step by a hook: llm.record from the notebook then
    says so instead of waiting for ever, and works once the run goes on."""
    monkeypatch.setattr(llm_module, "STEP_WAIT_S", 0.2)
    llm = make_llm(**CONFIG)
    with a_run_held_inside_a_step(llm) as got, \
            pytest.raises(RuntimeError, match=r"^llm.record: another thread has been inside one engine step for 0.2 s"):
        llm.record("blocks").__enter__()
    assert got == [fresh_tokens(PROMPTS)]
    with llm.record("blocks") as trace:
        assert token_ids(llm.generate(PROMPTS, greedy(6), use_tqdm=False)) == fresh_tokens(PROMPTS)
    assert trace.step_ids
    assert_healthy(llm)


def test_a_shutdown_refused_while_another_thread_stays_inside_a_step_changes_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A background run is held inside its step by a hook: shutdown() from the notebook says
    so after the wait, and leaves the LLM as it was (the run, once let go, finishes with its
    tokens rather than meeting an LLM shut down half-way), so a later shutdown() works."""
    monkeypatch.setattr(llm_module, "STEP_WAIT_S", 0.2)
    llm = make_llm(**CONFIG)
    with a_run_held_inside_a_step(llm) as got, \
            pytest.raises(RuntimeError, match=r"^LLM.shutdown: another thread has been inside one engine step for 0.2 s"):
        llm.shutdown()
    assert got == [fresh_tokens(PROMPTS)]
    assert_healthy(llm)
    llm.shutdown()
    with pytest.raises(RuntimeError, match=r"^this LLM was shut down"):
        llm.step()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_requests_added_and_aborted_from_another_thread_land_at_the_next_step_of_a_running_generate(
        async_scheduling: bool) -> None:
    """A notebook adds and aborts requests while a background ``generate`` runs (a dashboard's
    ``generate_async``): each call lands between two of that run's steps, at most one step after
    it was made, rather than once the whole run is over (or whenever the stepping thread
    happened to lose the race for the lock), and the added request's tokens come from ``step()``."""
    llm = make_llm(block_size=4, num_kv_blocks=64, async_scheduling=async_scheduling)
    ref = token_ids(make_llm(block_size=4, num_kv_blocks=64).generate([PROMPTS[1], PROMPTS[2]], greedy(60),
                                                                       use_tqdm=False))
    for _ in range(10):
        steps, second, errors, got = [], threading.Event(), [], []

        def ended(info) -> None:
            steps.append(set(info.request_ids.values()))
            second.set() if len(steps) == 2 else None

        def drive() -> None:
            try:
                got.append(token_ids(llm.generate([PROMPTS[1]], greedy(60), use_tqdm=False)))
            except BaseException as exc:
                errors.append(exc)

        handle = llm.hooks.add("step.end", ended)
        driver = threading.Thread(target=drive)
        driver.start()
        assert second.wait(10)
        before = len(steps)
        added = llm.add_request(PROMPTS[2], greedy(60))
        dropped = llm.add_request([8, 9, 10], greedy(6))
        llm.abort_request(dropped)
        waited = len(steps) - before
        driver.join(60)
        handle.remove()
        assert not errors, errors
        assert got == [ref[:1]]
        assert waited <= 1, f"the calls waited {waited} of the run's steps"
        assert any(added in s for s in steps) and not any(dropped in s for s in steps)
        final = drain(llm)
        assert final[dropped].outputs[0].finish_reason == "abort"
        assert final[added].outputs[0].token_ids == ref[1]
    assert_healthy(llm)


@pytest.mark.parametrize("call", ["add_request", "abort_request", "reset_prefix_cache", "generate", "step"])
def test_a_call_while_another_thread_stays_inside_a_step_is_refused_not_hung(
        call: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A background run is held inside its step by a hook: the notebook's calls say so after
    the wait instead of waiting for ever (``generate`` and ``step`` wait for the other
    thread's call to end while it keeps stepping), and change nothing."""
    monkeypatch.setattr(llm_module, "STEP_WAIT_S", 0.2)
    llm = make_llm(**CONFIG)
    streamed = llm.add_request(PROMPTS[1], greedy(6))
    calls = {"add_request": lambda: llm.add_request([5, 6, 7], greedy(2)),
             "abort_request": lambda: llm.abort_request(streamed),
             "reset_prefix_cache": llm.reset_prefix_cache,
             "generate": lambda: llm.generate([[5, 6, 7]], greedy(2), use_tqdm=False),
             "step": llm.step}
    with a_run_held_inside_a_step(llm) as got, \
            pytest.raises(RuntimeError, match=rf"^LLM.{call}: another thread has been inside one engine step for 0.2 s"):
        calls[call]()
    assert got == [fresh_tokens(PROMPTS)]
    final = drain(llm)
    assert list(final) == [streamed] and [final[streamed].outputs[0].token_ids] == fresh_tokens([PROMPTS[1]])
    assert_healthy(llm)


@pytest.mark.parametrize("leaves", ["stops before", "aborted before", "aborted after"])
def test_hooks_attached_with_a_step_in_flight_name_the_rows_of_a_request_that_left(leaves: str) -> None:
    """Async scheduling: hooks attach between two steps, with one launched that holds a row of
    request A. A leaves before they attach (it stops on a token while the step is in flight, or
    is aborted) or after (aborted). The step still names A's row in ``StepInfo.request_ids``:
    a user's ``step.end`` hook sees every row named, the recorder's hook is not detached (it
    raised a KeyError), and the blocks recording replays the pool the full one snapshots."""
    a_prompt, b_prompt = [3, 4, 5, 6, 7], [8, 9, 10]
    engine_config = dict(block_size=4, num_kv_blocks=64)
    ref = token_ids(make_llm(**engine_config).generate([a_prompt], greedy(8), use_tqdm=False))[0]
    llm = make_llm(**engine_config, async_scheduling=True)
    # A stops on its 2nd token, sampled by step 2; step 3 is launched with A's row before step 2 is read.
    a = llm.add_request(a_prompt, greedy(8, stop_token_ids=[ref[1]] if leaves == "stops before" else None))
    llm.add_request(b_prompt, greedy(8))
    for _ in range(3 if leaves == "stops before" else 2):
        llm.step()
    assert (a in llm.llm_engine.requests) == (leaves != "stops before")
    if leaves == "aborted before":
        llm.abort_request(a)
    unnamed: list[int] = []

    def named(info) -> None:
        unnamed.extend(set(info.scheduler_output.columns.seq_id.tolist()) - set(info.request_ids))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with llm.hooks({"step.end": named}), llm.record("full") as full, llm.record("blocks") as blocks:
            if leaves == "aborted after":
                llm.abort_request(a)
            drain(llm)
    assert not [w for w in caught if "raised and was detached" in str(w.message)], [str(w.message) for w in caught]
    assert not unnamed
    assert blocks.step_ids and full.step_ids == blocks.step_ids
    for step in blocks.step_ids:
        snap, replay = full.pool_arrays(step), blocks.pool_arrays(step)
        for k in ("ref_count", "block_hash", "num_tokens"):
            assert (snap[k] == replay[k]).all(), (k, step)
    assert_healthy(llm)


# ------------------------------------------------------------------ case 6
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("point", HOOK_POINTS)
def test_ctrl_c_at_every_transition_aborts_the_call_and_the_engine_serves_on(point: str, async_scheduling: bool) -> None:
    """A real SIGINT raised at the 1st, 2nd, 5th and 9th firing of each hook point (every
    scheduler and block-manager transition fires one) during generate()."""
    llm = make_llm(async_scheduling=async_scheduling, **CONFIG)
    for k in (1, 2, 5, 9):
        calls = [0]

        def hook(**_) -> None:
            calls[0] += 1
            if calls[0] == k:
                signal.raise_signal(signal.SIGINT)

        interrupted = False
        with llm.hooks({point: hook}):
            try:
                llm.generate(PROMPTS, greedy(6), use_tqdm=False)
            except KeyboardInterrupt:
                interrupted = True
        assert interrupted == (calls[0] >= k)
        assert_healthy(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("point", HOOK_POINTS)
def test_a_hook_that_raises_keyboard_interrupt_or_system_exit_stops_the_call_as_ctrl_c_does(
        point: str, async_scheduling: bool) -> None:
    """A hook that raises ``KeyboardInterrupt`` or ``SystemExit`` itself (a way to stop a run
    from a notebook), at the 1st, 2nd, 5th and 9th firing of each hook point: the call raises
    that very exception once the engine is consistent, as a Ctrl-C there does, and the hook is
    not reported as failed. Inside a transition it used to leave a block to nobody or a request
    in no queue, and every later step failed."""
    llm = make_llm(async_scheduling=async_scheduling, **CONFIG)
    for kind in (KeyboardInterrupt, SystemExit):
        for k in (1, 2, 5, 9):
            calls, stop = [0], kind(f"stop at {k}")

            def hook(**_) -> None:
                calls[0] += 1
                if calls[0] == k:
                    raise stop

            raised = None
            with warnings.catch_warnings(record=True) as caught, llm.hooks({point: hook}):
                warnings.simplefilter("always")
                try:
                    llm.generate(PROMPTS, greedy(6), use_tqdm=False)
                except kind as exc:
                    raised = exc
            assert (raised is stop) == (calls[0] >= k) and raised in (None, stop)
            assert not [w for w in caught if "raised and was detached" in str(w.message)]
            assert_healthy(llm)


@pytest.mark.parametrize("point", ["step.scheduled", "block.allocated", "block.freed"])
def test_a_hook_that_raises_keyboard_interrupt_in_another_thread_stops_that_threads_call(point: str) -> None:
    """The same from a generate() in a thread that is not the main one (where no Ctrl-C ever
    arrives, so nothing was held there): that thread's call raises the hook's exception, the
    engine serves on."""
    llm = make_llm(**CONFIG)
    stop, got = KeyboardInterrupt("stop"), []

    def hook(**_) -> None:
        if not got:
            got.append("fired")
            raise stop

    def generate() -> None:
        try:
            llm.generate(PROMPTS, greedy(6), use_tqdm=False)
        except KeyboardInterrupt as exc:
            got.append(exc)

    with llm.hooks({point: hook}):
        thread = threading.Thread(target=generate)
        thread.start()
        thread.join()
    assert got == ["fired", stop]
    assert_healthy(llm)


@pytest.mark.parametrize("call", ["step", "generate"])
def test_ctrl_c_just_after_the_engine_step_loses_no_streamed_output(call: str) -> None:
    """A SIGINT that lands the moment ``LLMEngine.step`` has returned, before ``LLM.step`` or
    ``generate`` has kept its outputs: the call raises KeyboardInterrupt, and the streamed
    request that finished in that step is delivered by the next step, once, with its tokens."""
    llm = make_llm(**CONFIG)
    engine = llm.llm_engine
    rid = llm.add_request([10, 11, 12], greedy(2))
    delivered = llm.step()
    engine_step = engine.step

    def step_then_ctrl_c():
        outputs = engine_step()
        if any(o.request_id == rid and o.finished for o in outputs):
            signal.raise_signal(signal.SIGINT)
        return outputs

    engine.step = step_then_ctrl_c
    with pytest.raises(KeyboardInterrupt):
        llm.step() if call == "step" else llm.generate([[9, 8, 7, 6]], greedy(4), use_tqdm=False)
    del engine.step
    delivered += drain(llm).values()
    final = [o for o in delivered if o.request_id == rid and o.finished]
    assert len(final) == 1 and final[0].outputs[0].token_ids == fresh_tokens([[10, 11, 12]], 2)[0]
    assert_healthy(llm)


@pytest.mark.parametrize("point", ["request.finished", "step.end"])
def test_ctrl_c_in_the_step_that_stops_generate_leaves_no_step_in_flight(point: str) -> None:
    """Async scheduling, a stop token, and a SIGINT in that step: generate raises
    KeyboardInterrupt with nothing in flight (test_generate_leaves_no_step_in_flight_... without
    the Ctrl-C)."""
    llm = make_llm(async_scheduling=True, **CONFIG)
    stop = fresh_tokens([PROMPTS[0]])[0][1]
    with llm.hooks({point: lambda **_: signal.raise_signal(signal.SIGINT)}), pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPTS[0]], greedy(6, stop_token_ids=[stop]), use_tqdm=False)
    assert not llm.has_unfinished_requests() and llm.llm_engine._in_flight is None
    assert_healthy(llm)


@pytest.mark.parametrize("call", ["generate", "step", "add_request", "abort_request", "check_invariants",
                                  "shutdown"])
def test_a_ctrl_c_the_moment_a_call_takes_its_lock_leaves_no_lock_held(
        call: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGINT that lands just as the main thread's call has taken one of the LLM's locks,
    before the ``try`` that would release it: the call raises KeyboardInterrupt and holds
    nothing, so another thread's generate() then runs (it waited for a lock nobody would
    release, and raised after the wait or never returned)."""
    monkeypatch.setattr(llm_module, "STEP_WAIT_S", 2.0)
    llm = make_llm(**CONFIG)
    rid = llm.add_request(PROMPTS[1], greedy(6))

    class SignalledOnTake:
        """The lock, with a SIGINT raised the moment it is taken (once)."""

        def __init__(self, lock) -> None:
            self.lock, self.armed = lock, True

        def acquire(self, *a, **kw) -> bool:
            took = self.lock.acquire(*a, **kw)
            if took and self.armed:
                self.armed = False
                signal.raise_signal(signal.SIGINT)
            return took

        def __getattr__(self, name: str):
            return getattr(self.lock, name)

        def __enter__(self):
            self.acquire()
            return self

        def __exit__(self, *exc) -> None:
            self.lock.release()

    calls = {"generate": lambda: llm.generate(PROMPTS, greedy(6), use_tqdm=False), "step": llm.step,
             "add_request": lambda: llm.add_request([5, 6, 7], greedy(2)),
             "abort_request": lambda: llm.abort_request(rid), "check_invariants": llm.check_invariants,
             "shutdown": llm.shutdown}
    for name in ("_lock", "_step_lock"):
        if name == "_lock" and call not in ("generate", "step"):
            continue
        real = getattr(llm, name)
        setattr(llm, name, SignalledOnTake(real))
        with pytest.raises(KeyboardInterrupt):
            calls[call]()
        setattr(llm, name, real)
        got, errors = [], []

        def other() -> None:
            try:
                got.append(token_ids(llm.generate(PROMPTS, greedy(6), use_tqdm=False)))
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=other)
        thread.start()
        thread.join(20)
        assert not thread.is_alive() and not errors, (name, errors)
        assert got == [fresh_tokens(PROMPTS)], name
    drain(llm)
    assert_healthy(llm)


def test_a_ctrl_c_held_in_the_main_thread_never_reaches_another_threads_generate() -> None:
    """While the main thread holds a Ctrl-C (inside an engine call), a generate() in another
    thread runs to its tokens: the held signal is the main thread's alone."""
    llm = make_llm(**CONFIG)
    results = []
    with pytest.raises(KeyboardInterrupt), deferred_interrupts():
        signal.raise_signal(signal.SIGINT)
        thread = threading.Thread(target=lambda: results.append(llm.generate(PROMPTS, greedy(6), use_tqdm=False)))
        thread.start()
        thread.join()
    assert [token_ids(r) for r in results] == [fresh_tokens(PROMPTS)]
    assert_healthy(llm)


# ------------------------------------------------------------------ case 7
def test_a_streamed_request_that_finishes_inside_generate_arrives_from_the_next_step() -> None:
    llm = make_llm(**CONFIG)
    rid = llm.add_request([10, 11, 12], greedy(2))
    outs = llm.generate(PROMPTS, greedy(6), use_tqdm=False)
    assert token_ids(outs) == fresh_tokens(PROMPTS)
    assert llm.has_unfinished_requests()  # its output has not been delivered yet
    delivered = [o for o in llm.step() if o.request_id == rid]
    assert len(delivered) == 1 and delivered[0].finished
    assert delivered[0].outputs[0].token_ids == fresh_tokens([[10, 11, 12]], 2)[0]
    assert_healthy(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_steps_from_step_end_during_generate_leave_generate_its_outputs(async_scheduling: bool) -> None:
    """A ``step.end`` hook streams with ``LLM.step()`` while generate() runs: generate gets every
    one of its outputs, the hook's steps only the streamed request's, which arrives finished once."""
    llm = make_llm(async_scheduling=async_scheduling, **CONFIG)
    rid = llm.add_request([10, 11, 12], greedy(2))
    streamed, inside = [], []

    def step_again(info) -> None:
        if not inside:  # (not from the step.end of its own step)
            inside.append(True)
            streamed.extend(llm.step())
            inside.clear()

    with llm.hooks({"step.end": step_again}):
        outs = llm.generate(PROMPTS, greedy(6), use_tqdm=False)
    assert token_ids(outs) == fresh_tokens(PROMPTS)
    streamed += drain(llm).values()
    assert {o.request_id for o in streamed} == {rid}
    final = [o for o in streamed if o.finished]
    assert len(final) == 1 and final[0].outputs[0].token_ids == fresh_tokens([[10, 11, 12]], 2)[0]
    assert_healthy(llm)


def test_an_id_whose_final_output_waits_for_step_is_not_given_to_a_new_request() -> None:
    """A streamed request finishes while generate() runs, under an id automatic ids reach
    later: until step() delivers it, the id is taken (adding it again is refused, the next
    generate() skips it), and its output arrives intact."""
    llm = make_llm(**CONFIG)
    first = llm.generate([PROMPTS[0]], greedy(6), use_tqdm=False)[0].request_id
    rid = str(int(first) + 3)
    llm.add_request([10, 11, 12], greedy(2), request_id=rid)
    llm.generate([PROMPTS[0]], greedy(6), use_tqdm=False)  # (rid finishes inside)
    with pytest.raises(ValueError, match=f"request_id '{rid}' is already in use"):
        llm.add_request([1, 2], greedy(2), request_id=rid)
    assert token_ids(llm.generate(PROMPTS, greedy(6), use_tqdm=False)) == fresh_tokens(PROMPTS)
    final = drain(llm)
    assert list(final) == [rid] and final[rid].outputs[0].token_ids == fresh_tokens([[10, 11, 12]], 2)[0]
    assert_healthy(llm)


def test_generate_beside_another_threads_add_request_waits_for_it_rather_than_refusing() -> None:
    """Another thread's ``add_request`` is inside its transition (held there by a
    ``request.added`` hook) when this thread calls ``generate``: generate waits for it and runs;
    only a call from inside a hook of this very thread's step is refused."""
    llm = make_llm(**CONFIG)
    inside, leave, added = threading.Event(), threading.Event(), []

    def hold(**_: object) -> None:
        inside.set()
        leave.wait(10)

    handle = llm.hooks.add("request.added", hold)
    adder = threading.Thread(target=lambda: added.append(llm.add_request(PROMPTS[1], greedy(6))))
    adder.start()
    assert inside.wait(10)
    handle.remove()
    threading.Timer(0.3, leave.set).start()
    try:
        got = token_ids(llm.generate(PROMPTS, greedy(6), use_tqdm=False))
    finally:
        leave.set()
        adder.join(10)
    assert got == fresh_tokens(PROMPTS) and len(added) == 1
    drain(llm)
    assert_healthy(llm)


@pytest.mark.parametrize("stop", ["KeyboardInterrupt", "SystemExit", "SIGINT"])
def test_an_engine_stopped_by_a_hooks_keyboard_interrupt_is_freed_by_del_alone(stop: str) -> None:
    """After a hook's ``KeyboardInterrupt`` (or ``SystemExit``, or a real Ctrl-C) stopped
    ``generate``, ``del llm`` frees the engine at once, as it does after a call that ran to its
    end: the held exception used to reach itself through its traceback's frame, a cycle only
    the garbage collector broke, so the engine's pool (and a tensor-parallel engine's workers)
    stayed held until it ran."""
    kind = SystemExit if stop == "SystemExit" else KeyboardInterrupt

    def hook(**_) -> None:
        if stop == "SIGINT":
            signal.raise_signal(signal.SIGINT)
        else:
            raise kind("stop")

    gc.collect()
    gc.disable()
    try:
        llm = make_llm(**CONFIG)
        with llm.hooks({"step.scheduled": hook}):
            try:
                llm.generate(PROMPTS, greedy(4), use_tqdm=False)
            except kind:
                pass
        engine = weakref.ref(llm.llm_engine)
        del llm
        assert engine() is None
    finally:
        gc.enable()


def test_check_invariants_from_a_block_hook_says_the_tables_are_mid_change() -> None:
    """A block event fires half-way through the block manager's change (a block taken before its
    table holds it, freed before its request leaves the queues), where the validator's tables
    disagree by design: a check from that hook says so by name instead of raising an
    InvariantError for an engine that is fine. From every other hook point it checks at once."""
    llm = make_llm(**CONFIG)
    outcomes: dict[str, list[BaseException | None]] = {p: [] for p in HOOK_POINTS}

    def checker(point: str):
        def hook(**_: Any) -> None:
            try:
                llm.check_invariants()
                outcomes[point].append(None)
            except Exception as exc:
                outcomes[point].append(exc)
        return hook

    with llm.hooks([(p, checker(p)) for p in HOOK_POINTS]):
        outs = llm.generate(PROMPTS, greedy(6), use_tqdm=False)
        llm.reset_prefix_cache()
    assert all(outcomes.values()), [p for p, o in outcomes.items() if not o]  # every point fired
    for point, seen in outcomes.items():
        if point.startswith("block."):
            assert all(isinstance(e, RuntimeError) and not isinstance(e, InvariantError)
                       and repr(point) in str(e) for e in seen), (point, seen[:2])
        else:
            assert seen == [None] * len(seen), (point, seen[:2])
    assert token_ids(outs) == fresh_tokens(PROMPTS)
    assert_healthy(llm)
