"""Probe (1 GPU): (A) Triton reductions / scans over a size-1 axis, as _send_tokens does at W_PAD=1; (B) ep_dispatch
+ ep_combine at W=1, T=1000, with the rank axis padded to 1 (as shipped) and to 2."""
import json, os, sys
import torch, triton, triton.language as tl

BIG = tl.constexpr(2**30)


@triton.jit
def route_math(owner_p, slot_p, rpos_p, goes_p, first_p, BT: tl.constexpr, K_PAD: tl.constexpr, W_PAD: tl.constexpr):
    t = tl.arange(0, BT)
    kk = tl.arange(0, K_PAD)
    dv = tl.arange(0, W_PAD)
    owner = tl.load(owner_p + t[:, None] * K_PAD + kk[None, :])
    slot = tl.load(slot_p + t[:, None] * K_PAD + kk[None, :])
    at = owner[:, :, None] == dv[None, None, :]
    goes = tl.max(at.to(tl.int32), axis=1)
    rpos = tl.cumsum(goes, axis=0) - goes
    first = tl.min(tl.where(at, slot[:, :, None], BIG), axis=1)
    tl.store(rpos_p + t[:, None] * W_PAD + dv[None, :], rpos)
    tl.store(goes_p + t[:, None] * W_PAD + dv[None, :], goes)
    tl.store(first_p + t[:, None] * W_PAD + dv[None, :], first)


def probe_a():
    bad = []
    for W in (1, 2):
        for BT in (2, 4, 8, 16):
            for KP in (1, 2, 4, 8):
                for nw in (4, 8, 16):
                    owner = torch.randint(-1, 1, (BT, KP), device="cuda", dtype=torch.int32)
                    owner[0] = 0
                    slot = torch.randint(0, 1000, (BT, KP), device="cuda", dtype=torch.int32)
                    rpos, goes, first = (torch.full((BT, W), -7, device="cuda", dtype=torch.int32) for _ in range(3))
                    route_math[(1,)](owner, slot, rpos, goes, first, BT=BT, K_PAD=KP, W_PAD=W, num_warps=nw)
                    at = owner[:, :, None] == torch.arange(W, device="cuda")[None, None, :]
                    g = at.int().amax(1)
                    r = g.cumsum(0) - g
                    f = torch.where(at, slot[:, :, None], 2**30).amin(1)
                    ok = torch.equal(g, goes), torch.equal(r.int(), rpos), torch.equal(f.int(), first)
                    if not all(ok):
                        bad.append(dict(W=W, BT=BT, K_PAD=KP, warps=nw, goes=ok[0], rpos=ok[1], first=ok[2]))
    return bad


def probe_b(pad2):
    import triton_dist as td
    from triton_dist.kernels import ep_combine, ep_dispatch
    from triton_dist.kernels.moe_ep import buffers as B
    import types
    if pad2:
        B.triton = types.SimpleNamespace(next_power_of_2=lambda n: max(2, triton.next_power_of_2(n)), cdiv=triton.cdiv)
    out = {}
    dev = td.shmem.device()
    for T, K in ((512, 8), (513, 8), (1000, 8), (2048, 2), (4096, 1), (4096, 8)):
        H, E = 1024, 64
        g = torch.Generator(device=dev).manual_seed(T + K)
        x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
        idx = torch.rand(T, E, device=dev, generator=g).topk(K, dim=1).indices
        w = torch.rand(T, K, device=dev, generator=g)
        res = ep_dispatch(x, idx, w, num_experts=E, max_tokens=T)
        y = ep_combine(res.x, res.handle)
        ref = w.sum(1, keepdim=True) * x.float()
        wrong = ((y.float() - ref).abs() > 2e-2 * (1 + ref.abs())).any(1)
        out[f"T{T}K{K}"] = int(wrong.sum())
    return out


if __name__ == "__main__":
    res = {"A_bad": probe_a()}
    import triton_dist as td
    from triton_dist.launch import run_main
    td.init()
    res["B_pad1"] = probe_b(False)
    td.shmem.release_workspaces() if hasattr(td.shmem, "release_workspaces") else None
    res["B_pad2"] = probe_b(True)
    print(json.dumps(res, indent=1))
    if os.environ.get("OUT"):
        json.dump(res, open(os.path.join(os.environ["OUT"], "probe_w1.json"), "w"), indent=1)
