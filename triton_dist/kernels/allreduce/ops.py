"""The ops ``all_reduce`` and ``all_reduce_rmsnorm`` (one launch of ``all_reduce_kernel`` each, or NCCL), their
torch baselines (also the "nccl" paths) and their ``torch.ops.triton_dist`` registrations."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ... import hardware, shmem
from ...hardware import next_power_of_2
from .. import library
from ..fp8 import E4M3_MAX
from .config import MAX_ROW, bucket
from .host import NCCL, Plan, check_algo, check_tensor, heap_offset, plan_pair, resolve_configs, zero_copy
from .kernels import EPILOGUE_RMSNORM, EPILOGUE_RMSNORM_FP8, EPILOGUE_STORE

FP8 = torch.float8_e4m3fn
_PLANS = {op: shmem.Plans(op) for op in ("all_reduce", "all_reduce_rmsnorm")}


# ----------------------------------------------------------------------------------------------- all_reduce
def all_reduce_nccl(x, out=None, group=None):
    """The baseline and the "nccl" path: ``dist.all_reduce`` (NCCL; gloo on CPU) on a copy of x (or in ``out``)."""
    out = x.clone() if out is None else (out if out.data_ptr() == x.data_ptr() else out.copy_(x))
    dist.all_reduce(out, group=shmem.team(group).group)
    return out


def _check_out(out, x):
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {x.dtype} tensor of shape {list(x.shape)} on {x.device}, got "
                         f"{out.dtype} {list(out.shape)} on {out.device}")
    nbytes = x.numel() * x.element_size()
    if out.data_ptr() != x.data_ptr() and out.data_ptr() < x.data_ptr() + nbytes and \
            x.data_ptr() < out.data_ptr() + nbytes:
        raise ValueError("out overlaps x: pass x itself (in place) or a tensor of its own")


def _all_reduce(x, out, algo, config, team):
    """The op on checked, contiguous, non-empty inputs: one dictionary look-up, then the launch (or NCCL)."""
    in_place = out is not None and out.data_ptr() == x.data_ptr()
    key = (team.name, x.numel(), x.dtype, algo, shmem.is_symmetric(x), in_place,
           config and repr(sorted(config.items())))
    plan = _PLANS["all_reduce"].get(key, lambda: _all_reduce_plans(x, in_place, algo, config, team))[
        hardware.capturing()]
    if plan is NCCL:
        return all_reduce_nccl(x, out, team.group)
    out = torch.empty_like(x) if out is None else out
    plan.launch(x, out)
    return out


def _all_reduce_plans(x, in_place, algo, config, team):
    """The (eager, captured) plans of a call (``NCCL``: the NCCL path)."""
    def build(cfg):
        if cfg["algo"] == "nccl":
            return NCCL
        return Plan("all_reduce", x, x.dtype, cfg["block"], cfg["block"], EPILOGUE_STORE, cfg,
                    zero_copy(x, in_place, cfg["algo"], team.size), team)

    return plan_pair(resolve_configs("all_reduce", x.numel() * x.element_size(), team, algo, config, x.device,
                                     lambda: _tuning_call(x, team), dict(dtype=str(x.dtype))), build)


def _tuning_call(x, team):
    """``call(cfg)``: one all_reduce of a fresh tensor the size of x's bucket, with ``cfg`` (see config.tuned)."""
    t = torch.randn(bucket(x.numel() * x.element_size()) // x.element_size(), device=x.device).to(x.dtype)
    out = torch.empty_like(t)
    return lambda cfg: _all_reduce(t, out, cfg["algo"], cfg, team)


def all_reduce(x, out=None, algo="auto", group=None, config=None):
    """``sum over the ranks of group of x`` on every rank (``group`` default: the heap's), fp32 accumulation in
    rank order 0..W-1: bitwise identical on every rank and every run, whichever of our algorithms runs
    (``algo="nccl"``, and ``"auto"`` where it picks NCCL, sums in NCCL's order instead: the same on every rank).

    ``x``: any float16/bfloat16/float32 tensor, the same shape on every rank. A symmetric ``x``
    (``td.shmem.empty``, the same tensor on every rank of the group) is read in place by the peers (zero-copy);
    any other x is copied into the heap inside the kernel. ``out``: the result's tensor (contiguous, x's shape and
    dtype; x itself for an in-place call), else a new one. ``algo``: "auto" (by size and world size, tuned on
    GPU; in a group of one a copy), "one_shot", "two_shot" or "nccl". ``config``: knobs of ``config.default_config``.
    Collective: every rank of the group calls it alike (same shape, algo and kind of x). CUDA graphs: call it
    once per size before capturing (workspaces and tuning happen outside the capture).
    Autograd: an ``x`` that requires grad goes through the torch op (``config``: its forward's, eagerly; ``out``
    is for calls without grad); the gradient is that of the sum of every rank's loss: ``all_reduce`` of the
    output's gradient.
    """
    check_tensor(x, "x")
    check_algo(algo)
    if out is not None:
        _check_out(out, x)
    if library.needs_grad(x):
        if out is not None:
            raise ValueError("all_reduce: out= is for calls without grad (under torch.no_grad())")
        return library.with_caller_config("all_reduce", config, lambda: torch.ops.triton_dist.all_reduce(
            x, algo, shmem.group_name(group)))
    if out is None and config is None and hardware.compiling():
        return torch.ops.triton_dist.all_reduce(x, algo, shmem.group_name(group))
    team = shmem.op_team("all_reduce", group, lambda: dict(
        shape=tuple(x.shape), dtype=str(x.dtype), algo=algo, config=config, out=out is not None,
        in_place=out is not None and out.data_ptr() == x.data_ptr(), heap_offset=heap_offset(x)))
    if x.numel() == 0:
        return torch.empty_like(x) if out is None else out
    if team.size == 1 and algo == "auto" and config is None:  # a group of one: the sum is x, a copy (as NCCL's)
        if out is None:
            return torch.empty(x.shape, dtype=x.dtype, device=x.device).copy_(x)
        return out if out.data_ptr() == x.data_ptr() else out.copy_(x)
    return _all_reduce(x.contiguous(), out, algo, config, team)


# ----------------------------------------------------------------------------------------------- + RMSNorm
def quantize_fp8_rows(y):
    """(y / scale as float8_e4m3fn, scale [..., 1] fp32) with scale = amax(|y|) / 448 per row (0 for a zero row)."""
    scale = y.float().abs().amax(-1, keepdim=True) / E4M3_MAX
    q = (y.float() / torch.where(scale > 0, scale, torch.ones_like(scale))).clamp(-E4M3_MAX, E4M3_MAX)
    return q.to(FP8), scale


def all_reduce_rmsnorm_torch(x, residual, weight, eps, out_fp8=False, group=None):
    """The baseline and the "nccl" path: ``dist.all_reduce``, then torch's add and ``rms_norm`` (and
    ``quantize_fp8_rows``)."""
    new_residual = residual + all_reduce_nccl(x, group=group)
    normed = F.rms_norm(new_residual, (x.shape[-1],), weight.to(new_residual.dtype), eps)
    if not out_fp8:
        return normed, new_residual
    q, scales = quantize_fp8_rows(normed)
    return q, new_residual, scales


def rmsnorm_backward(h, weight, eps, grad):
    """fp32 (d h, d weight) of ``normed = h * rsqrt(mean(h^2) + eps) * weight`` over the last dim, for ``grad`` of
    normed (None: zeros)."""
    h = h.float()
    if grad is None:
        return torch.zeros_like(h), torch.zeros(weight.shape, dtype=torch.float32, device=h.device)
    r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    gw = grad.float() * weight.float()
    d_h = r * gw - h * r.pow(3) * (h * gw).mean(-1, keepdim=True)
    return d_h, (grad.float() * h * r).reshape(-1, h.shape[-1]).sum(0)


def _check_rmsnorm_inputs(x, residual, weight, eps):
    for t, name in ((x, "x"), (residual, "residual"), (weight, "weight")):
        check_tensor(t, name)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the hidden one, last)")
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual must match x ({x.dtype} {list(x.shape)}), got {residual.dtype} "
                         f"{list(residual.shape)}")
    if weight.shape != x.shape[-1:] or weight.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"weight must be a [{x.shape[-1]}] tensor of {x.dtype} or float32, got {weight.dtype} "
                         f"{list(weight.shape)}")
    if not 0 < x.shape[-1] <= MAX_ROW:
        raise ValueError(f"the hidden size (x's last dimension) must be in [1, {MAX_ROW}], got {x.shape[-1]}")
    _check_eps(eps)


def _check_eps(eps):
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be a positive number, got {eps!r}")


_CHECKED = shmem.Plans("all_reduce_rmsnorm_inputs")  # the inputs' layouts whose checks passed


def _checked_rmsnorm_inputs(x, residual, weight, eps):
    """``_check_rmsnorm_inputs``, whose tensor checks a layout (types, shapes, dtypes, devices) passes once."""
    try:
        key = (x.shape, x.dtype, x.device, residual.shape, residual.dtype, residual.device, weight.shape,
               weight.dtype, weight.device, type(x), type(residual), type(weight))
    except AttributeError:  # not tensors: the checks say which
        key = None
    if key is None or _CHECKED.find(key) is None:
        _check_rmsnorm_inputs(x, residual, weight, eps)
        _CHECKED.get(key, lambda: True)
    else:
        _check_eps(eps)


def _all_reduce_rmsnorm(x, residual, weight, eps, out_fp8, algo, config, team):
    key = (team.name, x.shape, x.dtype, weight.dtype, out_fp8, algo, shmem.is_symmetric(x),
           config and repr(sorted(config.items())))
    plan = _PLANS["all_reduce_rmsnorm"].get(key, lambda: _rmsnorm_plans(x, weight, eps, out_fp8, algo, config,
                                                                        team))[hardware.capturing()]
    if plan is NCCL:
        return all_reduce_rmsnorm_torch(x, residual, weight, eps, out_fp8, team.group)
    normed = torch.empty(x.shape, dtype=FP8 if out_fp8 else x.dtype, device=x.device)
    new_residual = torch.empty_like(residual)
    scales = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device) if out_fp8 else None
    plan.launch(x, normed, residual, weight, new_residual, scales, float(eps))
    return (normed, new_residual, scales) if out_fp8 else (normed, new_residual)


def _rmsnorm_plans(x, weight, eps, out_fp8, algo, config, team):
    hidden = x.shape[-1]

    def build(cfg):
        if cfg["algo"] == "nccl":
            return NCCL
        return Plan("all_reduce_rmsnorm", x, torch.float32, hidden, next_power_of_2(hidden),
                    EPILOGUE_RMSNORM_FP8 if out_fp8 else EPILOGUE_RMSNORM, cfg,
                    zero_copy(x, False, cfg["algo"], team.size), team)

    return plan_pair(resolve_configs("all_reduce_rmsnorm", x.numel() * x.element_size(), team, algo, config,
                                     x.device, lambda: _rmsnorm_tuning_call(x, weight, eps, out_fp8, team),
                                     dict(dtype=str(x.dtype), hidden=hidden, fp8=out_fp8), row_len=hidden), build)


def _rmsnorm_tuning_call(x, weight, eps, out_fp8, team):
    rows = max(1, bucket(x.numel() * x.element_size()) // (x.shape[-1] * x.element_size()))  # fill the bucket
    t = torch.randn(rows, x.shape[-1], device=x.device).to(x.dtype)
    res = torch.randn_like(t)
    return lambda cfg: _all_reduce_rmsnorm(t, res, weight, eps, out_fp8, cfg["algo"], cfg, team)


def all_reduce_rmsnorm(x, residual, weight, eps, out_fp8=False, group=None, algo="auto", config=None):
    """``new_residual = residual + all_reduce(x)``, ``normed = new_residual * rsqrt(mean(new_residual^2) + eps) *
    weight`` over the last (hidden) dimension, in one kernel; returns ``(normed, new_residual)``, or with
    ``out_fp8`` ``(normed as float8_e4m3fn, new_residual, scales)``, ``scales`` [..., 1] float32 per token
    (amax(|normed|) / 448; normed ~ fp8 * scale).

    ``x``, ``residual``: [..., H] float16/bfloat16/float32 of one dtype (the same shape on every rank);
    ``weight``: [H], x's dtype or float32; ``eps`` > 0. The sum is the one of ``all_reduce`` (fp32, rank order),
    each rank adds its own residual; new_residual is rounded to its dtype before the norm is taken. A symmetric
    ``x`` is read in place (zero-copy). ``algo``, ``config``, collectiveness, graphs: as ``all_reduce``.
    Autograd (``x``, ``residual`` or ``weight`` requiring grad: through the torch op, ``config`` its forward's,
    eagerly; not with ``out_fp8``): gradients of the residual, the weight and x (``all_reduce`` of new_residual's
    gradient), ``kernels/autograd.py``.
    """
    _checked_rmsnorm_inputs(x, residual, weight, eps)
    check_algo(algo)
    if library.needs_grad(x, residual, weight):
        if out_fp8:
            raise ValueError("all_reduce_rmsnorm: out_fp8=True has no backward (call it under torch.no_grad())")
        return tuple(library.with_caller_config("all_reduce_rmsnorm", config, lambda: torch.ops.triton_dist.
                                                all_reduce_rmsnorm(x, residual, weight, float(eps), False, algo,
                                                                   shmem.group_name(group)))[:2])
    if config is None and hardware.compiling():
        res = torch.ops.triton_dist.all_reduce_rmsnorm(x, residual, weight, float(eps), out_fp8, algo,
                                                       shmem.group_name(group))
        return tuple(res) if out_fp8 else tuple(res[:2])
    team = shmem.op_team("all_reduce_rmsnorm", group, lambda: dict(
        shape=tuple(x.shape), dtype=str(x.dtype), weight=str(weight.dtype), eps=float(eps), out_fp8=out_fp8,
        algo=algo, config=config, heap_offset=heap_offset(x)))
    if x.numel() == 0:
        empty = torch.empty(x.shape, dtype=FP8 if out_fp8 else x.dtype, device=x.device)
        scales = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
        return (empty, torch.empty_like(residual), scales) if out_fp8 else (empty, torch.empty_like(residual))
    return _all_reduce_rmsnorm(x.contiguous(), residual.contiguous(), weight.contiguous(), eps, out_fp8, algo,
                               config, team)


# ----------------------------------------------------------------------------------------------- torch ops
def _all_reduce_op(x, algo="auto", group_name=None):
    with torch.no_grad():  # (below autograd: the public function must not route back to the op)
        return all_reduce(x, algo=algo, group=shmem.group_named(group_name), config=library.caller_config("all_reduce"))


def _all_reduce_fake(x, algo="auto", group_name=None):
    return torch.empty_like(x)


def _rmsnorm_op(x, residual, weight, eps, out_fp8=False, algo="auto", group_name=None):
    with torch.no_grad():  # (below autograd: the public function must not route back to the op)
        res = all_reduce_rmsnorm(x, residual, weight, eps, out_fp8, shmem.group_named(group_name), algo,
                                 library.caller_config("all_reduce_rmsnorm"))
    return res if out_fp8 else (*res, x.new_empty((0,), dtype=torch.float32))


def _rmsnorm_fake(x, residual, weight, eps, out_fp8=False, algo="auto", group_name=None):
    _check_rmsnorm_inputs(x, residual, weight, eps)
    scales = x.new_empty((*x.shape[:-1], 1) if out_fp8 else (0,), dtype=torch.float32)
    return x.new_empty(x.shape, dtype=FP8 if out_fp8 else x.dtype), torch.empty_like(residual), scales


library.define("all_reduce(Tensor x, str algo='auto', str? group_name=None) -> Tensor", _all_reduce_op,
               _all_reduce_fake)
library.define("all_reduce_rmsnorm(Tensor x, Tensor residual, Tensor weight, float eps, bool out_fp8=False, "
               "str algo='auto', str? group_name=None) -> (Tensor, Tensor, Tensor)", _rmsnorm_op, _rmsnorm_fake)
