"""Summarise `ncu --page source --csv --print-source sass` exports (one per profiled launch): per launch, the
stall-sample columns' totals and the SASS lines holding the most samples, with their top stall reasons.

    python ncu_source_summary.py tensor.csv block.csv [TOP]
"""

import csv
import sys


def num(v):
    try:
        return float(str(v).replace(",", ""))
    except ValueError:
        return 0.0


def summarise(path, top):
    rows = list(csv.DictReader(open(path, newline="")))
    if not rows:
        print(f"== {path}: empty")
        return
    cols = [c for c in rows[0] if c]
    samples = next((c for c in cols if "Sampling (All" in c), None) or next(c for c in cols if "Sampl" in c)
    stalls = [c for c in cols if c.startswith("stall_") or "Stall" in c and c != samples and "Sampl" not in c]
    total = sum(num(r[samples]) for r in rows)
    print(f"== {path}: {len(rows)} SASS lines, {total:.0f} samples ({samples}); columns: {cols[:8]} ...")
    sums = sorted(((sum(num(r[c]) for r in rows), c) for c in stalls), reverse=True)
    print("   reasons: " + ", ".join(f"{c} {v / max(total, 1):.1%}" for v, c in sums[:12] if v))
    src = next((c for c in cols if c.lower() in ("source", "sass")), cols[1])
    addr = next((c for c in cols if "Address" in c), cols[0])
    for r in sorted(rows, key=lambda r: -num(r[samples]))[:top]:
        why = sorted(((num(r[c]), c) for c in stalls), reverse=True)[:3]
        print(f"   {r[addr]:>8} {num(r[samples]) / max(total, 1):6.2%}  {r[src][:70]:70}  "
              + ", ".join(f"{c} {v:.0f}" for v, c in why if v))


top = int(sys.argv[-1]) if sys.argv[-1].isdigit() else 40
for path in [p for p in sys.argv[1:] if not p.isdigit()]:
    summarise(path, top)
