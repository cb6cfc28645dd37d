"""run110's quantiser probe (one H200): ``fp8.quantize_fp8`` (the Triton kernels) against ``fp8.quantize`` (torch)
on the GPU, bitwise, for every scaling and a few shapes; run109's GPU tier found the FP8 layers in "row" mode
further from the reference than torch (the kernels had only run under the interpreter).
    python quant_probe.py OUT_DIR"""
import json
import sys

import torch

from triton_dist.kernels import fp8

SHAPES = [(517, 1024), (1536, 1024), (517, 2816), (4, 1024), (3, 1000), (256, 4096), (33, 129)]


def main(out_dir):
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for t, h in SHAPES:
            x = (torch.randn(t, h, device="cuda", generator=gen) * 3).to(dtype)
            for scaling in ("group", "row", "block", "tensor"):
                q, s = fp8.quantize_fp8(x, scaling)
                qr, sr = fp8.quantize(x, scaling)
                torch.cuda.synchronize()
                qd = (q.view(torch.uint8) != qr.view(torch.uint8))
                sd = (s != sr)
                row = dict(dtype=str(dtype), t=t, h=h, scaling=scaling, q_diff=int(qd.sum()), s_diff=int(sd.sum()),
                           s_maxrel=float(((s - sr).abs() / sr).max()))
                if row["q_diff"]:
                    i = qd.nonzero()[0].tolist()
                    row["first"] = dict(at=i, x=float(x[i[0], i[1]]), q=float(q[i[0], i[1]].float()),
                                        qr=float(qr[i[0], i[1]].float()))
                rows.append(row)
                print(row, flush=True)
    json.dump(rows, open(f"{out_dir}/quant_probe.json", "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
