"""vLLM-compatible sampling parameters, validated when constructed."""
from __future__ import annotations

import copy
import enum
import warnings
from dataclasses import KW_ONLY, dataclass, field

from kvscope.arg_checks import check_int, check_seed, check_text, is_finite_number, is_int, plain_number

MASKED, SEEDED, ADJUSTED = 1, 2, 4  # SamplingParams.sampling_flags: top-k/top-p/min-p, a seed, adjusted logits
MIN_TEMPERATURE = 0.01  # vLLM's: a temperature above 0 but under this samples at this one
_FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32: the sampler's logits are float32


class RequestOutputKind(enum.Enum):
    """What each streamed output of a request carries (vLLM's enum, same names and values)."""

    CUMULATIVE = 0  # everything so far, in every output
    DELTA = 1  # only what is new since the request's last output
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class SamplingParams:
    """How to pick tokens for one request. ``temperature=0`` means greedy; as in vLLM, a
    temperature above 0 and under ``MIN_TEMPERATURE`` (0.01) samples at 0.01, with a warning,
    and greedy params read back ``top_p=1.0``, ``top_k=0`` and ``min_p=0.0``, whatever was given;
    greedy refuses ``n > 1``, whose completions would all be the same.

    ``top_k`` of 0 or -1 disables top-k (vLLM accepts both); ``min_p`` drops the tokens less
    likely than ``min_p`` times the likeliest one (0 disables it); ``logprobs=k`` returns the
    top-k log-probabilities of every generated token (plus the chosen one), and
    ``prompt_logprobs=k`` those of every prompt token after the first (vLLM's: such a request
    computes its whole prompt, the prefix cache left unread). As in vLLM, ``-1`` for either asks
    for the whole vocabulary's, ``True`` is 1, and ``seed=-1`` is no seed.

    As in vLLM, ``stop`` and ``bad_words`` read back as lists once checked: ``[]`` for none, a
    lone string as a list of it; ``bad_words`` and ``stop_token_ids`` keep each entry once.

    ``truncate_prompt_tokens=k`` keeps the prompt's last k tokens (-1: its last
    ``max_model_len``), as vLLM's does.

    ``output_kind`` (vLLM's :class:`RequestOutputKind`) says what ``LLM.step()`` reports of the
    request: everything so far (``CUMULATIVE``), what is new since its last output (``DELTA``;
    the outputs concatenated are the cumulative final one), or only its final output
    (``FINAL_ONLY``). ``LLM.generate`` returns final cumulative outputs whatever it says.
    ``detokenize=False`` leaves the text out (``""``): token ids only, no stop strings.

    ``allowed_token_ids`` limits the draw to those tokens, ``bad_words`` bans the token that
    would complete one of those words after the outputs so far, and ``logit_bias`` adds its
    value to its tokens' logits. These and the penalties are vLLM's, applied in this order to
    the logits before everything else (greedy rows too): ``presence_penalty`` is subtracted
    from every token generated so far, and ``frequency_penalty`` once per time it was
    generated; ``repetition_penalty`` divides the positive logits of the tokens in the prompt or
    the output and multiplies the negative ones.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # vLLM's next field (prompt_logprob_token_ids) is not kvscope's, nor are several after it, so
    # the fields from here on keep vLLM's relative order but are keyword-only: a positional call
    # that long is refused rather than read into the wrong fields.
    _: KW_ONLY
    detokenize: bool = True
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # vLLM's: how many characters of a streamed text to hold back while the request runs, so
    # that no text a stop string may yet cut off is ever reported.
    output_text_buffer_length: int = field(default=0, init=False, repr=False, compare=False)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Each bad word's token ids (vLLM's), set by update_from_tokenizer when the request is added.
    _bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False, compare=False)
    # kvscope's, after vLLM's fields: vLLM's SamplingParams dropped it for generate's
    # tokenization_kwargs (vllm-project/vllm#35441), which kvscope takes too.
    truncate_prompt_tokens: int | None = None
    # What the sampler must do for such a row (MASKED | SEEDED | ADJUSTED), derived once when
    # built: a batch reads it per row whenever its rows change. (The engine copies and checks
    # each request's params when it is added, so a later change to the caller's object is seen.)
    sampling_flags: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._plain_numbers()
        check_int("n", self.n)
        # NaN fails every comparison, so ``temperature < 0`` alone would let it through.
        if not is_finite_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature > _FLOAT32_MAX:
            raise ValueError(f"temperature must be at most {_FLOAT32_MAX:.6g} (the sampler divides in "
                             f"float32), got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:  # (vLLM's clamp: 1 / T would make logits overflow)
            warnings.warn(f"temperature={self.temperature!r} is under {MIN_TEMPERATURE}, which vLLM samples at; "
                          f"sampling at {MIN_TEMPERATURE} (temperature=0 is greedy)", UserWarning, stacklevel=3)
            self.temperature = MIN_TEMPERATURE
        if not is_finite_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_finite_number(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_finite_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        rp = self.repetition_penalty
        if not is_finite_number(rp) or not 0.0 < rp <= _FLOAT32_MAX:  # (vLLM's: any finite number > 0)
            raise ValueError(f"repetition_penalty must be a finite number > 0 (at most {_FLOAT32_MAX:.6g}: the "
                             f"sampler scales float32 logits by it), got {rp!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 disables it), got {self.top_k!r}")
        if self.max_tokens is not None:
            check_int("max_tokens", self.max_tokens)
        check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if is_int(self.seed) and self.seed == -1:  # vLLM's: -1 is no seed
            self.seed = None
        if self.seed is not None:
            check_seed("seed", self.seed)
            if self.seed + self.n - 1 >= 2**64:  # (child i draws with seed + i)
                raise ValueError(f"seed + n - 1 must be < 2**64: the n={self.n} children draw with seeds "
                                 f"seed..seed+n-1, got seed={self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is True:  # vLLM's: the chosen token's and the top one's
                k = 1
                setattr(self, name, k)
            if k is not None and (not is_int(k) or k < -1):
                raise ValueError(f"{name} must be an integer >= 0, -1 (the whole vocabulary) or None, got {k!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):  # (the tokenizer refused a non-bool mid-run)
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        tpt = self.truncate_prompt_tokens
        if tpt is not None and (not is_int(tpt) or not (tpt >= 1 or tpt == -1)):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1 (keep the prompt's last k tokens) "
                             f"or -1 (its last max_model_len), got {tpt!r}")
        self._check_logit_bias()
        if self.allowed_token_ids is not None:
            ids = _as_list("allowed_token_ids", self.allowed_token_ids, int)
            if not ids or any(isinstance(t, bool) or t < 0 for t in ids):
                raise ValueError(f"allowed_token_ids must be a non-empty list of non-negative token ids, "
                                 f"got {self.allowed_token_ids!r}")
            self.allowed_token_ids = ids
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY; "
                             f"from kvscope import RequestOutputKind), got {self.output_kind!r}")
        words = _as_list("bad_words", self.bad_words, str)
        if any(not w.strip() for w in words):
            raise ValueError(f"bad_words must be non-blank strings, got {self.bad_words!r}")
        for i, word in enumerate(words):
            check_text(f"bad_words[{i}]", word)
        self.bad_words = list(dict.fromkeys(words))  # (vLLM's: always a list, empty for none, each word once)
        stop = _as_list("stop", self.stop, str)
        if any(not s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        for i, text in enumerate(stop):  # (a lone surrogate never matches, and a trace cannot save it)
            check_text("stop" if isinstance(self.stop, str) else f"stop[{i}]", text)
        if stop and not self.detokenize:  # (vLLM refuses it too)
            raise ValueError(f"stop strings need the text, which detokenize=False leaves out: pass "
                             f"detokenize=True to use stop={self.stop!r}, or stop on stop_token_ids")
        if stop and not self.include_stop_str_in_output:
            self.output_text_buffer_length = max(map(len, stop)) - 1
        self.stop = stop  # (vLLM's: always a list, a lone string in one, empty for none)
        ids = _as_list("stop_token_ids", self.stop_token_ids, int)
        if any(isinstance(t, bool) or t < 0 for t in ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(dict.fromkeys(ids))  # (vLLM's: each id once, in first-seen order)
        if self.temperature == 0:  # (vLLM's test is under 1e-5: after the clamp above, only 0)
            self._reset_for_greedy()
            if self.n > 1:  # (vLLM's _verify_greedy_sampling: the n completions would all be the same)
                raise ValueError(f"n must be 1 with greedy sampling (temperature=0), got n={self.n}: greedy "
                                 f"draws the same tokens for every completion; pass a temperature above 0 "
                                 f"for n different ones")
        self.sampling_flags = ((MASKED if self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0 else 0)
                               | (SEEDED if self.seed is not None else 0)
                               | (ADJUSTED if self.adjusts_logits else 0))

    def _reset_for_greedy(self) -> None:
        """vLLM's: greedy ignores top-p, top-k and min-p, so (once checked) they read back as
        the values that disable them."""
        self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _plain_numbers(self) -> None:
        """Every number as an exact Python int or float (numpy's, and int or float subclasses: see
        :func:`~kvscope.arg_checks.plain_number`), before the checks below read them."""
        for name in ("n", "top_k", "max_tokens", "min_tokens", "seed", "logprobs", "temperature", "top_p", "min_p",
                     "presence_penalty", "frequency_penalty", "repetition_penalty", "prompt_logprobs",
                     "truncate_prompt_tokens"):
            setattr(self, name, plain_number(getattr(self, name)))
        for name in ("stop_token_ids", "allowed_token_ids"):
            value = getattr(self, name)
            setattr(self, name, [plain_number(t) for t in value] if isinstance(value, (list, tuple))
                    else plain_number(value))

    def clone(self) -> "SamplingParams":
        """vLLM's: a deep copy, whose lists and dicts can change without touching this one's."""
        return copy.deepcopy(self)

    @property
    def stop_strings(self) -> list[str]:
        return self.stop

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
        plain = {}
        for token, value in bias.items():
            token, value = plain_number(token), plain_number(value)
            if not is_int(token) or token < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {token!r}")
            if not is_finite_number(value) or abs(value) > _FLOAT32_MAX:
                raise ValueError(f"logit_bias values must be finite float32 numbers (to ban a token, use a "
                                 f"large negative one such as -100, or allowed_token_ids), got {value!r} "
                                 f"for token {token}")
            plain[token] = value
        self.logit_bias = plain

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits change before the draw (bias, allowed tokens, bad words, penalties)."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words) or self.penalizes

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        """The token ids of each bad word, as ``update_from_tokenizer`` found them."""
        return self._bad_words_token_ids

    def update_from_vocabulary(self, vocab_size: int) -> None:
        """vLLM's ``-1`` log-probs, the whole vocabulary's, as the count the sampler takes."""
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) == -1:
                setattr(self, name, vocab_size)

    def update_from_tokenizer(self, tokenizer) -> None:
        """vLLM's: each bad word as token ids, both as it starts a text and as it follows a space
        (the second only where that gives a different first token and as many tokens). A word
        with no tokens is refused."""
        if not self.bad_words:
            return
        found: list[list[int]] = []
        for word in self.bad_words:
            bare = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            if not bare:
                raise ValueError(f"bad_words entries must tokenize to at least one token, got {word!r}")
            found.append(bare)
            spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                found.append(spaced)
        self._bad_words_token_ids = found

    @property
    def penalizes(self) -> bool:
        """Whether a penalty changes the logits: the sampler then needs the request's tokens."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _as_list(name: str, value: object, item_type: type) -> list:
    """``None``, one ``item_type`` or a list/tuple of them, as a list; anything else (a dict, a
    set, a bare number) is refused, since iterating it would silently take its keys or digits."""
    if value is None:
        return []
    if isinstance(value, item_type) and not isinstance(value, bool):
        return [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, item_type) for v in value):
        raise ValueError(f"{name} must be one {item_type.__name__} or a list of them, got {value!r}")
    return list(value)
