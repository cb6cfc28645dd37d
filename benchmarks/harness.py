"""Recording for the multi-GPU benchmarks (run under torchrun); timing lives in ``triton_dist.timing``
(fixed iterations on every rank, CUDA events, median per rank, max over ranks). Ours and the baselines run in the
same process on the same inputs, one after another or, where the GPU's power-state drift matters, in turn
(``in_turn``).
"""

import argparse
import contextlib
import cProfile
import datetime
import functools
import json
import os
import subprocess
import time

import torch
import torch.distributed as dist

from triton_dist.timing import check_timeable


def run_check(check, what):
    """``check()`` (the labels it checked, the problems it found) on this rank: an AssertionError naming the
    problems, else rank 0 says what agreed."""
    import triton_dist as td

    checked, problems = check()
    assert not problems, f"rank {td.rank()}: {problems}"
    if td.rank() == 0:
        print(f"[{td.shmem.device().type} x{td.world_size()}] {what} contenders agree ({len(checked)} checked): "
              f"{', '.join(checked)}")


def start(doc, check, what, heap_size, add_arguments=None):
    """A benchmark's command line and start: ``--check`` (its contenders against each other at tiny fp32 sizes:
    ``run_check(check, what)`` on every rank; also what runs with no GPU, on CPU ranks) and ``--rounds`` (in-turn
    rounds), plus what ``add_arguments(parser)`` adds. With a GPU and no ``--check``: this process is a rank, on its
    GPU and initialised with ``heap_size``; returns the parsed arguments. Otherwise runs the check and returns
    None."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check the contenders at tiny fp32 sizes")
    parser.add_argument("--rounds", type=int, default=5, help="in-turn rounds")
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args()
    if args.check or not torch.cuda.is_available():
        from triton_dist.launch import run_main

        run_main(functools.partial(run_check, check, what))
        return None
    import triton_dist as td

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    td.init(backend="cuda", heap_size=heap_size)
    return args


def environment():
    try:
        commit = os.environ.get("GIT_COMMIT") or subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"], stderr=subprocess.DEVNULL, text=True).strip()
    except Exception:
        commit = "unknown"
    import triton

    return {
        "gpu": torch.cuda.get_device_name(),
        "world_size": dist.get_world_size(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "torch": torch.__version__,
        "triton": triton.__version__,
    }


def host_us(fn, calls=50, profile=None):
    """Host µs per call of ``fn`` while the GPU is busy (a sleep kernel queued ahead of each batch, so the host
    never waits for the device): median of 5 batches of ``calls`` calls, max over ranks. With ``profile`` (a
    list), a cProfile of the last batch is appended to it."""
    check_timeable()
    fn()
    torch.cuda.synchronize()
    dist.barrier()
    batches = []
    for b in range(5):
        torch.cuda._sleep(int(1.5e6 * calls * 0.4))  # ~0.4 ms of GPU work per call ahead of the calls
        prof = cProfile.Profile() if (profile is not None and b == 4) else None
        if prof:
            prof.enable()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        batches.append((time.perf_counter() - t0) / calls * 1e6)
        if prof:
            prof.disable()
            profile.append(prof)
        torch.cuda.synchronize()
        dist.barrier()
    batches.sort()
    t = torch.tensor([batches[len(batches) // 2]], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def kernel_table(fn, top=15):
    """The device kernels of one call of ``fn`` (after a warm-up call), most device time first: torch.profiler's
    table of its ``top`` kernels (this rank). Says where a step's time goes (GEMMs, quantisers, copies)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    for key in ("self_device_time_total", "self_cuda_time_total"):  # (torch's name for it changed)
        try:
            return events.table(sort_by=key, row_limit=top, max_name_column_width=90)
        except (AttributeError, KeyError, ValueError):
            continue
    return events.table(row_limit=top)


def knob_sweep(run, base, sweep, device):
    """``{label: µs}`` of ``run(config)`` for ``base`` with each ``(label, knobs)`` of ``sweep`` applied, one after
    another (median of 10, max over ranks; NaN if a variant fails). A negative ``num_programs`` means that many
    fewer than SMs."""
    return interleaved_ab(run, base, sweep, device, rounds=1, what="sweep")


def interleaved_ab(run, base, variants, device, rounds=5, what="A/B"):
    """``{label: µs}`` like ``knob_sweep``, but the variants are timed in turn (``in_turn``): a GPU at its
    power limit drifts by several percent within a run, which a one-after-another sweep mistakes for
    differences between configs."""
    from triton_dist.kernels.gemm import default_num_programs

    calls = {}
    for label, knobs in variants:
        cfg = {**base, **knobs}
        if cfg.get("num_programs") is not None and cfg["num_programs"] < 0:
            cfg["num_programs"] = default_num_programs(device) + cfg["num_programs"]
        calls[label] = functools.partial(run, cfg)
    return in_turn(calls, rounds, what)


def in_turn_note(rounds=5):
    """How ``in_turn`` timed a table, for its notes."""
    return (f"timed in turn: median of {rounds} rounds (10 iterations in the first, then enough to span ~50 ms, "
            "at most 100) after ~50 ms of warm-up, each round starting at another contender and in another order")


IN_TURN = in_turn_note()


def in_turn(calls, rounds=5, what="in turn"):
    """``{label: µs}`` of ``calls`` ({label: fn}) timed in turn as the autotuner times candidates
    (``autotune.in_turn``): ``rounds`` times over after ~50 ms of warm-up each (10 iterations in a contender's
    first round, later ones enough to span ``autotune.SPAN_US``: a power-capped GPU's slow spells last ~0.1 s;
    counted from the first round's figure, the max over ranks, so the same counts on every rank), each round
    starting at a different contender and in a different order, each keeping the median of its rounds: every
    contender sees the same mix of the GPU's power states and none always runs right after the same one (a GEMM
    after a communication-bound call starts with power headroom: run57, run66). NaN for one that fails."""
    from triton_dist import autotune
    from triton_dist.timing import time_us_or_nan

    labels = list(calls)
    medians = autotune.in_turn(len(labels), rounds, autotune.spanning(lambda i, iters: time_us_or_nan(
        calls[labels[i]], f"{what} {labels[i]}", iters=iters, warmup=2, warmup_us=autotune.WARMUP_US), 10))
    return dict(zip(labels, medians))


def head_to_head(ours, baselines, others=None, rounds=5):
    """Table columns for ``ours`` against ``baselines`` ({label: fn}), all timed in turn (``in_turn``) with
    ``others`` (e.g. the GEMM alone, no ratio): ``in turn: <label> us`` for each and ``in turn vs <baseline>``
    (baseline µs / ours µs: above 1, ours is faster)."""
    turn = in_turn({"ours": ours, **baselines, **(others or {})}, rounds)
    return {**{f"in turn: {label} us": v for label, v in turn.items()},
            **{f"in turn vs {label}": turn[label] / turn["ours"] for label in baselines}}


def clocks_during(fn, iters=40):
    """Run ``fn`` ``iters`` times back to back while NVML samples this GPU every ~2 ms: median SM clock (MHz),
    mean board power (W) and the clock-throttle reasons seen (NVML bit names), this rank only; also µs per call
    (CUDA events around the calls) and J per call (the board's energy counter). Tells a power-capped kernel
    (clock below the maximum, "sw_power_cap") from a slow one."""
    import threading

    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    reasons = {"sw_power_cap": 0x4, "hw_slowdown": 0x8, "sw_thermal": 0x20, "hw_thermal": 0x40,
               "hw_power_brake": 0x80}
    clocks, power, seen, stop = [], [], set(), threading.Event()

    def sample():
        while not stop.is_set():
            clocks.append(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM))
            power.append(pynvml.nvmlDeviceGetPowerUsage(handle) / 1000)
            bits = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons",
                           getattr(pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None))(handle)
            seen.update(name for name, bit in reasons.items() if bits & bit)
            time.sleep(0.002)

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    thread = threading.Thread(target=sample)
    millijoules = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    thread.start()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    millijoules = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) - millijoules
    stop.set()
    thread.join()
    clocks.sort()
    return {"MHz": clocks[len(clocks) // 2] if clocks else float("nan"),
            "W": sum(power) / len(power) if power else float("nan"), "throttle": ",".join(sorted(seen)) or "-",
            "us": start.elapsed_time(end) * 1e3 / iters, "J": millijoules / 1e3 / iters}


@contextlib.contextmanager
def recorded_paths():
    """The path of every ag_gemm / gemm_rs call made inside, in order ("ag_gemm overlap", "gemm_rs fallback", ...):
    what a benchmark row says it timed (a fallback row is not ours)."""
    from triton_dist.kernels import allgather_gemm, gemm_reducescatter

    seen, run, configs = [], allgather_gemm._run, gemm_reducescatter._CONFIGS

    def ag_run(a, w, plan, *rest):
        seen.append(f"ag_gemm {plan.path}")
        return run(a, w, plan, *rest)

    def rs_config(key, build):
        cfg = type(configs).get(configs, key, build)
        seen.append(f"gemm_rs {cfg['path']}")
        return cfg

    allgather_gemm._run, configs.get = ag_run, rs_config
    try:
        yield seen
    finally:
        allgather_gemm._run = run
        del configs.get


def path_of(call):
    """The paths one ``call()`` ran ("ag_gemm overlap > gemm_rs overlap"; "-": no ag_gemm / gemm_rs call)."""
    with recorded_paths() as seen:
        call()
    return " > ".join(seen) or "-"


def record(name, rows, notes=""):
    """Rank 0 writes ``$BENCH_DIR/<name>.json`` (default benchmarks/results/raw) and prints a table."""
    check_timeable()  # rows timed where ranks share a GPU are not figures
    if dist.get_rank() != 0:
        return
    out_dir = os.environ.get("BENCH_DIR", os.path.join(os.path.dirname(__file__), "results", "raw"))
    os.makedirs(out_dir, exist_ok=True)
    doc = {"benchmark": name, **environment(), "notes": notes, "rows": rows}
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(format_table(doc), flush=True)


def format_table(doc):
    rows = doc["rows"]
    if not rows:
        return f"## {doc['benchmark']}: no rows"
    cols = list(dict.fromkeys(c for r in rows for c in r))  # every row's columns, in order of appearance
    lines = [f"## {doc['benchmark']} — {doc['gpu']} x{doc['world_size']}, {doc['date']}, commit {doc['commit']}",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |")
    if doc.get("notes"):
        lines.append(doc["notes"])
    return "\n".join(lines)


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)
