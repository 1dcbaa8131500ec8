"""Paged attention on the GPU in Triton: K/V written through the slot mapping, every request's context read
straight from its block table, no gathered copies and no masks built on the host.

Decodes run one program per (request, K/V head); prefill chunks one per (request, query tile, head), causal
from each request's first uncomputed token. A decode-only step's metadata is a handful of fixed-shape tensors
(``decode_metadata``), so the runner can capture it in a CUDA graph and replay it with new contents.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from roseinfer.attention.backend import AttentionBackend, AttentionMetadata
from roseinfer.kernels import triton_kernels as tk

if TYPE_CHECKING:
    from roseinfer.scheduler import ScheduledRequest


@dataclass
class TritonAttentionMetadata(AttentionMetadata):
    num_prefill_tokens: int
    decode_block_tables: torch.Tensor | None  # [Bd, width] int32 block ids (entries past a context never read)
    decode_context_lens: torch.Tensor | None  # [Bd] int32: keys each decode sees (0: a padding row)
    prefill_block_tables: torch.Tensor | None  # [Bp, width] int32
    prefill_q_starts: torch.Tensor | None  # [Bp] int32: first row of each chunk in the packed batch
    prefill_q_lens: torch.Tensor | None  # [Bp] int32
    prefill_ctx_starts: torch.Tensor | None  # [Bp] int32: tokens computed before the chunk
    prefill_max_q: int


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs: ClassVar[bool] = True
    k_cache_layout = ("num_blocks", "block_size", "num_kv_heads", "head_dim")
    v_cache_layout = ("num_blocks", "block_size", "num_kv_heads", "head_dim")

    def build_metadata(
        self,
        scheduled: Sequence[ScheduledRequest],
        num_decodes: int,
        positions: torch.Tensor,
        slot_mapping: list[int],
    ) -> TritonAttentionMetadata:
        decodes, prefills = scheduled[:num_decodes], scheduled[num_decodes:]
        width = max(len(r.block_ids) for r in scheduled)
        # Every int the step needs in one host tensor, one copy to the device.
        rows = [r.block_ids + [0] * (width - len(r.block_ids)) for r in scheduled]
        q_starts, offset = [], num_decodes
        for r in prefills:
            q_starts.append(offset)
            offset += r.num_tokens
        # Each array starts 16-byte aligned: Triton compiles a kernel per alignment of its pointers, and arrays at
        # offsets that change from step to step would compile new ones in the middle of serving.
        nd, npf = len(decodes), len(prefills)
        segments = [
            [x for row in rows[:nd] for x in row],
            [x for row in rows[nd:] for x in row],
            [r.start + 1 for r in decodes],
            q_starts,
            [r.num_tokens for r in prefills],
            [r.start for r in prefills],
        ]
        flat, offsets = [], []
        for seg in segments:
            offsets.append(len(flat))
            flat += seg + [0] * (-len(seg) % 4)
        host = torch.tensor(flat, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        dev = host.to(self.device, non_blocking=True)
        decode_tables = dev[: nd * width].view(nd, width)
        prefill_tables = dev[offsets[1] : offsets[1] + npf * width].view(npf, width)
        ctx_lens, starts, lens, ctx_starts = (dev[o : o + n] for o, n in zip(offsets[2:], (nd, npf, npf, npf)))
        return TritonAttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long).to(self.device, non_blocking=True),
            positions=positions,
            num_decodes=num_decodes,
            num_prefill_tokens=len(slot_mapping) - num_decodes,
            decode_block_tables=decode_tables if nd else None,
            decode_context_lens=ctx_lens if nd else None,
            prefill_block_tables=prefill_tables if npf else None,
            prefill_q_starts=starts if npf else None,
            prefill_q_lens=lens if npf else None,
            prefill_ctx_starts=ctx_starts if npf else None,
            prefill_max_q=max((r.num_tokens for r in prefills), default=0),
        )

    @staticmethod
    def decode_metadata(
        positions: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor
    ) -> TritonAttentionMetadata:
        """A decode-only step's metadata over caller-owned buffers (a CUDA graph's persistent inputs)."""
        return TritonAttentionMetadata(
            slot_mapping=slot_mapping,
            positions=positions,
            num_decodes=positions.shape[0],
            num_prefill_tokens=0,
            decode_block_tables=block_tables,
            decode_context_lens=context_lens,
            prefill_block_tables=None,
            prefill_q_starts=None,
            prefill_q_lens=None,
            prefill_ctx_starts=None,
            prefill_max_q=0,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: TritonAttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        tk.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        nd = meta.num_decodes
        if meta.num_prefill_tokens == 0:
            return tk.paged_decode(
                q,
                k_cache,
                v_cache,
                meta.decode_block_tables,
                meta.decode_context_lens,
                scale,
                window=window,
                softcap=softcap,
            )
        q = q.contiguous()
        out = torch.empty_like(q)
        if nd:
            tk.paged_decode(
                q[:nd],
                k_cache,
                v_cache,
                meta.decode_block_tables,
                meta.decode_context_lens,
                scale,
                out=out[:nd],
                window=window,
                softcap=softcap,
            )
        tk.paged_prefill(
            q,
            k_cache,
            v_cache,
            meta.prefill_block_tables,
            meta.prefill_q_starts,
            meta.prefill_q_lens,
            meta.prefill_ctx_starts,
            meta.prefill_max_q,
            scale,
            out,
            window,
            softcap,
        )
        return out
