"""The GPU path (Triton attention, CUDA-graph decode) against transformers on the same GPU, at float32: token for
token, through graph replay at every batch-size bucket, chunked prefill, preemption and prefix hits. Skipped
where there is no CUDA device."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import hf_greedy

from roseinfer import LLM, SamplingParams
from roseinfer.tiny_models import RANDOM_SHAPES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 60, vocab: int = 256, prefix=()) -> list[list[int]]:
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _save(tmp_path_factory, name: str, config) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(name)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_llama, tiny_gpt2) -> dict[str, str]:
    from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    small = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,
        eos_token_id=None,
        bos_token_id=None,
    )
    qwen2 = Qwen2Config(**small)
    qwen3 = Qwen3Config(**small, head_dim=32)  # q/k norms, heads wider than hidden / heads
    mistral = MistralConfig(**small, sliding_window=6)  # every layer slides, in the graphs' decode kernel too
    gemma3 = Gemma3TextConfig(
        **{**small, "num_hidden_layers": 3, "head_dim": 32, "sliding_window": 6, "pad_token_id": None},
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    )
    # SmolLM2-135M's shape: 30 layers, 9 query heads on 3 K/V heads, head dim 64, tied embeddings.
    smol = LlamaConfig(
        **RANDOM_SHAPES["smollm2-135m"],
        max_position_embeddings=2048,
        initializer_range=0.1,  # decisive logits: greedy argmax is not decided by rounding
        eos_token_id=None,
        bos_token_id=None,
    )
    gemma2 = Gemma2Config(  # capped scores in the graphs' decode kernel and the prefill kernel
        **{**small, "num_hidden_layers": 3, "head_dim": 32, "sliding_window": 6, "pad_token_id": None},
        attn_logit_softcapping=2.0,
    )
    return {
        "llama": tiny_llama,
        "qwen2": _save(tmp_path_factory, "qwen2", qwen2),
        "qwen3": _save(tmp_path_factory, "qwen3", qwen3),
        "mistral-window": _save(tmp_path_factory, "mistral", mistral),
        "gemma3": _save(tmp_path_factory, "gemma3", gemma3),
        "gemma2": _save(tmp_path_factory, "gemma2", gemma2),
        "gpt2": tiny_gpt2,
        "smollm2-shape": _save(tmp_path_factory, "smol", smol),
    }


@pytest.mark.parametrize(
    "name", ["llama", "qwen2", "qwen3", "mistral-window", "gemma2", "gemma3", "gpt2", "smollm2-shape"]
)
def test_greedy_matches_transformers_on_the_gpu_through_graph_replay(models, name):
    path = models[name]
    vocab = 49152 if name == "smollm2-shape" else 256
    prompts = _prompts(12, seed=1, vocab=vocab)
    llm = LLM(path, dtype="float32", device="cuda", max_num_seqs=16)
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=24, temperature=0))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 24, device="cuda")
    assert sum(graphs.replays.values()) > 0


def test_a_longrope_model_matches_transformers_through_graph_replay_past_its_original_length(tiny_longrope):
    """Prompts within the original length (64) decoded past it, recomputed there, and prompts past it: the graphs
    take each token's rotary row from their own buffer."""
    prompts = _prompts(6, seed=3, vocab=256, lo=40, hi=60) + _prompts(2, seed=4, vocab=256, lo=70, hi=90)
    llm = LLM(tiny_longrope, dtype="float32", device="cuda", max_num_seqs=16)
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=32, temperature=0))
    expected = hf_greedy(tiny_longrope, prompts, 32, device="cuda", use_cache=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert sum(graphs.replays.values()) > 0


def test_a_mixture_of_experts_decodes_eagerly_and_matches_transformers(tmp_path_factory):
    """Which experts a step runs depends on its tokens, which no captured graph can replay: its steps run eagerly."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        max_position_embeddings=512, initializer_range=0.3, eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    path = _save(tmp_path_factory, "qwen3-moe", config)
    prompts = _prompts(12, seed=1, vocab=256)
    llm = LLM(path, dtype="float32", device="cuda", max_num_seqs=16)
    assert llm.engine.runner.graphs is None
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=24, temperature=0))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 24, device="cuda")


def test_graph_replay_at_every_bucket_size(models):
    path = models["llama"]
    llm = LLM(path, dtype="float32", device="cuda", max_num_seqs=40)
    graphs = llm.engine.runner.graphs
    assert graphs.sizes == [1, 2, 4, 8, 16, 32, 40]
    prompts = _prompts(40, seed=2, lo=5, hi=30)
    ref = hf_greedy(path, prompts, 12, device="cuda")
    for n in [1, 2, 3, 4, 7, 8, 13, 16, 31, 32, 35, 40]:  # each bucket, full and padded
        graphs.replays.clear()
        params = SamplingParams(max_tokens=12, temperature=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:n]], params)
        assert [o.outputs[0].token_ids for o in outs] == ref[:n], f"{n} requests"
        assert graphs.replays[graphs.bucket(n)] > 0, f"{n} requests never replayed bucket {graphs.bucket(n)}"


def test_chunked_prefill_prefix_hits_and_arrivals_on_the_gpu(models):
    path = models["llama"]
    shared = _prompts(1, seed=7, lo=40, hi=40)[0]
    prompts = _prompts(4, seed=2, prefix=shared) + _prompts(3, seed=3, lo=70, hi=90)
    llm = LLM(path, dtype="float32", device="cuda", max_num_batched_tokens=24, block_size=8)
    engine, done, pending, step = llm.engine, {}, list(enumerate(prompts)), 0
    params = SamplingParams(max_tokens=24, temperature=0)
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert [done[f"r{i}"] for i in range(len(prompts))] == hf_greedy(path, prompts, 24, device="cuda")
    assert engine.kv.prefix_hit_tokens >= 3 * 32
    assert engine.kv.num_used_blocks == 0


def test_preemption_on_the_gpu(models):
    path = models["llama"]
    prompts = _prompts(6, seed=5, lo=20, hi=30)
    llm = LLM(path, dtype="float32", device="cuda", kv_cache_memory=12 * 2 * 2 * 16 * 2 * 16 * 4, block_size=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=28, temperature=0))
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 28, device="cuda")


def test_eager_and_graph_decode_agree_and_sampling_runs_on_the_gpu(models):
    path = models["llama"]
    prompts = _prompts(5, seed=9)
    params = [SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=20, seed=i) for i in range(5)]
    runs = []
    for eager in (False, True):
        llm = LLM(path, dtype="float32", device="cuda", enforce_eager=eager)
        assert (llm.engine.runner.graphs is None) == eager
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        runs.append([o.outputs[0].token_ids for o in outs])
    assert runs[0] == runs[1]


def test_sampling_is_queued_on_the_gpu_without_waiting_for_it():
    """Temperature, filters, a logit bias, penalties, seeds, min_tokens, logprobs and a structured output's mask:
    ``start`` makes no host sync (CUDA's sync debug mode raises on one), so the host's one wait a step is
    ``result()``."""
    from test_sampler import _mixed_batch

    from roseinfer.sampler import Sampler, seeded_generator

    seqs, masks = _mixed_batch(40)
    for s in seqs:
        if s.params.seed is not None:
            s.generator = seeded_generator(s.params.seed, torch.device("cuda"))
    logits = torch.randn(6, 40, device="cuda") * 3
    sampler = Sampler([0], 5, torch.device("cuda"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = sampler.start(logits, seqs, masks)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    got = pending.result()
    on_cpu = Sampler([0], 5, torch.device("cpu"))(logits.cpu(), *_mixed_batch(40))
    assert got.token_ids[4] == 5 and got.token_ids[0] == on_cpu.token_ids[0]  # the greedy rows agree
    assert got.logprobs[4].keys() == on_cpu.logprobs[4].keys()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_decodes_through_graphs_as_transformers_does(models, dtype):
    path = models["llama"]
    prompts = _prompts(8, seed=11)
    llm = LLM(path, dtype=dtype, device="cuda", max_num_seqs=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=16, temperature=0))
    ref = hf_greedy(path, prompts, 16, dtype=dtype, device="cuda")
    got = [o.outputs[0].token_ids for o in outs]
    # Half precision rounds differently in fused kernels: a near tie may flip, and the rest of that row follows.
    first_diff = [next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), len(r)) for g, r in zip(got, ref)]
    assert sum(first_diff) >= 0.9 * 16 * len(prompts), first_diff
    assert llm.engine.runner.graphs.replays


def test_jobs_through_redis_on_the_gpu_equal_the_engine_in_process(redis_url, tmp_path):
    from conftest import ThreadWorker
    from test_queue_integration import _reference, _varied_requests

    from producer import Client
    from roseinfer.tiny_models import save_tiny_chat_model

    tiny_chat_model = save_tiny_chat_model(tmp_path / "tiny-chat")  # its own small tokenizer: no default model needed

    reqs = _varied_requests(40)
    worker = ThreadWorker(redis_url, tiny_chat_model, device="cuda", dtype="float32", max_num_seqs=16)
    try:
        client = Client(redis_url, queue=worker.queue)
        jobs = client.submit_many(reqs)
        results = [job.result(timeout=300) for job in jobs]
        streamed = ["".join(job.stream(timeout=30)) for job in jobs]
    finally:
        worker.stop()
    expected = _reference(tiny_chat_model, jobs, reqs, device="cuda", dtype="float32")
    assert [r["token_ids"] for r in results] == expected
    assert streamed == [r["text"] for r in results]
