"""The autotuner (``triton_dist.autotune``): cache keys, the disk cache, the no-tuning rule under the interpreter,
and timing candidates in turn so that a GPU drifting within the tuning (power cap) picks the fastest candidate."""

import json

import pytest

from triton_dist import autotune

from .conftest import cpu_only


@cpu_only  # on GPU ranks tuning is allowed, so the no-tuning rule does not apply
def test_keys_cache_and_interpreter_rule(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_DIST_CACHE_DIR", str(tmp_path))
    key = autotune.full_key("demo", {"m": 1, "dtype": "bfloat16"}, collective=False)
    fields = json.loads(key)
    for field in ("gpu", "world", "m", "dtype", "triton_dist", "triton", "torch"):
        assert field in fields
    with_cands = [autotune.full_key("demo", {"m": 1}, False, cands) for cands in ([{"x": 1}], [{"x": 1}, {"x": 2}])]
    assert with_cands[0] != with_cands[1]  # new candidates: tuned again, not a stale choice from the old list
    assert with_cands[0] == autotune.full_key("demo", {"m": 1}, False, [{"x": 1}])
    autotune._write_disk("demo", key, {"BLOCK_M": 64}, [1.0, 2.0])
    assert autotune._read_disk("demo", key) == {"BLOCK_M": 64}
    calls = []
    cfg = autotune.choose("demo", {"m": 1}, [{"x": 1}, {"x": 2}], lambda: calls.append(1), default={"x": 0},
                          collective=False)
    assert cfg == {"x": 0} and not calls  # interpreter / no GPU: never tunes, same default everywhere


class BurstyGPU:
    """Fake timings: candidate i takes true[i] us, but the first ``burst`` calls of the tuning run 10 % fast (a
    GPU below its power limit at first). Records the order of calls."""

    def __init__(self, true, burst=1):
        self.true, self.burst, self.order = true, burst, []

    def __call__(self, i):
        self.order.append(i)
        return self.true[i] * (0.9 if len(self.order) <= self.burst else 1.0)


def test_in_turn_is_not_fooled_by_a_burst():
    """One after another, candidate 0 wins on a burst figure; in turn (each round starting elsewhere, median of
    the rounds) the truly fastest candidate wins, every candidate is timed once per round."""
    gpu = BurstyGPU([100.0, 97.0, 100.0, 99.0])
    once = autotune.in_turn(4, 1, gpu)
    assert min(range(4), key=once.__getitem__) == 0  # fooled
    gpu = BurstyGPU([100.0, 97.0, 100.0, 99.0])
    medians = autotune.in_turn(4, 3, gpu)
    assert medians == [100.0, 97.0, 100.0, 99.0]
    assert sorted(gpu.order) == sorted(list(range(4)) * 3)
    assert [gpu.order[4 * r] for r in range(3)] == [0, 1, 2]  # round r starts at candidate r * n // rounds


class HeadroomGPU:
    """Fake timings: candidate i takes true[i] us, 10 % less right after candidate ``light`` (a communication-bound
    call leaves the power-capped GPU headroom for the next one)."""

    def __init__(self, true, light):
        self.true, self.light, self.order = true, light, []

    def __call__(self, i):
        boost = 0.9 if self.order and self.order[-1] == self.light else 1.0
        self.order.append(i)
        return self.true[i] * boost


def test_in_turn_varies_each_candidates_predecessor():
    """In a fixed cyclic order candidate 1 would always follow the light candidate 0 and win on its headroom;
    with the stride changing per round its predecessor changes, and the truly fastest one wins."""
    gpu = HeadroomGPU([150.0, 100.0, 99.0, 100.0, 101.0], light=0)
    medians = autotune.in_turn(5, 5, gpu)
    assert min(range(5), key=medians.__getitem__) == 2, medians
    for n, rounds in ((5, 5), (9, 5), (4, 3), (7, 7)):
        orders = [autotune.turn_order(n, r, rounds) for r in range(rounds)]
        assert all(sorted(o) == list(range(n)) for o in orders)  # every candidate once per round
        predecessors = {i: {o[o.index(i) - 1] for o in orders if o.index(i) > 0} for i in range(n)}
        assert all(len(p) >= min(2, rounds - 1) for p in predecessors.values()), predecessors


def test_in_turn_times_a_failed_candidate_once():
    gpu = BurstyGPU([50.0, float("inf"), 60.0], burst=0)
    assert autotune.in_turn(3, 3, gpu) == [50.0, float("inf"), 60.0]
    assert gpu.order.count(1) == 1 and gpu.order.count(0) == 3
    gpu = BurstyGPU([50.0, float("nan"), 60.0], burst=0)  # the benchmarks' harness reports a failure as NaN
    medians = autotune.in_turn(3, 3, gpu)
    assert medians[0] == 50.0 and medians[2] == 60.0 and medians[1] != medians[1]
    assert gpu.order.count(1) == 1


def test_choose_tunes_in_turn_and_caches(tmp_path, monkeypatch):
    """choose() with tuning allowed (faked here: no GPU needed): candidates timed in turn, the fastest by median
    chosen, the medians written to the disk cache, a second call served from memory without timing."""
    monkeypatch.setenv("TRITON_DIST_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "tuning_allowed", lambda: True)
    gpu = BurstyGPU([100.0, 97.0, 100.0])
    candidates = [{"x": 1}, {"x": 2}, {"x": 3}]
    monkeypatch.setattr(autotune, "time_candidate",
                        lambda run, cfg, **kw: gpu(candidates.index(cfg)))
    key = {"m": 7, "test": "choose-in-turn"}
    cfg = autotune.choose("demo_turn", key, candidates, lambda: None, default=candidates[0], collective=False)
    assert cfg == {"x": 2} and len(gpu.order) == 15  # 3 candidates, 5 rounds
    doc = json.loads((tmp_path / "demo_turn.json").read_text())
    fkey = autotune.full_key("demo_turn", key, False, candidates)
    assert doc[fkey] == {"x": 2} and doc["_timings_us"][fkey] == [100.0, 97.0, 100.0]
    assert autotune.choose("demo_turn", key, candidates, lambda: None, default=candidates[0],
                           collective=False) == {"x": 2} and len(gpu.order) == 15
    autotune._CHOSEN.pop((None, fkey))


def test_short_candidates_get_more_calls_after_their_first_round(tmp_path, monkeypatch):
    """Later rounds time enough calls to span SPAN_US (at most MAX_ITERS, never fewer than iters), counted from
    the candidate's own first-round figure: a 1-ms candidate 50 calls, a 10-ms one stays at 10, a 100-us one
    MAX_ITERS."""
    monkeypatch.setenv("TRITON_DIST_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "tuning_allowed", lambda: True)
    candidates = [{"us": 1000.0}, {"us": 10000.0}, {"us": 100.0}]
    counts = {0: [], 1: [], 2: []}

    def fake_time(run, cfg, iters, **kw):
        counts[candidates.index(cfg)].append(iters)
        return cfg["us"]
    monkeypatch.setattr(autotune, "time_candidate", fake_time)
    autotune.choose("demo_iters", {"test": "iters"}, candidates, lambda: None, default=candidates[0],
                    collective=False, iters=10, rounds=3)
    assert counts == {0: [10, 50, 50], 1: [10, 10, 10], 2: [10, 100, 100]}
    assert autotune.iters_after(None, 10) == 10 and autotune.iters_after(float("inf"), 10) == 10
    autotune._CHOSEN.clear()


def test_graph_runs_report_per_call_and_hold_enough_calls(tmp_path, monkeypatch):
    """A runner of ``calls`` launches per run (``graph_runner``): the chosen candidate, the printed and the kept
    figures are per call, and later rounds' counts follow the run's own time. ``graph_calls``: enough calls for
    GRAPH_SPAN_US of work, one for long kernels, MAX_GRAPH_CALLS for tiny or unknown ones."""
    monkeypatch.setenv("TRITON_DIST_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "tuning_allowed", lambda: True)
    candidates = [{"us": 300.0}, {"us": 200.0}]
    counts = []

    def fake_time(run, cfg, iters=10, **kw):
        counts.append(iters)
        return cfg["us"] * run.calls  # a run replays run.calls launches

    def make_runner():
        run = autotune.graph_runner(lambda cfg: None, calls=5)
        assert run.calls == 5
        return run
    monkeypatch.setattr(autotune, "time_candidate", fake_time)
    key = {"test": "graph-calls"}
    assert autotune.choose("demo_calls", key, candidates, make_runner, default=candidates[0], collective=False,
                           rounds=2) == {"us": 200.0}
    fkey = autotune.full_key("demo_calls", key, False, candidates)
    assert json.loads((tmp_path / "demo_calls.json").read_text())["_timings_us"][fkey] == [300.0, 200.0]
    assert sorted(counts) == [10, 10, 33, 50]  # SPAN_US (50 ms) spanned by 1500- and 1000-us runs
    autotune._CHOSEN.clear()
    span = autotune.GRAPH_SPAN_US
    assert autotune.graph_calls(10 * span) == 1 and autotune.graph_calls(span / 4) == 4
    assert autotune.graph_calls(span / 1000) == autotune.graph_calls(0.0) == autotune.MAX_GRAPH_CALLS


@pytest.mark.parametrize("n,rounds", [(1, 3), (5, 1), (11, 3), (3, 5)])
def test_in_turn_order_depends_only_on_the_counts(n, rounds):
    """Ranks time collectively in the same order: the order is a function of (n, rounds) alone."""
    a, b = BurstyGPU([1.0] * n), BurstyGPU([2.0] * n)
    autotune.in_turn(n, rounds, a)
    autotune.in_turn(n, rounds, b)
    assert a.order == b.order and len(a.order) == n * rounds
