"""GPT-2: learned positions, LayerNorm, fused QKV in Conv1D layout, GELU MLP, tied output layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from roseinfer.attention import AttentionBackend, AttentionMetadata
from roseinfer.checkpoint import Checkpoint
from roseinfer.models.linear import Linear


def _conv1d(weights: Checkpoint, name: str, in_features: int, out_features: int) -> Linear:
    # transformers' Conv1D stores [in, out]; Linear wants [out, in].
    weight = weights.get(f"{name}.weight", (in_features, out_features))
    return Linear(weight.t().contiguous(), weights.get(f"{name}.bias", (out_features,)))


def _layer_norm(weights: Checkpoint, name: str, cfg) -> tuple[torch.Tensor, torch.Tensor, float]:
    width = (cfg.n_embd,)
    return weights.get(f"{name}.weight", width), weights.get(f"{name}.bias", width), cfg.layer_norm_epsilon


class GPT2Block:
    def __init__(
        self, weights: Checkpoint, prefix: str, cfg, head_dim: int, scale: float, attn: AttentionBackend
    ) -> None:
        self.num_heads, self.head_dim, self.scale = cfg.n_head, head_dim, scale
        self.attn = attn
        width, inner = cfg.n_embd, cfg.n_inner or 4 * cfg.n_embd
        self.ln1 = _layer_norm(weights, f"{prefix}.ln_1", cfg)
        self.ln2 = _layer_norm(weights, f"{prefix}.ln_2", cfg)
        self.c_attn = _conv1d(weights, f"{prefix}.attn.c_attn", width, 3 * width)
        self.c_proj = _conv1d(weights, f"{prefix}.attn.c_proj", width, width)
        self.c_fc = _conv1d(weights, f"{prefix}.mlp.c_fc", width, inner)
        self.mlp_proj = _conv1d(weights, f"{prefix}.mlp.c_proj", inner, width)
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
    cuda_graphs_safe = True
    long_rope_from = 0

    @staticmethod
    def context_length(cfg) -> int:
        return cfg.n_positions

    def __init__(self, cfg, weights: Checkpoint, attn: AttentionBackend, max_len: int | None = None) -> None:
        # Saved by GPT2LMHeadModel, the names start "transformer."; the hub's original checkpoint has none.
        root = "transformer." if "transformer.wte.weight" in weights else ""
        self.num_layers = cfg.n_layer
        self.num_kv_heads = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.vocab_size = cfg.vocab_size
        self.max_position_embeddings = self.context_length(cfg)
        self.wte = weights.get(f"{root}wte.weight", (cfg.vocab_size, cfg.n_embd))
        self.wpe = weights.get(f"{root}wpe.weight", (cfg.n_positions, cfg.n_embd))
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
        self.ln_f = _layer_norm(weights, f"{root}ln_f", cfg)
        if getattr(cfg, "tie_word_embeddings", True):
            self.lm_head = Linear(self.wte)
        else:
            self.lm_head = Linear.from_checkpoint(weights, "lm_head", cfg.vocab_size, cfg.n_embd)

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches) -> torch.Tensor:
        h = F.embedding(input_ids, self.wte) + F.embedding(positions, self.wpe)
        for block, (k_cache, v_cache) in zip(self.blocks, kv_caches):
            h = block.forward(h, meta, k_cache, v_cache)
        return F.layer_norm(h, (h.shape[-1],), *self.ln_f[:2], self.ln_f[2])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
