"""Parallelising a Hugging Face ``transformers`` model: its MLP and sparse-MoE blocks swapped in place for ours.

    model = AutoModelForCausalLM.from_config(config)    # every rank builds the same model (same weights)
    triton_dist.nn.parallelize(model)                   # gated MLPs -> TensorParallelMLP, MoE -> ExpertParallelMoE
    logits = model(input_ids).logits                    # the same logits on every rank, as before

Blocks are recognised by class (the classes the installed transformers has, ``SUPPORTED_MLPS`` /
``SUPPORTED_MOES``), and other models' MLPs by form (``hf_blocks.gated_mlp_form``: a forward that is exactly
``down_proj(act_fn(gate_proj(x)) * up_proj(x))``; swapped where the activation is SiLU and there are no biases, else
left as they are, e.g. Gemma's GELU MLPs); everything else (attention, norms, embeddings) stays replicated, so a
swapped block gets the full activations on every rank and returns the full output (``sequence_parallel=False``,
``sharding.py``). Every block is read and checked before any is swapped: a listed one that cannot be (an activation
other than SiLU, biases, an intermediate size or expert count the group does not divide, an unknown expert layout)
raises a ValueError naming the module, and leaves the model untouched.

The catalogue of blocks and the readers of their weights: ``hf_blocks.py``.
"""

from torch import nn

from .hf_blocks import gated_mlp_form, read_experts, read_moe_block, supported_classes  # noqa: F401
# (read_*: re-exported)
from ..kernels.fp8 import check_fp8_grads, check_mode
from .linear import TensorParallelMLP, gated_mlp_weights
from .moe import ExpertParallelMoE


# ----------------------------------------------------------------------------------------------- parallelize
def _replacement(name, module, tp_group, ep_group, max_tokens, align, fp8, fp8_grads):
    mlps, moes = supported_classes()
    if not isinstance(module, mlps + moes) and gated_mlp_form(type(module)):
        # another model's MLP of the listed ones' form: swapped where it is SiLU without biases, else left as it is
        try:
            gated_mlp_weights(module, name)
        except ValueError:
            return None
        mlps += (type(module),)
    try:
        if isinstance(module, moes):
            return ExpertParallelMoE.from_dense(module, ep_group, max_tokens=max_tokens, align=align, fp8=fp8,
                                                fp8_grads=fp8_grads)
        if isinstance(module, mlps):
            return TensorParallelMLP.from_dense(module, tp_group, fp8=fp8, fp8_grads=fp8_grads)
    except ValueError as exc:
        raise ValueError(f"parallelize: cannot swap {name or 'the model'} ({type(module).__name__}): {exc}") from exc
    return None


def parallelize(model, tp_group=None, ep_group=None, *, max_tokens=None, align=1, fp8=None, fp8_grads=False):
    """Swap, in place, every supported gated MLP of ``model`` for a ``TensorParallelMLP`` (on ``tp_group``) and
    every supported sparse-MoE block for an ``ExpertParallelMoE`` (on ``ep_group``); both take and return the
    full activations on every rank. Collective: every rank calls it on the same model (same weights). Groups:
    None (the group ``triton_dist.init`` was given). ``max_tokens``/``align``: the MoE
    blocks' dispatch capacity per rank and group alignment (see ``ExpertParallelMoE``). ``fp8`` ("tensor",
    "row", "block"): the MLPs and the MoE blocks' experts train in FP8 (``TensorParallelMLP``'s and
    ``ExpertParallelMoE``'s mode); ``fp8_grads`` (with ``fp8``): the MLPs' and the MoE blocks' experts' backward
    GEMMs in FP8 too. Returns ``model``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    check_fp8_grads(fp8_grads, check_mode(fp8, "parallelize: fp8"), "parallelize: fp8_grads", "fp8")
    swaps = []

    def walk(prefix, module):
        for child_name, child in module.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            new = _replacement(name, child, tp_group, ep_group, max_tokens, align, fp8, fp8_grads)
            if new is None:
                walk(name, child)
            else:  # a swapped block's insides (e.g. a shared expert) are the new layer's business
                swaps.append((module, child_name, new))

    new_root = _replacement("", model, tp_group, ep_group, max_tokens, align, fp8, fp8_grads)
    if new_root is not None:
        raise ValueError(f"parallelize: {type(model).__name__} is itself a block: use its layer's from_dense")
    walk("", model)
    for parent, child_name, new in swaps:  # everything read and checked: now swap
        new.train(parent.training)
        setattr(parent, child_name, new)
    return model
