"""Launch knobs of the all-reduce ops, their defaults, the candidates the autotuner times on GPU, and how a call
picks its configuration.

Knobs (``config=`` overrides of ``default_config``): ``algo`` ("one_shot" | "two_shot" | "nccl": torch
``dist.all_reduce``, plus torch ops for the RMSNorm and GEMM), ``num_programs`` (None: one per row, at most one
per SM), ``block`` (all_reduce: the elements of a row; all_reduce_rmsnorm's rows are its tokens), ``num_warps``;
gemm_ar has its own (``gemm_ar.default_config``).

``algo="auto"`` takes a configuration per size bucket (the next power of two of the bytes), identical on every
rank: on CPU the default (one-shot up to ``one_shot_limit`` bytes, two-shot above), on GPU the autotuner's pick.
A call is tuned twice, both on its first eager call: timed as eager calls (host cost included) and as replays of
a CUDA graph of one call (device time); a call made while a CUDA graph is being captured takes the second.
"""

import torch

from ... import autotune, hardware
from ...hardware import next_power_of_2

ALGOS = ("auto", "one_shot", "two_shot", "nccl")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_ROW = 65536  # all_reduce_rmsnorm keeps a whole row in registers


def one_shot_limit(world):
    """The largest message (bytes) the default sends one-shot: each rank reads (W - 1) whole inputs, which only
    pays while the latency of the second phase of two-shot would dominate."""
    return (2 << 20) // max(world, 1)


def bucket(nbytes):
    """The size bucket a message of ``nbytes`` is tuned in."""
    return next_power_of_2(max(int(nbytes), 1024))


def default_config(nbytes, world, device, row_len=None):
    """Launch knobs for a message of ``nbytes`` (``row_len``: all_reduce_rmsnorm's rows, else None)."""
    algo = "one_shot" if nbytes <= one_shot_limit(world) else "two_shot"
    if row_len is not None:  # a whole row per block
        warps = 4 if device.type != "cuda" else max(4, min(16, next_power_of_2(row_len) // 512))
        return dict(algo=algo, num_programs=2 if device.type != "cuda" else None, num_warps=warps)
    if device.type != "cuda":  # interpreter: few programs, small rows
        return dict(algo=algo, num_programs=2, block=32, num_warps=4)
    return dict(algo=algo, num_programs=None, block=2048 if nbytes <= (1 << 20) else 4096, num_warps=4)


def candidates(nbytes, world, device, row_len=None):
    """The configurations the autotuner times for a message of ``nbytes`` (GPU only)."""
    base = default_config(nbytes, world, device, row_len)
    cands = [base, {**base, "algo": "nccl"}]
    algos = ["two_shot"] + (["one_shot"] if nbytes <= (16 << 20) else [])
    for algo in algos:
        if row_len is not None:
            cands += [{**base, "algo": algo, "num_warps": w} for w in (4, 8, 16)]
        else:
            cands += [{**base, "algo": algo, "block": b, "num_warps": w} for b, w in ((1024, 4), (2048, 4),
                                                                                      (4096, 8), (8192, 16))]
    return autotune.dedupe(cands)


def tunable(device, world):
    """Whether "auto" takes tuned configurations: on GPUs, with peers (elsewhere the defaults)."""
    return device.type == "cuda" and world > 1


def tuned(op, key, cands, default, make_call, group):
    """(config for eager calls, config for calls captured into a CUDA graph) of ``op`` at ``key`` (a dict), each
    chosen among ``cands`` by ``autotune.choose`` on every rank of ``group``: timed as eager calls, and as
    replays of a CUDA graph of one call. ``make_call()`` -> ``call(cfg)``, one op call on tuning inputs."""
    eager = autotune.choose(op, {**key, "timed": "eager"}, cands, make_call, default=default, group=group)

    graph = autotune.choose(op, {**key, "timed": "graph"}, cands, lambda: autotune.graph_runner(make_call()),
                            default=default, group=group)
    return eager, graph


def num_programs(cfg, rows, device):
    """Programs of a launch over ``rows`` rows per program set: one per row, at most one per SM (GPU: every
    program must be resident, since each waits on the peers' programs of the same index), or ``num_programs``."""
    most = cfg.get("num_programs") or 2
    if device.type == "cuda":
        most = min(int(cfg.get("num_programs") or 1 << 30), hardware.num_sms(device.index))
    return max(1, min(int(most), rows))
