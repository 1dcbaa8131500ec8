"""The default model (SmolLM2-135M-Instruct): parity with transformers, sampling, logprobs, stop strings."""

from __future__ import annotations

import json
import math

import pytest
from conftest import hf_greedy

from roseinfer import LLM, SamplingParams
from roseinfer.bench import DEFAULT_WORKLOAD

pytestmark = pytest.mark.slow
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a prime number is.",
    "hi",
    "List three benefits of regular exercise, with a short explanation of each one, please.",
    "Translate 'good morning' into French and Spanish.",
]


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2-135m-instruct", dtype="float32")


def test_greedy_matches_transformers_on_a_mixed_batch(llm, default_model_path):
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outs = llm.chat(convs, SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)
    prompts = [o.prompt_token_ids for o in outs]
    assert len({len(p) for p in prompts}) > 3  # really mixed lengths
    ref = hf_greedy(default_model_path, prompts, 40)
    for out, expected in zip(outs, ref):
        got = out.outputs[0].token_ids
        # transformers stops at EOS and includes it; so do we.
        assert got == expected
    assert outs[0].outputs[0].text == "The capital of France is Paris."
    assert outs[0].outputs[0].finish_reason == "stop"


def test_seeded_request_is_the_same_alone_and_in_a_full_batch(llm):
    conv = [{"role": "user", "content": "Tell me a story about a dragon."}]
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone = llm.chat([conv], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [[{"role": "user", "content": q}] for q in QUESTIONS]
    batch = llm.chat(
        others + [conv] + others,
        [SamplingParams(max_tokens=30, temperature=1.0)] * len(others)
        + [params]
        + [SamplingParams(max_tokens=10, temperature=0)] * len(others),
        use_tqdm=False,
    )
    assert batch[len(others)].outputs[0].token_ids == alone
    again = llm.chat([conv], params, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone
    params_99 = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=99)
    other_seed = llm.chat([conv], params_99, use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone


def test_logprobs_are_log_probabilities_of_the_chosen_tokens(llm):
    out = llm.chat(
        [[{"role": "user", "content": "Say hello."}]],
        SamplingParams(max_tokens=6, temperature=0, logprobs=3),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and len(entry) <= 4
        assert all(lp <= 0 for lp in entry.values())
        assert entry[token] == max(entry.values())  # greedy: the chosen token is the most likely
        assert sum(math.exp(lp) for lp in entry.values()) <= 1.0 + 1e-5


def test_stop_string_is_cut_and_streamed_text_never_shows_it(llm):
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    engine = llm.engine
    engine.add_request("stop-test", {"messages": conv}, SamplingParams(max_tokens=40, temperature=0, stop=[" Paris"]))
    pieces, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.append(out.delta_text)
            final = out
    assert final.outputs[0].text == "The capital of France is"
    assert "".join(pieces) == final.outputs[0].text
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == " Paris"


def test_min_tokens_and_ignore_eos_hold_off_eos(llm):
    conv = [[{"role": "user", "content": "What is the capital of France?"}]]
    out = llm.chat(conv, SamplingParams(max_tokens=20, min_tokens=15, temperature=0), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 15
    out = llm.chat(conv, SamplingParams(max_tokens=20, ignore_eos=True, temperature=0), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 20 and out.finish_reason == "length"


def test_bench_workload_prompts_all_finish(llm):
    prompts = json.loads(DEFAULT_WORKLOAD.read_text())[:16]
    outs = llm.chat(
        [[{"role": "user", "content": p}] for p in prompts],
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [16] * 16
    assert llm.engine.kv.num_used_blocks == 0


def test_count_tokens_takes_the_model_names_a_worker_takes(default_model_path):
    """``batch --dry-run --count-tokens smollm2-135m-instruct`` found no tokenizer: it took the name for a hub id."""
    from transformers import AutoTokenizer

    from producer.cli import _tokenizer

    by_name = _tokenizer("smollm2-135m-instruct")
    assert by_name.encode("Hello there") == AutoTokenizer.from_pretrained(default_model_path).encode("Hello there")


def test_int8_answers_as_the_float_model_does_and_scores_its_text_near_it(llm):
    """The default model in int8 (output layer too): the answers keep their facts, and the float model finds the
    int8 text nearly as likely as its own (benchmarks/int8_cpu.py measures it on the 64 bench prompts)."""
    int8 = LLM("smollm2-135m-instruct", dtype="float32", quantization="int8", int8_output_layer=True)
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(max_tokens=32, temperature=0)
    ours, theirs = (m.chat(convs, params, use_tqdm=False) for m in (llm, int8))
    assert "Paris" in theirs[0].outputs[0].text
    score = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def mean_logprob(outs) -> float:  # the float model's, of each output after its prompt
        prompts = [{"prompt_token_ids": o.prompt_token_ids + o.outputs[0].token_ids} for o in outs]
        scored = llm.generate(prompts, score, use_tqdm=False)
        lps = [s.prompt_logprobs[i][s.prompt_token_ids[i]] for s, o in zip(scored, outs)
               for i in range(len(o.prompt_token_ids), len(s.prompt_token_ids))]  # fmt: skip
        return sum(lps) / len(lps)

    own, quantized = mean_logprob(ours), mean_logprob(theirs)
    # (greedy text is not the likeliest text: the int8 answers may even score a little higher)
    assert abs(own - quantized) < 0.1, (own, quantized)  # nats a token
