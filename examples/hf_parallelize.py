"""Template: parallelise a Hugging Face model with ``triton_dist.nn.parallelize`` and check it against the original.

    torchrun --nproc-per-node=2 examples/hf_parallelize.py   # GPUs: check in fp32, then time a bf16 model
    python examples/hf_parallelize.py                        # no GPU: 2 ranks on CPU (Triton interpreter), fp32

A small randomly initialised Qwen2-MoE model (the config is built here, nothing is downloaded): layer 0 has a dense
gated MLP, the others a sparse-MoE block with a gated shared expert. Every rank builds the same model, keeps a copy,
and parallelises the other: the MLPs become ``TensorParallelMLP`` (ag_gemm with the fused SiLU gate -> gemm_rs),
the MoE blocks ``ExpertParallelMoE`` (ep_dispatch -> grouped GEMMs -> ep_combine). Attention, norms and embeddings
stay replicated, so every rank computes the full logits, which must match the copy's.
"""

import copy

import torch

import triton_dist as td
from triton_dist.launch import run_main


def make_model(hidden, layers, experts, inter, moe_inter, dtype, device, seed=0):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(vocab_size=256, hidden_size=hidden, intermediate_size=inter, moe_intermediate_size=moe_inter,
                         shared_expert_intermediate_size=moe_inter * 2, num_experts=experts, num_experts_per_tok=2
                         if experts < 16 else 8, num_hidden_layers=layers, num_attention_heads=max(2, hidden // 128),
                         num_key_value_heads=max(1, hidden // 512), mlp_only_layers=[0], max_position_embeddings=8192)
    torch.manual_seed(seed)  # the same weights on every rank (the same seed gives the same numbers on every GPU)
    with torch.device(device):  # built and initialised where it runs: the bf16 model has 2 B parameters
        model = Qwen2MoeForCausalLM(cfg)
    with torch.no_grad():  # O(1) activations (the default init, std 0.02, would make every block's output ~0)
        for p in model.parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if p.dim() == 1 else torch.randn_like(p) / p.shape[-1] ** 0.5)
    return model.to(dtype=dtype).eval()


def check(device, tokens):
    """fp32: the parallelised model's logits against the original's on every rank."""
    from triton_dist.nn import parallelize

    model = make_model(32, 2, 4 * td.world_size(), 32, 16, torch.float32, device)
    ref = copy.deepcopy(model)
    parallelize(model)
    ids = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        logits, want = model(ids).logits, ref(ids).logits
    err = ((logits - want).abs().max() / want.abs().max()).item()
    assert err < 1e-4, f"rank {td.rank()}: logits off by {err:.3g} (relative)"
    swapped = sorted({type(m).__name__ for m in model.modules() if type(m).__module__.startswith("triton_dist")})
    return err, swapped


def main():
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise SystemExit("examples/hf_parallelize.py needs transformers (pip install transformers)")
    world, rank = td.world_size(), td.rank()
    dev = td.shmem.device()
    err, swapped = check(dev, 7)
    if dev.type != "cuda":
        if rank == 0:
            print(f"[cpu x{world}] parallelize(Qwen2-MoE, 2 layers): {', '.join(swapped)}; logits match the "
                  f"original model (relative error {err:.2g})")
        return

    from triton_dist.nn import parallelize
    from triton_dist.timing import time_us, timeable

    tokens = 4096
    model = make_model(2048, 4, 64, 8192, 1408, torch.bfloat16, dev)
    ref = copy.deepcopy(model)
    parallelize(model, max_tokens=tokens // world)
    ids = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(2)).to(dev)
    with torch.no_grad():
        logits, want = model(ids).logits.float(), ref(ids).logits.float()
        diff = ((logits - want).abs().mean() / want.abs().mean()).item()  # bf16: routing near-ties may flip
    assert torch.isfinite(logits).all() and diff < 0.1, f"rank {rank}: bf16 logits differ by {diff:.3g} (mean)"
    if not timeable():  # ranks sharing one GPU: checked, not timed
        if rank == 0:
            print(f"[{td.shmem.backend()} x{world}] parallelize(Qwen2-MoE 4 layers): fp32 check error {err:.2g}; "
                  f"bf16 mean logit difference {diff:.2g}")
        return
    with torch.no_grad():
        t_ours, t_ref = time_us(lambda: model(ids)), time_us(lambda: ref(ids))
    if rank == 0:
        print(f"[{td.shmem.backend()} x{world}] parallelize(Qwen2-MoE 4 layers, hidden 2048, 64 experts top-8), "
              f"{tokens} tokens bf16: fp32 check error {err:.2g}; bf16 mean logit difference {diff:.2g}; forward "
              f"{t_ours:.0f} us vs {t_ref:.0f} us for the original model on one GPU ({t_ref / t_ours:.2f}x)")


if __name__ == "__main__":
    run_main(main, heap_size=8 << 30)  # torchrun: this process is a rank; no GPU: two CPU ranks
