"""vLLM's ``bad_words``: a row may not draw the last token of one of its bad words (as token
ids, ``SamplingParams.bad_words_token_ids``) when its newest outputs are that word's other
tokens; a one-token word is never drawn.

Under async scheduling a row's newest output may still be on the device. The host compares the
rest of each word with the outputs it has, and only where those match is the last comparison,
against the output in flight, made on the device.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from kvscope.engine.scheduler_output import TokenHistory
from kvscope.runner.token_counts import Histories, Upload


class _Word(NamedTuple):
    """A word of two tokens or more, as a step compares it with a row's newest outputs."""

    before: int  # how many outputs must come just before its last token
    head: list[int]  # those outputs
    head_but_one: list[int]  # the same less the newest (compared when that one is still in flight)
    second_last: int  # the newest one (what the output in flight must be)
    last: int  # the token banned
    entry: int  # its (row, last) entry among the batch's (see ``BadWords``)


class BadWords:
    """A batch's bad words, sorted once per batch (with its other settings) so that a step does
    the least: a one-token word's token is banned at every step through index tensors made
    here, and only the longer words are compared with each row's newest outputs. Those whose
    last comparison is made on the device (an output in flight) decide the batch's (row,
    token) entries of longer words, also made here, so a step uploads one list."""

    def __init__(self, words: Sequence[list[list[int]]], upload: Upload) -> None:
        """``words``: each row's bad words, as token ids."""
        fixed = [(k, word[0]) for k, row_words in enumerate(words) for word in row_words if len(word) == 1]
        self._fixed = _index(fixed, upload)
        entry_of: dict[tuple[int, int], int] = {}  # (row, token) -> entry: a token several words may ban is one
        self._longer = [[_Word(len(w) - 1, w[:-1], w[:-2], w[-2], w[-1],
                               entry_of.setdefault((k, w[-1]), len(entry_of))) for w in row_words if len(w) > 1]
                        for k, row_words in enumerate(words)]
        self._entries = _index(list(entry_of), upload)

    def ban(self, logits: torch.Tensor, batch: Histories | None, upload: Upload,
            part: Sequence[int] | None = None) -> torch.Tensor:
        """float32 ``logits`` (one row per row of these words, the rows of ``batch`` or its rows
        ``part``; the caller's own copy, changed in place) with each row's banned tokens at
        ``-inf``: a few entries written, never a ``[rows, vocab]`` mask. Without ``batch``, no
        row has outputs yet."""
        if batch is None:
            batch, part = Histories([], [TokenHistory([], 0)] * len(self._longer), [], None), None
        always_rows: list[int] = []  # banned whatever the output in flight is
        always_tokens: list[int] = []
        if_flying: list[int] = []  # banned if the row's output in flight is the one expected
        if_expected: list[int] = []
        if_entries: list[int] = []
        in_flight = dict(zip(batch.in_flight, range(len(batch.in_flight))))
        histories = batch.histories
        for k, (row_words, i) in enumerate(zip(self._longer, range(len(self._longer)) if part is None else part)):
            if not row_words:
                continue
            h = histories[i]
            ids = h.token_ids
            known = len(ids) - h.num_prompt_tokens
            flying = in_flight.get(i)
            for before, head, head_but_one, second_last, last, entry in row_words:
                if flying is None:
                    if before <= known and ids[len(ids) - before:] == head:
                        always_rows.append(k)
                        always_tokens.append(last)
                elif before - 1 <= known and ids[len(ids) - (before - 1):] == head_but_one:
                    if_flying.append(flying)
                    if_expected.append(second_last)
                    if_entries.append(entry)
        # (-inf made on the device: a value copied from the host would wait for its queued work)
        if self._fixed is not None:
            logits.index_put_(self._fixed, logits.new_full((), float("-inf")))
        if not if_flying and not always_rows:
            return logits
        m, a = len(if_flying), len(always_rows)
        ints = upload(if_flying + if_expected + if_entries + always_rows + always_tokens, torch.int64)
        if m:  # (each entry banned if any of its words matches)
            hit = batch.in_flight_tokens[ints[:m]] == ints[m:2 * m]
            banned = torch.zeros(len(self._entries[0]), device=logits.device).scatter_reduce(
                0, ints[2 * m:3 * m], hit.float(), "amax")
            logits[self._entries] = torch.where(banned > 0, float("-inf"), logits[self._entries])
        if a:
            logits.index_put_((ints[3 * m:3 * m + a], ints[3 * m + a:]), logits.new_full((), float("-inf")))
        return logits


def _index(pairs: list[tuple[int, int]], upload: Upload) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, tokens) of ``pairs`` as index tensors; None for none."""
    if not pairs:
        return None
    return upload([r for r, _ in pairs], torch.int64), upload([t for _, t in pairs], torch.int64)
