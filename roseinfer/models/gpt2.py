"""GPT-2: learned positions, LayerNorm, fused QKV in Conv1D layout, GELU MLP, tied output layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from roseinfer.attention import AttentionBackend, AttentionMetadata
from roseinfer.models.linear import Linear


def _conv1d(module: torch.nn.Module) -> Linear:
    # transformers' Conv1D stores [in, out]; Linear wants [out, in].
    return Linear(module.weight.detach().t().contiguous(), module.bias)


class GPT2Block:
    def __init__(
        self, block: torch.nn.Module, num_heads: int, head_dim: int, scale: float, attn: AttentionBackend
    ) -> None:
        self.num_heads, self.head_dim, self.scale = num_heads, head_dim, scale
        self.attn = attn
        self.ln1 = (block.ln_1.weight.detach(), block.ln_1.bias.detach(), block.ln_1.eps)
        self.ln2 = (block.ln_2.weight.detach(), block.ln_2.bias.detach(), block.ln_2.eps)
        self.c_attn = _conv1d(block.attn.c_attn)
        self.c_proj = _conv1d(block.attn.c_proj)
        self.c_fc = _conv1d(block.mlp.c_fc)
        self.mlp_proj = _conv1d(block.mlp.c_proj)
        self.act = block.mlp.act

    def forward(self, h, meta, k_cache, v_cache) -> torch.Tensor:
        t, width = h.shape
        x = F.layer_norm(h, (width,), *self.ln1[:2], self.ln1[2])
        qkv = self.c_attn(x).view(t, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(1)
        o = self.attn.forward(q, k.contiguous(), v.contiguous(), k_cache, v_cache, meta, self.scale)
        h = h + self.c_proj(o.reshape(t, width))
        x = F.layer_norm(h, (width,), *self.ln2[:2], self.ln2[2])
        return h + self.mlp_proj(self.act(self.c_fc(x)))


class GPT2:
    def __init__(self, hf_model: torch.nn.Module, attn: AttentionBackend) -> None:
        cfg = hf_model.config
        inner = hf_model.transformer
        self.num_layers = cfg.n_layer
        self.num_kv_heads = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.vocab_size = cfg.vocab_size
        self.max_position_embeddings = cfg.n_positions
        self.wte = inner.wte.weight.detach()
        self.wpe = inner.wpe.weight.detach()
        base_scale = self.head_dim**-0.5 if cfg.scale_attn_weights else 1.0
        self.blocks = [
            GPT2Block(
                block,
                cfg.n_head,
                self.head_dim,
                base_scale / (i + 1) if cfg.scale_attn_by_inverse_layer_idx else base_scale,
                attn,
            )
            for i, block in enumerate(inner.h)
        ]
        self.ln_f = (inner.ln_f.weight.detach(), inner.ln_f.bias.detach(), inner.ln_f.eps)
        self.lm_head = Linear(hf_model.lm_head.weight)

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches) -> torch.Tensor:
        h = F.embedding(input_ids, self.wte) + F.embedding(positions, self.wpe)
        for block, (k_cache, v_cache) in zip(self.blocks, kv_caches):
            h = block.forward(h, meta, k_cache, v_cache)
        return F.layer_norm(h, (h.shape[-1],), *self.ln_f[:2], self.ln_f[2])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
