"""Paged attention in the C kernel (``roseinfer/kernels/cpu_kernels.c``), straight from the block tables.

The kernel lays the caches out per KV head: K [blocks, Hkv, D, block_size], so the scores of a whole block
come from vector products over its keys with no horizontal sums; V [blocks, Hkv, block_size, D], so one
head's rows of a block are contiguous.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from roseinfer.attention.backend import AttentionBackend, AttentionMetadata, pad_block_tables

if TYPE_CHECKING:
    from roseinfer.scheduler import ScheduledRequest


@dataclass
class CpuKernelAttentionMetadata(AttentionMetadata):
    seq_of_token: torch.Tensor  # [T] int64: row of each token's request in block_tables
    block_tables: torch.Tensor  # [S, nb] int64 block ids of every scheduled request, padded with 0


class CpuKernelAttentionBackend(AttentionBackend):
    name = "cpu-kernels"
    k_cache_layout = ("num_blocks", "num_kv_heads", "head_dim", "block_size")
    v_cache_layout = ("num_blocks", "num_kv_heads", "block_size", "head_dim")

    def __init__(self, lib: ctypes.CDLL, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(block_size, dtype, device)
        self.lib = lib

    def build_metadata(
        self,
        scheduled: Sequence[ScheduledRequest],
        num_decodes: int,
        positions: torch.Tensor,
        slot_mapping: list[int],
    ) -> CpuKernelAttentionMetadata:
        # Every token attends to its request's keys up to its own position: decodes and prefills alike.
        device = positions.device
        counts = torch.tensor([r.num_tokens for r in scheduled], device=device)
        return CpuKernelAttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
            positions=positions,
            num_decodes=num_decodes,
            seq_of_token=torch.repeat_interleave(torch.arange(len(scheduled), device=device), counts),
            block_tables=pad_block_tables([r.block_ids for r in scheduled], device),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: CpuKernelAttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        if not kernels_fit(q, k, v):
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        t, num_heads, head_dim = q.shape
        _, num_kv_heads, block_size, _ = v_cache.shape  # V layout: [blocks, Hkv, block_size, D]
        out = q.new_empty(t, num_heads, head_dim)
        self.lib.paged_attention(
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
            num_kv_heads,
            head_dim,
            block_size,
            scale,
            window,
            softcap,
            int(q.dtype == torch.bfloat16),
        )
        return out


def kernels_fit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the C kernel can read these views: rows strided alike, heads and dims packed."""
    return all(x.stride(2) == 1 and x.stride(1) == x.shape[2] for x in (q, k, v)) and k.stride(0) == v.stride(0)
