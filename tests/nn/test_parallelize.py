"""``triton_dist.nn.parallelize`` on the installed transformers' blocks (fp32, CPU ranks): for every supported
MLP and sparse-MoE class the swapped block's forward equals the original's within 1e-4 at 2 and 4 ranks (token
counts that leave a rank without tokens included); a whole 2-layer model (a dense and a sparse-MoE layer with a
shared expert) gives the same logits; unsupported configurations raise a ValueError naming the module and leave
the model untouched; other models' MLPs of the same form are swapped where they are SiLU without biases and left
alone otherwise; every expert layout transformers uses is read into the same weights."""

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from triton_dist.nn import ExpertParallelMoE, TensorParallelMLP, parallelize  # noqa: E402
from triton_dist.nn.hf import read_experts, supported_classes  # noqa: E402

from ..conftest import gpu_only  # noqa: E402

H = 16
TOL = 1e-4


def _randomise(module, seed):
    """Weights of O(1) outputs (the models' own init is std 0.02: every block's output would be ~0)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:  # norms
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    return module.eval()


def _block(name):
    """A tiny instance of each supported block class."""
    from transformers import (DeepseekV3Config, LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config,
                              Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig)
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds
    from transformers.models.llama import modeling_llama
    from transformers.models.mistral import modeling_mistral
    from transformers.models.mixtral import modeling_mixtral
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen2_moe import modeling_qwen2_moe as q2m
    from transformers.models.qwen3 import modeling_qwen3
    from transformers.models.qwen3_moe import modeling_qwen3_moe as q3m

    heads = dict(num_attention_heads=2, num_key_value_heads=2)
    dense = dict(hidden_size=H, intermediate_size=16, **heads)
    moe = dict(hidden_size=H, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=8, **heads)
    ds_cfg = DeepseekV3Config(hidden_size=H, **heads, intermediate_size=16, moe_intermediate_size=8, n_routed_experts=8,
                              num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
                              routed_scaling_factor=2.5, norm_topk_prob=True)
    return {
        "LlamaMLP": lambda: modeling_llama.LlamaMLP(LlamaConfig(**dense)),
        "MistralMLP": lambda: modeling_mistral.MistralMLP(MistralConfig(**dense)),
        "Qwen2MLP": lambda: modeling_qwen2.Qwen2MLP(Qwen2Config(**dense)),
        "Qwen3MLP": lambda: modeling_qwen3.Qwen3MLP(Qwen3Config(**dense)),
        "Qwen2MoeMLP": lambda: q2m.Qwen2MoeMLP(Qwen2MoeConfig(**dense), intermediate_size=16),
        "Qwen3MoeMLP": lambda: q3m.Qwen3MoeMLP(Qwen3MoeConfig(**dense), intermediate_size=16),
        "DeepseekV3MLP": lambda: ds.DeepseekV3MLP(ds_cfg),
        "MixtralSparseMoeBlock": lambda: modeling_mixtral.MixtralSparseMoeBlock(MixtralConfig(
            hidden_size=H, intermediate_size=8, num_local_experts=8, num_experts_per_tok=2, **heads)),
        "Qwen2MoeSparseMoeBlock": lambda: q2m.Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(
            **moe, shared_expert_intermediate_size=12)),
        "Qwen3MoeSparseMoeBlock": lambda: q3m.Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**moe, norm_topk_prob=True)),
        "DeepseekV3MoE": lambda: ds.DeepseekV3MoE(ds_cfg),
        "OlmoeSparseMoeBlock": lambda: _module("olmoe", "OlmoeSparseMoeBlock")(transformers.OlmoeConfig(
            hidden_size=H, intermediate_size=8, num_experts=8, num_experts_per_tok=2, **heads)),
        "Glm4MoeMoE": lambda: _module("glm4_moe", "Glm4MoeMoE")(transformers.Glm4MoeConfig(
            hidden_size=H, **heads, intermediate_size=16, moe_intermediate_size=8, n_routed_experts=8,
            num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
            norm_topk_prob=True)),
        # not listed: recognised by the form of their forward (hf_blocks.gated_mlp_form)
        "Olmo2MLP": lambda: _module("olmo2", "Olmo2MLP")(transformers.Olmo2Config(**dense)),
        "GraniteMLP": lambda: _module("granite", "GraniteMLP")(transformers.GraniteConfig(**dense)),
        "CohereMLP": lambda: _module("cohere", "CohereMLP")(transformers.CohereConfig(**dense)),
    }[name]()


def _module(model, name):
    return getattr(__import__(f"transformers.models.{model}.modeling_{model}", fromlist=[name]), name)


BLOCKS = ["LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "Qwen2MoeMLP", "Qwen3MoeMLP", "DeepseekV3MLP",
          "MixtralSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "DeepseekV3MoE",
          "OlmoeSparseMoeBlock", "Glm4MoeMoE"]
FORM_BLOCKS = ["Olmo2MLP", "GraniteMLP", "CohereMLP"]  # other models' MLPs of the listed ones' form


def _rel(got, ref):
    return ((got.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def _swapped_blocks(names, tokens):
    """Each block, parallelised inside a holder, against its unswapped copy, for each token count."""
    errs = {}
    for i, name in enumerate(names):
        block = _randomise(_block(name), seed=i)
        holder = nn.ModuleDict({"block": copy.deepcopy(block)})
        parallelize(holder)
        kind = ExpertParallelMoE if "Moe" in name and "MLP" not in name or name == "DeepseekV3MoE" else \
            TensorParallelMLP
        if not isinstance(holder["block"], kind):
            errs[name] = f"not swapped: {type(holder['block']).__name__}"
            continue
        gen = torch.Generator().manual_seed(100 + i)
        for m in tokens:
            x = torch.randn(1, m, H, generator=gen)
            with torch.no_grad():
                errs[f"{name} m={m}"] = _rel(holder["block"](x), block(x))
    return errs


def test_every_supported_class_is_installed():
    mlps, moes = supported_classes()
    assert {c.__name__ for c in mlps + moes} == set(BLOCKS)


@pytest.mark.parametrize("world,tokens", [(2, (5,)), (4, (3,))])  # 3 tokens on 4 ranks: the last has none
def test_parallelized_blocks_match_originals(ranks, world, tokens):
    for errs in ranks(world, _swapped_blocks, BLOCKS + FORM_BLOCKS, tokens):
        bad = {k: v for k, v in errs.items() if isinstance(v, str) or v > TOL}
        assert not bad, bad


def _tiny_model():
    """Qwen2-MoE, 2 layers: layer 0 a dense gated MLP, layer 1 a sparse-MoE block with a gated shared expert."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(vocab_size=64, hidden_size=H, intermediate_size=16, moe_intermediate_size=8,
                         shared_expert_intermediate_size=12, num_experts=8, num_experts_per_tok=2,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, mlp_only_layers=[0],
                         max_position_embeddings=64)
    torch.manual_seed(0)
    return _randomise(Qwen2MoeForCausalLM(cfg), seed=0)


def _whole_model():
    model = _tiny_model()
    ref = copy.deepcopy(model)
    parallelize(model)
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    twin = copy.deepcopy(model)  # a parallelised model copies like any other
    with torch.no_grad():
        return kinds, max(_rel(model(ids).logits, ref(ids).logits), _rel(twin(ids).logits, ref(ids).logits))


def test_parallelized_model_gives_the_same_logits(ranks):
    for kinds, err in ranks(2, _whole_model):
        assert kinds == ["TensorParallelMLP", "ExpertParallelMoE"] and err < TOL, (kinds, err)


def _by_form():
    """Models whose MLP classes are not listed: OLMo-2's (SiLU) swapped, logits unchanged; Gemma's (GELU, the same
    form) left as it is, logits unchanged."""
    small = dict(vocab_size=32, hidden_size=H, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=2, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    found = {}
    for name, cfg, cls in (("olmo2", transformers.Olmo2Config(**small), transformers.Olmo2ForCausalLM),
                           ("gemma", transformers.GemmaConfig(**small, head_dim=8), transformers.GemmaForCausalLM)):
        torch.manual_seed(0)
        model = _randomise(cls(cfg), seed=1)
        ref = copy.deepcopy(model)
        parallelize(model)
        ids = torch.randint(0, 32, (1, 6), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            found[name] = (type(model.model.layers[0].mlp).__name__, _rel(model(ids).logits, ref(ids).logits) < TOL)
    return found


def test_mlps_of_the_same_form_swapped_where_they_fit(ranks):
    for found in ranks(2, _by_form):
        assert found == {"olmo2": ("TensorParallelMLP", True), "gemma": ("GemmaMLP", True)}, found


def _unsupported():
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    small = dict(vocab_size=32, hidden_size=H, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
    cases = {
        "gelu": LlamaForCausalLM(LlamaConfig(**small, intermediate_size=16, hidden_act="gelu")),
        "bias": LlamaForCausalLM(LlamaConfig(**small, intermediate_size=16, mlp_bias=True)),
        "intermediate": LlamaForCausalLM(LlamaConfig(**small, intermediate_size=15)),
        "experts": MixtralForCausalLM(MixtralConfig(**small, intermediate_size=8, num_local_experts=3,
                                                    num_experts_per_tok=2)),
        "layout": MixtralForCausalLM(MixtralConfig(**small, intermediate_size=8, num_local_experts=4,
                                                   num_experts_per_tok=2)),
    }
    cases["layout"].model.layers[0].mlp.experts = nn.Linear(H, H)  # an expert layout nobody knows
    found = {}
    for name, model in cases.items():
        before = [type(m).__name__ for m in model.modules()]
        try:
            parallelize(model)
            found[name] = "no error"
        except ValueError as exc:
            found[name] = ("layers.0.mlp" in str(exc), [type(m).__name__ for m in model.modules()] == before)
    return found


def test_unsupported_configs_raise_naming_the_module(ranks):
    for found in ranks(2, _unsupported):
        assert found == {k: (True, True) for k in ("gelu", "bias", "intermediate", "experts", "layout")}, found


class _FusedExperts(nn.Module):
    def __init__(self, gate_up, down, **flags):
        super().__init__()
        self.gate_up_proj, self.down_proj = nn.Parameter(gate_up), nn.Parameter(down)
        self.act_fn = nn.SiLU()
        self.__dict__.update(flags)


class _Expert(nn.Module):
    def __init__(self, gate, up, down):
        super().__init__()
        self.w1, self.w3, self.w2 = (nn.Linear(t.shape[1], t.shape[0], bias=False) for t in (gate, up, down))
        with torch.no_grad():
            self.w1.weight.copy_(gate)
            self.w3.weight.copy_(up)
            self.w2.weight.copy_(down)


def test_every_expert_layout_reads_the_same_weights():
    E, I = 3, 4
    gate, up, down = torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, H, I)
    want = (torch.cat([gate, up], dim=1), down)
    interleaved = torch.stack([gate, up], dim=2).reshape(E, 2 * I, H)
    layouts = {
        "fused": _FusedExperts(*want),
        "transposed": _FusedExperts(want[0].transpose(1, 2).clone(), down.transpose(1, 2).clone(), is_transposed=True),
        "interleaved": _FusedExperts(interleaved, down.clone(), is_concatenated=False),
        "module list": nn.ModuleList(_Expert(gate[e], up[e], down[e]) for e in range(E)),
    }
    for name, experts in layouts.items():
        got = read_experts(experts, name)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name
    for bad in (_FusedExperts(*want, has_bias=True), nn.ModuleList([nn.Linear(2, 2)]), nn.Linear(2, 2)):
        with pytest.raises(ValueError):
            read_experts(bad)


# ----------------------------------------------------------------------------------------------- GPU
def _hf_model(name, hidden=64):
    """A small causal LM of each family parallelize swaps blocks in (2 layers; OLMo-2: MLPs recognised by form; the
    MoE ones: a dense layer too where the family has one, shared experts where it has them)."""
    from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM, MixtralConfig,
                              MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    common = dict(vocab_size=128, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024)
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    cfg, cls = {
        "llama": (LlamaConfig(**common, intermediate_size=96), LlamaForCausalLM),
        "olmo2": (transformers.Olmo2Config(**common, intermediate_size=96, pad_token_id=0, bos_token_id=0,
                                           eos_token_id=0), transformers.Olmo2ForCausalLM),
        "olmoe": (transformers.OlmoeConfig(**common, intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                                           pad_token_id=0, bos_token_id=0, eos_token_id=0),
                  transformers.OlmoeForCausalLM),
        "glm4_moe": (transformers.Glm4MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32,
                                                n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                                                n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True,
                                                pad_token_id=0, bos_token_id=0, eos_token_id=0),
                     transformers.Glm4MoeForCausalLM),
        "mixtral": (MixtralConfig(**common, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2),
                    MixtralForCausalLM),
        "qwen2_moe": (Qwen2MoeConfig(**common, intermediate_size=96, **moe, shared_expert_intermediate_size=48,
                                     mlp_only_layers=[0]), Qwen2MoeForCausalLM),
        "qwen3_moe": (Qwen3MoeConfig(**common, intermediate_size=96, **moe, norm_topk_prob=True),
                      Qwen3MoeForCausalLM),
        "deepseek_v3": (DeepseekV3Config(**{**common, "num_key_value_heads": 4}, intermediate_size=96,
                                         moe_intermediate_size=32, n_routed_experts=8,
                                         num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
                                         first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32,
                                         qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16),
                        DeepseekV3ForCausalLM),
    }[name]
    torch.manual_seed(0)
    return _randomise(cls(cfg), seed=1)


MODELS = ["llama", "olmo2", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "olmoe", "glm4_moe"]


def _gpu_models(names, dtypes, shapes):
    """Per (model, dtype, batch x seq): (the parallelised model's logits error, the HF model's own error in that
    dtype), both against the HF model in fp64 on the GPU, and the block kinds swapped in."""
    from triton_dist import shmem

    dev = shmem.device()
    out = {}
    for name in names:
        base = _hf_model(name).to(dev)
        ref64 = copy.deepcopy(base).double()
        if hasattr(ref64, "set_experts_implementation"):  # (torch's grouped_mm, the default, takes no fp64)
            ref64.set_experts_implementation("eager")
        for dtype in dtypes:
            hf = copy.deepcopy(base).to(dtype)
            ours = copy.deepcopy(hf)
            parallelize(ours)
            kinds = sorted({type(layer.mlp).__name__ for layer in ours.model.layers})
            for b, s in shapes:
                ids = torch.randint(0, 128, (b, s), device=dev, generator=torch.Generator(dev).manual_seed(b * s))
                with torch.no_grad():
                    ref = ref64(ids).logits
                    out[f"{name} {str(dtype)[6:]} {b}x{s}"] = (_rel(ours(ids).logits, ref), _rel(hf(ids).logits, ref),
                                                              kinds)
    return out


@gpu_only
@pytest.mark.long
@pytest.mark.parametrize("name", MODELS)
def test_parallelized_models_on_gpus(ranks, name):
    """Whole HF models parallelised on every GPU of the run (one GPU: groups of one), bf16, fp16 and fp32, a few
    tokens and more than 512 (the MoE ops' chunked path): logits as close to the fp64 model as the HF model's own
    in that dtype (2x its error; fp32: 1e-4 at least)."""
    shapes = [(2, 7), (3, 300)]
    dtypes = [torch.bfloat16, torch.float32] + ([torch.float16] if name in ("llama", "qwen2_moe") else [])
    for res in ranks(ranks.gpu_world, _gpu_models, [name], dtypes, shapes):
        bad = {k: v for k, v in res.items() if not (v[0] <= max(2 * v[1], 1e-4)) or
               not set(v[2]) <= {"TensorParallelMLP", "ExpertParallelMoE"} or "ExpertParallelMoE" not in v[2] and
               name not in ("llama", "olmo2")}
        assert not bad, bad
