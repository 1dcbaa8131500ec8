"""The Llama family (Llama, Mistral, Qwen2, Qwen3, SmolLM2 and 3, Phi-3 and 4, Granite; Mixtral and Qwen3-MoE with
their experts): RMSNorm, rotary positions, grouped K/V heads, SwiGLU."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from roseinfer.attention import AttentionBackend, AttentionMetadata
from roseinfer.checkpoint import Checkpoint
from roseinfer.kernels import add_rms_norm, rms_norm, rope_, silu_mul
from roseinfer.models.linear import Linear
from roseinfer.models.moe import SparseMoe, is_sparse_layer

_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


class LlamaLayer:
    def __init__(
        self,
        weights: Checkpoint,
        prefix: str,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        cfg,
        attn_backend: AttentionBackend,
        rotary: bool = True,
        window: int = 0,
        rotary_dim: int | None = None,
        index: int = 0,
    ) -> None:
        self.attn = attn_backend
        self.rotary = rotary
        self.rotary_dim = rotary_dim or head_dim  # the dims the rotation turns: fewer in a partial one
        self.window = window  # > 0: a sliding-window layer's last keys
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.qk_v_split = [num_heads + num_kv_heads, num_kv_heads]
        self.q_k_split = [num_heads, num_kv_heads]
        hidden = cfg.hidden_size
        self.qkv, self.o_proj = attention_projections(
            weights, prefix, cfg, num_heads * head_dim, num_kv_heads * head_dim
        )
        self.glu = functools.partial(glu, act=activation(cfg.hidden_act))
        self.moe = SparseMoe(weights, prefix, cfg, self.glu) if is_sparse_layer(cfg, index) else None
        if self.moe is None:
            self.gate_up, self.down = mlp_projections(weights, prefix, cfg)
        self.ln1 = (weights.get(f"{prefix}.input_layernorm.weight", (hidden,)), cfg.rms_norm_eps)
        self.ln2 = (weights.get(f"{prefix}.post_attention_layernorm.weight", (hidden,)), cfg.rms_norm_eps)
        qk_norms = cfg.model_type in ("qwen3", "qwen3_moe")
        self.qk_norm = _qk_norm(weights, prefix, num_heads, num_kv_heads, head_dim, cfg) if qk_norms else None
        self.scale = head_dim**-0.5  # (transformers' Llama, Mistral and Qwen2 attention)
        # Granite scales attention, each layer's output into the residual stream, the embedding and the logits.
        self.residual_multiplier = 1.0
        if cfg.model_type == "granite":
            self.scale, self.residual_multiplier = cfg.attention_multiplier, cfg.residual_multiplier

    def forward(self, h, x, rope, meta, k_cache, v_cache, next_norm) -> torch.Tensor:
        """x = this layer's normed input; h, the residual stream, is updated in place; rope: the rotary cos and
        sin tables and each token's row of them. Returns the input of the next layer, normed by ``next_norm`` (its
        weight and eps)."""
        t = h.shape[0]
        qk, v = self.qkv(x).view(t, -1, self.head_dim).split(self.qk_v_split, dim=1)
        if self.qk_norm is not None:
            rms_norm_heads_(qk, *self.qk_norm)
        if self.rotary:  # q and k heads rotated together; a partial rotation (Phi-4-mini) turns their first dims
            rope_(qk if self.rotary_dim == self.head_dim else qk[..., : self.rotary_dim], *rope)
        q, k = qk.split(self.q_k_split, dim=1)
        o = self.attn.forward(q, k, v, k_cache, v_cache, meta, self.scale, self.window)
        x = add_rms_norm(h, self._scaled(self.o_proj(o.view(t, -1))), *self.ln2)
        delta = self.moe(x) if self.moe is not None else self.down(self.glu(self.gate_up(x)))
        return add_rms_norm(h, self._scaled(delta), *next_norm)

    def _scaled(self, delta: torch.Tensor) -> torch.Tensor:
        return delta if self.residual_multiplier == 1.0 else delta * self.residual_multiplier


def _qk_norm(weights: Checkpoint, prefix: str, num_heads: int, num_kv_heads: int, head_dim: int, cfg):
    """Qwen3's RMSNorms over each q and k head, before the rotation: one weight row a head, q's then k's, so both
    norms are one op on the heads as the fused projection lays them out."""
    q = weights.get(f"{prefix}.self_attn.q_norm.weight", (head_dim,))
    k = weights.get(f"{prefix}.self_attn.k_norm.weight", (head_dim,))
    return torch.cat([q.expand(num_heads, head_dim), k.expand(num_kv_heads, head_dim)]), cfg.rms_norm_eps


def biases(cfg) -> tuple[bool, bool, bool]:
    """Whether transformers' model of this family gives its q/k/v, output and MLP projections a bias (its modeling
    code's rule): one it gives must be in the checkpoint (read as zeros, it was wrong text without a word), one it
    does not is not read (transformers leaves it unused)."""
    kind = cfg.model_type
    if kind in ("mistral", "mixtral", "phi3"):
        return False, False, False
    if kind in ("qwen2", "qwen2_moe"):  # q/k/v always (qwen2_moe: unless qkv_bias says not)
        return bool(getattr(cfg, "qkv_bias", True)), False, False
    attention = bool(getattr(cfg, "attention_bias", False))
    return attention, attention, kind in ("llama", "smollm3", "granite") and bool(getattr(cfg, "mlp_bias", False))


def attention_projections(weights: Checkpoint, prefix: str, cfg, q_size: int, kv_size: int) -> tuple[Linear, Linear]:
    """A layer's q/k/v projections as one layer, and its output projection; Phi-3's checkpoints hold q/k/v fused."""
    hidden = cfg.hidden_size
    qkv_bias, o_bias, _ = biases(cfg)
    if cfg.model_type == "phi3":
        qkv = Linear.from_checkpoint(weights, f"{prefix}.self_attn.qkv_proj", q_size + 2 * kv_size, hidden, False)
    else:
        names = [f"{prefix}.self_attn.{p}_proj" for p in "qkv"]
        qkv = Linear.fused(weights, names, [q_size, kv_size, kv_size], hidden, qkv_bias)
    return qkv, Linear.from_checkpoint(weights, f"{prefix}.self_attn.o_proj", hidden, q_size, o_bias)


def mlp_projections(weights: Checkpoint, prefix: str, cfg) -> tuple[Linear, Linear]:
    """A dense MLP's gate and up projections as one layer, and its down projection; Phi-3's hold gate/up fused."""
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    bias = biases(cfg)[2]
    if cfg.model_type == "phi3":
        gate_up = Linear.from_checkpoint(weights, f"{prefix}.mlp.gate_up_proj", 2 * inter, hidden, False)
    else:
        names = [f"{prefix}.mlp.gate_proj", f"{prefix}.mlp.up_proj"]
        gate_up = Linear.fused(weights, names, [inter] * 2, hidden, bias)
    return gate_up, Linear.from_checkpoint(weights, f"{prefix}.mlp.down_proj", hidden, inter, bias)


def output_layer(weights: Checkpoint, cfg, embed: torch.Tensor) -> Linear:
    """The logits' layer: the embedding itself where the config ties them."""
    if getattr(cfg, "tie_word_embeddings", False):
        return Linear(embed)
    return Linear.from_checkpoint(weights, "lm_head", cfg.vocab_size, cfg.hidden_size)


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """transformers' activation of that name; None for SiLU, which ``glu`` fuses with the gating product."""
    return None if name == "silu" else ACT2FN[name]


def glu(gate_up: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    """act(gate) * up of rows [gate | up] (``act`` None: SiLU)."""
    if act is None:
        return silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up


def rms_norm_heads_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place on x: [T, heads, D] (rows may be strided), each head normed over D and scaled by its row of
    ``weight`` [heads, D], as transformers' RMSNorm computes it."""
    x.copy_(rms_norm(x, weight, eps))


def sliding_windows(cfg) -> list[int]:
    """Each layer's sliding window (0: full attention) where transformers slides: as the config's ``layer_types``
    say (Qwen2 and 3: from ``use_sliding_window`` and ``max_window_layers``), else every layer of a Mistral (or a
    Qwen3-MoE: its config keeps ``sliding_window`` only with ``use_sliding_window``) with a ``sliding_window``. A
    Llama config's stray ``sliding_window`` is ignored, as transformers ignores it."""
    window = getattr(cfg, "sliding_window", None) or 0
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        return [window if kind == "sliding_attention" else 0 for kind in layer_types]
    return [window if cfg.model_type in ("mistral", "mixtral", "phi3", "qwen3_moe") else 0] * cfg.num_hidden_layers


def rope_parameters(cfg, layer_type: str | None = None) -> dict:
    """A config's rotary settings; ``layer_type``: of a config whose ``rope_parameters`` differ by layer type
    (Gemma 3's sliding and full layers)."""
    params = getattr(cfg, "rope_parameters", None)  # transformers 5; 4 kept rope_theta and rope_scaling apart
    if params is None:
        params = {"rope_theta": cfg.rope_theta, **(getattr(cfg, "rope_scaling", None) or {})}
    return params if layer_type is None else params[layer_type]


def context_length(cfg) -> int:
    """The tokens a model serves: its ``max_position_embeddings``, or YaRN's original length times its factor where
    that is longer (Qwen's instructions add YaRN to a config and leave the first alone; vLLM derives the same)."""
    params = rope_parameters(cfg)
    if params.get("rope_type", params.get("type")) == "yarn" and params.get("factor"):
        original = params.get("original_max_position_embeddings") or cfg.max_position_embeddings
        return max(cfg.max_position_embeddings, int(original * params["factor"]))
    return cfg.max_position_embeddings


def rope_frequencies(cfg, layer_type: str | None = None, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """The rotary inverse frequencies and the cos/sin scale of a model's config, as transformers' rotary
    embedding computes them (its own functions for the scaled types; LongRoPE's short factors, or its long ones
    for a ``seq_len`` past its original length)."""
    params = rope_parameters(cfg, layer_type)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _STATIC_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; use one of {_STATIC_ROPE_TYPES}")
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        kwargs = {} if layer_type is None else {"layer_type": layer_type}
        if seq_len is not None:
            kwargs["seq_len"] = seq_len
        return ROPE_INIT_FUNCTIONS[rope_type](cfg, None, **kwargs)  # device None: the CPU (transformers 4 needs it)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    return 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


def table_rows(context_length: int, max_len: int | None) -> int:
    """The rotary tables' rows: a position for each token of the engine's longest sequence (``max_len``; None: the
    model's whole context)."""
    return min(context_length, max_len) if max_len else context_length


def rope_tables(
    inv_freq: torch.Tensor, attention_scaling: float, max_positions: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [max_positions, head_dim] in ``dtype``: the same float32 products as transformers' rotary
    embedding, tabulated once for all positions."""
    pos = torch.arange(max_positions, dtype=torch.float32, device=device)
    freqs = torch.outer(pos, inv_freq.float().to(device))
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_scaling).to(dtype), (emb.sin() * attention_scaling).to(dtype)


class Llama:
    context_length = staticmethod(context_length)

    def __init__(self, cfg, weights: Checkpoint, attn: AttentionBackend, max_len: int | None = None) -> None:
        self.num_layers = cfg.num_hidden_layers
        num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        self.vocab_size = cfg.vocab_size
        self.max_position_embeddings = self.context_length(cfg)
        params = rope_parameters(cfg)
        self.long_rope_from = 0
        if params.get("rope_type") == "longrope":
            # transformers rotates a sequence longer than the original length by the long factors, recomputing its
            # cache when it grows past it; the scheduler does the same. The tables hold the short factors' rows,
            # then the long ones'; the runner picks each token's (``rope_row_offset``). (Neither key: the original
            # length is the whole context.)
            original = params.get("original_max_position_embeddings") or getattr(
                cfg, "original_max_position_embeddings", 0
            )
            if original and original < min(self.max_position_embeddings, max_len or self.max_position_embeddings):
                self.long_rope_from = original  # (an engine held within the original length never goes long)
        inv_freq, attention_scaling = rope_frequencies(cfg)  # before the weights: a refused model reads none
        self.embed = weights.get("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
        # SmolLM3 leaves out the rotation in some layers (1 in ``no_rope_layers``: rotated).
        rotary = getattr(cfg, "no_rope_layers", None) if cfg.model_type == "smollm3" else None
        windows = sliding_windows(cfg)
        self.layers = [
            LlamaLayer(
                weights,
                f"model.layers.{i}",
                num_heads,
                self.num_kv_heads,
                self.head_dim,
                cfg,
                attn,
                rotary=True if rotary is None else bool(rotary[i]),
                window=windows[i],
                rotary_dim=2 * inv_freq.numel(),
                index=i,
            )
            for i in range(self.num_layers)
        ]
        self.norm = (weights.get("model.norm.weight", (cfg.hidden_size,)), cfg.rms_norm_eps)
        # The experts a step runs depend on its tokens: no fixed graph can replay them.
        self.cuda_graphs_safe = all(layer.moe is None for layer in self.layers)
        granite = cfg.model_type == "granite"
        self.embedding_multiplier = cfg.embedding_multiplier if granite else 1.0
        self.logits_scaling = cfg.logits_scaling if granite else 1.0
        self.lm_head = output_layer(weights, cfg, self.embed)
        rows = table_rows(self.max_position_embeddings, max_len)
        self.cos, self.sin = rope_tables(inv_freq, attention_scaling, self.long_rope_from or rows, *self.embed_place)
        if self.long_rope_from:
            long_freq, long_scaling = rope_frequencies(cfg, seq_len=self.long_rope_from + 1)
            long_cos, long_sin = rope_tables(long_freq, long_scaling, rows, *self.embed_place)
            self.cos, self.sin = torch.cat([self.cos, long_cos]), torch.cat([self.sin, long_sin])

    @property
    def embed_place(self) -> tuple[torch.dtype, torch.device]:
        return self.embed.dtype, self.embed.device

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches) -> torch.Tensor:
        h = F.embedding(input_ids, self.embed)
        if self.embedding_multiplier != 1.0:
            h = h * self.embedding_multiplier
        x = add_rms_norm(h, None, *self.layers[0].ln1)
        norms = [layer.ln1 for layer in self.layers[1:]] + [self.norm]
        for layer, (k_cache, v_cache), next_norm in zip(self.layers, kv_caches, norms):
            x = layer.forward(h, x, (self.cos, self.sin, positions), meta, k_cache, v_cache, next_norm)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        return logits if self.logits_scaling == 1.0 else logits / self.logits_scaling
