"""GPU kernels in Triton: paged attention straight over the block tables, the K/V store through the slot mapping,
and the fused elementwise ops of a layer (add + RMSNorm, rotary embedding, SiLU-and-mul).

Strides and widths that change from step to step are not specialised on (one compiled kernel serves every step).
Every kernel reads the metadata from device tensors of fixed shape, so a decode step launches the same kernels
with the same arguments whatever its requests' lengths: what CUDA graphs need. Rounding follows transformers'
eager ops (intermediates rounded to the model's dtype where PyTorch rounds them), so float32 output is
token-identical. Imported only where Triton is (PyTorch's CUDA builds ship it); ``TRITON_INTERPRET=1`` runs the
kernels on CPU tensors for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 multiplies in full precision (tf32 would change greedy tokens); 16-bit types use the tensor cores.
    return "ieee" if dtype == torch.float32 else "tf32"


# ----- the K/V store ---------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["k_stride", "v_stride"])
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    k_stride, v_stride,
    WIDTH: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # a padding row of a captured batch: nothing to store
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < WIDTH
    tl.store(k_cache_ptr + slot * WIDTH + offs, tl.load(k_ptr + t * k_stride + offs, mask=mask), mask=mask)
    tl.store(v_cache_ptr + slot * WIDTH + offs, tl.load(v_ptr + t * v_stride + offs, mask=mask), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor):
    """k, v: [T, Hkv, D] (rows may be strided, heads contiguous) into caches laid out [blocks, bs, Hkv, D] at
    ``slots`` ([T] int; negative: skip the row)."""
    t, hkv, d = k.shape
    _store_kv_kernel[(t,)](k, v, k_cache, v_cache, slots, k.stride(0), v.stride(0), WIDTH=hkv * d, BLOCK=_pow2(hkv * d))


# ----- attention over the block table ----------------------------------------------------------------------------
@triton.jit
def _attend(
    q, pos, table_ptr, lo, end, kvh, k_cache_ptr, v_cache_ptr, scale,
    ROWS: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Softmax attention of ``q`` ([ROWS, HEAD_DIM_P]) over keys lo..end-1 of K/V head ``kvh``, read through the
    block table at ``table_ptr`` in tiles of BLOCK_N (online softmax); CAUSAL: row i sees keys <= pos[i]; WINDOW
    > 0: only the last WINDOW of them (without CAUSAL: keys >= end - WINDOW); SOFTCAP > 0: scores capped at
    SOFTCAP * tanh(s / SOFTCAP). A row that sees no key gets zeros."""
    d = tl.arange(0, HEAD_DIM_P)
    d_mask = d < HEAD_DIM
    m_i = tl.zeros([ROWS], tl.float32) - float("inf")
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM_P], tl.float32)
    for start in range((lo // BLOCK_N) * BLOCK_N, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        # Keys before lo are not even read: a sliding window's freed blocks may hold another request's (a decode
        # graph's tables still name them), and 0 * inf there would be NaN.
        n_mask = (n >= lo) & (n < end)
        block = tl.load(table_ptr + n // BLOCK_SIZE, mask=n_mask, other=0)
        row = (block.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE) * (NUM_KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if SOFTCAP > 0:  # tanh(x) = 1 - 2 / (exp(2x) + 1); past 2x = 80 that is 1.0 in float32, and exp stays finite
            s = SOFTCAP * (1.0 - 2.0 / (tl.exp(tl.minimum(2.0 * s / SOFTCAP, 80.0)) + 1.0))
        visible = n_mask[None, :]
        if CAUSAL:
            visible = visible & (n[None, :] <= pos[:, None])
            if WINDOW > 0:
                visible = visible & (n[None, :] > pos[:, None] - WINDOW)
        elif WINDOW > 0:
            visible = visible & (n[None, :] >= end - WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no key yet (its window starts past this tile) would take exp(-inf + inf).
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_use[:, None])
        alpha = tl.exp(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc / tl.where(l_i > 0, l_i, 1.0)[:, None]


# ----- decode: one query token per request ----------------------------------------------------------------------
@triton.jit(do_not_specialize=["q_stride", "out_stride", "table_stride"])
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, tables_ptr, ctx_ptr,
    q_stride, out_stride, table_stride, scale,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # One program per (request, K/V head): the GROUP query heads that share the head read its keys once.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    ctx = tl.load(ctx_ptr + b)
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, HEAD_DIM_P)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + b * q_stride + (kvh * GROUP + g)[:, None] * HEAD_DIM + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    lo = tl.maximum(ctx - WINDOW, 0) if WINDOW > 0 else 0
    # A padding row (no context) gets zeros.
    out = _attend(
        q, 0, tables_ptr + b * table_stride, lo, ctx, kvh, k_cache_ptr, v_cache_ptr, scale,
        GROUP_P, False, WINDOW, SOFTCAP, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM_P, BLOCK_SIZE, BLOCK_N, PRECISION,
    )  # fmt: skip
    tl.store(
        out_ptr + b * out_stride + (kvh * GROUP + g)[:, None] * HEAD_DIM + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=g_mask[:, None] & d_mask[None, :],
    )


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q: [B, H, D] (rows may be strided, heads contiguous); caches [blocks, bs, Hkv, D]; block_tables [B, width]
    int32; context_lens [B] (0: padding row); window > 0: each sees its last ``window`` keys; softcap > 0:
    scores capped at softcap * tanh(s / softcap). Returns [B, H, D]
    (``out``, heads contiguous, when given)."""
    b, h, d = q.shape
    hkv = k_cache.shape[2]
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    out = q.new_empty(b, h, d) if out is None else out
    group = h // hkv
    _paged_decode_kernel[(b, hkv)](
        q, k_cache, v_cache, out, block_tables, context_lens,
        q.stride(0), out.stride(0), block_tables.stride(0), scale,
        NUM_KV_HEADS=hkv, GROUP=group, GROUP_P=max(16, _pow2(group)),
        HEAD_DIM=d, HEAD_DIM_P=max(16, _pow2(d)), BLOCK_SIZE=k_cache.shape[1], BLOCK_N=64,
        WINDOW=window, SOFTCAP=softcap, PRECISION=_dot_precision(q.dtype),
    )  # fmt: skip
    return out


# ----- prefill chunks: many query tokens per request, causal over what came before -----------------------------
@triton.jit(do_not_specialize=["q_stride", "table_stride"])
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, tables_ptr, q_start_ptr, q_len_ptr, ctx_start_ptr,
    q_stride, table_stride, scale,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    # One program per (request, tile of BLOCK_M queries, query head); keys come through the block table.
    r = tl.program_id(0)
    tile = tl.program_id(1)
    h = tl.program_id(2)
    q_len = tl.load(q_len_ptr + r)
    if tile * BLOCK_M >= q_len:
        return
    q_start = tl.load(q_start_ptr + r)
    ctx_start = tl.load(ctx_start_ptr + r)  # tokens of this request computed before the chunk
    kvh = h // GROUP
    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM_P)
    m_mask = m < q_len
    d_mask = d < HEAD_DIM
    q_rows = (q_start + m).to(tl.int64) * q_stride + h * HEAD_DIM
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    pos = ctx_start + m  # each query's position: it sees the keys at positions <= its own
    end = ctx_start + tl.minimum(q_len, (tile + 1) * BLOCK_M)  # the tile's last query sees keys up to here
    lo = tl.maximum(ctx_start + tile * BLOCK_M - WINDOW + 1, 0) if WINDOW > 0 else 0  # the tile's first key
    out = _attend(
        q, pos, tables_ptr + r * table_stride, lo, end, kvh, k_cache_ptr, v_cache_ptr, scale,
        BLOCK_M, True, WINDOW, SOFTCAP, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM_P, BLOCK_SIZE, BLOCK_N, PRECISION,
    )  # fmt: skip
    tl.store(
        out_ptr + q_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :]
    )


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    ctx_starts: torch.Tensor,
    max_q: int,
    scale: float,
    out: torch.Tensor,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """Attention of packed prefill chunks into ``out`` ([T, H, D], rows at ``q_starts``). Request r's chunk is
    q[q_starts[r] : q_starts[r] + q_lens[r]], its queries at positions ctx_starts[r] onwards; window > 0: each
    sees its last ``window`` keys; softcap > 0: scores capped as in ``paged_decode``."""
    _t, h, d = q.shape
    hkv = k_cache.shape[2]
    q = q.contiguous()
    block_m = 64 if max_q > 32 else 16
    grid = (q_starts.shape[0], triton.cdiv(max_q, block_m), h)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, q_starts, q_lens, ctx_starts,
        q.stride(0), block_tables.stride(0), scale,
        NUM_KV_HEADS=hkv, GROUP=h // hkv, HEAD_DIM=d, HEAD_DIM_P=max(16, _pow2(d)),
        BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_N=64, WINDOW=window, SOFTCAP=softcap,
        PRECISION=_dot_precision(q.dtype),
    )  # fmt: skip


# ----- fused elementwise ops -------------------------------------------------------------------------------------
@triton.jit
def _add_rms_norm_kernel(h_ptr, delta_ptr, w_ptr, out_ptr, n_cols, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    h = tl.load(h_ptr + row * n_cols + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        h = (h.to(tl.float32) + tl.load(delta_ptr + row * n_cols + offs, mask=mask, other=0.0).to(tl.float32)).to(
            h.dtype
        )
        tl.store(h_ptr + row * n_cols + offs, h, mask=mask)
    x = h.to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols
    y = (x * tl.math.rsqrt(var + eps)).to(h.dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * n_cols + offs, (w.to(tl.float32) * y.to(tl.float32)).to(h.dtype), mask=mask)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``h += delta`` in place (when given), then ``weight * rmsnorm(h)``: one pass over the rows."""
    out = torch.empty_like(h)
    n = h.shape[1]
    _add_rms_norm_kernel[(h.shape[0],)](
        h, h if delta is None else delta.contiguous(), weight, out, n, eps, HAS_DELTA=delta is not None, BLOCK=_pow2(n)
    )
    return out


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, pos_ptr, row_stride, num_heads,
    HALF: tl.constexpr, HEADS_P: tl.constexpr, HALF_P: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    hh = tl.arange(0, HEADS_P)
    j = tl.arange(0, HALF_P)
    mask = (hh < num_heads)[:, None] & (j < HALF)[None, :]
    base = x_ptr + t.to(tl.int64) * row_stride + hh[:, None] * (2 * HALF) + j[None, :]
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    c1 = tl.load(cos_ptr + pos * 2 * HALF + j, mask=j < HALF, other=0.0)[None, :]
    c2 = tl.load(cos_ptr + pos * 2 * HALF + HALF + j, mask=j < HALF, other=0.0)[None, :]
    s1 = tl.load(sin_ptr + pos * 2 * HALF + j, mask=j < HALF, other=0.0)[None, :]
    s2 = tl.load(sin_ptr + pos * 2 * HALF + HALF + j, mask=j < HALF, other=0.0)[None, :]
    dt = x1.dtype
    # x * cos + rotate_half(x) * sin, each product and the sum rounded to the model's dtype as in eager PyTorch.
    a1 = (x1.to(tl.float32) * c1.to(tl.float32)).to(dt).to(tl.float32)
    b1 = (-x2.to(tl.float32) * s1.to(tl.float32)).to(dt).to(tl.float32)
    a2 = (x2.to(tl.float32) * c2.to(tl.float32)).to(dt).to(tl.float32)
    b2 = (x1.to(tl.float32) * s2.to(tl.float32)).to(dt).to(tl.float32)
    tl.store(base, (a1 + b1).to(dt), mask=mask)
    tl.store(base + HALF, (a2 + b2).to(dt), mask=mask)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> None:
    """Rotary embedding in place on x: [T, heads, D] (rows may be strided, heads contiguous)."""
    t, heads, d = x.shape
    half = d // 2
    _rope_kernel[(t,)](
        x, cos, sin, positions, x.stride(0), heads,
        HALF=half, HEADS_P=_pow2(heads), HALF_P=_pow2(half),
        enable_fp_fusion=False,  # no fused multiply-add: each product rounded before the sum, as in eager PyTorch
    )  # fmt: skip


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(x_ptr + row * 2 * n + offs, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * 2 * n + n + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out_ptr + row * n + offs, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for contiguous rows [gate | up]."""
    t, n2 = gate_up.shape
    n = n2 // 2
    out = gate_up.new_empty(t, n)
    block = min(1024, _pow2(n))
    _silu_mul_kernel[(t, triton.cdiv(n, block))](gate_up, out, n, BLOCK=block)
    return out
