"""Template: an FP8 tensor-parallel projection pair, ``ag_gemm`` then ``gemm_rs`` on FP8 operands with scales.

    torchrun --nproc-per-node=2 examples/fp8_tp_mlp.py     # GPUs: checks, then times ours vs bf16
    python examples/fp8_tp_mlp.py                          # no GPU: 2 ranks on CPU (Triton interpreter)

Each rank quantises its rows per 1x128 group (``quantize_fp8``: scales [m, ceil(K/128)]) and its weight slices
per 128x128 block (``fp8.quantize``); ``ag_gemm(..., scale_a=, scale_w=)`` gathers the FP8 rows with their scales
while it multiplies (half the bytes of bf16), ``gemm_rs(..., scale_a=, scale_w=)`` multiplies the FP8 hidden rows
and sums the bf16 partials across ranks in a fixed order (``scaled_ag_gemm`` / ``scaled_gemm_rs``: the same ops,
the scales positional). Blockwise scales as DeepSeek-V3 uses them; per-tensor and rowwise ones work the same way
(triton_dist/kernels/fp8.py).
"""

import torch
import torch.distributed as dist

import triton_dist as td
from triton_dist.kernels import ag_gemm, fp8, gemm_rs, quantize_fp8
from triton_dist.launch import run_main
from triton_dist.timing import time_us, timeable


def main():
    world, rank = td.world_size(), td.rank()
    dev = td.shmem.device()
    on_gpu = dev.type == "cuda"
    m, hidden, inter = (4096 // world, 8192, 28672 // world) if on_gpu else (9, 256, 128)  # per-rank shapes
    g = torch.Generator(device=dev).manual_seed(rank)
    w_up = torch.randn(inter, hidden, device=dev, generator=g) / hidden ** 0.5      # this rank's columns
    w_down = torch.randn(hidden, inter, device=dev, generator=g) / inter ** 0.5     # this rank's K slice
    (wu, swu), (wd, swd) = fp8.quantize(w_up, "block"), fp8.quantize(w_down, "block")
    x = torch.randn(m, hidden, device=dev, generator=g).to(torch.bfloat16)

    def fp8_projections(x):
        q, sq = quantize_fp8(x)                                       # FP8 rows + 1x128 group scales
        h = ag_gemm(q, wu, scale_a=sq, scale_w=swu)                   # [world * m, inter], bf16
        hq, shq = quantize_fp8(h)
        return h, hq, shq, gemm_rs(hq, wd, scale_a=shq, scale_w=swd)  # this rank's rows [m, hidden], bf16

    h, hq, shq, y = fp8_projections(x)
    # reference: the dequantised operands in fp32, the same two steps
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    deq = lambda t, s, kind: t.float() * fp8.expand(s, kind, *t.shape)  # noqa: E731
    xs = [quantize_fp8(p) for p in parts]
    ref_h = torch.cat([deq(a, s, "group") for a, s in xs]) @ deq(wu, swu, "block").T
    partial = deq(hq, shq, "group") @ deq(wd, swd, "block").T
    dist.all_reduce(partial)
    ref_y = partial[rank * m:(rank + 1) * m]
    err_h = ((h.float() - ref_h).abs().max() / ref_h.abs().max()).item()
    err_y = ((y.float() - ref_y).abs().max() / ref_y.abs().max()).item()
    assert err_h < 1e-2 and err_y < 3e-2, f"rank {rank}: errors {err_h:.3g}, {err_y:.3g}"
    if not timeable():  # CPU ranks, or ranks sharing one GPU: checked, not timed
        if rank == 0:
            print(f"[{td.shmem.backend()} x{world}] FP8 ag_gemm [{world * m}x{hidden}] -> gemm_rs: "
                  f"correct")
        return
    w_up, w_down = w_up.to(torch.bfloat16), w_down.to(torch.bfloat16)
    ours, bf16 = time_us(lambda: fp8_projections(x)), time_us(lambda: gemm_rs(ag_gemm(x, w_up), w_down))
    if rank == 0:
        print(f"[{td.shmem.backend()} x{world}] FP8 projections M={world * m} hidden={hidden} inter/rank={inter}: "
              f"correct; {ours:.0f} us vs bf16 {bf16:.0f} us ({bf16 / ours:.2f}x)")


if __name__ == "__main__":
    run_main(main)  # torchrun: this process is a rank; no GPU: two CPU ranks
