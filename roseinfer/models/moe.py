"""Mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks each token's top k experts, whose SwiGLU
outputs are summed with the router's weights, expert by expert in ascending order as transformers adds them; Qwen2-MoE
adds a shared expert every token runs, weighed by a sigmoid gate of its own."""

from __future__ import annotations

from collections.abc import Callable

import torch

from roseinfer.checkpoint import Checkpoint
from roseinfer.models.linear import Linear

# model type -> (the block's name under a layer, the experts' gate, up and down names, the weights' count key)
_LAYOUTS = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"), "num_local_experts"),
    "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"), "num_experts"),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"), "num_experts"),
}
MOE_MODEL_TYPES = tuple(_LAYOUTS)


def is_sparse_layer(cfg, index: int) -> bool:
    """Whether layer ``index`` of a model has experts (Qwen2- and Qwen3-MoE may keep dense MLPs in some layers)."""
    if cfg.model_type == "mixtral":
        return True
    if cfg.model_type in ("qwen2_moe", "qwen3_moe"):
        sparse_step = (index + 1) % cfg.decoder_sparse_step == 0
        return cfg.num_experts > 0 and index not in (cfg.mlp_only_layers or []) and sparse_step
    return False


class SparseMoe:
    def __init__(self, weights: Checkpoint, layer_prefix: str, cfg, act: Callable[[torch.Tensor], torch.Tensor]):
        block, (gate, up, down), count_key = _LAYOUTS[cfg.model_type]
        prefix = f"{layer_prefix}.{block}"
        hidden = cfg.hidden_size
        inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
        self.num_experts, self.top_k = getattr(cfg, count_key), cfg.num_experts_per_tok
        self.router = Linear.from_checkpoint(weights, f"{prefix}.gate", self.num_experts, hidden)
        self.experts = [
            (
                Linear.fused(
                    weights, [f"{prefix}.experts.{e}.{gate}", f"{prefix}.experts.{e}.{up}"], [inter] * 2, hidden
                ),
                Linear.from_checkpoint(weights, f"{prefix}.experts.{e}.{down}", hidden, inter),
            )
            for e in range(self.num_experts)
        ]
        self.act = act  # of [gate | up] rows
        # Mixtral renormalizes the top k's probabilities and weighs in float32; Qwen's renormalize where their
        # configs say, and weigh in the model's dtype.
        self.normalize = cfg.model_type == "mixtral" or bool(getattr(cfg, "norm_topk_prob", False))
        self.weigh_in_dtype = cfg.model_type != "mixtral"
        self.shared = None  # Qwen2-MoE's shared expert: (its gate/up and down layers)
        self.shared_expert_gate = None  # its sigmoid gate's layer (by this name, int8 leaves it in float)
        shared_inter = getattr(cfg, "shared_expert_intermediate_size", 0) if cfg.model_type == "qwen2_moe" else 0
        if shared_inter:
            names = [f"{prefix}.shared_expert.{gate}", f"{prefix}.shared_expert.{up}"]
            self.shared = (
                Linear.fused(weights, names, [shared_inter] * 2, hidden),
                Linear.from_checkpoint(weights, f"{prefix}.shared_expert.{down}", hidden, shared_inter),
            )
            self.shared_expert_gate = Linear.from_checkpoint(weights, f"{prefix}.shared_expert_gate", 1, hidden)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(x), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weigh_in_dtype:
            weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in torch.unique(chosen).tolist():  # ascending: each token's experts added in transformers' order
            tokens, slot = torch.where(chosen == e)
            gate_up, down = self.experts[e]
            y = down(self.act(gate_up(x[tokens])))
            out.index_add_(0, tokens, (y * weights[tokens, slot, None]).to(x.dtype))
        if self.shared is not None:
            gate_up, down = self.shared
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * down(self.act(gate_up(x)))
        return out
