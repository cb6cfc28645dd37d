"""Recording for the multi-GPU benchmarks (run under torchrun); timing lives in ``triton_dist.timing``
(fixed iterations on every rank, CUDA events, median per rank, max over ranks). Ours and the baselines run in the
same process, one after another, on the same inputs.
"""

import datetime
import json
import os
import subprocess

import torch
import torch.distributed as dist


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


def record(name, rows, notes=""):
    """Rank 0 writes ``$BENCH_DIR/<name>.json`` (default benchmarks/results/raw) and prints a table."""
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
    cols = list(rows[0])
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
