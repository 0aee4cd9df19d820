"""vLLM's KV-event wire format: multipart ZMQ frames around a msgpack ``KVEventBatch``.

Matched against ``vllm/distributed/kv_events.py`` (docs/ATTACH.md names the version). A frame is
``[topic, seq (8 bytes, big-endian), payload]``; the payload is a msgspec-encoded
``KVEventBatch(ts, events, data_parallel_rank)`` whose events are tagged structs
``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``. Current vLLM encodes each struct as a
map (``{"type": "BlockStored", "block_hashes": ...}``); releases before vLLM PR #42892 used
``array_like=True``: ``["BlockStored", block_hashes, ...]`` in field order, trailing fields with
their default left out. Both decode here into one row tuple per event (:data:`EVENT_FIELDS`).
"""
from __future__ import annotations

from typing import Any, NamedTuple

from kvscope.attach._deps import require

END_SEQ = -1  # the replay socket's last reply carries this sequence number

# Field order of vLLM's structs (the array-like encoding is positional, so order is the contract).
STORED_FIELDS: tuple[str, ...] = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
    "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
)
REMOVED_FIELDS: tuple[str, ...] = ("block_hashes", "medium", "group_idx")
TAGS: tuple[str, ...] = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
# One decoded event, whatever its tag (fields it lacks are None).
EVENT_FIELDS: tuple[str, ...] = (
    "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "group_idx", "extra_keys",
)


class WireError(ValueError):
    """A frame or payload that does not follow vLLM's format; ``kind`` names the fault counter."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Batch(NamedTuple):
    ts: float
    events: list[tuple]          # rows of EVENT_FIELDS
    data_parallel_rank: int | None
    unknown_tags: int            # events skipped because their tag is not one of TAGS


def split_frames(frames: list[bytes]) -> tuple[bytes, int, bytes]:
    """``(topic, seq, payload)`` of one PUB message, or ``WireError("missing_frames")``."""
    if len(frames) != 3:
        raise WireError("missing_frames", f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    topic, seq, payload = frames
    if len(seq) != 8:
        raise WireError("missing_frames", f"the sequence frame must be 8 bytes, got {len(seq)}")
    return bytes(topic), int.from_bytes(seq, "big", signed=True), bytes(payload)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


class Codec:
    """Encodes and decodes batch payloads (one msgspec encoder and decoder, reused)."""

    def __init__(self) -> None:
        msgspec = require("msgspec")
        self._decode = msgspec.msgpack.Decoder().decode
        self._encode = msgspec.msgpack.Encoder().encode
        self._error = msgspec.DecodeError

    def decode(self, payload: bytes) -> Batch:
        """A payload in either encoding; ``WireError("bad_msgpack")`` if it is not one."""
        try:
            raw = self._decode(payload)
        except self._error as exc:
            raise WireError("bad_msgpack", f"payload is not msgpack: {exc}") from None
        if isinstance(raw, dict):
            ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
        elif isinstance(raw, list) and len(raw) >= 2:
            ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
        else:
            raise WireError("bad_msgpack", f"payload is not a KVEventBatch: {type(raw).__name__}")
        if not isinstance(ts, (int, float)) or not isinstance(events, list):
            raise WireError("bad_msgpack", "KVEventBatch needs a numeric ts and a list of events")
        rows, unknown = [], 0
        for ev in events:
            row = _event_row(ev)
            if row is None:
                unknown += 1
            else:
                rows.append(row)
        return Batch(float(ts), rows, rank, unknown)

    def encode(self, ts: float, events: list[dict[str, Any]], data_parallel_rank: int | None) -> bytes:
        """A map-encoded ``KVEventBatch`` (the current vLLM encoding) of events made by :func:`stored` etc."""
        batch: dict[str, Any] = {"ts": ts, "events": events}
        if data_parallel_rank is not None:  # omit_defaults
            batch["data_parallel_rank"] = data_parallel_rank
        return self._encode(batch)


def stored(block_hashes: list, parent_block_hash: Any, token_ids: list[int], block_size: int,
           lora_id: int | None = None, medium: str | None = None, lora_name: str | None = None) -> dict:
    """A ``BlockStored`` as vLLM's map encoding writes it: every field without a default, in order."""
    return {"type": "BlockStored", "block_hashes": block_hashes, "parent_block_hash": parent_block_hash,
            "token_ids": token_ids, "block_size": block_size, "lora_id": lora_id, "medium": medium,
            "lora_name": lora_name}


def removed(block_hashes: list, medium: str | None = None) -> dict:
    return {"type": "BlockRemoved", "block_hashes": block_hashes, "medium": medium}


def cleared() -> dict:
    return {"type": "AllBlocksCleared"}


def _event_row(ev: Any) -> tuple | None:
    """One event of either encoding as a row of EVENT_FIELDS; None for an unknown tag or shape."""
    if isinstance(ev, dict):
        tag, get = ev.get("type"), ev.get
    elif isinstance(ev, list) and ev:
        tag = ev[0]
        fields = STORED_FIELDS if tag == "BlockStored" else REMOVED_FIELDS if tag == "BlockRemoved" else ()
        values = dict(zip(fields, ev[1:]))
        get = values.get
    else:
        return None
    if tag == "BlockStored":
        hashes, tokens = get("block_hashes"), get("token_ids")
        if not isinstance(hashes, list) or not isinstance(tokens, list):
            return None
        return ("BlockStored", hashes, get("parent_block_hash"), tokens, get("block_size"), get("lora_id"),
                get("medium"), get("lora_name"), get("group_idx"), get("extra_keys"))
    if tag == "BlockRemoved":
        hashes = get("block_hashes")
        if not isinstance(hashes, list):
            return None
        return ("BlockRemoved", hashes, None, None, None, None, get("medium"), None, get("group_idx"), None)
    if tag == "AllBlocksCleared":
        return ("AllBlocksCleared", None, None, None, None, None, None, None, None, None)
    return None
