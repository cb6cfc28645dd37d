"""Compile a kernel for Hopper (sm_90) on a machine without a GPU: catches code-generation errors that the
interpreter cannot see (layouts, atomics' scopes, tensor descriptors). The compiles run in one worker process
per test session (this process imported the kernels in interpreter mode; the worker imports torch and triton
once, not once per compile), which answers one JSON request per line."""

import atexit
import json
import os
import subprocess
import sys
import textwrap

_WORKER = textwrap.dedent("""
    import collections, json, os, re, sys, traceback
    sys.path.insert(0, os.path.join(sys.argv[1], "scripts"))  # the repository root
    import triton
    import ptx_digest
    from ptx_digest import with_defaults  # parameters a test leaves out: at their defaults, as a launch has them
    from triton.backends.compiler import GPUTarget
    OPS = re.compile(
        r"\\b(?:ld|st|atom|red|fence\\.proxy|setmaxnreg|cp\\.async|wgmma\\.mma_async|mma\\.sync|griddepcontrol|ex2)"
        r"[\\.\\w:]*")

    def compile_one(module, name, signature, constexprs, aligned, options, assemble):
        kernel = getattr(__import__(module, fromlist=[name]), name)
        while not hasattr(kernel, "arg_names"):  # unwrap autotuners / heuristics down to the JITFunction
            kernel = kernel.fn
        if isinstance(signature, str):  # a signature ptx_digest builds (Gluon descriptors carry their layouts)
            signature = getattr(ptx_digest, signature)()
        signature, constexprs = with_defaults(kernel, signature, constexprs)
        names = list(signature)
        attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
        src = ptx_digest.ast_source(kernel, signature, constexprs, attrs)  # (a Gluon kernel's too)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        ptx = compiled.asm["ptx"]
        result = {"ops": collections.Counter(OPS.findall(ptx)), "ptx_bytes": len(ptx),
                  "shared": compiled.metadata.shared}
        if assemble:  # ptxas's own word on the wgmma pipeline (ptx_digest.ptxas_log)
            log = ptx_digest.ptxas_log(ptx)
            result["wgmma_serialized"] = ptx_digest.wgmma_serialized(log)
            result["spilled_bytes"] = ptx_digest.spilled_bytes(log)
        return result

    for line in sys.stdin:
        try:
            reply = {"result": compile_one(*json.loads(line))}
        except BaseException:
            reply = {"error": traceback.format_exc()}
        sys.stdout.write("@@sm90 " + json.dumps(reply) + "\\n")
        sys.stdout.flush()
""")
_worker = None


def _start():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen([sys.executable, "-c", _WORKER, root], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    atexit.register(proc.kill)
    return proc


def compile_sm90(module, name, signature, constexprs=None, aligned=(), options=None, assemble=False):
    """Compile ``module.name`` for sm_90 with the given Triton signature (or the name of a function of
    scripts/ptx_digest.py that returns it); returns {"ops": Counter-like dict}.
    ``aligned``: pointer/int arguments to treat as 16-divisible, as the JIT does for real aligned tensors;
    ``options``: the compile's (e.g. ``num_warps``: a Gluon kernel's layouts name its warps); ``assemble``: also
    assemble it, adding "wgmma_serialized": ptxas's notes on wgmmas it serialized (none: the overlap holds), and
    "spilled_bytes"."""
    global _worker
    if _worker is None or _worker.poll() is not None:
        _worker = _start()
    _worker.stdin.write(json.dumps([module, name, signature, constexprs or {}, list(aligned), options, assemble]) + "\n")
    _worker.stdin.flush()
    for line in _worker.stdout:  # anything else the compiler printed is passed over
        if line.startswith("@@sm90 "):
            reply = json.loads(line[len("@@sm90 "):])
            break
    else:
        _worker = None
        raise AssertionError(f"{module}.{name}: the sm_90 compile worker died")
    if "error" in reply:
        raise AssertionError(f"{module}.{name} does not compile for sm_90:\n{reply['error'][-4000:]}")
    return reply["result"]
