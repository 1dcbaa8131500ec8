"""Tiny random models with a real tokenizer and chat template: for tests and benchmarks that time the machinery
(queue, scheduler, recovery), not the model. They load in about a second."""

from __future__ import annotations

from pathlib import Path


def save_tiny_chat_model(path: str | Path, tokenizer, max_position_embeddings: int = 256) -> str:
    """A 2-layer random Llama over ``tokenizer``'s vocabulary, saved with the tokenizer at ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        initializer_range=0.3,  # decisive logits: greedy output never hangs on rounding
        eos_token_id=None,  # runs to max_tokens
        bos_token_id=None,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
