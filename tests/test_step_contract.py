"""The engine's step contract: the scheduler says what runs (fixed when it says it), the runner computes it, and
``Scheduler.update_from_output`` alone records the result; the KV manager owns the block tables; each attention
backend owns its KV cache layout."""

from __future__ import annotations

import sys

import pytest
import torch

from roseinfer import LLM, SamplingParams
from roseinfer.attention import (
    KV_CACHE_DIMS,
    CpuKernelAttentionBackend,
    TorchAttentionBackend,
    select_attention_backend,
)
from roseinfer.attention.triton_backend import TritonAttentionBackend
from roseinfer.block_manager import KVCacheManager
from roseinfer.kernels import add_rms_norm, cpu_kernels_for, triton_kernels_for
from roseinfer.sampler import SamplerOutput
from roseinfer.scheduler import ScheduledRequest, Scheduler
from roseinfer.sequence import Sequence

CPU = torch.device("cpu")


def make(num_blocks=64, block_size=4, max_seqs=8, budget=64):
    kv = KVCacheManager(num_blocks, block_size)
    return kv, Scheduler(kv, max_seqs, budget)


def add(sched, rid, tokens):
    s = Sequence(rid, list(tokens), SamplingParams(), None, None)
    sched.add(s)
    return s


def update(sched, out, token=1):
    num_samples = sum(item.samples for item in out.scheduled)
    return sched.update_from_output(out, SamplerOutput([token] * num_samples, [None] * num_samples), now=1.0)


def fields(item: ScheduledRequest):
    return item.seq.request_id, item.start, item.num_tokens, item.samples, item.is_prefill, list(item.block_ids)


# ----- the scheduler's output ------------------------------------------------------------------------------
def test_decodes_come_first_and_a_prompts_last_single_token_is_a_decode():
    _, sched = make(block_size=4, budget=64)
    a = add(sched, "a", range(100, 109))  # 9 tokens: two full blocks, registered in the prefix cache
    update(sched, sched.schedule())
    add(sched, "long", range(200, 240))
    b = add(sched, "b", [*a.token_ids[:8], 77])  # the prefix hit leaves only its last prompt token
    out = sched.schedule()
    assert [(i.seq.request_id, i.num_tokens, i.is_prefill) for i in out.scheduled] == [
        ("a", 1, False),
        ("b", 1, False),
        ("long", 40, True),
    ]
    assert out.num_decodes == 2 and out.num_batched_tokens == 42
    assert all(i.samples for i in out.scheduled)
    assert out.scheduled[1].start == 8 and b.num_computed_tokens == 8 and b.num_cached_tokens == 8


def test_a_one_token_chunk_that_does_not_sample_is_a_prefill():
    _, sched = make(budget=2)
    add(sched, "a", range(2))
    update(sched, sched.schedule())  # a prefilled: one decode token next
    add(sched, "c", range(50, 60))
    out = sched.schedule()
    assert [(i.seq.request_id, i.num_tokens, i.samples, i.is_prefill) for i in out.scheduled] == [
        ("a", 1, True, False),
        ("c", 1, False, True),
    ]
    assert out.num_decodes == 1


def test_step_fields_are_fixed_when_scheduled_and_still_right_after_the_update():
    kv, sched = make(block_size=4, budget=16)
    long = add(sched, "long", range(40))
    expected = [
        ("long", 0, 16, False, True),
        ("long", 16, 16, False, True),
        ("long", 32, 8, True, True),
        ("long", 40, 1, True, False),
    ]
    previous = []
    for want in expected:
        out = sched.schedule()
        (item,) = out.scheduled
        before = fields(item)
        assert before[:5] == want
        assert item.block_ids == kv.get_block_ids("long")
        assert len(item.block_ids) == kv.blocks_needed(item.start + item.num_tokens)
        new_tokens = update(sched, out)
        assert fields(item) == before  # nothing in the output moved with the request
        assert long.num_computed_tokens == item.start + item.num_tokens
        assert new_tokens == ([(long, 1)] if item.samples else [])
        previous.append((item, before))
    for item, before in previous:  # later allocations did not touch earlier steps' tables
        assert fields(item) == before
    assert long.output_token_ids == [1, 1]


def test_update_records_tokens_logprobs_and_first_token_time_in_scheduled_order():
    _, sched = make(budget=64)
    a = add(sched, "a", range(5))
    b = add(sched, "b", range(10, 13))
    a.logprobs = []
    out = sched.schedule()
    sampled = SamplerOutput([7, 8], [{7: -0.5}, None])
    assert sched.update_from_output(out, sampled, now=3.0) == [(a, 7), (b, 8)]
    assert a.output_token_ids == [7] and b.output_token_ids == [8]
    assert a.logprobs == [{7: -0.5}] and b.logprobs is None
    assert a.first_token_time == 3.0 and b.first_token_time == 3.0
    out = sched.schedule()
    with pytest.raises(ValueError, match="sampled tokens"):
        sched.update_from_output(out, SamplerOutput([1], [None]), now=4.0)
    assert (a.num_computed_tokens, a.num_tokens) == (5, 6)  # the refused output changed nothing


# ----- who writes what ---------------------------------------------------------------------------------------
class WatchedSequence(Sequence):
    """Records the module of every assignment to num_computed_tokens."""

    writers: set[str]

    def __setattr__(self, name, value):
        if name == "num_computed_tokens":
            type(self).writers.add(sys._getframe(1).f_globals["__name__"])
        super().__setattr__(name, value)


def test_only_the_scheduler_moves_num_computed_tokens():
    WatchedSequence.writers = set()
    kv, sched = make(num_blocks=10, block_size=4, budget=12)
    shared = list(range(300, 308))
    seqs = [
        WatchedSequence(f"r{i}", [*shared, *range(10 * i, 10 * i + 6)], SamplingParams(), None, None) for i in range(5)
    ]
    for s in seqs:
        sched.add(s)
    preempted = 0
    for _ in range(200):
        out = sched.schedule()
        preempted += len(out.preempted)
        update(sched, out)
        for s in list(sched.running()):
            if s.num_output_tokens >= 6:
                sched.finish(s, "length")
        if not sched.has_unfinished():
            break
    assert not sched.has_unfinished()
    assert preempted > 0 and kv.prefix_hit_tokens > 0  # both paths that used to write it in the KV manager ran
    assert WatchedSequence.writers == {"roseinfer.sequence", "roseinfer.scheduler"}  # __init__, then the scheduler
    assert kv.num_used_blocks == 0 and kv.num_block_tables == 0


def test_the_kv_manager_reports_a_prefix_hit_and_the_scheduler_records_it():
    kv, sched = make(block_size=4)
    a = add(sched, "a", range(12))
    update(sched, sched.schedule())
    b = Sequence("b", list(range(8)) + [99], SamplingParams(), None, None)
    hit = kv.get_computed_blocks(b)
    assert hit.num_tokens == 8 and hit.block_ids == kv.get_block_ids("a")[:2]
    assert kv.allocate_slots(b, 1, hit) and b.num_computed_tokens == 0
    kv.free("b")
    assert b.num_computed_tokens == 0
    sched.add(b)
    out = sched.schedule()
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert [fields(i)[:5] for i in out.scheduled] == [("a", 12, 1, True, False), ("b", 8, 1, True, False)]
    assert a.num_computed_tokens == 12  # scheduled, not yet updated


def test_block_tables_are_owned_by_the_kv_manager_and_released_to_zero():
    kv, sched = make(block_size=4, budget=32)
    seqs = [add(sched, f"r{i}", range(20 * i, 20 * i + 9)) for i in range(3)]
    out = sched.schedule()
    assert not hasattr(seqs[0], "block_table")
    assert kv.num_block_tables == 3
    for item in out.scheduled:
        assert item.block_ids == kv.get_block_ids(item.seq.request_id) and len(item.block_ids) == 3
    update(sched, out)
    sched.finish(seqs[0], "stop")
    assert kv.get_block_ids("r0") == [] and kv.num_block_tables == 2
    sched.finish(seqs[1], "abort")
    sched.finish(seqs[2], "abort")
    assert kv.num_block_tables == 0 and kv.num_used_blocks == 0


# ----- attention backends ------------------------------------------------------------------------------------
def backends(block_size: int) -> list:
    found = [TorchAttentionBackend(block_size, torch.float32, CPU)]
    lib = cpu_kernels_for(CPU, torch.float32)
    if lib is not None:
        found.append(CpuKernelAttentionBackend(lib, block_size, torch.float32, CPU))
    return found


def test_declared_layouts():
    assert TorchAttentionBackend.k_cache_layout == ("num_blocks", "block_size", "num_kv_heads", "head_dim")
    assert TorchAttentionBackend.v_cache_layout == ("num_blocks", "block_size", "num_kv_heads", "head_dim")
    assert CpuKernelAttentionBackend.k_cache_layout == ("num_blocks", "num_kv_heads", "head_dim", "block_size")
    assert CpuKernelAttentionBackend.v_cache_layout == ("num_blocks", "num_kv_heads", "block_size", "head_dim")


@pytest.mark.parametrize("backend", [TorchAttentionBackend, CpuKernelAttentionBackend], ids=["torch", "c-kernel"])
def test_kv_cache_shapes_are_the_declared_layout(backend):
    size = dict(num_blocks=5, block_size=4, num_kv_heads=2, head_dim=8)  # all different: any mix-up shows
    args = (None,) if backend is CpuKernelAttentionBackend else ()
    b = backend(*args, size["block_size"], torch.float32, CPU)
    for layout in (b.k_cache_layout, b.v_cache_layout):
        assert sorted(layout) == sorted(KV_CACHE_DIMS)
    caches = b.allocate_kv_caches(3, size["num_blocks"], size["num_kv_heads"], size["head_dim"])
    assert len(caches) == 3
    for k_cache, v_cache in caches:
        assert k_cache.shape == tuple(size[d] for d in b.k_cache_layout)
        assert v_cache.shape == tuple(size[d] for d in b.v_cache_layout)
        assert k_cache.dtype == v_cache.dtype == torch.float32
    assert b.kv_cache_bytes_per_block(3, 2, 8) == 2 * 3 * 4 * 2 * 8 * 4


def _request(start: int, num_tokens: int, samples: bool, block_ids: list[int]) -> ScheduledRequest:
    return ScheduledRequest(None, start, num_tokens, samples, not (num_tokens == 1 and samples), block_ids)


def _step(backend, caches, requests, num_decodes, q, k, v):
    bs = backend.block_size
    positions, slots = [], []
    for r in requests:
        positions += range(r.start, r.start + r.num_tokens)
        slots += [r.block_ids[p // bs] * bs + p % bs for p in range(r.start, r.start + r.num_tokens)]
    meta = backend.build_metadata(requests, num_decodes, torch.tensor(positions), slots)
    out = backend.forward(q, k, v, *caches, meta, 0.3)
    return out, slots


def _canonical(cache: torch.Tensor, layout: tuple[str, ...]) -> torch.Tensor:
    """The cache as [blocks * block_size, Hkv, D] slots, whatever its layout."""
    c = cache.permute(*[layout.index(d) for d in KV_CACHE_DIMS])
    return c.reshape(-1, c.shape[2], c.shape[3])


def test_backends_write_their_layout_and_compute_the_same_attention():
    torch.manual_seed(0)
    bs, heads, kv_heads, dim = 4, 4, 2, 8
    tables = {"a": [3, 1], "b": [0, 6, 2]}
    # Step 1: a's 6-token prompt, the first 5 of b's 9. Step 2: a decodes, b's last 4 tokens.
    steps = [
        ([_request(0, 6, True, tables["a"]), _request(0, 5, False, tables["b"][:2])], 0),
        ([_request(6, 1, True, tables["a"]), _request(5, 4, True, tables["b"])], 1),
    ]
    inputs = [
        (torch.randn(t, heads, dim), torch.randn(t, kv_heads, dim), torch.randn(t, kv_heads, dim)) for t in (11, 5)
    ]
    results = []
    for backend in backends(bs):
        caches = backend.allocate_kv_caches(1, 8, kv_heads, dim)[0]
        outs = []
        for (requests, num_decodes), (q, k, v) in zip(steps, inputs):
            out, slots = _step(backend, caches, requests, num_decodes, q, k, v)
            assert torch.equal(_canonical(caches[0], backend.k_cache_layout)[slots], k)
            assert torch.equal(_canonical(caches[1], backend.v_cache_layout)[slots], v)
            outs.append(out)
        results.append(torch.cat(outs))

    # The reference: each request's queries against its keys up to their own positions, in float64.
    packed_rows = {"a": [*range(6), 11], "b": [*range(6, 11), 12, 13, 14, 15]}  # rows of step 1, then step 2
    q_all, k_all, v_all = (torch.cat([inputs[0][i], inputs[1][i]]).double() for i in range(3))
    ref = torch.empty(16, heads, dim, dtype=torch.float64)
    for idx in packed_rows.values():
        q, k, v = q_all[idx], k_all[idx].repeat_interleave(2, dim=1), v_all[idx].repeat_interleave(2, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * 0.3
        scores += torch.full((len(idx), len(idx)), float("-inf")).triu(1)
        ref[idx] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    assert len(results) == len(backends(bs))
    for out in results:
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_one_function_decides_where_the_c_kernels_run():
    lib = cpu_kernels_for(CPU, torch.float32)
    chosen = select_attention_backend(8, torch.float32, CPU)
    assert isinstance(chosen, CpuKernelAttentionBackend if lib is not None else TorchAttentionBackend)
    for device, dtype in [(torch.device("cuda"), torch.float32), (CPU, torch.float16), (CPU, torch.float64)]:
        assert cpu_kernels_for(device, dtype) is None
        gpu = triton_kernels_for(device) is not None  # CUDA with Triton installed runs the Triton kernels
        assert isinstance(
            select_attention_backend(8, dtype, device), TritonAttentionBackend if gpu else TorchAttentionBackend
        )


def test_kernels_off_means_torch_attention_and_torch_ops(no_kernels):
    assert cpu_kernels_for(CPU, torch.float32) is None
    assert isinstance(select_attention_backend(8, torch.float32, CPU), TorchAttentionBackend)
    h = torch.randn(3, 16)
    ref = h.clone()
    out = add_rms_norm(h, None, torch.ones(16), 1e-6)
    torch.testing.assert_close(out, ref * torch.rsqrt(ref.pow(2).mean(-1, keepdim=True) + 1e-6))


# ----- the runner --------------------------------------------------------------------------------------------
def test_runner_returns_one_token_per_sampling_request_in_scheduled_order(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", max_num_batched_tokens=24, block_size=4)
    engine = llm.engine
    params = SamplingParams(max_tokens=5, temperature=0.0)
    for i, n in enumerate([30, 3, 12, 1]):
        engine.add_request(f"r{i}", list(range(1 + i, 1 + i + n)), params)
    while engine.has_unfinished_requests():
        sched = engine.scheduler.schedule()
        sampled = engine.runner.execute(sched)
        samplers = [item.seq for item in sched.scheduled if item.samples]
        assert len(sampled.token_ids) == len(samplers)
        new_tokens = engine.scheduler.update_from_output(sched, sampled, now=0.0)
        assert [s for s, _ in new_tokens] == samplers and [t for _, t in new_tokens] == sampled.token_ids
        for seq, _ in new_tokens:
            if seq.num_output_tokens >= 5:
                engine.scheduler.finish(seq, "length")
    assert engine.kv.num_used_blocks == 0 and engine.kv.num_block_tables == 0
