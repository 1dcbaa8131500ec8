"""A model folder's weights, read tensor by tensor from its safetensors (or PyTorch) files.

The engine builds its layers from these tensors, as vLLM does, rather than from a transformers model: building one
imports its modeling code (seconds of torch._dynamo, torch.distributed and scipy on a small CPU, at every worker
start) and holds a second copy of every weight the engine fuses while it loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from roseinfer.config import ConfigError

_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_SINGLE_FILES = ("model.safetensors", "pytorch_model.bin")


class MissingWeightError(ConfigError):
    """A tensor the model's config calls for that its checkpoint lacks: refused, never left random."""


def weight_files(folder: Path) -> dict[str, Path]:
    """Each tensor's name -> the file that holds it: from the folder's index when it is sharded."""
    for index_name in _INDEXES:
        index = folder / index_name
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: folder / file for name, file in weight_map.items()}
    for file_name in _SINGLE_FILES:
        path = folder / file_name
        if path.is_file():
            return {name: path for name in _names_in(path)}
    raise FileNotFoundError(
        f"{folder} holds no weights: no {', '.join(_SINGLE_FILES)} nor a sharded index ({', '.join(_INDEXES)})"
    )


def _names_in(path: Path) -> list[str]:
    if path.suffix == ".safetensors":
        with safe_open(path, framework="pt") as f:
            return list(f.keys())
    return list(_torch_file(path))


def _torch_file(path: Path) -> dict[str, torch.Tensor]:
    # weights_only: a checkpoint is data, never code to run; mmap: only the tensors asked for are read.
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


class Checkpoint:
    """The tensors of one model folder, each read when asked for, in the engine's dtype and on its device."""

    def __init__(self, folder: str | Path, dtype: torch.dtype, device: str | torch.device) -> None:
        self.folder = Path(folder)
        self.dtype = dtype
        self.device = torch.device(device)
        self._files = weight_files(self.folder)
        self._open: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def get(self, name: str) -> torch.Tensor:
        if name not in self._files:
            raise MissingWeightError(
                f"cannot load model {str(self.folder)!r}: its checkpoint has no tensor {name!r}, which its config "
                "calls for (a checkpoint of another architecture, or an incomplete download)"
            )
        path = self._files[name]
        if path not in self._open:
            self._open[path] = safe_open(path, framework="pt") if path.suffix == ".safetensors" else _torch_file(path)
        source = self._open[path]
        tensor = source[name] if isinstance(source, dict) else source.get_tensor(name)
        return tensor.to(device=self.device, dtype=self.dtype)

    def optional(self, name: str) -> torch.Tensor | None:
        """A tensor the checkpoint may leave out (a bias its config has none of)."""
        return self.get(name) if name in self else None
