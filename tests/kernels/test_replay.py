"""The graph cache's policy (kernels/replay.py), which keeps ranks in step: every call executes the op exactly once
(first call of a shape launched directly, then capture + replay, replays), weights are keyed by address, and past
MAX_WEIGHTS new weights launch directly while captured ones stay in use. CUDA graphs themselves are exercised by
the GPU tests of ag_gemm and gemm_rs (path "graph"); here a stand-in records what would be captured."""

import torch

from triton_dist.kernels import replay


class _FakeGraphedCall:
    captured = []

    def __init__(self, run, inputs, captured, clone):
        self.run, self.w = run, captured
        _FakeGraphedCall.captured.append(tuple(w.data_ptr() for w in captured))

    def __call__(self, inputs):
        return self.run(*inputs, *self.w)


def test_graph_cache_policy(monkeypatch):
    monkeypatch.setattr(replay, "usable", lambda a: True)
    monkeypatch.setattr(replay, "GraphedCall", _FakeGraphedCall)
    _FakeGraphedCall.captured = []
    cache = replay.GraphCache("test")
    runs = []

    def run(a, w):
        runs.append((a.data_ptr(), w.data_ptr()))
        return a @ w.T

    a = torch.randn(3, 4)
    w = torch.randn(5, 4)
    assert cache.run("k", run, (a,), (w,)) is None  # first call of the shape: the caller launches directly
    assert runs == [] and _FakeGraphedCall.captured == []
    for _ in range(3):  # then one capture, replays after it
        assert torch.equal(cache.run("k", run, (a,), (w,)), a @ w.T)
    assert _FakeGraphedCall.captured == [(w.data_ptr(),)] and len(runs) == 3
    others = [torch.randn(5, 4) for _ in range(replay.MAX_WEIGHTS)]
    for wi in others[:-1]:
        assert cache.run("k", run, (a,), (wi,)) is not None
    assert len(_FakeGraphedCall.captured) == replay.MAX_WEIGHTS  # the first weight + MAX_WEIGHTS - 1 new ones
    assert cache.run("k", run, (a,), (others[-1],)) is None  # past the limit: launched directly
    assert cache.run("k", run, (a,), (w,)) is not None  # captured weights keep their graphs
    assert cache.run("other shape", run, (a,), (w,)) is None  # keys are separate
    cache.clear()
    assert cache.run("k", run, (a,), (w,)) is None  # cleared (e.g. workspaces regrown): direct first again


def test_graphs_are_not_used_on_cpu():
    cache = replay.GraphCache("test")
    a, w = torch.randn(2, 2), torch.randn(2, 2)
    assert not replay.usable(a)
    assert cache.run("k", lambda x, y: x, (a,), (w,)) is None and cache.run("k", lambda x, y: x, (a,), (w,)) is None
