"""vLLM's ``bad_words``: a row may not draw the last token of one of its bad words (as token
ids, ``SamplingParams.bad_words_token_ids``) when its newest outputs are that word's other
tokens; a one-token word is never drawn.

Under async scheduling a row's newest output may still be on the device. The host compares the
rest of each word with the outputs it has, and only where those match is the last comparison,
against the output in flight, made on the device.
"""
from __future__ import annotations

from typing import Sequence

import torch

from kvscope.engine.scheduler_output import TokenHistory
from kvscope.runner.token_counts import Histories, Upload


def ban_bad_words(logits: torch.Tensor, words: Sequence[list[list[int]]], batch: Histories | None,
                  upload: Upload) -> torch.Tensor:
    """float32 ``logits`` (one row per entry of ``words``, the rows of ``batch``; the caller's own
    copy, changed in place) with each row's banned tokens at ``-inf``: a few entries written,
    never a ``[rows, vocab]`` mask. Without ``batch``, no row has outputs yet."""
    if batch is None:
        batch = Histories([], [TokenHistory([], 0)] * len(words), [], None)
    always_rows: list[int] = []  # banned whatever the output in flight is
    always_tokens: list[int] = []
    if_rows: list[int] = []  # banned if the row's output in flight is the one expected
    if_tokens: list[int] = []
    if_flying: list[int] = []
    if_expected: list[int] = []
    in_flight = dict(zip(batch.in_flight, range(len(batch.in_flight))))
    for k, (row_words, h) in enumerate(zip(words, batch.histories)):
        ids = h.token_ids
        known = len(ids) - h.num_prompt_tokens
        flying = in_flight.get(k)
        for word in row_words:
            before = len(word) - 1  # the outputs that must come just before the word's last token
            if flying is None:
                if before <= known and ids[len(ids) - before:] == word[:-1]:
                    always_rows.append(k)
                    always_tokens.append(word[-1])
            elif before == 0:
                always_rows.append(k)
                always_tokens.append(word[-1])
            elif before - 1 <= known and ids[len(ids) - (before - 1):] == word[:-2]:
                if_rows.append(k)
                if_tokens.append(word[-1])
                if_flying.append(flying)
                if_expected.append(word[-2])
    if if_rows:
        # One entry per (row, token): a token that several words may ban goes if any of them matches.
        pair_at: dict[tuple[int, int], int] = {}
        entry = [pair_at.setdefault(pair, len(pair_at)) for pair in zip(if_rows, if_tokens)]
        hit = batch.in_flight_tokens[upload(if_flying, torch.int64)] == upload(if_expected, torch.int64)
        banned = torch.zeros(len(pair_at), device=logits.device).scatter_reduce(
            0, upload(entry, torch.int64), hit.float(), "amax")
        at = (upload([r for r, _ in pair_at], torch.int64), upload([t for _, t in pair_at], torch.int64))
        logits[at] = torch.where(banned > 0, float("-inf"), logits[at])
    if always_rows:
        logits.index_put_((upload(always_rows, torch.int64), upload(always_tokens, torch.int64)),
                          logits.new_full((), float("-inf")))  # (-inf made on the device: no wait for it)
    return logits
