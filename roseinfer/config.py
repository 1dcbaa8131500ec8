"""Engine settings: one plain dataclass, checked once at start-up."""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_MODEL = "smollm2-135m-instruct"
_DTYPES = ("float32", "bfloat16", "float16")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(value: int | float | str) -> int:
    """Bytes from 1073741824, "1GiB", "512MiB", "2G"."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(f"cannot read {value!r} as a size; write e.g. 1GiB, 512MiB or a number of bytes")
    unit = (match.group(2) or "").lower().removesuffix("b")
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "float32"
    device: str = "cpu"
    tokenizer: str | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    # 8, not 16: prefix caching shares whole blocks, and chat templates' system prompts are short (SmolLM2's
    # is 24 tokens: 16 of them shared at 16, all 24 at 8).
    block_size: int = 8
    # Memory for the KV cache pool; "auto" is 1 GiB on CPU and half the free GPU memory on CUDA.
    kv_cache_memory: int | str = "auto"
    enable_prefix_caching: bool = True
    seed: int = 0
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.dtype == "float16" and self.device == "cpu":
            raise ValueError("float16 is for GPUs; on CPU use float32 or bfloat16")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len!r}")
        if self.kv_cache_memory != "auto":
            self.kv_cache_memory = parse_size(self.kv_cache_memory)
            if self.kv_cache_memory <= 0:
                raise ValueError("kv_cache_memory must be positive")
