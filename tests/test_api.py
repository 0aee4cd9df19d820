"""The vLLM-compatible surface: prompt forms, ordering, streaming, abort, stops, logprobs, errors."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_helpers import bias_logits, drain, greedy, make_llm, token_ids
from kvscope import LLM, SamplingParams
from kvscope.config import CPU_KV_CACHE_BYTES, EngineConfig
from tiny_models import EOS_ID, tiny_checkpoint


@pytest.fixture(scope="module")
def llm() -> LLM:
    return make_llm(block_size=4, num_kv_blocks=64, max_model_len=256)


def test_prompt_forms_agree_and_keep_input_order(llm):
    tok = llm.get_tokenizer()
    texts = ["The quick brown fox", "A paged key value cache stores", "Numbers 1 2 3"]
    ids = [tok.encode(t) for t in texts]
    by_text = llm.generate(texts, greedy(5), use_tqdm=False)
    by_ids = llm.generate(ids, greedy(5), use_tqdm=False)
    by_dict = llm.generate([{"prompt_token_ids": i} for i in ids], greedy(5), use_tqdm=False)
    assert token_ids(by_text) == token_ids(by_ids) == token_ids(by_dict)
    assert [o.prompt for o in by_text] == texts
    assert [o.prompt_token_ids for o in by_text] == ids
    single = llm.generate(texts[1], greedy(5), use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == by_text[1].outputs[0].token_ids
    one_list = llm.generate(ids[2], greedy(5), use_tqdm=False)  # a bare list of ints is one prompt
    assert len(one_list) == 1 and one_list[0].outputs[0].token_ids == by_text[2].outputs[0].token_ids
    assert by_text[0].outputs[0].text == tok.decode(by_text[0].outputs[0].token_ids, skip_special_tokens=True)


def _with_bos_tokenizer(path) -> str:
    """A copy of the tiny llama checkpoint whose tokenizer puts BOS before a text, as Llama's do."""
    import shutil

    from tokenizers import processors
    from transformers import AutoTokenizer

    shutil.copytree(tiny_checkpoint("llama"), path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tok.bos_token} $A", special_tokens=[(tok.bos_token, tok.bos_token_id)])
    tok.save_pretrained(path)
    return str(path)


def test_a_text_prompt_is_tokenized_with_the_special_tokens_its_tokenizer_adds(tmp_path):
    """vLLM tokenizes a text prompt with the tokenizer's defaults, so a Llama prompt starts with
    BOS; the model was trained on such prompts, and the same text must give the same tokens."""
    from transformers import AutoTokenizer

    path = _with_bos_tokenizer(tmp_path / "bos")
    truth = AutoTokenizer.from_pretrained(path)
    text = "The quick brown fox"
    assert truth(text).input_ids[0] == truth.bos_token_id  # (the check below can tell)
    llm = LLM(path, device="cpu", dtype="float32", block_size=4, num_kv_blocks=32)
    by_text, by_dict = llm.generate([text, {"prompt": text}], greedy(4), use_tqdm=False)
    by_ids = llm.generate([truth(text).input_ids], greedy(4), use_tqdm=False)[0]
    assert by_text.prompt_token_ids == by_dict.prompt_token_ids == truth(text).input_ids
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids


def test_truncate_prompt_tokens_keeps_the_prompt_s_last_tokens(llm):
    """vLLM's left truncation: the same tokens as the truncated prompt given whole."""
    prompt = list(range(5, 45))
    for keep in (1, 7, 40, 100):
        out = llm.generate([prompt], greedy(4, truncate_prompt_tokens=keep), use_tqdm=False)[0]
        whole = llm.generate([prompt[-keep:]], greedy(4), use_tqdm=False)[0]
        assert out.prompt_token_ids == prompt[-keep:] and out.outputs[0].token_ids == whole.outputs[0].token_ids
    with pytest.raises(ValueError, match=r"prompt length \(256\) \+ max_tokens \(4\)"):  # (-1: max_model_len)
        llm.add_request(list(range(5, 300)), greedy(4, truncate_prompt_tokens=-1))


def test_per_prompt_sampling_params_and_lengths(llm):
    outs = llm.generate([[5, 6, 7]] * 3, [greedy(1), greedy(4), greedy(9)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 4, 9]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    m = outs[2].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([[5], [6]], [greedy(1)], use_tqdm=False)


def test_step_streams_incrementally_and_abort(llm):
    a = llm.add_request([9, 8, 7, 6], greedy(6))
    b = llm.add_request([1, 2, 3], greedy(50))
    seen: dict[str, list[int]] = {a: [], b: []}
    finished = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            toks = out.outputs[0].token_ids
            assert toks[: len(seen[out.request_id])] == seen[out.request_id]  # grows monotonically
            seen[out.request_id] = toks
            if out.finished:
                finished[out.request_id] = out.outputs[0].finish_reason
            if len(seen[b]) == 3 and b not in finished:
                llm.abort_request(b)
    assert finished == {a: "length", b: "abort"}  # the step after an abort reports it
    assert len(seen[a]) == 6 and len(seen[b]) == 3
    assert seen[a] == llm.generate([[9, 8, 7, 6]], greedy(6), use_tqdm=False)[0].outputs[0].token_ids
    llm.check_invariants()
    assert llm.llm_engine.block_manager.num_free_blocks == 64


def test_stop_token_ids_and_stop_strings(llm):
    full = llm.generate([[11, 12, 13]], greedy(12), use_tqdm=False)[0].outputs[0]
    stop_tok = full.token_ids[4]
    first = full.token_ids.index(stop_tok)
    out = llm.generate([[11, 12, 13]], greedy(12, stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    text = full.text
    # a two-character needle from the middle, not blank and not the replacement character
    # (random token ids decode to stray bytes)
    needle = next(text[i:i + 2] for i in range(len(text) // 2, len(text) - 1)
                  if text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2])
    out = llm.generate([[11, 12, 13]], greedy(12, stop=[needle]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == needle
    assert out.text == text[: text.index(needle)]


def test_the_token_that_stops_a_request_is_left_out_of_its_text(llm):
    """As in vLLM: a token of ``stop_token_ids`` ends the request and stays in ``token_ids``, but
    its text is not in ``text`` unless ``include_stop_str_in_output`` (the tokenizer's own decode
    of the ids is the truth)."""
    tokenizer = llm.get_tokenizer()
    full = llm.generate([[11, 12, 13]], greedy(12), use_tqdm=False)[0].outputs[0].token_ids
    # a token that first appears here and adds text
    i = next(i for i in range(1, 12) if full[i] not in full[:i]
             and tokenizer.decode(full[:i + 1]) != tokenizer.decode(full[:i]))
    for include in (False, True):
        params = greedy(12, stop_token_ids=[full[i]], include_stop_str_in_output=include)
        out = llm.generate([[11, 12, 13]], params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == full[:i + 1] and out.stop_reason == full[i]
        assert out.text == tokenizer.decode(full[:i + 1] if include else full[:i])


def test_a_stop_string_inside_the_text_of_the_token_that_stops_a_request(llm):
    """As in vLLM: with ``include_stop_str_in_output`` the stopping token's text is output text,
    so a stop string inside it cuts the text there and becomes the ``stop_reason``; without it,
    that text is never searched and the token stays the reason (the tokenizer's decode is the
    truth)."""
    tokenizer = llm.get_tokenizer()
    full = llm.generate([[11, 12, 13]], greedy(12), use_tqdm=False)[0].outputs[0].token_ids
    for i in range(1, 12):  # a new token whose text has a character, not its last, unseen before it
        before, upto = tokenizer.decode(full[:i]), tokenizer.decode(full[:i + 1])
        added = upto[len(before):] if upto.startswith(before) else ""
        needle = next((c for c in added[:-1] if not c.isspace() and c not in before and c != "\ufffd"), None)
        if full[i] not in full[:i] and needle is not None:
            break
    else:
        raise AssertionError("no token whose text holds a fresh character before its last")
    for include in (False, True):
        params = greedy(12, stop_token_ids=[full[i]], stop=[needle], include_stop_str_in_output=include)
        out = llm.generate([[11, 12, 13]], params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == full[:i + 1] and out.finish_reason == "stop"
        if include:
            assert out.stop_reason == needle and out.text == upto[: upto.index(needle) + 1] != upto
        else:
            assert out.stop_reason == full[i] and out.text == before


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_min_tokens_ending_inside_a_character_hide_only_that_character(async_scheduling):
    """The text a stop string may not end in is that of the first ``min_tokens`` tokens less an
    incomplete last character, whether the request is streamed (its text read at every step) or
    final-only (read first at ``min_tokens``): here the first 4 tokens end inside a 4-byte
    character, so the ``a`` of ``xa`` is theirs and the request stops at the next ``a``."""
    llm = make_llm(async_scheduling=async_scheduling)
    tokenizer = llm.get_tokenizer()
    script = tokenizer.encode("xa\U0001d518b\U0001d54fa", add_special_tokens=False)
    assert tokenizer.decode(script[:4]).endswith("\ufffd")  # the 4th token ends inside a character
    stop_at = len(script)
    script += tokenizer.encode("zzzzzz", add_special_tokens=False)  # (an async step may run past the stop)
    draws = iter(script)
    bias_logits(llm, lambda: {next(draws): 1e4})  # each run draws the script from its start
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=len(script) - 2, min_tokens=4, stop=["a"],
                                include_stop_str_in_output=include)
        text = tokenizer.decode(script[:stop_at])
        want = text if include else text[:-1]
        draws = iter(script)
        final_only = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
        draws = iter(script)
        rid = llm.add_request([5, 6, 7], params)
        streamed = drain(llm)[rid].outputs[0]
        for out in (final_only, streamed):
            assert (out.token_ids, out.text, out.stop_reason) == (script[:stop_at], want, "a")


def test_stop_strings_in_the_text_of_the_first_min_tokens_tokens_are_ignored(llm):
    """As in vLLM: a stop string is looked for only once more than ``min_tokens`` tokens are out,
    in the text they add (a match may begin up to its length back). A stop string that is the
    whole text of the first two tokens stops the request at once, but not with ``min_tokens=2``."""
    tokenizer = llm.get_tokenizer()
    for prompt in ([11, 12, 13], [20, 21], [30, 31, 32], [40], [50, 51]):
        out = llm.generate([prompt], greedy(10), use_tqdm=False)[0].outputs[0]
        needle = tokenizer.decode(out.token_ids[:2])
        if needle.strip() and "\ufffd" not in needle and out.text.count(needle) == 1:
            break
    else:
        raise AssertionError("no prompt whose first two tokens make a clean, unrepeated needle")
    assert out.text.startswith(needle)
    stopped = llm.generate([prompt], greedy(10, stop=[needle]), use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.text == "" and len(stopped.token_ids) <= 2
    params = greedy(10, stop=[needle], min_tokens=2)
    final_only = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    rid = llm.add_request(prompt, params)  # streamed: its text is decoded as it grows
    streamed = drain(llm)[rid].outputs[0]
    for late in (final_only, streamed):
        assert late.finish_reason == "length" and late.text == out.text


def test_eos_stops_unless_ignored():
    llm = make_llm(block_size=4)
    bias_logits(llm, {EOS_ID: 1e4})  # EOS the argmax everywhere
    out = llm.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [EOS_ID] and out.finish_reason == "stop" and out.text == ""
    # EOS's own text, kept by skip_special_tokens=False, stays out too unless asked for (as in vLLM)
    eos_text = llm.get_tokenizer().decode([EOS_ID], skip_special_tokens=False)
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=5, skip_special_tokens=False,
                                include_stop_str_in_output=include)
        out = llm.generate([[5, 6]], params, use_tqdm=False)[0].outputs[0]
        assert eos_text and out.token_ids == [EOS_ID] and out.text == (eos_text if include else "")
    out = llm.generate([[5, 6]], greedy(5), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [EOS_ID] * 5 and out.finish_reason == "length"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_min_tokens_hold_back_eos_and_stop_tokens(async_scheduling):
    """As in vLLM, a request short of its ``min_tokens`` never draws EOS or one of its
    ``stop_token_ids`` (rather than drawing and ignoring them): on a model that all but always
    picks them, greedy and sampled requests give exactly ``min_tokens`` other tokens, then stop."""
    llm = make_llm(block_size=4, async_scheduling=async_scheduling)
    bias_logits(llm, {EOS_ID: 1e4})
    params = [SamplingParams(temperature=0, max_tokens=8, min_tokens=3),
              SamplingParams(temperature=1.0, max_tokens=8, min_tokens=5, seed=3),
              SamplingParams(temperature=0, max_tokens=8)]
    outs = [o.outputs[0] for o in llm.generate([[5, 6], [7, 8, 9], [10]], params, use_tqdm=False)]
    assert [len(o.token_ids) for o in outs] == [4, 6, 1]
    assert all(o.token_ids[-1] == EOS_ID not in o.token_ids[:-1] and o.finish_reason == "stop" for o in outs)
    stop = 9
    bias_logits(llm, {stop: 3e4})  # now above EOS
    params = [SamplingParams(temperature=0, max_tokens=8, min_tokens=2, stop_token_ids=[stop], ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=8, min_tokens=4, stop_token_ids=[stop], ignore_eos=True)]
    outs = [o.outputs[0] for o in llm.generate([[5, 6], [7, 8, 9]], params, use_tqdm=False)]
    assert [o.token_ids for o in outs] == [[EOS_ID] * 2 + [stop], [EOS_ID] * 4 + [stop]]
    assert all(o.stop_reason == stop for o in outs)
    llm.check_invariants()


def test_logprobs_are_log_softmax_of_the_model(llm):
    out = llm.generate([[20, 21, 22]], greedy(3, logprobs=4), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 3
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and len(lp) == 4  # greedy: the chosen token is among the top 4
        assert max(lp, key=lp.get) == tok
        assert all(v <= 0 for v in lp.values())
    hf = __import__("tiny_models").load_hf_model(tiny_checkpoint("qwen3"))
    with torch.no_grad():
        ref = hf(torch.tensor([[20, 21, 22]])).logits[0, -1].log_softmax(-1)
    first = out.logprobs[0]
    for t, v in first.items():
        assert v == pytest.approx(ref[t].item(), abs=1e-4)


def test_logprobs_of_minus_one_are_the_whole_vocabulary_as_in_vllm():
    """vLLM's ``logprobs=-1`` and ``prompt_logprobs=-1``: every token's log-prob, as asking for
    the vocabulary's size gives them (on an engine whose ``max_logprobs`` is -1, no cap)."""
    llm = make_llm(block_size=4, max_logprobs=-1)
    vocab = llm.llm_engine.vocab_size
    prompt = [20, 21, 22, 23]
    whole, sized = (llm.generate([prompt], SamplingParams(temperature=1.0, seed=4, max_tokens=3, ignore_eos=True,
                                                           logprobs=k, prompt_logprobs=k), use_tqdm=False)[0]
                    for k in (-1, vocab))
    assert whole.outputs[0].token_ids == sized.outputs[0].token_ids
    for got, want in ((whole.outputs[0].logprobs, sized.outputs[0].logprobs),
                      (whole.prompt_logprobs[1:], sized.prompt_logprobs[1:])):
        assert [len(row) for row in got] == [vocab] * len(want)
        assert [{t: lp.logprob for t, lp in row.items()} for row in got] == \
            [{t: lp.logprob for t, lp in row.items()} for row in want]


def test_logprobs_of_true_are_one_as_in_vllm(llm):
    """vLLM's ``logprobs=True`` and ``prompt_logprobs=True``: one log-prob besides the token's
    own, as ``1`` gives."""
    prompt = [20, 21, 22, 23]
    flagged, one = (llm.generate([prompt], SamplingParams(temperature=1.0, seed=4, max_tokens=3, ignore_eos=True,
                                                           logprobs=k, prompt_logprobs=k), use_tqdm=False)[0]
                    for k in (True, 1))
    assert flagged.outputs[0].token_ids == one.outputs[0].token_ids
    for got, want in ((flagged.outputs[0].logprobs, one.outputs[0].logprobs),
                      (flagged.prompt_logprobs[1:], one.prompt_logprobs[1:])):
        assert [{t: lp.logprob for t, lp in row.items()} for row in got] == \
            [{t: lp.logprob for t, lp in row.items()} for row in want]


@pytest.mark.parametrize("cap", [20, 3])
def test_max_logprobs_caps_what_a_request_may_ask_for_as_in_vllm(cap):
    """vLLM's ``max_logprobs`` (default 20): a request asking for more log-probs, or prompt
    log-probs, or for the whole vocabulary's (-1), is refused naming the cap, and the engine
    serves on; the cap itself is served."""
    llm = make_llm(block_size=4) if cap == 20 else make_llm(block_size=4, max_logprobs=cap)
    assert llm.config.max_logprobs == cap
    for name in ("logprobs", "prompt_logprobs"):
        for k in (cap + 1, -1):
            with pytest.raises(ValueError, match=rf"^{name}=\d+ exceeds max_logprobs={cap}, the engine's cap"):
                llm.generate([[20, 21, 22]], greedy(3, **{name: k}), use_tqdm=False)
    out = llm.generate([[20, 21, 22]], greedy(3, logprobs=cap, prompt_logprobs=cap), use_tqdm=False)[0]
    assert [len(row) for row in out.outputs[0].logprobs] == [cap] * 3
    for token, row in zip((21, 22), out.prompt_logprobs[1:]):  # the top ``cap`` and the prompt's own token
        assert token in row and len(row) in (cap, cap + 1)
    assert not llm.has_unfinished_requests()
    llm.check_invariants()


def test_kv_cache_memory_bytes_unset_gives_a_cpu_pool_its_default_budget():
    """vLLM's ``kv_cache_memory_bytes`` defaults to None; on CPU the pool then takes
    ``CPU_KV_CACHE_BYTES``, as setting it to that does, and a set value sizes the pool."""
    from kvscope.runner.model_runner import kv_block_bytes

    default, same, small = (make_llm(**kw) for kw in ({}, dict(kv_cache_memory_bytes=CPU_KV_CACHE_BYTES),
                                                       dict(kv_cache_memory_bytes=1 << 20)))
    assert default.config.kv_cache_memory_bytes is None
    block = kv_block_bytes(default.hf_config, 1, default.config.block_size, default.llm_engine.executor.kv_cache_dtype)
    assert [llm.llm_engine.block_manager.num_blocks for llm in (default, same, small)] == \
        [CPU_KV_CACHE_BYTES // block, CPU_KV_CACHE_BYTES // block, (1 << 20) // block]


def test_a_seed_of_minus_one_is_no_seed_as_in_vllm(llm):
    """vLLM's ``seed=-1``: the request draws as an unseeded one does (two such runs differ),
    where any other seed, negative ones too, repeats its draws."""
    def run(seed: int) -> list[int]:
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True)
        return llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids

    assert SamplingParams(seed=-1).seed is None
    assert run(-1) != run(-1)
    assert run(-2) == run(-2)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_logprobs_are_vllm_logprob_objects_with_rank_and_decoded_token(async_scheduling):
    """vLLM's ``Logprob``: ``.logprob``, ``.rank`` (the tokens at least as likely, counted on
    transformers' log-softmax; no two tie here) and ``.decoded_token`` (the tokenizer's text of the token alone),
    for a drawn token outside the top-k too, and for prompt log-probs."""
    llm = make_llm(block_size=4, async_scheduling=async_scheduling)
    prompt = [20, 21, 22, 40]
    params = SamplingParams(temperature=1.5, seed=3, max_tokens=6, ignore_eos=True, logprobs=1, prompt_logprobs=2)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    hf = __import__("tiny_models").load_hf_model(tiny_checkpoint("qwen3"))
    ids = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    tok = llm.get_tokenizer()
    positions = [(i - 1, ids[i], out.prompt_logprobs[i]) for i in range(1, len(prompt))]
    positions += [(len(prompt) - 1 + j, t, out.outputs[0].logprobs[j]) for j, t in enumerate(out.outputs[0].token_ids)]
    assert any(lp[t].rank > 1 for _, t, lp in positions)  # (a token drawn or prompted off the top)
    for at, token, row in positions:
        for t, lp in row.items():
            assert lp.logprob == float(lp) == pytest.approx(ref[at, t].item(), abs=1e-4)
            assert lp.rank == 1 + int((ref[at] > ref[at, t] + 1e-5).sum()), (at, t)
            assert lp.decoded_token == tok.decode([t])


BAD_PARAMS = [
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=2.0), "truncate_prompt_tokens"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_p=float("nan")), "min_p"),
    (dict(top_k=-3), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(logprobs=-2), "logprobs"),
    (dict(prompt_logprobs=-2), "prompt_logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(n=0), "n must be an integer >= 1"),
    (dict(n=1.5), "n must be an integer >= 1"),
    (dict(n=True), "n must be an integer >= 1"),
]


@pytest.mark.parametrize("kwargs,name", BAD_PARAMS)
def test_invalid_sampling_params_raise_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_a_none_in_a_list_of_sampling_params_samples_with_the_model_s_defaults(tmp_path):
    """As ``sampling_params=None`` and ``add_request(prompt)`` do: a None in the list was
    ``SamplingParams()`` (16 tokens here, at temperature 1), not the model's generation config."""
    from test_generation_defaults import checkpoint_with

    llm = LLM(checkpoint_with(tmp_path / "m", temperature=0.0, max_new_tokens=5), device="cpu", dtype="float32",
              block_size=4, num_kv_blocks=32)
    prompts = [[5, 6, 7, 8], [40, 41, 42]]
    three = SamplingParams(temperature=0, max_tokens=3)
    listed = llm.generate(prompts, [None, three], use_tqdm=False)
    assert token_ids(listed) == [token_ids(llm.generate(prompts[:1], use_tqdm=False))[0],
                                 token_ids(llm.generate(prompts[1:], three, use_tqdm=False))[0]]
    assert [len(t) for t in token_ids(listed)] == [5, 3]


def test_bad_requests_raise_at_add_request_and_engine_keeps_serving(llm):
    vocab = llm.hf_config.vocab_size
    with pytest.raises(ValueError, match="empty"):
        llm.add_request([], greedy(1))
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", greedy(1), use_tqdm=False)
    with pytest.raises(ValueError, match=f"outside the vocabulary \\[0, {vocab}\\)"):
        llm.add_request([1, vocab], greedy(1))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.add_request([-1], greedy(1))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.add_request([1] * 200, greedy(100))
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.add_request([1], {"temperature": 0})
    # a batch with one bad prompt adds nothing and leaves the engine clean
    with pytest.raises(ValueError):
        llm.generate([[1, 2], [vocab + 5]], greedy(2), use_tqdm=False)
    assert not llm.has_unfinished_requests()
    out = llm.generate([[1, 2, 3]], greedy(4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    llm.check_invariants()


def test_request_that_cannot_fit_the_pool_is_refused_not_hung():
    llm = make_llm(block_size=4, num_kv_blocks=3)
    with pytest.raises(ValueError, match="could never run.*num_kv_blocks=3|num_kv_blocks=3.*could never run"):
        llm.generate([[1] * 10], greedy(5), use_tqdm=False)
    assert len(llm.generate([[1] * 6], greedy(5), use_tqdm=False)[0].outputs[0].token_ids) == 5


def test_unknown_and_invalid_config_keys_raise():
    path = str(tiny_checkpoint("qwen3"))
    with pytest.raises(TypeError, match="did you mean 'block_size'"):
        LLM(path, block_szie=8, device="cpu")
    with pytest.raises(ValueError, match="block_size"):
        LLM(path, block_size=0, device="cpu")
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM(path, scheduling_policy="fifo", device="cpu")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(path, max_model_len=10**6, device="cpu")
    with pytest.raises(FileNotFoundError, match="never downloads"):
        LLM("some-org/definitely-not-cached-model")


@pytest.mark.parametrize("dtype, name", [("half", "float16"), ("float", "float32"), (torch.float16, "float16"),
                                         (torch.bfloat16, "bfloat16"), (torch.float32, "float32")])
def test_dtype_takes_vllm_s_other_names_and_torch_dtypes(dtype, name):
    """vLLM's ``dtype`` is also ``"half"``, ``"float"`` or a ``torch.dtype`` (``LLM(m, dtype=torch.bfloat16)``);
    kvscope refused them, naming its own four."""
    assert EngineConfig.from_kwargs(dtype=dtype).dtype == name


def test_a_torch_dtype_kvscope_does_not_run_is_refused_by_name():
    with pytest.raises(ValueError, match=r"^dtype must be one of 'auto', 'float32', 'float16', 'bfloat16', "
                                         r"got torch.float64"):
        EngineConfig.from_kwargs(dtype=torch.float64)


def test_runner_error_is_raised_and_engine_recovers(llm):
    runner = llm.llm_engine.executor
    original = runner.execute
    calls = {"n": 0}

    def flaky(out):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected device failure")
        return original(out)

    runner.execute = flaky
    try:
        with pytest.raises(RuntimeError, match="injected"):
            llm.generate([[3, 4, 5]], greedy(5), use_tqdm=False)
    finally:
        runner.execute = original
    assert not llm.has_unfinished_requests()
    llm.check_invariants()
    assert len(llm.generate([[3, 4, 5]], greedy(5), use_tqdm=False)[0].outputs[0].token_ids) == 5


def test_async_step_error_rolls_back_both_steps_and_engine_recovers():
    """A launch that fails while the previous step is in flight rolls both back; the requests
    then run to the same tokens as an engine that never failed."""
    llm = make_llm(block_size=4, async_scheduling=True)
    engine, runner = llm.llm_engine, llm.llm_engine.executor
    launch, calls = runner.execute_async, {"n": 0}

    def flaky(out):
        calls["n"] += 1
        if calls["n"] == 3:  # the previous step is still in flight
            raise RuntimeError("injected device failure")
        return launch(out)

    runner.execute_async = flaky
    prompts, params = [[3, 4, 5, 6, 7], [8, 9, 10]], [greedy(2), greedy(6)]
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]  # the failing step
    # schedules only the second: the first's last token is in flight in the step before
    with pytest.raises(RuntimeError, match="injected"):
        while engine.has_unfinished_requests():
            engine.step()
    llm.check_invariants()
    done = {}
    while engine.has_unfinished_requests():  # the engine keeps serving the same requests
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    expected = token_ids(make_llm(block_size=4).generate(prompts, params, use_tqdm=False))
    assert [done[i] for i in ids] == expected
    with pytest.raises(RuntimeError, match="injected"):  # and through generate(), which aborts its requests
        calls["n"] = 1
        llm.generate(prompts, params, use_tqdm=False)
    runner.execute_async = launch
    assert not llm.has_unfinished_requests()
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected


def test_cpu_threads_apply_to_steps_and_restore_the_callers_setting():
    llm = make_llm(block_size=4, cpu_threads=1)
    seen = []
    model = llm.llm_engine.executor.model
    model.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm.generate([[1, 2, 3]], greedy(3), use_tqdm=False)
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)
    with pytest.raises(ValueError, match="cpu_threads"):
        make_llm(cpu_threads=0)


def test_demo_command_runs_on_the_bundled_model_and_hits_the_prefix_cache(capsys):
    import re

    from kvscope.__main__ import main

    main(["demo", "--device", "cpu", "--max-tokens", "8"])
    out = capsys.readouterr().out
    cached, total = map(int, re.search(r"again: (\d+) of (\d+) prompt tokens", out).groups())
    assert 0 < cached < total  # full blocks come back from the cache; the last token never does


@pytest.mark.parametrize("option, value, named", [
    ("--block-size", "0", "block_size"), ("--max-tokens", "0", "max_tokens"),
    ("--temperature", "nan", "temperature"), ("--device", "tpu", "device"),
    ("--model", "/nonexistent/model", "model"),
])
def test_demo_command_refuses_a_bad_option_with_a_usage_error(option, value, named, capsys):
    """A value the engine refuses is a usage error naming it (exit status 2), not a traceback."""
    from kvscope.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--device", "cpu", option, value])
    assert exit_info.value.code == 2
    assert f"kvscope demo: error: {named}" in capsys.readouterr().err


def test_engine_runs_without_the_notebook_extra():
    """pandas/pyarrow are the notebook extra: the engine and ``kvscope demo`` work without them
    (as from a bare wheel install), and recording says what to install."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['pandas'] = None; sys.modules['pyarrow'] = None\n"
        "from kvscope import LLM, SamplingParams\n"
        "llm = LLM(device='cpu')\n"
        "out = llm.generate('Help on topic assert:\\n\\n', SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)\n"
        "assert len(out[0].outputs[0].token_ids) >= 1\n"
        "try:\n"
        "    llm.record().__enter__()\n"
        "except ImportError as e:\n"
        "    print('REFUSED', e)\n"
        "from kvscope.__main__ import main\n"
        "main(['demo', '--device', 'cpu', '--max-tokens', '4'])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "REFUSED" in proc.stdout and "kvscope[notebook]" in proc.stdout
    assert "8 requests" in proc.stdout and "the per-step table needs pandas" in proc.stdout


def test_use_tqdm_may_be_a_tqdm_factory_as_in_vllm() -> None:
    """vLLM's ``use_tqdm`` takes a callable that makes the progress bar: it is called once with
    the number of requests, and ticked once per finished request."""
    made = []

    class Bar:
        def __init__(self, total: int, **_: object) -> None:
            self.total, self.n, self.closed = total, 0, False
            made.append(self)

        def update(self, k: int) -> None:
            self.n += k

        def close(self) -> None:
            self.closed = True

    llm = make_llm(num_kv_blocks=32)
    outs = llm.generate([[5, 6], [7, 8, 9], [10]], greedy(3), use_tqdm=Bar)
    assert len(outs) == 3 and [(b.total, b.n, b.closed) for b in made] == [(3, 3, True)]


def test_an_llm_s_repr_says_its_model_pool_and_queues_as_the_engine_has_them_now():
    """In a notebook ``llm`` showed ``<kvscope.llm.LLM object at 0x...>``. Its repr is one line:
    the model, the device, the KV blocks referenced by the requests' block tables now, the queues
    and the step; read again mid-run (from a hook) and after shutdown."""
    llm = make_llm(block_size=4, num_kv_blocks=48, max_num_seqs=2)
    engine, name = llm.llm_engine, Path(llm.model_dir).name

    def expected(running: int, waiting: int, used: int, step: int) -> str:
        return (f"<kvscope.LLM {name!r} on cpu: {used} of 48 KV blocks of 4 tokens in use, "
                f"{running} running, {waiting} waiting, step {step}>")

    assert repr(llm) == expected(0, 0, 0, 0)
    seen = []

    def look(info) -> None:
        s = engine.scheduler
        used = len({b for r in s.running for b in r.block_table})
        seen.append((repr(llm), expected(len(s.running), len(s.waiting), used, info.step)))

    hook = llm.hooks.add("step.end", look)
    llm.generate(["the quick brown fox"] * 3, greedy(6), use_tqdm=False)
    hook.remove()
    assert [got for got, _ in seen] == [want for _, want in seen]
    assert any("2 running, 1 waiting" in got for got, _ in seen)
    llm.shutdown()
    assert repr(llm) == f"<kvscope.LLM {name!r}: shut down>"
