"""A request resumed from an earlier attempt's output: at float32 it ends exactly as the uninterrupted run, greedy
and seeded, with penalties, min_tokens and stop strings; its deltas hold only what the earlier attempt had not
streamed."""

from __future__ import annotations

import pytest

from roseinfer import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_chat_model):
    return LLM(tiny_chat_model, dtype="float32", max_num_seqs=8, enable_prefix_caching=True)


def run(llm, request_id, prompt, params, output_prefix=None):
    """Run one request to its end beside two busy neighbours; (per-token deltas, final output)."""
    engine = llm.engine
    engine.add_request(request_id, prompt, params, output_prefix=output_prefix)
    for i in range(2):  # other requests in the batch change its shape, not its tokens
        engine.add_request(f"{request_id}-other{i}", f"neighbour {i}", SamplingParams(max_tokens=7, temperature=1.0))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                deltas.append((out.delta_text, out.delta_token_ids))
                final = out if out.finished else final
    return deltas, final


CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, seed=1234, max_tokens=40, ignore_eos=True),
    "seeded-filters-penalties": SamplingParams(
        temperature=1.2,
        seed=7,
        top_k=50,
        top_p=0.9,
        frequency_penalty=0.8,
        presence_penalty=0.5,
        repetition_penalty=1.3,
        max_tokens=40,
        ignore_eos=True,
    ),
    "min-tokens": SamplingParams(temperature=0.8, seed=5, min_tokens=30, max_tokens=40),
}


_FULL: dict[str, tuple] = {}  # case -> its uninterrupted run, shared by the cut points


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("cut", [pytest.param(1, marks=pytest.mark.slow), 17, pytest.param(39, marks=pytest.mark.slow)])
def test_resumed_request_equals_the_uninterrupted_run(llm, case, cut):
    params = CASES[case]
    if case not in _FULL:
        _FULL[case] = run(llm, f"full-{case}", "Tell me a story", params)
    deltas, full = _FULL[case]
    ids = full.outputs[0].token_ids
    assert len(ids) == 40
    streamed = "".join(text for text, _ in deltas[:cut])

    rest, resumed = run(llm, f"resumed-{case}-{cut}", "Tell me a story", params, output_prefix=ids[:cut])
    assert resumed.outputs[0].token_ids == ids
    assert resumed.outputs[0].text == full.outputs[0].text
    assert resumed.outputs[0].finish_reason == full.outputs[0].finish_reason
    # Only what follows the prefix comes out, and it is what the uninterrupted run streamed after it.
    assert [t for _, d in rest for t in d] == ids[cut:]
    assert streamed + "".join(text for text, _ in rest) == full.outputs[0].text


def test_stop_string_found_across_the_resume_point(llm):
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    _, full = run(llm, "probe", "Once upon", base)
    text = full.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # a string that shows up mid-output
    assert stop.strip()
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=stop)
    deltas, stopped = run(llm, "stopped", "Once upon", params)
    ids = stopped.outputs[0].token_ids
    assert stopped.outputs[0].finish_reason == "stop"
    cut = len(ids) - 1  # resume just before the token that completes the stop string
    streamed = "".join(t for t, _ in deltas[:cut])
    rest, resumed = run(llm, "stopped-resumed", "Once upon", params, output_prefix=ids[:cut])
    assert resumed.outputs[0].token_ids == ids
    assert resumed.outputs[0].text == stopped.outputs[0].text
    assert streamed + "".join(t for t, _ in rest) == stopped.outputs[0].text


def test_prefix_is_computed_in_one_prefill_and_reuses_the_prefix_cache(llm):
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    _, full = run(llm, "cache-full", "A long walk " * 8, params)
    ids = full.outputs[0].token_ids
    steps_before = llm.engine.stats.num_steps
    _, resumed = run(llm, "cache-resumed", "A long walk " * 8, params, output_prefix=ids[:60])
    assert resumed.outputs[0].token_ids == ids
    assert resumed.metrics.num_cached_tokens > 0  # the blocks of the prompt and the first output tokens were kept
    assert llm.engine.stats.num_steps - steps_before <= 8  # one prefill, four decodes, the neighbours' tail


@pytest.mark.parametrize(
    "prefix, params, message",
    [
        ([1] * 40, SamplingParams(max_tokens=40), "max_tokens is 40"),
        ([1, 2, -3], SamplingParams(max_tokens=40), r"\[0, "),
        ([1, 2], SamplingParams(max_tokens=40, stop_token_ids=[2]), "stop token"),
        ([5, 6], SamplingParams(max_tokens=40, logprobs=2), "logprobs"),  # without the prefix's logprobs
    ],
)
def test_prefix_that_cannot_be_resumed_is_refused(llm, prefix, params, message):
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request("bad-prefix", "hello", params, output_prefix=prefix)
    assert "bad-prefix" not in llm.engine.scheduler


def test_a_request_asking_for_logprobs_resumes_with_its_prefixs_logprobs(llm):
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=30, ignore_eos=True, logprobs=3)
    _, full = run(llm, "lp-full", "Tell me a story", params)
    ids, logprobs = full.outputs[0].token_ids, full.outputs[0].logprobs
    engine = llm.engine
    engine.add_request("lp-resumed", "Tell me a story", params, output_prefix=ids[:12], prefix_logprobs=logprobs[:12])
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.request_id == "lp-resumed" and o.finished), final)
    resumed = final.outputs[0]
    assert resumed.token_ids == ids and len(resumed.logprobs) == 30
    assert resumed.logprobs[:12] == logprobs[:12]  # handed back as they were streamed
    for got, want in zip(resumed.logprobs[12:], logprobs[12:]):  # computed again after a prefill, not decodes
        assert got.keys() == want.keys() and list(got.values()) == pytest.approx(list(want.values()), abs=1e-4)
    with pytest.raises(ValueError, match="logprobs"):  # out of step with the ids: refused, not misaligned
        engine.add_request("lp-bad", "hi", params, output_prefix=ids[:3], prefix_logprobs=logprobs[1:4])


def test_a_stop_token_before_min_tokens_is_part_of_a_valid_prefix(llm):
    params = SamplingParams(temperature=0, min_tokens=5, max_tokens=8, stop_token_ids=[2])
    llm.engine.add_request("early-stop-id", "hello", params, output_prefix=[2, 2, 3])
    [out] = llm.engine.abort_request("early-stop-id")
    assert out.outputs[0].token_ids == [2, 2, 3]  # taken as its output so far, not refused


@pytest.mark.slow
def test_bench_resume_prints_both_ways_and_checks_the_tokens(tiny_chat_model, capsys):
    import argparse
    import json

    from roseinfer import bench_resume

    parser = argparse.ArgumentParser()
    bench_resume.add_arguments(parser)
    args = parser.parse_args(["--model", tiny_chat_model, "--jobs", "2", "--tokens", "20", "--repeats", "1"])
    assert bench_resume.main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["streamed_before_the_kill"] == 18 and out["same_tokens_as_uninterrupted"] is True
    assert out["resumed_s"] > 0 and out["regenerated_s"] > 0
