"""The ``triton_dist.nn`` layers against the Hugging Face modules they replace, bf16, 4096 tokens
(torchrun --nproc-per-node=N benchmarks/bench_layers.py):

  TP MLP     LlamaMLP, hidden 4096, intermediate 14336 (Llama-3-8B's)  -> TensorParallelMLP
  EP MoE     Qwen3-MoE block, hidden 7168, 64 experts top-8, expert intermediate 2048  -> ExpertParallelMoE
             (at W=2 a rank runs bench_grouped_gemm's shapes: 32 experts, ~16384 rows)

  ours replicated   the layer as ``parallelize`` leaves it: all 4096 tokens in and out on every rank (its slice
                    computed, the output all-gathered)
  ours seq-par      the native sharded shapes: this rank's 4096/W tokens in and out (no all-gather)
  HF                the original module, whole, on every GPU (what the model ran before ``parallelize``)
  HF grouped_mm     (MoE) the same with transformers' ``grouped_mm`` experts implementation, where it has one
  Llama      a whole LlamaForCausalLM (hidden 2048, intermediate 5632, 2 layers, 16 / 4 heads, vocab 32000),
             input_ids [4, tokens / 4]  -> ``parallelize(model)`` (the MLPs swapped; attention, norms, head as
             they were): the whole forward, logits included ("ours seq-par": none, the model takes full batches)
"path ours ..." columns: the path of each ag_gemm / gemm_rs call inside (overlap / graph / fallback; "-": none,
e.g. the MoE layer). All timed in turn (``harness.in_turn``), max over ranks. ``--check``: the same contenders at tiny fp32 sizes
against each other (runs on CPU ranks too).
"""

import copy

import torch

import triton_dist as td

FULL = {"mlp": dict(hidden=4096, inter=14336), "moe": dict(hidden=7168, experts=64, top_k=8, inter=2048),
        "llama": dict(hidden=2048, inter=5632, layers=2, heads=16, kv_heads=4, vocab=32000)}
TINY = {"mlp": dict(hidden=32, inter=64), "moe": dict(hidden=32, experts=8, top_k=2, inter=16),
        "llama": dict(hidden=32, inter=64, layers=2, heads=4, kv_heads=2, vocab=97)}


def hf_module(kind, sizes, dtype, device):
    """The HF module, randomly initialised with O(1) activations, the same on every rank."""
    from transformers import LlamaConfig, Qwen3MoeConfig
    from transformers.models.llama.modeling_llama import LlamaMLP
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    heads = dict(num_attention_heads=8, num_key_value_heads=8, head_dim=sizes["hidden"] // 8)
    if kind == "mlp":
        module = LlamaMLP(LlamaConfig(hidden_size=sizes["hidden"], intermediate_size=sizes["inter"], **heads))
    else:
        module = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(
            hidden_size=sizes["hidden"], num_experts=sizes["experts"], num_experts_per_tok=sizes["top_k"],
            moe_intermediate_size=sizes["inter"], norm_topk_prob=True, **heads))
    module = module.to(device)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, device=device) / p.shape[-1] ** 0.5)
    return module.to(dtype).eval()


def llama_model(sizes, dtype, device):
    """A randomly initialised LlamaForCausalLM (O(1) activations), the same on every rank."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=sizes["vocab"], hidden_size=sizes["hidden"], intermediate_size=sizes["inter"],
                      num_hidden_layers=sizes["layers"], num_attention_heads=sizes["heads"],
                      num_key_value_heads=sizes["kv_heads"], max_position_embeddings=8192)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if p.dim() == 1 else torch.randn_like(p) / p.shape[-1] ** 0.5)
    return model.to(dtype).eval()


def model_contenders(sizes, tokens, dtype, device):
    """``contenders`` of the whole-model case: the HF model and a parallelised copy, logits compared."""
    from triton_dist.nn import parallelize

    hf = llama_model(sizes, dtype, device)
    ours = parallelize(copy.deepcopy(hf))
    batch = 4 if tokens % 4 == 0 else 1
    ids = torch.randint(0, sizes["vocab"], (batch, tokens // batch), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    calls = {"ours replicated": lambda: ours(ids).logits, "HF": lambda: hf(ids).logits}
    with torch.no_grad():
        pairs = {"ours replicated": (calls["ours replicated"](), calls["HF"]())}
    return calls, pairs


def contenders(kind, sizes, tokens, dtype, device):
    """{label: fn} of the contenders (collective: every rank calls them in the same order) and the reference
    output of each, {label: (output, reference)}."""
    from triton_dist.nn import ExpertParallelMoE, TensorParallelMLP

    if kind == "llama":
        return model_contenders(sizes, tokens, dtype, device)
    world, rank = td.world_size(), td.rank()
    hf = hf_module(kind, sizes, dtype, device)
    layer_cls = TensorParallelMLP if kind == "mlp" else ExpertParallelMoE
    ours = layer_cls.from_dense(hf)
    ours_sp = layer_cls.from_dense(hf, sequence_parallel=True)
    x = torch.randn(1, tokens, sizes["hidden"], generator=torch.Generator().manual_seed(1)).to(device, dtype)
    mine = torch.tensor_split(x[0], world)[rank].contiguous()
    calls = {"ours replicated": lambda: ours(x), "ours seq-par": lambda: ours_sp(mine, total_rows=tokens),
             "HF": lambda: hf(x)}
    if kind == "moe" and hasattr(hf.experts, "config"):
        try:  # a copy of the block (its own config) with transformers' grouped_mm experts
            hf_grouped = copy.deepcopy(hf)
            hf_grouped.experts.config._experts_implementation = "grouped_mm"
            with torch.no_grad():
                hf_grouped(x)
            calls["HF grouped_mm"] = lambda: hf_grouped(x)
        except Exception:  # this transformers / torch build has no grouped_mm experts: leave it out
            pass
    with torch.no_grad():
        ref = hf(x)
        pairs = {"ours replicated": (ours(x), ref),
                 "ours seq-par": (ours_sp(mine, total_rows=tokens), torch.tensor_split(ref[0], world)[rank])}
        if "HF grouped_mm" in calls:
            pairs["HF grouped_mm"] = (calls["HF grouped_mm"](), ref)
    return calls, pairs


BF16_TOLERANCE = 5e-2  # max relative error of a bf16 layer against the HF module's output


def _rel(got, ref):
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def check():
    """Tiny fp32 sizes: every contender's output against the HF module's (within 1e-4). Returns (the labels
    checked, the problems)."""
    from harness import path_of

    checked, problems = [], []
    for kind in ("mlp", "moe", "llama"):
        calls, pairs = contenders(kind, TINY[kind], 13, torch.float32, td.shmem.device())
        with torch.no_grad():
            path = path_of(calls["ours replicated"])
        if kind != "moe" and not path.startswith("ag_gemm "):
            problems.append(f"mlp: the path of ours replicated was not recorded ({path!r})")
        for label, (got, ref) in pairs.items():
            checked.append(f"{kind} {label}")
            if not _rel(got, ref) < 1e-4:
                problems.append(f"{kind} {label}: relative error {_rel(got, ref):.3g}")
    return checked, problems


def main():
    from harness import IN_TURN, in_turn, path_of, record, start

    def add_arguments(parser):
        parser.add_argument("--tokens", type=int, default=4096)
        parser.add_argument("--only", default="mlp,moe,llama", help="comma-separated cases of mlp, moe, llama")

    args = start(__doc__, check, "layer benchmark", 8 << 30, add_arguments)
    if args is None:
        return
    try:
        import transformers  # noqa: F401  (the baselines are its modules)
    except ImportError:
        record("layers", [], notes="not run: transformers is not installed (pip install transformers, or carry its "
               "wheel to the node)")
        td.finalize()
        return
    rows = []
    for kind in args.only.split(","):
        calls, pairs = contenders(kind, FULL[kind], args.tokens, torch.bfloat16, td.shmem.device())
        with torch.no_grad():
            turn = in_turn(calls, args.rounds)
        with torch.no_grad():
            paths = {f"path {label}": path_of(call) for label, call in calls.items() if label.startswith("ours")}
        errs = {label: _rel(*pair) for label, pair in pairs.items()}
        wrong = [label for label, err in errs.items() if not err < BF16_TOLERANCE]  # no speed-up of a wrong result
        rows.append({"layer": kind, **FULL[kind], "tokens": args.tokens, **paths,
                     **{f"{label} us": t for label, t in turn.items()},
                     **{f"HF / {label}": None if label in wrong else turn["HF"] / turn[label]
                        for label in turn if label.startswith("ours")},
                     **{f"max rel err {label}": err for label, err in errs.items()},
                     "wrong results": ", ".join(wrong) or None})
        if wrong and td.rank() == 0:
            print(f"bench_layers {kind}: WRONG results from {wrong} (relative errors {errs})", flush=True)
    record("layers", rows, notes=f"bf16, W={td.world_size()}; ours vs the HF module on one GPU; {IN_TURN}")
    td.finalize()


if __name__ == "__main__":
    main()
