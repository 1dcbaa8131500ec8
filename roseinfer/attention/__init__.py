"""Paged attention over packed variable-length batches, behind one backend chosen per engine.

A step packs the tokens of every scheduled request into one row each: the decodes first, then the prefill
chunks. Each layer writes its new K/V into the paged cache through ``slot_mapping``, then reads every
request's context back through its block table. A backend owns its KV cache layout (it allocates the
caches), builds its metadata from the scheduler output, and runs the attention.
"""

from __future__ import annotations

import torch

from roseinfer.attention.backend import KV_CACHE_DIMS, AttentionBackend, AttentionMetadata
from roseinfer.attention.cpu_kernel_backend import CpuKernelAttentionBackend, CpuKernelAttentionMetadata
from roseinfer.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata
from roseinfer.kernels import cpu_kernels_for, triton_kernels_for

__all__ = [
    "KV_CACHE_DIMS",
    "AttentionBackend",
    "AttentionMetadata",
    "CpuKernelAttentionBackend",
    "CpuKernelAttentionMetadata",
    "TorchAttentionBackend",
    "TorchAttentionMetadata",
    "select_attention_backend",
]


def select_attention_backend(block_size: int, dtype: torch.dtype, device: torch.device) -> AttentionBackend:
    """The C kernels where they run on this device and dtype (``cpu_kernels_for`` decides), Triton on CUDA where it
    is installed, PyTorch elsewhere."""
    lib = cpu_kernels_for(device, dtype)
    if lib is not None:
        return CpuKernelAttentionBackend(lib, block_size, dtype, device)
    if triton_kernels_for(device) is not None:
        from roseinfer.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(block_size, dtype, device)
    return TorchAttentionBackend(block_size, dtype, device)
