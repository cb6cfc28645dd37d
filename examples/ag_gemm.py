"""Template: the tensor-parallel input projection ``all_gather(a) @ w.T`` with the GEMM overlapping the gather.

    torchrun --nproc-per-node=2 examples/ag_gemm.py     # GPUs: checks, then times ours vs NCCL + cuBLAS
    python examples/ag_gemm.py                          # no GPU: 2 ranks on CPU (Triton interpreter)

Each rank holds a row shard ``a`` [m, K] and its weight slice ``w`` [N_local, K]. ``ag_gemm`` starts the GEMM on
the local shard while the other shards are pushed in (copy engines, a flag per chunk) and multiplies each remote
chunk as soon as its flag lands (triton_dist/kernels/allgather_gemm.py). The same call is the torch op
``torch.ops.triton_dist.ag_gemm`` (torch.compile / CUDA graphs).
"""


import torch
import torch.distributed as dist

import triton_dist as td
from triton_dist.kernels import ag_gemm
from triton_dist.launch import run_main
from triton_dist.timing import time_us, timeable


def main():
    world, rank = td.world_size(), td.rank()
    dev = td.shmem.device()
    on_gpu = dev.type == "cuda"
    m, n, k = (4096 // world * 2, 8192 // world, 8192) if on_gpu else (17, 24, 40)  # per-rank shapes
    dtype = torch.bfloat16 if on_gpu else torch.float16
    w = torch.randn(n, k, device=dev, dtype=dtype) / 16
    for step in range(3):  # fresh inputs every step
        a = torch.randn(m, k, device=dev, dtype=dtype)
        out, gathered = ag_gemm(a, w, return_gathered=True)
        parts = [torch.empty_like(a) for _ in range(world)]
        dist.all_gather(parts, a)
        ref = torch.cat(parts).float() @ w.float().T
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-2 and torch.equal(gathered, torch.cat(parts)), f"rank {rank}: step {step}: error {err}"
    if not timeable():  # CPU ranks, or ranks sharing one GPU: checked, not timed
        if rank == 0:
            print(f"[{td.shmem.backend()} x{world}] ag_gemm [{world * m}x{k}] @ [{n}x{k}].T: correct")
        return

    def nccl_then_cublas():
        full = torch.empty((world * m, k), device=dev, dtype=dtype)
        dist.all_gather_into_tensor(full, a)
        return full @ w.T

    ours, base = time_us(lambda: ag_gemm(a, w)), time_us(nccl_then_cublas)
    if rank == 0:
        tflops = 2 * world * m * n * k / ours / 1e6
        print(f"[{td.shmem.backend()} x{world}] ag_gemm M={world * m} N_local={n} K={k} bf16: correct; "
              f"{ours:.0f} us ({tflops:.0f} TFLOP/s) vs NCCL+cuBLAS {base:.0f} us ({base / ours:.2f}x)")


if __name__ == "__main__":
    run_main(main)  # torchrun: this process is a rank; no GPU: two CPU ranks
