"""The engine's own forward passes, built from a checkpoint's weights and its transformers config."""

from __future__ import annotations

from typing import Protocol

import torch

from roseinfer.attention import AttentionBackend, AttentionMetadata
from roseinfer.checkpoint import Checkpoint

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "phi3", "granite", "mixtral", "qwen2_moe", "qwen3_moe")
SUPPORTED_MODEL_TYPES = (*LLAMA_FAMILY, "olmo2", "gemma2", "gemma3_text", "gemma3", "gpt2")
# Vision-language checkpoints whose text model the engine serves on its own (text prompts only): where their text
# model's ``model.*`` tensors sit, as the hub's files name them or as newer transformers saves them.
TEXT_PARTS = {"gemma3": ("language_model.model.", "model.language_model.")}


class CausalLM(Protocol):
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    # False where a step's work depends on its tokens (a mixture of experts): its decode steps run eagerly.
    cuda_graphs_safe: bool
    # > 0 (LongRoPE's original length): a request longer than this rotates by the long factors (the scheduler
    # recomputes one that grows past it): ``forward`` then takes each token's row of its rotary tables
    # (``rope_row_offset``), not its position.
    long_rope_from: int

    @staticmethod
    def context_length(cfg) -> int:
        """The tokens a model of ``cfg`` serves (its ``max_position_embeddings``), read before its weights."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,  # each token's position (its rotary row, where long_rope_from > 0)
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def rope_row_offset(seq_long_rope: bool, long_rope_from: int) -> int:
    """What to add to a request's positions to index LongRoPE tables that hold the short factors' ``long_rope_from``
    rows before the long factors' rows: 0, or past the short rows for a request rotated by the long factors."""
    return long_rope_from if seq_long_rope else 0


def kv_window(model: CausalLM) -> int:
    """The keys every layer still reads: the widest window where every layer slides (Mistral v0.1, Phi-3), so K/V
    that fell out of it can be freed; 0 where any layer attends over the whole context (Gemma 2's full layers)."""
    windows = [getattr(layer, "window", 0) for layer in getattr(model, "layers", ())]
    return max(windows) if windows and all(windows) else 0


class UnsupportedModelError(ValueError):
    pass


def check_supported(model_type: str) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported; roseinfer runs {', '.join(SUPPORTED_MODEL_TYPES)} "
            "(the Llama family includes SmolLM; gemma3 is Gemma 3's text model, served without its vision tower)"
        )


def model_class(config) -> type:
    """The engine's forward for a model's architecture (its transformers ``config``)."""
    check_supported(config.model_type)
    if config.model_type == "gpt2":
        from roseinfer.models.gpt2 import GPT2

        return GPT2
    if config.model_type == "olmo2":
        from roseinfer.models.olmo2 import Olmo2

        return Olmo2
    if config.model_type in ("gemma2", "gemma3_text"):
        from roseinfer.models.gemma import Gemma

        return Gemma
    from roseinfer.models.llama import Llama

    return Llama


def build_model(config, weights: Checkpoint, attn: AttentionBackend, max_len: int | None = None) -> CausalLM:
    """The engine's forward for a model's architecture (its transformers ``config``) over its checkpoint's
    ``weights``, its attention run by ``attn`` (the engine's backend, which also laid out the KV caches it is
    given); ``max_len``: the engine's longest sequence (its rotary tables hold no more rows: a 131k-token model's
    took hundreds of MB), None for the model's whole context."""
    return model_class(config)(config, weights, attn, max_len)
