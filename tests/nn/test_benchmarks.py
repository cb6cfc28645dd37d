"""The benchmarks of the nn layers and the grouped GEMM run on GPUs only; on CPU their contenders are checked
against each other at tiny fp32 sizes (the same code the timed runs call) and their command lines parse."""

import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")


def _bench(name):
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    return __import__(name)


@pytest.mark.parametrize("name", ["bench_grouped_gemm", "bench_layers"])
def test_benchmark_command_line_parses(name, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as done:
        _bench(name).main()
    assert done.value.code == 0 and "--check" in capsys.readouterr().out


def test_grouped_gemm_benchmark_contenders_agree():
    import torch

    bench = _bench("bench_grouped_gemm")
    assert bench.check(torch.device("cuda" if torch.cuda.is_available() else "cpu")) == []
    counts = bench.group_counts(32, 16384, "skewed")
    assert sum(counts) == 16384 and counts[0] == 4096 and counts[16:] == [0] * 16


def _layers_check():
    return _bench("bench_layers").check()


def test_layer_benchmark_contenders_agree(ranks):
    pytest.importorskip("transformers")
    for checked, problems in ranks(2, _layers_check):
        assert problems == [] and len(checked) >= 4, (checked, problems)
