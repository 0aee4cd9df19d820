"""Column schemas of the attach tables (the ``kvscope.trace.tables`` conventions: fixed names and
dtypes, strings and hashes as ``object`` since vLLM's hashes may be ints or bytes, lists as lists)."""
from __future__ import annotations

from typing import Any

from kvscope.attach.metrics import METRICS
from kvscope.attach.subscriber import FAULTS

_I, _F, _O, _N = "int64", "float64", object, "Int64"  # _N: nullable integers

SCHEMAS: dict[str, dict[str, Any]] = {
    "events": {
        "instance": _O, "data_parallel_rank": _I, "seq": _I, "ts": _F, "type": _O, "block_hashes": _O,
        "parent_block_hash": _O, "token_ids": _O, "block_size": _N, "lora_id": _N, "medium": _O,
        "lora_name": _O, "group_idx": _N, "extra_keys": _O,
    },
    "blocks": {
        "instance": _O, "data_parallel_rank": _I, "block_hash": _O, "parent_block_hash": _O, "depth": _I,
        "token_ids": _O, "block_size": _N, "medium": _O, "lora_name": _O, "group_idx": _N, "extra_keys": _O,
    },
    "metrics": {"time_s": _F, "instance": _O, "data_parallel_rank": _I, **{c: _F for c in METRICS}},
    "faults": {"instance": _O, "data_parallel_rank": _I, **{f: _I for f in FAULTS}, "unknown_removes": _I,
               "scrape_errors": _I},
    "overlap": {"block_hash": _O, "num_instances": _I, "instances": _O},
}
