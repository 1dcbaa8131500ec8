"""Paged attention in plain PyTorch (CPU and CUDA alike).

Decodes attend as one [B, 1] batch through two batched matmuls; prefill chunks as one padded [B, max_q]
batch through SDPA, with a causal mask offset by what each request had already computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from roseinfer.attention.backend import AttentionBackend, AttentionMetadata, pad_block_tables

if TYPE_CHECKING:
    from roseinfer.scheduler import ScheduledRequest


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    num_prefill_tokens: int
    decode_block_tables: torch.Tensor | None  # [Bd, nb] block ids, padded with 0
    decode_bias: torch.Tensor | None  # [Bd, 1, 1, nb * block_size] float32: 0 for keys it sees, -inf else
    prefill_block_tables: torch.Tensor | None  # [Bp, nb]
    prefill_mask: torch.Tensor | None  # [Bp, 1, max_q, nb * block_size] bool: keys each query sees
    prefill_rows: torch.Tensor | None  # [num_prefill_tokens] row of each prefill token in [Bp * max_q]
    prefill_max_q: int
    decode_context_lens: torch.Tensor | None = None  # [Bd]: keys each decode sees
    prefill_positions: torch.Tensor | None = None  # [Bp, max_q]: each query row's position (padding: the last)
    windowed: dict[int, tuple] = field(default_factory=dict)  # a sliding window's masks, built once a step

    def masks(self, window: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(decode bias, prefill mask) of a layer that sees the last ``window`` keys (0: all of them)."""
        if window <= 0:
            return self.decode_bias, self.prefill_mask
        if window not in self.windowed:
            bias = mask = None
            if self.decode_bias is not None:
                keys = torch.arange(self.decode_bias.shape[-1], device=self.decode_bias.device)
                old = keys[None, :] < self.decode_context_lens[:, None] - window
                bias = self.decode_bias.masked_fill(old[:, None, None], float("-inf"))
            if self.prefill_mask is not None:
                keys = torch.arange(self.prefill_mask.shape[-1], device=self.prefill_mask.device)
                recent = keys[None, None, :] > self.prefill_positions[:, :, None] - window
                mask = self.prefill_mask & recent[:, None]
            self.windowed[window] = bias, mask
        return self.windowed[window]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    # One token's K (or V) heads side by side, so the slot mapping indexes a [slots, Hkv, D] view.
    k_cache_layout = ("num_blocks", "block_size", "num_kv_heads", "head_dim")
    v_cache_layout = ("num_blocks", "block_size", "num_kv_heads", "head_dim")

    def build_metadata(
        self,
        scheduled: Sequence[ScheduledRequest],
        num_decodes: int,
        positions: torch.Tensor,
        slot_mapping: list[int],
    ) -> TorchAttentionMetadata:
        device = positions.device
        decodes, prefills = scheduled[:num_decodes], scheduled[num_decodes:]

        decode_tables = decode_bias = ctx = None
        if decodes:
            decode_tables = pad_block_tables([r.block_ids for r in decodes], device)
            ctx = torch.tensor([r.start + 1 for r in decodes], device=device)
            keys = torch.arange(decode_tables.shape[1] * self.block_size, device=device)
            hidden = keys[None, :] >= ctx[:, None]
            decode_bias = torch.zeros(hidden.shape, device=device).masked_fill_(hidden, float("-inf"))[:, None, None]

        prefill_tables = prefill_mask = prefill_rows = last_key = None
        max_q = 0
        if prefills:
            prefill_tables = pad_block_tables([r.block_ids for r in prefills], device)
            q_lens = [r.num_tokens for r in prefills]
            max_q = max(q_lens)
            start = torch.tensor([r.start for r in prefills], device=device)
            q_len_t = torch.tensor(q_lens, device=device)
            keys = torch.arange(prefill_tables.shape[1] * self.block_size, device=device)
            q_idx = torch.arange(max_q, device=device)
            # Padded query rows still see key 0, so their (discarded) softmax never divides by zero.
            last_key = start[:, None] + torch.minimum(q_idx[None, :], q_len_t[:, None] - 1)
            prefill_mask = (keys[None, None, :] <= last_key[:, :, None])[:, None]
            prefill_rows = torch.cat([torch.arange(q, device=device) + i * max_q for i, q in enumerate(q_lens)])

        return TorchAttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
            positions=positions,
            num_decodes=num_decodes,
            num_prefill_tokens=len(slot_mapping) - num_decodes,
            decode_block_tables=decode_tables,
            decode_bias=decode_bias,
            prefill_block_tables=prefill_tables,
            prefill_mask=prefill_mask,
            prefill_rows=prefill_rows,
            prefill_max_q=max_q,
            decode_context_lens=ctx,
            prefill_positions=last_key,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: TorchAttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
        nd = meta.num_decodes
        decode_bias, prefill_mask = meta.masks(window)
        if meta.num_prefill_tokens == 0:
            return _decode(q, k_cache, v_cache, meta.decode_block_tables, decode_bias, scale, softcap)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = _decode(q[:nd], k_cache, v_cache, meta.decode_block_tables, decode_bias, scale, softcap)
        bp = meta.prefill_block_tables.shape[0]
        padded = q.new_zeros(bp * meta.prefill_max_q, q.shape[1], q.shape[2])
        padded[meta.prefill_rows] = q[nd:]
        padded = padded.view(bp, meta.prefill_max_q, q.shape[1], q.shape[2]).transpose(1, 2)
        keys = _gather(k_cache, meta.prefill_block_tables).transpose(1, 2)
        values = _gather(v_cache, meta.prefill_block_tables).transpose(1, 2)
        if softcap:
            o = _capped_attention(padded, keys, values, prefill_mask, scale, softcap)
        else:
            o = F.scaled_dot_product_attention(
                padded, keys, values, attn_mask=prefill_mask, scale=scale, enable_gqa=q.shape[1] != num_kv_heads
            )
        out[nd:] = o.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2])[meta.prefill_rows]
        return out


def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bs, Hkv, D] cache, [B, nb] tables -> [B, nb * bs, Hkv, D] contexts."""
    b, nb = tables.shape
    return cache[tables].view(b, nb * cache.shape[1], cache.shape[2], cache.shape[3])


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One query per request: two small batched matmuls beat SDPA's kernels, built for long queries."""
    b, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    k = _gather(k_cache, block_tables).permute(0, 2, 3, 1)  # [B, Hkv, D, L]
    v = _gather(v_cache, block_tables).transpose(1, 2)  # [B, Hkv, L, D]
    # Query heads that share a K/V head sit next to each other: [B, Hkv, group, D].
    scores = torch.matmul(q.view(b, num_kv_heads, num_heads // num_kv_heads, head_dim), k)
    scores = scores.float() * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    probs = torch.softmax(scores + bias, dim=-1).to(q.dtype)
    return torch.matmul(probs, v).view(b, num_heads, head_dim)


def _capped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    """SDPA's attention with each scaled score capped at softcap * tanh(s / softcap), which SDPA cannot do: q
    [B, H, Lq, D], k and v [B, Hkv, Lk, D], mask [B, 1, Lq, Lk] (True: seen)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)).float() * scale / softcap) * softcap
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).to(q.dtype)
    return torch.matmul(probs, v)
