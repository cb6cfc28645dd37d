"""The ``torch.ops.triton_dist`` namespace: every op of the zoo is registered here, once.

Ops are defined with ``torch.library.Library`` (a schema, one CompositeExplicitAutograd implementation, a fake
implementation for torch.compile) rather than ``torch.library.custom_op``: on the GPU node's host the latter's
Python wrapper (output aliasing checks, autograd plumbing) cost ~150 µs per eager call, more than the small-M GPU
work it wraps. The implementations are the ops' own Python functions, so eager calls of ``torch.ops.triton_dist.X``
and of ``triton_dist.kernels.X`` do the same work.
"""

import torch

_LIB = torch.library.Library("triton_dist", "DEF")


def define(schema, impl, fake):
    """Register ``torch.ops.triton_dist.<name>`` from ``schema`` (e.g. ``"f(Tensor a, int n) -> Tensor"``), its
    implementation and its fake (shape-only) implementation; returns the op."""
    name = schema.split("(", 1)[0].strip()
    _LIB.define(schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"triton_dist::{name}", fake, lib=_LIB)
    return getattr(torch.ops.triton_dist, name)


def compiling():
    """True while torch.compile traces: ops then go through ``torch.ops.triton_dist`` (their fake impls)."""
    compiler = getattr(torch, "compiler", None)
    return compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling()
