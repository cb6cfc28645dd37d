"""Where a rank's heap lives and how its peers' heaps are reached.

* ``CpuHeap``: one file per rank in /dev/shm, mapped by every rank (kernels run under the Triton interpreter, and
  Triton's atomics are real atomics on these shared pages). Files are unlinked as soon as every rank has mapped
  them, so nothing is left behind, even when a rank dies.
* ``TorchSymmHeap``: PyTorch symmetric memory (NVSHMEM or CUDA backend); peers are reached over NVLink by address.
  A world of one rank takes a plain device allocation (nothing to map).
* ``SharedGpuHeap``: several ranks (processes) on ONE GPU, where torch's symmetric memory and NCCL refuse to go:
  each rank allocates its heap on the device and exports it by CUDA IPC; the handles travel over the (gloo)
  group and every rank maps its peers'. Peers are then reached by address, exactly as on separate GPUs.
"""

import os
import uuid

import torch
import torch.distributed as dist


class CpuHeap:
    name = "cpu"

    def __init__(self, nbytes, group, rank, world):
        tokens = [None] * world
        dist.all_gather_object(tokens, uuid.uuid4().hex, group=group)
        paths = [f"/dev/shm/triton_dist_{tokens[0]}_{r}" for r in range(world)]
        self._own_path = paths[rank]
        self.local = torch.from_file(paths[rank], shared=True, size=nbytes, dtype=torch.uint8)
        dist.barrier(group=group)
        self.peers = [self.local if r == rank else torch.from_file(p, shared=True, size=nbytes, dtype=torch.uint8)
                      for r, p in enumerate(paths)]
        dist.barrier(group=group)
        self.unlink()
        self.bases = [t.data_ptr() for t in self.peers]
        self.device = torch.device("cpu")

    def unlink(self):
        try:
            os.unlink(self._own_path)
        except FileNotFoundError:
            pass

    def close(self):
        self.unlink()
        self.peers = []
        self.local = None


def nvshmem_available():
    try:
        import torch.distributed._symmetric_memory as symm_mem
        return bool(getattr(symm_mem, "is_nvshmem_available", lambda: False)())
    except Exception:
        return False


class TorchSymmHeap:
    def __init__(self, nbytes, group, rank, world, device, backend):
        import torch.distributed._symmetric_memory as symm_mem

        self.name = backend
        if backend == "nvshmem":  # CUDA is torch's default (and torch 2.11 cannot name it before first use)
            if not hasattr(symm_mem, "set_backend"):
                raise RuntimeError("this torch has no NVSHMEM symmetric-memory backend; use backend='cuda'")
            symm_mem.set_backend("NVSHMEM")
        self.device = device
        if world == 1:  # a heap of one needs no rendezvous (torch refuses a group of one): a plain allocation
            self.local = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.handle, self.bases, self.peers = None, [self.local.data_ptr()], [self.local]
            return
        self.local = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.local, group.group_name)
        self.bases = [int(p) for p in self.handle.buffer_ptrs]
        self.peers = [self.local if r == rank else self.handle.get_buffer(r, (nbytes,), torch.uint8)
                      for r in range(world)]

    def close(self):
        self.peers = []
        self.handle = None
        self.local = None


class SharedGpuHeap:
    name = "shared-gpu"

    def __init__(self, nbytes, group, rank, world, device):
        from torch.multiprocessing.reductions import reduce_tensor

        self.device = device
        self.local = torch.empty(nbytes, dtype=torch.uint8, device=device)
        rebuild, handle = reduce_tensor(self.local)  # an IPC handle of the allocation, and how to open it
        handles = [None] * world
        dist.all_gather_object(handles, handle, group=group)
        # a process cannot open its own IPC handle: its own heap is the local tensor
        self.peers = [self.local if r == rank else rebuild(*handles[r]) for r in range(world)]
        self.bases = [t.data_ptr() for t in self.peers]

    def close(self):
        self.peers = []
        self.local = None
