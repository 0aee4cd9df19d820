"""``SamplingParams(n=k)``: k child requests of one prompt behind one request, as in vLLM V1.

The truth each test checks against is the same work asked for another way: child i of a
seeded request equals a request of its own with ``seed + i``, and a greedy child equals the
greedy request; aborts and Ctrl-C leave the engine as a fresh one.
"""
from __future__ import annotations

import signal

import pytest

from engine_helpers import drain, greedy, make_llm, token_ids
from kvscope import SamplingParams

PROMPTS = [[3, 4, 5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]
CONFIG = dict(block_size=4, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=16)


def sampled(n: int = 1, seed: int | None = 7, max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, top_k=50, seed=seed, max_tokens=max_tokens, ignore_eos=True)


def completions(out) -> list[list[int]]:
    assert [c.index for c in out.outputs] == list(range(len(out.outputs)))
    return [c.token_ids for c in out.outputs]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_each_child_equals_a_request_of_its_own_with_seed_plus_its_index(async_scheduling, enable_prefix_caching):
    llm = make_llm(**CONFIG, async_scheduling=async_scheduling, enable_prefix_caching=enable_prefix_caching)
    outs = llm.generate(PROMPTS, sampled(n=3), use_tqdm=False)
    alone = make_llm(**CONFIG)
    for prompt, out in zip(PROMPTS, outs):
        assert out.finished and out.prompt_token_ids == prompt
        singles = alone.generate([prompt] * 3, [sampled(seed=7 + i) for i in range(3)], use_tqdm=False)
        assert completions(out) == token_ids(singles)
    assert len({tuple(t) for t in completions(outs[0])}) > 1  # (the seeds do differ)


def test_top_k_1_children_each_equal_the_greedy_request():
    """(Greedy refuses n > 1, as vLLM does; ``greedy(6, n=2)`` draws at top_k=1.)"""
    llm = make_llm(**CONFIG)
    outs = llm.generate(PROMPTS, greedy(6, n=2), use_tqdm=False)
    single = token_ids(make_llm(**CONFIG).generate(PROMPTS, greedy(6), use_tqdm=False))
    assert [completions(o) for o in outs] == [[t, t] for t in single]


def test_children_are_requests_of_their_own_that_share_the_prompt_blocks():
    """The scope sees the children (vLLM's ids ``{index}_{parent}``); the later children take
    the prompt's full blocks from the prefix cache."""
    llm = make_llm(**CONFIG)
    added, cached = [], {}
    with llm.hooks({"request.added": lambda request_id, **_: added.append(request_id),
                    "request.finished": lambda request_id, metrics, **_: cached.__setitem__(
                        request_id, metrics.num_cached_tokens)}):
        llm.llm_engine.add_request(PROMPTS[0], sampled(n=3), request_id="p")
        drain(llm)
    assert added == ["0_p", "1_p", "2_p"]
    full = len(PROMPTS[0]) // CONFIG["block_size"] * CONFIG["block_size"]
    assert cached["0_p"] == 0 and cached["1_p"] == cached["2_p"] == full


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_streamed_parent_reports_every_childs_latest_completion(async_scheduling):
    llm = make_llm(**CONFIG, async_scheduling=async_scheduling)
    rid = llm.add_request(PROMPTS[0], sampled(n=3))
    seen = []
    while llm.has_unfinished_requests():
        seen += [o for o in llm.step() if o.request_id == rid]
    assert seen and [o.finished for o in seen] == [False] * (len(seen) - 1) + [True]
    lengths = [[len(c.token_ids) for c in o.outputs] for o in seen]
    assert lengths == sorted(lengths) and lengths[-1] == [6, 6, 6]
    final = make_llm(**CONFIG).generate([PROMPTS[0]], sampled(n=3), use_tqdm=False)[0]
    assert completions(seen[-1]) == completions(final)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_aborting_a_parent_aborts_every_child_and_reports_it_once(async_scheduling):
    llm = make_llm(**CONFIG, async_scheduling=async_scheduling)
    rid = llm.add_request(PROMPTS[0], sampled(n=3))
    other = llm.add_request(PROMPTS[1], sampled())
    llm.step()
    llm.step()
    llm.abort_request(rid)
    final = drain(llm)
    assert set(final) == {rid, other}
    assert [c.finish_reason for c in final[rid].outputs] == ["abort"] * 3
    assert final[other].outputs[0].token_ids == token_ids(make_llm(**CONFIG).generate([PROMPTS[1]], sampled(),
                                                                                     use_tqdm=False))[0]
    _assert_fresh(llm)


def test_a_taken_child_id_refuses_the_whole_request():
    llm = make_llm(**CONFIG)
    llm.add_request(PROMPTS[1], sampled(), request_id="1_p")
    with pytest.raises(ValueError, match="'1_p' is already in use"):
        llm.add_request(PROMPTS[0], sampled(n=3), request_id="p")
    assert list(llm.llm_engine.requests) == ["1_p"]
    drain(llm)
    _assert_fresh(llm)


@pytest.mark.parametrize("taken", ["p", "1_p"])
def test_ids_of_a_request_being_added_are_taken_before_its_first_request_added_hook(taken):
    """A ``request.added`` hook of the first child adds a request under the parent's id or a
    later child's: refused, and the parent's children equal their own requests."""
    llm = make_llm(**CONFIG)
    refused = []

    def added(request_id, **_) -> None:
        if request_id == "0_p" and not refused:
            with pytest.raises(ValueError, match=f"'{taken}' is already in use"):
                llm.add_request(PROMPTS[1], sampled(), request_id=taken)
            refused.append(taken)

    with llm.hooks({"request.added": added}):
        llm.add_request(PROMPTS[0], sampled(n=3), request_id="p")
    assert refused == [taken]
    final = drain(llm)
    assert list(final) == ["p"]
    own = [token_ids(make_llm(**CONFIG).generate([PROMPTS[0]], sampled(seed=7 + i), use_tqdm=False))[0]
           for i in range(3)]
    assert completions(final["p"]) == own
    _assert_fresh(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_finished_childs_id_stays_taken_until_its_parent_is_reported(async_scheduling):
    """Child 0 stops on its first token while child 1 runs on: a new request may not take
    child 0's id, which would merge its tokens into the parent; once the parent's last output is
    out, the id is free."""
    llm = make_llm(**CONFIG, async_scheduling=async_scheduling)
    free_run = completions(make_llm(**CONFIG).generate([PROMPTS[0]], sampled(n=2, max_tokens=8), use_tqdm=False)[0])
    params = SamplingParams(n=2, temperature=1.0, top_k=50, seed=7, max_tokens=8, ignore_eos=True,
                   stop_token_ids=[free_run[0][0]])
    assert free_run[1][0] != free_run[0][0]  # (so child 1 runs on after child 0 stopped)
    llm.add_request(PROMPTS[0], params, request_id="p")
    reported = []
    while not any(c.index == 0 and c.finish_reason for o in reported for c in o.outputs):
        reported += llm.step()
    assert llm.has_unfinished_requests()
    with pytest.raises(ValueError, match="'0_p' is already in use"):
        llm.add_request(PROMPTS[1], sampled(), request_id="0_p")
    reported += drain(llm).values()
    stop = free_run[0][0]
    child1 = free_run[1][: free_run[1].index(stop) + 1] if stop in free_run[1] else free_run[1]
    assert completions(reported[-1]) == [[stop], child1]
    assert {o.request_id for o in reported} == {"p"}
    llm.add_request(PROMPTS[1], sampled(), request_id="0_p")
    assert set(drain(llm)) == {"0_p"}
    _assert_fresh(llm)


@pytest.mark.parametrize("n", [1, 2])
def test_automatic_ids_pass_over_the_ids_a_caller_chose(n):
    """``generate`` numbers its requests itself: a streamed request whose id (or, for ``n=2``, a
    child's) looks like the next number keeps its outputs, and generate gets its own."""
    llm = make_llm(**CONFIG)
    llm.add_request(PROMPTS[0], sampled(n=2), request_id="0")
    llm.add_request(PROMPTS[0], sampled(), request_id="0_1")
    got = llm.generate([PROMPTS[1]], sampled(n=n), use_tqdm=False)[0]
    assert got.prompt_token_ids == PROMPTS[1]
    alone = make_llm(**CONFIG)
    assert completions(got) == completions(alone.generate([PROMPTS[1]], sampled(n=n), use_tqdm=False)[0])
    streamed = drain(llm)
    assert set(streamed) == {"0", "0_1"}
    assert completions(streamed["0"]) == completions(alone.generate([PROMPTS[0]], sampled(n=2), use_tqdm=False)[0])
    _assert_fresh(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_abort_that_a_request_finished_hook_takes_back_reports_nothing(async_scheduling):
    """``abort_request("p")`` finishes child 0 first; its ``request.finished`` hook aborts "p"
    again with ``report=False``, which takes back the report of the whole parent."""
    llm = make_llm(**CONFIG, async_scheduling=async_scheduling)
    llm.add_request(PROMPTS[0], sampled(n=2), request_id="p")
    llm.step()
    taken_back = []

    def hook(**_) -> None:
        if not taken_back:
            taken_back.append(llm.llm_engine.abort_request("p", report=False))

    with llm.hooks({"request.finished": hook}):
        llm.abort_request("p")
        assert drain(llm) == {} and taken_back
    _assert_fresh(llm)


@pytest.mark.parametrize("n", [0, -1, 1.5, "2"])
def test_an_n_changed_after_the_params_were_built_is_refused_when_added(n):
    llm = make_llm(**CONFIG)
    params = sampled(n=2)
    params.n = n
    with pytest.raises(ValueError, match=f"n must be an integer >= 1, got {n!r}"):
        llm.add_request(PROMPTS[0], params)
    with pytest.raises(ValueError, match="n must be"):
        llm.generate(PROMPTS, params, use_tqdm=False)
    _assert_fresh(llm)


@pytest.mark.parametrize("n", [CONFIG["num_kv_blocks"] + 1, 2**63])
def test_more_children_than_kv_blocks_is_refused_at_once(n):
    llm = make_llm(**CONFIG)
    with pytest.raises(ValueError, match=f"n={n} exceeds the KV pool's num_kv_blocks={CONFIG['num_kv_blocks']}"):
        llm.add_request(PROMPTS[0], sampled(n=n))
    _assert_fresh(llm)


@pytest.mark.parametrize("hook_point", ["request.added", "step.end"])
def test_ctrl_c_while_adding_or_generating_children_leaves_nothing_behind(hook_point):
    """A real SIGINT at the second child's ``request.added`` (the parent is undone whole) or at
    a step of ``generate`` (the call's parents and all their children are aborted)."""
    llm = make_llm(**CONFIG)
    calls = [0]

    def hook(**_) -> None:
        calls[0] += 1
        if calls[0] == 2:
            signal.raise_signal(signal.SIGINT)

    with llm.hooks({hook_point: hook}), pytest.raises(KeyboardInterrupt):
        if hook_point == "request.added":
            llm.add_request(PROMPTS[0], sampled(n=3))
        else:
            llm.generate(PROMPTS, sampled(n=3), use_tqdm=False)
    assert not llm.has_unfinished_requests() and not llm.step()
    _assert_fresh(llm)


def _assert_fresh(llm) -> None:
    """Nothing left: no request, every block free, the validator passes, and a parent run now
    gives what a fresh engine gives."""
    engine = llm.llm_engine
    assert not engine.requests and not llm.has_unfinished_requests()
    llm.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    again = [completions(o) for o in llm.generate(PROMPTS, sampled(n=2), use_tqdm=False)]
    assert again == [completions(o) for o in make_llm(**CONFIG).generate(PROMPTS, sampled(n=2), use_tqdm=False)]


def test_a_recording_of_children_replays_the_pool_it_snapshots():
    """The blocks recording of a run with shared prompt blocks (refcounts above 1) rebuilds, from
    its block events, the pool the full recording snapshots at every step."""
    llm = make_llm(**CONFIG)
    with llm.record("full") as full, llm.record("blocks") as blocks:
        llm.generate(PROMPTS, sampled(n=3), use_tqdm=False)
    assert set(blocks.requests["request_id"]) == {f"{i}_{p}" for i in range(3) for p in range(len(PROMPTS))}
    assert max(full.pool_arrays(s)["ref_count"].max() for s in full.step_ids) > 1
    for step in blocks.step_ids:
        snap, replay = full.pool_arrays(step), blocks.pool_arrays(step)
        for k in ("ref_count", "block_hash", "num_tokens"):
            assert (snap[k] == replay[k]).all(), (k, step)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_children_preempted_from_shared_blocks_still_equal_their_own_requests(async_scheduling):
    """A pool too small for all children at once: children holding shared prompt blocks are
    preempted and resumed, and each still draws what a request of its own draws."""
    small = dict(block_size=4, num_kv_blocks=10, max_num_seqs=6, max_num_batched_tokens=32)
    llm = make_llm(**small, async_scheduling=async_scheduling)
    preempted = []
    with llm.hooks({"request.preempted": lambda request_id, **_: preempted.append(request_id)}):
        outs = llm.generate(PROMPTS, sampled(n=3, max_tokens=10), use_tqdm=False)
    assert preempted, "the pool was meant to be small enough to force preemption"
    alone = make_llm(**CONFIG)
    for prompt, out in zip(PROMPTS, outs):
        singles = alone.generate([prompt] * 3, [sampled(seed=7 + i, max_tokens=10) for i in range(3)], use_tqdm=False)
        assert completions(out) == token_ids(singles)
