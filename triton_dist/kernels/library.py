"""The ``torch.ops.triton_dist`` namespace: every op of the zoo is registered here, once.

Ops are defined with ``torch.library.Library`` (a schema, one CompositeExplicitAutograd implementation, a fake
implementation for torch.compile) rather than ``torch.library.custom_op``, whose Python wrapper (output aliasing
checks, autograd plumbing) costs more per eager call than the small-M GPU work it wraps. The implementations are
the ops' own Python functions, so eager calls of ``torch.ops.triton_dist.X`` and of ``triton_dist.kernels.X`` do
the same work. A call whose inputs require grad goes through the op (``needs_grad``): its backward is registered
on it (``kernels/autograd.py``).
"""

import threading

import torch

_LIB = torch.library.Library("triton_dist", "DEF")


def define(schema, impl, fake):
    """Register ``torch.ops.triton_dist.<name>`` from ``schema`` (e.g. ``"f(Tensor a, int n) -> Tensor"``), its
    implementation and its fake (shape-only) implementation; returns the op. Tracing the op (its fake runs) in a
    job of several ranks keeps inductor from reordering collectives by buffer size (``keep_collective_order``)."""
    name = schema.split("(", 1)[0].strip()
    _LIB.define(schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")

    def traced(*args, **kwargs):
        keep_collective_order()
        return fake(*args, **kwargs)

    torch.library.register_fake(f"triton_dist::{name}", traced, lib=_LIB)
    return getattr(torch.ops.triton_dist, name)


def keep_collective_order():
    """In a job of several ranks, turn off inductor's memory-driven reordering
    (``torch._inductor.config.reorder_for_peak_memory``) for the graphs compiled from now on, once, with a
    warning. That pass orders a graph's nodes by its buffers' sizes, which differ from rank to rank wherever the
    ranks' shapes do (uneven sequence-parallel shards, a rank's own batch): with shards of 7 and 6 rows one rank's
    compiled backward ran an ag_gemm while its peer ran an all_gather, although the ops' ORDERED effect chains
    them. Without it every rank keeps the traced order. Called from the ops' fakes, which run while a graph is
    traced, before inductor compiles it."""
    from .. import shmem

    import torch._inductor.config as inductor_config

    if getattr(inductor_config, "reorder_for_peak_memory", False) and shmem.is_initialized() \
            and shmem.world_size() > 1:
        inductor_config.reorder_for_peak_memory = False
        import warnings

        warnings.warn("triton_dist: torch._inductor.config.reorder_for_peak_memory turned off for this multi-rank "
                      "job: it orders each rank's graph by the rank's own buffer sizes, so ranks of unequal shapes "
                      "would call collectives in different orders", RuntimeWarning, stacklevel=2)


def define_composite(schema, impl):
    """Register ``torch.ops.triton_dist.<name>`` as a composition of other ops (CompositeImplicitAutograd): its
    autograd and its tracing under torch.compile are those of the ops ``impl`` calls."""
    name = schema.split("(", 1)[0].strip()
    _LIB.define(schema)
    _LIB.impl(name, impl, "CompositeImplicitAutograd")
    return getattr(torch.ops.triton_dist, name)


def collective(*names):
    """Mark ops ``torch.ops.triton_dist.<name>`` as collectives for torch.compile: an ORDERED effect, so that no
    graph pass drops one (a rank without rows computes empty results, which a compiler may otherwise fold away) or
    reorders independent ones; every rank then calls them in the same order, whatever its shapes."""
    for name in names:
        _register_ordered(name)


def _register_ordered(name):
    """The ORDERED effect on ``triton_dist::<name>`` through whichever private API this torch has:
    ``torch.library._register_effectful_op`` (a name; newer torch), else the one of
    ``torch._higher_order_ops.effects`` (an OpOverload; older). Neither: unmarked (eager and other graphs are
    unaffected; inductor may then drop a token-less rank's call)."""
    try:
        from torch._library.effects import EffectType

        torch.library._register_effectful_op(f"triton_dist::{name}", EffectType.ORDERED)
        return
    except (ImportError, AttributeError):
        pass
    try:
        from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

        _register_effectful_op(getattr(torch.ops.triton_dist, name).default, _EffectType.ORDERED)
    except (ImportError, AttributeError):
        pass


def needs_grad(*tensors):
    """Whether a call must go through its torch op so that autograd records it: grad mode on and an input that
    requires grad."""
    for t in tensors:  # (a loop, not any(): this runs on every eager call)
        if t.requires_grad:
            return torch.is_grad_enabled()
    return False


_CALLER_CONFIG = threading.local()  # .value: (op name, config) of the differentiable call running now


def with_caller_config(name, config, call):
    """``call()``, a differentiable call through ``torch.ops.triton_dist.<name>`` (whose schema has no config),
    with its caller's ``config=`` for the op's forward (``caller_config``; None: the tuned one). The backward's
    calls take their tuned configurations. Eager only: a graph torch.compile traces calls the op without it
    (ValueError)."""
    if config is None:
        return call()
    from .. import hardware

    if hardware.compiling():
        raise ValueError(f"{name}: config= with grad runs eagerly; under torch.compile the differentiable op takes "
                         f"its tuned configuration (drop config, or call it under torch.no_grad())")
    before = getattr(_CALLER_CONFIG, "value", None)
    _CALLER_CONFIG.value = (name, config)
    try:
        return call()
    finally:
        _CALLER_CONFIG.value = before


def caller_config(name):
    """In op ``name``'s implementation: the ``config`` its differentiable caller gave (``with_caller_config``),
    taken once (the op's own inner calls do not see it); None otherwise."""
    value = getattr(_CALLER_CONFIG, "value", None)
    if value is None or value[0] != name:
        return None
    _CALLER_CONFIG.value = None
    return value[1]


class _InferenceOnly(torch.autograd.Function):
    """The result of an op without a backward, computed from inputs that require grad: its backward raises, as
    torch's own ops without a derivative do, instead of leaving the inputs' gradients silently out."""

    @staticmethod
    def forward(ctx, name, out, *inputs):
        ctx.name = name
        return out.view_as(out)

    @staticmethod
    def backward(ctx, *grads):
        _no_backward(ctx.name)


def _no_backward(name):
    raise RuntimeError(f"{name} is inference-only: it has no backward (call it under torch.no_grad())")


def inference_only(name, outputs, *inputs):
    """``outputs`` (a tensor or a tuple of them) of op ``name``, tied to ``inputs`` where one requires grad (grad
    mode on), so that a backward through them raises; else as they are."""
    if not needs_grad(*inputs):
        return outputs
    if isinstance(outputs, torch.Tensor):
        return _InferenceOnly.apply(name, outputs, *inputs)
    return tuple(_InferenceOnly.apply(name, out, *inputs) for out in outputs)


def inference_only_op(name):
    """Register on ``torch.ops.triton_dist.<name>`` (an op without a backward) the backward that raises."""
    torch.library.register_autograd(f"triton_dist::{name}", lambda ctx, *grads: _no_backward(name),
                                    setup_context=lambda ctx, inputs, output: None)
