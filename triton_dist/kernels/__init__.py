"""The kernel zoo: each op lives in its own file (kernels -> launcher -> torch op). Imported lazily so that
``import triton_dist.kernels`` stays cheap and one op's dependencies never block another."""

import importlib

_OPS = {
    "all_gather": "allgather",
    "ping_pong": "pingpong",
    "ag_gemm": "allgather_gemm",
    "gemm_rs": "gemm_reducescatter",
    "ep_dispatch": "moe_ep",
    "ep_combine": "moe_ep",
    "sp_flash_decode": "flash_decode",
    "local_flash_decode": "flash_decode",
}

__all__ = sorted(_OPS)


def __getattr__(name):
    if name in _OPS:
        return getattr(importlib.import_module(f"{__name__}.{_OPS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
