"""Text of a growing list of output tokens, without decoding the whole list at every step.

Decoding all of a request's output tokens each step costs O(n) per step, O(n²) per request:
fine at the end of a request, too slow for streaming (``LLM.step()``) and stop strings. Decoding
token by token is wrong instead: one character can span several byte-level tokens, and some
tokenizers attach a space to the token that follows it. So each update decodes a short window
that begins at the previous update's tokens, keeps what the window adds beyond the text those
tokens already gave, and holds back a tail that decodes to U+FFFD (an incomplete character)
until the token that completes it arrives.

Only the tokens of that character are held back, however many tokens an update brings: the text
after an update does not depend on how often the text was read before (a final-only request is
read first when its stop strings start to count, at ``min_tokens``; a streamed one at every step).
"""
from __future__ import annotations

from typing import Any

_INCOMPLETE = "\ufffd"
_MAX_HELD = 3  # the most tokens an incomplete character's bytes span (UTF-8: at most 3 of 4 bytes)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.text = ""
        self._prefix = 0  # window start: the tokens of the previous update
        self._read = 0    # tokens whose text is already in ``self.text``

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def update(self, output_ids: list[int]) -> str:
        """The text of ``output_ids`` (which only ever grows between calls), incomplete tail held back."""
        n = len(output_ids)
        if n > self._read:
            seen = self._decode(output_ids[self._prefix:self._read])
            for end in range(n, max(self._read, n - _MAX_HELD - 1), -1):  # the longest clean window
                window = self._decode(output_ids[self._prefix:end])
                if len(window) > len(seen) and not window.endswith(_INCOMPLETE):
                    self.text += window[len(seen):]
                    self._prefix, self._read = self._read, end
                    break
        return self.text
