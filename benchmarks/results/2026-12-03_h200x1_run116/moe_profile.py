"""run116's MoE training-step profile (one H200, W = 1): bench_backward's moe case (Qwen3-MoE block, hidden 7168,
64 experts, top 8, intermediate 2048, 4096 tokens, bf16): ExpertParallelMoE (replicated) against HF's block with
transformers' grouped_mm experts; torch.profiler, CUDA kernels by total time, 3 steps each after 2 warm-up steps.
    torchrun --nproc-per-node=1 moe_profile.py OUT_DIR"""
import os
import sys

import torch

import triton_dist as td

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def main(out_dir):
    torch.cuda.set_device(0)
    td.init(backend="cuda", heap_size=8 << 30)
    from bench_backward import layer_steps
    from bench_layers import FULL

    steps, _ = layer_steps("moe", FULL["moe"], 4096, torch.bfloat16, td.shmem.device())
    report = []
    for name in ("HF grouped_mm", "ours replicated"):
        step = steps.get(name)
        if step is None:
            continue
        for _ in range(2):
            step.fwd_bwd()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step.fwd_bwd()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=90)
        report.append(f"== {name}\n{table}")
    open(f"{out_dir}/moe_profile.txt", "w").write("\n".join(report))
    td.finalize()


if __name__ == "__main__":
    main(sys.argv[1])
