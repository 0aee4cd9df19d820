"""vLLM's ``bad_words``: each word as token ids by vLLM's rule, and whole runs against a step-by-step
torch reference that bans a word's last token after its other tokens, under async scheduling
(the newest output still on the device), chunked prefill, preemption and parallel sampling."""
from __future__ import annotations

import random

import pytest
import torch

from engine_helpers import bias_logits, greedy, make_llm, token_ids
from kvscope import SamplingParams
from kvscope.engine.scheduler_output import TokenHistory
from kvscope.runner.bad_words import BadWords
from kvscope.runner.logit_adjustments import Adjustments
from kvscope.runner.token_counts import Histories, TokenCounts
from test_logit_adjustments import CONFIGS
from tiny_models import load_hf_model, tiny_checkpoint

MAX_NEW = 20


def reference_tokens(model, prompt: list[int], words: list[list[int]], bias: dict[int, float]) -> list[int]:
    """Greedy tokens of transformers' logits plus ``bias`` (part of the model here), each step's
    banned tokens at -inf: a word's last token when the outputs so far end with its others."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(MAX_NEW):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            for token, b in bias.items():
                logits[token] += b
            for word in words:
                if len(word) - 1 <= len(out) and out[len(out) - len(word) + 1:] == word[:-1]:
                    logits[word[-1]] = float("-inf")
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    return out


def _contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


def test_each_word_is_its_token_ids_alone_and_after_a_space_as_vllm_finds_them():
    """Both forms where the space changes the first token and not the length; only the bare
    form otherwise; leading spaces of a word are dropped first."""
    tok = make_llm(block_size=4).get_tokenizer()

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    words = ["ab", "  ab", "hello", "the cat"]
    params = SamplingParams(bad_words=words)
    params.update_from_tokenizer(tok)
    want = []
    for word in words:
        bare, spaced = enc(word.lstrip()), enc(" " + word.lstrip())
        want.append(bare)
        if spaced[0] != bare[0] and len(spaced) == len(bare):
            want.append(spaced)
    assert params.bad_words_token_ids == want
    assert [enc("ab"), enc(" ab")] == want[:2] and enc(" hello") not in want  # (both cases occur)


def test_a_word_the_space_does_not_change_is_kept_once():
    """A tokenizer that drops spaces gives both forms the same ids: vLLM keeps one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "ab": 1, "cd": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    params = SamplingParams(bad_words=["ab cd"])
    params.update_from_tokenizer(PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]"))
    assert params.bad_words_token_ids == [[1, 2]]


@pytest.mark.parametrize("config", CONFIGS, ids=["sync", "async", "chunked", "preempting"])
def test_bad_words_match_a_torch_reference(config):
    """A model biased towards bad words' tokens, on one prompt: without the one-token word it
    draws that word, without it the two-token one, and with both banned it keeps drawing the
    two-token word's first token, never completing the word: its last token is banned exactly
    after the first (still on the device under async scheduling)."""
    llm = make_llm(block_size=4, **config)
    tok = llm.get_tokenizer()
    ab, spaced_ab, c = (tok.encode(t, add_special_tokens=False) for t in ("ab", " ab", "c"))
    bias = {ab[0]: 7.0, ab[1]: 6.5, spaced_ab[0]: 5.0, c[0]: 7.2}
    bias_logits(llm, bias)
    prompts = [[30, 31, 32, 33, 34]] * 4  # (what differs between rows is their bans alone)
    rows = [greedy(MAX_NEW, bad_words="c"), greedy(MAX_NEW, bad_words=["ab", "c"]),
            greedy(MAX_NEW, bad_words=[" ab", "c"], n=2), greedy(MAX_NEW)]
    outs = llm.generate(prompts, rows, use_tqdm=False)
    ours = [[list(c.token_ids) for c in o.outputs] for o in outs]
    model = load_hf_model(tiny_checkpoint("qwen3"))
    for prompt, params, got in zip(prompts, rows, ours):
        words = SamplingParams(bad_words=params.bad_words) if params.bad_words else None
        if words is not None:
            words.update_from_tokenizer(tok)
        want = reference_tokens(model, prompt, words.bad_words_token_ids if words else [], bias)
        assert got == [want] * params.n
        for word in words.bad_words_token_ids if words else []:
            assert not _contains(want, word)
    assert c[0] in ours[3][0] and _contains(ours[0][0], ab)  # (what each ban takes away, drawn without it)
    assert ab[0] in ours[1][0]  # (the first token of a banned word still comes)


@pytest.mark.parametrize("kwargs, error", [
    (dict(bad_words=[""]), "bad_words must be non-blank strings"),
    (dict(bad_words=["ok", "  "]), "bad_words must be non-blank strings"),
    (dict(bad_words=5), "bad_words must be one str or a list of them"),
    (dict(bad_words=[b"ab"]), "bad_words must be one str or a list of them"),
])
def test_bad_words_of_the_wrong_kind_are_refused_by_name(kwargs, error):
    with pytest.raises(ValueError, match=error):
        SamplingParams(**kwargs)


def test_bad_words_without_a_tokenizer_are_refused_at_add_request():
    llm = make_llm(block_size=4, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="bad_words need a tokenizer"):
        llm.add_request([5, 6, 7], greedy(3, bad_words=["ab"]))
    assert not llm.has_unfinished_requests()
    assert token_ids(llm.generate([[5, 6, 7]], greedy(3), use_tqdm=False))[0]


def _upload(values, dtype: torch.dtype) -> torch.Tensor:
    return torch.as_tensor(values, dtype=dtype)


def _banned(words: list[list[int]], outputs: list[int]) -> set[int]:
    """The tokens ``words`` ban after ``outputs`` (the one in flight included)."""
    return {w[-1] for w in words if len(w) - 1 <= len(outputs) and outputs[len(outputs) - len(w) + 1:] == w[:-1]}


@pytest.mark.parametrize("seed", range(8))
def test_each_ban_is_every_word_matched_with_the_newest_outputs(seed):
    """Random words (several banning one token, some repeated) over random histories, with
    outputs in flight for every row, some or none, for a whole batch and for a part of it, and
    without any history: each ban against the words matched one by one."""
    rng = random.Random(seed)
    vocab, alphabet = 9, 3  # (few tokens: words match often)
    for _ in range(30):
        size = rng.randrange(1, 9)
        histories = []
        for _ in range(size):
            prompt = rng.randrange(0, 3)
            histories.append(TokenHistory([rng.randrange(alphabet) for _ in range(prompt + rng.randrange(5))], prompt))
        everyone = rng.random() < 0.3
        flying = [i for i in range(size) if everyone or rng.random() < 0.5]
        flown = [rng.randrange(alphabet) for _ in flying]
        batch = Histories(list(range(size)), histories, flying, torch.tensor(flown) if flying else None)
        part = sorted(rng.sample(range(size), rng.randrange(1, size + 1))) if rng.random() < 0.5 else None
        rows = list(range(size)) if part is None else part
        words = [[[rng.randrange(alphabet) for _ in range(rng.randrange(1, 5))] for _ in range(rng.randrange(4))]
                 for _ in rows]
        logits = torch.randn(len(rows), vocab)
        without = rng.random() < 0.15
        got = BadWords(words, _upload).ban(logits.clone(), None if without else batch, _upload, part)
        want = logits.clone()
        for k, i in enumerate(rows):
            h = histories[i]
            outputs = [] if without else h.token_ids[h.num_prompt_tokens:] + (
                [flown[flying.index(i)]] if i in flying else [])
            for token in _banned(words[k], outputs):
                want[k, token] = float("-inf")
        assert torch.equal(got, want)


class _Tokenizer:
    """Each space-separated piece of a word is one token: ``"t4 t1"`` is ``[4, 1]``."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [int(piece[1:]) for piece in text.split()]


@pytest.mark.parametrize("seed", range(4))
def test_a_batch_looks_up_each_rows_tokens_once_and_adjusts_each_row_as_alone(seed):
    """Rows with penalties, bad words, both, a bias alone and nothing, over steps whose rows
    gain outputs on the host and in flight: the batch asks for its rows' tokens once a step,
    for the rows with penalties or bad words only, and adjusts each row as a batch of that
    row alone does."""
    rng = random.Random(seed)
    vocab, alphabet = 12, 4
    words = ["t1", "t2 t3", "t0 t1 t2", "t3 t3"]
    kinds = [dict(repetition_penalty=1.7, frequency_penalty=0.4), dict(bad_words=words[:3]),
             dict(presence_penalty=0.9, bad_words=words[1:]), dict(logit_bias={2: 1.5}), dict()]
    params = []
    for _ in range(9):
        p = SamplingParams(temperature=0.0, **rng.choice(kinds))
        p.update_from_tokenizer(_Tokenizer())
        params.append(p)
    prompts = [[rng.randrange(alphabet) for _ in range(rng.randrange(1, 4))] for _ in params]
    histories = [TokenHistory(prompt, len(prompt)) for prompt in prompts]
    flying: dict[int, int] = {}  # row -> its output in flight
    asked: list[list[int]] = []

    def history_of(which: list[int], rows: list[int] | None = None) -> Histories:
        rows = which if rows is None else rows
        at = [k for k, i in enumerate(rows) if i in flying]
        tokens = torch.tensor([flying[rows[k]] for k in at]) if at else None
        return Histories(rows, [histories[i] for i in rows], at, tokens)

    def asking(which: list[int]) -> Histories:
        asked.append(which)
        return history_of(which)

    batch = Adjustments.of(params, vocab, torch.device("cpu"), _upload)
    alone = [Adjustments.of([p], vocab, torch.device("cpu"), _upload) for p in params]
    counts = TokenCounts(torch.device("cpu"), _upload)
    own_counts = [TokenCounts(torch.device("cpu"), _upload) for _ in params]
    for _ in range(12):
        for i, h in enumerate(histories):
            if i in flying and rng.random() < 0.8:
                h.token_ids.append(flying.pop(i))  # (or else it is lost)
            h.token_ids.extend(rng.randrange(alphabet) for _ in range(rng.choice((0, 1, 1, 2))))
            if rng.random() < 0.6:
                flying[i] = rng.randrange(alphabet)
            else:
                flying.pop(i, None)
        logits = torch.randn(len(params), vocab)
        asked.clear()
        got = batch.apply(logits, asking, counts, _upload)
        assert asked == [[i for i, p in enumerate(params) if p.penalizes or p.bad_words]]
        for i, adjustments in enumerate(alone):
            want = adjustments.apply(logits[i:i + 1], lambda _, i=i: history_of([0], [i]), own_counts[i], _upload)
            assert torch.equal(got[i:i + 1], want), (i, params[i])
