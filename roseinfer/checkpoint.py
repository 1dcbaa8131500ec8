"""A model folder's weights, read tensor by tensor from its safetensors (or PyTorch) files.

The engine builds its layers from these tensors, as vLLM does, rather than from a transformers model: building one
imports its modeling code (seconds of torch._dynamo, torch.distributed and scipy on a small CPU, at every worker
start) and holds a second copy of every weight the engine fuses while it loads.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from roseinfer.config import ConfigError

# (a single file, the index of a sharded checkpoint), looked for in transformers' order: each single file before its
# index (a folder saved again in the other layout keeps both, and transformers loads the single file), safetensors
# before PyTorch's.
WEIGHT_FORMATS = (
    ("model.safetensors", "model.safetensors.index.json"),
    ("pytorch_model.bin", "pytorch_model.bin.index.json"),
)


class CheckpointError(ConfigError):
    """A checkpoint the engine cannot serve: no weights, a file it cannot read, or a tensor its config calls for
    that it lacks (refused, never left random as transformers leaves it)."""


def weight_files(folder: Path, opened: dict[Path, Any]) -> dict[str, Path]:
    """Each tensor's name -> the file that holds it: from the folder's index when it is sharded. A single file is
    opened to list its names; ``opened`` (by path) keeps it open for the tensors' reads."""
    for file_name, index_name in WEIGHT_FORMATS:
        path = folder / file_name
        if path.is_file():
            opened[path] = _open(path)
            names = opened[path].keys()  # (a safetensors handle has keys() alone)
            return {name: path for name in names}
        index = folder / index_name
        if index.is_file():
            files = {name: folder / file for name, file in sharded_files(index).items()}
            for path in set(files.values()) - {p for p in files.values() if p.is_file()}:
                raise CheckpointError(f"{index} names {path.name}, which is not there")
            return files
    files, indexes = zip(*WEIGHT_FORMATS)
    raise FileNotFoundError(
        f"{folder} holds no weights: no {', '.join(files)} nor a sharded index ({', '.join(indexes)})"
    )


def sharded_files(index: Path) -> dict[str, str]:
    """A sharded checkpoint's index: each tensor's name -> the name of the file that holds it."""
    return _read(index, lambda: dict(json.loads(index.read_text())["weight_map"]))


def _read(path: Path, read: Any) -> Any:
    try:
        return read()
    except Exception as exc:  # safetensors' and torch's own errors, a truncated download, a bad index
        raise CheckpointError(f"cannot read {path}: {type(exc).__name__}: {exc}") from None


def _open(path: Path) -> Any:
    """A file's tensors by name, read on access: safetensors mapped, a PyTorch file unpickled as data only."""
    if path.suffix == ".safetensors":
        return _read(path, lambda: safe_open(path, framework="pt"))
    # weights_only: a checkpoint is data, never code to run; mmap (zip files, torch >= 1.6): only what is asked for.
    return _read(path, lambda: torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path)))


class Checkpoint:
    """The tensors of one model folder, each read when asked for, in the engine's dtype and on its device."""

    def __init__(self, folder: str | Path, dtype: torch.dtype, device: str | torch.device) -> None:
        self.folder = Path(folder)
        self.dtype = dtype
        self.device = torch.device(device)
        self._open: dict[Path, Any] = {}
        self._files = weight_files(self.folder, self._open)
        self._model_prefix = "model."

    def read_text_part(self, prefixes: tuple[str, ...]) -> None:
        """Reads ``model.*`` names under the first of ``prefixes`` the checkpoint holds: the text model of a
        vision-language checkpoint, whose other tensors (the vision tower) are never read."""
        found = next((p for p in prefixes if any(n.startswith(p) for n in self._files)), None)
        if found is None:
            raise CheckpointError(f"its checkpoint has no text model's tensors (none under {' or '.join(prefixes)})")
        self._model_prefix = found

    def _stored(self, name: str) -> str:
        return self._model_prefix + name[len("model.") :] if name.startswith("model.") else name

    def __contains__(self, name: str) -> bool:
        return self._stored(name) in self._files

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor ``name``, of the ``shape`` the config calls for: a mismatch (another model's config beside
        these weights) is refused here, not found by the first step of every request."""
        name = self._stored(name)
        if name not in self._files:
            raise CheckpointError(
                f"its checkpoint has no tensor {name!r}, which its config calls for (a checkpoint of another "
                "architecture, or an incomplete download)"
            )
        path = self._files[name]
        if path not in self._open:
            self._open[path] = _open(path)
        source = self._open[path]
        tensor = _read(path, lambda: source[name] if isinstance(source, dict) else source.get_tensor(name))
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(
                f"its checkpoint's {name!r} has shape {list(tensor.shape)}, where its config calls for {list(shape)}"
            )
        return tensor.to(device=self.device, dtype=self.dtype)

    def optional(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """A tensor the checkpoint may leave out (a bias its config has none of)."""
        return self.get(name, shape) if name in self else None
