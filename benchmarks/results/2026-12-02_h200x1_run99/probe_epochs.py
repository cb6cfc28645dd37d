"""Probe of the shared-GPU ag_gemm timeouts (1x H200, ranks sharing the GPU under MPS). Runs 95, 96, 98 and 99
('ag_gemm.arrived': one rank waited for epoch E and last saw E - 1 while its peers went on) replayed as their
tests call the op: FP8 every candidate at W = 2 (fails at the 2nd call of the first graph candidate), bf16
silu_gate 517x520x4104 at W = 4 (the 2nd call of config {"path": "overlap", "use_tma": False}), the same at
W = 2, and both with every Launcher on Triton's plain launch path. After each call every rank's epoch counters
(ws.state, ws.epoch word) and graph caches are logged; after a timeout its workspaces' flags and plans. Prints
the first call where the ranks' counters differ or a wait timed out. run99 lost the per-rank logs (the pool
re-raised the recorded timeout); this version clears it first.
Usage: TRITON_DIST_SHARED_GPU_RANKS=8 python probe_epochs.py [case ...] (cases: CASES below; default all; runs
100 and 101 ran it with the cases their steps.sh name). Updated to the tree after the FP8 fold (one ag_gemm module)."""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
import triton_dist as td  # noqa: E402
from triton_dist.kernels import allgather_gemm as agm  # noqa: E402
from triton_dist.launch import RankPool, RankError  # noqa: E402
from tests.kernels.fp8_inputs import operands  # noqa: E402


def _counters():
    torch.cuda.synchronize()
    return {repr(key[1]): (ws.state.tolist(), ws.epoch.tolist()) for (op, key), ws in
            td.shmem.workspaces._WORKSPACES.items() if op == "ag_gemm"}


def _dump():
    """Everything a stale or misplaced flag could come from, on this rank, after a timeout."""
    torch.cuda.synchronize()
    td.shmem.clear_errors()  # else the pool re-raises the recorded timeout and this log is lost
    world = td.world_size()
    out = {"rank": td.rank(), "workspaces": [], "plans": []}
    for (op, key), ws in td.shmem.workspaces._WORKSPACES.items():
        if op == "ag_gemm":
            out["workspaces"].append((repr(key), id(ws), ws.state.tolist(), ws.epoch.tolist(),
                                      ws.arrived[:world * 2].tolist(), ws.ready.tolist()))
    for key, plan in agm._PLANS._plans.items():
        if getattr(plan, "path", None) != "fallback" and hasattr(plan, "ws"):
            # what this rank's flags read on each peer through its peer views (the peer reads them locally
            # above): equal values but a stuck peer means the views and the peer's own heap differ
            pushed = [(step, [(lo, hi, flag.tolist(), flag.data_ptr()) for lo, hi, _, flag in items])
                      for step, (_, items, _) in enumerate(plan.pushes, 1)]
            out["plans"].append((repr(key)[:160], id(plan.ws), plan.n_chunks, plan.chunk_rows, plan.grid,
                                 plan.handshake.compiled is not None, pushed))
    return out


def _graphs():
    return len(agm._GRAPHS.graphs), len(agm._GRAPHS.seen)


def fp8_every_candidate(mode):
    from triton_dist.kernels.gemm import fp8_tiles
    m, n, k = 1000, 1536, 1024
    world = td.world_size()
    dev, e4m3 = torch.device("cuda"), torch.float8_e4m3fn
    cands = agm.candidate_configs(m, n, k, e4m3, dev, world)  # FP8 tiles already
    cands += [{**fp8_tiles(agm.default_config(m, n, k, e4m3, dev, world), e4m3, dev), "n_chunks": 4}]
    log = []
    for ci, cfg in enumerate(cands):
        for i in range(3):
            gen = torch.Generator().manual_seed(1000 * i + td.rank())
            a, sa, w, sw, da, dw = operands(m, n, k, mode, gen)
            try:
                agm.scaled_ag_gemm(a.cuda(), w.cuda(), sa.cuda(), sw.cuda(), config=cfg)
                torch.cuda.synchronize()
                td.shmem.check_errors()
            except Exception as e:  # noqa: BLE001
                log.append((ci, i, cfg.get("path"), repr(e)[:400], _counters(), _graphs(), _dump()))
                return log
            log.append((ci, i, cfg.get("path"), None, _counters(), _graphs()))
    return log


def unbound(fn, *args):
    """``fn`` with every Launcher on Triton's plain launch path (is the pre-bound fast path the difference?)."""
    from triton_dist.kernels import launcher
    launcher.Launcher._bind = lambda self, compiled, args: None
    return fn(*args)


def bf16_silu_gate():
    log = []
    for ci, (m, n_out, k, cfg) in enumerate([(517, 520, 4104, None), (517, 520, 4104,
                                             {"path": "overlap", "use_tma": False})]):
        for i in range(20):
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(2 * n_out, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            agm.buffers(m, k, torch.bfloat16)
            for ws in td.shmem.workspaces.cached("ag_gemm"):
                ws.a_full.fill_(float("nan"))
            td.shmem.barrier()
            try:
                if cfg is None:
                    torch.ops.triton_dist.ag_gemm(a, w, False, "silu_gate")
                else:
                    agm.ag_gemm(a, w, config=cfg, activation="silu_gate")
                torch.cuda.synchronize()
                td.shmem.check_errors()
            except Exception as e:  # noqa: BLE001
                log.append((ci, i, None if cfg is None else cfg.get("path"), repr(e)[:400], _counters(), _graphs(),
                            _dump()))
                return log
            log.append((ci, i, None if cfg is None else cfg.get("path"), None, _counters(), _graphs()))
    return log


def report(name, logs):
    world = len(logs)
    print(f"== {name}: {[len(x) for x in logs]} calls logged per rank")
    for j in range(max(len(x) for x in logs)):
        rows = [x[j] if j < len(x) else None for x in logs]
        states = [r[4] if r else None for r in rows]
        errs = [r[3] for r in rows if r and r[3]]
        if errs or any(s != states[0] for s in states):
            print(f"-- first divergence/error at call {j}: (candidate, repeat, path) "
                  f"{[r[:3] if r else None for r in rows]}")
            for rk in range(world):
                for back in range(max(0, j - 2), j + 1):
                    if back < len(logs[rk]):
                        print(f"   rank {rk} call {back}: {logs[rk][back]}")
            return
    print(f"   all {len(logs[0])} calls in step; last counters {logs[0][-1][4]}, graphs {logs[0][-1][5]}")


CASES = {"fp8_row": (2, fp8_every_candidate, ("row",)), "fp8_block": (2, fp8_every_candidate, ("block",)),
         "bf16_w4": (4, bf16_silu_gate, ()), "bf16_w2": (2, bf16_silu_gate, ()),
         "unbound_fp8_row": (2, unbound, (fp8_every_candidate, "row")), "unbound_bf16_w4": (4, unbound, (bf16_silu_gate,))}

if __name__ == "__main__":
    for name in sys.argv[1:] or ["fp8_row", "bf16_w4", "bf16_w2", "unbound_fp8_row", "unbound_bf16_w4"]:
        world, fn, args = CASES[name]
        with RankPool(world, backend="shared-gpu", wait_timeout_s=15) as pool:
            try:
                report(f"{fn.__name__}{args} W={world}", pool.run(fn, *args, timeout=400))
            except RankError as e:
                print(f"== {fn.__name__}{args} W={world}: RankError\n{str(e)[-3000:]}")
