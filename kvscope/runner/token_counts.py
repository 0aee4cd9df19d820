"""What the penalties read of each penalized sequence, kept on the device from step to step:
a mask of its prompt's tokens and a count of each output token.

A step adds only the outputs its rows gained since they were last read, so its host work
grows with its rows, not with their histories (vLLM V1's sampler rebuilds both from token
lists every step). A sequence's row is made on its first read, from its whole history, and
kept until the runner forgets the finished sequence.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from operator import attrgetter, itemgetter
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

Upload = Callable[[list | np.ndarray, torch.dtype], torch.Tensor]  # a host list or array as a device tensor


class History(Protocol):
    """A sequence's tokens as the host knows them: its prompt, then its outputs."""

    token_ids: list[int]
    num_prompt_tokens: int


@dataclass(frozen=True)
class Histories:
    """Some rows of a batch, as :class:`TokenCounts` reads them."""

    keys: Sequence[int]  # each row's sequence (``seq_id``)
    histories: Sequence[History]
    in_flight: Sequence[int]  # the rows (positions here, ascending) with one more output, still on the device
    in_flight_tokens: torch.Tensor | None  # int64 [len(in_flight)]: those outputs (None: no row has one)


@dataclass(frozen=True)
class Located:
    """The rows of a batch in the pool (:meth:`TokenCounts.locate`)."""

    prompt_mask: torch.Tensor  # bool [pool rows, vocab]: the whole pool
    output_counts: torch.Tensor  # float32 [pool rows, vocab]: the whole pool, outputs in flight not counted
    pool_rows: torch.Tensor  # int64 [rows]: each row's pool row
    in_flight: torch.Tensor  # int64 [rows]: each row's output still on the device, -1 for none


HistoryOf = Callable[[list[int]], Histories]  # a batch's row numbers -> those rows' tokens


class Row(Protocol):
    """A scheduled row as :func:`histories_of` reads it."""

    seq_id: int
    history: History


def histories_of(source: Sequence[Row], which: list[int], index: Sequence[int],
                 in_flight_tokens: Callable[[list[int]], torch.Tensor]) -> Histories:
    """Rows ``which`` of ``source`` as :class:`TokenCounts` reads them. A row whose output index
    (``index``) is past its known outputs has that output in flight (async scheduling): the last
    step sampled it on the device, and ``in_flight_tokens`` (given those rows' numbers) reads it there."""
    picked = [source[i] for i in which]
    histories = [r.history for r in picked]
    flying = [k for k, (i, h) in enumerate(zip(which, histories))
              if index[i] > len(h.token_ids) - h.num_prompt_tokens]
    tokens = in_flight_tokens([which[k] for k in flying]) if flying else None
    return Histories([r.seq_id for r in picked], histories, flying, tokens)

_TOKEN_IDS = attrgetter("token_ids")
_NEWEST = itemgetter(-1)
GROWTH = 64  # rows added at a time: the pool is copied whenever it grows


class TokenCounts:
    """Per sequence, a row of the prompt mask (bool) and of the output counts (float32), each
    ``[rows, vocab]`` on the device. The rows count the outputs the host has (a row holds the
    first ``seen[row]`` tokens of its sequence: prompt, then outputs); an output still in
    flight is added to the copy a read returns only, so an output lost with a rolled-back step
    was never counted."""

    def __init__(self, device: torch.device, upload: Upload) -> None:
        self.device = device
        self._upload = upload
        self._mask = torch.zeros(0, 0, dtype=torch.bool, device=device)
        self._counts = torch.zeros(0, 0, dtype=torch.float32, device=device)
        self._row: dict[int, int] = {}  # sequence -> its row
        self._seen = np.zeros(0, dtype=np.int64)  # by row: how many of its sequence's tokens it holds
        self._free: list[int] = []

    def __len__(self) -> int:
        """How many sequences have a row."""
        return len(self._row)

    def read(self, batch: Histories, vocab: int, part: Sequence[int] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of ``batch`` (or its rows ``part``), in its order: their prompt masks and
        output counts (new tensors; the counts with each row's output in flight), each row
        updated first with the outputs the host gained since its last read."""
        seen = self.locate(batch, vocab, part)
        counts = seen.output_counts[seen.pool_rows]
        flying = seen.in_flight.unsqueeze(1)
        counts.scatter_add_(1, flying.clamp(min=0), (flying >= 0).to(counts.dtype))
        return seen.prompt_mask[seen.pool_rows], counts

    def locate(self, batch: Histories, vocab: int, part: Sequence[int] | None = None) -> "Located":
        """Where the rows of ``batch`` (or its rows ``part``, positions ascending) are in the
        pool, each row updated first with the outputs the host gained since its last read: what
        a kernel that reads the pool in place needs
        (:func:`kvscope.kernels.triton_penalties.penalize_`), where :meth:`read` copies.

        The rows are worked on as arrays (a batch's keys are distinct sequences), not one by
        one: a steady step's rows each gained one output, and their host lists go up in one
        upload; with every row's output in flight (async scheduling) those outputs are
        ``in_flight`` as they are."""
        if self._mask.shape[1] != vocab:
            self._resize(0, vocab)
        keys, histories = batch.keys, batch.histories
        if part is not None:
            keys, histories = [keys[i] for i in part], [histories[i] for i in part]
        n = len(keys)
        ids = list(map(_TOKEN_IDS, histories))
        lengths = np.fromiter(map(len, ids), np.int64, n)
        rows = np.fromiter(map(self._row.get, keys, itertools.repeat(-1, n)), np.int64, n)
        if rows.min(initial=0) < 0:  # sequences read for the first time
            fresh = np.flatnonzero(rows < 0).tolist()
            for k in fresh:
                rows[k] = self._take(keys[k])
            self._start(rows[fresh], [ids[k][:histories[k].num_prompt_tokens] for k in fresh])
        seen = self._seen[rows]
        # the outputs gained, as ``row * vocab + token``
        if (lengths - seen == 1).all():  # (a steady step: each row gained its newest output)
            added = rows * vocab + np.fromiter(map(_NEWEST, ids), np.int64, n)
        else:
            grew = np.flatnonzero(lengths > seen)
            gained = (lengths - seen)[grew]
            tails = [ids[k][-g:] for k, g in zip(grew.tolist(), gained.tolist())]
            added = np.repeat(rows[grew] * vocab, gained) + np.fromiter(
                itertools.chain.from_iterable(tails), np.int64, int(gained.sum()))
        self._seen[rows] = lengths
        every_row_flying = part is None and 0 < n == len(batch.in_flight)  # (ascending: every position in order)
        flying, source = (None, None) if every_row_flying else _flying(batch, part)
        sent = [rows, added] + ([] if flying is None else [flying]) + ([] if source is None else [source])
        ints = self._upload(np.concatenate(sent), torch.int64)
        if len(added):  # (index_add_ adds a pair given twice twice, in one kernel)
            flat = self._counts.view(-1)
            flat.index_add_(0, ints[n:n + len(added)], flat.new_ones(()).expand(len(added)))
        if every_row_flying:
            in_flight = batch.in_flight_tokens
        else:
            in_flight = torch.full((n,), -1, dtype=torch.int64, device=self.device)
            if len(flying):
                at = n + len(added)
                tokens = batch.in_flight_tokens if source is None else batch.in_flight_tokens[ints[at + len(flying):]]
                in_flight.index_put_((ints[at:at + len(flying)],), tokens)
        return Located(self._mask, self._counts, ints[:n], in_flight)

    def _start(self, rows: np.ndarray, prompts: list[list[int]]) -> None:
        """Set up new ``rows``: their prompts' tokens in the mask, no outputs counted yet."""
        self._seen[rows] = list(map(len, prompts))
        up = self._upload
        # (values made on the device: ``t[index] = scalar`` copies the scalar from the host,
        # which waits for the device's queued work)
        at = up(rows, torch.int64)
        self._mask.index_put_((at,), self._mask.new_zeros(()))
        self._counts.index_put_((at,), self._counts.new_zeros(()))
        self._mask.index_put_((up(np.repeat(rows, list(map(len, prompts))), torch.int64),
                               up(list(itertools.chain.from_iterable(prompts)), torch.int64)),
                              self._mask.new_ones(()))

    def forget(self, keys: Sequence[int]) -> None:
        """Free the rows of these sequences (finished ones); unknown keys are ignored."""
        for key in keys:
            row = self._row.pop(key, None)
            if row is not None:
                self._free.append(row)

    def _take(self, key: int) -> int:
        """A free row for ``key``, growing the pool when none is left."""
        if not self._free:
            self._resize(self._mask.shape[0] + GROWTH, self._mask.shape[1])
        row = self._row[key] = self._free.pop()
        return row

    def _resize(self, rows: int, vocab: int) -> None:
        """Make the pool ``rows`` × ``vocab``, keeping its rows when ``vocab`` is the same (a
        new vocabulary forgets every row)."""
        mask = torch.zeros(rows, vocab, dtype=torch.bool, device=self.device)
        counts = torch.zeros(rows, vocab, dtype=torch.float32, device=self.device)
        if vocab == self._mask.shape[1]:
            kept = self._mask.shape[0]
            mask[:kept] = self._mask
            counts[:kept] = self._counts
            self._seen = np.concatenate([self._seen, np.zeros(rows - kept, dtype=np.int64)])
        else:
            self._row.clear()
            self._seen = np.zeros(rows, dtype=np.int64)
        self._mask, self._counts = mask, counts
        taken = set(self._row.values())
        self._free = [r for r in range(rows - 1, -1, -1) if r not in taken]


def _flying(batch: Histories, part: Sequence[int] | None) -> tuple[np.ndarray, np.ndarray | None]:
    """Which of the rows read (``batch``'s, or its rows ``part``) have an output in flight, as
    positions among them, and for ``part`` where each such output is in ``in_flight``."""
    if part is None:
        return np.asarray(batch.in_flight, dtype=np.int64), None
    place = np.full(len(batch.keys), -1, dtype=np.int64)
    place[np.asarray(batch.in_flight, dtype=np.int64)] = np.arange(len(batch.in_flight))
    place = place[np.asarray(part, dtype=np.int64)]
    flying = np.flatnonzero(place >= 0)
    return flying, place[flying]
