"""The transformers blocks ``parallelize`` knows, and how their weights are read (``hf.py`` swaps them).

Blocks are recognised by class (the classes the installed transformers has, ``SUPPORTED_MLPS`` /
``SUPPORTED_MOES``). Expert weights: transformers 5 stores a block's experts as fused 3-D parameters,
``experts.gate_up_proj`` [E, 2I, H] (gate rows over up rows) and ``experts.down_proj`` [E, H, I], with layout flags
(``is_transposed``, ``is_concatenated``, ``has_bias``, ``has_gate``) set by ``use_experts_implementation``; older
releases keep an ``nn.ModuleList`` of per-expert MLPs (``gate_proj``/``up_proj``/``down_proj``, or Mixtral's
``w1``/``w3``/``w2``). Both are read; any other layout is an error.
"""

import functools
import importlib

import torch
from torch import nn

from .linear import check_silu, gated_mlp_weights
from .router import Router

# (module of transformers.models, class): the dense gated MLPs (gate_proj, up_proj, down_proj, act_fn)
SUPPORTED_MLPS = [("llama.modeling_llama", "LlamaMLP"), ("mistral.modeling_mistral", "MistralMLP"),
                  ("qwen2.modeling_qwen2", "Qwen2MLP"), ("qwen3.modeling_qwen3", "Qwen3MLP"),
                  ("qwen2_moe.modeling_qwen2_moe", "Qwen2MoeMLP"), ("qwen3_moe.modeling_qwen3_moe", "Qwen3MoeMLP"),
                  ("deepseek_v3.modeling_deepseek_v3", "DeepseekV3MLP")]
SUPPORTED_MOES = [("mixtral.modeling_mixtral", "MixtralSparseMoeBlock"),
                  ("qwen2_moe.modeling_qwen2_moe", "Qwen2MoeSparseMoeBlock"),
                  ("qwen3_moe.modeling_qwen3_moe", "Qwen3MoeSparseMoeBlock"),
                  ("deepseek_v3.modeling_deepseek_v3", "DeepseekV3MoE"),
                  ("olmoe.modeling_olmoe", "OlmoeSparseMoeBlock"), ("glm4_moe.modeling_glm4_moe", "Glm4MoeMoE")]


@functools.lru_cache(maxsize=None)
def _classes(table):
    found = []
    for module, name in table:
        try:
            found.append(getattr(importlib.import_module(f"transformers.models.{module}"), name))
        except (ImportError, AttributeError):  # not in this transformers release
            continue
    return tuple(found)


def supported_classes():
    """(MLP classes, MoE classes) of the installed transformers that ``parallelize`` swaps."""
    return _classes(tuple(SUPPORTED_MLPS)), _classes(tuple(SUPPORTED_MOES))


@functools.lru_cache(maxsize=None)
def gated_mlp_form(cls):
    """Whether ``cls.forward`` is exactly a Llama-style gated MLP, ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``
    (returned, or assigned to a name that is returned), read from its source: the form of many transformers
    models' MLPs beyond the listed classes (OLMo, Granite, Cohere, Gemma's with GELU...). Whether an instance can be
    swapped (SiLU, no biases) is ``gated_mlp_weights``' business."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    fn = tree.body[0] if tree.body else None
    if not isinstance(fn, ast.FunctionDef) or len(fn.args.args) != 2 or fn.args.vararg or fn.args.kwarg:
        return False
    x = fn.args.args[1].arg
    body = [st for st in fn.body if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))]

    def call_of(node, attr, arg):  # self.<attr>(<arg>)
        return (isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords
                and isinstance(node.func, ast.Attribute) and node.func.attr == attr
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "self" and arg(node.args[0]))

    def is_x(node):
        return isinstance(node, ast.Name) and node.id == x

    def is_form(node):
        return call_of(node, "down_proj", lambda prod: isinstance(prod, ast.BinOp) and isinstance(prod.op, ast.Mult)
                       and call_of(prod.left, "act_fn", lambda g: call_of(g, "gate_proj", is_x))
                       and call_of(prod.right, "up_proj", is_x))

    if len(body) == 1:
        return isinstance(body[0], ast.Return) and is_form(body[0].value)
    return (len(body) == 2 and isinstance(body[0], ast.Assign) and len(body[0].targets) == 1
            and isinstance(body[0].targets[0], ast.Name) and is_form(body[0].value)
            and isinstance(body[1], ast.Return) and isinstance(body[1].value, ast.Name)
            and body[1].value.id == body[0].targets[0].id)


# ----------------------------------------------------------------------------------------------- reading blocks
def _router_of(gate, what):
    """Our ``Router`` with the math and weights of a block's router module."""
    kind = type(gate).__name__
    weight = gate.weight.detach()
    experts, hidden = weight.shape
    if kind == "MixtralTopKRouter":
        router = Router(hidden, experts, gate.top_k, norm_topk_prob=True, cast_weights=False, dtype=weight.dtype,
                        device=weight.device)
    elif kind in ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "OlmoeTopKRouter"):
        router = Router(hidden, experts, gate.top_k, norm_topk_prob=gate.norm_topk_prob, cast_weights=True,
                        dtype=weight.dtype, device=weight.device)
    elif kind in ("DeepseekV3TopkRouter", "Glm4MoeTopkRouter"):
        router = Router(hidden, experts, gate.top_k, scoring="sigmoid", norm_topk_prob=gate.norm_topk_prob,
                        n_group=gate.num_group, topk_group=gate.topk_group,
                        routed_scaling_factor=gate.routed_scaling_factor, score_bias=True, dtype=weight.dtype,
                        device=weight.device)
    else:
        raise ValueError(f"{what}: unknown router {kind}")
    with torch.no_grad():
        router.weight.copy_(weight)
        if router.score_bias is not None:
            router.score_bias.copy_(gate.e_score_correction_bias.detach())
    return router


def _default_apply_gate():
    try:
        from transformers.integrations.moe import _default_apply_gate as fn
    except ImportError:
        return None
    return fn


def read_experts(experts, what="experts"):
    """(gate_up [E, 2I, H], down [E, H, I]) of a block's experts, in any layout described in the module
    docstring; ValueError naming ``what`` otherwise."""
    if isinstance(experts, nn.ModuleList):
        names = [("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")]
        for gate_name, up_name, down_name in names:
            if all(hasattr(e, gate_name) and hasattr(e, up_name) and hasattr(e, down_name) for e in experts):
                gates, downs = [], []
                for i, e in enumerate(experts):
                    g, u, d = gated_mlp_weights({"gate_proj.weight": getattr(e, gate_name).weight.detach(),
                                                 "up_proj.weight": getattr(e, up_name).weight.detach(),
                                                 "down_proj.weight": getattr(e, down_name).weight.detach()},
                                                f"{what}[{i}]")
                    check_silu(e, f"{what}[{i}]")
                    gates.append(torch.cat([g, u]))
                    downs.append(d)
                return torch.stack(gates), torch.stack(downs)
        raise ValueError(f"{what}: a ModuleList of experts without gate_proj/up_proj/down_proj (or w1/w3/w2)")
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3
            and down.dim() == 3):
        raise ValueError(f"{what} ({type(experts).__name__}): unknown expert layout (expected 3-D gate_up_proj and "
                         f"down_proj parameters, or a ModuleList of expert MLPs)")
    flags = {k: getattr(experts, k, d) for k, d in (("has_bias", False), ("has_gate", True),
                                                    ("has_post_expert_norm", False))}
    if flags != {"has_bias": False, "has_gate": True, "has_post_expert_norm": False}:
        raise ValueError(f"{what}: experts with {flags} are not supported (gated, no biases, no post-expert norm)")
    default_gate = _default_apply_gate()
    if default_gate is not None and getattr(type(experts), "_apply_gate", default_gate) is not default_gate:
        raise ValueError(f"{what}: a custom expert gate ({type(experts).__name__}._apply_gate) is not supported")
    check_silu(experts, what)
    gate_up, down = gate_up.detach(), down.detach()
    if getattr(experts, "is_transposed", False):  # stored [E, H, 2I] / [E, I, H]
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    if not getattr(experts, "is_concatenated", True):  # rows interleaved gate0, up0, gate1, up1, ...
        gate_up = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)
    if gate_up.shape[1] % 2 or down.shape != (gate_up.shape[0], gate_up.shape[2], gate_up.shape[1] // 2):
        raise ValueError(f"{what}: gate_up {list(gate_up.shape)} and down {list(down.shape)} do not form experts")
    return gate_up.contiguous(), down.contiguous()


def read_moe_block(block, what=None):
    """A supported sparse-MoE block's parts: ``router`` (a ``Router``), ``gate_up``, ``down``, ``jitter_noise``
    (Mixtral's training-time input jitter, 0 for the others), and optionally ``shared`` ((gate_up, down) of the
    shared experts) and ``shared_gate`` (Qwen2-MoE's [1, H] sigmoid gate)."""
    what = what or type(block).__name__
    if not isinstance(block, supported_classes()[1]):
        raise ValueError(f"{what}: {type(block).__name__} is not a supported MoE block "
                         f"({[c for _, c in SUPPORTED_MOES]})")
    gate_up, down = read_experts(block.experts, f"{what}.experts")
    parts = {"router": _router_of(block.gate, f"{what}.gate"), "gate_up": gate_up, "down": down,
             "jitter_noise": float(getattr(block, "jitter_noise", 0.0) or 0.0)}  # Mixtral's router jitter
    if gate_up.shape[0] != parts["router"].num_experts:
        raise ValueError(f"{what}: the router scores {parts['router'].num_experts} experts, the block has "
                         f"{gate_up.shape[0]}")
    shared = getattr(block, "shared_expert", None)  # Qwen2-MoE
    if shared is None:
        shared = getattr(block, "shared_experts", None)  # DeepSeek-V3
    if shared is not None:
        g, u, d = gated_mlp_weights(shared, f"{what}.shared_expert")
        parts["shared"] = (torch.cat([g, u]), d)
    shared_gate = getattr(block, "shared_expert_gate", None)
    if shared_gate is not None:
        if shared_gate.bias is not None:
            raise ValueError(f"{what}.shared_expert_gate: a bias is not supported")
        parts["shared_gate"] = shared_gate.weight.detach()
    return parts
