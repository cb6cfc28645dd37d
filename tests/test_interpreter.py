"""The interpreter repair: a Triton whose interpreter converts scalars with ``int(array)`` (triton <= 3.6, broken
by numpy >= 2.4) gets the ``squeeze()`` conversion; one that works is left alone."""

import numpy as np
import pytest
import triton
import triton.language as tl

from triton_dist import interpreter


def test_a_working_interpreter_is_left_alone():
    from triton.runtime import interpreter as interp

    before = interp._patch_lang_tensor
    if interpreter._index_broken(interp):
        pytest.skip("this Triton's interpreter needs the repair (covered by the next test)")
    assert interpreter.repair_index() is False and interp._patch_lang_tensor is before


def test_a_broken_interpreter_is_repaired(monkeypatch):
    from triton.runtime import interpreter as interp

    if tuple(int(v) for v in np.__version__.split(".")[:2]) < (2, 4):
        pytest.skip("numpy < 2.4 accepts int() of a one-element array")
    original = interp._patch_lang_tensor

    def broken(tensor, scope):  # what triton <= 3.6 installs
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    monkeypatch.setattr(interp, "_patch_lang_tensor", broken)
    assert interpreter._index_broken(interp)
    assert interpreter.repair_index() is True
    assert not interpreter._index_broken(interp)
    assert interpreter.repair_index() is False  # once is enough


def test_bf16_dot_multiplies_values():
    """The interpreter's ``tl.dot`` of bf16 operands (held as uint16 bit patterns) multiplies the numbers, in fp32:
    ``import triton_dist`` installed the repair where the fault is."""
    import os

    import torch
    import triton
    import triton.language as tl

    from triton.runtime import interpreter as interp

    assert not interpreter._bf16_dot_broken(interp)
    assert interpreter.repair_bf16_dot() is False  # installed once, at import
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("kernels are compiled here")

    @triton.jit
    def dot_kernel(a, b, c, N: tl.constexpr):
        r = tl.arange(0, N)
        x = tl.load(a + r[:, None] * N + r[None, :])
        y = tl.load(b + r[:, None] * N + r[None, :])
        tl.store(c + r[:, None] * N + r[None, :], tl.dot(x, y))

    a = torch.randn(16, 16).to(torch.bfloat16)
    b = torch.randn(16, 16).to(torch.bfloat16)
    c = torch.empty(16, 16)
    dot_kernel[(1,)](a, b, c, N=16)
    assert torch.allclose(c.double(), a.double() @ b.double(), rtol=1e-5, atol=1e-5)


def test_language_patched_once_per_launch(monkeypatch):
    """A launch patches ``triton.language`` once, not again at each device-function call inside it (15 here), and
    restores it after; the result is the kernel's."""
    import os

    import torch

    from triton.runtime import interpreter as interp

    assert interpreter.patch_language_once() is False  # installed once, at import
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("kernels are compiled here")
    patches = []
    original = interp._patch_lang_core
    monkeypatch.setattr(interp, "_patch_lang_core", lambda *a: (patches.append(1), original(*a))[1])
    out = torch.full((3, 8), -1, dtype=torch.int32)
    nested_kernel[(3,)](out, N=8)
    assert torch.equal(out, torch.arange(24, dtype=torch.int32).view(3, 8) + 5)
    assert len(patches) == 1, len(patches)  # without the speed-up: 1 + 3 programs x 5 calls
    assert tl.core.is_builtin(tl.arange)  # restored after the launch


@triton.jit
def _plus_one(v):
    return v + 1


@triton.jit
def nested_kernel(out, N: tl.constexpr):
    r = tl.arange(0, N)
    v = r + tl.program_id(0) * N
    for _ in tl.static_range(5):
        v = _plus_one(v)
    tl.store(out + tl.program_id(0) * N + r, v)
