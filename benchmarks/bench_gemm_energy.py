"""Joules per GEMM: the GEMM core's configurations and cuBLAS at the large per-rank shapes, on every GPU.

At N or K = 28672 an H200 runs at its board power limit (``sw_power_cap``: 1230-1500 MHz at ~700 W, run14), so
a GEMM's time is its energy divided by the cap: the kernel that needs fewer joules per GEMM is the faster one
there, whatever it does on a cool GPU. Short timings (20 calls, ~60 ms) see the power limiter's transient; this
benchmark runs each contender back to back for ``SECONDS`` and reads the board's energy counter (NVML
``nvmlDeviceGetTotalEnergyConsumption``), in turn over ``ROUNDS`` rounds (the board's temperature, hence its
leakage, drifts), and reports µs, J per call, W and the median SM clock.

    torchrun --nproc-per-node=N benchmarks/bench_gemm_energy.py   (every GPU measures itself, all at once)

Run78 (1xH200, 2026-11-30, sustained 1.5 s x 2 rounds): every contender, cuBLAS included, needs ~2.0 J per
GEMM of 1.92 PFLOP at 690-715 W: 2830-2950 µs for the good tiles, whichever of them.
"""

import os
import statistics
import time

import pynvml
import torch
import torch.distributed as dist

import triton_dist as td
from harness import clocks_during, record
from triton_dist.kernels.gemm import gemm_config, launch_gemm

SHAPES = [(8192, 14336, 8192), (8192, 4096, 28672), (8192, 28672, 4096)]  # AG+GEMM's two, GEMM+RS's one (W = 2)
SECONDS = float(os.environ.get("ENERGY_SECONDS", 1.5))
ROUNDS = int(os.environ.get("ENERGY_ROUNDS", 2))
VARIANTS = {  # label -> overrides of gemm_config
    "128x256x64 s3 g8": {},
    "s4 subtile": dict(num_stages=4, EPILOGUE_SUBTILE=True),
    "flatten": dict(FLATTEN=True),
    "warp_specialize": dict(WARP_SPECIALIZE=True),
    "g4": dict(GROUP_M=4),
    "g16": dict(GROUP_M=16),
    "g32": dict(GROUP_M=32),
    "256x128x64 s3": dict(BLOCK_M=256, BLOCK_N=128),
    "128x128x64 s4": dict(BLOCK_N=128, num_stages=4),
    "flatten s4 subtile": dict(FLATTEN=True, num_stages=4, EPILOGUE_SUBTILE=True),
}


def sustained(fn, seconds=SECONDS):
    """Back-to-back calls of ``fn`` for about ``seconds`` (``harness.clocks_during``): µs, J per call, W = J / time,
    median MHz."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.3:  # reach the power limiter's steady state
        fn()
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    run = clocks_during(fn, iters=max(5, int(seconds * 1e3 / start.elapsed_time(end))))
    return {"us": run["us"], "J": run["J"], "W": run["J"] / run["us"] * 1e6, "MHz": run["MHz"]}


def main():
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    td.init(backend="cuda")
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    gpu = f"{td.rank()} ({pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3:.0f} W limit)"
    rows = []
    for m, n, k in SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 16
        out = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)
        ref = a.float() @ w.float().T
        base = gemm_config(m, n, k, a.dtype, a.device)
        calls = {"cuBLAS": lambda: torch.matmul(a, w.T, out=out)}
        for label, knobs in VARIANTS.items():
            calls[label] = (lambda c: lambda: launch_gemm(a, w, out.view(1, m, n), c))({**base, **knobs})
        errors = {}
        for label, fn in calls.items():  # compile and check every contender before any timing
            out.fill_(float("nan"))
            try:
                fn()
                torch.cuda.synchronize()
                errors[label] = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            except Exception as exc:  # a configuration this GPU / triton cannot run
                errors[label] = f"{type(exc).__name__}: {str(exc)[:80]}"
        runnable = [lbl for lbl in calls if isinstance(errors[lbl], float) and errors[lbl] < 1e-2]
        runs = {lbl: [] for lbl in runnable}
        for r in range(ROUNDS):  # in turn: every round starts elsewhere, odd rounds go backwards
            order = runnable[r % len(runnable):] + runnable[:r % len(runnable)]
            for lbl in order[::-1] if r % 2 else order:
                runs[lbl].append(sustained(calls[lbl]))
        temp = pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
        for lbl in calls:
            row = {"GPU": gpu, "M": m, "N": n, "K": k, "kernel": lbl}
            if lbl in runs:
                row.update({key: statistics.median(x[key] for x in runs[lbl]) for key in ("us", "J", "W", "MHz")})
                row["TFLOP/s"] = 2 * m * n * k / row["us"] / 1e6
            row.update({"max rel err": errors[lbl], "temp C after": temp})
            rows.append(row)
    everyone = [None] * td.world_size()
    dist.all_gather_object(everyone, rows)
    record("gemm_energy", [r for ranks_rows in everyone for r in ranks_rows],
           notes=f"bf16 a[M,K] @ w[N,K].T on each GPU at once; per contender: {SECONDS} s of back-to-back calls "
           f"after 0.3 s of warm-up, {ROUNDS} rounds in turn, medians; J from NVML's energy counter, W = J / time, "
           "MHz: median SM clock sampled every ~2 ms; failed / wrong contenders have no timing")
    td.finalize()


if __name__ == "__main__":
    main()
