"""AG+GEMM on the node (torchrun --nproc-per-node=N benchmarks/bench_ag_gemm.py), bf16, in one run:

  ours           triton_dist.kernels.ag_gemm (autotuned once per shape: tiles, FLATTEN, sub-tiling and the
                 NCCL+cuBLAS fallback itself; rank 0 prints the sweep); "op" = torch.ops.triton_dist.ag_gemm
  ours fallback  our op forced onto its NCCL+cuBLAS path (must equal the NCCL+cuBLAS column: plan cache)
  ours overlap   our op forced onto the overlapped kernel with the default config
  graph-path     (M <= 2048) our op forced onto path "graph": the overlapped kernels replayed from a cached
                 CUDA graph by an eager call (copy in, replay, copy out)
  gather-first   (M <= 512) path "graph" with gather_first: wait for every rank's rows, then one GEMM pass with
                 128x64 tiles (the weight streamed once)
  host us/call   Python + launch cost of one eager call (GPU kept busy, so the host never waits; median of
                 5 batches of 20 calls, max over ranks: harness.host_us)
  sweep          (8192^3 and 2048 only) the overlapped kernel per knob: n_chunks, FLATTEN, EPILOGUE_SUBTILE,
                 GROUP_M, tile shape, one program fewer than SMs
  NCCL+cuBLAS    dist.all_gather_into_tensor then torch.matmul
  async-TP       torch.ops.symm_mem.fused_all_gather_matmul (torch symmetric memory, CUDA backend)
  in turn        ours, NCCL+cuBLAS, async-TP and the GEMM alone (full [M, K] @ w.T by cuBLAS, and by our GEMM
                 core: what the overlap adds to it) again, timed in turn over 5 rounds: the fair comparison on a
                 power-capped GPU whose speed drifts within a run
Shapes (M, N, K) are full sizes; each rank has a [M/W, K] and w [N/W, K]. TFLOP/s per GPU = 2*M*(N/W)*K / time.
"""

import os

import torch
import torch.distributed as dist

import triton_dist as td
from harness import IN_TURN, head_to_head, host_us, knob_sweep, record
from triton_dist.timing import time_us, time_us_or_nan
from triton_dist.kernels import ag_gemm
from triton_dist.kernels.gemm import gemm, skinny_configs
from triton_dist.kernels.allgather_gemm import default_config

SWEEP = [("n_chunks=1", {}), ("n_chunks=2", {"n_chunks": 2}), ("n_chunks=4", {"n_chunks": 4}),
         ("flatten", {"FLATTEN": True}), ("subtile s4", {"EPILOGUE_SUBTILE": True, "num_stages": 4}),
         ("GROUP_M=16", {"GROUP_M": 16}), ("GROUP_M=4", {"GROUP_M": 4}),
         ("128x128 s4", {"BLOCK_N": 128, "num_stages": 4}), ("programs-1", {"num_programs": -1})]
# Tried and dropped (commit c6bec7a, reverted; runs 65-67): stream-K's last wave, the last partial wave of tiles
# (e.g. 20 of 3584 on 132 SMs) or that plus one full wave shared out over every program by K steps, owners adding
# the partials in program order (GPU-tested: 100 fresh repeats, ragged M/K, TMA and masked). In-turn A/Bs with
# ~50 ms of warm-up (run67, 9 rounds; none / last wave / plus one wave): 848.9 / 850.1 / 883.3 us at 8192^3,
# 2906.6 / 2913.2 / 2891.6 at N = 28672, 2875.6 / 2876.7 / 3048.5 at K = 28672. Without the warm-up (runs 65-66)
# the last-wave variant read 4 % faster at K = 28672, a power-state artefact: at the power cap the idle SMs of a
# short last wave let the busy ones clock up, so the wave costs little, and the partials cost energy.


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
    world = td.world_size()
    group_name = dist.group.WORLD.group_name
    rows, sweep_rows = [], []
    for m_total, n_total, k in SHAPES:
        m, n = m_total // world, n_total // world
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 16
        full = torch.empty((m_total, k), device="cuda", dtype=torch.bfloat16)

        def nccl_cublas():
            dist.all_gather_into_tensor(full, a)
            return torch.matmul(full, w.T)

        ref = nccl_cublas().float()
        out = ag_gemm(a, w)  # tunes on first call (same choice on every rank)
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        t_ours = time_us(lambda: ag_gemm(a, w))
        t_op = time_us(lambda: torch.ops.triton_dist.ag_gemm(a, w, False))
        base = default_config(m, n, k, a.dtype, a.device, world)
        t_fb = time_us(lambda: ag_gemm(a, w, config={"path": "fallback"}))
        over = {**base, "path": "overlap"}
        t_over = time_us(lambda: ag_gemm(a, w, config=over))
        t_replay = time_us(lambda: ag_gemm(a, w, config={**over, "path": "graph"})) if m_total <= 2048 else \
            float("nan")
        gather_first = {**over, "path": "graph", "gather_first": True, **skinny_configs(a.dtype)[1]}
        t_gather = time_us(lambda: ag_gemm(a, w, config=gather_first)) if m_total <= 512 else float("nan")
        h_ours = host_us(lambda: ag_gemm(a, w), calls=20)
        if (m_total, n_total, k) in ((8192, 8192, 8192), (2048, 8192, 8192)):
            sweep = knob_sweep(lambda cfg: ag_gemm(a, w, config=cfg), over, SWEEP, a.device)
            sweep_rows.append({"M": m_total, "N": n_total, "K": k, **{kk: round(v, 1) for kk, v in sweep.items()}})
        t_nccl = time_us(nccl_cublas)
        t_tp = time_us_or_nan(_async_tp(a, w.T, group_name), "async-TP")
        # head to head timed in turn: each sees the same mix of the power-capped GPU's states
        turn = head_to_head(lambda: ag_gemm(a, w), {"NCCL+cuBLAS": nccl_cublas,
                            "async-TP": _async_tp(a, w.T, group_name)},
                            {"GEMM": lambda: torch.matmul(full, w.T), "our GEMM": lambda: gemm(full, w)})
        tflops = lambda t: 2 * m_total * n * k / t / 1e6  # noqa: E731
        rows.append({"M": m_total, "N": n_total, "K": k, "ours us": t_ours, "ours TFLOP/s": tflops(t_ours),
                     "op us": t_op, "ours fallback us": t_fb, "ours overlap us": t_over,
                     "ours graph-path us": t_replay, "gather-first graph us": t_gather, "host us/call": h_ours,
                     "NCCL+cuBLAS us": t_nccl, "async-TP us": t_tp,
                     "vs NCCL+cuBLAS": t_nccl / t_ours, "vs async-TP": t_tp / t_ours, **turn, "max rel err": err})
        del a, w, full, out, ref
    record("ag_gemm", rows, notes=f"bf16, W={world}; median of 20, max over ranks; ours = autotuned eager call; "
           f"'in turn': ours, the baselines and the GEMM alone {IN_TURN}")
    record("ag_gemm_sweep", sweep_rows, notes="overlapped kernel, default config + one knob; median of 10, max over ranks")
    td.finalize()


if __name__ == "__main__":
    main()
