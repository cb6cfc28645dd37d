"""All-gather by pushing: every rank stores its shard straight into every peer's output, chunk by chunk.

    rank r:   for each peer p (starting with itself) and each chunk c of its shard:
                  wait until p has entered this call          (ready[r] on r, set by p: p is done with the old out)
                  dl.put(out[r's rows, chunk c]) on p
                  dl.signal(arrived[r, c]) on p with this call's epoch
              the last program then waits until arrived[q, c] >= epoch for every rank q and chunk c

Flags carry the call's *epoch* (1, 2, 3, ... kept on the device by ``dl.call_epoch``/``dl.finish_call``), so
repeated calls and CUDA-graph replays need no flag resets. ``arrived`` is what overlapped consumers (AG+GEMM)
wait on chunk by chunk; this standalone op waits for everything before it returns.

Programs are ordered so that all pushes of a launch precede its waits: the Triton interpreter runs the programs
of a launch one after another, and the same source must run there.
"""

import torch
import triton
import triton.language as tl

from .. import autotune, hardware, shmem
from .. import language as dl
from ..hardware import cdiv, next_power_of_2
from . import library
from .launcher import Launcher


@triton.jit
def all_gather_push_kernel(src, out, arrived, ready, state, shard_words, chunk_words, n_chunks, ctx,
                           BLOCK: tl.constexpr, FLAGS_BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    epoch = dl.call_epoch(state)
    if pid == 0:  # every peer may overwrite our copy of `out` now
        dl.enter_call(ready, epoch, me, world, ctx)
    for item in range(pid, world * n_chunks, n_programs):
        # Consecutive items go to different destinations, so at any moment some programs copy into our own
        # `out` (HBM bound) while the others push to peers (NVLink bound): the two overlap instead of queueing.
        peer = (me + item % world) % world
        chunk = item // world
        dl.wait_entered(ready, peer, epoch, ctx)
        start = chunk * chunk_words
        end = tl.minimum(start + chunk_words, shard_words)
        dst = out + me.to(tl.int64) * shard_words
        for off in range(start, end, BLOCK):
            offs = off + tl.arange(0, BLOCK)
            m = offs < end
            dl.put(dst + offs, tl.load(src + offs, mask=m), peer, ctx, mask=m)
        dl.signal(arrived + me * n_chunks + chunk, epoch, peer, ctx)
    if pid == n_programs - 1:
        for first in range(0, world * n_chunks, FLAGS_BLOCK):
            idx = first + tl.arange(0, FLAGS_BLOCK)
            dl.wait(arrived + idx, epoch, ctx, mask=idx < world * n_chunks)
    dl.finish_call(state, epoch, n_programs)


class _Signals:
    """The flags of one chunk count: ``arrived[r * n_chunks + c]`` (chunk c of rank r has landed here),
    ``ready[r]`` (rank r entered the call) and this rank's epoch counter."""

    def __init__(self, n_chunks, group):
        world = shmem.world_size(group)
        self.arrived = shmem.signals((world * n_chunks,), name="all_gather.arrived", group=group)
        self.ready = shmem.signals((world,), name="all_gather.ready", group=group)
        self.state = shmem.counters(2, name="all_gather.epoch")


def _as_words(t):
    """View a contiguous tensor as the widest integer words its byte size allows (wider = fewer instructions)."""
    flat = t.reshape(-1).view(torch.uint8)
    for dtype in (torch.int64, torch.int32, torch.int16):
        if flat.numel() % dtype.itemsize == 0 and flat.data_ptr() % dtype.itemsize == 0:
            return flat.view(dtype)
    return flat


def default_config(nbytes, device_type):
    if device_type == "cpu":
        return {"num_programs": 2, "n_chunks": 2, "block": 256, "num_warps": 4}
    if nbytes >= (8 << 20):
        return {"num_programs": 64, "n_chunks": 64, "block": 4096, "num_warps": 16}
    return {"num_programs": 16, "n_chunks": 16, "block": 1024, "num_warps": 8}


def all_gather(x, out=None, config=None, group=None):
    """``out = cat([x of rank 0, x of rank 1, ...], dim=0)`` on every rank of ``group`` (default: the heap's), by
    direct stores into peers' ``out``.

    ``x``: this rank's shard (any contiguous tensor; zero rows allowed). ``out``: a symmetric tensor of shape
    ``[world * x.shape[0], *x.shape[1:]]`` and x's dtype, allocated for the group if not given (an allocation is
    an agreement between the ranks: pass ``out`` for repeated calls and CUDA graphs). Also
    ``torch.ops.triton_dist.all_gather(x, group_name)`` (a new tensor every call, through a cached symmetric
    buffer), which an ``x`` that requires grad goes through: its gradient is this rank's rows of the sum of every
    rank's (``kernels/autograd.py``).
    """
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        _check_input(x)  # raises
    if out is None and config is None and (library.needs_grad(x) or hardware.compiling()):
        return torch.ops.triton_dist.all_gather(x, shmem.group_name(group))
    team = shmem.op_team("all_gather", group, lambda: dict(shape=tuple(x.shape), dtype=str(x.dtype),
                                                           out=None if out is None else tuple(out.shape),
                                                           config=config))
    x = x.contiguous()
    address = None  # (an out allocated here is symmetric by construction)
    if out is None:
        out = shmem.empty((team.size * x.shape[0], *x.shape[1:]), x.dtype, name="all_gather.out", group=group)
    elif not isinstance(out, torch.Tensor):
        shmem.check_symmetric(out, "out")  # raises
    else:
        address = out.data_ptr()
    cfg_key = None if config is None else repr(sorted(config.items()))
    # a given out's address in the key: whether it lies in the heap is checked once per address
    key = (team, x.shape, x.dtype, x.device, out.shape, out.stride(), out.dtype, address, cfg_key)
    words = _LAYOUTS.find(key)
    if words is None:  # a new layout: checked once
        _check_input(x)
        shmem.check_symmetric(out, "out")
        shape = (team.size * x.shape[0], *x.shape[1:])
        if tuple(out.shape) != shape or out.dtype != x.dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {x.dtype} tensor of shape {list(shape)}, "
                             f"got {out.dtype} {list(out.shape)}")
        words = _LAYOUTS.get(key, lambda: _Words(x, team, config, cfg_key))
    if words.empty:
        return out
    if (x.data_ptr() | out.data_ptr()) % 16 == 0:  # (the word views and the bound launch want aligned data)
        src, dst, plan = words.view(x), words.view(out), words.plan
        shmem.raise_pending_errors()
        plan.launch.run(src, dst, *plan.args)
        return out
    src, dst = _as_words(x), _as_words(out)
    if src.dtype != dst.dtype:  # alignment of one side forbids the wider view
        src, dst = x.reshape(-1).view(torch.uint8), out.reshape(-1).view(torch.uint8)
    plan = _plan(team, src.numel(), src.dtype, x.device.type, config, cfg_key)
    shmem.raise_pending_errors()
    plan.launch(src, dst, *plan.args)
    return out


class _Words:
    """How the shards of one layout (x's shape and dtype, out's, the group, the config) travel: as the widest
    integer words their byte size allows, viewed directly where x's rows hold whole words, and the launch plan of
    those words."""

    def __init__(self, x, team, config, cfg_key):
        nbytes = x.numel() * x.element_size()
        self.empty = nbytes == 0
        self.word = next((d for d in (torch.int64, torch.int32, torch.int16) if nbytes % d.itemsize == 0),
                         torch.uint8)
        self.direct = x.shape[-1] * x.element_size() % self.word.itemsize == 0
        self.plan = None if self.empty else _plan(team, nbytes // self.word.itemsize, self.word, x.device.type,
                                                  config, cfg_key)

    def view(self, t):
        if self.direct:
            return t.view(self.word)
        return t.reshape(-1).view(torch.uint8).view(self.word)


def _plan(team, shard_words, word, device_type, config, cfg_key):
    return _PLANS.get((team.name, shard_words, word, device_type, cfg_key),
                      lambda: _Plan(shard_words, word.itemsize, device_type, team, config))


def _check_input(x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    shmem.check_device(x, "x")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension")


def gathered(x, group=None):
    """``all_gather(x)`` as a new tensor: through a symmetric buffer cached per (shape, dtype, group), so that
    repeated calls (a training loop's) allocate nothing on the heap. (Under torch.compile: the torch op.)"""
    if hardware.compiling():
        return torch.ops.triton_dist.all_gather(x, shmem.group_name(group))
    shape = (shmem.world_size(group) * x.shape[0], *x.shape[1:])
    buf = shmem.workspace("all_gather.gathered", (shape, x.dtype),
                          lambda: shmem.empty(shape, x.dtype, name="all_gather.gathered", group=group), group=group)
    return all_gather(x, out=buf, group=group).clone()


def _all_gather_op(x, group_name=None):
    _check_input(x)
    return gathered(x, shmem.group_named(group_name))


def _all_gather_fake(x, group_name=None):
    _check_input(x)
    return x.new_empty((shmem.world_size(shmem.group_named(group_name)) * x.shape[0], *x.shape[1:]))


library.define("all_gather(Tensor x, str? group_name=None) -> Tensor", _all_gather_op, _all_gather_fake)


class _Plan:
    """What every call of one (shard words, word size, group, config) shares: the chunking, the flags and the
    bound launch."""

    def __init__(self, shard_words, word_bytes, device_type, team, config):
        cfg = autotune.with_overrides(default_config(shard_words * word_bytes, device_type), config)
        n_chunks = max(1, min(cfg["n_chunks"], cdiv(shard_words, cfg["block"])))
        chunk_words = cdiv(cdiv(shard_words, n_chunks), cfg["block"]) * cfg["block"]
        n_chunks = cdiv(shard_words, chunk_words)
        ws = shmem.workspace("all_gather", n_chunks, lambda: _Signals(n_chunks, team.group), group=team.group)
        self.args = (ws.arrived, ws.ready, ws.state, shard_words, chunk_words, n_chunks, team.ctx)
        self.launch = Launcher(all_gather_push_kernel, (cfg["num_programs"],), BLOCK=cfg["block"],
                               FLAGS_BLOCK=next_power_of_2(min(team.size * n_chunks, 1024)),
                               num_warps=cfg["num_warps"])


_PLANS = shmem.Plans("all_gather")  # (group, shard words, word, config) -> _Plan
_LAYOUTS = shmem.Plans("all_gather_layouts")  # a call's layout -> its _Words
