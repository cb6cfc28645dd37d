"""Sequence-parallel flash-decode vs SDPA + NCCL (torchrun --nproc-per-node=N benchmarks/bench_flash_decode.py).

GQA 32 query / 8 KV heads, head dim 128, bf16; the KV cache of B sequences of total length S split evenly over the
ranks. In the same run, on the same inputs:
  ours      sp_flash_decode with the default config, replayed from a CUDA graph (how decode loops run: device
            time) and eager (host launch cost included). "local" = local_flash_decode, the same split kernel
            writing this rank's (o, lse) instead of exchanging, also timed from a graph: combine overhead =
            ours graph - local graph (same config).
  sweeps    (1) the local kernel's knobs, each timed from a CUDA graph (eager timing at (1, 128K) measured the host,
            not the kernel); (2) the combine knobs (combine="fused"/"kernel", pdl) on the default and on the best
            local config, sp_flash_decode from a graph.
  baseline  local part: aten flash attention (returns the lse the combine needs; plain F.sdpa timed too),
            combine: NCCL all_gather of [B, Hq, D + 1] fp32 partials + torch softmax merge (eager, as it runs).
KV GB/s = bytes of this rank's K and V shard / time.
"""

import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import triton_dist as td
from triton_dist import hardware
from harness import IN_TURN, in_turn, record
from triton_dist.timing import graph_of, graph_us, time_us
from triton_dist.kernels.flash_decode import local_flash_decode, resolved_config, sp_flash_decode

HQ, HKV, D = 32, 8, 128
SHAPES = [(1, 131072), (1, 1048576), (32, 32768)]  # (B, total S)
TARGET_US = {(1, 131072): 90, (1, 1048576): 600, (32, 32768): 600}
SWEEP = [dict(block_n=128, num_warps=8, num_stages=3, programs_per_sm=1),
         dict(block_n=128, num_warps=8, num_stages=3, programs_per_sm=2),
         dict(block_n=128, num_warps=8, num_stages=4, programs_per_sm=1),
         dict(block_n=128, num_warps=4, num_stages=3, programs_per_sm=1),
         dict(block_n=128, num_warps=8, num_stages=2, programs_per_sm=2),
         dict(block_n=64, num_warps=4, num_stages=3, programs_per_sm=2),
         dict(block_n=64, num_warps=4, num_stages=4, programs_per_sm=2),
         dict(block_n=64, num_warps=4, num_stages=3, programs_per_sm=3),
         dict(block_n=64, num_warps=8, num_stages=3, programs_per_sm=1),
         dict(block_n=32, num_warps=4, num_stages=4, programs_per_sm=2)]
COMBINE_SWEEP = [dict(combine="fused"), dict(combine="kernel"), dict(combine="kernel", pdl=True)]


def _name(cfg):
    if not cfg:
        return "default"
    parts = []
    if "block_n" in cfg:
        parts.append("bn{block_n} w{num_warps} s{num_stages} pps{programs_per_sm}".format(**cfg))
    if "combine" in cfg:
        parts.append(cfg["combine"] + (" pdl" if cfg.get("pdl") else ""))
    return " ".join(parts)


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


def graph_us_or_inf(fn):
    """``graph_us`` (device time, no host launch cost); inf if it fails, so that a sweep's min skips it."""
    try:
        return graph_us(fn)
    except Exception as exc:  # a config that does not compile or launch (e.g. too much shared memory): reported
        print(f"rank {dist.get_rank()}: {type(exc).__name__}: {exc}"[:400], flush=True)
        torch.cuda.synchronize()
        return float("inf")


def main():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    td.init(backend="cuda")
    w, r = td.world_size(), td.rank()
    sms = hardware.num_sms()
    rows, sweep_rows, combine_rows = [], [], []
    pdl_broken = False  # a PDL launch that failed (e.g. in graph capture) is not retried
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

        o_loc, lse_loc, out = torch.empty_like(q), torch.empty(batch, HQ, device="cuda"), torch.empty_like(q)

        def local(cfg):
            return lambda: local_flash_decode(q, k, v, kv_lens, config=cfg, out=o_loc, lse=lse_loc)

        def ours(cfg):
            return lambda: sp_flash_decode(q, k, v, kv_lens, out=out, config=cfg)

        def check(cfg):
            sp_flash_decode(q, k, v, kv_lens, out=out, config=cfg)
            torch.cuda.synchronize()
            if ref is not None:
                err = (out.float() - ref.float()).abs().max().item()
                assert err < 3e-2, f"{_name(cfg)}: max error {err} vs the baseline"

        # --- sweep the local kernel from CUDA graphs (configs identical on every rank)
        best_cfg, best_local = None, float("inf")
        for cfg in SWEEP:
            t = graph_us_or_inf(local(cfg))
            try:
                splits = resolved_config(q, k, v, kv_lens, config=cfg, distributed=False)["n_splits"]
            except Exception:
                splits = None
            sweep_rows.append({"B": batch, "S total": s_total, "config": _name(cfg), "splits": splits,
                               "local graph us": t, "KV GB/s": gbps(t)})
            if t < best_local:
                best_cfg, best_local = cfg, t

        # --- ours, default config: graph and eager, local and full
        dflt = resolved_config(q, k, v, kv_lens)
        check(None)
        t_local = graph_us_or_inf(local(None))
        t_local_eager = time_us(local(None))
        t_graph = graph_us_or_inf(ours(None))
        t_eager = time_us(ours(None))

        # --- the combine knobs, on the default and on the best local config (sp_flash_decode from graphs)
        best_graph, best_combo = t_graph, "default"
        combos = [(base, t_base_local, knobs) for knobs in COMBINE_SWEEP
                  for base, t_base_local in ((None, t_local), (best_cfg, best_local))]
        combos.sort(key=lambda c: c[2].get("pdl", False))  # PDL (untried before this run) last
        for base, t_base_local, knobs in combos:
            if knobs["combine"] == "fused" and batch * HKV >= sms:
                continue  # refused by design (waiting programs could fill the GPU)
            if knobs.get("pdl") and pdl_broken:
                continue
            cfg = {**(base or {}), **knobs}
            try:
                check(cfg)
            except AssertionError:
                raise
            except Exception as exc:
                print(f"rank {r}: {_name(cfg)} failed: {type(exc).__name__}: {exc}"[:400], flush=True)
                torch.cuda.synchronize()
                pdl_broken |= bool(knobs.get("pdl"))
                continue
            t = graph_us_or_inf(ours(cfg))
            pdl_broken |= bool(knobs.get("pdl")) and t == float("inf")
            combine_rows.append({"B": batch, "S total": s_total, "config": _name(cfg), "graph us": t,
                                 "local graph us": t_base_local, "combine overhead us": t - t_base_local,
                                 "total KV GB/s": gbps(t)})
            if t < best_graph:
                best_graph, best_combo = t, _name(cfg)

        target = TARGET_US[(batch, s_total)]
        rows.append({"B": batch, "S total": s_total, "S/rank": s_local,
                     "ours graph us": t_graph, "ours eager us": t_eager, "local graph us": t_local,
                     "local eager us": t_local_eager, "combine overhead us": t_graph - t_local,
                     "local KV GB/s": gbps(t_local), "total KV GB/s": gbps(t_graph),
                     "best local cfg": _name(best_cfg), "best local graph us": best_local,
                     "best local KV GB/s": gbps(best_local), "best cfg": best_combo, "best graph us": best_graph,
                     "SDPA us": t_sdpa, "flash+lse us": t_flash, "NCCL combine us": t_nccl,
                     "baseline us": t_base, "speedup": t_base / best_graph,
                     "target us": target, "meets": best_graph <= target,
                     "default cfg": f"{_name(dflt)} splits {dflt['n_splits']}"})
        del k, v
        torch.cuda.empty_cache()
    record("flash_decode", rows, notes=f"Hq={HQ} Hkv={HKV} D={D} bf16, KV split evenly over {w} ranks; median of "
           "20, max over ranks; graph = CUDA-graph replay (device time), eager = host launches included; combine "
           "overhead = ours graph - local graph (default config); best = fastest sp_flash_decode graph over the "
           "combine sweep; KV GB/s = shard bytes / time")
    record("flash_decode_sweep", sweep_rows, notes="local kernel only (local_flash_decode), each config, from a "
           "CUDA graph")
    record("flash_decode_combine", combine_rows, notes="sp_flash_decode from a CUDA graph: combine knobs on the "
           "default and on the best local config; overhead = graph - that config's local graph")
    record("flash_decode_index_checks", index_check_rows(), notes="local_flash_decode over a paged cache (page 16), "
           "per call in a CUDA graph of 20 calls, the device-side checks of kv_lens and page ids on and off; " + IN_TURN)
    td.finalize()


def index_check_rows(page=16):
    """The cost of the device-side index checks: the paged local kernel with check_indices on and off, in turn."""
    rows = []
    for batch, s in ((1, 131072), (32, 32768)):
        pages = batch * s // page
        k = torch.randn(pages, page, HKV, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        table = torch.randperm(pages, device="cuda", dtype=torch.int32).view(batch, s // page)
        q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
        lens = torch.full((batch,), s, dtype=torch.int32, device="cuda")
        o, lse = torch.empty_like(q), torch.empty(batch, HQ, device="cuda")

        def call(checks):
            return lambda: local_flash_decode(q, k, v, lens, block_table=table, out=o, lse=lse,
                                              config={"check_indices": checks})
        graphs = {f"checks {on}": graph_of(call(on), calls=20) for on in (True, False)}
        t = in_turn({name: g.replay for name, g in graphs.items()})
        on, off = t["checks True"] / 20, t["checks False"] / 20
        rows.append({"B": batch, "S": s, "checks on us": on, "checks off us": off, "cost": on / off - 1,
                     "within 1 %": on <= 1.01 * off})
        del k, v
    return rows


if __name__ == "__main__":
    main()
