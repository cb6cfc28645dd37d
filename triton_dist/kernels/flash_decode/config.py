"""Launch knobs of flash-decode: split counts, tile sizes and pipelining that fit Hopper's shared memory, input
validation, and the resolved configuration of a call."""

import math

import torch

from ... import autotune, hardware
from ...hardware import cdiv, next_power_of_2

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (16, 32, 64, 128, 256)
COMBINES = ("auto", "fused", "kernel")
H200_SMS = 132
SMEM_PER_SM = 228 << 10  # Hopper: 228 KB per SM, 227 KB per block (opt-in)
SMEM_PER_BLOCK = 227 << 10
SMEM_RESERVE = 16 << 10  # what a split program needs besides its K/V buffers: q, layout conversions
MAX_SPLITS = 512


def choose_splits(batch_kv_heads, s_local_max, num_sms, programs_per_sm=2, block_n=64, min_tiles_per_split=2):
    """How many slices to cut each (sequence, KV head) into: the fewest that fill whole waves of
    ``num_sms * programs_per_sm`` programs at >= 95% (else the best filling), and never slices shorter than
    ``min_tiles_per_split`` tiles."""
    slots = max(1, num_sms * programs_per_sm)
    most = max(1, min(256, s_local_max // (block_n * min_tiles_per_split)))
    best, best_fill = 1, 0.0
    for n in range(1, most + 1):
        programs = batch_kv_heads * n
        fill = programs / (cdiv(programs, slots) * slots)
        if fill >= 0.95:
            return n
        if fill > best_fill + 1e-9:
            best, best_fill = n, fill
    return best


def merge_chunk(group, head_dim, n, num_warps=4):
    """Partials merged per load round: the largest power of two that keeps a [chunk, group, head_dim] fp32 tile
    within 32 registers a thread (1024 elements a warp), and no more than ``n`` needs."""
    max_elems = 1024 * num_warps
    chunk = 1
    while chunk < n and 2 * chunk * next_power_of_2(group) * head_dim <= max_elems:
        chunk *= 2
    return chunk


def split_smem_bytes(block_n, num_stages, head_dim, elem_bytes):
    """Shared memory of one split program, upper estimate: Triton's pipeliner keeps num_stages - 1 K and V tiles in
    flight, plus SMEM_RESERVE."""
    return max(1, num_stages - 1) * 2 * block_n * head_dim * elem_bytes + SMEM_RESERVE


def default_config(batch, kv_heads, s_local_max, head_dim, device_type, num_sms=None, elem_bytes=2):
    """Launch knobs; any of them can be overridden through ``config=``. GPU: the largest tile and deepest pipeline
    (128 tokens x 3 stages, then smaller) that fits in a block's shared memory (227 KB on Hopper; see
    ``split_smem_bytes``), 8 warps for 128-token tiles (docs/design/flash_decode.md); ``programs_per_sm`` None =
    as many as fit in an SM's shared memory, at most 2; ``n_splits`` None = ``choose_splits``; ``combine`` "auto"
    and ``pdl`` off (see the package docstring); ``check_indices`` (on): kv_lens and page ids checked on the
    device (off: trusted, what the index-check benchmark compares against)."""
    if device_type == "cpu":
        return {"block_n": 16, "n_splits": None, "programs_per_sm": 1, "num_sms": 2, "num_warps": 4,
                "num_stages": 1, "merge_num_warps": 4, "combine": "auto", "pdl": False,
                "check_indices": True}
    for block_n, stages in ((128, 3), (64, 3), (64, 2), (32, 3), (32, 2), (16, 2)):
        if split_smem_bytes(block_n, stages, head_dim, elem_bytes) <= SMEM_PER_BLOCK:
            break
    return {"block_n": block_n, "n_splits": None, "programs_per_sm": None, "num_sms": num_sms or H200_SMS,
            "num_warps": 8 if block_n >= 128 else 4, "num_stages": stages, "merge_num_warps": 4, "combine": "auto",
            "pdl": False, "check_indices": True}




def check_inputs(q, k_cache, v_cache, kv_lens, block_table, softmax_scale):
    """Validate and describe the inputs; returns (B, Hq, Hkv, D, S_local_max, page_size)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("kv_lens", kv_lens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if block_table is not None and not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table must be a torch.Tensor or None, got {type(block_table).__name__}")
    if q.dtype not in DTYPES:
        raise TypeError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, "
                        f"{v_cache.dtype}")
    if kv_lens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"kv_lens must be int32 or int64, got {kv_lens.dtype}")
    if block_table is not None and block_table.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"block_table must be int32 or int64, got {block_table.dtype}")
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got shape {list(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [B, S_local_max, Hkv, D] (paged: [num_pages, "
                         f"page_size, Hkv, D]), got {list(k_cache.shape)} and {list(v_cache.shape)}")
    batch, q_heads, head_dim = q.shape
    _, rows, kv_heads, kv_dim = k_cache.shape
    if kv_dim != head_dim:
        raise ValueError(f"head dim of q ({head_dim}) and of the KV cache ({kv_dim}) differ")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head dim must be one of {HEAD_DIMS}, got {head_dim}")
    if kv_heads < 1 or q_heads % kv_heads != 0:
        raise ValueError(f"Hq ({q_heads}) must be a multiple of Hkv ({kv_heads})")
    if batch * kv_heads > 65535:
        raise ValueError(f"B * Hkv = {batch * kv_heads} exceeds the 65535 programs of a grid dimension")
    if tuple(kv_lens.shape) != (batch,):
        raise ValueError(f"kv_lens must have shape [{batch}], got {list(kv_lens.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("kv_lens", kv_lens), ("block_table", block_table)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need a contiguous last (head) dimension")
    if block_table is None:
        if k_cache.shape[0] != batch:
            raise ValueError(f"k_cache holds {k_cache.shape[0]} sequences, q {batch} (paged caches need block_table)")
        page_size, s_max = 0, rows
    else:
        if block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must be [{batch}, max_pages], got {list(block_table.shape)}")
        if block_table.stride(-1) != 1:
            raise ValueError("block_table needs a contiguous last dimension")
        page_size, s_max = rows, rows * block_table.shape[1]
    if softmax_scale is not None:
        if not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool):
            raise TypeError(f"softmax_scale must be a float, got {type(softmax_scale).__name__}")
        if not math.isfinite(softmax_scale) or softmax_scale <= 0:
            raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale}")
    return batch, q_heads, kv_heads, head_dim, s_max, page_size



def resolve(dims, dtype, device, config, distributed):
    """The full config of a call: defaults, overrides (checked), split count and combine mode resolved."""
    batch, _, kv_heads, head_dim, s_max, _ = dims
    real_sms = hardware.num_sms(device.index) if device.type == "cuda" else None
    cfg = autotune.with_overrides(
        default_config(batch, kv_heads, s_max, head_dim, device.type, real_sms, dtype.itemsize), config)
    for key in ("block_n", "num_warps", "merge_num_warps"):
        value = cfg[key]
        if not isinstance(value, int) or value < 1 or value & (value - 1):
            raise ValueError(f"config {key} must be a power of two, got {value!r}")
    if cfg["block_n"] < 16:
        raise ValueError(f"config block_n must be >= 16 (tl.dot), got {cfg['block_n']}")
    for key in ("num_stages", "num_sms"):
        if not isinstance(cfg[key], int) or cfg[key] < 1:
            raise ValueError(f"config {key} must be a positive int, got {cfg[key]!r}")
    for key in ("n_splits", "programs_per_sm"):
        if cfg[key] is not None and (not isinstance(cfg[key], int) or cfg[key] < 1):
            raise ValueError(f"config {key} must be None or a positive int, got {cfg[key]!r}")
    if cfg["n_splits"] is not None and cfg["n_splits"] > MAX_SPLITS:
        raise ValueError(f"config n_splits must be <= {MAX_SPLITS} (the merge of the splits is unrolled), got "
                         f"{cfg['n_splits']}")
    if cfg["combine"] not in COMBINES:
        raise ValueError(f"config combine must be one of {COMBINES}, got {cfg['combine']!r}")
    for key in ("pdl", "check_indices"):
        if not isinstance(cfg[key], bool):
            raise ValueError(f"config {key} must be a bool, got {cfg[key]!r}")
    if cfg["programs_per_sm"] is None:  # as many split programs as fit in an SM's shared memory, 1 or 2
        smem = split_smem_bytes(cfg["block_n"], cfg["num_stages"], head_dim, dtype.itemsize)
        cfg["programs_per_sm"] = max(1, min(2, SMEM_PER_SM // smem))
    if batch * kv_heads == 0:
        cfg["n_splits"] = 1
    elif cfg["n_splits"] is None:
        cfg["n_splits"] = choose_splits(batch * kv_heads, s_max, cfg["num_sms"], cfg["programs_per_sm"],
                                        cfg["block_n"])
    if distributed:
        # "fused" makes the last split of every (b, kv head) wait inside the split launch. Safe while fewer
        # programs can wait than there are SMs (one SM always has room for the splits everyone waits for). The
        # interpreter runs programs in the same order on every rank: safe for any size.
        fused_ok = real_sms is None or batch * kv_heads < real_sms
        if cfg["combine"] == "auto":
            cfg["combine"] = "fused" if fused_ok else "kernel"
        elif cfg["combine"] == "fused" and not fused_ok:
            raise ValueError(f"combine='fused' needs B * Hkv ({batch * kv_heads}) < the number of SMs ({real_sms}): "
                             f"waiting split programs could otherwise fill the GPU; use 'kernel' or 'auto'")
    cfg["pdl"] = bool(cfg["pdl"]) and hardware.pdl_capable(device)  # before Hopper: launched without
    return cfg

