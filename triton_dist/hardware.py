"""What the ops ask about the machine they run on: interpreter or GPU, SM count, compute capability, and whether
the current moment allows host-side work (a CUDA-graph capture or a torch.compile trace does not); and the
launch-grid arithmetic of their host code (``cdiv``, ``next_power_of_2``: Triton's own are constexpr functions
that cost microseconds per host call).

Ops ask these on every call, so the device properties are cached.
"""

import functools
import os

import torch


def cdiv(a, b):
    """ceil(a / b) for ints (``triton.cdiv`` without its per-call cost)."""
    return -(-a // b)


def next_power_of_2(n):
    """The smallest power of two >= n, 0 for 0 (``triton.next_power_of_2`` without its per-call cost)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def interpreting():
    """True when Triton kernels run under the interpreter (``TRITON_INTERPRET=1``: CPU ranks)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


_RANKS_PER_GPU = 1  # ranks sharing this process's GPU (the shared-gpu backend), set by shmem.init


def num_sms(device_index=None):
    """The SMs this rank may fill on a CUDA device (None: the current one): the device's count, or this rank's
    share when several ranks share the GPU. A grid that waits on a peer must leave the peer room to run: under
    MPS with ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` the device already reports the share; otherwise an equal
    part of the SMs."""
    return _sm_count(torch.cuda.current_device() if device_index is None else device_index)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index):
    count = torch.cuda.get_device_properties(device_index).multi_processor_count
    if _RANKS_PER_GPU > 1 and not os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"):
        count = max(1, count // _RANKS_PER_GPU)
    return count


def share_gpu(ranks):
    """Record that ``ranks`` ranks (this one included) share this process's GPU."""
    global _RANKS_PER_GPU
    _RANKS_PER_GPU = max(1, int(ranks))
    _sm_count.cache_clear()


def gpu_shared():
    """Whether peers share this rank's GPU (the shared-gpu backend). A copy between two heaps of one GPU is then
    an SM kernel, not a copy-engine transfer: it queues behind a grid that fills this rank's SM share."""
    return _RANKS_PER_GPU > 1


@functools.lru_cache(maxsize=None)
def compute_major(device_index):
    """Major compute capability of a CUDA device (9: Hopper)."""
    return torch.cuda.get_device_capability(device_index)[0]


def fp8_capable(device):
    """Whether ``device`` multiplies FP8 (CPU: the interpreter does; CUDA: compute capability 8.9 or newer)."""
    return device.type != "cuda" or _capability(device.index) >= (8, 9)


@functools.lru_cache(maxsize=None)
def _capability(device_index):
    return torch.cuda.get_device_capability(device_index)


def pdl_capable(device):
    """Whether ``device`` runs programmatic dependent launch (a CUDA GPU of compute capability 9.0 or newer)."""
    return device.type == "cuda" and compute_major(device.index) >= 9


def work_us(flops, bytes_moved, dtype):
    """A floor of the device time of ``flops`` and ``bytes_moved`` in ``dtype`` on a Hopper-class GPU (dense tensor
    cores ~1000 TFLOP/s in 16-bit, twice that in 8-bit; HBM ~5 TB/s): what sizes a tuning graph
    (``autotune.graph_calls``), not a prediction."""
    tflops = 2000.0 if dtype.itemsize == 1 else 1000.0
    return max(flops / (tflops * 1e6), bytes_moved / 5e6)


def capturing():
    """True while the current CUDA stream records a graph (no allocation, tuning or host sync may happen). (CUDA
    not initialized in this process: nothing records; ``torch.cuda.is_available`` costs µs per eager call.)"""
    return torch.cuda.is_initialized() and torch._C._cuda_isCurrentStreamCapturing()


_TRACING_MODES = tuple(getattr(torch._C._TorchDispatchModeKey, k) for k in ("FAKE", "PROXY", "FUNCTIONAL"))


def compiling():
    """True while torch.compile traces: ops then go through ``torch.ops.triton_dist`` (their fake impls).

    Dynamo's flag alone is not enough: AOT autograd traces a backward formula (which calls our Python ops) with
    fake / functional tensors under its dispatch modes, and torch 2.11 does not set the flag there. Other
    dispatch modes (a user's FlopCounterMode) are not tracing; the length check keeps the common case cheap.
    """
    if torch.compiler.is_compiling():
        return True
    return torch._C._len_torch_dispatch_stack() > 0 and any(
        torch._C._get_dispatch_mode(mode) is not None for mode in _TRACING_MODES)
