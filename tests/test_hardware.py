"""hardware.compiling(): true while torch traces (dynamo, AOT autograd's fake / functional modes), false under
dispatch modes that only watch eager calls."""
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from triton_dist import hardware


def test_compiling_only_while_torch_traces():
    assert not hardware.compiling()
    with FakeTensorMode():
        assert hardware.compiling()
    with FlopCounterMode(display=False):  # a user's profiler: eager calls stay on the eager path
        assert not hardware.compiling()
    seen = []

    @torch.compile(backend="eager", fullgraph=True)
    def traced(x):
        seen.append(hardware.compiling())
        return x + 1

    traced(torch.ones(2))
    assert seen == [True]
