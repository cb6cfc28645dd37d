"""All-reduce, GEMM + all-reduce and all-reduce + RMSNorm for tensor-parallel decode
(torchrun --nproc-per-node=N benchmarks/bench_allreduce.py), bf16.

W >= 2, every contender timed in turn (``harness.in_turn``), eager calls and replays of a CUDA graph of 10 calls:
  all_reduce, 2 KiB ... 64 MiB   ours ("auto": tuned per size bucket; one-shot; two-shot; zero-copy: x already in
                                 the heap), NCCL (dist.all_reduce in place), torch's CUDA symmetric-memory
                                 one_shot_all_reduce / two_shot_all_reduce (symmetric input, CUDA backend)
  gemm_ar, M = 1, 16, 128        ours vs cuBLAS + NCCL, cuBLAS + our all_reduce, cuBLAS alone (the floor);
                                 hidden 8192 in and out (each rank: a [M, 8192/W], w [8192, 8192/W])
  all_reduce_rmsnorm, M = 1..256 ours (bf16 / FP8 out) vs NCCL + torch add + rms_norm (+ torch FP8 quantisation),
                                 our all_reduce + torch; hidden 8192
W = 1 (or --local): the local parts on one GPU: the all-reduce kernel alone (it reads and writes x once: its HBM
  rate, against torch's copy) and all_reduce_rmsnorm against torch's add + rms_norm.
Every contender's output is checked against an fp32 reference first (ours also byte for byte across ranks and
algorithms). ``--check``: the same contenders at tiny fp32 sizes (runs on CPU ranks too).
Goals on 2xH200: ours <= 0.7x NCCL's latency at <= 1 MiB from a graph, "auto" never slower than NCCL.
"""


import torch
import torch.distributed as dist
import torch.nn.functional as F

import triton_dist as td
from triton_dist.kernels import all_reduce, all_reduce_rmsnorm, gemm_ar
from triton_dist.kernels.allreduce import all_reduce_nccl, all_reduce_rmsnorm_torch, gemm_ar_torch

AR_BYTES = [2 << 10, 8 << 10, 32 << 10, 128 << 10, 512 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
HIDDEN = 8192
GEMM_M = [1, 16, 128]
RMS_M = [1, 16, 128, 256]
LOCAL_BYTES = [1 << 20, 16 << 20, 256 << 20]
LOCAL_RMS_M = [1, 16, 128, 256, 4096]
GRAPH_CALLS = 10
EPS = 1e-6


def _rel(got, ref):
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30)).item()


def _same_on_every_rank(t, group=None):
    raw = t.contiguous().view(-1).view(torch.uint8)
    parts = [torch.empty_like(raw) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, raw, group=group)
    return all(torch.equal(p, raw) for p in parts)


def group_of_one():
    """A group of this rank alone (every rank makes every rank's, in the same order); None with one rank."""
    if td.world_size() == 1:
        return None
    return [dist.new_group([r]) for r in range(td.world_size())][td.rank()]


def _tol(dtype):
    return 1e-4 if dtype == torch.float32 else 2e-2


# ----------------------------------------------------------------------------------------------- contenders
def symm_mem_calls(x, group_name):
    """torch's CUDA symmetric-memory all-reduces of a copy of x in a symmetric buffer ({label: fn returning the
    result}); {} where torch or the backend lacks them."""
    if x.device.type != "cuda":
        return {}
    try:
        import torch.distributed._symmetric_memory as symm_mem

        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group_name)
        buf = symm_mem.empty(x.shape, dtype=x.dtype, device=x.device)
        symm_mem.rendezvous(buf, group_name)
        buf.copy_(x)
    except Exception as exc:  # noqa: BLE001 - a torch without them: the table says so
        if dist.get_rank() == 0:
            print(f"torch symmetric-memory all-reduce unavailable: {type(exc).__name__}: {exc}", flush=True)
        return {}
    ops, out = torch.ops.symm_mem, torch.empty_like(x)
    in_place = symm_mem.empty(x.shape, dtype=x.dtype, device=x.device)  # two_shot_all_reduce_ sums in place: its
    symm_mem.rendezvous(in_place, group_name)  # result grows call after call (only the first one is checked)
    in_place.copy_(x)
    calls = {"torch symm one-shot": lambda: ops.one_shot_all_reduce(buf, "sum", group_name),
             "torch symm two-shot": lambda: ops.two_shot_all_reduce_(in_place, "sum", group_name)}
    if hasattr(ops, "one_shot_all_reduce_copy"):  # copies a local input into the symmetric buffer first
        calls["torch symm one-shot copy"] = lambda: ops.one_shot_all_reduce_copy(buf, x, "sum", group_name)
    if hasattr(ops, "two_shot_all_reduce_out"):
        calls["torch symm two-shot out"] = lambda: ops.two_shot_all_reduce_out(buf, "sum", group_name, out)
    return calls


def run_once(calls, what):
    """Every contender once: ({label: fn} of those that ran, {label: a copy of its output}). One that raises
    (e.g. a torch symmetric-memory op this build lacks) is reported and left out."""
    ran, outputs = {}, {}
    for label, fn in calls.items():
        try:
            got = fn()
        except Exception as exc:  # noqa: BLE001
            if dist.get_rank() == 0:
                print(f"{what} {label} left out: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        ran[label] = fn
        outputs[label] = got.clone() if isinstance(got, torch.Tensor) else tuple(t.clone() for t in got)
    return ran, outputs


def all_reduce_contenders(numel, dtype, device, group_name):
    """({label: fn}, problems): every contender run once on the same x and checked against an fp32 reference."""
    x = torch.randn(numel, device=device).to(dtype)
    heap = td.shmem.empty((numel,), dtype, name=f"bench_allreduce.x{numel}")
    heap.copy_(x)
    out, nccl = torch.empty_like(x), x.clone()
    calls = {"ours": lambda: all_reduce(x, out), "ours one-shot": lambda: all_reduce(x, out, algo="one_shot"),
             "ours two-shot": lambda: all_reduce(x, out, algo="two_shot"),
             "ours zero-copy": lambda: all_reduce(heap, out),
             "NCCL": lambda: (dist.all_reduce(nccl), nccl)[1]}  # in place (the result grows call after call)
    calls.update(symm_mem_calls(x, group_name))
    calls, outputs = run_once(calls, f"all_reduce {numel}")
    ref = all_reduce_nccl(x.float())
    problems = [f"all_reduce {numel} {label}: relative error {_rel(got, ref):.3g}" for label, got in outputs.items()
                if _rel(got, ref) > _tol(dtype)]
    ours = {k: v for k, v in outputs.items() if k.startswith("ours ")}  # "ours" (auto) may be NCCL's order
    if not all(torch.equal(t, ours["ours one-shot"]) for t in ours.values()):
        problems.append(f"all_reduce {numel}: our algorithms disagree")
    if not _same_on_every_rank(ours["ours two-shot"]):
        problems.append(f"all_reduce {numel}: differs across ranks")
    return calls, problems


def gemm_ar_contenders(m, hidden, dtype, device):
    k = hidden // td.world_size()
    a = torch.randn(m, k, device=device).to(dtype)
    w = (torch.randn(hidden, k, device=device) / k ** 0.5).to(dtype)
    calls = {"ours": lambda: gemm_ar(a, w), "ours fused": lambda: gemm_ar(a, w, config={"path": "fused"}),
             "cuBLAS + NCCL": lambda: gemm_ar_torch(a, w), "cuBLAS + ours": lambda: all_reduce(torch.matmul(a, w.T)),
             "cuBLAS alone": lambda: torch.matmul(a, w.T)}
    calls, outputs = run_once(calls, f"gemm_ar M={m}")
    ref = all_reduce_nccl(a.float() @ w.float().T)
    problems = [f"gemm_ar M={m} {label}: relative error {_rel(got, ref):.3g}" for label, got in outputs.items()
                if label != "cuBLAS alone" and _rel(got, ref) > _tol(dtype)]
    if not _same_on_every_rank(outputs["ours fused"]):
        problems.append(f"gemm_ar M={m}: differs across ranks")
    return calls, problems


def rmsnorm_contenders(m, hidden, dtype, device, group=None):
    x = torch.randn(m, hidden, device=device).to(dtype)
    res = torch.randn(m, hidden, device=device).to(dtype)
    dist.broadcast(res, src=0)  # the replicated residual stream
    weight = torch.rand(hidden, device=device).to(dtype)
    dist.broadcast(weight, src=0)
    calls = {"ours": lambda: all_reduce_rmsnorm(x, res, weight, EPS, group=group),
             "ours fp8": lambda: all_reduce_rmsnorm(x, res, weight, EPS, out_fp8=True, group=group),
             "NCCL + torch": lambda: all_reduce_rmsnorm_torch(x, res, weight, EPS, group=group),
             "NCCL + torch fp8": lambda: all_reduce_rmsnorm_torch(x, res, weight, EPS, True, group=group),
             "ours all_reduce + torch": lambda: F.rms_norm(res + all_reduce(x, group=group), (hidden,), weight, EPS)}
    if td.world_size(group) == 1:  # the local part: the sum is x itself

        def torch_add_rms_norm():
            new_res = res + x
            return F.rms_norm(new_res, (hidden,), weight, EPS), new_res
        calls["torch add + rms_norm"] = torch_add_rms_norm
    calls, outputs = run_once(calls, f"all_reduce_rmsnorm M={m}")
    ref_normed, ref_res = all_reduce_rmsnorm_torch(x.float(), res.float(), weight.float(), EPS, group=group)
    problems = []
    for label, got in outputs.items():
        normed = got if isinstance(got, torch.Tensor) else got[0]
        if "fp8" in label:  # dequantised: within FP8's precision
            normed = normed.float() * got[2]
            bad = ((normed - ref_normed).abs() > 0.07 * ref_normed.abs() + 2 * got[2]).any().item()
        else:
            bad = _rel(normed, ref_normed) > 2 * _tol(dtype)
        if bad or (not isinstance(got, torch.Tensor) and _rel(got[1], ref_res) > _tol(dtype)):
            problems.append(f"all_reduce_rmsnorm M={m} {label}: off the reference")
    if not all(_same_on_every_rank(t, group) for t in outputs["ours fp8"]):
        problems.append(f"all_reduce_rmsnorm M={m}: differs across ranks")
    return calls, problems


def check():
    """Tiny fp32 sizes: every contender against the reference. Returns (the labels checked, the problems)."""
    dev, checked, problems = td.shmem.device(), [], []
    group_name = dist.group.WORLD.group_name
    for numel in (7, 300):
        calls, found = all_reduce_contenders(numel, torch.float32, dev, group_name)
        checked += [f"all_reduce {numel} {label}" for label in calls]
        problems += found
    single = group_of_one()  # the local part's
    for make in (lambda: gemm_ar_contenders(3, 32, torch.float32, dev),
                 lambda: rmsnorm_contenders(3, 40, torch.float32, dev),
                 lambda: rmsnorm_contenders(2, 24, torch.float32, dev, single)):
        calls, found = make()
        checked += list(calls)
        problems += found
    return checked, problems


# ----------------------------------------------------------------------------------------------- timing
def eager_and_graph(calls, rounds):
    """{"eager us: <label>": ..., "graph us: <label>": ...}: eager calls and replays of a CUDA graph of
    GRAPH_CALLS calls (per call), each set timed in turn."""
    from harness import in_turn
    from triton_dist.timing import graph_of

    eager = in_turn(calls, rounds)
    graphs = {}
    for label, fn in calls.items():
        try:
            graphs[label] = graph_of(fn, GRAPH_CALLS).replay
        except Exception as exc:  # noqa: BLE001 - NaN in the table
            if dist.get_rank() == 0:
                print(f"graph of {label} failed: {type(exc).__name__}: {exc}", flush=True)
            graphs[label] = _no_graph
    graph = in_turn(graphs, rounds)
    return {**{f"eager us: {k}": v for k, v in eager.items()},
            **{f"graph us: {k}": v / GRAPH_CALLS for k, v in graph.items()}}


def _no_graph():
    raise RuntimeError("capture failed")


def ratios(times, ours, baseline):
    return {f"{mode}: {baseline} / {ours}": times[f"{mode} us: {baseline}"] / times[f"{mode} us: {ours}"]
            for mode in ("eager", "graph")}


def timed(name, cases, make, columns, pairs, rounds, notes):
    """The table ``name``: for each case its contenders ``make(case)`` -> (calls, problems), checked, then timed
    eagerly and from graphs; ``columns(case)``: the row's first columns; ``pairs``: (ours, baseline) labels whose
    ratio baseline / ours each row gets (where both ran). Returns the problems found."""
    from harness import IN_TURN, record

    rows, problems = [], []
    for case in cases:
        calls, found = make(case)
        problems += found
        times = eager_and_graph(calls, rounds)
        rows.append({**columns(case), **times, **{k: v for ours, base in pairs if base in calls
                                                   for k, v in ratios(times, ours, base).items()}})
        del calls
        torch.cuda.empty_cache()
    record(name, rows, notes=f"bf16, W={td.world_size()}; {IN_TURN}; graph: per call in a graph of {GRAPH_CALLS}"
           + notes)
    return problems


def multi_rank(rounds):
    dev, group_name = td.shmem.device(), dist.group.WORLD.group_name
    problems = timed("all_reduce", AR_BYTES,
                     lambda nbytes: all_reduce_contenders(nbytes // 2, torch.bfloat16, dev, group_name),
                     lambda nbytes: {"bytes": nbytes},
                     [("ours", "NCCL"), ("ours", "torch symm one-shot"), ("ours", "torch symm two-shot")], rounds, "")
    problems += timed("gemm_ar", GEMM_M, lambda m: gemm_ar_contenders(m, HIDDEN, torch.bfloat16, dev),
                      lambda m: {"M": m, "N": HIDDEN, "K": HIDDEN}, [("ours", "cuBLAS + NCCL")], rounds,
                      "; full sizes (K split over the ranks)")
    problems += timed("all_reduce_rmsnorm", RMS_M, lambda m: rmsnorm_contenders(m, HIDDEN, torch.bfloat16, dev),
                      lambda m: {"M": m, "H": HIDDEN},
                      [("ours", "NCCL + torch"), ("ours fp8", "NCCL + torch fp8")], rounds, "")
    return problems


def local(rounds):
    """The local parts on this rank's GPU alone (a group of one)."""
    from harness import IN_TURN, in_turn, record

    dev, group = td.shmem.device(), group_of_one()
    rows = []
    for nbytes in LOCAL_BYTES:
        x = torch.randn(nbytes // 2, device=dev).to(torch.bfloat16)
        out = torch.empty_like(x)
        turn = in_turn({"ours": lambda: all_reduce(x, out, algo="one_shot", group=group),
                        "torch copy": lambda: out.copy_(x)}, rounds)
        rows.append({"bytes": nbytes, **{f"{k} us": v for k, v in turn.items()},
                     **{f"{k} GB/s (read + write)": 2 * nbytes / v / 1e3 for k, v in turn.items()}})
    record("all_reduce_local", rows, notes=f"bf16, one GPU (a group of one): the kernel reads x and writes out; "
           f"{IN_TURN}")
    rows, problems = [], []
    for m in LOCAL_RMS_M:
        calls, found = rmsnorm_contenders(m, HIDDEN, torch.bfloat16, dev, group)
        problems += found
        turn = in_turn({k: calls[k] for k in ("ours", "ours fp8", "torch add + rms_norm")}, rounds)
        nbytes = 4 * m * HIDDEN * 2  # x and residual read, new_residual and normed written
        rows.append({"M": m, "H": HIDDEN, **{f"{k} us": v for k, v in turn.items()},
                     "torch / ours": turn["torch add + rms_norm"] / turn["ours"],
                     "ours GB/s": nbytes / turn["ours"] / 1e3})
    record("all_reduce_rmsnorm_local", rows, notes=f"bf16, one GPU (a group of one): fused kernel vs torch add + "
           f"rms_norm; {IN_TURN}")
    return problems


def main():
    from harness import start

    args = start(__doc__, check, "all-reduce benchmark", 4 << 30,
                 lambda parser: parser.add_argument("--local", action="store_true",
                                                    help="also time the local parts at W >= 2"))
    if args is None:
        return
    problems = multi_rank(args.rounds) if td.world_size() > 1 else []
    if td.world_size() == 1 or args.local:
        problems += local(args.rounds)
    if problems and td.rank() == 0:
        print("CHECKS FAILED:\n  " + "\n  ".join(problems), flush=True)
    td.finalize()
    if problems:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
