"""Dense layers with weights prepacked once for oneDNN on CPU (20-40% faster than F.linear at decode sizes)."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from roseinfer.checkpoint import Checkpoint
from roseinfer.config import BF16_GEMM_CHOICES, cache_dir, env_choice
from roseinfer.kernels import dequantize_rows, quantize_rows

log = logging.getLogger(__name__)
_warned_no_bf16 = False
_float32_for_bfloat16 = 0  # bfloat16 layers built in this process that multiply in float32


def _can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight reordered for oneDNN, or None where this build or this CPU cannot run it packed."""
    if not _can_pack(weight):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
    except RuntimeError:  # an op this torch build lacks, or bf16 on a CPU without bf16 support
        return None


def float32_for_bfloat16() -> int:
    """How many bfloat16 layers built in this process so far multiply in float32: their outputs' last bits differ
    from a bfloat16 GEMM's, so a seeded job's text may too (read before and after a model's build)."""
    return _float32_for_bfloat16


def _warn_float32_fallback(why: str) -> None:
    global _warned_no_bf16, _float32_for_bfloat16
    _float32_for_bfloat16 += 1
    if not _warned_no_bf16:
        _warned_no_bf16 = True
        log.warning(
            "%s: bfloat16 layers multiply in float32 (the results of a bfloat16 GEMM with float32 sums; the "
            "weights take float32 memory)",
            why,
        )


@functools.cache
def bfloat16_gemm_is_slower() -> bool:
    """Whether oneDNN's packed bfloat16 GEMM is slower than its float32 one on this CPU (timed once, on a layer of
    a small model's size). So it is where AVX-512 BF16's dot products issue at half the rate of float32 FMAs and
    no AMX tiles are exposed (an Intel Xeon in a VM, seen: 150 vs 198 GFLOP/s); where the CPU has AMX, or on AMD
    Zen 4, bfloat16 is the faster. The first timing on a machine is kept (``_kept_gemm_choice``) for every later
    process; ``ROSEINFER_BF16_GEMM=bfloat16|float32`` decides instead of it."""
    forced = env_choice("ROSEINFER_BF16_GEMM", BF16_GEMM_CHOICES)
    if forced is not None:
        return forced == "float32"
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    # Timed once per machine, not per process: where the two are near (a loaded machine's timing picks either),
    # a restarted worker took the other and wrote other text for the same seeded job (its last bits differ).
    kept = _kept_gemm_choice()
    if (choice := _read_choice(kept)) is not None:
        return choice == "float32"
    timed = "float32" if _time_bfloat16_gemm() else "bfloat16"
    return _write_choice(kept, timed) == "float32"  # (the first kept: two timed at once take the same)


def _kept_gemm_choice() -> Path:
    """Where this machine's timed choice is kept (the cache folder): one file per CPU, torch version and thread
    count. Deleted, the next start times it again."""
    from roseinfer.cpu_features import flags, model_name

    key = "|".join((model_name(), " ".join(sorted(flags())), torch.__version__, str(torch.get_num_threads())))
    return cache_dir() / "bf16-gemm" / hashlib.sha256(key.encode()).hexdigest()[:16]


def _read_choice(path: Path) -> str | None:
    try:
        choice = path.read_text().strip()
    except OSError:
        return None
    return choice if choice in BF16_GEMM_CHOICES else None


def _write_choice(path: Path, choice: str) -> str:
    """``choice`` kept at ``path`` unless one is there already, and the choice kept there (``choice`` where the
    folder cannot be written): written whole, then linked in only where none is (a rename replaced the first)."""
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(choice)
        os.link(temporary, path)
    except FileExistsError:
        pass
    except OSError:
        return choice
    finally:
        temporary.unlink(missing_ok=True)
    return _read_choice(path) or choice


def _time_bfloat16_gemm() -> bool:
    """Whether the bfloat16 GEMM is the slower by more than 15%, timed interleaved on a small model's layer."""
    weight, x = torch.randn(1024, 1024), torch.randn(128, 1024)
    try:
        runs = [(_pack(weight), x), (_pack(weight.bfloat16()), x.bfloat16())]
    except RuntimeError:
        return False
    if any(packed is None for packed, _ in runs):
        return False
    pointwise = torch.ops.mkldnn._linear_pointwise
    best = _best_times([lambda p=p, i=i: pointwise(i, p, None, "none", [], "") for p, i in runs])
    return best[0] < 0.85 * best[1]


def _best_times(runs: list, repeats: int = 8, budget_s: float = 0.3) -> list[float]:
    """Seconds of each call in ``runs`` at its best, run interleaved: a busy machine slows them all alike. Past
    ``budget_s``, two rounds are enough: an int8 GEMM without VNNI took 0.12 s a call, 20 times the float one."""
    best = [float("inf")] * len(runs)
    started = time.perf_counter()
    for round_ in range(repeats):
        if round_ >= 2 and time.perf_counter() - started > budget_s:
            break
        for i, run in enumerate(runs):
            start = time.perf_counter()
            run()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def int8_gemm_speedup(dtype: torch.dtype = torch.float32) -> float:
    """How many times faster ``torch._int_mm`` multiplies than the float layer of ``dtype`` it would replace (oneDNN's
    packed GEMM in that dtype, or in float32 where bfloat16's is the slower), on a layer of a small model's size, the
    best of interleaved runs. About 3 on a Xeon with VNNI and no AMX; where AMX runs bfloat16, maybe below 1. Timed
    once a process for each dtype and thread count: an int8 engine built again does not wait for it again."""
    return _int8_gemm_speedup(dtype, torch.get_num_threads())


@functools.cache
def _int8_gemm_speedup(dtype: torch.dtype, threads: int) -> float:
    layer, x = Linear(torch.randn(1024, 1024).to(dtype)), torch.randn(128, 1024).to(dtype)
    wq = torch.randint(-127, 128, (1024, 1024), dtype=torch.int8)
    xq = torch.randint(-127, 128, (128, 1024), dtype=torch.int8)
    best = _best_times([lambda: layer(x), lambda: torch._int_mm(xq, wq.t())])
    return best[0] / best[1]


class Linear:
    """``y = x @ weight.T + bias`` for x of shape [T, in].

    A bfloat16 layer on a CPU whose oneDNN cannot pack bfloat16 (no AVX-512) would fall back to PyTorch's
    scalar bfloat16 GEMM, ~8x slower than float32 there; where it can, but slower than in float32
    (``bfloat16_gemm_is_slower``), the same holds. It multiplies in float32 instead: products of
    bfloat16 values are exact in float32, so with the output rounded back to bfloat16 the result is that of
    a bfloat16 GEMM with float32 accumulation, as oneDNN computes it where it can.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        self.out_features = weight.shape[0]
        self.out_dtype: torch.dtype | None = None  # set when the GEMM runs in float32 for a bfloat16 layer
        # int8 weights (one scale per output row) once ``quantize_int8`` ran: the GEMM is int8, its sums int32
        self._qweight: torch.Tensor | None = None
        self._qscale: torch.Tensor | None = None
        self._smooth: torch.Tensor | None = None  # 1 / SmoothQuant's factor per input channel
        self._packed = _pack(self.weight)
        if _can_pack(self.weight) and self.weight.dtype == torch.bfloat16:
            if self._packed is None:
                self._run_in_float32("oneDNN cannot multiply bfloat16 matrices on this CPU")
            elif bfloat16_gemm_is_slower():
                self._run_in_float32("oneDNN's bfloat16 GEMM is slower than its float32 one on this CPU")

    def _run_in_float32(self, why: str) -> None:
        _warn_float32_fallback(why)
        self.out_dtype = self.weight.dtype
        self.weight = self.weight.float()
        self.bias = None if self.bias is None else self.bias.float()
        self._packed = _pack(self.weight)

    def quantize_int8(self, input_max: torch.Tensor | None = None, alpha: float = 0.5) -> None:
        """Multiply in int8 from now on (``quantization="int8"``): the weight rounded once to int8 with one scale
        per output row, each call's input rows to int8 with one scale per row (symmetric both), their products
        summed exactly in int32 (``torch._int_mm``: VNNI or AMX dot products) and scaled back, as SGLang's
        ``int8dq`` and vLLM's W8A8 with dynamic per-token scales. ``input_max``: each input channel's largest
        magnitude seen (calibration); SmoothQuant's factors then move part of the inputs' outlier channels into
        the weight (``alpha`` of it), which rounds them with less error than a row's scale set by one outlier."""
        weight = self.weight.float()
        self._smooth = None
        if input_max is not None:
            weight_max = weight.abs().amax(dim=0).clamp(min=1e-5)
            factor = (input_max.float().clamp(min=1e-5).pow(alpha) / weight_max.pow(1 - alpha)).clamp_(min=1e-5)
            weight = weight * factor  # the same product: (x / factor) @ (weight * factor).T
            self._smooth = 1.0 / factor
        scale = weight.abs().amax(dim=1).clamp_(min=1e-12) / 127
        self._qweight = torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        self._qscale = scale
        self.out_dtype = self.out_dtype or self.weight.dtype  # (a bfloat16 layer already run in float32 stays one)
        self.bias = None if self.bias is None else self.bias.float()
        self.weight = self._packed = None  # its memory goes back: a quarter of float32's stays, as int8

    def drop_unpacked_weight(self) -> None:
        """Let go of the weight where oneDNN's packed copy is what runs: two copies of every weight were kept (a
        1.5B model's in float32: 6 GB twice). After this the layer can no longer be quantized or repacked."""
        if self._packed is not None:
            self.weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._qweight is not None:
            return self._int8_matmul(x)
        if self.out_dtype is not None:
            return self._matmul(x.float()).to(self.out_dtype)
        return self._matmul(x)

    def _int8_matmul(self, x: torch.Tensor) -> torch.Tensor:
        xq, row_scale = quantize_rows(x, self._smooth)
        return dequantize_rows(torch._int_mm(xq, self._qweight.t()), row_scale, self._qscale, self.bias, self.out_dtype)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    @classmethod
    def from_checkpoint(
        cls, weights: Checkpoint, name: str, out_features: int, in_features: int, bias: bool | None = None
    ) -> Linear:
        """The layer ``name`` of a checkpoint: its ``.weight`` and its ``.bias`` (``bias``: True, the config says
        it has one, which must be there; False, it has none, whatever the checkpoint holds; None: where there)."""
        return cls.fused(weights, [name], [out_features], in_features, bias)

    @classmethod
    def fused(
        cls, weights: Checkpoint, names: list[str], out_features: list[int], in_features: int, bias: bool | None = None
    ) -> Linear:
        """One layer for projections that read the same input (q/k/v, gate/up): one matmul, not several."""
        parts = [weights.get(f"{name}.weight", (n, in_features)) for name, n in zip(names, out_features)]
        read = weights.get if bias else weights.optional
        biases = [read(f"{name}.bias", (n,)) if bias is not False else None for name, n in zip(names, out_features)]
        weight = parts[0] if len(parts) == 1 else torch.cat(parts)
        if all(b is None for b in biases):
            return cls(weight)
        bias = torch.cat([b if b is not None else weight.new_zeros(n) for b, n in zip(biases, out_features)])
        return cls(weight, bias)
