"""The timeline's series stays bounded on a long live run and still draws a faithful summary of
every step: each drawn point is the mean of its bin of steps, checked against the trace's own
``steps`` table, live and replayed."""
from __future__ import annotations

import gc

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("anywidget")
pytest.importorskip("plotly")

from engine_helpers import greedy, make_llm  # noqa: E402

from kvscope.trace import Trace  # noqa: E402
from kvscope.trace.record import StepRecord  # noqa: E402
from kvscope.widgets import Dashboard  # noqa: E402
from kvscope.widgets.snapshot import StepSeries  # noqa: E402
from kvscope.widgets.views import TIMELINE_SERIES, timeline_frame  # noqa: E402

# One request at a time, so a few short requests make many steps; a shared prefix makes prefix hits.
ENGINE = dict(num_kv_blocks=40, block_size=8, max_num_batched_tokens=32, max_num_seqs=1, validate=False)
PROMPTS = ["a paged key value cache stores attention keys and values in blocks " + w
           for w in ("one", "two", "three", "four", "five", "six")] + ["every sequence owns a block table"] * 3


def per_step(steps: pd.DataFrame) -> pd.DataFrame:
    """What the timeline draws for each step, from ``trace.steps`` alone."""
    queries, hits = steps["prefix_cache_queries"].cumsum(), steps["prefix_cache_hits"].cumsum()
    return pd.DataFrame({
        "step": steps["step"], "prefill_tokens": steps["num_prefill_tokens"], "decode_tokens": steps["num_decode_tokens"],
        "kv_usage_pct": 100 * steps["kv_cache_usage_perc"],
        "prefix_hit_pct": (100 * hits.astype(float) / queries).where(queries > 0),
        "preemptions": steps["num_preemptions"], "latency_ms": 1000 * steps["duration_s"],
    }).astype(float)


def reference_bins(steps: pd.DataFrame, max_points: int) -> tuple[int, dict[str, np.ndarray]]:
    """Bin width and per-bin means (NaN in a bin makes its mean NaN): groups of ``width``
    consecutive steps from the first, ``width`` the smallest power of two giving at most
    ``max_points`` groups."""
    values = per_step(steps)
    n, width = len(values), 1
    while -(-n // width) > max_points:
        width *= 2
    means = np.array([values.iloc[a:a + width].to_numpy().mean(axis=0) for a in range(0, n, width)])
    return width, {c: means[:, i] for i, c in enumerate(values.columns)}


def assert_same_bins(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for c in want:
        np.testing.assert_allclose(np.asarray(got[c], float), want[c], rtol=1e-12, equal_nan=True, err_msg=c)


def test_a_long_live_run_keeps_a_bounded_timeline_that_draws_every_step():
    """1,800 steps live with a ring buffer of 64: the dashboard's series holds a bounded number
    of rows and bins, the drawn timeline is the mean of each bin of steps of the whole run (an
    unbounded recording of the same run is the truth), its totals are the run's, and the
    queues view reads the shown step's row."""
    llm = make_llm(**ENGINE)
    with llm.record(level="summary", max_steps=100_000) as whole:
        dash = Dashboard(llm, views="queues,timeline", max_steps=64, interval=0.001, max_load=1.0)
        llm.generate(PROMPTS * 2, greedy(95), use_tqdm=False)
        dash.detach()
    steps = whole.steps
    assert len(steps) > 1500
    series = dash.series
    assert len(series.columns["step"]) <= 2 * 64  # rows of the newest steps only
    sums, counts = series.bins()
    assert int(counts.sum()) == len(steps) and len(counts) <= 1500
    width, want = reference_bins(steps, 1500)
    assert series.width == width > 1
    drawn = {col: np.asarray(t.y, float) for t, (col, *_rest) in zip(dash.views["timeline"].data, TIMELINE_SERIES)}
    drawn["step"] = np.asarray(dash.views["timeline"].data[0].x, float)
    assert_same_bins(drawn, want)
    # a faithful summary: the points, weighted by their bins' sizes, add up to the run's totals
    for col, field in (("prefill_tokens", "num_prefill_tokens"), ("decode_tokens", "num_decode_tokens"),
                       ("preemptions", "num_preemptions")):
        assert (drawn[col] * counts).sum() == pytest.approx(steps[field].sum(), rel=1e-12)
    assert dash.views["queues"].queues["scheduled_tokens"] == steps.set_index("step").at[dash.step, "num_scheduled_tokens"]


@pytest.mark.parametrize("max_points", [7, 8])
def test_bins_merged_live_at_any_sync_equal_a_replays_bins_and_the_trace(tmp_path, max_points):
    """A live series of few bins, synced after irregular numbers of steps, merges its bins as
    the run grows; a saved and loaded trace of the same run bins all its steps at once. Both
    equal the means over the trace's own steps, for the series' bins and for fewer points."""
    llm = make_llm(**ENGINE)
    with llm.record(level="summary", max_steps=100_000) as whole:
        with llm.record(level="summary", max_steps=16) as live:
            series = StepSeries(live, max_points=max_points)
            seen = []

            def take(record) -> None:
                series.add(record)
                seen.append(record.step)
                if len(seen) % 5 in (0, 2):  # irregular syncs: some steps wait for the next one
                    series.sync()

            live.add_listener(take, block_events=False)
            llm.generate(PROMPTS[:4], greedy(40), use_tqdm=False)
            series.sync()
            for step in live.step_ids:  # the rows of every step the live trace holds
                assert series.row(step) == {c: live.steps.set_index("step").loc[step, c].item() if c != "step" else step
                                            for c in series.columns}
    whole.save(tmp_path / "run")
    replay = StepSeries(Trace.load(tmp_path / "run"), max_points=max_points)
    steps = whole.steps
    assert len(steps) > 8 * max_points and len(series.columns["step"]) <= 2 * 16
    for points in (max_points, 3, 1500):
        width, want = reference_bins(steps, min(points, max_points))
        assert width > 1
        assert_same_bins(timeline_frame(series, points), want)
        assert_same_bins(timeline_frame(replay, points), want)


def test_steps_queued_between_updates_keep_no_step_record_alive():
    """A series queues each step until the next update; updates come rarer as they cost more,
    and none while the notebook is busy. What it queues must not hold the step's record (its
    block events, rows and queues) past the ring buffer that dropped it: the records alive stay
    the ring's, however many steps wait."""
    llm = make_llm(**ENGINE)
    with llm.record(level="blocks", max_steps=16) as live:
        series = StepSeries(live)
        live.add_listener(series.add, block_events=False)
        llm.generate(PROMPTS[:4], greedy(40), use_tqdm=False)
        gc.collect()
        alive = sum(isinstance(o, StepRecord) for o in gc.get_objects())
        assert len(live.step_ids) == 16 and alive <= 16
        series.sync()
        assert series.columns["step"][-1] == live.step_ids[-1]
        assert series.row(live.step_ids[-1]) == {c: live.steps.set_index("step").loc[live.step_ids[-1], c].item()
                                                 if c != "step" else live.step_ids[-1] for c in series.columns}
