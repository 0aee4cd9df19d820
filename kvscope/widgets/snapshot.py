"""What each view shows at one step, computed from the trace alone.

The live widgets, the replay slider and the static HTML export all call these functions, so
the three always show the same facts, and a test can compare a view with the trace directly.
Every function reads only the public :class:`~kvscope.trace.Trace` API.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

MAX_SLOT_TOKENS = 128  # tokens per request sent to the slot-mapping view (the rest are counted)


def block_tables(trace: Any, step: int) -> dict[str, list[int]]:
    """``{request_id: [physical block of logical block 0, 1, ...]}`` in the trace's row order."""
    df = trace.block_tables(step)
    codes, request_ids = pd.factorize(df["request_id"], sort=False)
    order = np.lexsort((df["logical_block"].to_numpy(), codes))
    blocks = df["physical_block"].to_numpy(np.int64)[order]
    splits = np.flatnonzero(np.diff(codes[order])) + 1
    return {str(r): chunk.tolist() for r, chunk in zip(request_ids, np.split(blocks, splits))}


def pool_state(trace: Any, step: int) -> dict[str, Any]:
    """Traits of :class:`BlockPoolView`: the whole pool as binary arrays plus the block tables."""
    arrays = trace.pool_arrays(step)
    return {
        "step": int(step),
        "block_size": int(trace.block_size),
        "state": np.ascontiguousarray(arrays["state"], dtype=np.uint8).tobytes(),
        "ref_count": np.ascontiguousarray(arrays["ref_count"], dtype=np.int32).tobytes(),
        "tables": block_tables(trace, step),
    }


def tables_state(trace: Any, step: int) -> dict[str, Any]:
    """Traits of :class:`BlockTablesView`: per request its blocks, their refcounts, its tokens."""
    arrays = trace.pool_arrays(step)
    refs, fill = arrays["ref_count"], arrays["num_tokens"]
    rows = [
        {"id": rid, "blocks": blocks, "refs": refs[blocks].tolist(), "num_tokens": int(fill[blocks].sum())}
        for rid, blocks in block_tables(trace, step).items()
    ]
    return {"step": int(step), "rows": rows}


def slots_state(trace: Any, step: int) -> dict[str, Any]:
    """Traits of :class:`SlotMappingView`: the step's tokens grouped by request, prefill or decode."""
    df = trace.slot_mapping(step)
    kinds = scheduled_kinds(trace, step)
    groups = []
    for rid, g in df.groupby("request_id", sort=False):
        g = g.sort_values("position")
        head = g.head(MAX_SLOT_TOKENS)
        tokens = [
            [int(p), int(t), trace.decode([int(t)]), int(s), int(b), int(o)]
            for p, t, s, b, o in zip(head["position"], head["token_id"], head["slot"], head["block_id"], head["offset"])
        ]
        groups.append({"id": str(rid), "kind": kinds.get(str(rid), "prefill"), "num_tokens": len(g), "tokens": tokens})
    return {"step": int(step), "block_size": int(trace.block_size), "groups": groups}


def scheduled_kinds(trace: Any, step: int) -> dict[str, str]:
    """``{request_id: "prefill" | "decode"}`` for the requests scheduled at ``step``."""
    df = trace.scheduled(step)
    return {str(r): ("prefill" if p else "decode") for r, p in zip(df["request_id"], df["is_prefill"])}


def step_row(trace: Any, step: int) -> dict[str, Any]:
    """The ``trace.steps`` row of ``step`` as a dict (empty if the step was not recorded)."""
    steps = trace.steps
    row = steps[steps["step"] == step]
    return row.iloc[0].to_dict() if len(row) else {}


def queues_state(trace: Any, step: int) -> dict[str, Any]:
    """Traits of :class:`QueuesView`: queues after the step, budget use and KV usage."""
    q = trace.queues(step).sort_values(["queue", "position"])
    lanes = {name: g["request_id"].astype(str).tolist() for name, g in q.groupby("queue")}
    row = step_row(trace, step)
    return {
        "step": int(step),
        "queues": {
            "running": lanes.get("running", []),
            "waiting": lanes.get("waiting", []),
            "preempted": lanes.get("preempted", []),
            "finished": lanes.get("finished", []),
            "scheduled_tokens": int(row.get("num_scheduled_tokens", 0)),
            "prefill_tokens": int(row.get("num_prefill_tokens", 0)),
            "decode_tokens": int(row.get("num_decode_tokens", 0)),
            "token_budget": int(row.get("token_budget", 0)),
            "kv_usage": float(row.get("kv_cache_usage_perc", 0.0)),
            "num_blocks": int(trace.num_blocks),
            "used": int(row.get("num_used_blocks", 0)),
            "cached": int(row.get("num_cached_blocks", 0)),
            "num_preemptions": int(row.get("num_preemptions", 0)),
        },
    }


def block_details(trace: Any, step: int, block_ids: list[int]) -> dict[str, dict[str, Any]]:
    """Hover facts of some blocks after ``step``: content hash, tokens, their text, owners."""
    blocks = trace.blocks(step)
    out = {}
    for b in block_ids:
        row = blocks.iloc[int(b)]
        tokens = trace.block_tokens(step, int(b))
        out[str(int(b))] = {
            "hash": None if pd.isna(row["block_hash"]) else f"{int(row['block_hash']):016x}",
            "tokens": tokens, "text": trace.decode(tokens), "owners": [str(o) for o in row["owners"]],
        }
    return out
