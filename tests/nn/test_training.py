"""Training the tensor-parallel layers (fp32, CPU ranks): every gradient against the dense module's in fp64 —
replicated mode (one loss, the same on every rank: each rank gets the whole input gradient and its shard of the
weights') and sequence-parallel mode (each rank's loss on its own rows, the objective their sum) — and a tiny
Hugging Face Llama, parallelised, trained 20 AdamW steps beside the same model trained without triton_dist: the
same loss curve and final weights; more transformers families (Mixtral with router jitter, DeepSeek-V3, OLMoE,
OLMo-2, Phi-3) against theirs; the layers under torch.compile (fullgraph; inductor on uneven and changing row
counts) and activation checkpointing."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import triton_dist as td
from triton_dist.nn import ColumnParallelLinear, RowParallelLinear, TensorParallelMLP, parallelize

from ..conftest import gpu_only
from .test_layers import GatedMLP

TOL = 1e-5


def _rel(got, ref):
    return ((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp(min=1e-30)).item()


def _shards(dense, kind, world, rank):
    """The dense module's gradients, cut as the layer holds them: {parameter name: tensor}."""
    if kind == "col":
        return {"weight": dense.weight.grad.chunk(world, 0)[rank], "bias": dense.bias.grad.chunk(world, 0)[rank]}
    if kind == "row":
        return {"weight": dense.weight.grad.chunk(world, 1)[rank], "bias": dense.bias.grad}
    gate, up = dense.gate_proj.weight.grad.chunk(world, 0)[rank], dense.up_proj.weight.grad.chunk(world, 0)[rank]
    return {"gate_up": torch.cat([gate, up]), "down": dense.down_proj.weight.grad.chunk(world, 1)[rank]}


def _layer_grads(m):
    """{case: relative error} of the input's and every parameter's gradient, both modes, on this rank."""
    world, rank = td.world_size(), td.rank()
    torch.manual_seed(3)  # the same dense modules and data on every rank
    H, I, N = 16, 8 * world, 4 * world
    dense = {"col": nn.Linear(H, N), "row": nn.Linear(N, H), "mlp": GatedMLP(H, I)}
    make = {"col": ColumnParallelLinear, "row": RowParallelLinear, "mlp": TensorParallelMLP}
    errs = {}
    for kind, module in dense.items():
        width = N if kind == "row" else H
        out_width = N if kind == "col" else H
        x = torch.randn(m, width, dtype=torch.float64)
        weighting = torch.randn(m, out_width, dtype=torch.float64)
        ref = copy.deepcopy(module).double()
        xr = x.clone().requires_grad_()
        (ref(xr) * weighting).sum().backward()
        for sp in (False, True):
            layer = make[kind].from_dense(module, sequence_parallel=sp)
            if not sp:
                xi = x.float().requires_grad_()
                (layer(xi) * weighting.float()).sum().backward()
                x_err = _rel(xi.grad, xr.grad)
            elif kind == "row":  # every row, this rank's features in; this rank's rows out
                feats = slice(rank * (N // world), (rank + 1) * (N // world))
                xi = x[:, feats].float().contiguous().requires_grad_()
                (layer(xi) * torch.tensor_split(weighting, world)[rank].float()).sum().backward()
                x_err = _rel(xi.grad, xr.grad[:, feats])
            else:  # this rank's rows in (and out, for the MLP; every row, its features, for the column layer)
                xi = torch.tensor_split(x, world)[rank].float().requires_grad_()
                if kind == "col":
                    w = weighting[:, rank * (N // world):(rank + 1) * (N // world)]
                else:
                    w = torch.tensor_split(weighting, world)[rank]
                (layer(xi, total_rows=m) * w.float()).sum().backward()
                x_err = _rel(xi.grad, torch.tensor_split(xr.grad, world)[rank])
            errs[f"{kind} sp={sp} x"] = x_err
            for name, want in _shards(ref, kind, world, rank).items():
                errs[f"{kind} sp={sp} {name}"] = _rel(getattr(layer, name).grad, want)
    return errs


@pytest.mark.parametrize("world", [1, 2, 3])
def test_layer_gradients_match_dense(ranks, world):
    for errs in ranks(world, _layer_grads, 2 * world + 1):  # rows that do not divide by the ranks
        bad = {k: v for k, v in errs.items() if not v < TOL}
        assert not bad, bad


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _batches():
    """Two token batches, the same on every rank (a replicated model); few, so that the loss can fall."""
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 64, (2, 9), generator=gen) for _ in range(2)]


def _lm_loss(model):
    return lambda ids: model(ids, labels=ids).loss


def _loss_curves(models, losses, batches, steps):
    """Each model trained ``steps`` AdamW steps (lr 1e-2) on ``batches`` in turn, on its loss (``losses``: ids ->
    loss, e.g. compiled), the models alternating within a step: their loss curves."""
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    curves = tuple([] for _ in models)
    for step in range(steps):
        ids = batches[step % len(batches)]
        for loss_of, opt, curve in zip(losses, opts, curves):
            opt.zero_grad()
            loss = loss_of(ids)
            loss.backward()
            opt.step()
            curve.append(loss.item())
    return curves


def _train(steps):
    """(loss curves of the plain and the parallelised model, largest relative difference of their final weights,
    the MLP shards compared with the plain model's slices)."""
    world, rank = td.world_size(), td.rank()
    plain = _tiny_llama()
    ours = copy.deepcopy(plain)
    parallelize(ours)
    curves = _loss_curves((plain, ours), (_lm_loss(plain), _lm_loss(ours)), _batches(), steps)
    worst = 0.0
    mine = dict(ours.named_parameters())
    for name, p in plain.named_parameters():
        if ".mlp." in name:  # gate_proj / up_proj / down_proj: this rank's slices in gate_up / down
            layer = name.rsplit(".mlp.", 1)[0] + ".mlp."
            if name.endswith("down_proj.weight"):
                got, want = mine[layer + "down"], p.chunk(world, 1)[rank]
            else:
                half = mine[layer + "gate_up"].shape[0] // 2
                gate_up = mine[layer + "gate_up"]
                got = gate_up[:half] if "gate_proj" in name else gate_up[half:]
                want = p.chunk(world, 0)[rank]
        else:
            got, want = mine[name], p
        worst = max(worst, _rel(got.detach(), want.detach()))
    return curves, worst


def test_parallelized_llama_trains_like_the_original(ranks):
    for (plain, ours), worst in ranks(2, _train, 20):
        assert plain[-1] < plain[0] - 0.5, plain  # it learned something
        assert max(abs(a - b) / abs(b) for a, b in zip(ours, plain)) < 1e-5, (ours, plain)
        assert worst < 1e-4, worst


def square_loss_grads(layer, fn, x0):
    """The gradients of ``(fn(x0) ** 2).sum()``: the input's, then each of ``layer``'s parameters'."""
    layer.zero_grad()
    x = x0.clone().requires_grad_()
    (fn(x) ** 2).sum().backward()
    return [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]


def _compiled_and_checkpointed(sp):
    """The MLP layer's gradients (input and weights) eagerly, under torch.compile(fullgraph=True) and under
    activation checkpointing: largest difference of each from the eager ones."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    layer = TensorParallelMLP.from_dense(GatedMLP(16, 32), sequence_parallel=sp)
    x0 = torch.randn(7, 16)
    if sp:
        x0 = torch.tensor_split(x0, td.world_size())[td.rank()]
    forward = (lambda x: layer(x, total_rows=7)) if sp else layer

    def grads(fn):
        return square_loss_grads(layer, fn, x0)

    eager = grads(forward)
    others = grads(torch.compile(forward, fullgraph=True)), grads(lambda x: checkpoint(forward, x, use_reentrant=False))
    return [max((a - b).abs().max().item() for a, b in zip(eager, o)) for o in others]


@pytest.mark.parametrize("sp", [False, True])
def test_layer_trains_under_compile_and_checkpointing(ranks, sp):
    for compiled, checkpointed in ranks(2, _compiled_and_checkpointed, sp):
        assert compiled < 1e-6 and checkpointed == 0.0, (compiled, checkpointed)


def _tiny_qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                         shared_expert_intermediate_size=12, num_experts=4, num_experts_per_tok=2,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, mlp_only_layers=[0],
                         max_position_embeddings=32, output_router_logits=True, router_aux_loss_coef=0.1)
    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(cfg)  # (its loss: cross-entropy + 0.1 x the load-balancing loss)


def _train_moe(steps):
    """(loss curves of the plain and the parallelised Qwen2-MoE, largest relative difference of the replicated
    parameters' final values: embeddings, attention, norms, router, shared expert gate)."""
    plain = _tiny_qwen2_moe()
    ours = copy.deepcopy(plain)
    parallelize(ours)
    curves = _loss_curves((plain, ours), (_lm_loss(plain), _lm_loss(ours)), _batches(), steps)
    names = {"mlp.gate.weight": "mlp.router.weight", "mlp.shared_expert_gate.weight": "mlp.shared_expert_gate"}
    mine = dict(ours.named_parameters())
    worst = 0.0
    for name, p in plain.named_parameters():
        if ".mlp." not in name:
            worst = max(worst, _rel(mine[name].detach(), p.detach()))
        for theirs, ours_name in names.items():
            if name.endswith(theirs):
                worst = max(worst, _rel(mine[name.replace(theirs, ours_name)].detach(), p.detach()))
    return curves, worst


def test_parallelized_moe_model_trains_like_the_original(ranks):
    """Qwen2-MoE (a dense layer and a sparse-MoE layer with a gated shared expert), experts split over 2 ranks,
    trained on its loss with the load-balancing term: the router, the experts and the shared expert all learn as
    in the original. (Weights within 1e-3 after 20
    steps: AdamW divides each gradient by its own running scale, so entries whose gradient is ~0 — the attention's
    key biases, which softmax ignores — step by ~lr on rounding noise; the first step's gradients of the router
    and the shared-expert gate agree within 2e-7, 2026-12-02.)"""
    for (plain, ours), worst in ranks(2, _train_moe, 20):
        assert plain[-1] < plain[0] - 0.5, plain
        assert max(abs(a - b) / abs(b) for a, b in zip(ours, plain)) < 1e-5, (ours, plain)
        assert worst < 1e-3, worst


def _moe_layer_trained_compiled(sp, steps, backend="aot_eager", fp8=None):
    """ExpertParallelMoE (from a Qwen2-MoE block: router, experts, gated shared expert; ``fp8``: its FP8 mode)
    trained ``steps`` AdamW steps eagerly and, a copy, under torch.compile(fullgraph=True): (loss curves equal,
    final parameters equal, largest relative difference of either)."""
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    from triton_dist.nn import ExpertParallelMoE

    world, rank = td.world_size(), td.rank()
    cfg = Qwen2MoeConfig(hidden_size=16, num_experts=2 * world, num_experts_per_tok=2, moe_intermediate_size=8,
                         shared_expert_intermediate_size=12, num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(4)  # the same block and data on every rank
    block = _randomised(Qwen2MoeSparseMoeBlock(cfg), torch.Generator().manual_seed(4), torch.float32)
    if hasattr(block.experts, "config"):
        block.experts.config._experts_implementation = "eager"
    rows = 2 * world + 1  # (not a multiple of the ranks)
    x, weighting = torch.randn(rows, 16), torch.randn(rows, 16)
    if sp:  # this rank's rows
        x, weighting = torch.tensor_split(x, world)[rank], torch.tensor_split(weighting, world)[rank]
    eager, compiled = (ExpertParallelMoE.from_dense(copy.deepcopy(block), sequence_parallel=sp, fp8=fp8)
                       for _ in range(2))

    def loss(layer):
        return lambda x: (layer(x, total_rows=rows) * weighting).sum()

    curves = _loss_curves((eager, compiled), (loss(eager), torch.compile(loss(compiled), fullgraph=True,
                                                                         backend=backend)), [x], steps)
    params = list(zip(eager.parameters(), compiled.parameters()))
    same = curves[0] == curves[1] and all(torch.equal(p, q) for p, q in params)
    worst = max([abs(a - b) / abs(b) for a, b in zip(*curves)] + [_rel(q.detach(), p.detach()) for p, q in params])
    return same, worst


@pytest.mark.parametrize("sp,fp8", [(False, None), (True, None), (True, "block")])
def test_moe_layer_trains_under_compile_fullgraph(ranks, sp, fp8):
    """The MoE layer's dispatch and combine are torch ops with their backward (``kernels/moe_ep/training.py``), and
    so is the grouped GEMM (FP8 too): compiled with fullgraph=True (aot_eager) it trains with the eager layer's
    bits."""
    pytest.importorskip("transformers")
    for same, worst in ranks(2, _moe_layer_trained_compiled, sp, 3, "aot_eager", fp8):
        assert same, worst


def _train_compiled(steps):
    """The parallelised Llama's forward under torch.compile(fullgraph=True), trained beside the eager original:
    the largest relative difference of their loss curves."""
    plain = _tiny_llama()
    ours = copy.deepcopy(plain)
    parallelize(ours)
    curves = _loss_curves((plain, ours), (_lm_loss(plain), torch.compile(_lm_loss(ours), fullgraph=True)),
                          _batches(), steps)
    return max(abs(a - b) / abs(b) for a, b in zip(*curves))


def test_parallelized_llama_trains_under_compile(ranks):
    for worst in ranks(2, _train_compiled, 5):
        assert worst < 1e-5, worst


def _train_moe_compiled(steps):
    """The parallelised Qwen2-MoE's forward under torch.compile(fullgraph=True) (the MoE ops in the graph with their
    registered backward), trained beside the eager original: the largest relative difference of the curves."""
    plain = _tiny_qwen2_moe()
    ours = copy.deepcopy(plain)
    parallelize(ours)
    with torch.no_grad():  # transformers installs its output-capturing hooks at the first call (under a lock)
        ours(_batches()[0])
    curves = _loss_curves((plain, ours), (_lm_loss(plain), torch.compile(_lm_loss(ours), fullgraph=True)),
                          _batches()[:1], steps)
    return max(abs(a - b) / abs(b) for a, b in zip(*curves))


def test_parallelized_moe_model_trains_under_compile(ranks):
    for worst in ranks(2, _train_moe_compiled, 3):
        assert worst < 1e-5, worst


# ----------------------------------------------------------------------------------------------- other HF families
FAMILIES = {  # model type: (its config beyond the common one, the blocks parallelize swaps in)
    "mixtral": (dict(intermediate_size=8, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.1,
                     output_router_logits=True, router_aux_loss_coef=0.1), {"ExpertParallelMoE": 2}),
    "deepseek_v3": (dict(num_key_value_heads=2, intermediate_size=32, moe_intermediate_size=8, n_routed_experts=4,
                         num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                         norm_topk_prob=True, routed_scaling_factor=2.5, q_lora_rank=None, kv_lora_rank=16,
                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
                    {"TensorParallelMLP": 1, "ExpertParallelMoE": 1}),
    "olmoe": (dict(intermediate_size=8, num_experts=4, num_experts_per_tok=2, output_router_logits=True,
                   router_aux_loss_coef=0.1), {"ExpertParallelMoE": 2}),
    "olmo2": (dict(intermediate_size=32), {"TensorParallelMLP": 2}),  # an MLP recognised by its form
    "phi3": (dict(intermediate_size=32), {}),  # fused gate_up_proj: left as it is
    "qwen3_moe": (dict(intermediate_size=32, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
                       output_router_logits=True, head_dim=8), {"ExpertParallelMoE": 2}),
    "glm4_moe": (dict(intermediate_size=32, moe_intermediate_size=8, n_routed_experts=4, num_experts_per_tok=2,
                      n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, head_dim=8),
                 {"TensorParallelMLP": 1, "ExpertParallelMoE": 1}),
    "qwen3": (dict(intermediate_size=32, head_dim=8), {"TensorParallelMLP": 2}),
    "mistral": (dict(intermediate_size=32), {"TensorParallelMLP": 2}),
    # its MoE block is not among the swapped ones: the dense first layer's MLP and the shared experts' are
    "deepseek_v2": (dict(num_key_value_heads=2, intermediate_size=32, moe_intermediate_size=8, n_routed_experts=4,
                         num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                         q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                         topk_method="group_limited_greedy"), {"TensorParallelMLP": 2}),
    "gpt_oss": (dict(intermediate_size=8, num_local_experts=4, num_experts_per_tok=2, head_dim=8,
                     layer_types=["full_attention", "full_attention"]), {}),  # experts with biases: left as they are
}


def _tiny_family(name):
    import transformers

    common = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=32, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    cfg = transformers.AutoConfig.for_model(name, **{**common, **FAMILIES[name][0]})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _grads_as_held(plain, ours, world, rank):
    """The largest relative difference of ``ours``'s gradients from ``plain``'s, each cut as this rank holds it
    (a TensorParallelMLP's slices of the intermediate, an ExpertParallelMoE's experts, router and shared experts)."""
    from triton_dist.nn import ExpertParallelMoE

    mine, swapped, worst = dict(ours.named_modules()), [], 0.0
    for name, m in plain.named_modules():
        if any(name.startswith(s + ".") for s in swapped):
            continue
        o = mine[name]
        if isinstance(o, TensorParallelMLP):
            g = [p.grad for p in (m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight)]
            pairs = [(o.gate_up, torch.cat([g[0].chunk(world)[rank], g[1].chunk(world)[rank]])),
                     (o.down, g[2].chunk(world, 1)[rank])]
        elif isinstance(o, ExpertParallelMoE):
            mine_e = slice(o.first_expert, o.first_expert + o.gate_up.shape[0])
            pairs = [(o.gate_up, m.experts.gate_up_proj.grad[mine_e]), (o.down, m.experts.down_proj.grad[mine_e]),
                     (o.gate.weight, m.gate.weight.grad)]
            shared = getattr(m, "shared_experts", None)
            if shared is not None:
                pairs += [(o.shared_gate_up, torch.cat([shared.gate_proj.weight.grad, shared.up_proj.weight.grad])),
                          (o.shared_down, shared.down_proj.weight.grad)]
        else:
            pairs = [(getattr(o, n), p.grad) for n, p in m.named_parameters(recurse=False)]
        if isinstance(o, (TensorParallelMLP, ExpertParallelMoE)):
            swapped.append(name)
        worst = max([worst] + [_rel(p.grad, want) for p, want in pairs])
    return worst


def _train_families(names, steps):
    """Each family's tiny model and its parallelised copy trained ``steps`` AdamW steps on batches of 15 tokens
    (uneven slices) and 16, the RNG reseeded before each forward (Mixtral's router jitter draws the same noise in
    both): {name: (the swapped blocks, the loss curves' largest relative difference, the first step's gradients')}."""
    import collections

    from triton_dist.nn import ExpertParallelMoE

    world, rank = td.world_size(), td.rank()
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 64, shape, generator=gen) for shape in ((3, 5), (2, 8))]
    found = {}
    for name in names:
        plain = _tiny_family(name)
        ours = copy.deepcopy(plain)
        parallelize(ours)
        kinds = dict(collections.Counter(type(m).__name__ for m in ours.modules()
                                         if isinstance(m, (TensorParallelMLP, ExpertParallelMoE))))
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, ours)]
        curves, grads = ([], []), None
        for step in range(steps):
            ids = batches[step % len(batches)]
            for model, opt, curve in zip((plain, ours), opts, curves):
                opt.zero_grad()
                torch.manual_seed(100 + step)
                loss = model(ids, labels=ids).loss
                loss.backward()
                curve.append(loss.item())
            if step == 0:
                grads = _grads_as_held(plain, ours, world, rank)
            for opt in opts:
                opt.step()
        found[name] = (kinds, max(abs(a - b) / abs(b) for a, b in zip(*curves)), grads)
    return found


def test_parallelized_hf_families_train_like_the_originals(ranks):
    """More transformers families at W = 2 beside the Llama and Qwen2-MoE above: Mixtral with router jitter (the
    swapped block drew none: its loss was off by 1e-3), DeepSeek-V3 (sigmoid group-limited routing, shared experts,
    a dense first layer), OLMoE, OLMo-2 (its MLP swapped by form), Phi-3 (left as it is), Qwen3-MoE, GLM-4-MoE,
    Qwen3, Mistral, DeepSeek-V2 (its MoE block left, its MLPs swapped) and gpt-oss (left): the blocks swapped, the
    same loss curve (2 steps) and the same gradients, cut as each rank holds them."""
    pytest.importorskip("transformers")
    for found in ranks(2, _train_families, list(FAMILIES), 2):
        for name, (kinds, loss_err, grad_err) in found.items():
            assert kinds == FAMILIES[name][1], (name, kinds)
            assert loss_err < 1e-5 and grad_err < 1e-4, (name, loss_err, grad_err)


def _layers_compiled_on_uneven_rows(rows_seq):
    """ExpertParallelMoE (from a Qwen2-MoE block: a shared expert, whose weights' gradient all_reduce sits beside
    the dispatch in the backward) on the first row count of ``rows_seq``, and TensorParallelMLP on each in turn (a
    second count compiles with dynamic shapes), replicated, under torch.compile (inductor, fullgraph): the largest
    relative difference of the loss and the input's gradient from the eager layer's."""
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    from triton_dist.nn import ExpertParallelMoE

    world = td.world_size()
    gen = torch.Generator().manual_seed(6)
    cfg = Qwen2MoeConfig(hidden_size=16, num_experts=2 * world, num_experts_per_tok=2, moe_intermediate_size=8,
                         shared_expert_intermediate_size=12, num_attention_heads=2, num_key_value_heads=1)
    block = _randomised(Qwen2MoeSparseMoeBlock(cfg), gen, torch.float32)
    mlp = TensorParallelMLP.from_dense(_randomised(GatedMLP(16, 16 * world), gen, torch.float32))
    worst = 0.0
    for layer, counts in ((ExpertParallelMoE.from_dense(block), rows_seq[:1]), (mlp, rows_seq)):
        def loss(x):
            return (layer(x) ** 2).sum()

        compiled = torch.compile(loss, fullgraph=True)
        for rows in counts:
            x = torch.randn(1, rows, 16, generator=gen)
            results = []
            for fn in (loss, compiled):
                xi = x.clone().requires_grad_()
                value = fn(xi)
                value.backward()
                results.append((value.detach(), xi.grad))
            worst = max([worst] + [_rel(a, b) for a, b in zip(*results)])
    return worst


def test_layers_under_inductor_on_uneven_and_changing_rows(ranks):
    """Every rank compiles the same graph (slices taken into padded tensors, ``sharding.take_rows``): with slices of
    8 and 7 rows inductor had scheduled one rank's all_reduce against its peer's dispatch (a collective mismatch);
    a new row count (dynamic shapes) had failed in gemm_rs' fake (divmod of a SymInt)."""
    pytest.importorskip("transformers")
    for worst in ranks(2, _layers_compiled_on_uneven_rows, (15, 9)):
        assert worst < 1e-5, worst


def _sp_layers_compiled_on_uneven_shards(total):
    """ExpertParallelMoE then TensorParallelMLP, sequence-parallel on shards of ``total`` rows (unequal: every
    rank's graph has sizes of its own), under torch.compile (inductor, fullgraph) with inductor's memory-driven
    reordering on to start with: (largest relative difference of the loss and the input's gradient from eager
    over 2 steps, whether tracing turned that reordering off)."""
    import torch._inductor.config as inductor_config
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    from triton_dist.nn import ExpertParallelMoE

    inductor_config.reorder_for_peak_memory = True  # (a process of the pool may have compiled before)
    world, rank = td.world_size(), td.rank()
    gen = torch.Generator().manual_seed(6)
    cfg = Qwen2MoeConfig(hidden_size=16, num_experts=2 * world, num_experts_per_tok=2, moe_intermediate_size=8,
                         shared_expert_intermediate_size=12, num_attention_heads=2, num_key_value_heads=1)
    moe = ExpertParallelMoE.from_dense(_randomised(Qwen2MoeSparseMoeBlock(cfg), gen, torch.float32),
                                       sequence_parallel=True)
    mlp = TensorParallelMLP.from_dense(_randomised(GatedMLP(16, 16 * world), gen, torch.float32),
                                       sequence_parallel=True)

    def loss(x):
        h = torch.nn.functional.layer_norm(moe(x, total_rows=total) * 2 + x, (16,))
        return (mlp(h, total_rows=total) ** 2).sum()

    compiled = torch.compile(loss, fullgraph=True)
    worst = 0.0
    for _ in range(2):
        x = torch.tensor_split(torch.randn(total, 16, generator=gen), world)[rank]
        results = []
        for fn in (loss, compiled):
            xi = x.clone().requires_grad_()
            value = fn(xi)
            value.backward()
            results.append((value.detach(), xi.grad))
        worst = max([worst] + [_rel(a, b) for a, b in zip(*results)])
    return worst, inductor_config.reorder_for_peak_memory is False


def test_sequence_parallel_layers_under_inductor_on_uneven_shards(ranks):
    """Shards of 7 and 6 rows: with inductor's memory-driven reordering, rank 0's compiled backward called an
    ag_gemm while rank 1 called an all_gather (each rank's order from its own buffer sizes); tracing the ops in a
    multi-rank job turns that pass off (``library.keep_collective_order``)."""
    pytest.importorskip("transformers")
    for worst, turned_off in ranks(2, _sp_layers_compiled_on_uneven_shards, 13):
        assert worst < 1e-5 and turned_off, (worst, turned_off)


# ----------------------------------------------------------------------------------------------- GPU, bf16
# The layers' gradients in bf16 on GPUs, held to plain torch's bf16 error on the same module (tests/kernels/
# test_autograd.py: BF16_FACTOR, BF16_FLOOR and why), both against the module in fp64; fresh random inputs and
# weights per call. Ours steps twice, first on a throwaway input (every workspace gets built), then on the input
# with the ops' workspaces poisoned before the forward and before the backward.
def _bf16_failures(errs):
    from ..kernels.test_autograd import _bf16_failures as failures

    return failures(errs)


def _weighted_loss(out, weighting):
    return (out.double() * weighting.double()).sum()  # d loss / d out = weighting: exact in bf16


def _two_poisoned_steps(layer, x, weighting, tokens, sp):
    """Ours steps twice (default configs): on a throwaway input, then on ``x`` with the ops' workspaces poisoned
    before the forward and the backward of the weighted loss. (out, the input holding its gradient)."""
    from ..kernels.test_autograd import _poison_workspaces, default_configs

    with default_configs():
        for throwaway in (True, False):
            layer.zero_grad(set_to_none=True)
            xi = (torch.randn_like(x) if throwaway else x).clone().requires_grad_()
            _poison_workspaces()
            out = layer(xi, total_rows=tokens) if sp else layer(xi)
            _poison_workspaces()
            _weighted_loss(out, weighting).backward()
    return out, xi


def _randomised(module, gen, dtype):
    """``module`` with O(1)-activation random weights (fan-in scaled), in ``dtype``."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, device=p.device, generator=gen) / p.shape[-1] ** 0.5)
    return module.to(dtype)


def _torch_grads(module, dtype, x, weighting, params):
    """A copy of ``module`` in ``dtype`` on every row: (output, x's gradient, {name: gradient of each of
    ``params``})."""
    ref = copy.deepcopy(module).to(dtype)
    xr = x.to(dtype, copy=True).requires_grad_()
    out = ref(xr)
    _weighted_loss(out, weighting).backward()
    named = dict(ref.named_parameters())
    return out, xr.grad, {name: named[name].grad for name in params}


def _compare(errs, what, ours, ref, plain):
    from ..kernels.test_autograd import _err

    errs[what] = (_err(ours, ref), _err(plain, ref))


GPU_MLP = dict(hidden=1024, inter=2816)
GPU_MOE = dict(hidden=512, experts=16, top_k=4, inter=256, shared=512)


def _gpu_mlp_grads(tokens, sp, dtype=torch.bfloat16, sizes=GPU_MLP):
    """TensorParallelMLP against the dense gated MLP: {what: (our error, plain torch's error)} of the output, the
    input's gradient and this rank's slices of the weights' gradients (``dtype`` float32 and small ``sizes``: CPU
    ranks run it too)."""

    dev, world, rank = td.shmem.device(), td.world_size(), td.rank()
    gen = torch.Generator(device=dev).manual_seed(tokens + 10 * world + sp)
    H, inter = sizes["hidden"], sizes["inter"]
    dense = _randomised(GatedMLP(H, inter).to(dev), gen, dtype)
    x = torch.randn(tokens, H, device=dev, generator=gen).to(dtype)
    weighting = torch.randn(tokens, H, device=dev, generator=gen).to(dtype)
    names = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
    ref, plain = (_torch_grads(dense, dt, x, weighting, names) for dt in (torch.float64, dtype))

    def shards(grads):  # as this rank holds them: gate_up = [gate_r; up_r], down's r-th column slice
        return {"gate_up": torch.cat([grads[n].chunk(world, 0)[rank] for n in names[:2]]),
                "down": grads[names[2]].chunk(world, 1)[rank]}

    def rows(t):  # this rank's rows in sequence-parallel mode, all of them otherwise
        return torch.tensor_split(t, world)[rank] if sp else t

    layer = TensorParallelMLP.from_dense(dense, sequence_parallel=sp)
    out, xi = _two_poisoned_steps(layer, rows(x), rows(weighting), tokens, sp)
    errs = {}
    _compare(errs, "out", out, rows(ref[0]), rows(plain[0]))
    _compare(errs, "x", xi.grad, rows(ref[1]), rows(plain[1]))
    mine, want, theirs = {n: getattr(layer, n).grad for n in ("gate_up", "down")}, shards(ref[2]), shards(plain[2])
    for name in mine:
        _compare(errs, name, mine[name], want[name], theirs[name])
    return errs


def _assert_bf16_gradients(ranks, world, check, *args):
    """``check(*args)`` on one GPU (W = 1) or on ``world`` ranks; no rank's errors over their bounds."""
    for errs in [ranks.on_one_gpu(check, *args)] if world == 1 else ranks(world, check, *args):
        assert not _bf16_failures(errs), _bf16_failures(errs)


@gpu_only
@pytest.mark.parametrize("tokens,sp", [(517, False), (517, True), (1024, False)])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_mlp_layer_gradients_bf16_on_gpus(ranks, world, tokens, sp):
    """W = 1 on one GPU; W = 2, 4 where the machine (or the several-ranks-on-one-GPU mode) has the ranks."""
    _assert_bf16_gradients(ranks, world, _gpu_mlp_grads, tokens, sp)


class _PinnedRouter(nn.Module):
    """A transformers top-k router (``gate``: its weight, ``norm_topk_prob``) with the experts of each token fixed
    to ``idx``: the references differentiate the routing our layer took, not another one where two experts'
    scores nearly tie and fp64 (or another bf16 product) orders them the other way."""

    def __init__(self, gate, idx):
        super().__init__()
        self.gate, self.idx = gate, idx

    def forward(self, h):
        logits = F.linear(h, self.gate.weight)
        probs = F.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
        top = probs.gather(1, self.idx)
        if self.gate.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), self.idx


def _gpu_moe_grads(tokens, sp, dtype=torch.bfloat16, sizes=GPU_MOE, fp8=None, recipe=None, fp8_grads=False):
    """ExpertParallelMoE made from a Qwen2-MoE block (a gated shared expert beside the routed ones) against the
    block: {what: (our error, plain torch's error)} of the output and the gradients of the input, the router,
    this rank's experts and the shared expert. ``fp8``: the layer's FP8 mode, the references' experts
    ``recipe(experts, fp8, world)`` (its recipe in torch); ``fp8_grads``: the layer's. ``dtype`` float32 and small
    ``sizes``: CPU ranks."""
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    from triton_dist.nn import ExpertParallelMoE

    dev, world, rank = td.shmem.device(), td.world_size(), td.rank()
    gen = torch.Generator(device=dev).manual_seed(tokens + 10 * world + sp)
    H = sizes["hidden"]
    cfg = Qwen2MoeConfig(hidden_size=H, num_experts=sizes["experts"], num_experts_per_tok=sizes["top_k"],
                         moe_intermediate_size=sizes["inter"], shared_expert_intermediate_size=sizes["shared"],
                         num_attention_heads=4, num_key_value_heads=4)
    block = _randomised(Qwen2MoeSparseMoeBlock(cfg).to(dev), gen, dtype)
    if hasattr(block.experts, "config"):  # the loop over experts: transformers' grouped_mm takes no fp64
        block.experts.config._experts_implementation = "eager"
    x = torch.randn(1, tokens, H, device=dev, generator=gen).to(dtype)
    weighting = torch.randn(1, tokens, H, device=dev, generator=gen).to(dtype)

    def rows(t):  # this rank's tokens in sequence-parallel mode, all of them otherwise
        return torch.tensor_split(t[0], world)[rank] if sp else t

    # ours first: the experts it routed each token to pin the references' routing

    layer = ExpertParallelMoE.from_dense(copy.deepcopy(block), sequence_parallel=sp, fp8=fp8, fp8_grads=fp8_grads)
    routed = []
    layer.gate.register_forward_hook(lambda mod, inp, out: routed.append(out[2]))
    out, xi = _two_poisoned_steps(layer, rows(x), rows(weighting), tokens, sp)
    idx = routed[-1]
    if sp:  # every rank's tokens' experts
        every = [None] * world
        torch.distributed.all_gather_object(every, idx.cpu())
        idx = torch.cat(every).to(dev)
    names = ("gate.weight", "experts.gate_up_proj", "experts.down_proj", "shared_expert.gate_proj.weight",
             "shared_expert.up_proj.weight", "shared_expert.down_proj.weight", "shared_expert_gate.weight")
    results = []
    for dt in (torch.float64, dtype):
        pinned = copy.deepcopy(block)
        pinned.gate = _PinnedRouter(pinned.gate, idx)
        if fp8 is not None:
            pinned.experts = recipe(pinned.experts, fp8, world)
        got = _torch_grads(pinned, dt, x, weighting, ["gate.gate.weight"] + list(names[1:]))
        results.append((got[0], got[1], {name: g for name, g in zip(names, got[2].values())}))
    ref, plain = results
    local = layer.gate_up.shape[0]
    mine = slice(rank * local, (rank + 1) * local)

    def held(grads):  # the gradients as this rank holds them
        return {"router": grads["gate.weight"], "gate_up": grads["experts.gate_up_proj"][mine],
                "down": grads["experts.down_proj"][mine],
                "shared_gate_up": torch.cat([grads["shared_expert.gate_proj.weight"],
                                             grads["shared_expert.up_proj.weight"]]),
                "shared_down": grads["shared_expert.down_proj.weight"],
                "shared_expert_gate": grads["shared_expert_gate.weight"]}

    errs = {}
    _compare(errs, "out", out, rows(ref[0]), rows(plain[0]))
    _compare(errs, "x", xi.grad, rows(ref[1]), rows(plain[1]))
    ours = {"router": layer.gate.weight.grad, "gate_up": layer.gate_up.grad, "down": layer.down.grad,
            "shared_gate_up": layer.shared_gate_up.grad, "shared_down": layer.shared_down.grad,
            "shared_expert_gate": layer.shared_expert_gate.grad}
    want, theirs = held(ref[2]), held(plain[2])
    for name in ours:
        _compare(errs, name, ours[name], want[name], theirs[name])
    return errs


@gpu_only
@pytest.mark.parametrize("tokens,sp", [(333, False), (333, True), (1024, False)])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_moe_layer_gradients_bf16_on_gpus(ranks, world, tokens, sp):
    """Router, experts and shared expert; W = 1 on one GPU, W = 2, 4 where the ranks are."""
    pytest.importorskip("transformers")
    _assert_bf16_gradients(ranks, world, _gpu_moe_grads, tokens, sp)
