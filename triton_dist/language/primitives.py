"""The primitives behind ``triton_dist.language`` (see the package docstring for the ordering contract).

All of them are built from Triton's own loads, stores and atomics; the one trick is the address translation in
``symm_at``: a symmetric tensor sits at the same offset in every rank's heap, so its copy on ``peer`` is
``ptr + (heap_base[peer] - heap_base[me])``.
"""

import os
import time

import triton
import triton.language as tl
from triton.language.extra import cuda as _cuda

from ..shmem import layout
from ..hardware import next_power_of_2

# The heap layout (shmem/layout.py) as compile-time constants of the same names (CTX_*, ERR_*, BARRIER_ARRIVALS,
# FENCE_SCRATCH).
_LAYOUT = ("CTX_RANK", "CTX_WORLD", "CTX_WAIT_BUDGET", "CTX_BARRIER", "CTX_BASES", "ERR_FLAG", "ERR_GAVE_UP",
           "ERR_RANK", "ERR_SIGNAL", "ERR_EXPECTED", "ERR_SEEN", "ERR_CMP", "ERR_KIND_WAIT", "ERR_KIND_INDEX",
           "BARRIER_ARRIVALS", "FENCE_SCRATCH")
globals().update({name: tl.constexpr(getattr(layout, name)) for name in _LAYOUT})

# Comparisons for `wait` and operations for `signal`. Pass these (e.g. `cmp=dl.EQ`) rather than bare strings:
# Triton 3.6 cannot pass a Python str into a @triton.jit helper (a kernel's own constexpr parameter is fine).
GE = tl.constexpr("ge")
GT = tl.constexpr("gt")
EQ = tl.constexpr("eq")
NE = tl.constexpr("ne")
SET = tl.constexpr("set")
ADD = tl.constexpr("add")


def rank_lanes(world):
    """Host side: the length of a kernel's rank axis (``tl.arange(0, rank_lanes(W))``, masked to ``< W``), to pass
    as a constexpr: a power of two, at least 2. A rank axis of one lane is miscompiled by triton 3.6 inside
    ep_combine's kernels (a group of one on an H200: 60 % of tokens wrong, right with two lanes;
    docs/design/moe_ep.md), so no kernel gets one."""
    return max(2, next_power_of_2(world))


@triton.jit
def rank(ctx):
    """This rank's index (int32 scalar)."""
    return tl.load(ctx + CTX_RANK).to(tl.int32)


@triton.jit
def num_ranks(ctx):
    """Number of ranks sharing the heap (int32 scalar)."""
    return tl.load(ctx + CTX_WORLD).to(tl.int32)


@triton.jit
def _heap_base(ctx, peer):
    return tl.load(ctx + CTX_BASES + peer)


@triton.jit
def symm_at(ptr, peer, ctx):
    """The address of ``ptr`` (a pointer or a block of pointers into a symmetric tensor) on rank ``peer``."""
    ELEM_BYTES: tl.constexpr = ptr.dtype.element_ty.primitive_bitwidth // 8
    delta = _heap_base(ctx, peer) - _heap_base(ctx, rank(ctx))
    # Heaps are page aligned: the distance is a whole number of elements, and a multiple of 16 of them, which
    # keeps the peer address exactly as aligned as `ptr` (so stores stay vectorised).
    return ptr + tl.multiple_of(delta // ELEM_BYTES, 16)


@triton.jit
def put(ptr, value, peer, ctx, mask=None):
    """Store ``value`` at ``ptr`` on rank ``peer`` (plain store; follow with ``signal`` to publish it)."""
    tl.store(symm_at(ptr, peer, ctx), value, mask=mask)


@triton.jit
def get(ptr, peer, ctx, mask=None, other=None):
    """Load ``ptr`` from rank ``peer`` (plain load; ``wait`` first for data the peer publishes)."""
    return tl.load(symm_at(ptr, peer, ctx), mask=mask, other=other)


@triton.jit
def signal(flag, value, peer, ctx, op: tl.constexpr = SET):
    """Publish every earlier store of this program, then set (``op=dl.SET``) or add to (``op=dl.ADD``) the int32
    ``flag`` on rank ``peer`` with release semantics at system scope."""
    tl.debug_barrier()  # the stores of all threads of the program happen before the release below
    remote = symm_at(flag, peer, ctx)
    if op == "add":
        tl.atomic_add(remote, value, sem="release", scope="sys")
    else:
        tl.atomic_xchg(remote, value, sem="release", scope="sys")


@triton.jit
def _satisfied(seen, value, CMP: tl.constexpr):
    # Signed difference: counters that wrap around past 2**31 still compare correctly.
    diff = (seen - value).to(tl.int32)
    if CMP == "eq":
        ok = diff == 0
    elif CMP == "ne":
        ok = diff != 0
    elif CMP == "gt":
        ok = diff > 0
    else:
        ok = diff >= 0
    return ok


@triton.jit
def _cmp_code(CMP: tl.constexpr):
    if CMP == "eq":
        code = 1
    elif CMP == "ne":
        code = 2
    elif CMP == "gt":
        code = 3
    else:
        code = 0
    return code


@triton.jit
def _record(ctx, KIND: tl.constexpr, where, expected, seen, code):
    """Fill this rank's error record unless it holds one already (the first error wins the record)."""
    me = rank(ctx)
    base = _heap_base(ctx, me)
    if tl.atomic_cas((base + ERR_FLAG).to(tl.pointer_type(tl.int32)), 0, KIND, sem="acq_rel", scope="sys") == 0:
        # tl.cast, not .to: a value may be a compile-time constant (Triton specialises integer arguments == 1)
        tl.store((base + ERR_RANK).to(tl.pointer_type(tl.int64)), tl.cast(me, tl.int64))
        tl.store((base + ERR_SIGNAL).to(tl.pointer_type(tl.int64)), tl.cast(where, tl.int64))
        tl.store((base + ERR_EXPECTED).to(tl.pointer_type(tl.int64)), tl.cast(expected, tl.int64))
        tl.store((base + ERR_SEEN).to(tl.pointer_type(tl.int64)), tl.cast(seen, tl.int64))
        tl.store((base + ERR_CMP).to(tl.pointer_type(tl.int64)), tl.cast(code, tl.int64))


@triton.jit
def _record_timeout(flag, value, seen, ctx, CMP: tl.constexpr):
    base = _heap_base(ctx, rank(ctx))
    tl.atomic_xchg((base + ERR_GAVE_UP).to(tl.pointer_type(tl.int32)), 1, sem="relaxed", scope="gpu")
    _record(ctx, ERR_KIND_WAIT, flag.to(tl.int64) - base, value, seen, _cmp_code(CMP))


_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
CPU_POLLS_PER_SECOND = tl.constexpr(layout.CPU_POLLS_PER_SECOND)


def _host_seconds():
    """The host's clock, for interpreted kernels only (a compiled kernel never reaches this Python function)."""
    return time.monotonic()


_host_seconds.__triton_builtin__ = True  # what Triton's dependency scan skips (it is no device code to hash)


@triton.jit
def _failed(ctx):
    """Whether a ``dl.wait`` of this rank has given up (then every later wait gives up at once)."""
    flag = (_heap_base(ctx, rank(ctx)) + ERR_GAVE_UP).to(tl.pointer_type(tl.int32))
    return tl.load(flag, volatile=True) != 0


@triton.jit
def check_index(index, position, bound, ctx, SITE: tl.constexpr, mask=None):
    """Whether ``index`` (a scalar or a block) lies in [0, ``bound``), element by element; an index outside it
    (not masked off) is recorded in this rank's error record with its ``position`` and the call site ``SITE``
    (``shmem.layout.INDEX_SITES``), which the host raises as ``DeviceIndexError``. The caller must not use the
    indices this returns False for: they would address memory outside their tensor."""
    good = (index >= 0) & (index < bound)
    if mask is None:
        mask = True
    bad = (good == 0) & mask
    if len(bad.shape) > 1:  # one reduction over every element
        bad = tl.reshape(bad, (bad.numel,))
        position = tl.reshape(position, (position.numel,))
        index = tl.reshape(index, (index.numel,))
    if len(bad.shape) > 0:
        if tl.max(bad.to(tl.int32), axis=0) > 0:
            first = tl.min(tl.where(bad, position, 0x7FFFFFFFFFFFFFFF), axis=0)
            # (elements may share a position, e.g. the tokens of one page: they hold the same index)
            value = tl.max(tl.where(bad & (position == first), index.to(tl.int64), -0x7FFFFFFFFFFFFFFF), axis=0)
            _record(ctx, ERR_KIND_INDEX, bound, first, value, SITE)
    elif bad:
        _record(ctx, ERR_KIND_INDEX, bound, position, index, SITE)
    return good


@triton.jit
def _poll(flag, mask):
    return tl.atomic_add(flag, 0, mask=mask, sem="acquire", scope="sys")


@triton.jit
def _all_satisfied(seen, value, mask, CMP: tl.constexpr):
    ok = _satisfied(seen, value, CMP)
    if len(seen.shape) > 0:
        ok = tl.min(((ok != 0) | (mask == 0)).to(tl.int32), axis=0)
    return ok != 0


@triton.jit
def wait(flag, value, ctx, cmp: tl.constexpr = GE, mask=None):
    """Poll this rank's int32 ``flag`` with acquire semantics until ``flag <cmp> value`` (``dl.GE``, ``dl.GT``,
    ``dl.EQ``, ``dl.NE``) and return the last value(s) seen. ``flag`` is a pointer or a 1-D block of pointers (then
    every element not masked off must satisfy the comparison; one poll round reads them all in parallel).
    Gives up after the context's wait budget and records the timeout (rank, signal, expected, seen) for the
    host to raise as ``WaitTimeoutError``; once this rank has recorded an error, every wait gives up at once."""
    if mask is None:
        mask = True
    budget = tl.load(ctx + CTX_WAIT_BUDGET).to(tl.int32)
    if _failed(ctx):  # this rank already gave up: a stalled call ends within one budget, wherever it waits
        budget = 1
    seen = _poll(flag, mask)
    if _INTERPRETED:  # the budget in host time: the interpreter's poll rate follows the host's load
        deadline = _host_seconds() + budget / CPU_POLLS_PER_SECOND
        while (_all_satisfied(seen, value, mask, cmp) == 0) & (_host_seconds() < deadline) & (_failed(ctx) == 0):
            seen = _poll(flag, mask)
    else:
        polls = 1
        while (_all_satisfied(seen, value, mask, cmp) == 0) & (polls < budget):
            seen = _poll(flag, mask)
            polls += 1
            if polls % 1024 == 0:
                if _failed(ctx):
                    budget = polls
    if _all_satisfied(seen, value, mask, cmp) == 0:
        if len(seen.shape) > 0:  # name the first flag that is still short
            bad = (_satisfied(seen, value, cmp) == 0) & (mask != 0)
            addr = tl.min(tl.where(bad, flag.to(tl.int64), 0x7FFFFFFFFFFFFFFF), axis=0)
            first_seen = tl.sum(tl.where(bad & (flag.to(tl.int64) == addr), seen.to(tl.int64), 0), axis=0)
            _record_timeout(addr.to(tl.pointer_type(tl.int32)), value, first_seen, ctx, cmp)
        else:
            _record_timeout(flag, value, seen, ctx, cmp)
    tl.debug_barrier()  # every thread of the program reads after the acquire
    return seen


@triton.jit
def fence(ctx):
    """Order all earlier memory operations of this program before all later ones, at system scope."""
    tl.debug_barrier()
    scratch = (_heap_base(ctx, rank(ctx)) + FENCE_SCRATCH).to(tl.pointer_type(tl.int32))
    tl.atomic_add(scratch, 0, sem="acq_rel", scope="sys")
    tl.debug_barrier()


@triton.jit
def barrier_all(ctx):
    """Block until every rank has reached its own ``barrier_all``; call it from ONE program of a launch.
    Stores made before the barrier by the calling program are visible to every rank after it."""
    me = rank(ctx)
    world = num_ranks(ctx)
    words = _heap_base(ctx, me) + tl.load(ctx + CTX_BARRIER)  # this group's barrier words
    count = words.to(tl.pointer_type(tl.int32))
    arrivals = (words + BARRIER_ARRIVALS).to(tl.pointer_type(tl.int32))
    generation = tl.load(count) + 1
    tl.store(count, generation)
    for peer in range(world):
        signal(arrivals + me, 1, peer, ctx, op=ADD)
    for peer in range(world):
        wait(arrivals + peer, generation, ctx)


@triton.jit
def enter_call(ready, epoch, me, world, ctx, SKIP_SELF: tl.constexpr = False):
    """The ready handshake, first half: tell every rank (``SKIP_SELF``: every other rank) that this rank has entered
    call ``epoch``, i.e. is done with the previous call's buffers, by raising ``ready[me] = epoch`` there.
    ``me``, ``world``: ``rank(ctx)``, ``num_ranks(ctx)``, which the caller already holds."""
    for peer in range(world):
        if SKIP_SELF:
            if peer != me:
                signal(ready + me, epoch, peer, ctx)
        else:
            signal(ready + me, epoch, peer, ctx)


@triton.jit
def wait_entered(ready, peer, epoch, ctx):
    """The ready handshake, second half: wait until rank ``peer`` has entered call ``epoch`` (``enter_call``);
    only then may this rank overwrite what ``peer`` read in the previous call."""
    wait(ready + peer, epoch, ctx)


@triton.jit
def call_epoch(state):
    """This call's epoch (1, 2, 3, ... per launch) from an int32[2] device counter ``state`` that
    ``finish_call`` advances; every program of the launch reads the same value."""
    return tl.load(state) + 1


@triton.jit
def finish_call(state, epoch, num_programs):
    """Every program calls this last; the last one to arrive advances ``state`` to ``epoch``."""
    if arrive_last(state + 1, num_programs):
        tl.atomic_xchg(state + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(state, epoch, sem="release", scope="gpu")


@triton.jit
def arrive_last(counter, arrivals):
    """Count this program's arrival at the int32 ``counter`` (GPU scope), after every earlier store of the
    program. True in the program that arrives ``arrivals``-th: it sees what the programs that arrived before it
    stored, and it is the one to set the counter back to 0 for the next launch (``tl.atomic_xchg(counter, 0)``:
    no host memsets, CUDA-graph replay safe). No program waits, so nothing can hang whichever programs run at
    once."""
    tl.debug_barrier()  # the stores of all threads of the program happen before the release below
    return tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == arrivals - 1


@triton.jit
def bulk_stores_done(ON: tl.constexpr):
    """Wait until this program's TMA (tensor-descriptor) stores have been written, to peers too, and order them
    before its later generic accesses: call it before a ``signal`` that publishes such stores (``signal`` alone
    covers plain stores only). ``ON=False`` (no descriptor stores, or the interpreter): nothing."""
    if ON:
        tl.inline_asm_elementwise("cp.async.bulk.wait_group 0; fence.proxy.async.global; mov.u32 $0, 0;", "=r",
                                  [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def launch_dependents(ON: tl.constexpr):
    """Programmatic dependent launch: the stream's next kernel, if launched with ``launch_pdl=True``, may start
    once every program of this one has called this (or ended). That kernel must ``wait_prior_kernel`` before it
    reads anything this one writes. ``ON=False`` (the interpreter runs no inline assembly): nothing."""
    if ON:
        _cuda.gdc_launch_dependents()


@triton.jit
def wait_prior_kernel(ON: tl.constexpr):
    """In a kernel launched with ``launch_pdl=True``: wait until the stream's previous kernel has ended, its
    writes visible. ``ON=False``: nothing (a kernel launched normally starts after it anyway)."""
    if ON:
        _cuda.gdc_wait()


@triton.jit
def timestamp():
    """Nanoseconds of the GPU's global timer (``%globaltimer``): comparable across the programs and launches on
    one GPU. For phase timelines while tuning; GPU only (the interpreter runs no inline assembly)."""
    return _cuda.globaltimer()
