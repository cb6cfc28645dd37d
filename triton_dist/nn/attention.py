"""Decode attention with the KV cache split over ranks by sequence position: ``sp_flash_decode`` as a module.

One new query token per sequence attends to every cached token; with no causal mask at decode time the result
over the whole cache is a log-sum-exp merge of per-shard results, so each rank keeps only a slice of every
sequence's tokens and the op merges the ranks' partials on the device (no host sync, CUDA-graph capturable).

    DecodeAttention                   the dense module: the whole (paged) cache on one device, in torch
    SequenceParallelDecodeAttention   the same forward on this rank's slice of the cache (``shard_kv_cache``),
                                      every rank gets the full [B, Hq, D] output

Caches are ``[B, S, Hkv, D]`` (token t of sequence b at [b, t]) or paged ``[pages, page_size, Hkv, D]`` with a
``block_table`` [B, max_pages] (token t in page ``block_table[b, t // page_size]``, row ``t % page_size``).
GQA: Hq a multiple of Hkv, query head h reads KV head h // (Hq / Hkv).
"""

import math

import torch
from torch import nn

from .sharding import GroupOps


def _tokens(cache, b, n, block_table):
    """The first ``n`` cached tokens of sequence ``b`` as [n, Hkv, D]."""
    if block_table is None:
        return cache[b, :n]
    page = cache.shape[1]
    pages = block_table[b, :(n + page - 1) // page].long()
    return cache[pages].reshape(-1, *cache.shape[2:])[:n]


class DecodeAttention(nn.Module):
    """``softmax(q K^T * scale) V`` per sequence over its ``kv_lens[b]`` cached tokens (torch, one device; reads
    the lengths on the host). q [B, Hq, D] -> [B, Hq, D] in q's dtype; zeros for a sequence with no tokens."""

    def __init__(self, num_heads, num_kv_heads, head_dim, softmax_scale=None):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)

    def forward(self, q, k_cache, v_cache, kv_lens, block_table=None):
        out = torch.zeros_like(q)
        group = self.num_heads // self.num_kv_heads
        for b, n in enumerate(kv_lens.tolist()):
            if n <= 0:
                continue
            k = _tokens(k_cache, b, n, block_table).float().repeat_interleave(group, dim=1)  # [n, Hq, D]
            v = _tokens(v_cache, b, n, block_table).float().repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * self.softmax_scale
            out[b] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v).to(q.dtype)
        return out


class SequenceParallelDecodeAttention(DecodeAttention):
    """``DecodeAttention``'s forward on this rank's slice of every sequence's cache (``sp_flash_decode``):
    ``k_cache``/``v_cache``/``kv_lens``/``block_table`` are this rank's shard (e.g. from ``shard_kv_cache``),
    ``q`` the same on every rank; returns the attention over all ranks' tokens, on every rank. Collective."""

    def __init__(self, num_heads, num_kv_heads, head_dim, softmax_scale=None, *, group=None):
        super().__init__(num_heads, num_kv_heads, head_dim, softmax_scale)
        self.ops = GroupOps(group)

    @classmethod
    def from_dense(cls, module, group=None):
        """From a ``DecodeAttention`` (it has no weights: the heads and scale carry over)."""
        if not isinstance(module, DecodeAttention):
            raise TypeError(f"expected a DecodeAttention, got {type(module).__name__}")
        return cls(module.num_heads, module.num_kv_heads, module.head_dim, module.softmax_scale, group=group)

    def forward(self, q, k_cache, v_cache, kv_lens, block_table=None):
        if q.dim() != 3 or q.shape[1] != self.num_heads or q.shape[2] != self.head_dim:
            raise ValueError(f"q must be [B, {self.num_heads}, {self.head_dim}], got {list(q.shape)}")
        if k_cache.shape[-2] != self.num_kv_heads:
            raise ValueError(f"k_cache has {k_cache.shape[-2]} KV heads, the layer {self.num_kv_heads}")
        return self.ops.sp_flash_decode(q, k_cache, v_cache, kv_lens, block_table, self.softmax_scale)

    def shard_kv_cache(self, k_cache, v_cache, kv_lens, block_table=None, page_size=None):
        """This rank's slice of a full cache: of sequence b's ``kv_lens[b]`` tokens, the ``torch.tensor_split``
        share of rank r (positions do not matter to decode attention). Returns (k, v, lens, table): a paged
        shard with pages of ``page_size`` tokens (table None if page_size is None: a [B, S_local, Hkv, D] cache).
        Host-side set-up (reads the lengths)."""
        world, rank = self.ops.world, self.ops.rank
        lens = kv_lens.tolist()
        parts_k, parts_v, mine = [], [], []
        for b, n in enumerate(lens):
            start = rank * (n // world) + min(rank, n % world)
            count = n // world + (1 if rank < n % world else 0)
            k = _tokens(k_cache, b, start + count, block_table)[start:]
            v = _tokens(v_cache, b, start + count, block_table)[start:]
            parts_k.append(k)
            parts_v.append(v)
            mine.append(count)
        longest = max(mine + [1])
        heads, dim = k_cache.shape[-2:]
        new_lens = torch.tensor(mine, dtype=kv_lens.dtype, device=kv_lens.device)
        if page_size is None:
            k_out = k_cache.new_zeros((len(lens), longest, heads, dim))
            v_out = torch.zeros_like(k_out)
            for b, (k, v) in enumerate(zip(parts_k, parts_v)):
                k_out[b, :k.shape[0]], v_out[b, :v.shape[0]] = k, v
            return k_out, v_out, new_lens, None
        per_seq = (longest + page_size - 1) // page_size
        k_out = k_cache.new_zeros((len(lens) * per_seq, page_size, heads, dim))
        v_out = torch.zeros_like(k_out)
        # pages handed out in reverse so that a sequence's pages are not simply consecutive
        table = torch.arange(len(lens) * per_seq - 1, -1, -1, dtype=torch.int32, device=k_cache.device)
        table = table.view(len(lens), per_seq)
        for b, (k, v) in enumerate(zip(parts_k, parts_v)):
            for t0 in range(0, k.shape[0], page_size):
                p = int(table[b, t0 // page_size])
                k_out[p, :k[t0:t0 + page_size].shape[0]] = k[t0:t0 + page_size]
                v_out[p, :v[t0:t0 + page_size].shape[0]] = v[t0:t0 + page_size]
        return k_out, v_out, new_lens, table
