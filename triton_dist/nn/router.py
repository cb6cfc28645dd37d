"""The routers of the sparse-MoE blocks ``parallelize`` replaces, operation for operation: softmax top-k
(optionally renormalised; the weights in fp32 or cast to the input's dtype) and DeepSeek-V3's sigmoid scores with
a score-correction bias, group-limited top-k and routed scaling."""

import torch
import torch.nn.functional as F
from torch import nn

SCORINGS = ("softmax", "sigmoid")


class Router(nn.Module):
    """Top-k routing of ``x`` [T, H] over ``weight`` [E, H]: returns (ids [T, k] int64, weights [T, k]).

    softmax: ``softmax(x @ W.T)`` in fp32, top-k, renormalised if ``norm_topk_prob``; weights cast back to x's
    dtype if ``cast_weights`` (Qwen2/3-MoE) or kept in fp32 (Mixtral). sigmoid (DeepSeek-V3): fp32 logits,
    ``sigmoid``, choice among the ``topk_group`` best of ``n_group`` groups (a group's score: its 2 best scores +
    ``score_bias``), weights the chosen sigmoid scores, renormalised if ``norm_topk_prob``, times
    ``routed_scaling_factor``."""

    def __init__(self, hidden_size, num_experts, top_k, *, scoring="softmax", norm_topk_prob=True,
                 cast_weights=False, n_group=1, topk_group=1, routed_scaling_factor=1.0, score_bias=False,
                 dtype=None, device=None):
        super().__init__()
        if scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        if scoring == "sigmoid" and (num_experts % n_group or not 1 <= topk_group <= n_group):
            raise ValueError(f"group-limited routing needs n_group ({n_group}) dividing num_experts "
                             f"({num_experts}) and 1 <= topk_group ({topk_group}) <= n_group")
        self.num_experts, self.top_k, self.scoring = num_experts, top_k, scoring
        self.norm_topk_prob, self.cast_weights = bool(norm_topk_prob), bool(cast_weights)
        self.n_group, self.topk_group, self.routed_scaling_factor = n_group, topk_group, routed_scaling_factor
        self.weight = nn.Parameter(torch.empty((num_experts, hidden_size), dtype=dtype, device=device))
        bias = torch.zeros(num_experts, dtype=torch.float32, device=device) if score_bias else None
        self.register_buffer("score_bias", bias)

    def forward(self, x, weight=None):
        """(ids, weights) of ``x``'s rows; ``weight``: the router weight to use (default: ``self.weight``)."""
        weight = self.weight if weight is None else weight
        if self.scoring == "softmax":
            logits = F.linear(x, weight)
            probs = torch.softmax(logits.float(), dim=-1)
            weights, idx = torch.topk(probs, self.top_k, dim=-1)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return idx, weights.to(logits.dtype) if self.cast_weights else weights
        scores = F.linear(x.float(), weight.float()).sigmoid()
        choice = scores + self.score_bias if self.score_bias is not None else scores
        per_group = self.num_experts // self.n_group
        group_scores = choice.view(-1, self.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        groups = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, groups, 1)
        keep = keep.unsqueeze(-1).expand(-1, self.n_group, per_group).reshape(-1, self.num_experts)
        choice = choice.masked_fill(~keep.bool(), float("-inf"))
        idx = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, idx)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, weights * self.routed_scaling_factor
