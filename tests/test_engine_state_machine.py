"""A stateful property test of the public API: add_request, step, abort_request and generate,
interleaved with hooks that abort, add, raise, call generate or press Ctrl-C at any hook point.

After every rule the invariant validator runs; at the end every streamed request has been
reported finished exactly once and no block is left in use. No internal error may escape: the
only exceptions a rule may see are the KeyboardInterrupt it asked for and the RuntimeError of
a refused nested generate.

The model is NullExecutor (deterministic tokens, an EOS now and then), so thousands of steps
run in seconds; the LLM, the engine, the scheduler and the block manager are the real ones.
``KVSCOPE_STATE_MACHINE_EXAMPLES`` sets the number of examples (CI runs 300). A second machine
runs the same rules with async scheduling and may start a ``blocks`` and a ``full`` recording:
after every rule the pool replayed from the block events must equal the snapshot of the last
recorded step (the block manager at its ``step.end``), whatever the hooks did.
"""
from __future__ import annotations

import os
import signal
import warnings
from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import kvscope.llm as llm_module
from kvscope import LLM, SamplingParams
from kvscope.engine.hooks import HOOK_POINTS
from kvscope.runner.null_executor import NullExecutor
from kvscope.trace import Recorder
from tiny_models import tiny_checkpoint

EXAMPLES = int(os.environ.get("KVSCOPE_STATE_MACHINE_EXAMPLES", "300"))
ACTIONS = ("abort", "add", "raise", "generate", "interrupt", "reset")
prompts = st.lists(st.integers(3, 6), min_size=1, max_size=14)  # few values: shared prefixes


def null_executor(config, hf_config, model_dir, max_model_len) -> NullExecutor:
    return NullExecutor(config.num_kv_blocks, hf_config.vocab_size, config.block_size, eos_every=13)


class EngineMachine(RuleBasedStateMachine):
    async_scheduling = False

    def __init__(self) -> None:
        super().__init__()
        real, llm_module._make_executor = llm_module._make_executor, null_executor
        try:
            self.llm = LLM(str(tiny_checkpoint("qwen3")), device="cpu", block_size=4, num_kv_blocks=12,
                           max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64,
                           async_scheduling=self.async_scheduling)
        finally:
            llm_module._make_executor = real
        self.llm.llm_engine.validate_every_step = True
        self.streamed: set[str] = set()
        self.reported: Counter[str] = Counter()
        self.handles: list = []

    # ------------------------------------------------------------ helpers
    def _run(self, fn, *args):
        """Call the engine; only an interrupt this machine raised may come out."""
        try:
            return fn(*args)
        except KeyboardInterrupt:
            return None

    def _collect(self, outputs) -> None:
        for o in outputs or ():
            if o.finished:
                assert o.request_id in self.streamed, f"output for unknown request {o.request_id}"
                self.reported[o.request_id] += 1

    def _hook(self, action: str, when: int):
        calls = [0]
        llm = self.llm

        def hook(**payload) -> None:
            calls[0] += 1
            if calls[0] != when:
                return
            if action == "abort":
                rid = payload.get("request_id") or next(iter(self.streamed), None)
                if rid is not None:
                    llm.abort_request(rid)
            elif action == "add":
                self.streamed.add(llm.add_request([5, 4, 3], SamplingParams(temperature=0, max_tokens=3)))
            elif action == "raise":
                raise ValueError("a broken hook")
            elif action == "generate":
                try:
                    llm.generate([[4, 4]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
                except RuntimeError as exc:
                    assert "inside a kvscope hook" in str(exc)
            elif action == "interrupt":
                signal.raise_signal(signal.SIGINT)
            elif action == "reset":
                llm.reset_prefix_cache()
        return hook

    # -------------------------------------------------------------- rules
    @rule(prompt=prompts, max_tokens=st.integers(1, 10))
    def add(self, prompt, max_tokens) -> None:
        rid = self._run(self.llm.add_request, prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
        if rid is not None:  # (an interrupted add adds nothing)
            self.streamed.add(rid)

    @rule()
    def step(self) -> None:
        self._collect(self._run(self.llm.step))

    @rule(data=st.data())
    @precondition(lambda self: self.streamed)
    def abort(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.streamed)))
        self._run(self.llm.abort_request, rid)

    @rule(batch=st.lists(prompts, min_size=1, max_size=4), max_tokens=st.integers(1, 8))
    def generate(self, batch, max_tokens) -> None:
        outs = self._run(self.llm.generate, batch, SamplingParams(temperature=0, max_tokens=max_tokens), False)
        if outs is not None:
            assert len(outs) == len(batch) and all(o.finished for o in outs)
            assert all(o.request_id not in self.streamed for o in outs)

    @rule(point=st.sampled_from(HOOK_POINTS), action=st.sampled_from(ACTIONS), when=st.integers(1, 6))
    def attach(self, point, action, when) -> None:
        self.handles.append(self.llm.hooks.add(point, self._hook(action, when)))

    @rule()
    @precondition(lambda self: self.handles)
    def detach(self) -> None:
        self.handles.pop().remove()

    # --------------------------------------------------------- invariants
    @invariant()
    def consistent(self) -> None:
        self.llm.check_invariants()
        assert all(n == 1 for n in self.reported.values()), self.reported
        bm = self.llm.llm_engine.block_manager
        if not self.llm.llm_engine.scheduler.has_unfinished():
            assert not bm.used and bm.num_free_blocks == bm.num_blocks

    def teardown(self) -> None:
        for h in self.handles:
            h.remove()
        for _ in range(1000):
            if not self.llm.has_unfinished_requests():
                break
            self._collect(self.llm.step())
        assert not self.llm.has_unfinished_requests(), "the engine did not drain"
        self.llm.check_invariants()
        assert set(self.reported) == self.streamed, self.streamed - set(self.reported)
        assert all(n == 1 for n in self.reported.values())


class AsyncRecordedMachine(EngineMachine):
    async_scheduling = True

    def __init__(self) -> None:
        super().__init__()
        self.traces: tuple = ()

    @rule()
    @precondition(lambda self: not self.traces)
    def record(self) -> None:
        engine = self.llm.llm_engine
        self.recorders = (Recorder(engine, "full"), Recorder(engine, "blocks"))
        self.traces = tuple(r.start() for r in self.recorders)

    @invariant()
    def replay_equals_snapshot(self) -> None:
        if not self.traces or not self.traces[0].step_ids:
            return
        full, blocks = self.traces
        assert full.step_ids == blocks.step_ids
        step = full.step_ids[-1]
        snap, replay = full.pool_arrays(step), blocks.pool_arrays(step)
        for k in ("ref_count", "block_hash", "num_tokens"):
            assert (snap[k] == replay[k]).all(), f"{k} at step {step}"

    def teardown(self) -> None:
        super().teardown()
        self.replay_equals_snapshot()
        for r in getattr(self, "recorders", ()):
            r.stop()


SETTINGS = dict(stateful_step_count=25, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
EngineMachine.TestCase.settings = settings(max_examples=EXAMPLES, **SETTINGS)
AsyncRecordedMachine.TestCase.settings = settings(max_examples=max(1, EXAMPLES // 3), **SETTINGS)


@pytest.mark.parametrize("machine", [EngineMachine, AsyncRecordedMachine], ids=["sync", "async-recorded"])
def test_engine_state_machine(machine) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # hooks that raise are reported and detached
        machine.TestCase().runTest()
