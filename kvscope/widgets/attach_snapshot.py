"""What the attach views show, computed from an :class:`~kvscope.attach.attached.Attached`'s tables.

Plain functions of the public tables (``blocks``, ``overlap()``, ``faults``), so the views read
what the notebook reads and tests can check the numbers without a browser. The metric timeline
follows ``src.metrics`` row by row instead (:mod:`kvscope.widgets.metric_bins`).
"""
from __future__ import annotations

from typing import Any, Callable

import pandas as pd

# The dashboard views a vLLM source cannot fill, and why (its events name blocks by hash only).
NEEDS_BLOCK_IDS: dict[str, str] = {
    "pool": "the block pool needs physical block ids and refcounts",
    "tables": "block tables need each request's physical block ids",
    "slots": "the slot mapping needs physical block ids and token positions",
    "queues": "per-request queues need request ids (the timeline has vLLM's queue lengths)",
}


def _hash_text(h: Any) -> str:
    return h.hex() if isinstance(h, (bytes, bytearray)) else str(h)


def forest_state(attached: Any, decode: Callable[[list[int]], str] | None = None,
                 max_nodes: int = 5000) -> dict[str, Any]:
    """Per instance, its held blocks as an icicle of prefix chains.

    Each node is ``[hash, depth, offset, size, num_instances, tokens, text]``: ``size`` counts the
    blocks that share this block's prefix (itself and every block below it), ``offset`` places it
    inside its parent's span, and ``num_instances`` says how many instances hold the same hash.
    An instance with more than ``max_nodes`` blocks is drawn down to the depth that fits.
    """
    blocks, overlap = attached.blocks, attached.overlap()
    holders = dict(zip(overlap.block_hash, overlap.num_instances))
    out = []
    for name in attached.instances:
        rows = _rows_of(blocks, attached, name)
        nodes, height = _icicle(rows, holders, decode, max_nodes)
        out.append({"instance": name, "num_blocks": len(rows), "height": height, "nodes": nodes})
    return {"instances": out}


def _rows_of(blocks: pd.DataFrame, attached: Any, name: str) -> pd.DataFrame:
    stream = next(s for s in attached.streams if s.name == name)
    return blocks[(blocks.instance == stream.instance) & (blocks.data_parallel_rank == stream.data_parallel_rank)]


def _icicle(rows: pd.DataFrame, holders: dict, decode: Callable | None, max_nodes: int) -> tuple[list[list], int]:
    """The nodes in preorder and the height of the whole forest in blocks."""
    hashes = rows.block_hash.tolist()
    held = set(hashes)
    tokens_of = dict(zip(hashes, rows.token_ids))
    children: dict[Any, list[Any]] = {}
    for h, parent, depth in zip(hashes, rows.parent_block_hash, rows.depth):
        # An evicted parent makes a root here, and so does the block the blocks table gave
        # depth 0 in a loop of parents (a malformed stream), which would otherwise hang from
        # nothing drawn.
        is_root = parent is None or parent not in held or depth == 0
        children.setdefault(None if is_root else parent, []).append(h)
    order: list[tuple[Any, int, Any]] = []  # preorder (hash, depth, parent), iteratively: chains run deep
    stack = [(h, 0, None) for h in reversed(children.get(None, []))]
    seen: set[Any] = set()
    while stack:
        h, d, parent = stack.pop()
        if h not in seen:
            seen.add(h)
            order.append((h, d, parent))
            stack.extend((c, d + 1, h) for c in reversed(children.get(h, [])))
    size: dict[Any, int] = {}
    for h, _, _ in reversed(order):
        size[h] = 1 + sum(size.get(c, 0) for c in children.get(h, ()))
    depths = sorted(d for _, d, _ in order)
    limit = depths[max_nodes] if len(order) > max_nodes else len(order) + 1  # draw down to the depth that fits
    cursor: dict[Any, int] = {None: 0}
    nodes = []
    for h, d, parent in order:
        start = cursor[parent]
        cursor[parent], cursor[h] = start + size[h], start + 1
        if d < limit:
            tokens = list(tokens_of[h]) if tokens_of[h] is not None else []
            nodes.append([_hash_text(h), d, start, size[h], int(holders.get(h, 1)), tokens,
                          decode(tokens) if decode is not None and tokens else ""])
    return nodes, cursor[None]


def overlap_state(attached: Any, top: int = 50) -> dict[str, Any]:
    """The overlap matrix, the duplication totals and the deepest prefixes held by several instances."""
    m = attached.overlap_matrix()
    ov = attached.overlap()
    shared = ov[ov.num_instances > 1]
    depth = dict(zip(attached.blocks.block_hash, attached.blocks.depth))
    shared = shared.assign(depth=[int(depth.get(h, 0)) for h in shared.block_hash]) \
        .sort_values(["num_instances", "depth"], ascending=False).head(top)
    return {
        "instances": list(m.index),
        "matrix": m.to_numpy().tolist(),
        "duplication": attached.duplication(),
        "shared": [[_hash_text(h), int(d), int(n), list(i)]
                   for h, d, n, i in zip(shared.block_hash, shared.depth, shared.num_instances, shared.instances)],
    }


def faults_state(attached: Any) -> list[dict[str, Any]]:
    """One dict per publisher: its name and every fault counter."""
    f = attached.faults
    names = attached.instances
    return [{"instance": name, **{k: int(v) for k, v in row.items() if k not in ("instance", "data_parallel_rank")}}
            for name, (_, row) in zip(names, f.iterrows())]

