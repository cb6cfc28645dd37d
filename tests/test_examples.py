"""Every example, started as a user starts it, runs to the end with its own checks (assertions against a torch
reference on every rank) passing: ``python examples/<name>.py`` with no GPU (two CPU ranks) and, on a GPU machine,
on the local GPU (one rank), started by python and by torchrun. A rank that fails makes the launcher raise, so the
process exits non-zero."""

import os
import subprocess
import sys

import pytest

from .conftest import GPU_WORLD, ON_GPU_RANKS, cpu_only, gpu_only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "examples")) if f.endswith(".py"))


def _run(name, interpret, torchrun=False):
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env["TRITON_INTERPRET"] = "1" if interpret else "0"
    # this tree's triton_dist, not whichever checkout an editable install points at (a script's sys.path starts at
    # examples/, not at the root)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    script = os.path.join("examples", f"{name}.py")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--standalone"] if torchrun \
        else [sys.executable]
    proc = subprocess.run(launcher + [script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_every_example_is_listed():
    assert {"allgather", "ag_gemm", "gemm_rs", "tp_mlp", "moe_ep", "flash_decode"} <= set(EXAMPLES), EXAMPLES


@cpu_only
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs_on_two_cpu_ranks(name):
    out = _run(name, interpret=True)
    assert "cpu x2" in out or "rank 1" in out, out[-2000:]


@gpu_only
@pytest.mark.long
@pytest.mark.parametrize("launcher", ["python", "torchrun"])
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs_on_one_gpu(name, launcher):
    """``python examples/<name>.py`` and ``torchrun --nproc-per-node=1 examples/<name>.py`` on one GPU."""
    if ON_GPU_RANKS:
        pytest.skip("plain pytest on a GPU machine runs this (torchrun's ranks hold the GPUs)")
    if GPU_WORLD is not None:
        pytest.skip(f"one rank per GPU: the plain GPU tier runs this (TRITON_DIST_GPU_WORLD={GPU_WORLD} here)")
    out = _run(name, interpret=False, torchrun=launcher == "torchrun")
    assert "x1]" in out or "rank 0" in out, out[-2000:]
