"""Tensor-parallel linear layers and the gated MLP, on the overlapped ops: ag_gemm in, gemm_rs out.

    ColumnParallelLinear   y = x @ W.T + b,  W's output features split over ranks      ag_gemm
    RowParallelLinear      y = x @ W.T + b,  W's input features split over ranks       gemm_rs
    TensorParallelMLP      down(silu(gate(x)) * up(x)), the intermediate split:         ag_gemm(silu_gate) -> gemm_rs

Rank r holds the r-th of W equal slices (``torch.chunk`` of the split dimension; it must divide by W).
``sequence_parallel`` picks what goes in and out (``sharding.py``): True, the native shapes (rows sharded like
``torch.tensor_split``; the column-parallel output and the row-parallel input hold every row and this rank's
features); False, the full activations in and the full output out on every rank, like the dense module.
``from_dense(module_or_state_dict, group=None)`` loads this rank's slices from the unsharded module.

The MLP (a Llama-style block: ``gate_proj``, ``up_proj``, ``down_proj``, SiLU) stores its gate and up slices
stacked, ``[gate_r; up_r]``, so that ag_gemm's fused SiLU-gate epilogue writes only ``silu(gate) * up``.

FP8 training (``fp8="tensor" | "row" | "block"``, the usual recipe: FP8 forward, high-precision gradients): the
weights stay the bf16 / fp32 parameters (the master weights); each forward quantises the input rows and the
weight slice to e4m3 with scales taken on the device (per tensor, per row / output channel, or 1x128 groups and
128x128 blocks, of this rank's operands: ``kernels/fp8.py``) and runs the overlapped FP8 ag_gemm / gemm_rs
(their ``quantize=`` mode). The backward is the high-precision layer's, from the unquantised input and weight
(straight-through). None: no quantisation. ``fp8_grads=True`` (with ``fp8`` only; DeepSeek-V3's recipe): the
backward's GEMMs in FP8 too, each operand (the output gradient, the saved input or weight) quantised to e4m3 in
the same mode along that GEMM's reduction dimension, dynamic scales of its own (the ops' ``fp8_grads``,
``kernels/autograd.py``); the gradients come out in the parameters' dtype.
"""

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.fp8 import check_fp8_grads, check_mode
from .sharding import (GroupOps, drop_padding, finish_rows, gather_slices, local_rows, pad_rows, plan_rows,
                       replicated_param, take_slice)


def state_of(module_or_state_dict):
    """A module's state dict (tensors detached), or the dict itself."""
    if isinstance(module_or_state_dict, nn.Module):
        return {k: v.detach() for k, v in module_or_state_dict.state_dict().items()}
    if isinstance(module_or_state_dict, dict):
        return module_or_state_dict
    raise TypeError(f"expected an nn.Module or a state dict, got {type(module_or_state_dict).__name__}")


def check_silu(module, what):
    """ValueError unless ``module.act_fn`` (when it has one) is SiLU: the fused epilogues compute silu(gate)."""
    act = getattr(module, "act_fn", None)
    if act is not None and not isinstance(act, nn.SiLU) and type(act).__name__ not in ("SiLU", "SiLUActivation"):
        raise ValueError(f"{what}: activation {type(act).__name__} is not supported (triton_dist fuses SiLU only)")


def gated_mlp_weights(module_or_state_dict, what="module"):
    """(gate [I, H], up [I, H], down [H, I]) of a Llama-style gated MLP (``gate_proj``/``up_proj``/``down_proj``,
    no biases, SiLU), or ValueError naming ``what``."""
    if isinstance(module_or_state_dict, nn.Module):
        check_silu(module_or_state_dict, what)
    sd = state_of(module_or_state_dict)
    names = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
    missing = [n for n in names if n not in sd]
    if missing:
        raise ValueError(f"{what}: not a gated MLP (missing {missing}; has {sorted(sd)})")
    biases = [k for k in sd if k.endswith(".bias")]
    if biases:
        raise ValueError(f"{what}: biases {biases} are not supported in a gated MLP (the SiLU gate is fused)")
    gate, up, down = (sd[n] for n in names)
    if gate.shape != up.shape or down.shape != (gate.shape[1], gate.shape[0]):
        raise ValueError(f"{what}: gate {list(gate.shape)}, up {list(up.shape)}, down {list(down.shape)} do not "
                         f"form an MLP")
    return gate, up, down


def _split(t, dim, ops, what):
    """This rank's slice of ``t`` along ``dim`` (equal slices, a copy)."""
    if t.shape[dim] % ops.world:
        raise ValueError(f"{what}: size {t.shape[dim]} is not divisible by the {ops.world} ranks")
    return t.chunk(ops.world, dim)[ops.rank].contiguous().clone()


def _linear_state(module_or_state_dict, what):
    sd = state_of(module_or_state_dict)
    if "weight" not in sd or sd["weight"].dim() != 2:
        raise ValueError(f"{what}: expected a Linear's state (a 2-D 'weight', optional 'bias'), got {sorted(sd)}")
    return sd["weight"], sd.get("bias")


class _ParallelLinear(nn.Module):
    """A linear layer whose weight is split along ``SPLIT_DIM`` (0: output features, 1: input features);
    ``fp8``: None, or the FP8 training mode, ``fp8_grads``: its backward in FP8 too (the module docstring)."""

    SPLIT_DIM = 0

    def __init__(self, in_features, out_features, bias=True, *, sequence_parallel=False, group=None, dtype=None,
                 device=None, fp8=None, fp8_grads=False):
        super().__init__()
        split_dim = self.SPLIT_DIM
        self.fp8 = check_mode(fp8, f"{type(self).__name__}: fp8")
        self.fp8_grads = check_fp8_grads(fp8_grads, self.fp8, f"{type(self).__name__}: fp8_grads", "fp8")
        self.ops = GroupOps(group)
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel = bool(sequence_parallel)
        full = (out_features, in_features)
        if full[split_dim] % self.ops.world:
            raise ValueError(f"{type(self).__name__}: {'out' if split_dim == 0 else 'in'}_features={full[split_dim]} "
                             f"is not divisible by the {self.ops.world} ranks")
        shape = list(full)
        shape[split_dim] //= self.ops.world
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        bias_size = shape[0] if split_dim == 0 else out_features
        self.bias = nn.Parameter(torch.zeros(bias_size, dtype=dtype, device=device)) if bias else None

    @classmethod
    def from_dense(cls, module_or_state_dict, group=None, sequence_parallel=False, fp8=None, fp8_grads=False):
        """From an ``nn.Linear`` (or its state dict): this rank's slice of the weight (column parallel: of the
        output features and the bias; row parallel: of the input features, the bias kept whole)."""
        split_dim = cls.SPLIT_DIM
        weight, bias = _linear_state(module_or_state_dict, cls.__name__)
        layer = cls(weight.shape[1], weight.shape[0], bias is not None, sequence_parallel=sequence_parallel,
                    group=group, dtype=weight.dtype, device=weight.device, fp8=fp8, fp8_grads=fp8_grads)
        with torch.no_grad():
            layer.weight.copy_(_split(weight, split_dim, layer.ops, cls.__name__))
            if bias is not None:
                layer.bias.copy_(_split(bias, 0, layer.ops, cls.__name__) if split_dim == 0 else bias)
        return layer


class ColumnParallelLinear(_ParallelLinear):
    """``x @ W.T + b`` with W [out, in] split by output features (rank r: rows r of ``W.chunk(W)``): ag_gemm.

    sequence_parallel=True: x is this rank's rows [m_r, in]; returns every row, this rank's features
    [M, out / W] (what a row-parallel layer takes). False: x [..., in] full on every rank; returns the full
    [..., out] (the feature slices all-gathered)."""

    SPLIT_DIM = 0

    def forward(self, x, total_rows=None):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        rows = plan_rows(x2, self.ops, self.sequence_parallel, total_rows)
        if rows.total == 0:
            width = self.weight.shape[0] if self.sequence_parallel else self.out_features
            return x.new_zeros((*lead, width))
        y = drop_padding(self.ops.ag_gemm(local_rows(x2, rows, self.ops), self.weight, quantize=self.fp8,
                                          fp8_grads=self.fp8_grads), rows)  # [M, out / W]
        if self.bias is not None:
            y = y + self.bias
        if self.sequence_parallel:
            return y
        return gather_slices(y, self.ops, 1).reshape(*lead, self.out_features)  # every rank's features


class RowParallelLinear(_ParallelLinear):
    """``x @ W.T + b`` with W [out, in] split by input features (rank r: columns r of ``W.chunk(W, 1)``): gemm_rs.

    sequence_parallel=True: x holds every row and this rank's input features [M, in / W]; returns this rank's
    ``tensor_split`` rows [m_r, out]. False: x [..., in] full on every rank; returns the full [..., out]."""

    SPLIT_DIM = 1

    def forward(self, x):
        lead = x.shape[:-1]
        if self.sequence_parallel:  # every row, our features: the output rows come out tensor_split
            x2 = x.reshape(-1, self.weight.shape[1])
            y = self.ops.gemm_rs(x2.contiguous(), self.weight, quantize=self.fp8, fp8_grads=self.fp8_grads)
            return y + replicated_param(self.bias, self.ops) if self.bias is not None else y
        x2 = x.reshape(-1, self.in_features)
        m, width = x2.shape[0], self.weight.shape[1]
        if m == 0:
            return x.new_zeros((*lead, self.out_features))
        mine = take_slice(x2, self.ops, 1, self.ops.rank * width, width)
        rows = plan_rows(x2, self.ops, False)
        padded = pad_rows(mine, rows.shard * self.ops.world).contiguous()  # equal shares: rank r's rows r*shard..
        y = finish_rows(self.ops.gemm_rs(padded, self.weight, quantize=self.fp8, fp8_grads=self.fp8_grads), rows,
                        self.ops)
        if self.bias is not None:  # on the full rows: the (replicated) bias sees every row's gradient
            y = y + self.bias
        return y.reshape(*lead, self.out_features)


class TensorParallelMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with the intermediate size split over ranks: ag_gemm with the fused
    SiLU gate, then gemm_rs. ``gate_up`` [2I/W, H] = [gate_r; up_r], ``down`` [H, I/W].

    sequence_parallel=True: x is this rank's rows [m_r, H] (``total_rows`` when shards are uneven), the result
    this rank's rows. False: x [..., H] full on every rank, the result the full [..., H], equal to the dense MLP's.
    ``fp8``: both projections in FP8 (the module docstring); the SiLU gate's input and output stay in x's dtype.
    ``fp8_grads``: both projections' backward GEMMs in FP8 too (the module docstring).
    """

    def __init__(self, hidden_size, intermediate_size, *, sequence_parallel=False, group=None, dtype=None,
                 device=None, fp8=None, fp8_grads=False):
        super().__init__()
        self.fp8 = check_mode(fp8, "TensorParallelMLP: fp8")
        self.fp8_grads = check_fp8_grads(fp8_grads, self.fp8, "TensorParallelMLP: fp8_grads", "fp8")
        self.ops = GroupOps(group)
        if intermediate_size % self.ops.world:
            raise ValueError(f"TensorParallelMLP: intermediate_size={intermediate_size} is not divisible by the "
                             f"{self.ops.world} ranks")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.sequence_parallel = bool(sequence_parallel)
        local = intermediate_size // self.ops.world
        self.gate_up = nn.Parameter(torch.empty((2 * local, hidden_size), dtype=dtype, device=device))
        self.down = nn.Parameter(torch.empty((hidden_size, local), dtype=dtype, device=device))

    @classmethod
    def from_dense(cls, module, group=None, sequence_parallel=False, fp8=None, fp8_grads=False):
        """From a gated MLP module (``gate_proj``, ``up_proj``, ``down_proj``, SiLU, no biases: LlamaMLP and
        alike) or its state dict."""
        gate, up, down = gated_mlp_weights(module, type(module).__name__)
        layer = cls(gate.shape[1], gate.shape[0], sequence_parallel=sequence_parallel, group=group,
                    dtype=gate.dtype, device=gate.device, fp8=fp8, fp8_grads=fp8_grads)
        ops = layer.ops
        with torch.no_grad():
            layer.gate_up.copy_(torch.cat([_split(gate, 0, ops, "gate_proj"), _split(up, 0, ops, "up_proj")]))
            layer.down.copy_(_split(down, 1, ops, "down_proj"))
        return layer

    def forward(self, x, total_rows=None):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.hidden_size)
        rows = plan_rows(x2, self.ops, self.sequence_parallel, total_rows)
        if rows.total == 0:
            return x.new_zeros((*lead, self.hidden_size))
        h = self.ops.ag_gemm(local_rows(x2, rows, self.ops), self.gate_up, activation="silu_gate",
                             quantize=self.fp8, fp8_grads=self.fp8_grads)  # [W*shard, I/W]
        y = self.ops.gemm_rs(h, self.down, quantize=self.fp8,
                             fp8_grads=self.fp8_grads)  # [shard, H]: W * shard rows split evenly
        out = finish_rows(y, rows, self.ops)
        return out.reshape(*lead, self.hidden_size) if not self.sequence_parallel else out


def gated_mlp_torch(x, gate_up, down):
    """The dense gated MLP on stacked weights (``gate_up`` = [gate; up]): for replicated shared experts."""
    h = F.linear(x, gate_up)
    inter = gate_up.shape[0] // 2
    return F.linear(F.silu(h[..., :inter]) * h[..., inter:], down)
