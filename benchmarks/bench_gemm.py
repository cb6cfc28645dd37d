"""The GEMM core alone vs cuBLAS on the per-rank AG+GEMM shapes and GEMM+RS's N = 28672 and small-M shapes
(torchrun --nproc-per-node=N benchmarks/bench_gemm.py; every rank times its own GPU, the table is the max over
ranks). SM clock and board power are sampled during ours and cuBLAS (rank 0's GPU): long GEMMs on H200 can be
power-capped, which bounds every kernel alike.

  ours tuned     triton_dist.kernels.gemm.gemm, autotuned per shape (persistent, TMA, pipelined)
  each knob      the sweep's candidates, so the best levers on this GPU are visible
  cuBLAS         torch.matmul(a, w.T)
  in turn        (M >= 4096) ours and cuBLAS again, timed in turn over 5 rounds, each also as two GEMMs over the
                 halves of M (async-TP's per-shard GEMMs at W = 2 beat one cuBLAS GEMM over the whole M in run58:
                 is it the split?)
Device times replay a CUDA graph of back-to-back calls, enough for ~100 µs of work (``autotune.graph_calls``, as the
tuner times candidates), per call: one small call replayed alone times the host's cost of the replay, not the
kernel. The eager columns time Python calls.

FP8 (``--only fp8``; ``--only bf16`` skips it), one GPU's GEMMs M x N x K at FP8_SHAPES, e4m3 in, bf16 out:
  tensor / row   our scaled GEMM core (``gemm.scaled_gemm``, autotuned) against ``torch._scaled_mm`` (cuBLAS)
                 with per-tensor and rowwise scales, both with and without fast accumulation, timed in turn
  block          our 128-blockwise scales (DeepSeek-V3: 1x128 groups of A, 128x128 blocks of W) against cuBLAS's
                 per-tensor figure: cuBLAS has no block scales in this form; "block kmajor": A's scales K-major
                 ([M, K/128] of strides (1, M), torch._scaled_mm's layout), read as they lie, tuned on their own
  quantize       ``quantize_fp8`` (the dispatch senders' 1x128 quantisation) of 4096 x 7168 bf16 tokens: effective
                 TB/s = (2 B read + 1 B written + 4 B per 128 values) / time, against the same in torch
"""

import argparse
import os

import torch

import triton_dist as td
from triton_dist import autotune, hardware
from harness import IN_TURN, clocks_during, head_to_head, in_turn, record
from triton_dist.timing import graph_us_or_nan, time_us
from triton_dist.kernels import fp8
from triton_dist.kernels.gemm import gemm, gemm_candidates, gemm_config, scaled_gemm

SHAPES = [(8192, 8192, 8192), (8192, 28672, 8192), (8192, 8192, 28672), (2048, 8192, 8192), (512, 8192, 8192),
          (128, 8192, 8192)]


def _label(cfg):
    parts = [f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']}", f"s{cfg['num_stages']}", f"w{cfg['num_warps']}"]
    parts += [name.lower() for name in ("EPILOGUE_SUBTILE", "FLATTEN", "WARP_SPECIALIZE") if cfg.get(name)]
    if cfg.get("MAINLOOP") == "gluon":  # the Gluon mainloop (kernels/gemm_sm90.py), not the Triton core
        parts.append("gluon")
    if (cfg.get("SPLIT_K") or 1) > 1:
        parts.append(f"split-k {cfg['SPLIT_K']}")
    if cfg.get("A_SCALES_K_MAJOR"):  # row-major block scales of A copied K-major by the op first
        parts.append("A scales to k-major")
    if (cfg.get("TAIL_SPLIT") or 1) > 1:  # the last round's tiles in K shares (the Gluon mainloop's split tail)
        parts.append(f"tail-split {cfg['TAIL_SPLIT']}")
    return " ".join(parts)


def graph_calls(m, n, k, dtype):
    """Calls per timing graph of an M x N x K GEMM (as the autotuner's)."""
    return autotune.graph_calls(hardware.work_us(2 * m * n * k, (m * k + n * k + m * n) * dtype.itemsize, dtype))


# ``--only small``: small M (decode, TP shards), long K, odd sizes; bf16 and FP8 rowwise, device and eager time
SMALL_SHAPES = [(1, 4096, 4096), (16, 4096, 14336), (64, 8192, 8192), (96, 2560, 7168), (128, 4096, 8192),
                (128, 8192, 8192), (256, 1024, 8192), (333, 4000, 1000), (512, 8192, 8192), (1024, 1024, 16384)]
# issue 34's shapes (M >= 2048), then a long K, small M and an odd N / K
FP8_SHAPES = [(8192, 8192, 8192), (8192, 28672, 8192), (4096, 6144, 4096), (2048, 8192, 8192), (8192, 4096, 28672),
              (512, 4096, 8192), (128, 4096, 8192), (1536, 2560, 7168)]


def fp8_operands(m, n, k, mode, device):
    """e4m3 operands of a scaling mode and their scales (A: tensor / row / 1x128 groups; W: tensor / row / blocks)."""
    x = torch.randn(m, k, device=device)
    y = torch.randn(n, k, device=device) / 16
    a, sa = fp8.quantize(x, {"block": "group"}.get(mode, mode))
    w, sw = fp8.quantize(y, mode)
    return a, sa, w, sw


def cublas_fp8(a, w, sa, sw, mode, fast):
    """``torch._scaled_mm`` of the same product (B = w.T, column-major; B's rowwise scales are [1, N])."""
    sa_, sw_ = (sa, sw.t()) if mode == "row" else (sa.reshape(()), sw.reshape(()))
    return lambda: torch._scaled_mm(a, w.t(), sa_, sw_, out_dtype=torch.bfloat16, use_fast_accum=fast)


def fp8_rows(shapes=FP8_SHAPES):
    """The FP8 tables: GEMM core vs cuBLAS per shape (in turn), and the quantiser's throughput."""
    from triton_dist.kernels.gemm import _CONFIGS
    rows = []
    for m, n, k in shapes:
        calls, errs, chosen = {}, {}, {}
        for mode in ("tensor", "row", "block"):
            a, sa, w, sw = fp8_operands(m, n, k, mode, "cuda")
            for fast in (False, True):
                tag = f"{mode}{' fast' if fast else ''}"
                out = scaled_gemm(a, w, sa, sw, scaling=mode, fast_accum=fast)  # tunes once
                tuned = _CONFIGS.find((m, n, k, a.dtype, a.device, mode, fast, torch.bfloat16))
                chosen[f"ours {tag} config"] = _label(tuned) if tuned else "?"  # the path: Gluon or Triton core
                ours = (lambda a=a, w=w, sa=sa, sw=sw, mode=mode, fast=fast:
                        scaled_gemm(a, w, sa, sw, scaling=mode, fast_accum=fast))
                calls[f"ours {tag}"] = ours
                if mode != "block":
                    ref = cublas_fp8(a, w, sa, sw, mode, fast)
                    calls[f"cuBLAS {tag}"] = ref
                    errs[tag] = ((out.float() - ref().float()).abs().max() / ref().float().abs().max()).item()
        sa_k = sa.t().contiguous().t()  # (the block operands of the loop's last mode)
        out_k = scaled_gemm(a, w, sa_k, sw, scaling="block")  # tunes once: the layout has its own tuning
        out_r = scaled_gemm(a, w, sa, sw, scaling="block").float()
        err_k = ((out_k.float() - out_r).abs().max() / out_r.abs().max()).item()
        tuned = _CONFIGS.find((m, n, k, a.dtype, a.device, "block", False, torch.bfloat16, ("a_scales", "k-major")))
        chosen["ours block kmajor config"] = _label(tuned) if tuned else "?"
        calls["ours block kmajor"] = lambda a=a, w=w, sa_k=sa_k, sw=sw: scaled_gemm(a, w, sa_k, sw, scaling="block")
        turn = in_turn(calls)
        tflops = lambda t: 2 * m * n * k / t / 1e6  # noqa: E731
        row = {"M": m, "N": n, "K": k}
        for tag in ("tensor", "tensor fast", "row", "row fast"):
            row[f"ours {tag} us"], row[f"cuBLAS {tag} us"] = turn[f"ours {tag}"], turn[f"cuBLAS {tag}"]
            row[f"vs cuBLAS {tag}"] = turn[f"cuBLAS {tag}"] / turn[f"ours {tag}"]
        for tag in ("block", "block fast", "block kmajor"):  # against per-tensor: cuBLAS has no block scales here
            base = "tensor fast" if "fast" in tag else "tensor"
            row[f"ours {tag} us"] = turn[f"ours {tag}"]
            row[f"vs cuBLAS {base} (no block scales){', kmajor' if 'kmajor' in tag else ''}"] = \
                turn[f"cuBLAS {base}"] / turn[f"ours {tag}"]
        row["ours row TFLOP/s"] = tflops(turn["ours row"])
        if m <= 2048:  # host-bound sizes: the device time too
            reps = graph_calls(m, n, k, torch.float8_e4m3fn)
            row["ours row graph us"] = graph_us_or_nan(calls["ours row"], "ours row", warmup=2, calls=reps)
            row["cuBLAS row graph us"] = graph_us_or_nan(calls["cuBLAS row"], "cuBLAS row", warmup=2, calls=reps)
        row["max rel err vs cuBLAS"] = max(errs.values())
        row["block kmajor rel err vs rows"] = err_k
        row.update(chosen)
        rows.append(row)
    record("gemm_core_fp8", rows, notes=f"e4m3 a[M,K] @ w[N,K].T -> bf16 on one GPU per rank; eager calls {IN_TURN}; "
           "'fast': fast accumulation (torch use_fast_accum=True; ours: no fp32 promotion every K step); "
           "block: 1x128 / 128x128 scales, compared with cuBLAS per-tensor (cuBLAS has no block scales in this "
           "form); max over ranks")
    x = torch.randn(4096, 7168, device="cuda").to(torch.bfloat16)
    turn = in_turn({"quantize_fp8": lambda: fp8.quantize_fp8(x), "torch": lambda: fp8.quantize(x, "group")})
    nbytes = x.numel() * 3 + x.numel() // 128 * 4
    q, s = fp8.quantize_fp8(x)
    rq, rs = fp8.quantize(x, "group")
    record("fp8_quantize", [{"tokens": 4096, "hidden": 7168, "ours us": turn["quantize_fp8"],
                             "ours TB/s": nbytes / turn["quantize_fp8"] / 1e6, "torch us": turn["torch"],
                             "torch TB/s": nbytes / turn["torch"] / 1e6, "scales equal": torch.equal(s, rs),
                             "values equal": torch.equal(q.view(torch.uint8), rq.view(torch.uint8))}],
           notes=f"per token per 1x128 group, bf16 -> e4m3 + fp32 scales; effective bytes = 2 read + 1 written per "
           f"value + 4 per 128 values; {IN_TURN}")


def small_rows():
    """Small M, long K and odd shapes (SMALL_SHAPES): our tuned GEMM (the configuration it chose: split-K or not)
    against cuBLAS in bf16 and FP8 rowwise (``_scaled_mm``, where N and K are multiples of 16), device time from
    CUDA graphs and eager time, with every bf16 candidate's device time."""
    from triton_dist.kernels.gemm import _CONFIGS

    rows = []
    for m, n, k in SMALL_SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 16
        out = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)
        ref = (a.double() @ w.double().T)
        gemm(a, w, out=out)  # tunes once
        tuned = _CONFIGS.find((m, n, k, a.dtype, a.device))
        row = {"M": m, "N": n, "K": k, "ours config": _label(tuned) if tuned else "?",
               "max rel err": ((out.double() - ref).abs().max() / ref.abs().max()).item()}
        calls = {"ours": lambda: gemm(a, w, out=out), "cuBLAS": lambda: torch.matmul(a, w.T, out=out)}
        reps = {name: graph_calls(m, n, k, torch.bfloat16) for name in ("ours", "cuBLAS")}
        if not (n % 16 or k % 16):
            a8, sa = fp8.quantize(a.float(), "row")
            w8, sw = fp8.quantize(w.float(), "row")
            scaled_gemm(a8, w8, sa, sw)  # tunes once
            tuned8 = _CONFIGS.find((m, n, k, a8.dtype, a.device) + ("row", False, torch.bfloat16))
            row["ours fp8 row config"] = _label(tuned8) if tuned8 else "?"
            calls["ours fp8 row"] = lambda: scaled_gemm(a8, w8, sa, sw)
            calls["cuBLAS fp8 row"] = cublas_fp8(a8, w8, sa, sw, "row", False)
            reps.update({name: graph_calls(m, n, k, a8.dtype) for name in ("ours fp8 row", "cuBLAS fp8 row")})
        row["graph calls"] = reps["ours"]
        for name, fn in calls.items():
            row[f"{name} us"] = graph_us_or_nan(fn, name, warmup=2, calls=reps[name])
        eager = in_turn(calls)
        for name in calls:
            row[f"{name} eager us"] = eager[name]
        row["ours/cuBLAS"] = row["cuBLAS us"] / row["ours us"]
        row["ours/cuBLAS eager"] = eager["cuBLAS"] / eager["ours"]
        if "ours fp8 row" in calls:
            row["fp8 row ours/cuBLAS"] = row["cuBLAS fp8 row us"] / row["ours fp8 row us"]
            row["fp8 row ours/cuBLAS eager"] = eager["cuBLAS fp8 row"] / eager["ours fp8 row"]
        knobs = {_label(c): graph_us_or_nan(lambda: gemm(a, w, out=out, config=c), _label(c), iters=10, warmup=2,
                                            calls=reps["ours"])
                 for c in gemm_candidates(m, n, k, a.dtype, a.device, split_k=True)}
        row["all knobs"] = "; ".join(f"{k_}: {v:.1f}" for k_, v in knobs.items())
        rows.append(row)
    record("gemm_small", rows, notes="a[M,K] @ w[N,K].T -> bf16 on one GPU per rank; 'us': device time per call "
           "(replays of a CUDA graph of 'graph calls' calls, median of 20), "
           f"'eager us': Python calls {IN_TURN} (host cost included); ours: the tuned configuration named in "
           "'config' (split-K: each tile's K in shares summed by the last); fp8 row: e4m3 "
           "rowwise scales vs torch._scaled_mm (no fast accumulation); max over ranks")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("bf16", "fp8", "small"), help="run one part (default: bf16 and fp8)")
    parser.add_argument("--fp8-shapes", help="MxNxK,... instead of FP8_SHAPES")
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    td.init(backend="cuda")
    if args.only == "small":
        small_rows()
        td.finalize()
        return
    if args.only != "bf16":
        fp8_rows([tuple(map(int, s.split("x"))) for s in args.fp8_shapes.split(",")] if args.fp8_shapes
                 else FP8_SHAPES)
    if args.only == "fp8":
        td.finalize()
        return
    world = td.world_size()
    rows = []
    # the GEMM each rank runs in AG+GEMM, then GEMM+RS's per-rank GEMMs at N = 28672 and small M (K split)
    local_shapes = [(m_total, n_total // world, k) for m_total, n_total, k in SHAPES]
    local_shapes += [(8192, 28672, 8192 // world), (512, 8192, 8192 // world), (128, 8192, 8192 // world)]
    local_shapes += [(4096, 6144, 4096), (1536, 2560, 7168)]  # issue 34's mid shapes (bf16 >= 0.97x at M >= 1024)
    for m, n, k in sorted(local_shapes, key=lambda s: s[0] * s[1] * s[2]):  # small first: before the GPU heats up
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 16
        out = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)
        ref = (a @ w.T).float()
        gemm(a, w, out=out)  # tunes once
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        t_tuned = time_us(lambda: gemm(a, w, out=out))
        t_cublas = time_us(lambda: torch.matmul(a, w.T, out=out))
        reps = graph_calls(m, n, k, a.dtype)
        t_tuned_dev = graph_us_or_nan(lambda: gemm(a, w, out=out), "ours", warmup=2, calls=reps)
        t_cublas_dev = graph_us_or_nan(lambda: torch.matmul(a, w.T, out=out), "cuBLAS", warmup=2, calls=reps)
        knobs = {_label(c): graph_us_or_nan(lambda: gemm(a, w, out=out, config=c), _label(c), iters=10, warmup=2,
                                            calls=reps)
                 for c in gemm_candidates(m, n, k, a.dtype, a.device, split_k=True)}
        base = gemm_config(m, n, k, a.dtype, a.device, SPLIT_K=1)
        extras = []
        if m * n * k >= 8192 * 4096 * 8192:  # the large shapes: L2 order and tile shape, beyond the tuner's set
            extras = [dict(GROUP_M=16), dict(GROUP_M=4), dict(BLOCK_M=256, BLOCK_N=128), dict(FLATTEN=True, GROUP_M=16)]
        elif m <= 512:  # skinny tiles beyond the tuner's (gemm.skinny_configs is among the candidates above)
            extras = [dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_stages=4, num_warps=4, GROUP_M=2),
                      dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_stages=8, num_warps=4, GROUP_M=2),
                      dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, num_stages=4, num_warps=4, GROUP_M=8),
                      dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_stages=6, num_warps=4, GROUP_M=2)]
        for extra in extras:
            c = {**base, **extra}
            knobs[_label(c) + f" g{c['GROUP_M']}"] = graph_us_or_nan(lambda: gemm(a, w, out=out, config=c),
                                                                     _label(c), iters=10, warmup=2, calls=reps)
        clk_ours = clocks_during(lambda: gemm(a, w, out=out))
        clk_cublas = clocks_during(lambda: torch.matmul(a, w.T, out=out))
        turn = {}
        if m >= 4096:
            h = m // 2
            halves = [(a[:h], out[:h]), (a[h:], out[h:])]
            gemm(a[:h], w, out=out[:h])  # tunes the half shape once

            def ours_halves():
                for a_, o_ in halves:
                    gemm(a_, w, out=o_)

            def cublas_halves():
                for a_, o_ in halves:
                    torch.matmul(a_, w.T, out=o_)
            turn = head_to_head(lambda: gemm(a, w, out=out), {"cuBLAS": lambda: torch.matmul(a, w.T, out=out)},
                                {"ours halves": ours_halves, "cuBLAS halves": cublas_halves})
        best = min(knobs, key=knobs.get)
        tflops = lambda t: 2 * m * n * k / t / 1e6  # noqa: E731
        rows.append({"M": m, "N": n, "K": k, "ours us": t_tuned_dev, "ours TFLOP/s": tflops(t_tuned_dev),
                     "cuBLAS us": t_cublas_dev, "cuBLAS TFLOP/s": tflops(t_cublas_dev),
                     "ours/cuBLAS": t_cublas_dev / t_tuned_dev, "ours eager us": t_tuned, "cuBLAS eager us": t_cublas,
                     **turn,
                     "best knob": best, "best knob us": knobs[best],
                     "all knobs": "; ".join(f"{k_}: {v:.0f}" for k_, v in knobs.items()), "max rel err": err,
                     "ours MHz / W": f"{clk_ours['MHz']} / {clk_ours['W']:.0f}",
                     "cuBLAS MHz / W": f"{clk_cublas['MHz']} / {clk_cublas['W']:.0f}",
                     "throttle (ours; cuBLAS)": f"{clk_ours['throttle']}; {clk_cublas['throttle']}"})
    record("gemm_core", rows, notes="bf16 per-rank GEMM a[M,K] @ w[N,K].T; median of 20, max over ranks; "
           "ours / cuBLAS / knobs: device time per call (CUDA-graph replays of graph_calls calls); eager columns: "
           "Python calls (host cost included); "
           f"in turn: eager calls {IN_TURN}; MHz / W: median SM clock and mean board power over 40 back-to-back "
           "calls (rank 0's GPU)")
    td.finalize()


if __name__ == "__main__":
    main()
