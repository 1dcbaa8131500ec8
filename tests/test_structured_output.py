"""Structured outputs through the engine: every kind, greedy and seeded, with chunked prefill, preemption, stop
strings, min_tokens and a resumed output; a constraint the library rejects fails only its own request."""

from __future__ import annotations

import json
from itertools import pairwise

import jsonschema
import pytest

from roseinfer import LLM, SamplingParams, StructuredOutputsParams

# Bounded, so even a random model's output ends well within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["cat", "dog", "bird"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
        "ok": {"type": "boolean"},
    },
    "required": ["label", "score", "ok"],
    "additionalProperties": False,
}
GRAMMAR = 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]/'
KINDS = {
    "json": ({"json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    "json-text": ({"json": json.dumps(SCHEMA)}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    "regex": ({"regex": "[0-9]{3}-[0-9]{4}"}, lambda t: _match(r"[0-9]{3}-[0-9]{4}", t)),
    "choice": ({"choice": ["positive", "negative", "neutral"]}, lambda t: _match("positive|negative|neutral", t)),
    "grammar": ({"grammar": GRAMMAR}, lambda t: _match("yes|no|maybe [0-9]", t)),
}


def _match(pattern: str, text: str) -> None:
    import re

    assert re.fullmatch(pattern, text), text


@pytest.fixture(scope="module")
def llm(tiny_chat_model):
    return LLM(tiny_chat_model, dtype="float32", max_num_seqs=8)


def texts(outs):
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


PROMPTS = [f"Question {i}: classify this animal and score it." for i in range(5)]


@pytest.mark.parametrize(
    "kind", [k if k in ("json", "choice") else pytest.param(k, marks=pytest.mark.slow) for k in sorted(KINDS)]
)
@pytest.mark.parametrize("sampling", ["greedy", pytest.param("seeded", marks=pytest.mark.slow)])
def test_every_kind_finishes_valid(llm, kind, sampling):
    so, check = KINDS[kind]
    extra = {"temperature": 0} if sampling == "greedy" else {"temperature": 1.0, "seed": 11}
    params = SamplingParams(max_tokens=60, structured_outputs=so, **extra)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for text, reason in texts(outs):
        assert reason == "stop", text
        check(text)
    if sampling == "seeded":  # a rerun draws the same
        assert texts(llm.generate(PROMPTS, params, use_tqdm=False)) == texts(outs)


def test_unconstrained_neighbours_and_the_constraint_change_nothing_of_each_other(llm):
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json": SCHEMA})
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = texts(llm.generate(PROMPTS[:1], params, use_tqdm=False))
    free_alone = texts(llm.generate(PROMPTS[1:2], free, use_tqdm=False))
    mixed = texts(llm.generate(PROMPTS[:2], [params, free], use_tqdm=False))
    assert mixed == alone + free_alone


@pytest.mark.slow
def test_chunked_prefill_and_preemption_keep_the_constraint(tiny_chat_model):
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json": SCHEMA})
    prompts = [p * 6 for p in PROMPTS]  # long enough to be chunked
    roomy = LLM(tiny_chat_model, dtype="float32", max_num_seqs=8)
    want = texts(roomy.generate(prompts, params, use_tqdm=False))
    # 40 blocks of 8 tokens cannot hold five of these at once: requests are preempted and recomputed.
    tight = LLM(tiny_chat_model, dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, block_size=8)
    tight.engine.kv.__init__(40, 8, True)
    got = texts(tight.generate(prompts, params, use_tqdm=False))
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == want
    for text, _ in got:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_a_constraint_the_library_rejects_fails_only_its_request(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match=r"invalid structured output.*frobnicate"):
        engine.add_request("bad-schema", "hi", SamplingParams(structured_outputs={"json": {"type": "frobnicate"}}))
    with pytest.raises(ValueError, match=r"invalid structured output.*regex"):
        engine.add_request("bad-regex", "hi", SamplingParams(structured_outputs={"regex": "a(b"}))
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["a"]})
    with pytest.raises(ValueError, match="invalid structured output"):
        SamplingParams(structured_outputs={"schema": {}})
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    # The library quotes what it refuses, more than once: its reason is cut to one line of at most 1,000 characters
    # (a 3 MB regex's made a 9 MB log line and a 12 MB result, kept for a year).
    with pytest.raises(ValueError, match=r"invalid structured output") as refused:
        engine.add_request("long-regex", "hi", SamplingParams(structured_outputs={"regex": "(" + "a\nb" * 2000}))
    assert len(str(refused.value)) < 1100 and "\n" not in str(refused.value)
    # Bounded before anything compiles: a GBNF grammar converts in time that grows with the square of its size.
    for kind, value in (("grammar", "x" * 40_000), ("regex", "a" * 40_000), ("choice", ["x" * 20_000] * 2)):
        with pytest.raises(ValueError, match="32768"):
            StructuredOutputsParams(**{kind: value})
    # A schema nested past Python's recursion depth: a RecursionError, which a worker reported as its own fault.
    deep: dict = {}
    for _ in range(1200):
        deep = {"items": deep}
    with pytest.raises(ValueError, match="invalid structured output: maximum recursion depth"):
        engine.add_request("deep", "hi", SamplingParams(structured_outputs={"json": deep}))
    # A choice that compiles alone compiles after thinking too (its Lark form refused a raw DEL).
    engine.structured.matcher_for(StructuredOutputsParams(choice=["a\x7fb"], thinking="first"), [])
    assert not engine.has_unfinished_requests()
    outs = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=60, structured_outputs={"choice": ["x", "y"]}))
    assert outs[0].outputs[0].text in ("x", "y")


def test_a_stop_string_still_cuts_and_min_tokens_gives_way_to_a_complete_constraint(llm):
    so = {"grammar": 'start: "alpha beta gamma"'}
    out = llm.generate(["go"], SamplingParams(temperature=0, max_tokens=20, stop=" beta", structured_outputs=so))[0]
    assert (out.outputs[0].text, out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("alpha", "stop", " beta")
    # The grammar is complete before min_tokens: nothing else may follow, so it ends there.
    out = llm.generate(["go"], SamplingParams(temperature=0, max_tokens=20, min_tokens=15, structured_outputs=so))[0]
    assert (out.outputs[0].text, out.outputs[0].finish_reason) == ("alpha beta gamma", "stop")


def test_max_tokens_cuts_with_length(llm):
    params = SamplingParams(temperature=0, max_tokens=3, structured_outputs={"json": SCHEMA})
    out = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 5}])
def test_a_resumed_output_goes_on_under_its_constraint(llm, sampling):
    params = SamplingParams(max_tokens=60, structured_outputs={"json": SCHEMA}, **sampling)
    whole = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    engine = llm.engine
    prefix = whole.token_ids[:4]
    engine.add_request("resumed", PROMPTS[0], params, output_prefix=prefix)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert (final.outputs[0].token_ids, final.outputs[0].text) == (whole.token_ids, whole.text)
    # A prefix the constraint does not allow is refused with the reason.
    bad = llm.get_tokenizer().encode("nope")
    with pytest.raises(ValueError, match="breaks its structured output"):
        engine.add_request("resumed-bad", PROMPTS[0], params, output_prefix=bad)
    # The whole output as the prefix (its worker died after its last token went out): it had ended. A step would
    # add an EOS the uninterrupted run never had; the worker starts such a job over.
    assert whole.finish_reason == "stop" and whole.stop_reason is None  # (complete, not cut by a stop string)
    with pytest.raises(ValueError, match="completes its structured output: the request had ended"):
        engine.add_request("resumed-whole", PROMPTS[0], params, output_prefix=whole.token_ids)


def test_logprobs_are_those_under_the_constraint(llm):
    """As vLLM (its runner masks before its sampler): the alternatives a step reports are tokens the structured
    output allows, not the model's favourites it forbids; where it allows fewer than asked for, fewer are listed
    (never a forbidden one at -inf, which JSON cannot even hold)."""
    import math

    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=5, structured_outputs={"choice": ["yes", "no"]})
    out = llm.generate(["Is the sky blue? Answer:"], params, use_tqdm=False)[0].outputs[0]
    first = out.logprobs[0]
    assert len(first) >= 2
    for token_id in first:
        piece = tok.decode([token_id])
        assert "yes".startswith(piece) or "no".startswith(piece), (piece, first)
    word = "Supercalifragilistic"
    params = SamplingParams(temperature=0, max_tokens=30, logprobs=5, structured_outputs={"choice": [word]})
    out = llm.generate(["Say it:"], params, use_tqdm=False)[0].outputs[0]
    assert out.text == word
    for step in out.logprobs:
        assert all(math.isfinite(v) for v in step.values()), step
        json.dumps(step, allow_nan=False)


def _stream(llm, rid: str, params: SamplingParams) -> list:
    engine = llm.engine
    engine.add_request(rid, "Hi", params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def test_a_cumulative_output_never_takes_back_text_it_showed(llm):
    """A tail that may still begin a stop string is not shown (vLLM's stop buffer): "Hello world" was shown, then
    cut to "Hello " when the stop string "world, h" completed."""
    forced = {"choice": ["Hello world, how are you"]}
    params = SamplingParams(max_tokens=30, temperature=0, structured_outputs=forced, stop=["world, h"])
    shown = [o.outputs[0].text for o in _stream(llm, "cumulative", params)]
    assert all(later.startswith(earlier) for earlier, later in pairwise(shown)), shown
    assert shown[-1] == "Hello "


def test_no_stop_string_is_matched_in_an_unfinished_last_character(llm):
    """Cut by max_tokens inside an emoji: the character's stand-in (U+FFFD) ends the text, and ". " (matched only
    across it) cut nothing under a "length" reason."""
    forced = {"choice": ["Yes. 😀 b"]}
    params = SamplingParams(max_tokens=3, temperature=0, structured_outputs=forced, stop=[". "])
    out = llm.generate(["Hi"], params, use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == ("Yes. \ufffd", "length", None)


def test_a_sample_of_n_that_ends_first_has_its_reason_in_its_last_delta(llm):
    forced = {"choice": ["Yo", "Hello world"]}
    params = SamplingParams(n=2, max_tokens=30, temperature=0, structured_outputs=forced, output_kind="delta")
    outs = _stream(llm, "n-delta", params)
    for index in (0, 1):  # each sample's last delta carries its reason, the request's end or not
        last = [o for o in outs if o.delta_index == index][-1]
        assert [c.finish_reason for c in last.outputs if c.index == index] == ["stop"]
    assert sum(o.finished for o in outs) == 1


def test_a_final_only_output_gives_its_whole_delta(llm):
    forced = {"choice": ["Hello world"]}
    params = SamplingParams(max_tokens=30, temperature=0, structured_outputs=forced, output_kind="final_only")
    (out,) = _stream(llm, "final-only", params)
    assert (out.delta_text, out.delta_token_ids) == (out.outputs[0].text, out.outputs[0].token_ids)
    assert len(out.delta_token_ids) > 1


@pytest.mark.slow
def test_a_constrained_request_loads_no_compiler(tiny_chat_model):
    """llguidance.torch compiles a kernel when imported (torch.compile loads inductor's compiler, seconds): that
    import sat inside the step of a worker's first constrained request, stalling every running request with it."""
    import subprocess
    import sys

    code = (
        "import sys; from roseinfer import LLM, SamplingParams;"
        f"llm = LLM({tiny_chat_model!r}, dtype='float32');"
        "p = SamplingParams(temperature=0, max_tokens=20, structured_outputs={'choice': ['yes', 'no']});"
        "out = llm.generate(['x'], p, use_tqdm=False)[0].outputs[0];"
        "print(out.text, out.finish_reason, 'torch._inductor.compile_fx' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    text, reason, compiler = out.stdout.split()
    assert text in ("yes", "no") and reason == "stop" and compiler == "False", out.stdout


@pytest.mark.parametrize(
    ("thinking", "so", "text", "reads", "done"),
    [
        ("first", {"json": SCHEMA}, 'Hmm { not yet</think>{"label": "cat", "score": 1, "ok": true}', True, True),
        ("first", {"json": SCHEMA}, "Hmm</think>\n", False, False),  # (the constraint at once: the answer is its text)
        ("first", {"json": SCHEMA}, '<think>Hmm.</think>{"label": "dog", "score": 2, "ok": false}', True, True),
        ("first", {"json": SCHEMA}, '{"label": "cat", "score": 1, "ok": true}', True, False),  # (still thinking)
        ("first", {"json": SCHEMA}, 'Hmm</think>{"label":"cat"', False, False),  # (the schema's spacing holds)
        ("optional", {"json_object": True}, '{"a": 1}', True, True),
        ("optional", {"json_object": True}, '<think>a { b</think>{"a": 1}', True, True),
        ("optional", {"json_object": True}, "Sure: {", False, False),  # (no thinking block: the object at once)
        ("optional", {"choice": ["yes", 'no "way"']}, '<think>Hm.</think>no "way"', True, True),
        ("first", {"choice": ["yes", "no"]}, "yes", True, False),
    ],
)
def test_a_reasoning_models_thinking_comes_before_its_constraint(llm, thinking, so, text, reads, done):
    """``thinking``: free text up to </think> ("first") or in a <think> block the output may begin with
    ("optional"), then the constraint at once, as without it."""
    manager = llm.engine.structured
    matcher = manager.matcher_for(StructuredOutputsParams(**so, thinking=thinking), [])
    assert bool(matcher.consume_tokens(llm.get_tokenizer().encode(text))) is reads
    assert bool(reads and matcher.is_stopped()) is done


def test_thinking_then_the_constraint_through_the_engine(llm):
    """A thought given as the output so far (a resumed one): the engine goes on under the schema and ends there."""
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json": SCHEMA, "thinking": "first"})
    thought = llm.get_tokenizer().encode("<think>A cat, I think.</think>")
    llm.engine.add_request("thought", PROMPTS[0], params, output_prefix=thought)
    final = None
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            final = out
    text = final.outputs[0].text
    assert final.outputs[0].finish_reason == "stop" and text.startswith("<think>A cat, I think.</think>{")
    jsonschema.validate(json.loads(text.partition("</think>")[2]), SCHEMA)
    for bad in ({"regex": "a+", "thinking": "first"}, {"json": SCHEMA, "thinking": "later"}):
        with pytest.raises(ValueError, match="thinking"):
            StructuredOutputsParams(**bad)


def test_a_prompt_that_closed_the_thinking_is_constrained_from_the_first_token(llm):
    """A template that closed the thinking in the prompt (Qwen3's with enable_thinking false): "first" would wait
    for a second </think>; the engine reads the prompt's end and holds the output to the schema at once."""
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json": SCHEMA, "thinking": "first"})
    [out] = llm.generate([PROMPTS[0] + "\n<think>\n\n</think>\n\n"], params, use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


def test_a_token_the_constraint_refuses_fails_the_job_not_as_a_cancel(llm, monkeypatch):
    """The engine ends such a request "abort" (a library fault: the grammar and the tokenizer disagree on an end
    token, say). The worker took that for its client's cancel: a canceled result, RQ's status left "started" for
    good, a batch waiting on the job for a day. It is a failure, not retried, its text kept."""
    from worker.pump import Pump

    engine = llm.engine
    monkeypatch.setattr(engine.structured, "accept", lambda seq, token: False)
    pump = Pump(engine, tokenize_in_thread=False)
    params = SamplingParams(max_tokens=8, temperature=0, structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    pump.submit("refused", {"prompt": "A number:"}, params)
    pump.submit("free", {"prompt": "Anything:"}, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    ends = _run_to_the_end(pump)
    refused = ends["refused"]
    assert (refused.finish_reason, refused.error_type, refused.retryable) == ("error", "server_error", False)
    assert "refused the token the model produced" in refused.error and refused.output is not None
    assert ends["free"].finish_reason == "length"


def _run_to_the_end(pump) -> dict:
    """Each job's last event, the pump stepped until it has no work."""
    ends = {}
    while pump.has_work():
        ends.update((e.job_id, e) for e in pump.step() if e.finished)
    return ends


def test_a_dead_end_fails_the_job_as_the_requests_fault(llm):
    """A schema no text completes fails the same way every time: said to be the request's fault (a 400 from the
    server), it was a server error, and the official clients submitted the job twice more."""
    from worker.pump import Pump

    pump = Pump(llm.engine, tokenize_in_thread=False)
    dead = {"regex": "ab[^\\s\\S]"}
    pump.submit("dead", {"prompt": "A word:"}, SamplingParams(max_tokens=8, temperature=0, structured_outputs=dead))
    failed = _run_to_the_end(pump)["dead"]
    assert (failed.finish_reason, failed.error_type, failed.retryable) == ("error", "invalid_request", False)
    assert "dead end" in failed.error and "not retried" in failed.error


@pytest.mark.parametrize(
    "so",
    [
        {"json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "required": ["a"],
                  "$defs": {"x": {"$ref": "#/$defs/x"}}}},
        {"regex": "ab[^\\s\\S]"},
        # Met as a refused token (the parser's forced expansion never ends): it was a server error, retried.
        {"json": {"type": "array", "items": {"$ref": "#"}, "minItems": 1}},
        {"json": {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"],
                  "additionalProperties": False}},
    ],
    ids=["schema-that-no-json-completes", "regex-with-an-empty-class", "array-of-itself", "object-of-itself"],
)  # fmt: skip
def test_a_constraint_that_reaches_a_dead_end_ends_abort_not_stop(llm, so):
    """llguidance met the dead end while filling the mask, which then allowed EOS alone: the request ended "stop",
    a success whose text its constraint does not allow ('{"a": ' for JSON)."""
    params = SamplingParams(max_tokens=30, temperature=0, structured_outputs=so)
    [out] = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    assert out.outputs[0].finish_reason == "abort" and out.outputs[0].abort_cause.dead_end
    free = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)  # (the engine goes on serving)
    assert llm.generate([PROMPTS[1]], free, use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_a_format_llguidance_does_not_know_is_an_annotation_not_a_refusal(llm):
    """pydantic's schemas name formats JSON Schema leaves to annotation (a Path's "path", a SecretStr's "password",
    bytes' "binary"): llguidance refused the whole schema ("Unknown format: path") and the job failed. A format it
    enforces stays enforced, and a property named "format" stays a property."""
    import pathlib

    import pydantic

    from roseinfer.structured_output import enforceable

    class Upload(pydantic.BaseModel):
        path: pathlib.Path
        secret: pydantic.SecretStr
        blob: bytes
        when: str = pydantic.Field(json_schema_extra={"format": "date"})
        format: str

    schema = Upload.model_json_schema()
    kept = enforceable(schema)
    assert "format" not in kept["properties"]["path"] and kept["properties"]["when"]["format"] == "date"
    assert kept["properties"]["format"] == schema["properties"]["format"] and "format" in kept["required"]
    manager = llm.engine.structured
    matcher = manager.matcher_for(StructuredOutputsParams(json=schema), [])
    text = '{"path": "/tmp/a", "secret": "s", "blob": "b", "when": "2026-11-30", "format": "x"}'
    assert matcher.consume_tokens(llm.get_tokenizer().encode(text)) and matcher.is_stopped()
    bad_date = manager.matcher_for(StructuredOutputsParams(json=schema), [])
    assert not bad_date.consume_tokens(llm.get_tokenizer().encode(text.replace("2026-11-30", "tomorrow")))


@pytest.mark.slow  # seconds: the grammar library's lexer blows up once, as it does in the wild
def test_a_constraint_whose_earlier_requests_used_up_the_grammar_librarys_limits_is_compiled_afresh(llm):
    """The copies of a compiled constraint share its lexer's states and their budget: earlier requests of a regex
    whose lexer blows up used it up, and every later request of it failed as a dead end (the client's fault, not
    retried) for the worker's life. Said as the server's, worth a retry, and the next request compiles afresh."""
    import random

    from roseinfer.sampling_params import StructuredOutputsParams

    regex = "(a|b)*a(a|b){20}"
    tok, manager = llm.get_tokenizer(), llm.engine.structured
    a, b = tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("b")
    rng = random.Random(0)
    for _ in range(25):  # earlier requests of the same regex, driven through the engine's own matchers
        matcher = manager.matcher_for(StructuredOutputsParams(regex=regex), [])
        for _ in range(2000):
            if not matcher.consume_token(rng.choice((a, b))):
                break
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured_outputs={"regex": regex})
    [out] = llm.generate(["Hi"], params, use_tqdm=False)
    cause = out.outputs[0].abort_cause
    assert out.outputs[0].finish_reason == "abort" and cause.limit and not cause.dead_end, cause
    [again] = llm.generate(["Hi"], params, use_tqdm=False)
    assert again.outputs[0].finish_reason != "abort" and again.outputs[0].text, again.outputs[0]


def test_a_constraint_past_the_grammar_librarys_limits_on_a_fresh_compile_is_the_requests_fault(llm):
    """``(x{1000}){1000}`` is past llguidance's limits compiled afresh: said as the server's, the job ran again as
    often as its retries allowed (each ~0.9 s of every other job's steps), and the server's 500 made the official
    clients send it twice more."""
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs={"regex": "(x{1000}){1000}"})
    [out] = llm.generate(["Hi"], params, use_tqdm=False)
    cause = out.outputs[0].abort_cause
    assert out.outputs[0].finish_reason == "abort" and cause.dead_end and not cause.limit, cause
    assert "past the grammar library's limits on its own" in cause.why


def test_a_job_past_the_grammar_librarys_limits_fails_as_the_servers_and_may_run_again():
    """Its abort said "dead end" (the request's fault, not retried) where no fault of the request's was met."""
    from types import SimpleNamespace

    from roseinfer.outputs import AbortCause
    from worker.pump import _refused_by_grammar

    why = "lexer error: too many expressions constructed; Stop: LexerTooComplex"
    sample = SimpleNamespace(abort_cause=AbortCause(False, why, limit=True), index=0, logprobs=None)
    out = SimpleNamespace(outputs=[sample], request_id="j", delta_text="", delta_token_ids=[], delta_index=0)
    event = _refused_by_grammar(out, sample.abort_cause)
    assert (event.error_type, event.retryable) == ("server_error", True) and "limits" in event.error


def test_a_job_of_n_samples_one_of_which_reached_a_dead_end_fails_as_one_sample_would():
    """Sample 0's dead end failed the job (the request's fault); another sample's left it finished, that choice
    cut short and said "stop" by the OpenAI shape."""
    from types import SimpleNamespace

    from roseinfer.outputs import AbortCause
    from worker.pump import Pump

    def sample(index: int, reason: str, cause: AbortCause | None = None) -> SimpleNamespace:
        return SimpleNamespace(index=index, finish_reason=reason, abort_cause=cause, logprobs=None)

    dead_end = AbortCause(True, "no text completes it")
    out = SimpleNamespace(
        request_id="j", finished=True, outputs=[sample(0, "stop"), sample(1, "abort", dead_end)], delta_text="",
        delta_token_ids=[], delta_index=0, prompt_token_ids=[1],
    )  # fmt: skip
    [event] = Pump._events_of(SimpleNamespace(_jobs={"j": object()}), [out])
    assert (event.finish_reason, event.error_type, event.retryable) == ("error", "invalid_request", False)
    assert "dead end" in event.error


def test_an_end_token_past_the_models_table_refuses_no_constraint(smol_tokenizer):
    """A generation config may name an end token past the model's table (never sampled): llguidance refused every
    constraint for it ("EOS token ID ... is out of range"), each a failure of the client's."""
    from roseinfer.sampling_params import StructuredOutputsParams
    from roseinfer.structured_output import StructuredOutputManager

    vocab = len(smol_tokenizer)
    manager = StructuredOutputManager(smol_tokenizer, vocab, [smol_tokenizer.eos_token_id, vocab + 5])
    assert not manager.matcher_for(StructuredOutputsParams(regex="a+"), []).is_error()


def test_an_object_that_lists_its_properties_takes_no_others_unless_it_says_so(llm):
    """A pydantic model's schema says nothing of other keys, which JSON Schema then allows: llguidance let a small
    model write keys of noise until max_tokens (8 seeds of 8: no JSON at all). As vLLM's default backend and
    OpenAI's strict mode, such an object takes its own properties only; one that says otherwise keeps that, and
    the parts of an allOf (whose properties add up) are not closed each."""
    from roseinfer.structured_output import enforceable

    schema = {"type": "object", "properties": {"c": {"enum": ["red", "blue"]}, "n": {"type": "boolean"}},
              "required": ["c", "n"]}  # fmt: skip
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=40, structured_outputs={"json": schema})
        for seed in range(8)
    ]
    for out in llm.generate([PROMPTS[0]] * 8, params, use_tqdm=False):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        assert set(json.loads(out.outputs[0].text)) == {"c", "n"}
    opened = {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True}
    assert enforceable(opened) == opened
    parts = {"allOf": [{"properties": {"a": {"type": "string"}}}, {"properties": {"b": {"type": "string"}}}]}
    assert enforceable(parts) == parts
    beside = {"properties": {"a": {"type": "string"}}, "allOf": [{"properties": {"b": {"type": "string"}}}]}
    assert enforceable(beside) == beside
    # Objects whose properties add up with others' stay open (closed, each of these matched nothing).
    from llguidance import LLMatcher

    a, b, c = ({"type": "string"},) * 3
    composed = [
        {"$defs": {"Base": {"type": "object", "properties": {"a": a}, "required": ["a"]}},
         "allOf": [{"$ref": "#/$defs/Base"}, {"type": "object", "properties": {"b": b}, "required": ["b"]}]},
        {"type": "object", "properties": {"kind": a}, "required": ["kind"],
         "anyOf": [{"properties": {"b": b}, "required": ["b"]}, {"properties": {"c": c}, "required": ["c"]}]},
        {"type": "object", "properties": {"a": a}, "required": ["a", "b"]},
    ]  # fmt: skip
    chain = {"$defs": {"Base": {"$ref": "#/$defs/Real"}, "Real": {"properties": {"a": a}, "required": ["a"]}},
             "allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"b": b}, "required": ["b"]}]}  # fmt: skip
    for schema in [*composed, chain]:
        grammar = LLMatcher.grammar_from_json_schema(enforceable(schema))
        assert LLMatcher.validate_grammar(grammar) == "", schema
    # And pydantic's own forms of a nested model stay closed: Optional, a (discriminated) union, a tuple, a field
    # with a description (a union's alternatives, a $ref beside annotations: none composed).
    from typing import Literal

    import pydantic

    class Inner(pydantic.BaseModel):
        a: int

    class Cat(pydantic.BaseModel):
        kind: Literal["cat"]

    class Dog(pydantic.BaseModel):
        kind: Literal["dog"]

    class Outer(pydantic.BaseModel):
        inner: Inner | None
        pet: Cat | Dog = pydantic.Field(discriminator="kind")
        pair: tuple[Inner, int]
        described: Inner = pydantic.Field(description="an inner one")

    closed = enforceable(Outer.model_json_schema())
    assert [d["additionalProperties"] for d in closed["$defs"].values()] == [False] * 3
    nested = enforceable({"type": "object", "properties": {"inner": {"type": "object", "properties": {}}}})
    assert nested["additionalProperties"] is False and nested["properties"]["inner"]["additionalProperties"] is False


def test_an_integer_bound_no_double_holds_is_moved_inside_not_rounded_outward(llm):
    """llguidance holds bounds as doubles: an integer within [2**53 - 2, 2**53 + 7] came out as 9007199254741000,
    past its maximum, 14 seeds of 16, and ended "stop" as if it matched. (An int64's 2**63 - 1, a schema
    generator's usual bound, stays a bound: the nearest double below it.)"""
    from roseinfer.structured_output import enforceable

    narrow = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 2**53 - 2, "maximum": 2**53 + 7}},
              "required": ["x"]}  # fmt: skip
    bounds = enforceable(narrow)["properties"]["x"]
    assert (bounds["minimum"], bounds["maximum"]) == (2**53 - 2, 2**53 + 6)
    assert enforceable({"type": "integer", "maximum": 2**63 - 1})["maximum"] == 2**63 - 1024
    with pytest.raises(ValueError, match="past what a JSON number holds"):  # (an OverflowError: a server error)
        enforceable({"type": "integer", "maximum": 10**400})
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=30, structured_outputs={"json": narrow})
        for seed in range(8)
    ]
    for out in llm.generate([PROMPTS[0]] * 8, params, use_tqdm=False):
        if out.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(out.outputs[0].text), narrow)


def test_an_exclusive_integer_bound_no_double_holds_still_lets_the_value_inside_it_through(smol_tokenizer):
    """Moved inside, an exclusive bound stayed exclusive and refused the value it moved to: exclusiveMaximum
    2**53 + 3 refused 2**53 + 2, which lies below it (llguidance takes it, given the schema as written)."""
    from roseinfer.sampling_params import StructuredOutputsParams
    from roseinfer.structured_output import StructuredOutputManager, enforceable

    assert enforceable({"type": "integer", "exclusiveMaximum": 2**53 + 3}) == {"type": "integer", "maximum": 2**53 + 2}
    both = {"type": "integer", "minimum": 2**53 - 2, "exclusiveMinimum": 2**53 + 1, "exclusiveMaximum": 2**53 + 7}
    assert enforceable(both) == {"type": "integer", "minimum": 2**53 + 2, "maximum": 2**53 + 6}  # (the tighter)
    manager = StructuredOutputManager(smol_tokenizer, len(smol_tokenizer), [smol_tokenizer.eos_token_id])
    for schema, text, accepted in [
        ({"type": "integer", "exclusiveMaximum": 2**53 + 3}, str(2**53 + 2), True),
        ({"type": "integer", "exclusiveMinimum": -(2**53) - 3}, str(-(2**53) - 2), True),
        ({"type": "integer", "exclusiveMaximum": 2**53 + 3}, str(2**53 + 4), False),
    ]:
        matcher = manager.matcher_for(StructuredOutputsParams(json=schema), [])
        assert (matcher.consume_tokens(smol_tokenizer.encode(text)) and matcher.is_accepting()) is accepted, schema
