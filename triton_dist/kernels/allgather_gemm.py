"""AllGather + GEMM, overlapped: ``out = all_gather(a) @ w.T`` (the tensor-parallel input projection).

Every rank holds a row shard ``a`` [m, K] of the activations and its weight slice ``w`` [N_local, K]. The result
[W*m, N_local] needs every rank's shard; instead of gathering first and multiplying after, each rank starts the
GEMM on the rows it already has while the other shards are still on the wire, and multiplies a remote chunk of
rows as soon as its flag says it has landed.

Data movement (W ranks, shard rows cut into ``n_chunks`` chunks of ``chunk_rows``, a multiple of BLOCK_M):

    a_full  [W*m, K]  symmetric; rows [r*m, (r+1)*m) hold rank r's shard once it has arrived
    arrived [W * MAX_CHUNKS] int32 symmetric; arrived[r*n_chunks + c] = epoch once chunk c of rank r is here

    producer of rank r, for its own copy first and then every peer p = r+1, r+2, ... (ring order):
        wait until p entered this call            (ready handshake: p no longer reads the previous a_full)
        a_full[r*m + chunk c] on p  <-  a[chunk c]                       copy engine, or SM stores (dl.put)
        arrived[r*n_chunks + c] on p  <-  epoch                          after the data, release ordered
    consumer (persistent GEMM, one program per SM) on rank r:
        tiles in the order: own segment r first, then r-1, r-2, ... (the order in which the rings deliver),
        grouped-M inside a segment; before a tile's K loop:
            dl.wait(arrived[seg*n_chunks + chunk of the tile's rows] >= epoch); fence.proxy.async (TMA reads)
        acc = A_tile @ W_tile.T  (triton_dist.kernels.gemm: TMA descriptors, pipelined)  ->  out[seg, rows, cols]

Two producers, one switch (``config["producer"]``), so both can be measured in one GPU run:
    "copy_engine"  a one-program handshake kernel (signal ``ready``, wait for the peers' ``ready``, publish this
                   call's epoch in a device word), then per peer a side stream of ``peer_view(a_full).copy_``
                   chunk copies, each followed by a 4-byte copy of the epoch word into the peer's flag (stream
                   order puts it after the data). No SM is taken from the GEMM.
    "sm"           the first ``num_producers`` programs of the GEMM launch push with ``dl.put`` + ``dl.signal``
                   (the ``all_gather`` recipe); the rest run the GEMM.

Epochs (``dl.call_epoch``/``dl.finish_call``, device side) make repeated calls and CUDA-graph replays safe with no
flag resets. The kernels are ordered so that, on every rank, all pushes of a launch come before the waits that
depend on them: the same source runs under the Triton interpreter, where a launch's programs run one by one.

Small M: when the GEMM is too short to hide anything, ``choose_path`` sends the call to NCCL all_gather +
cuBLAS (``SMALL_M_ROWS`` is the one crossover constant; on GPU the autotuner also times both and keeps the faster).
"""

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from .. import autotune, shmem
from .. import language as dl
from .gemm import (check_matmul_operands, default_num_programs, describe_operands, dot_precision, gemm_config,
                   interpreting, tile_accumulate, tile_coords, tile_store)

MAX_CHUNKS = 64  # per rank; sizes the `arrived` flags
# The crossover: at or below this many gathered rows (W * m) the overlapped kernel cannot beat NCCL all_gather +
# cuBLAS (the GEMM is too short to hide the transfer and too small to fill the GPU with 128-row tiles), so the
# default path is the fallback. On GPU the autotuner measures both paths around the crossover and keeps the faster.
SMALL_M_ROWS = 1024


# ----------------------------------------------------------------------------------------------- kernels
@triton.jit
def _fence_async_proxy():
    """Make data that generic-proxy writes (peers' stores, copy engines) published be visible to TMA reads."""
    tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _wait_chunk(flag, epoch, ctx, FENCE_ASYNC_PROXY: tl.constexpr):
    dl.wait(flag, epoch, ctx)
    if FENCE_ASYNC_PROXY:
        _fence_async_proxy()


@triton.jit
def _tile_flag(tile, tiles_m, tiles_n, me, world, n_chunks, chunk_rows,
               BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr):
    seg, pid_m, pid_n = tile_coords(tile, tiles_m, tiles_n, world, me, -1, GROUP_M)
    return seg * n_chunks + (pid_m * BLOCK_M) // chunk_rows


@triton.jit
def _push_shard(src, dst, arrived, ready, epoch, ctx, me, world, shard_words, chunk_words, n_chunks,
                producer, num_producers, PUSH_BLOCK: tl.constexpr):
    """SM producers: rank `me`'s shard into rows [me*m, (me+1)*m) of every rank's a_full, chunk by chunk."""
    if producer == 0:  # tell every peer it may overwrite our a_full now
        for peer in range(world):
            dl.signal(ready + me, epoch, peer, ctx)
    for item in range(producer, world * n_chunks, num_producers):
        peer = (me + item // n_chunks) % world  # own copy first, then the peers in ring order
        chunk = item % n_chunks
        dl.wait(ready + peer, epoch, ctx)
        start = chunk * chunk_words
        end = tl.minimum(start + chunk_words, shard_words)
        out = dst + me.to(tl.int64) * shard_words
        for off in range(start, end, PUSH_BLOCK):
            offs = off + tl.arange(0, PUSH_BLOCK)
            m = offs < end
            dl.put(out + offs, tl.load(src + offs, mask=m), peer, ctx, mask=m)
        dl.signal(arrived + me * n_chunks + chunk, epoch, peer, ctx)


@triton.jit
def _consume(a, b, c, arrived, epoch, ctx, me, world, m_shard, N, K, stride_am, stride_bn, stride_cs, stride_cm,
             chunk_rows, n_chunks, program, num_programs,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
             USE_TMA: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr, FLATTEN: tl.constexpr,
             WARP_SPECIALIZE: tl.constexpr, LOOKAHEAD: tl.constexpr, FENCE_ASYNC_PROXY: tl.constexpr,
             DOT_PRECISION: tl.constexpr):
    """The persistent GEMM over all W segments, own segment first, waiting for each chunk before reading it.

    LOOKAHEAD also waits for the chunk of this program's *next* tile before starting the current one, so that
    loads the compiler issues early across the tile boundary (FLATTEN, warp specialisation) never run ahead of
    the flag; without it the wait sits right before the tile's K loop, which the pipeliner does not cross."""
    tiles_m = tl.cdiv(m_shard, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = world * tiles_m * tiles_n
    a_rows = world * m_shard
    waited = -1
    for tile in tl.range(program, num_tiles, num_programs, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        seg, pid_m, pid_n = tile_coords(tile, tiles_m, tiles_n, world, me, -1, GROUP_M)
        flag = seg * n_chunks + (pid_m * BLOCK_M) // chunk_rows
        if flag != waited:
            _wait_chunk(arrived + flag, epoch, ctx, FENCE_ASYNC_PROXY)
            waited = flag
        if LOOKAHEAD:
            if tile + num_programs < num_tiles:
                next_flag = _tile_flag(tile + num_programs, tiles_m, tiles_n, me, world, n_chunks, chunk_rows,
                                       BLOCK_M, GROUP_M)
                if next_flag != waited:
                    _wait_chunk(arrived + next_flag, epoch, ctx, FENCE_ASYNC_PROXY)
                    waited = next_flag
        acc = tile_accumulate(a, b, seg * m_shard + pid_m * BLOCK_M, pid_n * BLOCK_N, a_rows, N, K,
                              stride_am, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, DOT_PRECISION)
        tile_store(c, acc, seg, pid_m * BLOCK_M, pid_n * BLOCK_N, m_shard, N, stride_cs, stride_cm,
                   BLOCK_M, BLOCK_N, USE_TMA, EPILOGUE_SUBTILE)


@triton.jit
def ag_gemm_kernel(a, b, c, src_words, dst_words, arrived, ready, state, ctx,
                   m_shard, N, K, stride_am, stride_bn, stride_cs, stride_cm,
                   shard_words, chunk_words, chunk_rows, n_chunks,
                   NUM_PRODUCERS: tl.constexpr, PUSH_BLOCK: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   USE_TMA: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr, FLATTEN: tl.constexpr,
                   WARP_SPECIALIZE: tl.constexpr, LOOKAHEAD: tl.constexpr, FENCE_ASYNC_PROXY: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """Programs [0, NUM_PRODUCERS) push this rank's shard (SM producers); the others run the GEMM. With
    NUM_PRODUCERS = 0 the shards are moved by copy engines before/alongside this launch."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    epoch = dl.call_epoch(state)
    if NUM_PRODUCERS > 0:
        if pid < NUM_PRODUCERS:
            _push_shard(src_words, dst_words, arrived, ready, epoch, ctx, me, world, shard_words, chunk_words,
                        n_chunks, pid, NUM_PRODUCERS, PUSH_BLOCK)
        else:
            _consume(a, b, c, arrived, epoch, ctx, me, world, m_shard, N, K, stride_am, stride_bn, stride_cs,
                     stride_cm, chunk_rows, n_chunks, pid - NUM_PRODUCERS, n_programs - NUM_PRODUCERS,
                     BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, USE_TMA, EPILOGUE_SUBTILE, FLATTEN, WARP_SPECIALIZE,
                     LOOKAHEAD, FENCE_ASYNC_PROXY, DOT_PRECISION)
    else:
        _consume(a, b, c, arrived, epoch, ctx, me, world, m_shard, N, K, stride_am, stride_bn, stride_cs,
                 stride_cm, chunk_rows, n_chunks, pid, n_programs,
                 BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, USE_TMA, EPILOGUE_SUBTILE, FLATTEN, WARP_SPECIALIZE,
                 LOOKAHEAD, FENCE_ASYNC_PROXY, DOT_PRECISION)
    dl.finish_call(state, epoch, n_programs)


@triton.jit
def ready_handshake_kernel(ready, state, epoch_out, ctx):
    """Copy-engine producer, step 1 (one program): this call's epoch -> ``epoch_out`` (the word the copy engines
    write into the peers' flags); tell every peer we entered the call; wait until every peer did."""
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    epoch = dl.call_epoch(state)
    tl.store(epoch_out, epoch)
    for peer in range(world):
        dl.signal(ready + me, epoch, peer, ctx)
    for peer in range(world):
        dl.wait(ready + peer, epoch, ctx)


# ----------------------------------------------------------------------------------------------- launcher
class _Workspace:
    """Per-shape buffers, made once (collectively: every rank calls ag_gemm with the same shapes in the same
    order) and reused by every later call, including CUDA-graph replays."""

    _cache = {}

    def __init__(self, m_shard, k, dtype):
        world, me = shmem.world_size(), shmem.rank()
        self.a_full = shmem.empty((world * m_shard, k), dtype, name="ag_gemm.a_full")
        self.arrived = shmem.zeros((world * MAX_CHUNKS,), torch.int32, name="ag_gemm.arrived")
        self.ready = shmem.zeros((world,), torch.int32, name="ag_gemm.ready")
        dev = shmem.device()
        self.state = torch.zeros(2, dtype=torch.int32, device=dev)
        self.epoch = torch.zeros(1, dtype=torch.int32, device=dev)
        self.a_full_peers = shmem.peer_views(self.a_full)
        self.arrived_peers = shmem.peer_views(self.arrived)
        # one side stream per destination (own copy first), so that every link is busy at once
        self.streams = [torch.cuda.Stream(dev) for _ in range(world)] if dev.type == "cuda" else []
        self.me = me
        shmem.barrier()  # peers signal into these flags only after everyone zeroed them

    @classmethod
    def get(cls, m_shard, k, dtype):
        key = (m_shard, k, dtype)
        if key not in cls._cache:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("ag_gemm: first call for this shape happens during CUDA-graph capture; call it "
                                   "once before capturing (workspaces are allocated and zeroed collectively)")
            cls._cache[key] = cls(m_shard, k, dtype)
        return cls._cache[key]


def _word_views(a, a_full, chunk_rows):
    """``a`` and ``a_full`` as the widest integer words that keep shard and chunk boundaries whole."""
    shard_bytes = a.numel() * a.element_size()
    chunk_bytes = chunk_rows * a.shape[1] * a.element_size()
    for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
        size = dtype.itemsize
        if shard_bytes % size == 0 and chunk_bytes % size == 0 and a.data_ptr() % size == 0:
            return a.reshape(-1).view(torch.uint8).view(dtype), a_full.reshape(-1).view(torch.uint8).view(dtype)
    raise AssertionError("unreachable")


def _chunking(m_shard, cfg):
    """Rows per chunk (a multiple of BLOCK_M, so a tile never straddles two chunks) and the chunk count."""
    bm = cfg["BLOCK_M"]
    n_chunks = max(1, min(int(cfg["n_chunks"]), MAX_CHUNKS, triton.cdiv(m_shard, bm)))
    chunk_rows = triton.cdiv(triton.cdiv(m_shard, n_chunks), bm) * bm
    return chunk_rows, triton.cdiv(m_shard, chunk_rows)


def _copy_engine_push(a, ws, chunk_rows, n_chunks):
    """Copy-engine producer, step 2: side streams copy our shard into every rank's a_full, a flag per chunk."""
    world, me = len(ws.a_full_peers), ws.me
    m_shard = a.shape[0]
    main = torch.cuda.current_stream() if a.is_cuda else None
    for step in range(world):
        peer = (me + step) % world
        stream = ws.streams[step] if a.is_cuda else None
        if stream is not None:
            stream.wait_stream(main)
        with torch.cuda.stream(stream) if stream is not None else _nullcontext():
            for chunk in range(n_chunks):
                lo, hi = chunk * chunk_rows, min((chunk + 1) * chunk_rows, m_shard)
                ws.a_full_peers[peer][me * m_shard + lo: me * m_shard + hi].copy_(a[lo:hi])
                flag = me * n_chunks + chunk
                ws.arrived_peers[peer][flag: flag + 1].copy_(ws.epoch)


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _run_overlapped(a, w, cfg, return_gathered):
    world, me = shmem.world_size(), shmem.rank()
    m_shard, k = a.shape
    n = w.shape[0]
    out = torch.empty((world * m_shard, n), dtype=a.dtype, device=a.device)
    ws = _Workspace.get(m_shard, k, a.dtype)
    chunk_rows, n_chunks = _chunking(m_shard, cfg)
    a_arg, b_arg, c_arg, use_tma = describe_operands(ws.a_full, w, out.view(world, m_shard, n), cfg)
    src_words, dst_words = _word_views(a, ws.a_full, chunk_rows)
    shard_words = src_words.numel()
    chunk_words = chunk_rows * k * a.element_size() // src_words.element_size()
    tiles = world * triton.cdiv(m_shard, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    # loads the compiler hoists across tiles (flattened loop, warp specialisation) need the one-tile lookahead
    lookahead = bool(cfg["LOOKAHEAD"] or cfg["FLATTEN"] or cfg["WARP_SPECIALIZE"])
    sm_producers = cfg["producer"] == "sm"
    num_producers = int(cfg["num_producers"]) if sm_producers else 0
    programs = cfg.get("num_programs") or default_num_programs(a.device)
    consumers = max(1, min(programs - num_producers, tiles))
    ctx = shmem.context()
    shmem.raise_pending_errors()
    if not sm_producers:
        ready_handshake_kernel[(1,)](ws.ready, ws.state, ws.epoch, ctx)
        _copy_engine_push(a, ws, chunk_rows, n_chunks)
    ag_gemm_kernel[(num_producers + consumers,)](
        a_arg, b_arg, c_arg, src_words, dst_words, ws.arrived, ws.ready, ws.state, ctx,
        m_shard, n, k, ws.a_full.stride(0), w.stride(0), m_shard * n, n,
        shard_words, chunk_words, chunk_rows, n_chunks,
        NUM_PRODUCERS=num_producers, PUSH_BLOCK=cfg["push_block"],
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        USE_TMA=use_tma, EPILOGUE_SUBTILE=bool(cfg["EPILOGUE_SUBTILE"]) and use_tma, FLATTEN=cfg["FLATTEN"],
        WARP_SPECIALIZE=cfg["WARP_SPECIALIZE"], LOOKAHEAD=lookahead,
        FENCE_ASYNC_PROXY=use_tma and not interpreting(), DOT_PRECISION=dot_precision(a.dtype),
        num_stages=cfg["num_stages"], num_warps=cfg["num_warps"])
    if a.is_cuda and not sm_producers:
        main = torch.cuda.current_stream()
        for stream in ws.streams:
            main.wait_stream(stream)
    gathered = ws.a_full.clone() if return_gathered else a.new_empty((0, k))
    return out, gathered


def _run_gather_then_matmul(a, w, return_gathered):
    """The small-M path: NCCL (gloo on CPU) all_gather into a fresh tensor, then cuBLAS."""
    world = shmem.world_size()
    gathered = torch.empty((world * a.shape[0], a.shape[1]), dtype=a.dtype, device=a.device)
    group = shmem.group()
    if a.is_cuda:
        dist.all_gather_into_tensor(gathered, a, group=group)
    else:  # gloo
        dist.all_gather(list(gathered.chunk(world)), a, group=group)
    out = torch.matmul(gathered, w.T)
    return out, (gathered if return_gathered else a.new_empty((0, a.shape[1])))


# ----------------------------------------------------------------------------------------------- configs
def choose_path(m_total, n, k, world, device_type="cuda"):
    """The default path for a shape: "fallback" (all_gather + matmul) when the overlap cannot win on a GPU.
    (On CPU, where nothing is about speed, the overlapped kernels always run so that tests exercise them.)"""
    if world == 1:
        return "fallback"
    if device_type == "cuda" and m_total <= SMALL_M_ROWS:
        return "fallback"
    return "overlap"


def default_config(m_shard, n, k, dtype, device, world):
    m_total = world * m_shard
    cfg = gemm_config(m_total, n, k, dtype, device)
    cfg.update(path=choose_path(m_total, n, k, world, device.type), producer="copy_engine", num_producers=16, n_chunks=4,
               push_block=4096, LOOKAHEAD=False)
    if device.type != "cuda":
        cfg.update(producer="sm", num_producers=2, n_chunks=2, push_block=256, num_programs=4)
    return cfg


def candidate_configs(m_shard, n, k, dtype, device, world):
    """The small sweep run once per shape on GPU (the benchmark's time budget keeps it short)."""
    base = default_config(m_shard, n, k, dtype, device, world)
    m_total = world * m_shard
    over = {**base, "path": "overlap"}
    big = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_stages=3, num_warps=8)
    cands = [{**base, "path": "fallback"}]
    if m_total > 256 and world > 1:
        cands += [{**over, **big, "n_chunks": 4},
                  {**over, **big, "n_chunks": 8, "EPILOGUE_SUBTILE": True, "num_stages": 4},
                  {**over, **big, "n_chunks": 8, "producer": "sm", "num_producers": 16},
                  {**over, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_stages": 4, "num_warps": 8,
                   "n_chunks": 4}]
    unique = []
    for c in cands:
        if c not in unique:
            unique.append(c)
    return unique


def _config_for(a, w, world):
    m_shard, k = a.shape
    n = w.shape[0]
    base = default_config(m_shard, n, k, a.dtype, a.device, world)
    if a.device.type != "cuda":
        return base

    def make_runner():
        x = torch.randn_like(a)
        y = torch.randn_like(w)

        def run(cfg):
            if cfg["path"] == "fallback":
                return _run_gather_then_matmul(x, y, False)
            return _run_overlapped(x, y, cfg, False)
        return run

    key = dict(m_shard=m_shard, n=n, k=k, dtype=str(a.dtype).replace("torch.", ""))
    return autotune.choose("ag_gemm", key, candidate_configs(m_shard, n, k, a.dtype, a.device, world),
                           make_runner, default=base)


# ----------------------------------------------------------------------------------------------- the op
def _check_inputs(a, w):
    check_matmul_operands(a, w, "a", "w")
    home = shmem.device()
    if a.device.type != home.type or (home.type == "cuda" and a.device.index != home.index):
        raise ValueError(f"a and w are on {a.device}, but triton_dist runs on {home}")


def _ag_gemm_impl(a, w, return_gathered, config=None):
    _check_inputs(a, w)
    world = shmem.world_size()
    m_shard, k = a.shape
    n = w.shape[0]
    if m_shard == 0 or k == 0:  # nothing to move or nothing to multiply
        out = a.new_zeros((world * m_shard, n))
        return out, a.new_empty((world * m_shard if return_gathered else 0, k))
    if n == 0 or world == 1:
        return _run_gather_then_matmul(a, w, return_gathered)
    cfg = {**default_config(m_shard, n, k, a.dtype, a.device, world), **(config or _config_for(a, w, world))}
    if cfg["path"] == "fallback":
        return _run_gather_then_matmul(a, w, return_gathered)
    return _run_overlapped(a, w, cfg, return_gathered)


@torch.library.custom_op("triton_dist::ag_gemm", mutates_args=())
def _ag_gemm_op(a: torch.Tensor, w: torch.Tensor, return_gathered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    out, gathered = _ag_gemm_impl(a, w, return_gathered)
    return out, gathered


@_ag_gemm_op.register_fake
def _(a, w, return_gathered=False):
    _check_inputs(a, w)
    world = shmem.world_size()
    rows = world * a.shape[0]
    return a.new_empty((rows, w.shape[0])), a.new_empty((rows if return_gathered else 0, a.shape[1]))


def ag_gemm(a, w, return_gathered=False, config=None):
    """``all_gather(a) @ w.T`` on every rank, the gather overlapped with the GEMM.

    a: this rank's row shard [m, K]; w: this rank's weight slice [N_local, K] (``linear`` convention); both
    contiguous, same dtype (bfloat16 or float16; float32 for tests) and on triton_dist's device. Collective: every
    rank calls it with the same shapes. Returns ``out`` [W*m, N_local], and with ``return_gathered=True`` the
    tuple ``(out, all_gather(a))``. Also available as ``torch.ops.triton_dist.ag_gemm(a, w, return_gathered)``
    (always returns the pair; the second is empty unless asked for), which works under torch.compile and CUDA
    graphs (call once before capturing). ``config``: override the tuned configuration (see ``default_config``).
    """
    if not isinstance(a, torch.Tensor) or not isinstance(w, torch.Tensor):
        raise TypeError(f"a and w must be torch.Tensors, got {type(a).__name__} and {type(w).__name__}")
    _check_inputs(a, w)
    if config is not None:
        out, gathered = _ag_gemm_impl(a, w, return_gathered, config)
    else:
        out, gathered = torch.ops.triton_dist.ag_gemm(a, w, return_gathered)
    return (out, gathered) if return_gathered else out


__all__ = ["ag_gemm", "ag_gemm_kernel", "ready_handshake_kernel", "choose_path", "default_config",
           "candidate_configs", "SMALL_M_ROWS"]
