"""The symmetric heap: one equally sized heap per rank, tensors at the same offset in every heap.

Allocation is collective over a group (default: every rank of the heap): the members exchange their request and
their free blocks (``Team.agree``), so a disagreement (another name or size on some rank) raises on every rank,
naming each rank's request, and the tensor takes the lowest offset free on every member — symmetric by
construction, whatever each rank freed before. A tensor owns its block; the block returns to the heap when the
last view of the tensor dies (on GPU it is reused only after the work queued on the freeing stream has finished).
"""

import atexit
import gc
import os
import uuid
import warnings
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from . import layout, teams
from .. import hardware
from .backends import CpuHeap, SharedGpuHeap, TorchSymmHeap, nvshmem_available
from .errors import CollectiveMismatchError, HeapExhaustedError, NotInitializedError, error_from_record

ALIGN = 256
DEFAULT_HEAP_BYTES = {"cpu": 256 << 20, "gpu": 2 << 30}
# Poll rates of dl.wait, to turn a timeout in seconds into a poll budget (CPU ranks count it in host milliseconds).
POLLS_PER_SECOND = {"cpu": layout.CPU_POLLS_PER_SECOND, "gpu": 2_000_000}
DEFAULT_WAIT_TIMEOUT_S = 60.0
ERROR_POLL_EVERY = 8  # GPU: op calls between two host copies of the device error flag


@dataclass
class _Allocation:
    offset: int
    nbytes: int
    name: str
    shape: tuple
    dtype: torch.dtype


@dataclass
class _Runtime:
    group: object
    rank: int
    world: int
    heap: object
    nbytes: int
    kind: str  # "cpu" or "gpu"
    token: str  # names this heap's entries in the torch.distributed store
    free: list = field(default_factory=list)  # [offset, nbytes, [(event, stream, seq)]] sorted by offset
    live: dict = field(default_factory=dict)  # offset -> _Allocation
    signal_state: list = field(default_factory=list)  # weak references to tensors `reset()` zeroes
    teams: dict = field(default_factory=dict)  # group name -> Team (the default team under None)
    wait_timeout_s: float = DEFAULT_WAIT_TIMEOUT_S
    wait_polls: int = 1
    check_calls: bool = False
    err_host: torch.Tensor = None  # GPU: pinned copy of the error flag, refreshed every ERROR_POLL_EVERY op calls
    err_host_view: np.ndarray = None  # the same memory, read without creating tensors (hot path)
    err_device_word: torch.Tensor = None  # the error flag in this rank's heap
    calls: int = 0  # op calls seen by raise_pending_errors
    releases: int = 0  # GPU blocks freed so far (orders their events)


_RT = None


def runtime():
    if _RT is None:
        raise NotInitializedError("triton_dist is not initialised: call triton_dist.init() first")
    return _RT


def is_initialized():
    return _RT is not None


BACKENDS = ("auto", "nvshmem", "cuda", "shared-gpu", "cpu")


def init(group=None, backend="auto", heap_size=None, wait_timeout_s=None, check_calls=None):
    """Create this rank's heap and map every peer's. ``backend``: "auto" (on GPU: NVSHMEM if torch has it, else
    CUDA symmetric memory, or "shared-gpu" when torchrun starts more ranks than the node has GPUs; shared memory
    on CPU), "nvshmem", "cuda", "shared-gpu" (several ranks on one GPU: heaps shared by CUDA IPC, a gloo group;
    run it under MPS, docs/design/shmem.md) or "cpu". Collective over ``group`` (default: the torch.distributed
    default group, started from the torchrun environment if needed); ops may run on any group of its ranks
    (``group=`` of every op). ``check_calls``: compare every op call's signature across the ranks before
    launching (``CollectiveMismatchError``); default: the ``TRITON_DIST_CHECK_CALLS`` variable."""
    global _RT
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of {', '.join(map(repr, BACKENDS))}")
    if _RT is not None:
        return
    use_gpu = backend != "cpu" and (backend != "auto" or torch.cuda.is_available())
    if backend == "auto" and use_gpu and _more_local_ranks_than_gpus():
        backend = "shared-gpu"
    if not dist.is_initialized():
        _init_process_group(use_gpu, nccl=backend != "shared-gpu")
    group = group or dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world > layout.MAX_RANKS:
        raise ValueError(f"triton_dist supports at most {layout.MAX_RANKS} ranks, got {world}")
    kind = "gpu" if use_gpu else "cpu"
    nbytes = heap_size or int(os.environ.get("TRITON_DIST_HEAP_SIZE", 0)) or DEFAULT_HEAP_BYTES[kind]
    nbytes = -(-nbytes // 4096) * 4096
    if backend in ("cpu", "shared-gpu") and dist.get_backend(group) != "gloo":  # host-side exchange by gloo
        group = dist.new_group(dist.get_process_group_ranks(group), backend="gloo")
    if use_gpu:
        device = torch.device("cuda", torch.cuda.current_device())
        if backend == "auto":
            backend = "nvshmem" if nvshmem_available() else "cuda"
        if backend == "shared-gpu":
            heap = SharedGpuHeap(nbytes, group, rank, world, device)
            hardware.share_gpu(_ranks_on_my_gpu(group, world))
        else:
            heap = TorchSymmHeap(nbytes, group, rank, world, device, backend)
        heap.local[: layout.RESERVED_BYTES].zero_()
        torch.cuda.synchronize()
    else:
        heap = CpuHeap(nbytes, group, rank, world)
    token = [uuid.uuid4().hex[:12]]
    if world > 1:
        dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
    dist.barrier(group=group)
    rt = _Runtime(group=group, rank=rank, world=world, heap=heap, nbytes=nbytes, kind=kind, token=token[0])
    rt.free = [[layout.RESERVED_BYTES, nbytes - layout.RESERVED_BYTES, []]]
    if check_calls is None:
        check_calls = os.environ.get("TRITON_DIST_CHECK_CALLS", "0") not in ("", "0")
    rt.check_calls = bool(check_calls)
    rt.teams[None] = teams.default_team(rt)
    if kind == "gpu":
        rt.err_host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        rt.err_host_view = rt.err_host.numpy()
        rt.err_device_word = heap.local[layout.ERR_FLAG: layout.ERR_FLAG + 4].view(torch.int32)
    _RT = rt
    set_wait_timeout(DEFAULT_WAIT_TIMEOUT_S if wait_timeout_s is None else wait_timeout_s)
    atexit.register(finalize)


def _more_local_ranks_than_gpus():
    """torchrun started more ranks on this node than it has GPUs (``--nproc-per-node`` > GPU count)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1)) > torch.cuda.device_count()


def _ranks_on_my_gpu(group, world):
    """How many ranks of ``group`` run on this rank's GPU (they share its SMs)."""
    here = (os.uname().nodename, str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid))
    everyone = [None] * world
    dist.all_gather_object(everyone, here, group=group)
    return everyone.count(here)


def _init_process_group(use_gpu, nccl=True):
    """The default group from torchrun's environment (or a world of one): NCCL on GPU, gloo on CPU and where
    several ranks share a GPU (NCCL refuses that). Rank ``LOCAL_RANK`` takes GPU ``LOCAL_RANK`` mod the count."""
    if use_gpu and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    kwargs = {}
    if "WORLD_SIZE" not in os.environ:
        # a plain `python script.py`: a world of one, its store in this process (a TCP store's free port can be taken
        # by another process before the store binds it)
        kwargs = dict(store=dist.HashStore(), rank=0, world_size=1)
    if use_gpu and nccl:
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()), **kwargs)
    else:
        dist.init_process_group("gloo", **kwargs)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_DEPENDENTS = []  # what keeps pointers into the heap (workspaces.py registers its caches): dropped with it


def on_heap_drop(fn):
    """Have ``finalize`` and ``reset`` call ``fn()`` (no arguments) when they drop the heap's contents."""
    _DEPENDENTS.append(fn)
    return fn


def _drop_dependents():
    for fn in _DEPENDENTS:
        fn()


def finalize():
    """Release the heap. Collective; tolerates peers that died (the closing barrier is bounded)."""
    global _RT
    rt = _RT
    if rt is None:
        return
    try:
        if rt.kind == "gpu":
            torch.cuda.synchronize()
        _device_barrier(rt.teams[None])
        if rt.kind == "gpu":
            torch.cuda.synchronize()
    except Exception as exc:  # a dead peer must not turn exit into a hang or a crash
        warnings.warn(f"triton_dist.finalize: closing barrier failed on rank {rt.rank}: {exc}")
    _RT = None
    hardware.share_gpu(1)
    _drop_dependents()  # every op's workspaces point into this heap
    gc.collect()
    rt.heap.close()


# ----------------------------------------------------------------------------------------------- groups
def team(group=None):
    """The team of ``group`` (a torch.distributed group; None: the group ``init`` was given), made on first use:
    collectively among its members, who must all ask for it in the same order."""
    rt = runtime()
    t = rt.teams.get(group)
    if t is not None:
        return t
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"rank {rt.rank} is not a member of this group (torch.distributed gave it "
                         f"GroupMember.NON_GROUP_MEMBER): call the op only on the group's ranks")
    key = teams.group_key(group)
    if key == teams.group_key(rt.group) or key == teams.group_key(dist.group.WORLD) and \
            dist.get_world_size() == rt.world:
        t = rt.teams[None]
    else:
        t = rt.teams.get(key)
        if t is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"group {key} is first used during CUDA-graph capture: call an op on it (or "
                                   f"triton_dist.shmem.context(group)) once before capturing")
            t = rt.teams[key] = teams.Team(rt, group, f"{key}@{rt.token}", teams.heap_ranks_of(rt, group), 0)
            _init_team(rt, t, key)
    rt.teams[group] = t
    return t


def _init_team(rt, t, key):
    """A new team's first steps, on every member: agree that all are here, then its barrier words."""
    t.agree(rt, "a new team", t.heap_ranks)
    t.barrier_words = zeros((layout.barrier_bytes(t.size) // 4,), torch.int32, name=f"barrier[{key}]",
                            group=t.group)
    t.barrier_offset = t.barrier_words.data_ptr() - rt.heap.bases[rt.rank]
    t.ctx[layout.CTX_BARRIER] = t.barrier_offset
    if rt.kind == "gpu":
        torch.cuda.synchronize()  # the zeros have landed ...
    t.agree(rt, "zeroed barrier words", None)  # ... on every member, before anyone signals into them


def rank(group=None):
    """This rank's index in ``group`` (default: the heap's group)."""
    return team(group).rank


def world_size(group=None):
    """The number of ranks in ``group`` (default: the heap's group). For the heap's group and a torch
    ProcessGroup it builds no team (that is collective): ops' fake impls and torch.compile's tracing call it."""
    if group is None:
        return runtime().world
    return dist.get_world_size(group) if isinstance(group, dist.ProcessGroup) else team(group).size


def group():
    """The torch.distributed group the heap spans."""
    return runtime().group


def backend():
    """The heap's backend: "cpu", "cuda", "nvshmem" or "shared-gpu"."""
    return runtime().heap.name


def device():
    return runtime().heap.device


def check_device(t, name):
    """ValueError unless tensor ``t`` is where triton_dist's kernels run: the same device type and, on GPU, the
    same CUDA device (a kernel launched on it cannot read another GPU's tensor as its own)."""
    home = device()
    if t.device.type != home.type or (home.type == "cuda" and t.device.index != home.index):
        raise ValueError(f"{name} is on {t.device}, but triton_dist runs on {home}")


def context(group=None):
    """The int64 tensor every triton_dist kernel takes as its ``ctx`` argument, for ``group``."""
    return team(group).ctx


def set_wait_timeout(seconds):
    """Roughly how long a stalled call waits before it gives up: a ``dl.wait`` with a WaitTimeoutError (later
    waits of the rank then give up at once), an agreement between ranks with a CollectiveMismatchError."""
    rt = runtime()
    rt.wait_timeout_s = float(seconds)
    rt.wait_polls = int(max(1.0, min(seconds * POLLS_PER_SECOND[rt.kind], 2**31 - 1)))
    for t in set(rt.teams.values()):
        t.ctx[layout.CTX_WAIT_BUDGET] = rt.wait_polls


def check_calls(on=None):
    """Whether op calls compare their signatures across ranks first; ``on``: switch it."""
    rt = runtime()
    if on is not None:
        rt.check_calls = bool(on)
    return rt.check_calls


def op_team(op, group, signature):
    """The team an op call runs on; in check mode first ``agree_on_call`` with ``signature()`` (a dict of the
    call's shapes, dtypes, config...: only built in check mode, so that the check costs nothing when off)."""
    t = team(group)
    if _RT.check_calls:
        agree_on_call(t, op, signature())
    return t


HEAP_GROUP = "heap"  # the heap's group in ``group_name``'s names


def group_named(name):
    """The torch.distributed group of ``name`` (what torch ops take: ``group_name``'s, or a torch group's own
    name); None: the heap's group. A name with a size that is not its group's raises ValueError."""
    if name is None:
        return None
    key, sep, size = name.rpartition("/")
    if not (sep and size.isdigit()):  # a c10d group name (torch's async-TP schemas take those)
        key, size = name, None
    if key == HEAP_GROUP:
        group = None
    else:
        t = runtime().teams.get(key)
        group = t.group if t is not None else dist.distributed_c10d._resolve_process_group(key)
    if size is not None and int(size) != world_size(group):
        raise ValueError(f"group name {name!r}: its group has {world_size(group)} ranks, not {size}")
    return group


def group_name(group):
    """``group``'s name for torch ops: "<key>/<size>" ("heap/<size>" for the heap's group). The size rides in the
    name because the ops' output shapes depend on it and a compiled graph is cached by its code, not by the
    process group: a graph traced at 2 ranks must not be reused by a run at 4 on the same machine."""
    return f"{HEAP_GROUP if group is None else teams.group_key(group)}/{world_size(group)}"


def agree_on_call(t, op, signature):
    """Check mode: raise CollectiveMismatchError on every rank unless every member of team ``t`` calls ``op``
    with the same ``signature`` (a dict of field -> value), naming the ranks and fields that differ."""
    rt = runtime()
    everyone = t.agree(rt, f"a call of {op}", signature)
    differ = sorted({k for s in everyone for k in set(s) | set(signature) if s.get(k) != signature.get(k)})
    if differ:
        rows = "; ".join(f"rank {t.heap_ranks[r]}: " + ", ".join(f"{k}={s.get(k)}" for k in differ)
                         for r, s in enumerate(everyone))
        raise CollectiveMismatchError(f"rank {rt.rank}: {op} called differently on {t.describe()}: {rows}")


# ----------------------------------------------------------------------------------------------- allocation
class _Block:
    """Owns one heap block; exposes it through the array interface so a torch tensor can keep it alive."""

    def __init__(self, rt, alloc):
        self._rt, self.alloc = rt, alloc
        addr = rt.heap.bases[rt.rank] + alloc.offset
        iface = {"shape": (alloc.nbytes,), "typestr": "|u1", "data": (addr, False), "version": 2}
        if rt.kind == "gpu":
            self.__cuda_array_interface__ = iface
        else:
            self.__array_interface__ = iface

    def __del__(self):
        rt = self._rt
        if rt.heap.peers:  # heap still open
            _release(rt, self.alloc)


def empty(shape, dtype=torch.float32, name=None, group=None):
    """A symmetric tensor: same shape, dtype and heap offset on every rank of ``group`` (default: the heap's).
    Collective over the group: every member asks for the same name, shape and dtype, or every member raises."""
    rt = runtime()
    shape = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else (int(shape),)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    if any(int(s) < 0 for s in shape):
        raise ValueError(f"negative size in shape {shape}")
    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = max(int(np.prod(shape, dtype=np.int64)) * elem, 1)
    name = name or "tensor"
    alloc = _Allocation(_reserve(rt, team(group), nbytes, name, shape, dtype), nbytes, name, shape, dtype)
    rt.live[alloc.offset] = alloc
    block = _Block(rt, alloc)
    if rt.kind == "gpu":
        raw = torch.as_tensor(block, device=rt.heap.device)
    else:
        raw = torch.from_numpy(np.asarray(block))
    return raw[: int(np.prod(shape, dtype=np.int64)) * elem].view(dtype).view(shape)


def zeros(shape, dtype=torch.float32, name=None, group=None):
    """``empty`` filled with zeros on this rank (peers may write into it only after a ``barrier``)."""
    t = empty(shape, dtype, name, group)
    t.zero_()
    return t


def signals(shape, name, group=None):
    """Zeroed symmetric int32 flags for an op's signalling; ``reset()`` zeroes them again. Like ``zeros``: call
    ``barrier()`` once the op's workspace is made, before any peer may signal into them."""
    flags = zeros(shape, torch.int32, name, group)
    runtime().signal_state.append(weakref.ref(flags))
    return flags


def counters(n, name="counters"):
    """Zeroed local int32 device counters (e.g. the ``dl.call_epoch`` state of an op); ``reset()`` zeroes them."""
    t = torch.zeros(n, dtype=torch.int32, device=device())
    runtime().signal_state.append(weakref.ref(t))
    return t


def _reserve(rt, t, nbytes, name, shape, dtype):
    """The heap offset of a new block: agreed with every member of team ``t``, free on all of them."""
    size = -(-nbytes // ALIGN) * ALIGN
    request = (name, list(shape), str(dtype).replace("torch.", ""), size)
    everyone = t.agree(rt, "a symmetric allocation", (request, [(f[0], f[1]) for f in rt.free]))
    requests = [e[0] for e in everyone]
    if any(r != request for r in requests):
        rows = "; ".join(f"rank {t.heap_ranks[i]}: '{r[0]}' {r[1]} {r[2]} ({r[3]} bytes)"
                         for i, r in enumerate(requests))
        raise CollectiveMismatchError(f"rank {rt.rank}: symmetric allocations differ across {t.describe()}: {rows}")
    common = _common_free([e[1] for e in everyone])
    offset = next((o for o, n in common if n >= size), None)
    if offset is None:
        largest = max((n for _, n in common), default=0)
        raise HeapExhaustedError(
            f"rank {rt.rank}: symmetric heap exhausted: '{name}' asked for {nbytes} bytes, the largest block free on "
            f"every rank of {t.describe()} has {largest} of {rt.nbytes} bytes; pass "
            f"triton_dist.init(heap_size=...) or set TRITON_DIST_HEAP_SIZE")
    _take(rt, offset, size)
    return offset


def _common_free(free_lists):
    """The (offset, bytes) intervals free in every one of ``free_lists`` (each sorted, disjoint)."""
    common = free_lists[0]
    for other in free_lists[1:]:
        merged, i, j = [], 0, 0
        while i < len(common) and j < len(other):
            lo = max(common[i][0], other[j][0])
            hi = min(common[i][0] + common[i][1], other[j][0] + other[j][1])
            if hi > lo:
                merged.append((lo, hi - lo))
            if common[i][0] + common[i][1] < other[j][0] + other[j][1]:
                i += 1
            else:
                j += 1
        common = merged
    return common


def _take(rt, offset, size):
    """Carve [offset, offset + size) out of this rank's free block holding it."""
    for i, (start, free_bytes, events) in enumerate(rt.free):
        if start <= offset and offset + size <= start + free_bytes:
            # GPU: work queued on the block before it was freed must come first. Stream order, no host sync (as
            # in torch's caching allocator): the current stream waits for it. A graph capture needs no wait (its
            # replays are queued after all of that work).
            if events and not torch.cuda.is_current_stream_capturing():
                stream = torch.cuda.current_stream()
                for ev, _, _ in events:
                    stream.wait_event(ev)
            rest = [[start, offset - start, events], [offset + size, start + free_bytes - offset - size, events]]
            rt.free[i:i + 1] = [r for r in rest if r[1] > 0]  # the rest keeps its events: it may hold freed memory
            return
    raise AssertionError(f"heap offset {offset:#x} is not free on rank {rt.rank}")


def _release(rt, alloc):
    rt.live.pop(alloc.offset, None)
    events = []
    if rt.kind == "gpu":
        ev = torch.cuda.Event()
        ev.record()
        rt.releases += 1
        events.append((ev, torch.cuda.current_stream(), rt.releases))
    size = -(-alloc.nbytes // ALIGN) * ALIGN
    free = rt.free
    free.append([alloc.offset, size, events])
    free.sort(key=lambda f: f[0])
    merged = [free[0]]
    for f in free[1:]:
        last = merged[-1]
        if last[0] + last[1] == f[0]:
            last[1] += f[1]
            last[2] = _newest_per_stream(last[2] + f[2])
        else:
            merged.append(f)
    rt.free[:] = merged


def _newest_per_stream(events):
    """Free-block events, the newest per stream (an event covers everything queued before it on its stream), so
    that a block freed and merged many times does not collect events."""
    newest = {}
    for ev, stream, seq in events:
        if stream not in newest or newest[stream][2] < seq:
            newest[stream] = (ev, stream, seq)
    return list(newest.values())


# ----------------------------------------------------------------------------------------------- peers
def is_symmetric(t):
    """True when ``t`` lies inside this rank's symmetric heap."""
    rt = runtime()
    if not isinstance(t, torch.Tensor) or t.device.type != rt.heap.device.type:
        return False
    start = t.data_ptr() - rt.heap.bases[rt.rank]
    if t.is_contiguous():
        span = t.numel() * t.element_size()
    else:
        span = (sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0) + 1) * t.element_size()
    return layout.RESERVED_BYTES <= start and start + span <= rt.nbytes


def check_symmetric(t, what="tensor"):
    """Raise a ValueError unless ``t`` is a symmetric tensor (what a kernel needs for peer addressing)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.numel() and not is_symmetric(t):
        raise ValueError(f"{what} is not a symmetric tensor: allocate it with triton_dist.shmem.empty/zeros")


def peer_view(t, peer, group=None):
    """The copy of symmetric tensor ``t`` on rank ``peer`` of ``group``, as a tensor this rank can read/write."""
    rt = runtime()
    check_symmetric(t)
    members = team(group)
    if not 0 <= peer < members.size:
        raise ValueError(f"peer {peer} out of range for {members.size} ranks")
    start = t.data_ptr() - rt.heap.bases[rt.rank]
    heap = rt.heap.peers[members.heap_ranks[peer]].view(t.dtype)
    return heap.as_strided(t.shape, t.stride(), start // t.element_size())


def peer_views(t, group=None):
    """``[peer_view(t, r, group) for r in range(world_size(group))]``."""
    return [peer_view(t, r, group) for r in range(team(group).size)]


# ----------------------------------------------------------------------------------------------- errors, barrier
def check_errors():
    """Raise the error a kernel recorded on this rank (WaitTimeoutError, DeviceIndexError). Syncs on GPU."""
    rt = runtime()
    rec = rt.heap.local[: layout.ERR_CMP + 8].cpu()
    kind = int(rec[layout.ERR_FLAG: layout.ERR_FLAG + 4].view(torch.int32))
    if kind != 0:
        raise error_from_record(rt, kind, rec[8:].view(torch.int64).tolist())


def clear_errors():
    rt = runtime()
    rt.heap.local[: layout.ERR_CMP + 8].zero_()
    if rt.err_host is not None:
        rt.err_host.zero_()


def raise_pending_errors():
    """Cheap check used by ops before each launch: raises an error that an earlier call recorded.
    CPU: exact (kernels are synchronous). GPU: no host sync; it sees the error flag as of a few calls ago."""
    rt = runtime()
    if rt.kind == "cpu":
        return check_errors()
    if rt.err_host_view[0] != 0:
        check_errors()
    rt.calls += 1
    # refresh the host copy every few calls (a copy costs host time); never inside a graph capture
    if rt.calls % ERROR_POLL_EVERY == 0 and not torch.cuda.is_current_stream_capturing():
        rt.err_host.copy_(rt.err_device_word, non_blocking=True)


def barrier(group=None):
    """All ranks of ``group`` reach this point (in stream order on GPU: a one-program kernel, CUDA-graph
    capturable)."""
    rt = runtime()
    raise_pending_errors()
    _device_barrier(team(group))
    if rt.kind == "cpu":
        check_errors()


def _device_barrier(t):
    from .device_barrier import barrier_all_kernel

    barrier_all_kernel[(1,)](t.ctx)


def reset():
    """Collective recovery after a failed call (WaitTimeoutError, CollectiveMismatchError, DeviceIndexError):
    waits for the device, drops every op's workspaces, plans and graphs on every rank (so that no rank keeps one
    the others lack; the next calls rebuild them), zeroes every signal, counter and barrier word, clears the
    error record and brings the ranks' agreement steps back in line. Every rank of the heap calls it."""
    rt = runtime()
    if rt.kind == "gpu":
        torch.cuda.synchronize()
    dist.barrier(group=rt.group)
    _drop_dependents()
    gc.collect()
    rt.heap.local[layout.BARRIER_COUNT: layout.FENCE_SCRATCH].zero_()
    for t in set(rt.teams.values()):
        if t.barrier_words is not None:
            t.barrier_words.zero_()
    for ref in rt.signal_state:
        flags = ref()
        if flags is not None:
            flags.zero_()
    rt.signal_state[:] = [r for r in rt.signal_state if r() is not None]
    clear_errors()
    for t in set(rt.teams.values()):  # agreements start afresh, wherever each rank's steps had got to
        t.restart()
    if rt.kind == "gpu":
        torch.cuda.synchronize()
    dist.barrier(group=rt.group)
