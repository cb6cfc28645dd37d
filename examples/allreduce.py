"""Template: the all-reduce of tensor-parallel decode, alone and fused with the layer's neighbours.

    torchrun --nproc-per-node=2 examples/allreduce.py     # GPUs: checks, then times ours vs NCCL (+ torch)
    python examples/allreduce.py                          # no GPU: 2 ranks on CPU (Triton interpreter)

``all_reduce(x)`` sums x over the ranks in rank order (one-shot: every rank reads every peer's copy of x from the
symmetric heap; two-shot: each rank sums a slice, then every rank reads the summed slices): the same bits on every
rank and every run. ``gemm_ar(a, w)`` is ``all_reduce(a @ w.T)`` (the row-parallel projection) in one kernel,
``all_reduce_rmsnorm`` adds the residual and normalises in the same kernel as the reduction
(triton_dist/kernels/allreduce/).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

import triton_dist as td
from triton_dist.kernels import all_reduce, all_reduce_rmsnorm, gemm_ar
from triton_dist.launch import run_main
from triton_dist.timing import time_us, timeable


def main():
    world, rank = td.world_size(), td.rank()
    dev = td.shmem.device()
    on_gpu = dev.type == "cuda"
    tokens, hidden = (16, 8192) if on_gpu else (3, 40)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    k = hidden // world  # this rank's slice of the projection's input features
    w = (torch.randn(hidden, k, device=dev) / k ** 0.5).to(dtype)
    weight = torch.ones(hidden, device=dev, dtype=dtype)
    tol = 3e-2 if on_gpu else 1e-4
    for step in range(3):  # fresh inputs every step
        a = torch.randn(tokens, k, device=dev).to(dtype)
        residual = torch.randn(tokens, hidden, device=dev).to(dtype)
        dist.broadcast(residual, src=0)  # the residual stream is the same on every rank
        y = gemm_ar(a, w)
        ref = a.float() @ w.float().T
        dist.all_reduce(ref)
        assert (y.float() - ref).abs().max() <= tol * ref.abs().max(), f"rank {rank}: gemm_ar off at step {step}"
        assert torch.equal(y, gemm_ar(a, w)), f"rank {rank}: gemm_ar not bitwise reproducible"
        for algo in ("one_shot", "two_shot"):
            s = all_reduce(a, algo=algo)
            ref_s = a.float().clone()
            dist.all_reduce(ref_s)
            assert (s.float() - ref_s).abs().max() <= tol * ref_s.abs().max(), f"rank {rank}: {algo} off"
        normed, new_residual = all_reduce_rmsnorm(y, residual, weight, 1e-6)
        ref_res = residual.float() + all_reduce(y).float()
        assert (new_residual.float() - ref_res).abs().max() <= tol * ref_res.abs().max(), f"rank {rank}: residual"
        ref_n = F.rms_norm(new_residual.float(), (hidden,), weight.float(), 1e-6)
        assert (normed.float() - ref_n).abs().max() <= tol * ref_n.abs().max(), f"rank {rank}: rmsnorm off"
    if not timeable():  # CPU ranks, or ranks sharing one GPU: checked, not timed
        if rank == 0:
            print(f"[{td.shmem.backend()} x{world}] all_reduce (one-/two-shot), gemm_ar and all_reduce_rmsnorm "
                  f"[{tokens}x{hidden}]: correct, reproducible")
        return

    x = torch.randn(tokens, hidden, device=dev, dtype=dtype)
    nccl = x.clone()
    ours, base = time_us(lambda: all_reduce(x)), time_us(lambda: dist.all_reduce(nccl))
    fused = time_us(lambda: all_reduce_rmsnorm(x, residual, weight, 1e-6))
    unfused = time_us(lambda: F.rms_norm(residual + all_reduce(x, algo="nccl"), (hidden,), weight, 1e-6))
    if rank == 0:
        print(f"[{td.shmem.backend()} x{world}] all_reduce {tokens}x{hidden} bf16: correct; {ours:.1f} us vs NCCL "
              f"{base:.1f} us; + residual + RMSNorm fused {fused:.1f} us vs NCCL + torch {unfused:.1f} us")


if __name__ == "__main__":
    run_main(main)  # torchrun: this process is a rank; no GPU: two CPU ranks
