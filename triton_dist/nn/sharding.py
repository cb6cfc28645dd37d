"""How the layers of ``triton_dist.nn`` split rows over ranks and put them back together, and the one place where
they reach the zoo's ops on their process group.

Two modes, per layer (``sequence_parallel``):

    True   rows in and out are sharded like ``torch.tensor_split(rows, W)`` (the native ag_gemm -> gemm_rs shape,
           as between the blocks of a sequence-parallel transformer). Uneven shards: pass the layer's forward
           ``total_rows`` (a rank cannot tell from its own shard whether a peer holds one row more).
    False  every rank holds the full rows (a replicated model, as ``parallelize`` leaves one): the layer works on
           this rank's slice, rows [r * m, min(M, (r + 1) * m)) with m = cdiv(M, W) rounded up to a few sizes
           per octave (``bucket_rows``: fewer distinct workspaces), padded with zero rows to m
           so that every rank's ops see the same shapes, and all-gathers the output slices: the first M rows of
           the gathered [W * m, ...] are the full output, equal to the dense module's. A slice is taken straight
           into its padded [m, ...] tensor (``take_rows``), never as a [count, ...] tensor of its own: every rank
           then traces the same graph, tensor for tensor (only the slice's bounds differ), and torch.compile
           schedules its collectives in the same order on every rank. (Inductor's memory-driven reordering does not
           keep the ops' ORDERED effect: graphs whose buffers differ in size from rank to rank, as a 15-token batch's
           slices of 8 and 7 rows did, had one rank all_reduce a weight gradient while its peer dispatched.)

``GroupOps`` binds the ops (ag_gemm, gemm_rs, all_gather, ep_dispatch / ep_combine, sp_flash_decode) to a
layer's process group (None: the group ``triton_dist.init`` was given).

Training. The ops' gradients are those of the sum of every rank's loss (``kernels/autograd.py``): right for
sequence-parallel rows, where each rank's loss covers its own rows. A replicated model has ONE loss, copied on
every rank, so where a layer takes its slice of replicated rows or features it gathers the slices' gradients in
the backward (every rank gets the whole gradient, as the dense module would), and where it gathers the slices of
its output it takes its own slice of the gradient (``take_slice`` / ``gather_slices``: Megatron-LM's
scatter / gather conjugates). A replicated parameter used on sequence-parallel rows (a row-parallel bias) gets
the sum of every rank's gradient (``replicated_param``).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import hardware, shmem
from ..kernels import ag_gemm, all_gather, all_reduce, ep_combine, ep_dispatch, gemm_rs, sp_flash_decode
from ..kernels.gemm_reducescatter import rows_of_rank
from ..hardware import cdiv


def resolve_group(group):
    """The group a layer runs on: a torch.distributed process group, or None (the group ``triton_dist.init`` was
    given); anything else is a ValueError."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    return group


class GroupOps:
    """The zoo's ops on one layer's group (``resolve_group``), with its world size and this rank's index in it."""

    def __init__(self, group=None):
        self.group = resolve_group(group)
        self.world, self.rank = shmem.world_size(self.group), shmem.rank(self.group)

    def __deepcopy__(self, memo):  # no state of its own; a process group cannot be copied
        return self

    def ag_gemm(self, a, w, activation="none", quantize=None, fp8_grads=False):
        return ag_gemm(a, w, activation=activation, group=self.group, quantize=quantize, fp8_grads=fp8_grads)

    def gemm_rs(self, a, w, quantize=None, fp8_grads=False):
        return gemm_rs(a, w, group=self.group, quantize=quantize, fp8_grads=fp8_grads)

    def all_reduce(self, x):
        return all_reduce(x, group=self.group)

    def all_gather(self, x):
        """Every rank's ``x`` (equal shapes), gathered into a symmetric buffer cached per shape: the callers copy
        what they keep out of it (``drop_padding``) before the next call. (Under torch.compile: the torch op, a
        new tensor.)"""
        if hardware.compiling():
            return all_gather(x, group=self.group)
        shape = (self.world * x.shape[0], *x.shape[1:])
        out = shmem.workspace("nn.all_gather", (shape, x.dtype),
                              lambda: shmem.empty(shape, x.dtype, name="nn.all_gather.out", group=self.group),
                              group=self.group)
        return all_gather(x, out=out, group=self.group)

    def ep_dispatch(self, x, topk_idx, topk_weights, num_experts, max_tokens, align):
        return ep_dispatch(x, topk_idx, topk_weights, num_experts=num_experts, max_tokens=max_tokens, align=align,
                           group=self.group)

    def ep_combine(self, y, handle):
        return ep_combine(y, handle)

    def sp_flash_decode(self, q, k_cache, v_cache, kv_lens, block_table, softmax_scale):
        return sp_flash_decode(q, k_cache, v_cache, kv_lens, block_table=block_table, softmax_scale=softmax_scale,
                               group=self.group)


@dataclass
class Rows:
    """Where this rank's rows sit: ``shard`` rows per rank after padding (the same on every rank), this rank's
    ``start`` and ``count`` of the ``total`` rows, and every rank's count (``counts``)."""

    total: int
    shard: int
    start: int
    count: int
    counts: list
    sequence_parallel: bool

    @property
    def uneven(self):
        return any(c != self.shard for c in self.counts)


def bucket_rows(rows):
    """Rows per rank rounded up to one of a few sizes per octave (at most 1/4 padding): every distinct size
    makes the ops build workspaces, so a model fed many sequence lengths must not see each one."""
    if rows <= 16:
        return rows
    step = 1 << max(0, rows.bit_length() - 3)  # 4 sizes per power of two
    return cdiv(rows, step) * step


def plan_rows(x, ops, sequence_parallel, total_rows=None):
    """The ``Rows`` of a layer's input ``x`` [rows, ...] (the full rows, or this rank's shard)."""
    world, rank = ops.world, ops.rank
    if not sequence_parallel:
        m = x.shape[0]
        shard = m if world == 1 else bucket_rows(cdiv(m, world))  # a group of one: no slices, no padding
        counts = [max(0, min(m, (r + 1) * shard) - r * shard) for r in range(world)]
        return Rows(m, shard, rank * shard, counts[rank], counts, False)
    total = world * x.shape[0] if total_rows is None else int(total_rows)
    counts = [rows_of_rank(total, world, r)[1] for r in range(world)]
    if counts[rank] != x.shape[0]:
        raise ValueError(f"rank {rank} holds {x.shape[0]} rows, but its tensor_split share of total_rows={total} "
                         f"is {counts[rank]}" + ("" if total_rows is not None else
                                                 " (uneven shards: pass total_rows)"))
    return Rows(total, cdiv(total, world), rows_of_rank(total, world, rank)[0], counts[rank], counts, True)


def local_rows(x, rows, ops):
    """This rank's rows of ``x``, padded with zero rows to ``rows.shard`` (equal shapes on every rank)."""
    mine = x if rows.sequence_parallel else take_rows(x, ops, rows)
    return pad_rows(mine, rows.shard).contiguous()


def own_rows(x, rows, world, fill=0):
    """This rank's rows of a replicated ``x`` [M, ...]: rows ``[rows.start, rows.start + rows.shard)`` of ``x``
    padded with ``fill`` rows to ``world * rows.shard`` (a view; no gradient: ``take_rows``). Every rank runs the
    same ops on the same shapes (the module docstring), only the view's offset differs."""
    return pad_rows(x, world * rows.shard, fill).narrow(0, rows.start, rows.shard)


def pad_rows(t, count, fill=0):
    """``t`` [n, ...] with ``fill`` rows (zeros) appended up to ``count`` rows (``t`` itself when it has them)."""
    if t.shape[0] == count:
        return t
    padded = t.new_full((count, *t.shape[1:]), fill)
    padded[:t.shape[0]] = t
    return padded


def drop_padding(gathered, rows):
    """[W * shard, ...] rows of every rank (padded) -> the ``rows.total`` real rows, in order: a view of
    ``gathered`` unless sequence-parallel shards are uneven."""
    if not rows.sequence_parallel:  # slices were contiguous ranges padded at the end of the whole
        return gathered[:rows.total]
    if not rows.uneven:
        return gathered
    per_rank = gathered.view(len(rows.counts), rows.shard, *gathered.shape[1:])
    return torch.cat([per_rank[r, :c] for r, c in enumerate(rows.counts)])


def finish_rows(y, rows, ops):
    """A layer's padded output rows of this rank [shard, ...] -> its result: this rank's rows (sequence parallel)
    or every rank's, all-gathered (replicated)."""
    if rows.sequence_parallel:
        return y[:rows.count]
    return gather_slices(y, ops, 0, rows)


# ----------------------------------------------------------------------------------------------- training
def _gather(t, ops, dim, rows):
    """Every rank's ``t`` (equal shapes) concatenated along ``dim`` (rows: ``rows.total`` real ones, padding
    dropped), a new tensor."""
    if dim == 0:  # (out of the all_gather's workspace: a copy)
        real = drop_padding(ops.all_gather(t.contiguous()), rows)
        return real if rows.sequence_parallel and rows.uneven else real.clone()
    slices = ops.all_gather(t.contiguous()).view(ops.world, *t.shape)  # [W, M, f]: rank r's features r-th
    return slices.permute(1, 0, 2).reshape(t.shape[0], ops.world * t.shape[1])


class _TakeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ops, rows):
        ctx.ops, ctx.rows = ops, rows
        return own_rows(x, rows, ops.world).clone()

    @staticmethod
    def backward(ctx, grad):  # every rank's padded slice gradient, gathered; the padding dropped
        return _gather(grad, ctx.ops, 0, ctx.rows), None, None


class _TakeSlice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ops, dim, start, count, rows):
        ctx.ops, ctx.dim, ctx.rows, ctx.count = ops, dim, rows, count
        return x.narrow(dim, start, count).clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.dim == 0:  # rows: every rank's padded slice gradient, gathered
            return _gather(pad_rows(grad, ctx.rows.shard), ctx.ops, 0, ctx.rows), None, None, None, None, None
        return _gather(grad, ctx.ops, 1, None), None, None, None, None, None


class _GatherSlices(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, ops, dim, rows):
        ctx.ops, ctx.dim, ctx.rows, ctx.width = ops, dim, rows, y.shape[dim]
        return _gather(y, ops, dim, rows)

    @staticmethod
    def backward(ctx, grad):
        if ctx.dim == 0:  # this rank's rows of the (replicated) gradient, padded back to the shard
            return own_rows(grad, ctx.rows, ctx.ops.world).clone(), None, None, None
        return grad.narrow(1, ctx.ops.rank * ctx.width, ctx.width), None, None, None


class _ReplicatedParam(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p, ops):
        ctx.ops = ops
        return p.view_as(p)

    @staticmethod
    def backward(ctx, grad):
        return ctx.ops.all_reduce(grad.contiguous()), None


def take_slice(x, ops, dim, start, count, rows=None):
    """``x.narrow(dim, start, count)`` of a replicated ``x`` (dim 0: rows, ``rows`` their ``Rows``; 1: features);
    backward: every rank's slice gradient gathered, so that each rank holds the whole gradient."""
    start = min(start, x.shape[dim] - count)  # (a rank without rows: an empty slice at the end)
    if ops.world == 1:  # the whole of x: autograd's own view, nothing to gather
        return x.narrow(dim, start, count)
    return _TakeSlice.apply(x, ops, dim, start, count, rows) if torch.is_grad_enabled() and x.requires_grad \
        else x.narrow(dim, start, count)


def take_rows(x, ops, rows):
    """This rank's rows of a replicated ``x`` [M, ...] (``rows``: a replicated plan, ``plan_rows``), padded with
    zero rows to ``rows.shard``: the same shape on every rank (the module docstring). Backward: every rank's slice
    gradient gathered, so that each rank holds the whole gradient."""
    if ops.world == 1:  # the whole of x (a group of one: no padding)
        return x
    return _TakeRows.apply(x, ops, rows) if torch.is_grad_enabled() and x.requires_grad \
        else own_rows(x, rows, ops.world)


def gather_slices(y, ops, dim, rows=None):
    """Every rank's slice ``y`` concatenated along ``dim`` (0: rows, padding dropped; 1: features), the
    replicated result; backward: this rank's slice of the gradient."""
    if ops.world == 1:  # its own slice is the whole (rows: less the padding)
        return y[:rows.total] if dim == 0 else y
    return _GatherSlices.apply(y, ops, dim, rows) if torch.is_grad_enabled() and y.requires_grad \
        else _gather(y, ops, dim, rows)


def replicated_param(p, ops):
    """``p`` (the same on every rank) for use on this rank's share of the rows: backward sums every rank's
    gradient."""
    return _ReplicatedParam.apply(p, ops) if ops.world > 1 and torch.is_grad_enabled() and p.requires_grad else p
