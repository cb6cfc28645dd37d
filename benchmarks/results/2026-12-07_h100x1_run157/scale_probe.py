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

    PYTHONPATH=$PWD:$PWD/benchmarks torchrun --nproc-per-node=1 benchmarks/results/2026-12-07_h100x1_run157/scale_probe.py
"""

import importlib.util
import os
import tempfile

import torch

from bench_gemm import cublas_fp8
from probe import BLOCK_SHAPES, block_case, start, time_block_contenders, write  # (this directory's probe.py)
from triton_dist import hardware
from triton_dist.kernels import gemm_sm90

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


if __name__ == "__main__":  # (run158's ring_probe.py imports ``variant`` and ``launcher``)
    start()
    mods = {name: variant(name) for name in VARIANTS}
    cfg = gemm_sm90.default_config({"GROUP_M": 8}, torch.bfloat16, True)  # 128 wide, its deepest ring
    rows = []
    for m, n, k in BLOCK_SHAPES:
        (at, sat, wt, swt), (ab, sab, wb, swb), want, out = block_case(m, n, k)
        sab_k = sab.t().contiguous()  # [K/128, M]
        calls = {"cuBLAS tensor": cublas_fp8(at, wt, sat, swt, "tensor", False),
                 "ours tensor 128": launcher(mods["rows"], at, wt, out, cfg, "tensor", sat, swt),
                 "block rows": launcher(mods["rows"], ab, wb, out, cfg, "block", sab, swb),
                 "block kmajor": launcher(mods["kmajor"], ab, wb, out, cfg, "block", sab_k, swb, stride_sa=m),
                 "block none": launcher(mods["none"], ab, wb, out, cfg, "block", sab, swb)}
        rows += time_block_contenders((m, n, k), calls, want, out, stages=cfg["num_stages"])
    write(rows, "scale_probe.json")
