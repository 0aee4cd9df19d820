"""Checks of one request's inputs at the API boundary, before anything reaches the scheduler.

Pure functions over plain data: a bad prompt or a sampling parameter the model cannot honour
raises here with the argument's name, instead of failing later inside a step (where a
``logprobs`` above the vocabulary size used to crash the sampler for the whole batch).
"""
from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence, Set
from typing import Any

from kvscope.arg_checks import check_text, is_index
from kvscope.sampling_params import SamplingParams

PROMPT_KEYS = ("prompt", "prompt_token_ids")  # what a prompt dict may hold


def check_prompt(prompt: Any) -> None:
    """Refuse a prompt whose shape the engine cannot read, naming the field at fault."""
    if isinstance(prompt, dict):
        # (vLLM's prompt dicts have more keys, e.g. multi_modal_data: dropping one silently would
        # serve a different request than the one asked for)
        unknown = [k for k in prompt if k not in PROMPT_KEYS]
        if unknown:
            raise ValueError(f"prompt dict key {unknown[0]!r} is not supported: kvscope reads "
                             f"{' and '.join(map(repr, PROMPT_KEYS))}")
        if "prompt" in prompt:  # (beside the ids, it is the text reported with them)
            if not isinstance(prompt["prompt"], str):
                raise TypeError(f"prompt['prompt'] must be a str, got {type(prompt['prompt']).__name__}")
            check_text("prompt['prompt']", prompt["prompt"])
        if "prompt_token_ids" in prompt:
            _check_id_container(prompt["prompt_token_ids"], "prompt['prompt_token_ids']")
        elif "prompt" not in prompt:
            raise ValueError("a prompt dict needs a 'prompt' or 'prompt_token_ids' key")
    elif isinstance(prompt, str):
        check_text("prompt", prompt)
    else:
        _check_id_container(prompt, "prompt")


def _check_id_container(ids: Any, name: str) -> None:
    """Ids in an order: not text or bytes, nor a set or a mapping (whose order is its own)."""
    if isinstance(ids, (str, bytes, bytearray, Mapping, Set)) or not (
            hasattr(ids, "__len__") and hasattr(ids, "__iter__")):
        raise TypeError(f"{name} must be a list of token ids, got {type(ids).__name__}")


def check_request_ids(token_ids: Sequence[Any], params: SamplingParams, vocab_size: int,
                      eos_token_ids: frozenset[int], max_logprobs: int) -> list[int]:
    """The prompt's token ids as plain ints, after checking them and ``params`` against the
    vocabulary (``eos_token_ids``: the ones that end this request) and the engine's
    ``max_logprobs`` (vLLM's cap; -1 for none).

    numpy integers are accepted (converted); floats and bools are refused as not token ids,
    rather than reported as "outside the vocabulary". A request whose ``min_tokens`` holds back
    every token of the vocabulary is refused: nothing could be drawn before it.
    """
    ids = _plain_ids(token_ids, vocab_size)
    if ids is None:
        ids = _checked_ids(token_ids, vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and k > vocab_size:
            raise ValueError(f"{name}={k} exceeds the vocabulary size ({vocab_size})")
        if k is not None and k > max_logprobs >= 0:
            raise ValueError(f"{name}={k} exceeds max_logprobs={max_logprobs}, the engine's cap (vLLM's, "
                             f"default 20): raise it with LLM(..., max_logprobs=...), -1 for the whole vocabulary")
    bad_words = [t for word in params.bad_words_token_ids or () for t in word]
    for name, tokens in (("stop_token_ids", params.stop_token_ids), ("allowed_token_ids", params.allowed_token_ids),
                         ("logit_bias", params.logit_bias), ("bad_words", bad_words)):
        bad = [t for t in tokens or () if t >= vocab_size]
        if bad:
            raise ValueError(f"{name} contains {bad[0]}, outside the vocabulary [0, {vocab_size})")
    held = eos_token_ids.union(params.stop_token_ids)
    if params.min_tokens and params.allowed_token_ids is not None and held.issuperset(params.allowed_token_ids):
        raise ValueError(f"min_tokens={params.min_tokens} holds back stop_token_ids and EOS, which cover every "
                         f"token of allowed_token_ids: no token could be drawn before it")
    if params.min_tokens and sum(t < vocab_size for t in held) == vocab_size:
        raise ValueError(f"min_tokens={params.min_tokens} holds back stop_token_ids and EOS, which cover "
                         f"the whole vocabulary ({vocab_size}): no token could be drawn before it")
    return ids


def _plain_ids(token_ids: Sequence[Any], vocab_size: int) -> list[int] | None:
    """A copy of a non-empty list of plain ints all inside the vocabulary (the usual prompt),
    checked in C-level passes; None for anything else, which :func:`_checked_ids` then walks
    id by id to name the first one at fault."""
    if type(token_ids) is not list or not token_ids or set(map(type, token_ids)) != {int}:
        return None
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:
        return None
    return list(token_ids)


def _checked_ids(token_ids: Sequence[Any], vocab_size: int) -> list[int]:
    ids = []
    for pos, t in enumerate(token_ids):
        if not is_index(t):  # (an array of more than one id has __index__, which raises)
            raise TypeError(f"prompt_token_ids[{pos}] is {t!r} ({type(t).__name__}); token ids must be integers")
        ids.append(operator.index(t))
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt_token_ids contains {bad[0]!r}, outside the vocabulary [0, {vocab_size})")
    return ids
