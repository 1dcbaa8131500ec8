"""n samples per request: the prompt is computed once and its full blocks are shared by every sample (reference
counted in the KV cache manager); each sample of a seeded request has its own seed, so reruns repeat every one."""

from __future__ import annotations

import json

import jsonschema
import pytest

from roseinfer import LLM, SamplingParams

PROMPT = "Write a short story about a lighthouse by the sea. " * 12


@pytest.fixture(scope="module")
def llm(tiny_chat_model):
    return LLM(tiny_chat_model, dtype="float32", max_num_seqs=16, block_size=8)


def run_to_end(engine, request_id, prompt, params):
    deltas, final = [], None
    engine.add_request(request_id, prompt, params)
    refcounts = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                deltas.append((out.delta_index, out.delta_token_ids))
                final = out if out.finished else final
        table = engine.kv.get_block_ids(f"{request_id}[0]")
        if table:
            refcounts.append(engine.kv.blocks[table[0]].ref_count)
    return deltas, final, refcounts


def test_n_samples_share_the_prompt_computed_once(llm):
    engine = llm.engine
    engine.kv.reset_prefix_cache()
    n, params = 4, SamplingParams(temperature=1.0, seed=9, max_tokens=12, ignore_eos=True, n=4)
    num_prompt = len(engine.tokenize(PROMPT)[1])
    stats = engine.stats
    before, prompts, cached = stats.num_prefill_tokens, stats.num_prompt_tokens_computed, stats.num_prompt_tokens_cached
    deltas, final, refcounts = run_to_end(engine, "story", PROMPT, params)
    computed = engine.stats.num_prefill_tokens - before
    # The first sample computes the prompt; the others only what follows its last full block.
    tail = num_prompt - (num_prompt - 1) // 8 * 8
    assert computed == num_prompt + (n - 1) * tail
    # The request's prompt counted once (roseinfer_prompt_tokens_total: it was once a sample, n times), none cached;
    # again, its full blocks come from the cache (roseinfer_prompt_tokens_cached_total).
    assert (stats.num_prompt_tokens_computed - prompts, stats.num_prompt_tokens_cached - cached) == (num_prompt, 0)
    run_to_end(engine, "again", PROMPT, params)
    assert stats.num_prompt_tokens_computed - prompts == 2 * num_prompt
    assert stats.num_prompt_tokens_cached - cached == num_prompt - tail
    assert max(refcounts) == n  # the prompt's first block is held by all four samples at once
    assert [c.index for c in final.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in final.outputs)
    assert len({tuple(c.token_ids) for c in final.outputs}) == n  # sampled: different samples
    for c in final.outputs:  # each sample's deltas add up to its output
        assert [t for i, ids in deltas if i == c.index for t in ids] == c.token_ids
    assert final.request_id == "story" and engine.kv.num_block_tables == 0
    # The request's metrics say its prompt's hits: the other samples' on the first one's blocks are not the cache's
    # (their sum, 384 here, was more than the prompt; the stats said 0).
    assert final.metrics.num_cached_tokens == 0


def test_unfinished_requests_are_counted_as_requests_not_samples(llm):
    """vLLM's count: an n = 4 request is one (it was 4), until its last output is out."""
    engine = llm.engine
    engine.add_request("four", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True, n=4))
    engine.add_request("one", PROMPT, SamplingParams(max_tokens=5, ignore_eos=True))
    counts = []
    while engine.has_unfinished_requests():
        counts.append(engine.get_num_unfinished_requests())
        engine.step()
    assert counts[0] == 2 and counts[-1] == 1 and engine.get_num_unfinished_requests() == 0


@pytest.mark.slow
def test_seeded_samples_repeat_and_sample_zero_is_the_n1_request(llm):
    params = SamplingParams(temperature=1.0, seed=21, max_tokens=10, ignore_eos=True, n=3)
    first = llm.generate([PROMPT], params, use_tqdm=False)[0]
    again = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    single = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=21, max_tokens=10, ignore_eos=True))[0]
    assert single.outputs[0].token_ids == first.outputs[0].token_ids
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=2))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


@pytest.mark.slow
def test_n_with_a_structured_output(llm):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    schema["additionalProperties"] = False
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=30, n=3, structured_outputs={"json": schema})
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    for c in out.outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), schema)


def test_an_abort_ends_every_sample(llm):
    engine = llm.engine
    engine.add_request("cut", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True, n=3))
    engine.step()
    # A sample's own id is no request's: its abort ended that sample of another caller's request without a word.
    assert engine.abort_request("cut[1]") == []
    with pytest.raises(ValueError, match=r"names a sample of the request 'cut'"):
        engine.add_request("cut[0]", PROMPT, SamplingParams(max_tokens=5))
    last = engine.abort_request("cut")[-1]
    assert last.finished and [c.finish_reason for c in last.outputs] == ["abort"] * 3
    assert not engine.has_unfinished_requests() and engine.kv.num_block_tables == 0
    assert engine.abort_request("cut") == []


def test_n_bounds_and_no_resume(llm):
    for bad in (0, 65, 2.0, True):
        with pytest.raises(ValueError, match="n must be"):
            SamplingParams(n=bad)
    with pytest.raises(ValueError, match="cannot resume"):
        llm.engine.add_request("r", PROMPT, SamplingParams(n=2, max_tokens=5), output_prefix=[5, 6])
    assert not llm.engine.has_unfinished_requests()


def test_negative_seeds_repeat_and_are_their_own_streams(llm):
    """OpenAI-shaped APIs take any signed 64-bit seed. (PyTorch's CPU generator keeps a seed's low 32 bits, so
    seeds 2**32 apart share a stream there; the ones below differ in those bits.)"""

    def sample(seed):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True)
        return tuple(llm.generate(["The sea"], params, use_tqdm=False)[0].outputs[0].token_ids)

    lowest = sample(-(2**63))
    assert sample(-(2**63)) == lowest and len(sample(2**63 - 1)) == 8
    assert len({sample(-1), sample(-2), sample(1), sample(2)}) == 4
