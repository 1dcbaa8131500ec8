"""The Llama family (Llama, Mistral, Qwen2, SmolLM): RMSNorm, rotary positions, grouped K/V heads, SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from roseinfer.attention import AttentionBackend, AttentionMetadata
from roseinfer.kernels import add_rms_norm, rope_, silu_mul
from roseinfer.models.linear import Linear

_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class LlamaLayer:
    def __init__(
        self,
        layer: torch.nn.Module,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        hidden_act: str,
        attn_backend: AttentionBackend,
    ) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.attn = attn_backend
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.qk_v_split = [num_heads + num_kv_heads, num_kv_heads]
        self.q_k_split = [num_heads, num_kv_heads]
        self.qkv = Linear.fused(attn.q_proj, attn.k_proj, attn.v_proj)
        self.o_proj = Linear(attn.o_proj.weight, attn.o_proj.bias)
        self.gate_up = Linear.fused(mlp.gate_proj, mlp.up_proj)
        self.down = Linear(mlp.down_proj.weight, mlp.down_proj.bias)
        self.ln1 = (layer.input_layernorm.weight.detach(), layer.input_layernorm.variance_epsilon)
        self.ln2 = (layer.post_attention_layernorm.weight.detach(), layer.post_attention_layernorm.variance_epsilon)
        # None: SiLU, fused with the gating product.
        self.act = None if hidden_act == "silu" else mlp.act_fn
        self.scale = attn.scaling

    def forward(self, h, x, rope_tables, meta, k_cache, v_cache, next_norm) -> torch.Tensor:
        """x = this layer's normed input; h, the residual stream, is updated in place. Returns the input
        of the next layer, normed by ``next_norm`` (its weight and eps)."""
        t = h.shape[0]
        qk, v = self.qkv(x).view(t, -1, self.head_dim).split(self.qk_v_split, dim=1)
        rope_(qk, *rope_tables, meta.positions)  # q and k heads rotated together
        q, k = qk.split(self.q_k_split, dim=1)
        o = self.attn.forward(q, k, v, k_cache, v_cache, meta, self.scale)
        x = add_rms_norm(h, self.o_proj(o.view(t, -1)), *self.ln2)
        gate_up = self.gate_up(x)
        if self.act is None:
            act = silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = self.act(gate) * up
        return add_rms_norm(h, self.down(act), *next_norm)


def _slides(cfg) -> bool:
    """Whether transformers runs some layer of this model with a sliding window: as its ``layer_types`` say
    (Qwen2: from ``use_sliding_window`` and ``max_window_layers``), else Mistral's ``sliding_window``. A Llama
    config's stray ``sliding_window`` (transformers ignores it) cut the context to it."""
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        return "sliding_attention" in layer_types and bool(getattr(cfg, "sliding_window", None))
    return cfg.model_type == "mistral" and bool(getattr(cfg, "sliding_window", None))


class Llama:
    def __init__(self, hf_model: torch.nn.Module, attn: AttentionBackend) -> None:
        cfg = hf_model.config
        inner = hf_model.model
        self.num_layers = cfg.num_hidden_layers
        num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        self.vocab_size = cfg.vocab_size
        self.max_position_embeddings = cfg.max_position_embeddings
        if _slides(cfg):  # attention here is always full: stay within the window, where both agree
            self.max_position_embeddings = min(self.max_position_embeddings, cfg.sliding_window)
        self.embed = inner.embed_tokens.weight.detach()
        self.layers = [
            LlamaLayer(layer, num_heads, self.num_kv_heads, self.head_dim, cfg.hidden_act, attn)
            for layer in inner.layers
        ]
        self.norm = (inner.norm.weight.detach(), inner.norm.variance_epsilon)
        self.lm_head = Linear(hf_model.lm_head.weight)
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
        x = add_rms_norm(h, None, *self.layers[0].ln1)
        norms = [layer.ln1 for layer in self.layers[1:]] + [self.norm]
        for layer, (k_cache, v_cache), next_norm in zip(self.layers, kv_caches, norms):
            x = layer.forward(h, x, (self.cos, self.sin), meta, k_cache, v_cache, next_norm)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
