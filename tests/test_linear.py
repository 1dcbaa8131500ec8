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
    assert llm.engine.numerics == ("f32gemm" if bf16_gemm == "float32" else "")  # (in its fingerprint)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ref = hf_greedy(tiny_llama, prompts, 12, dtype="bfloat16")
    # bfloat16 roundings differ between fused and unfused ops: the first tokens come before any can compound.
    assert [o.outputs[0].token_ids[:4] for o in outs] == [r[:4] for r in ref]


def _int8_reference(layer: linear.Linear, x: torch.Tensor) -> torch.Tensor:
    """What an int8 layer computes, from its stored int8 weight and scales, in float64."""
    xs = x.double() * (1 if layer._smooth is None else layer._smooth.double())
    per_row = xs.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    xq = (xs * (127 / per_row)).round().clamp(-127, 127)
    y = (xq @ layer._qweight.double().T) * (per_row / 127) * layer._qscale.double()
    return y if layer.bias is None else y + layer.bias.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("smoothed", [False, True])
def test_an_int8_layer_sums_its_rounded_operands_exactly_and_stays_near_the_float_product(dtype, smoothed):
    torch.manual_seed(0)
    w, b = torch.randn(96, 64), torch.randn(96)
    x = torch.randn(7, 64)
    x[:, 3] *= 40  # an outlier channel, as LLMs' activations have
    x[2] = 0  # a row of zeros: scaled, not divided by zero
    layer = linear.Linear(w.to(dtype), b.to(dtype))
    layer.quantize_int8(x.abs().amax(dim=0) if smoothed else None)
    assert layer.weight is None and layer._qweight.dtype == torch.int8  # the float weight is let go
    y = layer(x.to(dtype))
    assert y.dtype == dtype and y.shape == (7, 96) and torch.isfinite(y).all()
    ref = _int8_reference(layer, x.to(dtype).float())
    assert ((y.double() - ref).abs() <= (1e-5 if dtype == torch.float32 else 2**-8) * ref.abs() + 1e-4).all()
    exact = x.to(dtype).double() @ w.to(dtype).double().T + b.to(dtype).double()
    assert torch.allclose(y[2].double(), b.to(dtype).double(), atol=1e-6)
    error = (y.double() - exact).norm() / exact.norm()
    assert error < (0.02 if smoothed else 0.05), error


def test_smoothing_moves_an_outlier_channel_into_the_weight_and_cuts_the_rounding_error():
    """SmoothQuant's factors keep the product: x / s @ (w * s).T == x @ w.T, and rounding the smoothed operands
    loses less than rounding the raw ones when one input channel dwarfs the others."""
    torch.manual_seed(1)
    w = torch.randn(128, 256)
    x = torch.randn(32, 256)
    x[:, :4] *= 60
    errors = []
    for smooth in (None, x.abs().amax(dim=0)):
        layer = linear.Linear(w.clone())
        layer.quantize_int8(smooth)
        errors.append(((layer(x) - x @ w.T).norm() / (x @ w.T).norm()).item())
    assert errors[1] < 0.5 * errors[0], errors
    layer = linear.Linear(w.clone())
    layer.quantize_int8(x.abs().amax(dim=0))
    restored = layer._qweight.float() * layer._qscale[:, None] * layer._smooth
    assert ((restored - w).abs() <= 0.5 * layer._qscale[:, None] * layer._smooth + 1e-6).all()  # half a step


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_gpt2"])
def test_an_int8_engine_scores_text_as_the_float_engine_does_and_forgets_its_calibration(model, request):
    from roseinfer.quantization import dense_layers

    path = request.getfixturevalue(model)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    prompt = {"prompt_token_ids": [5, 17, 99, 3, 42, 8, 250, 1, 7, 64, 12, 90]}
    float_llm = LLM(path, dtype="float32")
    int8_llm = LLM(path, dtype="float32", quantization="int8")
    engine = int8_llm.engine
    layers = dense_layers(engine.model)
    assert len(layers) == 4 * engine.model.num_layers and all(layer._qweight is not None for layer in layers)
    assert engine.model.lm_head._qweight is None and engine.model.lm_head._packed is not None  # the logits: float
    head_llm = LLM(path, dtype="float32", quantization="int8", int8_output_layer=True)
    with_head = head_llm.engine.model
    assert with_head.lm_head._qweight is not None and len(dense_layers(with_head, True)) == len(layers) + 1
    assert engine.kv.num_used_blocks == 0 and not engine.has_unfinished_requests()  # the calibration is gone
    assert engine.kv.prefix_query_tokens == 0 and engine.stats.num_steps == 0
    ref, *gots = (
        llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs[1:] for llm in (float_llm, int8_llm, head_llm)
    )
    ids = prompt["prompt_token_ids"][1:]
    for got, bound in zip(gots, (0.03, 0.05)):
        diffs = [abs(r[t] - g[t]) for r, g, t in zip(ref, got, ids)]
        # The same text scored alike (these random models' logits are large: their logprobs run to -14).
        assert 0 < sum(diffs) < bound * sum(abs(r[t]) for r, t in zip(ref, ids)), diffs


def test_the_int8_gemm_is_timed_once_a_process_and_briefly_where_it_is_slow(monkeypatch):
    """Each int8 engine timed the int8 GEMM against the float one, 8 rounds: 1 s of every build on a CPU without VNNI
    (0.12 s a call). Now once a process, and two rounds once the budget is spent."""
    import time

    timed = []
    best_times = linear._best_times
    monkeypatch.setattr(linear, "_best_times", lambda runs: timed.append(len(runs)) or best_times(runs))
    linear._int8_gemm_speedup.cache_clear()
    first = linear.int8_gemm_speedup(torch.float32)
    assert first > 0 and linear.int8_gemm_speedup(torch.float32) == first and timed == [2]
    calls = []
    best = best_times([lambda: calls.append(time.sleep(0.06)), lambda: None], budget_s=0.1)
    assert len(calls) == 2 and best[0] >= 0.06 > best[1]
    calls.clear()
    best_times([lambda: calls.append(None)], budget_s=0.1)
    assert len(calls) == 8


def test_int8_on_a_cpu_whose_int8_gemm_does_not_pay_says_so(tiny_llama, monkeypatch, caplog):
    import logging

    from roseinfer import llm_engine

    monkeypatch.setattr(llm_engine, "int8_gemm_speedup", lambda dtype: 0.6)
    with caplog.at_level(logging.WARNING, logger="roseinfer.llm_engine"):
        LLM(tiny_llama, quantization="int8")
    assert any("int8 GEMM runs 0.60x the float32 GEMM it replaces" in r.getMessage() for r in caplog.records)


def test_int8_where_pytorch_has_no_int8_gemm_is_a_one_line_config_error(tiny_llama, monkeypatch):
    from roseinfer import llm_engine
    from roseinfer.config import ConfigError

    def missing(dtype):
        raise RuntimeError("_int_mm is not implemented for this backend")

    monkeypatch.setattr(llm_engine, "int8_gemm_speedup", missing)
    with pytest.raises(ConfigError, match="quantization int8: this PyTorch cannot multiply int8 matrices here"):
        LLM(tiny_llama, quantization="int8")


def test_a_cpu_engine_keeps_one_copy_of_each_weight_the_packed_one(tiny_llama):
    """oneDNN's packed copy is what runs: the unpacked weight beside it was a second copy of the model (a 1.5B
    model's float32 weights: 6 GB twice). The engine lets it go once the model is built (and quantized)."""
    from roseinfer.quantization import dense_layers

    llm = LLM(tiny_llama, dtype="float32")
    layers = dense_layers(llm.engine.model, with_output_layer=True)
    if any(layer._packed is None for layer in layers):
        pytest.skip("this PyTorch build packs no weights for oneDNN")
    assert all(layer.weight is None for layer in layers)
    out = llm.generate([{"prompt_token_ids": [5, 17, 99]}], SamplingParams(max_tokens=4, temperature=0.0),
                       use_tqdm=False)  # fmt: skip
    assert len(out[0].outputs[0].token_ids) == 4


def test_int8_is_a_cpu_option():
    from roseinfer import EngineConfig

    with pytest.raises(ValueError, match="runs on CPU"):
        EngineConfig(device="cuda", quantization="int8")
    with pytest.raises(ValueError, match="quantization must be one of int8"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="int8_output_layer needs quantization int8"):
        EngineConfig(int8_output_layer=True)
    with pytest.raises(ValueError, match="int8_output_layer must be true or false, got 1"):
        EngineConfig(int8_output_layer=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("smoothed", [False, True])
def test_the_c_kernels_of_an_int8_layer_give_the_bytes_of_their_pytorch_twins(dtype, bias, smoothed, monkeypatch):
    """Bit for bit, so a worker without a C compiler writes what one with it writes. Rows enough to meet values
    one rounding away from a half (bfloat16 inputs meet them in ~1 row of 50)."""
    from roseinfer import kernels

    if kernels.cpu_kernels() is None:
        pytest.skip("no C compiler here")
    torch.manual_seed(2)
    x = torch.randn(2000, 200) * torch.linspace(0.1, 30, 200)  # channels of many sizes
    x[4] = 0
    layer = linear.Linear(torch.randn(72, 200).to(dtype), torch.randn(72).to(dtype) if bias else None)
    layer.quantize_int8(x.abs().amax(dim=0) if smoothed else None)
    inputs = (x.to(dtype), torch.cat([x, x], dim=1).to(dtype)[:, :200])  # strided rows too
    with_c = [layer(inp) for inp in inputs]
    monkeypatch.setattr(kernels, "_lib", None)  # (as the ``no_kernels`` fixture)
    assert all(torch.equal(c, layer(inp)) for c, inp in zip(with_c, inputs))


def test_calibration_prompts_fit_every_model_a_template_that_refuses_a_lone_turn_too():
    from types import SimpleNamespace

    from roseinfer.quantization import CALIBRATION_TEXTS, calibration_prompts

    class Refusing:  # a chat template that wants a system turn first
        tokenizer = SimpleNamespace(chat_template="...", encode=lambda text: [len(text) % 7, 1])
        model = SimpleNamespace(vocab_size=50)

        def tokenize(self, prompt):
            raise ValueError("Conversation roles must alternate system/user/...")

    got = calibration_prompts(Refusing())
    assert got == [[len(text) % 7, 1] for text in CALIBRATION_TEXTS]  # the plain texts
    bare = SimpleNamespace(tokenizer=None, model=SimpleNamespace(vocab_size=50))  # a random model without one
    ids = calibration_prompts(bare)
    assert len(ids) == len(CALIBRATION_TEXTS) and all(0 <= t < 50 for p in ids for t in p)


def test_the_timed_gemm_choice_is_kept_for_the_machine_and_named_in_the_fingerprint(tmp_path, monkeypatch):
    """The bfloat16-or-float32 GEMM was timed in each process: where the two are near, a restarted worker took the
    other, and wrote other text for a seeded job under the same system_fingerprint. The first timing is kept for
    later processes, and a worker multiplying bfloat16 layers in float32 says so in its fingerprint."""
    from types import SimpleNamespace

    from worker.jobs import system_fingerprint

    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("ROSEINFER_BF16_GEMM", raising=False)
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", object(), raising=False)
    timings = []
    monkeypatch.setattr(linear, "_time_bfloat16_gemm", lambda: timings.append(1) or True)
    for expected in (True, True):  # timed once; the second process (its cache cleared) reads what the first kept
        linear.bfloat16_gemm_is_slower.cache_clear()
        assert linear.bfloat16_gemm_is_slower() is expected
    assert len(timings) == 1 and linear._kept_gemm_choice().read_text() == "float32"
    linear._kept_gemm_choice().write_text("bfloat16")  # (the operator's word, or another machine's timing)
    linear.bfloat16_gemm_is_slower.cache_clear()
    assert linear.bfloat16_gemm_is_slower() is False and len(timings) == 1
    # Two workers starting at once, timed apart: the second takes the first's (a rename kept the last, and each ran
    # on its own timing: the first changed its numerics at its restart).
    kept = linear._kept_gemm_choice()
    kept.unlink()
    assert linear._write_choice(kept, "float32") == "float32" and linear._write_choice(kept, "bfloat16") == "float32"
    assert sorted(p.name for p in kept.parent.iterdir()) == [kept.name]  # (no temporary file left)
    linear.bfloat16_gemm_is_slower.cache_clear()
    settings = SimpleNamespace(device="cpu", dtype="bfloat16", quantization=None)
    assert system_fingerprint(settings, "f32gemm").endswith("-cpu-bfloat16-f32gemm")
    assert system_fingerprint(settings).endswith("-cpu-bfloat16")
