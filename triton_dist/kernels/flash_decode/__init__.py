"""Sequence-parallel flash-decode: one new query token per sequence, every sequence's KV cache split over ranks.

Each rank holds a slice of every sequence's KV cache (``k_cache``/``v_cache`` [B, S_local_max, Hkv, D], the first
``kv_lens[b]`` tokens valid, possibly none; or a paged cache with ``block_table``) and the same query ``q``
[B, Hq, D]. Decode attention has no causal mask, so softmax(q K^T) V over the concatenated shards is a mix of the
shards' normalised outputs o_i weighted by exp(lse_i):

    flash_decode_split_kernel (n_splits, B * Hkv)   split-KV attention at HBM speed -> partial (o, lse) per split;
                                                    the last split of (b, kv head) merges them and dl.put-s the
                                                    rank's partial into every peer's receive buffer + a flag
      combine "fused"  (B * Hkv < SMs)              ... then waits for the peers' partials, merges, writes o:
                                                    one launch per call
      combine "kernel"                              ... and flash_decode_merge_kernel (B * Hkv,) waits and merges
                                                    (optionally launched early: programmatic dependent launch)

"fused" is used only while B * Hkv < #SMs: at most B * Hkv programs ever wait, so one SM always has room for the
splits everyone waits on. No NCCL, no host sync; flags carry device-side epochs and the receive buffer is double
buffered by epoch parity, so calls need no ready handshake and CUDA graphs replay. Per call and rank the KV shard
is read once; B * Hq * (D + 1) * 4 bytes go to each peer. ``local_flash_decode`` is the split kernel alone with a
local epilogue (single-GPU decode). Knobs: ``config.default_config``; docs/design/flash_decode.md.
"""

import math

import torch

from ... import language as dl
from ... import shmem
from ...hardware import next_power_of_2
from .. import library
from ..launcher import Launcher
from .config import (COMBINES, DTYPES, HEAD_DIMS, MAX_SPLITS, SMEM_PER_BLOCK, SMEM_PER_SM, check_inputs,  # noqa: F401
                     choose_splits, default_config, merge_chunk, resolve, split_smem_bytes)
from .kernels import (LOG2E, MODE_FUSED, MODE_LOCAL, MODE_PUSH, flash_decode_merge_kernel,  # noqa: F401
                      flash_decode_split_kernel)


def _check_out(out, shape, dtype, name):
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dtype} tensor of shape {list(shape)}, got {out.dtype} "
                         f"{list(out.shape)} with strides {list(out.stride())}")



class _Exchange:
    """Symmetric receive buffers and flags of one (B, Hq, Hkv, D): recv_o [2 (epoch parity), world, B, Hq, D]
    fp32, recv_lse [2, world, B, Hq] fp32 (log2 units), flags [world, B * Hkv] int32 (epochs), state int32[2]."""

    def __init__(self, batch, q_heads, kv_heads, head_dim, group):
        world = shmem.world_size(group)
        self.recv_o = shmem.zeros((2, world, batch, q_heads, head_dim), torch.float32, name="flash_decode.recv_o",
                                  group=group)
        self.recv_lse = shmem.zeros((2, world, batch, q_heads), torch.float32, name="flash_decode.recv_lse",
                                    group=group)
        self.state = shmem.counters(2, name="flash_decode.state")
        self.flags = shmem.signals((world, batch * kv_heads), name="flash_decode.flags", group=group)


_PLANS = shmem.Plans("flash_decode")


class _Plan:
    """Everything a call needs that depends only on the inputs' metadata and the config: built (and the inputs
    validated) on the first call with that metadata, then reused, so a call costs a look-up and the launches."""

    def __init__(self, q, k_cache, v_cache, kv_lens, block_table, softmax_scale, config, team):
        dims = check_inputs(q, k_cache, v_cache, kv_lens, block_table, softmax_scale)
        batch, q_heads, kv_heads, head_dim, s_max, page_size = dims
        self.dims = dims
        distributed = team is not None
        cfg = self.cfg = resolve(dims, q.dtype, q.device, config, distributed)
        group, n_splits = q_heads // kv_heads, cfg["n_splits"]
        self.empty = batch == 0
        self.q_copy = q.stride(-1) != 1
        self.grid = (n_splits, batch * kv_heads)
        world = team.size if distributed else 1
        mode = {"fused": MODE_FUSED, "kernel": MODE_PUSH}[cfg["combine"]] if distributed else MODE_LOCAL
        self.mode = mode
        pad = max(16, next_power_of_2(group))  # tl.dot needs >= 16 rows
        group_p2 = next_power_of_2(group)
        rank_pad = pad if n_splits == 1 else group_p2  # rows of the tile a rank publishes
        self.part = (torch.empty((batch * kv_heads, n_splits, group, head_dim), dtype=torch.float32, device=q.device),
                     torch.empty((batch * kv_heads, n_splits, group), dtype=torch.float32, device=q.device),
                     torch.zeros((batch * kv_heads,), dtype=torch.int32, device=q.device))
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.table_stride = block_table.stride(0) if block_table is not None else 1
        self.strides = (q.stride(0) if not self.q_copy else q_heads * head_dim,
                        q.stride(1) if not self.q_copy else head_dim,
                        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), self.table_stride)
        self.scalars = (batch, q_heads, kv_heads, s_max, k_cache.shape[0] if page_size else 1, scale * LOG2E)
        self.split_meta = dict(
            GROUP=group, GROUP_PAD=pad, HEAD_DIM=head_dim, BLOCK_N=cfg["block_n"], GROUP_P2=group_p2,
            N_SPLITS=n_splits, SPLIT_CHUNK=merge_chunk(group, head_dim, n_splits, cfg["num_warps"]),
            PAGE_SIZE=page_size, MODE=mode, WORLD=world, WORLD_PAD=dl.rank_lanes(world),
            RANK_CHUNK=merge_chunk(rank_pad, head_dim, world, cfg["num_warps"]), FP32_DOT=q.dtype == torch.float32,
            PDL=mode == MODE_PUSH and cfg["pdl"],
            CHECK_INDICES=0 if not cfg["check_indices"] else 2 if distributed or shmem.is_initialized() else 1,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        self.merge_meta = dict(
            GROUP=group, GROUP_P2=group_p2, HEAD_DIM=head_dim, WORLD=world,
            WORLD_PAD=dl.rank_lanes(world),
            RANK_CHUNK=merge_chunk(group, head_dim, world, cfg["merge_num_warps"]), PDL=cfg["pdl"],
            num_warps=cfg["merge_num_warps"])
        if cfg["pdl"]:
            self.merge_meta["launch_pdl"] = True
        # the launches bound for a contiguous out (its strides are then fixed); an out of other strides goes through
        # the checked launches of its own Launchers (``_other_out``)
        self.out_strides = (q_heads * head_dim, head_dim)
        self.split = Launcher(flash_decode_split_kernel, self.grid, **self.split_meta)
        self.merge = Launcher(flash_decode_merge_kernel, (self.grid[1],), **self.merge_meta)
        self.other_out = None
        self.exchange = shmem.workspace("flash_decode", (batch, q_heads, kv_heads, head_dim),
                                        lambda: _Exchange(batch, q_heads, kv_heads, head_dim, team.group),
                                        group=team.group) if distributed and batch else None
        self.ctx = team.ctx if distributed else None

    @classmethod
    def get(cls, q, k_cache, v_cache, kv_lens, block_table, softmax_scale, config, team):
        """The plan of a call (``team``: the group's team for sp_flash_decode, None for the local op)."""
        try:
            key = (None if team is None else team.name, q.dtype, q.device, q.shape, q.stride(), k_cache.dtype,
                   k_cache.shape, k_cache.stride(), v_cache.dtype, v_cache.shape, v_cache.stride(), kv_lens.dtype,
                   kv_lens.device, kv_lens.shape,
                   None if block_table is None else (block_table.dtype, block_table.device, block_table.shape,
                                                     block_table.stride()),
                   softmax_scale, tuple(sorted(config.items())) if config else None)
        except AttributeError:  # not tensors (or config not a dict): the checks below say which
            key = None
        plan = None if key is None else _PLANS.find(key)
        if plan is not None:
            return plan
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("kv_lens", kv_lens)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if block_table is not None and not isinstance(block_table, torch.Tensor):
            raise TypeError(f"block_table must be a torch.Tensor or None, got {type(block_table).__name__}")
        if config is not None and not isinstance(config, dict):
            raise TypeError(f"config must be a dict or None, got {type(config).__name__}")
        if team is not None:
            shmem.check_device(q, "q")
        return _PLANS.get(key, lambda: cls(q, k_cache, v_cache, kv_lens, block_table, softmax_scale, config, team))

    def launchers(self, q, k_cache, v_cache, kv_lens, block_table, out):
        """(split, merge, bound): the Launchers for this call's ``out`` and whether the bound launch applies (a
        contiguous out, every pointer 16-byte aligned: ``Launcher.run`` without the argument check)."""
        out_strides = (out.stride(0), out.stride(1))
        if out_strides != self.out_strides:
            if self.other_out is None:
                self.other_out = (Launcher(flash_decode_split_kernel, self.grid, **self.split_meta),
                                  Launcher(flash_decode_merge_kernel, (self.grid[1],), **self.merge_meta))
            return self.other_out + (False,)
        pointers = q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr() | kv_lens.data_ptr() | out.data_ptr()
        if block_table is not None:
            pointers |= block_table.data_ptr()
        return self.split, self.merge, q.is_cuda and not self.q_copy and pointers % 16 == 0

    def launch_split(self, q, k_cache, v_cache, kv_lens, block_table, dst_o, dst_lse, out, flags, state, ctx,
                     split=None, bound=False):
        if self.q_copy:
            q = q.contiguous()
        table = block_table if block_table is not None else kv_lens  # a dummy pointer when not paged
        args = (q, k_cache, v_cache, kv_lens, table, *self.part, dst_o, dst_lse, out, flags, state, ctx,
                *self.strides, out.stride(0), out.stride(1), *self.scalars)
        split = split or self.launchers(q, k_cache, v_cache, kv_lens, block_table, out)[0]
        if bound:
            split.run(*args)
        else:
            split(*args)


def resolved_config(q, k_cache, v_cache, kv_lens, block_table=None, softmax_scale=None, config=None,
                    distributed=True):
    """The knobs a call with these inputs would use: ``config`` over ``default_config``, with ``n_splits``,
    ``programs_per_sm`` and (``distributed``: sp_flash_decode) ``combine`` resolved."""
    dims = check_inputs(q, k_cache, v_cache, kv_lens, block_table, softmax_scale)
    return resolve(dims, q.dtype, q.device, config, distributed)


def local_flash_decode(q, k_cache, v_cache, kv_lens, block_table=None, softmax_scale=None, config=None, out=None,
                       lse=None):
    """Attention of ``q`` [B, Hq, D] over this rank's cache only: returns (o [B, Hq, D] in q's dtype,
    lse [B, Hq] float32, natural log; -inf where the rank holds no token of a sequence, with o = 0 there).
    ``out``/``lse`` may be given (contiguous; graph capture wants them fixed). Needs no ``triton_dist.init``;
    no communication. Inference-only (a backward through the results raises)."""
    plan = _Plan.get(q, k_cache, v_cache, kv_lens, block_table, softmax_scale, config, None)
    batch, q_heads, _, head_dim, _, _ = plan.dims
    if out is None:
        out = torch.empty((batch, q_heads, head_dim), dtype=q.dtype, device=q.device)
    else:
        _check_out(out, (batch, q_heads, head_dim), q.dtype, "out")
    if lse is None:
        lse = torch.empty((batch, q_heads), dtype=torch.float32, device=q.device)
    else:
        _check_out(lse, (batch, q_heads), torch.float32, "lse")
    if not plan.empty:  # (with triton_dist initialised, bad indices go to the error record through a context)
        recording = plan.split_meta["CHECK_INDICES"] == 2
        if recording:
            shmem.raise_pending_errors()
        ctx = shmem.context() if recording else kv_lens
        split, _, bound = plan.launchers(q, k_cache, v_cache, kv_lens, block_table, out)
        plan.launch_split(q, k_cache, v_cache, kv_lens, block_table, out, lse, out, kv_lens, kv_lens, ctx, split,
                          bound and lse.data_ptr() % 16 == 0 and ctx.data_ptr() % 16 == 0)
    return library.inference_only("local_flash_decode", (out, lse), q, k_cache, v_cache)


def sp_flash_decode(q, k_cache, v_cache, kv_lens, block_table=None, softmax_scale=None, out=None, config=None,
                    group=None):
    """Decode attention over a KV cache split across the ranks of ``group`` (default: the heap's); every rank gets
    the full result.

    ``q`` [B, Hq, D] (the same on every rank); ``k_cache``/``v_cache`` this rank's shard [B, S_local_max, Hkv, D]
    (or, with ``block_table`` [B, max_pages], a paged cache [num_pages, page_size, Hkv, D]); ``kv_lens`` [B]
    int32/int64: how many tokens of each sequence this rank holds (0 allowed). Indices are checked on the
    device, without a sync: a length outside [0, S_local_max] or a page id outside the cache is never used to
    address memory and raises ``DeviceIndexError`` at the next op call (or ``check_errors()``). GQA: Hq a multiple of Hkv, query head h uses KV head h // (Hq / Hkv).
    ``softmax_scale`` defaults to 1/sqrt(D). Returns o [B, Hq, D] in q's dtype (zeros for a sequence with no
    tokens on any rank); ``out`` may be given (any strides with a contiguous last dimension). fp16, bf16 or fp32.

    Collective: every rank calls it with the same B, Hq, Hkv, D and config, in the same order. The first call for a
    shape allocates symmetric buffers (collective, not graph capturable); later calls are graph capturable.
    ``config``: launch knobs (see ``default_config``), identical on every rank. Inference-only: where an input
    requires grad, a backward through the result raises RuntimeError.
    """
    team = shmem.op_team("sp_flash_decode", group, lambda: dict(
        q=tuple(getattr(q, "shape", ())), dtype=str(getattr(q, "dtype", None)),
        kv_heads=tuple(getattr(k_cache, "shape", ())[2:]), paged=block_table is not None,
        softmax_scale=softmax_scale, config=config))
    plan = _Plan.get(q, k_cache, v_cache, kv_lens, block_table, softmax_scale, config, team)
    ctx = plan.ctx
    batch, q_heads, _, head_dim, _, _ = plan.dims
    if out is None:
        out = torch.empty((batch, q_heads, head_dim), dtype=q.dtype, device=q.device)
    elif not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be a {q.dtype} tensor of shape {[batch, q_heads, head_dim]} with a contiguous "
                         f"last dimension, got {out.dtype} {list(out.shape)}")
    if plan.empty:
        return library.inference_only("sp_flash_decode", out, q, k_cache, v_cache)
    ex = plan.exchange
    shmem.raise_pending_errors()
    split, merge, bound = plan.launchers(q, k_cache, v_cache, kv_lens, block_table, out)
    plan.launch_split(q, k_cache, v_cache, kv_lens, block_table, ex.recv_o, ex.recv_lse, out, ex.flags, ex.state,
                      ctx, split, bound)
    if plan.mode == MODE_PUSH:
        args = (ex.recv_o, ex.recv_lse, ex.flags, out, ex.state, ctx, out.stride(0), out.stride(1),
                *plan.scalars[:3])
        if bound:
            merge.run(*args)
        else:
            merge(*args)
    return library.inference_only("sp_flash_decode", out, q, k_cache, v_cache)


# ----------------------------------------------------------------------------------------------- torch op
def _sp_flash_decode_op(q, k_cache, v_cache, kv_lens, block_table=None, softmax_scale=None, group_name=None):
    return sp_flash_decode(q, k_cache, v_cache, kv_lens, block_table=block_table, softmax_scale=softmax_scale,
                           group=shmem.group_named(group_name))


def _sp_flash_decode_fake(q, k_cache, v_cache, kv_lens, block_table=None, softmax_scale=None, group_name=None):
    return q.new_empty(q.shape)


library.define("sp_flash_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor kv_lens, Tensor? block_table=None, "
               "float? softmax_scale=None, str? group_name=None) -> Tensor", _sp_flash_decode_op,
               _sp_flash_decode_fake)
library.inference_only_op("sp_flash_decode")
