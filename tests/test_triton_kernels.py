"""The GPU's Triton kernels against plain PyTorch: on CUDA where there is one, else in Triton's interpreter on CPU
(TRITON_INTERPRET=1), so every machine with Triton checks the same kernels."""

from __future__ import annotations

import math

import pytest
import torch

CUDA = torch.cuda.is_available()
# conftest.py set TRITON_INTERPRET=1 where there is no GPU, before anything imported Triton or the kernels.
triton = pytest.importorskip("triton")
from roseinfer.kernels import triton_kernels as tk  # noqa: E402

if not CUDA:
    from triton.runtime import interpreter

    _patch_tensor = interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, *scope):
        """NumPy 2.4 refuses int() of a one-element 1-D array, which the interpreter calls for a loop bound read
        from memory (``range(0, tl.load(p))``); .item() reads it as the compiled kernel does. (Triton 3.2 passes
        no scope.)"""
        _patch_tensor(tensor, *scope)
        tensor.__index__ = lambda self: int(self.handle.data.item())

    interpreter._patch_lang_tensor = _patch_lang_tensor

DEVICE = "cuda" if CUDA else "cpu"


def _ref_attention(q, keys, values, scale, first_pos, window=0, softcap=0.0):
    """float64 causal attention of queries at positions first_pos.. over keys 0.. (window > 0: the last ``window``
    keys up to each query's own; softcap > 0: scores capped at softcap * tanh(s / softcap)); GQA by repeating K/V
    heads."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    pos = torch.arange(q.shape[0])[:, None] + first_pos
    keys_at = torch.arange(k.shape[0])[None, :]
    s = s.masked_fill(keys_at > pos, float("-inf"))
    if window:
        s = s.masked_fill(keys_at <= pos - window, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)


def _caches(num_blocks, block_size, hkv, d, gen):
    shape = (num_blocks, block_size, hkv, d)
    return (torch.randn(shape, generator=gen).to(DEVICE), torch.randn(shape, generator=gen).to(DEVICE))


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    # The interpreter is slow: two of the three shapes run in the slow lane.
    [
        (4, 2, 16, 8),
        pytest.param(9, 3, 64, 16, marks=pytest.mark.slow),
        pytest.param(8, 8, 32, 4, marks=pytest.mark.slow),
    ],
)
# window 20: a sliding-window layer (rows of 37 and 130 keys see 20); softcap 2: Gemma 2's capped scores.
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (20, 0.0), (20, 2.0)])
def test_store_and_decode_match_attention_over_the_block_table(heads, kv_heads, head_dim, block_size, window, softcap):
    gen = torch.Generator().manual_seed(heads * 100 + block_size)
    k_cache, v_cache = _caches(64, block_size, kv_heads, head_dim, gen)
    ctx_lens = [1, 5, 37, 130, 0]  # the last row is padding: no context, writes zeros
    width = max(math.ceil(c / block_size) for c in ctx_lens)
    perm = torch.randperm(64, generator=gen).tolist()  # blocks scattered over the cache
    tables, used = [], 0
    for c in ctx_lens:
        n = math.ceil(c / block_size)
        tables.append(perm[used : used + n] + [0] * (width - n))
        used += n
    b = len(ctx_lens)
    q = torch.randn(b, heads, head_dim, generator=gen).to(DEVICE)
    k_new = torch.randn(b, kv_heads, head_dim, generator=gen).to(DEVICE)
    v_new = torch.randn(b, kv_heads, head_dim, generator=gen).to(DEVICE)
    slots = [
        t[(c - 1) // block_size] * block_size + (c - 1) % block_size if c else -1 for t, c in zip(tables, ctx_lens)
    ]
    before = k_cache.clone()
    tk.store_kv(k_new, v_new, k_cache, v_cache, torch.tensor(slots, device=DEVICE))
    flat_k = k_cache.view(-1, kv_heads, head_dim)
    for i, s in enumerate(slots[:-1]):
        assert torch.equal(flat_k[s], k_new[i])
    changed = (k_cache != before).any(dim=-1).any(dim=-1).nonzero().tolist()
    assert len(changed) == len(slots) - 1  # the padding row stored nothing

    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    tk.paged_decode(
        q,
        k_cache,
        v_cache,
        torch.tensor(tables, dtype=torch.int32, device=DEVICE),
        torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE),
        scale,
        out=out,
        window=window,
        softcap=softcap,
    )
    flat_v = v_cache.view(-1, kv_heads, head_dim)
    for i, c in enumerate(ctx_lens):
        if c == 0:
            assert torch.equal(out[i], torch.zeros_like(out[i]))
            continue
        idx = torch.tensor([tables[i][p // block_size] * block_size + p % block_size for p in range(c)])
        ref = _ref_attention(q[i : i + 1].cpu(), flat_k[idx].cpu(), flat_v[idx].cpu(), scale, c - 1, window, softcap)
        assert torch.allclose(out[i].cpu().double(), ref[0], atol=1e-5, rtol=1e-4)
    if window:
        # Blocks wholly out of the window are freed, and a decode graph's tables still name them (only appended
        # entries are copied): another request may have filled them with anything, infinities included. None of
        # it may reach the output.
        poison = next(blk for blk in range(64) if all(blk not in t for t in tables))
        k_cache[poison], v_cache[poison] = float("inf"), float("nan")
        stale = [
            [poison if j < (c - window) // block_size else blk for j, blk in enumerate(t)]
            for t, c in zip(tables, ctx_lens)
        ]
        again = torch.full_like(q, float("nan"))
        as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
        tk.paged_decode(
            q, k_cache, v_cache, as_i32(stale), as_i32(ctx_lens), scale, out=again, window=window, softcap=softcap
        )
        assert torch.equal(again, out)


@pytest.mark.slow
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (9, 0.0), (9, 2.0)])
def test_prefill_chunks_attend_causally_from_their_first_uncomputed_token(window, softcap):
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, d, bs = 6, 2, 32, 8
    k_cache, v_cache = _caches(48, bs, kv_heads, d, gen)
    # (tokens computed before, chunk length): a fresh prompt, a chunk after a prefix hit, a long one, a single token.
    chunks = [(0, 13), (16, 20), (5, 70), (40, 1)]
    width = max(math.ceil((s + n) / bs) for s, n in chunks)
    perm = torch.randperm(48, generator=gen).tolist()
    tables, used = [], 0
    for s, n in chunks:
        m = math.ceil((s + n) / bs)
        tables.append(perm[used : used + m] + [0] * (width - m))
        used += m
    total = sum(n for _, n in chunks)
    q = torch.randn(total, heads, d, generator=gen).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    starts = [sum(n for _, n in chunks[:i]) for i in range(len(chunks))]
    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
    tk.paged_prefill(
        q,
        k_cache,
        v_cache,
        as_i32(tables),
        as_i32(starts),
        as_i32([n for _, n in chunks]),
        as_i32([s for s, _ in chunks]),
        max(n for _, n in chunks),
        0.125,
        out,
        window,
        softcap,
    )
    flat_k, flat_v = k_cache.view(-1, kv_heads, d).cpu(), v_cache.view(-1, kv_heads, d).cpu()
    for (s, n), t, q0 in zip(chunks, tables, starts):
        idx = torch.tensor([t[p // bs] * bs + p % bs for p in range(s + n)])
        ref = _ref_attention(q[q0 : q0 + n].cpu(), flat_k[idx], flat_v[idx], 0.125, s, window, softcap)
        assert torch.allclose(out[q0 : q0 + n].cpu().double(), ref, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
# Every benchmark runs bfloat16, at the SmolLM2 and 1B shapes' heads (9/3 and 32/8, 64 wide), which no other kernel
# test covers. bfloat16 on CUDA only: the interpreter's bfloat16 dot is wrong (float16's is exact).
@pytest.mark.parametrize(
    "dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not CUDA, reason="CUDA only"))]
)
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (32, 8)])
def test_half_precision_attention_at_the_benchmarks_shapes(dtype, heads, kv_heads):
    gen = torch.Generator().manual_seed(heads)
    d, bs, blocks = 64, 16, 40
    k_cache, v_cache = (c.to(dtype) for c in _caches(blocks, bs, kv_heads, d, gen))
    chunks = [(0, 33), (16, 17), (47, 1)]  # (tokens computed before, chunk length): whole blocks and odd ends
    width = max(math.ceil((s + n) / bs) for s, n in chunks)
    perm = torch.randperm(blocks, generator=gen).tolist()
    tables, used = [], 0
    for s, n in chunks:
        m = math.ceil((s + n) / bs)
        tables.append(perm[used : used + m] + [0] * (width - m))
        used += m
    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
    flat_k, flat_v = k_cache.view(-1, kv_heads, d).cpu(), v_cache.view(-1, kv_heads, d).cpu()
    keys_of = [torch.tensor([t[p // bs] * bs + p % bs for p in range(s + n)]) for (s, n), t in zip(chunks, tables)]
    total = sum(n for _, n in chunks)
    q = torch.randn(total, heads, d, generator=gen).to(DEVICE, dtype)
    out = torch.full_like(q, float("nan"))
    starts = [sum(n for _, n in chunks[:i]) for i in range(len(chunks))]
    lens = [n for _, n in chunks]
    tk.paged_prefill(
        q, k_cache, v_cache, as_i32(tables), as_i32(starts), as_i32(lens), as_i32([s for s, _ in chunks]),
        max(lens), d**-0.5, out, 0, 0.0,
    )  # fmt: skip
    for (s, n), idx, q0 in zip(chunks, keys_of, starts):
        ref = _ref_attention(q[q0 : q0 + n].cpu(), flat_k[idx], flat_v[idx], d**-0.5, s)
        assert torch.allclose(out[q0 : q0 + n].cpu().double(), ref, atol=2e-2, rtol=2e-2)
    # A decode row per chunk's end: its last query against every key up to it.
    last = torch.tensor([q0 + n - 1 for q0, (_, n) in zip(starts, chunks)], device=DEVICE)
    decoded = torch.full_like(q[last], float("nan"))
    ctx = [s + n for s, n in chunks]
    tk.paged_decode(q[last], k_cache, v_cache, as_i32(tables), as_i32(ctx), d**-0.5, out=decoded)
    for i, (idx, c) in enumerate(zip(keys_of, ctx)):
        ref = _ref_attention(q[last][i : i + 1].cpu(), flat_k[idx], flat_v[idx], d**-0.5, c - 1)
        assert torch.allclose(decoded[i].cpu().double(), ref[0], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
def test_elementwise_ops_round_as_pytorch_does(dtype):
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(7, 96, generator=gen).to(DEVICE, dtype)
    delta = torch.randn(7, 96, generator=gen).to(DEVICE, dtype)
    w = torch.randn(96, generator=gen).to(DEVICE, dtype)
    h_ref = h.clone()
    out = tk.add_rms_norm(h, delta, w, 1e-5)
    h_ref += delta
    x = h_ref.float()
    ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    # Exact where conversions round to nearest as PyTorch's do; the interpreter truncates float32 to bfloat16.
    same = torch.equal if CUDA or dtype == torch.float32 else lambda a, b: torch.allclose(a, b, atol=0.1, rtol=0.02)
    assert same(h, h_ref)  # the residual stream updated in place
    assert torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol)

    # Rotary embedding on strided rows: q and k heads of a fused projection output.
    qkv = torch.randn(5, (4 + 2 + 2) * 16, generator=gen).to(DEVICE, dtype)
    qk = qkv.view(5, 8, 16)[:, :6]
    cos = torch.randn(32, 16, generator=gen).to(DEVICE, dtype)
    sin = torch.randn(32, 16, generator=gen).to(DEVICE, dtype)
    pos = torch.tensor([0, 3, 9, 31, 2], device=DEVICE)
    ref = qk * cos[pos][:, None] + torch.cat((-qk[..., 8:], qk[..., :8]), dim=-1) * sin[pos][:, None]
    untouched = qkv.view(5, 8, 16)[:, 6:].clone()
    tk.rope_(qk, cos, sin, pos)
    assert same(qk, ref)
    assert torch.equal(qkv.view(5, 8, 16)[:, 6:], untouched)

    gate_up = torch.randn(3, 2 * 40, generator=gen).to(DEVICE, dtype)
    ref = torch.nn.functional.silu(gate_up[:, :40]) * gate_up[:, 40:]
    assert torch.allclose(tk.silu_mul(gate_up).float(), ref.float(), atol=tol, rtol=tol)


@pytest.fixture
def triton_engine(monkeypatch):
    """The engine's kernels and attention on Triton: the GPU's own where there is one, else the same kernels in the
    interpreter on CPU."""
    import roseinfer.attention as attention
    import roseinfer.kernels as kernels

    if not CUDA:
        monkeypatch.setenv("ROSEINFER_CPU_KERNELS", "0")
        monkeypatch.setattr(kernels, "_tried", False)
        monkeypatch.setattr(kernels, "_lib", None)
        monkeypatch.setattr(kernels, "triton_kernels_for", lambda device: tk)
        monkeypatch.setattr(attention, "triton_kernels_for", lambda device: tk)


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.slow
def test_the_engine_on_the_triton_backend_matches_transformers(tiny_llama, triton_engine):
    """The whole step (K/V store, decode and chunked-prefill attention, fused elementwise ops) on the Triton
    kernels, on CPU through the interpreter where there is no GPU: the same greedy tokens as transformers."""
    from conftest import hf_greedy

    from roseinfer import LLM, SamplingParams

    prompts = _prompts(5, seed=1)
    llm = LLM(tiny_llama, dtype="float32", device=DEVICE, max_num_batched_tokens=24)
    assert llm.engine.attn_backend.name == "triton"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=10, temperature=0))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tiny_llama, prompts, 10, device=DEVICE)


@pytest.mark.slow
def test_gemma2_on_the_triton_backend_matches_transformers(triton_engine, tmp_path):
    """Sliding-window layers between full ones and capped attention scores through the Triton kernels, prompts in
    chunks of 16: the same greedy tokens as transformers."""
    from conftest import hf_greedy
    from test_checkpoint import FAMILIES, PROMPTS, _config, _save

    from roseinfer import LLM, SamplingParams

    family, extra = FAMILIES["gemma2"]
    path = _save(_config(family, **extra), tmp_path / "gemma2")
    llm = LLM(path, dtype="float32", device=DEVICE, max_num_batched_tokens=16)
    assert llm.engine.attn_backend.name == "triton"
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=12, temperature=0))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, PROMPTS, 12, device=DEVICE)


@pytest.mark.slow
def test_blocks_freed_out_of_every_layers_window_on_the_triton_backend(triton_engine, tmp_path):
    """Mistral (every layer slides: a window of 6 in blocks of 8) in a pool of 12 blocks the requests outgrow: the
    kernels start at the window while the tables name freed blocks before it; the same greedy tokens as
    transformers, and no request preempted."""
    from conftest import hf_greedy
    from test_checkpoint import PROMPTS, WINDOWED, _config, _peak_blocks, _save

    from roseinfer import LLM, SamplingParams

    family, extra = WINDOWED["mistral, every layer"]
    path = _save(_config(family, **extra), tmp_path / "mistral")
    llm = LLM(path, dtype="float32", device=DEVICE, max_num_batched_tokens=16, kv_cache_memory="48KiB")
    assert llm.engine.attn_backend.name == "triton" and llm.engine.kv.num_blocks == 12
    outputs, peak = _peak_blocks(llm, PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert outputs == hf_greedy(path, PROMPTS, 24, device=DEVICE)
    assert llm.engine.scheduler.num_preemptions == 0 and peak <= 12


def _graph_buffers_run_eagerly(llm):
    """The engine's decode steps through the CUDA-graph runner's persistent buffers and buckets, each run eagerly
    (no capture): what a GPU replays, checked on any machine."""
    from roseinfer.cuda_graphs import DecodeGraphs

    engine, runner = llm.engine, llm.engine.runner
    if runner.graphs is None:
        max_blocks = -(-engine.max_model_len // engine.config.block_size)
        runner.graphs = DecodeGraphs(
            runner.model,
            runner.attn_backend,
            runner.kv_caches,
            engine.config.max_num_seqs,
            max_blocks,
            runner.device,
            capture=CUDA,
        )
    return runner.graphs


@pytest.mark.slow
def test_decode_through_the_graph_buffers_matches_transformers_at_every_bucket(tiny_llama, triton_engine):
    """Every bucket size, full and padded (padding rows store nothing and see nothing), and rows whose tables are
    copied one new block at a time while their owner stays: greedy tokens equal transformers'."""
    from conftest import hf_greedy

    from roseinfer import LLM, SamplingParams

    llm = LLM(tiny_llama, dtype="float32", device=DEVICE, max_num_seqs=12, block_size=4)
    graphs = _graph_buffers_run_eagerly(llm)
    assert graphs.sizes == [1, 2, 4, 8, 12]
    prompts = _prompts(12, seed=2, lo=3, hi=20)
    ref = hf_greedy(tiny_llama, prompts, 10, device=DEVICE)  # 10 tokens cross blocks of 4: tables grow mid-run
    params = SamplingParams(max_tokens=10, temperature=0)
    for n in [1, 3, 11]:
        graphs.replays.clear()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:n]], params)
        assert [o.outputs[0].token_ids for o in outs] == ref[:n], f"{n} requests"
        assert graphs.replays[graphs.bucket(n)] > 0, f"{n} requests never ran bucket {graphs.bucket(n)}"


@pytest.mark.slow
def test_a_longrope_model_decodes_through_the_graph_buffers_by_its_rotary_rows(tiny_longrope, triton_engine):
    """A LongRoPE model's decodes take each token's rotary row (short factors, or long past the original length)
    from the graph buffers' own row: greedy tokens as transformers', before and after the recompute at 64."""
    from conftest import hf_greedy

    from roseinfer import LLM, SamplingParams

    prompts = _prompts(3, seed=7, lo=50, hi=62) + _prompts(1, seed=8, lo=70, hi=80)
    ref = hf_greedy(tiny_longrope, prompts, 16, device=DEVICE, use_cache=False)
    llm = LLM(tiny_longrope, dtype="float32", device=DEVICE, max_num_seqs=4, block_size=16)
    graphs = _graph_buffers_run_eagerly(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=16, temperature=0))
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert sum(graphs.replays.values()) > 0


@pytest.mark.slow
def test_preempted_requests_decode_through_the_graph_buffers_with_rebuilt_tables(tiny_llama, triton_engine):
    """A preempted request comes back with new blocks: its row's table is copied whole again (its owner changed),
    never patched onto the old one."""
    from conftest import hf_greedy

    from roseinfer import LLM, SamplingParams

    prompts = _prompts(6, seed=5, lo=20, hi=30)
    kv_memory = 12 * 2 * 2 * 16 * 2 * 16 * 4  # 12 blocks of 16 tokens of the tiny model: too few for all six
    llm = LLM(tiny_llama, dtype="float32", device=DEVICE, kv_cache_memory=kv_memory, block_size=16, max_num_seqs=8)
    graphs = _graph_buffers_run_eagerly(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=28, temperature=0))
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(graphs.replays.values()) > 0
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tiny_llama, prompts, 28, device=DEVICE)


@pytest.mark.slow
def test_a_request_a_failed_step_sent_back_decodes_through_the_graph_buffers_with_its_new_table(
    tiny_llama, triton_engine
):
    """A request admitted on a prefix hit whose first (decode-only) step failed goes back to waiting, its blocks
    freed, uncounted as a preemption: its row's owner stayed the same, so its new table was patched onto the old
    one, and it attended over freed blocks (another request's, by then). Its table's epoch changes now."""
    from roseinfer import LLMEngine, SamplingParams
    from roseinfer.config import EngineConfig

    prompt = [7, 3, 99, 42, 5, 17, 200, 8, 61]  # 9 tokens in blocks of 4: a hit leaves one token to compute
    config = EngineConfig(model=tiny_llama, dtype="float32", device=DEVICE, max_model_len=24, block_size=4,
                          kv_cache_memory=6 * 2 * 2 * 4 * 2 * 16 * 4, max_num_seqs=2)  # fmt: skip
    wanted = []
    for fail in (False, True):
        engine = LLMEngine(config)
        assert engine.kv.num_blocks == 6
        graphs = _graph_buffers_run_eagerly(type("LLM", (), {"engine": engine})())
        greedy = SamplingParams(max_tokens=6, temperature=0)
        engine.add_request("first", prompt, SamplingParams(max_tokens=1, temperature=0))
        while engine.has_unfinished_requests():  # its blocks stay in the prefix cache
            engine.step()
        start, calls = engine.runner.sampler.start, []

        def failing_once(*args, start=start, calls=calls, fail=fail, **kwargs):
            calls.append(1)
            if fail and len(calls) == 1:
                raise RuntimeError("out of memory while sampling")
            return start(*args, **kwargs)

        engine.runner.sampler.start = failing_once
        engine.add_request("again", prompt, greedy)
        tokens = None
        while engine.has_unfinished_requests():
            try:
                outputs = engine.step()
            except RuntimeError:
                outputs = engine.take_undelivered()
            for out in outputs:
                if out.finished:
                    tokens = out.outputs[0].token_ids
        assert sum(graphs.replays.values()) > 0
        wanted.append(tokens)
    assert wanted[1] == wanted[0] and len(wanted[0]) == 6
