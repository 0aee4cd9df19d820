"""vLLM's KV-event wire format: multipart ZMQ frames around a msgpack ``KVEventBatch``.

Matched against ``vllm/distributed/kv_events.py`` (docs/ATTACH.md names the version). A frame is
``[topic, seq (8 bytes, big-endian), payload]``; the payload is a msgspec-encoded
``KVEventBatch(ts, events, data_parallel_rank)`` whose events are tagged structs
``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``. Current vLLM encodes each struct as a
map (``{"type": "BlockStored", "block_hashes": ...}``); releases before vLLM PR #42892 used
``array_like=True``: ``["BlockStored", block_hashes, ...]`` in field order, trailing fields with
their default left out. Both decode here into the same structs; tables show them as rows of :data:`EVENT_FIELDS`.
"""

import functools
import types
from typing import Annotated, Any, NamedTuple, Union

from kvscope.attach._deps import require

END_SEQ = -1  # the replay socket's last reply carries this sequence number
INT64_MAX = 2**63 - 1  # the tables hold sizes, ids and ranks as int64

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
    events: list                 # decoded events (:func:`event_structs` types), in order
    data_parallel_rank: int | None
    unknown_tags: int            # events skipped because their tag is not one of TAGS


def split_frames(frames: list[bytes]) -> tuple[bytes, int, bytes]:
    """``(topic, seq, payload)`` of one PUB message, or ``WireError("missing_frames")`` (a sequence
    number below 0 too: taken as a restart, it would clear the cache)."""
    if len(frames) != 3:
        raise WireError("missing_frames", f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    topic, seq, payload = frames
    if len(seq) != 8:
        raise WireError("missing_frames", f"the sequence frame must be 8 bytes, got {len(seq)}")
    number = int.from_bytes(seq, "big", signed=True)
    if not 0 <= number < INT64_MAX:  # publishers count from 0; the next one expected must fit 8 bytes too
        raise WireError("missing_frames", f"the sequence number must be in 0..{INT64_MAX - 1}, got {number}")
    return bytes(topic), number, bytes(payload)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


@functools.cache
def event_structs(array_like: bool) -> types.SimpleNamespace:
    """msgspec Structs that read vLLM's events in one encoding: every field after ``block_size``
    defaults to None (older releases omit them), and fields vLLM added later are ignored.

    Fields are typed as vLLM declares them (a hash is an int or bytes, ``ExternalBlockHash``), and
    integers bounded to what an int64 column holds: an event that breaks these would otherwise
    reach the cache (an unhashable hash) or the tables (an int they cannot hold) and fail there."""
    msgspec = require("msgspec", "kvscope.attach.wire")
    opts = dict(gc=False, array_like=array_like)
    Hash = Union[int, bytes]
    Count = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]

    class Event(msgspec.Struct, tag=True, **opts):
        pass

    class BlockStored(Event):
        block_hashes: list[Hash]
        parent_block_hash: Hash | None = None
        token_ids: list[int] = []
        block_size: Count | None = None
        lora_id: Count | None = None
        medium: str | None = None
        lora_name: str | None = None
        extra_keys: Any = None
        group_idx: Count | None = None

    class BlockRemoved(Event):
        block_hashes: list[Hash]
        medium: str | None = None
        group_idx: Count | None = None

    class AllBlocksCleared(Event):
        pass

    class KVEventBatch(msgspec.Struct, **opts):
        ts: float
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]
        data_parallel_rank: Count | None = None

    return types.SimpleNamespace(BlockStored=BlockStored, BlockRemoved=BlockRemoved,
                                 AllBlocksCleared=AllBlocksCleared, KVEventBatch=KVEventBatch)


def event_kind(ev: Any) -> str:
    """``"BlockStored"``, ``"BlockRemoved"`` or ``"AllBlocksCleared"``: the struct's tag."""
    return type(ev).__name__


class Codec:
    """Encodes and decodes batch payloads (msgspec encoder and decoders, made once).

    Decoding tries the typed decoder of each encoding (fast: no dict per event); a payload they
    reject (an unknown tag, a field of an unexpected type) is read untyped, event by event, so one
    bad event costs only itself.
    """

    def __init__(self) -> None:
        msgspec = require("msgspec", "kvscope.attach.wire")
        self._typed = [msgspec.msgpack.Decoder(event_structs(a).KVEventBatch).decode for a in (False, True)]
        self._raw = msgspec.msgpack.Decoder().decode
        self._encode = msgspec.msgpack.Encoder().encode
        # msgspec raises RecursionError for a payload nested deeper than it follows
        self._errors = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)
        self._convert = msgspec.convert
        self._structs = event_structs(False)

    def decode(self, payload: bytes) -> Batch:
        """A payload in either encoding; ``WireError("bad_msgpack")`` if it is not one."""
        for decode in self._typed:
            try:
                b = decode(payload)
            except self._errors:
                continue
            return Batch(b.ts, b.events, b.data_parallel_rank, 0)
        return self._decode_untyped(payload)

    def _decode_untyped(self, payload: bytes) -> Batch:
        try:
            raw = self._raw(payload)
        except self._errors as exc:
            raise WireError("bad_msgpack", f"payload is not msgpack: {exc}") from None
        if isinstance(raw, dict):
            ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
        elif isinstance(raw, list) and len(raw) >= 2:
            ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
        else:
            raise WireError("bad_msgpack", f"payload is not a KVEventBatch: {type(raw).__name__}")
        if not isinstance(ts, (int, float)) or not isinstance(events, list):
            raise WireError("bad_msgpack", "KVEventBatch needs a numeric ts and a list of events")
        out = [ev for ev in map(self._event, events) if ev is not None]
        rank_ok = isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank <= INT64_MAX
        return Batch(float(ts), out, rank if rank_ok else None, len(events) - len(out))

    def _event(self, ev: Any) -> Any:
        """One event of either encoding as a struct; None for an unknown tag or a malformed event."""
        if isinstance(ev, dict):
            tag, values = ev.get("type"), {k: v for k, v in ev.items() if k != "type"}
        elif isinstance(ev, list) and ev:
            tag = ev[0]
            fields = STORED_FIELDS if tag == "BlockStored" else REMOVED_FIELDS if tag == "BlockRemoved" else ()
            values = dict(zip(fields, ev[1:]))
        else:
            return None
        if tag not in TAGS:
            return None
        try:  # validated as the typed decoder would: a struct's constructor checks no types
            return self._convert({**values, "type": tag}, getattr(self._structs, tag))
        except self._errors:
            return None

    def encode(self, ts: float, events: list[dict[str, Any]], data_parallel_rank: int | None) -> bytes:
        """A map-encoded ``KVEventBatch`` (the current vLLM encoding) of events made by :func:`stored` etc."""
        batch: dict[str, Any] = {"ts": ts, "events": events}
        if data_parallel_rank is not None:  # omit_defaults
            batch["data_parallel_rank"] = data_parallel_rank
        return self._encode(batch)


def event_row(ev: Any) -> tuple:
    """One decoded event as a row of :data:`EVENT_FIELDS` (fields its tag lacks are None)."""
    kind = type(ev).__name__
    if kind == "BlockStored":
        return (kind, ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size, ev.lora_id, ev.medium,
                ev.lora_name, ev.group_idx, ev.extra_keys)
    if kind == "BlockRemoved":
        return (kind, ev.block_hashes, None, None, None, None, ev.medium, None, ev.group_idx, None)
    return (kind,) + (None,) * (len(EVENT_FIELDS) - 1)


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
