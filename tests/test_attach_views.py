"""The attach dashboard shows what the attached tables hold: forests, overlap, faults, metric timelines."""
import math
import threading

import pytest

pytest.importorskip("anywidget")
pytest.importorskip("plotly")
pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from attach_helpers import applied, attach_to, metrics_server, publisher, wait_for  # noqa: E402

import kvscope  # noqa: E402
from kvscope.attach import MIN_METRICS_INTERVAL  # noqa: E402
from kvscope.attach.wire import removed, stored  # noqa: E402
from kvscope.widgets.attach_view import AttachDashboard, AttachView  # noqa: E402
from kvscope.widgets.attach_snapshot import forest_state  # noqa: E402


@pytest.fixture
def replicas():
    """Four replicas (the hand count of tests/test_attach.py): S = 100-101-102 everywhere, then
    A, B: 200-201; C: 300; D: 300 (301 stored, then evicted)."""
    pubs = [publisher() for _ in range(4)]
    att = attach_to(*pubs)
    chains = {0: [200, 201], 1: [200, 201], 2: [300], 3: [300, 301]}
    for i, pub in enumerate(pubs):
        pub.publish([stored([100, 101, 102], None, list(range(12)), 4)])
        pub.publish([stored(chains[i], 102, list(range(4 * len(chains[i]))), 4)])
    pubs[3].publish([removed([301])])
    for i, last in enumerate((1, 1, 1, 2)):
        wait_for(applied(att, f"p{i}", last))
    yield att, pubs
    att.close()
    for p in pubs:
        p.close()


def test_overlap_and_forest_views_match_the_hand_count(replicas):
    att, _ = replicas
    dash = kvscope.dashboard(att)
    try:
        assert isinstance(dash, AttachDashboard)
        ov = dash.cache.overlap
        assert ov["duplication"] == {"total_blocks": 18, "unique_blocks": 6, "duplicated_blocks": 12,
                                     "duplicated_fraction": 12 / 18}
        assert ov["instances"] == ["p0", "p1", "p2", "p3"]
        assert ov["matrix"] == [[5, 5, 3, 3], [5, 5, 3, 3], [3, 3, 4, 4], [3, 3, 4, 4]]
        shared = [tuple(s[:3]) + (tuple(s[3]),) for s in ov["shared"]]  # (hash, depth, held by, who)
        assert shared[:3] == [("102", 2, 4, ("p0", "p1", "p2", "p3")), ("101", 1, 4, ("p0", "p1", "p2", "p3")),
                              ("100", 0, 4, ("p0", "p1", "p2", "p3"))]
        assert shared[3] == ("201", 4, 2, ("p0", "p1"))
        assert set(shared[4:]) == {("200", 3, 2, ("p0", "p1")), ("300", 3, 2, ("p2", "p3"))}
        forests = {f["instance"]: f for f in dash.cache.forest["instances"]}
        # a chain: (hash, depth, offset, size, held by) -- size counts the blocks sharing the prefix
        assert [n[:5] for n in forests["p0"]["nodes"]] == [
            ["100", 0, 0, 5, 4], ["101", 1, 1, 4, 4], ["102", 2, 2, 3, 4], ["200", 3, 3, 2, 2], ["201", 4, 4, 1, 2]]
        assert [n[:5] for n in forests["p3"]["nodes"]] == [
            ["100", 0, 0, 4, 4], ["101", 1, 1, 3, 4], ["102", 2, 2, 2, 4], ["300", 3, 3, 1, 2]]
        assert forests["p0"]["nodes"][1][5] == [4, 5, 6, 7]  # the tokens hover shows
        assert set(dash.cache.unavailable) == {"pool", "tables", "slots", "queues"}
        assert [f["instance"] for f in dash.cache.faults] == ["p0", "p1", "p2", "p3"]
        assert all(v == 0 for f in dash.cache.faults for k, v in f.items() if k != "instance")
    finally:
        dash.detach()


def test_branching_forest_and_live_updates():
    with publisher() as pub:
        att = attach_to(pub)
        try:
            pub.publish([stored([1, 2, 3], None, list(range(6)), 2)])
            wait_for(applied(att, "p0", 0))
            dash = kvscope.dashboard(att, interval=0.05, tokenizer=type("T", (), {"decode": lambda self, t: f"<{len(t)}>"})())
            try:
                before = dash.num_updates
                pub.publish([stored([4], 1, [7, 8], 2), stored([5], 4, [9, 9], 2)])  # 1 -> {2 -> 3, 4 -> 5}
                wait_for(lambda: dash.num_updates > before and len(dash.cache.forest["instances"][0]["nodes"]) == 5)
                nodes = {n[0]: n for n in dash.cache.forest["instances"][0]["nodes"]}
                assert {h: (n[1], n[3]) for h, n in nodes.items()} == {  # (depth, size) by hand
                    "1": (0, 5), "2": (1, 2), "3": (2, 1), "4": (1, 2), "5": (2, 1)}
                # children split their parent's span below the parent's own row
                assert nodes["2"][2] == 1 and nodes["3"][2] == 2 and nodes["4"][2] == 3 and nodes["5"][2] == 4
                assert nodes["4"][6] == "<2>"
                pub.publish([removed([1, 2, 3, 4, 5])])
                wait_for(lambda: dash.cache.forest["instances"][0]["nodes"] == [])
            finally:
                dash.detach()
        finally:
            att.close()


def test_the_forest_draws_every_block_of_a_parent_loop():
    """Blocks that are each other's parent (a malformed stream) and a child of theirs are all
    drawn, each once: the forest's height is the number of blocks held."""
    with publisher() as pub:
        att = attach_to(pub)
        try:
            pub.publish([stored([1], 2, [1, 1], 2), stored([2], 1, [2, 2], 2), stored([3], 1, [3, 3], 2),
                         stored([4], 4, [4, 4], 2)])
            wait_for(applied(att, "p0", 0))
            forest = forest_state(att)["instances"][0]
            drawn = sorted(n[0] for n in forest["nodes"])
            assert drawn == ["1", "2", "3", "4"] and forest["height"] == forest["num_blocks"] == 4
        finally:
            att.close()


def test_views_that_need_block_ids_say_so(replicas):
    att, _ = replicas
    dash = kvscope.dashboard(att, views=["pool"])
    try:
        assert "physical block ids" in dash.cache.unavailable["pool"] and dash.timeline is None
    finally:
        dash.detach()
    with pytest.raises(ValueError, match="unknown views \\['bogus'\\] for an attached source"):
        kvscope.dashboard(att, views=["bogus"])


def test_an_interval_past_a_day_is_refused_before_the_redraw_thread_starts(replicas):
    """The redraw thread waits ``interval`` between redraws: one past threading's longest wait
    killed it with an OverflowError as it started, so the dashboard never redrew."""
    att, _ = replicas
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ValueError, match=r"^interval must be a finite number of seconds >= 0 and <= 86400, got 10000000000\.0$"):
        kvscope.dashboard(att, interval=1e10)
    assert "kvscope-attach-dashboard" not in {t.name for t in threading.enumerate()} - before


def test_timeline_plots_the_scraped_metrics():
    """Counters grow by 100 queries and 60 hits per scrape: the hit rate between scrapes is 60 %."""
    scrapes = []

    def page() -> str:
        n = len(scrapes)
        scrapes.append(n)
        return (f'vllm:num_requests_running{{engine="0"}} {n}\nvllm:num_requests_waiting{{engine="0"}} 2\n'
                f'vllm:kv_cache_usage_perc{{engine="0"}} 0.25\nvllm:prefix_cache_queries_total{{engine="0"}} {100 * n}\n'
                f'vllm:prefix_cache_hits_total{{engine="0"}} {60 * n}\nvllm:num_preemptions_total{{engine="0"}} {n}\n')

    with metrics_server(page) as url, publisher() as pub:
        att = attach_to(pub, metrics_urls=url, metrics_interval=MIN_METRICS_INTERVAL)
        dash = kvscope.dashboard(att, interval=0.05)
        try:
            wait_for(lambda: len(att.metrics) >= 4)
            dash.refresh()
            by_name = {t.name: t for t in dash.timeline.data}
            rate = [y for y in by_name["p0 prefix hit rate %"].y if not math.isnan(y)]
            assert len(rate) >= 3 and all(abs(y - 60.0) < 1e-9 for y in rate)
            usage, running = list(by_name["p0 KV usage %"].y), list(by_name["p0 running"].y)
            assert len(usage) >= 4 and usage == [25.0] * len(usage)
            assert running == list(range(int(running[0]), int(running[0]) + len(running)))  # the n-th scrape says n
        finally:
            dash.detach()
            att.close()


def test_faults_show_in_the_view():
    """A bad payload and a dropped batch are counted, shown, and the view keeps drawing."""
    with publisher() as pub:
        att = attach_to(pub)
        dash = kvscope.dashboard(att, interval=0.05)
        try:
            pub.publish([stored([1], None, [1, 2], 2)])
            pub.send(b"\xc1")  # not msgpack
            real, pub._pub = pub._pub, type("Drop", (), {"send_multipart": lambda self, frames: None})()
            pub.publish([stored([2], 1, [3, 4], 2)])  # lost on the wire, back through replay
            pub._pub = real
            last = pub.publish([{"type": "BlockMoved"}, stored([3], 2, [5, 6], 2)])
            wait_for(applied(att, "p0", last))
            wait_for(lambda: dash.cache.faults[0]["gaps"] == 1 and dash.cache.faults[0]["bad_msgpack"] == 1)
            shown = dash.cache.faults[0]
            assert (shown["unknown_tag"], shown["replayed_batches"], shown["lost_batches"]) == (1, 1, 0)
            assert [n[0] for n in dash.cache.forest["instances"][0]["nodes"]] == ["1", "2", "3"]
        finally:
            dash.detach()
            att.close()


@pytest.mark.browser
def test_attach_view_renders_in_chromium(replicas, tmp_path):
    """The static page (``dash.to_html``: the view's ES module with an in-page model) draws one canvas
    per instance with its nodes and the overlap table, with no page error."""
    from browser.lab import CHROMIUM, CHROMIUM_ARGS, missing

    if missing():
        pytest.skip(missing())
    from playwright.sync_api import sync_playwright

    att, _ = replicas
    dash = kvscope.dashboard(att)
    dash.detach()
    state = {k: getattr(dash.cache, k) for k in AttachView.STATE}
    page_html = dash.to_html(tmp_path / "attach.html")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(page_html.as_uri())
            page.wait_for_selector("body[data-done='1']", timeout=15_000)
            nodes = page.eval_on_selector_all("canvas.kvs-forest-canvas", "cs => cs.map((c) => Number(c.dataset.nodes))")
            assert nodes == [len(f["nodes"]) for f in state["forest"]["instances"]] == [5, 5, 4, 4]
            assert page.get_attribute(".kvs-overlap", "data-duplicated") == "12"
            assert page.locator(".kvs-unavailable [data-view]").count() == 4
            page.hover("canvas.kvs-forest-canvas >> nth=0", position={"x": 5, "y": 5})
            assert "block 100" in page.inner_text(".kvs-tip") and "held by 4 instances" in page.inner_text(".kvs-tip")
            assert errors == []
        finally:
            browser.close()
