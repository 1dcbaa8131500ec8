"""Fused CPU kernels (``cpu_kernels.c``), built once with the system C compiler and loaded with ctypes.

On CUDA the same ops run as Triton kernels (``triton_kernels``, chosen by ``triton_kernels_for``). Each op has a
plain PyTorch twin with the same semantics: it runs on CUDA without Triton, on dtypes the C code does not
cover, where no compiler is found, or when ``ROSEINFER_CPU_KERNELS=0``. Whether the C code runs is decided
by ``cpu_kernels_for`` alone, for the attention backend and the elementwise ops here alike.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F

from roseinfer.config import cache_dir, env_switch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_kernels.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math", "-shared", "-fPIC"]
_MAX_HEAD_DIM = 512
_lib: ctypes.CDLL | None = None
_tried = False
_triton = None
_triton_tried = False

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# q, q_stride, k, v, kv_stride, k_cache, v_cache, slots, positions, seq_of_token, tables, width, out, tokens, heads,
# kv_heads, head_dim, block_size, scale, window, softcap, bf16
_PAGED_ATTENTION = [_P, _I, _P, _P, _I, *[_P] * 6, _I, _P, *[_I] * 5, _F, _I, _F, ctypes.c_int]
_SIGNATURES = {
    "paged_attention": _PAGED_ATTENTION,
    "add_rms_norm": [_P, _P, _P, _P, _I, _I, _F, ctypes.c_int],
    "rope": [_P, _I, _I, _I, _I, _P, _P, _P, ctypes.c_int],
    "argmax_rows": [_P, _I, _I, _I, ctypes.c_int, _P],
    # logits, rows, vocabulary, row stride, bf16, temperature, top_k, top_p, min_p, u, processors, out
    "sample_rows": [_P, _I, _I, _I, ctypes.c_int, *[_P] * 7],
    # logits, rows, vocabulary, row stride, bf16, tokens, num, max_num, chosen, top_vals, top_ids
    "logprob_rows": [_P, _I, _I, _I, ctypes.c_int, _P, _P, _I, _P, _P, _P],
    # x, rows, vocabulary, row stride, top_k, top_p, min_p, out
    "filter_rows": [_P, _I, _I, _I, *[_P] * 4],
    # x, rows, n, row stride, bf16, smooth, out, row_scale
    "quantize_rows": [_P, _I, _I, _I, ctypes.c_int, _P, _P, _P],
    # acc, rows, n, row_scale, col_scale, bias, out, bf16
    "dequantize_rows": [_P, _I, _I, _P, _P, _P, _P, ctypes.c_int],
}


# What tells CPUs apart in /proc/cpuinfo: x86's "flags"; ARM's "Features" and which core it is (no "flags" line).
_CPU_KEYS = ("flags", "Features", "CPU implementer", "CPU part")


def _cpu_tag() -> str:
    """The build's CPU, in its file name: it is built with -march=native, which another CPU may not run (SIGILL),
    and a cache folder may be shared by machines. Every ARM machine had one tag (its cpuinfo has no "flags"
    line); where nothing is read, the host's name keeps builds apart."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    first: dict[str, str] = {}
    for line in lines:
        first.setdefault(line.split(":", 1)[0].strip(), line)
    what = "\n".join(first[key] for key in _CPU_KEYS if key in first) or f"{platform.processor()} {platform.node()}"
    return hashlib.sha1(f"{platform.machine()}{what}".encode()).hexdigest()[:10]


def _build() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: using the slower PyTorch ops")
        return None
    source = _SOURCE.read_bytes()
    digest = hashlib.sha1(source + " ".join(_FLAGS).encode()).hexdigest()[:12]
    target = cache_dir() / "kernels" / f"cpu_kernels-{digest}-{_cpu_tag()}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        cmd = [compiler, *_FLAGS, str(_SOURCE), "-o", tmp, "-lm"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            os.unlink(tmp)
            log.warning("building the CPU kernels failed, using PyTorch ops:\n%s", result.stderr[-2000:])
            return None
        os.replace(tmp, target)  # atomic: concurrent workers never load half a file
    lib = ctypes.CDLL(str(target))
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = None
    return lib


def cpu_kernels() -> ctypes.CDLL | None:
    """The compiled kernels, or None when they are off or cannot be built."""
    global _lib, _tried
    if not _tried:
        wanted = env_switch("ROSEINFER_CPU_KERNELS", True)  # (a refused value is refused at every call)
        _tried = True
        if wanted:
            try:
                _lib = _build()
            except OSError as exc:
                log.warning("cannot load the CPU kernels (%s): using PyTorch ops", exc)
    return _lib


def cpu_kernels_for(device: torch.device, dtype: torch.dtype) -> ctypes.CDLL | None:
    """The compiled kernels if they run on tensors of this device and dtype, else None (use the PyTorch twins).
    The one place this is decided: the attention backend is chosen with it, and every op below asks it."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    return cpu_kernels()


def triton_kernels_for(device: torch.device):
    """The Triton kernels (``triton_kernels``) on a CUDA device where Triton is installed, else None."""
    global _triton, _triton_tried
    if device.type != "cuda":
        return None
    if not _triton_tried:
        _triton_tried = True
        try:
            from roseinfer.kernels import triton_kernels

            _triton = triton_kernels
        except ImportError as exc:
            log.warning("Triton is not available (%s): the GPU runs the slower PyTorch ops", exc)
    return _triton


def _bf16(t: torch.Tensor) -> int:
    return int(t.dtype == torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, round_first: bool = True) -> torch.Tensor:
    """``weight * rmsnorm(x)`` over the last dim, in float32, in PyTorch ops. ``round_first``: Llama's order, the
    normed rows rounded to x's dtype before the product; else Gemma's and OLMo 2's, the product in float32 (a float32
    ``weight``) rounded after it."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype) if round_first else (y * weight).to(x.dtype)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``h += delta`` in place (when given), then ``weight * rmsnorm(h)`` as transformers computes it."""
    lib = cpu_kernels_for(h.device, h.dtype)
    if lib is None and (tk := triton_kernels_for(h.device)) is not None and h.is_contiguous():
        return tk.add_rms_norm(h, delta, weight, eps)
    if lib is None or not h.is_contiguous() or (delta is not None and not delta.is_contiguous()):
        if delta is not None:
            h.add_(delta)
        return rms_norm(h, weight, eps)
    out = torch.empty_like(h)
    lib.add_rms_norm(
        h.data_ptr(),
        None if delta is None else delta.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        h.shape[0],
        h.shape[1],
        eps,
        _bf16(h),
    )
    return out


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> None:
    """Rotary embedding in place on x: [T, heads, D] (rows may be strided); cos/sin: [max_pos, D] tables."""
    lib = cpu_kernels_for(x.device, x.dtype)
    heads_packed = x.stride(2) == 1 and x.stride(1) == x.shape[2]
    if lib is None and (tk := triton_kernels_for(x.device)) is not None and heads_packed:
        tk.rope_(x, cos, sin, positions)
        return
    if lib is None or x.stride(2) != 1 or x.stride(1) != x.shape[2] or x.shape[2] > _MAX_HEAD_DIM:
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        x.copy_(x * c + rotate_half(x) * s)
        return
    lib.rope(
        x.data_ptr(),
        x.stride(0),
        x.shape[0],
        x.shape[1],
        x.shape[2],
        cos.data_ptr(),
        sin.data_ptr(),
        positions.data_ptr(),
        _bf16(x),
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for rows [gate | up]. On CPU PyTorch's own two ops: its vectorized exp beats a fused C loop
    (64 x 1536: 36 against 83 us at float32, 47 against 88 at bfloat16), and they are what transformers runs."""
    if (tk := triton_kernels_for(gate_up.device)) is not None and gate_up.is_contiguous():
        return tk.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def quantize_rows(x: torch.Tensor, smooth: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 layer's input rows [T, n] (times ``smooth`` where given) as int8, each scaled so its largest
    magnitude is 127 and rounded half to even, and the scales back ([T, 1], float32)."""
    lib = cpu_kernels_for(x.device, x.dtype)
    if lib is None or x.dim() != 2 or x.stride(1) != 1:
        x = x.float() if smooth is None else x.float() * smooth
        per_row = x.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-12)
        # (each op one IEEE rounding, as the C code's: ``127 / t`` is a reciprocal and a product in PyTorch)
        xq = (x * per_row.reciprocal().mul_(127)).round_().clamp_(-127, 127).to(torch.int8)
        return xq, per_row * (1 / 127)
    rows, n = x.shape
    out = torch.empty(rows, n, dtype=torch.int8)
    scale = torch.empty(rows, 1, dtype=torch.float32)
    smooth_ptr = None if smooth is None else smooth.data_ptr()
    lib.quantize_rows(x.data_ptr(), rows, n, x.stride(0), _bf16(x), smooth_ptr, out.data_ptr(), scale.data_ptr())
    return out, scale


def dequantize_rows(
    acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """An int8 layer's int32 sums [T, n] as ``dtype``: ``acc * row_scale * col_scale (+ bias)``."""
    lib = cpu_kernels_for(acc.device, dtype)
    if lib is None or not acc.is_contiguous():
        y = torch.mul(acc, row_scale).mul_(col_scale)
        if bias is not None:
            y += bias
        return y.to(dtype)
    out = torch.empty(acc.shape, dtype=dtype)
    bias_ptr = None if bias is None else bias.data_ptr()
    rows, n = acc.shape
    lib.dequantize_rows(
        acc.data_ptr(), rows, n, row_scale.data_ptr(), col_scale.data_ptr(), bias_ptr, out.data_ptr(), _bf16(out)
    )
    return out


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's greedy token: ``logits.float().argmax(-1)``, without the float32 copy on CPU."""
    lib = cpu_kernels_for(logits.device, logits.dtype)
    if lib is None or logits.dim() != 2 or logits.stride(1) != 1 or logits.shape[1] == 0:
        return logits.float().argmax(dim=-1).tolist()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    rows, n = logits.shape
    lib.argmax_rows(logits.data_ptr(), rows, n, logits.stride(0), _bf16(logits), out.data_ptr())
    return out.tolist()


def can_sample_rows(logits: torch.Tensor) -> bool:
    """Whether ``sample_rows`` runs on these logits (else PyTorch's ops sample them)."""
    return cpu_kernels_for(logits.device, logits.dtype) is not None and logits.dim() == 2 and logits.stride(1) == 1


@dataclass
class RowProcessors:
    """What each row's sampling parameters do to its logits before the temperature (``Sampler``'s processors, in
    their order): a list per row of each kind; an empty list does nothing."""

    bias: list[dict[int, float]]  # logit_bias
    history: list[list[int] | torch.Tensor]  # prompt and output tokens, where the repetition penalty is not 1
    repetition: list[float]
    output: list[list[int]]  # output tokens, where a frequency or presence penalty is set
    frequency: list[float]
    presence: list[float]
    banned: list[list[int]]  # tokens at -inf (min_tokens not reached)


class _Processors(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_void_p)
        for name in (
            "bias_ids",
            "bias",
            "bias_off",
            "history",
            "history_off",
            "repetition",
            "output",
            "output_off",
            "frequency",
            "presence",
            "banned",
            "banned_off",
        )
    ]


def _spans(lists: list[list[int]] | list[list[int] | torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Lists (or int64 tensors) as one flat int64 array and the offsets of each in it."""
    offsets = [0]
    for values in lists:
        offsets.append(offsets[-1] + len(values))
    if any(isinstance(values, torch.Tensor) for values in lists):
        flat = torch.cat([torch.as_tensor(values, dtype=torch.int64) for values in lists])
    else:
        flat = torch.tensor([t for values in lists for t in values], dtype=torch.int64)
    return flat, torch.tensor(offsets, dtype=torch.int64)


def sample_rows(
    logits: torch.Tensor,
    temperature: list[float],
    top_k: list[int],
    top_p: list[float],
    min_p: list[float],
    u: torch.Tensor,
    processors: RowProcessors | None = None,
) -> torch.Tensor:
    """Each row's token (int64): its argmax where its temperature is 0, else the draw at ``u`` (float64 in [0, 1))
    from softmax(row / temperature) as top-k, min-p and top-p leave it (0, 0.0, 1.0: off), from the row as
    ``processors`` make it where given. The token is where the kept probabilities' running sum passes u of their
    total, as ``sampler.sample_inverse_cdf`` draws it. Only where ``can_sample_rows``."""
    lib = cpu_kernels_for(logits.device, logits.dtype)
    rows, n = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    args = [
        torch.tensor(temperature, dtype=torch.float32),
        torch.tensor([max(k, 0) for k in top_k], dtype=torch.int64),
        torch.tensor(top_p, dtype=torch.float32),
        torch.tensor(min_p, dtype=torch.float32),
        u.to(torch.float64).contiguous(),
    ]
    per_row = [*args] if processors is None else [*args, *(getattr(processors, f.name) for f in fields(processors))]
    if any(len(values) != rows for values in per_row):  # the kernel would read past the shorter lists
        raise ValueError(f"sample_rows: {rows} rows of logits, but lists of {sorted({len(v) for v in per_row})}")
    held, pr = [], None  # (the arrays the structure points into live until the call returns)
    if processors is not None:
        bias_ids, bias_off = _spans([list(b) for b in processors.bias])
        history, history_off = _spans(processors.history)
        output, output_off = _spans(processors.output)
        banned, banned_off = _spans(processors.banned)
        held = [
            bias_ids,
            torch.tensor([v for b in processors.bias for v in b.values()], dtype=torch.float32),
            bias_off,
            history,
            history_off,
            torch.tensor(processors.repetition, dtype=torch.float32),
            output,
            output_off,
            torch.tensor(processors.frequency, dtype=torch.float32),
            torch.tensor(processors.presence, dtype=torch.float32),
            banned,
            banned_off,
        ]
        pr = ctypes.byref(_Processors(*[t.data_ptr() for t in held]))
    lib.sample_rows(
        logits.data_ptr(), rows, n, logits.stride(0), _bf16(logits), *[a.data_ptr() for a in args], pr, out.data_ptr()
    )
    return out


def filter_rows(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """``sampler.apply_filters`` in the C kernel (float32 rows on CPU): what ``sample_rows`` keeps of each row."""
    lib = cpu_kernels_for(logits.device, torch.float32)
    x = logits.float().contiguous()
    out = torch.empty_like(x)
    args = [
        torch.tensor([max(k, 0) for k in top_k], dtype=torch.int64),
        torch.tensor(top_p, dtype=torch.float32),
        torch.tensor(min_p, dtype=torch.float32),
    ]
    lib.filter_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), *[a.data_ptr() for a in args], out.data_ptr())
    return out


def logprob_rows(
    logits: torch.Tensor, tokens: torch.Tensor, num: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of the model's logits: the log-softmax at ``tokens[row]``, and the ``num[row]`` largest entries of
    the log-softmax and their ids ([rows, max(num)], descending; a row's entries past its num unset). Only where
    ``can_sample_rows``."""
    lib = cpu_kernels_for(logits.device, logits.dtype)
    rows, n = logits.shape
    k = max(num, default=0)
    chosen = torch.empty(rows, dtype=torch.float32)
    top_vals = torch.empty(rows, k, dtype=torch.float32)
    top_ids = torch.empty(rows, k, dtype=torch.int64)
    tokens = tokens.to(torch.int64).contiguous()
    if len(tokens) != rows or len(num) != rows:  # the kernel would read past the shorter one
        raise ValueError(f"logprob_rows: {rows} rows of logits, {len(tokens)} tokens and {len(num)} counts")
    counts = torch.tensor(num, dtype=torch.int64)
    lib.logprob_rows(
        logits.data_ptr(),
        rows,
        n,
        logits.stride(0),
        _bf16(logits),
        tokens.data_ptr(),
        counts.data_ptr(),
        k,
        chosen.data_ptr(),
        top_vals.data_ptr(),
        top_ids.data_ptr(),
    )
    return chosen, top_vals, top_ids
