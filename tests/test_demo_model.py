"""The bundled demo model (assets/kvscope-demo) is what `LLM()` and every notebook load, on
machines that cannot download weights. These tests pin the properties the demos rely on:
it loads offline with plain transformers, is small, writes readable text and stops on EOS."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

DEMO = Path(__file__).resolve().parents[1] / "assets" / "kvscope-demo"
MAX_NEW_TOKENS = 64

# Help-page headers, the corpus's prompt format (tools/demo_corpus.py): a topic, modules,
# functions, methods, a class and builtins. The model should answer with one short paragraph.
PROMPTS = [
    "Help on function join in module posixpath:\n\njoin(a, *p)\n\n",
    "Help on method list.append in module builtins:\n\nappend(self, object, /)\n\n",
    "Help on topic assert:\n\n",
    "Help on module json:\n\n",
    "Help on class OrderedDict in module collections:\n\nclass OrderedDict(dict)\n\n",
    "Help on method date.replace in module datetime:\n\nreplace(self, year=None, month=None, day=None)\n\n",
    "Help on function rmtree in module shutil:\n\nrmtree(path, ignore_errors=False, onerror=None, *, dir_fd=None)\n\n",
    "Help on method Checkbutton.toggle in module tkinter:\n\ntoggle(self)\n\n",
    "Help on method str.split in module builtins:\n\nsplit(self, /, sep=None, maxsplit=-1)\n\n",
    "Help on topic for:\n\n",
]

# Documents from the held-out test split: never trained on.
HELD_OUT = [
    'Help on topic async:\n\nIt is a "SyntaxError" to use an "async with" statement outside the body '
    "of a coroutine function.",
    "Help on function execv in module posix:\n\nexecv(path, argv, /)\n\nExecute an executable path "
    "with arguments, replacing current process.",
    "Help on function variance in module statistics:\n\nvariance(data, xbar=None)\n\nIf you have "
    "already calculated the mean of your data, you can pass it as the optional second argument "
    "``xbar`` to avoid recalculating it:",
    "Help on method URLopener.addheader in module urllib.request:\n\naddheader(self, *args)\n\n"
    "Add a header to be used by the HTTP interface only e.g. u.addheader('Accept', 'sound/basic')",
    "Help on class BasePattern in module lib2to3.pytree:\n\nclass BasePattern(object)\n\nThis is an "
    "abstract base class. There are three concrete subclasses:",
]


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(DEMO, local_files_only=True)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32, local_files_only=True)
    return m.eval()


def test_assets_are_small() -> None:
    total = sum(p.stat().st_size for p in DEMO.iterdir() if p.is_file())
    assert total <= 20 * 1024 * 1024, f"{total / 2**20:.1f} MiB"


def test_config_is_small_qwen3_with_eos(model) -> None:
    cfg = model.config
    assert cfg.model_type == "qwen3" and type(model).__name__ == "Qwen3ForCausalLM"
    assert cfg.num_attention_heads > cfg.num_key_value_heads  # GQA, as the engine must handle
    assert cfg.tie_word_embeddings
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (cfg.head_dim,)
    assert model.generation_config.eos_token_id == cfg.eos_token_id


def test_tokenizer_round_trips_and_has_eos(tokenizer, model) -> None:
    assert tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == model.config.eos_token_id
    assert len(tokenizer) == model.config.vocab_size
    for text in [
        "def f(x):\n    return x ** 2  # tabs\tand  double  spaces\n",
        "Unicode: naïve café, Ελληνικά, 日本語, emoji 🐍 and \r\n line ends.",
        "Help on function join in module posixpath:\n\njoin(a, *p)\n\n",
        "",
    ]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
        assert tokenizer.eos_token_id not in ids
    # A corpus-like paragraph compresses well: the BPE merges were learned on this domain.
    sample = "Return a new list containing all items from the iterable in ascending order."
    assert len(tokenizer(sample)["input_ids"]) < len(sample) / 3


def _total_nll(model, ids: list[int]) -> float:
    t = torch.tensor([ids])
    return model(input_ids=t, labels=t).loss.item() * (len(ids) - 1)


@torch.no_grad()
def test_held_out_text_is_likely_and_shuffled_text_is_not(tokenizer, model) -> None:
    """Readable text is what the model expects: low perplexity on documents it never saw,
    and orders of magnitude higher on the same tokens shuffled."""
    rng = random.Random(0)
    nll, shuffled_nll, count = 0.0, 0.0, 0
    for text in HELD_OUT:
        ids = tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
        shuffled = rng.sample(ids, len(ids))
        nll += _total_nll(model, ids)
        shuffled_nll += _total_nll(model, shuffled)
        count += len(ids) - 1
    ppl, shuffled_ppl = math.exp(nll / count), math.exp(shuffled_nll / count)
    assert ppl < 30, ppl
    assert shuffled_ppl > 100 * ppl, (ppl, shuffled_ppl)


@torch.no_grad()
def test_greedy_answers_end_with_eos(tokenizer, model) -> None:
    """Output lengths must vary naturally: most answers stop on EOS well before the budget,
    and what comes before it decodes to words, not byte soup."""
    stopped = 0
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        new = out[0, ids.shape[1]:].tolist()
        if tokenizer.eos_token_id in new:
            stopped += 1
            new = new[: new.index(tokenizer.eos_token_id)]
        text = tokenizer.decode(new)
        assert text.strip(), prompt
        assert sum(c.isalpha() or c.isspace() for c in text) / len(text) > 0.7, text
    assert stopped >= 0.8 * len(PROMPTS), f"{stopped}/{len(PROMPTS)} stopped on EOS"
