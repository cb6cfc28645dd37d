"""run157 probe (one GPU, device time by ``do_bench``): do A's block scales cost blockwise FP8 its 7-12 % against
per-tensor in the same Gluon kernel (run155)? The producer copies a K step's 128 row scales of A into the ring with
4-byte cp.async from ``scale_a[row, kb]``: [M, K/128] row-major, so the 128 values lie a row apart (128 lines per
step, served from L1 about 7 steps in 8). Variants, each the kernel of ``kernels/gemm_sm90.py`` with its
producer's address of A's scales rewritten (a copy of the module, loaded from a temporary file):
  rows     as shipped: ``scale_a[row * stride + kb]``
  kmajor   A's scales K-major ([K/128, M], as torch._scaled_mm wants 1x128 scales): ``scale_a[kb * M + row]``, a
           step's 128 scales in 512 contiguous bytes
  none     no copy of A's scales at all (wrong results: the cost of the copies, for timing only)
against our per-tensor kernel on the same tile (the scales' upper bound) and cuBLAS per-tensor.

    PYTHONPATH=$PWD:$PWD/benchmarks torchrun --nproc-per-node=1 benchmarks/results/2026-12-07_gpu_run157/scale_probe.py
"""

import importlib.util
import json
import os
import tempfile

import torch
import triton

import triton_dist as td
from bench_gemm import cublas_fp8, fp8_operands
from triton_dist import hardware
from triton_dist.kernels import fp8, gemm_sm90

torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
td.init(backend="cuda")

SHIPPED = "_copy_to_shared(sa_bufs.index(slot), scale_a + rows * stride_sa + kk, mask=rows < M)"
VARIANTS = {"rows": SHIPPED,
            "kmajor": "_copy_to_shared(sa_bufs.index(slot), scale_a + rows + kk * stride_sa, mask=rows < M)",
            "none": "pass"}


def variant(name):
    src = open(gemm_sm90.__file__).read()
    assert SHIPPED in src
    src = src.replace(SHIPPED, VARIANTS[name]).replace("from .. import hardware", "from triton_dist import hardware")
    src = src.replace("from . import fp8", "from triton_dist.kernels import fp8").replace(
        "from .launcher import", "from triton_dist.kernels.launcher import")
    path = os.path.join(tempfile.mkdtemp(), f"sm90_{name}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"sm90_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def launcher(mod, a, w, c, cfg, mode, sa, sw, stride_sa=None):
    args = list(mod.Arguments(a, w, c, cfg, mode, sa, sw)(a, w, c, sa, sw))
    if stride_sa is not None:
        args[-2] = stride_sa  # (m, n, k, stride_sa, stride_sw) end the arguments
    tiles = -(-a.shape[0] // 128) * -(-w.shape[0] // cfg["BLOCK_N"])
    grid = (min(tiles, hardware.num_sms(a.device.index)),)
    meta = mod.meta(cfg, mode)
    return lambda: mod._LAUNCH(grid, *args, **meta)


mods = {name: variant(name) for name in VARIANTS}
rows = []
for m, n, k in [(8192, 8192, 8192), (8192, 28672, 8192), (4096, 6144, 4096), (2048, 8192, 8192)]:
    at, sat, wt, swt = fp8_operands(m, n, k, "tensor", "cuda")
    ab, sab, wb, swb = fp8_operands(m, n, k, "block", "cuda")
    sab_k = sab.t().contiguous()  # [K/128, M]
    want = (ab.double() * fp8.expand(sab, "group", m, k).double()) @ \
        (wb.double() * fp8.expand(swb, "block", n, k).double()).T
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    cfg = gemm_sm90.default_config({"GROUP_M": 8}, torch.bfloat16, True)  # 128 wide, its deepest ring
    calls = {"cuBLAS tensor": cublas_fp8(at, wt, sat, swt, "tensor", False),
             "ours tensor 128": launcher(mods["rows"], at, wt, out, cfg, "tensor", sat, swt),
             "block rows": launcher(mods["rows"], ab, wb, out, cfg, "block", sab, swb),
             "block kmajor": launcher(mods["kmajor"], ab, wb, out, cfg, "block", sab_k, swb, stride_sa=m),
             "block none": launcher(mods["none"], ab, wb, out, cfg, "block", sab, swb)}
    for name, fn in calls.items():
        out.fill_(float("nan"))
        fn()
        err = ((out.double() - want).norm() / want.norm()).item() if name.startswith("block") else None
        us = triton.testing.do_bench(fn, warmup=25, rep=100) * 1e3
        rows.append(dict(shape=[m, n, k], name=name, stages=cfg["num_stages"], device_us=us, rel_err=err))
    bar = rows[-len(calls)]["device_us"]
    for r in rows[-len(calls):]:
        r["vs_cublas"] = bar / r["device_us"]
        print(f"{m}x{n}x{k} {r['name']:16s} {r['device_us']:8.1f} us {r['vs_cublas']:5.2f}x"
              + (f" rel err {r['rel_err']:.1e}" if r["rel_err"] is not None else ""), flush=True)
if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "scale_probe.json"), "w") as f:
        json.dump(rows, f, indent=1)
