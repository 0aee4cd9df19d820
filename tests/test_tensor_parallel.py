"""Tensor parallelism on CPU (gloo): TP=2 gives TP=1's greedy tokens, under every scheduler
feature; failures surface as exceptions, not hangs; nothing outlives the engine.

Each TP=2 engine spawns one worker process (about two seconds of imports), so the tests share
workloads and check several things per engine.
"""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from engine_helpers import greedy, make_llm, token_ids
from kvscope import LLM, SamplingParams
from kvscope.distributed.channel import NAME_PREFIX, ChannelWriter
from kvscope.distributed.executor import TensorParallelError
from kvscope.model_source import BUNDLED_MODEL
from tiny_models import ARCHS, load_hf_model, tiny_checkpoint

SHM = Path("/dev/shm")
HANG_S = 60  # a failure must surface well within this; past it the test fails instead of hanging


def _workload() -> tuple[list[list[int]], list]:
    """Six prompts over the tiny models' 320-token vocabulary, sharing prefixes of varied length."""
    rng = random.Random(11)
    shared = [rng.randrange(3, 320) for _ in range(19)]
    prompts = [shared[: rng.randrange(0, 19)] + [rng.randrange(3, 320) for _ in range(rng.randrange(1, 25))]
               for _ in range(6)]
    return prompts, [greedy(rng.randrange(4, 14)) for _ in prompts]


def _shm() -> set[str]:
    return set(os.listdir(SHM))


def _within(seconds: float, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a thread; fail the test (rather than hang CI) if it takes longer."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised in the test's thread
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"still running after {seconds} s: a tensor-parallel failure hung")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _assert_released(llm: LLM, created: set[str]) -> None:
    """Every worker has exited and every shared-memory name this engine created is gone."""
    procs = llm.llm_engine.executor._ranks.procs
    assert procs and not any(p.is_alive() for p in procs)
    assert not [p for p in mp.active_children() if p in procs]
    assert not created & _shm(), f"left behind in /dev/shm: {sorted(created & _shm())}"


def _created_by(llm: LLM, before: set[str]) -> set[str]:
    """The /dev/shm names this live engine made: its channel segments and its doorbell
    semaphores (by name, so another process's names never count: tests may run side by side)."""
    ranks = llm.llm_engine.executor._ranks
    bells = {"sem." + bell._semlock.name.lstrip("/") for bell in ranks.doorbells}
    created = {n for n in _shm() - before if n.startswith(ranks.channel.base) or n in bells}
    assert any(n.startswith(ranks.channel.base) for n in created) and bells <= created
    return created


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_outputs_match_single_rank(arch: str) -> None:
    prompts, params = _workload()
    single = make_llm(arch, num_kv_blocks=64)
    expected = token_ids(single.generate(prompts, params, use_tqdm=False))
    before = _shm()
    with make_llm(arch, tensor_parallel_size=2, num_kv_blocks=64) as llm:
        created = _created_by(llm, before)
        with llm.record(level="summary") as trace:
            assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected
        shards = llm.llm_engine.executor.kv_shards()
        # (the same line as TP=1's but for the rank count)
        assert repr(llm) == repr(single).replace(" on cpu:", " on cpu (TP=2):")
    assert trace.kv_shards.to_dict("records") == shards  # the trace shows the per-rank layout
    _assert_released(llm, created)
    # 2 KV heads: one per rank, each holding half of what the single rank's pool holds
    (whole,) = single.llm_engine.executor.kv_shards()
    assert [(s["rank"], s["kv_head_start"], s["kv_head_end"], s["num_kv_heads"]) for s in shards] == \
        [(0, 0, 1, 1), (1, 1, 2, 1)]
    assert all(s["num_blocks"] == 64 and 2 * s["bytes"] == whole["bytes"] for s in shards)


@pytest.mark.skipif(not (BUNDLED_MODEL / "config.json").exists(),
                    reason=f"the bundled demo model is not built yet ({BUNDLED_MODEL})")
def test_bundled_model_matches_single_rank() -> None:
    prompts = ["def fibonacci(n):", "The list type supports", "import os\nimport sys\n\n"]
    kw = dict(device="cpu", dtype="float32", num_kv_blocks=128)
    params = greedy(24)
    expected = token_ids(LLM(**kw).generate(prompts, params, use_tqdm=False))
    with LLM(tensor_parallel_size=2, **kw) as llm:
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prefix_caching_chunked_prefill_and_preemption_match_single_rank(async_scheduling: bool) -> None:
    """A pool of 16 four-token blocks, a 16-token budget and two rounds of the same prompts:
    chunked prefills, preemptions and prefix-cache hits all happen under TP=2. With async
    scheduling every decode input of the worker is a placeholder it fills from the tokens rank
    0 broadcast for the step before; the tokens are TP=1's synchronous ones all the same."""
    config = dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=16, enable_prefix_caching=True)
    prompts, params = _workload()
    plain = token_ids(make_llm(block_size=16).generate(prompts, params, use_tqdm=False))
    single = make_llm(**config)
    expected = [token_ids(single.generate(prompts, params, use_tqdm=False)) for _ in range(2)]
    assert expected == [plain, plain]
    with make_llm(tensor_parallel_size=2, async_scheduling=async_scheduling, **config) as llm:
        preempted: list[str] = []
        scheduled: list = []
        llm.hooks.add("request.preempted", lambda request_id, **_: preempted.append(request_id))
        llm.hooks.add("step.scheduled", lambda scheduler_output, **_: scheduled.extend(scheduler_output.requests))
        first = llm.generate(prompts, params, use_tqdm=False)
        second = llm.generate(prompts, params, use_tqdm=False)
        assert [token_ids(first), token_ids(second)] == expected
    assert preempted, "the pool was meant to be small enough to force preemption"
    assert any(r.is_prefill and not r.sample for r in scheduled), "no prefill was chunked"
    assert any(o.num_cached_tokens for o in second), "the second round hit no cached prefix"


def test_kv_heads_not_divisible_by_tp_is_refused_before_spawning() -> None:
    children = mp.active_children()
    with pytest.raises(ValueError, match=r"num_key_value_heads=2 not divisible by 4"):
        make_llm("qwen3", tensor_parallel_size=4)
    assert mp.active_children() == children


@pytest.mark.parametrize("tie", [False, True])
def test_vocabulary_not_divisible_by_tp_is_padded_and_matches_single_rank_and_transformers(tie: bool) -> None:
    """Vocab 321 at TP=2: each rank holds 161 rows, rank 1's last one padding. Greedy tokens equal
    TP=1's and transformers'; the logprobs cover exactly the 321 real ids with TP=1's values, so
    the padding column was neither sampled nor normalised over."""
    vocab = 321
    path = tiny_checkpoint("qwen3", tie, vocab_size=vocab)
    prompts, _ = _workload()
    params = greedy(8, logprobs=vocab)
    kw = dict(device="cpu", dtype="float32", num_kv_blocks=64, max_logprobs=-1)
    single = LLM(str(path), **kw).generate(prompts, params, use_tqdm=False)
    with LLM(str(path), tensor_parallel_size=2, **kw) as llm:
        sharded = llm.generate(prompts, params, use_tqdm=False)
    hf = load_hf_model(path)
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        reference = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=8, do_sample=False, pad_token_id=2)[0, len(p):].tolist()
                     for p in prompts]
    assert token_ids(sharded) == token_ids(single) == reference
    for one, two in zip(single, sharded):
        for lp1, lp2 in zip(one.outputs[0].logprobs, two.outputs[0].logprobs):
            assert sorted(lp2) == list(range(vocab))
            assert max(abs(lp1[t] - lp2[t]) for t in lp1) < 1e-4


_ECHO_READER = """
import hashlib
from kvscope.distributed.channel import ChannelReader
reader = ChannelReader(name, doorbell)
while True:
    got, payload = reader.receive(30.0)
    if got:
        reply.send((len(payload), hashlib.sha256(payload).hexdigest(), reader.generation))
"""


def test_channel_grows_for_commands_far_above_1_mib() -> None:
    ctx = mp.get_context("spawn")
    doorbell = ctx.Semaphore(0)
    receive, send = ctx.Pipe(duplex=False)
    writer = ChannelWriter([doorbell])
    # the reader runs as a code string, so the child imports the channel and nothing heavy
    reader = ctx.Process(target=exec, args=(_ECHO_READER, dict(name=writer.name, doorbell=doorbell, reply=send)))
    reader.start()
    try:
        for size, generation in ((10, 0), (3 << 20, 1), (40 << 20, 2), (1000, 2)):
            payload = os.urandom(size)
            writer.send(payload)
            assert receive.poll(HANG_S), "the reader did not answer"
            assert receive.recv() == (size, hashlib.sha256(payload).hexdigest(), generation)
        assert writer.shm.size >= 40 << 20
        assert sorted(n for n in _shm() if n.startswith(writer.base)) == [f"{writer.base}_2"]
        # a reader killed while it waits must not wedge the writer (a multiprocessing.Event would)
        reader.kill()
        reader.join()
        _within(HANG_S, lambda: writer.send(b"nobody listens"))
    finally:
        writer.close()
        if reader.is_alive():
            reader.kill()
    assert not [n for n in _shm() if n.startswith(writer.base)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_killed_worker_makes_generate_raise_not_hang_and_spares_other_engines(async_scheduling: bool) -> None:
    """Two TP engines share this process and host (own groups, ports and channels); killing one's
    worker fails that engine's next step within seconds and leaves the other one working (under
    async scheduling too, where a step's ``done`` is collected when the next one is sent)."""
    prompts, params = _workload()
    before = _shm()
    with make_llm(tensor_parallel_size=2, num_kv_blocks=64, async_scheduling=async_scheduling) as llm, \
            make_llm(tensor_parallel_size=2, num_kv_blocks=64) as other:
        created = _created_by(llm, before)
        expected = token_ids(other.generate(prompts, params, use_tqdm=False))
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected
        (worker,) = llm.llm_engine.executor._ranks.procs
        os.kill(worker.pid, signal.SIGKILL)
        with pytest.raises(TensorParallelError, match=r"rank 1 .* killed by SIGKILL"):
            _within(HANG_S, lambda: llm.generate(prompts, params, use_tqdm=False))
        with pytest.raises(TensorParallelError, match="is down"):
            llm.generate(prompts, params, use_tqdm=False)
        assert token_ids(other.generate(prompts, params, use_tqdm=False)) == expected
    _assert_released(llm, created)
    _assert_released(other, created)


def test_worker_exception_is_raised_in_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make rank 0 send block ids past the end of the pool: the worker's indexing error must
    come back as the caller's exception, traceback included."""
    from kvscope.distributed import executor as tp_executor

    prompts, params = _workload()
    before = _shm()
    with make_llm(tensor_parallel_size=2, num_kv_blocks=64) as llm:
        created = _created_by(llm, before)
        encode = tp_executor.encode_step

        def out_of_pool(out):
            msg = encode(out)
            msg.table_entries += 10_000
            return msg

        monkeypatch.setattr(tp_executor, "encode_step", out_of_pool)
        with pytest.raises(TensorParallelError, match=r"(?si)rank 1 .* raised:.*out of (range|bounds)"):
            _within(HANG_S, lambda: llm.generate(prompts, params, use_tqdm=False))
    _assert_released(llm, created)


_EXIT_WITHOUT_SHUTDOWN = """
import json, os, sys, weakref
import torch
torch.set_num_threads(1)
from kvscope import LLM, SamplingParams

class Box:
    procs = []

def report():
    prefix = f"kvscope_tp_{os.getpid()}_"
    print("REPORT " + json.dumps(dict(
        exitcodes=[p.exitcode for p in Box.procs],
        shm=[n for n in os.listdir("/dev/shm") if n.startswith(prefix)])), flush=True)

box = Box()
weakref.finalize(box, report)  # created before the engine's finalizer, so it runs after it
llm = LLM(sys.argv[1], device="cpu", dtype="float32", num_kv_blocks=16, tensor_parallel_size=2)
params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
assert len(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
Box.procs = list(llm.llm_engine.executor._ranks.procs)
# no shutdown: interpreter exit must end the worker and unlink the channel
"""


def test_interpreter_exit_ends_workers_and_unlinks_shared_memory() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_EXIT_WITHOUT_SHUTDOWN), str(tiny_checkpoint("qwen3"))],
        capture_output=True, text=True, timeout=HANG_S * 2,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
    )
    assert proc.returncode == 0, proc.stderr
    (report,) = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert report == 'REPORT {"exitcodes": [0], "shm": []}', report
    assert "leaked" not in proc.stderr, proc.stderr  # the resource tracker found nothing to clean


def _greedy_stopping(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=[7, 11], min_tokens=max_tokens // 2)


def test_async_tp_matches_single_rank_with_seeded_sampling_stops_logprobs_and_an_abort() -> None:
    """Async TP=2 against synchronous TP=1: seeded random rows (the worker never samples, so its
    next inputs must be rank 0's draws), greedy rows that stop on a token, logprobs; then a hook
    aborts a request mid-run and the engine serves the same tokens again. The greedy rows hold
    back their stop tokens for half their tokens (``min_tokens``), on rank 0 alone."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randrange(2, 30))] for _ in range(10)]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=rng.randrange(5, 40), logprobs=2) if i % 2
              else _greedy_stopping(rng.randrange(5, 40)) for i in range(10)]
    config = dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=24, max_num_seqs=4)
    expected = make_llm(**config).generate(prompts, params, use_tqdm=False)
    with make_llm(tensor_parallel_size=2, async_scheduling=True, **config) as llm:
        out = llm.generate(prompts, params, use_tqdm=False)
        assert token_ids(out) == token_ids(expected)
        assert [o.outputs[0].finish_reason for o in out] == [o.outputs[0].finish_reason for o in expected]
        for ours, ref in zip(out, expected):
            for a, b in zip(ours.outputs[0].logprobs or (), ref.outputs[0].logprobs or ()):
                assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)

        ids: list[str] = []

        def abort_first(info) -> None:
            if info.step >= 3 and ids[0] in llm.llm_engine.requests:
                llm.abort_request(ids[0])

        with llm.hooks({"step.end": abort_first}):
            ids += [llm.add_request(p, sp) for p, sp in zip(prompts[:4], params[:4])]
            finished = {}
            while llm.has_unfinished_requests():
                finished.update({o.request_id: o.outputs[0].finish_reason for o in llm.step() if o.finished})
        assert finished[ids[0]] == "abort" and set(finished) == set(ids)
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == token_ids(expected)
        llm.check_invariants()


def test_ctrl_c_while_shutdown_waits_for_a_worker_still_releases_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C landing while shutdown() waits for a worker to leave (a second one, say, as a
    ``with LLM(...)`` block exits after the first) is raised once the workers, rank 0's shard and
    the shared memory are released. Landing half-way, it left the channel linked and rank 0's
    weights and KV pool held for good: the engine was already marked closed."""
    before = _shm()
    llm = make_llm(tensor_parallel_size=2, num_kv_blocks=16)
    created = _created_by(llm, before)
    ranks = llm.llm_engine.executor._ranks
    (worker,) = ranks.procs
    join = worker.join

    def interrupted_join(timeout: float | None = None) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        join(timeout)

    monkeypatch.setattr(worker, "join", interrupted_join)
    with pytest.raises(KeyboardInterrupt):
        llm.shutdown()
    _assert_released(llm, created)
    assert ranks.runner is None


@pytest.mark.parametrize("workers_too", [False, True], ids=["rank 0 alone", "every rank"])
def test_ctrl_c_as_a_worker_is_spawned_raises_keyboard_interrupt_and_leaves_no_worker(
        monkeypatch: pytest.MonkeyPatch, workers_too: bool) -> None:
    """A Ctrl-C right as LLM() spawns its worker: a notebook's interrupt reaches rank 0 alone, a
    terminal's every process of its group, killing the worker still starting. Either way LLM()
    raises KeyboardInterrupt, not a TensorParallelError blaming the worker the Ctrl-C killed, and
    neither the worker nor the channel outlives it. Landing between the spawn and its record, the
    Ctrl-C left that worker starting up unseen by the teardown."""
    process = type(mp.get_context("spawn").Process())
    start = process.start
    spawned: list[mp.process.BaseProcess] = []

    def interrupted_start(self: mp.process.BaseProcess) -> None:
        start(self)
        spawned.append(self)
        if workers_too:
            os.kill(self.pid, signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(process, "start", interrupted_start)
    with pytest.raises(KeyboardInterrupt):
        make_llm(tensor_parallel_size=2, num_kv_blocks=16)  # (in this thread: only it gets the Ctrl-C)
    (worker,) = spawned
    assert not worker.is_alive()
    assert not [n for n in _shm() if n.startswith(f"{NAME_PREFIX}{os.getpid()}_")]
