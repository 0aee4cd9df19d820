"""Calls that mean one thing in vLLM mean the same here: each test names the vLLM behaviour it
matches (file and function in vllm-project/vllm) and runs it through a real engine."""
from __future__ import annotations

import inspect
import json
import shutil

import pytest

from engine_helpers import greedy, make_llm, token_ids
from kvscope import LLM, SamplingParams
from test_logit_adjustments import reference_tokens
from tiny_models import EOS_ID, load_hf_model, tiny_checkpoint

PROMPT = [5, 6, 7, 8, 9]


def near_tie(llm) -> tuple[int, int, float]:
    """The likeliest two first tokens after ``PROMPT`` and the bias that makes the second as
    likely as the first."""
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, logprobs=2), use_tqdm=False)
    (a, la), (b, lb) = sorted(out[0].outputs[0].logprobs[0].items(), key=lambda kv: -kv[1])[:2]
    return a, b, float(la - lb)


def test_a_temperature_above_0_and_under_0_01_samples_at_0_01():
    """vLLM's ``SamplingParams.__post_init__`` (vllm/sampling_params.py) raises a temperature in
    (0, _MAX_TEMP=0.01) to 0.01, with a warning, so such a request samples; kvscope took one under
    1e-5 for greedy and divided by any other as given. Two tokens made as likely as each other:
    greedy always picks one, a draw at 0.01 picks either."""
    llm = make_llm()
    a, b, gap = near_tie(llm)
    with pytest.warns(UserWarning, match=r"temperature=1e-06 is under 0\.01"):
        tiny = SamplingParams(temperature=1e-6, max_tokens=1, allowed_token_ids=[a, b], logit_bias={b: gap})
    assert tiny.temperature == 0.01
    seen = []
    llm.hooks.add("request.added", lambda **e: seen.append(e["params"].temperature))
    with pytest.warns(UserWarning):
        rows = [SamplingParams(temperature=1e-6, seed=seed, max_tokens=1, allowed_token_ids=[a, b],
                               logit_bias={b: gap}) for seed in range(16)]
    drawn = token_ids(llm.generate([PROMPT] * 16, rows, use_tqdm=False))
    assert seen == [0.01] * 16
    at_001 = [SamplingParams(temperature=0.01, seed=seed, max_tokens=1, allowed_token_ids=[a, b],
                             logit_bias={b: gap}) for seed in range(16)]
    assert drawn == token_ids(llm.generate([PROMPT] * 16, at_001, use_tqdm=False))
    assert {t for [t] in drawn} == {a, b}


def checkpoint_with(path, **generation) -> str:
    """A copy of the tiny qwen3 checkpoint whose generation_config.json also sets ``generation``."""
    shutil.copytree(tiny_checkpoint("qwen3"), path)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, **generation}))
    return str(path)


@pytest.mark.parametrize("skip_tokenizer_init", [False, True])
def test_the_generation_config_s_other_eos_ids_stop_as_stop_token_ids(tmp_path, skip_tokenizer_init):
    """vLLM's ``SamplingParams.update_from_generation_config`` (vllm/sampling_params.py, called by
    ``InputProcessor.process_inputs``) keeps the tokenizer's EOS as the request's EOS and adds the
    generation config's other ``eos_token_id`` values to its ``stop_token_ids``, so ``check_stop``
    (vllm/v1/core/sched/utils.py) reports the one that ended it as ``stop_reason``; without a
    tokenizer every one of them is a stop token id. kvscope took them all for EOS (no
    ``stop_reason``)."""
    other = 17
    llm = LLM(checkpoint_with(tmp_path / "m", eos_token_id=[EOS_ID, other]), device="cpu", dtype="float32",
              skip_tokenizer_init=skip_tokenizer_init)
    params = [SamplingParams(temperature=0, max_tokens=4, allowed_token_ids=[t]) for t in (other, EOS_ID)]
    by_other, by_eos = (o.outputs[0] for o in llm.generate([PROMPT, PROMPT], params, use_tqdm=False))
    assert (by_other.token_ids, by_other.finish_reason, by_other.stop_reason, by_other.text) == ([other], "stop", other, "")
    assert (by_eos.token_ids, by_eos.finish_reason) == ([EOS_ID], "stop")
    assert by_eos.stop_reason == (EOS_ID if skip_tokenizer_init else None)
    assert params[0].stop_token_ids == []  # (the request's own copy took them)
    ignoring = SamplingParams(temperature=0, max_tokens=4, allowed_token_ids=[other], ignore_eos=True)
    assert llm.generate([PROMPT], ignoring, use_tqdm=False)[0].outputs[0].token_ids == [other] * 4


def test_a_repetition_penalty_above_2_penalizes_as_below_it():
    """vLLM's ``SamplingParams._verify_args`` (vllm/sampling_params.py) takes any finite
    ``repetition_penalty`` above 0 (kvscope refused one above 2, vLLM's old limit). A prompt token
    biased up is drawn again at 2 but not at 8, and the greedy tokens at 8 are the torch
    reference's (transformers' logits, the penalty divides the positive ones)."""
    llm = make_llm()
    rows = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=rp, logit_bias={5: 10.0})
            for rp in (2.0, 8.0)]
    at_2, at_8 = token_ids(llm.generate([PROMPT, PROMPT], rows, use_tqdm=False))
    assert at_2 == [5] * 12 and 5 not in at_8
    assert at_8 == reference_tokens(load_hf_model(tiny_checkpoint("qwen3")), PROMPT, rows[1], max_new=12)


def test_of_two_stop_strings_in_one_token_s_text_the_first_listed_stops():
    """vLLM's ``check_stop_strings`` (vllm/v1/engine/detokenizer.py) takes the stop strings in
    list order and stops at the first one found in the new text, wherever another one lies;
    kvscope stopped at the one that started earliest. One token whose text holds both: the
    later-starting one, listed first, cuts the text and is the ``stop_reason``."""
    llm = make_llm()
    tokenizer = llm.get_tokenizer()
    token, text = next((t, s) for t in range(3, llm.hf_config.vocab_size) if len(s := tokenizer.decode([t])) >= 3
                       and len(set(s)) == len(s) and s.strip() == s)
    stop = [text[-1], text[:2]]
    for include, want in ((False, text[:-1]), (True, text)):
        params = SamplingParams(temperature=0, max_tokens=3, allowed_token_ids=[token], stop=stop,
                                include_stop_str_in_output=include)
        out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
        assert (out.text, out.stop_reason, out.finish_reason) == (want, text[-1], "stop")


def test_clone_is_a_deep_copy_that_samples_as_the_original():
    """vLLM's ``SamplingParams.clone`` (vllm/sampling_params.py) deep-copies the params, as
    callers do to change one request's copy."""
    llm = make_llm()
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True, stop_token_ids=[7],
                            logit_bias={9: 1.5})
    copied = params.clone()
    assert copied == params and copied is not params
    copied.stop_token_ids.append(8)
    copied.logit_bias[9] = -2.0
    assert (params.stop_token_ids, params.logit_bias) == ([7], {9: 1.5})
    assert token_ids(llm.generate([PROMPT], params.clone(), use_tqdm=False)) == \
        token_ids(llm.generate([PROMPT], params, use_tqdm=False))


def test_a_tied_token_s_rank_counts_the_tokens_as_likely_as_it_as_vllm_does(tmp_path):
    """vLLM's ``Logprob.rank``: ``batched_count_greater_than`` (vllm/v1/sample/ops/logprobs.py)
    counts the tokens whose log-prob is at least the token's own, so tokens that tie share the
    worse rank (kvscope counted 1 + the tokens strictly likelier); and a row is built as
    ``append_logprobs_for_next_position`` (vllm/v1/engine/logprobs.py) builds it: the token's own
    entry first, then the top k ranked 1..k by place, a top token keeping its place. A checkpoint
    whose LM head gives tokens 40 and 41 the same row ties them at every position (bf16 logits
    tie often on GPUs)."""
    from safetensors.torch import load_file, save_file

    path = shutil.copytree(tiny_checkpoint("qwen3"), tmp_path / "tied")
    (weights_file,) = path.glob("*.safetensors")
    weights = load_file(weights_file)
    weights["lm_head.weight"][41] = weights["lm_head.weight"][40]
    save_file(weights, weights_file, metadata={"format": "pt"})
    llm = LLM(str(path), device="cpu", dtype="float32", max_logprobs=-1)
    prompt = [5, 40, 6, 41, 7]

    def rows(k: int) -> list[tuple[int, dict]]:
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=k, prompt_logprobs=k,
                                allowed_token_ids=[40])
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        return [(t, out.prompt_logprobs[i]) for i, t in enumerate(prompt) if i] + \
            list(zip(out.outputs[0].token_ids, out.outputs[0].logprobs))

    for (token, whole), (same, alone) in zip(rows(-1), rows(0)):
        assert same == token and list(alone) == [token] and next(iter(whole)) == token
        if token in (40, 41):
            assert whole[40].logprob == whole[41].logprob  # (the tie the test is about)
        assert alone[token].rank == sum(lp.logprob >= alone[token].logprob for lp in whole.values()), token
        assert [lp.rank for lp in sorted(whole.values(), key=lambda lp: lp.rank)] == list(range(1, len(whole) + 1))
        assert all(a.logprob >= b.logprob for a, b in zip(sorted(whole.values(), key=lambda lp: lp.rank),
                                                         sorted(whole.values(), key=lambda lp: lp.rank)[1:]))


def test_greedy_params_read_back_vllm_s_neutral_top_p_top_k_and_min_p():
    """vLLM's ``SamplingParams.__post_init__`` (vllm/sampling_params.py) sets ``top_p=1.0``,
    ``top_k=0`` and ``min_p=0.0`` once a temperature under ``_SAMPLING_EPS`` (greedy) has passed
    ``_verify_args``; kvscope kept the values given, which greedy ignores. The object reads them
    back, and so does the request's own copy of params set to temperature 0 after they were
    built; the tokens are greedy's."""
    llm = make_llm()
    seen = []
    llm.hooks.add("request.added", lambda **e: seen.append(e["params"]))
    filtered = {"top_p": 0.5, "top_k": 3, "min_p": 0.2}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, **filtered)
    assert (params.top_p, params.top_k, params.min_p) == (1.0, 0, 0.0)
    later = SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, **filtered)
    later.temperature = 0
    outs = llm.generate([PROMPT, PROMPT], [params, later], use_tqdm=False)
    assert [(p.top_p, p.top_k, p.min_p) for p in seen] == [(1.0, 0, 0.0)] * 2
    assert token_ids(outs) == token_ids(llm.generate([PROMPT], greedy(6), use_tqdm=False)) * 2
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\]"):  # (checked before it is reset)
        SamplingParams(temperature=0, top_p=1.5)


def test_n_above_1_with_greedy_sampling_is_refused():
    """vLLM's ``SamplingParams._verify_greedy_sampling`` (vllm/sampling_params.py, called from
    ``__post_init__`` at a temperature under ``_SAMPLING_EPS``) raises "n must be 1 when using
    greedy sampling"; kvscope ran n children that all drew the same tokens. Params set to
    temperature 0 after they were built are refused when added, and nothing is queued."""
    refused = r"^n must be 1 with greedy sampling \(temperature=0\), got n=2"
    with pytest.raises(ValueError, match=refused):
        SamplingParams(n=2, temperature=0)
    assert SamplingParams(n=2, temperature=0.5).n == 2
    llm = make_llm()
    later = SamplingParams(n=2, temperature=0.5, max_tokens=4)
    later.temperature = 0
    with pytest.raises(ValueError, match=refused):
        llm.generate([PROMPT], later, use_tqdm=False)
    assert not llm.has_unfinished_requests()


def test_stop_and_bad_words_read_back_as_lists_as_vllm_s_do():
    """vLLM's ``SamplingParams.__post_init__`` (vllm/sampling_params.py at 00388f6, "if self.stop
    is None: self.stop = [] / elif isinstance(self.stop, str): self.stop = [self.stop]", and
    ``bad_words`` None -> ``[]``) leaves both lists, so ported code iterates or extends
    ``params.stop`` whatever was given; kvscope kept None or the lone string (``for s in
    params.stop`` raised, or went over characters). A stop string appended to the list later
    stops the request, as the request's own copy of the params is built when it is added."""
    assert (SamplingParams().stop, SamplingParams().bad_words) == ([], [])
    assert SamplingParams(stop="ab").stop == ["ab"] and SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(bad_words="hello").bad_words == ["hello"]
    assert SamplingParams(stop="ab").clone().stop == ["ab"]
    llm = make_llm()
    free = llm.generate([PROMPT], greedy(8), use_tqdm=False)[0].outputs[0]
    cut = free.text[2:4]
    params = greedy(8)
    params.stop.append(cut)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert (out.text, out.stop_reason, out.finish_reason) == (free.text[:free.text.find(cut)], cut, "stop")


def test_a_request_output_built_as_vllm_builds_one():
    """vLLM's ``RequestOutput.__init__`` (vllm/outputs.py at 003d3ee) takes ``metrics=None`` by
    default, and vLLM builds its ``STREAM_FINISHED`` output (same file) without one, as tests and
    mocks of ported code do; kvscope required ``metrics`` (TypeError). ``CompletionOutput``'s
    ``cumulative_logprob`` and ``logprobs``, required there, are taken by keyword, and such
    outputs merge with ``add`` as vLLM's do."""
    from kvscope import CompletionOutput, RequestOutput

    def built(text: str, token_ids: list[int], finished: bool) -> RequestOutput:
        completion = CompletionOutput(index=0, text=text, token_ids=token_ids, cumulative_logprob=None,
                                      logprobs=None, finish_reason="length" if finished else None)
        return RequestOutput(request_id="r", prompt="p", prompt_token_ids=[1, 2], prompt_logprobs=None,
                             outputs=[completion], finished=finished)

    done = RequestOutput(request_id="", prompt=None, prompt_token_ids=None, prompt_logprobs=None, outputs=[],
                         finished=True)
    assert (done.metrics, done.finished, done.outputs) == (None, True, [])
    first = built("a", [3], False)
    first.add(built("b", [4], True), aggregate=True)
    assert (first.outputs[0].text, first.outputs[0].token_ids, first.finished, first.metrics) == ("ab", [3, 4], True, None)
    assert first.outputs[0].finished()


def test_generate_chat_and_reset_prefix_cache_take_vllm_s_keywords():
    """vLLM's ``LLM.generate(prompts, sampling_params, *, use_tqdm, lora_request, priority,
    tokenization_kwargs)``, ``LLM.chat(..., lora_request, chat_template_content_format, ...,
    tokenization_kwargs, mm_processor_kwargs)`` and ``LLM.reset_prefix_cache(reset_running_requests=False,
    reset_connector=False)`` (vllm/entrypoints/llm.py at 10fdb8f); kvscope raised TypeError on each
    keyword. Ported calls at the values vLLM serves without LoRA or priority scheduling run:
    ``lora_request=None``, ``priority`` all 0, and ``tokenization_kwargs={"truncate_prompt_tokens": k}``
    (where vLLM's deprecation of ``SamplingParams.truncate_prompt_tokens`` sends it) keeps the
    prompt's last k tokens, as the params' own setting does, which wins when both are set."""
    llm = make_llm()
    prompt = [5, 6, 7, 8, 9, 10, 11]
    kept = llm.generate([prompt], greedy(4, truncate_prompt_tokens=3), use_tqdm=False)[0]
    assert kept.prompt_token_ids == prompt[-3:]
    for sp in (greedy(4), [greedy(4)]):
        out = llm.generate([prompt], sp, use_tqdm=False, lora_request=None, priority=[0],
                           tokenization_kwargs={"truncate_prompt_tokens": 3})[0]
        assert (out.prompt_token_ids, token_ids([out])) == (kept.prompt_token_ids, token_ids([kept]))
    own = llm.generate([prompt], greedy(4, truncate_prompt_tokens=5), use_tqdm=False,
                       tokenization_kwargs={"truncate_prompt_tokens": 3})[0]
    assert own.prompt_token_ids == prompt[-5:]
    conversation = [{"role": "user", "content": "Hello"}]
    plain = llm.chat(conversation, greedy(3), use_tqdm=False)[0]
    ported = llm.chat(conversation, greedy(3), use_tqdm=False, lora_request=None, chat_template_content_format="string",
                      tokenization_kwargs=None, mm_processor_kwargs=None)[0]
    assert (ported.prompt, token_ids([ported])) == (plain.prompt, token_ids([plain]))
    assert llm.reset_prefix_cache(reset_running_requests=False, reset_connector=False) is True


def test_stop_token_ids_and_bad_words_read_back_without_repeats_as_vllm_s_do():
    """vLLM's ``__post_init__`` (vllm/sampling_params.py at 00388f6, ``list(dict.fromkeys(...))``
    on both) keeps each stop token id and bad word once, in first-seen order; kvscope kept the
    repeats. A repeat changes nothing the engine does: the deduplicated params give the same
    tokens as the repeated ones."""
    params = SamplingParams(stop_token_ids=[5, 3, 5, 3, 9], bad_words=["b", "a", "b"])
    assert (params.stop_token_ids, params.bad_words) == ([5, 3, 9], ["b", "a"])
    llm = make_llm()
    free = llm.generate([PROMPT], greedy(8), use_tqdm=False)[0].outputs[0]
    stop = free.token_ids[3]
    once, twice = (llm.generate([PROMPT], greedy(8, stop_token_ids=ids), use_tqdm=False)[0].outputs[0]
                   for ids in ([stop], [stop, stop]))
    assert once.token_ids == twice.token_ids == free.token_ids[:free.token_ids.index(stop) + 1]

# vLLM's field order, the order its positional arguments take: ``SamplingParams`` is a msgspec
# Struct (vllm/sampling_params.py at 00388f6573ccfcffad607b8c9ecdf341a4669ceb), ``CompletionOutput``
# a dataclass and ``RequestOutput.__init__``'s parameters (vllm/outputs.py at
# 003d3ee22261b7937258b7531aee00e10393f1d6). Written out here, not read from kvscope's classes.
VLLM_SAMPLING_PARAMS_ORDER = [
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k", "min_p",
    "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
    "prompt_logprob_token_ids", "prompt_logprob_start", "logprob_token_ids", "flat_logprobs", "detokenize",
    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output", "output_kind",
    "stream_interval", "skip_clone", "output_text_buffer_length", "_eos_token_id", "_all_stop_token_ids",
    "structured_outputs", "logit_bias", "allowed_token_ids", "extra_args", "bad_words", "_bad_words_token_ids",
    "skip_reading_prefix_cache", "thinking_token_budget", "repetition_detection", "routed_experts_prompt_start",
    "trace_decode_token_ids",
]
VLLM_COMPLETION_OUTPUT_ORDER = [
    "index", "text", "token_ids", "cumulative_logprob", "logprobs", "routed_experts", "finish_reason", "stop_reason",
    "lora_request", "kv_transfer_params",
]
VLLM_REQUEST_OUTPUT_ORDER = [
    "request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs", "finished", "metrics", "lora_request",
    "encoder_prompt", "encoder_prompt_token_ids", "num_cached_tokens",
]


def test_sampling_params_built_positionally_read_each_value_where_vllm_s_would():
    """vLLM's ``SamplingParams(1, 0.5)`` is ``n=1, presence_penalty=0.5`` (a msgspec Struct takes
    positional arguments in field order); kvscope read it as ``temperature=0.5``. Every argument
    up to ``prompt_logprobs`` lands in vLLM's field; the fields kvscope shares after that one
    (past vLLM's ``prompt_logprob_token_ids``, which kvscope has not) keep vLLM's relative order
    and are keyword-only, so a longer positional call is refused rather than misread."""
    values = {"n": 2, "presence_penalty": 0.5, "frequency_penalty": -0.25, "repetition_penalty": 1.5,
              "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "seed": 11, "stop": ["zz"],
              "stop_token_ids": [3], "ignore_eos": True, "max_tokens": 9, "min_tokens": 2, "logprobs": 3,
              "prompt_logprobs": 4}
    positional = VLLM_SAMPLING_PARAMS_ORDER[:VLLM_SAMPLING_PARAMS_ORDER.index("prompt_logprob_token_ids")]
    assert positional == list(values)
    params = SamplingParams(*values.values())
    assert {name: getattr(params, name) for name in positional} == values
    assert SamplingParams(1, 0.5).presence_penalty == 0.5 and SamplingParams(1, 0.5).temperature == 1.0
    with pytest.raises(TypeError, match="positional argument"):
        SamplingParams(*values.values(), None)
    taken = [p.name for p in inspect.signature(SamplingParams).parameters.values()]
    shared = [name for name in VLLM_SAMPLING_PARAMS_ORDER if name in taken]
    assert taken[:len(shared)] == shared
    assert all(inspect.signature(SamplingParams).parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
               for name in taken[len(positional):])


def test_completion_output_built_positionally_reads_each_value_where_vllm_s_would():
    """vLLM's ``CompletionOutput`` (a dataclass) takes ``index, text, token_ids,
    cumulative_logprob, logprobs, routed_experts, finish_reason, stop_reason``; kvscope took
    ``finish_reason`` fourth, so a ported positional call set it to the cumulative log-prob.
    ``routed_experts`` (MoE routing, which kvscope does not record) is taken at vLLM's default,
    None, and reads back None; kvscope's own ``error`` is keyword-only."""
    from kvscope import CompletionOutput, Logprob

    values = {"index": 1, "text": "ab", "token_ids": [3, 4], "cumulative_logprob": -1.5,
              "logprobs": [{3: Logprob(-0.5)}, {4: Logprob(-1.0)}], "routed_experts": None, "finish_reason": "stop",
              "stop_reason": "b"}
    assert list(values) == VLLM_COMPLETION_OUTPUT_ORDER[:len(values)]
    completion = CompletionOutput(*values.values())
    assert {name: getattr(completion, name) for name in values} == values
    assert completion.error is None and completion.finished()
    with pytest.raises(TypeError, match="positional argument"):
        CompletionOutput(*values.values(), "failed")
    assert CompletionOutput(*values.values(), error="failed").error == "failed"


def test_request_output_built_positionally_reads_each_value_where_vllm_s_would():
    """vLLM's ``RequestOutput.__init__`` takes ``request_id, prompt, prompt_token_ids,
    prompt_logprobs, outputs, finished, metrics, lora_request, encoder_prompt,
    encoder_prompt_token_ids, num_cached_tokens``; kvscope took ``outputs`` fourth. The three
    kvscope has not (no LoRA, no encoder-decoder models) are taken at vLLM's default, None."""
    from kvscope import CompletionOutput, RequestMetrics, RequestOutput

    completion = CompletionOutput(index=0, text="a", token_ids=[3], cumulative_logprob=None, logprobs=None)
    values = {"request_id": "r", "prompt": "p", "prompt_token_ids": [1, 2], "prompt_logprobs": [None, {2: -0.5}],
              "outputs": [completion], "finished": True, "metrics": RequestMetrics(arrival_time=1.0),
              "lora_request": None, "encoder_prompt": None, "encoder_prompt_token_ids": None, "num_cached_tokens": 2}
    assert list(values) == VLLM_REQUEST_OUTPUT_ORDER
    out = RequestOutput(*values.values())
    shared = ["request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs", "finished", "metrics",
              "num_cached_tokens"]
    assert {name: getattr(out, name) for name in shared} == {name: values[name] for name in shared}
    short = RequestOutput("r", None, [1], None, [], False)
    assert (short.prompt_logprobs, short.outputs, short.finished) == (None, [], False)


def test_a_request_output_takes_unknown_keywords_and_warns_naming_them():
    """vLLM's ``RequestOutput.__init__`` takes ``**kwargs`` (so code written against a newer vLLM
    runs) and ignores them, with a warning naming them; kvscope raised TypeError."""
    from kvscope import RequestOutput

    given = {"request_id": "r", "prompt": None, "prompt_token_ids": [1], "prompt_logprobs": None, "outputs": [],
             "finished": True}
    with pytest.warns(UserWarning, match=r"^RequestOutput: ignoring extra arguments: 'kv_transfer_params', 'later'$"):
        out = RequestOutput(**given, later=1, kv_transfer_params={"x": 1})
    assert out == RequestOutput(**given) and "later" not in vars(out)


def test_a_request_output_built_by_hand_has_no_cached_token_count():
    """vLLM's ``RequestOutput.__init__`` defaults ``num_cached_tokens`` to None, so an output built
    by hand says nothing of the prefix cache; kvscope's said 0, no hit. The engine's outputs
    still carry the real count, as their metrics do."""
    from kvscope import RequestOutput

    assert RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1], prompt_logprobs=None, outputs=[],
                         finished=True).num_cached_tokens is None
    llm = make_llm()
    prefix = list(range(5, 5 + 4 * llm.llm_engine.config.block_size))
    first, again = (llm.generate([prefix + [3]], greedy(2), use_tqdm=False)[0] for _ in range(2))
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, again.metrics.num_cached_tokens)
    assert again.num_cached_tokens > 0


def test_outputs_read_back_vllm_s_attributes_for_what_kvscope_has_not():
    """vLLM's ``RequestOutput`` (vllm/outputs.py at 003d3ee) keeps ``lora_request``,
    ``encoder_prompt`` and ``encoder_prompt_token_ids`` as attributes and reads
    ``kv_transfer_params`` as a property, and its ``CompletionOutput`` has ``lora_request`` and
    ``kv_transfer_params`` fields: all None for a decoder-only model without LoRA or a KV
    connector. kvscope took the first three in ``RequestOutput()`` and dropped them, so ported
    code reading any of them (a log line, a generic serializer) raised AttributeError."""
    from kvscope import CompletionOutput, RequestOutput

    llm = make_llm()
    generated = llm.generate([[5, 6, 7]], greedy(2), use_tqdm=False)[0]
    llm.add_request([5, 6, 7], greedy(2))
    streamed = llm.step()[0]
    built = RequestOutput("r", None, [1], None, [CompletionOutput(0, "a", [3], None, None)], True,
                          None, None, None, None)
    for out in (generated, streamed, built):
        assert [getattr(out, name) for name in ("lora_request", "encoder_prompt", "encoder_prompt_token_ids",
                                                 "kv_transfer_params")] == [None] * 4
        assert [(c.lora_request, c.kv_transfer_params) for c in out.outputs] == [(None, None)]
    while llm.has_unfinished_requests():
        llm.step()


def test_a_priority_of_numpy_zeros_runs_as_vllm_runs_it():
    """vLLM's ``generate`` passes each ``priority[i]`` on and refuses only a nonzero one without
    priority scheduling, so numpy's zeros (``list(np.zeros(n, int))``) run there; kvscope
    refused them as "not a list of ints", though it takes numpy integers everywhere else."""
    import numpy as np

    llm = make_llm()
    prompts = [[5, 6, 7], [8, 9]]
    plain = llm.generate(prompts, greedy(3), use_tqdm=False)
    zeros = llm.generate(prompts, greedy(3), use_tqdm=False, priority=list(np.zeros(2, dtype=np.int64)))
    assert token_ids(zeros) == token_ids(plain)
    with pytest.raises(ValueError, match=r"^priority must be 0 for every prompt"):
        llm.generate(prompts, greedy(3), use_tqdm=False, priority=[np.int64(0), np.int32(2)])
    assert not llm.has_unfinished_requests()
