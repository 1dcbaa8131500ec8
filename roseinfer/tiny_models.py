"""Tiny random models: for tests and benchmarks that time the machinery (queue, scheduler, recovery), not the
model. They load in about a second and need nothing but transformers and tokenizers: no download, no default model.
"""

from __future__ import annotations

from pathlib import Path

# The chat template of SmolLM2 (ChatML with a default system prompt), so tiny chat models tokenize chats alike.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Text the tiny tokenizer learns its merges from: English words, digits, punctuation; any other text still
# encodes (byte-level), one byte per token.
_CORPUS = [
    "Once upon a time there was a story about a dragon, a wizard and a lighthouse by the sea.",
    "What is the capital of France? The capital of France is Paris.",
    "Write a haiku about autumn leaves. Explain in two sentences why the sky is blue.",
    "Give three tips for learning a new language: read, listen, and speak every day.",
    "The quick brown fox jumps over the lazy dog while seven wizards quietly hex 0123456789 times.",
    "Question number 1: what is 2 + 2? Tell me something about continuous batching in LLM inference.",
]


def build_tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer with ChatML special tokens and a chat template, trained in milliseconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<|endoftext|>"
    )
    fast.pad_token = fast.eos_token
    fast.chat_template = CHAT_TEMPLATE
    return fast


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


def save_tiny_chat_model(path: str | Path, tokenizer=None, max_position_embeddings: int = 256) -> str:
    """A tiny random Llama over ``tokenizer``'s vocabulary (default: ``build_tiny_tokenizer()``), saved with the
    tokenizer and its chat template."""
    tokenizer = tokenizer if tokenizer is not None else build_tiny_tokenizer()
    save_tiny_llama(path, len(tokenizer), max_position_embeddings)
    tokenizer.save_pretrained(path)
    return str(path)


# Real models' shapes, for benchmarks with random weights (``--model random:SHAPE``).
RANDOM_SHAPES = {
    "smollm2-135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
        rope_theta=100000.0,
    ),
    "llama-1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
        rope_theta=500000.0,
    ),
}


def save_random_model(shape: str, dtype: str, path: str | Path) -> str:
    """A random-weight Llama of a named shape (``RANDOM_SHAPES``), saved in ``dtype`` into ``path``; EOS never
    produced (no eos id). Speed does not depend on the weights: benchmarks of real shapes need no download."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape not in RANDOM_SHAPES:
        raise ValueError(f"unknown random shape {shape!r}; known: {', '.join(RANDOM_SHAPES)}")
    config = LlamaConfig(
        **RANDOM_SHAPES[shape], max_position_embeddings=8192, eos_token_id=None, bos_token_id=None, dtype=dtype
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(path)
    return str(path)
