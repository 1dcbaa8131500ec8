"""The C kernels against the PyTorch ops they stand for, at float32 and bfloat16: RoPE and RMSNorm round every
step as PyTorch's separate ops do, so they must agree bit for bit; SiLU uses its own exp (within an ulp or two)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from roseinfer.kernels import add_rms_norm, cpu_kernels_for, rope_, rotate_half, silu_mul

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]

pytestmark = pytest.mark.skipif(cpu_kernels_for(CPU, torch.float32) is None, reason="no C compiler here")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 48, 6])
def test_rope_matches_pytorch_bit_for_bit_on_strided_rows(dtype, head_dim):
    g = torch.Generator().manual_seed(head_dim)
    tokens, heads, extra = 37, 5, 3 * head_dim + 7  # rows of a fused QKV output: more columns than roped
    qkv = torch.randn(tokens, heads * head_dim + extra, generator=g).to(dtype)
    x = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    cos = torch.randn(300, head_dim, generator=g).to(dtype)
    sin = torch.randn(300, head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 300, (tokens,), generator=g)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    expected = x * c + rotate_half(x) * s
    untouched = qkv[:, heads * head_dim :].clone()
    rope_(x, cos, sin, positions)
    assert torch.equal(x, expected)
    assert torch.equal(qkv[:, heads * head_dim :], untouched)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_pytorch_bit_for_bit(dtype, with_delta):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(19, 576, generator=g).to(dtype)
    delta = torch.randn(19, 576, generator=g).to(dtype) if with_delta else None
    weight = torch.randn(576, generator=g).to(dtype)
    h_ref = h + delta if with_delta else h.clone()
    x = h_ref.float()
    expected = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    out = add_rms_norm(h, delta, weight, 1e-5)
    assert torch.equal(h, h_ref)  # the residual is updated in place
    torch.testing.assert_close(out, expected, rtol=1e-6 if dtype == torch.float32 else 0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_matches_pytorch(dtype):
    gate_up = (torch.randn(23, 2 * 1536, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    tolerance = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(silu_mul(gate_up), expected, **tolerance)
