"""Drop-in layers for real models, on triton_dist's overlapped ops, and ``parallelize`` for Hugging Face models.

    ColumnParallelLinear, RowParallelLinear, TensorParallelMLP   linear.py     ag_gemm / gemm_rs
    ExpertParallelMoE (Router: router.py)                        moe.py        ep_dispatch -> grouped GEMMs -> combine
    DecodeAttention, SequenceParallelDecodeAttention             attention.py  sp_flash_decode
    parallelize(model)                                           hf.py         swaps a transformers model's blocks
                                                                 (hf_blocks.py: which blocks, how they are read)

Every layer has ``from_dense(module, group=None)``, which loads this rank's shard from the unsharded module, and
the forward semantics of the module it replaces (``sequence_parallel=False``: full activations in and out on
every rank; ``True``: the native sharded rows, see ``sharding.py``). Call ``triton_dist.init()`` first. The
tensor-parallel layers, ``ExpertParallelMoE`` (its experts) and ``parallelize`` take ``fp8="tensor" | "row" |
"block"``: FP8 training, FP8 forward and high-precision gradients, or for the tensor-parallel layers with
``fp8_grads=True`` FP8 backward GEMMs too (``linear.py``, ``moe.py``); ``with fp8_weight_cache(): ...`` around
the micro-batches of one optimizer step quantises each weight once (``kernels/fp8.py``: ``weight_cache``).
"""

from ..kernels.fp8 import weight_cache as fp8_weight_cache  # noqa: F401
from .attention import DecodeAttention, SequenceParallelDecodeAttention  # noqa: F401
from .hf import parallelize  # noqa: F401
from .linear import ColumnParallelLinear, RowParallelLinear, TensorParallelMLP  # noqa: F401
from .moe import ExpertParallelMoE, Router  # noqa: F401

__all__ = ["ColumnParallelLinear", "DecodeAttention", "ExpertParallelMoE", "Router", "RowParallelLinear",
           "SequenceParallelDecodeAttention", "TensorParallelMLP", "fp8_weight_cache", "parallelize"]
