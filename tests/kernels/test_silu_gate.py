"""``silu_gate`` (kernels/silu_gate.py): SwiGLU's gate of a pre-activation [gate | up], differentiable.

CPU (interpreter): forward and backward against an fp64 torch reference (autograd of silu(g) * u) on ragged sizes,
fp32 and fp16, poisoned outputs; through torch.compile (fullgraph) as eagerly; bad input. GPU: bf16 at a layer's
size, forward and backward against fp64; sm_90 compiles: scripts/ptx_digest.py.
"""

import pytest
import torch

from triton_dist import hardware
from triton_dist.kernels import silu_gate

from ..conftest import gpu_only


def _reference(h, grad):
    """(silu_gate(h), its gradient for ``grad``) in fp64 by torch's autograd."""
    x = h.double().requires_grad_()
    half = x.shape[1] // 2
    out = torch.nn.functional.silu(x[:, :half]) * x[:, half:]
    out.backward(grad.double())
    return out.detach(), x.grad


def _errors(h, grad):
    """Relative errors of the forward and of the backward against ``_reference``."""
    ref_out, ref_grad = _reference(h, grad)
    x = h.clone().requires_grad_()
    out = silu_gate(x)
    out.backward(grad)
    rel = lambda got, want: ((got.double() - want).abs().max() / want.abs().max()).item()  # noqa: E731
    return rel(out, ref_out), rel(x.grad, ref_grad)


@pytest.mark.parametrize("rows,cols,dtype,bound", [(7, 33, torch.float32, 1e-6), (130, 300, torch.float32, 1e-6),
                                                   (5, 1024, torch.float16, 2e-3), (1, 1, torch.float32, 1e-6)])
def test_silu_gate_matches_fp64(rows, cols, dtype, bound):
    if not hardware.interpreting():
        pytest.skip("CPU tensors run the kernels under the interpreter only")
    gen = torch.Generator().manual_seed(rows * cols)
    h = (torch.randn(rows, 2 * cols, generator=gen) * 3).to(dtype)
    grad = torch.randn(rows, cols, generator=gen).to(dtype)
    out_err, grad_err = _errors(h, grad)
    assert out_err < bound and grad_err < bound, (out_err, grad_err)
    assert silu_gate(torch.zeros(0, 2 * cols, dtype=dtype)).shape == (0, cols)


def test_silu_gate_compiles_as_eager():
    if not hardware.interpreting():
        pytest.skip("CPU tensors run the kernels under the interpreter only")
    h = torch.randn(9, 40, requires_grad=True)

    def step(x):
        return (silu_gate(x) * torch.arange(20.0)).sum()

    step(h).backward()
    eager = h.grad.clone()
    h.grad = None
    torch.compile(step, fullgraph=True, backend="aot_eager")(h).backward()
    assert torch.equal(h.grad, eager)


def test_silu_gate_rejects_bad_input():
    for bad, exc in [(torch.randn(4, 7), ValueError), (torch.randn(8), ValueError),
                     (torch.randn(4, 8).to(torch.int32), TypeError), ([1.0, 2.0], ValueError)]:
        with pytest.raises(exc):
            silu_gate(bad)


def _gpu_errors():
    gen = torch.Generator(device="cuda").manual_seed(4)
    worst = (0.0, 0.0)
    for rows, cols in [(4096, 14336), (517, 2816), (3, 1000)]:
        h = (torch.randn(rows, 2 * cols, device="cuda", generator=gen) * 3).to(torch.bfloat16)
        grad = torch.randn(rows, cols, device="cuda", generator=gen).to(torch.bfloat16)
        errs = _errors(h, grad)
        worst = tuple(max(w, e if e == e else float("inf")) for w, e in zip(worst, errs))
    return worst


@gpu_only
def test_silu_gate_gpu_bf16(ranks):
    """bf16 in and out, fp32 inside: within bf16's rounding of the result (2^-8 relative) of fp64."""
    out_err, grad_err = ranks.on_one_gpu(_gpu_errors)
    assert out_err < 8e-3 and grad_err < 8e-3, (out_err, grad_err)
