"""Template: a push all-gather written with triton_dist.language, checked against torch, then timed.

    torchrun --nproc-per-node=2 examples/allgather.py     # GPUs: NVLink stores + flags
    python examples/allgather.py                          # no GPU: 2 ranks on CPU (Triton interpreter)

The kernel (triton_dist/kernels/allgather.py) is ~30 lines: each rank stores its shard into every peer's output
with dl.put, then raises a per-chunk flag with dl.signal; the last program dl.wait-s for every chunk to land.
"""

import time

import torch
import torch.distributed as dist

import triton_dist as td
from triton_dist.kernels import all_gather, ping_pong
from triton_dist.launch import run_main
from triton_dist.timing import timeable


def main():
    w, r = td.world_size(), td.rank()
    on_gpu = td.shmem.device().type == "cuda"
    n = (64 << 20) // 2 if on_gpu else 1000
    dtype = torch.bfloat16 if on_gpu else torch.float32
    out = td.shmem.empty((w * n,), dtype, name="gathered")
    for step in range(3):  # fresh inputs each time, output poisoned before each call
        x = torch.randn(n, device=td.shmem.device(), dtype=dtype) + r
        out.fill_(float("nan"))
        td.shmem.barrier()
        all_gather(x, out)
        parts = [torch.empty_like(x) for _ in range(w)]
        dist.all_gather(parts, x)
        assert torch.equal(out, torch.cat(parts)), f"rank {r}: all_gather mismatch at step {step}"
    iters = 10 if on_gpu else 3
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        all_gather(x, out)
    sync()
    ag_us = (time.perf_counter() - t0) / iters * 1e6
    rounds = 1000 if on_gpu else 5
    ping_pong(rounds)
    sync()
    t0 = time.perf_counter()
    ping_pong(rounds)
    sync()
    one_way_us = (time.perf_counter() - t0) / (2 * rounds) * 1e6
    if r == 0:
        gbps = n * x.element_size() * (w - 1) / ag_us / 1e3
        figures = (f"; {ag_us:.1f} us ({gbps:.1f} GB/s bus); signal one-way latency {one_way_us:.2f} us"
                   if timeable() else " (not timed: CPU ranks, or ranks sharing one GPU)")
        print(f"[{td.shmem.backend()} x{w}] all_gather of {n * x.element_size() >> 10} KiB/rank: correct{figures}")


if __name__ == "__main__":
    run_main(main)  # torchrun: this process is a rank; no GPU: two CPU ranks
