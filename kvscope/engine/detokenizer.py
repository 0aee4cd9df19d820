"""Text of a growing list of output tokens, without decoding the whole list at every step.

Decoding all of a request's output tokens each step costs O(n) per step, O(n²) per request:
fine at the end of a request, too slow for streaming (``LLM.step()``) and stop strings. Decoding
token by token is wrong instead: one character can span several byte-level tokens, and some
tokenizers attach a space to the token that follows it. So each new token decodes a short
window that begins at the tokens that last added text before it, keeps what the window adds
beyond the text those tokens already gave, and holds back a tail that decodes to U+FFFD (an
incomplete character) until the token that completes it arrives.

An update that brings many tokens takes them in one at a time, so the text after an update does
not depend on how often the text was read before (a final-only request is read first when its
stop strings start to count, at ``min_tokens``; a streamed one at every step). Backing off from
the last token to the longest window that decodes cleanly would not do: a run of bytes that
never forms a character decodes to U+FFFD for good, however far it reaches back.

Nothing is decoded with ``clean_up_tokenization_spaces``, as in vLLM, whose detokenizers never
apply it: it rewrites text across token boundaries (" ," becomes ","), so a window decoded with
it does not agree with the text before it, and a whole decode with it is not the streamed text.
A request's final text is its detokenizer's (:meth:`IncrementalDetokenizer.finish`), never a
whole decode of its tokens, so its streamed text is always a prefix of it. A tail still held back
when the request ends stays out, as in vLLM, whose detokenizer only ever adds the text a token
completes: a request that ends inside a character ends before it. A byte that never forms a
character keeps its U+FFFD once text follows it, as there.
"""
from __future__ import annotations

from typing import Any

_INCOMPLETE = "\ufffd"


def decode(tokenizer: Any, ids: list[int], skip_special_tokens: bool = True) -> str:
    """``tokenizer``'s text of ``ids``, its spaces never cleaned up (see the module docstring)."""
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, **_options(tokenizer))


def final_text(tokenizer: Any, ids: list[int], skip_special_tokens: bool = True) -> str:
    """The final text of a request's output ``ids`` never read as it ran, as
    :meth:`IncrementalDetokenizer.finish` gives it: one whole decode, unless that ends inside a
    character, whose tail only a detokenizer run over the ids tells apart to leave out."""
    text = decode(tokenizer, ids, skip_special_tokens)
    if not text.endswith(_INCOMPLETE):
        return text
    return IncrementalDetokenizer(tokenizer, skip_special_tokens).finish(ids)


def _options(tokenizer: Any) -> dict[str, bool]:
    """Decode options that turn the tokenizer's clean-up off (none for a tokenizer without one)."""
    return {"clean_up_tokenization_spaces": False} if getattr(tokenizer, "clean_up_tokenization_spaces", False) else {}


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.text = ""
        self._prefix = 0  # window start: the tokens before the last ones that added text
        self._read = 0    # tokens whose text is already in ``self.text``
        self._seen = ""   # the text of the tokens from ``_prefix`` to ``_read``, decoded alone
        self._taken = 0   # tokens taken in so far
        self._options = _options(tokenizer)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip, **self._options)

    def update(self, output_ids: list[int]) -> str:
        """The text of ``output_ids`` (which only ever grows between calls), incomplete tail held back."""
        for end in range(self._taken + 1, len(output_ids) + 1):
            window = self._decode(output_ids[self._prefix:end])
            if len(window) > len(self._seen) and not window.endswith(_INCOMPLETE):
                self.text += window[len(self._seen):]
                self._prefix, self._read = self._read, end
                self._seen = self._decode(output_ids[self._prefix:self._read])
        self._taken = max(self._taken, len(output_ids))
        return self.text

    def finish(self, output_ids: list[int]) -> str:
        """The final text of ``output_ids``: :meth:`update`'s. The tail it held back stays out
        (no token will come to complete it): vLLM never lets it out either, so the final text
        is the same there, and a DELTA request's pieces still add up to it."""
        return self.update(output_ids)
