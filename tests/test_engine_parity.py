"""Greedy output of the engine equals transformers' generate, token for token, under every scheduling path."""

from __future__ import annotations

import random

import pytest
from conftest import hf_greedy

from roseinfer import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def _prompts(n: int, seed: int = 1, lo: int = 3, hi: int = 60, prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _run_online(llm: LLM, prompts: list[list[int]], arrive_every: int, params=GREEDY) -> dict[str, list[int]]:
    """Feed one prompt every ``arrive_every`` steps while the others decode."""
    engine, done, pending = llm.engine, {}, list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % arrive_every == 0:
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
    return done


@pytest.mark.parametrize("kernels", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["c-kernels", "torch-ops"])
@pytest.mark.parametrize("model", ["tiny_llama", pytest.param("tiny_gpt2", marks=pytest.mark.slow)])
def test_mixed_batch_matches_transformers(model, kernels, request):
    if not kernels:
        request.getfixturevalue("no_kernels")
    path = request.getfixturevalue(model)
    prompts = _prompts(6)
    llm = LLM(path, dtype="float32")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 24)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


def test_logit_bias_matches_transformers_sequence_bias(tiny_llama):
    """Rows with and without a logit_bias in one batch: each equals transformers' greedy generate with that bias
    (its ``sequence_bias`` of one-token sequences), and the biases change what comes out."""
    rng = random.Random(3)
    prompts = _prompts(6, seed=4, hi=40)
    biases = [None if i % 3 == 0 else {rng.randrange(256): rng.uniform(-20, 20) for _ in range(8)} for i in range(6)]
    biases[5] = {t: 100.0 if j == 0 else -100.0 for j, t in enumerate(rng.sample(range(256), 4))}  # the extremes
    llm = LLM(tiny_llama, dtype="float32")
    params = [SamplingParams(max_tokens=16, temperature=0, logit_bias=b) for b in biases]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == hf_greedy(tiny_llama, prompts, 16, logit_biases=biases)
    plain = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    changed = [g != o.outputs[0].token_ids[:16] for g, o in zip(got, plain)]
    assert changed[5] and sum(changed) >= 3 and not changed[0] and not changed[3]


def _hf_prompt_logprobs(model, prompt: list[int], top: int) -> list[tuple[float, set[int]] | None]:
    """transformers' log-softmax at each prompt position: (the next prompt token's logprob, the top ``top`` ids)."""
    import torch

    with torch.inference_mode():
        lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    return [None] + [
        (lp[i, prompt[i + 1]].item(), set(lp[i].topk(top).indices.tolist())) for i in range(len(prompt) - 1)
    ]


@pytest.mark.parametrize(
    "engine",
    [
        {"max_num_batched_tokens": 24, "block_size": 8},
        pytest.param({"kv_cache_memory": 8 * 2 * 2 * 16 * 2 * 16 * 4, "block_size": 16}, marks=pytest.mark.slow),
    ],
    ids=["chunked-prefill-and-prefix-cache", "preemption"],
)
def test_prompt_logprobs_match_transformers(tiny_llama, engine):
    """vLLM's prompt_logprobs: each prompt token's logprob under the model and the top-N beside it, as transformers
    computes them, through chunked prefills, a shared prefix in the cache (a request that needs them computes its
    whole prompt), and preemption (a recompute adds none twice). Requests without them are unchanged."""
    shared = _prompts(1, seed=7, lo=40, hi=40)[0]
    prompts = _prompts(5, seed=8, lo=3, hi=40, prefix=shared)
    tops = [0, 2, 5, None, 3]
    import torch
    from transformers import AutoModelForCausalLM

    llm = LLM(tiny_llama, dtype="float32", **engine)
    params = [SamplingParams(max_tokens=28, temperature=0, prompt_logprobs=k) for k in tops]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tiny_llama, prompts, 28)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    for prompt, top, out in zip(prompts, tops, outs):
        if top is None:
            assert out.prompt_logprobs is None
            continue
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for i, (got, (value, best)) in enumerate(
            zip(out.prompt_logprobs[1:], _hf_prompt_logprobs(hf, prompt, top)[1:])
        ):
            assert got[prompt[i + 1]] == pytest.approx(value, abs=1e-4)
            assert set(got) == best | {prompt[i + 1]}
    if "kv_cache_memory" in engine:
        assert llm.engine.scheduler.num_preemptions > 0
    else:
        assert llm.engine.kv.prefix_hit_tokens > 0  # the request without them hit the shared prefix


@pytest.mark.parametrize(
    "block_size", [pytest.param(16, marks=pytest.mark.slow), 8, pytest.param(4, marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("kernels", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["c-kernels", "torch-ops"])
def test_arrivals_chunked_prefill_and_prefix_hits(tiny_llama, kernels, block_size, request):
    if not kernels:
        request.getfixturevalue("no_kernels")
    shared = _prompts(1, seed=7, lo=40, hi=40)[0]  # 40 shared tokens: at least 32 in full blocks
    prompts = _prompts(4, seed=2, prefix=shared) + _prompts(3, seed=3, lo=70, hi=90)
    llm = LLM(tiny_llama, dtype="float32", max_num_batched_tokens=24, block_size=block_size)
    done = _run_online(llm, prompts, arrive_every=3)
    ref = hf_greedy(tiny_llama, prompts, 24)
    assert [done[f"r{i}"] for i in range(len(prompts))] == ref
    assert llm.engine.kv.prefix_hit_tokens >= 3 * 32  # the later shared-prefix prompts reused the blocks
    assert llm.engine.kv.num_used_blocks == 0  # every block back in the pool


def test_preemption_resumes_with_the_same_tokens(tiny_llama):
    prompts = _prompts(6, seed=5, lo=20, hi=30)
    # 12 blocks of 16 tokens: not enough for six requests of ~50 tokens each, so some get preempted.
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory=12 * 2 * 2 * 16 * 2 * 16 * 4, block_size=16)
    assert llm.engine.kv.num_blocks == 12
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=28, temperature=0), use_tqdm=False
    )
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tiny_llama, prompts, 28)
    assert llm.engine.kv.num_used_blocks == 0


def test_a_failed_step_leaves_no_unfilled_block_in_the_prefix_cache(tiny_llama, monkeypatch):
    """A step that raises (out of memory, say) after it allocated and registered its blocks: the request is
    aborted and sent again (as the worker retries it), and must not hit blocks whose K/V were never written."""
    llm = LLM(tiny_llama, dtype="float32", block_size=8)
    engine = llm.engine
    prompt = _prompts(1, seed=11, lo=40, hi=40)[0]  # 5 full blocks
    other = _prompts(1, seed=12, lo=40, hi=40)[0]
    llm.generate([{"prompt_token_ids": other}], GREEDY, use_tqdm=False)  # the free blocks hold another's K/V
    forward = engine.model.forward
    calls = []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("out of memory")
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", fails_once)
    engine.add_request("first", {"prompt_token_ids": prompt}, GREEDY)
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.step()
    engine.abort_request("first")
    again = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == hf_greedy(tiny_llama, [prompt], 24)[0]
    assert engine.kv.num_used_blocks == 0


def test_a_failed_step_takes_back_the_draws_of_the_seeded_requests_that_run_on(tiny_llama, monkeypatch):
    """A step that fails after its sampler drew (prompt logprobs out of memory): the request it admitted on a
    prefix hit goes back to waiting and runs again, and its seeded generator, one draw ahead, gave every later token
    from the wrong draw. Its output is the one a run without the failure gives."""
    prompt = list(range(10, 22))  # 3 full blocks of 4: the seeded request's prefix hit
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=1234)

    def run(fail: bool) -> list[int]:
        engine = LLM(tiny_llama, dtype="float32", block_size=4).engine
        engine.add_request("warm", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, temperature=0))
        while engine.has_unfinished_requests():
            engine.step()
        engine.add_request("s", {"prompt_token_ids": prompt + [99]}, seeded)
        if fail:
            engine.add_request("q", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2, prompt_logprobs=1))
            logprobs = engine.runner._prompt_logprobs

            def out_of_memory(*args, **kwargs):
                monkeypatch.setattr(engine.runner, "_prompt_logprobs", logprobs)
                raise RuntimeError("out of memory")

            monkeypatch.setattr(engine.runner, "_prompt_logprobs", out_of_memory)
            with pytest.raises(RuntimeError, match="out of memory"):
                engine.step()
            assert engine.running_request_ids() == ["q"]  # "s" went back to waiting: it runs again
            engine.abort_request("q")  # as the worker fails the running ones
        done = {}
        while engine.has_unfinished_requests():
            done |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
        return done["s"]

    assert run(fail=True) == run(fail=False)


def test_the_models_generation_config_gives_the_defaults_of_unset_fields(tiny_llama, tmp_path):
    """As vLLM: a model's recommended settings (its generation_config.json) are ``get_default_sampling_params()``,
    what ``generate`` uses when given none; transformers' greedy generate applies its repetition_penalty too, and
    greedy with those defaults matches it token for token. Parameters given explicitly stay as given."""
    import dataclasses
    import shutil

    from transformers import GenerationConfig

    path = tmp_path / "recommends"
    shutil.copytree(tiny_llama, path)
    GenerationConfig(repetition_penalty=1.3, max_new_tokens=12).save_pretrained(path)
    llm = LLM(str(path), dtype="float32")
    defaults = llm.get_default_sampling_params()
    assert (defaults.repetition_penalty, defaults.max_tokens, defaults.temperature) == (1.3, 12, 1.0)
    prompts = [[5, 6, 7, 8, 9], [40, 41, 40, 41, 40, 41], [100, 3, 100, 3]]
    requests = [{"prompt_token_ids": p} for p in prompts]
    greedy = dataclasses.replace(defaults, temperature=0.0)
    outs = llm.generate(requests, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(str(path), prompts, 12)
    plain = llm.generate(requests, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] != [o.outputs[0].token_ids for o in outs]
