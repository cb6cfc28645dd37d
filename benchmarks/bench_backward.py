"""Training steps: forward + backward of the ``triton_dist.nn`` layers and of ag_gemm / gemm_rs against torch's
autograd of the same computation, bf16 (torchrun --nproc-per-node=N benchmarks/bench_backward.py):

  mlp       LlamaMLP, hidden 4096, intermediate 14336, 4096 tokens   ours: TensorParallelMLP (replicated, seq-par)
  moe       Qwen3-MoE block, bench_layers' shapes                     ours: ExpertParallelMoE (replicated, seq-par)
            (HF, and HF with transformers' grouped_mm experts where it has them)
  mlp, moe also "ours fp8-<mode>" (replicated, ``fp8=mode``: FP8 forward, bf16 gradients; ``--fp8`` modes), its
            error held to FP8_TOLERANCE instead, and "ours fp8-<mode> kept": the same layer in ``fp8_weight_cache``,
            its weights quantised once (a micro-batch after the first of an optimizer step); with ``--fp8-grads``
            also "ours fp8-<mode> grads" (``fp8_grads=True``: the backward GEMMs in FP8 too) and "... grads kept"
            (the step inside the cache: the transposed weights' copies for the backward kept too)
  ag_gemm   all_gather(a) @ w.T, M x N x K full sizes                 torch: all_gather_tensor_autograd, matmul
  gemm_rs   rows_r(sum_s a_s @ w_s.T)                                 torch: matmul, reduce_scatter_tensor_autograd

A step of each contender clears the input's and the weights' gradients, runs the forward with autograd recording
and the backward of sum(out * g) (g: a fixed random output gradient). One row per contender:

  fwd+bwd us    the step
  fwd us        the forward alone, recording autograd (its graph dropped), timed in the same in-turn rounds
  bwd us        fwd+bwd - fwd: the backward alone
  <base> / ours the baseline's time over ours (above 1: ours is faster), for the step and for the backward
  path          what ran: the path of every ag_gemm / gemm_rs call of the forward and of the backward (the tuner's
                choice per shape: overlap, graph or fallback), "torch" for the baselines
  max rel err   of the output and every gradient against the baseline's (bf16 on both sides); above
                bench_layers' BF16_TOLERANCE (FP8 contenders: FP8_TOLERANCE) the row's ratios are withheld
All timed in turn (``harness.in_turn``), max over ranks. With KERNEL_PROFILE=1, rank 0 also prints each contender's
step kernel by kernel (``harness.kernel_table``). ``--check``: the same contenders at tiny fp32 sizes against
each other (runs on CPU ranks too).
"""

import contextlib
import copy
import os

import torch
import torch.distributed as dist

import triton_dist as td
from bench_layers import BF16_TOLERANCE, FULL, TINY, hf_module
from triton_dist.kernels import ag_gemm, gemm_rs

FP8_TOLERANCE = 0.15  # an FP8 layer against the bf16 one: e4m3 steps are 6 %, the SiLU gate's two products compound
OPS_FULL = [(8192, 8192, 8192), (2048, 8192, 8192)]  # (M, N, K), full sizes: a large and a small step
OPS_TINY = [(12, 24, 40)]
CASES = ("mlp", "moe", "ag_gemm", "gemm_rs")


class Step:
    """One contender: ``forward(x)`` on its own leaf ``x``, the backward of sum(out * grad); ``held`` maps
    (out, x's gradient, {name: parameter}) to {what: tensor} in this rank's layout, the same for every contender
    of a case, so that their results compare."""

    def __init__(self, forward, x, params, held, grad_of, context=None):
        self.forward, self.x, self.params, self.held = forward, x.detach().clone().requires_grad_(), params, held
        # around the forward and the backward (an empty fp8_weight_cache has len 0: falsy, yet the context)
        self.context = contextlib.nullcontext() if context is None else context
        with self.context:
            self.grad = grad_of(self.forward(self.x).detach())  # the output gradient, shaped like this one's out
        self.out = None

    def clear(self):
        self.x.grad = None
        for p in self.params.values():
            p.grad = None

    def fwd(self):
        self.clear()
        with self.context:
            return self.forward(self.x)

    def fwd_bwd(self):
        self.clear()
        with self.context:
            self.out = self.forward(self.x)
            self.out.backward(self.grad)

    def results(self):
        """{what: tensor} after a step."""
        return self.held(self.out.detach(), self.x.grad, {n: p.grad for n, p in self.params.items()})


def _own_rows(t):
    return torch.tensor_split(t.reshape(-1, t.shape[-1]), td.world_size())[td.rank()]


def _output_gradient(shape_of_full, dtype, device):
    """A fixed random gradient of the full output (the same on every rank); ``grad_of(out)`` cuts a contender's
    part: every row, or this rank's rows."""
    full = torch.randn(shape_of_full, generator=torch.Generator().manual_seed(2)).to(device, dtype)

    def grad_of(out):
        return full.reshape(out.shape) if out.numel() == full.numel() else _own_rows(full).reshape(out.shape)
    return grad_of


def tolerance(label):
    return FP8_TOLERANCE if "fp8" in label else BF16_TOLERANCE


def layer_steps(kind, sizes, tokens, dtype, device, fp8_modes=(), fp8_grads=False):
    """{label: Step} of a layer case: ours (replicated, seq-par; replicated in each of ``fp8_modes``, with
    ``fp8_grads`` also with FP8 backward GEMMs) and the HF module(s). A "kept" contender runs its steps inside one
    ``fp8_weight_cache`` of its own: from the second on, the FP8 weights quantised by the first (a micro-batch
    after the first of an optimizer step)."""
    from triton_dist.nn import fp8_weight_cache

    from triton_dist.nn import ExpertParallelMoE, TensorParallelMLP

    world, rank = td.world_size(), td.rank()
    hf = hf_module(kind, sizes, dtype, device).train()
    x = torch.randn(1, tokens, sizes["hidden"], generator=torch.Generator().manual_seed(1)).to(device, dtype)
    grad_of = _output_gradient(x.shape, dtype, device)
    layer_cls = TensorParallelMLP if kind == "mlp" else ExpertParallelMoE
    ours = layer_cls.from_dense(copy.deepcopy(hf))  # copies: a module shared with HF would sum both gradients
    ours_sp = layer_cls.from_dense(copy.deepcopy(hf), sequence_parallel=True)

    def rows(t):  # this rank's rows of a full activation (a seq-par one is already)
        t = t.reshape(-1, t.shape[-1])
        return torch.tensor_split(t, world)[rank] if t.shape[0] == tokens else t

    if kind == "mlp":
        def held_hf(out, gx, g):
            return {"out": rows(out), "x": rows(gx),
                    "gate_up": torch.cat([g["gate_proj.weight"].chunk(world, 0)[rank],
                                          g["up_proj.weight"].chunk(world, 0)[rank]]),
                    "down": g["down_proj.weight"].chunk(world, 1)[rank]}
    else:
        local = sizes["experts"] // world
        mine = slice(rank * local, (rank + 1) * local)

        def held_hf(out, gx, g):
            return {"out": rows(out), "x": rows(gx), "router": g["gate.weight"],
                    "gate_up": g["experts.gate_up_proj"][mine], "down": g["experts.down_proj"][mine]}

    def held_ours(out, gx, g):
        mine = {"out": rows(out), "x": rows(gx), "gate_up": g["gate_up"], "down": g["down"]}
        return mine if kind == "mlp" else {**mine, "router": g["gate.weight"]}

    def ours_params(layer):
        named = dict(layer.named_parameters())
        return {**named, **({"gate.weight": layer.gate.weight} if kind == "moe" else {})}

    steps = {"ours replicated": Step(ours, x, ours_params(ours), held_ours, grad_of),
             "ours seq-par": Step(lambda rows: ours_sp(rows, total_rows=tokens), _own_rows(x), ours_params(ours_sp),
                                  held_ours, grad_of),
             "HF": Step(hf, x, dict(hf.named_parameters()), held_hf, grad_of)}
    for mode in fp8_modes:
        for grads in (False, True) if fp8_grads else (False,):
            label = f"ours fp8-{mode}{' grads' if grads else ''}"
            fp8_layer = layer_cls.from_dense(copy.deepcopy(hf), fp8=mode, **({"fp8_grads": True} if grads else {}))
            steps[label] = Step(fp8_layer, x, ours_params(fp8_layer), held_ours, grad_of)
            steps[f"{label} kept"] = Step(fp8_layer, x, ours_params(fp8_layer), held_ours, grad_of,
                                          context=fp8_weight_cache())
    if kind == "moe" and hasattr(hf.experts, "config"):
        try:  # a copy of the block (its own config) with transformers' grouped_mm experts
            grouped = copy.deepcopy(hf)
            grouped.experts.config._experts_implementation = "grouped_mm"
            step = Step(grouped, x, dict(grouped.named_parameters()), held_hf, grad_of)
            step.fwd_bwd()
            steps["HF grouped_mm"] = step
        except Exception:  # this transformers / torch build has no grouped_mm experts (or not their backward)
            pass
    return steps, "HF"


def op_steps(op, m, n, k, dtype, device):
    """{label: Step} of ag_gemm or gemm_rs at full sizes (M, N, K) against torch's functional collectives."""
    from torch.distributed import _functional_collectives as funcol

    world, group = td.world_size(), dist.group.WORLD
    # (renamed *_single_autograd in newer torch; the GPU image's may have only the old names)
    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    scatter = getattr(funcol, "reduce_scatter_single_autograd", None) or funcol.reduce_scatter_tensor_autograd
    gen = torch.Generator().manual_seed(3 + td.rank())
    if op == "ag_gemm":  # this rank: a [M/W, K], w [N/W, K]; out [M, N/W]
        a = torch.randn(m // world, k, generator=gen).to(device, dtype)
        w = (torch.randn(n // world, k, generator=gen) / k ** 0.5).to(device, dtype)

        def theirs(x):
            return funcol.wait_tensor(gather(x, 0, group)) @ weights["torch"].T

        def ours(x):
            return ag_gemm(x, weights["ours"])
        out_rows = m
    else:  # this rank: a [M, K/W], w [N, K/W]; out [M/W, N]
        a = torch.randn(m, k // world, generator=gen).to(device, dtype)
        w = (torch.randn(n, k // world, generator=gen) / k ** 0.5).to(device, dtype)

        def theirs(x):
            return funcol.wait_tensor(scatter(x @ weights["torch"].T, "sum", 0, group))

        def ours(x):
            return gemm_rs(x, weights["ours"])
        out_rows = m // world
    weights = {label: w.clone().requires_grad_() for label in ("ours", "torch")}
    out_grad = torch.randn(out_rows, n // world if op == "ag_gemm" else n, generator=gen).to(device, dtype)

    def held(out, ga, g):
        return {"out": out, "a": ga, "w": g["w"]}
    return {"ours": Step(ours, a, {"w": weights["ours"]}, held, lambda out: out_grad),
            "torch": Step(theirs, a, {"w": weights["torch"]}, held, lambda out: out_grad)}, "torch"


def paths_of(step, label):
    """What one step of ``step`` ran, forward and backward."""
    from harness import recorded_paths

    if not label.startswith("ours"):
        return "torch"
    step.clear()
    with step.context:
        with recorded_paths() as fwd:
            out = step.forward(step.x)
        with recorded_paths() as bwd:
            out.backward(step.grad)
    return f"fwd: {' > '.join(fwd) or '-'}; bwd: {' > '.join(bwd) or '-'}"


def _rel(got, ref):
    if got is None or ref is None or got.shape != ref.shape:
        return float("inf")
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30)).item()


def errors(steps, baseline):
    """{label: max relative error of its output and gradients against the baseline's} after one step each."""
    for step in steps.values():
        step.fwd_bwd()
    ref = steps[baseline].results()
    return {label: max(_rel(got, ref[what]) for what, got in step.results().items())
            for label, step in steps.items() if label != baseline}


def cases(tiny, dtype, device, only=CASES, tokens=4096, fp8_modes=("row",), fp8_grads=False):
    """(case name, {label: Step}, baseline label) of every case."""
    for kind in ("mlp", "moe"):
        if kind in only:
            steps, base = layer_steps(kind, (TINY if tiny else FULL)[kind], 13 if tiny else tokens, dtype, device,
                                      fp8_modes, fp8_grads)
            yield f"{kind} {tokens if not tiny else 13} tokens", steps, base
    for op in ("ag_gemm", "gemm_rs"):
        if op in only:
            for m, n, k in OPS_TINY if tiny else OPS_FULL:
                steps, base = op_steps(op, m * td.world_size() if tiny else m, n * td.world_size() if tiny else n,
                                       k * td.world_size() if tiny else k, dtype, device)
                yield f"{op} {m}x{n}x{k}", steps, base


def check():
    """Tiny fp32 sizes: every contender's output and gradients against its baseline's (within 1e-4; FP8 ones
    within FP8_TOLERANCE). Returns (the labels checked, the problems)."""
    checked, problems = [], []
    for case, steps, base in cases(True, torch.float32, td.shmem.device(), fp8_grads=True):
        for label, err in errors(steps, base).items():
            checked.append(f"{case}: {label}")
            if not err < (FP8_TOLERANCE if "fp8" in label else 1e-4):
                problems.append(f"{case}: {label}: relative error {err:.3g}")
    return checked, problems


def main():
    from harness import IN_TURN, in_turn, kernel_table, record, start

    def add_arguments(parser):
        parser.add_argument("--only", default=",".join(CASES), help=f"comma-separated cases of {', '.join(CASES)}")
        parser.add_argument("--tokens", type=int, default=4096)
        parser.add_argument("--fp8", default="row", help="comma-separated FP8 modes of the layers' FP8 contenders")
        parser.add_argument("--fp8-grads", action="store_true",
                            help="also the layers' FP8 contenders with fp8_grads=True (FP8 backward GEMMs)")

    args = start(__doc__, check, "backward benchmark", 8 << 30, add_arguments)
    if args is None:
        return
    only = [c for c in args.only.split(",") if c]
    try:
        import transformers  # noqa: F401  (the layer baselines are its modules)
    except ImportError:
        only = [c for c in only if c not in ("mlp", "moe")]
        if td.rank() == 0:
            print("bench_backward: transformers is not installed: the layer cases are left out", flush=True)
    rows = []
    fp8_modes = [m for m in args.fp8.split(",") if m]
    for case, steps, base in cases(False, torch.bfloat16, td.shmem.device(), only, args.tokens, fp8_modes,
                                   args.fp8_grads):
        errs = errors(steps, base)  # (the first step of each: the tuner picks every shape's path here)
        paths = {label: paths_of(step, label) for label, step in steps.items()}
        timed = {}
        for label, step in steps.items():
            timed[f"{label} fwd+bwd"], timed[f"{label} fwd"] = step.fwd_bwd, step.fwd
        turn = in_turn(timed, args.rounds)
        if os.environ.get("KERNEL_PROFILE") == "1":  # where each contender's step goes, kernel by kernel
            for label, step in steps.items():
                table = kernel_table(step.fwd_bwd)
                if td.rank() == 0:
                    print(f"---- kernels of one {case} step, {label}\n{table}", flush=True)
        step_us = {label: turn[f"{label} fwd+bwd"] for label in steps}
        bwd_us = {label: turn[f"{label} fwd+bwd"] - turn[f"{label} fwd"] for label in steps}
        for label in steps:
            wrong = not errs.get(label, 0.0) < tolerance(label)  # no speed-up of a wrong result
            rows.append({"case": case, "contender": label, "fwd+bwd us": step_us[label],
                         "fwd us": turn[f"{label} fwd"], "bwd us": bwd_us[label],
                         f"{base} / ours fwd+bwd": None if wrong or label == base else step_us[base] / step_us[label],
                         f"{base} / ours bwd": None if wrong or label == base else bwd_us[base] / bwd_us[label],
                         "path": paths[label], "max rel err": errs.get(label), "wrong": "WRONG" if wrong else None})
            if wrong and td.rank() == 0:
                print(f"bench_backward {case}: WRONG results from {label} (relative error {errs[label]:.3g})",
                      flush=True)
        del steps
        torch.cuda.empty_cache()
    record("backward", rows, notes=f"bf16, W={td.world_size()}; ours vs HF modules / torch autograd; fwd and fwd+bwd "
                                   f"{IN_TURN}; bwd = fwd+bwd - fwd")
    td.finalize()


if __name__ == "__main__":
    main()
