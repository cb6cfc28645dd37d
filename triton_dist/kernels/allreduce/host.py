"""The launcher of the all-reduce kernel: the symmetric workspace an op keeps per input dtype (grown, never
allocated per call), the plan of a call (grid, constants, workspace: derived once per shape and configuration),
and how a call resolves its configuration and whether x can be read in place (zero-copy)."""

import torch

from ... import autotune, shmem
from ... import language as dl
from ...shmem.heap import runtime
from ...hardware import cdiv, next_power_of_2
from ..launcher import Launcher
from . import config as knobs
from .config import ALGOS, DTYPES
from .kernels import all_reduce_kernel


class Workspace:
    """An op's symmetric buffers for one input dtype: staging [2, stage_elems] (x's copy, epoch parity halves),
    reduced [2, slice_elems] (two-shot), the flags arrived / published / done [programs, W] and the epoch."""

    def __init__(self, op, dtype, reduced_dtype, sizes, group):
        self.sizes = sizes
        self.stage_elems, self.slice_elems, n_flags = sizes
        self.staging = shmem.empty((2 * self.stage_elems,), dtype, name=f"{op}.staging", group=group)
        self.reduced = shmem.empty((2 * self.slice_elems,), reduced_dtype, name=f"{op}.reduced", group=group)
        self.arrived, self.published, self.done = (shmem.signals((n_flags,), name=f"{op}.{f}", group=group)
                                                   for f in ("arrived", "published", "done"))
        self.state = shmem.counters(2, name=f"{op}.epoch")


def grown_workspace(op, key, build, needs, group):
    """The workspace of ``op`` for ``key`` holding at least ``needs`` (a tuple of sizes), built by
    ``build(sizes)`` (powers of two, never smaller than the one it replaces). Replacing one is collective (every
    rank makes the same calls) and starts with a device barrier: earlier calls of the peers may still read the
    old buffers, which the new ones may overlap."""
    old = shmem.workspaces.peek(op, key, group)
    if old is not None:
        if all(have >= need for have, need in zip(old.sizes, needs)):
            return old
        needs = tuple(max(have, need) for have, need in zip(old.sizes, needs))
        shmem.barrier(group)
    sizes = tuple(next_power_of_2(max(int(n), 1)) for n in needs)
    return shmem.workspace(op, key, lambda: build(sizes), group=group,
                           fits=lambda ws: all(h >= n for h, n in zip(ws.sizes, sizes)))


class Plan:
    """One launch of ``all_reduce_kernel`` for a shape, dtype and configuration: the grid, the constants and the
    workspace, derived once; ``launch`` is what a call costs on the host."""

    def __init__(self, op, x, reduced_dtype, row_len, block, epilogue, cfg, zero_copy, team):
        world, numel = team.size, x.numel()
        rows = cdiv(numel, row_len)
        two_shot = cfg["algo"] == "two_shot" and world > 1
        programs = knobs.num_programs(cfg, cdiv(rows, world) if two_shot else rows, x.device)
        needs = (0 if zero_copy else numel, cdiv(rows, world) * row_len if two_shot else 0, programs * world)
        self.ws = ws = grown_workspace(op, (x.dtype, reduced_dtype),
                                       lambda sizes: Workspace(op, x.dtype, reduced_dtype, sizes, team.group),
                                       needs, team.group)
        self.sizes = (rows, row_len, numel, ws.stage_elems, ws.slice_elems)
        self.kernel = Launcher(all_reduce_kernel, (programs,), BLOCK=block, WORLD=world,
                               WORLD_P2=dl.rank_lanes(world), TWO_SHOT=two_shot, ZERO_COPY=zero_copy,
                               EPILOGUE=epilogue, num_warps=cfg["num_warps"])
        self.ctx = team.ctx

    def launch(self, x, out, residual=None, weight=None, new_residual=None, scales=None, eps=0.0):
        ws = self.ws
        shmem.raise_pending_errors()
        tensors = (x, out, out if residual is None else residual, out if weight is None else weight,
                   out if new_residual is None else new_residual, out if scales is None else scales)
        args = (*tensors, ws.staging, ws.reduced, ws.arrived, ws.published, ws.done, ws.state, *self.sizes, eps,
                self.ctx)
        pointers = 0
        for t in tensors:
            pointers |= t.data_ptr()
        if x.is_cuda and pointers % 16 == 0:  # (the plan's key fixes the dtypes, sizes and the workspace)
            self.kernel.run(*args)
        else:
            self.kernel(*args)


NCCL = "nccl"  # the plan of a call that takes the NCCL path


def resolve_configs(op, nbytes, team, algo, config, device, make_call, key, row_len=None):
    """(configuration of eager calls, of calls a CUDA graph captures): ``config`` over the default (an ``algo``
    other than "auto" replaces its algo); with ``algo="auto"`` and no ``config`` on GPU, the ones tuned for the
    call's size bucket (``key``: what else the tuning depends on; ``make_call``: see ``config.tuned``)."""
    base = knobs.default_config(nbytes, team.size, device, row_len)
    if algo != "auto" or config or not knobs.tunable(device, team.size):
        cfg = autotune.with_overrides({**base, **({} if algo == "auto" else {"algo": algo})}, config)
        return cfg, cfg
    size = knobs.bucket(nbytes)
    return knobs.tuned(op, {**key, "bytes": size}, knobs.candidates(nbytes, team.size, device, row_len), base,
                       make_call, team.group)


def plan_pair(configs, build):
    """(plan of eager calls, plan of captured calls): ``build(config)`` of each, both now (a capture cannot make
    workspaces). The second may grow the workspace the first holds: then the first is built again on it."""
    first = build(configs[0])
    if configs[1] == configs[0]:
        return first, first
    second = build(configs[1])
    if first is not NCCL and second is not NCCL and first.ws is not second.ws:
        first = build(configs[0])
    return first, second


def zero_copy(x, in_place, algo, world):
    """Whether the peers may read x where it is: x in the heap (the same symmetric tensor on every rank), and not
    overwritten by its own one-shot result (the peers read x until the call's end). One rank: nothing to share."""
    return world == 1 or (shmem.is_symmetric(x) and not (algo == "one_shot" and in_place))


def heap_offset(x):
    """Where a symmetric x starts in this rank's heap (check mode compares it across ranks), else None."""
    if not shmem.is_symmetric(x):
        return None
    rt = runtime()
    return x.data_ptr() - rt.heap.bases[rt.rank]


def check_tensor(t, name):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    shmem.check_device(t, name)


def check_algo(algo):
    if algo not in ALGOS:
        raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
