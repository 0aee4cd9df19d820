"""KV events decoded and applied per second by ``kvscope.attach``, in vLLM's wire format.

Two figures over the same synthetic stream (a prefix cache of ``--blocks`` distinct hashes,
one ``BlockStored`` with 16 token ids or one ``BlockRemoved`` per event, ``--batch`` events per
batch, as vLLM sends one batch per engine step):

- in process: msgpack decode + the prefix-cache update + the event log, no sockets;
- end to end: a ``KVEventPublisher`` on loopback -> ``kvscope.attach`` (its subscriber thread
  decodes and applies), timed from the first publish to the last batch applied.

    python benchmarks/bench_attach.py [--events 200000] [--batch 64] [--encoding map|array]
"""
from __future__ import annotations

import argparse
import os
import random
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=20_000)
    ap.add_argument("--encoding", choices=("map", "array"), default="map")
    args = ap.parse_args()
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
