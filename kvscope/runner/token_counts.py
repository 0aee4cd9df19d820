"""What the penalties read of each penalized sequence, kept on the device from step to step:
a mask of its prompt's tokens and a count of each output token.

A step adds only the outputs its rows gained since they were last read, so its host work
grows with its rows, not with their histories (vLLM V1's sampler rebuilds both from token
lists every step). A sequence's row is made on its first read, from its whole history, and
kept until the runner forgets the finished sequence.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

Upload = Callable[[list, torch.dtype], torch.Tensor]  # a host list as a device tensor


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

GROWTH = 64  # rows added at a time: the pool is copied whenever it grows


class TokenCounts:
    """Per sequence, a row of the prompt mask (bool) and of the output counts (float32), each
    ``[rows, vocab]`` on the device. The rows count the outputs the host has
    (``counted[row]`` of them); an output still in flight is added to the copy a read returns
    only, so an output lost with a rolled-back step was never counted."""

    def __init__(self, device: torch.device, upload: Upload) -> None:
        self.device = device
        self._upload = upload
        self._mask = torch.zeros(0, 0, dtype=torch.bool, device=device)
        self._counts = torch.zeros(0, 0, dtype=torch.float32, device=device)
        self._row: dict[int, int] = {}  # sequence -> its row
        self._counted: list[int] = []  # by row
        self._free: list[int] = []

    def __len__(self) -> int:
        """How many sequences have a row."""
        return len(self._row)

    def read(self, batch: Histories, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of ``batch``, in its order: their prompt masks and output counts (new
        tensors; the counts with each row's output in flight), each row updated first with the
        outputs the host gained since its last read."""
        seen = self.locate(batch, vocab)
        counts = seen.output_counts[seen.pool_rows]
        flying = seen.in_flight.unsqueeze(1)
        counts.scatter_add_(1, flying.clamp(min=0), (flying >= 0).to(counts.dtype))
        return seen.prompt_mask[seen.pool_rows], counts

    def locate(self, batch: Histories, vocab: int) -> "Located":
        """Where the rows of ``batch`` are in the pool, each row updated first with the outputs
        the host gained since its last read: what a kernel that reads the pool in place needs
        (:func:`kvscope.kernels.triton_penalties.penalize_`), where :meth:`read` copies.

        A steady step's rows each gained one output: the host's lists go up in one upload, and
        with every row's output in flight (async scheduling) those outputs are ``in_flight`` as
        they are."""
        if self._mask.shape[1] != vocab:
            self._resize(0, vocab)
        rows: list[int] = []
        fresh: list[int] = []  # rows made now: set from their prompts
        prompt_rows: list[int] = []
        prompt_tokens: list[int] = []
        added: list[int] = []  # outputs not counted yet, as ``row * vocab + token``
        counted = self._counted
        for key, h in zip(batch.keys, batch.histories):
            ids, p = h.token_ids, h.num_prompt_tokens
            row = self._row.get(key)
            if row is None:
                row = self._take(key)
                fresh.append(row)
                prompt_rows += [row] * p
                prompt_tokens += ids[:p]
                counted[row] = 0
            n, known = counted[row], len(ids) - p
            if n < known:
                base = row * vocab
                added += [base + t for t in ids[p + n:]]
                counted[row] = known
            rows.append(row)
        n = len(rows)
        every_row_flying = 0 < n == len(batch.in_flight)  # (ascending: every position in order)
        ints = self._upload(rows + added + ([] if every_row_flying else list(batch.in_flight)), torch.int64)
        pool_rows = ints[:n]
        if fresh:
            up = self._upload
            # (values made on the device: ``t[index] = scalar`` copies the scalar from the host,
            # which waits for the device's queued work)
            at = up(fresh, torch.int64)
            self._mask.index_put_((at,), self._mask.new_zeros(()))
            self._counts.index_put_((at,), self._counts.new_zeros(()))
            self._mask.index_put_((up(prompt_rows, torch.int64), up(prompt_tokens, torch.int64)),
                                  self._mask.new_ones(()))
        if added:  # (index_add_ adds a pair given twice twice, in one kernel)
            flat = self._counts.view(-1)
            flat.index_add_(0, ints[n:n + len(added)], flat.new_ones(()).expand(len(added)))
        if every_row_flying:
            in_flight = batch.in_flight_tokens
        else:
            in_flight = torch.full((n,), -1, dtype=torch.int64, device=self.device)
            if batch.in_flight:
                in_flight.index_put_((ints[n + len(added):],), batch.in_flight_tokens)
        return Located(self._mask, self._counts, pool_rows, in_flight)

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
        new vocabulary forgets every row). ``_counted`` changes in place: ``read`` holds it."""
        mask = torch.zeros(rows, vocab, dtype=torch.bool, device=self.device)
        counts = torch.zeros(rows, vocab, dtype=torch.float32, device=self.device)
        if vocab == self._mask.shape[1]:
            kept = self._mask.shape[0]
            mask[:kept] = self._mask
            counts[:kept] = self._counts
            self._counted += [0] * (rows - kept)
        else:
            self._row.clear()
            self._counted[:] = [0] * rows
        self._mask, self._counts = mask, counts
        taken = set(self._row.values())
        self._free = [r for r in range(rows - 1, -1, -1) if r not in taken]
