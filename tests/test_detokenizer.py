"""Streaming text is decoded incrementally; the truth is the tokenizer decoding every token at once,
and for a final text that ends inside a character, vLLM's (tokenizers' ``DecodeStream``).

Checked on the bundled model's byte-level BPE (real text, multi-byte characters) and on the
tiny test tokenizer fed random ids (many bytes that never form a character), then through the
engine: ``LLM.step()`` text and stop strings.
"""
from __future__ import annotations

import functools
import itertools
import random

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer

from kvscope import LLM, SamplingParams
from kvscope.engine.detokenizer import IncrementalDetokenizer, final_text
from kvscope.model_source import BUNDLED_MODEL
from tiny_models import tiny_checkpoint

INCOMPLETE = "\ufffd"


def _assert_streams_like_full_decode(tokenizer, ids: list[int]) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    final = tokenizer.decode(ids, skip_special_tokens=True)
    for k in range(1, len(ids) + 1):
        streamed = detok.update(ids[:k])
        full = tokenizer.decode(ids[:k], skip_special_tokens=True)
        if not full.endswith(INCOMPLETE):
            assert streamed == full, k
        assert full.startswith(streamed) or final.startswith(streamed), k


@pytest.fixture(scope="module")
def bundled_tokenizer():
    return AutoTokenizer.from_pretrained(BUNDLED_MODEL, local_files_only=True)


def test_multibyte_text_streams_exactly(bundled_tokenizer):
    text = "Help on café naïve — 日本語 🙂 strings:\n\n  ‘quoted’ x² ≤ y\tend"
    _assert_streams_like_full_decode(bundled_tokenizer, bundled_tokenizer.encode(text))


def test_text_read_now_and_then_equals_text_read_at_every_token(bundled_tokenizer):
    """An update that brings many tokens holds back only an incomplete last character, as
    updates token by token do: the text at each token count does not depend on how often it
    was read before (4-byte characters span 4 byte-level tokens here)."""
    ids = bundled_tokenizer.encode("xa\U0001d518b\U0001d54fa 日本語 🙂 naïve — café\n\U0001f600!", add_special_tokens=False)
    every = IncrementalDetokenizer(bundled_tokenizer)
    streamed = [every.update(ids[:k]) for k in range(1, len(ids) + 1)]
    for stride in (2, 3, 5, 7, len(ids)):
        for offset in range(stride):
            sparse = IncrementalDetokenizer(bundled_tokenizer)
            for k in range(offset + 1, len(ids) + 1, stride):
                assert sparse.update(ids[:k]) == streamed[k - 1], (stride, offset, k)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_text_of_any_bytes_does_not_depend_on_how_often_it_is_read(data):
    """Ids of the tiny byte-level tokenizer, many of them bytes that never form a character;
    read at any cadence, the text at each read is what reading it at every token gives."""
    tokenizer = _tiny_tokenizer()
    stray = [i for i in range(3, 320) if tokenizer.decode([i]) == INCOMPLETE]
    ids = data.draw(st.lists(st.one_of(st.integers(3, 319), st.sampled_from(stray)), min_size=1, max_size=40))
    strides = data.draw(st.lists(st.integers(1, 8), min_size=1))
    every = IncrementalDetokenizer(tokenizer)
    streamed = [every.update(ids[:k]) for k in range(1, len(ids) + 1)]
    sparse, k = IncrementalDetokenizer(tokenizer), 0
    for stride in itertools.cycle(strides):
        if k == len(ids):
            break
        k = min(len(ids), k + stride)
        assert sparse.update(ids[:k]) == streamed[k - 1], k


def test_sentencepiece_style_spaces_stream_exactly():
    """Metaspace tokenizers (Llama 2, Mistral) drop a token's leading space when it is decoded
    alone; the window of the previous update's tokens keeps the spaces between words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["the paged cache keeps blocks of keys and values", "a block table maps positions to blocks",
              "prefix caching shares the blocks of a common prompt"] * 20
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    ids = tokenizer.encode("the block table maps the paged cache", add_special_tokens=False)
    assert tokenizer.decode(ids[1:2]) != tokenizer.decode(ids[:2])[len(tokenizer.decode(ids[:1])):]  # the trap
    _assert_streams_like_full_decode(tokenizer, ids)


@functools.cache
def _tiny_tokenizer():
    return AutoTokenizer.from_pretrained(tiny_checkpoint("qwen3"), local_files_only=True)


def test_random_bytes_stream_like_full_decode():
    tokenizer = _tiny_tokenizer()
    rng = random.Random(0)
    for _ in range(5):
        _assert_streams_like_full_decode(tokenizer, [rng.randrange(3, 320) for _ in range(60)])


def vllm_text(tokenizer, ids: list[int]) -> str:
    """vLLM's text of ``ids``, streamed or final: the pieces its fast detokenizer gathers from
    tokenizers' ``DecodeStream``, which gives nothing for a token that leaves the text inside a
    character, and is never asked for what it held back once the request ends."""
    stream = DecodeStream(skip_special_tokens=True)
    return "".join(stream.step(tokenizer._tokenizer, i) or "" for i in ids)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_finished_text_is_vllm_s_whatever_the_bytes_and_reads(data):
    """No token will complete a held-back tail once the request ends, and vLLM's text never
    gets it: the final text is vLLM's, whatever the ids (bytes that never form a character
    among them) and however often they were read before, or if never (``final_text``)."""
    tokenizer = _tiny_tokenizer()
    stray = [i for i in range(3, 320) if tokenizer.decode([i]) == INCOMPLETE]
    ids = data.draw(st.lists(st.one_of(st.integers(3, 319), st.sampled_from(stray)), min_size=1, max_size=30))
    reads = data.draw(st.lists(st.integers(1, len(ids)), unique=True).map(sorted))
    detok = IncrementalDetokenizer(tokenizer)
    for k in reads:
        detok.update(ids[:k])
    assert detok.finish(ids) == final_text(tokenizer, ids) == vllm_text(tokenizer, ids)


def test_text_cut_inside_a_character_ends_before_it(bundled_tokenizer):
    """Real text cut after every token: the final text is vLLM's, the whole decode less the
    U+FFFD of a character cut short."""
    tiny = _tiny_tokenizer()
    for tokenizer in (bundled_tokenizer, tiny):
        ids = tokenizer.encode("a 日本語 🙂 naïve \U0001d518!", add_special_tokens=False)
        cut_inside = 0
        for k in range(1, len(ids) + 1):
            final = IncrementalDetokenizer(tokenizer).finish(ids[:k])
            assert final == final_text(tokenizer, ids[:k]) == vllm_text(tokenizer, ids[:k]), k
            whole = tokenizer.decode(ids[:k], skip_special_tokens=True)
            assert final == whole.rstrip(INCOMPLETE), k
            cut_inside += whole.endswith(INCOMPLETE)
        assert cut_inside  # (the trap)


def test_a_byte_that_never_forms_a_character_keeps_its_u_fffd_unless_it_ends_the_text():
    """Only the unfinished tail is left out: a stray byte before more text decodes to U+FFFD for
    good, as in vLLM; one that ends the text is a tail vLLM never lets out."""
    tokenizer = _tiny_tokenizer()
    stray = [i for i in range(3, 320) if tokenizer.decode([i]) == INCOMPLETE]
    x, y = (tokenizer.encode(c, add_special_tokens=False) for c in "xy")
    for byte in stray:
        for ids, want in ((x + [byte] + y, "x" + INCOMPLETE + "y"), (x + [byte], "x")):
            detok = IncrementalDetokenizer(tokenizer)
            detok.update(ids[:-1])
            assert detok.finish(ids) == want == vllm_text(tokenizer, ids)


def test_a_tokenizer_that_cleans_up_spaces_streams_its_text_uncleaned():
    """transformers' ``clean_up_tokenization_spaces`` rewrites text across tokens (" ," becomes
    ","): a window decoded with it would drop text. The stream is the decode without it, as in vLLM."""
    tokenizer = AutoTokenizer.from_pretrained(
        tiny_checkpoint("qwen3"), local_files_only=True, clean_up_tokenization_spaces=True,
        clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True)
    ids = tokenizer.encode("a , b . c ! d ' s , , e ?", add_special_tokens=False)
    uncleaned = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    assert tokenizer.decode(ids) != uncleaned  # (the trap)
    detok = IncrementalDetokenizer(tokenizer)
    for k in range(1, len(ids) + 1):
        assert detok.update(ids[:k]) == tokenizer.decode(ids[:k], clean_up_tokenization_spaces=False), k
    assert detok.finish(ids) == uncleaned


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu")


def test_step_text_is_the_decode_of_the_tokens_so_far(llm, bundled_tokenizer):
    prompts = ["Help on topic assert:\n\n", "Help on module json:\n\n"]
    for i, p in enumerate(prompts):
        llm.add_request(p, SamplingParams(temperature=0.8, seed=i, max_tokens=48))
    finished = 0
    while llm.has_unfinished_requests():
        for out in llm.step():
            c = out.outputs[0]
            full = bundled_tokenizer.decode(c.token_ids, skip_special_tokens=True)
            if out.finished or not full.endswith(INCOMPLETE):
                assert c.text == full
            else:
                assert full.startswith(c.text)
            finished += out.finished
    assert finished == len(prompts)


def test_stop_string_cuts_the_greedy_text(llm):
    prompt = "Help on method list.append in module builtins:\n\nappend(self, object, /)\n\n"
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    words = full.text.split()
    assert len(words) > 4, full.text
    needle = " " + words[len(words) // 2]
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, stop=[needle]),
                       use_tqdm=False)[0].outputs[0]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", needle)
    assert cut.text == full.text[: full.text.index(needle)]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)] and len(cut.token_ids) < len(full.token_ids)
