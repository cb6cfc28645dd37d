"""Sequence-parallel flash-decode vs SDPA + NCCL (torchrun --nproc-per-node=N benchmarks/bench_flash_decode.py).

GQA 32 query / 8 KV heads, head dim 128, bf16; the KV cache of B sequences of total length S split evenly over the
ranks. In the same run, on the same inputs:
  ours      sp_flash_decode: split-KV local kernel (push fused into its epilogue) + merge kernel; eager and
            replayed from a CUDA graph (how decode loops run). "local" = local_flash_decode, the same local kernel
            writing this rank's (o, lse) instead of pushing: combine overhead = ours - local.
  baseline  local part: aten flash attention (returns the lse the combine needs; plain F.sdpa timed too),
            combine: NCCL all_gather of [B, Hq, D + 1] fp32 partials + torch softmax merge.
KV GB/s = bytes of this rank's K and V shard / time. A sweep of the local kernel's knobs picks the best config.
"""

import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import triton_dist as td
from harness import record, time_us
from triton_dist.kernels.flash_decode import (choose_splits, default_config, local_flash_decode,
                                              sp_flash_decode)

HQ, HKV, D = 32, 8, 128
SHAPES = [(1, 131072), (1, 1048576), (32, 32768)]  # (B, total S)
TARGET_US = {(1, 131072): 90, (1, 1048576): 600, (32, 32768): 600}
SWEEP = [dict(block_n=64, num_warps=4, num_stages=3, programs_per_sm=2),
         dict(block_n=64, num_warps=4, num_stages=2, programs_per_sm=2),
         dict(block_n=64, num_warps=4, num_stages=4, programs_per_sm=2),
         dict(block_n=64, num_warps=4, num_stages=3, programs_per_sm=1),
         dict(block_n=64, num_warps=4, num_stages=3, programs_per_sm=3),
         dict(block_n=64, num_warps=4, num_stages=3, programs_per_sm=4),
         dict(block_n=64, num_warps=8, num_stages=3, programs_per_sm=2),
         dict(block_n=128, num_warps=4, num_stages=2, programs_per_sm=2),
         dict(block_n=128, num_warps=8, num_stages=3, programs_per_sm=2),
         dict(block_n=128, num_warps=4, num_stages=3, programs_per_sm=1),
         dict(block_n=32, num_warps=4, num_stages=4, programs_per_sm=2),
         dict(block_n=32, num_warps=2, num_stages=4, programs_per_sm=4)]


def _name(cfg):
    return "bn{block_n} w{num_warps} s{num_stages} pps{programs_per_sm}".format(**cfg)


def baseline_local(q, k, v, scale):
    """Local attention that also yields the lse a combine needs: aten flash attention (FA2 handles GQA)."""
    out = torch.ops.aten._scaled_dot_product_flash_attention(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
                                                             scale=scale)
    return out[0].squeeze(2), out[1].squeeze(-1)


def baseline_combine(o, lse, gathered):
    """NCCL all_gather of (o, lse) [B, Hq, D + 1] fp32, then the softmax merge in torch."""
    w = dist.get_world_size()
    part = torch.cat([o.float(), lse.float().unsqueeze(-1)], dim=-1)
    dist.all_gather_into_tensor(gathered, part)
    parts = gathered.view(w, *part.shape)
    lse_all = parts[..., -1]
    weight = torch.exp(lse_all - lse_all.amax(0, keepdim=True))
    return ((weight.unsqueeze(-1) * parts[..., :-1]).sum(0) / weight.sum(0).unsqueeze(-1)).to(o.dtype)


def graph_of(fn):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def main():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    td.init(backend="cuda")
    w, r = td.world_size(), td.rank()
    rows, sweep_rows = [], []
    scale = 1.0 / math.sqrt(D)
    for batch, s_total in SHAPES:
        s_local = s_total // w
        gen = torch.Generator(device="cuda").manual_seed(1000 + r)
        k = torch.randn(batch, s_local, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(batch, s_local, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16, generator=torch.Generator(
            device="cuda").manual_seed(7))
        kv_lens = torch.full((batch,), s_local, dtype=torch.int32, device="cuda")
        kv_bytes = 2 * k.numel() * k.element_size()
        gbps = lambda t: kv_bytes / t / 1e3  # noqa: E731

        # --- baseline
        try:
            o_b, lse_b = baseline_local(q, k, v, scale)
            flash_ok = True
        except Exception as exc:  # no flash kernel for this build: time F.sdpa and fake the lse
            print(f"rank {r}: aten flash attention unavailable ({exc}); baseline lse faked", flush=True)
            o_b, lse_b, flash_ok = q.clone(), torch.zeros(batch, HQ, device="cuda"), False
        gathered = torch.empty(w * batch * HQ * (D + 1), device="cuda")
        t_sdpa = time_us(lambda: F.scaled_dot_product_attention(q.unsqueeze(2), k.transpose(1, 2),
                                                                v.transpose(1, 2), enable_gqa=True))
        t_flash = time_us(lambda: baseline_local(q, k, v, scale)) if flash_ok else float("nan")
        t_nccl = time_us(lambda: baseline_combine(o_b, lse_b, gathered))
        ref = baseline_combine(o_b, lse_b, gathered) if flash_ok else None
        t_base = time_us(lambda: baseline_combine(*baseline_local(q, k, v, scale), gathered)) if flash_ok else \
            t_sdpa + t_nccl

        # --- sweep the local kernel (configs identical on every rank)
        best_cfg, best_t = None, None
        for cfg in SWEEP:
            try:  # a config that does not compile or launch (e.g. too much shared memory) is reported, not fatal
                t = time_us(lambda: local_flash_decode(q, k, v, kv_lens, config=cfg))
            except Exception as exc:
                print(f"rank {r}: config {_name(cfg)} failed: {type(exc).__name__}: {exc}"[:400], flush=True)
                torch.cuda.synchronize()
                t = float("inf")
            splits = choose_splits(batch * HKV, s_local, torch.cuda.get_device_properties(0).multi_processor_count,
                                   cfg["programs_per_sm"], cfg["block_n"])
            sweep_rows.append({"B": batch, "S total": s_total, "config": _name(cfg), "splits": splits,
                               "local us": t, "KV GB/s": gbps(t)})
            if t != float("inf") and (best_t is None or t < best_t):
                best_cfg, best_t = cfg, t

        # --- ours: default config and best config, eager and graph
        out = torch.empty_like(q)
        result = {}
        for label, cfg in (("default", None), ("best", best_cfg)):
            sp_flash_decode(q, k, v, kv_lens, out=out, config=cfg)
            torch.cuda.synchronize()
            if ref is not None:
                err = (out.float() - ref.float()).abs().max().item()
                assert err < 3e-2, f"{label} config: max error {err} vs the baseline"
            t_local = time_us(lambda: local_flash_decode(q, k, v, kv_lens, config=cfg))
            t_eager = time_us(lambda: sp_flash_decode(q, k, v, kv_lens, out=out, config=cfg))
            graph = graph_of(lambda: sp_flash_decode(q, k, v, kv_lens, out=out, config=cfg))
            t_graph = time_us(graph.replay)
            result[label] = (t_local, t_eager, t_graph)
        dflt = default_config(batch, HKV, s_local, D, "cuda",
                              torch.cuda.get_device_properties(0).multi_processor_count)
        t_local, t_eager, t_graph = result["default"]
        b_local, b_eager, b_graph = result["best"]
        target = TARGET_US[(batch, s_total)]
        rows.append({"B": batch, "S total": s_total, "S/rank": s_local,
                     "ours graph us": t_graph, "ours eager us": t_eager, "ours local us": t_local,
                     "combine overhead us": t_graph - t_local, "local KV GB/s": gbps(t_local),
                     "total KV GB/s": gbps(t_graph),
                     "best cfg": _name(best_cfg), "best graph us": b_graph, "best local us": b_local,
                     "best local KV GB/s": gbps(b_local),
                     "SDPA us": t_sdpa, "flash+lse us": t_flash, "NCCL combine us": t_nccl,
                     "baseline us": t_base, "speedup": t_base / min(t_graph, b_graph),
                     "target us": target, "meets": min(t_graph, b_graph) <= target,
                     "default cfg": _name(dflt)})
        del k, v, graph
        torch.cuda.empty_cache()
    record("flash_decode", rows, notes=f"Hq={HQ} Hkv={HKV} D={D} bf16, KV split evenly over {w} ranks; median of "
           "20, max over ranks; combine overhead = ours graph - ours local (same config); KV GB/s = shard bytes "
           "/ time")
    record("flash_decode_sweep", sweep_rows, notes="local kernel only (local_flash_decode), each config")
    td.finalize()


if __name__ == "__main__":
    main()
