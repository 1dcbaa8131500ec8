"""``roseinfer serve`` driven by the official openai client (and plain HTTP), over a real Redis and a worker; and
``producer.AsyncClient``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import re
import threading
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest
import redis
import torch
import uvicorn
from conftest import ThreadWorker, slow_engine_steps

from producer import Client, JobFailed
from producer.aio import AsyncClient
from producer.generation_job import GenerationJob
from producer.protocol import installed_version
from producer.server import create_app, server_client
from worker.local_redis import free_port

pytestmark = pytest.mark.slow  # a worker and HTTP servers in threads: about 15 s


class ServerThread:
    def __init__(self, redis_url: str, queue: str, **options) -> None:
        self.port = free_port()
        self.client = server_client(redis_url, queue)
        config = uvicorn.Config(create_app(self.client, **options), host="127.0.0.1", port=self.port, log_level="error")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def served(redis_url, tiny_chat_model):
    worker = ThreadWorker(redis_url, tiny_chat_model, max_num_seqs=8)
    server = ServerThread(redis_url, worker.queue)
    yield worker, server, tiny_chat_model
    server.stop()
    worker.stop()


@pytest.fixture
def oai(served):
    _, server, _ = served
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


MESSAGES = [{"role": "user", "content": "Tell me about the sea"}]


@pytest.fixture
def slow_steps(served, monkeypatch):
    slow_engine_steps(monkeypatch, served[0].worker.engine)


def direct(redis_url, queue, **fields):
    return Client(redis_url, queue=queue).submit(**fields).result(timeout=60)


def test_chat_completion_matches_the_same_job_submitted_directly(served, oai, redis_url):
    worker, _, model = served
    out = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0)
    expected = direct(redis_url, worker.queue, messages=MESSAGES, max_tokens=12, temperature=0.0)
    choice = out.choices[0]
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == expected["text"]
    assert choice.finish_reason == expected["finish_reason"]
    assert out.usage.completion_tokens == expected["usage"]["completion_tokens"]
    assert out.usage.prompt_tokens == expected["usage"]["prompt_tokens"] > 0
    # The worker's backend beside the model (OpenAI's field: a seeded request's text may differ where it does).
    assert out.system_fingerprint == expected["system_fingerprint"] == f"roseinfer-{installed_version()}-cpu-float32"
    assert oai.completions.create(model=model, prompt="x", max_tokens=2).system_fingerprint == out.system_fingerprint


def test_a_prompt_of_token_ids_is_the_same_job_as_its_text(served, oai, redis_url):
    """OpenAI's completions take token ids for a prompt (one list, or a list of one list), and the payload
    ``prompt_token_ids`` as any producer sends it; ids the model does not have fail that job alone, as a 400."""
    from transformers import AutoTokenizer

    worker, _, model = served
    ids = AutoTokenizer.from_pretrained(model).encode("The sea is")
    text = direct(redis_url, worker.queue, prompt="The sea is", max_tokens=8, temperature=0.0)
    as_ids = direct(redis_url, worker.queue, prompt_token_ids=ids, max_tokens=8, temperature=0.0)
    assert as_ids["token_ids"] == text["token_ids"] and as_ids["usage"] == text["usage"]
    for prompt in (ids, [ids]):
        served_out = oai.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
        assert served_out.choices[0].text == text["text"]
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=model, prompt=[ids[0], -2], max_tokens=2)
    assert err.value.body["param"] == "prompt"  # the request's name for it, not the payload's
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=model, prompt=[ids[0], 10**9], max_tokens=2)
    assert "prompt token ids must be integers in [0, 49152)" in err.value.message


def test_a_completion_of_several_prompts_numbers_their_choices_as_openai(served, oai, redis_url):
    """A list of prompts is a job each: prompt i's samples are choices i * n .. i * n + n - 1, usage their sum;
    streamed or not."""
    worker, _, model = served
    prompts = ["The sea is", "A cat sat", "Once upon a time"]
    alone = [direct(redis_url, worker.queue, prompt=p, max_tokens=6, temperature=0.0) for p in prompts]
    out = oai.completions.create(model=model, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in out.choices] == list(range(6))
    assert [c.text for c in out.choices] == [r["text"] for r in alone for _ in range(2)]  # greedy: both samples
    assert out.usage.prompt_tokens == sum(r["usage"]["prompt_tokens"] for r in alone)
    assert out.usage.completion_tokens == 2 * sum(r["usage"]["completion_tokens"] for r in alone)
    # Streamed: each prompt's pieces under its choices' indexes, interleaved as they come; the usage of them all.
    chunks = list(
        oai.completions.create(
            model=model, prompt=prompts, max_tokens=6, temperature=0, n=2, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(6)]
    assert texts == [c.text for c in out.choices]
    ends = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(ends) == 6 and chunks[-1].usage.completion_tokens == out.usage.completion_tokens
    with pytest.raises(openai.BadRequestError):  # one prompt the worker refuses: the request's status, streamed too
        oai.completions.create(model=model, prompt=["fine", "sea " * 3000], max_tokens=6, stream=True)


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(served, oai, redis_url):
    """vLLM's stream_options.continuous_usage_stats (a 400 before): with include_usage, every chunk carries its
    prompt's tokens and its choice's tokens so far, the last one the usage of all; without, nothing (vLLM's rule)."""
    worker, _, model = served
    prompts = ["The sea is", "Once upon a time"]
    prompt_tokens = [direct(redis_url, worker.queue, prompt=p, max_tokens=1)["usage"]["prompt_tokens"] for p in prompts]
    fields = {"model": model, "max_tokens": 6, "temperature": 0, "n": 2, "extra_body": {"ignore_eos": True}}
    continuous = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(oai.completions.create(prompt=prompts, stream=True, stream_options=continuous, **fields))
    made: dict[int, list[int]] = {i: [] for i in range(4)}
    for chunk in chunks[:-1]:
        [c] = chunk.choices
        u = chunk.usage
        assert (u.prompt_tokens, u.total_tokens) == (prompt_tokens[c.index // 2], u.prompt_tokens + u.completion_tokens)
        made[c.index].append(u.completion_tokens)
    # (a completion's stream opens with its first text: no empty chunk of 0 tokens, as OpenAI's)
    assert all(counts[0] > 0 and counts == sorted(counts) and counts[-1] == 6 for counts in made.values())
    assert chunks[-1].choices == [] and (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (
        sum(prompt_tokens),
        24,
    )
    chat = list(
        oai.chat.completions.create(
            messages=MESSAGES, stream=True, stream_options={"continuous_usage_stats": True}, **fields
        )
    )
    assert len(chat) > 2 and not any("usage" in c.model_fields_set for c in chat)


def test_streamed_chat_gives_the_same_text_then_usage(served, oai):
    _, _, model = served
    whole = oai.chat.completions.create(
        model=model, messages=MESSAGES, max_completion_tokens=20, temperature=0, extra_body={"ignore_eos": True}
    )
    chunks = list(
        oai.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_completion_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all("usage" in c.model_fields_set and c.usage is None for c in chunks[:-1])  # OpenAI's null on the others


def test_usage_says_the_prompt_tokens_the_prefix_cache_held_in_every_api(served, oai):
    """OpenAI's ``prompt_tokens_details.cached_tokens`` (the Responses API's ``input_tokens_details``): it was left
    out of chat and completions, and always 0 in a response, while the engine counted the prefix cache's hits."""
    _, _, model = served
    messages = [{"role": "user", "content": f"{uuid.uuid4().hex} " * 3}]  # (a prompt no other test sent)
    first = oai.chat.completions.create(model=model, messages=messages, max_completion_tokens=2)
    again = oai.chat.completions.create(model=model, messages=messages, max_completion_tokens=2)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == (again.usage.prompt_tokens - 1) // 8 * 8  # (the whole prompt's blocks, short of its last token)
    assert first.usage.prompt_tokens_details.cached_tokens < cached  # (the template's system prompt at most)
    chunks = list(
        oai.chat.completions.create(
            model=model, messages=messages, max_completion_tokens=2, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    response = oai.responses.create(model=model, input=messages[0]["content"], max_output_tokens=16)
    assert response.usage.input_tokens_details.cached_tokens == cached
    one = oai.completions.create(model=model, prompt=messages[0]["content"], max_tokens=1)
    two = oai.completions.create(model=model, prompt=[messages[0]["content"]] * 2, max_tokens=1)
    hit = (one.usage.prompt_tokens - 1) // 8 * 8  # (its whole blocks, short of the token computed for its logits)
    assert one.usage.prompt_tokens_details.cached_tokens == 0
    assert two.usage.prompt_tokens_details.cached_tokens == 2 * hit  # (the jobs' together)


def test_created_is_when_the_request_came_not_when_its_answer_was_done(served, oai, slow_steps):
    """OpenAI's ``created`` (and a streamed answer's, and a response's ``created_at``) is the request's time: a
    non-streamed chat or completion took the time its job ended, seconds later for a queued or long job."""
    _, _, model = served
    ask = {"model": model, "max_tokens": 150, "temperature": 0, "extra_body": {"ignore_eos": True}}
    for create, prompt in ((oai.chat.completions.create, {"messages": MESSAGES}),
                           (oai.completions.create, {"prompt": "The sea is"})):  # fmt: skip
        sent = time.time()
        created = create(**prompt, **ask).created
        assert time.time() - sent > 2.5  # (150 steps of 20 ms at least)
        assert int(sent) <= created <= int(sent) + 1


def test_text_completion_streamed_and_not(served, oai):
    _, _, model = served
    prompt = "The capital of France is"
    whole = oai.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0, seed=1)
    assert whole.object == "text_completion" and whole.usage.completion_tokens <= 10
    pieces = oai.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0, seed=1, stream=True)
    assert "".join(c.choices[0].text for c in pieces) == whole.choices[0].text
    # Without max_tokens, 16: the legacy API's default (OpenAI's, vLLM's), not the whole context.
    default = oai.completions.create(model=model, prompt=prompt, temperature=0, extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16
    with pytest.raises(openai.BadRequestError) as err:  # OpenAI's rule: top_logprobs alone would give nothing
        oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, top_logprobs=2)
    assert err.value.body["param"] == "top_logprobs"


def test_a_choice_says_the_stop_that_ended_it_as_vllm(served, oai, redis_url):
    """vLLM's ``stop_reason`` (the stop token id or string that ended a choice, null for EOS or a length) was left
    out of every choice, though the job's result holds it."""
    worker, _, model = served
    prompt = "The capital of France is"
    ids = direct(redis_url, worker.queue, prompt=prompt, max_tokens=6, temperature=0, ignore_eos=True)["token_ids"]
    stopped = oai.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0,
                                     extra_body={"stop_token_ids": [ids[2]], "ignore_eos": True})  # fmt: skip
    choice = stopped.choices[0].model_dump()
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", ids[2])
    chat = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, temperature=0,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    assert (chat.choices[0].finish_reason, chat.choices[0].model_dump()["stop_reason"]) == ("length", None)
    # Streamed: on each choice's last chunk (its job's last event, or its sample's end), n = 1 and n = 2 alike.
    for n in (1, 2):
        chunks = oai.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, n=n, stream=True,
                                        extra_body={"stop_token_ids": [ids[2]], "ignore_eos": True})  # fmt: skip
        ends = [c.model_dump() for chunk in chunks for c in chunk.choices if c.finish_reason is not None]
        assert sorted((c["index"], c["finish_reason"], c["stop_reason"]) for c in ends) == [
            (i, "stop", ids[2]) for i in range(n)
        ]


def test_nulls_are_fields_not_given_and_a_blank_prompt_is_a_prompt():
    """OpenAI's clients send null for what they leave unset, and a response's message dumped back into the
    conversation carries its unset fields as nulls: each was a 400. A prompt of spaces has tokens: it was refused."""
    from openai.types.chat import ChatCompletionMessage

    from producer.openai_api import APIError, ChatCompletionRequest, parse, parse_completions

    answer = ChatCompletionMessage(role="assistant", content="The sea is wide.").model_dump()
    assert answer["refusal"] is None and answer["tool_calls"] is None
    body = {
        "model": "m", "messages": [MESSAGES[0], answer, {"role": "user", "content": "More", "name": None}],
        "n": None, "stream": None, "stream_options": None, "tools": None, "tool_choice": None, "logit_bias": None,
        "metadata": None, "max_tokens": 3,
    }  # fmt: skip
    req, fields = parse(ChatCompletionRequest, body)
    assert (req.n, req.stream) == (1, False)
    assert fields["messages"][1] == {"role": "assistant", "content": "The sea is wide."}
    req, jobs = parse_completions({"model": "m", "prompt": [" ", "\n"], "echo": None, "n": None})
    assert [job["prompt"] for job in jobs] == [" ", "\n"] and req.n == 1 and jobs[0]["max_tokens"] == 16
    _, [job] = parse_completions({"model": "m", "prompt": "x", "max_tokens": None})
    assert "max_tokens" not in job  # null: to the context (as vLLM), not the legacy default of 16
    with pytest.raises(APIError, match=r"tools\.0\.function: Field required"):  # a real value is still read
        parse(ChatCompletionRequest, {**body, "tools": [{"type": "function"}]})
    with pytest.raises(APIError, match="model: Field required"):
        parse(ChatCompletionRequest, {**body, "model": None})


def test_completion_top_logprobs_hold_the_sampled_token_as_openai_says():
    """OpenAI's legacy API: the top ``logprobs`` and the sampled token, up to logprobs + 1 entries. A sampled
    token outside the top was left out."""
    from producer.openai_api import completion_logprobs
    from producer.token_names import BY_ID as _token

    steps = [[[1, -0.1], [2, -0.5], [5, -3.0]], [[2, -0.2], [1, -0.4]]]  # as the worker sends: top 2, then sampled
    out = completion_logprobs({"token_ids": [5, 2], "logprobs": steps}, top=2)
    assert out["token_logprobs"] == [-3.0, -0.2]
    assert out["top_logprobs"] == [
        {_token(1): -0.1, _token(2): -0.5, _token(5): -3.0},
        {_token(2): -0.2, _token(1): -0.4},
    ]


def _model_tokenizer(model: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(model) / "tokenizer.json"))


def test_content_as_text_parts_and_logprobs(served, oai, redis_url):
    worker, _, model = served
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "about the sea"}]}
    ]
    a = oai.chat.completions.create(
        model=model, messages=parts, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    joined = [{"role": "user", "content": "Tell me\nabout the sea"}]  # parts join on new lines, as in vLLM
    b = oai.chat.completions.create(model=model, messages=joined, max_tokens=6, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    content = a.choices[0].logprobs.content
    assert len(content) == a.usage.completion_tokens
    assert all(len(step.top_logprobs) == 2 and step.logprob <= 0 for step in content)
    # Tokens by their text, with the tokenizer the worker wrote to Redis (they went by id: the server has no model).
    ids = direct(redis_url, worker.queue, messages=joined, max_tokens=6, temperature=0.0)["token_ids"]
    texts = [_model_tokenizer(model).decode([t], skip_special_tokens=False) for t in ids]
    assert [step.token for step in content] == texts
    # Each token's own bytes (a token holding part of a character, named U+FFFD, has that part's); they join to the
    # text.
    assert all(step.bytes == list(t.encode()) for step, t in zip(content, texts) if "\ufffd" not in t)
    whole = _model_tokenizer(model).decode(ids, skip_special_tokens=False)
    assert bytes(b for step in content for b in step.bytes).decode(errors="replace") == whole
    top = content[0].top_logprobs[0]
    assert not top.token.startswith("token_id:")
    assert "\ufffd" in top.token or top.bytes == list(top.token.encode())


def test_prompt_logprobs_come_back_in_vllms_shape(served, oai, redis_url):
    """vLLM's prompt_logprobs (extra_body; the job's field, a 400 here before): chat has them at the top level,
    each completion choice its prompt's, per prompt token {token id: {logprob, rank, decoded_token}}."""
    worker, _, model = served
    job = direct(redis_url, worker.queue, messages=MESSAGES, max_tokens=2, temperature=0.0, prompt_logprobs=2)
    ask = {"model": model, "max_tokens": 2, "temperature": 0, "extra_body": {"prompt_logprobs": 2}}
    chat = oai.chat.completions.create(messages=MESSAGES, **ask).model_extra["prompt_logprobs"]
    ids, tokenizer = job["prompt_token_ids"], _model_tokenizer(model)
    assert len(chat) == len(ids) > 2 and chat[0] is None
    for token_id, entry, pairs in zip(ids[1:], chat[1:], job["prompt_logprobs"][1:]):
        assert entry[str(token_id)]["logprob"] == pytest.approx(dict(map(tuple, pairs))[token_id], abs=1e-5)
        assert sorted(e["rank"] for e in entry.values() if e["rank"] is not None) == [1, 2]  # the top 2, ranked
        assert len(entry) == 2 + (entry[str(token_id)]["rank"] is None)  # and the prompt's token where not in them
        named = {t: tokenizer.decode([int(t)], skip_special_tokens=False) for t in entry}
        assert {t: e["decoded_token"] for t, e in entry.items()} == named
    text = oai.completions.create(prompt=ids, n=2, **ask)

    def shape(plp):
        return [e and {t: (v["rank"], v["decoded_token"]) for t, v in e.items()} for e in plp]

    for choice in text.choices:  # the same prompt as token ids: the same entries (values within float noise)
        got = choice.model_extra["prompt_logprobs"]
        assert shape(got) == shape(chat)
        flat = [v["logprob"] for e in got[1:] for v in e.values()]
        assert flat == pytest.approx([v["logprob"] for e in chat[1:] for v in e.values()], abs=1e-4)
    for bad in ({"stream": True}, {"extra_body": {"prompt_logprobs": 21}}):
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(messages=MESSAGES, **{**ask, **bad})
        assert err.value.body["param"] == "prompt_logprobs"


def test_tokenize_and_detokenize_as_vllm_with_the_workers_tokenizer(served, redis_url):
    """vLLM's /tokenize and /detokenize (404s before), by the tokenizer the worker wrote to Redis: a prompt's ids are
    the ones its job computes; /v1/models gives the context length, as vLLM's does."""
    worker, server, model = served
    http = httpx.Client(base_url=server.url, timeout=30)
    prompt = "The sea is wide, \u00e9t\u00e9 <|im_end|>"
    job = direct(redis_url, worker.queue, prompt=prompt, max_tokens=1, temperature=0.0, prompt_logprobs=0)
    out = http.post("/tokenize", json={"model": model, "prompt": prompt, "return_token_strs": True}).json()
    length = worker.worker.engine.max_model_len
    assert out["tokens"] == job["prompt_token_ids"] and (out["count"], out["max_model_len"]) == (
        len(job["prompt_token_ids"]),
        length,
    )
    assert out["token_strs"] == [_model_tokenizer(model).id_to_token(t) for t in out["tokens"]]
    assert http.post("/detokenize", json={"model": model, "tokens": out["tokens"]}).json() == {"prompt": prompt}
    assert [m["max_model_len"] for m in http.get("/v1/models").json()["data"]] == [length]
    # A chat (vLLM's form): the worker's chat template, rendered on the server, gives its job's prompt ids.
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
    job = direct(redis_url, worker.queue, messages=chat, max_tokens=1, temperature=0.0, prompt_logprobs=0)
    out = http.post("/tokenize", json={"model": model, "messages": chat}).json()
    assert out["tokens"] == job["prompt_token_ids"] and out["count"] == len(out["tokens"])
    continued = [*chat, {"role": "assistant", "content": "The sea"}]
    job = direct(redis_url, worker.queue, messages=continued, continue_final_message=True, max_tokens=1,
                 temperature=0.0, prompt_logprobs=0)  # fmt: skip
    body = {"model": model, "messages": continued, "continue_final_message": True}
    assert http.post("/tokenize", json=body).json()["tokens"] == job["prompt_token_ids"]
    # With tools (a 400 before: no tool choice read as "auto", which needs a parser): the template is shown them.
    job = direct(redis_url, worker.queue, messages=chat, tools=TOOLS, max_tokens=1, temperature=0.0, prompt_logprobs=0)
    tokens = http.post("/tokenize", json={"model": model, "messages": chat, "tools": TOOLS}).json()["tokens"]
    assert tokens == job["prompt_token_ids"]
    for path, body, status, param in [
        ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
        ("/tokenize", {"model": model, "prompt": "x", "messages": chat}, 400, None),
        ("/tokenize", {"model": model, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
        (
            "/tokenize",
            {"model": model, "messages": chat, "chat_template_kwargs": {"chat_template": "x"}},
            400,
            "chat_template_kwargs",
        ),
        ("/detokenize", {"model": model, "tokens": [1, 10**6]}, 400, "tokens"),
        ("/detokenize", {"model": model, "tokens": [True]}, 400, "tokens.0"),
    ]:
        reply = http.post(path, json=body)
        assert (reply.status_code, reply.json()["error"]["param"]) == (status, param), (path, body, reply.text)


def test_logprobs_bytes_and_offsets_of_tokens_that_split_a_character(served, oai, smol_tokenizer):
    """A token holding part of a character decodes alone to U+FFFD: its ``bytes`` were that sign's, not its own (a
    client joins a character's tokens by them), and ``text_offset`` counted one sign per part, past the text's end."""
    from producer.token_names import TokenNames

    _, _, model = served
    names = TokenNames(smol_tokenizer.backend_tokenizer)
    text = "🙂你好, a"
    ids = smol_tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(bytes(names.bytes(t)) for t in ids) == text.encode()
    for _ in range(200):  # (any tokens: their bytes join to what they decode to together)
        some = [int(t) for t in torch.randint(0, smol_tokenizer.vocab_size, (5,))]
        joined = b"".join(bytes(names.bytes(t)) for t in some).decode(errors="replace")
        assert joined == smol_tokenizer.decode(some), some
    echoed = oai.completions.create(model=model, prompt=ids, echo=True, max_tokens=0, logprobs=0)
    lp = echoed.choices[0].logprobs
    assert echoed.choices[0].text == text and max(lp.text_offset) < len(text)
    assert [text[o] for o in lp.text_offset[1:]] == [text[names.offsets(ids)[i]] for i in range(1, len(ids))]
    assert lp.text_offset[-2:] == [text.index(","), text.index(" a")]


def test_logprobs_streamed_are_the_ones_of_the_whole_answer(served, oai):
    """Each chunk carries its tokens' logprobs (chat: ``content`` entries; text: token lists), and together they are
    the non-streamed answer's: the same tokens, values and alternatives."""
    _, _, model = served
    ask = {"model": model, "max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = oai.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=3, **ask)
    chunks = list(oai.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=3, stream=True, **ask))
    streamed = [step for c in chunks if c.choices and c.choices[0].logprobs for step in c.choices[0].logprobs.content]
    assert [s.model_dump() for s in streamed] == [s.model_dump() for s in whole.choices[0].logprobs.content]
    assert len(streamed) == 12 and all(len(s.top_logprobs) == 3 for s in streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    text = oai.completions.create(prompt="The sea is", logprobs=2, **ask).choices[0].logprobs
    pieces = [
        c.choices[0].logprobs for c in oai.completions.create(prompt="The sea is", logprobs=2, stream=True, **ask)
    ]
    assert [t for p in pieces if p for t in p.tokens] == text.tokens and len(text.tokens) == 12
    # text_offset (left out while tokens went by id): each token's place in the choice's text, streamed or not
    offsets = list(itertools.accumulate((len(t) for t in text.tokens[:-1]), initial=0))
    assert [o for p in pieces if p for o in p.text_offset] == text.text_offset == offsets
    assert [v for p in pieces if p for v in p.token_logprobs] == text.token_logprobs
    assert [v for p in pieces if p for v in p.top_logprobs] == text.top_logprobs
    plain = oai.chat.completions.create(messages=MESSAGES, stream=True, **ask)
    assert all(c.choices[0].logprobs is None for c in plain if c.choices)  # none asked, none sent


def test_concurrent_streams_each_get_their_own_text(served, oai):
    _, _, model = served

    def one(i: int) -> tuple[str, str]:
        msgs = [{"role": "user", "content": f"Story number {i}"}]
        streamed = "".join(
            c.choices[0].delta.content or ""
            for c in oai.chat.completions.create(model=model, messages=msgs, max_tokens=16, temperature=0, stream=True)
            if c.choices
        )
        whole = oai.chat.completions.create(model=model, messages=msgs, max_tokens=16, temperature=0)
        return streamed, whole.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        pairs = list(pool.map(one, range(8)))
    assert all(streamed == whole for streamed, whole in pairs)
    assert len({whole for _, whole in pairs}) > 1


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"temperature": 5}, "temperature"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"n": 65}, "n"),
        ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
        ({"stop": 5}, "stop"),  # a field of several types: its path, not pydantic's tag of each ("stop.str")
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ({"max_tokens": True}, "max_tokens"),  # JSON's true is no count (it was a 1-token limit)
        ({"n": True}, "n"),
        ({"extra_body": {"top_k": "5"}}, "top_k"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"the": 1}}, "logit_bias"),  # keys are token ids
    ],
)
def test_a_bad_request_is_a_400_naming_the_parameter(served, oai, kwargs, param):
    _, _, model = served
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=model, **{"messages": MESSAGES, **kwargs})
    assert info.value.status_code == 400
    assert info.value.body["param"] == param and f"{param}." not in info.value.message


@pytest.mark.parametrize("prompt", ["", [""], [[]], [], [True], [[1, True]], [1, "a"], [[1]] * 257])
def test_a_bad_completion_prompt_is_a_400_naming_prompt(prompt):
    """Empty prompts, JSON's true as a token id (no token 1), mixed forms, too many prompts."""
    from producer.openai_api import APIError, parse_completions

    with pytest.raises(APIError) as err:
        parse_completions({"model": "m", "prompt": prompt})
    assert (err.value.status, err.value.param) == (400, "prompt")


@pytest.mark.parametrize("field", [{"logprobs": False}, {"logprobs": True}, {"max_tokens": 8.0}, {"echo": 1}])
def test_a_completion_field_of_the_wrong_type_is_a_400_not_converted(field):
    """``logprobs: false`` was read as 0, which asked for logprobs; OpenAI refuses a field of the wrong type."""
    from producer.openai_api import APIError, parse_completions

    with pytest.raises(APIError) as err:
        parse_completions({"model": "m", "prompt": "x", **field})
    assert (err.value.status, err.value.param) == (400, next(iter(field)))


@pytest.mark.parametrize(
    "field",
    [
        {"logit_bias": {}},
        {"tools": []},
        {"tool_choice": "none"},
        {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}},
        {"messages": [*MESSAGES, {"role": "tool", "content": "42", "tool_call_id": "call_1"}]},
    ],
)
def test_fields_that_ask_for_nothing_are_taken(field):
    """Clients send these empty (or a tool message with the id OpenAI requires on it): each was a 400."""
    from producer.openai_api import ChatCompletionRequest, parse

    _, fields = parse(ChatCompletionRequest, {"model": "m", "messages": MESSAGES, **field})
    assert not {"logit_bias", "tools", "tool_choice", "stream_options"} & set(fields)


def test_what_the_official_client_sends_back_or_adds_is_taken():
    """The client's stream helper gives each accumulated tool call an ``index``, and ``parse()`` gives the message
    ``parsed``: sent back in the conversation, each was a 400. ``response_format: text`` (the default, sent by some
    clients every time) beside a forced tool call, chat's ``verbosity``, a completion's ``best_of`` equal to its n
    and the Responses API's ``stream_options`` ask for nothing here either."""
    from producer.openai_api import APIError, ChatCompletionRequest, CompletionRequest, parse
    from producer.responses_api import parse_responses

    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "now", "arguments": "{}", "parsed_arguments": {}}}  # fmt: skip
    said = {"role": "assistant", "content": None, "tool_calls": [call], "parsed": {"a": 1}}
    answer = {
        "role": "tool",
        "content": [{"type": "text", "text": "12:00", "cache_control": {}}],
        "tool_call_id": "call_1",
    }
    _, fields = parse(ChatCompletionRequest, {"model": "m", "messages": [*MESSAGES, said, answer]})
    assert fields["messages"][1:] == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "content": [{"type": "text", "text": "12:00"}], "tool_call_id": "call_1"},
    ]  # fmt: skip
    forced = {"model": "m", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"}
    _, fields = parse(ChatCompletionRequest, {**forced, "response_format": {"type": "text"}, "verbosity": "low"})
    assert "response_format" not in fields and "verbosity" not in fields and "json" in fields["structured_outputs"]
    with pytest.raises(APIError, match="tool_choice constrains the output already") as err:
        parse(ChatCompletionRequest, {**forced, "response_format": {"type": "json_object"}})
    assert err.value.param == "response_format"
    _, fields = parse(CompletionRequest, {"model": "m", "prompt": "x", "n": 2, "best_of": 2})
    assert fields["n"] == 2 and "best_of" not in fields
    with pytest.raises(APIError, match="best_of 3 is not supported") as err:
        parse(CompletionRequest, {"model": "m", "prompt": "x", "best_of": 3})
    assert err.value.param == "best_of"
    parse_responses({"model": "m", "input": "Hi", "stream": True, "stream_options": {"include_obfuscation": False}})


@pytest.mark.parametrize("field", [{"suffix": "x"}, {"tool_choice": "required"}])
def test_fields_that_ask_for_what_is_not_here_are_a_400(field):
    from producer.openai_api import APIError, CompletionRequest, parse

    with pytest.raises(APIError) as err:
        parse(CompletionRequest, {"model": "m", "prompt": "x", **field})
    assert err.value.status == 400 and err.value.param in ("suffix", "tools")


def test_an_integer_is_a_number_for_a_float_field():
    from producer.openai_api import ChatCompletionRequest, parse

    _, fields = parse(ChatCompletionRequest, {"model": "m", "messages": MESSAGES, "temperature": 1, "top_p": 1})
    assert (fields["temperature"], fields["top_p"]) == (1.0, 1.0)


def test_priority_through_extra_body_picks_the_lane(served, oai, redis_url):
    worker, _, model = served
    out = oai.chat.completions.with_raw_response.create(
        model=model, messages=MESSAGES, max_tokens=3, extra_body={"priority": -5}
    )
    job_id = out.headers["x-roseinfer-job-id"]
    assert out.parse().usage.completion_tokens <= 3 and out.request_id == job_id  # (OpenAI's x-request-id)
    origin = Client(redis_url, queue=worker.queue).connection.hget(f"rq:job:{job_id}", "origin")
    assert origin.decode() == f"{worker.queue}:p-5"
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=model, messages=MESSAGES, extra_body={"priority": 1000})
    assert info.value.body["param"] == "priority"


def test_unknown_model_and_bad_json(served, oai):
    _, server, _ = served
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="no-such-model", messages=MESSAGES)
    reply = httpx.post(f"{server.url}/v1/chat/completions", content=b"{not json", timeout=10)
    assert reply.status_code == 400 and "not valid JSON" in reply.json()["error"]["message"]
    # nested past the JSON parser's depth: was a plain-text 500 (which the openai client retries)
    reply = httpx.post(f"{server.url}/v1/chat/completions", content=b"[" * 100_000, timeout=10)
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["chat/completions", "responses"])
def test_a_client_that_disconnects_mid_stream_cancels_its_job(served, redis_url, slow_steps, path):
    worker, server, model = served
    asked = (
        {"messages": MESSAGES, "max_tokens": 200, "ignore_eos": True}
        if path != "responses"
        else {"input": "Hi", "max_output_tokens": 200}
    )
    body = {"model": model, **asked, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/{path}", json=body, timeout=30) as reply:
        job_id = reply.headers["x-roseinfer-job-id"]
        lines = (line for line in reply.iter_lines() if line.startswith("data: {"))
        next(lines), next(lines), next(lines)  # the role chunk, then text: the job runs; then the client goes
    job = Client(redis_url, queue=worker.queue).job(job_id)
    deadline = time.time() + 10
    while job.status() not in ("canceled", "finished") and time.time() < deadline:
        time.sleep(0.05)
    assert job.status() == "canceled"


def test_a_client_that_leaves_a_non_streamed_request_cancels_its_job(redis_url):
    """No worker takes this queue's jobs (the server is told one serves it), so the job waits until the client
    gives up: the server sees the disconnect while it waits for the result, and cancels the job."""
    lonely = f"nobody-serves-this-{uuid.uuid4().hex[:8]}"  # (a second run in one Redis finds its own canceled job)
    server = ServerThread(redis_url, lonely)

    async def one_live_worker() -> list[dict]:
        return [{"name": "w", "model": "m", "in_flight": 0, "tokens_per_s": 0.0, "redis": "ok"}]

    server.client.workers = one_live_worker
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": MESSAGES}, timeout=0.5)
        queue = Client(redis_url, queue=lonely).queue
        deadline = time.time() + 10
        while not queue.canceled_job_registry.get_job_ids() and time.time() < deadline:
            time.sleep(0.05)
        [job_id] = queue.canceled_job_registry.get_job_ids()
        assert queue.fetch_job(job_id).get_status() == "canceled" and queue.count == 0
    finally:
        server.stop()


def test_health_asks_redis_again_after_a_dropped_connection(served, redis_url, monkeypatch):
    """A pooled connection Redis had dropped (a restart, an idle timeout, fakeredis' embedded server): /health said
    503 once while every other route went through, and a container's probe restarted a good server."""
    worker, _, _ = served
    lone = ServerThread(redis_url, worker.queue)
    try:
        real, calls = lone.client.connection.ping, []

        async def ping(**kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise redis.ConnectionError("Error 104 while writing to socket. Connection reset by peer.")
            return await real(**kwargs)

        monkeypatch.setattr(lone.client.connection, "ping", ping)
        health = httpx.get(f"{lone.url}/health", timeout=10)
        assert health.status_code == 200 and len(calls) == 2, health.text
    finally:
        lone.stop()


def test_health_models_and_api_key(served, redis_url):
    worker, server, model = served
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["workers"] == 1
    from importlib import metadata

    assert httpx.get(f"{server.url}/version", timeout=10).json() == {"version": metadata.version("roseinfer")}
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    models = oai.models.list()
    assert [m.id for m in models.data] == [model]
    assert oai.models.retrieve(model) == models.data[0]  # (OpenAI's retrieve; an id here may be a path)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        oai.models.retrieve("gpt-4o")

    locked = ServerThread(redis_url, worker.queue, api_key="sesame")
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{locked.url}/v1", api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=f"{locked.url}/v1", api_key="sesame", max_retries=0)
        assert ok.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2).usage.completion_tokens <= 2
        # The tokenizer's endpoints too: one request of the largest body took 2.5 GB to encode, no key needed.
        body = {"model": model, "prompt": "the sea"}
        assert httpx.post(f"{locked.url}/tokenize", json=body, timeout=10).status_code == 401
        keyed = httpx.post(f"{locked.url}/tokenize", json=body, headers={"Authorization": "Bearer sesame"}, timeout=10)
        assert keyed.status_code == 200 and keyed.json()["count"] > 0
        assert httpx.post(f"{locked.url}/detokenize", json={"model": model, "tokens": [5]}).status_code == 401
        assert httpx.get(f"{locked.url}/version", timeout=10).status_code == 200
    finally:
        locked.stop()


@pytest.mark.slow  # seconds: a worker of its own
def test_a_served_model_name_is_the_models_name_to_clients(redis_url, tiny_chat_model):
    """Copies of one model at other paths (other machines) are one model under one name, as vLLM's
    --served-model-name: the server takes no request while its workers' names differ."""
    worker = ThreadWorker(redis_url, tiny_chat_model, served_model_name="sea-model")
    server = ServerThread(redis_url, worker.queue)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["sea-model"]
        out = client.chat.completions.create(model="sea-model", messages=MESSAGES, max_tokens=2)
        assert out.model == "sea-model" and out.usage.completion_tokens <= 2
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model=tiny_chat_model, messages=MESSAGES, max_tokens=2)
        result = Client(redis_url, queue=worker.queue).submit(prompt="x", max_tokens=1).result(timeout=60)
        assert result["model"] == "sea-model"
    finally:
        server.stop()
        worker.stop()


def test_a_job_past_the_server_timeout_is_a_504_and_is_canceled(served, redis_url, slow_steps):
    worker, _, model = served
    impatient = ServerThread(redis_url, worker.queue, timeout=0.3)
    sent = []
    try:  # the client retries as it does by default: a 504 told it not to (a retry submitted the job again)
        http = httpx.Client(event_hooks={"request": [sent.append]})
        client = openai.OpenAI(base_url=f"{impatient.url}/v1", api_key="x", http_client=http)
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.with_raw_response.create(
                model=model, messages=MESSAGES, max_tokens=200, extra_body={"ignore_eos": True}
            )
        assert info.value.status_code == 504 and len(sent) == 1
        assert info.value.response.headers["x-should-retry"] == "false"
        job_id = info.value.response.headers["x-roseinfer-job-id"]
    finally:
        impatient.stop()
    _canceled_and_left(worker, redis_url, job_id)


def test_a_stream_with_no_event_within_the_server_timeout_is_a_504_and_is_canceled(served, redis_url, monkeypatch):
    """The job's TimeoutError was taken for the end of the first events' grace: the server sent a 200 and its role
    chunk, then waited forever, and the job ran on."""
    worker, _, model = served
    engine = worker.worker.engine
    real_step = engine.step

    def step(*args, **kwargs):  # no first token within the 0.3 s timeout
        time.sleep(0.6)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(engine, "step", step)
    impatient = ServerThread(redis_url, worker.queue, timeout=0.3)
    try:
        body = {"model": model, "messages": MESSAGES, "max_tokens": 200, "stream": True, "ignore_eos": True}
        response = httpx.post(f"{impatient.url}/v1/chat/completions", json=body, timeout=20)
    finally:
        impatient.stop()
    assert response.status_code == 504 and response.headers["x-should-retry"] == "false"
    assert "no result within 0.3 s" in response.json()["error"]["message"]
    _canceled_and_left(worker, redis_url, response.headers["x-roseinfer-job-id"])


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_stops_reading_sooner_than_the_server_waits_gets_the_504_once(served, redis_url, stream):
    """The official client sends how long it reads (x-stainless-read-timeout; 600 s by default, as --timeout is):
    it gave up first, never saw the 504 that says not to retry, and retried: the job was submitted three times."""
    worker, server, model = served
    engine = worker.worker.engine
    real_step = engine.step
    sent = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine, "step", lambda *a, **k: (time.sleep(5), real_step(*a, **k))[1])  # past the client's 4 s
        http = httpx.Client(event_hooks={"request": [sent.append]})
        # (the server answers within 0.8 of it: 3.2 s, and a loaded machine's handler and hops fit in the rest; a
        # longer wait would pass the 5 s the headers are held, and a stream's 504 would come in the stream instead)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", http_client=http, timeout=4.0)
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(
                model=model, messages=MESSAGES, max_tokens=200, stream=stream, extra_body={"ignore_eos": True}
            )
    assert info.value.status_code == 504 and len(sent) == 1  # (the server's own --timeout: 600 s)
    _canceled_and_left(worker, redis_url, info.value.response.headers["x-roseinfer-job-id"])


def _canceled_and_left(worker: ThreadWorker, redis_url: str, job_id: str) -> None:
    """The server canceled the job, and the worker let it go: the slow step it was in is over (the next test's steps
    are its own)."""
    job = Client(redis_url, queue=worker.queue).job(job_id)
    deadline = time.monotonic() + 30
    while (job.status() != "canceled" or job_id in worker.worker.in_flight) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert job.status() == "canceled" and job_id not in worker.worker.in_flight


def test_no_live_worker_is_a_503(redis_url):
    lonely = ServerThread(redis_url, "queue-without-workers")
    try:
        health = httpx.get(f"{lonely.url}/health", timeout=10)
        assert health.status_code == 503 and "no live worker" in health.json()["reason"]
        client = openai.OpenAI(base_url=f"{lonely.url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(model="any", messages=MESSAGES)
        assert info.value.status_code == 503
    finally:
        lonely.stop()


async def _text(job) -> str:
    return "".join([piece async for piece in job.stream(timeout=60)])


def test_async_client_submits_streams_and_waits(served, redis_url, monkeypatch):
    worker, _, _ = served

    async def main():
        async with AsyncClient(redis_url, worker.queue) as client:
            jobs = [await client.submit(f"async {i}", max_tokens=8, temperature=0.0) for i in range(3)]
            texts = [await _text(job) for job in jobs]
            results = await asyncio.gather(*(job.result(timeout=60) for job in jobs))
            # Many followers at once, two of them on one job: each gets every event of its job, once.
            more = [await client.submit(f"together {i}", max_tokens=6, temperature=0.0) for i in range(4)]
            together = await asyncio.gather(*(_text(job) for job in [*more, more[0]]))
            assert together[0] == together[-1]
            for job, text in zip(more, together):
                assert text == (await job.result(timeout=60))["text"]
            # Waited for while they run, all at once, through the client's one stream reader: a connection each (a
            # pub/sub subscription per waiting job) made a server with 1,000 requests waiting hold 1,000.
            slow_engine_steps(monkeypatch, worker.worker.engine)  # (none ends before the count: no result re-reads)
            waiting = [
                await client.submit(f"wait {i}", max_tokens=96, temperature=0.0, ignore_eos=True) for i in range(12)
            ]
            gathered = asyncio.gather(*(job.result(timeout=60) for job in waiting))
            await asyncio.sleep(0.3)
            assert len(client.connection.connection_pool._in_use_connections) <= 2  # held while they wait
            waited = await gathered
            assert [r["usage"]["completion_tokens"] for r in waited] == [96] * 12
            assert [r["text"] for r in waited] == [(await job.result(timeout=5))["text"] for job in waiting]
            return texts, results, await jobs[0].status()

    texts, results, status = asyncio.run(main())
    assert texts == [r["text"] for r in results]
    assert all(r["usage"]["completion_tokens"] == 8 for r in results)
    assert status == "finished"


def test_the_server_and_the_worker_serve_prometheus_metrics(served, oai, redis_url, tiny_chat_model):
    from prometheus_client.parser import text_string_to_metric_families

    _, server, model = served
    oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)

    def samples(text: str) -> dict:
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    before = samples(httpx.get(f"{server.url}/metrics", timeout=10).text)
    for path in (f"/v1/models/{model}", "/version", "/made/up", "/v1/made/up"):
        httpx.get(f"{server.url}{path}", timeout=10)
    httpx.post(f"{server.url}/v1/responses", json={"model": model}, timeout=10)  # no input: a 400
    got = samples(httpx.get(f"{server.url}/metrics", timeout=10).text)

    def added(endpoint: str, status: str) -> float:
        key = ("roseinfer_server_requests_total", (("endpoint", endpoint), ("status", status)))
        return got.get(key, 0) - before.get(key, 0)

    assert got[("roseinfer_server_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "200")))] >= 1
    # Every route under its template (the model's name is no series of its own); made-up paths under one label.
    assert added("/v1/models/{model:path}", "200") == 1 and added("/version", "200") == 1
    assert added("/v1/responses", "400") == 1 and added("other", "404") == 2
    assert got[("roseinfer_server_open_streams", ())] == 0

    port = free_port()
    worker = ThreadWorker(redis_url, tiny_chat_model, metrics_port=port)
    try:
        client = Client(redis_url, queue=worker.queue)
        jobs = client.submit_many([{"prompt": f"m{i}", "max_tokens": 5, "ignore_eos": True} for i in range(3)])
        for job in jobs:
            job.result(timeout=60)
        deadline = time.monotonic() + 30  # the sender counts a job ended once its result lands, and reads depths
        while True:
            got = samples(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)
            ended = got.get(("roseinfer_jobs_total", (("status", "finished"),))) == 3
            emptied = got.get(("roseinfer_queue_depth", (("lane", worker.queue),))) == 0
            if (ended and emptied) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        # The queue filling while the worker takes nothing (suspended): its depth was the sender's last reading, 0.
        from rq.suspension import resume, suspend

        suspend(client.connection)
        try:
            deadline = time.monotonic() + 30  # the puller reads the suspension a second apart, before a pull
            while not worker.worker._suspended and time.monotonic() < deadline:
                time.sleep(0.05)
            client.submit_many([{"prompt": "later", "max_tokens": 2}] * 4)
            waiting = samples(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)
        finally:
            resume(client.connection)
        assert waiting[("roseinfer_queue_depth", (("lane", worker.queue),))] == 4
    finally:
        worker.stop()
    with pytest.raises(httpx.ConnectError):  # a stopped worker's metrics are gone, and its port free again
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
    assert got[("roseinfer_jobs_total", (("status", "finished"),))] == 3
    assert got[("roseinfer_generated_tokens_total", ())] == 15
    assert got[("roseinfer_ttft_seconds_count", ())] == 3 == got[("roseinfer_queue_time_seconds_count", ())]
    assert got[("roseinfer_time_per_output_token_seconds_count", ())] == 3
    assert got[("roseinfer_engine_step_seconds_count", ())] >= 5
    assert got[("roseinfer_redis_round_trip_seconds_count", ())] >= 1
    assert got[("roseinfer_queue_depth", (("lane", worker.queue),))] == 0
    assert got[("roseinfer_jobs_in_flight", ())] == 0 and got[("roseinfer_redis_up", ())] == 1
    assert got[("roseinfer_requests_running", ())] == 0 == got[("roseinfer_requests_waiting", ())]
    assert 0 <= time.time() - got[("roseinfer_last_heartbeat_timestamp_seconds", ())] < 60
    assert 0 <= got[("roseinfer_kv_cache_usage_ratio", ())] <= 1
    assert ("roseinfer_preemptions_total", ()) in got and got[("roseinfer_prompt_tokens_total", ())] > 0
    assert 0 <= got[("roseinfer_prompt_tokens_cached_total", ())] <= got[("roseinfer_prompt_tokens_total", ())]


def test_serve_embedded_is_one_command(tiny_chat_model):
    import os
    import shutil
    import subprocess
    import sys

    port = free_port()
    cmd = [sys.executable, "-m", "worker.cli", "serve", "--embedded", "--model", tiny_chat_model, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        _wait_until_healthy(proc, f"http://127.0.0.1:{port}", 120)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        out = client.chat.completions.create(model=tiny_chat_model, messages=MESSAGES, max_tokens=5, temperature=0)
        assert out.usage.completion_tokens <= 5 and out.choices[0].finish_reason in ("length", "stop")
        redis_servers = [p for p in Path("/proc").iterdir() if _parent(p) == proc.pid and "redis" in _command(p)]
        assert redis_servers or not shutil.which("redis-server")  # (without one it serves fakeredis in-process)
        # (its title, not its arguments: "redis-server 127.0.0.1:<port>"; the folder is the server's to say)
        ports = [int(re.search(r":(\d+)", _command(p)).group(1)) for p in redis_servers]
        folders = [Path(redis.Redis(port=port).config_get("dir")["dir"]) for port in ports]
        assert all(f.is_dir() for f in folders)
        for port in ports:  # (a day's results in the command's own Redis: ~13 KB a request, hundreds of MB a day)
            own = redis.Redis(port=port)
            kept = [own.ttl(key) for pattern in ("rq:results:*", "rq:job:*") for key in own.scan_iter(pattern)]
            assert kept and all(0 < ttl <= 600 for ttl in kept), kept
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert [p for p in redis_servers if "redis" in _command(p)] == []  # its redis-server ended before it did
    assert not any(f.exists() for f in folders)  # and its folder is gone


# A serve --embedded whose model takes a minute to load: stopped during it.
_SLOW_LOAD = """import sys, time
import worker.main
build = worker.main.build_worker
worker.main.build_worker = lambda *a, **k: (time.sleep(60), build(*a, **k))[1]
from worker.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow  # a Python process
def test_serve_embedded_stopped_while_its_model_loads_stops_its_redis_server(tiny_chat_model):
    """A SIGTERM during the load killed the command outright (its handler came after the load): its redis-server
    and folder were left behind. Its redis-server runs in a session of its own: a terminal's Ctrl-C reaches the
    command's group, and the Redis died under the command's shutdown."""
    import os
    import shutil
    import signal
    import subprocess
    import sys

    if not shutil.which("redis-server"):
        pytest.skip("serves fakeredis in-process without a redis-server")
    cmd = [sys.executable, "-c", _SLOW_LOAD, "serve", "--embedded", "--model", tiny_chat_model,
           "--port", str(free_port())]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, server, port = time.monotonic() + 60, None, None
        while port is None and time.monotonic() < deadline:  # (not `redis-server --version`, the check before it)
            for p in Path("/proc").iterdir():
                command = _command(p)  # (its arguments, or once started its title: "redis-server 127.0.0.1:<port>")
                found = re.search(r"(?:--port\x00|:)(\d+)", command)
                if found and _parent(p) == proc.pid and "redis" in command and "--version" not in command:
                    server, port = p, int(found[1])
            time.sleep(0.1)
        assert server is not None, "no redis-server started"
        assert os.getsid(int(server.name)) == int(server.name)  # (its own session)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # (up once it answers: the load begins after that)
            with contextlib.suppress(redis.RedisError):
                folder = Path(redis.Redis(port=port).config_get("dir")["dir"])
                break
            time.sleep(0.1)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
    assert not _command(server) and not folder.exists()  # (its redis-server ended, its folder removed)


@pytest.mark.slow  # seconds: a server process started and stopped
def test_a_stopped_server_gives_open_streams_a_bound_then_cancels_them_and_reads_its_key_from_the_environment(
    served, redis_url, monkeypatch
):
    """SIGTERM waited for every open stream to end (a container's stop then killed it, and the jobs ran on for no
    one); it now waits 5 s, then cancels them. ``--api-key`` was a flag alone, shown in ``ps``."""
    import os
    import signal
    import subprocess
    import sys
    import threading

    worker, _, model = served
    real_step = worker.worker.engine.step

    def step(*args, **kwargs):  # 200 tokens take 12 s: a stream still open when the grace ends
        time.sleep(0.06)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(worker.worker.engine, "step", step)
    port = free_port()
    cmd = [sys.executable, "-m", "worker.cli", "serve", "--redis-url", redis_url, "--queue", worker.queue,
           "--port", str(port)]  # fmt: skip
    env = {**os.environ, "ROSEINFER_API_KEY": "sesame"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    url, started, job = f"http://127.0.0.1:{port}", threading.Event(), {}
    try:
        _wait_until_healthy(proc, url, 60)
        body = {"model": model, "messages": MESSAGES, "max_tokens": 200, "ignore_eos": True, "stream": True}
        assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=10).status_code == 401

        def follow() -> None:
            headers = {"Authorization": "Bearer sesame"}
            stream = httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)
            with contextlib.suppress(httpx.HTTPError), stream as reply:
                job["id"] = reply.headers["x-roseinfer-job-id"]
                for line in reply.iter_lines():
                    job.setdefault("lines", []).append(line)
                    started.set()

        def wait_whole() -> None:  # (a request not streamed: a plain-text 500 at the stop, no JSON error)
            whole = {**body, "stream": False}
            job["whole"] = httpx.post(f"{url}/v1/chat/completions", json=whole, headers=headers, timeout=60)

        headers = {"Authorization": "Bearer sesame"}
        reader = threading.Thread(target=follow, daemon=True)
        reader.start()
        waiter = threading.Thread(target=wait_whole, daemon=True)
        waiter.start()
        assert started.wait(30)
        stopped_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        assert time.monotonic() - stopped_at < 9  # (5 s of grace, and the stop itself)
        waiter.join(10)
        whole = job["whole"]
        assert whole.status_code == 503 and "the server is stopping" in whole.json()["error"]["message"], whole.text
        canceled = Client(redis_url, queue=worker.queue).job(whole.headers["x-roseinfer-job-id"])
        reader.join(10)
        # The stream ends with the error and its [DONE] (it was cut at the grace's end: no word, a traceback logged)
        data = [line.removeprefix("data: ") for line in job["lines"] if line.startswith("data: ")]
        assert data[-1] == "[DONE]" and "the server is stopping" in json.loads(data[-2])["error"]["message"]
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    status = Client(redis_url, queue=worker.queue).job(job["id"])
    deadline = time.time() + 10
    while status.status() != "canceled" and time.time() < deadline:
        time.sleep(0.1)
    assert status.status() == "canceled", proc.stderr.read()
    while canceled.status() != "canceled" and time.time() < deadline:
        time.sleep(0.1)
    assert canceled.status() == "canceled"


def _wait_until_healthy(proc, url: str, patience: float) -> None:
    """Until a server process started answers ``/health`` with 200 (failing with its stderr if it ends first)."""
    deadline = time.time() + patience
    while True:
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() else "no start"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def _parent(proc_dir: Path) -> int | None:
    try:
        return int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _command(proc_dir: Path) -> str:
    try:
        return (proc_dir / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


SCHEMA = {
    "type": "object",
    "properties": {"label": {"enum": ["calm", "rough"]}, "waves": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["label", "waves"],
    "additionalProperties": False,
}


def test_response_format_json_schema_and_structured_outputs_pass_through(served, oai, redis_url):
    import jsonschema

    worker, _, model = served
    fmt = {"type": "json_schema", "json_schema": {"name": "sea", "schema": SCHEMA, "strict": True}}
    out = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=40, temperature=0, response_format=fmt)
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    # The same constraint in vLLM's form gives the same output, through the server and submitted directly.
    so = {"json": SCHEMA}
    vllm_form = oai.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=40, temperature=0, extra_body={"structured_outputs": so}
    )
    direct_out = direct(
        redis_url, worker.queue, messages=MESSAGES, max_tokens=40, temperature=0.0, structured_outputs=so
    )
    assert vllm_form.choices[0].message.content == direct_out["text"] == out.choices[0].message.content
    choice = oai.completions.create(
        model=model, prompt="The sea is", max_tokens=10, extra_body={"structured_outputs": {"choice": ["calm", "wild"]}}
    )
    assert choice.choices[0].text in ("calm", "wild")


def test_logit_bias_through_the_server_is_the_jobs_and_a_token_past_the_vocabulary_is_a_400(served, oai, redis_url):
    """OpenAI's logit_bias (it was a 400 "not supported"): +100 on a token makes every greedy token that one, as
    the same job submitted directly; a token id the model does not have fails the job, a 400 naming it."""
    worker, _, model = served
    token = 300
    out = oai.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=4, temperature=0, logit_bias={str(token): 100}
    )
    job = direct(redis_url, worker.queue, messages=MESSAGES, max_tokens=4, temperature=0.0, logit_bias={token: 100})
    assert job["token_ids"] == [token] * 4 and out.choices[0].message.content == job["text"]
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, logit_bias={"10000000": -100})
    assert "past the model's vocabulary" in err.value.message


def test_an_echoed_completion_begins_with_its_prompt_and_the_prompts_logprobs(served, oai, redis_url):
    """``echo`` (lm-evaluation-harness scores a text with it: ``echo``, ``logprobs`` and token ids): the text and
    the logprobs begin with the prompt's, the first token's logprob null, as the job's ``prompt_logprobs`` give
    them; the completion after them is the plain request's."""
    worker, _, model = served
    ids = direct(redis_url, worker.queue, prompt="The sea is", max_tokens=1, temperature=0.0, prompt_logprobs=0)
    prompt = ids["prompt_token_ids"]
    plain = oai.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0, logprobs=1)
    for given in ("The sea is", prompt):
        out = oai.completions.create(model=model, prompt=given, max_tokens=3, temperature=0, echo=True, logprobs=1)
        choice = out.choices[0]
        assert choice.text == "The sea is" + plain.choices[0].text
        lp = choice.logprobs
        named = [_model_tokenizer(model).decode([t], skip_special_tokens=False) for t in prompt]
        assert lp.tokens == named + plain.choices[0].logprobs.tokens and "".join(named) == "The sea is"
        assert lp.text_offset[len(prompt)] == len("The sea is") and lp.text_offset[0] == 0
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        scored = [dict(s)[t] for t, s in zip(prompt[1:], ids["prompt_logprobs"][1:])]
        assert lp.token_logprobs[1 : len(prompt)] == pytest.approx(scored, abs=1e-5)
        assert all(len(top) in (1, 2) for top in lp.top_logprobs[1:])  # the top 1, and the token where it is not
        assert lp.token_logprobs[len(prompt) :] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    text_only = oai.completions.create(model=model, prompt="The sea is", max_tokens=3, temperature=0, echo=True)
    assert text_only.choices[0].text == "The sea is" + plain.choices[0].text and text_only.choices[0].logprobs is None
    # The job computes the prompt's logprobs only where they (or the text of its token ids) are wanted.
    from producer.openai_api import parse_completions

    asks = {"model": "m", "prompt": "x", "echo": True}
    assert [("prompt_logprobs" in job, job.get("prompt_logprobs")) for job in parse_completions(asks)[1]] == [
        (False, None)
    ]
    assert parse_completions({**asks, "logprobs": 2})[1][0]["prompt_logprobs"] == 2
    assert parse_completions({**asks, "prompt": [5, 6]})[1][0]["prompt_logprobs"] == 0
    # Streamed, a text prompt is the first piece of each choice; one that needs the job's logprobs is a 400.
    fields = {"model": model, "prompt": "The sea is", "max_tokens": 3, "temperature": 0, "echo": True, "stream": True}
    pieces = [c.choices[0].text for c in oai.completions.create(**fields)]
    assert pieces[0] == "The sea is" and "".join(pieces) == text_only.choices[0].text
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(**fields, logprobs=1)
    assert err.value.body["param"] == "echo"


def test_an_echo_with_max_tokens_0_scores_the_prompt_alone(served, oai, redis_url):
    """OpenAI's (and vLLM's) way to score a text: ``echo`` with ``max_tokens`` 0, the prompt and its logprobs, nothing
    generated. It was a 400 (max_tokens at least 1). Streamed too, and with n; without echo, 0 stays refused."""
    worker, _, model = served
    ids = direct(redis_url, worker.queue, prompt="The sea is", max_tokens=1, temperature=0.0, prompt_logprobs=0)
    scored = [dict(s)[t] for t, s in zip(ids["prompt_token_ids"][1:], ids["prompt_logprobs"][1:])]
    out = oai.completions.create(model=model, prompt="The sea is", max_tokens=0, echo=True, logprobs=0, n=2)
    assert [c.text for c in out.choices] == ["The sea is"] * 2
    assert {c.finish_reason for c in out.choices} == {"length"}
    lp = out.choices[1].logprobs
    assert len(lp.tokens) == len(ids["prompt_token_ids"]) and lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(scored, abs=1e-5)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids["prompt_token_ids"]), 0)
    fields = {"model": model, "prompt": "The sea is", "max_tokens": 0, "echo": True, "stream": True}
    chunks = list(oai.completions.create(**fields, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "The sea is"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=model, prompt="The sea is", max_tokens=0)
    assert err.value.body["param"] == "max_tokens"


def test_a_schema_the_library_rejects_is_a_failed_job_and_a_bad_response_format_a_400(served, oai, redis_url):
    worker, _, model = served
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=model, messages=MESSAGES, response_format={"type": "xml"})
    assert err.value.body["param"] == "response_format.type"
    client = Client(redis_url, queue=worker.queue)
    bad = client.submit(prompt="x", structured_outputs={"json": {"type": "frobnicate"}})
    good = client.submit(prompt="x", max_tokens=5, structured_outputs={"regex": "[a-z]{3}"})
    with pytest.raises(JobFailed, match=r"invalid structured output.*frobnicate"):
        bad.result(timeout=60)
    assert len(good.result(timeout=60)["text"]) == 3


def test_n_samples_through_the_queue_the_stream_and_the_server(served, oai, redis_url):
    worker, _, model = served
    job = Client(redis_url, queue=worker.queue).submit(prompt="The sea", max_tokens=8, temperature=1.0, seed=3, n=3)
    result = job.result(timeout=60)
    choices = result["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2] and len({c["text"] for c in choices}) > 1
    assert (result["text"], result["token_ids"]) == (choices[0]["text"], choices[0]["token_ids"])
    assert result["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)
    for c in choices:  # each sample's events add up to it, in the stream and in stream(index=)
        assert "".join(job.stream(timeout=10, index=c["index"])) == c["text"]
        ids = [t for e in job.events(timeout=10) if e.get("index", 0) == c["index"] for t in e["token_ids"]]
        assert ids == c["token_ids"]
    fields = {"model": model, "max_tokens": 8, "temperature": 1.0, "seed": 3, "n": 3}
    chat = oai.chat.completions.create(messages=MESSAGES, **fields)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    pieces: dict[int, str] = {}
    ends = {}
    for chunk in oai.chat.completions.create(messages=MESSAGES, stream=True, **fields):
        for c in chunk.choices:
            pieces[c.index] = pieces.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                ends[c.index] = c.finish_reason
    assert pieces == {c.index: c.message.content for c in chat.choices}
    assert ends == {c.index: c.finish_reason for c in chat.choices}


def test_a_sample_that_ends_before_the_others_ends_at_once_in_its_events_and_the_stream(
    served, oai, redis_url, monkeypatch
):
    """OpenAI streams a choice's finish_reason when that choice ends. A sample of n ending first had its end only
    with the job's: now its last event says so (``sample_finish_reason``) and the stream ends its choice there."""
    worker, _, model = served
    # Seed 2: a sample stops at 5 tokens, the others run 43 steps of 50 ms on: over 2 s in which the followers, started
    # after the submit (a thread's event loop and client among them), read the status at the early sample's end.
    slow_engine_steps(monkeypatch, worker.worker.engine, 0.05)
    fields = {"prompt": "The sea", "max_tokens": 48, "temperature": 1.0, "seed": 2, "n": 3, "stop": ["z"]}
    job = Client(redis_url, queue=worker.queue).submit(**fields)
    followed: dict[tuple[str, int], tuple[str, str]] = {}  # (client, sample): its text, the job's status at its end

    def follow(i: int) -> None:
        followed["sync", i] = ("".join(job.stream(timeout=60, index=i)), job.status())

    async def follow_async(i: int) -> None:
        async with AsyncClient(redis_url, worker.queue) as client:
            ajob = client.job(job.id)
            followed["async", i] = ("".join([p async for p in ajob.stream(timeout=60, index=i)]), await ajob.status())

    threads = [threading.Thread(target=follow, args=(i,)) for i in range(3)]
    threads.append(threading.Thread(target=lambda: asyncio.run(_gather(follow_async(i) for i in range(3)))))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    result = job.result(timeout=60)
    lengths = [len(c["token_ids"]) for c in result["choices"]]
    early = lengths.index(min(lengths))
    assert lengths.count(min(lengths)) == 1 and min(lengths) < max(lengths)  # one sample ends first
    events = list(job.events(timeout=10))
    ended: dict[int, str] = {}
    for event in events:
        assert event.get("index", 0) not in ended  # nothing of a sample after its end
        if "sample_finish_reason" in event:
            ended[event.get("index", 0)] = event["sample_finish_reason"]
    assert next(iter(ended)) == early and len(ended) == 2  # every sample but the one whose end is the job's
    assert all(result["choices"][i]["finish_reason"] == reason for i, reason in ended.items())
    [last] = {0, 1, 2} - ended.keys()  # the sample whose end is the job's
    assert len(followed) == 6
    for (_, i), (text, status) in followed.items():  # stream(index=) returns at its sample's end, not the job's
        assert text == result["choices"][i]["text"]
        assert status == {early: "started", last: "finished"}.get(i, status)
    order = [
        (c.index, c.finish_reason, c.text)
        for chunk in oai.completions.create(model=model, stream=True, **fields)
        for c in chunk.choices
    ]
    finish_at = {i: k for k, (i, reason, _) in enumerate(order) if reason}
    assert finish_at[early] < max(k for k, (_, _, text) in enumerate(order) if text)  # before the others' last text
    assert {i: order[k][1] for i, k in finish_at.items()} == {c["index"]: c["finish_reason"] for c in result["choices"]}


async def _gather(calls) -> None:
    await asyncio.gather(*calls)


def _submits_with_the_first_caller_gone(redis_url: str, queue: str) -> tuple[list[str], list[str]]:
    """Three submits batched together; the first caller is cancelled (its client left) while the batch is enqueued.
    The other two's job ids, and the queue's once the client closed."""

    async def main():
        async with AsyncClient(redis_url, queue) as client:
            enqueue = client.sync.submit_many

            def slowly(requests):  # the batch takes a while to go in: the cancel lands meanwhile
                time.sleep(0.2)
                return enqueue(requests)

            client.sync.submit_many = slowly
            calls = [asyncio.create_task(client.submit(f"p{i}", max_tokens=4)) for i in range(3)]
            await asyncio.sleep(0.05)
            calls[0].cancel()
            _, waiting = await asyncio.wait(calls[1:], timeout=10)
            assert not waiting, "the others' submits never returned"
            return [call.result().id for call in calls[1:]]

    kept = asyncio.run(main())
    return kept, Client(redis_url, queue=queue).queue.job_ids


def test_a_caller_cancelled_while_its_submit_goes_in_leaves_the_others_theirs(redis_url):
    """The other two get their jobs; the cancelled caller's job, which no one can follow, is canceled."""
    queue = f"cancelled-submit-{uuid.uuid4().hex[:6]}"
    kept, queued = _submits_with_the_first_caller_gone(redis_url, queue)
    assert queued == kept
    [gone] = Client(redis_url, queue=queue).queue.canceled_job_registry.get_job_ids()
    assert gone not in kept


def test_a_cancel_that_fails_for_a_left_caller_leaves_the_batchs_other_callers_their_jobs(redis_url, monkeypatch):
    """As above, but the cancel of the left caller's job fails (Redis went away just then): the callers after it
    in the batch still get their jobs."""

    def refused(self) -> bool:
        raise redis.exceptions.ConnectionError("Redis is gone")

    monkeypatch.setattr(GenerationJob, "cancel", refused)
    kept, queued = _submits_with_the_first_caller_gone(redis_url, f"failed-cancel-{uuid.uuid4().hex[:6]}")
    assert len(queued) == 3 and set(kept) < set(queued)  # the left caller's job stays queued: nobody could cancel it


def _three_async_submits(redis_url: str, queue_name: str, second_id: str, third_id: str) -> list:
    """Three AsyncClient submits batched together (p0 with no id, p1 and p2 with these): their jobs or errors."""

    async def main():
        async with AsyncClient(redis_url, queue_name) as client:
            calls = [client.submit("p0", max_tokens=4), client.submit("p1", max_tokens=4, job_id=second_id)]
            calls.append(client.submit("p2", max_tokens=4, job_id=third_id))
            return await asyncio.gather(*calls, return_exceptions=True)

    return asyncio.run(main())


def test_a_bad_job_id_fails_its_own_async_submit_not_the_batch_sent_with_it(redis_url):
    from producer.job_errors import InvalidRequest

    queue_name = f"bad-id-{uuid.uuid4().hex[:6]}"
    first, bad, good = _three_async_submits(redis_url, queue_name, "bad id!", "good-id")
    assert isinstance(bad, InvalidRequest) and "Job ID" in str(bad)
    assert Client(redis_url, queue=queue_name).queue.job_ids == [first.id, good.id] and good.id == "good-id"


def test_two_async_submits_of_one_job_id_go_in_one_after_the_other_and_the_second_alone_is_refused(redis_url):
    """Sent in one batch they failed every submission with it ("request 2: job id 'same' is given twice"), the one
    that named no id too; as with two ``Client.submit`` calls, the second comes after the first, and finds the id
    taken by a job still queued."""
    from producer.job_errors import InvalidRequest

    queue_name, same = f"same-id-{uuid.uuid4().hex[:6]}", f"same-{uuid.uuid4().hex[:6]}"
    first, one, two = _three_async_submits(redis_url, queue_name, same, same)
    assert not isinstance(first, Exception) and not isinstance(one, Exception) and one.id == same, (first, one)
    assert isinstance(two, InvalidRequest) and f"{same!r} is taken by a job that is queued" in str(two)
    queue = Client(redis_url, queue=queue_name).queue
    assert queue.job_ids == [first.id, same]
    assert queue.fetch_job(same).kwargs["prompt"] == "p1"  # the first submission's, not written over


def test_an_async_submit_of_a_job_id_a_live_job_holds_fails_alone_not_the_submits_batched_with_it(redis_url):
    """One batch: a submit naming the id of a job still queued failed every submission sent with it, those that
    named no id too, with an error about someone else's id; nothing of theirs went in."""
    from producer.job_errors import JobIdTaken

    queue_name, held, fresh = f"held-id-{uuid.uuid4().hex[:6]}", f"held-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    Client(redis_url, queue=queue_name).submit("already here", max_tokens=4, job_id=held)
    first, refused, third = _three_async_submits(redis_url, queue_name, held, fresh)
    assert isinstance(refused, JobIdTaken) and refused.job_ids == [held] and f"{held!r} is taken" in str(refused)
    assert not isinstance(first, Exception) and not isinstance(third, Exception) and third.id == fresh
    assert Client(redis_url, queue=queue_name).queue.job_ids == [held, first.id, fresh]


def test_an_async_submit_cancelled_as_its_job_went_in_cancels_that_job(redis_url):
    """A caller cancelled after its job was enqueued but before it woke (a timeout around ``submit``, a server's
    shutdown) never learned the job's id: the job ran to its end for nobody. It is canceled."""
    queue_name = f"left-{uuid.uuid4().hex[:6]}"

    async def main() -> None:
        async with AsyncClient(redis_url, queue_name) as client:
            second: asyncio.Task | None = None

            async def first() -> None:
                await client.submit("one", max_tokens=4)
                second.cancel()  # in the loop turn the batch's futures were resolved in: before the second woke

            one = asyncio.create_task(first())
            second = asyncio.create_task(client.submit("two", max_tokens=4))
            await one
            with pytest.raises(asyncio.CancelledError):
                await second

    asyncio.run(main())
    queue = Client(redis_url, queue=queue_name).queue
    [left] = queue.canceled_job_registry.get_job_ids()
    assert queue.fetch_job(left).kwargs["prompt"] == "two" and queue.fetch_job(left).get_status() == "canceled"
    assert len(queue.job_ids) == 1  # (the first, still queued: no worker serves this queue)


def test_an_async_submit_many_cancelled_while_its_jobs_go_in_cancels_them(redis_url, monkeypatch):
    """``submit_many``'s thread went on after its caller was cancelled: its jobs ran to their ends for nobody (a
    cancelled ``submit``'s were canceled)."""
    import threading

    queue_name = f"left-many-{uuid.uuid4().hex[:6]}"
    going_in = threading.Event()

    async def main() -> None:
        async with AsyncClient(redis_url, queue_name) as client:
            submit_many = client.sync.submit_many

            def slow_submit_many(requests):
                going_in.set()
                time.sleep(0.3)  # (the caller is cancelled meanwhile)
                return submit_many(requests)

            monkeypatch.setattr(client.sync, "submit_many", slow_submit_many)
            task = asyncio.create_task(client.submit_many([{"prompt": f"p{i}", "max_tokens": 4} for i in range(3)]))
            while not going_in.is_set():
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(100):  # (the thread ends, then its jobs are canceled)
                if len(Client(redis_url, queue=queue_name).queue.canceled_job_registry.get_job_ids()) == 3:
                    break
                await asyncio.sleep(0.05)

    asyncio.run(main())
    queue = Client(redis_url, queue=queue_name).queue
    assert len(queue.canceled_job_registry.get_job_ids()) == 3 and queue.job_ids == []


def test_an_async_submit_cancelled_before_its_batch_went_in_enqueues_nothing(redis_url):
    """A caller cancelled while its request still waited for the batch (a timeout around ``submit``): it went in
    anyway, then was canceled, its prompt kept for the result TTL and its id pushed to its completion list."""
    queue_name = f"gone-{uuid.uuid4().hex[:6]}"

    async def main() -> None:
        async with AsyncClient(redis_url, queue_name) as client:
            gone = asyncio.create_task(client.submit("one", max_tokens=4, notify=queue_name))
            await asyncio.sleep(0)  # (in the waiting list, the batch not sent yet)
            gone.cancel()
            with pytest.raises(asyncio.CancelledError):
                await gone
            await client.submit("two", max_tokens=4)

    asyncio.run(main())
    queue = Client(redis_url, queue=queue_name).queue
    assert [queue.fetch_job(j).kwargs["prompt"] for j in queue.job_ids] == ["two"]
    assert queue.canceled_job_registry.get_job_ids() == []
    assert not queue.connection.exists(f"roseinfer:done:{queue_name}")


def test_a_failed_requests_job_is_kept_as_long_as_a_finished_ones_not_rqs_year(served, redis_url):
    """Each request the worker refused kept its job hash, payload and all, for RQ's year: any caller of the API
    could fill Redis with them (1,000 requests of 4 MB: 3 GB pinned, every write refused under noeviction)."""
    from redis import Redis

    _, server, model = served
    body = {"model": model, "prompt": [10**9], "max_tokens": 2}  # (a token id past the model's table)
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    ttl = Redis.from_url(redis_url).ttl(f"rq:job:{reply.headers['x-roseinfer-job-id']}")
    assert 0 < ttl <= 24 * 3600


def test_a_max_tokens_past_the_context_is_a_400_from_the_server_but_cut_in_the_queue(served, oai, redis_url):
    """As OpenAI's and vLLM's servers: a prompt plus an explicit max_tokens (max_completion_tokens, max_output_tokens,
    or the legacy default of 16) past the model's context is a 400 naming both, streamed or not. A queue job keeps
    vLLM's offline behaviour: cut at the context (finish_reason length). The error has OpenAI's code and names the
    field to shorten, which clients read to trim a conversation and retry."""
    worker, _, model = served
    length = worker.worker.engine.max_model_len
    prompt_ids = [10 + i % 100 for i in range(length - 3)]  # room for 3 tokens
    for kwargs in ({"max_tokens": 4}, {"max_tokens": 4, "stream": True}, {}):
        with pytest.raises(openai.BadRequestError) as err:
            oai.completions.create(model=model, prompt=prompt_ids, temperature=0, **kwargs)
        wanted = kwargs.get("max_tokens", 16)
        assert f"{len(prompt_ids)} input tokens plus {wanted} 'max_tokens'" in err.value.message
        assert (err.value.code, err.value.param) == ("context_length_exceeded", "prompt")
    for stream in (False, True):  # (named as the request named it: it sent no max_tokens)
        with pytest.raises(openai.BadRequestError, match=f"maximum context length is {length} tokens") as err:
            oai.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=length, stream=stream)
        assert (err.value.code, err.value.param) == ("context_length_exceeded", "messages")
        assert f"plus {length} 'max_completion_tokens'" in err.value.message
    for stream in (False, True):  # (in the Responses API's words: it has no max_tokens)
        with pytest.raises(openai.BadRequestError, match=f"maximum context length is {length} tokens") as err:
            oai.responses.create(model=model, input="Hi", max_output_tokens=length, stream=stream)
        assert (err.value.code, err.value.param) == ("context_length_exceeded", "input")
        assert f"plus {length} 'max_output_tokens'" in err.value.message
    fits = oai.completions.create(model=model, prompt=prompt_ids, max_tokens=3, temperature=0, extra_body={
        "ignore_eos": True})  # fmt: skip
    assert fits.usage.completion_tokens == 3
    queued = Client(redis_url, queue=worker.queue).submit(
        prompt_token_ids=prompt_ids, max_tokens=16, temperature=0, ignore_eos=True
    )
    result = queued.result(timeout=60)
    assert result["finish_reason"] == "length" and result["usage"]["completion_tokens"] == 3


def test_a_failed_job_is_a_400_only_when_the_job_was_at_fault(served, oai, redis_url):
    """The worker says whose fault a failure was (``error_type``): a prompt longer than the model allows is the
    request's (400, as vLLM answers it); a job past its own timeout is a 504; a failure the worker never explained
    (RQ's abandoned job, say) is the server's (500), which the openai client retries."""
    from producer.job_errors import JobCanceled as Canceled
    from producer.job_errors import JobFailed as Failed
    from producer.server_jobs import job_error

    _, _, model = served
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "sea " * 3000}], max_tokens=2)
    assert "this model allows at most" in err.value.message
    assert (err.value.code, err.value.param) == ("context_length_exceeded", "messages")
    with pytest.raises(openai.BadRequestError) as err:  # streamed too: the status comes before any chunk
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "sea " * 3000}], stream=True)
    assert "this model allows at most" in err.value.message and err.value.code == "context_length_exceeded"
    timed_out = Failed("j", "job exceeded its timeout of 1 s", {"error_type": "timeout"})
    assert (job_error(timed_out).status, job_error(timed_out).type) == (504, "timeout")
    assert job_error(timed_out).headers == {"x-should-retry": "false"} == job_error(Canceled("j", "x")).headers
    died = job_error(Failed("j", "AbandonedJobError: the worker died"))
    assert died.status == 500 and died.headers == {}  # the openai client's retry may meet a live worker
    assert died.code is None and job_error(Failed("j", "bad", {"error_type": "invalid_request"})).code is None


def test_a_stream_whose_job_is_canceled_ends_with_an_error_not_a_whole_answer(served, redis_url, slow_steps):
    """A job canceled mid-stream (``roseinfer cancel``, RQ's cancel) ended like a finished answer, with
    ``finish_reason: stop``; without streaming the same job is an error. Now the stream ends with an error too."""
    worker, server, model = served
    body = {"model": model, "messages": MESSAGES, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as reply:
        Client(redis_url, queue=worker.queue).job(reply.headers["x-roseinfer-job-id"]).cancel()
        chunks = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]" and json.loads(chunks[-2])["error"]["message"] == "the job was canceled"
    reasons = [c["finish_reason"] for chunk in chunks[:-2] for c in json.loads(chunk)["choices"]]
    assert not any(reasons)


def test_paths_and_methods_the_server_lacks_answer_in_openais_shape(served):
    _, server, _ = served
    missing = httpx.get(f"{server.url}/v1/nothing-here", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"
    wrong = httpx.get(f"{server.url}/v1/chat/completions", timeout=10)
    assert wrong.status_code == 405 and wrong.json()["error"]["message"] == "Method Not Allowed"
    assert wrong.headers["allow"] == "POST"


def test_a_burst_of_requests_reads_the_live_workers_once():
    import asyncio

    from producer.server import Workers

    class Fleet:
        reads = 0

        async def workers(self):
            Fleet.reads += 1
            await asyncio.sleep(0.05)  # a few round trips
            return [{"name": "w", "model": "m"}]

    async def burst():
        workers = Workers(Fleet())
        return await asyncio.gather(*(workers.models() for _ in range(64)))

    assert asyncio.run(burst()) == [["m"]] * 64 and Fleet.reads == 1


def test_a_redis_that_does_not_answer_is_a_503_in_openais_shape():
    gone = ServerThread("redis://127.0.0.1:1/0", "anything")  # (nothing listens on 1)
    try:
        for method, path, body in [("GET", "/v1/models", None), ("POST", "/v1/chat/completions", {"model": "m"})]:
            body = {"model": "m", "messages": MESSAGES} if body else None
            response = httpx.request(method, f"{gone.url}{path}", json=body, timeout=30)
            assert response.status_code == 503, (path, response.text)
            assert "Redis" in response.json()["error"]["message"]
    finally:
        gone.stop()


def test_request_metrics_are_labelled_by_endpoint_not_by_any_path_a_client_sends(served):
    from prometheus_client.parser import text_string_to_metric_families

    _, server, _ = served
    for i in range(5):
        httpx.get(f"{server.url}/made-up/{i}", timeout=10)
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    endpoints = {
        s.labels["endpoint"]
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if "endpoint" in s.labels
    }
    assert "other" in endpoints and not any(e.startswith("/made-up") for e in endpoints)


def test_a_stream_that_goes_quiet_past_the_server_timeout_ends_with_a_timeout_error_and_cancels_its_job(
    served, redis_url, monkeypatch
):
    """--timeout counts from a stream's last token, as a client's read timeout does (OpenAI and vLLM cut no stream
    that goes on): one whose tokens keep coming runs past it to its end; one that goes quiet ends in a timeout."""
    worker, _, model = served
    engine = worker.worker.engine
    real_step, steps = engine.step, []

    def step(*args, **kwargs):  # 20 ms a step; after 40 steps, 3.5 s a step
        steps.append(1)
        time.sleep(0.02 if len(steps) <= 40 else 3.5)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(engine, "step", step)
    # (2 s: a loaded machine's first token comes within, and no 20 ms step of the steady stream takes as long)
    impatient = ServerThread(redis_url, worker.queue, timeout=2.0)
    try:
        body = {"model": model, "messages": MESSAGES, "stream": True, "ignore_eos": True}
        url = f"{impatient.url}/v1/chat/completions"
        with httpx.stream("POST", url, json={**body, "max_tokens": 30}, timeout=30) as response:
            steady = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        with httpx.stream("POST", url, json={**body, "max_tokens": 200}, timeout=30) as response:
            job_id = response.headers["x-roseinfer-job-id"]
            chunks = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    finally:
        impatient.stop()
    assert json.loads(steady[-2])["choices"][0]["finish_reason"] == "length"  # ~0.6 s of tokens, 20 ms apart: not cut
    assert chunks[-1] == "[DONE]"
    error = json.loads(chunks[-2])["error"]
    assert error["type"] == "timeout" and "no new token within 2 s" in error["message"]
    assert any(json.loads(c)["choices"][0]["delta"].get("content") for c in chunks[:-2])  # text came first
    _canceled_and_left(worker, redis_url, job_id)


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]


def _streamed_calls(stream) -> tuple[dict[int, dict], set]:
    """The tool calls of a streamed chat's one choice, put together as the official client's users do; its finish
    reasons."""
    calls: dict[int, dict] = {}
    reasons = set()
    for chunk in stream:
        for choice in chunk.choices:
            assert choice.delta.content in (None, "")
            reasons.add(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": delta.id, "name": delta.function.name, "arguments": ""})
                call["arguments"] += delta.function.arguments or ""
    return calls, reasons - {None}


def test_a_named_function_call_is_its_schemas_job_streamed_and_not(served, oai, redis_url):
    """tool_choice naming a function: the job is the one constrained to its parameters (the tools told to the
    template), its text the call's arguments; streamed, the call comes first and its arguments piece by piece."""
    import jsonschema

    worker, _, model = served
    named = {"type": "function", "function": {"name": "get_weather"}}
    ask = {
        "model": model,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": named,
        "max_tokens": 40,
        "temperature": 0,
    }
    out = oai.chat.completions.create(**ask)
    [choice] = out.choices
    assert choice.message.content is None and choice.finish_reason == "stop"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    job = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 40, "temperature": 0.0}
    expected = direct(redis_url, worker.queue, **job, structured_outputs={"json": WEATHER})
    assert call.function.arguments == expected["text"]
    assert out.usage.completion_tokens == expected["usage"]["completion_tokens"]
    calls, reasons = _streamed_calls(oai.chat.completions.create(**ask, stream=True))
    assert list(calls) == [0] and reasons == {"stop"}
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == call.function.arguments


def test_required_tool_calls_are_read_from_the_output_streamed_and_not_and_go_back_into_the_conversation(
    served, oai, redis_url
):
    worker, _, model = served
    ask = {"model": model, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "temperature": 0}
    out = oai.chat.completions.create(**ask, max_tokens=120)
    [choice] = out.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None  # (OpenAI's and vLLM's)
    calls = choice.message.tool_calls
    assert calls and all(c.function.name in ("get_weather", "now") for c in calls)
    job = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 120, "temperature": 0.0}
    from producer.tool_calls import ToolChoice

    expected = direct(
        redis_url, worker.queue, **job, structured_outputs={"json": ToolChoice.of(TOOLS, "required").schema()}
    )
    array = json.loads(expected["text"])
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (c["name"], c["parameters"]) for c in array
    ]
    streamed, reasons = _streamed_calls(oai.chat.completions.create(**ask, max_tokens=120, stream=True))
    assert reasons == {"tool_calls"} and list(streamed) == list(range(len(calls)))
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == [
        (c.function.name, c.function.arguments) for c in calls
    ]
    # parallel_tool_calls false: one call
    one = oai.chat.completions.create(**ask, max_tokens=120, parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1
    # The answer goes back into the conversation with the tools' results, as an agent's loop sends it.
    results = [{"role": "tool", "content": "12:00", "tool_call_id": c.id} for c in calls]
    follow = [*MESSAGES, choice.message.model_dump(exclude_none=True), *results]
    again = oai.chat.completions.create(model=model, messages=follow, tools=TOOLS, tool_choice="none", max_tokens=5)
    assert again.choices[0].message.tool_calls is None and again.usage.prompt_tokens > out.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="needs a parser"):
        oai.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=5)


def test_the_responses_api_is_the_chat_job_streamed_and_not(served, oai, redis_url):
    """OpenAI's Responses API through the official client: the same job as a chat's (instructions a system
    message), its text whole and as typed events (the client's own stream helper reads them), incomplete where
    max_output_tokens cut it, tool calls as function_call items that go back as input."""
    worker, _, model = served
    ask = {"model": model, "instructions": "Be brief.", "input": "Tell me about the sea", "temperature": 0}
    out = oai.responses.create(**ask, max_output_tokens=12)
    chat = [{"role": "system", "content": "Be brief."}, *MESSAGES]
    expected = direct(redis_url, worker.queue, messages=chat, max_tokens=12, temperature=0.0)
    assert out.id.startswith("resp_") and out.output_text == expected["text"]
    assert out.usage.output_tokens == expected["usage"]["completion_tokens"]
    assert out.usage.input_tokens == expected["usage"]["prompt_tokens"]
    assert expected["finish_reason"] == "length"  # (12 tokens of a random model)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    events = list(oai.responses.create(**ask, max_output_tokens=12, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == f"response.{out.status}"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == out.output_text
    assert events[-1].response.output_text == out.output_text
    # The client's stream helper wants response.completed: an output that ends by itself (a random model's does
    # where a schema ends it).
    fmt = {"format": {"type": "json_schema", "name": "weather", "schema": WEATHER}}
    with oai.responses.stream(**ask, max_output_tokens=60, text=fmt) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and json.loads(final.output_text)["unit"] in ("c", "f")
    # Tool calls: "required" as function_call items, whole and streamed alike; they go back with their outputs.
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    calls = {"input": "Weather?", "tools": tools, "tool_choice": "required", "parallel_tool_calls": False}
    out = oai.responses.create(model=model, **calls, temperature=0, max_output_tokens=60)
    [call] = out.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("chatcmpl-tool-")
    streamed = list(oai.responses.create(model=model, **calls, temperature=0, max_output_tokens=60, stream=True))
    [item] = [e.item for e in streamed if e.type == "response.output_item.done"]
    assert (item.name, item.arguments) == (call.name, call.arguments)
    back = [{"role": "user", "content": "Weather?"}, call, {"type": "function_call_output", "call_id": call.call_id,
                                                            "output": "Rain"}]  # fmt: skip
    again = oai.responses.create(model=model, input=back, tools=tools, tool_choice="none", max_output_tokens=4)
    assert again.usage.input_tokens > out.usage.input_tokens
    with pytest.raises(openai.BadRequestError, match="not stored here"):
        oai.responses.create(model=model, input="Hi", previous_response_id=out.id)
    # The output text's logprobs (include), as the chat's of the same job; streamed, each delta's tokens'.
    lp = {"model": model, "input": "Tell me about the sea", "max_output_tokens": 6, "temperature": 0, "top_logprobs": 2,
          "include": ["message.output_text.logprobs"]}  # fmt: skip
    whole = oai.responses.create(**lp).output[0].content[0]
    chat_lp = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
                                          top_logprobs=2).choices[0].logprobs.content  # fmt: skip
    assert [t.model_dump() for t in whole.logprobs] == [t.model_dump() for t in chat_lp] and len(chat_lp) == 6
    assert "".join(t.token for t in whole.logprobs) == whole.text
    deltas = [e for e in oai.responses.create(**lp, stream=True) if e.type == "response.output_text.delta"]
    assert [t.model_dump() for e in deltas for t in e.logprobs] == [t.model_dump() for t in whole.logprobs]
    for stream in (False, True):  # a job the worker refuses (a prompt past the context) is the request's 400
        with pytest.raises(openai.BadRequestError, match="at most 255 prompt tokens"):
            oai.responses.create(model=model, input="sea " * 400, stream=stream)


def test_a_final_message_continued_through_the_server_is_the_jobs(served, oai, redis_url):
    """vLLM's continue_final_message (extra_body): the answer goes on from the assistant's words given, the job's
    prompt being the template's with that message left open."""
    from transformers import AutoTokenizer

    worker, _, model = served
    messages = [{"role": "user", "content": "Tell me about the sea"}, {"role": "assistant", "content": "The sea is"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    out = oai.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0, extra_body=extra)
    expected = direct(redis_url, worker.queue, messages=messages, max_tokens=8, temperature=0.0,
                      continue_final_message=True)  # fmt: skip
    assert out.choices[0].message.content == expected["text"]
    ids = AutoTokenizer.from_pretrained(model).apply_chat_template(
        messages, continue_final_message=True, return_dict=False
    )
    assert out.usage.prompt_tokens == len(ids)
    opened = oai.chat.completions.create(model=model, messages=messages, max_tokens=1, temperature=0)
    assert opened.usage.prompt_tokens > out.usage.prompt_tokens  # (a new turn: its end and the next one's start)
    with pytest.raises(openai.BadRequestError, match="not both"):
        oai.chat.completions.create(
            model=model, messages=messages, max_tokens=1, extra_body={"continue_final_message": True,
                                                                       "add_generation_prompt": True}
        )  # fmt: skip


def test_a_chats_echo_begins_the_answer_with_the_assistants_own_words_streamed_and_not(served, oai, redis_url):
    """vLLM's chat echo, with continue_final_message: the answer is the whole message, the given words first."""
    worker, _, model = served
    messages = [{"role": "user", "content": "Tell me about the sea"}, {"role": "assistant", "content": "The sea is"}]
    extra = {"continue_final_message": True, "echo": True}
    out = oai.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0, extra_body=extra)
    expected = direct(redis_url, worker.queue, messages=messages, max_tokens=6, temperature=0.0,
                      continue_final_message=True)  # fmt: skip
    assert out.choices[0].message.content == "The sea is" + expected["text"]
    assert out.usage.completion_tokens == expected["usage"]["completion_tokens"]  # (the echo is no output token)
    stream = oai.chat.completions.create(
        model=model, messages=messages, max_tokens=6, temperature=0, extra_body=extra, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == out.choices[0].message.content
    plain = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3, temperature=0, extra_body=extra)
    assert (
        plain.choices[0].message.content
        == direct(
            redis_url, worker.queue, messages=MESSAGES, max_tokens=3, temperature=0.0, continue_final_message=True
        )["text"]
    )  # (the last message is the user's: nothing to echo)


def test_an_upload_cut_short_is_a_400_not_an_error_in_the_log():
    """A client gone mid-body raised ClientDisconnect out of the body's read: an error's traceback in the server's log
    for each (twenty aborted uploads, 89 kB of log; no key needed for /tokenize)."""
    from starlette.requests import Request

    from producer.openai_api import APIError
    from producer.server import _body

    async def gone() -> dict:
        return {"type": "http.disconnect"}

    request = Request({"type": "http", "method": "POST", "path": "/tokenize", "headers": []}, gone)
    with pytest.raises(APIError, match="the client went away before its request body ended"):
        asyncio.run(_body(request))


def test_a_cancel_that_cannot_reach_redis_is_said_in_one_line(caplog):
    """A server stopped with Redis gone first: each client's cancel failed on its thread, unseen, and asyncio wrote
    "Future exception was never retrieved" with a traceback, one per request."""
    import logging
    import types

    from producer import server_jobs

    def refused() -> None:
        raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    async def cancel() -> None:
        server_jobs.cancel_soon(types.SimpleNamespace(id="gone-1", _sync=types.SimpleNamespace(cancel=refused)))
        while server_jobs.CANCELING:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.01)  # (its callbacks, in turn)

    with caplog.at_level(logging.WARNING, logger=server_jobs.log.name):
        asyncio.run(cancel())
    assert "job gone-1: its cancel did not reach Redis (ConnectionError: Error 111" in caplog.text


def test_a_server_stopped_by_ctrl_c_exits_130_as_the_other_commands_do():
    """uvicorn hands the Ctrl-C back once it has stopped: it was suppressed, and the command exited 0."""
    import signal
    import subprocess
    import sys

    port = free_port()
    cmd = [sys.executable, "-m", "worker.cli", "serve", "--redis-url", "redis://127.0.0.1:1/0", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:  # (up: /health answers, 503 with no Redis)
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "no start"
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
        assert proc.stderr.read().rstrip().endswith("interrupted")
    finally:
        proc.kill()
        proc.wait()
