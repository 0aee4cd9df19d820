"""``Trace._repr_html_``, the card a notebook shows for a trace, on the bundled model.

The workload shares a system prompt (prefix-cache hits), prefills in chunks (a small token
budget) and preempts (a small pool). The card's numbers are read back from their ``data-key``
elements and compared with what hooks and the block manager's counters saw while the engine
ran, and with the requests' outputs, never with the trace's own tables.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Iterator

import pytest

pytest.importorskip("pandas")
pytest.importorskip("pyarrow")

import kvscope  # noqa: E402
from kvscope import LLM, RequestOutput, SamplingParams, Trace  # noqa: E402
from kvscope.demo import demo_prompts  # noqa: E402
from kvscope.model_source import BUNDLED_MODEL  # noqa: E402

ENGINE = dict(block_size=16, num_kv_blocks=12, max_num_batched_tokens=32, device="cpu", dtype="float32")
PARAMS = SamplingParams(temperature=0, max_tokens=24)


class Card(HTMLParser):
    """The text of each ``data-key`` element, the tags and the attributes of a card's HTML."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.values: dict[str, str] = {}
        self.tags: list[str] = []
        self.attrs: list[tuple[str, str | None]] = []
        self._open: list[tuple[str | None, list[str]]] = []  # (key or None, its text) per open element
        self.feed(text)
        self.close()
        assert not self._open, f"unclosed elements: {self._open}"

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.attrs += attrs
        self._open.append((dict(attrs).get("data-key"), []))

    def handle_endtag(self, tag: str) -> None:
        key, text = self._open.pop()
        if key is not None:
            assert key not in self.values, f"data-key {key!r} twice"
            self.values[key] = "".join(text)
        if self._open:
            self._open[-1][1].extend(text)

    def handle_data(self, data: str) -> None:
        if self._open:
            self._open[-1][1].append(data)

    def int(self, key: str) -> int:
        return int(self.values[key].replace(",", ""))

    def percent(self, key: str) -> float:
        text = self.values[key]
        assert text.endswith(" %"), text
        return float(text[:-2])

    def seconds(self, key: str) -> tuple[float, float]:
        """The time shown, and half a unit of its last digit (what rounding may hide)."""
        number, unit = self.values[key].split()
        scale = {"ms": 1e-3, "s": 1.0, "min": 60.0}[unit]
        decimals = len(number.partition(".")[2])
        return float(number) * scale, 0.5 * 10 ** -decimals * scale


@dataclass
class Witness:
    """What hooks saw while the engine ran, and the block manager's prefix-cache counters."""

    steps: list[int] = field(default_factory=list)
    used: list[int] = field(default_factory=list)  # len(block_manager.used) at each step.end
    prefill_tokens: int = 0
    decode_tokens: int = 0
    chunks: int = 0  # prefill rows that stop short of the sequence's end (chunked prefill)
    preemptions: int = 0
    start_s: float | None = None
    end_s: float | None = None
    hits: int = 0
    queries: int = 0

    def hooks(self, llm: LLM) -> dict:
        bm = llm.llm_engine.block_manager

        def on_step_end(info) -> None:
            self.steps.append(info.step)
            self.used.append(len(bm.used))
            for row in info.scheduler_output.requests:
                if row.is_prefill:
                    self.prefill_tokens += row.num_new_tokens
                    self.chunks += not row.sample
                else:
                    self.decode_tokens += row.num_new_tokens
            if self.start_s is None:
                self.start_s = info.time_s
            self.end_s = info.time_s + info.duration_s

        def on_preempted(**_) -> None:
            self.preemptions += 1

        return {"step.end": on_step_end, "request.preempted": on_preempted}


@dataclass
class Run:
    llm: LLM
    trace: Trace
    outputs: list[RequestOutput]
    seen: Witness


def record(llm: LLM, level: str, max_steps: int = 10_000) -> Run:
    seen = Witness()
    bm = llm.llm_engine.block_manager
    hits, queries = bm.prefix_cache_hits, bm.prefix_cache_queries
    with llm.record(level, max_steps) as trace, llm.hooks(seen.hooks(llm)):
        outputs = llm.generate(demo_prompts(6), PARAMS, use_tqdm=False)
    seen.hits, seen.queries = bm.prefix_cache_hits - hits, bm.prefix_cache_queries - queries
    return Run(llm, trace, outputs, seen)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request) -> Iterator[LLM]:
    llm = LLM(**ENGINE, async_scheduling=request.param)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module", params=["blocks", "summary"])
def run(request, llm: LLM) -> Run:
    llm.reset_prefix_cache()  # (each run starts cold, so its admissions find only what it cached)
    return record(llm, request.param)


def explore(card: Card) -> list[str]:
    return card.values["explore"].removeprefix("explore: ").split(" (")[0].split(" · ")


def test_the_workload_exercises_what_the_card_counts(run: Run):
    """Otherwise the checks below would compare zeros."""
    seen = run.seen
    assert seen.preemptions > 0 and seen.chunks > 0 and 0 < seen.hits < seen.queries


def test_the_card_counts_what_the_engine_did(run: Run):
    card, seen, bm = Card(run.trace._repr_html_()), run.seen, run.llm.llm_engine.block_manager
    assert card.values["level"] == run.trace.level
    assert card.values["model"] == Path(BUNDLED_MODEL).name
    assert (card.int("steps"), card.int("first_step"), card.int("last_step")) == \
        (len(seen.steps), seen.steps[0], seen.steps[-1])
    assert "max_steps" not in card.values  # the ring buffer dropped nothing
    wall, rounding = card.seconds("wall_time")
    assert abs(wall - (seen.end_s - seen.start_s)) <= rounding * 1.001

    assert card.int("requests") == card.int("finished") == len(run.outputs)
    assert card.int("generated_tokens") == sum(len(o.outputs[0].token_ids) for o in run.outputs)
    assert card.int("prefill_tokens") == seen.prefill_tokens
    assert card.int("decode_tokens") == seen.decode_tokens

    assert (card.int("num_blocks"), card.int("block_size")) == (bm.num_blocks, bm.block_size)
    peak = max(seen.used)
    assert card.int("peak_blocks") == peak
    assert card.int("peak_step") == seen.steps[seen.used.index(peak)]
    assert card.percent("peak_share") == pytest.approx(100 * peak / bm.num_blocks, abs=0.05)

    assert (card.int("prefix_hits"), card.int("prefix_queries")) == (seen.hits, seen.queries)
    assert card.percent("hit_rate") == pytest.approx(100 * seen.hits / seen.queries, abs=0.05)
    assert card.int("preemptions") == seen.preemptions


def test_the_card_points_only_at_what_the_level_records(run: Run):
    """Each expression it suggests runs on this trace (the dashboard's aside: it needs widgets),
    and the pool it points at is the peak's."""
    card = Card(run.trace._repr_html_())
    names = explore(card)
    peak_step = card.int("peak_step")
    blocks_level = ["trace.lifecycle", f"trace.blocks({peak_step})"]
    assert names == ["trace.steps", "trace.requests", *(blocks_level if run.trace.level != "summary" else []),
                     "kvscope.dashboard(trace)"]
    for name in names[:-1]:
        eval(name, {"trace": run.trace})
    if run.trace.level != "summary":
        pool = run.trace.blocks(peak_step)
        assert (pool["state"] == "used").sum() == card.int("peak_blocks")


def test_a_loaded_trace_shows_the_card_of_the_live_one(run: Run, tmp_path: Path):
    loaded = Trace.load(run.trace.save(tmp_path / "run.trace"))
    assert loaded._repr_html_() == run.trace._repr_html_()


def test_a_recording_stopped_mid_run_tells_seen_from_finished(llm: LLM):
    finished: list[str] = []
    with llm.record("blocks") as trace:
        for prompt, max_tokens in zip(demo_prompts(3), (2, 40, 40)):
            llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
        while not finished:
            finished += [o.request_id for o in llm.step() if o.finished]
    card = Card(trace._repr_html_())
    assert (card.int("requests"), card.int("finished")) == (3, len(finished)) and len(finished) < 3
    while llm.has_unfinished_requests():
        llm.step()


def test_a_full_ring_buffer_says_older_steps_may_be_gone(llm: LLM, tmp_path: Path):
    small = record(llm, "summary", max_steps=5)
    assert len(small.seen.steps) > 5  # (so steps were dropped)
    card = Card(small.trace._repr_html_())
    assert (card.int("steps"), card.int("max_steps")) == (5, 5)
    assert (card.int("first_step"), card.int("last_step")) == (small.seen.steps[-5], small.seen.steps[-1])
    kept = small.seen.used[-5:]
    assert card.int("peak_blocks") == max(kept)
    assert card.int("peak_step") == small.seen.steps[-5:][kept.index(max(kept))]
    loaded = Trace.load(small.trace.save(tmp_path / "small.trace"))
    assert loaded._repr_html_() == small.trace._repr_html_()


def test_an_empty_recording_gets_a_short_card(llm: LLM, tmp_path: Path):
    with llm.record("blocks") as trace:
        pass
    text = trace._repr_html_()
    card = Card(text)
    assert card.int("steps") == 0 and "table" not in card.tags and "explore" not in card.values
    assert "no engine step" in text
    assert repr(trace) == "<kvscope.Trace level='blocks' steps=0 (none) blocks=12>"  # (the text repr is kept)
    assert Trace.load(trace.save(tmp_path / "empty.trace"))._repr_html_() == text


def test_every_string_is_escaped(tmp_path: Path):
    """A model folder named like markup shows as text, in the text and in the hover title."""
    name = "<img src=x onerror=alert(1)> \"q\" & 'a'"
    link = tmp_path / name
    os.symlink(BUNDLED_MODEL, link)
    llm = LLM(str(link), **ENGINE)
    with llm.record("summary") as trace:
        llm.generate(demo_prompts(2), PARAMS, use_tqdm=False)
    text = trace._repr_html_()
    card = Card(text)
    assert "<img" not in text and "img" not in card.tags
    assert card.values["model"] == name
    assert ("title", str(link)) in card.attrs


def test_without_prefix_caching_the_card_says_off():
    llm = LLM(**ENGINE, enable_prefix_caching=False)
    off = record(llm, "summary")
    card = Card(off.trace._repr_html_())
    assert card.values["hit_rate"] == "off" and "prefix_hits" not in card.values
    assert (off.seen.hits, off.seen.queries) == (0, 0)
    assert card.int("preemptions") == off.seen.preemptions
