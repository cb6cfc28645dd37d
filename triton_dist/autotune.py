"""Kernel configurations that every rank agrees on, tuned once and cached on disk.

    cfg = autotune.choose("ag_gemm", {"m": m, "n": n, "k": k, "dtype": "bfloat16"},
                          candidates,                # list of config dicts (same list on every rank)
                          make_runner,               # () -> run(cfg): launches the op once with cfg
                          default=candidates[0])

* **Ranks never disagree.** Collective ops are timed on every rank in the same order; a candidate's time is the
  max over ranks, every rank picks the argmin of the same numbers, and rank 0's pick is broadcast anyway.
* **Tuned once.** Choices live in memory and in ``$TRITON_DIST_CACHE_DIR`` (default ``~/.cache/triton_dist/
  autotune``), one JSON file per op, keyed by GPU, world size, the op's key, the library versions and a digest
  of the candidate list (new candidates tune again).
* **Never at the wrong time.** No tuning under the interpreter, during CUDA-graph capture or a torch.compile trace,
  nor where ranks share a GPU (the cached choice or ``default`` then, identical on every rank).
  ``TRITON_DIST_AUTOTUNE=0`` turns it off.
* **Fair on a power-capped GPU.** Candidates are timed in turn, ``rounds`` times, each round in a different order
  (``turn_order``), each timing after ~50 ms of the candidate itself (``WARMUP_US``), and each keeps the median of
  its rounds: a GPU at its power limit drifts by several percent within a second.
* **Enough samples.** Later rounds time enough calls to span ``SPAN_US`` (at most ``MAX_ITERS``), counted from
  the first round's figure, which every rank shares: short calls beyond the host's jitter, long ones beyond a
  power-capped GPU's slow spells.
* **Device time for short kernels.** ``graph_runner`` replays a CUDA graph of each candidate holding enough calls
  for about ``GRAPH_SPAN_US`` of work (``graph_calls``): one call of a few µs replayed alone times the host's cost
  of a replay and its events, the same for every candidate. Figures are per call.
A candidate that fails (e.g. too much shared memory) fails on every rank alike and scores infinity.
docs/design/autotune.md has the measurements behind these rules.
"""

import hashlib
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from . import hardware
from .timing import max_over_ranks, median_us, timeable

_CHOSEN = {}  # full key -> config (identical on every rank)
SPAN_US = 50000.0  # later rounds time a candidate over about this long (a power-capped GPU's spells last ~0.1 s) ...
MAX_ITERS = 100  # ... in at most this many calls
WARMUP_US = 50000.0  # each timing starts after ~50 ms of the candidate itself (timing.warm_up)
GRAPH_SPAN_US = 100.0  # a tuning graph holds calls for about this much device work ...
MAX_GRAPH_CALLS = 16  # ... in at most this many calls


def cache_dir():
    return os.environ.get("TRITON_DIST_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "triton_dist", "autotune")


def _versions():
    import triton

    from . import __version__

    return {"triton_dist": __version__, "triton": triton.__version__, "torch": torch.__version__.split("+")[0]}


def _group_info(collective, group=None):
    """(group, its size, this rank's index) for a collective tuning on ``group`` (None: the heap's)."""
    if collective and dist.is_available() and dist.is_initialized():
        from . import shmem

        if shmem.is_initialized():
            team = shmem.team(group)
            return team.group, team.size, team.rank
        return group, dist.get_world_size(group), dist.get_rank(group)
    return None, 1, 0


def _group_name(group):
    return None if group is None else getattr(group, "group_name", str(id(group)))


def full_key(op, key, collective=True, candidates=None, group=None):
    """The cache key: op, GPU, world size, the op's key, the library versions and (when given) a digest of the
    candidate list, so that a library that tries new configurations tunes again instead of reusing a choice
    made among the old ones."""
    _, world, _ = _group_info(collective, group)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    extra = {}
    if candidates is not None:
        text = json.dumps(candidates, sort_keys=True, default=str)
        extra["candidates"] = hashlib.sha1(text.encode()).hexdigest()[:12]
    return json.dumps({"op": op, "gpu": gpu, "world": world, **key, **_versions(), **extra}, sort_keys=True)


def tuning_allowed():
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("TRITON_DIST_AUTOTUNE", "1") == "0":
        return False
    if not timeable():  # no GPU, or ranks sharing one (their timings measure each other)
        return False
    return not (hardware.capturing() or hardware.compiling())


def _read_disk(op, fkey):
    try:
        with open(os.path.join(cache_dir(), f"{op}.json")) as f:
            return json.load(f).get(fkey)
    except (OSError, ValueError):
        return None


def _write_disk(op, fkey, cfg, timings):
    path = os.path.join(cache_dir(), f"{op}.json")
    try:
        os.makedirs(cache_dir(), exist_ok=True)
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            doc = {}
        doc[fkey] = cfg
        doc.setdefault("_timings_us", {})[fkey] = timings
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only home must not break the op
        print(f"triton_dist autotune: could not write {path}: {exc}", file=sys.stderr)


def _broadcast(obj, group, world, rank):
    if world == 1:
        return obj
    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]


def time_candidate(run, cfg, iters=10, warmup=2, collective=True, group=None, warmup_us=0.0):
    """Median µs of ``run(cfg)`` on this rank (max over ranks if collective); inf if it raises. Warm-up:
    ``warmup`` calls, then more up to ``warmup_us`` (``timing.warm_up``)."""
    try:
        t = median_us(lambda: run(cfg), iters, warmup, warmup_us, group, collective)
    except Exception as exc:  # same failure on every rank; keep the collectives in step
        print(f"triton_dist autotune: candidate {cfg} failed: {type(exc).__name__}: {str(exc)[:200]}",
              file=sys.stderr)
        t = float("inf")
        try:
            torch.cuda.synchronize()
        except Exception:
            pass
    return max_over_ranks(t, group) if collective else t


def turn_order(n, r, rounds):
    """The candidates of round r in the order they are timed: starting at r * n // rounds (each candidate is
    timed early, midway and late in a round), then stepping by a stride that changes from round to round
    (1, 2, 3, ... modulo the smallest prime p >= n, skipping the numbers >= n), so that a candidate's
    predecessor changes too: one that always ran right after a light, communication-bound candidate would
    always start with the power headroom it left."""
    p = max(n, 2)
    while any(p % d == 0 for d in range(2, int(p ** 0.5) + 1)):
        p += 1
    stride = 1 + r % (p - 1)
    first = r * n // rounds
    return [i for i in ((first + j * stride) % p for j in range(p)) if i < n]


def in_turn(n, rounds, time_one):
    """Median over ``rounds`` rounds of ``time_one(i)`` for every candidate i < n, timed in turn
    (``turn_order``). A candidate that fails in its first round (inf here, NaN in the benchmarks' harness) is
    not timed again. The order depends only on n and rounds: collective timings stay in step across ranks."""
    times = [[] for _ in range(n)]
    for r in range(rounds):
        for i in turn_order(n, r, rounds):
            if times[i] and not math.isfinite(times[i][0]):
                continue
            times[i].append(time_one(i))
    return [statistics.median(t) for t in times]


def iters_after(first_us, iters):
    """Calls to time in a candidate's later rounds: enough to span SPAN_US (MAX_ITERS at most), never fewer than
    ``iters`` (also the count of the first round, ``first_us`` None). A function of numbers every rank shares."""
    if first_us is None or not first_us > 0 or math.isinf(first_us):
        return iters
    return max(iters, min(MAX_ITERS, int(SPAN_US / first_us)))


def spanning(time_iters, iters):
    """``in_turn``'s ``time_one(i)`` from ``time_iters(i, calls)``: a candidate's first round times ``iters``
    calls, its later rounds ``iters_after`` that round's figure (which every rank shares: a max over ranks)."""
    first = {}

    def time_one(i):
        t = time_iters(i, iters_after(first.get(i), iters))
        first.setdefault(i, t)
        return t
    return time_one


def choose(op, key, candidates, make_runner, default, collective=True, iters=10, rounds=5, group=None):
    """The configuration to use for ``op`` at ``key`` (see the module docstring); ``group``: the ranks a
    collective op runs on (None: the heap's)."""
    fkey = full_key(op, key, collective, candidates, group)
    team_group, world, rank = _group_info(collective, group)
    mkey = (_group_name(team_group), fkey)  # in memory per group: a rank in two groups tunes with each of them
    if mkey in _CHOSEN:
        return _CHOSEN[mkey]
    if not tuning_allowed() or len(candidates) <= 1:
        return default if len(candidates) != 1 else candidates[0]
    group = team_group
    cached = _broadcast(_read_disk(op, fkey) if rank == 0 else None, group, world, rank)
    if cached is not None:
        _CHOSEN[mkey] = cached
        return cached
    run = make_runner()
    calls = getattr(run, "calls", 1)  # launches per run (graph_runner): the figures printed and kept are per call
    t0 = time.time()
    if rank == 0:
        print(f"triton_dist autotune {op} {key}: {len(candidates)} candidates", file=sys.stderr, flush=True)
    done = [0] * len(candidates)

    def time_iters(i, calls_timed):
        t = time_candidate(run, candidates[i], iters=calls_timed, collective=collective, group=group,
                           warmup_us=WARMUP_US)
        done[i] += 1
        if rank == 0:
            print(f"  [{i + 1}/{len(candidates)}] round {done[i]}/{rounds} {t / calls:10.1f} us  "
                  f"{_short(candidates[i])}",
                  file=sys.stderr, flush=True)
        return t

    timings = [t / calls for t in in_turn(len(candidates), rounds, spanning(time_iters, iters))]
    best = min(range(len(candidates)), key=lambda i: timings[i])
    best = _broadcast(best, group, world, rank)  # belt and braces: rank 0's pick wins
    cfg = candidates[best]
    _CHOSEN[mkey] = cfg
    if rank == 0:
        print(f"triton_dist autotune {op}: chose [{best + 1}] {_short(cfg)}, median {timings[best]:.1f} us "
              f"({time.time() - t0:.1f} s)",
              file=sys.stderr, flush=True)
        _write_disk(op, fkey, cfg, timings)
    return cfg


def graph_calls(estimate_us):
    """Launches a tuning graph holds (``graph_runner``) for a kernel of about ``estimate_us`` µs of device work:
    enough for ``GRAPH_SPAN_US``, at most ``MAX_GRAPH_CALLS``. An estimate within a few times of the truth does."""
    if not estimate_us > 0:
        return MAX_GRAPH_CALLS
    return max(1, min(MAX_GRAPH_CALLS, math.ceil(GRAPH_SPAN_US / estimate_us)))


def graph_runner(launch, calls=1):
    """``run(cfg)`` for ``choose``'s ``make_runner``: a replay of a CUDA graph of ``calls`` back-to-back
    ``launch(cfg)``, captured at the candidate's first run after one eager call (``timing.graph_of``): device time
    without the op's host path. ``run.calls`` tells ``choose`` to report per call."""
    from .timing import graph_of

    graphs = {}  # id of a candidate (choose passes the same dicts every round) -> its graph

    def run(cfg):
        graph = graphs.get(id(cfg))
        if graph is None:
            graph = graphs[id(cfg)] = graph_of(lambda: launch(cfg), calls)
        graph.replay()
    run.calls = calls
    return run


def dedupe(configs):
    """``configs`` without repeats, first occurrences in order (candidate lists are built by overlaying knobs)."""
    unique = []
    for c in configs:
        if c not in unique:
            unique.append(c)
    return unique


def with_overrides(defaults, config):
    """``defaults`` (a dict of knobs) updated by the caller's ``config``: a config that is not a dict, or names a
    knob that ``defaults`` lacks (a typo would otherwise be ignored silently), raises."""
    if not config:
        return dict(defaults)
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict, got {type(config).__name__}")
    unknown = sorted(set(config) - set(defaults))
    if unknown:
        raise ValueError(f"unknown config keys {unknown}; known: {sorted(defaults)}")
    return {**defaults, **config}


def _short(cfg):
    return " ".join(f"{k}={v}" for k, v in cfg.items() if v is not None)
