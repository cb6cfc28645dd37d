"""run146's probe: an FP8 GEMM whose promotion adds overlap the next wgmmas, written in Gluon (Triton's own
lower-level language, shipped in triton >= 3.5 as ``triton.experimental.gluon``: explicit layouts, shared memory,
mbarriers, TMA and asynchronous ``warpgroup_mma``).

Why: without fast accumulation the core (plain Triton) promotes the tensor cores' partial sum into the fp32 sum after
every 128-wide K step, and Triton 3.6 waits for the step's wgmmas before those adds: the tensor cores idle while
they run (docs/design/fp8.md: 0.77-0.88x of ``_scaled_mm``). Here each K step's wgmmas go into a fresh partial
and the *previous* step's partial is added while they run (``warpgroup_mma_wait(num_outstanding=1)``): at most one
group in flight behind the one being added. A thread holds the sum and two partials: 3 x 64 fp32 registers at a
128x128 tile on 8 warps (two warpgroups of 64 rows), the largest tile whose three fit the register file.

Persistent: one program per SM walks its tiles; TMA loads run STAGES K steps ahead, across tile boundaries. Block
scales (128x128 for W, 1x128 for A) multiply each step's partial before its add, as DeepSeek-V3 / DeepGEMM do.

    python gluon_probe.py compile              # sm_90a PTX on any machine (triton 3.6): registers, spills
    python gluon_probe.py OUT_DIR              # on a Hopper GPU: error vs fp64 and device time vs _scaled_mm and
                                               # the core (scaled_gemm), per-tensor, rowwise and 128-blockwise
"""
import json
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from triton_dist.kernels.gemm_sm90 import _block_scale, _cta_barrier, _load_step, _tile_of, _tma_store  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-03_h200x1_run102"))
from fp8_probe import device_us  # noqa: E402  (CUDA-graph replays, median of 20)


@gluon.jit
def fp8_gemm_kernel(a_desc, b_desc, c_desc, scale_a, scale_w, M, N, K, stride_sa, stride_sw,
                    BLOCK_SCALES: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                    num_warps: gl.constexpr):
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BN, 32])
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [BM, BN], c_desc.layout)

    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    tiles_m = gl.cdiv(M, BM)
    tiles_n = gl.cdiv(N, BN)
    k_tiles = gl.cdiv(K, BK)
    my_tiles = gl.cdiv(tiles_m * tiles_n - pid, nprog)
    total = my_tiles * k_tiles
    for s in gl.static_range(STAGES):
        _load_step(a_desc, b_desc, a_bufs, b_bufs, ready, s, total, pid, nprog, k_tiles, tiles_m, tiles_n,
                   GROUP_M, STAGES)
    zero = gl.zeros([BM, BN], gl.float32, layout=mma)
    step = 0
    for t in range(my_tiles):
        pid_m, pid_n = _tile_of(pid + t * nprog, tiles_m, tiles_n, GROUP_M)
        rows = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
        acc = zero
        slot = step % STAGES
        mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
        part = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), zero, use_acc=False,
                             is_async=True)
        s_part = _block_scale(scale_a, scale_w, rows, M, pid_n, 0, stride_sa, stride_sw, BLOCK_SCALES)
        for ki in range(1, k_tiles):
            nxt = (step + 1) % STAGES
            mbarrier.wait(ready.index(nxt), ((step + 1) // STAGES) & 1)
            s_next = _block_scale(scale_a, scale_w, rows, M, pid_n, ki, stride_sa, stride_sw, BLOCK_SCALES)
            part_next = warpgroup_mma(a_bufs.index(nxt), b_bufs.index(nxt).permute((1, 0)), zero, use_acc=False,
                                      is_async=True)
            part = warpgroup_mma_wait(num_outstanding=1, deps=(part, ))
            # both warpgroups are past step `step`'s wgmmas before its slot is loaded again
            _cta_barrier()
            _load_step(a_desc, b_desc, a_bufs, b_bufs, ready, step + STAGES, total, pid, nprog, k_tiles,
                       tiles_m, tiles_n, GROUP_M, STAGES)
            if BLOCK_SCALES:
                acc += part * s_part[:, None]
            else:
                acc += part
            part = part_next
            s_part = s_next
            step += 1
        part = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
        _cta_barrier()
        _load_step(a_desc, b_desc, a_bufs, b_bufs, ready, step + STAGES, total, pid, nprog, k_tiles, tiles_m,
                   tiles_n, GROUP_M, STAGES)
        step += 1
        if BLOCK_SCALES:
            acc += part * s_part[:, None]
        else:
            cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
            s_rows = gl.load(scale_a + rows * stride_sa, mask=rows < M, other=0.0)
            s_cols = gl.load(scale_w + cols * stride_sw, mask=cols < N, other=0.0)
            acc = (acc + part) * s_rows[:, None] * s_cols[None, :]
        tma.store_wait(pendings=0)  # the previous tile's store has left c_smem
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        _tma_store(c_desc, [pid_m * BM, pid_n * BN], c_smem)
    tma.store_wait(pendings=0)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))


GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}


def gluon_fp8_gemm(a, w, scale_a, scale_w, out_dtype=torch.bfloat16, block_scales=False, stages=5, group_m=8,
                   block=(128, 128, 128), num_warps=8, programs_per_sm=1, flat=False):
    """The probe's nested kernel, or (``flat``) the library's ``gemm_fp8_sm90_kernel`` at any tile of one or two
    warpgroups (``programs_per_sm``: resident programs an SM, e.g. two 64-row programs of one warpgroup, one's
    epilogue beside the other's wgmmas)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton_dist.kernels import gemm_sm90
    (m, k), n = a.shape, w.shape[0]
    bm, bn, bk = block
    c = torch.empty(m, n, device=a.device, dtype=out_dtype)
    sa = scale_a.reshape(scale_a.shape[0], -1) if scale_a.numel() > 1 else scale_a.reshape(1, 1)
    sw = scale_w.reshape(scale_w.shape[0], -1) if scale_w.numel() > 1 else scale_w.reshape(1, 1)
    num_sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    grid = (min(num_sms * programs_per_sm, triton.cdiv(m, bm) * triton.cdiv(n, bn)),)
    if flat:
        mode = "block" if block_scales else ("tensor" if sa.numel() == 1 else "row")
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, num_stages=stages, num_warps=num_warps)
        return gemm_sm90.launch(a, w, c, cfg, mode, sa, sw, grid)
    fp8_layout = gl.NVMMASharedLayout.get_default_for([bm, bk], gl.float8e4nv)
    da = TensorDescriptor(a, [m, k], [k, 1], [bm, bk], fp8_layout)
    db = TensorDescriptor(w, [n, k], [k, 1], [bn, bk], gl.NVMMASharedLayout.get_default_for([bn, bk], gl.float8e4nv))
    dc = TensorDescriptor(c, [m, n], [n, 1], [bm, bn],
                          gl.NVMMASharedLayout.get_default_for([bm, bn], GL_DTYPES[out_dtype]))
    stride_sa = sa.stride(0) if sa.shape[0] > 1 else 0
    stride_sw = sw.stride(0) if sw.shape[0] > 1 else 0
    fp8_gemm_kernel[grid](da, db, dc, sa, sw, m, n, k, stride_sa, stride_sw, block_scales, group_m, stages,
                          num_warps=num_warps)
    return c


# ----------------------------------------------------------------------------------------------- sm_90a compile
def compile_check(stages=5):
    """The nested kernel for sm_90a (scripts/ptx_digest.py's signature of the library kernel: the same arguments)."""
    import re

    from triton.backends.compiler import GPUTarget
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "scripts"))
    import ptx_digest

    for block_scales in (False, True):
        consts = {"BLOCK_SCALES": block_scales, "GROUP_M": 8, "STAGES": stages, "num_warps": 8}
        src = ptx_digest.ast_source(fp8_gemm_kernel, ptx_digest.sm90_gemm_signature(), consts)
        out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
        ptx = out.asm["ptx"]
        print(f"block_scales={block_scales} stages={stages}: shared {out.metadata.shared} B,",
              ptx_digest.registers(ptx), "wgmma.wait_group:", re.findall(r"wgmma.wait_group.sync.aligned (\d+)", ptx),
              flush=True)


# ----------------------------------------------------------------------------------------------- on the GPU
SHAPES = [(8192, 8192, 8192), (4096, 6144, 4096), (2048, 8192, 8192), (8192, 28672, 8192), (512, 4096, 8192),
          (1000, 3000, 1000)]


def rel_err(c, exact):
    d = c.double() - exact
    return (d.norm() / exact.norm()).item()


VARIANTS = {  # label: gluon_fp8_gemm keywords ("flat": the library kernel)
    "nested 128 s5": dict(stages=5),
    "flat 128 s4": dict(flat=True, stages=4),
    "flat 128 s5": dict(flat=True, stages=5),
    "flat 128 s6": dict(flat=True, stages=6),
    "flat 64x128 w4 x2 s4": dict(flat=True, stages=4, block=(64, 128, 128), num_warps=4, programs_per_sm=2),
}
CHECKED = ("nested 128 s5", "flat 128 s5", "flat 64x128 w4 x2 s4")  # error vs fp64 (an fp32 result: <= 5 stages)


def on_gpu(out_dir):
    from triton_dist.kernels import fp8 as fp8_mod
    from triton_dist.kernels import gemm_sm90
    from triton_dist.kernels.gemm import scaled_gemm
    gemm_sm90.TUNER_OFFERS = False  # "core": the Triton core's tuned configuration
    rows = []
    for m, n, k in SHAPES:
        torch.manual_seed(0)
        x, y = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda") / 4
        for scaling in ("tensor", "row", "block"):
            row = {"M": m, "N": n, "K": k, "scaling": scaling}
            a_mode = "group" if scaling == "block" else scaling
            (a, sa), (w, sw) = fp8_mod.quantize(x, a_mode), fp8_mod.quantize(y, scaling)
            exact = (a.double() * fp8_mod.expand(sa, a_mode, m, k)) @ (w.double() * fp8_mod.expand(sw, scaling, n, k)).T
            blocks = scaling == "block"
            if blocks:  # block scales: per-tensor cuBLAS as the bar (issue 34)
                one = torch.ones((), device="cuda")
                a1, w1 = x.to(torch.float8_e4m3fn), y.to(torch.float8_e4m3fn)
                row["cuBLAS us"] = device_us(lambda: torch._scaled_mm(a1, w1.t(), one, one, out_dtype=torch.bfloat16))
            else:
                sw_ = sw.reshape(1, -1) if scaling == "row" else sw
                row["cuBLAS us"] = device_us(lambda: torch._scaled_mm(a, w.t(), sa, sw_, out_dtype=torch.bfloat16))
            row["err core"] = rel_err(scaled_gemm(a, w, sa, sw, scaling=scaling, out_dtype=torch.float32), exact)
            row["core us"] = device_us(lambda: scaled_gemm(a, w, sa, sw, scaling=scaling))
            for label, kw in VARIANTS.items():
                try:
                    if label in CHECKED:
                        row[f"err {label}"] = rel_err(gluon_fp8_gemm(a, w, sa, sw, torch.float32, blocks, **kw), exact)
                    row[f"{label} us"] = device_us(lambda: gluon_fp8_gemm(a, w, sa, sw, block_scales=blocks, **kw))
                except Exception as exc:
                    print(f"{m}x{n}x{k} {scaling} {label}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            bar = row["cuBLAS us"]
            cells = [f"{name} {row[f'{name} us']:.1f} ({bar / row[f'{name} us']:.2f}x"
                     + (f", err {row[f'err {name}']:.1e})" if f"err {name}" in row else ")")
                     for name in ["core"] + list(VARIANTS) if f"{name} us" in row]
            print(f"{m}x{n}x{k} {scaling:6s} cuBLAS {bar:.1f} us | " + " | ".join(cells), flush=True)
            rows.append(row)
            json.dump(rows, open(f"{out_dir}/gluon_probe.json", "w"), indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        for stages in (5, 6):
            compile_check(stages)
    else:
        on_gpu(sys.argv[1])
