"""Template: an expert-parallel MoE layer (dispatch -> per-expert MLPs -> combine), checked against a
single-process torch reference of the same layer, then timed.

    torchrun --nproc-per-node=2 examples/moe_ep.py     # GPUs: NVLink stores + flags, bf16
    python examples/moe_ep.py                          # no GPU: 2 ranks on CPU (Triton interpreter), fp32

Rank r owns experts [r * E/W, (r + 1) * E/W). ep_dispatch sends each token once to every rank that owns one of its
top-k experts and lays the rows out grouped by local expert; each rank runs its experts on contiguous row ranges;
ep_combine sends the weighted sums back and adds them up in a fixed order (bitwise reproducible).
"""

import time

import torch
import torch.nn.functional as F

import triton_dist as td
from triton_dist.kernels import ep_combine, ep_dispatch
from triton_dist.launch import run_main
from triton_dist.timing import timeable


def make_experts(E, H, F_, dtype, device):
    """Every rank builds the same weights (same seed): expert e is silu(x @ w1[e]) @ w2[e]."""
    g = torch.Generator().manual_seed(0)
    w1 = (torch.randn(E, H, F_, generator=g) / H ** 0.5).to(dtype).to(device)
    w2 = (torch.randn(E, F_, H, generator=g) / F_ ** 0.5).to(dtype).to(device)
    return w1, w2


def route(x, router, k):
    scores = (x.float() @ router).softmax(dim=-1)
    weights, idx = scores.topk(k, dim=-1)
    return idx, weights / weights.sum(dim=-1, keepdim=True)


def moe_reference(x, idx, weights, w1, w2):
    """The same layer in one process: every token visits its k experts, weighted sum in fp32."""
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w1.shape[0]):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if tok.numel():
            out = F.silu(x[tok] @ w1[e]) @ w2[e]
            y.index_add_(0, tok, weights[tok, slot, None] * out.float())
    return y.to(x.dtype)


def moe_ep(x, idx, weights, w1, w2, max_tokens, align):
    """The expert-parallel layer: dispatch, this rank's experts on their row groups, combine."""
    E = w1.shape[0]
    el = E // td.world_size()
    first = td.rank() * el
    recv = ep_dispatch(x, idx, weights, num_experts=E, max_tokens=max_tokens, align=align)
    out = torch.zeros_like(recv.x)
    offsets, counts = recv.expert_offsets.tolist(), recv.expert_counts.tolist()  # (a grouped GEMM avoids this sync)
    for e in range(el):
        rows = slice(offsets[e], offsets[e] + counts[e])
        out[rows] = F.silu(recv.x[rows] @ w1[first + e]) @ w2[first + e]
    return ep_combine(out, recv.handle)


def main():
    w, r = td.world_size(), td.rank()
    dev = td.shmem.device()
    on_gpu = dev.type == "cuda"
    T, H, F_, E, k = (4096, 2048, 1408, 64, 8) if on_gpu else (9, 16, 24, 4, 2)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    w1, w2 = make_experts(E, H, F_, dtype, dev)
    router = torch.randn(H, E, generator=torch.Generator().manual_seed(1)).to(dev)
    g = torch.Generator().manual_seed(10 + r)
    x = torch.randn(T - r, H, generator=g).to(dtype).to(dev)  # ranks may hold different numbers of tokens
    idx, weights = route(x, router, k)
    y = moe_ep(x, idx, weights, w1, w2, max_tokens=T, align=16 if on_gpu else 1)
    ref = moe_reference(x, idx, weights, w1, w2)
    err = (y.float() - ref.float()).abs().max().item()
    tol = 5e-2 if on_gpu else 1e-4
    assert err <= tol * max(1.0, ref.float().abs().max().item()), f"rank {r}: EP MoE off by {err}"
    y2 = moe_ep(x, idx, weights, w1, w2, max_tokens=T, align=16 if on_gpu else 1)
    assert torch.equal(y, y2), f"rank {r}: not bitwise reproducible"
    if timeable():  # (not on CPU ranks, nor where ranks share one GPU)
        recv = ep_dispatch(x, idx, weights, num_experts=E, max_tokens=T, align=16)
        iters = 20
        timings = {}
        for name, fn in (("dispatch", lambda: ep_dispatch(x, idx, weights, num_experts=E, max_tokens=T, align=16,
                                                          check_ids=False)),
                         ("combine", lambda: ep_combine(recv.x, recv.handle)),
                         ("layer", lambda: moe_ep(x, idx, weights, w1, w2, max_tokens=T, align=16))):
            recv = ep_dispatch(x, idx, weights, num_experts=E, max_tokens=T, align=16)
            fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
            timings[name] = (time.perf_counter() - t0) / iters * 1e6
        if r == 0:
            print(f"[{td.shmem.backend()} x{w}] EP MoE T={T} H={H} F={F_} top-{k} of {E}: matches the torch "
                  f"reference (max err {err:.3g}), bitwise reproducible; " +
                  ", ".join(f"{n} {t:.0f} us" for n, t in timings.items()))
    elif r == 0:
        print(f"[{td.shmem.backend()} x{w}] EP MoE T={T} H={H} top-{k} of {E}: matches the torch reference "
              f"(max err {err:.2g}), bitwise reproducible")


if __name__ == "__main__":
    run_main(main, heap_size=4 << 30)  # torchrun: this process is a rank; no GPU: two CPU ranks
