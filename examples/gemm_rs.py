"""Template: the tensor-parallel output projection ``reduce_scatter(a @ w.T)`` with the transfers overlapping the GEMM.

    torchrun --nproc-per-node=2 examples/gemm_rs.py     # GPUs: checks, then times ours vs torch.matmul + NCCL
    python examples/gemm_rs.py                          # no GPU: 2 ranks on CPU (Triton interpreter)

Each rank holds ``a`` [M, K_local] (its slice of the hidden dimension) and ``w`` [N, K_local]; ``gemm_rs`` returns
this rank's rows of ``sum over ranks of a @ w.T`` (rows split like ``torch.tensor_split``). The kernel computes the
tiles of the next rank's rows first and its own rows last; finished tiles are stored straight into the owner's
receive buffer while later tiles compute, and the owner adds them into its own tiles in a fixed ring order (own,
next rank, ...) (triton_dist/kernels/gemm_reducescatter.py). Same inputs, same bits, every run. The same call is
the torch op ``torch.ops.triton_dist.gemm_rs`` (torch.compile / CUDA graphs).
"""


import torch
import torch.distributed as dist

import triton_dist as td
from triton_dist.kernels import gemm_rs
from triton_dist.kernels.gemm_reducescatter import gemm_rs_torch, rows_of_rank
from triton_dist.launch import run_main
from triton_dist.timing import time_us, timeable


def main():
    world, rank = td.world_size(), td.rank()
    dev = td.shmem.device()
    on_gpu = dev.type == "cuda"
    m, n, k = (8192, 8192, 8192 // world) if on_gpu else (37, 24, 40)  # K is this rank's slice
    dtype = torch.bfloat16 if on_gpu else torch.float16
    w = torch.randn(n, k, device=dev, dtype=dtype) / k ** 0.5
    start, rows = rows_of_rank(m, world, rank)
    for step in range(3):  # fresh inputs every step
        a = torch.randn(m, k, device=dev, dtype=dtype)
        out = gemm_rs(a, w)
        ref = a.float() @ w.float().T
        dist.all_reduce(ref)
        ref = ref[start: start + rows]
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-2, f"rank {rank}: step {step}: relative error {err}"
        assert torch.equal(out, gemm_rs(a, w)), f"rank {rank}: not bitwise reproducible"
    if not timeable():  # CPU ranks, or ranks sharing one GPU: checked, not timed
        if rank == 0:
            print(f"[{td.shmem.backend()} x{world}] gemm_rs [{m}x{k}] @ [{n}x{k}].T, reduce-scattered: correct, "
                  f"reproducible")
        return

    ours, base = time_us(lambda: gemm_rs(a, w)), time_us(lambda: gemm_rs_torch(a, w))
    if rank == 0:
        tflops = 2 * m * n * k / ours / 1e6
        print(f"[{td.shmem.backend()} x{world}] gemm_rs M={m} N={n} K_local={k} bf16: correct; "
              f"{ours:.0f} us ({tflops:.0f} TFLOP/s per GPU) vs torch.matmul + NCCL reduce_scatter {base:.0f} us "
              f"({base / ours:.2f}x)")


if __name__ == "__main__":
    run_main(main)  # torchrun: this process is a rank; no GPU: two CPU ranks
