"""Host cost of one eager call (torchrun --nproc-per-node=N benchmarks/bench_host.py), ours against the baselines.

Small shapes are decided on the host: when the GPU work of a call is ~50 µs, the Python and launch cost of the
call is what the user waits for. This measures it with the GPU kept busy (a long sleep kernel is queued first, so
the host never waits for the device and only its own cost is timed), for every op at a small shape and for the
building blocks (an empty Triton launch, a launch with tensor descriptors, torch.matmul, an NCCL call) and the
torch.ops dispatch of an op.

With HOST_PROFILE=1, rank 0 also prints a cProfile of each op's eager calls (top functions by own time).
"""

import io
import os
import pstats

import torch
import torch.distributed as dist
import triton
import triton.language as tl

import triton_dist as td
from harness import host_us, record
from triton_dist.kernels import ag_gemm, all_gather, ep_combine, ep_dispatch, gemm_rs, sp_flash_decode

CALLS = 50


@triton.jit
def _empty_kernel(a, b, c, n0, n1, n2, n3, BLOCK: tl.constexpr):
    pass


@triton.jit
def _desc_kernel(a, b, c, n0, BLOCK: tl.constexpr):
    pass


def main():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    td.init(backend="cuda", heap_size=2 << 30)
    world, me = td.world_size(), td.rank()
    profiling = os.environ.get("HOST_PROFILE") == "1" and me == 0
    dev = torch.device("cuda")
    bf = dict(dtype=torch.bfloat16, device=dev)
    cases = {}

    # building blocks
    x = torch.randn(1024, 1024, **bf)
    cases["empty triton launch (7 args)"] = (lambda: _empty_kernel[(1,)](x, x, x, 1, 2, 3, 4, BLOCK=64), None)
    from triton.tools.tensor_descriptor import TensorDescriptor

    def desc_launch():
        d = [TensorDescriptor(x, [1024, 1024], [1024, 1], [128, 64]) for _ in range(3)]
        _desc_kernel[(1,)](d[0], d[1], d[2], 5, BLOCK=64)
    cases["triton launch, 3 new descriptors"] = (desc_launch, None)
    a128 = torch.randn(128 // world, 8192, **bf)
    w4k = torch.randn(8192 // world, 8192, **bf)
    full = torch.empty(128, 8192, **bf)
    cases["torch.matmul"] = (lambda: torch.matmul(full, w4k.T), None)
    cases["NCCL all_gather_into_tensor"] = (lambda: dist.all_gather_into_tensor(full, a128), None)

    # the ops, small shapes, and their baselines
    cases["ag_gemm M=128 (ours)"] = (lambda: ag_gemm(a128, w4k), "ag_gemm")
    cases["ag_gemm M=128 (torch.ops)"] = (lambda: torch.ops.triton_dist.ag_gemm(a128, w4k, False), None)

    def ag_base():
        dist.all_gather_into_tensor(full, a128)
        return torch.matmul(full, w4k.T)
    cases["ag_gemm M=128 NCCL+cuBLAS"] = (ag_base, None)
    cases["ag_gemm M=128 graph-path"] = (lambda: ag_gemm(a128, w4k, config={"path": "graph"}), None)
    a2k = torch.randn(2048 // world, 8192, **bf)
    cases["ag_gemm M=2048 (ours)"] = (lambda: ag_gemm(a2k, w4k), "ag_gemm2048")
    cases["ag_gemm M=2048 overlap"] = (lambda: ag_gemm(a2k, w4k, config={"path": "overlap"}), "ag_gemm_overlap")

    ars = torch.randn(128, 8192 // world, **bf)
    wrs = torch.randn(8192, 8192 // world, **bf)
    rs_out = torch.empty(128 // world, 8192, **bf)
    cases["gemm_rs M=128 (ours)"] = (lambda: gemm_rs(ars, wrs), "gemm_rs")
    cases["gemm_rs M=128 overlap"] = (lambda: gemm_rs(ars, wrs, config={"path": "overlap"}), "gemm_rs_overlap")
    cases["gemm_rs M=128 graph-path"] = (lambda: gemm_rs(ars, wrs, config={"path": "graph"}), None)

    def rs_base():
        p = torch.matmul(ars, wrs.T)
        dist.reduce_scatter_tensor(rs_out, p)
        return rs_out
    cases["gemm_rs M=128 cuBLAS+NCCL"] = (rs_base, None)

    ag_in = torch.randn(1 << 19, **bf)
    cases["all_gather 1 MiB (ours)"] = (lambda: all_gather(ag_in), "all_gather")
    ag_out = torch.empty(world << 19, **bf)
    cases["all_gather 1 MiB NCCL"] = (lambda: dist.all_gather_into_tensor(ag_out, ag_in), None)

    T, H, E, K = 128, 7168, 64, 8
    xt = torch.randn(T, H, **bf)
    idx = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(T)]).to(torch.int32)
    wts = torch.rand(T, K, device=dev)

    def disp():
        return ep_dispatch(xt, idx, wts, num_experts=E, max_tokens=T)
    cases["ep_dispatch T=128 (ours)"] = (disp, "ep_dispatch")
    # combine needs the latest dispatch's handle: it is refreshed right before combine is timed
    cases["ep_combine T=128 (ours)"] = (None, "ep_combine")

    q = torch.randn(1, 32, 128, **bf)
    kc = torch.randn(1, 65536, 8, 128, **bf)
    vc = torch.randn(1, 65536, 8, 128, **bf)
    lens = torch.full((1,), 65536, dtype=torch.int32, device=dev)
    cases["sp_flash_decode B=1 S=128K (ours)"] = (lambda: sp_flash_decode(q, kc, vc, lens), "flash")

    rows = []
    for name, (fn, prof_name) in cases.items():
        if fn is None:  # ep_combine: the handle of the latest dispatch
            r = disp()
            eo = r.x.clone()
            fn = (lambda r=r, eo=eo: ep_combine(eo, r.handle))
        profs = [] if (profiling and prof_name) else None
        t = host_us(fn, CALLS, profile=profs)
        rows.append({"call": name, "host us/call": t})
        if me == 0:
            print(f"{name:45s} {t:8.1f} us", flush=True)
        if profs:
            s = io.StringIO()
            pstats.Stats(profs[0], stream=s).sort_stats("tottime").print_stats(22)
            print(f"---- cProfile {name} ({CALLS} calls), by own time\n" + s.getvalue()[-6000:], flush=True)
    record("host", rows, notes=f"W={world}; host µs per eager call with the GPU kept busy (median of 5 batches of "
                               f"{CALLS}, max over ranks); python {os.sys.version.split()[0]}")
    td.finalize()


if __name__ == "__main__":
    main()
