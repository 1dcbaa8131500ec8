"""The Llama family (Llama, Mistral, Qwen2, SmolLM): RMSNorm, rotary positions, grouped K/V heads, SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from roseinfer.attention import AttentionMetadata, paged_attention

_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # The same operations, in the same order and precision, as transformers' LlamaRMSNorm.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _linear_weights(*linears: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One fused weight (and bias) for projections that read the same input."""
    weight = torch.cat([m.weight.detach() for m in linears]) if len(linears) > 1 else linears[0].weight.detach()
    biases = [m.bias for m in linears]
    if all(b is None for b in biases):
        return weight, None
    bias = torch.cat([b.detach() if b is not None else weight.new_zeros(m.out_features) for b, m in zip(biases, linears)])
    return weight, bias


class LlamaLayer:
    def __init__(self, layer: torch.nn.Module, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.split = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        self.qkv_w, self.qkv_b = _linear_weights(attn.q_proj, attn.k_proj, attn.v_proj)
        self.o_w, self.o_b = _linear_weights(attn.o_proj)
        self.gate_up_w, self.gate_up_b = _linear_weights(mlp.gate_proj, mlp.up_proj)
        self.down_w, self.down_b = _linear_weights(mlp.down_proj)
        self.ln1_w, self.ln1_eps = layer.input_layernorm.weight.detach(), layer.input_layernorm.variance_epsilon
        self.ln2_w, self.ln2_eps = (
            layer.post_attention_layernorm.weight.detach(),
            layer.post_attention_layernorm.variance_epsilon,
        )
        self.act = mlp.act_fn
        self.scale = attn.scaling

    def forward(self, h, cos, sin, meta, k_cache, v_cache) -> torch.Tensor:
        t = h.shape[0]
        x = rms_norm(h, self.ln1_w, self.ln1_eps)
        q, k, v = F.linear(x, self.qkv_w, self.qkv_b).split(self.split, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        h = h + F.linear(o.reshape(t, -1), self.o_w, self.o_b)
        x = rms_norm(h, self.ln2_w, self.ln2_eps)
        gate, up = F.linear(x, self.gate_up_w, self.gate_up_b).chunk(2, dim=-1)
        return h + F.linear(self.act(gate) * up, self.down_w, self.down_b)


class Llama:
    def __init__(self, hf_model: torch.nn.Module) -> None:
        cfg = hf_model.config
        inner = hf_model.model
        self.num_layers = cfg.num_hidden_layers
        num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        self.vocab_size = cfg.vocab_size
        self.max_position_embeddings = cfg.max_position_embeddings
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
            # Attention here is always full: stay within the window, where both agree.
            self.max_position_embeddings = min(self.max_position_embeddings, cfg.sliding_window)
        self.embed = inner.embed_tokens.weight.detach()
        self.layers = [LlamaLayer(layer, num_heads, self.num_kv_heads, self.head_dim) for layer in inner.layers]
        self.norm_w, self.norm_eps = inner.norm.weight.detach(), inner.norm.variance_epsilon
        self.lm_head = hf_model.lm_head.weight.detach()
        rotary = inner.rotary_emb
        if getattr(rotary, "rope_type", "default") not in _STATIC_ROPE_TYPES:
            raise ValueError(f"rope type {rotary.rope_type!r} is not supported; use one of {_STATIC_ROPE_TYPES}")
        # The same float32 products as transformers' rotary embedding, tabulated once for all positions.
        pos = torch.arange(self.max_position_embeddings, dtype=torch.float32, device=self.embed.device)
        freqs = torch.outer(pos, rotary.inv_freq.float().to(pos.device))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * rotary.attention_scaling).to(self.embed.dtype)
        self.sin = (emb.sin() * rotary.attention_scaling).to(self.embed.dtype)

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches) -> torch.Tensor:
        h = F.embedding(input_ids, self.embed)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            h = layer.forward(h, cos, sin, meta, k_cache, v_cache)
        return rms_norm(h, self.norm_w, self.norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head)
