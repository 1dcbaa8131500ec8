"""GPT-2: learned positions, LayerNorm, fused QKV in Conv1D layout, GELU MLP, tied output layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from roseinfer.attention import AttentionBackend, AttentionMetadata
from roseinfer.checkpoint import Checkpoint
from roseinfer.models.linear import Linear


def _conv1d(weights: Checkpoint, name: str) -> Linear:
    # transformers' Conv1D stores [in, out]; Linear wants [out, in].
    return Linear(weights.get(f"{name}.weight").t().contiguous(), weights.get(f"{name}.bias"))


def _layer_norm(weights: Checkpoint, name: str, eps: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    return weights.get(f"{name}.weight"), weights.get(f"{name}.bias"), eps


class GPT2Block:
    def __init__(
        self, weights: Checkpoint, prefix: str, cfg, head_dim: int, scale: float, attn: AttentionBackend
    ) -> None:
        self.num_heads, self.head_dim, self.scale = cfg.n_head, head_dim, scale
        self.attn = attn
        self.ln1 = _layer_norm(weights, f"{prefix}.ln_1", cfg.layer_norm_epsilon)
        self.ln2 = _layer_norm(weights, f"{prefix}.ln_2", cfg.layer_norm_epsilon)
        self.c_attn = _conv1d(weights, f"{prefix}.attn.c_attn")
        self.c_proj = _conv1d(weights, f"{prefix}.attn.c_proj")
        self.c_fc = _conv1d(weights, f"{prefix}.mlp.c_fc")
        self.mlp_proj = _conv1d(weights, f"{prefix}.mlp.c_proj")
        self.act = ACT2FN[cfg.activation_function]

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
    def __init__(self, cfg, weights: Checkpoint, attn: AttentionBackend) -> None:
        # Saved by GPT2LMHeadModel, the names start "transformer."; the hub's original checkpoint has none.
        root = "transformer." if "transformer.wte.weight" in weights else ""
        self.num_layers = cfg.n_layer
        self.num_kv_heads = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.vocab_size = cfg.vocab_size
        self.max_position_embeddings = cfg.n_positions
        self.wte = weights.get(f"{root}wte.weight")
        self.wpe = weights.get(f"{root}wpe.weight")
        base_scale = self.head_dim**-0.5 if cfg.scale_attn_weights else 1.0
        self.blocks = [
            GPT2Block(
                weights,
                f"{root}h.{i}",
                cfg,
                self.head_dim,
                base_scale / (i + 1) if cfg.scale_attn_by_inverse_layer_idx else base_scale,
                attn,
            )
            for i in range(self.num_layers)
        ]
        self.ln_f = _layer_norm(weights, f"{root}ln_f", cfg.layer_norm_epsilon)
        tied = getattr(cfg, "tie_word_embeddings", True)
        self.lm_head = Linear(self.wte) if tied else Linear.from_checkpoint(weights, "lm_head")

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches) -> torch.Tensor:
        h = F.embedding(input_ids, self.wte) + F.embedding(positions, self.wpe)
        for block, (k_cache, v_cache) in zip(self.blocks, kv_caches):
            h = block.forward(h, meta, k_cache, v_cache)
        return F.layer_norm(h, (h.shape[-1],), *self.ln_f[:2], self.ln_f[2])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
