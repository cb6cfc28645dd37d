"""The expert-parallel MoE block: router top-k -> ep_dispatch -> grouped GEMMs -> ep_combine.

    idx, weights = router(x)                                      this rank's tokens only
    recv = ep_dispatch(x, idx, weights)                           rows grouped by this rank's experts
    h = grouped_gemm(recv.x, gate_up, offsets, counts, "silu_gate")   silu(x @ gate_e.T) * (x @ up_e.T), fused
    y = grouped_gemm(h, down, offsets, counts)                    h @ down_e.T
    out = ep_combine(y, recv.handle) (+ shared experts)           back on the tokens' ranks, weighted, summed

Rank r owns experts [r * E/W, (r + 1) * E/W) (E must divide by W); shared experts are replicated and run on the
rank's own tokens. Group sizes stay on the device from dispatch to combine: no host sync. ``sequence_parallel``
(``sharding.py``): True, x is this rank's tokens and so is the result; False, x is every token on every rank,
each rank routes only its slice and the slices' results are all-gathered, so the result equals the dense
block's. ``max_tokens`` (tokens per rank the dispatch buffers hold, the same on every rank) defaults to the
slice size rounded up to a power of two, so that a few workspaces serve every batch size.

FP8 (``fp8="tensor" | "row" | "block"``, the usual recipe as the tensor-parallel layers': FP8 forward,
high-precision gradients): both grouped GEMMs take their operands quantised in the call (``grouped_gemm``'s
``quantize=``: the received rows and the SiLU-gated activations with dynamic scales, each expert's weight on its
own) and give results in x's dtype; the backward is the high-precision one of the unquantised operands
(straight-through). ``fp8_grads=True`` (with ``fp8`` only; DeepSeek-V3's recipe): the grouped GEMMs' backward in
FP8 too (``grouped_gemm``'s ``fp8_grads``): each input gradient from the output gradient quantised along N and
each expert's weight transposed, each expert's weight gradient from the output gradient and the input quantised
along that expert's tokens, in the same mode. Dispatch, combine, the router and the shared experts stay in x's
dtype.

``Router`` (``router.py``) reproduces the routers of the blocks ``parallelize`` replaces; a layer made from a
transformers block routes with that block's own router module (``use_gate``).
"""

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.fp8 import check_fp8_grads, check_mode
from ..kernels.grouped_gemm import grouped_gemm
from ..hardware import next_power_of_2
from .hf_blocks import read_moe_block
from .linear import gated_mlp_torch, gated_mlp_weights, state_of
from .router import Router
from .sharding import GroupOps, finish_rows, own_rows, pad_rows, plan_rows, replicated_param, take_rows

class ExpertParallelMoE(nn.Module):
    """A sparse MoE block with its experts split over ranks (module docstring). ``gate_up`` [E/W, 2I, H]
    (each expert's gate rows over its up rows), ``down`` [E/W, H, I]; optional shared experts (``shared_gate_up``
    [2Is, H], ``shared_down`` [H, Is]) and, Qwen2-MoE style, a sigmoid gate on their output
    (``shared_expert_gate`` [1, H]). ``fp8``: None, or the experts' FP8 training mode, ``fp8_grads``: their
    backward in FP8 too (module docstring).
    ``jitter_noise`` (Mixtral's ``router_jitter_noise``): in training, the block's input is scaled by
    ``U(1 - jitter_noise, 1 + jitter_noise)`` before routing and the experts, drawn as the dense block draws it
    (replicated mode: every row on every rank, so ranks must share the RNG state, as a replicated model's dropout
    needs; sequence-parallel: each rank its own rows)."""

    def __init__(self, hidden_size, intermediate_size, router, *, shared_intermediate_size=0,
                 shared_expert_gate=False, sequence_parallel=False, max_tokens=None, align=1, group=None,
                 dtype=None, device=None, fp8=None, jitter_noise=0.0, fp8_grads=False):
        super().__init__()
        self.fp8 = check_mode(fp8, "ExpertParallelMoE: fp8")
        self.fp8_grads = check_fp8_grads(fp8_grads, self.fp8, "ExpertParallelMoE: fp8_grads", "fp8")
        self.ops = GroupOps(group)
        if not isinstance(router, Router):
            raise TypeError(f"router must be a triton_dist.nn.Router, got {type(router).__name__}")
        experts = router.num_experts
        if experts % self.ops.world:
            raise ValueError(f"ExpertParallelMoE: {experts} experts are not divisible by the {self.ops.world} ranks")
        self.hidden_size, self.intermediate_size, self.num_experts = hidden_size, intermediate_size, experts
        self.sequence_parallel, self.max_tokens, self.align = bool(sequence_parallel), max_tokens, align
        if not jitter_noise >= 0:
            raise ValueError(f"ExpertParallelMoE: jitter_noise must be >= 0, got {jitter_noise}")
        self.jitter_noise = float(jitter_noise)
        self.router = router
        self.gate = None  # a transformers router module (use_gate), else the routing is self.router's
        local = experts // self.ops.world
        self.first_expert = self.ops.rank * local
        self.gate_up = nn.Parameter(torch.empty((local, 2 * intermediate_size, hidden_size), dtype=dtype,
                                                device=device))
        self.down = nn.Parameter(torch.empty((local, hidden_size, intermediate_size), dtype=dtype, device=device))
        self.shared_gate_up = self.shared_down = self.shared_expert_gate = None
        if shared_intermediate_size:
            self.shared_gate_up = nn.Parameter(torch.empty((2 * shared_intermediate_size, hidden_size), dtype=dtype,
                                                           device=device))
            self.shared_down = nn.Parameter(torch.empty((hidden_size, shared_intermediate_size), dtype=dtype,
                                                        device=device))
        if shared_expert_gate:
            self.shared_expert_gate = nn.Parameter(torch.empty((1, hidden_size), dtype=dtype, device=device))

    @classmethod
    def from_dense(cls, module, group=None, *, router=None, sequence_parallel=False, max_tokens=None, align=1,
                   fp8=None, fp8_grads=False):
        """From a sparse-MoE block of the installed transformers (Mixtral, Qwen2/3-MoE, DeepSeek-V3, OLMoE, GLM-4-MoE:
        see ``hf.read_moe_block``), or from a state dict in their naming (``gate.weight``,
        ``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I], optional
        ``gate.e_score_correction_bias``, ``shared_expert(s).{gate,up,down}_proj.weight``,
        ``shared_expert_gate.weight``) together with ``router`` (a ``Router`` giving the routing math). ``fp8``,
        ``fp8_grads``: as the constructor's."""
        if isinstance(module, nn.Module):
            if router is not None:
                raise ValueError("router= goes with a state dict; a module brings its own router")
            parts = read_moe_block(module)
            parts["hf_gate"] = module.gate
        else:
            if router is None:
                raise ValueError("from_dense(state_dict) needs router= (a triton_dist.nn.Router: the routing math)")
            parts = _state_dict_parts(state_of(module), router)
        gate_up, down = parts["gate_up"], parts["down"]
        shared = parts.get("shared")
        layer = cls(gate_up.shape[2], gate_up.shape[1] // 2, parts["router"],
                    shared_intermediate_size=shared[1].shape[1] if shared else 0,
                    shared_expert_gate=parts.get("shared_gate") is not None, sequence_parallel=sequence_parallel,
                    max_tokens=max_tokens, align=align, group=group, dtype=gate_up.dtype, device=gate_up.device,
                    fp8=fp8, jitter_noise=parts.get("jitter_noise", 0.0), fp8_grads=fp8_grads)
        mine = slice(layer.first_expert, layer.first_expert + layer.gate_up.shape[0])
        with torch.no_grad():
            layer.gate_up.copy_(gate_up[mine])
            layer.down.copy_(down[mine])
            if shared:
                layer.shared_gate_up.copy_(shared[0])
                layer.shared_down.copy_(shared[1])
            if parts.get("shared_gate") is not None:
                layer.shared_expert_gate.copy_(parts["shared_gate"])
        if parts.get("hf_gate") is not None:
            layer.use_gate(parts["hf_gate"])
        return layer

    def use_gate(self, gate):
        """Route with a transformers block's own router module ``gate`` (its output: (logits, weights, ids)):
        the routing is the block's, and transformers records its logits (``output_router_logits``: the
        load-balancing loss). The layer's router shares its weight. Replicated mode runs it on every row, as the
        dense block does; sequence-parallel mode on this rank's rows, its weight's gradient summed over the ranks."""
        self.gate = gate
        self.router.weight = gate.weight
        if self.sequence_parallel and self.ops.world > 1:
            gate.weight.register_hook(self.ops.all_reduce)

    def _route(self, x):
        """(ids, weights) of the rows ``x`` (replicated mode: every row; sequence parallel: this rank's)."""
        if self.gate is not None:
            _, weights, idx = self.gate(x)
            return idx, weights
        weight = self.router.weight
        return self.router(x, replicated_param(weight, self.ops) if self.sequence_parallel else weight)

    def _capacity(self, rows):
        if self.max_tokens is not None:
            if rows.shard > self.max_tokens:
                raise ValueError(f"{rows.shard} tokens per rank exceed max_tokens={self.max_tokens}")
            return self.max_tokens
        return next_power_of_2(max(rows.shard, 1))

    def experts(self, x, idx, weights, max_tokens):
        """The routed part on this rank's tokens ``x`` [T <= max_tokens, H] and their routing (collective: every
        rank calls it with the same ``max_tokens``)."""
        recv = self.ops.ep_dispatch(x.contiguous(), idx, weights, self.num_experts, max_tokens, self.align)
        h = grouped_gemm(recv.x, self.gate_up, recv.expert_offsets, recv.expert_counts, activation="silu_gate",
                         quantize=self.fp8, fp8_grads=self.fp8_grads)
        y = grouped_gemm(h, self.down, recv.expert_offsets, recv.expert_counts, quantize=self.fp8,
                         fp8_grads=self.fp8_grads)
        return self.ops.ep_combine(y, recv.handle)

    def forward(self, x, total_rows=None):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.hidden_size)
        if self.training and self.jitter_noise > 0:  # (as MixtralSparseMoeBlock: the same draw, in place there)
            x2 = x2 * torch.empty_like(x2).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        rows = plan_rows(x2, self.ops, self.sequence_parallel, total_rows)
        if rows.total == 0:
            return x.new_zeros(x.shape)
        idx, weights = self._route(x2)  # replicated: every row's, as the dense block (its logits recorded)
        if self.sequence_parallel:
            mine = x2
        else:  # this rank's rows, padded to the shard (the same shapes on every rank; padding rows route to no
            # expert); their routing's gradient gathered back to every row
            mine = take_rows(x2, self.ops, rows)
            idx = own_rows(idx, rows, self.ops.world, fill=-1)
            weights = take_rows(weights, self.ops, rows)
        out = self.experts(mine, idx, weights, self._capacity(rows))
        if self.shared_gate_up is not None:  # replicated weights on this rank's rows: their gradients summed
            shared = gated_mlp_torch(mine, replicated_param(self.shared_gate_up, self.ops),
                                     replicated_param(self.shared_down, self.ops))
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(F.linear(mine, replicated_param(self.shared_expert_gate, self.ops))) * shared
            out = out + shared
        if self.sequence_parallel:
            return out
        return finish_rows(pad_rows(out, rows.shard), rows, self.ops).reshape(*lead, self.hidden_size)


def _state_dict_parts(sd, router):
    """``read_moe_block``'s parts from a state dict in the transformers naming (see ``from_dense``)."""
    for key in ("experts.gate_up_proj", "experts.down_proj"):
        if key not in sd:
            raise ValueError(f"state dict lacks {key!r} (fused 3-D experts [E, 2I, H] / [E, H, I]); has {sorted(sd)}")
    parts = {"router": router, "gate_up": sd["experts.gate_up_proj"], "down": sd["experts.down_proj"]}
    with torch.no_grad():
        if "gate.weight" in sd:
            router.weight.copy_(sd["gate.weight"])
        if router.score_bias is not None and "gate.e_score_correction_bias" in sd:
            router.score_bias.copy_(sd["gate.e_score_correction_bias"])
    for prefix in ("shared_expert.", "shared_experts."):
        sub = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
        if sub:
            gate, up, down = gated_mlp_weights(sub, prefix.rstrip("."))
            parts["shared"] = (torch.cat([gate, up]), down)
    if "shared_expert_gate.weight" in sd:
        parts["shared_gate"] = sd["shared_expert_gate.weight"]
    return parts
