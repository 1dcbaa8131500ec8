"""A reasoning model's thinking told from its answer (--reasoning-parser): whole and streamed alike, in chat
answers beside tool calls, and sent back in a conversation (the server's streams are in test_server_streams.py)."""

from __future__ import annotations

import json
import random

import pytest

from producer.openai_api import APIError, ChatCompletionRequest, chat_choices, parse
from producer.reasoning import FORMATS
from producer.schema import JobRequest

THOUGHT = "<think>\nThe user wants 2+2. That is 4.\n</think>\n\nIt is 4."
# Each format's outputs: (text, its reasoning, its answer).
OUTPUTS = {
    "deepseek_r1": [
        (THOUGHT, "\nThe user wants 2+2. That is 4.\n", "\n\nIt is 4."),
        ("The template opened it. 4.</think>It is 4.", "The template opened it. 4.", "It is 4."),
        ("<think>Still thinking when the length ran out", "Still thinking when the length ran out", None),
        ("No markers at all", "No markers at all", None),  # (thinking cut short: no answer yet)
        ("  <think></think>Fast.", "", "Fast."),
        ("<thi", "<thi", None),
        ("", None, ""),
    ],
    "qwen3": [
        (THOUGHT, "\nThe user wants 2+2. That is 4.\n", "\n\nIt is 4."),
        ("It is 4.", None, "It is 4."),  # (enable_thinking false: no <think> in the output)
        ("  It is 4. A </think> later is text", None, "  It is 4. A </think> later is text"),
        ("<think>Still thinking", "Still thinking", None),
        ("<thi", None, "<thi"),
        (" \n", None, " \n"),
        ("<think>a</think>", "a", None),
    ],
    "mistral": [
        ("[THINK]Two and two.[/THINK]It is 4.", "Two and two.", "It is 4."),
        ("It is 4. <think>x</think>", None, "It is 4. <think>x</think>"),  # (not its markers)
        ("[THINK]Still", "Still", None),
        ("[THI", None, "[THI"),
    ],
}


@pytest.mark.parametrize(("parser", "text", "reasoning", "answer"), [(p, *c) for p, cs in OUTPUTS.items() for c in cs])
def test_each_format_tells_the_thinking_from_the_answer(parser, text, reasoning, answer):
    assert FORMATS[parser].split(text) == (reasoning, answer)


@pytest.mark.parametrize("size", [1, 2, 3, 5, 1000])
@pytest.mark.parametrize("parser", list(OUTPUTS))
def test_streamed_in_any_pieces_is_the_whole_outputs_thinking_and_answer(parser, size):
    fmt = FORMATS[parser]
    for text, _, _ in OUTPUTS[parser]:
        stream = fmt.stream()
        reasoning, answer = "", ""
        for i in range(0, len(text), size):
            more_reasoning, more_answer = stream.feed(text[i : i + size])
            assert fmt.end not in more_reasoning and fmt.start not in more_reasoning  # (no marker leaks)
            reasoning, answer = reasoning + more_reasoning, answer + more_answer
        more_reasoning, more_answer = stream.finish()
        whole = fmt.split(text)
        assert (reasoning + more_reasoning, answer + more_answer) == (whole[0] or "", whole[1] or "")


def _chat(parser: str | None = "qwen3", tool_parser: str | None = None, **body):
    body = {"model": "m", "messages": [{"role": "user", "content": "2+2?"}], **body}
    return parse(ChatCompletionRequest, body, tool_parser, parser)[0]


def test_a_chat_answer_has_its_thinking_in_reasoning_and_its_older_name_and_only_with_a_parser():
    [choice] = chat_choices({"text": THOUGHT, "finish_reason": "stop"}, _chat())
    message = choice["message"]
    assert message["content"] == "\n\nIt is 4." and message["reasoning"] == "\nThe user wants 2+2. That is 4.\n"
    assert message["reasoning_content"] == message["reasoning"]  # (the name clients of older servers read)
    [choice] = chat_choices({"text": THOUGHT, "finish_reason": "stop"}, _chat(None))
    assert choice["message"] == {"role": "assistant", "content": THOUGHT}
    [choice] = chat_choices({"text": "It is 4.", "finish_reason": "stop"}, _chat())
    assert choice["message"] == {"role": "assistant", "content": "It is 4."}  # (no thinking: no field)
    [choice] = chat_choices({"text": "<think>Hmm, 2 and", "finish_reason": "length"}, _chat())
    assert choice["message"]["content"] is None and choice["message"]["reasoning"] == "Hmm, 2 and"


def test_thinking_then_a_tool_call_reads_both():
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    text = '<think>I should add.</think>\n\n<tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call>'
    [choice] = chat_choices({"text": text, "finish_reason": "stop"}, _chat("qwen3", "hermes", tools=tools))
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning"] == "I should add."
    assert choice["message"]["content"] is None
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"a": 2, "b": 2}


def test_a_job_keeps_the_markers_where_they_are_special_tokens():
    """Magistral's [THINK] is a special token: its job keeps special tokens in its text (as vLLM's mistral parser
    asks), unless the request says otherwise; <think> is plain text to Qwen3's and DeepSeek's tokenizers."""
    body = {"model": "m", "messages": [{"role": "user", "content": "2+2?"}]}
    assert parse(ChatCompletionRequest, body, None, "mistral")[1]["skip_special_tokens"] is False
    assert "skip_special_tokens" not in parse(ChatCompletionRequest, body, None, "qwen3")[1]
    asked = {**body, "skip_special_tokens": True}
    assert parse(ChatCompletionRequest, asked, None, "mistral")[1]["skip_special_tokens"] is True


ASKED = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


def test_a_constrained_output_thinks_first_where_its_constraint_is_json_or_a_choice():
    """With a parser, a JSON schema, any object, a choice or a forced tool call lets the model think first: the job
    asks for it (``thinking``: "first" for deepseek_r1, "optional" for qwen3), and the answer is read after it. A
    regex or a grammar, or markers that are special tokens (mistral), constrain from the first token: no thinking."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    thinks = [
        ({"response_format": {"type": "json_object"}}, "json"),
        ({"structured_outputs": {"choice": ["a", "b"]}}, "choice"),
        ({"tools": tools, "tool_choice": "required"}, "json"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}},
         "json"),
    ]  # fmt: skip
    for body, kind in thinks:
        for parser, thinking in (("deepseek_r1", "first"), ("qwen3", "optional")):
            request, fields = parse(ChatCompletionRequest, {**ASKED, **body}, None, parser)
            assert request.constraint() == kind and request.reasoning_plan() is FORMATS[parser]
            assert fields["thinking"] == thinking
            assert JobRequest.model_validate(fields).structured_form()["thinking"] == thinking  # (the engine's)
    for body, parser in (
        ({"structured_outputs": {"regex": "[0-9]+"}}, "deepseek_r1"),
        ({"structured_outputs": {"grammar": 'start: "x"'}}, "qwen3"),
        ({"response_format": {"type": "json_object"}}, "mistral"),
        ({"response_format": {"type": "json_object"}}, None),
    ):
        request, fields = parse(ChatCompletionRequest, {**ASKED, **body}, None, parser)
        assert request.reasoning_plan() is None and "thinking" not in fields
    assert _chat("deepseek_r1", response_format={"type": "text"}).constraint() is None
    request = _chat("deepseek_r1", response_format={"type": "json_object"})
    [choice] = chat_choices({"text": '<think>An object.</think>{"a": 1}', "finish_reason": "stop"}, request)
    assert choice["message"] == {"role": "assistant", "content": '{"a": 1}', "reasoning": "An object.",
                                 "reasoning_content": "An object."}  # fmt: skip
    named = _chat("qwen3", tools=tools, tool_choice={"type": "function", "function": {"name": "add"}})
    [choice] = chat_choices({"text": '<think>Add them.</think>{"a": 2}', "finish_reason": "stop"}, named)
    assert choice["message"]["reasoning"] == "Add them." and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2}'}
    with pytest.raises(ValueError, match="thinking says where a constraint begins"):
        JobRequest.model_validate({"prompt": "x", "thinking": "first"})
    with pytest.raises(ValueError, match="thinking says where a constraint begins"):
        JobRequest.model_validate({"prompt": "x", "thinking": "first", "structured_outputs": {"regex": "a"}})


def test_thinking_sent_back_reaches_the_template_under_both_names():
    """An assistant's earlier thinking, sent back as vLLM's ``reasoning`` or its older ``reasoning_content`` (what
    the official client dumps of an answer has both), is the job's ``reasoning`` and the template's
    ``reasoning_content`` (Qwen3's and DeepSeek's templates read it) and ``reasoning``."""
    answer = {"role": "assistant", "content": "It is 4.", "reasoning": "2+2", "reasoning_content": "2+2"}
    for sent in (answer, {**answer, "reasoning": None}, {**answer, "reasoning_content": None}):
        messages = [{"role": "user", "content": "2+2?"}, sent, {"role": "user", "content": "And 3+3?"}]
        _, fields = parse(ChatCompletionRequest, {"model": "m", "messages": messages})
        assert fields["messages"][1] == {"role": "assistant", "content": "It is 4.", "reasoning": "2+2"}
        [_, shown, _] = JobRequest.model_validate(fields).engine_prompt()["messages"]
        assert shown["reasoning"] == shown["reasoning_content"] == "2+2"
    thinking_alone = {"role": "assistant", "content": None, "reasoning": "2+2"}
    _, fields = parse(ChatCompletionRequest, {"model": "m", "messages": [thinking_alone]})
    assert fields["messages"][0] == {"role": "assistant", "content": "", "reasoning": "2+2"}
    for bad, match in (
        ({**answer, "reasoning_content": "other"}, "differ"),
        ({"role": "user", "content": "hi", "reasoning": "x"}, "only an assistant message carries reasoning"),
        ({"role": "user", "content": None, "reasoning": "x"}, "content is required"),
    ):
        with pytest.raises(APIError, match=match):
            parse(ChatCompletionRequest, {"model": "m", "messages": [bad]})
    with pytest.raises(ValueError, match="lone surrogate"):  # (the template reads it: checked as the content is)
        JobRequest.model_validate({"messages": [{"role": "assistant", "content": "a", "reasoning": "\udce9"}]})


@pytest.mark.parametrize("parser", list(OUTPUTS))
def test_any_output_streamed_in_any_pieces_splits_as_the_whole_one(parser):
    """Random outputs of markers, pieces of markers, text and white space (seeded), streamed in random pieces."""
    atoms = ["<think>", "</think>", "[THINK]", "[/THINK]", "<thi", "nk>", "</", "[", "]", " ", "\n", "x", "It is 4."]
    rng, fmt = random.Random(3), FORMATS[parser]
    for _ in range(2000):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 8)))
        stream, size = fmt.stream(), rng.randint(1, 5)
        pieces = [stream.feed(text[i : i + size]) for i in range(0, len(text), size)] + [stream.finish()]
        whole = fmt.split(text)
        assert ("".join(p[0] for p in pieces), "".join(p[1] for p in pieces)) == (whole[0] or "", whole[1] or "")


def test_reasoning_effort_is_the_templates_as_vllm_gives_it():
    body = {"model": "m", "messages": [{"role": "user", "content": "2+2?"}], "reasoning_effort": "low"}
    assert parse(ChatCompletionRequest, body)[1]["chat_template_kwargs"] == {"reasoning_effort": "low"}
    both = {**body, "chat_template_kwargs": {"reasoning_effort": "high", "enable_thinking": True}}
    assert parse(ChatCompletionRequest, both)[1]["chat_template_kwargs"] == {"reasoning_effort": "high",
                                                                             "enable_thinking": True}  # fmt: skip
    with pytest.raises(APIError, match="reasoning_effort"):
        parse(ChatCompletionRequest, {**body, "reasoning_effort": "extreme"})


def test_a_template_told_not_to_think_has_no_thinking_to_tell():
    """Qwen3 with ``enable_thinking: false`` (DeepSeek V3.1's ``thinking: false``): the template closes the
    thinking in the prompt, so the answer is all content and a constraint holds from the first token."""
    for kwargs in ({"enable_thinking": False}, {"thinking": False}):
        body = {**ASKED, "chat_template_kwargs": kwargs, "response_format": {"type": "json_object"}}
        request, fields = parse(ChatCompletionRequest, body, None, "deepseek_r1")
        assert request.reasoning_plan() is None and "thinking" not in fields
        [choice] = chat_choices({"text": '{"a": 1}', "finish_reason": "stop"}, request)
        assert choice["message"] == {"role": "assistant", "content": '{"a": 1}'}
    request, _ = parse(
        ChatCompletionRequest, {**ASKED, "chat_template_kwargs": {"enable_thinking": True}}, None, "qwen3"
    )
    assert request.reasoning_plan() is FORMATS["qwen3"]


@pytest.mark.parametrize(
    ("tail", "asked", "used"),
    [
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "first", None),  # (closed in the prompt)
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "optional", None),
        ("<|Assistant|><think>\n", "optional", "first"),  # (opened in the prompt: it thinks first)
        ("<|im_start|>assistant\n", "optional", "optional"),
        ("<|im_start|>assistant\n", "first", "first"),
    ],
)
def test_the_engine_reads_where_the_prompt_left_the_thinking(tail, asked, used):
    from roseinfer.llm_engine import _thinking_after
    from roseinfer.sampling_params import StructuredOutputsParams

    assert _thinking_after(StructuredOutputsParams(json_object=True, thinking=asked), tail).thinking == used


def test_include_reasoning_false_leaves_the_thinking_out_but_still_tells_it_apart():
    """vLLM's ``include_reasoning``: false gives the answer alone, whole and streamed (and in batch lines)."""
    from producer.openai_api import ChunkWriter

    request = _chat(include_reasoning=False)
    assert "include_reasoning" not in parse(ChatCompletionRequest, {**ASKED, "include_reasoning": False})[1]
    [choice] = chat_choices({"text": THOUGHT, "finish_reason": "stop"}, request)
    assert choice["message"] == {"role": "assistant", "content": "\n\nIt is 4."}
    writer = ChunkWriter("j", "m", chat=True, reasoning=request.reasoning_plan(), include_reasoning=False)
    chunks = [writer.piece("", first=True), *(writer.piece(c) for c in THOUGHT[:-1]), writer.piece(THOUGHT[-1], "stop")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c is not None]
    assert "".join(d.get("content") or "" for d in deltas) == "\n\nIt is 4."
    assert not any("reasoning" in d for d in deltas)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("<think>a</think>", "stop"),  # thinking, then an empty answer: a call of no arguments (it streamed none)
        ("", "stop"),  # no output at all: an empty answer, the same (streamed, none)
        ("<think>still thinking when cut", "length"),  # cut short in its thinking: no answer, no call
        ('<think>a</think>{"city": "Oslo"}', "stop"),
    ],
)
def test_a_named_functions_call_streams_after_the_thinking_as_the_whole_message_has_it(text, reason):
    """Its call (empty arguments) went out in the first chunk, before any thinking: an output that was thinking
    alone streamed a call the whole message does not have, and a call's delta came before the reasoning ones."""
    from producer.openai_api import ChunkWriter

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    request = _chat(tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [whole] = chat_choices({"text": text, "finish_reason": reason}, request)
    for size in (1, 3, max(len(text), 1)):
        writer = ChunkWriter("j", "m", chat=True, tools=request.tool_plan(), reasoning=request.reasoning_plan())
        pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]  # (the end comes in a piece)
        chunks = [writer.piece("", first=True)]
        chunks += [writer.piece(p, reason if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)]
        deltas = [c["choices"][0]["delta"] for c in chunks if c is not None]
        calls = [call for d in deltas for call in d.get("tool_calls") or ()]
        expected = whole["message"].get("tool_calls") or []
        assert [c["function"]["name"] for c in calls if "id" in c] == [c["function"]["name"] for c in expected]
        assert "".join(c["function"].get("arguments", "") for c in calls) == "".join(
            c["function"]["arguments"] for c in expected
        )
        first_call = next((i for i, d in enumerate(deltas) if d.get("tool_calls")), len(deltas))
        assert all("reasoning" not in d for d in deltas[first_call + 1 :])  # the thinking came first
    assert bool(whole["message"].get("tool_calls")) == (reason == "stop")


def test_an_empty_thought_is_no_reasoning_field_whole_as_streamed():
    """``<think></think>`` gave the whole message ``reasoning: ""``, its stream none (Responses' rule: none)."""
    from producer.openai_api import ChunkWriter

    request = _chat()
    for text in ("<think></think>Fast.", "<think></think>"):
        [whole] = chat_choices({"text": text, "finish_reason": "stop"}, request)
        writer = ChunkWriter("j", "m", chat=True, reasoning=request.reasoning_plan())
        chunks = [writer.piece("", first=True), writer.piece(text, "stop")]
        deltas = [c["choices"][0]["delta"] for c in chunks if c is not None]
        assert "reasoning" not in whole["message"] and not any("reasoning" in d for d in deltas), text
