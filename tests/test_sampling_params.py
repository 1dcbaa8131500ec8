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
