"""The several-ranks-on-one-GPU mode's host side, without a GPU (its GPU runs: the GPU tests at worlds above the
machine's GPU count, ``TRITON_DIST_GPU_WORLD``): the SM share a rank reports, when "auto" picks the mode, the
refusal to time, the MPS start without the tool, and the backend names ``init`` accepts."""

import types

import pytest
import torch

import triton_dist as td
from triton_dist import hardware, launch, timing
from triton_dist.shmem import heap

from ..conftest import cpu_only


@pytest.fixture
def fake_h200(monkeypatch):
    """torch.cuda answering as one 132-SM GPU; the SM share restored afterwards."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(multi_processor_count=132))
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    yield monkeypatch
    hardware.share_gpu(1)


@cpu_only  # replaces torch.cuda's device properties
def test_a_rank_sharing_a_gpu_fills_only_its_share_of_the_sms(fake_h200):
    assert hardware.num_sms(0) == 132
    hardware.share_gpu(3)
    assert hardware.num_sms(0) == 44
    hardware.share_gpu(200)
    assert hardware.num_sms(0) == 1
    fake_h200.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "50")  # MPS: the device reports the share itself
    hardware.share_gpu(2)
    assert hardware.num_sms(0) == 132
    fake_h200.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    hardware.share_gpu(1)
    assert hardware.num_sms(0) == 132


def test_auto_picks_shared_gpu_when_torchrun_starts_more_ranks_than_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert heap._more_local_ranks_than_gpus()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert not heap._more_local_ranks_than_gpus()
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert not heap._more_local_ranks_than_gpus()


def test_init_names_every_backend_it_takes():
    with pytest.raises(ValueError, match="shared-gpu"):
        td.init(backend="two-per-gpu")


def test_timers_refuse_where_ranks_share_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(td.shmem, "is_initialized", lambda: True)
    monkeypatch.setattr(td.shmem, "backend", lambda: "shared-gpu")
    assert not timing.timeable()
    with pytest.raises(timing.SharedGpuTimingError, match="share a GPU"):
        timing.median_us(lambda: None)
    with pytest.raises(timing.SharedGpuTimingError):  # not turned into a NaN row
        timing.time_us_or_nan(lambda: None, "a contender")
    monkeypatch.setattr(td.shmem, "backend", lambda: "cuda")
    assert timing.timeable()


def test_mps_start_says_why_it_cannot(monkeypatch):
    monkeypatch.setattr(launch.shutil, "which", lambda name: None)
    assert not launch.mps_running()
    assert "not on PATH" in launch.start_mps()


def test_shared_gpu_calls_run_together_while_their_shares_fit(monkeypatch, tmp_path):
    """Calls of ranks sharing a GPU hold rank shares: two 2-rank calls fit in 4 shares at once, a third waits
    until one ends; without TRITON_DIST_SHARED_GPU_RANKS a pool's own ranks are the whole GPU (one call at a time)."""
    import threading

    monkeypatch.setattr(launch.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.delenv("TRITON_DIST_SHARED_GPU_RANKS", raising=False)  # (test workers set it)
    assert launch.shared_gpu_ranks(2) == 2
    monkeypatch.setenv("TRITON_DIST_SHARED_GPU_RANKS", "4")
    assert launch.shared_gpu_ranks(2) == 4 and launch.shared_gpu_ranks(8) == 8
    third_in = threading.Event()

    def third():
        with launch._shared_gpu_shares(2, 4):
            third_in.set()

    with launch._shared_gpu_shares(2, 4):
        with launch._shared_gpu_shares(2, 4):  # a second call while the first runs
            waiter = threading.Thread(target=third)
            waiter.start()
            assert not third_in.wait(0.5), "a third call ran while two held every share"
        assert third_in.wait(5), "the third call did not run once a share was free"
    waiter.join()
