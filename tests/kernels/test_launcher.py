"""The bound launch (``kernels/launcher.py``): what it keys on, how it assembles the arguments Triton bound, that it
falls back to the plain launch whenever the arguments specialize differently, and (GPU) that it computes what the
plain launch computes."""

import pytest
import torch
import triton
import triton.language as tl

from triton_dist import hardware
from triton_dist.kernels import launcher
from triton_dist.kernels.launcher import Launcher

from ..conftest import gpu_only


def test_key_sees_dtype_alignment_and_values():
    t = torch.zeros(64, dtype=torch.float32)
    k = launcher._key
    assert k((t, 3)) == k((torch.zeros(64, dtype=torch.float32), 3))  # another tensor, same class
    assert k((t, 3)) != k((t, 4))  # another integer value
    assert k((t, 3)) != k((t.half(), 3))  # another dtype
    assert k((t[1:], 3)) != k((t, 3))  # 4 bytes off: no longer 16-byte aligned
    assert k((t[4:], 3)) == k((t, 3))  # 16 bytes off: still aligned
    assert k((t, True)) != k((t, 1)) and k((t, 1.0)) != k((t, 1))  # equal values of other types (other signatures)


class _FakeCompiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self):
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


class _FakeKernel:
    """A JITFunction's surface the Launcher uses: ``kernel[grid](*args, **meta)`` and the device cache's binder."""

    def __init__(self):
        self.compiled, self.plain = _FakeCompiled(), []

        def binder(x, n, BLOCK, FLAG=False, scale=None, stride=None, **options):  # what Triton's binder returns:
            return {"x": x, "n": n, "BLOCK": BLOCK, "FLAG": FLAG, "scale": scale, "stride": stride}, [], options
        self.device_caches = {0: (None, None, None, None, binder), 1: (None, None, None, None, binder)}

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.plain.append((grid, args, meta))
            return self.compiled
        return launch


@pytest.fixture
def compiling(monkeypatch):
    """As on a GPU: kernels compiled (not interpreted), device 0 (``device[0]``), whose current stream's handle is
    7 (device 1's: 9)."""
    device = [0]
    monkeypatch.setattr(hardware, "interpreting", lambda: False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: device[0], raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: {0: 7, 1: 9}[d], raising=False)
    return device


def test_binds_once_then_runs_the_compiled_kernel(compiling):
    kernel = _FakeKernel()
    launch = Launcher(kernel, (4,), BLOCK=64, num_warps=8)
    x, y = torch.zeros(16), torch.ones(16)
    launch(x, 16)  # plain, then bound
    launch(y, 16)  # the compiled kernel's run: grid, stream, handles, no hooks, every parameter in order
    assert len(kernel.plain) == 1 and kernel.plain[0] == ((4, 1, 1), (x, 16), {"BLOCK": 64, "num_warps": 8})
    (call,) = kernel.compiled.calls
    assert call[:9] == (4, 1, 1, 7, "fn", "meta", None, None, None) and call[9] is y and \
        call[10:] == (16, 64, False, None, None)
    launch(y[1:], 16)  # misaligned: the plain launch again
    launch(y, 15)  # another value: plain
    assert len(kernel.plain) == 3 and len(kernel.compiled.calls) == 1


def test_named_runtime_arguments_take_their_places(compiling):
    kernel = _FakeKernel()
    launch = Launcher(kernel, (4,), BLOCK=64, FLAG=True)
    x, s, s2 = torch.zeros(16), torch.ones(1), torch.full((1,), 2.0)
    launch(x, 16, scale=s, stride=0)  # plain (the named arguments passed by name), then bound
    assert kernel.plain[0] == ((4, 1, 1), (x, 16), {"scale": s, "stride": 0, "BLOCK": 64, "FLAG": True})
    launch(x, 16, scale=s2, stride=0)  # bound: the named arguments at their positions in the signature
    assert kernel.compiled.calls[-1][9:] == (x, 16, 64, True, s2, 0)
    launch(x, 16, scale=s2.half(), stride=0)  # another dtype of a named tensor: plain
    launch(x, 16, scale=s2, stride=1)  # another value: plain
    launch(x, 16, stride=0, scale=s2)  # the same arguments named in another order: plain (never misplaced)
    compiling[0] = 1  # another current device: plain (the compiled function is loaded on device 0)
    launch(x, 16, scale=s2, stride=0)
    assert len(kernel.plain) == 5 and len(kernel.compiled.calls) == 1


def test_described_arguments_reach_the_kernel_as_descriptors(compiling):
    """A position given as a tensor (``described``): the plain launch and the bound one (without a direct launch)
    pass the descriptor ``make`` builds of it; the key sees the tensor as given."""
    kernel = _FakeKernel()
    made = []

    def make(t):
        made.append(t)
        return ("desc", t)
    launch = Launcher(kernel, (4,), described={0: make}, BLOCK=64)
    x, y = torch.zeros(16), torch.ones(16)
    launch(x, 16)  # plain, then bound
    launch.run(y, 16)
    assert kernel.plain[0][1] == (("desc", x), 16) and kernel.compiled.calls[-1][9] == ("desc", y)
    launch(x, 16)  # the key of the bound call (a tensor's dtype and alignment): bound again
    assert len(kernel.plain) == 1 and len(kernel.compiled.calls) == 2 and made[-1] is x


def test_launchers_bind_one_launcher_per_grid_and_meta(compiling):
    kernel = _FakeKernel()
    launches = launcher.Launchers(kernel, "test_launchers")
    x = torch.zeros(16)
    for grid, block in [((4,), 64), ((4,), 64), ((8,), 64), ((4,), 32), ((4,), 64)]:
        launches(grid, x, 16, BLOCK=block)
    # plain once per (grid, meta): (4,)/64, (8,)/64, (4,)/32; the repeats of (4,)/64 run the bound kernel
    assert [(g, m["BLOCK"]) for g, _, m in kernel.plain] == [((4, 1, 1), 64), ((8, 1, 1), 64), ((4, 1, 1), 32)]
    assert len(kernel.compiled.calls) == 2


# Triton 3.6's CUDA launcher as far as ``direct_launch`` relies on it (backends/nvidia/driver.py: CudaLauncher,
# wrap_handle_tensordesc), written out so that CPU runs under any Triton check the direct call against it
_TRITON36_DRIVER = """
_BASE_ARGS_FORMAT_LEN = 13


ENCODED = []


def make_tensordesc_arg(arg, metadata):
    if metadata is None:
        return [arg.base, *arg.shape, *arg.strides]
    ENCODED.append(arg)
    return [("map", arg.base.data_ptr(), tuple(arg.shape), tuple(arg.strides), arg.padding, metadata), *arg.shape,
            *arg.strides]


def wrap_handle_tensordesc(launcher, tensordesc_indices, tensordesc_meta):
    def inner(*args):
        final_args = list(args[:_BASE_ARGS_FORMAT_LEN])
        tensordesc_idx = 0
        for i, arg in enumerate(args[_BASE_ARGS_FORMAT_LEN:]):
            if i in tensordesc_indices:
                final_args.extend(make_tensordesc_arg(arg, tensordesc_meta[tensordesc_idx]))
                tensordesc_idx += 1
            else:
                final_args.append(arg)
        return launcher(*final_args)
    return inner


class CudaLauncher:
    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self, launch):
        self.launch = launch

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl, None, None,
                    *args)
"""


class _Desc:
    """A host tensor descriptor as the launcher reads it."""

    def __init__(self, ptr, shape, strides, padding="zero"):
        self.base = type("Base", (), dict(data_ptr=lambda _: ptr))()
        self.shape, self.strides, self.padding = shape, strides, padding


@pytest.mark.parametrize("descriptors", [(), (0, 2), (3,), (1,)])
def test_direct_launch_calls_what_triton36_run_calls(descriptors):
    """``direct_launch`` on a launcher shaped as Triton 3.6's: the C launch gets exactly the arguments ``run``
    gives it (descriptors expanded in place, with their own metadata), with and without descriptors; an encoding
    is reused while its descriptor's address and layout repeat, and made again for another address, shape or
    padding (never kept without TMA metadata: position 1); a launcher of another shape, or one that needs scratch
    memory, gets None (the caller keeps ``run``)."""
    driver = {}
    exec(_TRITON36_DRIVER, driver)
    calls = []
    raw = _Builtin(calls)
    metas = [None if i == 1 else f"meta{i}" for i in descriptors]
    launch = driver["wrap_handle_tensordesc"](raw, set(descriptors), metas) if descriptors else raw
    compiled = type("Compiled", (), dict(function="fn", packed_metadata="meta", run=driver["CudaLauncher"](launch)))

    def args_with(ptr, shape=(64, 32), padding="zero"):
        args = ["a", "b", "c", 4, 5]
        for i in descriptors:
            args[i] = _Desc(ptr + 16 * i, list(shape), [shape[1], 1], padding)
        return args

    direct = launcher.direct_launch(compiled)
    assert direct is not None
    encoded = driver["ENCODED"]
    launches = [(args_with(1024), True), (args_with(1024), False), (args_with(4096), True), (args_with(1024), False),
                (args_with(1024, (32, 32)), True), (args_with(1024, padding="nan"), True)]
    for args, fresh in launches:
        compiled.run(8, 1, 1, 7, "fn", "meta", None, None, None, *args)
        before = len(encoded)
        direct((8, 1, 1), 7, args)
        assert calls[-2] == calls[-1]
        assert len(encoded) - before == (sum(m is not None for m in metas) if fresh else 0)
    compiled.run.global_scratch_size = 64
    assert launcher.direct_launch(compiled) is None
    assert launcher.direct_launch(type("C", (), dict(run=lambda *a: None, packed_metadata=None))) is None


def test_direct_launch_of_described_tensors_keys_on_the_address():
    """A descriptor position given as a tensor of the plan's fixed layout (``described``): the C launch gets what
    ``run`` would with ``make(t)`` there; the encoding is looked up by the address alone (``make`` runs on a miss
    only); a described position where the kernel takes no TMA descriptor: None."""
    driver = {}
    exec(_TRITON36_DRIVER, driver)
    calls = []
    raw = _Builtin(calls)
    launch = driver["wrap_handle_tensordesc"](raw, {0, 2}, ["meta0", None])
    compiled = type("Compiled", (), dict(function="fn", packed_metadata="meta", run=driver["CudaLauncher"](launch)))
    made = []

    class Tensor:
        def __init__(self, ptr):
            self.ptr = ptr

        def data_ptr(self):
            return self.ptr

    def make(t):
        made.append(t)
        return _Desc(t.data_ptr(), [64, 32], [32, 1])
    direct = launcher.direct_launch(compiled, {0: make})
    assert direct is not None
    for ptr, misses in [(1024, 1), (1024, 1), (2048, 2), (1024, 2)]:
        t = Tensor(ptr)
        args = [t, "b", _Desc(ptr, [8, 8], [8, 1]), 4, 5]
        direct((8, 1, 1), 7, args)
        compiled.run(8, 1, 1, 7, "fn", "meta", None, None, None, make(t), *args[1:])
        made.pop()
        assert calls[-2] == calls[-1] and len(made) == misses
    assert launcher.direct_launch(compiled, {2: make}) is None  # position 2: no TMA metadata
    assert launcher.direct_launch(compiled, {1: make}) is None  # position 1: no descriptor at all


class _Builtin:
    """A C function's stand-in (not a Python function): records its calls."""

    def __init__(self, calls):
        self.calls = calls

    def __call__(self, *args):
        self.calls.append(args)


@triton.jit
def _scale_kernel(x, out, n, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + offs, tl.load(x + offs, mask=offs < n) * factor, mask=offs < n)


def test_interpreted_launches_stay_plain():
    if not hardware.interpreting():
        pytest.skip("this process compiles kernels")
    launch = Launcher(_scale_kernel, (2,), BLOCK=64)
    x, out = torch.arange(100, dtype=torch.float32), torch.empty(100)
    for factor in (2.0, 3.0):
        launch(x, out, 100, factor)
        assert torch.equal(out, x * factor)
    assert launch.compiled is None


def _gpu_bound_launch():
    x = torch.randn(1000, device="cuda")
    launch = Launcher(_scale_kernel, (16,), BLOCK=64)
    ok = True
    for src, factor in [(x, 2.0), (x.clone(), 2.0), (x[1:], 2.0), (x.clone(), 3.0), (x.clone(), 2.0)]:
        out = torch.full_like(src, float("nan"))
        launch(src, out, src.numel(), factor=factor)  # bound / fast / misaligned: plain / another factor: plain / fast
        ok &= torch.equal(out, src * factor)
    # on the GPU image's Triton (3.6) the bound launch calls the C launch function directly
    return ok and launch.compiled is not None and (launch.direct is not None or not triton.__version__.startswith("3.6"))


@gpu_only
def test_bound_launch_matches_the_plain_launch_on_gpu(ranks):
    assert all(ranks(1, _gpu_bound_launch))
