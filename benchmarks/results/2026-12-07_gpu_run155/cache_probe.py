"""run155 (prepared 2026-12-07): does ``fp8_weight_cache`` keep the weights' FP8 copies on the GPU?

bench_backward's "kept" contenders saved nothing in run153 (row: 6094 -> 6109 us) and run154 (block: 6260 -> 6450),
and run154's profile of a kept step still quantised the weights (``quantize_blocks_kernel`` 496 us), while on CPU
ranks the same layer inside one reused cache quantises each weight in the first step only. Here: the bench's layer
(TensorParallelMLP from a gated MLP 4096 -> 14336, bf16, 4096 tokens) in each mode, with and without fp8_grads,
three steps inside one ``fp8_weight_cache`` object entered per step, as the bench does; per step the quantisations
made (shape, scaling, transposed, whether a Parameter) and how many copies the cache holds.

    PYTHONPATH=$PWD torchrun --nproc-per-node=1 benchmarks/results/2026-12-07_gpu_run155/cache_probe.py
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import triton_dist as td
from triton_dist.kernels import fp8
from triton_dist.nn import TensorParallelMLP, fp8_weight_cache


class GatedMLP(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(hidden, inter, bias=False), nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
td.init(backend="cuda")
dense = GatedMLP(4096, 14336).to("cuda", torch.bfloat16)
x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
real = fp8.quantize_fp8
made = []


def counting(t, scaling="group", transposed=False):
    made.append((tuple(t.shape), scaling, transposed, type(t).__name__))
    return real(t, scaling, transposed)


fp8.quantize_fp8 = counting
for mode in ("row", "block"):
    for grads in (False, True):
        layer = TensorParallelMLP.from_dense(dense, fp8=mode, fp8_grads=grads)
        cache = fp8_weight_cache()
        for step in range(3):
            made.clear()
            xs = x.clone().requires_grad_()
            with cache:
                y = layer(xs)
                y.backward(torch.ones_like(y))
            torch.cuda.synchronize()
            weights = [m for m in made if m[3] == "Parameter"]
            print(f"{mode} fp8_grads={grads} step {step}: {len(made)} quantisations, {len(weights)} of Parameters "
                  f"{weights}; the cache holds {len(cache)}", flush=True)
fp8.quantize_fp8 = real
td.finalize()
