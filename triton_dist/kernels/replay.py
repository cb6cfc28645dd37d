"""Eager calls replayed from a cached CUDA graph: the small-problem path of the overlapped GEMM ops (and of MoE
dispatch with ``eager_graph``), where an eager call's Python and launch cost exceeds its GPU work.

The path ``"graph"`` captures the op's launches once per (shape, config, weight) into a CUDA graph on static
buffers; a call then costs one copy of the activation in, one graph launch and one copy of the result out.
Everything the captured kernels touch stays valid across replays: workspaces are cached per shape, flags carry
device-side epochs (``dl.call_epoch``), and the weight is read at its captured address (the key holds it, so
in-place updates are seen). After ``MAX_WEIGHTS`` different weights for one shape, a new weight is launched
directly. Inside someone else's capture, under torch.compile tracing, or on CPU the caller launches directly.
A capture synchronises the device once (``torch.cuda.graph`` does); replays never do.
"""

import dataclasses

import torch

from ..hardware import capturing, compiling
from ..shmem.workspaces import register

MAX_WEIGHTS = 4  # distinct weight tensors captured per (shape, config) before giving up on graphs there


class GraphedCall:
    """One captured call: ``run(*static_inputs, *captured) -> output`` recorded once, replayed per call."""

    def __init__(self, run, inputs, captured, clone):
        self.inputs = tuple(t.clone() for t in inputs)  # copied into before every replay
        self.captured = captured  # read at their captured addresses: keep them alive as long as the graph
        self.clone = clone
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):  # records only: no kernel runs here
            self.out = run(*self.inputs, *captured)  # in the graph's memory pool: the same address every replay

    def __call__(self, inputs):
        for static, t in zip(self.inputs, inputs):
            static.copy_(t)
        self.graph.replay()
        return self.out.clone() if self.clone else self.out  # a static output is overwritten by the next replay


class GraphCache:
    """The graphs of one op, keyed by the caller's (shape, config) key and the weight's address.

    Every call executes the op exactly once, whichever way it goes (the first call of a key launches directly;
    a capture records without running, then replays), so ranks that decide differently (a weight at a new address
    on one rank only) still run the same kernels on the same workspaces, in step."""

    def __init__(self, op):
        register(op, self)  # release_workspaces() drops the graphs with the workspaces they captured
        self.graphs = {}   # (key, weight address) -> GraphedCall
        self.weights = {}  # key -> number of weights captured for it
        self.seen = set()  # keys launched directly once (kernels compiled, workspaces built)

    def run(self, key, run, inputs, captured=(), clone=True):
        """``run(*inputs, *captured)`` replayed from a graph, or None when the caller must launch directly.
        ``inputs`` are copied into the graph's own tensors on every call; ``captured`` (weights) are read where
        they are, so their addresses are part of the key. ``clone``: return a copy of the output (else the
        graph's static output, for ops whose results are views of a workspace anyway)."""
        if not usable(inputs[0]):
            return None
        if key not in self.seen:  # first call: compile and build workspaces outside any capture
            self.seen.add(key)
            return None
        gkey = (key, tuple(t.data_ptr() for t in captured))
        call = self.graphs.get(gkey)
        if call is None:
            n_weights = self.weights.get(key, 0)
            if n_weights >= MAX_WEIGHTS:  # weights that keep moving: graphs would not pay
                return None
            self.weights[key] = n_weights + 1
            call = self.graphs[gkey] = GraphedCall(run, inputs, captured, clone)
        return call(inputs)

    def run_op(self, key, run, a, w, scales=None):
        """``run(a, w, scales)``, a GEMM op's call, replayed as ``run`` does it: ``a`` is an input, ``w`` captured;
        FP8 ``scales`` (``fp8.Scales``, None for other operands) go with them, A's an input, W's captured."""
        if scales is None:
            return self.run(key, lambda x, y: run(x, y, None), (a,), (w,))
        return self.run(key, lambda x, sx, y, sy: run(x, y, dataclasses.replace(scales, a=sx, w=sy)),
                        (a, scales.a), (w, scales.w))

    def clear(self):
        self.graphs.clear()
        self.weights.clear()
        self.seen.clear()


def usable(a):
    """Graphs are for eager CUDA calls: not on CPU, not inside another capture, not while torch.compile traces."""
    return a.is_cuda and not capturing() and not compiling()
