"""The tensor-parallel gated MLP block end to end (torchrun --nproc-per-node=N benchmarks/bench_tp_mlp.py), bf16:

  ours           ag_gemm(activation="silu_gate") -> gemm_rs (triton_dist ops, autotuned once per shape): the
                 SiLU-gate fused into the AG+GEMM's tiles
  ours graph     the same block replayed from a CUDA graph
  ours unfused   ag_gemm -> silu(gate) * up (torch) -> gemm_rs: what the fusion saves (in turn)
  NCCL+torch     all_gather_into_tensor -> matmul -> silu(gate) * up -> matmul -> reduce_scatter_tensor
  parts          each half alone (ours vs NCCL+cuBLAS, the gate counted with the first), to see where the time
                 goes
  in turn        the two blocks and the block's three matmuls alone (cuBLAS, no communication: the floor of
                 any overlap) timed in turn, the fair comparison on a power-capped GPU
Every row names the path each ag_gemm / gemm_rs call ran ("path ours": overlap / graph / fallback; at W = 1 the
fallback). Sizes: M tokens (all ranks), hidden, intermediate I; rank r holds x [M/W, hidden], w_gate_up [2I/W, hidden],
w_down [hidden, I/W] (examples/tp_mlp.py explains the layout). TFLOP/s per GPU = 6*M*hidden*(I/W) / time.
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import triton_dist as td
from harness import IN_TURN, head_to_head, path_of, record
from triton_dist.timing import graph_us_or_nan, time_us
from triton_dist.kernels import ag_gemm, gemm_rs

SIZES = [(8192, 8192, 28672)]


def main():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    td.init(backend="cuda", heap_size=6 << 30)
    world = td.world_size()
    rows = []
    for m, hidden, inter in SIZES:
        il = inter // world
        x = torch.randn(m // world, hidden, device="cuda", dtype=torch.bfloat16)
        w_gate_up = torch.randn(2 * il, hidden, device="cuda", dtype=torch.bfloat16) / hidden ** 0.5
        w_down = torch.randn(hidden, il, device="cuda", dtype=torch.bfloat16) / inter ** 0.5
        full = torch.empty((m, hidden), device="cuda", dtype=torch.bfloat16)
        y_ref = torch.empty((m // world, hidden), device="cuda", dtype=torch.bfloat16)

        def gate(h):
            return F.silu(h[:, :il]) * h[:, il:]

        def ours():
            return gemm_rs(ag_gemm(x, w_gate_up, activation="silu_gate"), w_down)

        def ours_unfused():
            return gemm_rs(gate(ag_gemm(x, w_gate_up)), w_down)

        def nccl_ag_gemm():
            dist.all_gather_into_tensor(full, x)
            return full @ w_gate_up.T

        def nccl_gemm_rs(g):
            dist.reduce_scatter_tensor(y_ref, g @ w_down.T)
            return y_ref

        def nccl_torch():
            return nccl_gemm_rs(gate(nccl_ag_gemm()))

        y = ours()  # tunes both ops on the first call
        ref = nccl_torch().float()
        err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
        err_unfused = ((ours_unfused().float() - ref).abs().max() / ref.abs().max()).item()
        t_ours = time_us(ours)
        t_ref = time_us(nccl_torch)
        g = gate(nccl_ag_gemm())
        t_ag = time_us(lambda: ag_gemm(x, w_gate_up, activation="silu_gate"))
        t_ag_ref = time_us(lambda: gate(nccl_ag_gemm()))
        t_rs, t_rs_ref = time_us(lambda: gemm_rs(g, w_down)), time_us(lambda: nccl_gemm_rs(g))
        t_graph = graph_us_or_nan(ours, "graph capture")  # NaN keeps the rest of the table
        turn = head_to_head(ours, {"NCCL+torch": nccl_torch},
                            {"ours unfused": ours_unfused, "matmuls alone": lambda: (full @ w_gate_up.T, g @ w_down.T)})
        tflops = lambda t: 6 * m * hidden * il / t / 1e6  # noqa: E731
        rows.append({"M": m, "hidden": hidden, "intermediate": inter, "path ours": path_of(ours),
                     "path ours unfused": path_of(ours_unfused), "ours us": t_ours,
                     "ours TFLOP/s": tflops(t_ours), "ours graph us": t_graph, "NCCL+torch us": t_ref,
                     "NCCL+torch TFLOP/s": tflops(t_ref), "speedup": t_ref / t_ours,
                     "ag_gemm+gate us": t_ag, "AG+matmul+gate us": t_ag_ref, "gemm_rs us": t_rs,
                     "matmul+RS us": t_rs_ref, **turn, "max rel err vs NCCL+torch": err,
                     "unfused max rel err": err_unfused})
    record("tp_mlp", rows, notes=f"bf16, W={world}; median of 20, max over ranks; target speedup >= 1.2; "
           f"'in turn': {IN_TURN}")
    td.finalize()


if __name__ == "__main__":
    main()
