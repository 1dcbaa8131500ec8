"""Bad requests are refused at submission with a clear error; the engine keeps serving the others."""

import copy
import itertools
import json

import pytest

from roseinfer import LLM, EngineConfig, SamplingParams
from roseinfer.models import SUPPORTED_MODEL_TYPES, UnsupportedModelError


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, dtype="float32", max_model_len=64)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": list(range(64))}, "at most 63 prompt tokens"),
        ({"prompt_token_ids": [1, 999]}, r"\[0, 256\)"),
        ({"prompt_token_ids": [1, -1]}, r"\[0, 256\)"),
        ("text prompt", "no tokenizer"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no chat template"),
        ({"prompt": [1], "extra": 2}, "exactly one of"),
        ({"prompt": [1, 2, 3]}, "'prompt' is a string, not list"),  # (ran as ids)
        ({"prompt_token_ids": "1, 2, 3"}, "'prompt_token_ids' is a list of token ids, not str"),  # (encoded)
        ({"prompt_token_ids": "hi", "prompt": "hello"}, "not str"),
        (3.5, "a prompt is a string"),
    ],
)
def test_bad_prompts(llm, prompt, message):
    with pytest.raises((ValueError, TypeError), match=message):
        llm.engine.add_request("bad", prompt, SamplingParams())
    assert not llm.engine.has_unfinished_requests()


def test_duplicate_id_and_abort(llm):
    e = llm.engine
    e.add_request("x", [1, 2, 3], SamplingParams(max_tokens=50, temperature=0))
    with pytest.raises(ValueError, match="already in use"):
        e.add_request("x", [1, 2, 3])
    e.step()
    [out] = e.abort_request("x")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert e.abort_request("x") == [] and e.kv.num_used_blocks == 0
    # An int id went in, and could never be aborted (abort_request(7) read it as a list of ids; "7" is another id).
    with pytest.raises(TypeError, match="request_id must be a string, got int"):
        e.add_request(7, [1, 2, 3])
    assert not e.has_unfinished_requests()
    # A list holding a bad id is refused whole: "y" was aborted, then its final output lost to the raise at 7.
    e.add_request("y", [1, 2, 3], SamplingParams(max_tokens=50, temperature=0))
    for bad in (["y", 7], 7, None, b"y"):
        with pytest.raises(TypeError, match="a request id is a string, got"):
            e.abort_request(bad)
    assert e.scheduler.get("y") is not None and [o.finished for o in e.abort_request(["y"])] == [True]


def test_generation_stops_at_the_context_length(llm):
    out = llm.generate([list(range(1, 60))], SamplingParams(max_tokens=None, temperature=0), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 5


def test_a_max_tokens_past_the_context_is_cut_or_refused_as_the_request_asks(llm):
    """``context_overflow="cut"`` (the default, vLLM's offline LLM) generates up to the context; "error" refuses
    the request with vLLM's server's words, and a request that fits runs either way."""
    prompt = list(range(1, 60))  # 59 tokens of 64: 5 left
    cut = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert cut.outputs[0].finish_reason == "length" and len(cut.outputs[0].token_ids) == 5
    with pytest.raises(ValueError, match=r"maximum context length is 64 tokens.*59 input tokens plus 6 'max_tokens'"):
        llm.engine.add_request("past", prompt, SamplingParams(max_tokens=6, context_overflow="error"))
    assert not llm.engine.has_unfinished_requests()
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, context_overflow="error")
    fits = llm.generate([prompt], params, use_tqdm=False)[0]
    assert fits.outputs[0].token_ids == cut.outputs[0].token_ids
    with pytest.raises(ValueError, match="context_overflow must be 'cut' or 'error'"):
        SamplingParams(context_overflow="truncate")


def test_bad_engine_options():
    for kwargs, msg in [
        ({"dtype": "int8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"kv_cache_memory": "lots"}, "size"),
        ({"dtype": "float16"}, "GPUs"),
    ]:
        with pytest.raises(ValueError, match=msg):
            EngineConfig(**kwargs)


def test_a_max_model_len_past_the_models_context_is_refused_before_its_weights_load(tiny_llama, monkeypatch):
    """It was cut to the model's 512 without a word (vLLM refuses it), then said once the weights had loaded (minutes
    of a large model's); the model's own is taken where none is given."""
    from roseinfer import llm_engine
    from roseinfer.config import ConfigError

    def no_weights(*args):
        raise AssertionError("the weights were read")

    with monkeypatch.context() as patch:
        patch.setattr(llm_engine, "build_model", no_weights)
        with pytest.raises(ConfigError, match="max_model_len 4096 is past this model's context, 512 tokens"):
            LLM(tiny_llama, dtype="float32", max_model_len=4096)
    assert LLM(tiny_llama, dtype="float32").engine.max_model_len == 512


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    from transformers import BertConfig

    BertConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16
    ).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match=r"roseinfer runs llama, mistral, qwen2, .*, gemma3, gpt2") as err:
        LLM(str(tmp_path))
    assert all(name in str(err.value) for name in SUPPORTED_MODEL_TYPES)


def test_a_checkpoint_that_does_not_generate_text_is_refused(tmp_path):
    """A reward model (LlamaForSequenceClassification, tied: its embeddings stood in for the missing output layer)
    loaded, and generated text from a classifier."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from roseinfer.config import ConfigError

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)  # fmt: skip
    LlamaForSequenceClassification(config).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="LlamaForSequenceClassification does not generate text"):
        LLM(str(tmp_path))


def test_an_unsupported_gguf_is_refused_before_it_is_converted(tmp_path, monkeypatch):
    """From its metadata: converting it first (minutes and gigabytes for a large one) left a folder in the cache."""
    import gguf
    import numpy as np

    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny-stablelm.gguf"
    writer = gguf.GGUFWriter(str(path), "stablelm")
    for add, value in [("add_context_length", 64), ("add_embedding_length", 16), ("add_block_count", 1),
                       ("add_feed_forward_length", 32), ("add_head_count", 2), ("add_head_count_kv", 1),
                       ("add_layer_norm_rms_eps", 1e-6), ("add_rope_freq_base", 10000.0)]:  # fmt: skip
        getattr(writer, add)(value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "c", "ab"])
    writer.add_token_merges(["a b"])
    writer.add_tensor("token_embd.weight", np.zeros((4, 16), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="'stablelm' is not supported"):
        LLM(str(path))
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


@pytest.fixture(scope="module")
def chat_engine(tiny_chat_model):
    """One engine for the tests below: each runs its requests to their end (building one takes a second)."""
    return LLM(tiny_chat_model, dtype="float32").engine


def test_tokenize_many_is_tokenize_of_each_prompt_in_one_batch(chat_engine):
    engine = chat_engine
    chat = {"messages": [{"role": "user", "content": "What is the capital of France?"}]}
    prompts = [
        "Once upon a time",
        chat,
        {"prompt": "hello there"},
        [5, 6, 7],
        "",  # refused: empty
        {"messages": []},  # refused: no messages
        {"messages": [{"role": "user", "content": "Tell me a story."}]},
    ]
    got = engine.tokenize_many(prompts)
    for prompt, found in zip(prompts, got):
        try:
            expected = engine.tokenize(prompt)
        except ValueError as exc:
            assert isinstance(found, ValueError) and str(found) == str(exc)
        else:
            assert found == expected
    # A backend left truncating (transformers' own call turns that off): the whole prompt all the same.
    tokenizer = copy.deepcopy(engine.tokenizer)
    tokenizer.backend_tokenizer.enable_truncation(3)
    long = "Once upon a time there was a cat"
    assert engine.tokenize_many([long], tokenizer) == [engine.tokenize(long)] and len(engine.tokenize(long)[1]) > 3
    # Chats render in one call; a template that refuses one of them fails that one alone.
    strict = copy.deepcopy(engine.tokenizer)
    strict.chat_template = (
        "{% for m in messages %}{% if m.role == 'robot' %}{{ raise_exception('no robots here') }}{% endif %}"
        + engine.tokenizer.chat_template
        + "{% endfor %}"
    )
    robot = {"messages": [{"role": "robot", "content": "beep"}]}
    got = engine.tokenize_many([chat, robot, prompts[-1]], strict)
    assert "no robots here" in str(got[1])
    for prompt, found in zip([chat, prompts[-1]], [got[0], got[2]]):
        text = strict.apply_chat_template(prompt["messages"], add_generation_prompt=True, tokenize=False)
        assert found == (None, strict(text, add_special_tokens=False)["input_ids"])


def test_a_messages_name_reaches_the_chat_template_from_a_job_and_from_the_server(chat_engine):
    """vLLM gives a message's ``name`` to the chat template: a template that shows names shows it, from a job's
    payload and from an OpenAI request alike; a message without one has no ``name`` key (``is defined`` false)."""
    from producer.openai_api import ChatCompletionRequest, parse
    from producer.schema import JobRequest

    named = copy.deepcopy(chat_engine.tokenizer)
    named.chat_template = (
        "{% for m in messages %}{{ m.role }}{% if m.name is defined %} ({{ m.name }}){% endif %}: {{ m.content }}\n"
        "{% endfor %}"
    )
    messages = [{"role": "user", "content": "hi", "name": "ann"}, {"role": "assistant", "content": "hello"}]
    expected = named("user (ann): hi\nassistant: hello\n", add_special_tokens=False)["input_ids"]
    _, fields = parse(ChatCompletionRequest, {"model": "m", "messages": messages})
    for prompt in (JobRequest.model_validate({"messages": messages}).engine_prompt(), {"messages": fields["messages"]}):
        assert prompt["messages"] == messages
        assert chat_engine.tokenize(prompt, named)[1] == expected
        assert chat_engine.tokenize_many([prompt], named) == [(None, expected)]
    with pytest.raises(ValueError, match="'name' must be a string"):
        chat_engine.tokenize({"messages": [{"role": "user", "content": "hi", "name": 5}]}, named)
    with pytest.raises(ValueError, match="lone surrogate"):  # refused at submission, as such a content is
        JobRequest.model_validate({"messages": [{"role": "user", "content": "hi", "name": "ann\udce9"}]})


def test_a_developer_message_is_a_system_one_where_the_template_does_not_know_the_role(chat_engine):
    """OpenAI's "developer" role stands for the system's instructions. A template that knows only system, user and
    assistant (as Qwen's, which left the message out without a word) gets it as system; one that names the role
    gets it as it is. The engine's tokenizing, one prompt or many, and the server's and the batch's counts agree."""
    from producer.batch import count_prompt_tokens
    from producer.chat_render import template_messages
    from producer.schema import JobRequest

    plain = copy.deepcopy(chat_engine.tokenizer)
    plain.chat_template = (
        "{% for m in messages %}{% if m.role in ['system', 'user', 'assistant'] %}{{ m.role }}: {{ m.content }}\n"
        "{% endif %}{% endfor %}"
    )
    knows = copy.deepcopy(plain)
    knows.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{# developer too #}"
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    job = JobRequest.model_validate({"messages": messages})
    for tokenizer, shown in ((plain, "system"), (knows, "developer")):
        expected = tokenizer(f"{shown}: Be brief.\nuser: hi\n", add_special_tokens=False)["input_ids"]
        assert chat_engine.tokenize({"messages": messages}, tokenizer)[1] == expected
        assert chat_engine.tokenize_many([{"messages": messages}], tokenizer) == [(None, expected)]
        assert template_messages(tokenizer, job)[0]["role"] == shown
        assert count_prompt_tokens(tokenizer, {"messages": messages}) == len(expected)


def test_tools_and_tool_calls_reach_a_chat_template_that_shows_them(chat_engine):
    """A template that shows tools (as Qwen's and Hermes' do) gets a job's tools, its assistant's calls with their
    arguments as objects, and the tool's answer, from a job's payload and from an OpenAI request alike; in a batch
    beside chats without tools, each renders as alone."""
    from producer.openai_api import ChatCompletionRequest, parse
    from producer.schema import JobRequest

    shows = copy.deepcopy(chat_engine.tokenizer)
    shows.chat_template = (
        "{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\\n' }}{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %}[{{ c.function.name }} city={{ c.function.arguments.city }}]{% endfor %}"
        "{% if m.tool_call_id is defined %} (to {{ m.tool_call_id }}){% endif %}{{ '\\n' }}{% endfor %}"
    )
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "Rain", "tool_call_id": "c1"},
    ]
    text = "tools: get_weather\nuser: Weather?\nassistant: [get_weather city=Oslo]\ntool: Rain (to c1)\n"
    expected = shows(text, add_special_tokens=False)["input_ids"]
    _, fields = parse(
        ChatCompletionRequest, {"model": "m", "messages": messages, "tools": tools, "tool_choice": "none"}
    )
    plain = {"messages": [{"role": "user", "content": "Weather?"}]}
    payload = {"messages": [messages[0], {**messages[1], "content": ""}, messages[2]], "tools": tools}
    for job in (fields, payload):
        prompt = JobRequest.model_validate(job).engine_prompt()
        assert chat_engine.tokenize(prompt, shows)[1] == expected
        got = chat_engine.tokenize_many([plain, prompt, plain], shows)
        assert got[1] == (None, expected)
        assert got[0] == got[2] == chat_engine.tokenize(plain, shows)
    # The engine's own chats (LLM.chat, a {"messages"} prompt) in OpenAI's form, arguments as JSON text: the
    # template got the text, its ``arguments.city`` nothing (and a ``tojson`` a quoted, escaped string).
    direct = {"messages": [messages[0], {**messages[1], "content": ""}, messages[2]], "tools": tools}
    assert chat_engine.tokenize(direct, shows)[1] == expected
    assert chat_engine.tokenize_many([plain, direct], shows)[1] == (None, expected)
    with pytest.raises(ValueError, match="'messages' with the template's options"):
        chat_engine.tokenize({"prompt": "x", "tools": tools})


def test_an_assistants_thinking_sent_back_reaches_a_template_that_shows_it(chat_engine):
    """Qwen3's template shows an earlier answer's reasoning_content inside <think>: a request's ``reasoning`` (or
    its older name) renders there, through the job's payload."""
    from producer.openai_api import ChatCompletionRequest, parse
    from producer.schema import JobRequest

    shows = copy.deepcopy(chat_engine.tokenizer)
    shows.chat_template = (
        "{% for m in messages %}{{ m.role }}: {% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>"
        "{% endif %}{{ m.content }}{{ '\\n' }}{% endfor %}"
    )
    expected = shows("user: 2+2?\nassistant: <think>Two and two.</think>4\n", add_special_tokens=False)["input_ids"]
    for name in ("reasoning", "reasoning_content"):
        answer = {"role": "assistant", "content": "4", name: "Two and two."}
        body = {"model": "m", "messages": [{"role": "user", "content": "2+2?"}, answer]}
        _, fields = parse(ChatCompletionRequest, body)
        prompt = JobRequest.model_validate({**fields, "add_generation_prompt": False}).engine_prompt()
        assert chat_engine.tokenize(prompt, shows)[1] == expected


def test_the_chat_templates_options_from_a_job_and_from_the_server_are_the_templates_own(chat_engine):
    """vLLM's chat options: the last message continued (no new turn opened, its end left open), no generation
    prompt, and the template's own variables (``chat_template_kwargs``); from a job's payload, from an OpenAI
    request and given to the engine, each renders as the tokenizer's own call does, alone or in a batch."""
    from producer.openai_api import ChatCompletionRequest, parse
    from producer.schema import JobRequest

    tokenizer = copy.deepcopy(chat_engine.tokenizer)
    tokenizer.chat_template = "{% if brief %}Be brief. {% endif %}" + tokenizer.chat_template
    messages = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]
    cases = [
        ({"continue_final_message": True}, {"continue_final_message": True, "add_generation_prompt": False}),
        ({"continue_final_message": True, "add_generation_prompt": False}, {"continue_final_message": True}),
        ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
        ({"chat_template_kwargs": {"brief": True}}, {"brief": True, "add_generation_prompt": True}),
        ({}, {"add_generation_prompt": True}),
    ]
    plain = {"messages": messages[:1]}
    seen = set()
    for options, call in cases:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **call)
        expected = tokenizer(text, add_special_tokens=False)["input_ids"]
        seen.add(tuple(expected))
        _, fields = parse(ChatCompletionRequest, {"model": "m", "messages": messages, **options})
        for prompt in (JobRequest.model_validate(fields).engine_prompt(), {"messages": messages, **options}):
            assert chat_engine.tokenize(prompt, tokenizer)[1] == expected, options
            assert chat_engine.tokenize_many([plain, prompt], tokenizer)[1] == (None, expected), options
    assert len(seen) == 4  # (each option renders its own prompt: the first two are one)
    with pytest.raises(ValueError, match="not both"):
        chat_engine.tokenize({"messages": messages, "continue_final_message": True, "add_generation_prompt": True})
    with pytest.raises(ValueError, match="not both"):
        JobRequest.model_validate({"messages": messages, "continue_final_message": True, "add_generation_prompt": True})
    # The call's own arguments are not the template's variables: a template of the request's choosing never runs.
    evil = {"chat_template": "{{ raise_exception('ran') }}"}
    with pytest.raises(ValueError, match="may not set chat_template"):
        chat_engine.tokenize({"messages": messages, "chat_template_kwargs": evil})
    with pytest.raises(ValueError, match="may not set chat_template"):
        JobRequest.model_validate({"messages": messages, "chat_template_kwargs": evil})
    with pytest.raises(ValueError, match="continue_final_message: for the chat template, so with messages"):
        JobRequest.model_validate({"prompt": "x", "continue_final_message": True})


def test_text_no_tokenizer_can_encode_fails_its_own_prompt_not_the_batch_and_is_refused_at_submission(chat_engine):
    """A lone surrogate (text that was not UTF-8) in any string a chat template shows: the job is refused where it
    is submitted, naming where; and given to the engine anyway, only its prompt fails, not the others tokenized in
    the same batch."""
    from producer.schema import JobRequest

    shows = copy.deepcopy(chat_engine.tokenizer)
    shows.chat_template = "{% for t in tools or [] %}{{ t.function.description }}{% endfor %}" + shows.chat_template
    tool = {"type": "function", "function": {"name": "f", "description": "a\udce9"}}
    user = {"role": "user", "content": "hi"}
    plain = {"messages": [user]}
    bad = {"messages": [user], "tools": [tool]}
    got = chat_engine.tokenize_many([plain, bad, "Once upon a time", "a\udce9", plain], shows)
    assert isinstance(got[1], ValueError) and isinstance(got[3], ValueError) and "cannot encode" in str(got[3])
    assert got[0] == got[4] == chat_engine.tokenize(plain, shows) and got[2] == chat_engine.tokenize("Once upon a time")
    call = {"id": "c\udce9", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    refused = [
        ({"messages": [user], "tools": [tool]}, "in its tools"),
        ({"messages": [user], "chat_template_kwargs": {"who": "\udce9"}}, "in its chat_template_kwargs"),
        ({"messages": [user, {"role": "assistant", "content": "", "tool_calls": [call]}]}, "in its messages"),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "\udce9"}]}, "in its messages"),
        ({"prompt": "a\udce9"}, "in its text"),
    ]
    for payload, where in refused:
        with pytest.raises(ValueError, match=f"not valid Unicode: a lone surrogate .* {where}"):
            JobRequest.model_validate(payload)
    # What the result echoes too: written as a \u escape of half a pair, which strict JSON readers (serde) refuse.
    for name, value in (("stop", ["\udc00"]), ("metadata", {"k": "\ud800"})):
        with pytest.raises(ValueError, match=f"{name} is not valid Unicode: a lone surrogate"):
            JobRequest.model_validate({"prompt": "hi", name: value})


def test_a_chat_templates_own_refusal_is_the_requests_fault(chat_engine):
    """A template's raise_exception ("roles must alternate", "System role not supported": Mistral's, Gemma's) came
    out as jinja2's TemplateError, no ValueError: the worker reported a server error with a traceback, the server a
    500. It is the request's fault, as vLLM answers it (400)."""
    from worker.pump import Pump

    refuses = copy.deepcopy(chat_engine.tokenizer)
    refuses.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        + refuses.chat_template
    )
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]}
    with pytest.raises(ValueError, match="chat template refuses these messages: System role not supported"):
        chat_engine.apply_chat_template(chat["messages"], refuses)
    [got] = chat_engine.tokenize_many([chat], refuses)
    assert isinstance(got, ValueError) and "System role not supported" in str(got)
    original, chat_engine.tokenizer = chat_engine.tokenizer, refuses
    try:
        pump = Pump(chat_engine, tokenize_in_thread=False)
        pump.submit("refused", chat, SamplingParams(max_tokens=2))
        [event] = [e for e in pump.step() if e.finished]
        assert (event.finish_reason, event.error_type) == ("error", "invalid_request")
    finally:
        chat_engine.tokenizer = original


def test_a_tokenizer_larger_than_the_models_vocabulary_fails_the_prompt_not_the_batch(tiny_llama, tiny_chat_model):
    """Text encoded to ids past the model's embedding table (a tokenizer of 49,152 tokens over a model of 256): ids
    given as a list were checked, encoded text was not, and the step failed for every request in it (a device
    assert on CUDA)."""
    engine = LLM(tiny_llama, tokenizer=tiny_chat_model, dtype="float32").engine
    with pytest.raises(ValueError, match=r"past the model's vocabulary \[0, 256\)"):
        engine.add_request("text", "Once upon a time there was a dragon", SamplingParams(max_tokens=2))
    engine.add_request("ids", [1, 2, 3], SamplingParams(max_tokens=2))
    outs = [o for _ in range(4) for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == ["ids"] and len(outs[0].outputs[0].token_ids) == 2


@pytest.mark.slow  # a second or more: the full suite's (the fast lane stays under a minute)
def test_an_operators_chat_template_replaces_the_models_and_a_bad_one_fails_the_start(tiny_chat_model, tmp_path):
    """vLLM's --chat-template: a Jinja file or the template's text, in place of the model's own; one that cannot be
    read or does not render fails the engine's start with the reason, not each chat job later."""
    from roseinfer.config import ConfigError

    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"
    (tmp_path / "chat.jinja").write_text(template)
    chat = {"messages": [{"role": "user", "content": "Hi there"}]}
    for given in (str(tmp_path / "chat.jinja"), template):
        engine = LLM(tiny_chat_model, dtype="float32", chat_template=given).engine
        expected = engine.tokenizer("[user] Hi there\n[assistant]", add_special_tokens=False)["input_ids"]
        assert engine.tokenize(chat)[1] == expected
        assert engine.tokenize_many([chat]) == [(None, expected)]
    bad = [
        (str(tmp_path / "missing.jinja"), "cannot read the chat template file"),
        ("{% for m in messages %}", "does not render a one-message chat"),
        ("{{ raise_exception('no chats here') }}", "no chats here"),
    ]
    for given, reason in bad:
        with pytest.raises(ConfigError, match=reason):
            LLM(tiny_chat_model, dtype="float32", chat_template=given)


HOLD = [c + "\x00\x01" for c in "abcdefghijklmnopqrstuvwxyz.,)"]


def _output_kind_cases(n: int) -> dict[str, tuple[str, SamplingParams]]:
    """Requests whose outputs the output kinds must agree on: greedy, n sampled samples, a stop string, one that
    the test aborts."""
    return {
        "plain": ("Tell me a story", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)),
        f"n{n}": ("Count to ten", SamplingParams(max_tokens=9, temperature=0.9, seed=5, n=n)),
        "stop": ("Say something", SamplingParams(max_tokens=40, temperature=0.8, seed=3, stop=["e"])),
        "aborted": ("Go on", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)),
        # Stop strings that never match but hold back most last letters: at the abort each sample has text unsent.
        "aborted-n": ("Go on", SamplingParams(max_tokens=40, temperature=0.9, seed=7, ignore_eos=True, n=n, stop=HOLD)),
    }


def _add_cases(engine, cases: dict[str, tuple[str, SamplingParams]], kind: str) -> None:
    """Every case as a request of output kind ``kind``, its id ``<kind>-<case>``."""
    import dataclasses

    for name, (prompt, params) in cases.items():
        engine.add_request(f"{kind}-{name}", prompt, dataclasses.replace(params, output_kind=kind))


def test_final_only_outputs_are_the_cumulative_ones_at_the_end_and_nothing_before(chat_engine):
    """output_kind="final_only" (vLLM's FINAL_ONLY): a step returns nothing for the request until it ends, then
    the same output a cumulative request ends with, for n samples, a stop string and an abort alike."""
    engine = chat_engine
    assert not engine.has_unfinished_requests()
    cases = _output_kind_cases(n=3)
    ended = {}
    for kind in ("cumulative", "final_only"):
        _add_cases(engine, cases, kind)
        steps = 0
        while engine.has_unfinished_requests():
            steps += 1
            for out in engine.step():
                assert kind == "cumulative" or out.finished, out.request_id
                if out.finished:
                    ended[out.request_id] = out
            if steps == 3:
                for name in ("aborted", "aborted-n"):
                    [ended[f"{kind}-{name}"]] = engine.abort_request(f"{kind}-{name}")
    for name in cases:
        a, b = ended[f"cumulative-{name}"], ended[f"final_only-{name}"]
        assert a.finished and b.finished and a.prompt_token_ids == b.prompt_token_ids
        assert [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in a.outputs] == [
            (c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in b.outputs
        ], name
    assert len(ended["final_only-n3"].outputs) == 3 and ended["final_only-stop"].outputs[0].finish_reason == "stop"
    for name in cases:  # its one output's delta is the whole of it, aborted too (an abort gave no delta ids)
        out = ended[f"final_only-{name}"]
        if len(out.outputs) == 1:
            assert (out.delta_text, out.delta_token_ids) == (out.outputs[0].text, out.outputs[0].token_ids), name
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="streaming")


@pytest.mark.parametrize("flush_every", [1, 3, 0], ids=["every step", "every 3rd step", "never"])
def test_delta_outputs_add_up_to_the_cumulative_output(chat_engine, flush_every):
    """output_kind="delta": each output holds only what is new; steps with flush=False give a running request
    none after its first, and what it added comes with the next flushed step, its end or its abort. The pieces
    add up to what a cumulative request ends with (text and token ids), for a stop string, n samples and an abort."""

    engine = chat_engine
    assert not engine.has_unfinished_requests()
    cases = _output_kind_cases(n=2)
    ended, pieces, running_outputs = {}, {}, {}
    for kind in ("cumulative", "delta"):
        _add_cases(engine, cases, kind)
        steps = 0
        while engine.has_unfinished_requests():
            steps += 1
            flush = kind == "cumulative" or (flush_every and steps % flush_every == 0)
            outs = engine.step(flush=flush)
            if steps == 5:
                outs += engine.abort_request(f"{kind}-aborted") + engine.abort_request(f"{kind}-aborted-n")
            for out in outs:
                text, ids = pieces.setdefault((out.request_id, out.delta_index), ("", []))
                pieces[out.request_id, out.delta_index] = (text + out.delta_text, ids + out.delta_token_ids)
                if out.finished:
                    ended[out.request_id] = out
                elif kind == "delta":
                    running_outputs[out.request_id] = running_outputs.get(out.request_id, 0) + 1
                    assert [(c.text, c.token_ids) for c in out.outputs] == [(out.delta_text, out.delta_token_ids)]
    for name in cases:
        a, b = ended[f"cumulative-{name}"], ended[f"delta-{name}"]
        assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in a.outputs] == [
            (c.index, c.text, c.token_ids, c.finish_reason) for c in b.outputs
        ], name
        for c in b.outputs:  # the final output is whole; the pieces streamed add up to it
            assert pieces[f"delta-{name}", c.index] == (c.text, c.token_ids), (name, c.index)
    plain = running_outputs["delta-plain"]  # 12 tokens: 11 running outputs at most, then the final one
    assert plain == {1: 11, 3: 1 + 10 // 3, 0: 1}[flush_every], plain
    if flush_every == 0:  # the first output only, until the end or the abort
        assert running_outputs["delta-aborted"] == 1 and running_outputs.get("delta-stop", 1) == 1


@pytest.mark.parametrize("overlap", [False, True], ids=["cpu", "gpu-overlap"])
def test_a_flushed_step_gives_the_delta_output_a_preempted_request_held(tiny_llama, overlap):
    """A "delta" request's tokens held by steps without flush came out only when it sampled again: preempted by a
    more urgent request, its text stayed in the engine through every flushed step of its wait."""
    engine = LLM(tiny_llama, dtype="float32", max_num_seqs=1).engine
    engine._overlap = overlap  # (a GPU's flow: a step's outputs made during the next)
    delta = SamplingParams(max_tokens=30, temperature=0.0, output_kind="delta")
    engine.add_request("bulk", {"prompt_token_ids": [1, 2, 3]}, delta)
    pieces: dict[str, list[int]] = {}

    def step(flush: bool) -> None:
        for out in engine.step(flush=flush):
            pieces.setdefault(out.request_id, []).extend(out.delta_token_ids)

    for i in range(5):
        step(flush=i == 0)
    assert len(pieces.get("bulk", [])) <= 1  # (4 tokens held)
    engine.add_request("urgent", {"prompt_token_ids": [4, 5, 6]}, delta, priority=-1)
    step(flush=False)  # (it takes the slot; on a GPU the last step's outputs are made now, held)
    step(flush=True)
    bulk = engine.scheduler.get("bulk")
    assert bulk.status.value == "waiting" and bulk.num_preemptions == 1
    assert pieces["bulk"] == bulk.output_token_ids  # its 5 tokens, while it waits
    while engine.has_unfinished_requests():
        step(flush=True)
    assert len(pieces["bulk"]) == 30 and len(pieces["urgent"]) == 30


@pytest.mark.parametrize("overlap", [False, True], ids=["cpu", "gpu-overlap"])
def test_held_delta_output_given_as_its_request_runs_again_keeps_its_logprobs_to_its_ids(tiny_llama, overlap):
    """Held through a preemption by steps without flush, a request's output is given at the flushed step that runs it
    again: on a GPU the one that sampled its next token, whose logprobs were then the pieces' last (one off)."""
    engine = LLM(tiny_llama, dtype="float32", max_num_seqs=1).engine
    engine._overlap = overlap
    bulk = SamplingParams(max_tokens=12, temperature=0.0, output_kind="delta", logprobs=1)
    engine.add_request("bulk", {"prompt_token_ids": [1, 2, 3]}, bulk)
    ids, logprobs, final = [], [], None

    def step(flush: bool) -> None:
        nonlocal final
        for out in engine.step(flush=flush):
            if out.request_id == "bulk" and out.finished:
                final = out.outputs[0]
            elif out.request_id == "bulk":
                ids.extend(out.delta_token_ids)
                logprobs.extend(out.outputs[0].logprobs)

    for i in range(4):
        step(flush=i == 0)
    urgent = SamplingParams(max_tokens=3, temperature=0.0, output_kind="delta")
    engine.add_request("urgent", {"prompt_token_ids": [4, 5, 6]}, urgent, priority=-1)
    while engine.scheduler.get("urgent") is not None:  # (all without flush: bulk's ids still held after)
        step(flush=False)
    assert engine.scheduler.get("bulk").held_ids
    while engine.has_unfinished_requests():
        step(flush=True)
    assert ids == final.token_ids[: len(ids)] and len(ids) >= 4
    assert logprobs == final.logprobs[: len(ids)]


def test_an_engine_raises_the_young_gc_threshold_and_never_lowers_it(tiny_llama):
    import gc

    from roseinfer.llm_engine import GC_YOUNG_THRESHOLD

    saved = gc.get_threshold()
    try:
        gc.set_threshold(700, *saved[1:])  # Python's default
        LLM(tiny_llama, dtype="float32", max_model_len=64)
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, *saved[1:])
        gc.set_threshold(50_000, *saved[1:])  # the application's own, higher
        LLM(tiny_llama, dtype="float32", max_model_len=64)
        assert gc.get_threshold()[0] == 50_000
    finally:
        gc.set_threshold(*saved)


@pytest.mark.slow
def test_a_process_that_built_an_engine_exits_without_nanobind_leak_lines(tiny_llama):
    """The engine freezes what is loaded (``gc.freeze``); frozen at exit, triton's objects (torch imports it)
    outlived the interpreter and every ``roseinfer`` command ended with dozens of "nanobind: leaked" lines."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    code = f"from roseinfer import LLM; LLM({tiny_llama!r}, dtype='float32', max_model_len=64); print('built')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "built", out.stderr[-2000:]
    assert "leaked" not in out.stderr, out.stderr[-2000:]


def test_the_auto_kv_cache_on_cpu_is_what_the_batch_can_use_at_most(tiny_llama):
    """ "auto" on CPU: 1 GiB, or what max_num_seqs requests at max_model_len fill, whichever is less (a tiny model
    is not handed a GiB to zero); a size given is taken as it is."""
    llm = LLM(tiny_llama, dtype="float32", max_model_len=60, max_num_seqs=4, block_size=8)
    engine = llm.engine
    assert engine.kv.num_blocks == 4 * 8  # 60 tokens: 8 blocks of 8 each, for each of 4 requests
    # Four requests at the full length run together, none preempted.
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": [i + 1] * 50} for i in range(4)], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [10] * 4 and engine.scheduler.num_preemptions == 0
    block_bytes = engine.attn_backend.kv_cache_bytes_per_block(
        engine.model.num_layers, engine.model.num_kv_heads, engine.model.head_dim
    )
    given = LLM(tiny_llama, dtype="float32", max_model_len=60, max_num_seqs=4, kv_cache_memory="8MiB").engine
    assert given.kv.num_blocks == 8 * 2**20 // block_bytes > 4 * 8
    with pytest.raises(ValueError, match=rf"kv_cache_memory: 100 bytes hold 0 token\(s\).* takes {block_bytes}"):
        LLM(tiny_llama, dtype="float32", kv_cache_memory=100)  # it ran on one block, 16 tokens of context
    # One block of one token held a prompt of none: the engine started, and refused every request.
    one = block_bytes // engine.attn_backend.block_size  # (a block of one token)
    with pytest.raises(ValueError, match=r"hold 1 token\(s\) of KV cache, and a request needs 2 at least"):
        LLM(tiny_llama, dtype="float32", block_size=1, kv_cache_memory=one)
    assert LLM(tiny_llama, dtype="float32", block_size=1, kv_cache_memory=2 * one).engine.max_model_len == 2


def test_a_kv_cache_memory_past_the_free_memory_is_a_config_error_before_any_block(tiny_llama, monkeypatch):
    """64GiB on a machine of 23: the OOM killer took the worker after a minute (exit 137, nothing said); 1000TiB,
    under the 1PiB cap, built block objects for minutes; 500GiB of large blocks was torch's allocation traceback."""
    import roseinfer.llm_engine as llm_engine
    from roseinfer.config import ConfigError

    with pytest.raises(ConfigError, match=r"kv_cache_memory: 1024000\.00 GiB is more than the .* GiB free on cpu"):
        LLM(tiny_llama, dtype="float32", kv_cache_memory="1000TiB")  # (more than any machine has)
    monkeypatch.setattr(llm_engine, "free_memory", lambda device: 2**30)
    with pytest.raises(ConfigError, match=r"2\.00 GiB is more than the 1\.00 GiB free on cpu with the model loaded"):
        LLM(tiny_llama, dtype="float32", kv_cache_memory="2GiB")
    assert LLM(tiny_llama, dtype="float32", kv_cache_memory="1MiB").engine.kv.num_blocks > 0


def test_a_stop_tokens_text_is_kept_when_the_request_keeps_what_stopped_it(chat_engine):
    """``include_stop_str_in_output`` keeps the text of a stop id (and EOS) as of a stop string, as vLLM does: the
    token that stopped the request was always left out."""
    import dataclasses

    engine = chat_engine
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine.add_request("free", "Say something", greedy)
    free = _run_to_end(engine)["free"].outputs[0]
    stop_id = free.token_ids[2]
    assert stop_id not in free.token_ids[:2]
    for keep in (False, True):
        params = dataclasses.replace(greedy, stop_token_ids=[stop_id], include_stop_str_in_output=keep)
        engine.add_request(f"keep-{keep}", "Say something", params)
        out = _run_to_end(engine)[f"keep-{keep}"].outputs[0]
        assert out.token_ids == free.token_ids[:3] and out.stop_reason == stop_id
        assert out.text == engine.tokenizer.decode(free.token_ids[: 3 if keep else 2], skip_special_tokens=True)


def test_a_stop_string_in_the_kept_text_of_a_stop_token_is_the_stop_reason(chat_engine):
    """With ``include_stop_str_in_output`` a stop token's text is shown, and a stop string inside it cuts the text
    there: the reason is then that string, as vLLM says (it said the token, for text cut at the string)."""
    engine = chat_engine
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine.add_request("free", "Say something", greedy)
    free = _run_to_end(engine)["free"].outputs[0]
    before = engine.tokenizer.decode(free.token_ids[:2], skip_special_tokens=True)
    stop_id, its_text = free.token_ids[2], engine.tokenizer.decode(free.token_ids[2:3], skip_special_tokens=True)
    # The shortest start of the token's text that first occurs inside that token's text.
    whole, token_text = before + its_text, its_text.strip()
    string = next(token_text[:k] for k in range(1, len(token_text) + 1) if whole.find(token_text[:k]) >= len(before))
    params = SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, stop_token_ids=[stop_id], stop=[string],
        include_stop_str_in_output=True,
    )  # fmt: skip
    engine.add_request("both", "Say something", params)
    out = _run_to_end(engine)["both"].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == string and out.text.endswith(string)


def test_an_output_given_earlier_keeps_its_logprobs_as_they_were(chat_engine):
    """Cumulative outputs handed out the sequence's own logprobs list, which grew on after they were given: an
    output kept from the first step had one token and every later step's logprobs."""
    engine = chat_engine
    engine.add_request("c", "Say something", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1))
    kept = []
    while engine.has_unfinished_requests():
        kept += [out.outputs[0] for out in engine.step()]
    assert [len(o.token_ids) for o in kept] == [1, 2, 3, 4]
    assert [len(o.logprobs) for o in kept] == [1, 2, 3, 4]


def _run_to_end(engine) -> dict:
    ended = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                ended[out.request_id] = out
    return ended


def test_delta_outputs_carry_the_logprobs_of_their_tokens(chat_engine):
    """As vLLM's: each delta piece has the logprobs of the tokens it adds (they came only with the final output)."""
    engine = chat_engine
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1, output_kind="delta")
    engine.add_request("d", "Say something", params)
    pieces, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out.outputs[0]
            else:
                pieces += out.outputs[0].logprobs
    assert len(final.logprobs) == 6 and pieces == final.logprobs[: len(pieces)] and len(pieces) >= 5


def _model_of(config, path) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def test_a_sliding_window_slides_only_where_transformers_slides_and_never_cuts_the_context(tmp_path, tiny_llama):
    """The layers transformers runs with a sliding window attend over it (the context was cut to the window,
    when attention was always full); a Llama config's stray ``sliding_window`` is ignored, as transformers
    ignores it, and so is a Qwen2 window no layer uses."""
    from transformers import AutoConfig, MistralConfig, Qwen2Config

    small = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}  # fmt: skip
    stray = AutoConfig.from_pretrained(tiny_llama)
    stray.sliding_window, stray.max_position_embeddings = 64, 256
    window = {"use_sliding_window": True, "sliding_window": 64}
    cases = {
        "llama, a stray key": (stray, [0, 0]),
        "mistral": (MistralConfig(**small, sliding_window=64), [64, 64]),
        "qwen2, upper layer slides": (Qwen2Config(**small, **window, max_window_layers=1), [0, 64]),
        "qwen2, no layer slides": (Qwen2Config(**small, **window, max_window_layers=2), [0, 0]),
    }
    for name, (config, windows) in cases.items():
        path = _model_of(config, tmp_path / name.replace(" ", "-").replace(",", ""))
        engine = LLM(path, dtype="float32", max_num_seqs=1).engine
        assert engine.max_model_len == 256, name
        assert [layer.window for layer in engine.runner.model.layers] == windows, name


def test_a_longrope_model_serves_its_whole_context_as_transformers_generates(tiny_longrope):
    """transformers rotates a sequence longer than LongRoPE's original length by the long factors, and recomputes
    its cache when one grows past it. The engine served only the original length; now its whole context, greedy
    tokens as transformers' ``generate``: prompts within the original length decoded past it (recomputed once),
    prompts past it (in prefill chunks, beside other requests' decodes), on the C kernels and the PyTorch path. A
    long request's blocks (rotated by the long factors) are never a shorter prompt's prefix-cache hit."""
    import torch
    from conftest import hf_greedy

    import roseinfer.kernels as kernels

    gen = torch.Generator().manual_seed(1)
    cases = [(40, 50), (100, 20), (64, 10), (65, 10)]  # (prompt length, new tokens)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n, _ in cases]
    expected = [hf_greedy(tiny_longrope, [p], new, use_cache=False)[0] for p, (_, new) in zip(prompts, cases)]
    assert all(len(set(e)) > 3 for e in expected)  # (no token repeated throughout: the rotations show)
    for c_kernels in (True, False):
        with pytest.MonkeyPatch.context() as m:
            if not c_kernels:
                m.setattr(kernels, "_lib", None)
                m.setattr(kernels, "_tried", True)
            llm = LLM(tiny_longrope, dtype="float32", max_num_batched_tokens=48)
            assert llm.engine.max_model_len == 256
            outs = llm.generate(
                [{"prompt_token_ids": p} for p in prompts],
                [SamplingParams(max_tokens=new, temperature=0, ignore_eos=True) for _, new in cases],
                use_tqdm=False,
            )
            assert [o.outputs[0].token_ids for o in outs] == expected, c_kernels
            assert [o.metrics.num_preemptions for o in outs] == [1, 0, 1, 0]  # the recomputes, once each
            # The 100-token prompt's first 48 and 80 tokens: a prompt within the original length (short factors)
            # finds none of its blocks; one past it finds them.
            again = llm.generate(
                [{"prompt_token_ids": prompts[1][:n]} for n in (48, 80)], SamplingParams(max_tokens=1), use_tqdm=False
            )
            assert again[0].metrics.num_cached_tokens == 0 and again[1].metrics.num_cached_tokens >= 64


def test_the_rotary_tables_hold_the_engines_longest_sequence_not_the_models_whole_context(tiny_longrope):
    """They were built for the model's whole context whatever max_model_len said (256 MiB of them for Gemma 3's
    131k tokens), LongRoPE's long rows too where no sequence could go past the original length."""
    import torch
    from conftest import hf_greedy

    prompt = torch.randint(3, 256, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    expected = hf_greedy(tiny_longrope, [prompt], 20, use_cache=False)[0]
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for max_len, long_from, rows in ((60, 0, 60), (100, 64, 64 + 100), (None, 64, 64 + 256)):
        llm = LLM(tiny_longrope, dtype="float32", max_model_len=max_len)
        model = llm.engine.model
        assert (model.long_rope_from, model.cos.shape[0]) == (long_from, rows), max_len
        [out] = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)
        assert out.outputs[0].token_ids == expected, max_len


def test_a_yarn_model_serves_its_original_length_times_its_factor_as_transformers_generates(tmp_path):
    """Qwen's instructions add YaRN to a config and leave ``max_position_embeddings`` at the original length; vLLM
    serves the original length times the factor, and transformers generates past it. The engine served only the
    original 64 tokens (a longer prompt refused); now 256, greedy tokens as transformers'."""
    import torch
    from conftest import hf_greedy
    from transformers import AutoModelForCausalLM, LlamaConfig

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                         pad_token_id=None, eos_token_id=None, rope_parameters=rope)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for layer in model.model.layers:  # peaked attention, so the rotations show in a random model's tokens
            layer.self_attn.q_proj.weight *= 25
    path = str(tmp_path / "tiny-yarn")
    model.save_pretrained(path)
    gen = torch.Generator().manual_seed(2)
    cases = [(40, 60), (150, 30)]  # (prompt length, new tokens): decoded past 64, and a prompt past it
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n, _ in cases]
    expected = [hf_greedy(path, [p], new)[0] for p, (_, new) in zip(prompts, cases)]
    assert all(len(set(e)) > 3 for e in expected)
    llm = LLM(path, dtype="float32", max_num_batched_tokens=64)
    assert llm.engine.max_model_len == 256
    params = [SamplingParams(max_tokens=new, temperature=0, ignore_eos=True) for _, new in cases]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_a_quantized_checkpoint_is_refused_before_it_loads(tmp_path, tiny_llama):
    """Its layers hold packed weights the engine would have read as floats (the loader checked the type alone)."""
    import json
    import shutil

    from roseinfer.config import ConfigError

    path = tmp_path / "quantized"
    shutil.copytree(tiny_llama, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"a quantized checkpoint \(gptq\) is not supported"):
        LLM(str(path), dtype="float32")


def test_a_generate_stopped_by_ctrl_c_leaves_nothing_in_the_engine(tiny_chat_model, monkeypatch):
    """Its requests stayed: the next call ran all of them to their end before it returned (in a notebook, minutes
    for 10k prompts), their KV blocks held until then."""
    llm = LLM(tiny_chat_model, dtype="float32")
    engine = llm.engine
    free = engine.kv.num_free_blocks
    real_step, steps = engine.step, []

    def interrupted(*args, **kwargs):
        steps.append(1)
        if len(steps) == 3:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(engine, "step", interrupted)
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([f"prompt {i}" for i in range(4)], long, use_tqdm=False)
    assert not engine.has_unfinished_requests() and engine.kv.num_free_blocks == free
    [out] = llm.generate(["hi"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3 and len(steps) < 10  # its own steps only


@pytest.mark.slow  # a second or more: the full suite's (the fast lane stays under a minute)
def test_the_servers_chat_rendering_is_the_engines(chat_engine, tiny_chat_model):
    """/tokenize of messages: the worker's tokenizer and chat template as it publishes them, rendered on the server
    by transformers' own call, give the ids the engine computes for the same chat job, with every option."""
    from producer.chat_render import ChatRenderer
    from producer.openai_api import TokenizeRequest
    from producer.schema import JobRequest

    renderer = ChatRenderer(chat_engine.tokenizer_json(), chat_engine.chat_template_doc())
    chats = [
        {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi \u00e9t\u00e9"}]},
        {"messages": [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color"}],
         "continue_final_message": True},
        {"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": False},
        {"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"enable_thinking": False}},
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning": "Two."},
                      {"role": "user", "content": "3+3?"}]},
    ]  # fmt: skip
    for chat in chats:
        job = TokenizeRequest.model_validate({"model": "m", **chat}).chat_job()
        assert renderer.tokenize(job) == chat_engine.tokenize(job.engine_prompt())[1], chat
    given = "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"  # (the special tokens it reads come too)
    operators = LLM(tiny_chat_model, dtype="float32", chat_template=given)
    doc = operators.engine.chat_template_doc()
    assert json.loads(doc)["chat_template"] == given  # (what the worker renders with: the operator's)
    ids = ChatRenderer(operators.engine.tokenizer_json(), doc).tokenize(JobRequest.model_validate(chats[0]))
    assert ids == operators.engine.tokenize(chats[0])[1]
    # A tokenizer file that sets truncation and padding (the engine encodes with neither): /tokenize gave 4 ids of a
    # longer prompt, or padded it, where the job runs on all of them.
    from producer.token_names import _parse

    bounded = json.loads(chat_engine.tokenizer_json())
    bounded["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    bounded["padding"] = {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                          "pad_type_id": 0, "pad_token": "<pad>"}  # fmt: skip
    job = JobRequest.model_validate(chats[1])
    ids = ChatRenderer(json.dumps(bounded), chat_engine.chat_template_doc()).tokenize(job)
    assert ids == chat_engine.tokenize(job.engine_prompt())[1] and 4 < len(ids) < 64
    prompt = "a longer prompt of words than four tokens"
    assert _parse("d", json.dumps(bounded)).tokenizer.encode(prompt).ids == chat_engine.tokenize(prompt)[1]


@pytest.mark.slow  # a second or more: the full suite's (the fast lane stays under a minute)
def test_content_parts_reach_a_template_that_loops_over_them_as_a_list_and_others_joined(chat_engine, tiny_chat_model):
    """vLLM gives a template that loops over a message's content (Gemma 3's) the list of parts, which it joins its
    own way; the parts were always joined by newlines here, a token more than vLLM's prompt. A template that prints
    the content gets them joined, as before. The server's /tokenize renders as the worker does."""
    from producer.chat_render import ChatRenderer
    from producer.openai_api import ChatCompletionRequest
    from producer.schema import JobRequest

    looping = (
        "{% for m in messages %}<{{ m['role'] }}>{% if m['content'] is string %}{{ m['content'] }}{% else %}"
        "{% for part in m['content'] %}{{ part['text'] | trim }}{% endfor %}{% endif %}{% endfor %}<assistant>"
    )
    parts = [{"type": "text", "text": "Describe this: "}, {"type": "text", "text": "a red fox."}]
    request = {"model": "m", "messages": [{"role": "user", "content": parts}]}
    job = JobRequest.model_validate(ChatCompletionRequest.model_validate(request).job_fields())
    llm = LLM(tiny_chat_model, dtype="float32", chat_template=looping)
    engine = llm.engine
    text = "<user>Describe this:a red fox.<assistant>"  # (the template's own join, as vLLM renders it)
    expected = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert engine.tokenize(job.engine_prompt())[1] == expected
    assert engine.tokenize_many([job.engine_prompt()])[0][1] == expected
    assert ChatRenderer(engine.tokenizer_json(), engine.chat_template_doc()).tokenize(job) == expected
    joined = [{"role": "user", "content": "Describe this: \na red fox."}]  # (a template that prints the content)
    assert chat_engine.tokenize(job.engine_prompt())[1] == chat_engine.tokenize({"messages": joined})[1]
    assert (
        ChatRenderer(chat_engine.tokenizer_json(), chat_engine.chat_template_doc()).tokenize(job)
        == (chat_engine.tokenize({"messages": joined})[1])
    )
    [out] = llm.chat([{"role": "user", "content": parts}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert out.prompt_token_ids == expected  # (the offline chat's too)
    # transformers' {% generation %} tag does not hide the loop; named templates get the list only where each of
    # them loops (the one a call picks, printing it, showed the list's Python form).
    from roseinfer.prompts import content_format

    printing = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    marked = looping.replace("{% for part", "{% generation %}{% for part")
    marked = marked.replace("{% endfor %}{% endif", "{% endfor %}{% endgeneration %}{% endif")
    assert [content_format(t) for t in (looping, printing, marked)] == ["openai", "string", "openai"]
    assert content_format({"default": printing, "tool_use": looping}) == "string"
    assert content_format({"default": looping, "tool_use": marked}) == "openai"


def test_a_vllm_users_offline_code_runs_and_means_the_same(tiny_chat_model):
    """What vLLM's offline API users write: ``llm.llm_engine``, ``lora_request=None``, per-prompt ``priority``, 16
    tokens by default, ``cumulative_logprob``, chat content as text parts, an assistant's turn of tool calls with
    content None, ``abort_request`` of a list. Each was an AttributeError, a TypeError, a ValueError, or (the
    default) a generation to the end of the context."""
    llm = LLM(tiny_chat_model, dtype="float32")
    engine = llm.llm_engine
    assert engine is llm.engine and engine.get_tokenizer() is llm.get_tokenizer()
    free = SamplingParams(temperature=0, ignore_eos=True)
    [out] = llm.generate("Hello", free, use_tqdm=False, lora_request=None)
    assert len(out.outputs[0].token_ids) == 16 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="LoRA adapters are not supported"):
        llm.generate("Hello", free, use_tqdm=False, lora_request="adapter")
    outs = llm.generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=False, priority=[1, 0])
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]
    with pytest.raises(ValueError, match="2 prompts but 1 priorities"):
        llm.generate(["a", "b"], free, use_tqdm=False, priority=[0])
    [scored] = llm.generate("Hi", SamplingParams(max_tokens=4, temperature=0, logprobs=2), use_tqdm=False)
    sample = scored.outputs[0]
    assert sample.cumulative_logprob == pytest.approx(sum(s[t] for t, s in zip(sample.token_ids, sample.logprobs)))
    assert sample.cumulative_logprob < 0 and out.outputs[0].cumulative_logprob is None  # (none asked for)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    joined = [{"role": "user", "content": "Hi\nthere"}]
    assert llm.chat(parts, greedy, use_tqdm=False)[0].prompt_token_ids == llm.chat(joined, greedy)[0].prompt_token_ids
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    turns = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]  # fmt: skip
    assert llm.chat(turns, greedy, use_tqdm=False)[0].outputs[0].token_ids
    for wrong in ("hello", ["hello"], {"role": "user", "content": "hi"}):  # (read as messages 'h', 'e', ...)
        with pytest.raises(TypeError, match="list of messages"):
            llm.chat(wrong, greedy, use_tqdm=False)
    for rid in ("x", "y"):
        engine.add_request(rid, "hello", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    ended = engine.abort_request(["x", "y"])
    assert {o.request_id for o in ended if o.finished} == {"x", "y"} and not engine.has_unfinished_requests()


def test_an_eos_the_generation_config_adds_is_named_as_the_stop_reason(tiny_chat_model, tmp_path):
    """As vLLM moves a generation config's extra EOS ids to the stop ids: ending on one says which (Llama 3.1's
    <|eom_id|> beside <|eot_id|>); the tokenizer's own EOS names none. It was None for both."""
    import shutil

    from transformers import AutoTokenizer, GenerationConfig

    path = tmp_path / "model"
    shutil.copytree(tiny_chat_model, path)
    own = AutoTokenizer.from_pretrained(path).eos_token_id
    extra = own + 1
    GenerationConfig(eos_token_id=[extra, own]).save_pretrained(path)
    llm = LLM(str(path), dtype="float32")
    endings = []
    for token in (extra, own):
        params = SamplingParams(temperature=0, max_tokens=4, logit_bias={token: 100})
        [out] = llm.generate("Hi", params, use_tqdm=False)
        endings.append((out.outputs[0].token_ids, out.outputs[0].finish_reason, out.outputs[0].stop_reason))
    assert endings == [([extra], "stop", extra), ([own], "stop", None)]


def test_a_delta_outputs_cumulative_logprob_is_the_samples_running_total(tiny_chat_model):
    """vLLM's delta outputs carry the sample's total so far: each delta's was the sum over its own tokens alone."""
    engine = LLM(tiny_chat_model, dtype="float32").llm_engine
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, logprobs=1, output_kind="delta")
    engine.add_request("r", "Hello there", params)
    pieces = []
    while engine.has_unfinished_requests():
        pieces += [out.outputs[0] for out in engine.step()]
    *deltas, final = pieces  # (the last holds the whole output, as documented)
    own = [sum(step[t] for t, step in zip(p.token_ids, p.logprobs)) for p in deltas]
    totals = [p.cumulative_logprob for p in deltas]
    assert len(totals) >= 2 and totals == pytest.approx(list(itertools.accumulate(own)))
    assert final.cumulative_logprob == pytest.approx(sum(s[t] for t, s in zip(final.token_ids, final.logprobs)))
    assert final.cumulative_logprob < totals[0] < 0


def test_a_requests_running_time_begins_once_it_gets_a_place_in_the_batch(tiny_chat_model):
    """The worker's job timeout counts from it (RQ's: from a job's start), not from the wait behind max_num_seqs."""
    import time

    engine = LLM(tiny_chat_model, dtype="float32", max_num_seqs=1).llm_engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    before = time.monotonic()
    engine.add_request("first", "Hello", params)
    engine.add_request("second", "Hello", params)
    engine.step()
    first = engine.running_since("first")
    assert before < first <= time.monotonic()
    assert engine.running_since("second") is None  # still waiting for the one place
    engine.step()
    assert engine.running_since("first") == first  # (once)
    while engine.running_since("second") is None:
        engine.step()
    assert engine.running_since("second") > first
    assert engine.running_since("unknown") is None and engine.running_since("first") is None  # ended


def test_a_prompt_of_more_characters_than_the_context_could_hold_is_refused_before_it_is_tokenized(chat_engine):
    """A 3.9 MB prompt took the tokenizing thread 3.3 s (the next jobs' admissions waited) to be refused for its
    803,276 tokens. Past the context's tokens at the longest token's length it cannot fit: refused at once, text or
    chat, with OpenAI's code."""
    from roseinfer.llm_engine import ContextLengthExceeded

    bound = chat_engine.max_model_len * chat_engine.longest_token_chars
    assert chat_engine.longest_token_chars >= max(len(t) for t in chat_engine.tokenizer.get_vocab())
    kept = {"get_vocab": chat_engine.tokenizer.get_vocab, "chat_template": chat_engine.tokenizer.chat_template}
    tokenizer = type("Refusing", (), kept)()  # (no encode, no template's render: neither is called)
    too_long = "x" * (bound + 1)
    for prompt in (too_long, {"messages": [{"role": "user", "content": too_long}]}):
        [got] = chat_engine.tokenize_many([prompt], tokenizer)
        assert isinstance(got, ContextLengthExceeded) and got.code == "context_length_exceeded", got
        assert f"{bound + 1} characters" in str(got)
    assert chat_engine.tokenize_many(["x" * bound])[0][1]  # (at the bound: tokenized, its tokens counted later)


def test_token_ids_past_the_context_are_refused_by_their_count_before_each_is_checked(chat_engine):
    """Each id was checked (0.3 s a scan for 2M of them, and three scans a job, one on the step loop) before the
    count that refuses them anyway."""
    from roseinfer.prompts import ContextLengthExceeded

    too_many = [10**9] * chat_engine.max_model_len  # (ids past the vocabulary too: the count is said first)
    with pytest.raises(ContextLengthExceeded, match=f"the prompt has {chat_engine.max_model_len} tokens"):
        chat_engine.tokenize(too_many)
    with pytest.raises(ValueError, match="prompt token ids must be integers"):
        chat_engine.tokenize([10**9])


def test_a_chat_whose_rendered_text_the_context_could_not_hold_is_refused_before_it_is_encoded(chat_engine):
    """Only the messages' contents were counted: 130,000 one-character messages (4 MB of job) passed, and their
    rendered text took seconds to encode, every job tokenized beside it waiting, to be refused for its length."""
    from roseinfer.prompts import ContextLengthExceeded

    bound = chat_engine.max_model_len * chat_engine.longest_token_chars
    many = {"messages": [{"role": "user", "content": "a"} for _ in range(bound // 2)]}  # (contents under the bound)
    plain = {"messages": [{"role": "user", "content": "hi"}]}
    refused, fine = chat_engine.tokenize_many([many, plain])
    assert isinstance(refused, ContextLengthExceeded) and "characters" in str(refused)
    assert fine == chat_engine.tokenize(plain)
    with pytest.raises(ContextLengthExceeded, match="characters"):  # (alone too: LLM.chat, a stock rq worker's job)
        chat_engine.tokenize(many)


def test_a_chat_truncated_auto_drops_its_earliest_turns_to_fit_and_keeps_its_system_message(tiny_chat_model):
    """OpenAI's Responses ``truncation: "auto"`` (taken, and the response said "disabled", while a long conversation
    failed): the earliest turns go, whole, until the prompt leaves its output the room it asks; the system message
    stays; a conversation short enough is as it was, and one whose last turn alone is too long is refused."""
    from producer.schema import JobRequest
    from roseinfer.prompts import ContextLengthExceeded

    engine = LLM(tiny_chat_model, dtype="float32", max_model_len=256).engine
    tokenizer = engine.tokenizer
    system = {"role": "system", "content": "You answer in one word."}
    turns = [m for i in range(12) for m in ({"role": "user", "content": f"Question {i}: " + "why " * 12},
                                             {"role": "assistant", "content": f"Answer {i}."})]  # fmt: skip
    messages = [system, *turns, {"role": "user", "content": "And now?"}]

    def rendered(kept: list[dict]) -> list[int]:
        text = tokenizer.apply_chat_template(kept, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def expected(room: int) -> list[int]:  # the most turns kept that fit, each kept part beginning at a user's
        starts = [i for i, m in enumerate(messages) if m["role"] == "user"]
        return next(ids for k in starts if len(ids := rendered([system, *messages[k:]])) + room <= 256)

    assert len(rendered(messages)) > 256
    for fields, room in (({}, 1), ({"max_tokens": 100, "context_overflow": "error"}, 100), ({"max_tokens": 100}, 1)):
        prompt = JobRequest.model_validate({"messages": messages, "truncation": "auto", **fields}).engine_prompt()
        assert prompt["truncation"] == room
        ids = engine.tokenize(prompt)[1]
        assert ids == expected(room) and len(ids) + room <= 256
        assert system["content"] in tokenizer.decode(ids) and "Question 0:" not in tokenizer.decode(ids)
        assert engine.tokenize_many([{"messages": messages[-1:]}, prompt])[1] == (None, ids)
    assert len(expected(100)) < len(expected(1))  # (the output's room took turns)
    short = {"messages": messages[-3:], "truncation": 1}
    assert engine.tokenize(short)[1] == rendered(messages[-3:])
    too_long = [system, {"role": "user", "content": "why " * 300}]
    results = engine.tokenize_many([{"messages": too_long, "truncation": 1}, {"messages": messages[-1:]}])
    assert isinstance(results[0], ContextLengthExceeded) and results[1] == (None, rendered(messages[-1:]))
    past = JobRequest.model_validate({"messages": messages, "truncation": "auto", "max_tokens": 300,
                                      "context_overflow": "error"}).engine_prompt()  # fmt: skip
    with pytest.raises(ContextLengthExceeded, match="max_tokens 300 leaves no room"):  # (as without truncation)
        engine.tokenize(past)
    with pytest.raises(ValueError, match="truncation: for the chat template"):
        JobRequest.model_validate({"prompt": "x", "truncation": "auto"})
