import pytest

from roseinfer import SamplingParams

BAD = [
    {"max_tokens": 0},
    {"max_tokens": -5},
    {"max_tokens": 2.5},
    {"min_tokens": -1},
    {"min_tokens": 10, "max_tokens": 5},
    {"temperature": -0.1},
    {"temperature": "hot"},
    {"top_p": 0},
    {"top_p": 1.5},
    {"top_k": -2},
    {"top_k": 1.5},
    {"min_p": -0.1},
    {"min_p": 1.1},
    {"repetition_penalty": 0},
    {"repetition_penalty": float("nan")},  # passed "<= 0": NaN logits, argmax picked them
    {"repetition_penalty": float("inf")},
    {"frequency_penalty": 3},
    {"presence_penalty": -2.5},
    {"seed": -(2**63) - 1},
    {"seed": "x"},
    {"logprobs": 21},
    {"logprobs": -1},
    {"stop": 5},
    {"stop": [""]},
    {"stop": ["ok", 3]},
    {"stop_token_ids": [-1]},
    {"n": 65},
    {"n": 0},
    {"max_tokens": True},
    {"temperature": 2.5},
    {"seed": 2**63},
    {"top_k": 10**30},
    {"stop_token_ids": 3},
    {"ignore_eos": 1},
]


@pytest.mark.parametrize("kwargs", BAD, ids=[str(b) for b in BAD])
def test_bad_values_are_refused_with_the_parameter_named(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=rf"invalid sampling parameter: .*\b{name}\b"):
        SamplingParams(**kwargs)


def test_good_values_are_kept():
    p = SamplingParams(max_tokens=None, temperature=0, top_k=-1, stop="###", stop_token_ids=[7], logprobs=0)
    assert p.greedy and p.stop_strings == ("###",) and p.stop_token_ids == [7] and p.max_tokens is None
    assert not SamplingParams(temperature=0.7, top_p=1.0).uses_filters
    assert SamplingParams(temperature=0.7, min_p=0.1).uses_filters


def test_a_temperature_too_small_to_divide_by_is_greedy():
    """1e-50 overflowed the logits to inf and the softmax to NaN (token 0 every time): below 1e-5 it is greedy."""
    assert SamplingParams(temperature=1e-50).temperature == 0.0
    assert SamplingParams(temperature=1e-3).temperature == 1e-3


def test_a_json_schema_is_held_to_its_own_bound_and_its_patterns_to_a_regexs():
    """A regex in a schema's ``pattern`` took no bound (a regex of its own is held to 32 KB): a 3.3 MB one spent 1.7 s
    of the step loop before llguidance refused it; nor did the schema itself."""
    import pytest

    from roseinfer.sampling_params import MAX_CONSTRAINT_CHARS, MAX_SCHEMA_CHARS, StructuredOutputsParams

    long = "a" * (MAX_CONSTRAINT_CHARS + 1)
    for schema in ({"type": "string", "pattern": long},
                   {"type": "object", "patternProperties": {long: {"type": "string"}}},
                   {"anyOf": [{"type": "string"}, {"items": {"pattern": long}}]}):  # fmt: skip
        with pytest.raises(ValueError, match=f"a pattern in json has {len(long)} characters"):
            StructuredOutputsParams(json=schema)
    many = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(MAX_SCHEMA_CHARS // 20)}}
    with pytest.raises(ValueError, match=r"json \(the schema\) has \d+ characters; at most 262144"):
        StructuredOutputsParams(json=many)
    StructuredOutputsParams(json={"type": "string", "pattern": "a" * MAX_CONSTRAINT_CHARS})  # (at the bound: taken)


def test_a_stop_string_is_held_to_a_kilobyte_by_the_engine_and_the_payload():
    """Each new token's text was matched against every tail of every stop string: 64 of 15 KB held a step 4 s."""
    import pytest

    from producer.schema import JobRequest
    from roseinfer.sampling_params import MAX_STOP_CHARS, SamplingParams

    long = "x" * (MAX_STOP_CHARS + 1)
    with pytest.raises(ValueError, match=f"a stop string has {len(long)} characters; at most 1024"):
        SamplingParams(stop=["ok", long])
    for stop in (long, ["ok", long]):
        with pytest.raises(ValueError, match=f"a stop string has {len(long)} characters"):
            JobRequest.model_validate({"prompt": "x", "stop": stop})
    SamplingParams(stop=["x" * MAX_STOP_CHARS])  # (at the bound: taken)


def test_a_field_set_after_the_params_were_made_counts_through_the_engines_add_request(tiny_chat_model):
    """``sp.stop = [...]`` after the params were made (a vLLM habit): ``generate`` saw it (it made a copy), the
    engine's ``add_request`` did not, and the request ran to its length; a bad value set so went unchecked too."""
    from roseinfer import LLM

    llm = LLM(tiny_chat_model, dtype="float32")
    engine = llm.llm_engine
    free = llm.generate(["Hello"], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0].outputs[0]
    stop = free.text[len(free.text) // 2 :][:3]
    assert stop.strip()
    params = SamplingParams(max_tokens=12, temperature=0)
    params.stop = [stop]
    engine.add_request("set-after", "Hello", params)
    last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            last = out
    assert last.outputs[0].finish_reason == "stop" and stop not in last.outputs[0].text
    params.temperature = -1.0
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request("bad-after", "Hello", params)


def test_llm_takes_vllms_dtype_names_and_its_options_of_no_meaning_here(caplog):
    """vLLM's offline code failed at its first line: ``LLM(model, dtype="auto", gpu_memory_utilization=0.9)`` was a
    ValueError, then a TypeError naming the option."""
    import torch

    from roseinfer.llm import _engine_options

    assert _engine_options({"dtype": "auto"}) == {}
    for given, taken in [("half", "float16"), ("bf16", "bfloat16"), ("float", "float32"), (torch.bfloat16, "bfloat16")]:
        assert _engine_options({"dtype": given}) == {"dtype": taken}
    with caplog.at_level("WARNING", logger="roseinfer.llm"):
        options = _engine_options({"trust_remote_code": True, "gpu_memory_utilization": 0.9, "tensor_parallel_size": 1})
    assert options == {}
    assert "ignored, as nothing here uses them: trust_remote_code, gpu_memory_utilization" in caplog.text
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1"):
        _engine_options({"tensor_parallel_size": 2})
    assert _engine_options({"max_num_seqs": 4, "bogus": 1}) == {"max_num_seqs": 4, "bogus": 1}  # (still refused)


def test_numpys_numbers_are_taken_as_pythons():
    """A temperature sweep from np.linspace, a budget computed with numpy: np.float32(0.5) is no float, np.int64(10)
    no int, and both were refused (vLLM takes them)."""
    import numpy as np

    params = SamplingParams(max_tokens=np.int64(10), temperature=np.float32(0.5), top_k=np.int32(5))
    assert (params.max_tokens, params.temperature, params.top_k) == (10, 0.5, 5)
    assert type(params.max_tokens) is int and type(params.temperature) is float
    with pytest.raises(ValueError, match="max_tokens must be an integer"):
        SamplingParams(max_tokens=np.float64(1.5))
