"""GEMM+RS on the node (torchrun --nproc-per-node=N benchmarks/bench_gemm_rs.py), bf16, in one run:

  ours           triton_dist.kernels.gemm_rs (autotuned once per shape: tiles, sub-tiling, deferred signals and the
                 torch.matmul + NCCL fallback itself; rank 0 prints the sweep); "op" = torch.ops.triton_dist.gemm_rs
  ours fallback  our op forced onto its torch.matmul + reduce_scatter_tensor path
  ours overlap   our op forced onto the overlapped kernel with the default config
  graph-path     (M <= 2048) our op forced onto path "graph": the same kernel replayed from a cached CUDA
                 graph by an eager call (copy in, replay, copy out)
  graph us       the op replayed from a CUDA graph (no Python, no launch gaps)
  GEMM only      torch.matmul of the local shapes alone: the floor for any overlap
  sweep          (8192^3 and 2048 only) the overlapped kernel, default config + one knob
  remote TMA A/B (M = 8192) partial tiles by TMA stores vs stores from registers, the variants timed in turn
  NCCL+cuBLAS    torch.matmul then dist.reduce_scatter_tensor
  async-TP       torch.ops.symm_mem.fused_matmul_reduce_scatter (torch symmetric memory, CUDA backend)
  in turn        ours, NCCL+cuBLAS, async-TP and the GEMM alone (by cuBLAS, and by our GEMM core: what the
                 overlap adds to it) again, timed in turn over 5 rounds: the fair comparison on a power-capped GPU
                 whose speed drifts within a run
Shapes (M, N, K) are full sizes; each rank has a [M, K/W] and w [N, K/W]; the result is [M/W, N] per rank.
TFLOP/s per GPU = 2*M*N*(K/W) / time.
"""

import os

import torch
import torch.distributed as dist

import triton_dist as td
from harness import IN_TURN, head_to_head, in_turn_note, interleaved_ab, knob_sweep, record
from triton_dist.timing import graph_us_or_nan, time_us, time_us_or_nan
from triton_dist.kernels.gemm import gemm
from triton_dist.kernels import gemm_rs
from triton_dist.kernels.gemm_reducescatter import default_config

SHAPES = [(8192, 8192, 8192), (8192, 28672, 8192), (8192, 8192, 28672), (2048, 8192, 8192), (512, 8192, 8192),
          (128, 8192, 8192)]
SWEEP = [("no defer", {"DEFER_SIGNAL": False}), ("fp32 partials", {"partial": "fp32"}),
         ("128x256 s3", {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_stages": 3, "num_warps": 8}),
         ("128x256 s4 subtile", {"BLOCK_M": 128, "BLOCK_N": 256, "num_stages": 4, "EPILOGUE_SUBTILE": True}),
         ("128x128 s4", {"BLOCK_M": 128, "BLOCK_N": 128, "num_stages": 4, "num_warps": 8}),
         ("GROUP_M=4", {"GROUP_M": 4}), ("GROUP_M=16", {"GROUP_M": 16}), ("no TMA", {"use_tma": False}),
         ("programs-4", {"num_programs": -4})]
# Partial tiles by TMA stores into the peer (remote_tma) against stores from registers, timed in turn (run46's
# one-after-another sweep: 3058 vs 3117-3240 us at N = 28672, 842 vs 848-893 at 8192^3, within the GPU's drift)
# run67 in turn (9 rounds, ~50 ms of warm-up each): stores / remote TMA / programs-4 / remote TMA programs-4
# 956.8 / 950.5 / 937.6 / 934.9 us at 8192^3, 3252.9 / 3243.0 / 3220.5 / 3189.0 at N = 28672, 3024.7 / 3010.6 /
# 3007.5 / 2997.5 at K = 28672 (the tuner's pick at all three). Stream-K's last wave of own tiles (commit c6bec7a,
# reverted): 1-3 % slower than stores at every shape in runs 66-67.
# run77 (commit 144eb11, reverted): the own tiles' loads of the peers' partials marked L2 evict_first (MoE's copies
# gained ~4 % that way) on top of remote TMA, programs-4: 940.7 / 3223.6 / 3038.8 us against 937.9 / 3234.9 /
# 3035.3 -- noise; dropped.
# run79's one-after-another sweep had GROUP_M=16 at 828 us against the default's 883 at 8192^3: timed in turn here.
REMOTE_AB = [("stores", {}), ("remote TMA", {"remote_tma": True}), ("stores, programs-4", {"num_programs": -4}),
             ("remote TMA, programs-4", {"remote_tma": True, "num_programs": -4}),
             ("remote TMA, programs-4, GROUP_M=16", {"remote_tma": True, "num_programs": -4, "GROUP_M": 16})]
AB_ROUNDS = 9  # run65: 5 rounds of 10 calls left ~3 % of noise at N = 28672


def _async_tp(a, w_t, group_name):
    import torch.distributed._symmetric_memory as symm_mem

    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(group_name)

    def run():
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, w_t, "sum", 0, group_name)
    return run


def main():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    td.init(backend="cuda", heap_size=6 << 30)
    world, rank = td.world_size(), td.rank()
    group_name = dist.group.WORLD.group_name
    rows, sweep_rows, ab_rows = [], [], []
    for m, n, k_total in SHAPES:
        k = k_total // world
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 16
        rs_out = torch.empty((m // world, n), device="cuda", dtype=torch.bfloat16)

        def nccl_cublas():
            dist.reduce_scatter_tensor(rs_out, torch.matmul(a, w.T))
            return rs_out

        exact = a.float() @ w.float().T
        dist.all_reduce(exact)
        exact = exact[rank * (m // world): (rank + 1) * (m // world)]
        out = gemm_rs(a, w)  # tunes on first call (same choice on every rank)
        err = ((out.float() - exact).abs().max() / exact.abs().max()).item()
        bitwise = torch.equal(out, gemm_rs(a, w))
        del exact
        t_ours = time_us(lambda: gemm_rs(a, w))
        t_op = time_us(lambda: torch.ops.triton_dist.gemm_rs(a, w))
        base = default_config(m, n, k, a.dtype, a.device, world)
        t_fb = time_us(lambda: gemm_rs(a, w, config={"path": "fallback"}))
        over = {**base, "path": "overlap"}
        t_over = time_us(lambda: gemm_rs(a, w, config=over))
        t_replay = time_us(lambda: gemm_rs(a, w, config={**over, "path": "graph"})) if m <= 2048 else float("nan")
        t_graph = graph_us_or_nan(lambda: torch.ops.triton_dist.gemm_rs(a, w), "graph replay")  # NaN: table goes on
        t_gemm = time_us(lambda: torch.matmul(a, w.T))
        if (m, n, k_total) in ((8192, 8192, 8192), (2048, 8192, 8192)):
            sweep = {"default": t_over, **knob_sweep(lambda cfg: gemm_rs(a, w, config=cfg), over, SWEEP, a.device)}
            sweep_rows.append({"M": m, "N": n, "K": k_total, **{kk: round(v, 1) for kk, v in sweep.items()}})
        if m == 8192:
            ab = interleaved_ab(lambda cfg: gemm_rs(a, w, config=cfg), over, REMOTE_AB, a.device, AB_ROUNDS)
            ab_rows.append({"M": m, "N": n, "K": k_total, **{kk: round(v, 1) for kk, v in ab.items()}})
        t_nccl = time_us(nccl_cublas)
        t_tp = time_us_or_nan(_async_tp(a, w.T, group_name), "async-TP")
        # head to head timed in turn: each sees the same mix of the power-capped GPU's states (run56: the tuner
        # timed 2820 us at N = 28672 in a burst, sustained calls 3313-3487 later in the run)
        turn = head_to_head(lambda: gemm_rs(a, w), {"NCCL+cuBLAS": nccl_cublas,
                            "async-TP": _async_tp(a, w.T, group_name)},
                            {"GEMM": lambda: torch.matmul(a, w.T), "our GEMM": lambda: gemm(a, w)})
        tflops = lambda t: 2 * m * n * k / t / 1e6  # noqa: E731
        rows.append({"M": m, "N": n, "K": k_total, "ours us": t_ours, "ours TFLOP/s": tflops(t_ours),
                     "op us": t_op, "graph us": t_graph, "ours fallback us": t_fb, "ours overlap us": t_over,
                     "ours graph-path us": t_replay,
                     "GEMM only us": t_gemm, "NCCL+cuBLAS us": t_nccl, "async-TP us": t_tp,
                     "vs NCCL+cuBLAS": t_nccl / t_ours, "vs async-TP": t_tp / t_ours, **turn, "max rel err": err,
                     "bitwise repeat": bitwise})
        del a, w, out, rs_out
        torch.cuda.empty_cache()
    record("gemm_rs", rows, notes=f"bf16, W={world}; median of 20, max over ranks; ours = autotuned eager call; "
           f"'in turn': ours, the baselines and the GEMM alone {IN_TURN}")
    record("gemm_rs_sweep", sweep_rows,
           notes="overlapped kernel, default config + one knob; median of 10, max over ranks")
    record("gemm_rs_remote_tma_ab", ab_rows,
           notes=f"overlapped kernel, default config + knobs, {in_turn_note(AB_ROUNDS)}")
    td.finalize()


if __name__ == "__main__":
    main()
