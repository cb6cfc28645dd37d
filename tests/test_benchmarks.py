"""The benchmarks run on GPUs only; on CPU every one of them imports, those with options parse their command
lines, and the FP8 GEMM benchmark's contenders (our core, ``torch._scaled_mm``) agree at tiny sizes."""

import importlib
import os
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
NAMES = sorted(f[:-3] for f in os.listdir(BENCH) if f.startswith("bench_") and f.endswith(".py"))


def _bench(name):
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    return importlib.import_module(name)


@pytest.mark.parametrize("name", NAMES)
def test_benchmark_imports(name):
    assert callable(_bench(name).main)


@pytest.mark.parametrize("name,flag", [("bench_grouped_gemm", "--check"), ("bench_layers", "--check"),
                                       ("bench_backward", "--check"), ("bench_backward", "--only"),
                                       ("bench_gemm", "--only"), ("bench_fp8", "--only")])
def test_benchmark_command_line_parses(name, flag, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as done:
        _bench(name).main()
    assert done.value.code == 0 and flag in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU check of what the GPU run times")
def test_fp8_gemm_benchmark_contenders_agree():
    from triton_dist.kernels.gemm import scaled_gemm

    bench = _bench("bench_gemm")
    for mode in ("tensor", "row"):
        a, sa, w, sw = bench.fp8_operands(16, 24, 48, mode, "cpu")
        ours = scaled_gemm(a, w, sa, sw, scaling=mode).float()
        ref = bench.cublas_fp8(a, w, sa, sw, mode, False)().float()
        assert ((ours - ref).abs().max() / ref.abs().max()) < 1e-2, mode
