"""run130's profile of the MoE layer's training forward in FP8 (one H200, W = 1): bench_layers' Qwen3-MoE block
(hidden 7168, 64 experts, top 8, intermediate 2048, 4096 tokens, bf16) as ExpertParallelMoE, bf16 and fp8="row",
"block"; torch.profiler (CUDA), 3 forwards with autograd recording after 2 warm-up steps: CUDA kernels by total
time. Why run129's FP8 forward (8395 us) was slower than the bf16 one (5870).
    torchrun --nproc-per-node=1 moe_fp8_profile.py OUT_DIR"""
import copy
import os
import sys

import torch

import triton_dist as td

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def main(out_dir):
    torch.cuda.set_device(0)
    td.init(backend="cuda", heap_size=8 << 30)
    from bench_layers import FULL, hf_module
    from triton_dist.nn import ExpertParallelMoE

    sizes = FULL["moe"]
    hf = hf_module("moe", sizes, torch.bfloat16, td.shmem.device()).train()
    x = torch.randn(1, 4096, sizes["hidden"], device="cuda", dtype=torch.bfloat16)
    report = []
    for fp8 in (None, "row", "block"):
        layer = ExpertParallelMoE.from_dense(copy.deepcopy(hf), fp8=fp8)
        for _ in range(2):
            layer(x.requires_grad_()).sum().backward()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                out = layer(x)
            torch.cuda.synchronize()
        del out
        report.append(f"== fp8={fp8}: forward with autograd recording, 3 calls, by CUDA time\n"
                      + prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
        del layer
        torch.cuda.empty_cache()
    text = "\n".join(report)
    print(text)
    with open(os.path.join(out_dir, "moe_fp8_profile.txt"), "w") as f:
        f.write(text)
    td.finalize()


if __name__ == "__main__":
    main(sys.argv[1])
