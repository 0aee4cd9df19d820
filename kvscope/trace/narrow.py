"""Integer columns kept in the narrowest dtype that holds their values.

A trace holds a few columns per step for hours of steps; most of their values are small (block
ids of a pool's first blocks, one-byte reference counts, request indices), so each column of
each record picks its own dtype. ``widest`` is the column's contract: a value it cannot hold is
refused with ``OverflowError`` rather than wrapped.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Iterable

import numpy as np

_CANDIDATES = tuple(np.dtype(t) for t in ("u1", "i1", "u2", "i2", "u4", "i4", "u8", "i8"))  # smallest first


@lru_cache(maxsize=None)
def _fitting(widest: np.dtype) -> tuple[tuple[np.dtype, int, int], ...]:
    """The candidates that cast safely to ``widest``, with their ranges."""
    return tuple((dt, int(np.iinfo(dt).min), int(np.iinfo(dt).max)) for dt in _CANDIDATES if np.can_cast(dt, widest))


def narrow_dtype(lo: int, hi: int, widest: np.dtype) -> np.dtype:
    """The smallest integer dtype holding ``lo..hi`` that casts safely to ``widest``."""
    for dt, a, b in _fitting(np.dtype(widest)):
        if a <= lo and hi <= b:
            return dt
    raise OverflowError(f"values {lo}..{hi} do not fit a {np.dtype(widest)} column")


def narrow_values(values: Iterable[int] | np.ndarray, widest: np.dtype) -> np.ndarray:
    """``values`` (a sequence of ints or an integer array) as an array of their narrowest dtype."""
    if isinstance(values, np.ndarray):
        if not len(values):
            return values.astype(_CANDIDATES[0])
        return values.astype(narrow_dtype(int(values.min()), int(values.max()), widest), copy=False)
    values = values if isinstance(values, (list, tuple)) else list(values)
    if not values:
        return np.zeros(0, _CANDIDATES[0])
    return np.array(values, narrow_dtype(min(values), max(values), widest))
