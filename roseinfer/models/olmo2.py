"""OLMo 2: norms after attention and after the MLP (none before them), q and k each normed over their whole
projection, every norm's weight product taken in float32 as Gemma's are; otherwise Llama's layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from roseinfer.attention import AttentionBackend, AttentionMetadata
from roseinfer.checkpoint import Checkpoint
from roseinfer.kernels import rms_norm, rope_
from roseinfer.models.gemma import gemma_rms_norm
from roseinfer.models.llama import (
    activation,
    attention_projections,
    context_length,
    glu,
    mlp_projections,
    output_layer,
    rope_frequencies,
    rope_tables,
    table_rows,
)


def _norm(weights: Checkpoint, name: str, size: int, eps: float) -> tuple[torch.Tensor, float]:
    return weights.get(name, (size,)).float(), eps


class Olmo2Layer:
    def __init__(self, weights: Checkpoint, prefix: str, cfg, attn_backend: AttentionBackend) -> None:
        self.attn = attn_backend
        num_heads, num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        self.qk_v_split = [num_heads + num_kv_heads, num_kv_heads]
        self.q_k_split = [num_heads, num_kv_heads]
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv, self.o_proj = attention_projections(weights, prefix, cfg, self.q_size, self.kv_size)
        self.gate_up, self.down = mlp_projections(weights, prefix, cfg)
        self.act = activation(cfg.hidden_act)
        self.q_norm = _norm(weights, f"{prefix}.self_attn.q_norm.weight", self.q_size, eps)
        self.k_norm = _norm(weights, f"{prefix}.self_attn.k_norm.weight", self.kv_size, eps)
        self.post_attn = _norm(weights, f"{prefix}.post_attention_layernorm.weight", hidden, eps)
        self.post_ff = _norm(weights, f"{prefix}.post_feedforward_layernorm.weight", hidden, eps)
        self.scale = head_dim**-0.5

    def forward(self, h, rope, meta: AttentionMetadata, k_cache, v_cache) -> None:
        """h, the residual stream (this layer's input, no norm before it), is updated in place."""
        t = h.shape[0]
        qkv = self.qkv(h)
        q_rows, k_rows = qkv[:, : self.q_size], qkv[:, self.q_size : -self.kv_size]  # each normed over its whole width
        q_rows.copy_(rms_norm(q_rows, *self.q_norm, round_first=False))
        k_rows.copy_(rms_norm(k_rows, *self.k_norm, round_first=False))
        qk, v = qkv.view(t, -1, self.head_dim).split(self.qk_v_split, dim=1)
        rope_(qk, *rope, meta.positions)
        q, k = qk.split(self.q_k_split, dim=1)
        o = self.attn.forward(q, k, v, k_cache, v_cache, meta, self.scale)
        h.add_(gemma_rms_norm(self.o_proj(o.view(t, -1)), None, *self.post_attn))
        h.add_(gemma_rms_norm(self.down(glu(self.gate_up(h), self.act)), None, *self.post_ff))


class Olmo2:
    cuda_graphs_safe = True
    long_rope_from = 0
    context_length = staticmethod(context_length)

    def __init__(self, cfg, weights: Checkpoint, attn: AttentionBackend, max_len: int | None = None) -> None:
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size = cfg.vocab_size
        self.max_position_embeddings = self.context_length(cfg)
        inv_freq, attention_scaling = rope_frequencies(cfg)  # before the weights: a refused model reads none
        self.embed = weights.get("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
        self.layers = [Olmo2Layer(weights, f"model.layers.{i}", cfg, attn) for i in range(self.num_layers)]
        self.norm = _norm(weights, "model.norm.weight", cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = output_layer(weights, cfg, self.embed)
        rows = table_rows(self.max_position_embeddings, max_len)
        self.rope = rope_tables(inv_freq, attention_scaling, rows, self.embed.dtype, self.embed.device)

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches) -> torch.Tensor:
        h = F.embedding(input_ids, self.embed)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            layer.forward(h, self.rope, meta, k_cache, v_cache)
        return gemma_rms_norm(h, None, *self.norm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
