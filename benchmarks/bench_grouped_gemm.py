"""The grouped GEMM (MoE expert products) against torch's grouped matmul and a per-expert torch.matmul loop, at an
EP=2 rank's shapes: 32 local experts, 16384 rows (4096 tokens x top-8 over 2 ranks), bf16.

  up         x [16384, 7168] @ w[e].T, w [32, 2048, 7168]          the expert input projection, plain
  gate_up    silu(x @ gate[e].T) * (x @ up[e].T), w [32, 4096, 7168]  ours fused; the baselines multiply to
             [16384, 4096] and gate in torch
  down       h [16384, 2048] @ w[e].T, w [32, 7168, 2048]          the output projection
Loads: "even" (rows spread evenly), "skewed" (half the experts empty, one expert with a quarter of the rows).

  ours             triton_dist.kernels.grouped_gemm (autotuned once per shape; offsets read on the device)
  torch grouped    torch.nn.functional.grouped_mm / torch._grouped_mm (one launch; where the torch build has it)
  torch loop       one torch.matmul per expert (reads the offsets on the host, as the per-expert loop must)
All timed in turn (``harness.in_turn``), every GPU its own (torchrun --nproc-per-node=N, or plain python: one GPU).
``--check``: every contender on tiny fp32 shapes against an fp64 reference (runs on CPU too).
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

EXPERTS, ROWS, HIDDEN, INTER = 32, 16384, 7168, 2048
PROJECTIONS = {"up": (INTER, HIDDEN, "none"), "gate_up": (2 * INTER, HIDDEN, "silu_gate"),
               "down": (HIDDEN, INTER, "none")}
LOADS = ("even", "skewed")


def group_counts(experts, rows, load, seed=0):
    """Rows per expert: even, or skewed (half the experts empty, expert 0 a quarter of the rows)."""
    gen = torch.Generator().manual_seed(seed)
    if load == "even":
        return torch.full((experts,), rows // experts).index_add_(
            0, torch.arange(rows % experts), torch.ones(rows % experts, dtype=torch.long)).tolist()
    counts = [0] * experts
    counts[0] = rows // 4
    for e in torch.randint(1, experts // 2, (rows - rows // 4,), generator=gen).tolist():
        counts[e] += 1
    return counts


def make_case(experts, rows, n, k, load, dtype, device):
    counts = group_counts(experts, rows, load)
    offsets = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device=device)
    x = torch.randn(rows, k, device=device).to(dtype)
    w = (torch.randn(experts, n, k, device=device) / k ** 0.5).to(dtype)
    return x, w, offsets


def _gate(h, activation):
    if activation != "silu_gate":
        return h
    half = h.shape[1] // 2
    return F.silu(h[:, :half]) * h[:, half:]


def contenders(x, w, offsets, activation):
    """{label: fn} computing the same [rows, N_out] result (rows outside the groups aside)."""
    from triton_dist.kernels.grouped_gemm import grouped_gemm

    n_out = w.shape[1] // 2 if activation == "silu_gate" else w.shape[1]
    out = torch.empty((x.shape[0], n_out), dtype=x.dtype, device=x.device)
    ends = offsets[1:].contiguous()
    grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    calls = {"ours": lambda: grouped_gemm(x, w, offsets, activation=activation, out=out)}
    if grouped_mm is not None:
        calls["torch grouped"] = lambda: _gate(grouped_mm(x, w.transpose(-2, -1), offs=ends), activation)

    def loop():
        bounds = offsets.tolist()
        res = torch.empty((x.shape[0], w.shape[1]), dtype=x.dtype, device=x.device)
        for e in range(w.shape[0]):
            torch.matmul(x[bounds[e]:bounds[e + 1]], w[e].T, out=res[bounds[e]:bounds[e + 1]])
        return _gate(res, activation)

    calls["torch loop"] = loop
    return calls


def check(device):
    """Every contender on small fp32 shapes (both loads, every projection kind) against fp64."""
    problems = []
    for load in LOADS:
        for name, (n, k, activation) in {"up": (24, 40, "none"), "gate_up": (48, 32, "silu_gate")}.items():
            x, w, offsets = make_case(8, 50, n, k, load, torch.float32, device)
            ref = _gate(torch.cat([x[a:b].double() @ w[e].double().T
                                   for e, (a, b) in enumerate(zip(offsets.tolist(), offsets.tolist()[1:]))]),
                        activation)
            for label, fn in contenders(x, w, offsets, activation).items():
                err = (fn().double() - ref).abs().max().item() / ref.abs().max().item()
                if not err < 1e-5:
                    problems.append(f"{label} {name} {load}: relative error {err:.3g}")
    return problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check every contender on tiny fp32 shapes")
    parser.add_argument("--rounds", type=int, default=5, help="in-turn rounds")
    args = parser.parse_args()
    if args.check or not torch.cuda.is_available():
        import triton_dist  # noqa: F401  (no GPU: the Triton interpreter)

        problems = check(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        print("grouped GEMM contenders agree" if not problems else "\n".join(problems))
        raise SystemExit(1 if problems else 0)

    from harness import in_turn, IN_TURN, record

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "RANK" not in os.environ:  # plain python: a world of one (the timers' max over ranks needs a group)
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("nccl")
    rows = []
    for name, (n, k, activation) in PROJECTIONS.items():
        for load in LOADS:
            x, w, offsets = make_case(EXPERTS, ROWS, n, k, load, torch.bfloat16, torch.device("cuda"))
            calls = contenders(x, w, offsets, activation)
            ref = calls["torch loop"]().float()
            errs = {label: ((fn().float() - ref).abs().max() / ref.abs().max()).item() for label, fn in calls.items()}
            turn = in_turn(calls, args.rounds)
            flops = 2 * ROWS * n * k
            rows.append({"projection": name, "load": load, "N": n, "K": k,
                         **{f"{label} us": t for label, t in turn.items()},
                         "ours TFLOP/s": flops / turn["ours"] / 1e6,
                         **{f"vs {label}": turn[label] / turn["ours"] for label in turn if label != "ours"},
                         "max rel err vs loop": max(errs.values())})
    record("grouped_gemm", rows, notes=f"bf16, {EXPERTS} experts, {ROWS} rows; {IN_TURN}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
