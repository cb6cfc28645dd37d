"""MoE expert-parallel dispatch / combine: the received layout (rows grouped by local expert in source-rank,
token, slot order; counts; padding), the combined output against a single-process reference, bitwise
reproducibility, back-to-back calls, bad input, torch ops, CUDA graphs (GPU) and sm_90 code generation."""

import random
import time

import pytest
import torch
import torch.distributed as dist
import triton
import triton.language as tl

import triton_dist as td
from triton_dist.kernels.moe_ep import ep_combine, ep_dispatch
from triton_dist.kernels.moe_ep.protocol import count_units, receiver_unit

from ..conftest import ON_GPU_RANKS, error_names, gpu_only
from ..sm90 import compile_sm90


def _routing(mode, T, E, K, seed):
    """This rank's (x-independent) router output for a test scenario."""
    r, w = td.rank(), td.world_size()
    g = torch.Generator().manual_seed(1000 * seed + r)
    if mode == "zero" and r == w - 1:
        T = 0
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else \
        torch.zeros((0, K), dtype=torch.int64)
    if mode == "skew":  # every token sends slot 0 to expert 0
        for t in range(T):
            row = [0] + [e for e in torch.randperm(E, generator=g).tolist() if e != 0][:K - 1]
            idx[t] = torch.tensor(row)
    elif mode == "local":  # no token has a remote expert
        el = E // w
        for t in range(T):
            idx[t] = r * el + torch.randperm(el, generator=g)[:K]
    elif mode == "holes" and T:  # unused slots (-1) and repeated experts in a token (ids out of range raise:
        idx[torch.rand(T, K, generator=g) < 0.3] = -1  # tests/shmem/test_misuse.py)
        idx[::2, 1] = idx[::2, 0]
    weights = torch.rand(T, K, generator=g)
    return idx, weights


def _expert_scale(E):
    return (torch.arange(E, dtype=torch.float64) % 5 + 1) / 4  # expert e multiplies its rows by this


def _run(mode, T, H, E, K, dtype_name, align, seed, config=None, repeats=1):
    """Dispatch, fake experts (row * scale[e]), combine; check everything against a reference on this rank."""
    dtype = getattr(torch, dtype_name)
    dev = td.shmem.device()
    r, w = td.rank(), td.world_size()
    el = E // w
    idx, weights = _routing(mode, T, E, K, seed)
    g = torch.Generator().manual_seed(seed * 77 + r)
    x = torch.randn(idx.shape[0], H, generator=g).to(dtype)
    every = [None] * w
    dist.all_gather_object(every, (x, idx, weights))
    max_tokens = max(e[0].shape[0] for e in every) + 2
    res = ep_dispatch(x.to(dev), idx.to(dev), weights.to(dev), num_experts=E, max_tokens=max_tokens,
                      align=align, config=config, check_ids=mode != "holes")
    # reference receive layout on this rank
    counts, rows = [], []
    for e in range(r * el, (r + 1) * el):
        group = [(s, t, j) for s in range(w) for t in range(every[s][1].shape[0]) for j in range(K)
                 if int(every[s][1][t, j]) == e]
        counts.append(len(group))
        rows.append(group)
    problems = []
    if res.expert_counts.cpu().tolist() != counts:
        problems.append(f"counts {res.expert_counts.cpu().tolist()} != {counts}")
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + -(-c // align) * align)
    if res.expert_offsets.cpu().tolist() != offsets:
        problems.append(f"offsets {res.expert_offsets.cpu().tolist()} != {offsets}")
    rx, rid, rw = res.x.cpu(), res.expert_ids.cpu(), res.weights.cpu()
    for le, group in enumerate(rows):
        for i, (s, t, j) in enumerate(group):
            row = offsets[le] + i
            if not torch.equal(rx[row], every[s][0][t]) or int(rid[row]) != le or \
                    float(rw[row]) != float(every[s][2][t, j]):
                problems.append(f"row {row} (expert {le}, from rank {s} token {t} slot {j}) wrong")
                break
        pad = slice(offsets[le] + len(group), offsets[le + 1])
        if (rid[pad] != -1).any() or (rw[pad] != 0).any():
            problems.append(f"padding of expert {le} not marked")
    if (rid[offsets[-1]:] != -1).any():
        problems.append("rows past the last group not marked -1")
    # experts: row * scale; padding rows are NaN (combine must never read them)
    scale = _expert_scale(E)[r * el:(r + 1) * el].to(torch.float32)
    out = (res.x.float() * scale.to(dev)[res.expert_ids.clamp(min=0).long()][:, None]).to(dtype)
    out[res.expert_ids < 0] = float("nan")
    # repeats: combines of one handle, back to back, with the expert outputs scaled by 2**i (exact): y_i must be
    # 2**i * y_0 bitwise (catches a rank running ahead into partials a peer still reads)
    ys = [ep_combine(out * 2.0**i, res.handle, config=config).cpu() for i in range(repeats)]
    ref = torch.zeros(x.shape, dtype=torch.float64)
    gs = _expert_scale(E)
    for t in range(x.shape[0]):
        for j in range(K):
            e = int(idx[t, j])
            if 0 <= e < E:
                ref[t] += float(weights[t, j]) * gs[e] * x[t].double()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    if x.shape[0] and not torch.allclose(ys[0].double(), ref, rtol=tol, atol=tol):
        problems.append(f"combine off by {(ys[0].double() - ref).abs().max().item():.3g}")
    if any(not torch.equal(y.view(torch.uint8), (ys[0] * 2.0**i).view(torch.uint8)) for i, y in enumerate(ys)):
        problems.append("repeated combines differ (bitwise) from the first one scaled")
    return problems


@pytest.mark.parametrize("mode,T,align,dtype", [("random", 7, 1, "float32"), ("skew", 5, 4, "bfloat16"),
                                                ("local", 6, 1, "float32"), ("zero", 5, 2, "float16"),
                                                ("holes", 9, 1, "float32"), ("random", 1, 1, "bfloat16")])
def test_dispatch_combine_2_ranks(ranks, mode, T, align, dtype):
    for problems in ranks(2, _run, mode, T, 16, 8, 3, dtype, align, 1, None, 3 if mode == "zero" else 1):
        assert problems == []


@pytest.mark.parametrize("mode,T", [("zero", 5)])  # ranks 0-2 random routing, rank 3 no tokens
def test_dispatch_combine_4_ranks(ranks, mode, T):
    for problems in ranks(4, _run, mode, T, 8, 8, 3, "float32", 2, 2, None, 3):
        assert problems == []


# Configs of the tests below. They run under torchrun on GPUs too, where the defaults they override differ
# (test_configs_are_valid_with_gpu_defaults keeps them valid there).
CFG_8_RANKS = {"fused_layout": False, "num_chunks": 3, "block_h": 4, "h_parts": 2, "combine_block_h": 4,
               "combine_h_parts": 2, "defer_signal": True, "combine_defer_signal": True, "tail_chunks": 1,
               "tail_parts": 4, "combine_tail_chunks": 2, "combine_tail_parts": 3}
CFG_TWO_LAUNCH = {"fused_layout": False, "num_chunks": 5, "layout_chunks": 1, "num_programs": 3, "push_programs": 2,
                  "block_tokens": 2, "block_h": 16, "h_parts": 2, "combine_programs": 4, "combine_push": 3,
                  "combine_block_tokens": 4, "combine_block_h": 8, "combine_h_parts": 3, "defer_signal": True,
                  "combine_defer_signal": True, "tail_chunks": 2, "tail_parts": 3, "combine_tail_chunks": 9,
                  "combine_tail_parts": 4, "stream_hints": True, "combine_stream_hints": True}
CFG_LONG_CHUNKS = {"fused_layout": False, "num_chunks": 2, "block_tokens": 64, "block_h": 8}
CFG_RECOVERY = {"fused_layout": False}


def cfg_back_to_back(i):
    return {"fused_layout": bool(i % 2), "num_chunks": 5 if i % 2 else 2, "block_h": 4, "h_parts": 1 + i % 3, "combine_block_h": 4,
            "combine_h_parts": 1 + (i + 1) % 3, "combine_programs": 2 + i % 2, "combine_push": 1,
            "defer_signal": i % 2 == 0, "combine_defer_signal": i % 2 == 1}


@pytest.mark.parametrize("config", [None, CFG_8_RANKS])
def test_dispatch_combine_8_ranks(ranks, config):
    """The all-to-all at 8 ranks (2 experts each; the last rank has no tokens): counts, layout, combine; with the
    default (fused) layout and with the layout launch's look-back and half-width receiver units."""
    for problems in ranks(8, _run, "zero", 3, 8, 16, 3, "float16", 1, 3, config):
        assert problems == []


def test_two_launch_layout_and_uneven_chunks(ranks):
    """The layout launch (default for max_tokens > 256; one chunk per layout program here: the look-back over 5
    odd-sized chunks takes two steps of 4 on CPU); 2 senders + 1 receiver copying each chunk's 32 columns in 2
    parts (the last 2 chunks in 3 parts); combine with its own knobs (3 senders + 1 receiver, 4-token blocks,
    each chunk's columns taken in 3 parts: 16, 16 and an empty one; a tail of 9 chunks, more than there are, in
    4). Senders raise each chunk's flags late (deferred) in both; the copies carry L2 hints (ignored by the
    interpreter: the knobs' plumbing)."""
    for problems in ranks(2, _run, "random", 13, 32, 8, 2, "float32", 1, 3, CFG_TWO_LAUNCH):
        assert problems == []


def test_layout_counts_long_chunks_in_steps(ranks):
    """Chunks of more than 256 tokens: the layout counts them in steps of 256 (here 301 and 299 tokens)."""
    for problems in ranks(2, _run, "random", 600, 8, 8, 2, "float32", 1, 5, CFG_LONG_CHUNKS):
        assert problems == []


@triton.jit
def _units_kernel(out, n_chunks, h_parts, tail, tail_parts, H, BH: tl.constexpr):
    u = tl.program_id(0)
    c, h_first, h_end = receiver_unit(u, n_chunks, h_parts, tail, tail_parts, H, BH)
    tl.store(out + 3 * u, c)
    tl.store(out + 3 * u + 1, h_first)
    tl.store(out + 3 * u + 2, h_end)
    tl.store(out + 3 * tl.num_programs(0), count_units(n_chunks, h_parts, tail, tail_parts))


@pytest.mark.parametrize("n_chunks,h_parts,tail,tail_parts,H,BH", [
    (5, 2, 0, 1, 70, 16), (5, 2, 2, 3, 70, 16), (4, 1, 4, 4, 64, 16), (3, 4, 1, 16, 100, 8), (6, 3, 6, 1, 33, 32)])
def test_receiver_units_cover_every_column_once(n_chunks, h_parts, tail, tail_parts, H, BH):
    """The receivers' units (chunk, column part; the last ``tail`` chunks in tail_parts parts): every column of
    every chunk in exactly one unit, parts of whole BH tiles, in chunk order."""
    n = (n_chunks - tail) * h_parts + tail * tail_parts
    out = torch.full((3 * n + 1,), -7, dtype=torch.int32, device="cuda" if ON_GPU_RANKS else "cpu")
    _units_kernel[(n,)](out, n_chunks, h_parts, tail, tail_parts, H, BH=BH)
    units = out[:-1].view(n, 3).tolist()
    assert int(out[-1]) == n
    assert [c for c, _, _ in units] == sorted(c for c, _, _ in units)
    for chunk in range(n_chunks):
        spans = [(h0, h1) for c, h0, h1 in units if c == chunk and h1 > h0]
        covered = sorted(col for h0, h1 in spans for col in range(h0, h1))
        assert covered == list(range(H)), (chunk, spans)
        assert all(h0 % BH == 0 for h0, _ in spans)


@pytest.mark.parametrize("max_tokens", [8, 4096])  # the decode-size and the large GPU defaults
def test_configs_are_valid_with_gpu_defaults(max_tokens):
    """Every config these tests pass also runs with the GPU defaults it overrides (run33: a test that gave 2
    combine programs and left 66 senders to the GPU default failed there only)."""
    from triton_dist.kernels import moe_ep

    for cfg in [CFG_8_RANKS, CFG_TWO_LAUNCH, CFG_LONG_CHUNKS, CFG_RECOVERY] + [cfg_back_to_back(i) for i in range(4)]:
        moe_ep.dispatch_config(max_tokens, 16, "cuda", cfg)  # raise ValueError when not
        moe_ep.combine_config(max_tokens, 16, "cuda", cfg)


def _reproducible(runs):
    """20 combines of one dispatch plus 3 whole dispatch+combine rounds, with random delays per rank: bitwise."""
    dev = td.shmem.device()
    idx, weights = _routing("random", 11, 8, 3, 7)
    x = torch.randn(11, 16, generator=torch.Generator().manual_seed(td.rank())).to(torch.bfloat16).to(dev)
    idx, weights = idx.to(dev), weights.to(dev)
    rnd = random.Random(td.rank())
    outs = []
    for rnd_i in range(3):
        res = ep_dispatch(x, idx, weights, num_experts=8, max_tokens=11)
        expert_out = (res.x.float() * (1 + res.expert_ids.float())[:, None] / 3).to(torch.bfloat16)
        for _ in range(runs if rnd_i == 0 else 1):
            time.sleep(rnd.random() * 0.01)
            outs.append(ep_combine(expert_out, res.handle).view(torch.int16).cpu())
    return all(torch.equal(o, outs[0]) for o in outs)


def test_bitwise_reproducible_20_runs(ranks):
    assert ranks(2, _reproducible, 20) == [True, True]


def _back_to_back(calls):
    """Fresh routing every call, no barriers, alternating fused / two-launch layout, exact-size outputs, and the
    receivers' work counters reused by calls with other unit counts (column parts, receiving programs); the
    counts checked against every rank's routing (a layout that kept state from an earlier call shows there)."""
    dev = td.shmem.device()
    ok = []
    for i in range(calls):
        idx, weights = _routing("random", 4 + i, 8, 2, 10 + i)
        x = torch.randn(idx.shape[0], 8).to(dev) + td.rank()
        cfg = cfg_back_to_back(i)
        res = ep_dispatch(x, idx.to(dev), weights.to(dev), num_experts=8, max_tokens=8, exact=True, config=cfg)
        ok.append(res.x.shape[0] == int(res.expert_offsets[-1]) == int(res.expert_counts.sum()))
        every = [None] * td.world_size()
        dist.all_gather_object(every, idx)
        mine = torch.arange(td.rank() * 4, td.rank() * 4 + 4)  # 8 experts on 2 ranks
        ok.append(res.expert_counts.cpu().tolist() == [sum(int((e == m).sum()) for e in every) for m in mine])
        y = ep_combine(res.x, res.handle, config=cfg)  # identity experts: y = sum_j w_j * x
        ok.append(torch.allclose(y, weights.to(dev).sum(1, keepdim=True) * x, atol=1e-5))
    return ok


def test_back_to_back_calls(ranks):
    for ok in ranks(2, _back_to_back, 4):
        assert all(ok), ok


def _recovers_after_a_failed_call():
    """Rank 1 skips a combine: rank 0's receivers' waits for ``ep.combined`` time out with an error naming it;
    after ``td.shmem.reset()`` (collective) both ranks dispatch and combine correctly again (two-launch layout:
    its look-back flags and the receivers' work counters are reset too)."""
    dev = td.shmem.device()
    cfg = CFG_RECOVERY

    def dispatch(i):
        idx, weights = _routing("random", 6, 8, 2, 20 + i)
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(i + td.rank())).to(dev)
        return x, weights.to(dev), ep_dispatch(x, idx.to(dev), weights.to(dev), num_experts=8, max_tokens=8,
                                               config=cfg)

    def correct(x, weights, res):  # identity experts
        return torch.allclose(ep_combine(res.x, res.handle, config=cfg), weights.sum(1, keepdim=True) * x, atol=1e-5)

    ok = correct(*dispatch(0))
    x, weights, res = dispatch(1)
    message = None
    td.shmem.set_wait_timeout(0.05)
    td.shmem.check_calls(False)  # the device-side wait's timeout is what this test is about
    try:
        if td.rank() == 0:
            ep_combine(res.x, res.handle, config=cfg)
            try:
                td.shmem.check_errors()
            except td.shmem.WaitTimeoutError as exc:
                message = str(exc)
    finally:
        td.shmem.set_wait_timeout(60)
        td.shmem.check_calls(True)
    td.shmem.reset()
    for i in range(2, 4):
        ok &= correct(*dispatch(i))
    return ok, message


def test_recovers_after_a_failed_call(ranks):
    (ok0, message), (ok1, none) = ranks(2, _recovers_after_a_failed_call)
    assert ok0 and ok1 and none is None
    assert message is not None and "rank 0" in message, message
    assert "ep.combined" in message, message


def _bad_input():
    dev = td.shmem.device()
    x = torch.randn(3, 8, device=dev)
    idx = torch.tensor([[0, 1], [2, 3], [4, 5]], device=dev)
    w = torch.rand(3, 2, device=dev)
    kw = dict(num_experts=8, max_tokens=4)
    bad_ids = torch.tensor([[0, 1], [2, 8], [4, 5]], device=dev)
    cases = [
        lambda: ep_dispatch(x.numpy(), idx, w, **kw),                                  # not a tensor
        lambda: ep_dispatch(x.to(torch.int32), idx, w, **kw),                          # dtype of x
        lambda: ep_dispatch(x, idx.float(), w, **kw),                                  # dtype of ids
        lambda: ep_dispatch(x, idx, w[:2], **kw),                                      # shapes
        lambda: ep_dispatch(x, bad_ids, w, check_ids=True, **kw),                      # id out of range
        lambda: ep_dispatch(x, idx, w, num_experts=7, max_tokens=4),                   # E % world
        lambda: ep_dispatch(x, idx, w, num_experts=8, max_tokens=2),                   # T > max_tokens
        lambda: ep_combine(x, "handle"),                                               # not a handle
        lambda: ep_dispatch(x, idx, w, timeline=torch.zeros(4, dtype=torch.int64, device=dev), **kw),  # too small
        lambda: ep_dispatch(x, idx, w, config={"num_chunk": 4}, **kw),                # unknown knob (typo)
        lambda: ep_dispatch(x, idx, w, config={"num_programs": 2, "push_programs": 2}, **kw),  # no receiver
        lambda: ep_dispatch(x, idx, w, config={"h_parts": 0}, **kw),                  # no column part
        lambda: ep_dispatch(x, idx, w, config={"tail_chunks": -1}, **kw),             # tail of < 0 chunks
    ]
    res = ep_dispatch(x, idx, w, **kw)
    cases += [lambda: ep_combine(res.x.half(), res.handle),                            # dtype of expert_out
              lambda: ep_combine(res.x[:, :4], res.handle),                            # shape of expert_out
              lambda: ep_combine(res.x, res.handle, config={"combine_push": 1000})]    # no receiver
    errors = error_names(cases)
    old = res.handle
    ep_dispatch(x, idx, w, **kw)
    try:
        ep_combine(res.x, old)
        errors.append(None)
    except ValueError:
        errors.append("stale")
    ep_combine(res.x, ep_dispatch(x, idx, w, **kw).handle)  # keep the ranks' calls matched
    return errors


def test_rejects_bad_input(ranks):
    for errors in ranks(2, _bad_input):
        assert errors == ["TypeError", "TypeError", "TypeError", "ValueError", "ValueError", "ValueError",
                          "ValueError", "TypeError", "TypeError", "ValueError", "ValueError", "ValueError",
                          "ValueError", "TypeError", "ValueError", "ValueError", "stale"]


def _torch_ops():
    dev = td.shmem.device()
    idx, weights = _routing("random", 5, 8, 2, 4)
    x = torch.randn(5, 8).to(dev)
    recv_x, ids, rw, counts, offsets, token_pos = torch.ops.triton_dist.ep_dispatch(
        x, idx.to(dev), weights.to(dev), 8, 6, 1)
    y = torch.ops.triton_dist.ep_combine(recv_x, token_pos, 8, 2, 6, 1)
    from torch._subclasses.fake_tensor import FakeTensorMode

    # the differentiable ops (training.py): new tensors, the records among them
    train = torch.ops.triton_dist.ep_dispatch_train(x, idx.to(dev), weights.to(dev), 8, 6, 1)
    y_train = torch.ops.triton_dist.ep_combine_train(train[0], train[2], idx.to(dev), *train[5:], 8, 6, 1)
    home = torch.ops.triton_dist.ep_scalars_home(train[2], train[6], train[5])
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        fake = torch.ops.triton_dist.ep_dispatch(fx, mode.from_tensor(idx), mode.from_tensor(weights), 8, 6, 1)
        fy = torch.ops.triton_dist.ep_combine(fake[0], fake[5], 8, 2, 6, 1)
        fake_train = torch.ops.triton_dist.ep_dispatch_train(fx, mode.from_tensor(idx), mode.from_tensor(weights), 8,
                                                             6, 1)
        fake_y_train = torch.ops.triton_dist.ep_combine_train(fake_train[0], fake_train[2], mode.from_tensor(idx),
                                                              *fake_train[5:], 8, 6, 1)
        fake_home = torch.ops.triton_dist.ep_scalars_home(fake_train[2], fake_train[6], fake_train[5])
    real, fakes = (*train, y_train, home), (*fake_train, fake_y_train, fake_home)
    train_fakes = all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(real, fakes))
    return (torch.allclose(y, weights.sum(1, keepdim=True).to(dev) * x, atol=1e-5) and torch.equal(y, y_train)
            and torch.equal(home, weights.to(dev)),
            tuple(fake[0].shape) == tuple(recv_x.shape) and train_fakes, tuple(fy.shape) == (5, 8), int(counts.sum()))


def test_torch_ops_and_fake_impls(ranks):
    results = ranks(2, _torch_ops)
    for ok, same_shape, fake_y, _ in results:
        assert ok and same_shape and fake_y
    assert sum(r[3] for r in results) == 2 * 5 * 2  # every (token, slot) lands exactly once


def _moe_layer_compiled():
    """A whole EP MoE layer (dispatch -> per-expert scale -> combine) through the torch ops under
    torch.compile(fullgraph=True) gives the eager layer's bits."""
    dev = td.shmem.device()
    idx, weights = _routing("random", 7, 8, 3, 5)
    idx, weights = idx.to(dev), weights.to(dev)
    x = torch.randn(7, 16, generator=torch.Generator().manual_seed(td.rank())).to(dev)

    def layer(x, idx, weights):
        recv_x, ids, _, _, _, token_pos = torch.ops.triton_dist.ep_dispatch(x, idx, weights, 8, 7, 1)
        expert_out = recv_x * (1.0 + ids.clamp(min=0).to(recv_x.dtype))[:, None]  # expert e scales by 1 + e
        return torch.ops.triton_dist.ep_combine(expert_out, token_pos, 8, 3, 7, 1)

    eager = layer(x, idx, weights)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(x, idx, weights)
    el = 8 // td.world_size()
    ref = sum(weights[:, j, None].double() * (1.0 + (idx[:, j] % el).double())[:, None] * x.double()
              for j in range(3))  # local expert id e % EL on its owner rank
    return torch.equal(eager, compiled), torch.allclose(eager.double(), ref, atol=1e-5)


def test_moe_layer_under_torch_compile(ranks):
    assert ranks(2, _moe_layer_compiled) == [(True, True)] * 2


def _empty_rank_compiled():
    """The zero-copy ops under inductor, the last rank without tokens: its empty results must not let the compiler
    drop its calls (the ops are collectives: ordered effects, ``library.collective``)."""
    T = 0 if td.rank() == td.world_size() - 1 else 5
    idx, weights = _routing("random", T, 4, 2, 6)
    x = torch.randn(T, 8, generator=torch.Generator().manual_seed(td.rank()))

    def layer(x, idx, weights):
        recv_x, *_, token_pos = torch.ops.triton_dist.ep_dispatch(x, idx, weights, 4, 5, 1)
        return torch.ops.triton_dist.ep_combine(recv_x * 2, token_pos, 4, 2, 5, 1).sum()

    return torch.allclose(torch.compile(layer, fullgraph=True)(x, idx, weights), 2 * (weights.sum(1) * x.sum(1)).sum(),
                          rtol=1e-5)


def test_rank_without_tokens_under_inductor(ranks):
    assert ranks(2, _empty_rank_compiled) == [True, True]


# ----------------------------------------------------------------------------------------------------- GPU
def _gpu_bf16(T, H, E, K, align, config=None):
    dev = td.shmem.device()
    r, w = td.rank(), td.world_size()
    g = torch.Generator(device=dev).manual_seed(r)
    x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
    idx = torch.rand(T, E, device=dev, generator=g).topk(K, dim=1).indices
    weights = torch.rand(T, K, device=dev, generator=g)
    res = ep_dispatch(x, idx, weights, num_experts=E, max_tokens=T, align=align, config=config)
    el = E // w
    scale = _expert_scale(E).float().to(dev)
    out = (res.x.float() * scale[r * el + res.expert_ids.clamp(min=0).long()][:, None]).to(torch.bfloat16)
    y = ep_combine(out, res.handle, config=config)
    ref = (weights[:, :, None] * scale[idx][:, :, None] * x.float()[:, None, :]).sum(1)
    ok_y = torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-2)
    counts = torch.zeros(E, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, idx.reshape(-1), torch.ones(idx.numel(), dtype=torch.int64, device=dev))
    dist.all_reduce(counts)
    ok_counts = torch.equal(res.expert_counts.long(), counts[r * el:(r + 1) * el])
    y2 = ep_combine(out, res.handle, config=config)
    return ok_y and ok_counts and torch.equal(y.view(torch.int16), y2.view(torch.int16))


@gpu_only
@pytest.mark.parametrize("T,align,config", [(128, 1, None), (1000, 64, None), (4096, 16, None),
                                            (1000, 64, {"stream_hints": False, "combine_stream_hints": False}),
                                            (128, 1, {"fused_layout": True}),
                                            (1000, 64, {"fused_layout": True, "layout_chunks": 2})])
def test_gpu_bf16(ranks, T, align, config):
    """On every GPU of the run (W=1 included: the rank's own rows only, no peers)."""
    assert all(ranks(ranks.gpu_world, _gpu_bf16, T, 1024, 64, 8, align, config))


def _gpu_timeline():
    """With the phase timeline on: the result is unchanged and every program and chunk stamped its phases in
    order (start <= counts known <= sent / marked <= end; a chunk is seen no earlier than the receiver started)."""
    from triton_dist.kernels import moe_ep

    dev = td.shmem.device()
    T, H, E, K = 1000, 1024, 64, 8
    g = torch.Generator(device=dev).manual_seed(td.rank())
    x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
    idx = torch.rand(T, E, device=dev, generator=g).topk(K, dim=1).indices
    weights = torch.rand(T, K, device=dev, generator=g)
    stamps = torch.full((2, moe_ep.TIMELINE_SLOTS), -1, dtype=torch.int64, device=dev)
    res = ep_dispatch(x, idx, weights, num_experts=E, max_tokens=T, timeline=stamps[0])
    y = ep_combine(res.x, res.handle, timeline=stamps[1])
    ok = torch.allclose(y.float(), weights.sum(1, keepdim=True) * x.float(), rtol=2e-2, atol=2e-2)
    dcfg, ccfg = moe_ep.dispatch_config(T, H, "cuda"), moe_ep.combine_config(T, H, "cuda")
    st = stamps.cpu()
    for kernel, cfg in ((0, dcfg), (1, ccfg)):
        prog = st[kernel, moe_ep.TL_PROGRAM:moe_ep.TL_CHUNK].view(-1, 4)[:cfg.num_programs]
        chunk = st[kernel, moe_ep.TL_CHUNK:moe_ep.TL_LAYOUT].view(-1, 4)[:dcfg.num_chunks]
        n_push = cfg.push_programs
        ok &= bool((prog[:, 0] > 0).all() and (prog[:, 3] >= prog[:, 0]).all())
        ok &= bool((prog[:n_push, 1] >= prog[:n_push, 0]).all() and (prog[:n_push, 2] >= prog[:n_push, 1]).all())
        per_chunk = -(-T // dcfg.num_chunks)
        chunk = chunk[:-(-T // per_chunk)]  # the chunks that hold tokens (combine's receivers skip the others)
        ok &= bool((chunk[:, :3] >= prog[:, 0].min()).all() and (chunk[:, :3] <= prog[:, 3].max()).all())
    lay = st[0, moe_ep.TL_LAYOUT:].view(-1, 4)[:-(-dcfg.num_chunks // dcfg.layout_chunks)]  # per program
    ok &= bool((lay[:, 0] > 0).all() and (lay[:, 1:] >= lay[:, :-1]).all())
    return ok


def _gpu_eager_graph():
    """Eager dispatches with ``eager_graph`` replay from a cached CUDA graph after the first call: every call, fresh
    inputs, correct result."""
    from triton_dist.kernels import moe_ep

    dev = td.shmem.device()
    T, H, E, K = 128, 1024, 64, 8
    ok = True
    for i in range(4):  # direct, capture + replay, replay, replay
        g = torch.Generator(device=dev).manual_seed(10 * i + td.rank())
        x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
        idx = torch.rand(T, E, device=dev, generator=g).topk(K, dim=1).indices
        weights = torch.rand(T, K, device=dev, generator=g)
        res = ep_dispatch(x, idx, weights, num_experts=E, max_tokens=T, config={"eager_graph": True})
        y = ep_combine(res.x, res.handle)
        ok &= torch.allclose(y.float(), weights.sum(1, keepdim=True) * x.float(), rtol=2e-2, atol=2e-2)
    return ok and len(moe_ep.dispatch._GRAPHS.graphs) >= 1


@gpu_only
def test_gpu_eager_dispatch_replays_a_graph(ranks):
    assert all(ranks(2, _gpu_eager_graph))


def _gpu_bound_launches(T, config):
    """Repeated dispatches / combines of one layout launch bound (no argument check) only where that applies:
    16-byte aligned inputs; x, expert_out and out 2 bytes off an aligned address in between go the checked way."""
    dev = td.shmem.device()
    H, E, K = 1000, 16, 4
    ok = True
    for i, odd in enumerate((False, False, True, False, True)):
        g = torch.Generator(device=dev).manual_seed(10 * i + td.rank())
        x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
        if odd:
            x = torch.empty(T * H + 1, device=dev, dtype=torch.bfloat16)[1:].view(T, H).copy_(x)
        idx = torch.rand(T, E, device=dev, generator=g).topk(K, dim=1).indices
        weights = torch.rand(T, K, device=dev, generator=g)
        res = ep_dispatch(x, idx, weights, num_experts=E, max_tokens=T, config=config)
        rows = res.x if not odd else torch.empty(res.x.numel() + 1, device=dev, dtype=torch.bfloat16)[1:].view(
            res.x.shape).copy_(res.x)
        out = None if not odd else torch.full((T * H + 1,), float("nan"), device=dev, dtype=torch.bfloat16)[1:].view(
            T, H)
        y = ep_combine(rows, res.handle, out=out)
        ok &= torch.allclose(y.float(), weights.sum(1, keepdim=True) * x.float(), rtol=2e-2, atol=2e-2)
    return ok


@gpu_only
@pytest.mark.parametrize("T,config", [(128, None), (128, {"eager_graph": True}), (128, {"fused_layout": True}),
                                      (1000, None)], ids=["decode", "decode-graph", "decode-fused", "prefill"])
def test_gpu_bound_launches_only_where_they_apply(ranks, T, config):
    assert all(ranks(ranks.gpu_world, _gpu_bound_launches, T, config))


@gpu_only
def test_gpu_phase_timeline(ranks):
    assert all(ranks(2, _gpu_timeline))


def _gpu_graph():
    dev = td.shmem.device()
    T, H, E, K = 96, 512, 16, 4
    x = torch.zeros(T, H, device=dev, dtype=torch.bfloat16)
    idx = torch.zeros(T, K, device=dev, dtype=torch.int64)
    weights = torch.zeros(T, K, device=dev)

    def layer():
        res = ep_dispatch(x, idx, weights, num_experts=E, max_tokens=T, check_ids=False)
        return ep_combine(res.x, res.handle)  # identity experts

    layer()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer()
    ok = True
    for i in range(5):
        g = torch.Generator(device=dev).manual_seed(100 * i + td.rank())
        x.copy_(torch.randn(T, H, device=dev, generator=g))
        idx.copy_(torch.rand(T, E, device=dev, generator=g).topk(K, dim=1).indices)
        weights.copy_(torch.rand(T, K, device=dev, generator=g))
        graph.replay()
        ref = (weights.sum(1, keepdim=True) * x.float())
        ok &= torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-2)
    return ok


@gpu_only
def test_gpu_cuda_graph_replay(ranks):
    assert all(ranks(2, _gpu_graph))


# ----------------------------------------------------------------------------------------------------- sm_90
_DISPATCH_SIG = dict(
    x="*bf16", topk_idx="*i32", topk_weights="*fp32", T="i32", H="i32", E="i32", align="i32", max_tokens="i32",
    max_rows="i32", n_chunks="i32", h_parts="i32", tail="i32", tail_parts="i32", n_push="i32", recv_x="*bf16",
    recv_slots="*i32",
    recv_w="*fp32", recv_span="*i32", all_counts="*i32", counts_ready="*i32", arrived="*i32",
    recv_expert_ids="*i32", recv_weights="*fp32", expert_counts="*i32", expert_offsets="*i32", token_pos="*i32",
    chunk_prefix="*i32", claims="*i32", state="*i32", ctx="*i64", timeline="*i64", K="constexpr",
    EL="constexpr", BT="constexpr", BH="constexpr", K_PAD="constexpr", EL_PAD="constexpr", W_PAD="constexpr",
    RB="constexpr", MAXC="constexpr", FUSED_LAYOUT="constexpr", TB="constexpr", CG="constexpr",
    SENDERS_HELP="constexpr", TIMELINE="constexpr", PDL="constexpr", DEFER_SIGNAL="constexpr", EVICT="constexpr")


@pytest.mark.parametrize("fused", [False, True])
def test_dispatch_compiles_for_sm90(fused):
    consts = dict(K=8, EL=32, BT=16 if not fused else 4, BH=512, K_PAD=8, EL_PAD=32, W_PAD=2, RB=128,
                  MAXC=1024, FUSED_LAYOUT=fused, TB=2, CG=16 if fused else 4, SENDERS_HELP=not fused,
                  TIMELINE=not fused, PDL=not fused,
                  DEFER_SIGNAL=fused,  # with and without helping senders, stamps, early launch, deferred flags
                  EVICT="evict_first" if fused else "")  # and with the L2 hints of stream_hints
    ops = compile_sm90("triton_dist.kernels.moe_ep", "ep_dispatch_kernel", _DISPATCH_SIG, consts,
                       aligned=("x", "recv_x", "H"))["ops"]
    assert ops.get("st.global.v4.b32", 0) > 0, ops  # 16-byte row stores (to peers, and local duplicates unhinted)
    if fused:  # local copies with an L2 evict_first policy; the pushes to peers stay plain
        assert any("evict_first" in k and k.startswith("st.global") and k.endswith("v4.b32") for k in ops), ops
        assert any("evict_first" in k and k.startswith("ld.global") for k in ops), ops
    assert ops.get("atom.global.sys.release.exch.b32", 0) > 0, ops  # dl.signal
    assert any("acquire" in k for k in ops), ops  # dl.wait
    assert ops.get("griddepcontrol.wait", 0) == (0 if fused else 1), ops  # dl.wait_prior_kernel


def test_layout_and_combine_compile_for_sm90():
    sig = dict(topk_idx="*i32", chunk_counts="*i32", chunk_prefix="*i32", counted="*i32", all_counts="*i32",
               counts_ready="*i32", state="*i32", T="i32", E="i32", n_chunks="i32", ctx="*i64", timeline="*i64",
               K="constexpr", EL="constexpr", TB="constexpr", K_PAD="constexpr", EL_PAD="constexpr",
               W_PAD="constexpr", CG="constexpr", QB="constexpr", TIMELINE="constexpr", PDL="constexpr")
    ops = compile_sm90("triton_dist.kernels.moe_ep", "ep_layout_kernel", sig,
                       dict(K=8, EL=32, TB=16, K_PAD=8, EL_PAD=32, W_PAD=2, CG=16, QB=16, TIMELINE=True,
                            PDL=True))["ops"]
    assert ops.get("griddepcontrol.launch_dependents", 0) == 1, ops  # dl.launch_dependents
    sig = dict(expert_out="*bf16", y="*bf16", T="i32", H="i32", max_tokens="i32", n_chunks="i32", h_parts="i32",
               tail="i32", tail_parts="i32", n_push="i32", recv_slots="*i32", recv_w="*fp32", recv_span="*i32", token_pos="*i32",
               partials="*bf16", combined="*i32", claims="*i32", state="*i32", ctx="*i64",
               timeline="*i64", K="constexpr", BT="constexpr", BH="constexpr", K_PAD="constexpr", W_PAD="constexpr",
               MAXC="constexpr", SENDERS_HELP="constexpr", TIMELINE="constexpr", DEFER_SIGNAL="constexpr",
               EVICT="constexpr")
    ops = compile_sm90("triton_dist.kernels.moe_ep", "ep_combine_kernel", sig,
                       dict(K=8, BT=16, BH=512, K_PAD=8, W_PAD=2, MAXC=1024, SENDERS_HELP=True, TIMELINE=False,
                            DEFER_SIGNAL=True, EVICT=""),
                       aligned=("expert_out", "y", "partials", "H"))["ops"]
    assert ops.get("ld.global.v4.b32", 0) > 0 and ops.get("st.global.v4.b32", 0) > 0, ops
