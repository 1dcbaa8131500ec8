"""Dense layers: oneDNN-packed weights, and bfloat16 layers multiplied in float32 where the CPU lacks bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import hf_greedy

from roseinfer import LLM, SamplingParams
from roseinfer.models import linear


@pytest.fixture
def bf16_gemm(request, monkeypatch):
    """'float32': bfloat16 layers take the float32 path, whatever this CPU can do; 'bfloat16': they never do."""
    if request.param == "float32":
        pack = linear._pack
        monkeypatch.setattr(linear, "_pack", lambda w: None if w.dtype == torch.bfloat16 else pack(w))
    else:
        monkeypatch.setattr(linear.Linear, "_run_in_float32", lambda self, why: None)
    return request.param


@pytest.mark.parametrize("bf16_gemm", ["float32"], indirect=True)
def test_bfloat16_layer_in_float32_matches_a_bfloat16_gemm(bf16_gemm):
    torch.manual_seed(0)
    w, b, x = torch.randn(96, 64).bfloat16(), torch.randn(96).bfloat16(), torch.randn(5, 64).bfloat16()
    layer = linear.Linear(w, b)
    assert layer.out_dtype == torch.bfloat16 and layer.weight.dtype == torch.float32
    y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == (5, 96)
    exact = x.double() @ w.double().T + b.double()
    # Products of bf16 values are exact in float32: what remains is the final rounding to bf16 (2^-8 relative).
    assert ((y.double() - exact).abs() <= 2**-8 * exact.abs() + 1e-5).all()
    ref = F.linear(x, w, b)
    assert (y == ref).float().mean() > 0.95
    assert ((y.float() - ref.float()).abs() <= 2**-7 * ref.float().abs() + 1e-6).all()  # at most a rounding step


def test_float32_layer_is_untouched():
    w = torch.randn(8, 4)
    layer = linear.Linear(w)
    assert layer.out_dtype is None
    x = torch.randn(3, 4)
    torch.testing.assert_close(layer(x), x @ w.T)


@pytest.mark.parametrize("bf16_gemm", [pytest.param("float32", marks=pytest.mark.slow), "bfloat16"], indirect=True)
def test_bfloat16_engine_agrees_with_transformers_on_either_gemm(tiny_llama, bf16_gemm):
    prompts = [[5, 17, 99, 3, 42, 8], [250, 1, 7], list(range(10, 40))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM(tiny_llama, dtype="bfloat16")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ref = hf_greedy(tiny_llama, prompts, 12, dtype="bfloat16")
    # bfloat16 roundings differ between fused and unfused ops: the first tokens come before any can compound.
    assert [o.outputs[0].token_ids[:4] for o in outs] == [r[:4] for r in ref]
