"""Recordings, hooks and threads meeting: the order hooks fire in when recordings and their
listeners step the engine, a Ctrl-C while a recording starts or stops, and
``has_unfinished_requests`` read from another thread. Each case is the smallest one a
robustness fuzz found failing (the fuzz scripts live outside the repository)."""
from __future__ import annotations

import gc
import signal
import sys
import threading
import time
import warnings
from typing import Callable

import pytest

from engine_helpers import greedy, make_llm, token_ids
from kvscope import Trace


def wait_for(condition: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_listener_that_steps_the_engine_leaves_every_recording_in_step_order(tmp_path, async_scheduling: bool) -> None:
    """Two recordings at once (a dashboard's and the user's, say), and the newer one's listener
    runs a ``generate`` (as a ``step.end`` hook may). The listener used to be called inside its
    recorder's ``step.end`` hook, before the older recorder had recorded the step: that one then
    recorded the nested steps first, its steps went 2, 3, 1, 4, and ``Trace.load`` refused its
    save as not a whole one."""
    llm = make_llm(async_scheduling=async_scheduling)
    nested: list[list[list[int]]] = []

    def listener(record) -> None:
        if not nested:
            nested.append([])
            nested[0] = token_ids(llm.generate([[5, 6, 7]], greedy(2), use_tqdm=False))

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a listener that raised would only be detached)
        with llm.record("blocks") as older, llm.record("blocks") as newer:
            newer.add_listener(listener)
            outer = token_ids(llm.generate([[3, 4, 5, 6]], greedy(4), use_tqdm=False))
    assert outer == token_ids(make_llm().generate([[3, 4, 5, 6]], greedy(4), use_tqdm=False)) and nested[0]
    for name, trace in (("older", older), ("newer", newer)):
        assert trace.step_ids == sorted(trace.step_ids) == newer.step_ids
        Trace.load(trace.save(tmp_path / name))


def test_a_hook_removed_by_an_earlier_one_is_not_called_when_a_first_hook_came_in_that_firing() -> None:
    """A ``first=True`` hook added during a firing (a recording started from ``step.end``) used
    to replace the point's table of hooks, so a hook that an earlier one then removed was still
    called in that firing, against the documented contract."""
    llm = make_llm()
    calls, handles = [], {}

    def earlier(**_) -> None:
        calls.append("earlier")
        if "later" in handles:
            llm.hooks.add("step.end", lambda **_: None, first=True)
            handles.pop("later").remove()

    llm.hooks.add("step.end", earlier)
    handles["later"] = llm.hooks.add("step.end", lambda **_: calls.append("later"))
    llm.generate([[3, 4]], greedy(1), use_tqdm=False)
    assert calls == ["earlier"]


def test_hooks_fire_by_tier_first_then_after_first_then_the_others() -> None:
    """``first`` hooks (newest first), then ``after_first`` ones and then the rest (each in the
    order added), whatever order they were added in."""
    llm = make_llm()
    order = []

    def hook(name: str, **kw: bool):
        llm.hooks.add("step.end", lambda **_: order.append(name), **kw)

    hook("plain 1")
    hook("after 1", after_first=True)
    hook("first 1", first=True)
    hook("plain 2")
    hook("after 2", after_first=True)
    hook("first 2", first=True)
    llm.generate([[3, 4]], greedy(1), use_tqdm=False)
    assert order == ["first 2", "first 1", "after 1", "after 2", "plain 1", "plain 2"]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_listener_that_raises_keyboard_interrupt_lets_the_recordings_other_listeners_have_the_step(
        async_scheduling: bool) -> None:
    """Two listeners stop the run with ``KeyboardInterrupt`` at the 2nd recorded step, between
    two that only watch. The interrupt stopped the recorder's loop over its listeners, so the
    listeners after it missed that one step; now each gets it, and the call raises the first
    interrupt once all have run, as for a hook's. No listener is reported or detached, and the
    engine serves on unharmed."""
    llm = make_llm(async_scheduling=async_scheduling)
    seen: dict[str, list[int]] = {name: [] for name in ("before", "stop 1", "stop 2", "after")}
    stops = {"stop 1": KeyboardInterrupt("stop 1"), "stop 2": KeyboardInterrupt("stop 2")}

    def listener(name: str) -> Callable[[object], None]:
        def fn(record) -> None:
            seen[name].append(record.step)
            if name in stops and len(seen["before"]) == 2:  # (the 2nd recorded step: "before" runs first)
                raise stops[name]
        return fn

    with warnings.catch_warnings(record=True) as caught, llm.record("blocks") as trace:
        warnings.simplefilter("always")
        for name in seen:
            trace.add_listener(listener(name))
        with pytest.raises(KeyboardInterrupt) as raised:
            llm.generate([[3, 4, 5, 6]], greedy(4), use_tqdm=False)
        again = token_ids(llm.generate([[7, 8, 9]], greedy(3), use_tqdm=False))
    assert raised.value is stops["stop 1"]
    assert not [w for w in caught if "raised and was detached" in str(w.message)]
    assert all(steps == trace.step_ids for steps in seen.values()), seen
    assert not llm.has_unfinished_requests()
    llm.check_invariants()
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    fresh = make_llm()
    assert again == token_ids(fresh.generate([[7, 8, 9]], greedy(3), use_tqdm=False))
    prompt = [[3, 4, 5, 6]]
    assert token_ids(llm.generate(prompt, greedy(4), use_tqdm=False)) == token_ids(
        fresh.generate(prompt, greedy(4), use_tqdm=False))


@pytest.mark.parametrize("where", ["start", "stop"])
def test_a_ctrl_c_while_a_recording_starts_or_stops_leaves_no_recorder_attached(
        where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real SIGINT landing inside ``Recorder.start`` (a big pool's baseline takes a while) or
    ``Recorder.stop`` (packing the last chunk): ``llm.record`` raises KeyboardInterrupt, and the
    recorder is detached. It used to stay attached for good: its hooks and block sink fed on
    every later step, and the heap stayed frozen for the garbage collector."""
    from kvscope.trace.recorder import Recorder

    llm = make_llm()
    real = getattr(Recorder, where)

    def interrupted(self):  # (a SIGINT lands at the next bytecode: at start()'s end, at stop()'s beginning)
        if where == "stop":
            signal.raise_signal(signal.SIGINT)
        done = real(self)
        if where == "start":
            signal.raise_signal(signal.SIGINT)
        return done

    monkeypatch.setattr(Recorder, where, interrupted)
    with pytest.raises(KeyboardInterrupt):
        with llm.record("blocks"):
            llm.generate([[3, 4]], greedy(2), use_tqdm=False)
    monkeypatch.undo()
    assert not llm.hooks._hooks and not llm.hooks.block_sinks and gc.get_freeze_count() == 0
    with llm.record("blocks") as trace:
        llm.generate([[3, 4]], greedy(2), use_tqdm=False)
    assert trace.step_ids


def test_has_unfinished_requests_from_another_thread_while_generate_steps_never_raises() -> None:
    """A notebook polls ``has_unfinished_requests()`` while a background ``generate`` runs: it
    iterated the outputs kept for ``step()`` while the generating thread added and popped them,
    and raised ``RuntimeError: dictionary changed size during iteration``. Thread switches are
    forced as often as CPython allows, so the race shows within a few calls."""
    llm = make_llm()
    errors, done = [], threading.Event()

    def poll() -> None:
        while not done.is_set():
            try:
                llm.has_unfinished_requests()
            except Exception as exc:  # (the bug: any error at all from a poll)
                errors.append(exc)
                return

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    poller = threading.Thread(target=poll)
    poller.start()
    try:
        for i in range(60):
            llm.generate([[3, 4, 5 + i]] * 8, greedy(2), use_tqdm=False)
            if errors:
                break
    finally:
        done.set()
        poller.join()
        sys.setswitchinterval(interval)
    assert not errors, errors


def test_has_unfinished_requests_from_another_thread_counts_an_output_step_has_not_kept_yet(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Asked from another thread while ``step()`` holds a streamed request's final output that
    it has not kept yet (the request already left the engine), it said False, and a loop of that
    thread stopped with the output undelivered. It now waits for the step, and says True."""
    llm = make_llm()
    llm.add_request([3, 4, 5], greedy(1))
    keep, answers = llm._keep, []

    def keep_after_a_look(outputs) -> None:
        look = threading.Thread(target=lambda: answers.append(llm.has_unfinished_requests()))
        look.start()
        look.join(0.5)  # (it waits for this step, so it ends only once the outputs are kept)
        keep(outputs)

    monkeypatch.setattr(llm, "_keep", keep_after_a_look)
    finished = [o for o in llm.step() if o.finished]
    wait_for(lambda: answers)
    assert answers == [True] and len(finished) == 1 and not llm.has_unfinished_requests()
