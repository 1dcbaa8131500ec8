"""The C kernels against the PyTorch ops they stand for, at float32 and bfloat16: RoPE and RMSNorm round every
step as PyTorch's separate ops do, so they must agree bit for bit; paged attention against float64 attention."""

from __future__ import annotations

import pytest
import torch

from roseinfer.kernels import add_rms_norm, cpu_kernels_for, rope_, rotate_half

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
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(2, 2, 64), (4, 2, 64), (9, 3, 64), (8, 2, 64),
                                                                      (10, 2, 128), (6, 3, 48)])  # fmt: skip
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (11, 0.0), (11, 1.5)])
def test_paged_attention_matches_float64_attention(dtype, num_heads, num_kv_heads, head_dim, window, softcap):
    """The C kernel's decode and prefill rows against attention in float64, for every way a group of query heads
    is split over the kernel's shared value reads (1 to 5 heads a KV head), head sizes of 64 and beyond, and the
    generic loop (48); the sequences' blocks scattered over the cache. Window 11: a sliding-window layer, whose
    first key falls inside a block; softcap 1.5: Gemma 2's capped scores."""
    from roseinfer.attention import CpuKernelAttentionBackend
    from roseinfer.scheduler import ScheduledRequest

    lib = cpu_kernels_for(torch.device("cpu"), dtype)
    if lib is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(7)
    bs, lens = 8, {"long": 45, "short": 3, "prompt": 20}  # "prompt" is prefilled in this one step
    backend = CpuKernelAttentionBackend(lib, bs, dtype, torch.device("cpu"))
    k_cache, v_cache = backend.allocate_kv_caches(1, 32, num_kv_heads, head_dim)[0]
    free = torch.randperm(32, generator=g).tolist()
    tables = {name: [free.pop() for _ in range((n + bs - 1) // bs)] for name, n in lens.items()}
    keys = {n: torch.randn(lens[n], num_kv_heads, head_dim, generator=g).to(dtype) for n in lens}
    values = {n: torch.randn(lens[n], num_kv_heads, head_dim, generator=g).to(dtype) for n in lens}
    for name in ("long", "short"):  # earlier steps' keys, written straight into the kernel's layout
        for p in range(lens[name] - 1):
            blk, off = tables[name][p // bs], p % bs
            k_cache[blk, :, :, off] = keys[name][p]
            v_cache[blk, :, off, :] = values[name][p]
    requests = [
        ScheduledRequest(None, lens["long"] - 1, 1, True, False, tables["long"]),
        ScheduledRequest(None, lens["short"] - 1, 1, True, False, tables["short"]),
        ScheduledRequest(None, 0, lens["prompt"], True, True, tables["prompt"]),
    ]
    rows = [("long", lens["long"] - 1), ("short", lens["short"] - 1)] + [("prompt", p) for p in range(lens["prompt"])]
    positions = torch.tensor([p for _, p in rows])
    slots = [tables[n][p // bs] * bs + p % bs for n, p in rows]
    q = torch.randn(len(rows), num_heads, head_dim, generator=g).to(dtype)
    k = torch.stack([keys[n][p] for n, p in rows])
    v = torch.stack([values[n][p] for n, p in rows])
    meta = backend.build_metadata(requests, 2, positions, slots)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.125, window, softcap)

    group = num_heads // num_kv_heads
    for i, (name, p) in enumerate(rows):
        lo = max(0, p + 1 - window) if window else 0
        kk = keys[name][lo : p + 1].double().repeat_interleave(group, dim=1)
        vv = values[name][lo : p + 1].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,khd->hk", q[i].double(), kk) * 0.125
        weights = (torch.tanh(scores / softcap) * softcap if softcap else scores).softmax(-1)
        expected = torch.einsum("hk,khd->hd", weights, vv)
        tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
        torch.testing.assert_close(out[i].double(), expected, **tolerance)


def test_the_builds_cpu_tag_tells_arm_cores_apart(monkeypatch):
    """The kernels are built with -march=native and cached under a tag of the CPU: every ARM machine had one tag
    (its cpuinfo has no "flags" line), so a cache shared by a Graviton3 and a Graviton2 handed the older one SVE code
    it cannot run (SIGILL). x86 machines stay apart by their flags."""
    from pathlib import Path

    import roseinfer.kernels as kernels

    cpuinfo = {
        "graviton2": "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp "
        "cpuid asimdrdm lrcpc dcpop asimddp ssbs\nCPU implementer\t: 0x41\nCPU part\t: 0xd0c\n",
        "graviton3": "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp "
        "cpuid asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs "
        "paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng\nCPU implementer\t: 0x41\nCPU part\t: 0xd40\n",
        "avx2": "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\nmodel name\t: AMD EPYC\n",
        "avx512": "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw\nmodel name\t: AMD EPYC\n",
    }
    monkeypatch.setattr(kernels.platform, "machine", lambda: "aarch64")
    tags = {}
    for name, text in cpuinfo.items():
        monkeypatch.setattr(Path, "read_text", lambda self, *a, text=text, **k: text)
        tags[name] = kernels._cpu_tag()
    assert len(set(tags.values())) == len(tags), tags
