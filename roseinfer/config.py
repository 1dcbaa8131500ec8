"""Engine settings: one plain dataclass, checked once at start-up, and the one place engine options are declared.

Every field carries its help text. The worker's settings (``ROSEINFER_*`` variables), the command-line flags of
``roseinfer worker``, ``roseinfer bench`` and ``roseinfer generate`` are all derived from these fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "smollm2-135m-instruct"
# A tiny random Llama with a small tokenizer (built once, in a second, no download): steps of milliseconds, as a
# GPU's, for trying the queue's machinery or timing it (``--model tiny`` for every command).
TINY_MODEL = "tiny"
# Environment variables the engine reads itself (EngineConfig fields come from flags or the worker's settings).
ENGINE_ENV_VARS = (
    "ROSEINFER_CACHE_DIR",
    "ROSEINFER_CPU_KERNELS",
    "ROSEINFER_BENCH_PROMPTS",
    "ROSEINFER_MALLOC_TUNING",
    "ROSEINFER_BF16_GEMM",
)
DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("int8",)
# Past these a value is a slip, said before the model loads (after it, the sizes built from them hung or ran out of
# memory): vLLM's largest block is 256, its batches run to a few thousand sequences.
MAX_NUM_SEQS = 65536
MAX_BATCHED_TOKENS = 1 << 24
MAX_BLOCK_SIZE = 1024
MAX_NUM_THREADS = 4096
MAX_KV_CACHE_BYTES = 1 << 50
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(b|[kmgt]i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(value: int | float | str) -> int:
    """Bytes from 1073741824, "1GiB", "512MiB", "2G"."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ValueError(f"cannot read {value!r} as a size; write e.g. 1GiB, 512MiB or a number of bytes")
        return int(value)
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(f"cannot read {value!r} as a size; write e.g. 1GiB, 512MiB or a number of bytes")
    unit = (match.group(2) or "").lower().removesuffix("b")
    return int(float(match.group(1)) * _UNITS[unit])


_SWITCH = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def _env_word(name: str) -> str | None:
    """A variable's value, trimmed and in lower case; None where it is unset or empty."""
    return os.environ.get(name, "").strip().lower() or None


def env_switch(name: str, default: bool) -> bool:
    """An on/off variable the engine reads itself: 1/0, true/false, yes/no, on/off in any case; unset or empty, the
    default. Any other value is refused (``=false`` meant off, and kept the default, on)."""
    word = _env_word(name)
    if word is not None and word not in _SWITCH:
        raise ConfigError(f"{name}={os.environ[name]!r}: write 1 or 0 (or true/false, yes/no, on/off)")
    return default if word is None else _SWITCH[word]


def env_choice(name: str, choices: tuple[str, ...]) -> str | None:
    """One of ``choices`` from a variable the engine reads itself (None where unset or empty); any other value is
    refused, naming them."""
    word = _env_word(name)
    if word is not None and word not in choices:
        raise ConfigError(f"{name}={os.environ[name]!r}: write one of {', '.join(choices)}, or leave it unset")
    return word


BF16_GEMM_CHOICES = ("bfloat16", "float32")


def check_engine_env() -> None:
    """The engine's own variables, read at its start whatever its device and dtype: each is read only where it
    applies (a GPU reads none), and a misspelt value there would wait, silent, for the machine where it does."""
    env_switch("ROSEINFER_CPU_KERNELS", True)
    env_switch("ROSEINFER_MALLOC_TUNING", True)
    env_choice("ROSEINFER_BF16_GEMM", BF16_GEMM_CHOICES)


def output_file(text: str) -> str:
    """An argparse type for a file a command writes at its end (a benchmark's --json): its folder must exist and it
    must not be one, said at once (found at the end, the whole run's figures were lost to a traceback)."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; name a file in it")
    if not path.resolve().parent.is_dir():
        raise argparse.ArgumentTypeError(f"no folder {path.resolve().parent} to write {path.name} in")
    return text


def cache_dir() -> Path:
    """Where converted models and compiled kernels are kept (``ROSEINFER_CACHE_DIR``; set empty, as any engine variable,
    it is unset: ``Path("")`` put them in the working folder, in Docker beside the app, not on its volume)."""
    given = os.environ.get("ROSEINFER_CACHE_DIR", "").strip()
    return Path(given).expanduser() if given else Path.home() / ".cache" / "roseinfer"


def option(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A config field with the help text every derived flag and setting shows."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class EngineConfig:
    model: str = option(DEFAULT_MODEL, "model: the default name, a transformers folder, a .gguf file or a hub id")
    dtype: str = option("float32", "numeric type of weights, activations and KV cache", DTYPES)
    device: str = option("cpu", "cpu, cuda or cuda:N")
    tokenizer: str | None = option(None, "tokenizer folder or hub id, when not the model's own")
    chat_template: str | None = option(None, "a chat template in place of the model's own: a Jinja file, or its text")
    max_num_seqs: int = option(128, "most requests in the running batch at once")
    max_num_batched_tokens: int = option(2048, "token budget of one step (decodes plus prefill chunks)")
    max_model_len: int | None = option(None, "context length (prompt plus output); default: the model's")
    # 8, not 16: prefix caching shares whole blocks, and chat templates' system prompts are short (SmolLM2's
    # is 24 tokens: 16 of them shared at 16, all 24 at 8).
    block_size: int = option(8, "tokens per KV cache block (prefix caching shares whole blocks)")
    kv_cache_memory: int | str = option(
        "auto",
        "memory for the KV cache, e.g. 4GiB; auto: 1 GiB on CPU, half the free GPU memory on CUDA, or less "
        "where max_num_seqs requests at max_model_len need less",
    )
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of prompt prefixes seen before")
    enforce_eager: bool = option(False, "on CUDA, run decode steps eagerly instead of replaying CUDA graphs")
    seed: int = option(0, "seed of the shared generator (requests with their own seed use theirs)")
    num_threads: int | None = option(None, "threads for the math (torch.set_num_threads); default: every core")
    quantization: str | None = option(
        None,
        "int8: the dense layers multiply in int8 on CPU (weights per row, inputs per token, SmoothQuant factors "
        "calibrated at load), faster where the CPU has VNNI (not where AMX runs bfloat16), a little less accurate; "
        "default: none",
        (*QUANTIZATIONS, "none"),
    )
    int8_output_layer: bool = option(
        False, "with quantization int8, the output layer multiplies in int8 too: faster again, a little less accurate"
    )

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")
        for name in ("tokenizer", "chat_template"):  # (a number here failed inside the model's load)
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if not isinstance(self.device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.dtype == "float16" and self.device == "cpu":
            raise ValueError("dtype float16 is for GPUs; on CPU use float32 or bfloat16")
        for name, most in (("max_num_seqs", MAX_NUM_SEQS), ("max_num_batched_tokens", MAX_BATCHED_TOKENS),
                           ("block_size", MAX_BLOCK_SIZE)):  # fmt: skip
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
            if value > most:  # (said now: past the model's load, the sizes built from it ran out of memory or hung)
                raise ValueError(f"{name} is at most {most}, got {value}")
        if self.max_model_len is not None and (not _is_int(self.max_model_len) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.num_threads is not None and (
            not _is_int(self.num_threads) or not 1 <= self.num_threads <= MAX_NUM_THREADS
        ):
            raise ValueError(f"num_threads must be an integer from 1 to {MAX_NUM_THREADS}, got {self.num_threads!r}")
        if not _is_int(self.seed) or not 0 <= self.seed < 2**64:  # (torch's seeds are 64-bit)
            raise ValueError(f"seed must be an integer from 0 to 2**64 - 1, got {self.seed!r}")
        for name in ("enable_prefix_caching", "enforce_eager", "int8_output_layer"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.quantization == "none":  # (the flag's and the variable's word for the default: over an int8 one)
            self.quantization = None
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, or none; got {self.quantization!r}"
            )
        if self.int8_output_layer and self.quantization != "int8":
            raise ValueError("int8_output_layer needs quantization int8")
        if self.quantization == "int8" and self.device != "cpu":
            raise ValueError("quantization int8 runs on CPU (VNNI or AMX int8 dot products); on a GPU use bfloat16")
        if self.kv_cache_memory != "auto":
            try:
                self.kv_cache_memory = parse_size(self.kv_cache_memory)
            except (ValueError, OverflowError) as exc:  # (inf: an OverflowError)
                raise ValueError(f"kv_cache_memory {exc}") from None
            if self.kv_cache_memory <= 0:
                raise ValueError("kv_cache_memory must be positive")
            if self.kv_cache_memory > MAX_KV_CACHE_BYTES:  # (a block list of that many entries grew until OOM)
                raise ValueError(f"kv_cache_memory is at most 1PiB, got {self.kv_cache_memory} bytes")


def quantization_name(config: Any) -> str:
    """``int8``, ``int8+output_layer``, or "" for a float engine (of an ``EngineConfig``, or the worker's settings,
    which hold its fields, "none" as the flag gives it): what a worker's status and a benchmark show."""
    if config.quantization in (None, "none"):  # (the settings' "none" showed in every result's fingerprint)
        return ""
    return config.quantization + ("+output_layer" if config.int8_output_layer else "")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class EngineOption:
    """One engine option as flags and settings see it."""

    name: str
    type: Any  # the annotation, resolved: e.g. int, int | None, int | str
    default: Any
    help: str
    choices: tuple[str, ...] | None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def scalar(self) -> type:
        """The type a command-line string converts to (None dropped from optional types; str for mixed ones)."""
        args = [a for a in typing.get_args(self.type) if a is not type(None)] or [self.type]
        return args[0] if len(args) == 1 else str


def engine_options() -> list[EngineOption]:
    hints = typing.get_type_hints(EngineConfig)
    return [
        EngineOption(f.name, hints[f.name], f.default, f.metadata["help"], f.metadata["choices"])
        for f in dataclasses.fields(EngineConfig)
    ]


def add_engine_arguments(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """One flag per engine option (but those excluded), defaults and help from the config."""
    group = parser.add_argument_group("engine options")
    for opt in engine_options():
        if opt.name in exclude:
            continue
        if opt.scalar is bool:
            group.add_argument(
                opt.flag, action=argparse.BooleanOptionalAction, default=opt.default, help=f"{opt.help} ({opt.default})"
            )
        else:
            group.add_argument(
                opt.flag, type=opt.scalar, default=opt.default, choices=opt.choices, help=f"{opt.help} ({opt.default})"
            )


def set_engine_defaults(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """``parser.set_defaults`` for a command whose defaults differ from the engine's: ``--help`` shows them (it
    showed the engine's, which the command did not use)."""
    for action in parser._actions:
        if action.dest in defaults and action.help and action.help.endswith(f"({action.default})"):
            action.help = f"{action.help[: -len(f'({action.default})')]}({defaults[action.dest]})"
    parser.set_defaults(**defaults)


class ConfigError(ValueError):
    """An engine option given on the command line that the engine refuses."""


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The config from flags added by ``add_engine_arguments`` (options not added keep their defaults)."""
    try:
        return EngineConfig(**{o.name: getattr(args, o.name) for o in engine_options() if hasattr(args, o.name)})
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
