"""What ``src.metrics`` and one attach-dashboard timeline update cost as metric rows accumulate.

A long-lived ``kvscope.attach`` source scrapes many URLs (each a vLLM with several engines)
every fraction of a second for hours, so its metric rows reach ``max_events``. This fills an
attached source with ``N`` rows the way its scrape threads do: each URL's Prometheus page
(``--engines`` engines, counters that grow scrape after scrape) is parsed by the scraper's own
``parse_metrics`` and handed to the source's add path, the URLs of one round added in a shuffled
order with stamps a few milliseconds apart (a long page is added after a short one stamped
later). Nothing is mocked but the HTTP fetch and the clock.

Reported at each ``N`` (seconds, median of ``--repeats``: wall, and the CPU time of the
calling thread, which other load on the machine does not inflate):

- ``src.metrics``: the whole table read once after new rows arrived;
- the timeline: the dashboard's ``MetricsTimelineView`` (headless) shown first over all ``N``
  rows (cold), then after each of ``--repeats`` more scrape rounds (warm: what a live update
  costs), with the points it draws and the bytes a warm update puts on the wire (every
  message's JSON and binary buffers as ipywidgets hands them to the comm; nothing is sent, and
  the timings include encoding them, as a live comm would).

    python benchmarks/bench_attach_metrics.py [--rows 10000,100000,1000000] [--urls 8] [--engines 4]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import kvscope
from kvscope.attach.metrics import parse_metrics
from kvscope.widgets.attach_view import MetricsTimelineView

PAGE = "".join(name + '{{engine="{e}",model_name="Qwen/Qwen3-0.6B"}} {' + field + '}\n' for name, field in (
    ("vllm:num_requests_running", "running"), ("vllm:num_requests_waiting", "waiting"),
    ("vllm:kv_cache_usage_perc", "usage"), ("vllm:prefix_cache_queries_total", "queries"),
    ("vllm:prefix_cache_hits_total", "hits"), ("vllm:num_preemptions_total", "preemptions"),
))


class Deployment:
    """``urls`` vLLM servers of ``engines`` engines each, scraped every ``interval`` seconds."""

    def __init__(self, urls: int, engines: int, interval: float, seed: int = 0) -> None:
        self.names = [f"10.0.0.{u}:8000" for u in range(urls)]
        self.engines, self.interval = engines, interval
        self.rng = random.Random(seed)
        self.round = 0
        self.totals = {(u, e): [0, 0, 0] for u in range(urls) for e in range(engines)}  # queries, hits, preemptions
        self.start = time.time()

    def page(self, u: int) -> str:
        out = []
        for e in range(self.engines):
            t = self.totals[(u, e)]
            t[0] += self.rng.randrange(0, 4096)
            t[1] += self.rng.randrange(0, t[0] - t[1] + 1) // 2
            t[2] += self.rng.random() < 0.01
            out.append(PAGE.format(e=e, running=self.rng.randrange(64), waiting=self.rng.randrange(16),
                                   usage=self.rng.random(), queries=t[0], hits=t[1], preemptions=t[2]))
        return "".join(out)

    def scrape_round(self, add) -> int:
        """One round: every URL's page parsed and added, in a shuffled order; the rows added."""
        base = self.start + self.round * self.interval
        order = list(range(len(self.names)))
        self.rng.shuffle(order)
        n = 0
        for u in order:
            rows = parse_metrics(self.page(u), self.names[u], base + 0.002 * u)
            add(rows)
            n += len(rows)
        self.round += 1
        return n


def timed(fn) -> tuple[float, float]:
    """``(wall, thread CPU)`` seconds of ``fn()``."""
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - wall, time.thread_time() - cpu


def medians(times: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def measure(n: int, args: argparse.Namespace) -> dict:
    dep = Deployment(args.urls, args.engines, args.interval)
    with kvscope.attach("tcp://127.0.0.1:9", max_events=args.max_events) as src:  # no publisher: metrics only
        added = 0
        while added < n:
            added += dep.scrape_round(src._add_metrics)
        table = []
        for _ in range(args.repeats):
            dep.scrape_round(src._add_metrics)
            table.append(timed(lambda: src.metrics))
        view = MetricsTimelineView()
        sent = [0]

        def wire(msg: dict, buffers: list | None = None, send=view._send) -> None:
            sent[0] += len(json.dumps(msg, default=repr)) + sum(memoryview(b).nbytes for b in buffers or [])
            send(msg, buffers)

        view._send = wire
        cold = timed(lambda: view.show(src, dep.start))
        sent[0], warm = 0, []
        for _ in range(args.repeats):
            dep.scrape_round(src._add_metrics)
            warm.append(timed(lambda: view.show(src, dep.start)))
        return {"held": len(src.metrics), "table": medians(table), "cold": cold, "warm": medians(warm),
                "drawn": sum(len(tr.x) for tr in view.data), "bytes": sent[0] / args.repeats}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="10000,100000,1000000", help="N, comma-separated")
    ap.add_argument("--urls", type=int, default=8)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--interval", type=float, default=0.25, help="seconds between two scrapes of a URL")
    ap.add_argument("--max-events", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; {args.urls} URLs x "
          f"{args.engines} engines = {args.urls * args.engines} rows a round, max_events {args.max_events:,}")
    for n in (int(x) for x in args.rows.split(",")):
        r = measure(n, args)
        print(f"N={n:>9,} (held {r['held']:,}): src.metrics {r['table'][0]:.4f} s wall / {r['table'][1]:.4f} s CPU; "
              f"timeline cold {r['cold'][0]:.4f} / {r['cold'][1]:.4f} s, warm update {r['warm'][0]:.4f} / "
              f"{r['warm'][1]:.4f} s, {r['drawn']:,} points drawn, {r['bytes'] / 1024:,.1f} KiB sent", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
