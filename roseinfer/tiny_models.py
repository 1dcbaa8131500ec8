"""Tiny random models: for tests and benchmarks that time the machinery (queue, scheduler, recovery), not the
model. They load in about a second."""

from __future__ import annotations

from pathlib import Path


def save_tiny_llama(path: str | Path, vocab_size: int = 256, max_position_embeddings: int = 512) -> str:
    """A 2-layer random Llama (4 query heads, 2 KV heads), saved at ``path``; the same weights every time."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        initializer_range=0.3,  # large weights: decisive logits, so greedy argmax never hangs on rounding
        eos_token_id=None,  # runs to max_tokens
        bos_token_id=None,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def save_tiny_chat_model(path: str | Path, tokenizer, max_position_embeddings: int = 256) -> str:
    """A tiny random Llama over ``tokenizer``'s vocabulary, saved with the tokenizer (and its chat template)."""
    save_tiny_llama(path, len(tokenizer), max_position_embeddings)
    tokenizer.save_pretrained(path)
    return str(path)
