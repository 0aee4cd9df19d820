"""The engine on a GPU (skipped without CUDA): against transformers, graphs vs eager, caching on/off.

Token identity runs in fp32 (TF32 off) so that the comparisons test the engine, not bf16
rounding; the bf16 check compares teacher-forced logits with a tolerance.
"""
from __future__ import annotations

import random

import pytest
import torch

from kvscope import LLM, SamplingParams
from kvscope.forward_context import forward_context
from engine_helpers import assert_same_outputs, batch_draws_short_of_memory, run_together
from tiny_models import make_tiny_checkpoint, pack_metadata

pytestmark = pytest.mark.gpu

SHAPE = dict(hidden_size=256, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
             head_dim=64, intermediate_size=512, vocab_size=512, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("gpu") / "qwen3", "qwen3", **SHAPE))


def _prompts(n: int = 12) -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, 512) for _ in range(48)]
    return [shared[: rng.randrange(0, 48)] + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 200))]
            for _ in range(n)]


def _generate(path: str, prompts, max_tokens: int = 48, params: list[SamplingParams] | None = None,
              **config) -> list[list[int]]:
    """Each prompt's tokens on a fresh engine: greedy ``max_tokens``, or ``params``."""
    config.setdefault("dtype", "float32")
    llm = LLM(path, device="cuda", attention_backend="triton", **config)
    llm.llm_engine.validate_every_step = True
    params = params or SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()
    return out


def test_greedy_tokens_match_transformers_on_gpu(checkpoint):
    from transformers import AutoModelForCausalLM

    prompts = _prompts(6)
    ours = _generate(checkpoint, prompts, max_tokens=32, block_size=16)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).cuda().eval()
    hf.generation_config.eos_token_id = None
    for prompt, toks in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=32, do_sample=False,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device="cuda"),
                              pad_token_id=2)
        assert toks == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("block_size", [4, 16, 256])  # (pages of 4: the Triton kernel on sm_90 too)
def test_teacher_forced_logits_close_to_transformers_bf16(checkpoint, block_size):
    """Prefill a prompt in two chunks through the paged pool (bf16) and compare every logit row."""
    from transformers import AutoModelForCausalLM

    llm = LLM(checkpoint, device="cuda", dtype="bfloat16", attention_backend="triton",
              block_size=block_size, num_kv_blocks=128, enforce_eager=True)
    runner = llm.llm_engine.executor
    prompt = _prompts(1)[0] + list(range(3, 120))
    n = len(prompt)
    table = list(range(127, 127 - (-(-n // block_size)), -1))  # fragmented: descending ids
    rows = []
    with torch.inference_mode():
        for start, stop in ((0, n // 3), (n // 3, n)):
            meta, pos = pack_metadata([(start, stop - start, table)], block_size, device="cuda")
            ids = torch.tensor(prompt[start:stop], device="cuda")
            with forward_context(meta):
                rows.append(runner.model.compute_logits(runner.model(ids, pos)))
    ours = torch.cat(rows).float()
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt], device="cuda")).logits[0].float()
    rel = (ours - ref).norm() / ref.norm()
    assert rel < 2e-2, rel
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean()
    assert agree > 0.95, agree


def test_cuda_graphs_match_eager(checkpoint):
    prompts = _prompts()
    eager = _generate(checkpoint, prompts, enforce_eager=True)
    graphs = _generate(checkpoint, prompts, enforce_eager=False)
    assert graphs == eager


def test_programmatic_dependent_launch_changes_no_token(checkpoint, monkeypatch):
    """With PDL a kernel may start while the one before it finishes; each waits before it
    reads, so graphs under async scheduling give the same tokens with it off."""
    from kvscope.kernels import pdl

    prompts = _prompts()
    runs = []
    for on in (False, True):
        monkeypatch.setattr(pdl, "USE_PDL", on)
        runs.append(_generate(checkpoint, prompts, async_scheduling=True, block_size=16))
    assert pdl.pdl_options(torch.device("cuda"))["PDL"] == (torch.cuda.get_device_capability()[0] >= 9)
    assert runs[1] == runs[0]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_cuda_graphs_match_eager_as_the_batch_shrinks(checkpoint, async_scheduling):
    """A graph reads the packed upload in place: the bucket's padding, the placeholder ids filled
    in its buffer (in order, and after rows end), the static tables as they grow and narrow.
    Requests of different lengths end one by one, so most steps are padded to their bucket."""
    prompts = _prompts()
    rng = random.Random(1)
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(4, 60), ignore_eos=True) for _ in prompts]
    runs, used = [], []
    for eager in (True, False):
        llm = LLM(checkpoint, device="cuda", attention_backend="triton", dtype="float32", block_size=4,
                  enforce_eager=eager, async_scheduling=async_scheduling, gpu_memory_utilization=0.3)
        llm.llm_engine.validate_every_step = True
        llm.hooks.add("step.end", lambda info: used.append(info.cuda_graph))
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.shutdown()
    assert runs[1] == runs[0]
    assert sum(used) > 20


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_graphs_draw_the_tokens_eager_sampling_draws(checkpoint, monkeypatch, async_scheduling):
    """With ``CAPTURE_DRAW``, decode graphs end in the LM head and the draw: random rows at
    several temperatures, greedy rows among them, get the tokens of an eager engine's draws, and
    the steps that replayed a graph launched no sampling kernel of their own. A log-probs
    request in the batch sends its steps to the eager draw (which the graphs' step number then
    catches up with): the same tokens again."""
    from kvscope.kernels import triton_sampling as ts
    from kvscope.runner import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "CAPTURE_DRAW", True)
    prompts = _prompts()
    temps = [0.7, 0, 1.3, 0.9]
    plain = [SamplingParams(temperature=temps[i % 4], max_tokens=40, ignore_eos=True) for i in range(len(prompts))]
    with_logprobs = plain[:-1] + [SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True, logprobs=2)]
    launches = []
    sample = ts.sample
    monkeypatch.setattr(ts, "sample", lambda *a, **k: launches.append(1) or sample(*a, **k))
    for params in (plain, with_logprobs):
        runs = []
        for eager in (True, False):
            llm = LLM(checkpoint, device="cuda", attention_backend="triton", dtype="float32", enforce_eager=eager,
                      async_scheduling=async_scheduling, gpu_memory_utilization=0.3)
            graph_steps = []
            llm.hooks.add("step.end", lambda info: graph_steps.append(info.cuda_graph))
            launches.clear()
            runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
            llm.shutdown()
        assert runs[1] == runs[0]
        assert sum(graph_steps) > 20
        if params is plain:
            assert len(launches) <= graph_steps.count(False), (len(launches), graph_steps)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_graphs_hold_back_stop_tokens_until_min_tokens(checkpoint, monkeypatch, async_scheduling):
    """With ``CAPTURE_DRAW``, a step with a row short of its ``min_tokens`` takes the eager draw,
    which holds back that row's stop tokens: stop_token_ids made of the tokens an unconstrained
    run draws most never appear before ``min_tokens``, and the graph engine's tokens equal the
    eager engine's."""
    from collections import Counter

    from kvscope.runner import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "CAPTURE_DRAW", True)
    prompts = _prompts()

    def run(params: list[SamplingParams], eager: bool) -> list[list[int]]:
        return _generate(checkpoint, prompts, params=params, enforce_eager=eager,
                         async_scheduling=async_scheduling, gpu_memory_utilization=0.3)

    free = run([SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True)] * len(prompts), eager=True)
    stops = [t for t, _ in Counter(t for tokens in free for t in tokens).most_common(20)]
    params = [SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, stop_token_ids=stops,
                             min_tokens=10 + i) for i in range(len(prompts))]
    eager, graphs = run(params, eager=True), run(params, eager=False)
    assert graphs == eager
    assert all(not set(tokens[:10 + i]) & set(stops) for i, tokens in enumerate(graphs))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_batch_whose_draw_fails_as_a_whole_loses_no_row_on_gpu(checkpoint, async_scheduling):
    """test_robustness.py's batch fault on the kernels' path, with decode graphs and the pinned
    readback: a draw that fails whenever more than one row draws at once is redone a row at a
    time, so greedy and seeded rows with log-probs draw the tokens and log-probs of the same
    engine without the fault, and the engine serves on."""
    llm = LLM(checkpoint, device="cuda", attention_backend="triton", dtype="float32", enable_prefix_caching=False,
              async_scheduling=async_scheduling, gpu_memory_utilization=0.3)
    llm.llm_engine.validate_every_step = True
    prompts = _prompts(8)
    params = [SamplingParams(temperature=0.8 * (i % 2), seed=i, max_tokens=24, ignore_eos=True, logprobs=i % 3)
              for i in range(len(prompts))]

    def run() -> list:
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]

    want = run()
    with batch_draws_short_of_memory(llm, "_sample_by_kernels") as faults:
        got = run()
    assert faults[0] > 0
    assert_same_outputs(got, want, abs_tol=1e-4)
    assert [o.token_ids for o in run()] == [o.token_ids for o in want]
    llm.shutdown()


def test_decode_graphs_without_the_captured_draw_sample_eagerly(checkpoint, monkeypatch):
    """``CAPTURE_DRAW = False`` (the default; True is the profiling scripts' A/B switch): the
    graphs replay without the draw, every step that replayed one samples by its own launch, and
    the tokens are those of the captured draw."""
    from kvscope.kernels import triton_sampling as ts
    from kvscope.runner import cuda_graphs

    params = SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True)
    launches, graph_steps, runs = [], [], []
    sample = ts.sample
    monkeypatch.setattr(ts, "sample", lambda *a, **k: launches.append(1) or sample(*a, **k))
    for capture in (True, False):
        monkeypatch.setattr(cuda_graphs, "CAPTURE_DRAW", capture)
        llm = LLM(checkpoint, device="cuda", attention_backend="triton", dtype="float32", gpu_memory_utilization=0.3)
        assert (llm.llm_engine.executor.graphs.tokens is not None) == capture
        llm.hooks.add("step.end", lambda info: graph_steps.append(info.cuda_graph))
        launches.clear()
        graph_steps.clear()
        runs.append([o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)])
        llm.shutdown()
    assert runs[1] == runs[0]
    assert len(launches) >= sum(graph_steps) > 20


def test_an_engine_built_while_another_generates_in_another_thread_changes_neither(checkpoint):
    """Two engines of one process (a notebook's own beside ``%kvscope demo``'s): one generates
    in a thread, again and again, while another thread builds the second (capturing its CUDA
    graphs) and generates. Each gives the tokens an engine gives alone."""
    import threading

    prompts = _prompts(8)
    config = dict(device="cuda", attention_backend="triton", dtype="float32", num_kv_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = _generate(checkpoint, prompts, max_tokens=24, num_kv_blocks=256)
    first = LLM(checkpoint, **config)
    done, outputs = threading.Event(), {0: [], 1: []}

    def run(k: int) -> None:
        if k == 0:
            while not done.is_set():
                outputs[0].append([o.outputs[0].token_ids for o in first.generate(prompts, params, use_tqdm=False)])
            return
        try:
            second = LLM(checkpoint, **config)
            outputs[1].append([o.outputs[0].token_ids for o in second.generate(prompts, params, use_tqdm=False)])
            second.shutdown()
        finally:
            done.set()

    assert not run_together(run, 2)
    assert outputs[0] and all(out == alone for out in outputs[0])
    assert outputs[1] == [alone]
    first.shutdown()


def test_cuda_graphs_are_used_and_fall_back_beyond_captured_batch(checkpoint):
    llm = LLM(checkpoint, device="cuda", dtype="float32", max_num_seqs=4, gpu_memory_utilization=0.3)
    used = []
    llm.hooks.add("step.end", lambda info: used.append(info.cuda_graph))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate(_prompts(3), params, use_tqdm=False)
    assert any(used), "no decode step replayed a CUDA graph"
    runner = llm.llm_engine.executor
    runner.graphs.width = 1  # tables wider than the captured width must run eagerly, not crash
    used.clear()
    out = llm.generate(_prompts(3), params, use_tqdm=False)
    assert not any(used) and all(len(o.outputs[0].token_ids) == 8 for o in out)
    llm.shutdown()


def _compiled_variants() -> int:
    """Compiled variants of the paged-attention, sampling, penalty and decode-advance kernels in this
    process, on every device."""
    from kvscope.kernels import decode_advance as da
    from kvscope.kernels import gluon_attention as ga
    from kvscope.kernels import triton_attention as ta
    from kvscope.kernels import triton_penalties as tp
    from kvscope.kernels import triton_sampling as ts

    kernels = (ga._prefill_kernel, ta._paged_attention_kernel, ta._merge_splits_kernel, ta._store_kvcache_kernel,
               ts._chunk_mass_kernel, ts._pick_kernel, tp._penalize_kernel, da._advance_kernel)
    return sum(len(caches[0]) for k in kernels for caches in k.device_caches.values())


def test_a_run_compiles_no_attention_or_sampling_kernel_after_start_up(tmp_path):
    """Start-up compiles every attention and sampling kernel variant a run uses (fresh prefill
    and mixed steps by dummy steps, decode by graph capture, the sampler's by a launch of each,
    the decode graphs' input advance by a launch on no rows), so nothing compiles inside a timed
    run. Steps of every size used to start their packed inputs at other byte alignments and
    give other block-table widths, each a variant of its own compiled mid-run. A shape no other
    test uses (one KV head of 64 for four query heads, 32-slot pages, a vocabulary not a
    multiple of 16), so the process's earlier compiles do not hide a variant; on sm_90 its fresh
    prefills take the Gluon kernel and its mixed steps the Triton kernel. The rows are greedy,
    random at one or at several temperatures, seeded, top-k, and penalized."""
    path = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3", **{**SHAPE, "num_attention_heads": 4,
                                                               "num_key_value_heads": 1, "head_dim": 64,
                                                               "vocab_size": 520})
    llm = LLM(str(path), device="cuda", attention_backend="triton", dtype="bfloat16", block_size=32,
              max_num_seqs=8, max_num_batched_tokens=96, gpu_memory_utilization=0.3)
    started = _compiled_variants()
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(1, 400))] for _ in range(14)]
    kinds_of_row = [dict(temperature=0), dict(temperature=0.8), dict(temperature=1.2), dict(temperature=0.8, seed=3),
                    dict(temperature=0.8, top_k=5), dict(temperature=0.8, repetition_penalty=1.2)]
    params = [SamplingParams(max_tokens=rng.randrange(1, 40), ignore_eos=True, **kinds_of_row[i % 6])
              for i in range(len(prompts))]
    kinds = set()
    llm.hooks.add("step.scheduled", lambda scheduler_output, **_: kinds.add(
        tuple(sorted({r.num_new_tokens > 1 for r in scheduler_output.requests}))))
    llm.generate(prompts, params, use_tqdm=False)
    assert {(True,), (False, True), (False,)} <= kinds  # prefills, mixed steps, decode steps all ran
    assert _compiled_variants() == started
    llm.shutdown()


def test_a_pool_sized_at_full_memory_leaves_room_for_sampling_every_row(tmp_path):
    """The pool is sized after the sampler's peak too: at ``gpu_memory_utilization=1.0``, a step
    of the most rows over a large vocabulary, each with top-k, top-p and 20 log-probs (float32
    copies and a sort of ``[rows, vocab]``, far more than the forward's activations here), still
    samples every row."""
    path = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3", **{**SHAPE, "vocab_size": 151936})
    llm = LLM(str(path), device="cuda", dtype="bfloat16", max_num_seqs=256, max_model_len=256,
              gpu_memory_utilization=1.0)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 151900) for _ in range(rng.randrange(4, 24))] for _ in range(256)]
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, logprobs=20, max_tokens=4, ignore_eos=True)
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in out] == ["length"] * 256
    assert all(len(o.outputs[0].token_ids) == 4 and len(o.outputs[0].logprobs) == 4 for o in out)
    llm.shutdown()


def test_kv_cache_memory_bytes_sizes_a_gpu_pool_as_in_vllm(checkpoint):
    """vLLM's ``kv_cache_memory_bytes`` is the KV pool's bytes per GPU, over
    ``gpu_memory_utilization``; kvscope's used to size a CPU pool only, and a GPU pool took what
    ``gpu_memory_utilization`` left, the setting unread. The engine still generates as one
    sized by the utilization does."""
    from kvscope.runner.model_runner import kv_block_bytes

    budget = 3 << 20
    llm = LLM(checkpoint, device="cuda", dtype="float32", kv_cache_memory_bytes=budget)
    runner = llm.llm_engine.executor
    block = kv_block_bytes(llm.hf_config, 1, llm.config.block_size, runner.kv_cache_dtype)
    assert llm.llm_engine.block_manager.num_blocks == budget // block
    assert runner.kv_cache.numel() * runner.kv_cache.element_size() == budget // block * block
    prompts = _prompts(6)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16,
                                                                                 ignore_eos=True), use_tqdm=False)]
    llm.shutdown()
    assert got == _generate(checkpoint, prompts, max_tokens=16, dtype="float32", gpu_memory_utilization=0.3)


def test_a_largest_step_past_gpu_memory_is_refused_by_name(checkpoint):
    """Token budget and max_num_seqs both meant as "no limit": the start-up profile of the
    largest step they allow cannot run, and the error names them (torch's or numpy's bare
    out-of-memory error before)."""
    with pytest.raises(ValueError, match=r"^the largest step max_num_batched_tokens=100000000 and "
                                         r"max_num_seqs=100000000 allow .* does not fit"):
        LLM(checkpoint, device="cuda", attention_backend="triton", max_num_batched_tokens=10**8,
            max_num_seqs=10**8)


@pytest.mark.parametrize("variant", [
    dict(enable_prefix_caching=True),
    dict(enable_prefix_caching=True, max_num_batched_tokens=64),
    dict(enable_prefix_caching=False, block_size=32, num_kv_blocks=40),
    dict(enable_prefix_caching=True, async_scheduling=True),
    dict(enable_prefix_caching=True, async_scheduling=True, max_num_batched_tokens=64, num_kv_blocks=40),
    # more requests running than a step holds, under a max_num_seqs meant as "no limit": graphs,
    # warm-ups and staging sized by a step's rows, the runner's table rows grown past them
    dict(enable_prefix_caching=True, async_scheduling=True, max_num_batched_tokens=8, max_num_seqs=10**9),
])
def test_prefix_caching_and_scheduling_do_not_change_tokens_on_gpu(checkpoint, variant):
    prompts = _prompts()
    base = _generate(checkpoint, prompts, enable_prefix_caching=False)
    assert _generate(checkpoint, prompts, **variant) == base


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_parallel_sampling_children_equal_requests_of_their_own_on_gpu(checkpoint, async_scheduling):
    """``SamplingParams(n=3)`` with CUDA graphs: child i draws the tokens of a request of its own
    seeded ``seed + i`` (test_parallel_sampling.py's truth, on the kernels' path)."""
    prompts = _prompts(4)
    n_params = SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=24, ignore_eos=True)
    llm = LLM(checkpoint, device="cuda", attention_backend="triton", dtype="float32",
              async_scheduling=async_scheduling, gpu_memory_utilization=0.3)
    llm.llm_engine.validate_every_step = True
    outs = llm.generate(prompts, n_params, use_tqdm=False)
    llm.shutdown()
    singles = _generate(checkpoint, [p for p in prompts for _ in range(3)],
                        params=[SamplingParams(temperature=0.9, seed=11 + i, max_tokens=24, ignore_eos=True)
                                for _ in prompts for i in range(3)])
    assert [c.token_ids for o in outs for c in o.outputs] == singles
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_adjusted_rows_and_prompt_logprobs_match_transformers_on_gpu(checkpoint, async_scheduling):
    """Penalties, allowed tokens, a logit bias and prompt log-probs through CUDA graphs, the
    kernels' float32 path and (async) the newest token still on the device, against
    transformers on the GPU (test_logit_adjustments.py's and test_prompt_logprobs.py's truths)."""
    from transformers import AutoModelForCausalLM

    from test_logit_adjustments import reference_tokens

    prompts = _prompts(4)
    greedy = dict(temperature=0, max_tokens=24, ignore_eos=True)
    params = [SamplingParams(repetition_penalty=1.8, **greedy),
              SamplingParams(allowed_token_ids=list(range(3, 512, 5)), logit_bias={8: 2.0}, frequency_penalty=0.7,
                             **greedy),
              SamplingParams(prompt_logprobs=3, **greedy), SamplingParams(presence_penalty=1.5, **greedy)]
    llm = LLM(checkpoint, device="cuda", attention_backend="triton", dtype="float32",
              async_scheduling=async_scheduling, gpu_memory_utilization=0.3, max_num_batched_tokens=64)
    llm.llm_engine.validate_every_step = True
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).cuda().eval()
    for out, prompt, p in zip(outs, prompts, params):
        assert out.outputs[0].token_ids == reference_tokens(hf, prompt, p, max_new=24)
    with torch.no_grad():
        lp = hf(torch.tensor([prompts[2]], device="cuda")).logits[0].float().log_softmax(-1)
    got = outs[2].prompt_logprobs
    assert got[0] is None and len(got) == len(prompts[2])
    for i in range(1, len(prompts[2])):  # (Triton's attention multiplies float32 in TF32: ~1e-3 off)
        assert got[i][prompts[2][i]] == pytest.approx(lp[i - 1, prompts[2][i]].item(), abs=1e-2)


def test_penalized_and_prompt_logprob_steps_launch_without_waiting_for_the_device(checkpoint):
    """Under async scheduling a step is launched while the device still runs the last one: a
    decode step of penalized rows (their newest tokens still on the device) and a prefill step
    owing prompt log-probs launch in well under the second of device work queued just before
    them (a copy from pageable host memory would wait it out)."""
    import time

    llm = LLM(checkpoint, device="cuda", attention_backend="triton", async_scheduling=True,
              gpu_memory_utilization=0.3)
    engine, runner = llm.llm_engine, llm.llm_engine.executor
    for prompt in _prompts(8):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True,
                                                  repetition_penalty=1.3, frequency_penalty=0.5))
    for _ in range(8):
        engine.step()
    launch, took = runner.execute_async, []

    def behind_a_busy_device(out):
        torch.cuda._sleep(int(2e9))  # (about a second of device work)
        t0 = time.perf_counter()
        handle = launch(out)
        took.append(time.perf_counter() - t0)
        return handle

    runner.execute_async = behind_a_busy_device
    engine.step()
    engine.add_request(_prompts(9)[8], SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2))
    engine.step()
    runner.execute_async = launch
    torch.cuda.synchronize()
    llm.shutdown()
    assert len(took) == 2 and max(took) < 0.4, took


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_no_step_launch_synchronizes_with_the_device(checkpoint, kv_cache_dtype):
    """Under async scheduling no launch may wait for the device, whatever its rows ask for:
    torch's sync debug mode reports every operation that synchronizes (a copy from pageable
    memory, ``.item()``, a data-dependent shape) inside ``execute_async``, with its stack.
    Requests of every sampling kind arrive before and during the run, chunked prefills among
    decode steps; the pool in the model's dtype and in fp8 (its scales on the device)."""
    import traceback
    import warnings

    llm = LLM(checkpoint, device="cuda", attention_backend="triton", async_scheduling=True,
              gpu_memory_utilization=0.3, max_num_batched_tokens=96, kv_cache_dtype=kv_cache_dtype)
    engine, runner = llm.llm_engine, llm.llm_engine.executor
    base = dict(max_tokens=40, ignore_eos=True)
    kinds = [SamplingParams(temperature=0, **base),
             SamplingParams(temperature=0.8, seed=3, **base),
             SamplingParams(temperature=0.9, top_k=20, top_p=0.8, min_p=0.05, **base),
             SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2, **base),
             SamplingParams(allowed_token_ids=list(range(3, 512, 3)), logit_bias={9: 3.0}, **base),
             SamplingParams(bad_words=["a", "b c", " the"], temperature=0.8, seed=9, **base),
             SamplingParams(min_tokens=12, stop_token_ids=[7, 11], temperature=0.7, max_tokens=40),
             SamplingParams(logprobs=3, temperature=0.6, **base),
             SamplingParams(prompt_logprobs=2, temperature=0, **base),
             SamplingParams(n=2, temperature=0.9, seed=5, **base)]
    prompts = _prompts(2 * len(kinds))
    launch, seen = runner.execute_async, []

    def report(message, *args, **kwargs):
        if "called a synchronizing" in str(message):
            seen.append(f"{message}\n{''.join(traceback.format_stack(limit=10))}")

    def watched(out):
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = report
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return launch(out)
            finally:
                torch.cuda.set_sync_debug_mode("default")

    runner.execute_async = watched
    for prompt, params in zip(prompts, kinds):
        engine.add_request(prompt, params)
    for _ in range(6):
        engine.step()
    for prompt, params in zip(prompts[len(kinds):], kinds):  # joining a running batch
        engine.add_request(prompt, params)
    steps = 0
    while engine.has_unfinished_requests() and steps < 400:
        engine.step()
        steps += 1
    runner.execute_async = launch
    llm.shutdown()
    assert steps < 400
    assert not seen, f"{len(seen)} synchronizing operations:\n" + "\n".join(dict.fromkeys(seen))
