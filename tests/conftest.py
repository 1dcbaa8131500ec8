"""Shared fixtures: tiny random models saved as transformers folders, the default model's folder, and
helpers that run transformers' own greedy generate as the reference."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,  # large weights: decisive logits, so argmax never hangs on rounding
        eos_token_id=None,
        bos_token_id=None,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory) -> str:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=256,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=512,
        initializer_range=0.3,
        eos_token_id=None,
        bos_token_id=None,
    )
    path = tmp_path_factory.mktemp("tiny-gpt2")
    GPT2LMHeadModel(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """The default model as a safetensors folder (converted from its GGUF once, then cached)."""
    from roseinfer.model_loader import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smol_tokenizer(default_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path)


def hf_greedy(
    model_path: str, prompts: list[list[int]], max_new_tokens: int, dtype: str = "float32"
) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time (no padding), new tokens only."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
    out = []
    for ids in prompts:
        with torch.inference_mode():
            gen = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        out.append(gen[0, len(ids) :].tolist())
    return out


@pytest.fixture
def no_kernels(monkeypatch):
    """Run the plain PyTorch twins of the C kernels (the path CUDA takes)."""
    import roseinfer.kernels as kernels

    monkeypatch.setattr(kernels, "_lib", None)
    monkeypatch.setattr(kernels, "_tried", True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> str:
    """A real Redis server of the tests' own, on a free port (none is shared with anything else)."""
    server = os.environ.get("ROSEINFER_TEST_REDIS_SERVER", "redis-server")
    port = _free_port()
    workdir: Path = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    import redis

    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    else:
        proc.kill()
        pytest.skip("could not start redis-server")
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)
