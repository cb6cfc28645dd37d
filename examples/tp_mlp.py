"""A tensor-parallel (sequence-parallel) gated MLP block: ``ag_gemm -> SiLU-gate -> gemm_rs``, against the same block
written with NCCL + torch, checked and timed end to end.

    torchrun --nproc-per-node=2 examples/tp_mlp.py     # GPUs: M=8192, hidden 8192, intermediate 28672, bf16
    python examples/tp_mlp.py                          # no GPU: 2 ranks on CPU (Triton interpreter), tiny sizes

Layout (W ranks, rank r; the classic Megatron split with sequence parallelism between blocks):
    x_r        [M/W, hidden]            this rank's rows of the activations
    w_gate_up  [2*I/W, hidden]          rows [0, I/W): this rank's gate slice, rows [I/W, 2I/W): its up slice
    w_down     [hidden, I/W]            this rank's columns of the down projection (linear convention)

    h   = all_gather(x) @ w_gate_up.T   [M, 2I/W]     ag_gemm: the gather overlaps the GEMM
    g   = silu(h[:, :I/W]) * h[:, I/W:] [M, I/W]       ... fused into its tiles (activation="silu_gate"): h is
                                                       never written, no separate activation pass
    y_r = reduce_scatter(g @ w_down.T)  [M/W, hidden]  gemm_rs: the reduce-scatter overlaps the GEMM
"""


import torch
import torch.distributed as dist
import torch.nn.functional as F

import triton_dist as td
from triton_dist.kernels import ag_gemm, gemm_rs
from triton_dist.launch import run_main
from triton_dist.timing import time_us, timeable


class TPMLP(torch.nn.Module):
    """The block with triton_dist's overlapped ops (``torch.ops.triton_dist.*``: torch.compile / CUDA graphs)."""

    def __init__(self, w_gate_up, w_down):
        super().__init__()
        self.w_gate_up, self.w_down = w_gate_up, w_down

    def forward(self, x):
        g = ag_gemm(x, self.w_gate_up, activation="silu_gate")  # silu(x @ w_gate.T) * (x @ w_up.T), gathered x
        return gemm_rs(g, self.w_down)


class TPMLPReference(torch.nn.Module):
    """The same block with NCCL collectives around torch.matmul (what a Megatron-style layer does)."""

    def __init__(self, w_gate_up, w_down):
        super().__init__()
        self.w_gate_up, self.w_down = w_gate_up, w_down
        self.inter_local = w_down.shape[1]
        self.world = dist.get_world_size()

    def forward(self, x):
        full = x.new_empty((self.world * x.shape[0], x.shape[1]))
        if x.is_cuda:
            dist.all_gather_into_tensor(full, x)
        else:  # gloo
            dist.all_gather(list(full.chunk(self.world)), x)
        h = full @ self.w_gate_up.T
        g = F.silu(h[:, : self.inter_local]) * h[:, self.inter_local:]
        partial = g @ self.w_down.T
        out = partial.new_empty((x.shape[0], partial.shape[1]))
        dist.reduce_scatter_tensor(out, partial)
        return out


def make_block(m, hidden, inter, dtype, device, seed=0):
    """This rank's inputs and weights (weights scaled so activations stay O(1))."""
    world, rank = td.world_size(), td.rank()
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(m // world, hidden, generator=gen)
    w_gate_up = torch.randn(2 * inter // world, hidden, generator=gen) / hidden ** 0.5
    w_down = torch.randn(hidden, inter // world, generator=gen) / inter ** 0.5
    return [t.to(device, dtype) for t in (x, w_gate_up, w_down)]


def main():
    world, rank = td.world_size(), td.rank()
    dev = td.shmem.device()
    on_gpu = dev.type == "cuda"
    m, hidden, inter = (8192, 8192, 28672) if on_gpu else (16, 32, 64)
    dtype = torch.bfloat16 if on_gpu else torch.float16
    x, w_gate_up, w_down = make_block(m, hidden, inter, dtype, dev)
    ours, ref = TPMLP(w_gate_up, w_down), TPMLPReference(w_gate_up, w_down)
    for step in range(3):  # fresh activations every step
        x = make_block(m, hidden, inter, dtype, dev, seed=step + 1)[0]
        y, y_ref = ours(x), ref(x)
        exact = TPMLPReference(w_gate_up.float(), w_down.float())(x.float())
        err, err_ref = [((t.float() - exact).abs().max() / exact.abs().max()).item() for t in (y, y_ref)]
        assert err < 2e-2, f"rank {rank}: step {step}: relative error {err} (NCCL+torch block: {err_ref})"
    if not timeable():  # CPU ranks, or ranks sharing one GPU: checked, not timed
        if rank == 0:
            print(f"[{td.shmem.backend()} x{world}] TP-MLP M={m} hidden={hidden} intermediate={inter}: correct "
                  f"(error {err:.2g}, NCCL+torch block {err_ref:.2g})")
        return

    t_ours, t_ref = time_us(lambda: ours(x)), time_us(lambda: ref(x))
    if rank == 0:
        tflops = 6 * m * hidden * (inter // world) / t_ours / 1e6
        print(f"[{td.shmem.backend()} x{world}] TP-MLP M={m} hidden={hidden} intermediate={inter} bf16: correct "
              f"(error {err:.2g}); {t_ours:.0f} us ({tflops:.0f} TFLOP/s per GPU) vs NCCL+torch {t_ref:.0f} us "
              f"({t_ref / t_ours:.2f}x)")


if __name__ == "__main__":
    run_main(main)  # torchrun: this process is a rank; no GPU: two CPU ranks
