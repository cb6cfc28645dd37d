"""Launching a Triton kernel again for the cost of the driver call: ``Launcher``.

``kernel[grid](*args, **meta)`` binds every argument on every call (the signature, the specialization key, the
cache look-up, the check of the globals the kernel read). A ``Launcher`` is made once per (kernel, grid,
constexprs and launch options) — ops keep one in their plans — and its first call launches the plain way and
keeps the compiled kernel with Triton's own binding of the arguments. A later call whose runtime arguments
specialize the same way (every tensor of the same dtype and 16-byte alignment, every other argument equal)
calls the compiled kernel's ``run``, the launcher ``kernel[grid]`` itself ends in, with the stored constexprs.
Anything else (another alignment or value, a launch hook, the interpreter, a Triton whose internals differ) takes
the plain path, so a Launcher never launches differently from ``kernel[grid]``.

Where ``run`` is the Triton 3.6 CUDA launcher (checked by its shape: ``direct_launch``), a bound call goes one step
further down, to the C launch function ``run`` ends in, with the tensor descriptors expanded at their known
positions: the same call without ``run``'s generic per-argument Python loop (its cost: docs/design/host.md), and
without encoding a descriptor again while its address and layout repeat (a weight's always do).

A plan whose layout fixes every field of a descriptor but its address passes the tensor itself there
(``Launcher(..., described={position: make})``, ``make(t)`` the descriptor of ``t``): the direct launch then looks
the encoding up by the address alone, and no descriptor object is built while the address repeats.
"""

import inspect

import torch

from .. import hardware
from ..shmem.workspaces import Plans


_VALUES = (int, float, bool, str, type(None))


def _key(args):
    """What the compiled kernel depends on in ``args``: a tensor's dtype and 16-byte alignment (Triton
    specializes pointers on it), a tensor descriptor's dtype, shape, strides, block and alignment, and every
    other argument's type and value (stricter than Triton, which only looks at integers' value classes; the type
    keeps True apart from 1, which Triton compiles as different types)."""
    key = []
    for a in args:
        kind = type(a)
        if kind in _VALUES:
            key.append((kind, a))
        elif isinstance(a, torch.Tensor):
            key.append((a.dtype, a.data_ptr() % 16 == 0))
        elif hasattr(a, "block_shape") and hasattr(a, "base"):  # triton.tools.tensor_descriptor.TensorDescriptor
            key.append((a.base.dtype, a.base.data_ptr() % 16 == 0, tuple(a.shape), tuple(a.strides),
                        tuple(a.block_shape)))
        else:
            key.append((kind, a))
    return tuple(key)


class Launcher:
    """``kernel[grid](*args, **named, **meta)``, bound once: ``Launcher(kernel, grid, **meta)(*args, **named)``.
    ``args``: the kernel's leading positional (runtime) arguments; ``named``: runtime arguments by name (e.g.
    those after the constexprs, always the same names); ``meta``: the constexprs and launch options, fixed.
    ``described``: {position: make} for leading arguments passed as tensors of a fixed layout whose tensor
    descriptor ``make(t)`` builds (the launch builds it only where it cannot look its encoding up)."""

    def __init__(self, kernel, grid, described=None, **meta):
        self.kernel, self.grid, self.meta = kernel, tuple(grid) + (1,) * (3 - len(grid)), meta
        self.described = tuple(sorted((described or {}).items()))
        self.compiled = None  # the compiled kernel of the bound call
        self.bound = None  # its arguments in signature order, as Triton bound them
        self.names, self.named_at = (), ()  # the named runtime arguments and their positions in ``bound``
        self.key = None
        self.device = None  # the CUDA device it was compiled for (the compiled function is loaded there)
        self.direct = None  # ``direct_launch`` of the compiled kernel, where this Triton allows it

    def __call__(self, *args, **named):
        if self.compiled is not None and _key(args + tuple(named.values())) == self.key and tuple(named) == self.names:
            self.run(*args, **named)
        else:
            self._plain(args, named)

    def run(self, *args, **named):
        """``self(*args, **named)`` for a caller that knows the arguments specialize as the bound call's did (the
        same dtypes, 16-byte alignments and plain values, the same names): the launch without the key's check
        (``gemm``'s eager plans, keyed by the operands' layout, check the alignments themselves)."""
        compiled = self.compiled
        if compiled is not None and _no_hooks():
            device = torch._C._cuda_getDevice()
            if device == self.device:
                bound = self.bound.copy()  # a copy: another thread may launch the same kernel meanwhile
                bound[:len(args)] = args
                for at, value in zip(self.named_at, named.values()):
                    bound[at] = value
                stream = torch._C._cuda_getCurrentRawStream(device)
                if self.direct is not None:
                    self.direct(self.grid, stream, bound)
                else:
                    for at, make in self.described:
                        bound[at] = make(bound[at])
                    compiled.run(self.grid[0], self.grid[1], self.grid[2], stream, compiled.function,
                                 compiled.packed_metadata, None, None, None, *bound)
                return
        self._plain(args, named)

    def _plain(self, args, named):
        """The launch through ``kernel[grid]``; the first one (compiled, not interpreted) is kept, bound."""
        given = list(args)  # the kernel's arguments: the descriptors of tensors given for them built
        for at, make in self.described:
            given[at] = make(given[at])
        compiled = self.kernel[self.grid](*given, **named, **self.meta)
        if self.compiled is None and not hardware.interpreting():
            self._bind(compiled, args, given, named)

    def _bind(self, compiled, args, given, named):
        """Keep ``compiled`` and Triton's own binding of this call's arguments (``given``: ``args`` as the kernel
        took them), if this Triton exposes it."""
        try:
            device = torch._C._cuda_getDevice()
            binder = self.kernel.device_caches[device][4]
            bound_args = binder(*given, **named, **self.meta)[0]
            names = list(bound_args)
            named_at = tuple(names.index(n) for n in named)
            bound = list(bound_args.values())
            compiled.function  # loaded (the plain launch did that)
            torch._C._cuda_getCurrentRawStream(device)
        except Exception:  # internals of another shape: stay on the plain path
            return
        self.compiled, self.bound, self.key = compiled, bound, _key(args + tuple(named.values()))
        self.names, self.named_at, self.device = tuple(named), named_at, device
        self.direct = direct_launch(compiled, dict(self.described))


_RUN_PARAMS = ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"]  # triton 3.6's CudaLauncher.__call__


def direct_launch(compiled, described=None):
    """``launch(grid, stream, args)``: what ``compiled.run(*grid, stream, compiled.function,
    compiled.packed_metadata, None, None, None, *args)`` does on Triton 3.6's CUDA launcher, without its Python
    layers: no scratch memory to allocate, the C launch called with the cooperative / PDL flags, and each tensor
    descriptor among ``args`` expanded (``make_tensordesc_arg``) at the positions the launcher would find it; an
    expansion is kept for the next launches whose descriptor there has the same address, shape, strides and
    padding (the CUtensorMap encodes nothing else: the block, dtype and swizzle are the compiled kernel's).
    ``described``: {position: make} where ``args`` holds a tensor of a fixed layout instead (``Launcher``): its
    expansion is looked up by the address alone, and ``make(t)`` builds the descriptor to expand on a miss.
    None where ``run`` is not that launcher (another Triton, a kernel that needs scratch memory): the caller
    keeps ``run``."""
    described = described or {}
    run = compiled.run
    try:
        if (list(inspect.signature(type(run).__call__).parameters) != _RUN_PARAMS or run.global_scratch_size
                or run.profile_scratch_size):
            return None
        launch, coop, pdl = run.launch, run.launch_cooperative_grid, run.launch_pdl
        descriptors = ()
        if getattr(launch, "__name__", None) == "inner":  # wrap_handle_tensordesc's: expands the descriptors
            cells = inspect.getclosurevars(launch).nonlocals
            expand = launch.__globals__["make_tensordesc_arg"]
            if launch.__globals__["_BASE_ARGS_FORMAT_LEN"] != 13:
                return None
            launch = cells["launcher"]
            descriptors = tuple((at, meta, described.get(at))
                                for at, meta in zip(sorted(cells["tensordesc_indices"]), cells["tensordesc_meta"]))
        elif not callable(launch) or inspect.isfunction(launch):  # not the C launch function itself
            return None
        metadata = compiled.packed_metadata
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    if set(described) - {at for at, meta, _ in descriptors if meta is not None}:
        return None  # a position given as a tensor where this kernel takes no TMA descriptor

    encoded = [{} for _ in descriptors]  # per descriptor: its recent expansions by (address, shape, strides, padding)

    def direct(grid, stream, args):
        head = [grid[0], grid[1], grid[2], stream, compiled.function, coop, pdl, None, None, metadata, None, None,
                None]
        start = 0
        for (at, meta, make), recent in zip(descriptors, encoded):
            head += args[start:at]
            desc = args[at]
            if meta is None:  # no TMA here: the expansion holds the tensor itself, never kept
                head += expand(desc, meta)
                start = at + 1
                continue
            if make is not None:  # a tensor of the plan's fixed layout: its address names the encoding
                key = desc.data_ptr()
            else:
                key = (desc.base.data_ptr(), tuple(desc.shape), tuple(desc.strides), desc.padding)
            expanded = recent.get(key)
            if expanded is None:  # the encoding (a CUtensorMap) is a function of the key: reused while it repeats
                if len(recent) >= ENCODINGS_KEPT:
                    recent.clear()
                expanded = recent[key] = expand(desc if make is None else make(desc), meta)
            head += expanded
            start = at + 1
        head += args[start:]
        launch(*head)
    return direct


ENCODINGS_KEPT = 8  # per descriptor of a bound launch: a weight's, and the few addresses activations cycle through


class Launchers:
    """The ``Launcher``s of one kernel, one per grid and meta: ``launchers(grid, *args, **meta)`` launches like
    ``kernel[grid](*args, **meta)``, bound after the first call of each (grid, meta). ``op``: the cache's name."""

    def __init__(self, kernel, op):
        self.kernel, self._bound = kernel, Plans(op)

    def __call__(self, grid, *args, named=None, **meta):
        """``named``: runtime arguments by name (a dict), passed on to the Launcher."""
        key = (tuple(grid),) + tuple(meta.items())
        self._bound.get(key, lambda: Launcher(self.kernel, grid, **meta))(*args, **(named or {}))


try:
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - a Triton without knobs: launch the plain way
    _knobs = None


def _no_hooks():
    """Launch hooks (profilers) see only plain launches. Triton keeps them in chains of callbacks (empty: none)."""
    try:
        runtime = _knobs.runtime
        return not (getattr(runtime.launch_enter_hook, "calls", runtime.launch_enter_hook)
                    or getattr(runtime.launch_exit_hook, "calls", runtime.launch_exit_hook))
    except Exception:
        return False
