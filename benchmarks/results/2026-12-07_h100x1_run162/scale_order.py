"""run162 variant probe (not shipped): where a block-scaled K step reads its scales. In the shipped kernel the
first piece's scales are read from the slot before its wgmmas; ptxas then places the scales' product (two
FMULs on three LDS results) between the step's first and second QGMMA (sm_90a SASS under triton 3.6: CPU-compiled,
``python scale_order.py``), so the second to fourth wgmma issue after the shared-memory loads return, which
compete with the wgmmas' own shared-memory reads. The per-tensor kernel issues its four back to back. Variants
(edits to a temporary copy of ``kernels/gemm_sm90.py`` at this commit, loaded by run161's ``tma_scales.py``):
  late  every piece reads its scales after its wgmmas are waited for (as pieces after the first already do)
  mid   the scales read after the wgmmas are issued, before they are waited for
Timed (``steps.sh o``): do_bench, rounds in turn (the order rotates each round), 128 s5 K-major block scales
against the shipped kernel and per-tensor cuBLAS at issue 34's four shapes; each result checked against fp64.
Where the 128 tile leaves a tail (8192^3) also row-major block scales through the op with and without
TAIL_SPLIT 8 (run161 timed that 11 % slower, but last in every round of a fixed order).

    python scale_order.py            # (CPU) compile both for sm_90a: registers, spills, where the LDS sit
    torchrun --nproc-per-node=1 scale_order.py   # (GPU) time them
"""

import functools
import os
import sys
import tempfile

if __name__ == "__main__" and "LOCAL_RANK" not in os.environ:  # compile for sm_90 here, not interpret
    os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402

from triton_dist.kernels import gemm_sm90  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", run) for run in ("2026-12-07_h100x1_run157", "2026-12-07_h100x1_run160",
                                                          "2026-12-07_h100x1_run161")]
import tma_scales  # noqa: E402  (run161's: a variant of the kernel loaded from an edited copy)

PIECE_STEP = """\
        part = _mma(a, b.slice(P * PN, PN), zero, BLOCK_SCALES and P > 0)
        if P == 0:
            scale = s_first
        else:
            scale = _piece_scale(sa, sw, P, PN, ROW0, zero.type.shape[0], gl.SliceLayout(1, zero.type.layout),
                                 BLOCK_SCALES)
        if P == PIECES - 1:
            if BLOCK_SCALES and P > 0:"""
EDITS = {
    "late": [(PIECE_STEP, """\
        part = _mma(a, b.slice(P * PN, PN), zero, BLOCK_SCALES and P > 0)
        scale = _piece_scale(sa, sw, P, PN, ROW0, zero.type.shape[0], gl.SliceLayout(1, zero.type.layout),
                             BLOCK_SCALES)
        if P == PIECES - 1:
            if BLOCK_SCALES:""")],
    "mid": [(PIECE_STEP, """\
        part = warpgroup_mma(a, b.slice(P * PN, PN).permute((1, 0)), zero, use_acc=BLOCK_SCALES and P > 0,
                             is_async=True)
        scale = _piece_scale(sa, sw, P, PN, ROW0, zero.type.shape[0], gl.SliceLayout(1, zero.type.layout),
                             BLOCK_SCALES)
        part = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
        if P == PIECES - 1:
            if BLOCK_SCALES:""")],
}


def variant(name):
    return tma_scales.variant(EDITS[name], f"sm90_scales_{name}")


def compile_report():
    """(CPU) each variant (and the shipped kernel) at 128 s5 with K-major block scales for sm_90a: registers,
    spills, serialized wgmmas, and the SASS between the K step's first QGMMA and its promotion."""
    import re
    import subprocess
    sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "scripts"))
    import ptx_digest
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas

    for name, mod in [("shipped", gemm_sm90)] + [(n, variant(n)) for n in EDITS]:
        consts = dict(stride_sa=1, BLOCK_SCALES=True, GROUP_M=8, STAGES=5, num_warps=4)
        s, c = ptx_digest.with_defaults(mod.gemm_fp8_sm90_kernel, ptx_digest.sm90_gemm_kmajor_signature(), consts)
        k = triton.compile(ptx_digest.ast_source(mod.gemm_fp8_sm90_kernel, s, c, {}),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": 168})
        log = ptx_digest.ptxas_log(k.asm["ptx"])
        with tempfile.TemporaryDirectory() as tmp:
            ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
            open(ptx, "w").write(k.asm["ptx"])
            ptxas = get_ptxas(90).path
            subprocess.run([ptxas, "-arch=sm_90a", ptx, "-o", cubin], check=True)
            sass = subprocess.run([os.path.join(os.path.dirname(ptxas), "nvdisasm"), "-c", cubin],
                                  capture_output=True, text=True).stdout.splitlines()
        first = next(i for i, ln in enumerate(sass) if "QGMMA" in ln)
        step = [re.sub(r"\s+", " ", ln.split("*/", 1)[-1]).strip(" ;") for ln in sass[first - 6:first + 30]]
        print(f"== {name}: {ptx_digest.registers(k.asm['ptx'])}, serialized {ptx_digest.wgmma_serialized(log)}")
        print("   " + "\n   ".join(s for s in step if s and not s.startswith(("UIADD3", "UMOV", "USHF", "USGXT"))))


def time_them():
    from bench_gemm import cublas_fp8
    from group_probe import launcher, medians
    from probe import BLOCK_SHAPES, block_case, start, time_block_contenders, write
    from triton_dist import hardware
    from triton_dist.kernels.gemm import gemm_config, scaled_gemm

    start()
    mods = {name: variant(name) for name in EDITS}
    rounds, rows = int(os.environ.get("ORDER_ROUNDS", 5)), []
    for m, n, k in BLOCK_SHAPES:
        (at, sat, wt, swt), (ab, sab, wb, swb), want, out = block_case(m, n, k)
        sab_k = sab.t().contiguous().t()  # [M, K/128] of strides (1, M): K-major
        cfg = {**gemm_sm90.default_config({"GROUP_M": 8}, torch.bfloat16, True), "num_stages": 5}
        calls = {"cuBLAS tensor": cublas_fp8(at, wt, sat, swt, "tensor", False),
                 "block kmajor s5": launcher(ab, wb, out, cfg, "block", sab_k, swb)}
        calls.update({f"block kmajor s5 {name}": launcher(ab, wb, out, cfg, "block", sab_k, swb, mod)
                      for name, mod in mods.items()})
        # run161's row-major block scales with the split tail, 11 % slower, were timed last in every round; the
        # same kernel loops compile alike with and without it (SASS), so time the pair again in rotated order
        op_cfg = {**gemm_sm90.default_config(gemm_config(m, n, k, ab.dtype, ab.device, SPLIT_K=1), torch.bfloat16,
                                             True), "num_stages": 5}
        if gemm_sm90.tail_split({**op_cfg, "TAIL_SPLIT": 8}, m, n, k, hardware.num_sms(ab.device.index)) > 1:
            for tail in (1, 8):
                calls[f"block rows s5 op tail{tail}"] = functools.partial(
                    scaled_gemm, ab, wb, sab, swb, scaling="block", out=out, config={**op_cfg, "TAIL_SPLIT": tail})
        names = list(calls)[1:]
        per_round = []
        for r in range(rounds):  # the bar first, then the contenders in an order that rotates each round
            turn = names[r % len(names):] + names[:r % len(names)]
            per_round.append(time_block_contenders((m, n, k), {"cuBLAS tensor": calls["cuBLAS tensor"],
                                                               **{x: calls[x] for x in turn}}, want, out, round=r))
        rows += medians((m, n, k), calls, per_round)
    write(rows, "scale_order.json")


if __name__ == "__main__":
    time_them() if "LOCAL_RANK" in os.environ else compile_report()
