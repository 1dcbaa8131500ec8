"""OpenAI's Responses API read into the chat job it means (the server's end to end is in test_server.py)."""

from __future__ import annotations

import pytest

from producer.openai_api import APIError
from producer.responses_api import ResponseWriter, parse_responses
from producer.tool_calls import ToolChoice

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather now", "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]


def test_input_and_instructions_are_the_chats_messages_and_its_settings_the_jobs():
    req, chat, job = parse_responses(
        {"model": "m", "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 9, "temperature": 0,
         "text": {"format": {"type": "json_schema", "name": "pet", "schema": WEATHER, "strict": True}},
         "metadata": {"k": "v"}, "store": True, "truncation": "disabled", "top_k": 3}
    )  # fmt: skip
    assert job["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert (job["max_tokens"], job["temperature"], job["metadata"], job["top_k"]) == (9, 0.0, {"k": "v"}, 3)
    schema = {"name": "pet", "schema": WEATHER, "strict": True}
    assert job["response_format"] == {"type": "json_schema", "json_schema": schema}
    assert not req.stream and chat.tool_plan() is None
    _, _, job = parse_responses({"model": "m", "input": "Hi", "text": {"format": {"type": "json_object"}}})
    assert job["response_format"] == {"type": "json_object"}


def test_vllms_sampling_extras_empty_instructions_and_a_thought_turned_off_are_the_chats():
    """vLLM's Responses request takes the chat's stop, penalties, logit_bias, ignore_eos and chat_template_kwargs
    (a 400 here before); "" instructions add no system message (it replaced the template's own); effort "none"
    turns Qwen3's thinking off (its template reads enable_thinking), and nothing is read as a thought then."""
    extras = {"stop": ["\n\n"], "presence_penalty": 0.5, "frequency_penalty": 0.25, "logit_bias": {"7": -100},
              "ignore_eos": True, "chat_template_kwargs": {"custom": 1}}  # fmt: skip
    _, _, job = parse_responses({"model": "m", "input": "Hi", "instructions": "", "max_tool_calls": 2, **extras})
    assert job["messages"] == [{"role": "user", "content": "Hi"}]
    assert {k: job[k] for k in extras} == {**extras, "logit_bias": {"7": -100.0}}
    _, chat, job = parse_responses({"model": "m", "input": "Hi", "reasoning": {"effort": "none"}}, None, "qwen3")
    assert job["chat_template_kwargs"] == {"reasoning_effort": "none", "enable_thinking": False}
    assert chat.reasoning_plan() is None
    _, chat, job = parse_responses({"model": "m", "input": "Hi", "reasoning": {"effort": "low"}}, None, "qwen3")
    assert job["chat_template_kwargs"] == {"reasoning_effort": "low"} and chat.reasoning_plan() is not None
    # A client that stores nothing asks for encrypted thoughts always: there are none to add.
    _, _, job = parse_responses({"model": "m", "input": "Hi", "include": ["reasoning.encrypted_content"]})
    assert "logprobs" not in job


def test_a_conversation_with_function_calls_and_their_outputs_goes_back_as_the_chats():
    """An earlier answer's output items sent back as input (as the official client's users do): its text and its
    parallel calls one assistant message, each output a tool message answering its call. The keys the client's
    ``stream()`` and ``parse()`` add to them (``parsed_arguments``, ``parsed``) are dropped, as the chat drops them:
    a conversation saved with ``model_dump()`` was a 400."""
    calls = [
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Oslo"}', "status": "completed", "parsed_arguments": {"city": "Oslo"}},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
    ]  # fmt: skip
    part = {"type": "output_text", "text": "Let me look.", "annotations": [], "logprobs": [], "parsed": None}
    said = {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed", "content": [part]}
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather"}, {"type": "input_text", "text": "?"}]},
        said, *calls,
        {"type": "function_call_output", "call_id": "call_1", "output": "Rain"},
        {"type": "function_call_output", "call_id": "call_2", "output": "Sun"},
    ]  # fmt: skip
    _, _, job = parse_responses({"model": "m", "input": items, "tools": TOOLS, "tool_choice": "none"})
    assert job["tools"] == CHAT_TOOLS and "structured_outputs" not in job
    assert job["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}], "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        ]},
        {"role": "tool", "content": "Rain", "tool_call_id": "call_1"},
        {"role": "tool", "content": "Sun", "tool_call_id": "call_2"},
    ]  # fmt: skip


def test_the_output_texts_logprobs_are_the_chats():
    for asked in ({"include": ["message.output_text.logprobs"], "top_logprobs": 3}, {"top_logprobs": 3}):
        _, chat, job = parse_responses({"model": "m", "input": "Hi", **asked})
        assert (job["logprobs"], job["top_logprobs"], chat.num_logprobs) == (True, 3, 3)
    _, chat, job = parse_responses({"model": "m", "input": "Hi", "include": ["message.output_text.logprobs"]})
    assert chat.num_logprobs == 0 and job["logprobs"] is True
    _, chat, job = parse_responses({"model": "m", "input": "Hi"})
    assert chat.num_logprobs is None and "logprobs" not in job


def test_tool_choice_is_the_chats():
    named = {"type": "function", "name": "get_weather"}
    _, chat, job = parse_responses({"model": "m", "input": "Hi", "tools": TOOLS, "tool_choice": named})
    assert chat.tool_plan() == ToolChoice.of(CHAT_TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert job["structured_outputs"] == {"json": WEATHER}


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "not stored here"),
        ({"reasoning": {"effort": "high"}}, "reasoning", "does not reason"),
        ({"background": True}, "background", "background"),
        ({"include": ["output_text.everything"]}, "include", "include takes .*'message.output_text.logprobs'"),
        ({"top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
        ({"input": []}, "input", "at least 1"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
            "item 0, content 0: input_image is not taken by a text model",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "item 0: nothing is stored here"),
        ({"input": ["Hi"]}, "input", "valid dictionary"),  # (an AttributeError, a 500, once)
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input", "type .web_search_call. are not"),
        (
            {
                "input": [
                    {"role": "user", "content": "Hi"},
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "not json"},
                ]
            },
            "input",
            "item 1: a tool call's arguments are a JSON object's text",
        ),
        ({"tools": TOOLS}, "tool_choice", '"auto" tool choice needs a parser'),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "rm"}}, "tool_choice", "not among the tools"),
        ({"tools": [{**TOOLS[0], "name": "a b"}], "tool_choice": "none"}, "tools.0.name", "pattern"),
        ({"temperature": 3}, "temperature", "less than or equal to 2"),
        ({"conversation": "conv_1"}, "conversation", "unsupported parameter"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "needs its schema"),
        ({"frequency_penalty": 3}, "frequency_penalty", "less than or equal to 2"),
    ],
)
def test_what_cannot_be_done_is_a_400_in_the_responses_apis_terms(fields, param, message):
    with pytest.raises(APIError, match=message) as err:
        parse_responses({"model": "m", "input": "Hi", **fields})
    assert err.value.status == 400 and (err.value.param or "").startswith(param), err.value.param


def test_a_responses_events_are_numbered_and_end_with_the_whole_response():
    req, chat, _ = parse_responses({"model": "m", "input": "Hi", "stream": True})
    writer = ResponseWriter("job1", "m", req, chat.tool_plan())
    events = [*writer.opening(), *writer.piece("Hel"), *writer.piece(""), *writer.piece("lo")]
    events += writer.closing("length", {"prompt_tokens": 3, "completion_tokens": 2})
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.incomplete",
    ]  # fmt: skip
    final = events[-1]["response"]
    assert final["id"] == "resp_job1" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["content"][0]["text"] == "Hello" and final["usage"]["total_tokens"] == 5
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    # The request's settings are echoed, as OpenAI's response echoes them (they were null, or left out).
    echoed = {"top_logprobs": 2, "max_tool_calls": 3, "service_tier": "auto", "safety_identifier": "s",
              "prompt_cache_key": "k"}  # fmt: skip
    req, chat, _ = parse_responses({"model": "m", "input": "Hi", "text": {"verbosity": "low"}, **echoed})
    whole = ResponseWriter("job2", "m", req, chat.tool_plan(), 2).whole({"text": "x", "finish_reason": "stop"})
    assert {k: whole[k] for k in echoed} == echoed and whole["text"]["verbosity"] == "low"


REASONED = [  # (output, finish reason, the output items' types): Qwen3's thinking, then text or a call
    ("<think>Two and two.</think>\n\nIt is 4.", "stop", ["reasoning", "message"]),
    (
        '<think>Look it up.</think><tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
        "stop",
        ["reasoning", "function_call"],
    ),
    ("<think>Still thinking when", "length", ["reasoning"]),
    ("It is 4.", "stop", ["message"]),  # (no thinking: no reasoning item)
    ("", "stop", ["message"]),
]


def _shown(output: list[dict]) -> list[tuple]:
    """Each output item's type, status and text (its arguments for a call); its id left out."""
    texts = {"reasoning": lambda i: i["content"][0]["text"], "message": lambda i: i["content"][0]["text"],
             "function_call": lambda i: (i["name"], i["arguments"])}  # fmt: skip
    return [(i["type"], i["status"], texts[i["type"]](i)) for i in output]


def _whole_and_streamed(req, chat, text: str, reason: str, size: int) -> tuple[dict, list[dict]]:
    """The whole response to a job's ``text`` and the events of its stream, fed ``size`` characters a piece."""
    usage = {"prompt_tokens": 3, "completion_tokens": 9}
    writer = ResponseWriter("j", "m", req, chat.tool_plan(), reasoning=chat.reasoning_plan())
    whole = writer.whole({"text": text, "finish_reason": reason, "usage": usage})
    writer = ResponseWriter("j", "m", req, chat.tool_plan(), reasoning=chat.reasoning_plan())
    events = writer.opening()
    for i in range(0, len(text), size):
        events += writer.piece(text[i : i + size])
    return whole, events + writer.closing(reason, usage)


@pytest.mark.parametrize("size", [1, 4, 1000])
@pytest.mark.parametrize(("text", "reason", "types"), REASONED)
def test_a_models_thinking_is_a_reasoning_item_before_its_answer_whole_and_streamed(text, reason, types, size):
    """--reasoning-parser: the thinking is a reasoning item (its text a reasoning_text part) before the answer's
    message or calls; streamed, its text comes in reasoning_text deltas first, and the response the events end with
    is the whole one's."""
    body = {"model": "m", "input": "2+2?", "tools": TOOLS, "stream": True}
    req, chat, _ = parse_responses(body, "hermes", "qwen3")
    whole, events = _whole_and_streamed(req, chat, text, reason, size)
    assert [item["type"] for item in whole["output"]] == types
    if types[0] == "reasoning":
        assert whole["output"][0]["content"][0] == {"type": "reasoning_text", "text": text[7:].partition("</think>")[0]}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert _shown(events[-1]["response"]["output"]) == _shown(whole["output"])
    deltas = [e for e in events if e["type"] == "response.reasoning_text.delta"]
    if types[0] == "reasoning":
        assert "".join(e["delta"] for e in deltas) == whole["output"][0]["content"][0]["text"]
        assert all(e["output_index"] == 0 for e in deltas)
        done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
        assert done == list(range(len(types)))  # (the thinking's item is done before the answer's)
    else:
        assert not deltas
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == types


@pytest.mark.parametrize("size", [1, 5, 1000])
@pytest.mark.parametrize(
    ("text", "reason"),
    [('<think>Weather first.</think>{"city": "Paris"}', "stop"), ("<think>Still thinking when", "length")],
)
def test_a_named_functions_call_after_thinking_streams_in_the_whole_responses_order(text, reason, size):
    """A named function's call item was added before any text, so a model that thought first streamed
    [function_call, reasoning] where the whole response has [reasoning, function_call] (and the call's arguments
    went to output 0 whatever it held)."""
    named = {"type": "function", "name": "get_weather"}
    body = {"model": "m", "input": "Weather?", "tools": TOOLS, "tool_choice": named, "stream": True}
    req, chat, _ = parse_responses(body, None, "qwen3")
    whole, events = _whole_and_streamed(req, chat, text, reason, size)
    output = events[-1]["response"]["output"]
    assert _shown(output) == _shown(whole["output"]) and output[0]["type"] == "reasoning"
    arguments = [e for e in events if e["type"].startswith("response.function_call_arguments")]
    if reason == "stop":
        assert [item["type"] for item in output] == ["reasoning", "function_call"]
        assert arguments and all(e["output_index"] == 1 for e in arguments)
    else:  # (cut short in its thinking: no call, as the whole response has none)
        assert [item["type"] for item in output] == ["reasoning"] and not arguments
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    assert added == list(range(len(output)))


EDGES = {  # (tool_choice, its texts): an empty thought, an empty answer, no output at all
    "none": ["", "<think></think>", "<think>\n</think>\n", "<think>x</think>"],
    "auto": ["", "<think></think>", "<think>\n\n</think>\n\n", "<think>a</think>"],
    "required": ["", "<think>x</think>", "<think>x"],
    "named": ["", "<think></think>", "<think>x</think>", "<think>x</think>\n", "<think>x"],
}


@pytest.mark.parametrize("size", [1, 3, 1000])
@pytest.mark.parametrize("reason", ["stop", "length"])
@pytest.mark.parametrize(("choice", "text"), [(c, t) for c, texts in EDGES.items() for t in texts])
def test_empty_thoughts_and_answers_stream_the_whole_responses_items(choice, text, reason, size):
    """An empty thought was a reasoning item whole but none streamed; an answer of nothing to a named function had
    its call whole but none streamed; a thought ended and cut short was done "incomplete" streamed. The rules of
    both now: a reasoning item for a thought of some text (vLLM's), a named call once the answer begins."""
    named = {"type": "function", "name": "get_weather"}
    body = {"model": "m", "input": "x", "tools": TOOLS, "stream": True,
            "tool_choice": named if choice == "named" else choice}  # fmt: skip
    req, chat, _ = parse_responses(body, "hermes" if choice == "auto" else None, "qwen3")
    whole, events = _whole_and_streamed(req, chat, text, reason, size)
    output = events[-1]["response"]["output"]
    assert _shown(output) == _shown(whole["output"])
    assert all(item["content"][0]["text"] for item in output if item["type"] == "reasoning")
    if choice == "named" and ("</think>" in text or not text):
        assert output[-1]["type"] == "function_call"
    if "</think>" in text:
        assert all(item["status"] == "completed" for item in output if item["type"] == "reasoning")


def test_thinking_sent_back_and_asked_for():
    """An earlier answer's reasoning item sent back is its assistant message's reasoning; ``reasoning.effort`` is
    the template's ``reasoning_effort`` where the server reads thinking (without a parser, a 400 as before)."""
    items = [
        {"role": "user", "content": "2+2?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Two."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4"}]},
        {"role": "user", "content": "And 3+3?"},
    ]
    _, _, fields = parse_responses({"model": "m", "input": items, "reasoning": {"effort": "low"}}, None, "qwen3")
    assert fields["messages"][1] == {"role": "assistant", "content": "4", "reasoning": "Two."}
    assert fields["chat_template_kwargs"] == {"reasoning_effort": "low"}
    with pytest.raises(APIError, match="does not reason"):
        parse_responses({"model": "m", "input": "Hi", "reasoning": {"effort": "low"}})
    with pytest.raises(APIError) as err:
        parse_responses({"model": "m", "input": "Hi", "reasoning": {"effort": "extreme"}}, None, "qwen3")
    assert err.value.param == "reasoning.effort"
    with pytest.raises(APIError, match=r"unsupported parameter: reasoning\.budget"):
        parse_responses({"model": "m", "input": "Hi", "reasoning": {"budget": 5}}, None, "qwen3")
    # Its values are OpenAI's: a summary of NaN was echoed into the response, a 500 (and NaN in a stream's JSON).
    for summary in (float("nan"), "everything", {"a": 1}):
        with pytest.raises(APIError) as err:
            parse_responses({"model": "m", "input": "Hi", "reasoning": {"summary": summary}}, None, "qwen3")
        assert err.value.param == "reasoning.summary"


OSLO = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


@pytest.mark.parametrize("size", [1, 7, 1000])
@pytest.mark.parametrize(
    ("text", "types"),
    [
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>', ["function_call"]),
        (
            'Let me see. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
            ["message", "function_call"],
        ),
        ("It is sunny.", ["message"]),
        ("", ["message"]),
        # Text after a call, or between two: the message goes where its first text came, cut short or not.
        (f"{OSLO}\nIt rains.", ["function_call", "message"]),
        (f"{OSLO} It is", ["function_call", "message"]),
        (f"{OSLO} and {OSLO}", ["function_call", "message", "function_call"]),
    ],
)
def test_auto_calls_stream_the_whole_responses_items_and_no_empty_message(text, types, size):
    """ "auto" opened a message item before any text: an output of calls alone streamed [message "", function_call]
    where the whole response has [function_call]. The whole response put its message first, where the stream had a
    call before it; and it marked a complete call "incomplete" when the text after it was cut short."""
    body = {"model": "m", "input": "Weather?", "tools": TOOLS, "stream": True}
    req, chat, _ = parse_responses(body, "hermes", None)
    usage = {"prompt_tokens": 3, "completion_tokens": 9}
    reason = "length" if text.endswith("It is") else "stop"
    whole = ResponseWriter("j", "m", req, chat.tool_plan()).whole(
        {"text": text, "finish_reason": reason, "usage": usage}
    )
    assert [item["type"] for item in whole["output"]] == types
    assert all(item["status"] == "completed" for item in whole["output"] if item["type"] == "function_call")
    writer = ResponseWriter("j", "m", req, chat.tool_plan())
    events = writer.opening()
    for i in range(0, len(text), size):
        events += writer.piece(text[i : i + size])
    events += writer.closing(reason, usage)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert _shown(events[-1]["response"]["output"]) == _shown(whole["output"])
    assert [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"] == types


@pytest.mark.slow  # imports openai (a second or two of each worker's): keeps the fast lane under a minute
@pytest.mark.parametrize(
    ("choice", "parser", "text"),
    [
        ("required", None, '[{"name": "get", "parameters": {"c": "x"}}]'),
        ("auto", "hermes", '<tool_call>{"name": "get", "arguments": {"c": "x"}}</tool_call>'),
    ],
)
def test_a_streamed_whole_call_reads_once_in_the_official_clients_snapshot(choice, parser, text):
    """The call's item was added with its arguments, then the delta sent them again: openai-python's stream state,
    which appends each delta to the item's arguments, held them twice."""
    tools = [
        {"type": "function", "name": "get", "parameters": {"type": "object", "properties": {"c": {"type": "string"}}}}
    ]
    body = {"model": "m", "input": "hi", "tools": tools, "tool_choice": choice, "stream": True}
    request, chat, _ = parse_responses(body, parser)
    writer = ResponseWriter("j", "m", request, chat.tool_plan())
    events = (
        writer.opening() + writer.piece(text) + writer.closing("stop", {"prompt_tokens": 1, "completion_tokens": 2})
    )
    [added] = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert added["arguments"] + "".join(deltas) == '{"c": "x"}'  # what a client appending the deltas holds
    [call] = [item for item in events[-1]["response"]["output"] if item["type"] == "function_call"]
    assert call["arguments"] == '{"c": "x"}' and call["status"] == "completed"
    streaming = pytest.importorskip("openai.lib.streaming.responses._responses")  # (not in openai 1.65, the floor)
    from openai._models import construct_type_unchecked
    from openai.types.responses import ResponseStreamEvent

    state, snapshots = streaming.ResponseStreamState(input_tools=tools, text_format=None), []
    for event in events:
        for out in state.handle_event(construct_type_unchecked(type_=ResponseStreamEvent, value=event)):
            if out.type == "response.function_call_arguments.delta":
                snapshots.append(out.snapshot)
    assert snapshots == ['{"c": "x"}']


@pytest.mark.parametrize("text", ['[{"name": "get", "parame', ""])
def test_required_calls_cut_before_any_stream_no_empty_message_the_whole_response_lacks(text):
    """The stream's final response held an empty message item where the whole response's output was empty."""
    tools = [
        {"type": "function", "name": "get", "parameters": {"type": "object", "properties": {"c": {"type": "string"}}}}
    ]
    body = {"model": "m", "input": "hi", "tools": tools, "tool_choice": "required", "stream": True}
    request, chat, _ = parse_responses(body, None)
    usage = {"prompt_tokens": 1, "completion_tokens": 2}
    whole = ResponseWriter("j", "m", request, chat.tool_plan()).whole({"text": text, "finish_reason": "length"})
    writer = ResponseWriter("j", "m", request, chat.tool_plan())
    events = writer.opening() + writer.piece(text) + writer.closing("length", usage)
    assert whole["output"] == [] and events[-1]["response"]["output"] == []
    assert not [e for e in events if e["type"] == "response.output_item.added"]


def test_a_named_functions_arguments_held_to_the_end_by_the_reasoning_parser_are_in_its_done_event():
    """Text the reasoning parser held until the output ended (whitespace that might begin a <think>) went out as a
    delta, but the call's done event and item read arguments without it, where the whole response had them."""
    named = {"type": "function", "name": "get_weather"}
    body = {"model": "m", "input": "Weather?", "tools": TOOLS, "tool_choice": named, "stream": True}
    req, chat, _ = parse_responses(body, None, "qwen3")
    usage = {"prompt_tokens": 3, "completion_tokens": 1}
    whole = ResponseWriter("j", "m", req, chat.tool_plan(), reasoning=chat.reasoning_plan()).whole(
        {"text": "\n", "finish_reason": "length", "usage": usage}
    )
    writer = ResponseWriter("j", "m", req, chat.tool_plan(), reasoning=chat.reasoning_plan())
    events = [*writer.opening(), *writer.piece("\n"), *writer.closing("length", usage)]
    [done] = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert done["arguments"] == "\n" == events[-1]["response"]["output"][-1]["arguments"]
    assert whole["output"][-1]["arguments"] == "\n"


def test_a_writer_that_took_in_text_its_reasoning_parser_holds_cannot_restart():
    """A job's restart (a reset event) was let through where no text had gone out, though the parser held "<think>"
    (one token in Qwen3): the writer went on with it, and the stream's thinking began "<think>"."""
    body = {"model": "m", "input": "Sum?", "stream": True}
    req, chat, _ = parse_responses(body, None, "qwen3")
    writer = ResponseWriter("j", "m", req, chat.tool_plan(), reasoning=chat.reasoning_plan())
    writer.opening()
    assert not writer.piece("<think>") and writer.fed and not writer.text


def test_a_text_answer_with_tools_offered_has_the_logprobs_asked_for_whole_and_streamed():
    """include logprobs with tools ("auto"): the message's text came with no logprobs, where a chat's has them."""
    include = ["message.output_text.logprobs"]
    body = {"model": "m", "input": "2+2?", "tools": TOOLS, "top_logprobs": 1, "include": include}
    req, chat, _ = parse_responses(body, "hermes")
    steps = [[[7, -0.5], [8, -1.5]], [[9, -0.25], [7, -2.0]], [[10, -0.125], [7, -3.0]]]
    result = {"text": "It is 4.", "token_ids": [7, 9, 10], "logprobs": steps, "finish_reason": "stop", "usage": {}}
    whole = ResponseWriter("j", "m", req, chat.tool_plan(), top_logprobs=1).whole(result)
    [message] = whole["output"]
    logprobs = message["content"][0]["logprobs"]
    assert [(t["token"], t["logprob"], len(t["top_logprobs"])) for t in logprobs] == [
        ("token_id:7", -0.5, 1), ("token_id:9", -0.25, 1), ("token_id:10", -0.125, 1)
    ]  # fmt: skip
    writer = ResponseWriter("j", "m", req, chat.tool_plan(), top_logprobs=1)
    events = writer.opening()
    for piece, token, step in zip(("It ", "is ", "4."), result["token_ids"], steps):
        events += writer.piece(piece, {"token_ids": [token], "logprobs": [step]})
    events += writer.closing("stop", {})
    deltas = [t for e in events if e["type"] == "response.output_text.delta" for t in e["logprobs"]]
    assert deltas == logprobs == events[-1]["response"]["output"][0]["content"][0]["logprobs"]


def test_truncation_auto_is_the_jobs_and_the_response_says_it():
    """truncation "auto" was taken and did nothing (a long conversation failed, and the response said "disabled"):
    it is the job's now (its earliest turns dropped to fit), and the response echoes what was asked."""
    from producer.openai_api import fit_to_context
    from producer.schema import JobRequest

    body = {"model": "m", "input": "Hi", "truncation": "auto", "max_output_tokens": 50}
    req, chat, job = parse_responses(body)
    assert job["truncation"] == "auto"
    assert JobRequest.model_validate(fit_to_context(job)).engine_prompt()["truncation"] == 50  # (the room kept)
    writer = ResponseWriter("j", "m", req, chat.tool_plan())
    assert writer.whole({"text": "Hello", "finish_reason": "stop", "usage": {}})["truncation"] == "auto"
    req, chat, job = parse_responses({"model": "m", "input": "Hi"})
    assert "truncation" not in job
    assert ResponseWriter("j", "m", req, None).whole({"text": "", "usage": {}})["truncation"] == "disabled"


@pytest.mark.parametrize(
    ("parser", "pieces", "reason"),
    [
        ("qwen3", ["<think>", "Let me add two and two.", "</think>", "\n\nIt is 4."], "stop"),
        ("deepseek_r1", ["Two and two, carried.", "</think>", "\n\nIt is 4."], "stop"),
        ("qwen3", ["<think>", "Still adding when the budget", " ran out"], "length"),
        ("qwen3", ["It is 4."], "stop"),
    ],
)
def test_reasoning_tokens_are_the_thinkings_whole_and_streamed(smol_tokenizer, parser, pieces, reason):
    """usage.output_tokens_details.reasoning_tokens was 0 whatever the model thought: it counts the tokens between
    the thinking's markers now (vLLM's count), told by the tokenizer the worker wrote (here the default model's)."""
    from producer.token_names import TokenNames

    encoded = [smol_tokenizer.encode(piece, add_special_tokens=False) for piece in pieces]
    ids, text = [t for e in encoded for t in e], "".join(pieces)
    thought = [e for p, e in zip(pieces, encoded) if p not in ("<think>", "</think>")]
    expected = 0 if len(pieces) == 1 else sum(map(len, thought[: 1 if reason == "stop" else 2]))
    req, chat, _ = parse_responses({"model": "m", "input": "2+2?", "stream": True}, None, parser)
    usage = {"prompt_tokens": 3, "completion_tokens": len(ids)}
    names = TokenNames(smol_tokenizer)
    whole = ResponseWriter("j", "m", req, None, names=names, reasoning=chat.reasoning_plan()).whole(
        {"text": text, "token_ids": ids, "finish_reason": reason, "usage": usage}
    )
    assert whole["usage"]["output_tokens_details"] == {"reasoning_tokens": expected} and (expected > 0) == (
        len(pieces) > 1
    )
    writer = ResponseWriter("j", "m", req, None, names=names, reasoning=chat.reasoning_plan())
    events = writer.opening()
    for piece, piece_ids in zip(pieces, encoded):
        events += writer.piece(piece, {"text": piece, "token_ids": piece_ids})
    events += writer.closing(reason, usage)
    assert events[-1]["response"]["usage"] == whole["usage"]


def test_an_earlier_answers_refusal_goes_back_as_its_text_and_the_default_tool_choice_is_auto():
    """A refusal part sent back (OpenAI's output) was a 400 listing every shape the item was not; a response to a
    request without tool_choice said "none" where OpenAI says its default, "auto"."""
    refused = {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot help with that."}]}
    req, _, job = parse_responses({"model": "m", "input": [refused, {"role": "user", "content": "Why?"}]})
    words = [{"type": "text", "text": "I cannot help with that."}]
    assert job["messages"][0] == {"role": "assistant", "content": words}
    assert ResponseWriter("j", "m", req, None).whole({"text": "", "usage": {}})["tool_choice"] == "auto"
