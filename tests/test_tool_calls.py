"""Function calling by structured output: what tools and tool_choice ask of a job, and the output read back into
OpenAI's tool_calls, whole and streamed (the server's and batch's end to end are in test_server.py)."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from producer.openai_api import APIError, ChatCompletionRequest, CompletionRequest, chat_choices, parse
from producer.schema import JobRequest
from producer.tool_calls import NO_PARAMETERS, ToolChoice, ToolChoiceError

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/unit"}},
    "required": ["city", "unit"],
    "$defs": {"unit": {"type": "string", "enum": ["c", "f"]}},
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now"}},  # no parameters: it takes none
]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _request(**fields) -> dict:
    return {"model": "m", "messages": MESSAGES, "tools": TOOLS, **fields}


def test_required_is_an_array_of_calls_of_the_tools_each_with_its_own_parameters():
    schema = ToolChoice.of(TOOLS, "required").schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}, {"name": "now", "parameters": {}}]
    jsonschema.validate(good, schema)
    bad = [
        [],  # no call
        [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "kelvin"}}],  # a $ref kept pointing
        [{"name": "now", "parameters": {"city": "Paris"}}],  # a function without parameters takes none
        [{"name": "sudo", "parameters": {}}],  # not a tool
        [{"name": "now", "parameters": {}, "also": 1}],
    ]
    for calls in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(calls, schema)
    assert "$defs" in WEATHER  # (the tool's own schema is left as it was)
    one = ToolChoice.of(TOOLS, "required", parallel=False).schema()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, one)
    jsonschema.validate(good[:1], one)


def test_a_named_function_is_its_parameters_and_one_without_is_an_empty_object():
    assert ToolChoice.of(TOOLS, NAMED).schema() == WEATHER
    assert ToolChoice.of(TOOLS, {"type": "function", "function": {"name": "now"}}).schema() == NO_PARAMETERS


@pytest.mark.parametrize(
    ("tools", "choice", "message"),
    [
        (TOOLS, None, '"auto" tool choice needs a parser'),  # OpenAI's default with tools is "auto"
        (TOOLS, "auto", '"auto" tool choice needs a parser'),
        ([], "required", 'tool_choice "required" needs tools'),
        (None, NAMED, "needs tools"),
        (TOOLS[1:], NAMED, "'get_weather', which is not among the tools"),
        ([TOOLS[1], TOOLS[1]], "required", "two tools are named 'now'"),
    ],
)
def test_what_cannot_be_done_is_refused_with_its_reason(tools, choice, message):
    with pytest.raises(ToolChoiceError, match=message):
        ToolChoice.of(tools, choice)


@pytest.mark.parametrize(
    ("parameters", "said"),
    [
        ({"type": "boolean"}, 'type "object", got type "boolean"'),
        ({"type": ["object", "null"]}, 'type "object", got type ["object", "null"]'),
        ({"enum": [1, 2]}, "its enum holds other values"),
        ({"const": "x"}, "its const holds other values"),
    ],
)
def test_parameters_that_describe_no_object_are_refused_at_the_request(parameters, said):
    """A boolean or enum schema was taken: the call's arguments came out ``false`` or ``1``, and the same call sent
    back in the next turn was refused there (a call's arguments are a JSON object's text). OpenAI refuses the tool."""
    from producer.openai_api import parse_request
    from producer.responses_api import ResponsesRequest

    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    with pytest.raises(APIError, match=re.escape(said)) as chat:
        parse_request(ChatCompletionRequest, _request(tools=[tool]))
    assert chat.value.param == "tools.0.function.parameters"
    body = {"model": "m", "input": "hi", "tools": [{"type": "function", "name": "f", "parameters": parameters}]}
    with pytest.raises(APIError, match=re.escape(said)) as responses:
        parse_request(ResponsesRequest, body)
    assert responses.value.param == "tools.0.parameters"
    for fine in ({}, {"type": "object"}, {"type": ["object"]}, {"enum": [{"a": 1}]}):
        parse_request(ChatCompletionRequest, _request(tools=[{"type": "function", "function": {"name": "f",
                      "parameters": fine}}]))  # fmt: skip


def test_two_tools_defining_one_name_differently_are_refused():
    other = {"type": "object", "properties": {"u": {"$ref": "#/$defs/unit"}}, "$defs": {"unit": {"type": "integer"}}}
    tools = [TOOLS[0], {"type": "function", "function": {"name": "other", "parameters": other}}]
    with pytest.raises(ToolChoiceError, match=r"define \$defs/unit twice"):
        ToolChoice.of(tools, "required").schema()
    same = {**other, "$defs": WEATHER["$defs"]}
    tools[1]["function"]["parameters"] = same
    defs = ToolChoice.of(tools, "required").schema()["$defs"]
    assert {k: v for k, v in defs.items() if not k.startswith("__roseinfer_tool_")} == WEATHER["$defs"]


def test_required_keeps_what_a_tools_own_references_point_at():
    """Each tool's parameters were nested in the array of calls: "#" (a recursive tree, as zod writes it) pointed at
    the whole array, and "#/properties/..." at nothing (refused), where a named tool_choice and OpenAI take them."""
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}, "twin": {"$ref":
            "#/properties/kids"}}, "additionalProperties": False}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "f", "parameters": tree}}]
    schema = ToolChoice.of(tools, "required").schema()
    good = [{"name": "f", "parameters": {"kids": [{"kids": []}], "twin": [{}]}}]
    jsonschema.validate(good, schema)
    with pytest.raises(jsonschema.ValidationError):  # an array of calls is no kid
        jsonschema.validate([{"name": "f", "parameters": {"kids": [[{"name": "f", "parameters": {}}]]}}], schema)


def test_required_reads_a_tools_own_id_and_properties_named_as_keywords():
    """A tool's parameters with an "$id" (re-basing its "#/..." references where they were moved) and a property
    named "default" (taken for a value, its "$ref" left pointing at the tool's old root) were refused under
    "required" ("Pointer ... does not exist"), where a named tool_choice took them."""
    from roseinfer.structured_output import enforceable

    a = {"type": "object", "properties": {"v": {"type": "string"}}, "required": ["v"], "additionalProperties": False}
    params = {
        "$id": "https://example.com/tool.json", "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object", "properties": {"a": {"$ref": "#/$defs/A"}, "default": {"$ref": "#/properties/a"}},
        "required": ["a", "default"], "additionalProperties": False, "$defs": {"A": a},
    }  # fmt: skip
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    schema = ToolChoice.of(tools, "required").schema()
    jsonschema.validate([{"name": "f", "parameters": {"a": {"v": "x"}, "default": {"v": "y"}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"a": {"v": "x"}, "default": 3}}], schema)
    import llguidance
    from llguidance import LLMatcher

    grammar = LLMatcher.grammar_from_json_schema(enforceable(schema))
    assert llguidance.LLMatcher.validate_grammar(grammar) == "", "llguidance refuses it"


def test_none_asks_for_no_call():
    assert ToolChoice.of(TOOLS, "none") is None and ToolChoice.of(None, None) is None


OUTPUT = (
    '[ {"name": "get_weather", "parameters": {"city": "Par}is \\"[{\\\\", "unit": "c"}},\n'
    ' {"parameters": {}, "name": "now"} ]'
)


@pytest.mark.parametrize("size", [1, 2, 7, len(OUTPUT)])
def test_required_calls_streamed_in_any_pieces_are_the_calls_of_the_whole_output(size):
    plan = ToolChoice.of(TOOLS, "required")
    whole = plan.read(OUTPUT)[1]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole] == [
        ("get_weather", {"city": 'Par}is "[{\\', "unit": "c"}),
        ("now", {}),
    ]
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in whole)
    assert len({c["id"] for c in whole}) == 2
    stream = plan.stream()
    assert stream.opening() == []
    deltas = [d for i in range(0, len(OUTPUT), size) for d in stream.feed(OUTPUT[i : i + size])[1]]
    assert stream.finish() == ("", [])
    assert [d["index"] for d in deltas] == [0, 1]
    assert [d["function"] for d in deltas] == [c["function"] for c in whole]


def test_required_calls_keep_the_parameters_as_the_model_wrote_them_a_number_past_a_float_too():
    """Written again from Python, ``1e999`` (which the grammar's "number" takes) became an infinity JSON has no word
    for and failed the response (a 500, or a stream cut without [DONE]); ``1E5`` became ``100000.0``."""
    output = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c", "days": 1e999, "at": 1E5}}]'
    [call] = ToolChoice.of(TOOLS, "required").read(output)[1]
    assert call["function"]["arguments"] == '{"city": "Paris", "unit": "c", "days": 1e999, "at": 1E5}'
    stream = ToolChoice.of(TOOLS, "required").stream()
    [delta] = [d for i in range(0, len(output), 3) for d in stream.feed(output[i : i + 3])[1]]
    assert delta["function"] == call["function"]


def test_a_call_cut_short_is_left_out_and_a_named_functions_arguments_are_the_output_as_it_came():
    cut = OUTPUT[: OUTPUT.index('"name": "now"')]
    assert [c["function"]["name"] for c in ToolChoice.of(TOOLS, "required").read(cut)[1]] == ["get_weather"]
    plan = ToolChoice.of(TOOLS, NAMED)
    text = '{"city": "Paris", "unit": "c"}'
    [call] = plan.read(text)[1]
    assert call["function"] == {"name": "get_weather", "arguments": text}
    stream = plan.stream()
    [opening] = stream.opening()
    assert opening["index"] == 0 and opening["function"] == {"name": "get_weather", "arguments": ""}
    pieces = [d["function"]["arguments"] for i in range(0, len(text), 4) for d in stream.feed(text[i : i + 4])[1]]
    assert "".join(pieces) == text and stream.feed("") == ("", [])


def test_a_chat_request_with_tool_choice_is_a_job_constrained_to_its_calls_and_told_of_the_tools():
    req, fields = parse(ChatCompletionRequest, _request(tool_choice="required", parallel_tool_calls=False))
    assert fields["tools"] == TOOLS
    assert fields["structured_outputs"] == {"json": ToolChoice.of(TOOLS, "required", parallel=False).schema()}
    assert "tool_choice" not in fields and "parallel_tool_calls" not in fields
    job = JobRequest.model_validate(fields)
    assert job.engine_prompt() == {"messages": MESSAGES, "tools": TOOLS}
    result = {"text": '[{"name": "now", "parameters": {}}]', "finish_reason": "stop"}
    [choice] = chat_choices(result, req)
    assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"  # (OpenAI's, vLLM's)
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "now", "arguments": "{}"}
    # tool_choice "none": the template is told of the tools all the same (vLLM's), and nothing constrains the output
    req, fields = parse(ChatCompletionRequest, _request(tool_choice="none"))
    assert fields["tools"] == TOOLS and "structured_outputs" not in fields
    assert chat_choices({"text": "Sunny."}, req)[0]["message"] == {"role": "assistant", "content": "Sunny."}


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({}, "tool_choice", '"auto" tool choice needs a parser'),
        ({"tool_choice": {"type": "function", "function": {"name": "rm"}}}, "tool_choice", "not among the tools"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tool_choice": "always"}, "tool_choice", "Input should be"),
        ({"tools": [{"type": "function"}], "tool_choice": "none"}, "tools.0.function", "Field required"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "none"}, "tools.0.function.name",
         "should match pattern"),
        ({"tool_choice": NAMED, "response_format": {"type": "json_object"}}, "response_format", "constrains the"),
        ({"tool_choice": NAMED, "structured_outputs": {"regex": "a+"}}, "structured_outputs", "constrains the"),
        # definitions that are not an object were an AttributeError: a 500 the client retried
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$defs": "x"}}}],
          "tool_choice": "required"}, "tools", r"tools.0: the function 'f''s parameters.\$defs must be an object"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"definitions": [1]}}}],
          "tool_choice": "required"}, "tools", "parameters.definitions must be an object of definitions, got list"),
    ],
)  # fmt: skip
def test_a_bad_tool_request_is_a_400_naming_its_parameter(fields, param, message):
    with pytest.raises(APIError, match=message) as err:
        parse(ChatCompletionRequest, _request(**fields))
    assert (err.value.status, err.value.param) == (400, param)


def test_a_completion_takes_no_tools():
    for fields in ({"tools": TOOLS, "tool_choice": "none"}, {"tool_choice": "required"}):
        with pytest.raises(APIError, match="for /v1/chat/completions") as err:
            parse(CompletionRequest, {"model": "m", "prompt": "x", **fields})
        assert err.value.param == "tools"
    parse(CompletionRequest, {"model": "m", "prompt": "x", "tools": [], "tool_choice": "auto"})  # (sent empty)


@pytest.mark.slow  # imports openai (a second or two of each worker's): keeps the fast lane under a minute
def test_a_conversation_with_tool_calls_goes_back_to_the_template_with_their_arguments_as_objects():
    """A response's message dumped back (content null, its tool_calls), then the tool's answer: the job carries
    both, and the template gets the arguments as an object, as vLLM and Hugging Face's templates take them."""
    from openai.types.chat import ChatCompletionMessage

    call = {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "now", "arguments": ""}}
    call2 = {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    answer = ChatCompletionMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [call, call2]})
    messages = [*MESSAGES, answer.model_dump(), {"role": "tool", "content": "12:00", "tool_call_id": "chatcmpl-tool-1"}]
    _, fields = parse(ChatCompletionRequest, _request(messages=messages, tool_choice="none"))
    assert fields["messages"][1] == {"role": "assistant", "content": "", "tool_calls": [call, call2]}
    assert fields["messages"][2] == {"role": "tool", "content": "12:00", "tool_call_id": "chatcmpl-tool-1"}
    prompt = JobRequest.model_validate(fields).engine_prompt()
    assert [c["function"]["arguments"] for c in prompt["messages"][1]["tool_calls"]] == [{}, {"city": "Oslo"}]


@pytest.mark.parametrize(
    ("message", "error"),
    [
        ({"role": "assistant", "content": None}, "content is required"),
        ({"role": "user", "content": None}, "content is required"),
        ({"role": "user", "content": "hi", "tool_calls": [{"id": "1", "type": "function",
          "function": {"name": "now", "arguments": "{}"}}]}, "only an assistant message carries tool_calls"),
        ({"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
          "function": {"name": "now", "arguments": "{city"}}]}, "arguments are a JSON object's text"),
        ({"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
          "function": {"name": "now", "arguments": "[1]"}}]}, "arguments are a JSON object's text"),
        ({"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
          "function": {"name": "now", "arguments": "[" * 100_000}}]}, "arguments are a JSON object's text"),
    ],
)  # fmt: skip
def test_a_bad_message_is_a_400(message, error):
    with pytest.raises(APIError, match=error) as err:
        parse(ChatCompletionRequest, _request(messages=[*MESSAGES, message], tool_choice="none"))
    assert err.value.status == 400 and err.value.param.startswith("messages")


def test_a_jobs_tools_need_messages_and_are_bounded():
    with pytest.raises(ValueError, match="tools: for the chat template, so with messages"):
        JobRequest.model_validate({"prompt": "x", "tools": TOOLS})
    # A writer that sends every field (Go without omitempty, a client generated from the schema) sends these at
    # their defaults: nothing asked of a plain prompt, and no refusal.
    unasked = {"tools": None, "chat_template_kwargs": None, "add_generation_prompt": True,
               "continue_final_message": False}  # fmt: skip
    assert JobRequest.model_validate({"prompt": "x", **unasked}).engine_prompt() == {"prompt": "x"}
    assert JobRequest.model_validate({"prompt": "x", "tools": [], "chat_template_kwargs": {}}).prompt == "x"
    with pytest.raises(ValueError, match="at most 128"):
        JobRequest.model_validate({"messages": MESSAGES, "tools": TOOLS[1:] * 129})
    deep: dict = {}
    for _ in range(120):
        deep = {"type": "object", "properties": {"x": deep}}
    with pytest.raises(ValueError, match="nests objects and lists deeper"):
        JobRequest.model_validate({"messages": MESSAGES, "tools": [{"function": {"name": "f", "parameters": deep}}]})


HERMES = (
    'Let me look that up. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
)


def test_auto_reads_the_models_own_calls_where_the_server_names_its_format():
    plan = ToolChoice.of(TOOLS, "auto", parser="hermes")
    assert plan.auto and plan.schema() is None and ToolChoice.of(TOOLS, None, parser="hermes") == plan
    content, calls = plan.read(HERMES)
    assert content == "Let me look that up. "
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "c"}),
        ("now", {}),
    ]
    assert plan.read("Just text, a < b.") == ("Just text, a < b.", [])
    left_open = '<tool_call>{"name": "now", "arguments": {}}'  # (the model ended before closing its block)
    assert [c["function"]["name"] for c in plan.read(left_open)[1]] == ["now"] and plan.read(left_open)[0] is None
    broken = 'Sure. <tool_call>{"name": "now", "arguments": </tool_call>'  # (vLLM's: all of it is text then)
    assert plan.read(broken) == (broken, [])
    deep = "<tool_call>" + "[" * 100_000 + "</tool_call>"  # (past the JSON parser's depth: text too, no crash)
    assert plan.read(deep) == (deep, [])
    stream = plan.stream()
    assert stream.feed(deep) == (deep, [])


# Each format's outputs: (text, its content, its calls as (name, arguments)); a content of the text itself: no calls.
_OSLO = ("get_weather", {"city": "Oslo", "unit": "c"})
OUTPUTS = {
    "hermes": [
        (HERMES, "Let me look that up. ", [_OSLO, ("now", {})]),
        ("Just text, a < b <tool", "Just text, a < b <tool", []),
        (HERMES[: HERMES.rindex("</tool_call>")], "Let me look that up. ", [_OSLO, ("now", {})]),
        ("\n " + HERMES[21:] + "\n", None, [_OSLO, ("now", {})]),
        ("  \n", "  \n", []),
        ('\n<tool_call>{"name": </tool_call>', '\n<tool_call>{"name": </tool_call>', []),  # (its space is text too)
        (
            '<tool_call>{bad</tool_call> <tool_call>{"name": "now"}</tool_call>',  # (after a bad block: all text)
            '<tool_call>{bad</tool_call> <tool_call>{"name": "now"}</tool_call>',
            [],
        ),
        (
            '<tool_call>{"name": "now", "arguments": {"x": NaN}}</tool_call>',  # (JSON has no NaN: not a call)
            '<tool_call>{"name": "now", "arguments": {"x": NaN}}</tool_call>',
            [],
        ),
        (HERMES + " More words.", "Let me look that up.  More words.", [_OSLO, ("now", {})]),
        # "parameters", as some models write it (its arguments were lost: a call with {})
        ('<tool_call>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}</tool_call>', None, [_OSLO]),
        (
            '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
            '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
            [],
        ),  # (a function the request did not offer: text)
        ('<tool_call>{"name": "now", "arguments": "{}"}</tool_call>', None, [("now", {})]),  # (an object's JSON)
        (
            '<tool_call>{"name": "now", "arguments": "Oslo"}</tool_call>',
            '<tool_call>{"name": "now", "arguments": "Oslo"}</tool_call>',
            [],
        ),  # (arguments a client cannot parse: text)
        (
            '<tool_call>{"name": "get_weather", "arguments": {"city": "\\ud83d", "unit": "c"}}</tool_call>',
            None,
            [("get_weather", {"city": "\ud83d", "unit": "c"})],
        ),  # (a lone surrogate: sent escaped)
    ],
    "llama3_json": [
        (
            '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}; {"name": "now", "parameters": {}}',
            None,
            [_OSLO, ("now", {})],
        ),
        (' <|python_tag|>{"name": "now", "arguments": {}}', None, [("now", {})]),
        ('Sure. <|python_tag|>{"name": "now", "parameters": {}}', "Sure. ", [("now", {})]),
        ('{"name": "now"}', None, [("now", {})]),
        ('{"answer": 42}', '{"answer": 42}', []),  # (JSON, but no call: the answer's text)
        ('{"name": "now", "parameters": {}} and then', '{"name": "now", "parameters": {}} and then', []),
        ("Sets are written {1, 2}.", "Sets are written {1, 2}.", []),
        (" {: ]", " {: ]", []),
        ('{1, 2} <|python_tag|>{"name": "now", "parameters": {}}', "{1, 2} ", [("now", {})]),
        ('{"name": "now", "parameters": {}', '{"name": "now", "parameters": {}', []),  # (cut short)
    ],
    "mistral": [
        (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}, '
            '{"name": "now", "arguments": {}}]',
            None,
            [_OSLO, ("now", {})],
        ),
        ('Let me check. [TOOL_CALLS][{"name": "now", "arguments": {}}]', "Let me check. ", [("now", {})]),
        # Words after the array are left out, as vLLM's parser leaves them: the answer was all text, no call.
        ('[TOOL_CALLS][{"name": "now", "arguments": {}}] I called it.', None, [("now", {})]),
        (
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "unit": "c"}[TOOL_CALLS]now[ARGS]{}',
            None,
            [_OSLO, ("now", {})],
        ),
        ("[TOOL_CALLS]now{}", None, [("now", {})]),
        ('[TOOL_CALLS][{"name": "now", "arguments": ', '[TOOL_CALLS][{"name": "now", "arguments": ', []),
        ("A [TOOL plain [answer].", "A [TOOL plain [answer].", []),
        ('[TOOL_CALLS][{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}]', None, [_OSLO]),
        (
            '[TOOL_CALLS][{"name": "now", "arguments": "Oslo"}]',
            '[TOOL_CALLS][{"name": "now", "arguments": "Oslo"}]',
            [],
        ),
    ],
    "pythonic": [
        ("[get_weather(city=\"Oslo\", unit='c'), now()]", None, [_OSLO, ("now", {})]),
        (
            "  [get_weather(a=[1, -2.5, {'k': None}], b=True, c=(1,))]",
            None,
            [("get_weather", {"a": [1, -2.5, {"k": None}], "b": True, "c": [1]})],
        ),
        ('[print(open("/etc/passwd").read())]', '[print(open("/etc/passwd").read())]', []),  # (positional)
        ("[f(a=g())]", "[f(a=g())]", []),  # (a call is no value: nothing is ever run)
        ("[f(x=__import__('os'))]", "[f(x=__import__('os'))]", []),
        ("[f(**{'a': 1})]", "[f(**{'a': 1})]", []),
        ("[Note] the answer is 4.", "[Note] the answer is 4.", []),
        ("[f(a=1)] and more", "[f(a=1)] and more", []),
        ("[os.system(a='ls')]", "[os.system(a='ls')]", []),
        ("[]", "[]", []),
        ("[f(a=1e999)]", "[f(a=1e999)]", []),  # (an infinity, which JSON has no word for)
        ("\n ['", "\n ['", []),
        ("[rm_rf()]", "[rm_rf()]", []),
        ('[get_weather(city="\\ud83d", unit="c")]', None, [("get_weather", {"city": "\ud83d", "unit": "c"})]),
        # Llama 4's wrapper, kept as text where tools may be called: the answer was all text, no call.
        ('<|python_start|>[get_weather(city="Oslo", unit="c")]<|python_end|>', None, [_OSLO]),
        ("Let me see. <|python_start|>[now()]<|python_end|>", "Let me see. ", [("now", {})]),
        ("<|python_start|>[now()]", None, [("now", {})]),
    ],
}
_CASES = [(fmt, *case) for fmt, cases in OUTPUTS.items() for case in cases]


def _read(calls: list) -> list:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), _CASES)
def test_auto_reads_each_formats_calls_and_the_text_around_them(parser, text, content, calls):
    plan = ToolChoice.of(TOOLS, "auto", parser=parser)
    got_content, got_calls = plan.read(text)
    assert (got_content, _read(got_calls)) == (content, calls)
    assert all(c["type"] == "function" and c["id"] for c in got_calls)
    for c in got_calls:  # a response holds it: UTF-8 (a lone surrogate has no form there, a 500)
        c["function"]["arguments"].encode("utf-8")


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_arguments_nested_past_what_python_writes_are_text_not_an_error(parser):
    """JSON that Python's parser reads and its writer cannot (about 990 levels, fewer the deeper the call stack):
    a RecursionError, a 500 (a stream cut without [DONE])."""
    plan = ToolChoice.of(TOOLS, "auto", parser=parser)
    wrap = {"hermes": "<tool_call>{}</tool_call>", "llama3_json": "{}", "mistral": "[TOOL_CALLS][{}]"}[parser]
    for depth in (*range(800, 1000), 2000):  # (where the writer fails moves with the stack: every depth)
        arguments = '{"a":' * depth + "1" + "}" * depth
        plan.read(wrap.replace("{}", '{"name": "now", "arguments": ' + arguments + "}", 1))
        stream = plan.stream()
        stream.feed(wrap.replace("{}", '{"name": "now", "arguments": ' + arguments + "}", 1))
        stream.finish()


def test_arguments_given_as_a_string_are_sent_as_json_a_client_reads():
    """Arguments a model writes as a string of JSON went out as they were: one holding a lone surrogate (half a
    UTF-16 pair, from a \\u escape) could not be encoded, a 500; one holding NaN was no JSON to the client."""
    plan = ToolChoice.of(TOOLS, "auto", parser="hermes")
    surrogate = '<tool_call>{"name": "now", "arguments": "{\\"a\\": \\"\\ud83d\\"}"}</tool_call>'
    _, [call] = plan.read(surrogate)
    assert call["function"]["arguments"].encode() == b'{"a": "\\ud83d"}'
    content, calls = plan.read('<tool_call>{"name": "now", "arguments": "{\\"a\\": NaN}"}</tool_call>')
    assert calls == [] and "NaN" in content  # (text, as a call whose object holds NaN)


def test_mistrals_call_ids_are_the_nine_letters_and_digits_its_templates_take():
    plan = ToolChoice.of(TOOLS, "auto", parser="mistral")
    _, calls = plan.read('[TOOL_CALLS][{"name": "now", "arguments": {}}, {"name": "now", "arguments": {}}]')
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls) and calls[0]["id"] != calls[1]["id"]
    _, calls = ToolChoice.of(TOOLS, "auto", parser="hermes").read(HERMES)
    assert all(c["id"].startswith("chatcmpl-tool-") for c in calls)  # (the others': vLLM's form)
    # "required" and named calls too, under a server of Mistral's format: theirs were vLLM's form, streamed or not.
    required = ToolChoice.of(TOOLS, "required", parser="mistral")
    _, calls = required.read('[{"name": "now", "parameters": {}}]')
    [streamed] = required.stream().feed('[{"name": "now", "parameters": {}}]')[1]
    named = ToolChoice.of(TOOLS, NAMED, parser="mistral")
    ids = [c["id"] for c in (*calls, streamed, *named.read('{"city": "Oslo"}')[1], *named.stream().opening())]
    assert len(ids) == 4 and all(len(i) == 9 and i.isalnum() for i in ids), ids


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("parser", list(OUTPUTS))
def test_auto_streamed_in_any_pieces_is_the_whole_outputs_text_and_calls(parser, size):
    plan = ToolChoice.of(TOOLS, "auto", parser=parser)
    markers = ["<tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "<|python_start|>"]
    for text, _, _ in OUTPUTS[parser]:
        stream = plan.stream()
        content, deltas = "", []
        whole_content, whole_calls = plan.read(text)
        for i in range(0, len(text), size):
            more, calls = stream.feed(text[i : i + size])
            if whole_calls:  # a marker never leaks out as text, even split between pieces
                assert not any(m in content + more for m in markers)
            content, deltas = content + more, deltas + calls
        more, calls = stream.finish()
        content, deltas = content + more, deltas + calls
        assert content == (whole_content or "")
        assert [d["index"] for d in deltas] == list(range(len(whole_calls)))
        assert [d["function"] for d in deltas] == [c["function"] for c in whole_calls]


_ATOMS = ["<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "{", "}", "[", "]", "(", ")",
          "<|python_start|>", "<|python_end|>",
          '"name"', ": ", '"now"', '"arguments"', '"parameters"', "{}", ", ", "; ", " ", "\n", "x", "now(", "a=1",
          '{"name": "now", "arguments": {}}', "[now()]", "'", '"']  # fmt: skip


@pytest.mark.parametrize("parser", list(OUTPUTS))
def test_any_output_streamed_in_any_pieces_reads_as_the_whole_one(parser):
    """Random outputs made of the formats' markers and pieces of calls (seeded), streamed in random pieces: each
    gives the whole output's text and calls, but where a call went out before a block that does not read (calls
    sent cannot be taken back; the whole output is then text)."""
    rng = random.Random(7)
    plan = ToolChoice.of(TOOLS, "auto", parser=parser)
    checked = 0
    for _ in range(2000):
        text = "".join(rng.choice(_ATOMS) for _ in range(rng.randint(0, 10)))
        stream, size = plan.stream(), rng.randint(1, 6)
        pieces = [stream.feed(text[i : i + size]) for i in range(0, len(text), size)] + [stream.finish()]
        content, calls = "".join(p[0] for p in pieces), [d["function"] for p in pieces for d in p[1]]
        whole_content, whole_calls = plan.read(text)
        if calls and not whole_calls:  # (a call sent, then a block that does not read)
            continue
        assert (content, calls) == (whole_content or "", [c["function"] for c in whole_calls]), text
        checked += 1
    assert checked > 1900


def test_auto_without_parallel_calls_keeps_the_first_call_whole_and_streamed():
    plan = ToolChoice.of(TOOLS, "auto", parallel=False, parser="hermes")
    content, [call] = plan.read(HERMES)
    assert content == "Let me look that up. " and call["function"]["name"] == "get_weather"
    stream = plan.stream()
    deltas = [d for c in HERMES for d in stream.feed(c)[1]] + stream.finish()[1]
    assert [(d["index"], d["function"]["name"]) for d in deltas] == [(0, "get_weather")]


def test_auto_jobs_are_not_constrained_and_keep_the_models_markers():
    for body in ({}, {"tool_choice": "auto"}):
        req, fields = parse(ChatCompletionRequest, _request(**body), tool_parser="hermes")
        assert "structured_outputs" not in fields and fields["skip_special_tokens"] is False
        assert fields["tools"] == TOOLS
    _, fields = parse(ChatCompletionRequest, _request(skip_special_tokens=True), tool_parser="hermes")
    assert fields["skip_special_tokens"] is True  # (the request's own word stands)
    [choice] = chat_choices({"text": HERMES, "finish_reason": "stop"}, req)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look that up. "
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather", "now"]
    [choice] = chat_choices({"text": "Sunny.", "finish_reason": "stop"}, req)
    assert choice == {"index": 0, "message": {"role": "assistant", "content": "Sunny."}, "finish_reason": "stop",
                      "stop_reason": None, "logprobs": None}  # fmt: skip
    with pytest.raises(APIError, match="--tool-call-parser"):
        parse(ChatCompletionRequest, _request(tool_choice="auto"))
