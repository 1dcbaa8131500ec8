"""Paged attention over packed variable-length batches, in plain PyTorch (CPU and CUDA alike).

A step packs the tokens of every scheduled request into one row each: decode tokens first, then the
prefill chunks. Each layer writes its new K/V into the paged cache through ``slot_mapping``, then reads
every request's context back through its block table. Decodes attend as one [B, 1] batch; prefill chunks
as one padded [B, max_q] batch with a causal mask offset by what each request had already computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from roseinfer.kernels import cpu_kernels


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each packed token
    positions: torch.Tensor  # [T] position of each token in its sequence
    seq_of_token: torch.Tensor  # [T] index of each token's sequence in block_tables
    block_tables: torch.Tensor  # [S, nb] block ids of every scheduled sequence, padded with 0
    use_kernels: bool
    num_decode: int
    num_prefill_tokens: int
    # Only for the PyTorch path (the C kernel reads block_tables directly):
    decode_block_tables: torch.Tensor | None = None  # [Bd, nb] block ids, padded with 0
    decode_bias: torch.Tensor | None = None  # [Bd, 1, 1, nb * block_size] float32: 0 for keys it sees, -inf else
    prefill_block_tables: torch.Tensor | None = None  # [Bp, nb]
    prefill_mask: torch.Tensor | None = None  # [Bp, 1, max_q, nb * block_size]
    prefill_rows: torch.Tensor | None = None  # [num_prefill_tokens] row of each prefill token in [Bp * max_q]
    prefill_max_q: int = 0

    @classmethod
    def build(
        cls,
        block_size: int,
        decode_ctx: list[tuple[list[int], int]],
        prefill_ctx: list[tuple[list[int], int, int]],
        slot_mapping: list[int],
        positions: torch.Tensor,
        use_kernels: bool,
    ) -> AttentionMetadata:
        """``decode_ctx``: (block table, context length) per decode; ``prefill_ctx``: (block table,
        tokens computed before this step, tokens in this chunk) per prefill."""
        device = positions.device

        def pad_tables(tables: list[list[int]]) -> torch.Tensor:
            width = max(len(t) for t in tables)
            return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=device)

        counts = [1] * len(decode_ctx) + [q for _, _, q in prefill_ctx]
        seq_of_token = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts)).to(device)
        all_tables = pad_tables([t for t, _ in decode_ctx] + [t for t, _, _ in prefill_ctx])
        slots = torch.tensor(slot_mapping, dtype=torch.long, device=device)
        common = dict(slot_mapping=slots, positions=positions, seq_of_token=seq_of_token, block_tables=all_tables)
        num_prefill_tokens = sum(counts) - len(decode_ctx)
        if use_kernels:
            return cls(**common, use_kernels=True, num_decode=len(decode_ctx), num_prefill_tokens=num_prefill_tokens)

        decode_tables = decode_bias = None
        if decode_ctx:
            decode_tables = pad_tables([t for t, _ in decode_ctx])
            ctx = torch.tensor([n for _, n in decode_ctx], device=device)
            keys = torch.arange(decode_tables.shape[1] * block_size, device=device)
            hidden = keys[None, :] >= ctx[:, None]
            decode_bias = torch.zeros(hidden.shape, device=device).masked_fill_(hidden, float("-inf"))[:, None, None]

        prefill_tables = prefill_mask = prefill_rows = None
        max_q = 0
        if prefill_ctx:
            prefill_tables = pad_tables([t for t, _, _ in prefill_ctx])
            q_lens = [q for _, _, q in prefill_ctx]
            max_q = max(q_lens)
            start = torch.tensor([c for _, c, _ in prefill_ctx], device=device)
            q_len_t = torch.tensor(q_lens, device=device)
            keys = torch.arange(prefill_tables.shape[1] * block_size, device=device)
            q_idx = torch.arange(max_q, device=device)
            # Padded query rows still see key 0, so their (discarded) softmax never divides by zero.
            last_key = start[:, None] + torch.minimum(q_idx[None, :], q_len_t[:, None] - 1)
            prefill_mask = (keys[None, None, :] <= last_key[:, :, None])[:, None]
            prefill_rows = torch.cat([torch.arange(q, device=device) + i * max_q for i, q in enumerate(q_lens)])

        return cls(
            **common,
            use_kernels=False,
            num_decode=len(decode_ctx),
            num_prefill_tokens=num_prefill_tokens,
            decode_block_tables=decode_tables,
            decode_bias=decode_bias,
            prefill_block_tables=prefill_tables,
            prefill_mask=prefill_mask,
            prefill_rows=prefill_rows,
            prefill_max_q=max_q,
        )


def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bs, Hkv, D] cache, [B, nb] tables -> [B, nb * bs, Hkv, D] contexts."""
    b, nb = tables.shape
    return cache[tables].view(b, nb * cache.shape[1], cache.shape[2], cache.shape[3])


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]. Returns [T, H, D]."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if meta.use_kernels:
        if not kernels_fit(q, k, v):
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return _kernel_attention(q, k, v, k_cache, v_cache, meta, scale)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    nd = meta.num_decode
    if meta.num_prefill_tokens == 0:
        return _decode(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = _decode(q[:nd], k_cache, v_cache, meta, scale)
    bp = meta.prefill_block_tables.shape[0]
    padded = q.new_zeros(bp * meta.prefill_max_q, q.shape[1], q.shape[2])
    padded[meta.prefill_rows] = q[nd:]
    padded = padded.view(bp, meta.prefill_max_q, q.shape[1], q.shape[2]).transpose(1, 2)
    o = F.scaled_dot_product_attention(
        padded,
        _gather(k_cache, meta.prefill_block_tables).transpose(1, 2),
        _gather(v_cache, meta.prefill_block_tables).transpose(1, 2),
        attn_mask=meta.prefill_mask,
        scale=scale,
        enable_gqa=q.shape[1] != num_kv_heads,
    )
    out[nd:] = o.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2])[meta.prefill_rows]
    return out


def _kernel_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    lib = cpu_kernels()
    t, num_heads, head_dim = q.shape
    out = q.new_empty(t, num_heads, head_dim)
    lib.paged_attention(
        q.data_ptr(),
        q.stride(0),
        k.data_ptr(),
        v.data_ptr(),
        k.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        meta.slot_mapping.data_ptr(),
        meta.positions.data_ptr(),
        meta.seq_of_token.data_ptr(),
        meta.block_tables.data_ptr(),
        meta.block_tables.shape[1],
        out.data_ptr(),
        t,
        num_heads,
        v_cache.shape[2],
        head_dim,
        v_cache.shape[1],
        scale,
        int(q.dtype == torch.bfloat16),
    )
    return out


def kernels_fit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the C kernel can read these views: rows strided alike, heads and dims packed."""
    return all(x.stride(2) == 1 and x.stride(1) == x.shape[2] for x in (q, k, v)) and k.stride(0) == v.stride(0)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float):
    """One query per request: two small batched matmuls beat SDPA's kernels, built for long queries."""
    b, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    k = _gather(k_cache, meta.decode_block_tables).permute(0, 2, 3, 1)  # [B, Hkv, D, L]
    v = _gather(v_cache, meta.decode_block_tables).transpose(1, 2)  # [B, Hkv, L, D]
    # Query heads that share a K/V head sit next to each other: [B, Hkv, group, D].
    scores = torch.matmul(q.view(b, num_kv_heads, num_heads // num_kv_heads, head_dim), k)
    probs = torch.softmax(scores.float() * scale + meta.decode_bias, dim=-1).to(q.dtype)
    return torch.matmul(probs, v).view(b, num_heads, head_dim)
