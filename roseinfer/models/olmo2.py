"""OLMo 2: norms after attention and after the MLP (none before them), q and k each normed over their whole
projection, every norm's weight product taken in float32 as Gemma's are; otherwise Llama's layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from roseinfer.attention import AttentionBackend, AttentionMetadata
from roseinfer.checkpoint import Checkpoint
from roseinfer.kernels import rope_, silu_mul
from roseinfer.models.gemma import gemma_rms_norm
from roseinfer.models.linear import Linear
from roseinfer.models.llama import rope_frequencies, rope_tables


def _norm(weights: Checkpoint, name: str, size: int, eps: float) -> tuple[torch.Tensor, float]:
    return weights.get(name, (size,)).float(), eps


def norm_rows_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place on x: [T, N] (rows may be strided), each row normed over N and scaled by ``weight`` in float32."""
    y = x.float()
    x.copy_(y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * weight)


class Olmo2Layer:
    def __init__(self, weights: Checkpoint, prefix: str, cfg, attn_backend: AttentionBackend) -> None:
        self.attn = attn_backend
        num_heads, num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        self.qk_v_split = [num_heads + num_kv_heads, num_kv_heads]
        self.q_k_split = [num_heads, num_kv_heads]
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        sizes = [self.q_size, self.kv_size, self.kv_size]
        self.qkv = Linear.fused(weights, [f"{prefix}.self_attn.{p}_proj" for p in "qkv"], sizes, hidden)
        self.o_proj = Linear.from_checkpoint(weights, f"{prefix}.self_attn.o_proj", hidden, self.q_size)
        gate_up = [f"{prefix}.mlp.gate_proj", f"{prefix}.mlp.up_proj"]
        self.gate_up = Linear.fused(weights, gate_up, [cfg.intermediate_size] * 2, hidden)
        self.down = Linear.from_checkpoint(weights, f"{prefix}.mlp.down_proj", hidden, cfg.intermediate_size)
        self.q_norm = _norm(weights, f"{prefix}.self_attn.q_norm.weight", self.q_size, eps)
        self.k_norm = _norm(weights, f"{prefix}.self_attn.k_norm.weight", self.kv_size, eps)
        self.post_attn = _norm(weights, f"{prefix}.post_attention_layernorm.weight", hidden, eps)
        self.post_ff = _norm(weights, f"{prefix}.post_feedforward_layernorm.weight", hidden, eps)
        self.scale = head_dim**-0.5

    def forward(self, h, rope, meta: AttentionMetadata, k_cache, v_cache) -> None:
        """h, the residual stream (this layer's input, no norm before it), is updated in place."""
        t = h.shape[0]
        qkv = self.qkv(h)
        norm_rows_(qkv[:, : self.q_size], *self.q_norm)
        norm_rows_(qkv[:, self.q_size : self.q_size + self.kv_size], *self.k_norm)
        qk, v = qkv.view(t, -1, self.head_dim).split(self.qk_v_split, dim=1)
        rope_(qk, *rope, meta.positions)
        q, k = qk.split(self.q_k_split, dim=1)
        o = self.attn.forward(q, k, v, k_cache, v_cache, meta, self.scale)
        h.add_(gemma_rms_norm(self.o_proj(o.view(t, -1)), None, *self.post_attn))
        h.add_(gemma_rms_norm(self.down(silu_mul(self.gate_up(h))), None, *self.post_ff))


class Olmo2:
    cuda_graphs_safe = True

    def __init__(self, cfg, weights: Checkpoint, attn: AttentionBackend) -> None:
        if cfg.hidden_act != "silu":
            raise ValueError(f"an OLMo 2 config with hidden_act={cfg.hidden_act!r} is not supported")
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size = cfg.vocab_size
        self.max_position_embeddings = cfg.max_position_embeddings
        inv_freq, attention_scaling = rope_frequencies(cfg)  # before the weights: a refused model reads none
        self.embed = weights.get("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
        self.layers = [Olmo2Layer(weights, f"model.layers.{i}", cfg, attn) for i in range(self.num_layers)]
        self.norm = _norm(weights, "model.norm.weight", cfg.hidden_size, cfg.rms_norm_eps)
        if getattr(cfg, "tie_word_embeddings", False):
            self.lm_head = Linear(self.embed)
        else:
            self.lm_head = Linear.from_checkpoint(weights, "lm_head", cfg.vocab_size, cfg.hidden_size)
        self.rope = rope_tables(
            inv_freq, attention_scaling, self.max_position_embeddings, self.embed.dtype, self.embed.device
        )

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches) -> torch.Tensor:
        h = F.embedding(input_ids, self.embed)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            layer.forward(h, self.rope, meta, k_cache, v_cache)
        return gemma_rms_norm(h, None, *self.norm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
