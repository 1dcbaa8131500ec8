"""What every attention backend provides, and the metadata fields they all share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from roseinfer.scheduler import ScheduledRequest

# The dimensions a KV cache layout orders; a backend lists them in its caches' memory order.
KV_CACHE_DIMS = ("num_blocks", "block_size", "num_kv_heads", "head_dim")


@dataclass
class AttentionMetadata:
    """The per-step tensors every backend reads; each backend's subclass adds its own, all built in its
    ``build_metadata``."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot (block id * block_size + offset) of each packed token
    positions: torch.Tensor  # [T] int64: position of each token in its request
    num_decodes: int  # the first num_decodes tokens are the decodes, one token per request


class AttentionBackend(ABC):
    """Paged attention for one engine: chosen once, for one block size, dtype and device."""

    name: ClassVar[str]
    # Whether a decode-only step can be captured in a CUDA graph (``decode_metadata`` over fixed buffers).
    supports_cuda_graphs: ClassVar[bool] = False
    # Each cache's dimensions in memory order, named from KV_CACHE_DIMS: the layout the backend reads and writes.
    k_cache_layout: ClassVar[tuple[str, str, str, str]]
    v_cache_layout: ClassVar[tuple[str, str, str, str]]

    def __init__(self, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.block_size = block_size
        self.dtype = dtype
        self.device = device

    def kv_cache_shapes(self, num_blocks: int, num_kv_heads: int, head_dim: int) -> tuple[tuple[int, ...], ...]:
        """(K shape, V shape) of one layer's caches, in the declared layouts."""
        size = dict(num_blocks=num_blocks, block_size=self.block_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
        return tuple(size[d] for d in self.k_cache_layout), tuple(size[d] for d in self.v_cache_layout)

    def kv_cache_bytes_per_block(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Memory one block takes across every layer's K and V caches."""
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * num_layers * self.block_size * num_kv_heads * head_dim * elem

    def allocate_kv_caches(
        self, num_layers: int, num_blocks: int, num_kv_heads: int, head_dim: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(K cache, V cache) per layer, zeroed, in this backend's layouts."""
        k_shape, v_shape = self.kv_cache_shapes(num_blocks, num_kv_heads, head_dim)
        return [
            (
                torch.zeros(k_shape, dtype=self.dtype, device=self.device),
                torch.zeros(v_shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(num_layers)
        ]

    @abstractmethod
    def build_metadata(
        self,
        scheduled: Sequence[ScheduledRequest],
        num_decodes: int,
        positions: torch.Tensor,
        slot_mapping: list[int],
    ) -> AttentionMetadata:
        """The step's metadata. ``scheduled`` lists the requests in packed order (``num_decodes`` decodes,
        then the prefills); ``positions`` and ``slot_mapping`` give every packed token's."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """Write k, v ([T, Hkv, D]) into the caches at the step's slots, then attend. q: [T, H, D]; returns
        [T, H, D]. ``window`` > 0: each query sees only the last ``window`` keys up to its own (a sliding-window
        layer: key j is seen from position i when i - window < j <= i, as transformers masks it). ``softcap`` >
        0: each scaled score s becomes softcap * tanh(s / softcap) before the softmax (Gemma 2)."""


def pad_block_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """[len(tables), longest] int64 block ids, padded with block 0 (never read past a request's context)."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=device)
