"""The benchmarks of the nn layers, their backward and the grouped GEMM run on GPUs only; on CPU their contenders
are checked against each other at tiny fp32 sizes (the same code the timed runs call). Command lines:
tests/test_benchmarks.py."""

import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")


def _bench(name):
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    return __import__(name)


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


def _backward_check():
    return _bench("bench_backward").check()


def test_backward_benchmark_contenders_agree(ranks):
    """Every contender of bench_backward (the layers both ways, HF, ag_gemm / gemm_rs, torch's autograd): output and
    every gradient against its baseline's at tiny fp32 sizes."""
    pytest.importorskip("transformers")
    for checked, problems in ranks(2, _backward_check):
        assert problems == [] and len(checked) >= 6, (checked, problems)


def _kept_quantisations():
    """{contender: (weight copies its cache holds, weights quantised in each of three steps)} of bench_backward's
    "kept" contenders at tiny sizes: inside their fp8_weight_cache a step after the first quantises none."""
    import torch

    from triton_dist.kernels import fp8

    bench = _bench("bench_backward")
    results, made, real = {}, [], fp8.weight_cache.quantized

    def counting(w, what, quantise):
        def counted():
            made.append(what)
            return quantise()
        return real(w, what, counted)

    fp8.weight_cache.quantized = staticmethod(counting)
    try:
        for case, steps, _ in bench.cases(True, torch.float32, torch.device("cpu"), fp8_grads=True):
            for label in (s for s in steps if s.endswith(" kept")):
                per_step = []
                for _ in range(3):
                    made.clear()
                    steps[label].fwd_bwd()
                    per_step.append(len(made))
                results[f"{case} {label}"] = (len(steps[label].context), per_step)
    finally:
        fp8.weight_cache.quantized = staticmethod(real)
    return results


def test_backward_benchmark_kept_contenders_keep_the_weights(ranks):
    """run153 / run154's "kept" rows quantised the weights in every step: the bench replaced an empty cache (len 0,
    falsy) by no context."""
    pytest.importorskip("transformers")
    results = ranks(1, _kept_quantisations)[0]
    assert results and all(kept and per_step[1:] == [0, 0] for kept, per_step in results.values()), results
