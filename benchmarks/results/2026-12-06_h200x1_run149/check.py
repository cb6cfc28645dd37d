"""Compile-check ws_probe.ws_fp8_gemm_kernel for sm_90a without a GPU: per mode, registers / spills (ptxas -v,
the ptxas Triton uses) and ptxas's wgmma-serialization notes (C751x), through scripts/ptx_digest.py.

    . /tmp/venv/bin/activate
    python benchmarks/results/2026-12-06_h200x1_run149/check.py                      # triton 3.9
    PYTHONPATH=/tmp/t36 python benchmarks/results/2026-12-06_h200x1_run149/check.py  # triton 3.6 (the GPU image's)
    ... check.py --warps 4 8 --stages 5 --blocks 0 1 --ptx DIR            # subsets; DIR: keep the PTX

Exit status 1 if a variant does not compile or ptxas serialized a wgmma.
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path[:0] = [HERE, os.path.join(ROOT, "scripts"), ROOT]

import ptx_digest as P  # noqa: E402  (sets TRITON_INTERPRET=0 before triton_dist is imported)
import triton  # noqa: E402

import ws_probe  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402


def sass_summary(ptx):
    """The PTX assembled (Triton's ptxas for sm_90) and disassembled: the highest register a thread uses (the
    launch count ptxas -v reports is .maxnreg: setmaxnreg moves registers between the partitions), the wgmmas
    (QGMMA: e4m3) and the setmaxnreg values."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        subprocess.run([get_ptxas(90).path, "-arch=sm_90a", src, "-o", cubin], check=True, capture_output=True)
        sass = subprocess.run([nvdisasm, "-c", cubin], check=True, capture_output=True, text=True).stdout
    top = max(int(r) for r in re.findall(r"\bR(\d+)\b", sass))
    gmma = len(re.findall(r"\bQGMMA\.", sass))
    regs = sorted({int(v) for v in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)})
    return f"SASS: highest register R{top}, {gmma} QGMMA, setmaxnreg values {regs}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--warps", type=int, nargs="*", default=[4])
    parser.add_argument("--stages", type=int, default=5)
    parser.add_argument("--blocks", type=int, nargs="*", default=[0, 1])
    parser.add_argument("--ptx", help="write each variant's PTX into this folder")
    args = parser.parse_args()
    assert ws_probe._signature_matches(), "parameters differ from gemm_fp8_sm90_kernel's"
    bad = 0
    for warps in args.warps:
        for blocks in args.blocks:
            name = f"triton {triton.__version__} num_warps={warps} BLOCK_SCALES={bool(blocks)} STAGES={args.stages}"
            consts = dict(BLOCK_SCALES=bool(blocks), GROUP_M=8, STAGES=args.stages, EVEN_K_STEPS=False,
                          num_warps=warps)
            try:
                sig, consts = P.with_defaults(ws_probe.ws_fp8_gemm_kernel, P.sm90_gemm_signature(), consts)
                compiled = triton.compile(P.ast_source(ws_probe.ws_fp8_gemm_kernel, sig, consts, {}),
                                          target=GPUTarget("cuda", 90, 32),
                                          options={"num_warps": warps, "maxnreg": ws_probe.MAXNREG})
                ptx = compiled.asm["ptx"]
            except Exception as exc:  # noqa: BLE001
                print(f"{name}: does not compile: {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
                bad += 1
                continue
            if args.ptx:
                os.makedirs(args.ptx, exist_ok=True)
                with open(os.path.join(args.ptx, f"ws_w{warps}_b{blocks}_s{args.stages}.ptx"), "w") as f:
                    f.write(ptx)
            log = P.ptxas_log(ptx)
            notes = P.wgmma_serialized(log)
            print(f"{name}: {P.registers(ptx)}; C751x notes: {notes or 'none'}; shared "
                  f"{compiled.metadata.shared} B; {sass_summary(ptx)}", flush=True)
            other = [line.strip() for line in log.splitlines() if "warning" in line.lower() or "error" in line.lower()]
            if other:
                print("  ptxas:", *other, sep="\n    ")
            bad += bool(notes)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
