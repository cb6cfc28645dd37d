"""run102's FP8 tile probe (one H200): the GEMM core's FP8 configurations against cuBLAS ``torch._scaled_mm``, in
device time (each call replayed from a CUDA graph, 20 replays, median; contenders timed one after another).
Question: how fast are the 128x128 tiles that keep the promoted accumulators in registers (``gemm.fp8_tiles``),
against the 128x256 tiles of before (which spill on sm_90) and cuBLAS, per-tensor / rowwise / 128-blockwise.
    python fp8_probe.py OUT_DIR"""
import json
import statistics
import sys

import torch

from triton_dist.kernels import fp8
from triton_dist.kernels.gemm import gemm, gemm_config

SHAPES = [(8192, 8192, 8192), (8192, 28672, 8192), (4096, 6144, 4096), (2048, 8192, 8192)]
PROMOTED = {"128x128 s4": dict(BLOCK_N=128, num_stages=4), "128x128 s5": dict(BLOCK_N=128, num_stages=5),
            "128x128 s5 g16": dict(BLOCK_N=128, num_stages=5, GROUP_M=16),
            "128x128 s6 sub": dict(BLOCK_N=128, num_stages=6, EPILOGUE_SUBTILE=True),
            "128x256 s3 (spills)": dict(BLOCK_N=256, num_stages=3)}
FAST = {"128x256 s3": dict(BLOCK_N=256, num_stages=3), "128x256 s4 sub": dict(BLOCK_N=256, num_stages=4,
                                                                             EPILOGUE_SUBTILE=True),
        "256x128 s3": dict(BLOCK_M=256, BLOCK_N=128, num_stages=3), "128x128 s5": dict(BLOCK_N=128, num_stages=5)}


def device_us(fn, iters=20):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1000)
    return statistics.median(times)


def main(out_dir):
    rows = []
    for m, n, k in SHAPES:
        tflops = lambda us: 2 * m * n * k / us / 1e6  # noqa: E731
        x, y = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda") / 16
        row = {"M": m, "N": n, "K": k}
        for mode in ("tensor", "row", "block"):
            a, sa = fp8.quantize(x, {"block": "group"}.get(mode, mode))
            w, sw = fp8.quantize(y, mode)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            for fast in (False, True):
                tag = mode + (" fast" if fast else "")
                if mode != "block":
                    sa_, sw_ = (sa, sw.t()) if mode == "row" else (sa.reshape(()), sw.reshape(()))
                    ref = lambda: torch._scaled_mm(a, w.t(), sa_, sw_, out_dtype=torch.bfloat16,  # noqa: E731
                                                   use_fast_accum=fast)
                    row[f"cuBLAS {tag}"] = device_us(ref)
                    exact = ref().float()
                configs = {"default": {}} if mode == "tensor" else (FAST if fast else PROMOTED)
                for label, over in configs.items():
                    cfg = {**gemm_config(m, n, k, a.dtype, a.device, fp8.Scales(mode, sa, sw, fast)), **over}
                    call = lambda: gemm(a, w, out=out, scale_a=sa, scale_w=sw, scaling=mode,  # noqa: E731
                                        fast_accum=fast, config=cfg)
                    try:
                        us = device_us(call)
                    except Exception as exc:  # a config that does not fit: report and go on
                        print(f"{m}x{n}x{k} {tag} {label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                        continue
                    row[f"ours {tag} {label}"] = us
                    if mode != "block" and label in ("default", "128x128 s4", "128x256 s3"):
                        call()
                        row[f"err {tag} {label}"] = ((out.float() - exact).abs().max() / exact.abs().max()).item()
                    base = row.get(f"cuBLAS {tag}", row.get("cuBLAS tensor" + (" fast" if fast else "")))
                    print(f"{m}x{n}x{k} {tag:12s} {label:20s} {us:8.1f} us {tflops(us):6.0f} TFLOP/s "
                          f"cuBLAS{'' if mode != 'block' else ' tensor'} {base:8.1f} -> {base / us:.2f}x", flush=True)
        rows.append(row)
        json.dump(rows, open(f"{out_dir}/fp8_probe.json", "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
