"""SwiGLU's gate as a differentiable op: ``silu_gate(h) = silu(h[:, :I]) * h[:, I:]`` for a pre-activation
``h = [gate | up]`` [rows, 2I] (columns; what ag_gemm writes with a stacked ``[w_gate; w_up]``).

Training keeps the pre-activation for the backward (as Megatron keeps SwiGLU's input), so the gate runs apart from
the GEMM there (inference fuses it into the GEMM's epilogue). Torch's ``silu(h[:, :I]) * h[:, I:]`` reads strided
halves (its unvectorised kernels), rounds twice in bf16 and keeps two more tensors for its backward, which then
fills a zero [rows, 2I] gradient and copies each half in. Here: one pass over h forward, one over h and the
gradient backward, in fp32 and rounded once (the fused epilogue's arithmetic):

    out      = silu(g) * u                                   s = sigmoid(g), silu(g) = g * s
    d g      = grad * u * s * (1 + g * (1 - s))
    d u      = grad * silu(g)
"""

import torch
import triton
import triton.language as tl

from .. import hardware
from ..hardware import cdiv
from . import library


@triton.jit
def silu_gate_kernel(h, out, numel, cols, BLOCK: tl.constexpr):
    """Program i: BLOCK values of out [rows, cols] (flat), from h [rows, 2 * cols]."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    at = offs // cols * (2 * cols) + offs % cols  # the gate's place in h; the up's is cols further
    gate = tl.load(h + at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h + at + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + offs, (gate * tl.sigmoid(gate) * up).to(out.dtype.element_ty), mask=mask)


@triton.jit
def silu_gate_backward_kernel(h, grad, grad_h, numel, cols, BLOCK: tl.constexpr):
    """Program i: BLOCK values of grad [rows, cols] (flat) -> their gate's and up's gradients in grad_h."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    at = offs // cols * (2 * cols) + offs % cols
    gate = tl.load(h + at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h + at + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(grad + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(gate)
    tl.store(grad_h + at, (g * up * s * (1 + gate * (1 - s))).to(grad_h.dtype.element_ty), mask=mask)
    tl.store(grad_h + at + cols, (g * gate * s).to(grad_h.dtype.element_ty), mask=mask)


def _launch(kernel, h, *tensors, out):
    numel = h.numel() // 2  # the gate's (and the output's) values: a program's BLOCK of them
    if numel:
        kernel[(cdiv(numel, 1024),)](h, *tensors, out, numel, h.shape[1] // 2, BLOCK=1024, num_warps=4)
    return out


def _kernels_run(t):
    return t.is_cuda or hardware.interpreting()


def _check(h):
    if not isinstance(h, torch.Tensor) or h.dim() != 2 or h.shape[1] % 2:
        raise ValueError(f"silu_gate takes h [rows, 2 * I] ([gate | up] by columns), got "
                         f"{list(h.shape) if isinstance(h, torch.Tensor) else type(h).__name__}")
    if h.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"silu_gate takes bfloat16 / float16 / float32, got {h.dtype}")


def silu_gate_torch(h):
    """``silu(gate) * up`` of ``h`` = [gate | up] (columns) in torch: ag_gemm's fallback epilogue for FP8 rows, the
    tests' reference, and this op on CPU tensors without the interpreter. Computed in fp32 and rounded once to h's
    dtype, as the kernels do (a bf16 silu and product round twice more: docs/design/ag_gemm.md)."""
    half = h.shape[-1] // 2
    gate, up = h[..., :half].float(), h[..., half:].float()
    return (torch.nn.functional.silu(gate) * up).to(h.dtype)


def _silu_gate(h):
    _check(h)
    return _gated(h)


def _gated(h):
    """``silu_gate`` of a checked ``h``."""
    h = h.contiguous()
    if not _kernels_run(h):
        return silu_gate_torch(h)
    return _launch(silu_gate_kernel, h, out=h.new_empty((h.shape[0], h.shape[1] // 2)))


def _silu_gate_backward(h, grad):
    h, grad = h.contiguous(), grad.contiguous()
    if not _kernels_run(h):
        half = h.shape[1] // 2
        gate, up, g = h[:, :half].float(), h[:, half:].float(), grad.float()
        s = torch.sigmoid(gate)
        return torch.cat([g * up * s * (1 + gate * (1 - s)), g * gate * s], dim=1).to(h.dtype)
    return _launch(silu_gate_backward_kernel, h, grad, out=torch.empty_like(h))


library.define("silu_gate(Tensor h) -> Tensor", _silu_gate,
               lambda h: h.new_empty((h.shape[0], h.shape[1] // 2)))
library.define("silu_gate_backward(Tensor h, Tensor grad) -> Tensor", _silu_gate_backward,
               lambda h, grad: torch.empty_like(h))


def silu_gate(h):
    """``silu(h[:, :I]) * h[:, I:]`` of ``h`` [rows, 2I] (bf16 / fp16 / fp32) in fp32, rounded once to h's dtype;
    differentiable (``torch.ops.triton_dist.silu_gate``, its backward ``silu_gate_backward``). CUDA tensors, or
    CPU ones (the interpreter, else the same arithmetic in torch). ValueError / TypeError for other shapes and
    dtypes."""
    _check(h)
    if library.needs_grad(h) or hardware.compiling():
        return torch.ops.triton_dist.silu_gate(h)
    return _gated(h)


def silu_gate_backward(h, grad):
    """The gradient of ``silu_gate`` at ``h`` [rows, 2I] for the output gradient ``grad`` [rows, I]: [rows, 2I] in
    h's dtype."""
    if hardware.compiling():
        return torch.ops.triton_dist.silu_gate_backward(h, grad)
    return _silu_gate_backward(h, grad)
