"""``Scheduled``: what one step computed, stored as what changed since the step before.

Most rows of a long recording are steady decode rows: a request that had a row in the previous
step computes the one token after it (``start`` = its previous row's end, one new token, no
cache hit, a decode row that samples). Such a row is implied by the previous step's rows and
costs only its token id. Every other row is kept whole (its request as an index into the
records' :class:`~kvscope.trace.event_log.RequestIds`), and so are all the rows of a keyframe,
which every ``KEYFRAME_EVERY``-th step built is: decoding a step reads at most that many steps
back. Token ids are kept in the narrowest dtype that holds them, the implied rows' apart from
the others' (sampled ids span the vocabulary, a prompt's may not).

A ``Scheduled`` reads as columns (``request_ids``, ``start``, ``num_new_tokens``, ...), decoded
on first use; its trace's :class:`RowTable` keeps the last steps decoded, so a replay that walks
the steps in order decodes each once, from the one before. A record whose older steps the ring
buffer dropped keeps their rows reachable back to its keyframe.
"""
from __future__ import annotations

from functools import lru_cache
from operator import attrgetter
from typing import Callable, Container, NamedTuple, Sequence

import numpy as np

from kvscope.trace.event_log import RequestIds
from kvscope.trace.narrow import narrow_values

KEYFRAME_EVERY = 64
_EXPLICIT = np.dtype([("request", np.int32), ("start", np.int32), ("num_new_tokens", np.int32),
                      ("num_cached_tokens", np.int32), ("is_prefill", bool), ("sample", bool)])
_I32 = np.dtype(np.int32)


class Rows(NamedTuple):
    """A step's rows decoded: one entry per scheduled request; ``token_ids`` all rows' tokens
    concatenated. Shared by every reader of the step: read-only."""

    request: np.ndarray            # int32, indices into its table's RequestIds
    request_ids: list[str]
    start: np.ndarray              # int32
    num_new_tokens: np.ndarray     # int32
    num_cached_tokens: np.ndarray  # int32: the prefix-cache hit when the row is an admission
    is_prefill: np.ndarray         # bool: a prefill chunk, else a decode row
    sample: np.ndarray             # bool: the row ends the sequence, so a token is sampled
    token_ids: np.ndarray          # int32


class RowTable:
    """What one trace's scheduled rows share: the request-id table their indices point into,
    and the steps decoded last (per trace, so reading one trace never releases another's)."""

    __slots__ = ("requests", "decoded")

    def __init__(self, requests: RequestIds) -> None:
        self.requests = requests
        # (a replay or a table build reads steps in order: it needs the step before)
        self.decoded: Callable[[Scheduled], Rows] = lru_cache(maxsize=8)(_decode)


def _column(name: str) -> property:
    """A decoded column of :class:`Rows`, read as an attribute."""
    get = attrgetter(name)
    return property(lambda self: get(self.table.decoded(self)), doc=f"The step's ``{name}`` (see :class:`Rows`).")


class Scheduled:
    """What one step computed, as columns (one entry per scheduled request).

    Request ``i`` computes positions ``start[i] .. start[i] + num_new_tokens[i] - 1``; their
    token ids are the ``i``-th run of ``token_ids``. Build one with :meth:`from_columns` or a
    :class:`RowEncoder`.
    """

    __slots__ = ("table", "prev", "keep", "explicit_at", "explicit", "steady_tokens", "explicit_tokens")

    def __init__(self, table: RowTable, prev: "Scheduled | None", keep: np.ndarray | None,
                 explicit_at: np.ndarray | None, explicit: np.ndarray | None,
                 steady_tokens: np.ndarray | None, explicit_tokens: np.ndarray | None) -> None:
        self.table = table
        self.prev = prev                        # the step these rows are told against; None: a keyframe
        self.keep = keep                        # prev's rows that go on steadily, in this step's order; None: all
        self.explicit_at = explicit_at          # where the whole rows sit among this step's; None: none
        self.explicit = explicit                # the whole rows (_EXPLICIT); None: none
        self.steady_tokens = steady_tokens      # one token per implied row
        self.explicit_tokens = explicit_tokens  # the whole rows' tokens

    @classmethod
    def from_columns(cls, table: RowTable, request: np.ndarray, start: np.ndarray, num_new_tokens: np.ndarray,
                     num_cached_tokens: np.ndarray, is_prefill: np.ndarray, sample: np.ndarray,
                     token_ids: np.ndarray) -> "Scheduled":
        """A keyframe of these rows (``request``: indices into ``table.requests``)."""
        rows = np.empty(len(start), _EXPLICIT)
        for name, values in zip(_EXPLICIT.names, (request, start, num_new_tokens, num_cached_tokens, is_prefill, sample)):
            rows[name] = values
        return cls(table, None, None, None, rows, None, narrow_values(np.asarray(token_ids), _I32))

    def rows(self) -> Rows:
        """The decoded columns (cached for the last steps read)."""
        return self.table.decoded(self)

    request_ids = _column("request_ids")
    start = _column("start")
    num_new_tokens = _column("num_new_tokens")
    num_cached_tokens = _column("num_cached_tokens")
    is_prefill = _column("is_prefill")
    sample = _column("sample")
    token_ids = _column("token_ids")

    @property
    def end(self) -> np.ndarray:
        r = self.table.decoded(self)
        return r.start + r.num_new_tokens

    def __len__(self) -> int:
        n = len(self.explicit) if self.explicit is not None else 0
        return n + (len(self.steady_tokens) if self.steady_tokens is not None else 0)

    def __repr__(self) -> str:
        return f"Scheduled({len(self)} rows)"

    def holding(self, tables: Container[str]) -> "Scheduled":
        """The rows whose request is in ``tables`` (itself when all are)."""
        rids = self.request_ids
        if all(map(tables.__contains__, rids)):
            return self
        return self.subset(np.fromiter(map(tables.__contains__, rids), dtype=bool, count=len(rids)))

    def subset(self, keep: np.ndarray) -> "Scheduled":
        """The rows where ``keep`` (bool per row) is true, as a keyframe."""
        r = self.table.decoded(self)
        per_token = np.repeat(keep, r.num_new_tokens)
        return Scheduled.from_columns(
            self.table, r.request[keep], r.start[keep], r.num_new_tokens[keep], r.num_cached_tokens[keep],
            r.is_prefill[keep], r.sample[keep], r.token_ids[per_token],
        )


class RowEncoder:
    """Encodes consecutive steps' rows, each against the step encoded before it.

    ``ident`` tells rows' requests apart across steps (the engine's sequence ids while
    recording, request indices when loading); ``codes(rows)`` gives the request indices of
    the rows at ``rows``, asked only for rows kept whole.
    """

    __slots__ = ("table", "_prev", "_ident", "_end", "_since")

    def __init__(self, table: RowTable) -> None:
        self.table = table
        self._prev: Scheduled | None = None
        self._ident = self._end = np.zeros(0, np.int64)
        self._since = 0  # steps encoded since the last keyframe

    def encode(self, ident: np.ndarray, codes: Callable[[np.ndarray], Sequence[int]], start: np.ndarray,
               num_new_tokens: np.ndarray, num_cached_tokens: np.ndarray, is_prefill: np.ndarray,
               sample: np.ndarray, token_ids: np.ndarray) -> Scheduled:
        prev, n = self._prev, len(ident)
        ident_before, end_before = self._ident, self._end
        self._ident, self._end = ident, start + num_new_tokens
        if prev is None or self._since + 1 >= KEYFRAME_EVERY:
            self._since = 0
            self._prev = Scheduled.from_columns(self.table, codes(np.arange(n)), start, num_new_tokens,
                                                num_cached_tokens, is_prefill, sample, token_ids)
            return self._prev
        self._since += 1
        # Every row one decode token that samples, with no cache hit (most steps): as many tokens as
        # rows, none of them empty. (count_nonzero: the cheapest pass over an array.)
        cnz = np.count_nonzero
        decode = (len(token_ids) == n and cnz(num_new_tokens) == n and cnz(sample) == n
                  and not cnz(is_prefill) and not cnz(num_cached_tokens))
        src = None  # each row's index in the step before; None: the same rows in the same order
        if n == len(ident_before) and not cnz(ident != ident_before):
            steady = start == end_before
        else:  # rows came or went: find each row's request among the previous step's
            src, found = _find(ident_before, ident)
            steady = found & (start == end_before[src]) if len(ident_before) else found
        if not decode:
            steady &= (num_new_tokens == 1) & ~is_prefill & sample & (num_cached_tokens == 0)
        if cnz(steady) == n:  # all rows implied: which of the previous step's go on, and their tokens
            keep = None if src is None or _is_range(src, len(ident_before)) else narrow_values(src, _I32)
            self._prev = Scheduled(self.table, prev, keep, None, None, narrow_values(token_ids, _I32), None)
            return self._prev
        whole = np.flatnonzero(~steady)
        keep = np.flatnonzero(steady) if src is None else src[steady]
        per_token = np.repeat(steady, num_new_tokens)
        rows = np.empty(len(whole), _EXPLICIT)
        for name, values in zip(_EXPLICIT.names, (codes(whole), start[whole], num_new_tokens[whole],
                                                  num_cached_tokens[whole], is_prefill[whole], sample[whole])):
            rows[name] = values
        self._prev = Scheduled(
            self.table, prev, None if _is_range(keep, len(ident_before)) else narrow_values(keep, _I32),
            narrow_values(whole, _I32), rows, narrow_values(token_ids[per_token], _I32),
            narrow_values(token_ids[~per_token], _I32),
        )
        return self._prev


def _find(ident_before: np.ndarray, ident: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each of ``ident``'s index in ``ident_before`` (any where absent), and whether it is there."""
    if not len(ident_before):
        return np.zeros(len(ident), np.int64), np.zeros(len(ident), bool)
    order = np.argsort(ident_before, kind="stable")
    src = order[np.minimum(np.searchsorted(ident_before, ident, sorter=order), len(order) - 1)]
    return src, ident_before[src] == ident


def _is_range(index: np.ndarray, n: int) -> bool:
    """Whether ``index`` is ``0 .. n-1``: every row of the step before, in order."""
    return len(index) == n and bool((index == np.arange(n)).all())


def _decode(s: Scheduled) -> Rows:
    """``s``'s columns, from its whole rows and the previous step's (decoded first)."""
    names = s.table.requests.names
    if s.prev is None:
        ex = s.explicit
        request = np.ascontiguousarray(ex["request"])
        return Rows(request, list(map(names.__getitem__, request.tolist())),
                    *(np.ascontiguousarray(ex[c]) for c in _EXPLICIT.names[1:]), s.explicit_tokens.astype(np.int32))
    before = s.table.decoded(s.prev)
    end = before.start + before.num_new_tokens
    keep = s.keep
    if keep is None:
        request, start = before.request, end
    else:
        request, start = before.request[keep], end[keep]
    if s.explicit is None:
        m = len(request)
        ids = before.request_ids if keep is None else list(map(names.__getitem__, request.tolist()))
        tokens = s.steady_tokens.astype(np.int32, copy=False)  # (the stored array itself when int32)
        tokens.flags.writeable = False
        return Rows(request, ids, start, *_steady_columns(m), tokens)
    ex, at = s.explicit, s.explicit_at
    rows = len(request) + len(ex)
    whole = np.zeros(rows, bool)
    whole[at] = True
    cols = []
    for name, steady_value in zip(_EXPLICIT.names, (request, start, 1, 0, False, True)):
        col = np.empty(rows, _EXPLICIT[name])
        col[~whole] = steady_value
        col[whole] = ex[name]
        cols.append(col)
    tokens = np.empty(int(cols[2].sum()), np.int32)
    per_token = np.repeat(whole, cols[2])
    tokens[~per_token] = s.steady_tokens
    tokens[per_token] = s.explicit_tokens
    return Rows(cols[0], list(map(names.__getitem__, cols[0].tolist())), *cols[1:], tokens)


_STEADY_VALUES = ((1, np.int32), (0, np.int32), (False, bool), (True, bool))
_STEADY = [np.zeros(0, t) for _, t in _STEADY_VALUES]


def _steady_columns(n: int) -> list[np.ndarray]:
    """``num_new_tokens``, ``num_cached_tokens``, ``is_prefill`` and ``sample`` of ``n`` steady
    rows: read-only views of arrays shared by every step (grown, never shrunk)."""
    if len(_STEADY[0]) < n:
        size = max(n, 2 * len(_STEADY[0]), 1024)
        _STEADY[:] = [np.full(size, v, t) for v, t in _STEADY_VALUES]
        for a in _STEADY:
            a.flags.writeable = False
    return [a[:n] for a in _STEADY]
