"""Compile every kernel of the zoo for sm_90 (no GPU needed) and print one digest of its PTX per kernel.

    python scripts/ptx_digest.py              # table: kernel variant, digest, PTX size
    python scripts/ptx_digest.py --json out   # also write the digests to a file
    python scripts/ptx_digest.py --spills     # also each variant's registers and spilled bytes (ptxas -v)

Exit status 1 when a variant does not compile or a kernel of the package (``*_kernel``) has no entry: CI runs it
under the GPU image's Triton (3.6) as well as the newest (``.ci/run``).

How a restructuring is verified without GPUs: the digests before and after must be equal (or each difference
explained). The digest covers the PTX without its debug information (``.loc``/``.file`` lines, ``//`` comments,
debug sections and the ``$L__tmp`` labels only they refer to), so moving code between files or functions changes
nothing unless the instructions change.
Each entry is a kernel at the configuration its op launches by default on an H200 (bf16, 2 ranks; the fp8/ entries
and those named fp8: FP8 operands). Parameters an entry leaves out are compiled at their defaults.
"""

import argparse
import hashlib
import json
import os
import re
import sys

os.environ["TRITON_INTERPRET"] = "0"  # before triton_dist is imported: compile, do not interpret
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


def _const(*names):
    return {n: "constexpr" for n in names}


def gluon_descriptor(dtype, block):
    """The signature of a Gluon TMA descriptor of torch ``dtype`` with ``block`` (and the shared-memory layout the
    op gives it: ``gemm_sm90``)."""
    import torch

    from triton_dist.kernels import gemm_sm90
    names = {torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5", torch.bfloat16: "bf16", torch.float32: "fp32"}
    return f"tensordesc<{names[dtype]}[{', '.join(map(str, block))}],{gemm_sm90._smem_layout(tuple(block), dtype)!r}>"


def sm90_gemm_signature(block_n=128, fp8=None):
    """``gemm_fp8_sm90_kernel``'s signature: ``fp8`` operands (None: e4m3), a bf16 result, 128 x ``block_n`` x 128
    tiles."""
    import torch
    fp8 = fp8 or torch.float8_e4m3fn
    return dict(a_desc=gluon_descriptor(fp8, (128, 128)), b_desc=gluon_descriptor(fp8, (block_n, 128)),
                c_desc=gluon_descriptor(torch.bfloat16, (128, 128)), scale_a="*fp32", scale_w="*fp32", M="i32",
                N="i32", K="i32", stride_sa="i32", stride_sw="i32",
                **_const("stride_sak", "BLOCK_SCALES", "GROUP_M", "STAGES", "num_warps"))


def sm90_gemm_wide_signature():
    """``gemm_fp8_sm90_kernel``'s signature at BLOCK_N 256 (two 128-column pieces per K step)."""
    return sm90_gemm_signature(256)


def sm90_gemm_kmajor_signature():
    """``gemm_fp8_sm90_kernel``'s signature with A's block scales K-major (row stride 1)."""
    return dict(sm90_gemm_signature(), stride_sa="constexpr", stride_sak="i32")


def sm90_gemm_subtile_signature():
    """``gemm_fp8_sm90_kernel``'s signature with A's block scales K-major and C's buffer 128 x 64
    (EPILOGUE_SUBTILE: each 128-column piece stored in two halves)."""
    import torch
    return dict(sm90_gemm_kmajor_signature(), c_desc=gluon_descriptor(torch.bfloat16, (128, 64)),
                EPILOGUE_SUBTILE="constexpr")


def sm90_gemm_tail_signature(signature=None):
    """``gemm_fp8_sm90_kernel``'s signature (``signature``: another of its signatures) with its last round's tiles
    split along K (SPLIT_TAIL: C's pointer and row stride, the partials, the counters, the split)."""
    return dict(signature or sm90_gemm_signature(), c="*bf16", stride_cm="i32", partials="*fp32",
                tile_counts="*i32", tail_split="i32", SPLIT_TAIL="constexpr")


def sm90_gemm_tail_kmajor_signature():
    return sm90_gemm_tail_signature(sm90_gemm_kmajor_signature())


def sm90_gemm_tail_wide_signature():
    return sm90_gemm_tail_signature(sm90_gemm_wide_signature())


def sm90_gemm_16bit_signature(block_n=128):
    """``gemm_fp8_sm90_kernel``'s signature with bf16 operands (64-wide K steps) and no scales."""
    import torch
    return dict(sm90_gemm_signature(block_n), a_desc=gluon_descriptor(torch.bfloat16, (128, 64)),
                b_desc=gluon_descriptor(torch.bfloat16, (block_n, 64)), **_const("scale_a", "scale_w"))


def sm90_gemm_16bit_wide_tail_signature():
    return sm90_gemm_tail_signature(sm90_gemm_16bit_signature(256))


def sm90_gemm_e5m2_signature():
    """``gemm_fp8_sm90_kernel``'s signature with e5m2 operands."""
    import torch
    return sm90_gemm_signature(128, torch.float8_e5m2)

GEMM_SIG = dict(a="tensordesc<bf16[128,64]>", b="tensordesc<bf16[256,64]>", c="tensordesc<bf16[1,128,256]>",
                num_segments="i32", seg_rows="i32", N="i32", K="i32", stride_am="i32", stride_bn="i32",
                stride_cs="i32", stride_cm="i32", first_segment="i32", segment_step="i32",
                **_const("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "USE_TMA", "EPILOGUE_SUBTILE", "FLATTEN",
                         "WARP_SPECIALIZE", "DOT_PRECISION", "SILU_GATE"))
WGRAD_SIG = dict(dw="tensordesc<bf16[1,128,64]>", dw_ptr="*bf16", offsets="*i32", counts="*i32", E="i32",
                 rows="i32", N="i32", K="i32", stride_dym="i32", stride_xm="i32", stride_we="i32", stride_wn="i32",
                 scale_dy="*fp32", scale_x="*fp32", stride_sdy="i32", stride_sx="i32",
                 **_const("BLOCK_M", "BLOCK_N", "BLOCK_K", "HAS_COUNTS", "USE_TMA", "DOT_PRECISION"))
WGRAD_FP8 = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, HAS_COUNTS=True, USE_TMA=True, DOT_PRECISION="tf32")
GEMM_BIG = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, USE_TMA=True, EPILOGUE_SUBTILE=False,
                FLATTEN=False, WARP_SPECIALIZE=False, DOT_PRECISION="tf32", SILU_GATE=False)
AG_SIG = dict(a_local="tensordesc<bf16[128,64]>", a_full="tensordesc<bf16[128,64]>", b="tensordesc<bf16[256,64]>",
              c="tensordesc<bf16[1,128,256]>", arrived="*i32", state="*i32", ctx="*i64", m_shard="i32", N="i32",
              K="i32", stride_al="i32", stride_af="i32", stride_bn="i32", stride_cs="i32", stride_cm="i32",
              chunk_rows="i32",
              **_const("N_CHUNKS", "BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "USE_TMA", "EPILOGUE_SUBTILE",
                       "FLATTEN", "WARP_SPECIALIZE", "FENCE_ASYNC_PROXY", "DOT_PRECISION", "SILU_GATE"))
AG_DEFAULT = dict(N_CHUNKS=1, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, USE_TMA=True, EPILOGUE_SUBTILE=False,
                  FLATTEN=False, WARP_SPECIALIZE=False, FENCE_ASYNC_PROXY=True, DOT_PRECISION="tf32",
                  SILU_GATE=False)
RS_SIG = dict(a="tensordesc<bf16[128,64]>", w="tensordesc<bf16[256,64]>", out="tensordesc<bf16[1,128,256]>",
              recv="*bf16", recv_peer="*bf16", arrived="*i32", ready="*i32", state="*i32", M="i32", N="i32",
              K="i32", stride_am="i32", stride_wn="i32", own_rows="i32", ctx="*i64",
              **_const("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "USE_TMA", "EPILOGUE_SUBTILE", "DEFER_SIGNAL",
                       "DOT_PRECISION", "SLOTS_BLOCK", "REMOTE_TMA"))
RS_DEFAULT = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, USE_TMA=True, EPILOGUE_SUBTILE=False,
                  DEFER_SIGNAL=True, DOT_PRECISION="tf32", SLOTS_BLOCK=1, REMOTE_TMA=False)
LAYOUT_SIG = dict(topk_idx="*i32", chunk_counts="*i32", chunk_prefix="*i32", counted="*i32", all_counts="*i32",
                  counts_ready="*i32", state="*i32", T="i32", E="i32", n_chunks="i32", ctx="*i64", timeline="*i64",
                  **_const("K", "EL", "TB", "K_PAD", "EL_PAD", "W_PAD", "CG", "QB", "TIMELINE", "PDL"))
DISPATCH_SIG = dict(
    x="*bf16", topk_idx="*i32", topk_weights="*fp32", T="i32", H="i32", E="i32", align="i32", max_tokens="i32",
    max_rows="i32", n_chunks="i32", h_parts="i32", tail="i32", tail_parts="i32", n_push="i32", recv_x="*bf16",
    recv_slots="*i32", recv_w="*fp32", recv_span="*i32", all_counts="*i32", counts_ready="*i32", arrived="*i32",
    recv_expert_ids="*i32", recv_weights="*fp32", expert_counts="*i32", expert_offsets="*i32", token_pos="*i32",
    chunk_prefix="*i32", claims="*i32", state="*i32", ctx="*i64", timeline="*i64",
    **_const("K", "EL", "BT", "BH", "K_PAD", "EL_PAD", "W_PAD", "RB", "MAXC", "FUSED_LAYOUT", "TB", "CG",
             "SENDERS_HELP", "TIMELINE", "PDL", "DEFER_SIGNAL", "EVICT"))
COMBINE_SIG = dict(
    expert_out="*bf16", y="*bf16", T="i32", H="i32", max_tokens="i32", n_chunks="i32", h_parts="i32", tail="i32",
    tail_parts="i32", n_push="i32", recv_slots="*i32", recv_w="*fp32", recv_span="*i32", token_pos="*i32",
    partials="*bf16", combined="*i32", claims="*i32", state="*i32", ctx="*i64", timeline="*i64",
    **_const("K", "BT", "BH", "K_PAD", "W_PAD", "MAXC", "SENDERS_HELP", "TIMELINE", "DEFER_SIGNAL", "EVICT"))
SPLIT_SIG = dict(q="*bf16", k_cache="*bf16", v_cache="*bf16", kv_lens="*i32", block_table="*i32",
                 part_o="*fp32", part_lse="*fp32", split_arrivals="*i32", dst_o="*fp32", dst_lse="*fp32",
                 out="*bf16", flags="*i32", state="*i32", ctx="*i64", stride_qb="i32", stride_qh="i32",
                 stride_kb="i64", stride_kn="i32", stride_kh="i32", stride_vb="i64", stride_vn="i32",
                 stride_vh="i32", stride_table_b="i32", stride_ob="i32", stride_oh="i32", B="i32", HQ="i32",
                 HKV="i32", s_max="i32", num_pages="i32", scale_log2="fp32",
                 **_const("GROUP", "GROUP_PAD", "HEAD_DIM", "BLOCK_N", "GROUP_P2", "N_SPLITS", "SPLIT_CHUNK",
                          "PAGE_SIZE", "MODE", "WORLD", "WORLD_PAD", "RANK_CHUNK", "FP32_DOT", "PDL",
                          "CHECK_INDICES"))
SPLIT_DEFAULT = dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=128, BLOCK_N=128, GROUP_P2=4, N_SPLITS=16, SPLIT_CHUNK=16,
                     PAGE_SIZE=0, MODE=2, WORLD=2, WORLD_PAD=2, RANK_CHUNK=2, FP32_DOT=False, PDL=False,
                     CHECK_INDICES=2)
MERGE_SIG = dict(recv_o="*fp32", recv_lse="*fp32", flags="*i32", out="*bf16", state="*i32", ctx="*i64",
                 stride_ob="i32", stride_oh="i32", B="i32", HQ="i32", HKV="i32",
                 **_const("GROUP", "GROUP_P2", "HEAD_DIM", "WORLD", "WORLD_PAD", "RANK_CHUNK", "PDL"))
AR_SIG = dict(x="*bf16", out="*bf16", residual="*bf16", weight="*bf16", new_residual="*bf16", scales="*fp32",
              staging="*bf16", reduced="*bf16", arrived="*i32", published="*i32", done="*i32", state="*i32",
              rows="i32", row_len="i32", numel="i32", stage_elems="i32", slice_elems="i32", eps="fp32", ctx="*i64",
              **_const("BLOCK", "WORLD", "WORLD_P2", "TWO_SHOT", "ZERO_COPY", "EPILOGUE"))
AR_ONE_SHOT = dict(BLOCK=2048, WORLD=2, WORLD_P2=2, TWO_SHOT=False, ZERO_COPY=False, EPILOGUE=0)
AR_ALIGNED = ("x", "out", "residual", "weight", "new_residual", "staging", "reduced", "row_len", "numel",
              "stage_elems", "slice_elems")
GEMM_AR_SIG = dict(a="tensordesc<bf16[64,128]>", w="tensordesc<bf16[64,128]>", out="*bf16", partials="*bf16",
                   flags="*i32", state="*i32", M="i32", N="i32", K="i32", stride_am="i32", stride_wn="i32",
                   partial_elems="i32", ctx="*i64",
                   **_const("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "USE_TMA", "DOT_PRECISION", "WORLD",
                            "WORLD_P2"))
GROUPED_SIG = dict(x="tensordesc<bf16[128,64]>", w="tensordesc<bf16[128,64]>", out_desc="tensordesc<bf16[1,128,128]>",
                   out="*bf16", offsets="*i32", counts="*i32", E="i32", rows="i32", N="i32", K="i32", w_rows="i32",
                   stride_xm="i32", stride_we="i32", stride_wn="i32", stride_om="i32",
                   **_const("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "E_PAD", "HAS_COUNTS", "USE_TMA",
                            "EPILOGUE_SUBTILE", "FLATTEN", "WARP_SPECIALIZE", "DOT_PRECISION", "SILU_GATE"))
GROUPED_DEFAULT = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, E_PAD=32, HAS_COUNTS=False, USE_TMA=True,
                       EPILOGUE_SUBTILE=False, FLATTEN=False, WARP_SPECIALIZE=False, DOT_PRECISION="tf32",
                       SILU_GATE=False)
GROUPED_ALIGNED = ("K", "N", "stride_xm", "stride_wn", "stride_om")
DISPATCH_T4096 = dict(K=8, EL=32, BT=16, BH=512, K_PAD=8, EL_PAD=32, W_PAD=2, RB=128, MAXC=1024, FUSED_LAYOUT=False,
                      TB=2, CG=4, SENDERS_HELP=True, TIMELINE=False, PDL=True, DEFER_SIGNAL=True, EVICT="evict_first")
DISPATCH_T128 = dict(DISPATCH_T4096, BT=2, BH=1024, EVICT="")
COMBINE_T4096 = dict(K=8, BT=16, BH=512, K_PAD=8, W_PAD=2, MAXC=1024, SENDERS_HELP=True, TIMELINE=False,
                     DEFER_SIGNAL=True, EVICT="evict_first")
COMBINE_T128 = dict(COMBINE_T4096, BT=2, BH=1024, EVICT="")

# FP8 variants (kernels/fp8.py): e4m3 operands with 128-wide K steps, fp32 scales, bf16 results
FP8_SCALES = dict(scale_a="*fp32", scale_w="*fp32", stride_sa="i32", stride_sw="i32", SCALES="constexpr",
                  MAX_IMPRECISE_ACC="constexpr")
FP8_GEMM_SIG = dict(GEMM_SIG, a="tensordesc<fp8e4nv[128,128]>", b="tensordesc<fp8e4nv[256,128]>", **FP8_SCALES)
FP8_ROWS = dict(BLOCK_K=128, SCALES="rows", MAX_IMPRECISE_ACC=128)  # per-tensor / rowwise, promoted every K step
FP8_BLOCKS = dict(BLOCK_K=128, SCALES="blocks", MAX_IMPRECISE_ACC=None)
FP8_AG_SIG = dict(AG_SIG, a_local="tensordesc<fp8e4nv[128,128]>", a_full="tensordesc<fp8e4nv[128,128]>",
                  b="tensordesc<fp8e4nv[256,128]>", scale_full="*fp32", **FP8_SCALES)
FP8_RS_SIG = dict(RS_SIG, a="tensordesc<fp8e4nv[128,128]>", w="tensordesc<fp8e4nv[256,128]>", **FP8_SCALES)
# the FP8 default of block scales (``gemm.fp8_tiles``): 128x128 tiles (two accumulators in registers)
FP8_N128 = dict(b="tensordesc<fp8e4nv[128,128]>", c="tensordesc<bf16[1,128,128]>")
# promoted per-tensor / rowwise 128x256 tiles: B's descriptor of 128 rows, two 128-wide accumulators (SPLIT_N)
FP8_SPLIT = "tensordesc<fp8e4nv[128,128]>"
FP8_GROUPED_SIG = dict(GROUPED_SIG, x="tensordesc<fp8e4nv[128,128]>", out_desc="tensordesc<bf16[1,128,256]>",
                       stride_swe="i32", **FP8_SCALES)
FP8_DISPATCH_SIG = dict(DISPATCH_SIG, recv_x="*fp8e4nv", x_scales="*fp32", recv_scales="*fp32", FP8="constexpr")

# (variant id, kernel module, kernel name, signature, constexprs, aligned args, launch options)
K = "triton_dist.kernels."
KERNELS = [
    ("barrier_all", "triton_dist.shmem.device_barrier", "barrier_all_kernel", dict(ctx="*i64"), {}, (), {"num_warps": 4}),
    ("ping_pong", K + "pingpong", "ping_pong_kernel", dict(flag="*i32", count="*i32", iters="i32", ctx="*i64"),
     {}, (), {"num_warps": 1}),
    ("all_gather/large", K + "allgather", "all_gather_push_kernel",
     dict(src="*i64", out="*i64", arrived="*i32", ready="*i32", state="*i32", shard_words="i64", chunk_words="i64",
          n_chunks="i32", ctx="*i64", BLOCK="constexpr", FLAGS_BLOCK="constexpr"),
     {"BLOCK": 4096, "FLAGS_BLOCK": 128}, ("src", "out", "chunk_words", "shard_words"), {"num_warps": 16}),
    ("all_gather/small", K + "allgather", "all_gather_push_kernel",
     dict(src="*i64", out="*i64", arrived="*i32", ready="*i32", state="*i32", shard_words="i64", chunk_words="i64",
          n_chunks="i32", ctx="*i64", BLOCK="constexpr", FLAGS_BLOCK="constexpr"),
     {"BLOCK": 1024, "FLAGS_BLOCK": 32}, ("src", "out", "chunk_words", "shard_words"), {"num_warps": 8}),
    ("gemm/128x256", K + "gemm", "gemm_kernel", GEMM_SIG, GEMM_BIG, ("K", "N"), {"num_warps": 8, "num_stages": 3}),
    ("gemm/128x128-silu", K + "gemm", "gemm_kernel",
     dict(GEMM_SIG, b="tensordesc<bf16[128,64]>", c="tensordesc<bf16[1,128,128]>"),
     dict(GEMM_BIG, BLOCK_N=128, SILU_GATE=True), ("K", "N"), {"num_warps": 8, "num_stages": 4}),
    ("gemm/skinny-128x64", K + "gemm", "gemm_kernel",
     dict(GEMM_SIG, b="tensordesc<bf16[64,64]>", c="tensordesc<bf16[1,128,64]>"),
     dict(GEMM_BIG, BLOCK_N=64), ("K", "N"), {"num_warps": 4, "num_stages": 6}),
    ("gemm/split-k-128x128", K + "gemm", "gemm_kernel",
     dict(GEMM_SIG, b="tensordesc<bf16[128,64]>", c="tensordesc<bf16[1,128,128]>", partials="*fp32",
          tile_counts="*i32", SPLIT_K="constexpr"),
     dict(GEMM_BIG, BLOCK_N=128, SPLIT_K=4), ("K", "N", "partials", "tile_counts"), {"num_warps": 4, "num_stages": 4}),
    ("gemm/masked", K + "gemm", "gemm_kernel",
     dict(GEMM_SIG, a="*bf16", b="*bf16", c="*bf16"), dict(GEMM_BIG, BLOCK_N=128, USE_TMA=False), (),
     {"num_warps": 8, "num_stages": 4}),
    ("ag_gemm/phased", K + "allgather_gemm", "ag_gemm_kernel", AG_SIG, AG_DEFAULT, ("K", "N"),
     {"num_warps": 8, "num_stages": 3}),
    ("ag_gemm/phased-silu", K + "allgather_gemm", "ag_gemm_kernel",
     dict(AG_SIG, b="tensordesc<bf16[128,64]>", c="tensordesc<bf16[1,128,128]>"),
     dict(AG_DEFAULT, BLOCK_N=128, SILU_GATE=True), ("K", "N"), {"num_warps": 8, "num_stages": 3}),
    ("ag_gemm/gathered", K + "allgather_gemm", "gathered_kernel",
     dict(arrived="*i32", state="*i32", ctx="*i64", N_CHUNKS="constexpr", FENCE_ASYNC_PROXY="constexpr"),
     dict(N_CHUNKS=1, FENCE_ASYNC_PROXY=True), (), {"num_warps": 4}),
    ("ag_gemm/ready_handshake", K + "allgather_gemm", "ready_handshake_kernel",
     dict(ready="*i32", state="*i32", epoch_out="*i32", ctx="*i64"), {}, (), {"num_warps": 4}),
    ("gemm_rs/default", K + "gemm_reducescatter", "gemm_rs_kernel", RS_SIG, RS_DEFAULT,
     ("recv", "N", "K", "stride_am", "stride_wn"), {"num_warps": 8, "num_stages": 3}),
    ("gemm_rs/weight-as-it-lies", K + "gemm_reducescatter", "gemm_rs_kernel",
     dict(RS_SIG, w="tensordesc<bf16[64,256]>", W_KN="constexpr"), dict(RS_DEFAULT, W_KN=True),
     ("recv", "N", "K", "stride_am", "stride_wn"), {"num_warps": 8, "num_stages": 3}),
    ("gemm_rs/remote-tma", K + "gemm_reducescatter", "gemm_rs_kernel",
     dict(RS_SIG, out="tensordesc<bf16[1,128,128]>", recv_peer="tensordesc<bf16[1,128,128]>"),
     dict(RS_DEFAULT, EPILOGUE_SUBTILE=True, REMOTE_TMA=True), ("recv", "N", "K", "stride_am", "stride_wn"),
     {"num_warps": 8, "num_stages": 4}),
    ("gemm_rs/masked-fp32-partials", K + "gemm_reducescatter", "gemm_rs_kernel",
     dict(RS_SIG, a="*bf16", w="*bf16", out="*bf16", recv="*fp32", recv_peer="*fp32"),
     dict(RS_DEFAULT, BLOCK_N=128, USE_TMA=False, SLOTS_BLOCK=4), ("a", "w", "out", "recv", "N", "K"),
     {"num_warps": 8, "num_stages": 4}),
    ("all_reduce/one-shot", K + "allreduce", "all_reduce_kernel", AR_SIG, AR_ONE_SHOT, AR_ALIGNED,
     {"num_warps": 4}),
    ("all_reduce/one-shot-zero-copy", K + "allreduce", "all_reduce_kernel", AR_SIG,
     dict(AR_ONE_SHOT, ZERO_COPY=True), AR_ALIGNED, {"num_warps": 4}),
    ("all_reduce/two-shot", K + "allreduce", "all_reduce_kernel", AR_SIG,
     dict(AR_ONE_SHOT, BLOCK=4096, TWO_SHOT=True), AR_ALIGNED, {"num_warps": 4}),
    ("all_reduce_rmsnorm/one-shot", K + "allreduce", "all_reduce_kernel", dict(AR_SIG, reduced="*fp32"),
     dict(AR_ONE_SHOT, BLOCK=8192, EPILOGUE=1), AR_ALIGNED, {"num_warps": 16}),
    ("all_reduce_rmsnorm/two-shot-fp8", K + "allreduce", "all_reduce_kernel",
     dict(AR_SIG, out="*fp8e4nv", reduced="*fp32"), dict(AR_ONE_SHOT, BLOCK=8192, TWO_SHOT=True, EPILOGUE=2),
     AR_ALIGNED, {"num_warps": 16}),
    ("gemm_ar/decode", K + "allreduce", "gemm_ar_kernel", GEMM_AR_SIG,
     dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, USE_TMA=True, DOT_PRECISION="tf32", WORLD=2, WORLD_P2=2),
     ("out", "partials", "N", "K", "partial_elems"), {"num_warps": 4, "num_stages": 4}),
    ("grouped_gemm/128x256", K + "grouped_gemm", "grouped_gemm_kernel",
     dict(GROUPED_SIG, w="tensordesc<bf16[256,64]>", out_desc="tensordesc<bf16[1,128,256]>"), GROUPED_DEFAULT,
     GROUPED_ALIGNED, {"num_warps": 8, "num_stages": 3}),
    ("grouped_gemm/128x128-silu-counts", K + "grouped_gemm", "grouped_gemm_kernel", GROUPED_SIG,
     dict(GROUPED_DEFAULT, BLOCK_N=128, HAS_COUNTS=True, SILU_GATE=True), GROUPED_ALIGNED,
     {"num_warps": 8, "num_stages": 3}),
    ("grouped_gemm/masked-fp32", K + "grouped_gemm", "grouped_gemm_kernel",
     dict(GROUPED_SIG, x="*fp32", w="*fp32", out_desc="*fp32", out="*fp32"),
     dict(GROUPED_DEFAULT, BLOCK_N=128, USE_TMA=False), (), {"num_warps": 8, "num_stages": 3}),
    ("grouped_gemm/kn-128x256", K + "grouped_gemm", "grouped_gemm_kernel",
     dict(GROUPED_SIG, w="tensordesc<bf16[1,64,256]>", out_desc="tensordesc<bf16[1,128,256]>", **_const("W_KN")),
     dict(GROUPED_DEFAULT, W_KN=True), GROUPED_ALIGNED, {"num_warps": 8, "num_stages": 3}),
    ("grouped_gemm/weight-grad", K + "grouped_gemm", "grouped_weight_grad_kernel",
     dict(dy="tensordesc<bf16[64,128]>", x="tensordesc<bf16[64,128]>", dw="tensordesc<bf16[1,128,128]>",
          dw_ptr="*bf16", offsets="*i32", counts="*i32", E="i32", rows="i32", N="i32", K="i32", stride_dym="i32",
          stride_xm="i32", stride_we="i32", stride_wn="i32",
          **_const("BLOCK_M", "BLOCK_N", "BLOCK_K", "HAS_COUNTS", "USE_TMA", "DOT_PRECISION")),
     dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, HAS_COUNTS=True, USE_TMA=True, DOT_PRECISION="tf32"),
     ("N", "K", "stride_dym", "stride_xm", "stride_we", "stride_wn"), {"num_warps": 8, "num_stages": 4}),
    ("grouped_gemm/weight-grad-masked-fp32", K + "grouped_gemm", "grouped_weight_grad_kernel",
     dict(dy="*fp32", x="*fp32", dw="*fp32", dw_ptr="*fp32", offsets="*i32", counts="*i32", E="i32", rows="i32",
          N="i32", K="i32", stride_dym="i32", stride_xm="i32", stride_we="i32", stride_wn="i32",
          **_const("BLOCK_M", "BLOCK_N", "BLOCK_K", "HAS_COUNTS", "USE_TMA", "DOT_PRECISION")),
     dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, HAS_COUNTS=False, USE_TMA=False, DOT_PRECISION="ieee"),
     ("dy", "x", "dw_ptr", "N", "K", "stride_dym", "stride_xm", "stride_we", "stride_wn"),
     {"num_warps": 4, "num_stages": 3}),
    ("grouped_gemm/weight-grad-fp8-rows", K + "grouped_gemm", "grouped_weight_grad_kernel",
     dict(WGRAD_SIG, dy="*fp8e4nv", x="*fp8e4nv", **_const("FP8", "MAX_IMPRECISE_ACC")),
     dict(WGRAD_FP8, FP8="rows", MAX_IMPRECISE_ACC=128),
     ("dy", "x", "N", "K", "stride_dym", "stride_xm", "stride_we", "stride_wn"),
     {"num_warps": 8, "num_stages": 2}),
    ("grouped_gemm/weight-grad-fp8-blocks", K + "grouped_gemm", "grouped_weight_grad_kernel",
     dict(WGRAD_SIG, dy="tensordesc<bf16[128,128]>", x="tensordesc<bf16[128,64]>", **_const("FP8")),
     dict(WGRAD_FP8, FP8="blocks"), ("N", "K", "stride_dym", "stride_xm", "stride_we", "stride_wn"),
     {"num_warps": 8, "num_stages": 3}),
    ("ep/layout-T4096", K + "moe_ep", "ep_layout_kernel", LAYOUT_SIG,
     dict(K=8, EL=32, TB=16, K_PAD=8, EL_PAD=32, W_PAD=2, CG=4, QB=64, TIMELINE=False, PDL=True), (),
     {"num_warps": 4}),
    ("ep/layout-T128", K + "moe_ep", "ep_layout_kernel", LAYOUT_SIG,
     dict(K=8, EL=32, TB=2, K_PAD=8, EL_PAD=32, W_PAD=2, CG=4, QB=16, TIMELINE=False, PDL=True), (),
     {"num_warps": 4}),
    ("ep/dispatch-T4096", K + "moe_ep", "ep_dispatch_kernel", DISPATCH_SIG, DISPATCH_T4096, ("x", "recv_x", "H"),
     {"num_warps": 8}),
    ("ep/dispatch-T128", K + "moe_ep", "ep_dispatch_kernel", DISPATCH_SIG, DISPATCH_T128, ("x", "recv_x", "H"),
     {"num_warps": 8}),
    ("ep/dispatch-fused-timeline", K + "moe_ep", "ep_dispatch_kernel", DISPATCH_SIG,
     dict(DISPATCH_T128, FUSED_LAYOUT=True, CG=16, SENDERS_HELP=False, TIMELINE=True, PDL=False, DEFER_SIGNAL=False),
     ("x", "recv_x", "H"), {"num_warps": 8}),
    ("ep/combine-T4096", K + "moe_ep", "ep_combine_kernel", COMBINE_SIG, COMBINE_T4096,
     ("expert_out", "y", "partials", "H"), {"num_warps": 16}),
    ("ep/combine-T128", K + "moe_ep", "ep_combine_kernel", COMBINE_SIG, COMBINE_T128,
     ("expert_out", "y", "partials", "H"), {"num_warps": 8}),
    ("ep/combine-grad", K + "moe_ep.training", "combine_grad_kernel",
     dict(g="*bf16", y="*bf16", weights="*fp32", ids="*i32", grad_y="*bf16", grad_w="*fp32", n="i32", total="i32",
          H="i32", stride_g="i32", stride_y="i32", **_const("ROWS", "BLOCK_H")), dict(ROWS=4, BLOCK_H=1024),
     ("g", "y", "grad_y", "H", "stride_g", "stride_y"), {"num_warps": 4}),
    ("gemm/fp8-rows-128x256", K + "gemm", "gemm_kernel", dict(FP8_GEMM_SIG, b=FP8_SPLIT), dict(GEMM_BIG, **FP8_ROWS),
     ("K", "N"), {"num_warps": 8, "num_stages": 3}),
    ("gemm/fp8-rows-fast-accum", K + "gemm", "gemm_kernel", FP8_GEMM_SIG,
     dict(GEMM_BIG, **{**FP8_ROWS, "MAX_IMPRECISE_ACC": None}), ("K", "N"), {"num_warps": 8, "num_stages": 3}),
    ("gemm/fp8-blocks-128x128", K + "gemm", "gemm_kernel", dict(FP8_GEMM_SIG, **FP8_N128),
     dict(GEMM_BIG, **FP8_BLOCKS, BLOCK_N=128), ("K", "N"), {"num_warps": 8, "num_stages": 4}),
    # the tuner's block-scaled candidate of one warpgroup, two programs per SM (``gemm.gemm_candidates``)
    ("gemm/fp8-blocks-64x128-w4", K + "gemm", "gemm_kernel",
     dict(FP8_GEMM_SIG, a="tensordesc<fp8e4nv[64,128]>", b="tensordesc<fp8e4nv[128,128]>",
          c="tensordesc<bf16[1,64,128]>"), dict(GEMM_BIG, **FP8_BLOCKS, BLOCK_M=64, BLOCK_N=128), ("K", "N"),
     {"num_warps": 4, "num_stages": 4}),
    ("gemm/fp8-blocks-masked", K + "gemm", "gemm_kernel", dict(FP8_GEMM_SIG, a="*fp8e4nv", b="*fp8e4nv", c="*bf16"),
     dict(GEMM_BIG, **FP8_BLOCKS, BLOCK_N=128, USE_TMA=False), (), {"num_warps": 8, "num_stages": 4}),
    ("ag_gemm/phased-fp8-rows", K + "allgather_gemm", "ag_gemm_kernel", dict(FP8_AG_SIG, b=FP8_SPLIT),
     dict(AG_DEFAULT, **FP8_ROWS), ("K", "N"), {"num_warps": 8, "num_stages": 3}),
    ("ag_gemm/phased-fp8-blocks", K + "allgather_gemm", "ag_gemm_kernel", dict(FP8_AG_SIG, **FP8_N128),
     dict(AG_DEFAULT, **FP8_BLOCKS, BLOCK_N=128), ("K", "N"), {"num_warps": 8, "num_stages": 4}),
    ("gemm_rs/fp8-rows", K + "gemm_reducescatter", "gemm_rs_kernel", dict(FP8_RS_SIG, w=FP8_SPLIT),
     dict(RS_DEFAULT, **FP8_ROWS), ("recv", "N", "K", "stride_am", "stride_wn"), {"num_warps": 8, "num_stages": 3}),
    ("gemm_rs/fp8-blocks", K + "gemm_reducescatter", "gemm_rs_kernel",
     dict(FP8_RS_SIG, w="tensordesc<fp8e4nv[128,128]>", out="tensordesc<bf16[1,128,128]>"),
     dict(RS_DEFAULT, **FP8_BLOCKS, BLOCK_N=128), ("recv", "N", "K", "stride_am", "stride_wn"),
     {"num_warps": 8, "num_stages": 4}),
    ("grouped_gemm/fp8-rows-128x256", K + "grouped_gemm", "grouped_gemm_kernel",
     dict(FP8_GROUPED_SIG, w=FP8_SPLIT), dict(GROUPED_DEFAULT, **FP8_ROWS), GROUPED_ALIGNED,
     {"num_warps": 8, "num_stages": 3}),
    ("grouped_gemm/fp8-blocks-silu-128x64", K + "grouped_gemm", "grouped_gemm_kernel",
     dict(FP8_GROUPED_SIG, w="tensordesc<fp8e4nv[64,128]>", out_desc="tensordesc<bf16[1,128,64]>"),
     dict(GROUPED_DEFAULT, **FP8_BLOCKS, BLOCK_N=64, SILU_GATE=True), GROUPED_ALIGNED,
     {"num_warps": 8, "num_stages": 4}),
    ("ep/dispatch-fp8-quantize-T4096", K + "moe_ep", "ep_dispatch_kernel", FP8_DISPATCH_SIG,
     dict(DISPATCH_T4096, FP8="quantize"), ("x", "recv_x", "H"), {"num_warps": 8}),
    ("ep/dispatch-fp8-given-T128", K + "moe_ep", "ep_dispatch_kernel", dict(FP8_DISPATCH_SIG, x="*fp8e4nv"),
     dict(DISPATCH_T128, FP8="given"), ("x", "recv_x", "H"), {"num_warps": 8}),
    ("fp8/quantize", K + "fp8", "quantize_fp8_kernel",
     dict(x="*bf16", q="*fp8e4nv", scales="*fp32", T="i32", H="i32", BT="constexpr", BH="constexpr"),
     dict(BT=16, BH=512), ("x", "q", "H"), {"num_warps": 4}),
    ("fp8/quantize-kmajor", K + "fp8", "quantize_fp8_kernel",
     dict(x="*bf16", q="*fp8e4nv", scales="*fp32", T="i32", H="i32", BT="constexpr", BH="constexpr",
          K_MAJOR="constexpr"), dict(BT=16, BH=512, K_MAJOR=True), ("x", "q", "H"), {"num_warps": 4}),
    ("fp8/quantize-blocks", K + "fp8", "quantize_blocks_kernel",
     dict(x="*bf16", q="*fp8e4nv", scales="*fp32", T="i32", H="i32", BLOCK="constexpr"), dict(BLOCK=128),
     ("x", "q", "H"), {"num_warps": 16}),
    ("fp8/quantize-rows", K + "fp8", "quantize_rows_kernel",
     dict(x="*bf16", q="*fp8e4nv", scales="*fp32", T="i32", H="i32", BT="constexpr", BH="constexpr"),
     dict(BT=4, BH=1024), ("x", "q", "H"), {"num_warps": 4}),
    ("fp8/amax", K + "fp8", "amax_kernel", dict(x="*bf16", amax="*i32", numel="i32", BLOCK="constexpr"),
     dict(BLOCK=4096), ("x",), {"num_warps": 8}),
    ("fp8/quantize-tensor", K + "fp8", "quantize_tensor_kernel",
     dict(x="*bf16", q="*fp8e4nv", amax="*i32", scale="*fp32", numel="i32", BLOCK="constexpr"), dict(BLOCK=4096),
     ("x", "q"), {"num_warps": 8}),
    ("fp8/column-amax", K + "fp8", "column_amax_kernel",
     dict(x="*bf16", amax="*i32", T="i32", H="i32", BT="constexpr", BH="constexpr"), dict(BT=128, BH=64),
     ("x", "H"), {"num_warps": 4}),
    ("fp8/column-amax-stack", K + "fp8", "column_amax_kernel",
     dict(x="*bf16", amax="*i32", T="i32", H="i32", BT="constexpr", BH="constexpr", STACK="constexpr"),
     dict(BT=128, BH=64, STACK=True), ("x", "H"), {"num_warps": 4}),
] + [
    (f"fp8/quantize-transposed-{scaling}{'-stack' if stack else ''}", K + "fp8", "quantize_transposed_kernel",
     dict(x="*bf16", q="*fp8e4nv", scales="*fp32", amax="*i32", T="i32", H="i32", SCALING="constexpr",
          BT="constexpr", BH="constexpr", **({"STACK": "constexpr"} if stack else {})),
     dict(SCALING=scaling, BT=128, BH=128 if scaling == "block" else 64, **({"STACK": True} if stack else {})),
     ("x", "q", "T", "H"), {"num_warps": 8 if scaling == "block" else 4})
    for scaling in ("group", "block", "row", "tensor") for stack in (False, True) if scaling != "group" or not stack
] + [
    ("fp8/quantize-transposed-group-kmajor", K + "fp8", "quantize_transposed_kernel",
     dict(x="*bf16", q="*fp8e4nv", scales="*fp32", amax="*i32", T="i32", H="i32", SCALING="constexpr",
          BT="constexpr", BH="constexpr", K_MAJOR="constexpr"), dict(SCALING="group", BT=128, BH=64, K_MAJOR=True),
     ("x", "q", "T", "H"), {"num_warps": 4}),
] + [
    ("silu_gate/forward", K + "silu_gate", "silu_gate_kernel",
     dict(h="*bf16", out="*bf16", numel="i32", cols="i32", BLOCK="constexpr"), dict(BLOCK=1024), ("h", "out", "cols"),
     {"num_warps": 4}),
    ("silu_gate/backward", K + "silu_gate", "silu_gate_backward_kernel",
     dict(h="*bf16", grad="*bf16", grad_h="*bf16", numel="i32", cols="i32", BLOCK="constexpr"), dict(BLOCK=1024),
     ("h", "grad", "grad_h", "cols"), {"num_warps": 4}),
    ("flash_decode/split-fused", K + "flash_decode", "flash_decode_split_kernel", SPLIT_SIG, SPLIT_DEFAULT,
     ("q", "k_cache", "v_cache", "part_o", "dst_o", "out"), {"num_warps": 8, "num_stages": 3}),
    ("flash_decode/split-push-paged-pdl", K + "flash_decode", "flash_decode_split_kernel", SPLIT_SIG,
     dict(SPLIT_DEFAULT, PAGE_SIZE=16, MODE=1, N_SPLITS=32, PDL=True),
     ("q", "k_cache", "v_cache", "part_o", "dst_o", "out"), {"num_warps": 8, "num_stages": 3}),
    ("flash_decode/split-local", K + "flash_decode", "flash_decode_split_kernel",
     dict(SPLIT_SIG, dst_o="*bf16"), dict(SPLIT_DEFAULT, MODE=0, WORLD=1),
     ("q", "k_cache", "v_cache", "part_o", "dst_o", "out"), {"num_warps": 8, "num_stages": 3}),
    ("gemm_sm90/fp8-rows", K + "gemm_sm90", "gemm_fp8_sm90_kernel", sm90_gemm_signature,
     dict(stride_sak=1, BLOCK_SCALES=False, GROUP_M=8, STAGES=6, num_warps=4), (), {"num_warps": 4, "maxnreg": 168}),
    ("gemm_sm90/fp8-blocks", K + "gemm_sm90", "gemm_fp8_sm90_kernel", sm90_gemm_signature,
     dict(stride_sak=1, BLOCK_SCALES=True, GROUP_M=8, STAGES=5, num_warps=4), (), {"num_warps": 4, "maxnreg": 168}),
    ("gemm_sm90/fp8-blocks-kmajor", K + "gemm_sm90", "gemm_fp8_sm90_kernel", sm90_gemm_kmajor_signature,
     dict(stride_sa=1, BLOCK_SCALES=True, GROUP_M=8, STAGES=5, num_warps=4), (), {"num_warps": 4, "maxnreg": 168}),
    ("gemm_sm90/fp8-blocks-kmajor-subtile", K + "gemm_sm90", "gemm_fp8_sm90_kernel", sm90_gemm_subtile_signature,
     dict(stride_sa=1, BLOCK_SCALES=True, GROUP_M=8, STAGES=6, num_warps=4, EPILOGUE_SUBTILE=True), (),
     {"num_warps": 4, "maxnreg": 168}),
    ("gemm_sm90/fp8-rows-tail", K + "gemm_sm90", "gemm_fp8_sm90_kernel", sm90_gemm_tail_signature,
     dict(stride_sak=1, BLOCK_SCALES=False, GROUP_M=8, STAGES=6, num_warps=4, SPLIT_TAIL=True),
     ("c", "partials", "tile_counts"), {"num_warps": 4, "maxnreg": 168}),
    ("gemm_sm90/fp8-blocks-kmajor-tail", K + "gemm_sm90", "gemm_fp8_sm90_kernel", sm90_gemm_tail_kmajor_signature,
     dict(stride_sa=1, BLOCK_SCALES=True, GROUP_M=8, STAGES=5, num_warps=4, SPLIT_TAIL=True),
     ("c", "partials", "tile_counts"), {"num_warps": 4, "maxnreg": 168}),
    ("gemm_sm90/fp8-rows-wide-tail", K + "gemm_sm90", "gemm_fp8_sm90_kernel", sm90_gemm_tail_wide_signature,
     dict(stride_sak=1, BLOCK_SCALES=False, GROUP_M=8, STAGES=4, num_warps=4, SPLIT_TAIL=True),
     ("c", "partials", "tile_counts"), {"num_warps": 4, "maxnreg": 168}),
    ("gemm_sm90/fp8-rows-wide", K + "gemm_sm90", "gemm_fp8_sm90_kernel", sm90_gemm_wide_signature,
     dict(stride_sak=1, BLOCK_SCALES=False, GROUP_M=8, STAGES=4, num_warps=4), (), {"num_warps": 4, "maxnreg": 168}),
    ("gemm_sm90/fp8-blocks-wide", K + "gemm_sm90", "gemm_fp8_sm90_kernel", sm90_gemm_wide_signature,
     dict(stride_sak=1, BLOCK_SCALES=True, GROUP_M=8, STAGES=4, num_warps=4), (), {"num_warps": 4, "maxnreg": 168}),
    ("gemm_sm90/bf16", K + "gemm_sm90", "gemm_fp8_sm90_kernel", sm90_gemm_16bit_signature,
     dict(scale_a=None, scale_w=None, stride_sak=1, BLOCK_SCALES=False, GROUP_M=8, STAGES=6, num_warps=4), (),
     {"num_warps": 4, "maxnreg": 168}),
    ("gemm_sm90/bf16-wide-tail", K + "gemm_sm90", "gemm_fp8_sm90_kernel", sm90_gemm_16bit_wide_tail_signature,
     dict(scale_a=None, scale_w=None, stride_sak=1, BLOCK_SCALES=False, GROUP_M=8, STAGES=4, num_warps=4,
          SPLIT_TAIL=True), ("c", "partials", "tile_counts"), {"num_warps": 4, "maxnreg": 168}),
    ("flash_decode/merge", K + "flash_decode", "flash_decode_merge_kernel", MERGE_SIG,
     dict(GROUP=4, GROUP_P2=4, HEAD_DIM=128, WORLD=2, WORLD_PAD=2, RANK_CHUNK=2, PDL=True),
     ("recv_o", "out", "stride_ob", "stride_oh"), {"num_warps": 4}),
]

_DEBUG_LINE = re.compile(r"^\s*(\.loc|\.file|//)|^\$L__tmp\d+:$")  # $L__tmp: labels only debug sections use


def normalized_ptx(ptx):
    """The PTX without debug information: source locations and the debug sections."""
    out, skipping = [], False
    for line in ptx.splitlines():
        if line.lstrip().startswith(".section") and ".debug" in line:
            skipping = True
        if skipping:
            if line.strip() == "}":
                skipping = False
            continue
        if _DEBUG_LINE.match(line) or not line.strip():
            continue
        out.append(line.rstrip())
    return "\n".join(out)


def _find(module, name):
    """The kernel ``name`` in ``module`` (a module path; if it is a package, its submodules are searched too)."""
    import importlib
    import pkgutil

    mod = importlib.import_module(module)
    if hasattr(mod, name):
        return getattr(mod, name)
    for info in pkgutil.iter_modules(getattr(mod, "__path__", [])):
        sub = importlib.import_module(f"{module}.{info.name}")
        if hasattr(sub, name):
            return getattr(sub, name)
    raise AttributeError(f"no kernel {name} in {module}")


def with_defaults(kernel, signature, constexprs):
    """The signature and constexprs with every parameter the entry leaves out at its default, as a launch that
    does not pass it compiles it (e.g. the FP8 scale arguments, None: constexpr, of a bf16 variant)."""
    import inspect

    full, constexprs = {}, dict(constexprs)
    for p in inspect.signature(kernel.fn).parameters.values():  # in the kernel's order (attrs go by position)
        if p.name in signature:
            full[p.name] = signature[p.name]
        elif p.default is not inspect.Parameter.empty:
            full[p.name] = "constexpr"
            constexprs[p.name] = p.default
    return full, constexprs


def compile_one(module, name, signature, constexprs, aligned, options):
    kernel = _find(module, name)
    while not hasattr(kernel, "arg_names"):
        kernel = kernel.fn
    signature, constexprs = with_defaults(kernel, signature, constexprs)
    names = list(signature)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ast_source(kernel, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def ast_source(kernel, signature, constexprs, attrs=None):
    """What ``triton.compile`` takes for ``kernel``: a Triton kernel's ``ASTSource``, a Gluon kernel's
    ``GluonASTSource`` (kernels/gemm_sm90.py)."""
    source = ASTSource
    if getattr(kernel, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as source
    return source(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)


def ptxas_log(ptx):
    """What the ptxas that Triton uses for sm_90 says assembling ``ptx`` for sm_90a verbosely: registers, spills,
    and its notes on wgmma pipelines it had to serialize (C7514 and kin: an FP8 mainloop then loses its overlap)."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        return subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                              capture_output=True, text=True).stderr


def wgmma_serialized(log):
    """ptxas's notes (from ``ptxas_log``) that it serialized or waited on wgmmas the kernel meant to overlap."""
    return [line.split("info    :")[-1].strip() for line in log.splitlines() if re.search(r"\(C751\d\)", line)]


def spilled_bytes(log):
    """The bytes of spill stores ptxas reports in ``ptxas_log`` (None: it reports none)."""
    spills = re.findall(r"(\d+) bytes spill stores", log)
    return int(spills[0]) if spills else None


def registers(ptx):
    """"R registers, S B spilled" of a kernel's PTX assembled for sm_90a (spills cost a GEMM tens of percent: a
    tile's accumulators must fit a thread's registers)."""
    log = ptxas_log(ptx)
    regs = re.findall(r"Used (\d+) registers", log)
    spilled = spilled_bytes(log)
    return f"{regs[0] if regs else '?'} registers, {'?' if spilled is None else spilled} B spilled"


def launched_kernels():
    """Every kernel of the package (a ``@triton.jit`` function named ``*_kernel`` at module level: what the ops
    launch; ``triton_dist.language`` holds device functions, not kernels) as (module, name)."""
    import importlib
    import pkgutil

    import triton_dist

    found = set()
    for info in pkgutil.walk_packages(triton_dist.__path__, "triton_dist."):
        if info.name.startswith("triton_dist.language"):
            continue
        mod = importlib.import_module(info.name)
        for name, obj in vars(mod).items():
            if name.endswith("_kernel") and isinstance(obj, triton.runtime.jit.JITFunction) and \
                    obj.__module__ == info.name:
                found.add((info.name, name))
    return found


def uncovered_kernels():
    """Kernels of the package that no entry of KERNELS compiles."""
    listed = {name for _, _, name, *_ in KERNELS}
    return sorted(f"{module}.{name}" for module, name in launched_kernels() if name not in listed)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write {variant: digest} here")
    parser.add_argument("--spills", action="store_true",
                        help="also assemble each variant (Triton's ptxas, sm_90a) and print its registers and spills")
    parser.add_argument("only", nargs="*", help="variant ids to compile (default: all)")
    args = parser.parse_args()
    missing = [] if args.only else uncovered_kernels()
    for name in missing:
        print(f"{name}: no entry in KERNELS (add one: every kernel is compiled here)", flush=True)
    digests = {}
    for vid, module, name, sig, consts, aligned, options in KERNELS:
        if args.only and vid not in args.only:
            continue
        try:
            raw = compile_one(module, name, sig() if callable(sig) else sig, consts, aligned, options)
            ptx = normalized_ptx(raw)
            digests[vid] = hashlib.sha256(ptx.encode()).hexdigest()[:16]
            print(f"{vid:40s} {digests[vid]}  {len(ptx):8d} bytes" + (f"  {registers(raw)}" if args.spills else ""),
                  flush=True)
        except Exception as exc:  # a kernel that does not compile is reported, not fatal
            digests[vid] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
            print(f"{vid:40s} {digests[vid]}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "digests": digests}, f, indent=1, sort_keys=True)
    failed = [vid for vid, d in digests.items() if d.startswith("error")]
    print(f"triton {triton.__version__}: {len(digests) - len(failed)} of {len(digests)} variants compiled for sm_90"
          + (f"; FAILED: {', '.join(failed)}" if failed else "") + (f"; {len(missing)} kernels not listed" if missing
                                                                      else ""), flush=True)
    return 1 if failed or missing else 0


if __name__ == "__main__":
    sys.exit(main())
