"""The symmetric heap: one equally sized heap per rank, tensors at the same offset in every heap.

Allocation is *collective by convention*: every rank allocates and frees the same sizes in the same order (the
usual SPMD program does), and a deterministic first-fit allocator then hands out the same offsets everywhere.
A tensor from ``empty``/``zeros`` owns its block; the block returns to the heap when the last view of the tensor
dies. On GPU a freed block is reused only after the work queued on the freeing stream has finished.
"""

import atexit
import gc
import os
import warnings
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from . import layout
from .backends import CpuHeap, TorchSymmHeap, nvshmem_available
from .workspaces import forget_all

ALIGN = 256
DEFAULT_HEAP_BYTES = {"cpu": 256 << 20, "gpu": 2 << 30}
# Rough poll rates of dl.wait, to turn a timeout in seconds into a poll budget (the interpreter manages ~1000/s).
POLLS_PER_SECOND = {"cpu": 1_000, "gpu": 2_000_000}
DEFAULT_WAIT_TIMEOUT_S = 60.0
ERROR_POLL_EVERY = 8  # GPU: op calls between two host copies of the device error flag


class WaitTimeoutError(RuntimeError):
    """A ``dl.wait`` ran out of its poll budget: the signal it waited for never came."""


class HeapExhaustedError(MemoryError):
    """The symmetric heap has no free block large enough."""


class NotInitializedError(RuntimeError):
    pass


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
    ctx: torch.Tensor = None
    free: list = field(default_factory=list)  # [offset, nbytes, [(event, stream, seq)]] sorted by offset
    live: dict = field(default_factory=dict)  # offset -> _Allocation
    signal_state: list = field(default_factory=list)  # weak references to tensors `reset()` zeroes
    err_host: torch.Tensor = None  # GPU: pinned copy of the error flag, refreshed every ERROR_POLL_EVERY op calls
    err_host_view: np.ndarray = None  # the same memory, read without creating tensors (hot path)
    err_device_word: torch.Tensor = None  # the error flag in this rank's heap
    calls: int = 0  # op calls seen by raise_pending_errors
    releases: int = 0  # GPU blocks freed so far (orders their events)


_RT = None


def _runtime():
    if _RT is None:
        raise NotInitializedError("triton_dist is not initialised: call triton_dist.init() first")
    return _RT


def is_initialized():
    return _RT is not None


def init(group=None, backend="auto", heap_size=None, wait_timeout_s=None):
    """Create this rank's heap and map every peer's. ``backend``: "auto" (NVSHMEM if torch has it, else CUDA
    symmetric memory, on GPU; shared memory on CPU), "nvshmem", "cuda" or "cpu". Collective over ``group``
    (default: the torch.distributed default group, started from the torchrun environment if needed)."""
    global _RT
    if _RT is not None:
        return
    use_gpu = backend in ("nvshmem", "cuda") or (backend == "auto" and torch.cuda.is_available())
    if backend not in ("auto", "nvshmem", "cuda", "cpu"):
        raise ValueError(f"unknown backend {backend!r}: use 'auto', 'nvshmem', 'cuda' or 'cpu'")
    if not dist.is_initialized():
        _init_process_group(use_gpu)
    group = group or dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world > layout.MAX_RANKS:
        raise ValueError(f"triton_dist supports at most {layout.MAX_RANKS} ranks, got {world}")
    kind = "gpu" if use_gpu else "cpu"
    nbytes = heap_size or int(os.environ.get("TRITON_DIST_HEAP_SIZE", 0)) or DEFAULT_HEAP_BYTES[kind]
    nbytes = -(-nbytes // 4096) * 4096
    if use_gpu:
        device = torch.device("cuda", torch.cuda.current_device())
        if backend == "auto":
            backend = "nvshmem" if nvshmem_available() else "cuda"
        heap = TorchSymmHeap(nbytes, group, rank, world, device, backend)
        heap.local[: layout.RESERVED_BYTES].zero_()
        torch.cuda.synchronize()
    else:
        if dist.get_backend(group) != "gloo":
            group = dist.new_group(dist.get_process_group_ranks(group), backend="gloo")
        heap = CpuHeap(nbytes, group, rank, world)
    dist.barrier(group=group)
    rt = _Runtime(group=group, rank=rank, world=world, heap=heap, nbytes=nbytes, kind=kind)
    rt.free = [[layout.RESERVED_BYTES, nbytes - layout.RESERVED_BYTES, []]]
    ctx = [rank, world, 0, 0] + heap.bases
    rt.ctx = torch.tensor(ctx, dtype=torch.int64, device=heap.device)
    if kind == "gpu":
        rt.err_host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        rt.err_host_view = rt.err_host.numpy()
        rt.err_device_word = heap.local[layout.ERR_FLAG: layout.ERR_FLAG + 4].view(torch.int32)
    _RT = rt
    set_wait_timeout(DEFAULT_WAIT_TIMEOUT_S if wait_timeout_s is None else wait_timeout_s)
    atexit.register(finalize)


def _init_process_group(use_gpu):
    if use_gpu and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if "WORLD_SIZE" not in os.environ:  # a plain `python script.py`: a world of one
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
    kwargs = {"device_id": torch.device("cuda", torch.cuda.current_device())} if use_gpu else {}
    dist.init_process_group("nccl" if use_gpu else "gloo", **kwargs)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def finalize():
    """Release the heap. Collective; tolerates peers that died (the closing barrier is bounded)."""
    global _RT
    rt = _RT
    if rt is None:
        return
    try:
        if rt.kind == "gpu":
            torch.cuda.synchronize()
        _device_barrier(rt)
        if rt.kind == "gpu":
            torch.cuda.synchronize()
    except Exception as exc:  # a dead peer must not turn exit into a hang or a crash
        warnings.warn(f"triton_dist.finalize: closing barrier failed on rank {rt.rank}: {exc}")
    _RT = None
    forget_all()  # every op's workspaces point into this heap
    gc.collect()
    rt.heap.close()


def rank():
    return _runtime().rank


def world_size():
    return _runtime().world


def group():
    """The torch.distributed group the heap spans."""
    return _runtime().group


def backend():
    """"cpu", "cuda" or "nvshmem"."""
    return _runtime().heap.name


def device():
    return _runtime().heap.device


def check_device(t, name):
    """ValueError unless tensor ``t`` is where triton_dist's kernels run: the same device type and, on GPU, the
    same CUDA device (a kernel launched on it cannot read another GPU's tensor as its own)."""
    home = device()
    if t.device.type != home.type or (home.type == "cuda" and t.device.index != home.index):
        raise ValueError(f"{name} is on {t.device}, but triton_dist runs on {home}")


def context():
    """The int64 tensor every triton_dist kernel takes as its ``ctx`` argument."""
    return _runtime().ctx


def set_wait_timeout(seconds):
    """Roughly how long a ``dl.wait`` polls before it gives up and records a WaitTimeoutError."""
    rt = _runtime()
    polls = int(max(1.0, min(seconds * POLLS_PER_SECOND[rt.kind], 2**31 - 1)))
    rt.ctx[layout.CTX_WAIT_BUDGET] = polls


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


def empty(shape, dtype=torch.float32, name=None):
    """A symmetric tensor: same shape, dtype and heap offset on every rank. Collective by convention."""
    rt = _runtime()
    shape = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else (int(shape),)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    if any(int(s) < 0 for s in shape):
        raise ValueError(f"negative size in shape {shape}")
    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = max(int(np.prod(shape, dtype=np.int64)) * elem, 1)
    alloc = _Allocation(_reserve(rt, nbytes), nbytes, name or "tensor", shape, dtype)
    rt.live[alloc.offset] = alloc
    block = _Block(rt, alloc)
    if rt.kind == "gpu":
        raw = torch.as_tensor(block, device=rt.heap.device)
    else:
        raw = torch.from_numpy(np.asarray(block))
    return raw[: int(np.prod(shape, dtype=np.int64)) * elem].view(dtype).view(shape)


def zeros(shape, dtype=torch.float32, name=None):
    """``empty`` filled with zeros on this rank (peers may write into it only after a ``barrier``)."""
    t = empty(shape, dtype, name)
    t.zero_()
    return t


def signals(shape, name):
    """Zeroed symmetric int32 flags for an op's signalling; ``reset()`` zeroes them again. Like ``zeros``: call
    ``barrier()`` once the op's workspace is made, before any peer may signal into them."""
    flags = zeros(shape, torch.int32, name)
    _runtime().signal_state.append(weakref.ref(flags))
    return flags


def counters(n, name="counters"):
    """Zeroed local int32 device counters (e.g. the ``dl.call_epoch`` state of an op); ``reset()`` zeroes them."""
    t = torch.zeros(n, dtype=torch.int32, device=device())
    _runtime().signal_state.append(weakref.ref(t))
    return t


def reset():
    """Collective recovery after a failed call (e.g. a WaitTimeoutError): waits for the device, then zeroes every
    op's signals and counters and the runtime's barrier words on every rank, and clears the error record."""
    rt = _runtime()
    if rt.kind == "gpu":
        torch.cuda.synchronize()
    dist.barrier(group=rt.group)
    rt.heap.local[layout.BARRIER_COUNT: layout.FENCE_SCRATCH].zero_()
    for ref in rt.signal_state:
        t = ref()
        if t is not None:
            t.zero_()
    rt.signal_state[:] = [r for r in rt.signal_state if r() is not None]
    clear_errors()
    if rt.kind == "gpu":
        torch.cuda.synchronize()
    dist.barrier(group=rt.group)


def _reserve(rt, nbytes):
    size = -(-nbytes // ALIGN) * ALIGN
    for i, (offset, free_bytes, events) in enumerate(rt.free):
        if free_bytes >= size:
            # GPU: work queued on the block before it was freed must come first. Stream order, no host sync (as
            # in torch's caching allocator): the current stream waits for it. A graph capture needs no wait (its
            # replays are queued after all of that work).
            if events and not torch.cuda.is_current_stream_capturing():
                stream = torch.cuda.current_stream()
                for ev, _, _ in events:
                    stream.wait_event(ev)
            if free_bytes == size:
                rt.free.pop(i)
            else:  # the rest keeps its events: it may hold freed memory too
                rt.free[i] = [offset + size, free_bytes - size, events]
            return offset
    largest = max((f[1] for f in rt.free), default=0)
    raise HeapExhaustedError(
        f"rank {rt.rank}: symmetric heap exhausted: asked for {nbytes} bytes, largest free block {largest} of "
        f"{rt.nbytes} bytes; pass triton_dist.init(heap_size=...) or set TRITON_DIST_HEAP_SIZE")


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
    rt = _runtime()
    if not isinstance(t, torch.Tensor) or t.device.type != rt.heap.device.type:
        return False
    start = t.data_ptr() - rt.heap.bases[rt.rank]
    span = (sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0) + 1) * t.element_size()
    return layout.RESERVED_BYTES <= start and start + span <= rt.nbytes


def check_symmetric(t, what="tensor"):
    """Raise a ValueError unless ``t`` is a symmetric tensor (what a kernel needs for peer addressing)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if not is_symmetric(t):
        raise ValueError(f"{what} is not a symmetric tensor: allocate it with triton_dist.shmem.empty/zeros")


def peer_view(t, peer):
    """The copy of symmetric tensor ``t`` that lives on rank ``peer``, as a tensor this rank can read/write."""
    rt = _runtime()
    check_symmetric(t)
    if not 0 <= peer < rt.world:
        raise ValueError(f"peer {peer} out of range for {rt.world} ranks")
    start = t.data_ptr() - rt.heap.bases[rt.rank]
    heap = rt.heap.peers[peer].view(t.dtype)
    return heap.as_strided(t.shape, t.stride(), start // t.element_size())


def peer_views(t):
    """``[peer_view(t, r) for r in range(world)]``."""
    return [peer_view(t, r) for r in range(_runtime().world)]


# ----------------------------------------------------------------------------------------------- errors, barrier
def describe_offset(offset):
    """Name the symmetric tensor element at a heap offset (for error messages)."""
    rt = _runtime()
    if offset < layout.RESERVED_BYTES:
        return f"runtime word at heap offset {offset:#x} (barrier/fence)"
    for a in rt.live.values():
        if a.offset <= offset < a.offset + a.nbytes:
            elem = torch.empty((), dtype=a.dtype).element_size()
            index = np.unravel_index((offset - a.offset) // elem, a.shape) if a.shape else ()
            return (f"element {tuple(int(i) for i in index)} of symmetric tensor '{a.name}' "
                    f"{list(a.shape)} {str(a.dtype).replace('torch.', '')} (heap offset {offset:#x})")
    return f"heap offset {offset:#x}"


def check_errors():
    """Raise WaitTimeoutError if a ``dl.wait`` on this rank gave up. Synchronises with the device on GPU."""
    rt = _runtime()
    rec = rt.heap.local[: layout.ERR_CMP + 8].cpu()
    if int(rec[layout.ERR_FLAG: layout.ERR_FLAG + 4].view(torch.int32)) == 0:
        return
    words = rec[8:].view(torch.int64).tolist()
    who, offset, expected, seen, cmp = words
    raise WaitTimeoutError(
        f"rank {who}: dl.wait timed out on {describe_offset(offset)}: waited for value "
        f"{layout.CMP_SYMBOLS.get(cmp, '?')} {expected}, last saw {seen}. A peer never signalled it "
        f"(did every rank make the same call? did a rank die?). Clear with triton_dist.shmem.clear_errors().")


def clear_errors():
    rt = _runtime()
    rt.heap.local[: layout.ERR_CMP + 8].zero_()
    if rt.err_host is not None:
        rt.err_host.zero_()


def raise_pending_errors():
    """Cheap check used by ops before each launch: raises a WaitTimeoutError that an earlier call recorded.
    CPU: exact (kernels are synchronous). GPU: no host sync; it sees the error flag as of a few calls ago."""
    rt = _runtime()
    if rt.kind == "cpu":
        return check_errors()
    if rt.err_host_view[0] != 0:
        check_errors()
    rt.calls += 1
    # refresh the host copy every few calls (a copy costs host time); never inside a graph capture
    if rt.calls % ERROR_POLL_EVERY == 0 and not torch.cuda.is_current_stream_capturing():
        rt.err_host.copy_(rt.err_device_word, non_blocking=True)


def barrier():
    """All ranks reach this point (in stream order on GPU: a one-program kernel, CUDA-graph capturable)."""
    rt = _runtime()
    raise_pending_errors()
    _device_barrier(rt)
    if rt.kind == "cpu":
        check_errors()


def _device_barrier(rt):
    from .device_barrier import barrier_all_kernel

    barrier_all_kernel[(1,)](rt.ctx)
