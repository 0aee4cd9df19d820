"""The attach dashboard's metric timeline follows src.metrics incrementally: what it draws after
any sequence of updates equals the series computed from scratch from src.metrics, across the
max_events cap dropping rows and URLs whose rows arrive out of time order, and an update reads
only the rows added since the last one."""
import random
from collections import deque
from operator import itemgetter

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("anywidget")
pytest.importorskip("plotly")
pytest.importorskip("zmq")
pytest.importorskip("msgspec")

import kvscope  # noqa: E402
from kvscope.attach.metrics import parse_metrics  # noqa: E402
from kvscope.attach.tables import SCHEMAS  # noqa: E402
from kvscope.trace.tables import frame  # noqa: E402
from kvscope.widgets.attach_view import METRIC_PLOTS, MetricsTimelineView  # noqa: E402

COUNTERS = ["prefix_cache_queries", "prefix_cache_hits", "num_preemptions"]
GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"]
NAMES = {"num_requests_running": "vllm:num_requests_running", "num_requests_waiting": "vllm:num_requests_waiting",
         "kv_cache_usage_perc": "vllm:kv_cache_usage_perc", "prefix_cache_queries": "vllm:prefix_cache_queries_total",
         "prefix_cache_hits": "vllm:prefix_cache_hits_total", "num_preemptions": "vllm:num_preemptions_total"}


def rebuilt(metrics: pd.DataFrame, origin: float, width: float) -> dict[str, dict[str, np.ndarray]]:
    """The timeline's series from scratch, from the whole table: per (instance, rank) in time order,
    rows in bins floor((time_s - origin) / width); a point is its bin's mean time and gauges, and
    over the span from the scrape before the bin's first (its first, for the series' first held
    row) to its last, the prefix hit rate and the preemptions per scrape."""
    multi = metrics.data_parallel_rank.nunique() > 1
    out = {}
    for (instance, rank), g in metrics.groupby(["instance", "data_parallel_rank"], sort=True):
        g = g.reset_index(drop=True).assign(x=lambda d: d.time_s - origin)
        g["bin"] = np.floor(g.x / width)
        by = g.groupby("bin", sort=True)
        first, last = by.head(1), by.tail(1)
        has_prev = (first.index > 0)[:, None]
        ref = np.where(has_prev, g[COUNTERS].shift(1).loc[first.index].to_numpy(), first[COUNTERS].to_numpy())
        dq, dh, dp = (last[COUNTERS].to_numpy() - ref).T
        scrapes = by.size().to_numpy() - (~has_prev[:, 0])
        mean = by[["x", *GAUGES]].mean()
        with np.errstate(invalid="ignore", divide="ignore"):
            out[f"{instance}/dp{rank}" if multi else instance] = {
                "time_s": mean.x.to_numpy(), "running": mean.num_requests_running.to_numpy(),
                "waiting": mean.num_requests_waiting.to_numpy(), "kv_usage_pct": 100 * mean.kv_cache_usage_perc.to_numpy(),
                "hit_rate_pct": np.where(dq > 0, 100 * dh / dq, np.nan),
                "preemptions": np.where(scrapes > 0, dp / scrapes, np.nan),
            }
    return out


def drawn(view: MetricsTimelineView) -> dict[str, dict[str, np.ndarray]]:
    """What the view's traces hold, as rebuilt's series (x: each series' time)."""
    out: dict[str, dict[str, np.ndarray]] = {}
    labels = {label: col for col, _, label in METRIC_PLOTS}
    for t in view.data:
        for label, col in labels.items():
            if t.name.endswith(" " + label):
                series = out.setdefault(t.name[:-len(label) - 1], {})
                series["time_s"], series[col] = np.asarray(t.x, float), np.asarray(t.y, float)
    return out


def assert_same_series(actual: dict, expected: dict) -> None:
    assert list(actual) == list(expected)
    for key, cols in expected.items():
        assert set(actual[key]) == set(cols), key
        for col, values in cols.items():
            np.testing.assert_allclose(actual[key][col], values, rtol=1e-9, atol=1e-9, equal_nan=True,
                                       err_msg=f"{key} {col}")


class Deployment:
    """``urls`` vLLM servers of ``engines`` engines, each scrape a Prometheus page parsed by the
    scraper's parse_metrics and added through the source's add path, the URLs of a round in a
    shuffled order and stamped a few ms apart (so added out of time order). Counters grow (and
    now and then restart from 0), a metric is now and then missing from a page, a URL now and
    then misses a round."""

    def __init__(self, src, rng: random.Random, urls: int, engines: int, start: float) -> None:
        self.src, self.rng, self.engines, self.t = src, rng, engines, start
        self.urls = [f"u{u}" for u in range(urls)]
        self.totals = {(u, e): [0.0, 0.0, 0.0] for u in self.urls for e in range(engines)}
        self.added: list[tuple] = []  # every row, in the order added

    def page(self, url: str) -> str:
        lines = []
        for e in range(self.engines):
            tot = self.totals[(url, e)]
            if self.rng.random() < 0.02:
                tot[:] = [0.0, 0.0, 0.0]
            tot[0] += self.rng.randrange(0, 50)
            tot[1] = min(tot[0], tot[1] + self.rng.randrange(0, 40))
            tot[2] += self.rng.random() < 0.2
            values = {"num_requests_running": self.rng.randrange(9), "num_requests_waiting": self.rng.randrange(5),
                      "kv_cache_usage_perc": self.rng.random(), "prefix_cache_queries": tot[0],
                      "prefix_cache_hits": tot[1], "num_preemptions": tot[2]}
            lines += [f'{NAMES[c]}{{engine="{e}"}} {v}\n' for c, v in values.items() if self.rng.random() > 0.05]
        return "".join(lines)

    def scrape(self) -> None:
        self.t += self.rng.uniform(0.1, 0.6)
        order = self.urls[:]
        self.rng.shuffle(order)
        for url in order:
            if self.rng.random() < 0.1:
                continue
            rows = parse_metrics(self.page(url), url, self.t + 0.004 * self.urls.index(url))
            self.src._add_metrics(rows)
            self.added += rows


class Racing:
    """The attached source, whose scrape threads add rows while the timeline reads: before a read,
    now and then, rounds come in (enough, at times, to push rows out past max_events)."""

    def __init__(self, src, dep: Deployment, rng: random.Random, cap: int) -> None:
        self.src, self.dep, self.rng, self.cap = src, dep, rng, cap
        self.on, self.dropped = False, 0  # racing now; reads before which rows were dropped
        self.reads = 0  # since the update began: one that never catches up fails, not hangs

    def metric_rows(self, *args):
        self.reads += 1
        assert self.reads < 1000, "an update that never ends"
        if self.on and self.rng.random() < 0.5:
            first = self.src.metric_rows().first
            for _ in range(self.rng.choice([1, 3, self.cap])):
                self.dep.scrape()
            self.dropped += self.src.metric_rows().first > first
        return self.src.metric_rows(*args)


@pytest.mark.parametrize("seed", range(6))
def test_the_drawn_timeline_equals_the_series_rebuilt_from_src_metrics(seed, monkeypatch):
    """Many updates, each after 0 to many scrape rounds (past max_events at times, so rows go
    before the timeline read them), with max_events and max_points small so that rows are
    dropped and bins merged, and (odd seeds) a backlog taken in a few rows at a time: after each
    update, every trace equals what ``rebuilt`` computes from src.metrics at the view's bin width.
    Half the updates race rows coming in (and going) between their reads: those show the rows
    numbered from the oldest held at their last read up to the last they read, rebuilt from a
    copy of every row added."""
    rng = random.Random(seed)
    if seed % 2:
        monkeypatch.setattr("kvscope.widgets.metric_bins.CHUNK_ROWS", 7)
    cap, max_points = rng.choice([60, 150, 400]), rng.choice([4, 16, 50])
    with kvscope.attach("tcp://127.0.0.1:9", max_events=cap) as src:  # nothing publishes: metrics only
        dep = Deployment(src, rng, urls=rng.randrange(2, 4), engines=rng.randrange(1, 3), start=1.7e9)
        racing = Racing(src, dep, rng, cap)
        origin = dep.t + 3.0  # rows before the dashboard began, too
        view = MetricsTimelineView(max_points=max_points)
        seen = {"behind": 0, "merged": 0, "dropped": 0}
        for _ in range(60):
            for _ in range(rng.choice([0, 1, 1, 2, 5, cap])):  # (cap rounds: more than cap rows)
                dep.scrape()
            bins = view.bins
            if bins is not None and src.metric_rows(bins.cursor).start > bins.cursor:
                seen["behind"] += 1
            racing.on, racing.reads = rng.random() < 0.5, 0
            view.show(racing, origin)
            bins = view.bins
            if racing.on:
                rows = dep.added[bins.held_from:bins.cursor]
                table = frame(SCHEMAS["metrics"], sorted(rows, key=itemgetter(0)))
            else:
                table = src.metrics
            assert_same_series(drawn(view), rebuilt(table, origin, bins.width))
            seen["merged"] += bins.width > 2.0 ** -10
            seen["dropped"] += src.metric_rows().first > 0
        times = [row[0] for row in dep.added]
    assert all(seen.values()) and racing.dropped and times != sorted(times), \
        f"the premises: {seen}, {racing.dropped} reads raced by drops, added out of time order"


def test_an_update_reads_only_the_rows_added_since_the_last():
    """After K new rows, an update reads K rows of the source (none of the rows it read before)
    however many are held; at the cap, K plus at most a few bins' worth of the oldest held rows
    (a bin that lost some rows is recomputed from those it still has)."""

    class Counting:
        """The attached source, counting the metric rows each read hands out."""

        def __init__(self, src) -> None:
            self.src, self.rows = src, 0

        @property
        def metrics(self) -> pd.DataFrame:
            m = self.src.metrics
            self.rows += len(m)
            return m

        def metric_rows(self, *args):
            cols = self.src.metric_rows(*args)
            self.rows += len(cols.time_s)
            return cols

    rng = random.Random(7)
    max_points, cap = 50, 4000
    with kvscope.attach("tcp://127.0.0.1:9", max_events=cap) as src:
        dep = Deployment(src, rng, urls=3, engines=2, start=1.7e9)
        counting, view = Counting(src), MetricsTimelineView()
        while len(dep.added) < cap // 2:
            dep.scrape()
        origin = dep.t
        view.show(counting, origin)
        for _ in range(10):
            before, held = len(dep.added), len(src.metrics)
            dep.scrape()
            counting.rows = 0
            view.show(counting, origin)
            assert counting.rows == len(dep.added) - before, f"{held} rows held"
        narrow = MetricsTimelineView(max_points=max_points)  # bins of many rows: the oldest loses some
        while src.metric_rows().first == 0:
            dep.scrape()
        narrow.show(counting, origin)
        extra = []
        for _ in range(10):
            before = len(dep.added)
            dep.scrape()
            counting.rows = 0
            narrow.show(counting, origin)
            extra.append(counting.rows - (len(dep.added) - before))
        assert 0 <= min(extra) and max(extra) <= 4 * cap // max_points, extra
        assert max(extra) > 0, "the premise: a bin lost some of its rows and was recomputed"


def test_the_drawn_points_stay_bounded_however_many_rows():
    """Points per trace stay within max_points (default 1500) while rows per series go far past it."""
    rng = random.Random(3)
    with kvscope.attach("tcp://127.0.0.1:9") as src:
        dep = Deployment(src, rng, urls=1, engines=1, start=1.7e9)
        view = MetricsTimelineView()
        for _ in range(4000):
            dep.scrape()
        view.show(src, dep.t)
        assert len(src.metrics) > 3000
        assert 0 < max(len(t.x) for t in view.data) <= 1500


def test_src_metrics_holds_the_last_max_events_rows_added_in_time_order():
    """The table against a reference (a deque of the rows, capped at max_events, sorted stably by
    time_s), over adds of any size (one larger than the cap included): the earliest added rows go
    first, and a table read and then changed does not change the next read."""
    rng = random.Random(5)
    for cap in (1, 7, 100, 5000):
        with kvscope.attach("tcp://127.0.0.1:9", max_events=cap) as src:
            reference = deque(maxlen=cap)
            for _ in range(300):
                rows = [(float(rng.randrange(50)), rng.choice(["a", "b", "c"]), rng.randrange(3),
                         *[rng.choice([np.nan, rng.random()]) for _ in range(6)]) for _ in range(rng.randrange(0, 12))]
                src._add_metrics(rows)
                reference.extend(rows)
                if rng.random() < 0.2:
                    expected = frame(SCHEMAS["metrics"], sorted(reference, key=itemgetter(0)))
                    got = src.metrics
                    pd.testing.assert_frame_equal(got, expected)
                    got.loc[0, "time_s"] = -1.0
                    got["instance"] = "changed"
                    pd.testing.assert_frame_equal(src.metrics, expected)


def test_updates_from_several_threads_take_each_row_once():
    """The live loop's thread and a notebook's ``dash.refresh()`` may update the timeline at
    once: every row is still taken in once (the series equal those rebuilt from src.metrics)."""
    import threading

    rng = random.Random(11)
    with kvscope.attach("tcp://127.0.0.1:9", max_events=300) as src:
        dep = Deployment(src, rng, urls=3, engines=2, start=1.7e9)
        view = MetricsTimelineView(max_points=16)
        view.show(src, dep.t)
        stop, errors = threading.Event(), []

        def refresh() -> None:
            try:
                while not stop.is_set():
                    view.bins.update()
            except Exception as exc:  # noqa: BLE001 - reported below, in the test's thread
                errors.append(exc)

        threads = [threading.Thread(target=refresh) for _ in range(3)]
        for t in threads:
            t.start()
        for _ in range(600):
            dep.scrape()
        stop.set()
        for t in threads:
            t.join()
        assert errors == []
        view.show(src, view.bins.origin)
        assert_same_series(drawn(view), rebuilt(src.metrics, view.bins.origin, view.bins.width))
