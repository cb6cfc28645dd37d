"""run113's backward profile (one H200, W = 1): where a training step of TensorParallelMLP (4096 tokens, 4096 ->
14336, bf16) spends its device time against HF's LlamaMLP (bench_backward's step: fwd + backward of
sum(out * g)), torch.profiler, CUDA kernels by total time, 5 steps each after 3 warm-up steps.
    torchrun --nproc-per-node=1 bwd_profile.py OUT_DIR"""
import copy
import os
import sys

import torch

import triton_dist as td

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def main(out_dir):
    torch.cuda.set_device(0)
    td.init(backend="cuda", heap_size=4 << 30)
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from triton_dist.nn import TensorParallelMLP

    torch.manual_seed(0)
    hf = LlamaMLP(LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=8,
                              num_key_value_heads=8, head_dim=512)).cuda().to(torch.bfloat16).train()
    ours = TensorParallelMLP.from_dense(copy.deepcopy(hf))
    x = torch.randn(1, 4096, 4096, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(1, 4096, 4096, device="cuda", dtype=torch.bfloat16)
    report = []
    for name, module in (("HF", hf), ("ours", ours)):
        xi = x.clone().requires_grad_()

        def step():
            for p in module.parameters():
                p.grad = None
            xi.grad = None
            (module(xi) * g).sum().backward()

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70)
        report.append(f"== {name}\n{table}")
        print(report[-1], flush=True)
    open(f"{out_dir}/bwd_profile.txt", "w").write("\n".join(report))
    td.finalize()


if __name__ == "__main__":
    main(sys.argv[1])
