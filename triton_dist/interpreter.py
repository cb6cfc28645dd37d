"""Kernels under the Triton interpreter (``TRITON_INTERPRET=1``, CPU ranks): two repairs and a speed-up.

Triton <= 3.6's interpreter gives ``tl.tensor`` an ``__index__`` of ``int(self.handle.data)``, where every scalar
is a numpy array of shape (1,); numpy 2.4 refuses that conversion ("only 0-dimensional arrays can be converted to
Python scalars"), so every ``range()`` / ``tl.range()`` over a runtime value fails. Triton 3.7 converts the array
with ``squeeze()`` first; ``repair_index()`` installs that conversion wherever a feature test finds the fault, and
warns what to install if it cannot.

The interpreter keeps bfloat16 values as their uint16 bit patterns, and its ``tl.dot`` (triton 3.6 to 3.9 at least)
multiplies those integers: every bf16 GEMM, grouped GEMM or attention score on CPU ranks came out as garbage
(relative errors of 1e9). ``repair_bf16_dot()`` widens bf16 operands to the fp32 values they hold (exactly: the
bits shifted up by 16) before the product, as the tensor cores do; a feature test finds the fault first.

A launch patches ``triton.language`` with the interpreter's semantics once, and the interpreter (triton 3.6 to 3.9
at least) patches it again at every call of a ``@triton.jit`` device function: a scan of the language modules'
members each time, which finds nothing left to patch (a patched member is no builtin any more) yet took ~45 % of a
CPU-rank MoE training step (~1 ms a call, ~95 calls a launch). ``patch_language_once()`` skips those repeats while
a launch's patch is in place, for device functions that see no language module the launch did not patch.
"""

import operator
import warnings


def _index_broken(interp):
    import numpy as np
    import triton.language as tl

    scope = interp._LangPatchScope()
    try:
        interp._patch_lang_tensor(tl.tensor, scope)  # what every interpreted launch does
        t = tl.tensor(interp.TensorHandle(np.array([3], dtype=np.int32), tl.int32), tl.int32)
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)  # numpy 1.25-2.3 warn where 2.4 raises
            return operator.index(t) != 3
    except (TypeError, DeprecationWarning):
        return True
    finally:
        scope.restore()


def repair_index():
    """Repair the interpreter's ``__index__`` if it is broken here; True if the repair was installed. Harmless
    when kernels are compiled (the interpreter then never runs)."""
    try:
        from triton.runtime import interpreter as interp

        original = interp._patch_lang_tensor
        if getattr(original, "triton_dist_repair", False) or not _index_broken(interp):
            return False
    except Exception:  # no interpreter, or internals of another shape: nothing known to repair
        return False

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor.triton_dist_repair = True
    interp._patch_lang_tensor = patch_lang_tensor
    if _index_broken(interp):
        interp._patch_lang_tensor = original
        import numpy
        import triton

        warnings.warn(f"triton {triton.__version__}'s interpreter cannot run range() over runtime values with numpy "
                      f"{numpy.__version__}: CPU-rank kernels will fail ('only 0-dimensional arrays can be converted "
                      f"to Python scalars'). Install triton>=3.7 or numpy<2.4.", RuntimeWarning, stacklevel=2)
        return False
    return True


def _bf16_dot_broken(interp):
    import numpy as np
    import triton.language as tl

    one = np.full((1, 1), 0x3F80, dtype=np.uint16)  # 1.0 in bf16
    a = interp.TensorHandle(one, tl.bfloat16)
    acc = interp.TensorHandle(np.zeros((1, 1), dtype=np.float32), tl.float32)
    try:
        out = interp.InterpreterBuilder.create_dot(interp.interpreter_builder, a, a, acc, "ieee", 0)
        return float(out.data.reshape(-1)[0]) != 1.0
    except Exception:
        return True


def _as_fp32(handle, interp):
    import numpy as np
    import triton.language as tl

    if handle.dtype != tl.bfloat16:
        return handle
    return interp.TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)


def repair_bf16_dot():
    """Make the interpreter's ``tl.dot`` multiply bf16 operands as the numbers they are (fp32 products and sums)
    where a feature test finds it multiplying their bit patterns; True if the repair was installed."""
    try:
        from triton.runtime import interpreter as interp

        original = interp.InterpreterBuilder.create_dot
        if getattr(original, "triton_dist_repair", False) or not _bf16_dot_broken(interp):
            return False
    except Exception:  # no interpreter, or internals of another shape: nothing known to repair
        return False

    def create_dot(self, a, b, d, *args, **kwargs):
        return original(self, _as_fp32(a, interp), _as_fp32(b, interp), d, *args, **kwargs)

    create_dot.triton_dist_repair = True
    interp.InterpreterBuilder.create_dot = create_dot
    if _bf16_dot_broken(interp):
        interp.InterpreterBuilder.create_dot = original
        warnings.warn("this Triton's interpreter multiplies bfloat16 operands of tl.dot wrongly and the repair did "
                      "not take: bf16 GEMMs on CPU ranks are wrong (use float16 or float32)", RuntimeWarning,
                      stacklevel=2)
        return False
    return True


_LAUNCH_PATCHED = None  # while a launch is interpreted: ids of the language modules its patch covers


_LANGUAGE_MODULES = {}  # id(a device function's globals) -> ids of the language modules they hold


def _language_modules(fn):
    import triton.language as tl

    scope = fn.__globals__
    found = _LANGUAGE_MODULES.get(id(scope))
    if found is None:  # (a module's globals live as long as the module: its id is not reused)
        found = _LANGUAGE_MODULES[id(scope)] = {id(v) for v in scope.values() if v is tl or v is tl.core}
    return found


def patch_language_once():
    """Skip the interpreter's re-patching of ``triton.language`` at every device-function call within a launch
    (the module docstring); True if installed. Harmless when kernels are compiled."""
    try:
        from triton.runtime import interpreter as interp

        original_patch, original_launch = interp._patch_lang, interp.GridExecutor.__call__
        interp._LangPatchScope()
    except Exception:  # no interpreter, or internals of another shape: leave it as it is
        return False
    if getattr(original_patch, "triton_dist_repair", False):
        return False

    def patch_lang(fn):
        langs = _language_modules(fn)
        if _LAUNCH_PATCHED and langs <= _LAUNCH_PATCHED:
            return interp._LangPatchScope()  # nothing to patch, nothing to restore
        scope = original_patch(fn)
        if _LAUNCH_PATCHED is not None:
            _LAUNCH_PATCHED.update(langs)
        return scope

    def launch(self, *args, **kwargs):
        global _LAUNCH_PATCHED
        outer, _LAUNCH_PATCHED = _LAUNCH_PATCHED, set()  # filled by the launch's own patch
        try:
            return original_launch(self, *args, **kwargs)
        finally:
            _LAUNCH_PATCHED = outer

    patch_lang.triton_dist_repair = launch.triton_dist_repair = True
    interp._patch_lang, interp.GridExecutor.__call__ = patch_lang, launch
    return True
