"""Gemma 2 and 3 (text): the Llama family's layer with four norms a layer (each scaling by 1 + its weight, in
float32), a scaled embedding, GeGLU, and sliding-window layers between full ones; Gemma 2 caps its attention scores
and logits with tanh, Gemma 3 norms q and k and gives its sliding layers their own rotary base."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from roseinfer.attention import AttentionBackend, AttentionMetadata
from roseinfer.checkpoint import Checkpoint
from roseinfer.kernels import add_rms_norm, rms_norm, rope_
from roseinfer.models.llama import (
    activation,
    attention_projections,
    glu,
    mlp_projections,
    output_layer,
    rope_frequencies,
    rope_tables,
    sliding_windows,
    table_rows,
)

Norm = tuple[torch.Tensor, float]  # (1 + weight in float32, eps)


def gemma_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """``h += delta`` in place (when given), then rmsnorm(h) * weight in float32 (Gemma's 1 + w, OLMo 2's w), rounded
    to h's dtype: these models round after the product, where Llama rounds before it. At float32 both orders are one
    product, so the fused kernel gives transformers' numbers."""
    if h.dtype == torch.float32:
        return add_rms_norm(h, delta, weight, eps)
    if delta is not None:
        h.add_(delta)
    return rms_norm(h, weight, eps, round_first=False)


def _norm(weights: Checkpoint, name: str, size: int, eps: float) -> Norm:
    return 1.0 + weights.get(name, (size,)).float(), eps


class GemmaLayer:
    def __init__(
        self,
        weights: Checkpoint,
        prefix: str,
        cfg,
        attn_backend: AttentionBackend,
        window: int,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        self.attn, self.window, self.rope = attn_backend, window, rope
        num_heads, num_kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.head_dim = head_dim
        self.qk_v_split = [num_heads + num_kv_heads, num_kv_heads]
        self.q_k_split = [num_heads, num_kv_heads]
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.qkv, self.o_proj = attention_projections(
            weights, prefix, cfg, num_heads * head_dim, num_kv_heads * head_dim
        )
        self.gate_up, self.down = mlp_projections(weights, prefix, cfg)
        self.act = activation(cfg.hidden_activation)
        self.ln1 = _norm(weights, f"{prefix}.input_layernorm.weight", hidden, eps)
        self.post_attn = _norm(weights, f"{prefix}.post_attention_layernorm.weight", hidden, eps)
        self.pre_ff = _norm(weights, f"{prefix}.pre_feedforward_layernorm.weight", hidden, eps)
        self.post_ff = _norm(weights, f"{prefix}.post_feedforward_layernorm.weight", hidden, eps)
        self.qk_norm = None
        if cfg.model_type == "gemma3_text":
            q_norm, _ = _norm(weights, f"{prefix}.self_attn.q_norm.weight", head_dim, eps)
            k_norm, _ = _norm(weights, f"{prefix}.self_attn.k_norm.weight", head_dim, eps)
            self.qk_norm = torch.cat([q_norm.expand(num_heads, head_dim), k_norm.expand(num_kv_heads, head_dim)]), eps
        self.scale = cfg.query_pre_attn_scalar**-0.5
        self.softcap = getattr(cfg, "attn_logit_softcapping", None) or 0.0

    def forward(self, h, x, meta: AttentionMetadata, k_cache, v_cache, next_norm: Norm) -> torch.Tensor:
        """x = this layer's normed input; h, the residual stream, is updated in place. Returns the input of the
        next layer, normed by ``next_norm``."""
        t = h.shape[0]
        qk, v = self.qkv(x).view(t, -1, self.head_dim).split(self.qk_v_split, dim=1)
        if self.qk_norm is not None:  # (1 + w) per head, in float32
            qk.copy_(rms_norm(qk, self.qk_norm[0], self.qk_norm[1], round_first=False))
        rope_(qk, *self.rope, meta.positions)
        q, k = qk.split(self.q_k_split, dim=1)
        o = self.attn.forward(q, k, v, k_cache, v_cache, meta, self.scale, self.window, self.softcap)
        x = gemma_rms_norm(h, gemma_rms_norm(self.o_proj(o.view(t, -1)), None, *self.post_attn), *self.pre_ff)
        delta = gemma_rms_norm(self.down(glu(self.gate_up(x), self.act)), None, *self.post_ff)
        return gemma_rms_norm(h, delta, *next_norm)


class Gemma:
    cuda_graphs_safe = True
    long_rope_from = 0

    @staticmethod
    def context_length(cfg) -> int:
        return cfg.max_position_embeddings

    def __init__(self, cfg, weights: Checkpoint, attn: AttentionBackend, max_len: int | None = None) -> None:
        if getattr(cfg, "use_bidirectional_attention", False):  # EmbeddingGemma's encoder, not a causal LM
            raise ValueError("a Gemma config with use_bidirectional_attention is not supported")
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.vocab_size = cfg.vocab_size
        self.max_position_embeddings = self.context_length(cfg)
        # Gemma 3's rotary settings differ by layer type; Gemma 2's are one for all.
        by_type = all(kind in cfg.rope_parameters for kind in cfg.layer_types)
        frequencies = {kind: rope_frequencies(cfg, kind if by_type else None) for kind in set(cfg.layer_types)}
        self.embed = weights.get("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
        # transformers' scale is a float32 tensor cast to the weights' dtype.
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5).to(self.embed.device, self.embed.dtype)
        tables = {
            kind: rope_tables(
                *f, table_rows(self.max_position_embeddings, max_len), self.embed.dtype, self.embed.device
            )
            for kind, f in frequencies.items()
        }
        windows = sliding_windows(cfg)
        self.layers = [
            GemmaLayer(weights, f"model.layers.{i}", cfg, attn, windows[i], tables[cfg.layer_types[i]])
            for i in range(self.num_layers)
        ]
        self.norm = _norm(weights, "model.norm.weight", cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = output_layer(weights, cfg, self.embed)  # (tied, as Gemma's are, unless its config says not)
        self.softcap = getattr(cfg, "final_logit_softcapping", None)

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches) -> torch.Tensor:
        h = F.embedding(input_ids, self.embed) * self.embed_scale
        x = gemma_rms_norm(h, None, *self.layers[0].ln1)
        norms = [layer.ln1 for layer in self.layers[1:]] + [self.norm]
        for layer, (k_cache, v_cache), next_norm in zip(self.layers, kv_caches, norms):
            x = layer.forward(h, x, meta, k_cache, v_cache, next_norm)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
