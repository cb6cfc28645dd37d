"""The errors triton_dist raises, and how a failure recorded on the device becomes one on the host.

A kernel never hangs and never traps: a ``dl.wait`` that runs out of its budget, or an index a kernel refuses to
use, is written into this rank's *error record* (heap offset 0, ``layout.ERR_*``) and the kernel goes on; the host
reads the record at the next op call, ``barrier`` or ``check_errors()`` and raises the matching error below.
"""

import numpy as np
import torch

from . import layout


class WaitTimeoutError(RuntimeError):
    """A ``dl.wait`` ran out of its poll budget: the signal it waited for never came."""


class DeviceIndexError(IndexError, ValueError):
    """A kernel met an index outside its tensor (a page id, a length, an expert id): masked, recorded, raised."""


class HeapExhaustedError(MemoryError):
    """The symmetric heap has no free block large enough."""


class NotInitializedError(RuntimeError):
    pass


class CollectiveMismatchError(RuntimeError):
    """Ranks of one group made different collective calls (shapes, dtypes, config, or no call at all)."""


def describe_offset(rt, offset):
    """Name the symmetric tensor element at a heap offset (for error messages)."""
    if offset < layout.RESERVED_BYTES:
        return f"runtime word at heap offset {offset:#x} (barrier/fence)"
    for a in rt.live.values():
        if a.offset <= offset < a.offset + a.nbytes:
            elem = torch.empty((), dtype=a.dtype).element_size()
            index = np.unravel_index((offset - a.offset) // elem, a.shape) if a.shape else ()
            return (f"element {tuple(int(i) for i in index)} of symmetric tensor '{a.name}' "
                    f"{list(a.shape)} {str(a.dtype).replace('torch.', '')} (heap offset {offset:#x})")
    return f"heap offset {offset:#x}"


def error_from_record(rt, kind, words):
    """The exception a non-zero error record stands for: ``kind`` its flag, ``words`` its five int64 fields."""
    who, where, expected, seen, code = (int(v) for v in words)
    if kind == layout.ERR_KIND_INDEX:
        op, tensor = layout.INDEX_SITES.get(code, ("an op", "an index tensor"))
        return DeviceIndexError(
            f"rank {rt.rank}: {op}: {tensor} holds {seen} at position {expected}, outside [0, {where}); the kernel "
            f"masked it (no memory outside the tensors was touched). Clear with triton_dist.shmem.clear_errors().")
    group = f" (rank {who} of its group)" if who != rt.rank else ""
    return WaitTimeoutError(
        f"rank {rt.rank}{group}: dl.wait timed out on {describe_offset(rt, where)}: waited for value "
        f"{layout.CMP_SYMBOLS.get(code, '?')} {expected}, last saw {seen}. A peer never signalled it "
        f"(did every rank make the same call? did a rank die?). Clear with triton_dist.shmem.clear_errors(); "
        f"triton_dist.shmem.reset() (collective) brings every rank back in step.")
