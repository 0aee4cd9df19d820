"""``LLM.chat``: conversations rendered by the chat template as transformers renders them, then
generated as ``generate`` would; bad conversations and options refused by name."""
from __future__ import annotations

import shutil

import pytest

from engine_helpers import greedy, make_llm, token_ids
from kvscope import LLM
from tiny_models import tiny_checkpoint

CONVERSATIONS = [
    [{"role": "user", "content": "The quick brown fox"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "A paged cache"},
     {"role": "assistant", "content": "stores blocks"}, {"role": "user", "content": "and then?"}],
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return make_llm(block_size=4, num_kv_blocks=64, max_model_len=256)


def truth(tokenizer, conversation, **options) -> list[int]:
    """transformers' own rendering and tokenization of a conversation."""
    options.setdefault("add_generation_prompt", True)
    return tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False, **options)


def test_chat_generates_from_the_template_s_tokens_one_conversation_or_several(llm):
    tok = llm.get_tokenizer()
    several = llm.chat(CONVERSATIONS, greedy(5), use_tqdm=False)
    one = llm.chat(CONVERSATIONS[1], greedy(5), use_tqdm=False)
    by_ids = llm.generate([truth(tok, c) for c in CONVERSATIONS], greedy(5), use_tqdm=False)
    assert [o.prompt_token_ids for o in several] == [truth(tok, c) for c in CONVERSATIONS]
    assert token_ids(several) == token_ids(by_ids)
    assert len(one) == 1 and token_ids(one) == token_ids(several[1:])
    assert several[0].prompt == tok.apply_chat_template(CONVERSATIONS[0], tokenize=False, add_generation_prompt=True)


def test_the_chat_options_reach_the_template(llm):
    tok = llm.get_tokenizer()
    conversation = CONVERSATIONS[1]
    template = ("{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}"
                "{% if tools %}tools={{ tools | length }}{% endif %}{{ flavour }}"
                "{% if add_generation_prompt %}[assistant:{% endif %}")
    cases = [
        ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
        ({"add_generation_prompt": False, "continue_final_message": True},
         {"add_generation_prompt": False, "continue_final_message": True}),
        ({"chat_template": template, "tools": [{"type": "function", "function": {"name": "f"}}],
          "chat_template_kwargs": {"flavour": "salty"}},
         {"chat_template": template, "tools": [{"type": "function", "function": {"name": "f"}}], "flavour": "salty"}),
        ({"chat_template": template, "chat_template_kwargs": {"add_generation_prompt": False}},
         {"chat_template": template, "add_generation_prompt": False}),  # (vLLM: the kwargs win)
    ]
    for options, hf_options in cases:
        out = llm.chat(conversation, greedy(1), use_tqdm=False, **options)[0]
        assert out.prompt_token_ids == truth(tok, conversation, **hf_options), options
    rendered = llm.chat(conversation, greedy(1), use_tqdm=False, chat_template=template,
                        chat_template_kwargs={"flavour": "salty"})[0].prompt
    assert "salty" in rendered and rendered.endswith("[assistant:")


def test_text_parts_are_joined_as_one_string(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "The quick"}, {"type": "text", "text": "brown fox"}]}]
    joined = [{"role": "user", "content": "The quick\nbrown fox"}]
    assert llm.chat(parts, greedy(1), use_tqdm=False)[0].prompt_token_ids == truth(llm.get_tokenizer(), joined)


def test_the_template_s_special_tokens_are_not_doubled(tmp_path):
    """A tokenizer that puts BOS before a text must not put a second one before a template's
    text, which writes its own: chat tokenizes without special tokens, as vLLM does."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    path = tmp_path / "bos"
    shutil.copytree(tiny_checkpoint("llama"), path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tok.bos_token} $A", special_tokens=[(tok.bos_token, tok.bos_token_id)])
    tok.chat_template = f"{tok.bos_token}" + tok.chat_template
    tok.save_pretrained(path)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, num_kv_blocks=32)
    ids = llm.chat(CONVERSATIONS[0], greedy(1), use_tqdm=False)[0].prompt_token_ids
    assert ids == truth(tok, CONVERSATIONS[0]) and ids.count(tok.bos_token_id) == 1


@pytest.mark.parametrize("messages, kwargs, error, named", [
    ([], {}, ValueError, "messages must be a non-empty list"),
    ("hello", {}, ValueError, "messages must be a non-empty list"),
    ([[]], {}, ValueError, r"messages\[0\] is an empty conversation"),
    ([{"role": "user", "content": "a"}, [{"role": "user", "content": "b"}]], {}, TypeError, r"messages\[1\] must be a message dict"),
    ([{"content": "a"}], {}, ValueError, r"messages\[0\]\['role'\]"),
    ([{"role": "user", "content": 3}], {}, TypeError, r"messages\[0\]\['content'\] must be a str"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {}, ValueError,
     r"messages\[0\]\['content'\]\[0\] must be a \{'type': 'text'"),
    ([{"role": "user", "content": "a\ud800"}], {}, ValueError,
     r"^messages\[0\]\['content'\] is not valid Unicode text: surrogates not allowed at index 1"),
    ([{"role": "user", "content": [{"type": "text", "text": "ok"}, {"type": "text", "text": "\udfff"}]}], {}, ValueError,
     r"^messages\[0\]\['content'\]\[1\]\['text'\] is not valid Unicode text"),
    ([{"role": "us\ud800er", "content": "hi"}], {}, ValueError, r"^messages\[0\]\['role'\] is not valid Unicode text"),
    (CONVERSATIONS[0], {"continue_final_message": True}, ValueError, "add_generation_prompt=False"),
    (CONVERSATIONS[0], {"add_generation_prompt": "yes"}, TypeError, "add_generation_prompt must be a bool"),
    (CONVERSATIONS[0], {"chat_template": ""}, ValueError, "chat_template must be a non-empty"),
    (CONVERSATIONS[0], {"chat_template": "{{ raise_exception('no system turns') }}"}, ValueError, "no system turns"),
    (CONVERSATIONS[0], {"chat_template": "{% for %}"}, ValueError, "chat template failed"),
    (CONVERSATIONS[0], {"chat_template_kwargs": ["x"]}, TypeError, "chat_template_kwargs must be a dict"),
    (CONVERSATIONS[0], {"chat_template_kwargs": {"tokenize": True}}, ValueError, "may not set 'tokenize'"),
    # (Python's own errors out of the template or of transformers, naming neither: "division by zero",
    # "got multiple values for argument 'conversation'", "'int' object is not iterable")
    (CONVERSATIONS[0], {"chat_template": "{{ 1 / 0 }}"}, ValueError,
     r"^the chat template failed on this conversation: division by zero"),
    (CONVERSATIONS[0], {"chat_template_kwargs": {"conversation": []}}, ValueError,
     r"^chat_template_kwargs may not set 'conversation': chat\(\) renders the messages it is given"),
    (CONVERSATIONS[0], {"chat_template_kwargs": {"documents": 5}}, ValueError,
     r"^the chat template failed on this conversation: 'int' object is not iterable"),
    (CONVERSATIONS[0], {"tools": "f"}, TypeError, "tools must be a list"),
])
def test_bad_conversations_and_options_are_refused_by_name_and_the_engine_serves_on(llm, messages, kwargs, error, named):
    with pytest.raises(error, match=named):
        llm.chat(messages, greedy(2), use_tqdm=False, **kwargs)
    assert not llm.has_unfinished_requests()
    assert len(llm.chat(CONVERSATIONS[0], greedy(2), use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_chat_without_a_template_or_a_tokenizer_says_what_to_pass(tmp_path):
    path = tmp_path / "plain"
    shutil.copytree(tiny_checkpoint("qwen3"), path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = None
    tok.save_pretrained(path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, num_kv_blocks=32)
    with pytest.raises(ValueError, match="no chat template.*pass chat_template="):
        llm.chat(CONVERSATIONS[0], greedy(1), use_tqdm=False)
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    out = llm.chat(CONVERSATIONS[0], greedy(1), use_tqdm=False, chat_template=template)[0]
    assert out.prompt_token_ids == truth(tok, CONVERSATIONS[0], chat_template=template)
    no_tokenizer = make_llm(block_size=4, num_kv_blocks=32, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="skip_tokenizer_init=True"):
        no_tokenizer.chat(CONVERSATIONS[0], greedy(1), use_tqdm=False)
