"""run161 variant (probe only, not shipped): the Gluon FP8 mainloop with block scales loaded by TMA instead of
cp.async. A ring slot is ready when its bytes have landed; with block scales shipped it also waits for the
producer's cp.async of the step's scales (A's 128 row scales, W's two block scales), whose completion the slot's
barrier counts: a step then waits on the later of two different loads (run160: 5 slots beat 4 by 1-7 % with
block scales only). Here the scales ride the same TMA transactions as the tiles (one expect-tx):
  A's scales K-major, viewed as [K/128, M] (rows 16-byte aligned: M % 4 == 0), a [1, 128] box per step;
  W's scales transposed once to [K/128, N/128] (N % 512 == 0), a [1, 4] box per step (16 bytes, the least a
  box may be; the tile's one or two blocks among them, blocks past N read as zeros).
The kernel is ``kernels/gemm_sm90.py``'s at this commit with four edits (``EDITS``), loaded from a temporary
copy; the scale descriptors are passed where the shipped kernel takes the scales' pointers (block scales only).

    python tma_scales.py    # (CPU) compile it for sm_90: shared memory, registers, spills
"""

import importlib.util
import os
import sys
import tempfile

if __name__ == "__main__":  # compiling for sm_90 here, not interpreting (before triton_dist is imported)
    os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402

from triton_dist.kernels import gemm_sm90  # noqa: E402

EDITS = [
    ("""\
                if BLOCK_SCALES:  # before the expect (the phase's last arrival): the copies' arrival counts in it
                    _copy_to_shared(sa_bufs.index(slot), scale_a + rows * stride_sa + kk * stride_sak, mask=rows < M)
                    _copy_to_shared(sw_bufs.index(slot), scale_w + pieces * stride_sw + kk, mask=pieces < n_blocks)
                    async_copy.mbarrier_arrive(bar)
                mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
""", """                mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes
                                + scale_a.block_type.nbytes + scale_w.block_type.nbytes)
                _tma_load(scale_a, [kk, pid_m * BM], bar, sa_bufs.index(slot))
                _tma_load(scale_w, [kk, pid_n * (BN // SCALE_BLOCK)], bar, sw_bufs.index(slot))
"""),
    ("""        sa_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BM if BLOCK_SCALES else 2], plain)
        sw_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 2], plain)
""", """        sa_tma = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BM], scale_a.layout)
        sw_tma = gl.allocate_shared_memory(gl.float32, [STAGES, 1, 4], scale_w.layout)
        sa_bufs = sa_tma._reinterpret(gl.float32, [STAGES, BM], plain)
        sw_bufs = sw_tma._reinterpret(gl.float32, [STAGES, 4], plain)
"""),
    ("""            (_producer, (a_desc, b_desc, a_bufs, b_bufs, sa_bufs, sw_bufs, ready, empty,""",
     """            (_producer, (a_desc, b_desc, a_bufs, b_bufs, sa_tma, sw_tma, ready, empty,"""),
    ("""                sw = sw_bufs.index(slot)
""", """                sw = sw_bufs.index(slot).slice(0, 2)
"""),
]


def variant(edits=EDITS, name="sm90_tma_scales"):
    """``kernels/gemm_sm90.py`` with ``edits`` ((old, new) pairs, each old found once), loaded as module ``name``
    from a temporary copy (run162's ``scale_order.py`` loads its variants so too)."""
    src = open(gemm_sm90.__file__).read()
    for old, new in edits:
        assert src.count(old) == 1, old[:80]
        src = src.replace(old, new)
    src = src.replace("from .. import hardware", "from triton_dist import hardware").replace(
        "from . import fp8", "from triton_dist.kernels import fp8").replace(
        "from .launcher import", "from triton_dist.kernels.launcher import")
    path = os.path.join(tempfile.mkdtemp(), f"{name}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def scale_layout():
    return gemm_sm90.gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def launcher(mod, a, w, c, cfg, scale_a_kmajor, scale_w):
    """A bound launch of the variant on block scales: ``scale_a_kmajor`` [M, K/128] of strides (1, M), ``scale_w``
    [N/128, K/128] (transposed here, once)."""
    from triton_dist import hardware
    (m, k), n = a.shape, w.shape[0]
    if m % 4 or n % 512 or scale_a_kmajor.stride(0) != 1:
        raise ValueError(f"the variant needs M % 4 == 0, N % 512 == 0 and K-major A scales: {m}x{n}x{k}")
    args = list(mod.Arguments(a, w, c, cfg, "block", scale_a_kmajor, scale_w)(a, w, c, scale_a_kmajor, scale_w))
    sw_t = scale_w.t().contiguous()
    args[3] = mod.GluonDescriptor.from_tensor(scale_a_kmajor.t(), [1, 128], scale_layout())
    args[4] = mod.GluonDescriptor.from_tensor(sw_t, [1, 4], scale_layout())
    tiles = -(-m // 128) * -(-n // cfg["BLOCK_N"])
    grid = (min(tiles, hardware.num_sms(a.device.index)),)
    meta = mod.meta(cfg, "block")
    keep = (sw_t,)  # (the descriptor's tensor lives as long as the launch)
    return lambda: mod._LAUNCH(grid, *args, **meta) or keep  # (bound after the first call, as the shipped one)


if __name__ == "__main__":  # compile for sm_90 on any machine
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "scripts"))
    import ptx_digest
    import triton
    from triton.backends.compiler import GPUTarget

    mod = variant()
    kernel = mod.gemm_fp8_sm90_kernel
    desc = f"tensordesc<fp32[1, 4],{scale_layout()!r}>"
    for stages, subtile in ((5, False), (6, True)):
        sig = dict(ptx_digest.sm90_gemm_kmajor_signature(), scale_a=f"tensordesc<fp32[1, 128],{scale_layout()!r}>",
                   scale_w=desc)
        if subtile:
            sig.update(c_desc=ptx_digest.gluon_descriptor(torch.bfloat16, (128, 64)), EPILOGUE_SUBTILE="constexpr")
        consts = dict(stride_sa=1, BLOCK_SCALES=True, GROUP_M=8, STAGES=stages, num_warps=4, EPILOGUE_SUBTILE=subtile)
        s, c = ptx_digest.with_defaults(kernel, sig, consts)
        src = ptx_digest.ast_source(kernel, s, c, {})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": 168})
        log = ptx_digest.ptxas_log(k.asm["ptx"])
        print(f"s{stages}{' subtile' if subtile else ''}: shared {k.metadata.shared} B, serialized "
              f"{ptx_digest.wgmma_serialized(log)}, {[ln.strip() for ln in log.splitlines() if 'spill' in ln][:1]}")
