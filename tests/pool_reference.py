"""The numpy reference of the pool view's overview (``poolBuckets`` in ``kvscope/widgets/static/pool.js``)."""
from __future__ import annotations

import numpy as np


def bucket_summary(state: np.ndarray, ref_count: np.ndarray, bucket: int,
                   ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per cell of ``bucket`` blocks (blocks ``ids`` in that order, else the whole pool): the
    highest code (0 free, 1 cached, 2 used, 3 shared) and the number of blocks not free."""
    if ids is not None:
        state, ref_count = state[ids], ref_count[ids]
    code = np.select([state == 2, (state == 1) & (ref_count > 1), state == 1], [1, 3, 2], 0).astype(np.uint8)
    pad = -len(code) % bucket
    cells = np.concatenate([code, np.zeros(pad, np.uint8)]).reshape(-1, bucket)
    return cells.max(axis=1), (cells > 0).sum(axis=1)
