"""AG+GEMM on the node (torchrun --nproc-per-node=N benchmarks/bench_ag_gemm.py), bf16, in one run:

  ours           torch.ops.triton_dist.ag_gemm (autotuned once per shape: copy-engine vs SM producers, tiles,
                 and the NCCL+cuBLAS fallback itself; rank 0 prints the sweep)
  ours CE / SM   the overlapped kernel forced to copy-engine or SM producers (the issue's measurement)
  NCCL+cuBLAS    dist.all_gather_into_tensor then torch.matmul
  async-TP       torch.ops.symm_mem.fused_all_gather_matmul (torch symmetric memory, CUDA backend)
Shapes (M, N, K) are full sizes; each rank has a [M/W, K] and w [N/W, K]. TFLOP/s per GPU = 2*M*(N/W)*K / time.
"""

import os

import torch
import torch.distributed as dist

import triton_dist as td
from harness import record, time_us
from triton_dist.kernels import ag_gemm
from triton_dist.kernels.allgather_gemm import default_config

SHAPES = [(8192, 8192, 8192), (8192, 28672, 8192), (8192, 8192, 28672), (2048, 8192, 8192), (512, 8192, 8192),
          (128, 8192, 8192)]


def _async_tp(a, w_t, group_name):
    import torch.distributed._symmetric_memory as symm_mem

    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(group_name)

    def run():
        return torch.ops.symm_mem.fused_all_gather_matmul(a, [w_t], gather_dim=0, group_name=group_name)[1][0]
    return run


def main():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    td.init(backend="cuda", heap_size=4 << 30)
    world, rank = td.world_size(), td.rank()
    group_name = dist.group.WORLD.group_name
    rows = []
    for m_total, n_total, k in SHAPES:
        m, n = m_total // world, n_total // world
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 16
        full = torch.empty((m_total, k), device="cuda", dtype=torch.bfloat16)

        def nccl_cublas():
            dist.all_gather_into_tensor(full, a)
            return torch.matmul(full, w.T)

        ref = nccl_cublas().float()
        out = torch.ops.triton_dist.ag_gemm(a, w, False)[0]  # tunes on first call (same choice on every rank)
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        t_ours = time_us(lambda: torch.ops.triton_dist.ag_gemm(a, w, False))
        variants = {}
        if m_total >= 2048:
            for producer in ("copy_engine", "sm"):
                cfg = {**default_config(m, n, k, a.dtype, a.device, world), "path": "overlap",
                       "producer": producer, "num_producers": 16}
                variants[producer] = time_us(lambda: ag_gemm(a, w, config=cfg))
        t_nccl = time_us(nccl_cublas)
        try:
            t_tp = time_us(_async_tp(a, w.T, group_name))
        except Exception as exc:  # keep the rest of the table
            if rank == 0:
                print(f"async-TP failed: {type(exc).__name__}: {exc}", flush=True)
            t_tp = float("nan")
        tflops = lambda t: 2 * m_total * n * k / t / 1e6  # noqa: E731
        rows.append({"M": m_total, "N": n_total, "K": k, "ours us": t_ours, "ours TFLOP/s": tflops(t_ours),
                     "ours CE us": variants.get("copy_engine", float("nan")),
                     "ours SM us": variants.get("sm", float("nan")),
                     "NCCL+cuBLAS us": t_nccl, "async-TP us": t_tp,
                     "vs NCCL+cuBLAS": t_nccl / t_ours, "vs async-TP": t_tp / t_ours, "max rel err": err})
        del a, w, full, out, ref
    record("ag_gemm", rows, notes=f"bf16, W={world}; median of 20, max over ranks; ours = autotuned op")
    td.finalize()


if __name__ == "__main__":
    main()
