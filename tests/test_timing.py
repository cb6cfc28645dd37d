"""Timing helpers (``triton_dist.timing``) and the autotuner's use of them, with CUDA events faked on the host:
the median of the timed calls, the warm-up's call count, and a failing candidate turning into inf."""

import pytest
import torch

from triton_dist import autotune, timing

from .conftest import cpu_only


class FakeEvent:
    """A CUDA event whose clock is a counter the test advances: elapsed_time in ms like torch's."""
    clock_ms = 0.0

    def __init__(self, enable_timing=True):
        self.at = None

    def record(self):
        self.at = FakeEvent.clock_ms

    def elapsed_time(self, end):
        return end.at - self.at


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)


@cpu_only  # replaces torch.cuda's events for the whole process
def test_median_us_times_every_call_after_the_warm_up(fake_cuda):
    durations_us = iter([999.0, 999.0] + [30.0, 10.0, 20.0, 50.0, 40.0])  # 2 warm-up calls, then 5 timed
    calls = []

    def fn():
        calls.append(1)
        FakeEvent.clock_ms += next(durations_us) / 1000.0

    assert timing.median_us(fn, iters=5, warmup=2, collective=False) == pytest.approx(30.0)
    assert len(calls) == 7


@cpu_only
def test_time_candidate_median_and_failure(fake_cuda):
    def run(cfg):
        if cfg["broken"]:
            raise RuntimeError("no kernel for this config")
        FakeEvent.clock_ms += cfg["us"] / 1000.0

    ok = autotune.time_candidate(run, {"broken": False, "us": 12.5}, iters=3, warmup=1, collective=False)
    assert ok == pytest.approx(12.5)
    assert autotune.time_candidate(run, {"broken": True}, iters=3, warmup=1, collective=False) == float("inf")


@cpu_only
def test_warm_up_adds_calls_up_to_its_span(fake_cuda, monkeypatch):
    """2 calls of 100 µs each (host clock faked), then enough more to span 1000 µs: 8 more, on one rank."""
    clock = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    calls = []

    def fn():
        calls.append(1)
        clock[0] += 100e-6

    timing.warm_up(fn, 2, span_us=1000.0, collective=False)
    assert len(calls) == 10
