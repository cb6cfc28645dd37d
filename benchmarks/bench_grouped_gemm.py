"""The grouped GEMM (MoE expert products) against torch's grouped matmul and a per-expert torch.matmul loop, at an
EP=2 rank's shapes: 32 local experts, 16384 rows (4096 tokens x top-8 over 2 ranks), bf16.

  up         x [16384, 7168] @ w[e].T, w [32, 2048, 7168]          the expert input projection, plain
  gate_up    silu(x @ gate[e].T) * (x @ up[e].T), w [32, 4096, 7168]  ours fused; the baselines multiply to
             [16384, 4096] and gate in torch
  down       h [16384, 2048] @ w[e].T, w [32, 7168, 2048]          the output projection
  <p> dgrad  the backward's input gradient of projection p: dy [16384, N] @ w[e] (ours: w_layout="kn", the weight
             as it lies; torch: grouped_mm on w, the loop dy_e @ w[e])
  <p> wgrad  its weight gradient: dw[e] = dy[g_e].T @ x[g_e] [32, N, K] (ours: grouped_weight_grad; torch:
             grouped_mm of dy.T and x with offsets along the rows, the loop dy_e.T @ x_e)
Loads: "even" (rows spread evenly), "skewed" (half the experts empty, one expert with a quarter of the rows).

  ours             triton_dist.kernels.grouped_gemm (autotuned once per shape; offsets read on the device)
  torch grouped    torch.nn.functional.grouped_mm / torch._grouped_mm (one launch; where the torch build has it)
  torch loop       one torch.matmul per expert (reads the offsets on the host, as the per-expert loop must)
FP8 (``--what fp8`` or ``all``): up / gate_up / down with e4m3 x and w (quantised before timing) and bf16
results, rowwise and 128-blockwise scales; groups of multiples of 16 rows (torch's scaled grouped GEMM needs them).

  ours             grouped_gemm(x8, w8, ..., scale_x=, scale_w=)
  ours bf16        the bf16 grouped GEMM of the unquantised operands (what FP8 must beat)
  torch grouped    grouped_mm in bf16 (as above)
  torch scaled     torch._scaled_grouped_mm (rowwise only; where the torch build and GPU have it)
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
               "down": (HIDDEN, INTER, "none"),
               "gate_up dgrad": (2 * INTER, HIDDEN, "dgrad"), "gate_up wgrad": (2 * INTER, HIDDEN, "wgrad"),
               "down dgrad": (HIDDEN, INTER, "dgrad"), "down wgrad": (HIDDEN, INTER, "wgrad")}
LOADS = ("even", "skewed")


def group_counts(experts, rows, load, seed=0, align=1):
    """Rows per expert: even, or skewed (half the experts empty, expert 0 a quarter of the rows); each a multiple
    of ``align`` (``rows`` one)."""
    gen = torch.Generator().manual_seed(seed)
    units = rows // align
    if load == "even":
        counts = torch.full((experts,), units // experts).index_add_(
            0, torch.arange(units % experts), torch.ones(units % experts, dtype=torch.long)).tolist()
    else:
        counts = [0] * experts
        counts[0] = units // 4
        for e in torch.randint(1, experts // 2, (units - units // 4,), generator=gen).tolist():
            counts[e] += 1
    return [c * align for c in counts]


def make_case(experts, rows, n, k, load, dtype, device, kind="none", align=1):
    """(x, w, offsets) of a projection; "dgrad": x is dy [rows, n]; "wgrad": x is (dy, x)."""
    counts = group_counts(experts, rows, load, align=align)
    offsets = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device=device)
    x = torch.randn(rows, k, device=device).to(dtype)
    w = (torch.randn(experts, n, k, device=device) / k ** 0.5).to(dtype)
    dy = torch.randn(rows, n, device=device).to(dtype)
    return {"dgrad": dy, "wgrad": (dy, x)}.get(kind, x), w, offsets


def _gate(h, activation):
    if activation != "silu_gate":
        return h
    half = h.shape[1] // 2
    return F.silu(h[:, :half]) * h[:, half:]


def contenders(x, w, offsets, activation):
    """{label: fn} computing the same result (rows outside the groups aside). activation "dgrad": ``x`` is dy
    [rows, N] and the result dy_e @ w[e]; "wgrad": ``x`` is the pair (dy, x) and the result dw [E, N, K]."""
    from triton_dist.kernels.grouped_gemm import grouped_gemm, grouped_weight_grad

    ends = offsets[1:].contiguous()
    grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    bounds = offsets.tolist()
    experts = w.shape[0]
    if activation == "wgrad":
        dy, xs = x
        calls = {"ours": lambda: grouped_weight_grad(dy, xs, offsets, None, experts),
                 "torch loop": lambda: torch.stack([dy[a:b].T @ xs[a:b] for a, b in zip(bounds, bounds[1:])])}
        if grouped_mm is not None:
            calls["torch grouped"] = lambda: grouped_mm(dy.t(), xs, offs=ends)
        return _working(calls)
    if activation == "dgrad":
        out = torch.empty((x.shape[0], w.shape[2]), dtype=x.dtype, device=x.device)
        calls = {"ours": lambda: grouped_gemm(x, w, offsets, out=out, w_layout="kn")}
        if grouped_mm is not None:
            calls["torch grouped"] = lambda: grouped_mm(x, w, offs=ends)
        calls["torch loop"] = lambda: torch.cat([x[a:b] @ w[e] for e, (a, b) in enumerate(zip(bounds, bounds[1:]))])
        return _working(calls)
    n_out = w.shape[1] // 2 if activation == "silu_gate" else w.shape[1]
    out = torch.empty((x.shape[0], n_out), dtype=x.dtype, device=x.device)
    calls = {"ours": lambda: grouped_gemm(x, w, offsets, activation=activation, out=out)}
    if grouped_mm is not None:
        calls["torch grouped"] = lambda: _gate(grouped_mm(x, w.transpose(-2, -1), offs=ends), activation)

    def loop():
        res = torch.empty((x.shape[0], w.shape[1]), dtype=x.dtype, device=x.device)
        for e in range(w.shape[0]):
            torch.matmul(x[bounds[e]:bounds[e + 1]], w[e].T, out=res[bounds[e]:bounds[e + 1]])
        return _gate(res, activation)

    calls["torch loop"] = loop
    return calls


def fp8_operands(x, w, mode):
    """x and w quantised in ``mode`` ("row" / "block": x in 1x128 groups): (x8, scale_x, w8, scale_w)."""
    from triton_dist.kernels.fp8 import quantize_fp8, quantize_stack

    return (*quantize_fp8(x, "group" if mode == "block" else "row"), *quantize_stack(w, mode))


def dequantised(x8, scale_x, w8, scale_w, mode):
    """fp64 x and w of ``fp8_operands``' results (each element times its scale)."""
    from triton_dist.kernels.fp8 import expand

    dx = x8.double() * expand(scale_x.double(), "group" if mode == "block" else "row", *x8.shape)
    dw = torch.stack([w8[e].double() * expand(scale_w[e].double(), mode, *w8.shape[1:]) for e in range(w8.shape[0])])
    return dx, dw


def fp8_contenders(x, w, offsets, activation, mode):
    """{label: fn}: the FP8 grouped GEMM of x and w quantised in ``mode`` ("row" / "block"), bf16 results, and the
    bf16 products of the unquantised operands (ours and torch's), torch's scaled grouped GEMM (rowwise)."""
    from triton_dist.kernels.grouped_gemm import grouped_gemm

    x8, scale_x, w8, scale_w = fp8_operands(x, w, mode)
    n_out = w.shape[1] // 2 if activation == "silu_gate" else w.shape[1]
    out = torch.empty((x.shape[0], n_out), dtype=torch.bfloat16, device=x.device)
    calls = {"ours": lambda: grouped_gemm(x8, w8, offsets, activation=activation, out=out, scale_x=scale_x,
                                          scale_w=scale_w),
             **{f"{label} bf16" if label == "ours" else label: fn
                for label, fn in contenders(x, w, offsets, activation).items() if label != "torch loop"}}
    scaled = getattr(torch, "_scaled_grouped_mm", None)
    if scaled is not None and mode == "row":
        ends, w8_kn, sw = offsets[1:].contiguous(), w8.transpose(-2, -1), scale_w.reshape(w.shape[0], -1)
        calls["torch scaled"] = lambda: _gate(scaled(x8, w8_kn, scale_x.reshape(-1), sw, offs=ends,
                                                     out_dtype=torch.bfloat16), activation)
    return _working(calls)


def _working(calls):
    """``calls`` without a torch contender that this build cannot run (grouped_mm's layouts differ by version)."""
    for label in [label for label in calls if label in ("torch grouped", "torch scaled")]:
        try:
            calls[label]()
        except (RuntimeError, ValueError, TypeError):
            del calls[label]
    return calls


def check(device):
    """Every contender on small fp32 shapes (both loads, every projection kind) against fp64."""
    problems = []
    for load in LOADS:
        for name, (n, k, activation) in {"up": (24, 40, "none"), "gate_up": (48, 32, "silu_gate"),
                                         "dgrad": (24, 40, "dgrad"), "wgrad": (24, 40, "wgrad")}.items():
            x, w, offsets = make_case(8, 50, n, k, load, torch.float32, device, activation)
            spans = list(enumerate(zip(offsets.tolist(), offsets.tolist()[1:])))
            if activation == "wgrad":
                ref = torch.stack([x[0][a:b].double().T @ x[1][a:b].double() for _, (a, b) in spans])
            elif activation == "dgrad":
                ref = torch.cat([x[a:b].double() @ w[e].double() for e, (a, b) in spans])
            else:
                ref = _gate(torch.cat([x[a:b].double() @ w[e].double().T for e, (a, b) in spans]), activation)
            for label, fn in contenders(x, w, offsets, activation).items():
                err = (fn().double() - ref).abs().max().item() / ref.abs().max().item()
                if not err < 1e-5:
                    problems.append(f"{label} {name} {load}: relative error {err:.3g}")
    for mode in ("row", "block"):  # FP8: ours against fp64 of its dequantised operands, the rest of the unquantised
        for name, (n, k, activation) in {"up": (24, 160, "none"), "gate_up": (48, 128, "silu_gate")}.items():
            x, w, offsets = make_case(4, 64, n, k, "skewed", torch.float32, device, align=16)
            spans = list(enumerate(zip(offsets.tolist(), offsets.tolist()[1:])))
            dx, dw = dequantised(*fp8_operands(x, w, mode), mode)
            refs = {fp8: _gate(torch.cat([a_.double() @ w_.double().T for a_, w_ in
                                          ((xs[a:b], ws[e]) for e, (a, b) in spans)]), activation)
                    for fp8, (xs, ws) in ((True, (dx, dw)), (False, (x, w)))}
            for label, fn in fp8_contenders(x, w, offsets, activation, mode).items():
                ref = refs[label == "ours"]
                err = (fn().double() - ref).abs().max().item() / ref.abs().max().item()
                if not err < 1e-2:  # bf16 results
                    problems.append(f"{label} {name} fp8-{mode}: relative error {err:.3g}")
    return problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check every contender on tiny fp32 shapes")
    parser.add_argument("--rounds", type=int, default=5, help="in-turn rounds")
    parser.add_argument("--what", choices=("bf16", "fp8", "all"), default="all", help="which rows to time")
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
    for name, (n, k, activation) in PROJECTIONS.items() if args.what != "fp8" else ():
        for load in LOADS:
            x, w, offsets = make_case(EXPERTS, ROWS, n, k, load, torch.bfloat16, torch.device("cuda"), activation)
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
    for name, (n, k, activation) in PROJECTIONS.items() if args.what != "bf16" else ():
        for load in LOADS if activation in ("none", "silu_gate") else ():
            x, w, offsets = make_case(EXPERTS, ROWS, n, k, load, torch.bfloat16, torch.device("cuda"), activation,
                                      align=16)
            for mode in ("row", "block"):
                calls = fp8_contenders(x, w, offsets, activation, mode)
                ref = calls["torch grouped"]().float() if "torch grouped" in calls else calls["ours bf16"]().float()
                errs = {label: ((fn().float() - ref).abs().max() / ref.abs().max()).item()
                        for label, fn in calls.items()}
                turn = in_turn(calls, args.rounds)
                flops = 2 * ROWS * n * k
                rows.append({"projection": f"{name} fp8-{mode}", "load": load, "N": n, "K": k,
                             **{f"{label} us": t for label, t in turn.items()},
                             "ours TFLOP/s": flops / turn["ours"] / 1e6,
                             **{f"vs {label}": turn[label] / turn["ours"] for label in turn if label != "ours"},
                             "max rel err vs bf16": max(errs.values())})
    record("grouped_gemm", rows, notes=f"bf16 (fp8 rows: e4m3 operands, bf16 out), {EXPERTS} experts, {ROWS} rows; "
                                       f"{IN_TURN}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
