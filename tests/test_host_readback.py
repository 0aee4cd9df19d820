"""The sampled tokens' way back to the host through reused memory (``HostReadback``): whatever
the order in which samples are made, read and dropped, each reads the tokens it was given, so
a reused buffer is never written while a sample that holds it is unread; and the memory is
reused (as many slots as samples unread at once, not one per step)."""
from __future__ import annotations

import gc

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.runner.sampler import DeviceSample, HostReadback
from kvscope.sampling_params import SamplingParams


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["make", "read", "drop"]), st.integers(1, 9), st.integers(0, 10**6)),
                min_size=1, max_size=40))
def test_each_sample_reads_its_own_tokens_while_buffers_are_reused(ops):
    readback = HostReadback(pin=False)
    live: list[tuple[DeviceSample, list[int]]] = []
    most_unread = 0
    for op, n, seed in ops:
        if op == "make":
            tokens = torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed))
            live.append((DeviceSample(tokens, [SamplingParams()] * n, None, readback), tokens.tolist()))
            tokens.fill_(-1)  # (the device tensor is reused by later steps; the copy was queued)
            most_unread = max(most_unread, len(live))
        elif live:
            sample, want = live.pop(seed % len(live))
            if op == "read":
                assert sample.to_output().tokens == want
            del sample
            gc.collect()
    for sample, want in live:
        assert sample.to_output().tokens == want
    assert len(readback._slots) <= most_unread


def test_async_steps_alternate_between_two_buffers():
    """Step n+1's copy is queued before step n is read, as under async scheduling."""
    readback = HostReadback(pin=False)
    params = [SamplingParams()] * 4
    previous = None
    buffers = set()
    for step in range(6):
        sample = DeviceSample(torch.full((4,), step), params, None, readback)
        buffers.add(sample._host[0].data_ptr())
        if previous is not None:
            assert previous.to_output().tokens == [step - 1] * 4
        previous = sample
    assert len(buffers) == 2 and len(readback._slots) == 2
