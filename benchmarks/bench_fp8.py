"""FP8 through the fused ops on the node (torchrun --nproc-per-node=2 benchmarks/bench_fp8.py [--only PART]).

  ag_gemm   scaled_ag_gemm (e4m3 rows gathered with their scales, bf16 out; rowwise and 128-blockwise scales)
            against torch.ops.symm_mem.fused_all_gather_scaled_matmul (async-TP, rowwise), NCCL all_gather of the
            FP8 rows and scales + torch._scaled_mm (cuBLAS), and our bf16 ag_gemm of the same shape
  gemm_rs   scaled_gemm_rs against torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter (rowwise),
            torch._scaled_mm + NCCL reduce_scatter_tensor, and our bf16 gemm_rs
  moe_ep    ep_dispatch(quant="fp8") (the senders quantise) and with pre-quantised x (x FP8 + x_scales) against
            the bf16 dispatch, T = 4096 and 128 tokens per rank, hidden 7168, top-8 of 64 experts; then the bf16
            ep_combine after each; CUDA-graph replays of one call
Everything of a table is timed in turn (``harness.in_turn``); "path ours ..." columns: the path each of our calls
ran (overlap / graph / fallback: ``harness.path_of``). Shapes (M, N, K) are full sizes as in
bench_ag_gemm / bench_gemm_rs; TFLOP/s per GPU.
"""

import argparse
import os

import torch
import torch.distributed as dist

import triton_dist as td
from harness import IN_TURN, in_turn, path_of, record
from triton_dist.kernels import ag_gemm, fp8, gemm_rs, scaled_ag_gemm, scaled_gemm_rs
from triton_dist.kernels.moe_ep import ep_combine, ep_dispatch
from triton_dist.timing import graph_of

SHAPES = [(8192, 8192, 8192), (8192, 28672, 8192), (8192, 8192, 28672), (2048, 8192, 8192), (512, 8192, 8192),
          (128, 8192, 8192)]
H, E, K = 7168, 64, 8


def _symm_mem(group_name):
    import torch.distributed._symmetric_memory as symm_mem

    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(group_name)


def _rel(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _operands(m, n, k):
    """Row- and block-scaled e4m3 operands of the same values (a [m, k], w [n, k]) and their bf16 copies."""
    x, y = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda") / 16
    (a, sa), (w, sw) = fp8.quantize(x, "row"), fp8.quantize(y, "row")
    (ab, sab), (wb, swb) = fp8.quantize(x, "group"), fp8.quantize(y, "block")
    return (a, w, sa, sw), (ab, wb, sab, swb), (x.to(torch.bfloat16), y.to(torch.bfloat16))


def _table_row(shape, op, bf16_op, operands, baseline, async_tp, flops):
    """``op`` (ours) on the row- and block-scaled ``operands``, ``bf16_op`` on their bf16 copies, ``async_tp`` and
    ``baseline`` (label, call): errors against the baseline (the first calls also tune), then every contender timed
    in turn."""
    (rows, block, bf16), (label, call) = operands, baseline
    calls = {"ours row": lambda: op(*rows), "ours block": lambda: op(*block), "async-TP row": async_tp,
             label: call, "ours bf16": lambda: bf16_op(*bf16)}
    ref = calls[label]().clone()
    errs = {"ours row": _rel(calls["ours row"](), ref), "bitwise repeat": torch.equal(calls["ours row"](),
                                                                                      calls["ours row"]())}
    paths = {f"path {label}": path_of(calls[label]) for label in ("ours row", "ours block", "ours bf16")}
    try:
        errs["async-TP row"] = _rel(calls["async-TP row"](), ref)
    except Exception as exc:  # an older torch without the scaled op, or another backend
        calls.pop("async-TP row")
        errs["async-TP row"] = f"n/a: {type(exc).__name__}"
    turn = in_turn(calls)
    return {**shape, **paths, **{f"{lb} us": v for lb, v in turn.items()},
            "ours row TFLOP/s": flops / turn["ours row"] / 1e6,
            **{f"vs {lb}": turn[lb] / turn["ours row"] for lb in turn if lb != "ours row"},
            **{f"rel err {lb}" if lb != "bitwise repeat" else lb: v for lb, v in errs.items()}}


def _ag_gemm_row(world, group_name, m_total, n_total, k):
    m, n = m_total // world, n_total // world
    operands = _operands(m, n, k)
    a, w, sa, sw = operands[0]
    full = torch.empty((m_total, k), device="cuda", dtype=a.dtype)
    full_s = torch.empty((m_total, 1), device="cuda")

    def nccl_cublas():
        dist.all_gather_into_tensor(full.view(torch.uint8), a.view(torch.uint8))
        dist.all_gather_into_tensor(full_s, sa)
        return torch._scaled_mm(full, w.t(), full_s, sw.t(), out_dtype=torch.bfloat16)

    def async_tp():
        return torch.ops.symm_mem.fused_all_gather_scaled_matmul(
            a, [w.t()], sa, [sw.t()], 0, group_name, [None], [None], [torch.bfloat16], [False])[1][0]

    return _table_row(dict(M=m_total, N=n_total, K=k), scaled_ag_gemm, ag_gemm, operands,
                      ("NCCL+cuBLAS row", nccl_cublas), async_tp, 2 * m_total * n * k)


def _gemm_rs_row(world, group_name, m, n, k_total):
    k = k_total // world
    operands = _operands(m, n, k)
    a, w, sa, sw = operands[0]
    out = torch.empty((m // world, n), device="cuda", dtype=torch.bfloat16)

    def cublas_nccl():
        dist.reduce_scatter_tensor(out, torch._scaled_mm(a, w.t(), sa, sw.t(), out_dtype=torch.bfloat16))
        return out

    def async_tp():
        return torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter(
            a, w.t(), sa, sw.t(), "sum", 0, 0, group_name, [m, n], None, None, torch.bfloat16, False)

    return _table_row(dict(M=m, N=n, K=k_total), scaled_gemm_rs, gemm_rs, operands,
                      ("cuBLAS+NCCL row", cublas_nccl), async_tp, 2 * m * n * k)


def _rows(row_of, world, group_name):
    """One table row per shape; a shape's operands go with its row function's frame before the next shape."""
    rows = []
    for shape in SHAPES:
        rows.append(row_of(world, group_name, *shape))
        torch.cuda.empty_cache()
    return rows


def ag_gemm_rows(world, group_name):
    record("ag_gemm_fp8", _rows(_ag_gemm_row, world, group_name), notes=f"W={world}; e4m3 rows, fp32 scales, "
           f"bf16 out; eager calls {IN_TURN}; 'vs X' = X us / ours row us; errors against NCCL+cuBLAS")


def gemm_rs_rows(world, group_name):
    record("gemm_rs_fp8", _rows(_gemm_rs_row, world, group_name), notes=f"W={world}; e4m3 operands, fp32 scales, "
           f"bf16 partials and out; eager calls {IN_TURN}; 'vs X' = X us / ours row us")


def moe_ep_rows(world):
    rows = []
    for T in (4096, 128):
        g = torch.Generator(device="cuda").manual_seed(td.rank())
        x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
        idx = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=1).indices
        weights = torch.rand(T, K, device="cuda", generator=g).softmax(-1)
        q, s = fp8.quantize_fp8(x)
        kw = dict(num_experts=E, max_tokens=T, check_ids=False)
        dispatches = {"bf16": lambda: ep_dispatch(x, idx, weights, **kw),
                      "fp8 quantize": lambda: ep_dispatch(x, idx, weights, quant="fp8", **kw),
                      "fp8 given": lambda: ep_dispatch(q, idx, weights, x_scales=s, **kw)}
        for call in dispatches.values():
            call()  # workspaces, compilation
        turn = in_turn({f"dispatch {lb}": graph_of(call).replay for lb, call in dispatches.items()})
        combines = {}
        for label in ("bf16", "fp8 quantize"):  # a fresh dispatch of each workspace, then its combine replayed
            res = dispatches[label]()
            out = res.x if label == "bf16" else (res.x.float() * res.scales.repeat_interleave(128, 1)[:, :H]).to(
                torch.bfloat16)
            combines[f"combine after {label}"] = graph_of(lambda res=res, out=out: ep_combine(out, res.handle)).replay
        turn_c = in_turn(combines)
        rows.append({"T": T, **{f"{lb} graph us": v for lb, v in turn.items()},
                     "fp8 quantize vs bf16": turn["dispatch bf16"] / turn["dispatch fp8 quantize"],
                     "fp8 given vs bf16": turn["dispatch bf16"] / turn["dispatch fp8 given"],
                     **{f"{lb} graph us": v for lb, v in turn_c.items()}})
    record("moe_ep_fp8", rows, notes=f"W={world}, H={H}, top-{K} of {E}; one call per CUDA-graph replay, {IN_TURN}; "
           "FP8 rows carry 7168 B + 56 fp32 scales against 14336 B of bf16")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("ag_gemm", "gemm_rs", "moe_ep"), help="run one part (default: all)")
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    td.init(backend="cuda", heap_size=6 << 30)
    world, group_name = td.world_size(), dist.group.WORLD.group_name
    _symm_mem(group_name)
    if args.only in (None, "ag_gemm"):
        ag_gemm_rows(world, group_name)
    if args.only in (None, "gemm_rs"):
        gemm_rs_rows(world, group_name)
    if args.only in (None, "moe_ep"):
        moe_ep_rows(world)
    td.finalize()


if __name__ == "__main__":
    main()
