"""run102's host probe (one H200): where an eager call of ``gemm`` spends its host time (bench_host: 121 µs per
call vs torch.matmul's 24 at 128x4096x8192 bf16). Per-call wall time of the Python call (synchronising every 50
calls, so the launch queue never fills), then a cProfile of 500 calls, top functions by own time.
    python host_probe.py OUT_DIR"""
import cProfile
import io
import pstats
import sys
import time

import torch

from triton_dist.kernels import fp8
from triton_dist.kernels.gemm import gemm


def per_call_us(fn, calls=1000):
    fn()
    torch.cuda.synchronize()
    spent = 0.0
    for _ in range(calls // 50):
        t0 = time.perf_counter()
        for _ in range(50):
            fn()
        spent += time.perf_counter() - t0
        torch.cuda.synchronize()
    return spent / calls * 1e6


def main(out_dir):
    m, n, k = 128, 4096, 8192
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    a8, sa = fp8.quantize(a.float(), "row")
    w8, sw = fp8.quantize(w.float(), "row")
    calls = {"torch.matmul": lambda: torch.matmul(a, w.t(), out=out), "gemm bf16": lambda: gemm(a, w, out=out),
             "gemm bf16 no out": lambda: gemm(a, w),
             "_scaled_mm row": lambda: torch._scaled_mm(a8, w8.t(), sa, sw.t(), out_dtype=torch.bfloat16),
             "gemm fp8 row": lambda: gemm(a8, w8, out=out, scale_a=sa, scale_w=sw)}
    report = []
    for name, fn in calls.items():
        report.append(f"{name:20s} {per_call_us(fn):7.1f} us per call (host)")
        print(report[-1], flush=True)
    for name in ("gemm bf16", "gemm fp8 row"):
        prof = cProfile.Profile()
        fn = calls[name]
        prof.enable()
        for i in range(500):
            fn()
            if i % 50 == 49:
                torch.cuda.synchronize()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        report.append(f"== cProfile {name} (500 calls)\n{s.getvalue()}")
        print(report[-1], flush=True)
    open(f"{out_dir}/host_probe.txt", "w").write("\n".join(report))


if __name__ == "__main__":
    main(sys.argv[1])
