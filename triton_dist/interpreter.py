"""Kernels under the Triton interpreter (``TRITON_INTERPRET=1``, CPU ranks): one repair for older Triton.

Triton <= 3.6's interpreter gives ``tl.tensor`` an ``__index__`` of ``int(self.handle.data)``, where every scalar
is a numpy array of shape (1,); numpy 2.4 refuses that conversion ("only 0-dimensional arrays can be converted to
Python scalars"), so every ``range()`` / ``tl.range()`` over a runtime value fails. Triton 3.7 converts the array
with ``squeeze()`` first; ``repair_index()`` installs that conversion wherever a feature test finds the fault, and
warns what to install if it cannot.
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
