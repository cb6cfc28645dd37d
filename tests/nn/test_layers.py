"""``triton_dist.nn`` layers against the dense modules they replace (fp32, within 1e-4), on 2 and 4 CPU ranks.

Every layer in both modes: replicated (full rows in and out, what ``parallelize`` uses) and sequence parallel
(rows sharded like ``torch.tensor_split``), with row counts that do not divide by the ranks, fewer rows than
ranks, and 3-D activations. The MoE: softmax and DeepSeek-style sigmoid group-limited routing, shared experts
with a sigmoid gate, experts no token picks, ranks that hold no tokens. Decode attention: contiguous and paged
shards of a cache, sequences with no tokens. Bad groups and shapes raise ValueError.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import triton_dist as td
from triton_dist.nn import (ColumnParallelLinear, DecodeAttention, ExpertParallelMoE, Router, RowParallelLinear,
                            SequenceParallelDecodeAttention, TensorParallelMLP)

from ..conftest import error_names, gpu_only

TOL = 1e-4


class GatedMLP(nn.Module):
    """The dense block TensorParallelMLP replaces (a LlamaMLP without transformers)."""

    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _err(got, ref):
    if got.shape != ref.shape:
        return f"shape {list(got.shape)} != {list(ref.shape)}"
    return (got.double() - ref.double()).abs().max().item() / max(ref.abs().max().item(), 1.0) if ref.numel() else 0.0


def _assert_close(results):
    """Every rank's errors (case -> relative error, or a string when the shape was wrong) within TOL."""
    for errs in results:
        bad = {k: v for k, v in errs.items() if isinstance(v, str) or v > TOL}
        assert not bad, bad


def _tp_layers(seed):
    """Every rank builds the same dense modules and inputs; each layer's error against them, per case."""
    torch.manual_seed(seed)
    world, rank = td.world_size(), td.rank()
    H, I, N = 16, 8 * world, 4 * world
    col, row, mlp = nn.Linear(H, N), nn.Linear(N, H), GatedMLP(H, I)
    errs = {}
    layers = {"col": ColumnParallelLinear.from_dense(col), "row": RowParallelLinear.from_dense(row),
              "mlp": TensorParallelMLP.from_dense(mlp)}
    sp = {"col": ColumnParallelLinear.from_dense(col.state_dict(), sequence_parallel=True),
          "row": RowParallelLinear.from_dense(row, sequence_parallel=True),
          "mlp": TensorParallelMLP.from_dense(mlp, sequence_parallel=True)}
    for m in (world + 3, 1, 2 * world) if world == 2 else (world + 3,):  # (4 ranks on 2 cores: fewer calls)
        x = torch.randn(m, H)
        xr = torch.randn(m, N)
        with torch.no_grad():
            errs[f"col m={m}"] = _err(layers["col"](x), col(x))
            errs[f"row m={m}"] = _err(layers["row"](xr), row(xr))
            errs[f"mlp m={m}"] = _err(layers["mlp"](x), mlp(x))
            mine = torch.tensor_split(x, world)[rank]
            features = slice(rank * (N // world), (rank + 1) * (N // world))
            errs[f"col sp m={m}"] = _err(sp["col"](mine, total_rows=m), col(x)[:, features])
            errs[f"row sp m={m}"] = _err(sp["row"](xr[:, features].contiguous()),
                                         torch.tensor_split(row(xr), world)[rank])
            errs[f"mlp sp m={m}"] = _err(sp["mlp"](mine, total_rows=m), torch.tensor_split(mlp(x), world)[rank])
    x3 = torch.randn(2, 3, H)
    with torch.no_grad():
        errs["mlp 3-D"] = _err(layers["mlp"](x3), mlp(x3))
    return errs


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_layers_match_dense(ranks, world):
    _assert_close(ranks(world, _tp_layers, world))


def _layers_on_groups(seed):
    """TP groups {0, 1} and {2, 3} beside an EP group of all four ranks (a 4-rank model with TP=2 attention-side
    MLPs and EP=4 experts): each layer on its group matches the dense module (the same weights on every rank)."""
    import torch.distributed as dist

    tp = [dist.new_group(r) for r in ([0, 1], [2, 3])][dist.get_rank() // 2]
    ep = dist.new_group([0, 1, 2, 3])
    torch.manual_seed(seed)
    H, I = 16, 8
    mlp = GatedMLP(H, I)
    router = Router(H, 8, top_k=2)
    with torch.no_grad():
        router.weight.normal_()
    gate_up, down = torch.randn(8, 2 * I, H) / 4, torch.randn(8, H, I) / 4
    layer = TensorParallelMLP.from_dense(mlp, group=tp)
    moe = ExpertParallelMoE.from_dense({"gate.weight": router.weight.detach().clone(), "experts.gate_up_proj": gate_up,
                                        "experts.down_proj": down}, group=ep, router=Router(H, 8, top_k=2))
    errs = {}
    for m in (5, 2):
        x = torch.randn(m, H)
        with torch.no_grad():
            errs[f"mlp on tp m={m}"] = _err(layer(x), mlp(x))
            errs[f"moe on ep m={m}"] = _err(moe(x), _moe_reference(x, router, gate_up, down))
    return errs


def test_layers_on_their_own_groups(ranks):
    _assert_close(ranks(4, _layers_on_groups, 3))


def _moe_reference(x, router, gate_up, down, shared=None, shared_gate=None):
    """The dense block: every token through its top-k experts, weighted, plus the shared experts."""
    idx, weights = router(x)
    out = torch.zeros_like(x)
    inter = gate_up.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            h = gate_up[e] @ x[t]
            out[t] += weights[t, j] * (down[e] @ (F.silu(h[:inter]) * h[inter:]))
    if shared is not None:
        h = x @ shared[0].T
        s = (F.silu(h[:, :h.shape[1] // 2]) * h[:, h.shape[1] // 2:]) @ shared[1].T
        out += (torch.sigmoid(x @ shared_gate.T) if shared_gate is not None else 1) * s
    return out


def _moe_layers(seed):
    torch.manual_seed(seed)
    world, rank = td.world_size(), td.rank()
    H, I, E = 16, 8, 2 * world
    errs = {}
    for name, router_kw, shared in [
            ("softmax", dict(top_k=2, norm_topk_prob=False, cast_weights=True), True),
            ("sigmoid", dict(top_k=2, scoring="sigmoid", n_group=2, topk_group=1, routed_scaling_factor=2.5,
                             score_bias=True), False)]:
        router = Router(H, E, **router_kw)
        with torch.no_grad():
            router.weight.normal_()
            router.weight[0] -= 5  # expert 0 is never picked: an empty group on its rank
            if router.score_bias is not None:
                router.score_bias.uniform_(-0.1, 0.1)
        sd = {"gate.weight": router.weight.detach().clone(),
              "experts.gate_up_proj": torch.randn(E, 2 * I, H) / 4, "experts.down_proj": torch.randn(E, H, I) / 3}
        if router.score_bias is not None:
            sd["gate.e_score_correction_bias"] = router.score_bias.clone()
        ref_shared = None
        if shared:
            g, u, d = torch.randn(12, H) / 4, torch.randn(12, H) / 4, torch.randn(H, 12) / 4
            sd.update({"shared_expert.gate_proj.weight": g, "shared_expert.up_proj.weight": u,
                       "shared_expert.down_proj.weight": d, "shared_expert_gate.weight": torch.randn(1, H)})
            ref_shared = (torch.cat([g, u]), d)
        make = dict(router=Router(H, E, **router_kw))
        layer = ExpertParallelMoE.from_dense(sd, **make)
        sp_layer = ExpertParallelMoE.from_dense(sd, router=Router(H, E, **router_kw), sequence_parallel=True,
                                                max_tokens=8)
        for m in (world - 1, 2 * world + 1)[:3 - world // 2]:  # fewer tokens than ranks: the last rank has none
            x = torch.randn(1, m, H)
            with torch.no_grad():
                ref = _moe_reference(x[0], router, sd["experts.gate_up_proj"], sd["experts.down_proj"], ref_shared,
                                     sd.get("shared_expert_gate.weight"))
                errs[f"{name} m={m}"] = _err(layer(x)[0], ref)
                mine = torch.tensor_split(x[0], world)[rank]
                errs[f"{name} sp m={m}"] = _err(sp_layer(mine, total_rows=m), torch.tensor_split(ref, world)[rank])
    return errs


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_moe_matches_dense(ranks, world):
    _assert_close(ranks(world, _moe_layers, world))


def _attention(seed):
    torch.manual_seed(seed)
    B, HQ, HKV, D, S = 3, 4, 2, 16, 11
    dense = DecodeAttention(HQ, HKV, D)
    layer = SequenceParallelDecodeAttention.from_dense(dense)
    q = torch.randn(B, HQ, D)
    k, v = torch.randn(B, S, HKV, D), torch.randn(B, S, HKV, D)
    lens = torch.tensor([5, 0, S], dtype=torch.int32)
    ref = dense(q, k, v, lens)
    errs = {}
    for page in (None, 4):
        shard = layer.shard_kv_cache(k, v, lens, page_size=page)
        errs[f"page={page}"] = _err(layer(q, *shard), ref)
    return errs


@pytest.mark.parametrize("world", [2])
def test_sequence_parallel_decode_attention_matches_dense(ranks, world):
    _assert_close(ranks(world, _attention, 5))


def _bad_layers():
    mlp = GatedMLP(16, 6)
    with_bias = GatedMLP(16, 8)
    with_bias.gate_proj = nn.Linear(16, 8, bias=True)
    gelu = GatedMLP(16, 8)
    gelu.act_fn = nn.GELU()
    return error_names([
        lambda: TensorParallelMLP.from_dense(GatedMLP(16, 8), group="tp"),    # not a process group
        lambda: TensorParallelMLP.from_dense(mlp),                             # 6 not divisible by 4
        lambda: TensorParallelMLP.from_dense(with_bias),                       # bias
        lambda: TensorParallelMLP.from_dense(gelu),                            # activation
        lambda: TensorParallelMLP.from_dense({"gate_proj.weight": torch.ones(8, 16)}),
        lambda: ColumnParallelLinear.from_dense(nn.Linear(16, 6)),
        lambda: ExpertParallelMoE(16, 8, Router(16, 6, 2)),                    # 6 experts on 4 ranks
        lambda: ExpertParallelMoE.from_dense({"experts.gate_up_proj": torch.ones(4, 16, 16)}),  # no router
        lambda: TensorParallelMLP.from_dense(GatedMLP(16, 8), sequence_parallel=True)(torch.ones(3, 16),
                                                                                      total_rows=40),
    ])


def test_bad_layers_raise(ranks):
    for names in ranks(4, _bad_layers):
        assert names == ["ValueError"] * 9, names


# ----------------------------------------------------------------------------------------------- GPU
def _gpu_bf16_layers():
    """bf16 at model-like sizes against fp32 dense references (the same weights), replicated mode."""
    torch.manual_seed(0)
    dev = td.shmem.device()
    world = td.world_size()
    H, I, E = 1024, 2048, 8 * world
    mlp = GatedMLP(H, I).to(dev)
    x = torch.randn(1, 1000, H, device=dev)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
        ref = mlp(x)
        errs = {"mlp": _err(TensorParallelMLP.from_dense(copy_to(mlp, torch.bfloat16))(x.bfloat16()), ref)}
        router = Router(H, E, 4).to(dev)
        router.weight.normal_()
        sd = {"gate.weight": router.weight.clone(),
              "experts.gate_up_proj": torch.randn(E, 2 * I, H, device=dev) / H ** 0.5,
              "experts.down_proj": torch.randn(E, H, I, device=dev) / I ** 0.5}
        bf16 = {k: v.bfloat16() for k, v in sd.items()}
        layer = ExpertParallelMoE.from_dense(bf16, router=Router(H, E, 4, dtype=torch.bfloat16, device=dev), align=16)
        idx, weights = layer.router(x[0].bfloat16())  # the layer's own routing (bf16 logits), fp32 experts
        moe_ref = _moe_reference_fast(x[0], idx, weights.float(), sd["experts.gate_up_proj"], sd["experts.down_proj"])
        errs["moe"] = _err(layer(x.bfloat16())[0], moe_ref)
    return errs


def copy_to(module, dtype):
    import copy

    return copy.deepcopy(module).to(dtype)


def _moe_reference_fast(x, idx, weights, gate_up, down):
    out = torch.zeros_like(x)
    inter = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        h = x[tok] @ gate_up[e].T
        out.index_add_(0, tok, weights[tok, slot, None] * ((F.silu(h[:, :inter]) * h[:, inter:]) @ down[e].T))
    return out


@gpu_only
def test_layers_bf16_on_gpus(ranks):
    for errs in ranks(ranks.gpu_world, _gpu_bf16_layers):  # every GPU of the run (one: a group of one)
        assert all(v < 3e-2 for v in errs.values()), errs


def test_replicated_rows_come_in_few_sizes():
    """Every distinct row count builds workspaces in the ops: replicated layers round rows per rank up to four
    sizes per power of two, padding at most a quarter, exact up to 16."""
    from triton_dist.nn.sharding import bucket_rows

    sizes = [bucket_rows(r) for r in range(1, 4097)]
    assert all(r <= s <= max(r, 16) * 1.25 for r, s in zip(range(1, 4097), sizes))
    assert sizes[:16] == list(range(1, 17)) and len(set(sizes[1024:2048])) == 4
