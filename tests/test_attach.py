"""kvscope.attach against real loopback sockets: vLLM's encodings, gap recovery, faults, overlap, metrics."""

import socket
import sys
import threading
import time
import types

import pytest

msgspec = pytest.importorskip("msgspec")
pytest.importorskip("zmq")
pd = pytest.importorskip("pandas")

import zmq  # noqa: E402
from attach_helpers import (applied, attach_to, free_port, metrics_server, mute_and_good, probed,  # noqa: E402
                            publisher, raw_stream, wait_for)

import kvscope  # noqa: E402
from kvscope.attach import MIN_MESSAGE_BYTES, MIN_METRICS_INTERVAL  # noqa: E402
from kvscope.attach.metrics import METRICS, parse_metrics  # noqa: E402
from kvscope.attach.wire import EVENT_FIELDS, Codec, WireError, cleared, event_row, removed, seq_bytes, stored  # noqa: E402


# --- vLLM's structs, written out from vllm/distributed/kv_events.py (see docs/ATTACH.md), in both encodings.
def vllm_structs(array_like: bool, fields: str) -> types.SimpleNamespace:
    """vLLM's KVEventBatch family; ``fields``: "v0.9" (up to ``medium``) or "current" (every field)."""
    opts = dict(omit_defaults=True, gc=False, array_like=array_like)

    class EventBatch(msgspec.Struct, **opts):
        ts: float
        events: list
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, tag=True, **opts):
        pass

    if fields == "v0.9":
        class BlockStored(KVCacheEvent):
            block_hashes: list[int]
            parent_block_hash: int | None
            token_ids: list[int]
            block_size: int
            lora_id: int | None
            medium: str | None

        class BlockRemoved(KVCacheEvent):
            block_hashes: list[int]
            medium: str | None
    else:
        class BlockStored(KVCacheEvent):
            block_hashes: list[int | bytes]
            parent_block_hash: int | bytes | None
            token_ids: list[int]
            block_size: int
            lora_id: int | None
            medium: str | None
            lora_name: str | None
            extra_keys: list | None = None
            group_idx: int | None = None
            kv_cache_spec_kind: str | None = None
            kv_cache_spec_sliding_window: int | None = None

        class BlockRemoved(KVCacheEvent):
            block_hashes: list[int | bytes]
            medium: str | None
            group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return types.SimpleNamespace(**{c.__name__: c for c in (KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared)})


def sample_events(v: types.SimpleNamespace, current: bool) -> list:
    extra = dict(lora_name="adapter-a", extra_keys=[("img", 7), None], group_idx=1) if current else {}
    return [
        v.BlockStored([11, 12], None, list(range(8)), 4, None, "GPU", **extra),
        v.BlockStored([13], 12, [8, 9, 10, 11], 4, 3, None, **({"lora_name": None} if current else {})),
        v.BlockRemoved([11], "GPU", **({"group_idx": 1} if current else {})),
        v.AllBlocksCleared(),
    ]


def expected_row(ev) -> tuple:
    """What one event of vLLM's schema should decode to, read field by field from the struct."""
    kind = type(ev).__name__
    get = lambda name: getattr(ev, name, None)  # noqa: E731
    if kind == "AllBlocksCleared":
        return (kind,) + (None,) * (len(EVENT_FIELDS) - 1)
    if kind == "BlockRemoved":
        return (kind, ev.block_hashes, None, None, None, None, ev.medium, None, get("group_idx"), None)
    return (kind, ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size, ev.lora_id, ev.medium,
            get("lora_name"), get("group_idx"), get("extra_keys"))


@pytest.mark.parametrize("array_like", [False, True], ids=["map", "array_like"])
@pytest.mark.parametrize("fields", ["v0.9", "current"])
def test_decodes_vllm_encodings_exactly(array_like, fields):
    v = vllm_structs(array_like, fields)
    events = sample_events(v, fields == "current")
    for rank in (None, 3):
        payload = msgspec.msgpack.encode(v.KVEventBatch(ts=12.5, events=events, data_parallel_rank=rank))
        raw = msgspec.msgpack.decode(payload)
        assert isinstance(raw, list if array_like else dict)  # the fixture really has this encoding
        batch = Codec().decode(payload)
        assert (batch.ts, batch.data_parallel_rank, batch.unknown_tags) == (12.5, rank, 0)
        got = [event_row(ev) for ev in batch.events]
        want = [expected_row(ev) for ev in events]
        want = [tuple([list(k) if isinstance(k, tuple) else k for k in x] if isinstance(x, list) and n == 9 else x
                      for n, x in enumerate(row)) for row in want]
        assert got == want


def test_kvscope_encoding_is_what_vllms_own_decoder_reads():
    """A consumer built on vLLM's structs (typed, strict) reads kvscope's payloads."""
    v = vllm_structs(False, "current")
    payload = Codec().encode(3.0, [stored([5, 6], 4, [1, 2, 3, 4], 2, medium="GPU"), removed([5]), cleared()], 2)
    batch = msgspec.msgpack.Decoder(v.KVEventBatch).decode(payload)
    assert batch.data_parallel_rank == 2 and batch.ts == 3.0
    assert batch.events == [v.BlockStored([5, 6], 4, [1, 2, 3, 4], 2, None, "GPU", None),
                            v.BlockRemoved([5], None), v.AllBlocksCleared()]


def test_malformed_payloads_are_wire_errors():
    codec = Codec()
    for bad in (b"\xc1", msgspec.msgpack.encode(42), msgspec.msgpack.encode({"ts": "x", "events": []})):
        with pytest.raises(WireError) as err:
            codec.decode(bad)
        assert err.value.kind == "bad_msgpack"
    batch = codec.decode(msgspec.msgpack.encode({"ts": 1.0, "events": [{"type": "BlockMoved"}, ["Nope", 1]]}))
    assert batch.unknown_tags == 2 and batch.events == []


# ----------------------------------------------------------------------------- faults
def test_faults_are_counted_not_raised():
    """Bad msgpack, an unknown tag and missing frames are each counted; good batches around them apply."""
    with raw_stream() as (raw, att):
        good = Codec().encode(1.0, [stored([1], None, [1, 2], 2), {"type": "BlockMoved", "x": 1}], 0)
        for frames in ([b"kv-events", seq_bytes(1), b"\xc1"],           # bad msgpack
                       [b"kv-events", seq_bytes(2), good],              # one unknown tag, one good event
                       [b"kv-events", good],                            # missing frames
                       [b"kv-events", b"\x00\x01", good]):              # a short sequence frame
            raw.send_multipart(frames)
        name = att.instances[0]
        wait_for(applied(att, name, 2), what="batch 2")
        wait_for(lambda: att.faults.missing_frames.iloc[0] == 2, what="missing frames counted")
        f = att.faults.iloc[0]
        assert (f.bad_msgpack, f.unknown_tag, f.missing_frames, f.gaps) == (1, 1, 2, 0)
        assert att.block_hashes(name) == {1}


def test_a_removal_of_a_block_never_stored_is_counted():
    """A BlockRemoved of a hash the cache never held (its store came before the consumer joined,
    or was lost) is counted in src.faults; removing a held one is not."""
    with raw_stream() as (raw, att):
        for seq, events in enumerate([[stored([1, 2], None, [1, 2, 3, 4], 2)], [removed([1, 99])], [removed([98])]],
                                     start=1):
            raw.send_multipart([b"kv-events", seq_bytes(seq), Codec().encode(1.0, events, 0)])
        name = att.instances[0]
        wait_for(applied(att, name, 3), what="batch 3")
        assert att.block_hashes(name) == {2}
        assert att.faults.unknown_removes.tolist() == [2]


def test_events_with_fields_of_the_wrong_type_are_skipped_not_applied():
    """Each batch holds one good BlockStored and one event whose field breaks vLLM's types: the bad
    one is counted and skipped, and the thread lives on to apply every good one and every later batch."""
    base = {"type": "BlockStored", "block_hashes": [0], "parent_block_hash": None, "token_ids": [1, 2],
            "block_size": 2}
    bad = [{"block_hashes": [[1, 2]]}, {"block_hashes": [{"a": 1}]}, {"parent_block_hash": [3]},
           {"medium": ["GPU"]}, {"group_idx": {"g": 1}}, {"block_size": "2"}, {"lora_id": "x"},
           {"block_size": 2**64 - 1}, {"token_ids": "ab"}]
    with raw_stream() as (raw, att):
        for seq, fields in enumerate(bad, start=1):
            good = dict(base, block_hashes=[1000 + seq])
            raw.send_multipart([b"kv-events", seq_bytes(seq), msgspec.msgpack.encode(
                {"ts": 1.0, "events": [dict(base, **fields), good]})])
        last = len(bad) + 1
        raw.send_multipart([b"kv-events", seq_bytes(last), Codec().encode(2.0, [removed([1001])], 0)])
        name = att.instances[0]
        wait_for(applied(att, name, last), what="the batch after the malformed ones")
        want = {1000 + seq for seq in range(2, len(bad) + 1)}
        assert att.block_hashes(name) == want
        assert att.faults.unknown_tag.iloc[0] == len(bad)
        assert set(att.blocks.block_hash) == want and all(t == [1, 2] for t in att.blocks.token_ids)
        assert att.events.type.tolist() == ["BlockStored"] * len(bad) + ["BlockRemoved"]


def big_batch(hash_: int) -> list:
    """One BlockStored whose token ids alone take about 16 KiB: over a 4 KiB message limit."""
    return [stored([hash_], None, list(range(1000, 9000)), 8000)]


def test_a_live_message_over_max_message_bytes_is_refused_and_counted():
    """A batch over max_message_bytes is refused unread and counted; the connection ZMQ gives up on
    is made again, and the batches published meanwhile come back through replay: every seq the
    publisher numbered is applied except the big one."""
    with publisher() as pub:
        att = attach_to(pub, max_message_bytes=4096)
        try:
            wait_for(applied(att, "p0", pub.publish([stored([0], None, [1, 2], 2)])), what="batch 0")
            big = pub.publish(big_batch(666))
            for i in range(1, 5):
                last = pub.publish([stored([i], None, [1, 2], 2)])
            wait_for(applied(att, "p0", last), timeout=10, what="the batches after the big one")
            wait_for(applied(att, "p0", last := pub.publish([stored([5], None, [1, 2], 2)])), timeout=5,
                     what="a live batch after the recovery")
            assert att.block_hashes("p0") == {0, 1, 2, 3, 4, 5}
            assert att.events.seq.tolist() == [q for q in range(last + 1) if q != big]
            f = att.faults.iloc[0]
            assert (f.oversize_messages, f.lost_batches, f.bad_msgpack, f.reconnects) == (1, 1, 0, 0)
        finally:
            att.close()


def test_without_replay_a_message_over_max_message_bytes_loses_little_and_says_so():
    """With no replay socket, what the publisher sends while the refused connection is made again
    is lost for good. It is made again as soon as ZMQ's silence says it will not (ZMQ's own retry
    follows any other drop at once), so of 25 batches sent 20 ms apart after the big one, only the
    first few are lost; every one not applied is counted lost, and the big one too."""
    with publisher(replay_endpoint=None) as pub:
        att = attach_to(pub, max_message_bytes=4096)
        try:
            wait_for(applied(att, "p0", pub.publish([stored([0], None, [1, 2], 2)])), what="batch 0")
            big = pub.publish(big_batch(666))
            for i in range(1, 26):
                pub.publish([stored([i], None, [1, 2], 2)])
                time.sleep(0.02)
            wait_for(lambda: att.faults.oversize_messages.iloc[0] == 1, what="the refusal")
            wait_for(applied(att, "p0", pub.publish([stored([26], None, [1, 2], 2)])), what="the batch after them")
            held = att.block_hashes("p0")
            lost = set(range(27)) - held  # block i > 0 went out as batch big + i
            assert lost == set(range(1, len(lost) + 1)) and len(lost) <= 8
            assert att.events.seq.tolist() == [0] + [big + i for i in sorted(held - {0})]
            assert att.faults.lost_batches.iloc[0] == len(lost) + 1  # and the big one
        finally:
            att.close()


def test_a_replayed_batch_over_max_message_bytes_is_skipped_not_a_stuck_replay():
    """A subscriber joins after batches 0..3, of which 1 is over the limit: replay brings the others,
    skips the big one (lost), and the live batches after it apply."""
    with publisher() as pub:
        pub.publish([stored([0], None, [1, 2], 2)])
        big = pub.publish(big_batch(666))
        pub.publish([stored([2], None, [1, 2], 2)])
        pub.publish([stored([3], None, [1, 2], 2)])
        att = attach_to(pub, max_message_bytes=4096)
        try:
            for i in (4, 5):
                wait_for(applied(att, "p0", last := pub.publish([stored([i], None, [1, 2], 2)])), timeout=10,
                         what=f"live batch {i}")
            assert att.block_hashes("p0") == {0, 2, 3, 4, 5}
            assert att.events.seq.tolist() == [q for q in range(last + 1) if q != big]
            f = att.faults.iloc[0]
            assert (f.replayed_batches, f.lost_batches, f.oversize_messages) == (3, 1, 0)
        finally:
            att.close()


def test_a_join_whose_replay_starts_with_a_batch_over_max_message_bytes_skips_it_at_once():
    """A subscriber joins a publisher that keeps its last 20 batches, the first of which is over
    the limit: the join's answer (asked from 0) drops before any reply, at a number it cannot see.
    It finds that batch quickly, counts it lost, and replays every other batch the publisher keeps."""
    keep, n = 20, 200
    big = n - keep + 1  # the head of the buffer once the live batch n is published
    with publisher(buffer_steps=keep) as pub:
        for i in range(n):
            pub.publish(big_batch(666) if i == big else [stored([i], None, [1, 2], 2)])
        att = attach_to(pub, max_message_bytes=4096, replay_timeout=5.0)
        try:
            start = time.monotonic()
            live = pub.publish([stored([n], None, [1, 2], 2)])
            kept = [seq for seq, _ in pub._buffer]
            wait_for(applied(att, "p0", live), timeout=10, what="the live batch after the join")
            assert time.monotonic() - start < 2.0
            assert kept[0] == big and att.events.seq.tolist() == kept[1:]
            assert att.block_hashes("p0") == set(kept[1:])
            f = att.faults.iloc[0]
            assert (f.replayed_batches, f.lost_batches) == (keep - 2, 1)
        finally:
            att.close()


def test_a_replay_dropped_past_its_gap_returns_at_once():
    """Batches 1 and 2 are lost live; live 3 asks replay for them, whose answer goes on to batch 4,
    over the limit. The gap was filled before the drop: batch 3 applies at once, not after the
    replay timeout, and nothing is counted lost."""
    with publisher() as pub:
        att = attach_to(pub, max_message_bytes=4096, replay_timeout=5.0)
        try:
            wait_for(applied(att, "p0", pub.publish([stored([0], None, [1, 2], 2)])), what="batch 0")
            real, pub._pub = pub._pub, types.SimpleNamespace(send_multipart=lambda frames: None)
            pub.publish([stored([1], None, [1, 2], 2)])
            pub.publish([stored([2], None, [1, 2], 2)])
            pub._pub = real
            start = time.monotonic()
            live = pub.publish([stored([3], None, [1, 2], 2)])
            pub.publish(big_batch(666))
            wait_for(applied(att, "p0", live), timeout=10, what="the live batch after the gap")
            assert time.monotonic() - start < 2.5
            assert att.block_hashes("p0") == {0, 1, 2, 3} and att.faults.lost_batches.iloc[0] == 0
        finally:
            att.close()


def test_a_payload_nested_too_deep_is_bad_msgpack():
    """A payload of arrays nested past msgspec's depth limit is one bad batch; the next one applies."""
    with raw_stream() as (raw, att):
        deep = b"\x91" * 100_000 + b"\xc0"  # [[[... None ...]]]
        raw.send_multipart([b"kv-events", seq_bytes(1), deep])
        raw.send_multipart([b"kv-events", seq_bytes(2), Codec().encode(1.0, [stored([5], None, [1, 2], 2)], 0)])
        name = att.instances[0]
        wait_for(applied(att, name, 2), timeout=5, what="the batch after the deep one")
        assert att.block_hashes(name) == {5} and att.faults.bad_msgpack.iloc[0] == 1


def test_sequence_numbers_out_of_range_are_skipped():
    """A negative sequence number is not a restart, and the largest one does not overflow the
    idle probe's request: both are malformed messages. Two jumps of nearly 2**63 saturate the counter."""
    with publisher() as pub:
        att = attach_to(pub)
        try:
            pub.publish([stored([1], None, [1, 2], 2)])
            wait_for(applied(att, "p0", 0))
            hostile = Codec().encode(1.0, [stored([66], None, [1, 2], 2)], 0)
            for seq in (-1, -2**63, 2**63 - 1):
                pub._pub.send_multipart([b"kv-events", seq_bytes(seq), hostile])
            wait_for(lambda: att.faults.missing_frames.iloc[0] == 3, what="three malformed messages")
            time.sleep(1.2)  # past the idle probe, which asks replay for what follows the last batch
            last = pub.publish([stored([2], 1, [3, 4], 2)])
            wait_for(applied(att, "p0", last), timeout=5, what="the batch after them")
            assert att.block_hashes("p0") == {1, 2}
            f = att.faults.iloc[0]
            assert (f.publisher_restarts, f.gaps, f.missed_batches) == (0, 0, 0)
            for seq in (2**63 - 2, 0, 2**63 - 2):  # jump, restart, jump
                pub._pub.send_multipart([b"kv-events", seq_bytes(seq), hostile])
            wait_for(lambda: att.streams[0].faults["gaps"] == 2, what="two jumps")
            assert att.faults.missed_batches.iloc[0] == 2**63 - 1
        finally:
            att.close()


def test_a_topic_that_only_starts_with_ours_is_another_stream():
    """One socket publishes "kv-events" and "kv-events-b", each numbered from 0: only the first is ours."""
    with raw_stream() as (raw, att):
        for i in range(1, 6):
            raw.send_multipart([b"kv-events", seq_bytes(i), Codec().encode(1.0, [stored([i], None, [1], 1)], 0)])
            raw.send_multipart([b"kv-events-b", seq_bytes(i - 1),
                                Codec().encode(1.0, [stored([100 + i], None, [1], 1)], 0)])
        raw.send_multipart([b"kv-events", seq_bytes(6), Codec().encode(1.0, [], 0)])
        name = att.instances[0]
        wait_for(applied(att, name, 6), timeout=5)
        assert att.block_hashes(name) == {1, 2, 3, 4, 5} and att.faults.gaps.iloc[0] == 0


def test_close_while_a_replay_waits_twice_and_from_a_listener():
    """close() does not wait out a pending replay, leaves no thread using the sockets it closed,
    may be called again, and works from a listener (in the subscriber thread)."""
    ctx = zmq.Context.instance()
    raw, mute = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)  # the replay socket takes requests, never answers
    port, replay_port = raw.bind_to_random_port("tcp://127.0.0.1"), mute.bind_to_random_port("tcp://127.0.0.1")
    att = kvscope.attach(f"tcp://127.0.0.1:{port}", topic="kv-events", replay_timeout=5.0,
                         replay_endpoints=f"tcp://127.0.0.1:{replay_port}")
    try:
        wait_for(lambda: probed(raw, att), what="subscription")
        raw.send_multipart([b"kv-events", seq_bytes(2), Codec().encode(1.0, [], 0)])  # 1 is missing
        assert mute.poll(5000), "the replay request"
        assert mute.recv_multipart()[2] == seq_bytes(1)
        start = time.monotonic()
        att.close()
        assert time.monotonic() - start < 1.0 and not att._subscriber._thread.is_alive()
        att.close()
    finally:
        att.close()
        raw.close(linger=0)
        mute.close(linger=0)
    with publisher() as pub:
        att = attach_to(pub)
        errors = []

        def close_here(name, seq):
            try:
                att.close()
            except Exception as exc:  # noqa: BLE001 - the test reports it
                errors.append(exc)

        att.add_listener(close_here)
        pub.publish([stored([1], None, [1, 2], 2)])
        wait_for(lambda: not att._subscriber._thread.is_alive(), timeout=5, what="the thread to end")
        assert errors == [] and att.block_hashes("p0") == {1}


def test_close_does_not_wait_for_a_listener_longer_than_its_bound():
    """A listener that would take 10 s holds close() a bounded while, not as long
    as the replay timeout allows; the subscriber thread closes its sockets once the listener returns."""
    with publisher() as pub:
        att = attach_to(pub, replay_timeout=60.0)
        busy, release = threading.Event(), threading.Event()
        att.add_listener(lambda name, seq: busy.set() or release.wait(10.0))
        try:
            pub.publish([stored([1], None, [1, 2], 2)])
            assert busy.wait(5.0), "the listener runs"
            start = time.monotonic()
            att.close()
            assert time.monotonic() - start < 4.0
        finally:
            release.set()
        wait_for(lambda: not att._subscriber._thread.is_alive(), timeout=5, what="the thread to end")


def test_gaps_are_recovered_through_replay():
    with publisher() as pub:
        att = attach_to(pub)
        try:
            pub.publish([stored([1], None, [1, 2], 2)])
            real = pub._pub
            pub._pub = types.SimpleNamespace(send_multipart=lambda frames: None)  # the network drops 1 and 2
            pub.publish([stored([2], 1, [3, 4], 2)])
            pub.publish([removed([1])])
            pub._pub = real
            last = pub.publish([stored([3], 2, [5, 6], 2)])
            wait_for(applied(att, "p0", last), what="last batch")
            f = att.faults.iloc[0]
            assert (f.gaps, f.missed_batches, f.replayed_batches, f.lost_batches) == (1, 2, 2, 0)
            assert att.block_hashes("p0") == {2, 3}
            assert att.events.seq.tolist() == [0, 1, 2, 3]  # applied in sequence order
        finally:
            att.close()


def test_batches_a_replay_answer_skips_are_counted_lost():
    """Replay keeps the last two batches: of the four dropped live, one comes back and three are lost."""
    with publisher(buffer_steps=2) as pub:
        att = attach_to(pub)
        try:
            pub.publish([stored([0], None, [0, 0], 2)])
            wait_for(applied(att, "p0", 0))
            real, pub._pub = pub._pub, types.SimpleNamespace(send_multipart=lambda frames: None)
            for i in range(1, 5):
                pub.publish([stored([i], None, [i, i], 2)])
            pub._pub = real
            last = pub.publish([stored([5], None, [5, 5], 2)])  # the buffer now holds 4 and 5
            wait_for(applied(att, "p0", last))
            f = att.faults.iloc[0]
            assert (f.gaps, f.missed_batches, f.replayed_batches, f.lost_batches) == (1, 4, 1, 3)
            assert att.block_hashes("p0") == {0, 4, 5}
        finally:
            att.close()


def test_a_late_subscriber_that_stalls_gets_the_whole_replay_buffer():
    """A subscriber joins after 3000 batches and stalls on the first one it applies: the replay
    answer backs up on the publisher, which must queue all of it rather than drop past ZMQ's default."""
    with publisher(buffer_steps=5000) as pub:
        tokens = list(range(2048))  # big batches, so the socket buffers between the two fill up
        for i in range(3000):
            pub.publish([stored([i], None, tokens, 2048)])
        stall = threading.Event()
        att = kvscope.attach({"p0": pub.endpoint}, topic="kv-events", replay_endpoints={"p0": pub.replay_endpoint},
                             replay_timeout=5.0)
        handle = att.add_listener(lambda name, seq: stall.wait(5.0) and None)
        try:
            time.sleep(0.3)  # the subscription reaches the publisher
            last = pub.publish([stored([3000], None, [1], 1)])
            time.sleep(0.5)
            stall.set()
            handle.remove()
            wait_for(applied(att, "p0", last), timeout=10, what="the live batch")
            assert att.block_hashes("p0") == set(range(3001))
            assert att.faults.iloc[0][["replayed_batches", "lost_batches"]].tolist() == [3000, 0]
        finally:
            stall.set()
            att.close()


def test_an_idle_probe_answered_far_ahead_does_not_drop_later_batches():
    """The idle probe asks replay for what follows the last batch; a reply numbered far ahead of it
    is not taken, the real next batch (dropped live) is, and the live batches after it apply."""
    history = {1: Codec().encode(1.0, [stored([1], None, [1, 2], 2)], 0)}  # batch 1 never goes out live

    def serve(router, stop):  # a replay socket that puts a reply 10**9 ahead before the real ones
        while not stop.is_set():
            if router.poll(50):
                client, _, start = router.recv_multipart()
                start = int.from_bytes(start, "big", signed=True)
                router.send_multipart([client, b"", seq_bytes(start + 10**9), Codec().encode(1.0, [], 0)])
                for seq in sorted(q for q in history if q >= start):
                    router.send_multipart([client, b"", seq_bytes(seq), history[seq]])
                router.send_multipart([client, b"", seq_bytes(-1), b""])

    with raw_stream(serve, replay_timeout=0.5) as (raw, att):
        name = att.instances[0]
        wait_for(applied(att, name, 1), timeout=5, what="batch 1, through the idle probe")
        for seq in (2, 3):
            raw.send_multipart([b"kv-events", seq_bytes(seq), Codec().encode(1.0, [stored([seq], None, [1, 2], 2)], 0)])
        wait_for(applied(att, name, 3), timeout=5, what="the live batches after it")
        assert att.block_hashes(name) == {1, 2, 3} and att.faults.duplicate_batches.iloc[0] == 0


def test_an_idle_probe_answered_by_another_publisher_does_not_drop_later_batches():
    """The replay endpoint given is another publisher's, fifty batches ahead: the idle probe takes
    its batches 1..49 as ours. Our next live batch 1 differs from the one replay gave under that
    number, so the stream starts over from it: every live batch ours sends after the probe applies."""
    with publisher() as ours, publisher() as other:
        for i in range(50):
            other.publish([stored([1000 + i], None, [1, 2], 2)])
        att = kvscope.attach({"p0": ours.endpoint}, topic="kv-events", replay_endpoints={"p0": other.replay_endpoint},
                             replay_timeout=0.5)
        try:
            time.sleep(0.3)  # the subscription reaches the publisher
            wait_for(applied(att, "p0", ours.publish([stored([0], None, [1, 2], 2)])), what="batch 0")
            wait_for(lambda: att.streams[0].faults["replayed_batches"] == 49, what="the idle probe")
            sent = [ours.publish([stored([i], None, [1, 2], 2)]) for i in range(1, 4)]
            wait_for(lambda: {1, 2, 3} <= att.block_hashes("p0"), timeout=5, what="our live batches")
            ev = att.events
            assert att.streams[0].faults["duplicate_batches"] == 0
            assert [list(h) for h in ev[ev.seq.isin(sent)].block_hashes][-3:] == [[1], [2], [3]]
            assert att.streams[0].faults["replay_mismatches"] == 1
        finally:
            att.close()


def test_a_replay_socket_of_another_data_parallel_rank_feeds_nothing():
    """The replay endpoint given answers with batches stamped data_parallel_rank 1 (another rank's
    replay socket: a port offset by the wrong rank), the live ones carry rank 0. Neither the idle
    probe nor a gap's replay applies any of its blocks: each answer is dropped and counted in
    replay_mismatches, the gap's batches counted lost, and the live batches apply."""
    other = {q: Codec().encode(1.0, [stored([100 + q], None, [1, 2], 2)], 1) for q in range(1, 5)}

    def serve(router, stop):  # the other rank's replay socket, which has batches 1..4
        while not stop.is_set():
            if router.poll(50):
                client, _, start = router.recv_multipart()
                start = int.from_bytes(start, "big", signed=True)
                for q in sorted(q for q in other if q >= start):
                    router.send_multipart([client, b"", seq_bytes(q), other[q]])
                router.send_multipart([client, b"", seq_bytes(-1), b""])

    with raw_stream(serve, replay_timeout=0.5) as (raw, att):
        name, f = att.instances[0], att.streams[0].faults
        wait_for(lambda: f["replay_mismatches"] == 1, timeout=5, what="the idle probe's answer, dropped")
        raw.send_multipart([b"kv-events", seq_bytes(5), Codec().encode(1.0, [stored([5], None, [1, 2], 2)], 0)])
        wait_for(applied(att, name, 5), timeout=5, what="the live batch after the gap")
        assert att.block_hashes(name) == {5}
        assert not any(h >= 100 for hashes in att.events.block_hashes.dropna() for h in hashes)
        assert (f["replay_mismatches"], f["replayed_batches"], f["gaps"], f["lost_batches"]) == (2, 0, 1, 4)


def test_an_idle_probe_whose_replay_connection_keeps_dropping_moves_nothing():
    """A replay endpoint that accepts each connection and closes it: the idle probe gets no batch,
    so it counts none missed or lost and the live batches after it all apply."""
    stop = threading.Event()
    try:
        with raw_stream(replay_timeout=1.0,
                        replay_endpoints=f"tcp://127.0.0.1:{_tcp_server(lambda conn: None, stop)}") as (raw, att):
            time.sleep(2.5)  # the idle probe, asked once a second, meets the dropping replay socket
            for seq in (1, 2, 3):
                raw.send_multipart([b"kv-events", seq_bytes(seq), Codec().encode(1.0, [stored([seq], None, [1], 1)], 0)])
            name = att.instances[0]
            wait_for(applied(att, name, 3), timeout=5, what="the live batches")
            assert att.block_hashes(name) == {1, 2, 3}
            f = att.streams[0].faults
            assert (f["duplicate_batches"], f["missed_batches"], f["lost_batches"]) == (0, 0, 0)
    finally:
        stop.set()


def test_a_stream_left_unread_while_another_replays_is_not_probed():
    """One publisher's gaps wait on a replay socket that never answers, two seconds in all, while
    the other publishes. The other lost nothing: no gap, replay or duplicate shows (its batches
    keep being read; a stream left unread a while, behind a slow listener, is not taken for quiet)."""
    with mute_and_good(replay_timeout=0.5) as (raw, att, good, _):
        before = dict(att.streams[1].faults)  # (a replay may have brought the first batch, if it came too early)
        for seq in (2, 4, 6, 8):  # four gaps, half a second each
            raw.send_multipart([b"kv-events", seq_bytes(seq), Codec().encode(1.0, [], 0)])
        time.sleep(0.2)  # the first of those replays waits
        for i in range(1, 21):
            last = good.publish([stored([i], None, [1, 2], 2)])
            time.sleep(0.05)
        wait_for(applied(att, "good", last), timeout=10, what="the good publisher's batches")
        f = att.streams[1].faults
        assert [f[k] - before[k] for k in ("gaps", "replayed_batches", "duplicate_batches")] == [0, 0, 0]
        assert att.block_hashes("good") == set(range(21))


def test_a_stream_whose_replays_time_out_does_not_starve_the_others():
    """Twenty gaps queue up on one publisher whose replay socket never answers (ten seconds of
    waiting in all); a batch the other publisher sends meanwhile applies at once, not after them."""
    with mute_and_good(replay_timeout=0.5) as (raw, att, good, _):
        gaps = 20
        for seq in range(2, 2 * gaps + 2, 2):
            raw.send_multipart([b"kv-events", seq_bytes(seq), Codec().encode(1.0, [], 0)])
        wait_for(lambda: att.streams[0].faults["gaps"] >= 1, what="the first gap")
        start = time.monotonic()
        wait_for(applied(att, "good", good.publish([stored([1], None, [1, 2], 2)])), timeout=15,
                 what="the good publisher's batch")
        assert time.monotonic() - start < 2.0
        assert att.block_hashes("good") == {0, 1} and att.streams[0].faults["gaps"] < gaps


@pytest.mark.parametrize("ask", ["idle probe", "gap"])
def test_a_replay_that_gets_no_answer_holds_up_no_other_stream(ask):
    """A replay socket that takes requests and never answers, under a replay timeout of 30 s:
    while the request waits, the other publisher's batches apply at once; the stream that asked
    waits for its answer only to fill a gap (an idle probe gives way to its next live batch); and
    close() ends the subscriber thread promptly, the answer still pending."""
    with mute_and_good(replay_timeout=30.0) as (raw, att, good, mute):
        if ask == "gap":
            raw.send_multipart([b"kv-events", seq_bytes(2), Codec().encode(1.0, [], 0)])  # 1 is missing
        assert mute.poll(5000), f"the {ask}'s replay request"
        assert mute.recv_multipart()[2] == seq_bytes(1)
        start = time.monotonic()
        wait_for(applied(att, "good", good.publish([stored([1], None, [1, 2], 2)])), timeout=10,
                 what="the good publisher's batch")
        assert time.monotonic() - start < 2.0, "the good publisher's batch waited for the other's replay"
        if ask == "idle probe":
            raw.send_multipart([b"kv-events", seq_bytes(1), Codec().encode(1.0, [stored([7], None, [1], 1)], 0)])
            wait_for(applied(att, "bad", 1), timeout=10, what="the probed stream's next batch")
            assert time.monotonic() - start < 4.0, "the probed stream's batch waited for the probe's answer"
            assert att.block_hashes("bad") == {7}
            f = att.streams[0].faults
            assert (f["gaps"], f["missed_batches"], f["lost_batches"]) == (0, 0, 0)
        assert att.block_hashes("good") == {0, 1}
        closing = time.monotonic()
        att.close()
        assert time.monotonic() - closing < 2.0 and not att._subscriber._thread.is_alive()


def _closed_port() -> int:
    """A loopback port nothing listens on (a connection to it is refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _unended_answer(skip: int):
    """A replay socket answering a request from ``start`` with batches ``start + skip`` to
    ``start + skip + 3`` and no end marker, as vLLM's ROUTER does when the answer outgrows its
    high-water mark (ZMQ drops the rest of it, the end included)."""
    def serve(router, stop):
        while not stop.is_set():
            if router.poll(50):
                ident, _, start = router.recv_multipart()
                first = int.from_bytes(start, "big") + skip
                for seq in range(first, first + 4):
                    router.send_multipart([ident, b"", seq_bytes(seq),
                                           Codec().encode(1.0, [stored([seq], None, [1, 2], 2)], 0)])
    return serve


UNRESOLVABLE = "no-such-host.invalid"  # RFC 6761: a name under .invalid never resolves


@pytest.mark.parametrize("replay", ["refused", "unresolvable", "covers the gap, unended", "skips the gap, unended"])
def test_a_gap_whose_replay_has_plainly_failed_holds_its_stream_briefly(replay):
    """Batch 1 is missing, under replay_timeout=30 s. A replay that has failed beyond doubt releases
    the live batches the gap holds within seconds, not 30: nothing listens at the replay address
    (the connection is refused), its host name does not resolve (ZMQ resolves it at each attempt
    to connect and reports no failure of its own for it), or the answer has gone past the gap
    without its end marker. What replay did not bring is counted lost, and the batches apply in order."""
    if replay == "refused":
        stream = raw_stream(replay_endpoints=f"tcp://127.0.0.1:{_closed_port()}", replay_timeout=30.0)
    elif replay == "unresolvable":
        with pytest.raises(socket.gaierror):  # the premise: this machine's resolver says so
            socket.getaddrinfo(UNRESOLVABLE, 5557)
        stream = raw_stream(replay_endpoints=f"tcp://{UNRESOLVABLE}:5557", replay_timeout=30.0)
    else:
        stream = raw_stream(_unended_answer(0 if replay.startswith("covers") else 5), replay_timeout=30.0)
    with stream as (raw, att):
        att._subscriber.idle_probe = 3600.0  # only the gap asks replay (an idle probe would take the answer ahead)
        start = time.monotonic()
        for seq in (2, 3):
            raw.send_multipart([b"kv-events", seq_bytes(seq), Codec().encode(1.0, [stored([seq], None, [1, 2], 2)], 0)])
        wait_for(applied(att, att.instances[0], 3), timeout=10, what="the live batches after the gap")
        assert time.monotonic() - start < 5.0, "the gap held the live batches until its replay timed out"
        f, covered = att.streams[0].faults, replay.startswith("covers")
        assert (f["gaps"], f["missed_batches"], f["replayed_batches"], f["lost_batches"]) == (1, 1, covered, 1 - covered)
        expected = [1, 2, 3] if covered else [2, 3]
        assert att.block_hashes(att.instances[0]) == set(expected)
        assert att.events.seq.tolist()[-len(expected):] == expected


def _relay(target_port: int, cut: threading.Event, stop: threading.Event) -> int:
    """A TCP relay on loopback to ``target_port``, until ``stop``; its first connection is cut (both
    ways) once ``cut`` is set. Its port."""
    import selectors

    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.05)

    def pump(conn, first):
        up = socket.create_connection(("127.0.0.1", target_port))
        with conn, up, selectors.DefaultSelector() as sel:
            sel.register(conn, selectors.EVENT_READ, up)
            sel.register(up, selectors.EVENT_READ, conn)
            while not stop.is_set() and not (first and cut.is_set()):
                for key, _ in sel.select(0.02):
                    data = key.fileobj.recv(1 << 16)
                    if not data:
                        return
                    key.data.sendall(data)

    def serve():
        first = True
        with srv:
            while not stop.is_set():
                try:
                    conn, _ = srv.accept()
                except TimeoutError:
                    continue
                threading.Thread(target=pump, args=(conn, first), daemon=True).start()
                first = False

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1]


def test_a_replay_whose_connection_drops_once_is_asked_again_and_fills_the_gap():
    """Batch 1 is missing, under replay_timeout=30 s; the replay connection is cut right after the
    request reaches the replay socket, and ZMQ reconnects (a drop, then its retry). The drop is not
    taken for a failed attempt to connect: the request is made again on the new connection, whose
    answer fills the gap (nothing lost), and the batches apply in order."""
    batch = {q: Codec().encode(1.0, [stored([q], None, [1, 2], 2)], 0) for q in (1, 2)}
    ctx, stop, cut = zmq.Context.instance(), threading.Event(), threading.Event()
    router = ctx.socket(zmq.ROUTER)
    relay = _relay(router.bind_to_random_port("tcp://127.0.0.1"), cut, stop)
    asks = []

    def serve():  # the first request goes unanswered (its connection is cut), the later ones get batch 1
        while not stop.is_set():
            if router.poll(20):
                client, _, start = router.recv_multipart()
                asks.append(int.from_bytes(start, "big", signed=True))
                if len(asks) == 1:
                    cut.set()
                    continue
                router.send_multipart([client, b"", seq_bytes(1), batch[1]])
                router.send_multipart([client, b"", seq_bytes(-1), b""])

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        with raw_stream(replay_endpoints=f"tcp://127.0.0.1:{relay}", replay_timeout=30.0) as (raw, att):
            att._subscriber.idle_probe = 3600.0  # only the gap asks replay
            raw.send_multipart([b"kv-events", seq_bytes(2), batch[2]])
            name = att.instances[0]
            wait_for(applied(att, name, 2), timeout=20, what="the batch after the gap")
            assert asks[:2] == [1, 1], "the request, then the same one again after the drop"
            f = att.streams[0].faults
            assert (f["gaps"], f["missed_batches"], f["replayed_batches"], f["lost_batches"]) == (1, 1, 1, 0)
            assert att.block_hashes(name) == {1, 2} and att.events.seq.tolist()[-2:] == [1, 2]
    finally:
        stop.set()
        server.join()
        router.close(linger=0)


def test_gap_without_replay_socket_is_counted_lost():
    with publisher(replay_endpoint=None) as pub:
        att = attach_to(pub)
        try:
            pub.publish([stored([1], None, [1, 2], 2)])
            wait_for(applied(att, "p0", 0))
            real, pub._pub = pub._pub, types.SimpleNamespace(send_multipart=lambda frames: None)
            pub.publish([stored([2], 1, [3, 4], 2)])
            pub._pub = real
            wait_for(applied(att, "p0", pub.publish([stored([3], None, [5, 6], 2)])))
            f = att.faults.iloc[0]
            assert (f.gaps, f.lost_batches, f.replayed_batches) == (1, 1, 0)
        finally:
            att.close()


def test_a_late_answer_to_a_timed_out_replay_does_not_end_the_next_one():
    """The replay socket answers the first request after the replay timeout, and each later one
    after a shorter while. The first gap's batch counts lost; the late answer, arriving while the
    second gap's replay waits, is not taken for that replay's end: its batch comes back too."""
    batch = {q: Codec().encode(1.0, [stored([q], None, [1, 2], 2)], 0) for q in range(1, 5)}
    history = {1: batch[1]}  # what the replay socket keeps: 1 and (once published) 3 never go out live
    asked = threading.Event()

    def serve(router, stop):  # answers wait in a queue until they are due
        due = []
        while not stop.is_set():
            now = time.monotonic()
            for when, frames in [d for d in due if d[0] <= now]:
                due.remove((when, frames))
                router.send_multipart(frames)
            if router.poll(10):
                client, _, start = router.recv_multipart()
                start = int.from_bytes(start, "big", signed=True)
                delay = 0.3 if asked.is_set() else 1.0
                asked.set()
                due += [(now + delay, [client, b"", seq_bytes(q), history[q]]) for q in sorted(history) if q >= start]
                due.append((now + delay + 0.001, [client, b"", seq_bytes(-1), b""]))

    with raw_stream(serve, replay_timeout=0.5) as (raw, att):
        raw.send_multipart([b"kv-events", seq_bytes(2), batch[2]])
        assert asked.wait(5), "the first replay request"
        history[3] = batch[3]
        time.sleep(0.8)  # the first replay timed out; its answer comes 0.2 s from now, the next one's after it
        raw.send_multipart([b"kv-events", seq_bytes(4), batch[4]])
        name = att.instances[0]
        wait_for(applied(att, name, 4), timeout=5, what="the second gap")
        assert att.block_hashes(name) == {2, 3, 4}
        f = att.streams[0].faults
        assert (f["gaps"], f["replayed_batches"], f["lost_batches"]) == (2, 1, 1)


def test_many_gaps_with_a_replay_socket_that_is_down():
    """Each gap asks a replay socket nobody listens on; past ZMQ's queue of unsent requests the
    next ask must fail at once, not block the thread, and every batch after keeps applying."""
    raw = zmq.Context.instance().socket(zmq.PUB)
    port, down = raw.bind_to_random_port("tcp://127.0.0.1"), free_port()
    att = kvscope.attach(f"tcp://127.0.0.1:{port}", topic="kv-events", replay_timeout=0.001,
                         replay_endpoints=f"tcp://127.0.0.1:{down}")
    try:
        wait_for(lambda: probed(raw, att), what="subscription")
        gaps = 1200  # more requests than the replay socket queues (its high-water mark, 1000)
        for i in range(1, gaps + 1):
            raw.send_multipart([b"kv-events", seq_bytes(2 * i), Codec().encode(1.0, [stored([i], None, [1], 1)], 0)])
        name = att.instances[0]
        wait_for(applied(att, name, 2 * gaps), timeout=8, what="the last batch")
        f = att.faults.iloc[0]
        assert (f.gaps, f.lost_batches) == (gaps, gaps) and att.block_hashes(name) == set(range(1, gaps + 1))
    finally:
        att.close()
        raw.close(linger=0)


def test_publisher_that_dies_and_comes_back():
    """A new publisher process on the same port starts counting at 0 with an empty cache."""
    first = publisher()
    port = first.endpoint.rsplit(":", 1)[1]
    replay_port = first.replay_endpoint.rsplit(":", 1)[1]
    att = attach_to(first)
    try:
        for i in range(4):
            last = first.publish([stored([100 + i], None, [i, i], 2)])
        wait_for(applied(att, "p0", last))
        assert att.block_hashes("p0") == {100, 101, 102, 103}
        first.close()
        from kvscope.attach.publisher import KVEventPublisher

        with KVEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", topic="kv-events",
                              bind=True) as second:
            second.publish([stored([7], None, [9, 9], 2)])
            # keep publishing until the subscriber has reconnected and caught up (bounded by wait_for)
            wait_for(lambda: second.publish([stored([8], 7, [9, 9], 2)]) >= 0 and att.block_hashes("p0") >= {7, 8},
                     what="the restarted publisher's blocks")
            wait_for(lambda: att.faults.publisher_restarts.iloc[0] + att.faults.reconnects.iloc[0] >= 1)
            assert att.block_hashes("p0") == {7, 8}  # nothing of the dead publisher's cache survives
    finally:
        att.close()


def test_slow_consumer_past_the_high_water_mark():
    """A consumer that stalls makes both high-water marks drop batches; they come back through replay."""
    with publisher(hwm=1) as pub:
        att = attach_to(pub, hwm=1)
        stall = threading.Event()
        handle = att.add_listener(lambda name, seq: stall.wait(5.0) and None)
        try:
            tokens = list(range(4096))  # big batches, so the sockets' buffers fill up quickly
            for i in range(600):
                last = pub.publish([stored([i], i - 1 if i else None, tokens, 4096)])
            stall.set()
            handle.remove()
            wait_for(applied(att, "p0", last), timeout=30, what="the last batch")
            f = att.faults.iloc[0]
            assert f.gaps >= 1 and f.missed_batches >= 1 and f.replayed_batches >= 1 and f.lost_batches == 0
            assert att.block_hashes("p0") == set(range(600))
        finally:
            stall.set()
            att.close()


# ------------------------------------------------------------------- several publishers
def test_parent_cycles_and_deep_chains_give_finite_depths():
    """Events whose parent links loop (1 <-> 2 with 4 below 1, 3 its own parent) and a chain
    20,000 blocks deep: src.blocks is built without looping or recursing, and each depth is its
    parent's plus one, except one block on each loop, which counts as a root."""
    deep = 20_000
    with publisher() as pub:
        att = attach_to(pub)
        try:
            pub.publish([stored([1], 2, [1], 1), stored([2], 1, [2], 1), stored([3], 3, [3], 1), stored([4], 1, [4], 1)])
            last = pub.publish([stored(list(range(10, 10 + deep)), None, list(range(deep)), 1)])
            wait_for(applied(att, "p0", last), what="both batches")
            blocks = att.blocks.set_index("block_hash")
            depth, parent = blocks.depth.to_dict(), blocks.parent_block_hash.to_dict()
            assert len(depth) == deep + 4 and depth[10 + deep - 1] == deep - 1
            roots = {h for h in depth if depth[h] == 0}
            assert all(depth[h] == depth[parent[h]] + 1 for h in depth if h not in roots)
            assert roots == {3, 10} | ({1, 2} & roots) and len({1, 2} & roots) == 1 and depth[4] == depth[1] + 1
        finally:
            att.close()


def test_four_replicas_overlap_matches_hand_count():
    """Four replicas share a system prompt; the overlap numbers below are counted by hand.

    A: S + [200, 201]   B: S + [200, 201]   C: S + [300]   D: S + [300, 301], then D evicts 301
    with S = [100, 101, 102]. Held: A 5, B 5, C 4, D 4 -> 18 copies of 6 distinct hashes.
    """
    pubs = [publisher() for _ in range(4)]
    att = attach_to(*pubs)
    try:
        S = [100, 101, 102]
        chains = {0: [200, 201], 1: [200, 201], 2: [300], 3: [300, 301]}
        for i, pub in enumerate(pubs):
            pub.publish([stored(S, None, list(range(12)), 4)])
            pub.publish([stored(chains[i], 102, list(range(4 * len(chains[i]))), 4)])
        last = pubs[3].publish([removed([301])])
        for i in range(3):
            wait_for(applied(att, f"p{i}", 1))
        wait_for(applied(att, "p3", last))
        assert att.duplication() == {"total_blocks": 18, "unique_blocks": 6, "duplicated_blocks": 12,
                                     "duplicated_fraction": 12 / 18}
        m = att.overlap_matrix()
        assert m.loc["p0", "p1"] == 5 and m.loc["p0", "p2"] == 3 and m.loc["p2", "p3"] == 4 and m.loc["p3", "p3"] == 4
        held = att.overlap().set_index("block_hash")
        assert held.loc[100, "instances"] == ["p0", "p1", "p2", "p3"] and held.loc[300, "num_instances"] == 2
        assert 301 not in held.index
        blocks = att.blocks
        a = blocks[blocks.instance == "p0"].set_index("block_hash")
        assert a.depth.to_dict() == {100: 0, 101: 1, 102: 2, 200: 3, 201: 4}
        assert a.loc[101, "token_ids"] == [4, 5, 6, 7] and a.loc[201, "parent_block_hash"] == 200
    finally:
        att.close()
        for p in pubs:
            p.close()


def test_data_parallel_ranks_publish_on_port_plus_rank():
    from kvscope.attach.publisher import KVEventPublisher, offset_endpoint

    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560" and offset_endpoint("inproc://x", 1) == "inproc://x_dp1"
    for _ in range(50):  # a base port whose neighbour is free too
        base = free_port()
        pubs = []
        try:
            for r in (0, 1):
                pubs.append(KVEventPublisher(f"tcp://127.0.0.1:{base}", topic="kv-events", data_parallel_rank=r,
                                             bind=True))
            break
        except ValueError:  # (the neighbour taken, an EndpointError; or past 65535)
            for p in pubs:
                p.close()
    assert [p.endpoint for p in pubs] == [f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}"]
    try:
        att = kvscope.attach({"dep": f"tcp://127.0.0.1:{base}"}, data_parallel_size=2, replay_timeout=0.2)
        try:
            assert att.instances == ["dep/dp0", "dep/dp1"]
            wait_for(lambda: _publish_until(pubs, att), what="both ranks")
            ev = att.events
            assert set(zip(ev.data_parallel_rank, ev.block_hashes.map(tuple))) == {(0, (10,)), (1, (11,))}
        finally:
            att.close()
    finally:
        for p in pubs:
            p.close()


def test_a_rank_whose_port_would_pass_65535_is_refused():
    """ZMQ binds port 65536 + k as port k without a word: the publisher refuses the offset instead."""
    from kvscope.attach.publisher import KVEventPublisher, offset_endpoint

    assert offset_endpoint("tcp://127.0.0.1:65534", 1) == "tcp://127.0.0.1:65535"
    with pytest.raises(ValueError, match=r"'tcp://127.0.0.1:65535' offset by data_parallel_rank=3 is port 65538, "
                                         r"past 65535"):
        KVEventPublisher("tcp://127.0.0.1:65535", topic="kv-events", data_parallel_rank=3, bind=True)


def test_a_publisher_that_fails_to_bind_leaves_no_port_bound():
    """The replay port is taken: the publisher fails, naming the argument and the address (ZMQ's
    error as the cause), and its live port is free for the retry at once (a notebook keeps the
    failed call's frames, so nothing would close it)."""
    from kvscope.attach.publisher import EndpointError, KVEventPublisher

    taken = zmq.Context.instance().socket(zmq.ROUTER)
    taken_port, port = taken.bind_to_random_port("tcp://127.0.0.1"), free_port()
    try:
        with pytest.raises(EndpointError, match=f"^replay_endpoint 'tcp://127.0.0.1:{taken_port}' cannot be "
                                                "bound: Address already in use$") as err:
            KVEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{taken_port}", bind=True)
        assert isinstance(err.value.__cause__, zmq.ZMQError)
        with pytest.raises(ValueError, match="past 65535") as err_offset:
            KVEventPublisher(f"tcp://127.0.0.1:{port}", "tcp://127.0.0.1:65535", data_parallel_rank=1, bind=True)
        with KVEventPublisher(f"tcp://127.0.0.1:{port}", bind=True) as retry:
            assert retry.endpoint == f"tcp://127.0.0.1:{port}"
        assert err.value is not None and err_offset.value is not None
    finally:
        taken.close(linger=0)


def _publish_until(pubs, att) -> bool:
    for r, p in enumerate(pubs):
        if not att.block_hashes(f"dep/dp{r}"):
            p.publish([stored([10 + r], None, [1, 2], 2)])
    return all(att.block_hashes(f"dep/dp{r}") for r in range(2))


# ----------------------------------------------------------------------------- metrics
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-0.6B"} 7.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-0.6B"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-0.6B"} 2.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-0.6B"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.4375
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-0.6B"} 0.125
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 12800.0
vllm:prefix_cache_queries_created{engine="0",model_name="Qwen/Qwen3-0.6B"} 1.7e9
vllm:prefix_cache_queries_total{engine="1",model_name="Qwen/Qwen3-0.6B"} 640.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 9600.0
vllm:prefix_cache_hits_total{engine="1",model_name="Qwen/Qwen3-0.6B"} 0.0
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 4.0
vllm:num_preemptions_total{engine="1",model_name="Qwen/Qwen3-0.6B"} 0.0
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 5.0e+04
"""


def test_prometheus_text_parses_into_the_time_series():
    rows = parse_metrics(VLLM_METRICS, "a", 5.0)
    assert [dict(zip(("time_s", "instance", "data_parallel_rank", *METRICS), r)) for r in rows] == [
        {"time_s": 5.0, "instance": "a", "data_parallel_rank": 0, "num_requests_running": 7.0,
         "num_requests_waiting": 2.0, "kv_cache_usage_perc": 0.4375, "prefix_cache_queries": 12800.0,
         "prefix_cache_hits": 9600.0, "num_preemptions": 4.0},
        {"time_s": 5.0, "instance": "a", "data_parallel_rank": 1, "num_requests_running": 3.0,
         "num_requests_waiting": 0.0, "kv_cache_usage_perc": 0.125, "prefix_cache_queries": 640.0,
         "prefix_cache_hits": 0.0, "num_preemptions": 0.0},
    ]
    old = parse_metrics('vllm:gpu_cache_usage_perc{model_name="m"} 0.5\n', "a", 1.0)[0]
    assert old[5] == 0.5  # the pre-v0.10 name fills the same column


def test_metrics_are_scraped_at_an_interval_and_failures_counted():
    with metrics_server(lambda: VLLM_METRICS) as dead_url:
        pass  # nothing listens there any more
    with metrics_server(lambda: VLLM_METRICS) as url, publisher() as a, publisher() as b:
        att = attach_to(a, b, metrics_urls=[url, dead_url], metrics_interval=MIN_METRICS_INTERVAL)
        try:
            wait_for(lambda: len(att.metrics) >= 6, what="three scrapes")
            wait_for(lambda: att.faults.scrape_errors.iloc[1] >= 2)
            m = att.metrics
            assert set(m.instance) == {"p0"} and m.time_s.is_monotonic_increasing
            assert m[m.data_parallel_rank == 0].num_requests_running.eq(7.0).all()
        finally:
            att.close()


def test_metrics_of_several_urls_are_one_time_ordered_table():
    """Each URL is scraped in its own thread, and a row is stamped when its page has come, before it
    is parsed: a long page ("slow", a histogram of many buckets, parsed for a good part of a
    second) is added after rows of the other URL stamped later. src.metrics is ordered by time_s
    all the same, and each instance's rows keep their scrape order (the page's counter of the
    requests its server answered only grows)."""
    served = {"slow": 0, "fast": 0}

    def page(name, filler=""):
        served[name] += 1
        return f'{filler}vllm:num_requests_running{{engine="0"}} {served[name]}\n'

    buckets = "".join(f'vllm:e2e_request_latency_seconds_bucket{{le="{i}"}} 1\n' for i in range(600_000))
    with metrics_server(lambda: page("slow", buckets)) as slow, metrics_server(lambda: page("fast")) as fast, \
            publisher() as a, publisher() as b:
        att = attach_to(a, b, metrics_urls=[slow, fast], metrics_interval=MIN_METRICS_INTERVAL)
        try:
            wait_for(lambda: (att.metrics.instance == "p0").sum() >= 3, timeout=30, what="three scrapes of the long page")
            arrived = att.metric_rows().time_s.tolist()  # (in the order added)
            assert arrived != sorted(arrived), "the premise: rows were added out of time order"
            m = att.metrics
        finally:
            att.close()
    assert m.time_s.is_monotonic_increasing and m.index.tolist() == list(range(len(m)))
    for instance in ("p0", "p1"):
        counts = m[m.instance == instance].num_requests_running.tolist()
        assert len(counts) >= 3 and counts == sorted(set(counts)), f"{instance}'s rows in scrape order"


def test_metrics_with_an_engine_label_that_is_not_a_rank_are_skipped():
    """Only decimal ranks an int64 holds are engines: the others' series are skipped, and
    src.metrics stays readable (it failed for good once a huge rank was kept)."""
    page = ('vllm:num_requests_running{engine="99999999999999999999999"} 5.0\n'
            'vllm:num_requests_running{engine=" 1_0 "} 6.0\n'
            'vllm:num_requests_running{engine="-3"} 8.0\n'
            'vllm:num_requests_running{engine="2"} 7.0\n')
    with metrics_server(lambda: page) as url, publisher() as pub:
        att = attach_to(pub, metrics_urls=url, metrics_interval=MIN_METRICS_INTERVAL)
        try:
            wait_for(lambda: len(att._metrics) >= 2, what="two scrapes")
            m = att.metrics
            assert set(m.data_parallel_rank) == {2} and m.num_requests_running.eq(7.0).all()
        finally:
            att.close()


def test_metrics_interval_below_its_floor_is_refused_and_the_floor_is_kept():
    """An interval under MIN_METRICS_INTERVAL (0 included) would scrape back to back, a dead URL in a
    busy loop: refused naming the argument and the floor. At the floor, the server's own count of
    requests stays within one per interval."""
    for bad in (MIN_METRICS_INTERVAL / 2, 1e-9, 0):
        with pytest.raises(ValueError, match=rf"metrics_interval must be a finite number of seconds "
                                             rf">= {MIN_METRICS_INTERVAL:g} and <= 86400, got {bad!r}"):
            kvscope.attach("tcp://127.0.0.1:1", metrics_urls="http://127.0.0.1:1/metrics", metrics_interval=bad)
    requests = []
    with metrics_server(lambda: requests.append(time.monotonic()) or VLLM_METRICS) as url, publisher() as pub:
        att = attach_to(pub, metrics_urls=url, metrics_interval=MIN_METRICS_INTERVAL)
        try:
            wait_for(lambda: len(requests) >= 5, what="five scrapes")
        finally:
            att.close()
    span = requests[-1] - requests[0]
    assert len(requests) - 1 <= span / MIN_METRICS_INTERVAL + 1


def _tcp_server(answer, stop):
    """A loopback server calling ``answer(conn)`` per connection, after its first bytes (until
    ``stop`` is set); its port."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.1)

    def serve():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            threading.Thread(target=lambda: _answer_once(answer, conn), daemon=True).start()
        srv.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1]


def _answer_once(answer, conn):
    with conn:
        try:
            conn.recv(65536)
            answer(conn)
        except OSError:
            pass  # the scraper hung up


def test_metrics_servers_that_misbehave_are_scrape_errors():
    """Garbage instead of HTTP, a cut page, a page without end, one a byte at a time and headers a
    byte at a time: each scrape of them fails within the timeout and is counted, the good server
    keeps being scraped, and close() ends the threads."""
    from kvscope.attach.metrics import MetricsScraper

    stop = threading.Event()
    page = VLLM_METRICS.encode()

    def good(conn):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(page) + page)

    def endless(conn):
        conn.sendall(b"HTTP/1.1 200 OK\r\n\r\n")
        while not stop.is_set():
            conn.sendall(b"#" * (1 << 20) + b"\n")
            time.sleep(0.005)

    def trickle(conn):
        conn.sendall(b"HTTP/1.1 200 OK\r\n\r\n")
        while not stop.is_set():
            conn.sendall(b"#")
            time.sleep(0.05)

    def slow_headers(conn):  # each read within the timeout, the headers never done
        conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
        while not stop.is_set():
            conn.sendall(b"x")
            time.sleep(0.05)

    answers = {"good": good, "garbage": lambda conn: conn.sendall(b"\x00\x01 not http\r\n\r\n"),
               "cut": lambda conn: conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(page)
                                                + page[:len(page) // 2]),
               "endless": endless, "trickle": trickle, "slow_headers": slow_headers}
    urls = {name: f"http://127.0.0.1:{_tcp_server(answer, stop)}/metrics" for name, answer in answers.items()}
    rows = []
    scraper = MetricsScraper(urls, 0.05, rows.extend, timeout=0.5)
    try:
        wait_for(lambda: min(scraper.errors[n] for n in answers if n != "good") >= 2, timeout=8,
                 what="two failed scrapes of each bad server")
        assert scraper.errors["good"] == 0 and all(t.is_alive() for t in scraper._threads)
        assert {r[1] for r in rows} == {"good"} and len(rows) >= 4  # two engines per scrape
        assert [r[3] for r in rows if r[2] == 0] == [7.0] * (len(rows) // 2)  # num_requests_running
        scraper.close()
        assert not any(t.is_alive() for t in scraper._threads)
    finally:
        stop.set()
        scraper.close()


def test_a_host_that_resolves_slowly_is_held_to_the_scrape_deadline(monkeypatch):
    """Resolving a host name is part of the scrape's deadline: a resolver that takes ten seconds
    (a stand-in for a slow DNS server, which a test cannot reach) fails that scrape within the
    timeout, the good URL after it keeps being scraped, and close() returns at once."""
    from kvscope.attach.metrics import MetricsScraper

    real, release = socket.getaddrinfo, threading.Event()

    def resolve(host, *args, **kwargs):
        if host == "slow.invalid":
            release.wait(10.0)
            host = "127.0.0.1"
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    rows = []
    with metrics_server(lambda: VLLM_METRICS) as url:
        port = url.split(":")[2].split("/")[0]
        scraper = MetricsScraper({"slow": f"http://slow.invalid:{port}/metrics", "good": url}, 0.05, rows.extend,
                                 timeout=0.5)
        try:
            wait_for(lambda: scraper.errors["slow"] >= 2 and len(rows) >= 4, timeout=4,
                     what="two failed scrapes of the slow host and two of the good one")
            assert scraper.errors["good"] == 0 and {r[1] for r in rows} == {"good"}
            start = time.monotonic()
            scraper.close()
            assert time.monotonic() - start < 1.0 and not any(t.is_alive() for t in scraper._threads)
        finally:
            release.set()
            scraper.close()


def test_a_url_whose_lookup_hangs_does_not_delay_the_others(monkeypatch):
    """A resolver that never answers for ``hung.invalid`` (a stand-in for a hung DNS server), under a
    scrape timeout of 30 s: the good URL listed after it is scraped at its interval meanwhile, not
    once per 30 s behind the hung URL's deadline; close() returns at once, the hung scrape given up."""
    from kvscope.attach.metrics import MetricsScraper

    real, release = socket.getaddrinfo, threading.Event()

    def resolve(host, *args, **kwargs):
        if host == "hung.invalid":
            release.wait(60.0)
            raise socket.gaierror(socket.EAI_NONAME, "hung")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    rows = []
    with metrics_server(lambda: VLLM_METRICS) as url:
        scraper = MetricsScraper({"hung": "http://hung.invalid:8000/metrics", "good": url}, 0.1, rows.extend,
                                 timeout=30.0)
        try:
            wait_for(lambda: len(rows) >= 6, timeout=10, what="three scrapes of the good URL")
            assert scraper.errors == {"hung": 0, "good": 0}  # the hung URL's first scrape still waits
            start = time.monotonic()
            scraper.close()
            assert time.monotonic() - start < 5.0
        finally:
            release.set()
            scraper.close()


def test_a_url_does_not_wait_on_the_lookup_another_url_of_its_host_started(monkeypatch):
    """Two healthy URLs on one host name, whose first lookup hangs (a stand-in for a DNS query lost
    on its way: the resolver answers the next one), under a scrape timeout of 30 s: the URL whose
    lookup hangs waits on it, the other resolves the host itself and is scraped at its interval. A
    lookup was shared by every URL of its host: both waited on the hung one until it returned."""
    from kvscope.attach.metrics import MetricsScraper

    real, release, lock, calls = socket.getaddrinfo, threading.Event(), threading.Lock(), []

    def resolve(host, *args, **kwargs):
        if host == "shared.invalid":
            with lock:
                calls.append(host)
                first = len(calls) == 1
            if first:
                release.wait(60.0)
                raise socket.gaierror(socket.EAI_NONAME, "hung")
            host = "127.0.0.1"
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    rows = []
    with metrics_server(lambda: VLLM_METRICS) as url_a, metrics_server(lambda: VLLM_METRICS) as url_b:
        urls = {name: url.replace("127.0.0.1", "shared.invalid") for name, url in (("a", url_a), ("b", url_b))}
        scraper = MetricsScraper(urls, 0.1, rows.extend, timeout=30.0)
        try:
            wait_for(lambda: len(rows) >= 6, timeout=10, what="three scrapes of the URL whose lookup answered")
            assert len({r[1] for r in rows}) == 1 and sum(scraper.errors.values()) == 0
        finally:
            release.set()
            scraper.close()


def _resolver_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvscope-metrics-resolve"]


def test_lookups_that_hang_hold_one_thread_per_url_not_per_scrape(monkeypatch):
    """A resolver that never answers for ``*.invalid`` (a stand-in for a hung DNS server): each of two
    URLs of one such host on two ports waits again on its own lookup, and a URL that redirects every
    scrape to a new such host holds one lookup at a time, so dozens of failed scrapes leave three
    resolver threads, one per URL, not one per scrape. close() returns at once; the threads left are
    daemons, and end when the resolver answers."""
    from kvscope.attach.metrics import MetricsScraper

    real, release = socket.getaddrinfo, threading.Event()

    def resolve(host, *args, **kwargs):
        if str(host).endswith(".invalid"):
            release.wait(30.0)
            raise socket.gaierror(socket.EAI_NONAME, "hung")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    redirects = iter(range(1_000_000))

    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(302)
            self.send_header("Location", f"http://r{next(redirects)}.invalid:9/metrics")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    before = len(_resolver_threads())
    scraper = MetricsScraper({"a": "http://hung.invalid:8000/metrics", "b": "http://hung.invalid:8001/metrics",
                              "moving": f"http://127.0.0.1:{server.server_address[1]}/metrics"}, 0.1, lambda rows: None,
                             timeout=0.2)
    try:
        wait_for(lambda: min(scraper.errors.values()) >= 8, timeout=20, what="eight failed scrapes of each URL")
        assert len(_resolver_threads()) - before <= 3, [t.name for t in _resolver_threads()]
        start = time.monotonic()
        scraper.close()
        assert time.monotonic() - start < 2.0 and not any(t.is_alive() for t in scraper._threads)
        assert all(t.daemon for t in _resolver_threads())
    finally:
        release.set()
        scraper.close()
        server.shutdown()
        server.server_close()
    wait_for(lambda: len(_resolver_threads()) <= before, timeout=10, what="the lookups to end once answered")


def test_a_lookup_that_never_returns_does_not_hold_up_the_interpreters_exit(tmp_path):
    """A process whose scraper met a resolver that never answers exits once it closes the scraper:
    the lookup's thread is a daemon."""
    import subprocess

    script = tmp_path / "hung.py"
    script.write_text(
        "import socket, threading, time\n"
        "from kvscope.attach.metrics import MetricsScraper\n"
        "socket.getaddrinfo = lambda *a, **k: threading.Event().wait()\n"
        "s = MetricsScraper({'a': 'http://hung.invalid:8000/metrics'}, 0.1, lambda rows: None, timeout=0.2)\n"
        "while s.errors['a'] < 2:\n"
        "    time.sleep(0.05)\n"
        "s.close()\n"
        "print('closed', flush=True)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stdout.strip() == "closed", done.stderr


# ----------------------------------------------------------------------------- API boundary
def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="endpoints"):
        kvscope.attach([])
    with pytest.raises(ValueError, match=r"endpoints\['127.0.0.1:1'\] must start with"):
        kvscope.attach("127.0.0.1:1")
    with pytest.raises(ValueError, match="replay_endpoints has 2 entries for 1 endpoints"):
        kvscope.attach("tcp://127.0.0.1:1", replay_endpoints=["tcp://127.0.0.1:2", "tcp://127.0.0.1:3"])
    with pytest.raises(ValueError, match="data_parallel_size must be an integer >= 1"):
        kvscope.attach("tcp://127.0.0.1:1", data_parallel_size=0)
    for bad in (0, -1.0, float("inf"), float("nan"), True, "1"):
        for arg, low in (("metrics_interval", f">= {MIN_METRICS_INTERVAL:g}"), ("replay_timeout", "> 0")):
            with pytest.raises(ValueError, match=f"{arg} must be a finite number of seconds {low}"):
                kvscope.attach("tcp://127.0.0.1:1", metrics_urls="http://127.0.0.1:1/metrics", **{arg: bad})
    with pytest.raises(ValueError, match="metrics_urls names unknown instances"):
        kvscope.attach({"a": "tcp://127.0.0.1:1"}, metrics_urls={"b": "http://127.0.0.1:1/metrics"})


def test_bad_addresses_and_limits_name_the_argument():
    """Addresses ZMQ would take and never reach, and values it would refuse with no name, are refused
    here naming the argument and its limit; a failed subscription leaves no socket open."""
    ok = "tcp://127.0.0.1:1"
    for kwargs, message in (
        (dict(endpoints="tcp://127.0.0.1"), r"endpoints\['127.0.0.1'\] must be tcp://host:port with a port in 1..65535"),
        (dict(endpoints="tcp://127.0.0.1:99999"), r"must be tcp://host:port with a port in 1..65535"),
        (dict(endpoints="tcp://:5557"), r"endpoints\[':5557'\] must be tcp://host:port"),
        (dict(endpoints={"a": "tcp://127.0.0.1:65535"}, data_parallel_size=2),
         r"endpoints\['a'\] must be tcp://host:port with a port in 1..65534 \(data_parallel_size=2"),
        (dict(endpoints=ok, replay_endpoints=[5]), r"replay_endpoints\['127.0.0.1:1'\] must start with one of tcp://"),
        (dict(endpoints=ok, replay_endpoints="127.0.0.1:2"), r"replay_endpoints\['127.0.0.1:1'\] must start with"),
        (dict(endpoints=ok, replay_endpoints=5), r"replay_endpoints must be an address"),
        (dict(endpoints=ok, metrics_urls="127.0.0.1:8000/metrics"),
         r"metrics_urls\['127.0.0.1:1'\] must be a URL starting with http:// or https://"),
        (dict(endpoints=ok, metrics_urls=[8000]), r"metrics_urls\['127.0.0.1:1'\] must be a URL"),
        (dict(endpoints=ok, hwm=2**31), r"hwm must be an integer in 1..2147483647"),
        (dict(endpoints=ok, max_events=2**63), rf"max_events must be an integer in 1..{sys.maxsize}"),
        (dict(endpoints=ok, max_message_bytes=MIN_MESSAGE_BYTES - 1),
         rf"max_message_bytes must be an integer >= {MIN_MESSAGE_BYTES}, got {MIN_MESSAGE_BYTES - 1}"),
        (dict(endpoints=ok, max_message_bytes=2**63), r"max_message_bytes must be an integer in 1024..9223372036854775807"),
        (dict(endpoints=ok, max_message_bytes=4096.0), r"max_message_bytes must be an integer >= 1024, got 4096.0"),
        (dict(endpoints=ok, data_parallel_size=70_000), r"data_parallel_size must be an integer in 1..65535"),
        (dict(endpoints=ok, replay_timeout=1e300), r"replay_timeout must be a finite number of seconds > 0 and <= 86400"),
        (dict(endpoints=ok, metrics_urls="http://127.0.0.1:1/metrics", metrics_interval=1e12),
         r"metrics_interval must be a finite number of seconds >= 0.1 and <= 86400"),
    ):
        with pytest.raises(ValueError, match=message):
            kvscope.attach(**kwargs)
    xpub = zmq.Context.instance().socket(zmq.XPUB)  # it reads each subscription made (1) and dropped (0)
    port = xpub.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(ValueError, match=r"cannot subscribe to 'b' at 'ipc:///x+'.*File name too long") as err:
            kvscope.attach({"a": f"tcp://127.0.0.1:{port}", "b": "ipc:///" + "x" * 300})
        subscribed, end = 0, time.monotonic() + 1.0  # ``err`` keeps the failed call's frames, as a notebook does
        while (left := end - time.monotonic()) > 0:
            if xpub.poll(int(left * 1000) + 1):
                subscribed += 1 if xpub.recv()[0] == 1 else -1
        assert subscribed == 0 and err.value.__cause__ is not None
    finally:
        xpub.close(linger=0)


def test_endpoints_of_the_wrong_shape_name_the_argument():
    """A nested list, bytes (a sequence of ints) or a name that is not a string are refused by name,
    not with an unhashable-type error, a list of ints, or an instance no table lookup can find."""
    ok = "tcp://127.0.0.1:1"
    for kwargs, message in (
        (dict(endpoints=[[ok]]), r"endpoints must be an address, a non-empty list of them"),
        (dict(endpoints=ok.encode()), r"endpoints must be an address, a non-empty list of them"),
        (dict(endpoints={5: ok}), r"endpoints must map names \(strings\) to address strings"),
        (dict(endpoints=ok, replay_endpoints=b"tcp://127.0.0.1:2"), r"replay_endpoints must be an address, a list"),
        (dict(endpoints=[ok, ok]), r"endpoints lists the same address twice"),
        # (two addresses, one default name: the message said they were the same address)
        (dict(endpoints=["tcp://h:1", "ipc://h:1"]), r"endpoints gives 'tcp://h:1' and 'ipc://h:1' the same "
                                                    r"default name 'h:1'; name them: a dict name -> address"),
    ):
        with pytest.raises(ValueError, match=message):
            kvscope.attach(**kwargs)


def test_block_hashes_of_an_instance_not_attached_names_the_instances():
    with publisher() as pub:
        att = attach_to(pub)
        try:
            for bad in ("p1", 0, None):
                with pytest.raises(ValueError, match=rf"instance must be one of \['p0'\], got {bad!r}"):
                    att.block_hashes(bad)
            assert att.block_hashes("p0") == set()
        finally:
            att.close()


def test_missing_extra_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "zmq", None)  # as if pyzmq were not installed
    with pytest.raises(ImportError, match=r'pip install "kvscope\[attach\]"'):
        kvscope.attach("tcp://127.0.0.1:1")


@pytest.mark.parametrize("missing", ["zmq", "msgspec", "pandas"])
def test_a_missing_module_of_the_extra_is_named_alone_with_what_needs_it(monkeypatch, missing):
    """The ImportError names the one module that is missing, not the others of the extra (it said
    "pyzmq and msgspec" whichever it was, and a missing pandas reached attach unexplained), and
    what needs it: ``kvscope.attach`` or ``kv_events_config`` (``LLM`` asks before the weights load)."""
    from kvscope.attach.publisher import EngineKVEvents

    monkeypatch.setitem(sys.modules, missing, None)
    others = [module for module in ("zmq", "msgspec", "pandas") if module != missing]
    for call, needed_by in ((lambda: kvscope.attach("tcp://127.0.0.1:1"), "kvscope.attach"),
                            (EngineKVEvents.require_dependencies, "kv_events_config")):
        with pytest.raises(ImportError) as err:
            call()
        message = str(err.value)
        assert not any(other in message for other in others), message
        assert message.startswith(f"{needed_by} needs {missing}"), message
        assert message.endswith('install it with pip install "kvscope[attach]"'), message


# ----------------------------------------------------------------------------- kvscope as a publisher
def replay_kv_events(kv) -> list[set]:
    """The cached-hash set after each step of ``trace.kv_events()`` that has events (one batch each)."""
    held, out = set(), []
    for _, step in kv.groupby("step", sort=True):
        for ev in step.itertuples():
            if ev.type == "BlockStored":
                held.update(ev.block_hashes)
            elif ev.type == "BlockRemoved":
                held.difference_update(ev.block_hashes)
            else:
                held.clear()
        out.append(set(held))
    return out


def test_round_trip_kvscope_publisher_to_attach():
    """kvscope's engine publishes; attach rebuilds, after every batch, the set trace.kv_events() replays to."""
    from engine_helpers import greedy, make_llm

    llm = make_llm(block_size=4, num_kv_blocks=24, max_num_batched_tokens=32, kv_events_config={
        "enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*",
        "topic": "kv-events", "buffer_steps": 100_000})
    pub = llm.kv_events.publisher
    att = attach_to(pub)
    seen: list[set] = []
    att.add_listener(lambda name, seq: seen.append(att.block_hashes(name)))
    try:
        shared = list(range(5, 25))
        prompts = [shared + [30 + i] * (3 + i) for i in range(6)] + [list(range(40, 58))]
        with llm.record("blocks") as trace:
            llm.generate(prompts, greedy(6), use_tqdm=False)  # evicts: the pool is smaller than the work
            llm.reset_prefix_cache()
            llm.generate(prompts[:3], greedy(4), use_tqdm=False)
        wait_for(applied(att, "p0", pub._seq - 1), what="every batch")
        kv = trace.kv_events()
        assert {"BlockStored", "BlockRemoved", "AllBlocksCleared"} <= set(kv.type)
        assert seen == replay_kv_events(kv)
        assert att.faults.iloc[0][["bad_msgpack", "unknown_tag", "lost_batches"]].sum() == 0
        held = llm.llm_engine.block_manager.hash_to_block
        assert att.block_hashes("p0") == set(held)  # and that is the engine's prefix cache now
        stored_rows = kv[kv.type == "BlockStored"]
        got = att.events[att.events.type == "BlockStored"]
        assert got.token_ids.tolist() == stored_rows.token_ids.tolist()
        assert got.parent_block_hash.tolist() == [None if pd.isna(p) else int(p) for p in stored_rows.parent_block_hash]
    finally:
        att.close()
        llm.shutdown()


def test_kv_events_config_is_checked_at_the_boundary():
    from kvscope.config import EngineConfig

    with pytest.raises(TypeError, match="unknown kv_events_config key 'endpiont'; did you mean 'endpoint'"):
        EngineConfig.from_kwargs(kv_events_config={"endpiont": "tcp://*:1"})
    with pytest.raises(ValueError, match="kv_events_config.hwm must be an integer >= 1"):
        EngineConfig.from_kwargs(kv_events_config={"enable_kv_cache_events": True, "hwm": 0})
    with pytest.raises(ValueError, match="data_parallel_rank must be an integer >= 0"):
        EngineConfig.from_kwargs(data_parallel_rank=-1)
    cfg = EngineConfig.from_kwargs(kv_events_config={"enable_kv_cache_events": True})
    assert cfg.kv_events_config.publisher == "zmq" and cfg.kv_events_config.publishes
    assert not EngineConfig.from_kwargs(kv_events_config={}).kv_events_config.publishes
