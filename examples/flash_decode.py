"""Sequence-parallel flash-decode: the KV cache of every sequence split over ranks, one query token per sequence.

    torchrun --nproc-per-node=2 examples/flash_decode.py     # GPUs: check against torch, then time it
    python examples/flash_decode.py                          # no GPU: 2 CPU ranks under the Triton interpreter

Each rank holds a slice of every sequence's KV cache ([B, S_local_max, Hkv, D] plus how many of those rows are
valid, ``kv_lens``); every rank gets the attention over the whole sequence. Copy this file to start your own.
"""

import math

import torch
import torch.distributed as dist

import triton_dist as td
from triton_dist.kernels import sp_flash_decode
from triton_dist.launch import run_main
from triton_dist.timing import timeable


def reference(q, k, v, kv_lens, scale):
    """fp32 attention over every rank's valid rows, gathered with torch.distributed (the slow, obvious way)."""
    world = td.world_size()
    ks, vs, ls = [torch.empty_like(k) for _ in range(world)], [torch.empty_like(v) for _ in range(world)], \
        [torch.empty_like(kv_lens) for _ in range(world)]
    dist.all_gather(ks, k)
    dist.all_gather(vs, v)
    dist.all_gather(ls, kv_lens)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b in range(q.shape[0]):
        kb = torch.cat([ks[r][b, :int(ls[r][b])] for r in range(world)]).float()  # [T, Hkv, D]
        vb = torch.cat([vs[r][b, :int(ls[r][b])] for r in range(world)]).float()
        group = q.shape[1] // k.shape[2]
        kb, vb = kb.repeat_interleave(group, 1), vb.repeat_interleave(group, 1)
        p = torch.softmax(torch.einsum("hd,thd->ht", q[b].float(), kb) * scale, dim=-1)
        out[b] = torch.einsum("ht,thd->hd", p, vb)
    return out


def main():
    rank, dev = td.rank(), td.shmem.device()
    on_gpu = dev.type == "cuda"  # (CPU ranks on a GPU machine too: TRITON_INTERPRET=1)
    # Small enough for the interpreter on CPU; a real decode shape on GPUs.
    batch, q_heads, kv_heads, head_dim, s_local = (4, 32, 8, 128, 8192) if on_gpu else (2, 8, 2, 64, 32)
    dtype = torch.bfloat16 if on_gpu else torch.float16  # (the interpreter's bf16 tl.dot is unreliable)
    torch.manual_seed(rank)
    k_cache = torch.randn(batch, s_local, kv_heads, head_dim, device=dev).to(dtype)
    v_cache = torch.randn(batch, s_local, kv_heads, head_dim, device=dev).to(dtype)
    kv_lens = torch.randint(0, s_local + 1, (batch,), device=dev, dtype=torch.int32)  # ragged, maybe 0
    torch.manual_seed(1234)  # the query is the same on every rank
    q = torch.randn(batch, q_heads, head_dim, device=dev).to(dtype)

    # == torch.ops.triton_dist.sp_flash_decode(...). Knobs go in config=, e.g. {"combine": "kernel", "pdl": True}
    # (see default_config); the first call for a shape plans and allocates, later calls just launch.
    out = sp_flash_decode(q, k_cache, v_cache, kv_lens)
    err = (out.float() - reference(q, k_cache, v_cache, kv_lens, 1.0 / math.sqrt(head_dim))).abs().max().item()
    print(f"rank {rank}: max |error| vs torch = {err:.2e}", flush=True)
    assert err < (3e-2 if on_gpu else 5e-3)

    if on_gpu:  # decode loops run from CUDA graphs: capture once (after a first eager call), replay every step
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            sp_flash_decode(q, k_cache, v_cache, kv_lens, out=out)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(5):
            graph.replay()
        start.record()
        for _ in range(50):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 1000 / 50
        kv_gb = 2 * k_cache.numel() * k_cache.element_size() / 1e9
        figures = f"{us:.1f} us per step, {kv_gb / us * 1e6:.0f} GB/s of KV" if timeable() else \
            "replayed (not timed: ranks sharing one GPU)"
        print(f"rank {rank}: B={batch} S/rank={s_local} Hq={q_heads} Hkv={kv_heads} D={head_dim}: {figures}",
              flush=True)
    return err


if __name__ == "__main__":
    run_main(main)  # torchrun: this process is a rank; no GPU: two CPU ranks
