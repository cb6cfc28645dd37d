"""Probe for the several-ranks-on-one-GPU backend (issue 33): W processes on one GPU under MPS.
Per rank: SM count seen under CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, a heap shared by CUDA IPC handles exchanged
through a gloo group (torch's reduce_tensor / rebuild), which gloo collectives take CUDA tensors, and whether a
grid of one program per reported SM, every program waiting on its twin of every peer, completes (co-residency)."""
import json, os, sys, time, traceback
import multiprocessing as mp


def rank_main(rank, world, port, pct, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if pct:
        os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(pct)
    import torch, torch.distributed as dist, triton, triton.language as tl
    from torch.multiprocessing.reductions import reduce_tensor
    out = {"rank": rank}
    try:
        torch.cuda.set_device(0)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        out["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
        heap = torch.zeros(64 << 20, dtype=torch.uint8, device="cuda")
        fn, args = reduce_tensor(heap)
        handles = [None] * world
        dist.all_gather_object(handles, args)
        peers = [heap if r == rank else fn(*handles[r]) for r in range(world)]
        heap[:16].fill_(rank + 1)
        torch.cuda.synchronize(); dist.barrier()
        out["ipc_read"] = [int(p[:16].float().mean()) for p in peers]
        out["ptrs_distinct"] = len({p.data_ptr() for p in peers}) == world
        ok = {}
        x = torch.full((4, 8), float(rank), device="cuda")
        for name, call in [
            ("all_reduce", lambda: dist.all_reduce(x.clone())),
            ("broadcast", lambda: dist.broadcast(x.clone(), 0)),
            ("all_gather", lambda: dist.all_gather([torch.empty_like(x) for _ in range(world)], x)),
            ("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(torch.empty(4 * world, 8, device="cuda"), x)),
            ("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(torch.empty(4 // world or 1, 8, device="cuda"), torch.ones(4 // world * world or world, 8, device="cuda"))),
            ("all_to_all_single", lambda: dist.all_to_all_single(torch.empty(4 * world, 8, device="cuda"), torch.ones(4 * world, 8, device="cuda"))),
        ]:
            try:
                call(); torch.cuda.synchronize(); ok[name] = "ok"
            except Exception as e:
                ok[name] = f"{type(e).__name__}: {str(e)[:120]}"
            dist.barrier()
        out["gloo_cuda"] = ok

        @triton.jit
        def twin_wait(base_ptrs, me, W: tl.constexpr, budget):
            pid = tl.program_id(0)
            own = tl.load(base_ptrs + me).to(tl.pointer_type(tl.int32))
            for r in range(W):
                peer = tl.load(base_ptrs + r).to(tl.pointer_type(tl.int32))
                tl.atomic_xchg(peer + pid * W + me, 1, sem="release", scope="sys")
            for r in range(W):
                n = 0
                v = tl.atomic_add(own + pid * W + r, 0, sem="acquire", scope="sys")
                while (v == 0) & (n < budget):
                    v = tl.atomic_add(own + pid * W + r, 0, sem="acquire", scope="sys")
                    n += 1
                if n >= budget:
                    tl.atomic_add(own + 1000000, 1)

        flags = [p[1 << 20:].view(torch.int32) for p in peers]
        bases = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64, device="cuda")
        for grid_name, grid in [("sms", out["sms"]), ("sms_x2", 2 * out["sms"])]:
            flags[rank][:1000001 + 8].zero_(); torch.cuda.synchronize(); dist.barrier()
            t0 = time.perf_counter()
            twin_wait[(grid,)](bases, rank, world, 20_000_000)
            torch.cuda.synchronize()
            out[f"twin_wait_{grid_name}"] = {"timeouts": int(flags[rank][1000000]), "s": round(time.perf_counter() - t0, 4)}
            dist.barrier()
        # ping-pong latency: 200 rounds of rank 0 -> rank 1 -> rank 0
        del peers
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        out["error"] = traceback.format_exc()[-1500:]
    q.put(out)


def run(world, pct):
    import socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    ctx = mp.get_context("spawn"); q = ctx.Queue()
    ps = [ctx.Process(target=rank_main, args=(r, world, port, pct, q)) for r in range(world)]
    [p.start() for p in ps]
    res = []
    for _ in ps:
        try:
            res.append(q.get(timeout=240))
        except Exception:
            res.append({"error": "no answer in 240 s"})
    [p.kill() for p in ps]
    return sorted(res, key=lambda r: r.get("rank", 99))


if __name__ == "__main__":
    report = {}
    for world, pct in [(2, 50), (4, 25), (2, 0)]:
        report[f"W{world}_pct{pct}"] = run(world, pct)
        print(json.dumps(report[f"W{world}_pct{pct}"]), flush=True)
    json.dump(report, open(os.path.join(os.environ.get("OUT", "."), "probe_shared_gpu.json"), "w"), indent=1)
