"""dl.put bandwidth and signal latency on the node (torchrun --nproc-per-node=N benchmarks/bench_allgather.py).

All-gather of S bytes per rank, three ways in the same run:
  ours      triton_dist all_gather: SM stores (dl.put) straight into every peer's output + per-chunk flags
  copy eng  peer_view(out, p)[rows].copy_(x) for every peer (the copy engine), then a device barrier
  NCCL      dist.all_gather_into_tensor
Bus bandwidth = S * (W - 1) / time (bytes each rank sends; for W = 2 the rate in each direction).
Signal one-way latency: ping_pong round trips / 2.
"""

import torch
import torch.distributed as dist
import triton
import triton.language as tl

import triton_dist.language as dl

import triton_dist as td
from harness import record
from triton_dist.timing import graph_us, time_us
from triton_dist.kernels.allgather import all_gather, default_config
from triton_dist.kernels.pingpong import ping_pong

SIZES_MIB = [1, 16, 256]
CONFIGS = [dict(num_programs=p, n_chunks=p, block=b, num_warps=w)
           for p in (16, 64, 128) for b in (1024, 4096) for w in (8, 16)]


def main():
    torch.cuda.set_device(int(__import__("os").environ["LOCAL_RANK"]))
    td.init(backend="cuda", heap_size=4 << 30)
    w, r = td.world_size(), td.rank()
    rows = []
    for mib in SIZES_MIB:
        nbytes = mib << 20
        x = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
        out = td.shmem.empty((w * x.numel(),), torch.bfloat16, name="out")
        nccl_out = torch.empty_like(out)
        peers = td.shmem.peer_views(out)

        def copy_engine():
            for step in range(w):
                p = (r + step) % w
                peers[p][r * x.numel():(r + 1) * x.numel()].copy_(x)
            td.shmem.barrier()

        out.fill_(float("nan"))
        all_gather(x, out)
        torch.cuda.synchronize()
        ref = torch.empty_like(out)
        dist.all_gather_into_tensor(ref, x)
        assert torch.equal(out, ref), "all_gather mismatch"
        best, best_cfg = None, None
        for cfg in CONFIGS:
            t = time_us(lambda: all_gather(x, out, cfg))
            if best is None or t < best:
                best, best_cfg = t, cfg
        t_default = time_us(lambda: all_gather(x, out))
        t_graph = graph_us(lambda: all_gather(x, out, best_cfg))  # device time, no Python launch cost
        t_ce = time_us(copy_engine)
        t_nccl = time_us(lambda: dist.all_gather_into_tensor(nccl_out, x))
        gbps = lambda t: nbytes * (w - 1) / t / 1e3  # noqa: E731
        rows.append({"MiB/rank": mib, "ours default us": t_default, "ours best us": best, "ours graph us": t_graph,
                     "ours default GB/s": gbps(t_default), "ours best GB/s": gbps(best), "ours graph GB/s": gbps(t_graph),
                     "copy engine GB/s": gbps(t_ce), "NCCL GB/s": gbps(t_nccl),
                     "best vs CE": t_ce / best, "best vs NCCL": t_nccl / best,
                     "best config": "p{num_programs} b{block} w{num_warps}".format(**best_cfg),
                     "default config": "p{num_programs} b{block} w{num_warps}".format(
                         **default_config(nbytes, "cuda"))})
        del out, peers
    record("allgather_bandwidth", rows, notes="bus bandwidth = bytes per rank * (W-1) / time; median of 20, max over ranks")
    global _never
    _never = td.shmem.zeros((1,), torch.int32, name="never")
    iters = 2000
    t = time_us(lambda: ping_pong(iters), iters=10, warmup=2)
    record("signal_latency", [{"round trips": iters, "total us": t, "one-way us": t / (2 * iters)}],
           notes="dl.signal (release, sys) -> dl.wait (acquire poll) between GPU pairs, one program each")
    record("wait_poll_rate", [{"polls": POLLS, "us": (t := time_us(poll_until_timeout, iters=3, warmup=1)),
                                "polls per s": POLLS / t * 1e6}],
           notes="dl.wait on a flag that never comes (calibrates the wait timeout)")
    td.finalize()


POLLS = 200_000


def poll_until_timeout():
    flag = _never
    td.shmem.context()[2] = POLLS
    out = torch.zeros(1, dtype=torch.int32, device="cuda")
    _wait_kernel[(1,)](flag, out, td.shmem.context())
    td.shmem.clear_errors()
    td.shmem.set_wait_timeout(60)


@triton.jit
def _wait_kernel(flag, out, ctx):
    tl.store(out, dl.wait(flag, 1, ctx))


if __name__ == "__main__":
    main()
