"""The knobs of MoE dispatch and combine: two typed configurations, identical on every rank (they depend only on
max_tokens, hidden and the device type), their defaults and their checks.

``ep_dispatch(config=...)`` takes a ``DispatchConfig`` or a dict of its fields, ``ep_combine(config=...)`` a
``CombineConfig`` or a dict of its fields. One flat dict may serve both calls: ``combine_<field>`` keys
(``combine_programs``, ``combine_push``, ``combine_warps`` for num_programs, push_programs, num_warps) configure
ep_combine and win there over the plain field; ep_dispatch ignores them, and ep_combine ignores dispatch-only
fields. Any other unknown key raises. docs/design/moe_ep.md has the measurements behind the defaults.
"""

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import torch

from ... import autotune, hardware, shmem
from .protocol import MAX_CHUNKS, MAX_TIMELINE_PROGRAMS, TIMELINE_SLOTS


@dataclass(frozen=True)
class CombineConfig:
    num_programs: int         # the grid
    push_programs: int        # of them, the senders (the peers' tokens); the rest receive (this rank's tokens)
    block_tokens: int         # rows per copy step
    block_h: int              # columns per copy step
    num_warps: int
    h_parts: int = 1          # the receivers' unit of work: a chunk's columns in this many parts ...
    tail_chunks: int = 0      # ... except for the last tail_chunks chunks: in tail_parts parts
    tail_parts: int = 1
    stream_hints: bool = False  # L2 evict_first on the loads and stores that touch a row once
    defer_signal: bool = True   # raise a chunk's flags once the sender's next chunk is under way
    maxnreg: Optional[int] = None  # a register cap per thread (None: the compiler's choice)


@dataclass(frozen=True)
class DispatchConfig(CombineConfig):
    num_chunks: int = 2       # token chunks per rank: the unit of flags and pipelining (combine reuses them)
    fused_layout: bool = False  # no layout launch: program 0 counts, then publishes (one launch per call)
    layout_chunks: int = 4    # chunks counted at once by one program of the layout launch (fused: per step)
    pdl: bool = True          # sm_90+: the dispatch launch starts while the layout launch runs
    eager_graph: bool = False  # an eager call replays its launches from a cached CUDA graph (inputs copied in)


def _defaults(max_tokens, device_type):
    """(dispatch, combine) defaults: CPU (interpreter: small, quick), GPU decode sizes, GPU large batches."""
    if device_type == "cpu":
        common = dict(num_programs=2, push_programs=1, block_h=32, block_tokens=8, num_warps=4)
        return DispatchConfig(**common, fused_layout=max_tokens <= 256, layout_chunks=2), CombineConfig(**common)
    if max_tokens <= 256:  # decode: small chunks, wide copies, every SM; one launch per dispatch (host-bound sizes)
        common = dict(num_programs=132, push_programs=66, block_h=1024, block_tokens=2, num_warps=8)
        return DispatchConfig(**common, num_chunks=64, fused_layout=True), CombineConfig(**common)
    return (DispatchConfig(num_programs=128, push_programs=80, block_h=512, block_tokens=16, num_warps=8,
                           num_chunks=256, h_parts=4, tail_chunks=16, tail_parts=8, stream_hints=True),
            CombineConfig(num_programs=128, push_programs=48, block_h=512, block_tokens=16, num_warps=16,
                          h_parts=2, tail_chunks=16, tail_parts=4, stream_hints=True))


_ALIASES = {"combine_programs": "num_programs", "combine_push": "push_programs", "combine_warps": "num_warps"}


def _overrides(config, cls):
    """The fields of ``cls`` that ``config`` (a dict, possibly the flat form, see the module docstring) sets."""
    own = {f.name for f in dataclasses.fields(cls)}
    other = {f.name for f in dataclasses.fields(DispatchConfig)} - own
    plain, prefixed = {}, {}
    for key, value in config.items():
        if key.startswith("combine_"):
            field = _ALIASES.get(key, key[len("combine_"):])
            if cls is CombineConfig:
                prefixed[field] = value
            elif field not in {f.name for f in dataclasses.fields(CombineConfig)}:
                plain[key] = value  # not a combine knob either: with_overrides names it
        elif key not in other:
            plain[key] = value
    return {**plain, **prefixed}


def _checked(cfg):
    if not 1 <= int(cfg.push_programs) < int(cfg.num_programs):
        raise ValueError(f"need 1 <= push_programs < num_programs, got {cfg.push_programs}, {cfg.num_programs}")
    for name in ("h_parts", "tail_parts"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or not 1 <= value <= 2**20:
            raise ValueError(f"{name} must be an int in [1, 2**20], got {value!r}")
    for name in ("block_tokens", "block_h") + (("layout_chunks",) if isinstance(cfg, DispatchConfig) else ()):
        if int(getattr(cfg, name)) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    if not isinstance(cfg.tail_chunks, int) or cfg.tail_chunks < 0:
        raise ValueError(f"tail_chunks must be an int >= 0, got {cfg.tail_chunks!r}")
    if isinstance(cfg, DispatchConfig) and not 1 <= int(cfg.num_chunks) <= MAX_CHUNKS:
        raise ValueError(f"num_chunks must be in [1, {MAX_CHUNKS}], got {cfg.num_chunks}")
    return cfg


def _resolve(cls, index, max_tokens, hidden, device_type, config):
    if type(config) is cls:
        return _checked(config)
    default = _defaults(max_tokens, device_type)[index]
    if not config:
        return default
    if not isinstance(config, dict):
        raise TypeError(f"config must be a {cls.__name__} or a dict, got {type(config).__name__}")
    knobs = autotune.with_overrides(dataclasses.asdict(default), _overrides(config, cls))
    return _checked(cls(**knobs))


@functools.lru_cache(maxsize=64)
def _default_pair(max_tokens, hidden, device_type):
    return _checked(_defaults(max_tokens, device_type)[0]), _checked(_defaults(max_tokens, device_type)[1])


def dispatch_config(max_tokens, hidden, device_type, config=None):
    """The ``DispatchConfig`` of a call: the defaults for (max_tokens, hidden, device type) with ``config`` over
    them, checked (ValueError for knobs the kernels cannot run with, unknown names included)."""
    if not config:
        return _default_pair(max_tokens, hidden, device_type)[0]
    return _resolve(DispatchConfig, 0, max_tokens, hidden, device_type, config)


def combine_config(max_tokens, hidden, device_type, config=None):
    """The ``CombineConfig`` of a call (see ``dispatch_config``)."""
    if not config:
        return _default_pair(max_tokens, hidden, device_type)[1]
    return _resolve(CombineConfig, 1, max_tokens, hidden, device_type, config)


# ----------------------------------------------------------------------------------------------------- launch options
def senders_help(n_prog, t):
    """Whether a launch's senders may join its receivers: on a GPU, with every program resident at once (a
    waiting sender must not keep a peer's sender off the GPU); never under the interpreter."""
    return t.is_cuda and n_prog <= hardware.num_sms(t.device.index)


def tail(cfg, n_chunks):
    """The receivers' (tail, tail_parts) launch arguments: the last tail_chunks chunks (at most all) in
    tail_parts column parts."""
    return min(int(cfg.tail_chunks), n_chunks), int(cfg.tail_parts)


def register_cap(cfg, t):
    """Launch options for a register cap per thread (GPU only; the interpreter has no registers)."""
    return {"maxnreg": int(cfg.maxnreg)} if cfg.maxnreg and t.device.type == "cuda" else {}


def check_timeline(timeline, device, n_prog):
    """The optional phase-timeline buffer: None, or an int64 GPU tensor of TIMELINE_SLOTS on the op's GPU."""
    if timeline is None:
        return
    if not isinstance(timeline, torch.Tensor) or timeline.dtype != torch.int64 or timeline.numel() < TIMELINE_SLOTS \
            or not timeline.is_contiguous():
        raise TypeError(f"timeline must be a contiguous int64 tensor of at least {TIMELINE_SLOTS} elements")
    if device.type != "cuda":
        raise ValueError("timeline needs a GPU (it reads the GPU clock)")
    shmem.check_device(timeline, "timeline")
    if n_prog > MAX_TIMELINE_PROGRAMS:
        raise ValueError(f"a timeline has room for {MAX_TIMELINE_PROGRAMS} programs, the launch has {n_prog}")
