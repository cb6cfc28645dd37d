"""run123's whole-model profile (one H200, W = 1): bench_layers' llama case (LlamaForCausalLM, hidden 2048,
intermediate 5632, 2 layers, 4 x 1024 tokens, bf16), the parallelised copy against the original; torch.profiler
(CPU and CUDA), 5 forwards each after 3 warm-up forwards: CUDA kernels by total time, and the wall time of a
forward with and without a synchronisation after each (host-bound or device-bound).
    torchrun --nproc-per-node=1 llama_profile.py OUT_DIR"""
import os
import sys
import time

import torch

import triton_dist as td

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def main(out_dir):
    torch.cuda.set_device(0)
    td.init(backend="cuda", heap_size=8 << 30)
    from bench_layers import FULL, model_contenders

    calls, _ = model_contenders(FULL["llama"], 4096, torch.bfloat16, td.shmem.device())
    report = []
    with torch.no_grad():
        for name in ("HF", "ours replicated", "HF", "ours replicated"):
            fwd = calls[name]
            for _ in range(3):
                fwd()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                fwd()
            torch.cuda.synchronize()
            queued = (time.perf_counter() - t0) / 20 * 1e6
            t0 = time.perf_counter()
            for _ in range(20):
                fwd()
            host = (time.perf_counter() - t0) / 20 * 1e6  # the host's time to issue a forward (GPU still busy)
            torch.cuda.synchronize()
            report.append(f"{name}: {queued:.0f} us a forward back to back; issuing one takes the host {host:.0f} us")
        for name in ("HF", "ours replicated"):
            fwd = calls[name]
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fwd()
                torch.cuda.synchronize()
            averages = prof.key_averages()
            report.append(f"== {name}, by CUDA time\n" + averages.table(sort_by="cuda_time_total", row_limit=25,
                                                                         max_name_column_width=80))
            report.append(f"== {name}, by own CPU time\n" + averages.table(sort_by="self_cpu_time_total",
                                                                            row_limit=25, max_name_column_width=80))
    text = "\n".join(report)
    print(text[:3000])
    open(f"{out_dir}/llama_profile.txt", "w").write(text)
    td.finalize()


if __name__ == "__main__":
    main(sys.argv[1])
