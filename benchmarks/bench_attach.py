"""KV events decoded and applied per second by ``kvscope.attach``, in vLLM's wire format.

Two figures over the same synthetic stream (a prefix cache of ``--blocks`` distinct hashes,
one ``BlockStored`` with 16 token ids or one ``BlockRemoved`` per event, ``--batch`` events per
batch, as vLLM sends one batch per engine step):

- in process: msgpack decode + the prefix-cache update + the event log, no sockets;
- end to end: a ``KVEventPublisher`` on loopback -> ``kvscope.attach`` (its subscriber thread
  decodes and applies), timed from the first publish to the last batch applied.

``--beside-mute SECONDS`` measures instead how long a publisher's batches take to apply while
another attached publisher's replay socket takes requests and never answers: that one skips a
number every half second (a gap, which asks its replay socket), and the good one publishes a
batch every 20 ms for that many seconds; the latency is the publish to the batch applied.

    python benchmarks/bench_attach.py [--events 200000] [--batch 64] [--encoding map|array]
    python benchmarks/bench_attach.py --beside-mute 10 [--replay-timeout 2.0]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import threading
import time

import msgspec

import kvscope
from kvscope.attach.cache import PrefixCache
from kvscope.attach.publisher import KVEventPublisher
from kvscope.attach.wire import Codec, removed, stored


def event_stream(n: int, blocks: int, seed: int = 0) -> list[dict]:
    """Stores of fresh hashes chained to a live parent, and removals of live ones (about 1 in 3)."""
    rng = random.Random(seed)
    live: list[int] = []
    events, next_hash = [], 1
    for _ in range(n):
        if live and (len(live) >= blocks or rng.random() < 0.33):
            h = live.pop(rng.randrange(len(live)))
            events.append(removed([h], "GPU"))
        else:
            parent = rng.choice(live) if live and rng.random() < 0.8 else None
            events.append(stored([next_hash], parent, list(range(next_hash, next_hash + 16)), 16, medium="GPU"))
            live.append(next_hash)
            next_hash += 1
    return events


def as_array_like(batch_events: list[dict]) -> list[list]:
    """The pre-map encoding (vLLM's ``array_like=True`` structs): tag first, then fields in order."""
    return [[e["type"], *list(e.values())[1:]] for e in batch_events]


def beside_mute(seconds: float, replay_timeout: float) -> None:
    """Latency of one publisher's batches while another's gaps ask a replay socket that never answers."""
    import zmq

    from kvscope.attach.wire import seq_bytes

    ctx = zmq.Context.instance()
    raw, mute = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    port, mute_port = raw.bind_to_random_port("tcp://127.0.0.1"), mute.bind_to_random_port("tcp://127.0.0.1")
    codec, applied, lock = Codec(), {}, threading.Lock()

    def on_batch(name: str, seq: int) -> None:
        if name == "good":
            with lock:
                applied[seq] = time.perf_counter()

    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    with KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv-events") as good:
        with kvscope.attach({"bad": f"tcp://127.0.0.1:{port}", "good": good.endpoint},
                            replay_endpoints={"bad": f"tcp://127.0.0.1:{mute_port}", "good": good.replay_endpoint},
                            replay_timeout=replay_timeout) as att:
            att.add_listener(on_batch)
            bad = att.streams[0]
            while bad.next_seq != 1:  # the subscription reaches the bare publisher
                raw.send_multipart([b"kv-events", seq_bytes(0), codec.encode(0.0, [], 0)])
                time.sleep(0.05)
            sent, bad_seq, next_gap = {}, 0, time.perf_counter()
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                now = time.perf_counter()
                if now >= next_gap:
                    bad_seq += 2
                    raw.send_multipart([b"kv-events", seq_bytes(bad_seq), codec.encode(0.0, [], 0)])
                    next_gap = now + 0.5
                seq = good.publish([stored([len(sent) + 1], None, [1, 2], 2)])
                sent[seq] = time.perf_counter()
                time.sleep(0.02)
            deadline = time.perf_counter() + replay_timeout + 5
            while len(applied) < len(sent) and time.perf_counter() < deadline:
                time.sleep(0.01)
            gaps = bad.faults["gaps"]
    with lock:
        lat = sorted((applied[q] - t) * 1000 for q, t in sent.items() if q in applied)
    print(f"beside a mute replay socket (replay_timeout {replay_timeout} s, {gaps} gaps asked of it): "
          f"{len(lat)} of {len(sent)} batches applied; latency ms median {statistics.median(lat):.1f}, "
          f"p90 {lat[int(0.9 * (len(lat) - 1))]:.1f}, p99 {lat[int(0.99 * (len(lat) - 1))]:.1f}, max {lat[-1]:.1f}; "
          f"load average after: {os.getloadavg()[0]:.2f}")
    raw.close(linger=0)
    mute.close(linger=0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=20_000)
    ap.add_argument("--encoding", choices=("map", "array"), default="map")
    ap.add_argument("--beside-mute", type=float, default=None, metavar="SECONDS")
    ap.add_argument("--replay-timeout", type=float, default=2.0)
    args = ap.parse_args()
    if args.beside_mute is not None:
        beside_mute(args.beside_mute, args.replay_timeout)
        return
    events = event_stream(args.events, args.blocks)
    batches = [events[i:i + args.batch] for i in range(0, len(events), args.batch)]
    codec = Codec()
    if args.encoding == "map":
        payloads = [codec.encode(float(i), b, 0) for i, b in enumerate(batches)]
    else:
        payloads = [msgspec.msgpack.encode([float(i), as_array_like(b), 0]) for i, b in enumerate(batches)]

    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    cache, log = PrefixCache(), []
    t, cpu = time.perf_counter(), time.process_time()
    for seq, payload in enumerate(payloads):  # what the subscriber thread does per batch
        batch = codec.decode(payload)
        cache.apply(batch.events)
        log.append(("bench", 0, seq, batch.ts, batch.events))
    local, cpu = time.perf_counter() - t, time.process_time() - cpu
    print(f"in process ({args.encoding}): {len(events):,} events in {local:.3f} s wall, {cpu:.3f} s CPU -> "
          f"{len(events) / local:,.0f} events/s ({len(events) / cpu:,.0f} per CPU-second; "
          f"{len(cache.blocks):,} blocks held)")

    with KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv-events",
                          buffer_steps=len(batches) + 1) as pub:
        with kvscope.attach(pub.endpoint, replay_endpoints=pub.replay_endpoint) as att:
            time.sleep(0.5)  # the subscription reaches the publisher
            stream = att.streams[0]
            t, cpu = time.perf_counter(), time.process_time()
            for payload in payloads:
                pub.send(payload)
            while stream.next_seq != len(batches):
                time.sleep(0.0005)
            wire, cpu = time.perf_counter() - t, time.process_time() - cpu
            held = len(att.blocks)
            f = att.faults.iloc[0]
    print(f"end to end over loopback ({args.encoding}): {len(events):,} events in {wire:.3f} s wall, {cpu:.3f} s CPU "
          f"(publisher and subscriber) -> {len(events) / wire:,.0f} events/s ({held:,} blocks held; "
          f"gaps {f.gaps}, replayed {f.replayed_batches}); load average after: {os.getloadavg()[0]:.2f}")
    assert held == len(cache.blocks)


if __name__ == "__main__":
    main()
