"""``SamplingParams.output_kind`` (vLLM's ``RequestOutputKind``) and ``detokenize``.

The truth for ``DELTA`` is the same requests run ``CUMULATIVE`` (greedy or seeded, so both runs
draw the same tokens): the deltas of a request, added up here by the test's own rules, are its
cumulative final output, and each delta is what its cumulative output gained over the one
before. ``FINAL_ONLY`` gives one output per request, the cumulative final one.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import pickle
import shutil
import signal

import pytest

import kvscope
from engine_helpers import bias_logits, greedy, make_llm
from kvscope import LLM, RequestOutputKind, SamplingParams
from test_detokenizer import vllm_text
from tiny_models import tiny_checkpoint

CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
# Requests that finish on different steps (5, 9 and 14 tokens).
PROMPTS = [[5, 6, 7], [11, 12, 13, 14], [20, 21]]
LENGTHS = [9, 14, 5]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request) -> LLM:
    return make_llm(block_size=4, num_kv_blocks=96, max_model_len=256, async_scheduling=request.param)


def stream(llm: LLM, requests: list[tuple[list[int], SamplingParams]]) -> list[list]:
    """Add the requests, step until idle; each request's outputs in order."""
    ids = [llm.add_request(prompt, params) for prompt, params in requests]
    got = {rid: [] for rid in ids}
    while llm.has_unfinished_requests():
        for out in llm.step():
            got[out.request_id].append(out)
    return [got[rid] for rid in ids]


def with_kind(requests: list[tuple[list[int], SamplingParams]], kind: RequestOutputKind) -> list:
    return [(prompt, dataclasses.replace(params, output_kind=kind)) for prompt, params in requests]


def view(completion) -> tuple:
    """A completion as plain values (a ``Logprob`` also by its rank and decoded token)."""
    logprobs = None if completion.logprobs is None else [
        {t: (float(lp), lp.rank, lp.decoded_token) for t, lp in row.items()} for row in completion.logprobs]
    return (completion.index, completion.text, list(completion.token_ids), completion.finish_reason,
            completion.stop_reason, logprobs, completion.cumulative_logprob)


def prompt_view(out) -> list | None:
    rows = out.prompt_logprobs
    return None if rows is None else [
        None if row is None else {t: (float(lp), lp.rank, lp.decoded_token) for t, lp in row.items()} for row in rows]


def final_view(out) -> tuple:
    return sorted(view(c) for c in out.outputs), prompt_view(out), out.finished


def added_up(deltas: list) -> tuple:
    """A request's DELTA outputs folded into one cumulative output: text, tokens and log-probs
    appended per index, the rest from the index's last completion; the prompt log-probs are
    those of the one output that carries them (the first)."""
    folded: dict[int, list] = {}
    for out in deltas:
        for c in out.outputs:
            index, text, ids, finish, stop, logprobs, cumulative = view(c)
            if index not in folded:
                folded[index] = [index, text, ids, finish, stop, logprobs, cumulative]
                continue
            acc = folded[index]
            assert acc[3] is None, "a completion went on after it finished"
            acc[1] += text
            acc[2] = acc[2] + ids
            acc[5] = None if logprobs is None else acc[5] + logprobs
            acc[3], acc[4], acc[6] = finish, stop, cumulative
    carried = [out.prompt_logprobs is not None for out in deltas]
    assert not any(carried[1:]), "prompt log-probs came again after the first output"
    assert [out.finished for out in deltas] == [False] * (len(deltas) - 1) + [True]
    return sorted(tuple(acc) for acc in folded.values()), prompt_view(deltas[0]), True


def assert_deltas_add_up(llm: LLM, requests: list[tuple[list[int], SamplingParams]]) -> list:
    """Run the requests CUMULATIVE, then DELTA, then FINAL_ONLY, and hold each against the
    first; returns the cumulative outputs."""
    cumulative = stream(llm, with_kind(requests, CUMULATIVE))
    delta = stream(llm, with_kind(requests, DELTA))
    final_only = stream(llm, with_kind(requests, FINAL_ONLY))
    for cum, dlt, fin in zip(cumulative, delta, final_only):
        assert added_up(dlt) == final_view(cum[-1])
        assert len(fin) == 1 and final_view(fin[0]) == final_view(cum[-1])
        if requests[0][1].n == 1:  # each delta is what the cumulative output gained since the one before
            assert len(dlt) == len(cum)
            before = ("", [])
            for c, d in zip(cum, dlt):
                c, d = c.outputs[0], d.outputs[0]
                assert c.text.startswith(before[0]) and c.token_ids[:len(before[1])] == before[1]
                assert (d.text, d.token_ids) == (c.text[len(before[0]):], c.token_ids[len(before[1]):])
                before = (c.text, c.token_ids)
    return cumulative


def test_the_enum_is_vllm_s_and_cumulative_is_the_default():
    assert {k.name: k.value for k in RequestOutputKind} == {"CUMULATIVE": 0, "DELTA": 1, "FINAL_ONLY": 2}
    assert kvscope.RequestOutputKind is kvscope.sampling_params.RequestOutputKind
    assert "RequestOutputKind" in kvscope.__all__
    assert SamplingParams().output_kind is CUMULATIVE and SamplingParams().detokenize is True


@pytest.mark.parametrize("extra", [{}, {"logprobs": 2, "prompt_logprobs": 1}], ids=["plain", "logprobs"])
def test_deltas_add_up_to_the_cumulative_final_output(llm, extra):
    requests = [(p, greedy(k, **extra)) for p, k in zip(PROMPTS, LENGTHS)]
    cumulative = assert_deltas_add_up(llm, requests)
    assert sorted(len(c[-1].outputs[0].token_ids) for c in cumulative) == sorted(LENGTHS)
    if extra:
        assert all(c[-1].prompt_logprobs is not None and c[-1].outputs[0].logprobs for c in cumulative)


@pytest.mark.parametrize("extra", [{}, {"logprobs": 1, "prompt_logprobs": 1}], ids=["plain", "logprobs"])
def test_deltas_of_parallel_samples_add_up_per_index(llm, extra):
    requests = [(p, SamplingParams(n=2, temperature=1.0, seed=40 + i, max_tokens=k, ignore_eos=True, **extra))
                for i, (p, k) in enumerate(zip(PROMPTS, LENGTHS))]
    cumulative = assert_deltas_add_up(llm, requests)
    assert all([c.index for c in out[-1].outputs] == [0, 1] for out in cumulative)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_delta_parent_carries_its_prompt_logprobs_once_when_its_children_start_apart(async_scheduling):
    """With one sequence a step, child 1 starts only once child 0 has finished: the parent's
    prompt log-probs still come once, with its first output."""
    llm = make_llm(block_size=4, num_kv_blocks=64, max_model_len=128, max_num_seqs=1,
                   async_scheduling=async_scheduling)
    requests = [(PROMPTS[0], SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=4, ignore_eos=True,
                                            prompt_logprobs=2))]
    ((cum,), (dlt,)) = (stream(llm, with_kind(requests, kind)) for kind in (CUMULATIVE, DELTA))
    assert [c.index for o in dlt[:4] for c in o.outputs] == [0] * 4  # (child 0 alone, to its end)
    assert added_up(dlt) == final_view(cum[-1])


def _needle_across_a_step(llm: LLM) -> tuple[list[int], int, str]:
    """A prompt, a length, and a 2-character stop string whose first character is the last
    text of one step and whose second is the first of the next: a stream that reported text
    as soon as it was decoded would report a character the stop string then cuts off."""
    for prompt, k in zip(PROMPTS, LENGTHS):
        (outs,) = stream(llm, [(prompt, greedy(k))])
        text = outs[-1].outputs[0].text
        for out in outs[:-1]:
            end = len(out.outputs[0].text)
            needle = text[end - 1:end + 1]
            if end and len(needle) == 2 and needle.strip() and "\ufffd" not in needle and text.find(needle) == end - 1:
                return prompt, k, needle
    raise AssertionError("no clean stop string across two steps")


@pytest.mark.parametrize("include", [False, True], ids=["cut", "included"])
def test_deltas_with_stop_strings_never_report_text_the_stop_string_cuts(llm, include):
    prompt, k, needle = _needle_across_a_step(llm)
    stops = [needle, "\x00never\x00"]  # (a longer one that never matches: the hold-back is the longest's)
    requests = [(prompt, greedy(k, stop=stops, include_stop_str_in_output=include))]
    requests += [(p, greedy(n, stop=stops)) for p, n in zip(PROMPTS, LENGTHS) if p != prompt]
    cumulative = assert_deltas_add_up(llm, requests)
    out = cumulative[0][-1].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", needle)
    assert out.text.endswith(needle) == include


@pytest.fixture(scope="module")
def cleanup_llm(tmp_path_factory) -> LLM:
    """An engine whose tokenizer cleans up spaces when it decodes (transformers'
    ``clean_up_tokenization_spaces``: " ," becomes ","), its model biased to draw spaces and
    commas: decoding all its tokens at once gives another text than decoding them as they come."""
    tokenizer_dir = tmp_path_factory.mktemp("cleanup-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_checkpoint("qwen3") / name, tokenizer_dir / name)
    config_path = tokenizer_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(clean_up_tokenization_spaces=True,  # (transformers applies it to a BPE tokenizer only so told)
                  clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True)
    config_path.write_text(json.dumps(config))
    llm = make_llm(block_size=4, num_kv_blocks=64, max_model_len=128, tokenizer=str(tokenizer_dir))
    tokenizer = llm.get_tokenizer()
    space_comma = tokenizer.convert_tokens_to_ids(["\u0120", ","])
    assert tokenizer.decode(space_comma) != tokenizer.decode(space_comma, clean_up_tokenization_spaces=False)
    bias_logits(llm, dict.fromkeys(space_comma, 30.0))
    return llm


@pytest.mark.parametrize("stop", [[], [" ,"]], ids=["plain", "stop-string"])
def test_deltas_add_up_with_a_tokenizer_that_cleans_up_spaces_when_it_decodes(cleanup_llm, stop):
    """As in vLLM, whose detokenizers never clean up spaces, the text is the tokens' decode
    without the clean-up: streamed, final, in deltas and final-only, the same text."""
    requests = [(p, SamplingParams(temperature=1.0, seed=70 + i, max_tokens=k, ignore_eos=True, stop=stop))
                for i, (p, k) in enumerate(zip(PROMPTS, LENGTHS))]
    cumulative = assert_deltas_add_up(cleanup_llm, requests)
    tokenizer = cleanup_llm.get_tokenizer()
    for outs in cumulative:
        c = outs[-1].outputs[0]
        uncleaned = tokenizer.decode(c.token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert c.text == uncleaned[:len(c.text)] and (c.text == uncleaned or c.finish_reason == "stop")
        if c.finish_reason == "stop":  # at the first token whose text completes the stop string
            assert stop[0] in uncleaned and stop[0] not in tokenizer.decode(
                c.token_ids[:-1], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert " ," in tokenizer.decode(c.token_ids, clean_up_tokenization_spaces=False)  # (the trap is there)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def multibyte_llm(request) -> LLM:
    """An engine whose model draws among the bytes of multi-byte characters and a few letters:
    a seeded request may end inside a character, and bytes that never form one come up mid-text."""
    llm = make_llm(block_size=4, num_kv_blocks=64, max_model_len=128, async_scheduling=request.param)
    pieces = llm.get_tokenizer().encode("日本語 🙂 é a b c d e", add_special_tokens=False)
    bias_logits(llm, dict.fromkeys(pieces, 30.0))
    return llm


@pytest.mark.parametrize("n", [1, 2])
def test_a_request_that_ends_inside_a_character_leaves_the_incomplete_tail_out(multibyte_llm, n):
    """As in vLLM, whose detokenizer never lets out the U+FFFD tail it held back: the final text
    is vLLM's, cumulative, in deltas and final-only alike."""
    requests = [(p, SamplingParams(n=n, temperature=1.0, seed=93 + i, max_tokens=k, ignore_eos=True))
                for i, (p, k) in enumerate(zip(PROMPTS, LENGTHS))]
    cumulative = assert_deltas_add_up(multibyte_llm, requests)
    tokenizer = multibyte_llm.get_tokenizer()
    ends_inside = []
    for outs in cumulative:
        for c in outs[-1].outputs:
            assert c.text == vllm_text(tokenizer, c.token_ids)
            ends_inside.append(tokenizer.decode(c.token_ids, skip_special_tokens=True).endswith("\ufffd"))
    assert any(ends_inside) and not all(ends_inside)  # (the trap, and text that ends cleanly beside it)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("via", ["generate", "Ctrl-C"])
def test_deltas_coalesced_by_llm_step_are_appended_not_replaced(llm, via, n):
    """Outputs of streamed requests that progress while ``generate`` runs the engine, or that a
    Ctrl-C kept from a step's caller, reach the next ``LLM.step()`` as one output per request:
    DELTA ones added up, so no token, character or log-prob is lost or repeated."""
    requests = [(p, SamplingParams(n=n, temperature=1.0, seed=60 + i, max_tokens=k, ignore_eos=True, logprobs=1,
                                   prompt_logprobs=1)) for i, (p, k) in enumerate(zip(PROMPTS, LENGTHS))]
    cumulative = stream(llm, with_kind(requests, CUMULATIVE))
    ids = [llm.add_request(p, sp) for p, sp in with_kind(requests, DELTA)]
    got = {rid: [] for rid in ids}
    first = True
    while llm.has_unfinished_requests():
        if first and any(got.values()):  # (async scheduling: the first step reports nothing yet)
            first = False
            if via == "generate":
                llm.generate([[40, 41, 42]], greedy(4), use_tqdm=False)
            else:
                with llm.hooks({"step.end": lambda info: signal.raise_signal(signal.SIGINT)}), \
                        pytest.raises(KeyboardInterrupt):
                    llm.step()
                assert llm._undelivered  # (the step's outputs wait for the next one)
        for out in llm.step():
            got[out.request_id].append(out)
    coalesced = [max(len(c.token_ids) for c in out.outputs) for outs in got.values() for out in outs]
    assert max(coalesced) >= 2  # some output carried the deltas of several steps
    for rid, cum in zip(ids, cumulative):
        assert added_up(got[rid]) == final_view(cum[-1])


@pytest.mark.parametrize("n", [1, 2])
def test_deltas_of_requests_added_to_the_engine_are_appended_by_llm_step_too(llm, n):
    """Whether ``LLM.step()`` adds up a request's outputs is its params' ``output_kind``, not
    which ``add_request`` queued it: one added through ``llm.llm_engine`` loses no delta either."""
    requests = [(p, SamplingParams(n=n, temperature=1.0, seed=80 + i, max_tokens=k, ignore_eos=True, logprobs=1))
                for i, (p, k) in enumerate(zip(PROMPTS, LENGTHS))]
    cumulative = stream(llm, with_kind(requests, CUMULATIVE))
    ids = [llm.llm_engine.add_request(p, sp) for p, sp in with_kind(requests, DELTA)]
    got = {rid: [] for rid in ids}
    while llm.has_unfinished_requests():
        if any(got.values()) and not any(len(outs) > 1 for outs in got.values()):
            llm.generate([[40, 41, 42]], greedy(4), use_tqdm=False)  # (its steps' outputs wait for step())
        for out in llm.step():
            got[out.request_id].append(out)
    assert max(len(c.token_ids) for outs in got.values() for out in outs for c in out.outputs) >= 2
    for rid, cum in zip(ids, cumulative):
        assert added_up(got[rid]) == final_view(cum[-1])


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA])
def test_whether_an_output_is_a_delta_survives_replace_and_copies(llm, kind, n):
    """Whether an output is a DELTA request's, which ``LLM.step`` adds up with the request's
    output not collected yet (a cumulative one replaces it), travels with the output through
    ``dataclasses.replace`` (as parallel sampling builds its parents' outputs), ``copy`` and
    pickle. It is no public field, as vLLM's ``RequestOutput`` has none: out of ``repr`` and ``==``."""
    (outs,) = stream(llm, with_kind([(PROMPTS[0], SamplingParams(n=n, temperature=1.0, seed=50, max_tokens=4))], kind))
    for out in outs:
        assert out._is_delta == (kind is DELTA)
        twins = (dataclasses.replace(out, request_id="twin"), copy.copy(out), copy.deepcopy(out),
                 pickle.loads(pickle.dumps(out)))
        assert [twin._is_delta for twin in twins] == [out._is_delta] * len(twins)
        flipped = dataclasses.replace(out, _is_delta=not out._is_delta)
        assert flipped == out and repr(flipped) == repr(out) and "_is_delta" not in repr(out)


def test_an_aborted_delta_request_s_last_output_carries_only_the_rest(llm):
    params = greedy(20, logprobs=1)
    outputs = {}
    for kind in (CUMULATIVE, DELTA):
        rid = llm.add_request(PROMPTS[0], dataclasses.replace(params, output_kind=kind))
        outs = []
        while llm.has_unfinished_requests():
            outs += llm.step()
            if len(outs) == 3:
                llm.abort_request(rid)
        outputs[kind] = outs
    cum, dlt = outputs[CUMULATIVE], outputs[DELTA]
    assert cum[-1].outputs[0].finish_reason == "abort" and len(dlt) == len(cum)
    assert added_up(dlt) == final_view(cum[-1])
    assert len(dlt[-1].outputs[0].token_ids) == len(cum[-1].outputs[0].token_ids) - len(cum[-2].outputs[0].token_ids)


def test_generate_returns_final_cumulative_outputs_whatever_the_kind(llm):
    params = greedy(7, logprobs=1, prompt_logprobs=1)
    want = [final_view(o) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    for kind in (DELTA, FINAL_ONLY):
        kind_params = dataclasses.replace(params, output_kind=kind)
        assert [final_view(o) for o in llm.generate(PROMPTS, kind_params, use_tqdm=False)] == want
        assert kind_params.output_kind is kind  # (the caller's params are left as they were)


def test_detokenize_false_gives_the_same_tokens_and_no_text(llm):
    """No text, and no decoded tokens in the log-probs (as vLLM, which then has no tokenizer
    for the request), in every streamed output and in generate's."""
    params = greedy(8, logprobs=1, prompt_logprobs=1, stop_token_ids=[7])
    for kind in (CUMULATIVE, DELTA):
        with_text, without = (stream(llm, [(p, dataclasses.replace(params, output_kind=kind, detokenize=d))
                                           for p in PROMPTS]) for d in (True, False))
        for texted, bare in zip(with_text, without):
            assert [c.token_ids for o in bare for c in o.outputs] == [c.token_ids for o in texted for c in o.outputs]
            assert any(c.text for o in texted for c in o.outputs)
            assert all(c.text == "" for o in bare for c in o.outputs)
            decoded = [lp.decoded_token for o in bare for c in o.outputs for row in c.logprobs for lp in row.values()]
            decoded += [lp.decoded_token for o in bare for row in (o.prompt_logprobs or [])[1:] for lp in row.values()]
            assert decoded and all(d is None for d in decoded)
            assert texted[0].prompt_logprobs[1] and next(iter(texted[0].prompt_logprobs[1].values())).decoded_token
    bare = llm.generate(PROMPTS, dataclasses.replace(params, detokenize=False), use_tqdm=False)
    texted = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in bare] == [o.outputs[0].token_ids for o in texted]
    assert all(o.outputs[0].text == "" for o in bare)


@pytest.mark.parametrize("value", ["DELTA", 1, None, "delta"])
def test_an_output_kind_that_is_not_the_enum_is_refused_naming_it(value):
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind=value)


@pytest.mark.parametrize("value", ["no", 0, None])
def test_a_detokenize_that_is_not_a_bool_is_refused_naming_it(value):
    with pytest.raises(ValueError, match="detokenize must be a bool"):
        SamplingParams(detokenize=value)


@pytest.mark.parametrize("stop", ["x", ["ab", "c"]])
def test_stop_strings_with_detokenize_false_are_refused_naming_both(stop):
    with pytest.raises(ValueError, match="stop.*detokenize=False|detokenize=False.*stop") as caught:
        SamplingParams(stop=stop, detokenize=False)
    assert "stop" in str(caught.value) and "detokenize" in str(caught.value)
    SamplingParams(stop=[], detokenize=False)  # (no stop string: nothing to refuse, as in vLLM)
    SamplingParams(stop_token_ids=[3], detokenize=False)
