"""Hostile input (issue #14): every case ends in an error naming the argument or cause, or in a
correct result, and the engine stays healthy afterwards: the same greedy tokens as a fresh
engine, nothing left unfinished, every control-plane invariant intact."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

import kvscope
from engine_helpers import greedy, make_llm, token_ids
from kvscope import LLM, SamplingParams
from kvscope.config import EngineConfig
from kvscope.trace import Recorder
from tiny_models import TINY, tiny_checkpoint

VOCAB = TINY["vocab_size"]
PROMPTS = [[5, 6, 7, 8], "the quick brown fox"]


@pytest.fixture(scope="module")
def fresh_tokens() -> list[list[int]]:
    return token_ids(make_llm(num_kv_blocks=32).generate(PROMPTS, greedy(6), use_tqdm=False))


@pytest.fixture(scope="module")
def llm() -> LLM:
    return make_llm(num_kv_blocks=32, max_logprobs=-1)


def assert_healthy(llm: LLM, fresh_tokens: list[list[int]]) -> None:
    assert not llm.has_unfinished_requests()
    llm.check_invariants()
    assert token_ids(llm.generate(PROMPTS, greedy(6), use_tqdm=False)) == fresh_tokens


def changed(field: str, value: Any) -> SamplingParams:
    """Valid params with one field set to ``value`` after they were built (no check runs then)."""
    params = greedy(3)
    setattr(params, field, value)
    return params


# (what is fed in, the exception, a pattern its message must match: the argument's name)
REQUEST_CASES: dict[str, tuple[Callable[[LLM], Any], type[Exception], str]] = {
    "stop=123": (lambda llm: SamplingParams(stop=123), ValueError, r"^stop must be .* got 123"),
    "stop as a dict": (lambda llm: SamplingParams(stop={"a": 1}), ValueError, r"^stop must be"),
    "stop_token_ids as a dict": (lambda llm: SamplingParams(stop_token_ids={3: 4}), ValueError,
                                 r"^stop_token_ids must be"),
    "NaN temperature": (lambda llm: SamplingParams(temperature=float("nan")), ValueError,
                        r"temperature must be a finite number"),
    "inf temperature": (lambda llm: SamplingParams(temperature=float("inf")), ValueError,
                        r"temperature must be a finite number"),
    "temperature past float32": (lambda llm: SamplingParams(temperature=1e308), ValueError,
                                 r"temperature must be at most 3.40282e\+38 .* got 1e\+308"),
    "skip_special_tokens=1": (lambda llm: SamplingParams(skip_special_tokens=1), ValueError,
                              r"^skip_special_tokens must be a bool, got 1"),
    "ignore_eos='no'": (lambda llm: SamplingParams(ignore_eos="no"), ValueError, r"^ignore_eos must be a bool, got 'no'"),
    # (the engine's seed range: torch's generator; an int past it was folded into another seed's stream)
    "seed=2**64": (lambda llm: SamplingParams(seed=2**64), ValueError,
                   r"^seed must be an integer in \[-2\*\*63, 2\*\*64\) \(torch's generator range\), got 18446744073709551616"),
    "seed=-2**63-1 set later": (lambda llm: llm.add_request([5, 6], changed("seed", -2**63 - 1)), ValueError,
                                r"^seed must be an integer in \[-2\*\*63, 2\*\*64\)"),
    "n=3 children past the seed range": (lambda llm: SamplingParams(n=3, seed=2**64 - 2), ValueError,
                                         r"^seed \+ n - 1 must be < 2\*\*64: the n=3 children draw with seeds"),
    "NaN top_p": (lambda llm: SamplingParams(top_p=float("nan")), ValueError, r"top_p must be in"),
    # (an int past float's range: math.isfinite raised OverflowError, naming no argument)
    "temperature an int past float's range": (lambda llm: SamplingParams(temperature=2**1100), ValueError,
                                              r"^temperature must be a finite number >= 0"),
    "repetition_penalty an int past float's range": (lambda llm: SamplingParams(repetition_penalty=10**400),
                                                     ValueError, r"^repetition_penalty must be a finite number > 0"),
    "a logit_bias an int past float's range": (lambda llm: SamplingParams(logit_bias={5: -10**400}), ValueError,
                                               r"^logit_bias values must be finite float32 numbers"),
    "prompt_token_ids None": (lambda llm: llm.generate({"prompt_token_ids": None}, use_tqdm=False),
                              TypeError, r"prompt\['prompt_token_ids'\] must be a list of token ids"),
    "a prompt dict with multi_modal_data": (
        lambda llm: llm.generate([[5, 6], {"prompt": "hi", "multi_modal_data": {"image": None}}], use_tqdm=False),
        ValueError, r"^prompt dict key 'multi_modal_data' is not supported: kvscope reads 'prompt' and 'prompt_token_ids'"),
    "a prompt dict's text that is not a str beside ids": (
        lambda llm: llm.add_request({"prompt_token_ids": [5, 6], "prompt": 7}), TypeError,
        r"^prompt\['prompt'\] must be a str, got int"),
    "a lone surrogate in the prompt": (lambda llm: llm.generate(["ok", "ab\ud800"], use_tqdm=False), ValueError,
                                       r"^prompt is not valid Unicode text: surrogates not allowed at index 2"),
    "a lone surrogate in prompt['prompt']": (lambda llm: llm.add_request({"prompt": "\udfff"}), ValueError,
                                             r"^prompt\['prompt'\] is not valid Unicode text"),
    "a lone surrogate in a bad word": (lambda llm: SamplingParams(bad_words=["ok", "a\ud800"]), ValueError,
                                       r"^bad_words\[1\] is not valid Unicode text: surrogates not allowed at index 1"),
    "a lone surrogate in a bad word set later": (lambda llm: llm.add_request("hi", changed("bad_words", ["\udfff"])),
                                                 ValueError, r"^bad_words\[0\] is not valid Unicode text"),
    # (it could never match the text, and a trace's save failed encoding it)
    "a lone surrogate in a stop string": (lambda llm: SamplingParams(stop=["ok", "b\udc80"]), ValueError,
                                          r"^stop\[1\] is not valid Unicode text"),
    "a lone surrogate in a stop string set later": (lambda llm: llm.add_request("hi", changed("stop", "\ud800")),
                                                    ValueError, r"^stop is not valid Unicode text"),
    # (its truth value raised after the requests were queued, and they ran on unasked)
    "use_tqdm an array": (lambda llm: llm.generate([[5, 6]], greedy(2), use_tqdm=np.array([1, 2])), TypeError,
                          r"^use_tqdm must be a bool or a tqdm-like callable, got ndarray"),
    "call_between_steps(None)": (lambda llm: llm.call_between_steps(None), TypeError,
                                 r"^fn must be callable, got None"),
    "a chat template that renders a lone surrogate": (
        lambda llm: llm.chat([{"role": "user", "content": "hi"}], greedy(2), use_tqdm=False,
                             chat_template="{{ messages[0]['content'] }}{{ odd }}", chat_template_kwargs={"odd": "\ud800"}),
        ValueError, r"^the chat template's rendering of messages is not valid Unicode text: surrogates not allowed at index 2"),
    "a chat template with a lone surrogate": (
        lambda llm: llm.chat([{"role": "user", "content": "hi"}], greedy(2), use_tqdm=False, chat_template="x\ud800"),
        ValueError, r"^chat_template is not valid Unicode text"),
    "SamplingParams as a dict": (lambda llm: llm.generate([[5, 6]], {"max_tokens": 3}, use_tqdm=False),
                                 TypeError, r"sampling_params must be a SamplingParams .* got dict"),
    # (it said "params must be a SamplingParams", add_request's name, not generate's argument)
    "a dict among sampling_params": (lambda llm: llm.generate(PROMPTS, [greedy(2), {"max_tokens": 3}], use_tqdm=False),
                                     TypeError, r"^sampling_params\[1\] must be a SamplingParams .* got dict"),
    # (add_request's argument is params: the message named generate's sampling_params)
    "add_request's params as a str": (lambda llm: llm.add_request([5, 6], params="greedy"), TypeError,
                                      r"^params must be a SamplingParams, got str"),
    "one bad prompt among good ones": (lambda llm: llm.generate([[5, 6], [5, VOCAB]], use_tqdm=False),
                                       ValueError, rf"prompt_token_ids contains {VOCAB}, outside the vocabulary"),
    "negative id": (lambda llm: llm.generate([[5, 6], [5, -1, VOCAB]], use_tqdm=False), ValueError,
                    r"prompt_token_ids contains -1, outside the vocabulary"),
    "float id": (lambda llm: llm.generate([[5.0, 6]], use_tqdm=False), TypeError,
                 r"prompt_token_ids\[0\] is 5.0 \(float\); token ids must be integers"),
    "float id in a flat list": (lambda llm: llm.generate([5, 6.0], use_tqdm=False), TypeError,
                                r"prompt_token_ids\[1\] is 6.0 \(float\); token ids must be integers"),
    "bool id": (lambda llm: llm.generate({"prompt_token_ids": [5, True]}, use_tqdm=False), TypeError,
                r"prompt_token_ids\[1\] is True \(bool\)"),
    # (numpy's and torch's own errors, naming no argument: "only integer scalar arrays can be converted ...")
    "a 2-D array of ids": (lambda llm: llm.generate({"prompt_token_ids": np.array([[5, 6]])}, use_tqdm=False),
                           TypeError, r"^prompt_token_ids\[0\] is array\(\[5, 6\]\) \(ndarray\); token ids must be integers"),
    "an id that is a one-element array": (lambda llm: llm.add_request([5, np.array([6])]), TypeError,
                                          r"^prompt_token_ids\[1\] is array\(\[6\]\) \(ndarray\)"),
    "a float tensor of ids": (lambda llm: llm.generate([[5, 6], {"prompt_token_ids": torch.tensor([5.0])}],
                                                       use_tqdm=False),
                              TypeError, r"^prompt_token_ids\[0\] is tensor\(5\.\) \(Tensor\)"),
    # (taken in the set's own order, and a bytearray's bytes as ids, where bytes were refused)
    "prompt_token_ids as a set": (lambda llm: llm.generate({"prompt_token_ids": {5, 6, 7}}, use_tqdm=False),
                                  TypeError, r"^prompt\['prompt_token_ids'\] must be a list of token ids, got set"),
    "prompt_token_ids as a bytearray": (lambda llm: llm.add_request({"prompt_token_ids": bytearray(b"\x05\x06")}),
                                        TypeError, r"^prompt\['prompt_token_ids'\] must be a list of token ids, "
                                                   r"got bytearray"),
    "logprobs over the vocabulary": (
        lambda llm: llm.generate([[5, 6]], SamplingParams(logprobs=VOCAB + 1), use_tqdm=False),
        ValueError, rf"logprobs={VOCAB + 1} exceeds the vocabulary size \({VOCAB}\)"),
    "stop_token_ids outside the vocabulary": (
        lambda llm: llm.generate([[5, 6]], SamplingParams(stop_token_ids=[3, VOCAB]), use_tqdm=False),
        ValueError, rf"stop_token_ids contains {VOCAB}, outside the vocabulary \[0, {VOCAB}\)"),
    "min_tokens with every token a stop token": (
        lambda llm: llm.generate([[5, 6]], SamplingParams(min_tokens=2, stop_token_ids=list(range(VOCAB))),
                                 use_tqdm=False),
        ValueError, rf"^min_tokens=2 holds back stop_token_ids and EOS, which cover the whole vocabulary \({VOCAB}\)"),
    "Recorder of an LLM": (lambda llm: Recorder(llm), TypeError,
                           r"^engine must be an LLMEngine, got LLM; for an LLM, use llm.record\(...\)"),
    "record level='all'": (lambda llm: llm.record(level="all").__enter__(), ValueError,
                           r"^level must be one of 'summary', 'blocks', 'full', got 'all'"),
    "record level an array": (lambda llm: llm.record(level=np.array(["blocks", "full"])).__enter__(), ValueError,
                              r"^level must be one of 'summary', 'blocks', 'full', got array"),
    "record max_steps=0": (lambda llm: llm.record(max_steps=0).__enter__(), ValueError,
                           r"^max_steps must be an integer >= 1, got 0"),
    # Fields changed after the params were built: checked again when the request is added.
    "temperature=-1 set later": (lambda llm: llm.generate([[5, 6]], changed("temperature", -1.0), use_tqdm=False),
                                 ValueError, r"^temperature must be a finite number >= 0, got -1.0"),
    "top_k=-5 set later": (lambda llm: llm.add_request([5, 6], changed("top_k", -5)), ValueError,
                           r"^top_k must be an integer >= -1"),
    "logprobs=1.5 set later": (lambda llm: llm.add_request([5, 6], changed("logprobs", 1.5)), ValueError,
                               r"^logprobs must be an integer >= 0, -1 \(the whole vocabulary\) or None, got 1.5"),
    "skip_special_tokens=None set later": (lambda llm: llm.add_request([5, 6], changed("skip_special_tokens", None)),
                                           ValueError, r"^skip_special_tokens must be a bool, got None"),
    "stop=123 set later": (lambda llm: llm.add_request([5, 6], changed("stop", 123)), ValueError,
                           r"^stop must be .* got 123"),
    # (it ran, and the trace of it could not be saved: UnicodeEncodeError out of trace.save)
    "a lone surrogate in request_id": (lambda llm: llm.add_request([5, 6], greedy(2), request_id="r\ud800"),
                                       ValueError, r"^request_id is not valid Unicode text: surrogates not allowed "
                                                   r"at index 1"),
    "int request_id": (lambda llm: llm.add_request([5, 6], request_id=5), TypeError,
                       r"request_id must be a str .* got int 5"),
    "abort an int request_id": (lambda llm: llm.abort_request(5), TypeError,
                                r"request_id must be a str or an iterable of str"),
    # vLLM's keywords for what kvscope has not (LoRA, priority scheduling, multimodal models, a KV
    # connector, tokenizer options): refused by name, as vLLM refuses LoRA and priority when they
    # are not enabled; their values vLLM serves without them run (test_vllm_parity).
    "generate lora_request": (lambda llm: llm.generate(PROMPTS, greedy(2), use_tqdm=False, lora_request=object()),
                              ValueError, r"^lora_request must be None: kvscope has no LoRA adapters"),
    "generate a lora_request per prompt, too few": (
        lambda llm: llm.generate(PROMPTS, greedy(2), use_tqdm=False, lora_request=[None]),
        ValueError, r"^got 1 lora_request for 2 prompts"),
    "generate priority=[0, 1]": (lambda llm: llm.generate(PROMPTS, greedy(2), use_tqdm=False, priority=[0, 1]),
                                 ValueError, r"^priority must be 0 for every prompt: kvscope schedules first come"),
    "generate priority=[0]": (lambda llm: llm.generate(PROMPTS, greedy(2), use_tqdm=False, priority=[0]),
                              ValueError, r"^got 1 priority for 2 prompts"),
    "generate priority=1": (lambda llm: llm.generate(PROMPTS, greedy(2), use_tqdm=False, priority=1),
                            TypeError, r"^priority must be a list of ints, one per prompt, got 1"),
    "generate tokenization_kwargs add_special_tokens": (
        lambda llm: llm.generate(PROMPTS, greedy(2), use_tqdm=False, tokenization_kwargs={"add_special_tokens": False}),
        ValueError, r"^tokenization_kwargs may only set truncate_prompt_tokens in kvscope .* got add_special_tokens"),
    "generate tokenization_kwargs truncate_prompt_tokens=0": (
        lambda llm: llm.generate(PROMPTS, greedy(2), use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": 0}),
        ValueError, r"^truncate_prompt_tokens must be an integer >= 1"),
    "chat chat_template_content_format='openai'": (
        lambda llm: llm.chat([{"role": "user", "content": "hi"}], greedy(2), use_tqdm=False,
                             chat_template_content_format="openai"),
        ValueError, r"^chat_template_content_format must be 'auto' or 'string'"),
    # (numpy's "The truth value of an array with more than one element is ambiguous", naming nothing)
    "chat chat_template_content_format an array": (
        lambda llm: llm.chat([{"role": "user", "content": "hi"}], greedy(2), use_tqdm=False,
                             chat_template_content_format=np.array(["auto", "string"])),
        ValueError, r"^chat_template_content_format must be 'auto' or 'string' .* got array\(\['auto', 'string'\]"),
    "chat mm_processor_kwargs": (
        lambda llm: llm.chat([{"role": "user", "content": "hi"}], greedy(2), use_tqdm=False,
                             mm_processor_kwargs={"num_crops": 4}),
        ValueError, r"^mm_processor_kwargs must be None: kvscope runs no multimodal models"),
    "chat lora_request": (lambda llm: llm.chat([{"role": "user", "content": "hi"}], greedy(2), use_tqdm=False,
                                               lora_request=object()),
                          ValueError, r"^lora_request must be None"),
    "reset_prefix_cache(reset_running_requests=True)": (
        lambda llm: llm.reset_prefix_cache(reset_running_requests=True),
        ValueError, r"^reset_running_requests must be False: kvscope does not preempt running requests"),
    "reset_prefix_cache(reset_connector=True)": (lambda llm: llm.reset_prefix_cache(reset_connector=True),
                                                 ValueError, r"^reset_connector must be False: kvscope has no KV connector"),
    "SamplingParams(structured_outputs=...)": (lambda llm: SamplingParams(structured_outputs={"json": {}}),
                                               TypeError, r"unexpected keyword argument 'structured_outputs'"),
    "SamplingParams(logits_processors=...)": (lambda llm: SamplingParams(logits_processors=[]),
                                              TypeError, r"unexpected keyword argument 'logits_processors'"),
    # vLLM's output arguments kvscope takes only at their default, None, so that a positional call
    # ported from vLLM reaches the arguments after them (test_vllm_parity).
    "CompletionOutput(routed_experts=...)": (
        lambda llm: kvscope.CompletionOutput(0, "", [], None, None, [[1]], "stop"),
        ValueError, r"^routed_experts must be None: kvscope records no MoE routing, got \[\[1\]\]"),
    "RequestOutput(lora_request=...)": (
        lambda llm: kvscope.RequestOutput("r", None, [1], None, [], True, None, object()),
        ValueError, r"^lora_request must be None: kvscope has no LoRA adapters"),
    "RequestOutput(encoder_prompt=...)": (
        lambda llm: kvscope.RequestOutput("r", None, [1], None, [], True, encoder_prompt="x"),
        ValueError, r"^encoder_prompt must be None: kvscope runs no encoder-decoder models"),
    "RequestOutput(encoder_prompt_token_ids=...)": (
        lambda llm: kvscope.RequestOutput("r", None, [1], None, [], True, encoder_prompt_token_ids=[1]),
        ValueError, r"^encoder_prompt_token_ids must be None: kvscope runs no encoder-decoder models"),
    "RequestOutput without outputs and finished": (
        lambda llm: kvscope.RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1]),
        TypeError, r"^RequestOutput\(\) missing required argument\(s\): 'outputs', 'finished'$"),
}


@pytest.mark.parametrize("case", REQUEST_CASES)
def test_bad_request_input_is_refused_by_name_and_the_engine_stays_healthy(
        case: str, llm: LLM, fresh_tokens: list[list[int]]) -> None:
    feed, error, pattern = REQUEST_CASES[case]
    llm.add_request(PROMPTS[0], greedy(3))  # another request in flight, which must be untouched
    with pytest.raises(error, match=pattern):
        feed(llm)
    outs = []
    while llm.has_unfinished_requests():
        outs += [o for o in llm.step() if o.finished]
    assert token_ids(outs) == [fresh_tokens[0][:3]]
    assert_healthy(llm, fresh_tokens)


def test_numpy_ids_and_logprobs_up_to_the_vocabulary_are_served(llm: LLM, fresh_tokens) -> None:
    params = greedy(6, logprobs=VOCAB)
    plain, numpy_ids = (llm.generate(p, params, use_tqdm=False)[0] for p in
                        ([5, 6, 7, 8], {"prompt_token_ids": np.array([5, 6, 7, 8])}))
    assert numpy_ids.prompt_token_ids == [5, 6, 7, 8]
    assert all(type(t) is int for t in numpy_ids.prompt_token_ids)
    assert numpy_ids.outputs[0].token_ids == plain.outputs[0].token_ids == fresh_tokens[0]
    assert all(len(lp) == VOCAB for lp in numpy_ids.outputs[0].logprobs)
    assert_healthy(llm, fresh_tokens)


def test_min_tokens_with_one_token_left_draws_it(llm: LLM) -> None:
    """The valid side of the case above: with every token but one held back, the tokens before
    ``min_tokens`` are that one, then a stop token ends the request."""
    left = 9
    params = SamplingParams(min_tokens=3, max_tokens=6, seed=1,
                            stop_token_ids=[t for t in range(VOCAB) if t != left])
    (out,) = llm.generate([[5, 6]], params, use_tqdm=False)
    tokens = out.outputs[0].token_ids
    assert tokens[:3] == [left] * 3
    after = tokens[3:]  # `left` again, until the first stop token ends it (or max_tokens does)
    assert after[:-1] == [left] * (len(after) - 1) and (after[-1] != left or len(tokens) == 6)


def test_params_changed_later_act_as_if_built_so_and_never_reach_a_request_already_added(
        llm: LLM, fresh_tokens: list[list[int]]) -> None:
    """A stop string set after the params were built cuts the text as one passed to them does;
    changing the params after add_request leaves that request as it was added."""
    text = llm.generate([PROMPTS[0]], greedy(6), use_tqdm=False)[0].outputs[0].text
    assert len(text) >= 4
    built = llm.generate([PROMPTS[0]], greedy(6, stop=[text[2:4]]), use_tqdm=False)[0].outputs[0]
    later = changed("stop", [text[2:4]])
    later.max_tokens = 6
    assert llm.generate([PROMPTS[0]], later, use_tqdm=False)[0].outputs[0].text == built.text == text[:2]
    params = greedy(6)
    rid = llm.add_request(PROMPTS[0], params)
    params.max_tokens, params.stop_token_ids = 1, fresh_tokens[0][:2]
    outs = []
    while llm.has_unfinished_requests():
        outs += [o for o in llm.step() if o.request_id == rid and o.finished]
    assert token_ids(outs) == [fresh_tokens[0]]
    assert_healthy(llm, fresh_tokens)


def test_numpy_numbers_in_sampling_params_act_as_python_numbers(llm: LLM, fresh_tokens: list[list[int]]) -> None:
    plain = SamplingParams(temperature=0.5, top_p=0.9, top_k=5, max_tokens=5, min_tokens=2, seed=3, logprobs=2,
                           stop_token_ids=[7], n=2)
    numpy = SamplingParams(temperature=np.float32(0.5), top_p=np.float64(0.9), top_k=np.int64(5),
                           max_tokens=np.int32(5), min_tokens=np.int16(2), seed=np.uint64(3), logprobs=np.int8(2),
                           stop_token_ids=[np.int64(7)], n=np.int64(2))
    assert numpy == plain and all(type(getattr(numpy, f)) is type(getattr(plain, f)) for f in ("n", "top_k", "top_p"))
    outs = llm.generate([PROMPTS[0]] * 2, [plain, numpy], use_tqdm=False)
    assert [c.token_ids for c in outs[0].outputs] == [c.token_ids for c in outs[1].outputs]
    with pytest.raises(ValueError, match=r"^max_tokens must be an integer >= 1, got 0"):
        SamplingParams(max_tokens=np.int64(0))
    assert_healthy(llm, fresh_tokens)


class TouchyInt(int):
    """A caller's own int type whose comparisons raise: none of its code may run in the engine."""

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("TouchyInt compared")

    __lt__ = __le__ = __gt__ = __ge__ = __ne__ = __eq__
    __hash__ = int.__hash__


class TouchyFloat(float):
    def __eq__(self, other: object) -> bool:
        raise RuntimeError("TouchyFloat compared")

    __lt__ = __le__ = __gt__ = __ge__ = __ne__ = __eq__
    __hash__ = float.__hash__


@pytest.mark.parametrize("later", [False, True], ids=["built", "set later"])
def test_int_and_float_subclasses_in_sampling_params_act_as_python_numbers(
        later: bool, llm: LLM, fresh_tokens: list[list[int]]) -> None:
    """Subclasses of int and float are numbers (vLLM takes them), kept as exact ints and floats, as
    numpy's are: their own comparisons raised at the checks, and a ``temperature`` whose ``==``
    raised passed them and failed its request inside a step (finish_reason abort)."""
    plain = dict(temperature=1, top_p=0.9, top_k=5, max_tokens=5, min_tokens=2, seed=3, logprobs=2,
                 presence_penalty=0.5, stop_token_ids=[7], allowed_token_ids=list(range(3, 40)), logit_bias={3: 0.5})
    touchy = dict(temperature=TouchyInt(1), top_p=TouchyFloat(0.9), top_k=TouchyInt(5), max_tokens=TouchyInt(5),
                  min_tokens=TouchyInt(2), seed=TouchyInt(3), logprobs=TouchyInt(2), presence_penalty=TouchyFloat(0.5),
                  stop_token_ids=[TouchyInt(7)], allowed_token_ids=[TouchyInt(t) for t in range(3, 40)],
                  logit_bias={TouchyInt(3): TouchyFloat(0.5)})
    params = SamplingParams(**plain)
    if later:
        for name, value in touchy.items():
            setattr(params, name, value)
    else:
        params = SamplingParams(**touchy)
    want, got = llm.generate([PROMPTS[0]] * 2, [SamplingParams(**plain), params], use_tqdm=False)
    assert got.outputs[0].finish_reason == "length" and got.outputs[0].token_ids == want.outputs[0].token_ids
    if not later:  # (set later, the request's own copy is the one checked)
        assert all(type(getattr(params, f)) is type(v) for f, v in plain.items() if not isinstance(v, (list, dict)))
        assert [type(t) for t in [*params.stop_token_ids, *next(iter(params.logit_bias.items()))]] == [int, int, float]
    assert_healthy(llm, fresh_tokens)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_function_a_hook_defers_between_steps_that_raises_is_reported_as_a_raising_hook(
        async_scheduling: bool, fresh_tokens: list[list[int]]) -> None:
    """``call_between_steps`` from a hook runs its function after the step, inside whichever
    call stepped the engine: one that raises is reported and the call goes on, as a hook that
    raises is (its error came out of that call, a generate() then losing all its outputs)."""
    llm = make_llm(num_kv_blocks=32, async_scheduling=async_scheduling)
    streamed = llm.add_request(PROMPTS[0], greedy(3))
    asked: list[bool] = []

    def end(**_: Any) -> None:
        if not asked:
            asked.append(True)
            llm.call_between_steps(lambda: 1 / 0)

    with llm.hooks({"step.end": end}), pytest.warns(
            RuntimeWarning, match=r"(?s)on 'llm.call_between_steps' raised .*ZeroDivisionError"):
        assert token_ids(llm.generate(PROMPTS, greedy(6), use_tqdm=False)) == fresh_tokens
    outs = []
    while llm.has_unfinished_requests():
        outs += [o for o in llm.step() if o.finished]
    assert [o.request_id for o in outs] == [streamed] and token_ids(outs) == [fresh_tokens[0][:3]]
    assert_healthy(llm, fresh_tokens)


def test_generate_after_shutdown_says_so() -> None:
    """Every call that needs the weights or the KV pool says the LLM was shut down (a recording
    read the freed pool and raised an AttributeError about None)."""
    llm = make_llm(num_kv_blocks=16)
    llm.shutdown()
    calls = (lambda: llm.generate([[5, 6]], use_tqdm=False), lambda: llm.add_request([5, 6]), llm.step,
             lambda: llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False), lambda: llm.abort_request("0"),
             llm.reset_prefix_cache, lambda: llm.record().__enter__())
    for call in calls:
        with pytest.raises(RuntimeError, match=r"this LLM was shut down; create a new LLM"):
            call()


CONFIG_CASES: dict[str, tuple[dict[str, Any], type[Exception], str]] = {
    # (numpy's "The truth value of an array with more than one element is ambiguous", naming no key)
    "dtype an array": (dict(dtype=np.array(["float32", "float16"])), ValueError,
                       r"^dtype must be one of 'auto', 'float32', 'float16', 'bfloat16', got array\(\['float32'"),
    "attention_backend an empty array": (dict(attention_backend=np.array([])), ValueError,
                                         r"^attention_backend must be one of 'auto', 'torch', 'triton', got array\(\["),
    "tokenizer=123": (dict(tokenizer=123), TypeError,
                      r"^tokenizer must be a local directory or a hub id \(a str or a path\), got int 123"),
    "kv_events_config port 99999": (dict(kv_events_config={"enable_kv_cache_events": True,
                                                           "endpoint": "tcp://*:99999"}), ValueError,
                                    r"^kv_events_config.endpoint needs a tcp port in 1..65535 \(or \*\), got 'tcp://\*:99999'"),
    # (torch tried to start them all at the first step, and the process died)
    "cpu_threads=10**6": (dict(cpu_threads=10**6), ValueError,
                          r"^cpu_threads must be at most this machine's \d+ CPUs, got 1000000"),
    "seed=10**30": (dict(seed=10**30), ValueError, r"seed must be an integer in \[-2\*\*63, 2\*\*64\)"),
    "max_logprobs=-2": (dict(max_logprobs=-2), ValueError, r"^max_logprobs must be an integer >= -1, got -2"),
    "num_kv_blocks=10**9": (dict(num_kv_blocks=10**9), ValueError,
                            r"num_kv_blocks=1000000000 needs .* GiB of KV cache .* more than"),
    # (a budget below one block still holds one: a block of 10**11 slots asked for hundreds of TiB)
    "block_size=10**11": (dict(block_size=10**11), ValueError,
                          r"^block_size=100000000000 needs .* GiB of KV cache .* more than .*; lower block_size"),
    "kv_cache_memory_bytes=2**60": (dict(kv_cache_memory_bytes=2**60, device="cpu"), ValueError,
                                    rf"kv_cache_memory_bytes={2**60} needs .* GiB of KV cache .* more than"),
    "gpu_memory_utilization='abc'": (dict(gpu_memory_utilization="abc"), ValueError,
                                     r"gpu_memory_utilization must be a number in \(0, 1\], got 'abc'"),
    "gpu_memory_utilization=NaN": (dict(gpu_memory_utilization=float("nan")), ValueError,
                                   r"gpu_memory_utilization must be a number"),
    # (the tiny model has 2 KV heads: a size of 4 cannot shard them)
    "tensor_parallel_size=4": (dict(tensor_parallel_size=4), ValueError,
                               r"tensor_parallel_size=4 cannot shard this model: num_key_value_heads=2 not divisible by 4"),
    # (the pool's size check came first, and asked to lower kv_cache_memory_bytes)
    "tensor_parallel_size=1000": (dict(tensor_parallel_size=1000), ValueError,
                                  r"tensor_parallel_size=1000 cannot shard this model"),
    # (an OverflowError, or a MemoryError from a list of one device per rank)
    "tensor_parallel_size=2**63, the pool set": (dict(tensor_parallel_size=2**63, num_kv_blocks=64), ValueError,
                                                 rf"tensor_parallel_size={2**63} cannot shard this model"),
    # (Triton's compiled kernels on CPU tensors: the first step failed deep inside Triton)
    "attention_backend='triton' on CPU": (dict(attention_backend="triton"), ValueError,
                                          r"attention_backend='triton' runs on CUDA devices, not on 'cpu': "
                                          r"pick attention_backend='torch'"),
    "attention_backend='triton' on CPU, tensor_parallel_size=2": (  # refused before any worker starts
        dict(attention_backend="triton", tensor_parallel_size=2), ValueError,
        r"attention_backend='triton' runs on CUDA devices, not on 'cpu'"),
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_bad_engine_config_is_refused_by_name(case: str) -> None:
    kwargs, error, pattern = CONFIG_CASES[case]
    with pytest.raises(error, match=pattern):
        make_llm(**kwargs)


_POOL_UNDER_A_LIMIT = """
import resource, sys
sys.path[:0] = [{tests!r}, {repo!r}]
from engine_helpers import make_llm
from kvscope.config import EngineConfig
from kvscope.runner.model_runner import kv_block_bytes
from tiny_models import tiny_checkpoint
from transformers import AutoConfig
import torch
block = kv_block_bytes(AutoConfig.from_pretrained(tiny_checkpoint("qwen3")), 1, 16, torch.float32)
used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (used + (1 << 30), resource.RLIM_INFINITY))
try:
    make_llm(num_kv_blocks=(3 << 30) // block)
except ValueError as e:
    print("REFUSED", e)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="an address-space limit (RLIMIT_AS) on Linux")
def test_a_pool_the_host_cannot_allocate_now_is_refused_by_name() -> None:
    """A pool within the host's memory (so the start-up check passes) that the allocator refuses
    now, here under a 1 GiB address-space limit on a process asking for 3 GiB, is refused
    naming ``num_kv_blocks``, where the allocator's own error named no setting. In a process of
    its own: the limit would hold for the rest of this one."""
    import subprocess

    tests = Path(__file__).parent
    code = _POOL_UNDER_A_LIMIT.format(tests=str(tests), repo=str(tests.parent))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("REFUSED num_kv_blocks="), proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "asks for a KV pool of 3.00 GiB" in proc.stdout and "could not allocate now; lower num_kv_blocks" in proc.stdout


def publishing(**kv: Any) -> dict[str, Any]:
    return {"kv_events_config": {"enable_kv_cache_events": True, "endpoint": "inproc://fuzz", **kv}}


# Refused by EngineConfig, before the model is read: the KV-event publisher's were refused by pyzmq,
# ZMQ or the publisher itself once the weights and the KV pool were in memory, most in their own words.
EARLY_CONFIG_CASES: dict[str, tuple[dict[str, Any], type[Exception], str]] = {
    # (OverflowError: value too large to convert to int; ZMQ's high-water marks are C ints)
    "kv_events_config hwm past a C int": (publishing(hwm=2**31), ValueError,
                                          r"^kv_events_config.hwm must be an integer in 1..2147483647, got 2147483648"),
    "kv_events_config buffer_steps past a C int": (
        publishing(buffer_steps=2**31 - 1, replay_endpoint="inproc://fuzz-replay"), ValueError,
        r"^kv_events_config.buffer_steps must be an integer in 1..2147483646, got 2147483647"),
    # (OverflowError: Python int too large to convert to C ssize_t)
    "kv_events_config buffer_steps=2**63": (publishing(buffer_steps=2**63), ValueError,
                                            r"^kv_events_config.buffer_steps must be an integer in 1..2147483646"),
    # (UnicodeEncodeError: 'utf-8' codec can't encode character ...)
    "kv_events_config topic with a lone surrogate": (publishing(topic="kv\ud800"), ValueError,
                                                     r"^kv_events_config.topic is not valid Unicode text"),
    # (ZMQError: Address already in use)
    "kv_events_config replay_endpoint the same as endpoint": (
        publishing(endpoint="tcp://*:5999", replay_endpoint="tcp://*:5999"), ValueError,
        r"^kv_events_config.replay_endpoint must differ from endpoint, got 'tcp://\*:5999' for both"),
    # (ZMQError: Invalid argument)
    "kv_events_config endpoint of no address": (publishing(endpoint="inproc://"), ValueError,
                                                r"^kv_events_config.endpoint must be a tcp://, ipc:// or inproc:// "
                                                r"address, got 'inproc://'"),
    # (ZMQError: No such file or directory for ipc path)
    "kv_events_config ipc endpoint in no directory": (publishing(endpoint="ipc:///nonexistent/dir/kv.sock"), ValueError,
                                                      r"^kv_events_config.endpoint 'ipc:///nonexistent/dir/kv.sock' "
                                                      r"is in no directory: /nonexistent/dir does not exist"),
    # (numpy's "The truth value of an array with more than one element is ambiguous")
    "kv_events_config publisher an array": (publishing(publisher=np.array(["zmq", "null"])), ValueError,
                                            r"^kv_events_config.publisher must be 'zmq' or 'null', got array"),
    "kv_events_config enable_kv_cache_events an array": (
        {"kv_events_config": {"enable_kv_cache_events": np.array([True, False])}}, ValueError,
        r"^kv_events_config.enable_kv_cache_events must be a bool, got array"),
    "kv_events_config ports past 65535 at this data_parallel_rank": (
        dict(data_parallel_rank=1000, **publishing(endpoint="tcp://*:65000")), ValueError,
        r"^endpoint 'tcp://\*:65000' offset by data_parallel_rank=1000 is port 66000, past 65535"),
}


@pytest.mark.parametrize("case", EARLY_CONFIG_CASES)
def test_bad_engine_config_is_refused_before_the_model_is_read(case: str) -> None:
    kwargs, error, pattern = EARLY_CONFIG_CASES[case]
    with pytest.raises(error, match=pattern):
        EngineConfig.from_kwargs(model=str(tiny_checkpoint()), **kwargs)
    with pytest.raises(error, match=pattern):
        make_llm(**kwargs)


def test_a_model_that_is_not_a_path_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"^model must be a local directory or a hub id .* got int 123"):
        LLM(123, device="cpu")


@pytest.mark.parametrize("budget", [8, 10**12])
def test_a_huge_max_num_seqs_is_a_bound_not_an_allocation(budget: int) -> None:
    """vLLM users pass a large ``max_num_seqs`` (and token budget) to mean "no limit": the
    runner's per-request rows grow with the requests it holds instead of being allocated for the
    bound (which failed with numpy's MemoryError after the weights loaded). With a budget of 8,
    more requests run than one step can hold, so the rows grow past what a step needs; the
    tokens equal a run with small bounds."""
    prompts = [[5 + i, 6, 7, 8 + i][: 2 + i % 3] for i in range(12)]
    bounded = make_llm(num_kv_blocks=64, max_num_batched_tokens=8, max_num_seqs=12)
    huge = make_llm(num_kv_blocks=64, max_num_batched_tokens=budget, max_num_seqs=10**12)
    want = token_ids(bounded.generate(prompts, greedy(5), use_tqdm=False))
    assert token_ids(huge.generate(prompts, greedy(5), use_tqdm=False)) == want


def test_triton_backend_without_triton_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    with pytest.raises(ImportError, match=r"attention_backend='triton' needs triton, not importable here: pip install triton"):
        make_llm(attention_backend="triton")


def test_model_without_tokenizer_files_is_refused_at_construction(tmp_path: Path) -> None:
    for f in tiny_checkpoint().iterdir():
        if f.name in ("config.json", "model.safetensors"):
            shutil.copy(f, tmp_path)
    with pytest.raises(FileNotFoundError, match=r"(?s)has no tokenizer files \(none of tokenizer.json.*"
                                                r"skip_tokenizer_init=True"):
        LLM(str(tmp_path), device="cpu")
    # ids in, ids out still works, with the same tokens as the full checkpoint
    bare = LLM(str(tmp_path), device="cpu", skip_tokenizer_init=True, num_kv_blocks=16)
    with pytest.raises(ValueError, match=r"^stop strings need text, which skip_tokenizer_init=True leaves out"):
        bare.generate([[5, 6, 7]], greedy(5, stop="a"), use_tqdm=False)
    full = make_llm(num_kv_blocks=16)
    assert token_ids(bare.generate([[5, 6, 7]], greedy(5), use_tqdm=False)) == \
        token_ids(full.generate([[5, 6, 7]], greedy(5), use_tqdm=False))


def test_a_tokenizer_that_is_not_a_directory_is_refused_by_name() -> None:
    """A missing path or a file given as ``tokenizer`` is named as such before anything loads (it
    reached Hugging Face as a hub id, which failed with its own unrelated error or tried the
    network); a tokenizer directory of its own still serves the checkpoint's tokens."""
    with pytest.raises(FileNotFoundError, match=r"^tokenizer='/nonexistent/tok' is not a local directory"):
        make_llm(tokenizer="/nonexistent/tok")
    with pytest.raises(FileNotFoundError, match=r"^tokenizer='no-such-org/no-such-tokenizer' is neither a local "
                                                r"directory nor in the local Hugging Face cache"):
        make_llm(tokenizer="no-such-org/no-such-tokenizer")
    config_file = str(tiny_checkpoint() / "config.json")
    with pytest.raises(ValueError, match=rf"^tokenizer='{config_file}' is a file; pass a directory with tokenizer files"):
        make_llm(tokenizer=config_file)
    own = make_llm(num_kv_blocks=16, tokenizer=str(tiny_checkpoint()))
    assert token_ids(own.generate(PROMPTS, greedy(4), use_tqdm=False)) == \
        token_ids(make_llm(num_kv_blocks=16).generate(PROMPTS, greedy(4), use_tqdm=False))


@pytest.mark.parametrize("arg", ["model", "tokenizer"])
def test_a_path_the_system_cannot_look_up_is_refused_by_name(arg: str) -> None:
    """A model or tokenizer path too long for the filesystem is refused naming the argument (it
    raised the filesystem's bare OSError, naming nothing of the caller's)."""
    too_long = "x" * 5000
    with pytest.raises(ValueError, match=rf"^{arg}='x{{40}}\.\.\.' \(5000 characters\) is not a path this "
                                         r"system can look up: File name too long"):
        make_llm(**{arg: too_long}) if arg == "tokenizer" else LLM(too_long, device="cpu")


def test_dashboard_of_none_names_what_it_takes() -> None:
    pytest.importorskip("anywidget")
    with pytest.raises(TypeError, match=r"dashboard source must be an LLM \(live\) or a kvscope.Trace"):
        kvscope.dashboard(None)


@pytest.mark.parametrize("meta_level", [None, "everything"])
def test_trace_meta_without_a_known_level_is_refused(tmp_path: Path, meta_level: str | None) -> None:
    pytest.importorskip("pyarrow")
    llm = make_llm(num_kv_blocks=16)
    with llm.record(level="summary") as trace:
        llm.generate([[5, 6, 7]], greedy(3), use_tqdm=False)
    trace.save(tmp_path / "run.trace")
    assert kvscope.Trace.load(tmp_path / "run.trace").steps.equals(trace.steps)  # the unedited one loads
    meta_path = tmp_path / "run.trace" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta.pop("level")
    if meta_level is not None:
        meta["level"] = meta_level
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=rf"'level' must be one of 'summary', 'blocks', 'full', got {meta_level!r}"):
        kvscope.Trace.load(tmp_path / "run.trace")
