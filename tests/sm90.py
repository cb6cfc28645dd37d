"""Compile a kernel for Hopper (sm_90) on a machine without a GPU: catches code-generation errors that the
interpreter cannot see (layouts, atomics' scopes, tensor descriptors). Runs in a subprocess because this test
process imported the kernels in interpreter mode."""

import json
import os
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent("""
    import collections, inspect, json, re, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    module, name, signature, constexprs, aligned = json.loads(sys.argv[1])
    kernel = getattr(__import__(module, fromlist=[name]), name)
    while not hasattr(kernel, "arg_names"):  # unwrap autotuners / heuristics down to the JITFunction
        kernel = kernel.fn
    params = inspect.signature(kernel.fn).parameters.values()  # one left out: compiled at its default
    constexprs.update({p.name: p.default for p in params if p.name not in signature and p.default is not p.empty})
    signature = {p.name: signature.get(p.name, "constexpr") for p in params
                 if p.name in signature or p.name in constexprs}
    names = list(signature)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    ptx = compiled.asm["ptx"]
    ops = collections.Counter(re.findall(
        r"\\b(?:ld|st|atom|red|fence\\.proxy|setmaxnreg|cp\\.async|wgmma\\.mma_async|mma\\.sync|griddepcontrol|ex2)[\\.\\w:]*", ptx))
    print(json.dumps({"ops": ops, "ptx_bytes": len(ptx), "shared": compiled.metadata.shared}))
""")


def compile_sm90(module, name, signature, constexprs=None, aligned=()):
    """Compile ``module.name`` for sm_90 with the given Triton signature; returns {"ops": Counter-like dict}.
    ``aligned``: pointer/int arguments to treat as 16-divisible, as the JIT does for real aligned tensors."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    arg = json.dumps([module, name, signature, constexprs or {}, list(aligned)])
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, arg], env=env, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"{module}.{name} does not compile for sm_90:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
