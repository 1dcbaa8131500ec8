"""A chat's prompt tokens on the server, as its job's would be (vLLM's ``/tokenize`` of messages): the worker's chat
template and special tokens (``TEMPLATE_KEY``) rendered by transformers' own template call over the worker's
tokenizer (``TOKENIZER_KEY``), with the options the engine gives the call (``JobRequest.template_args``). No model
is loaded; transformers is needed for its template call (the engine extra)."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from producer.protocol import TEMPLATE_KEY, TOKENIZER_KEY
from producer.schema import JobRequest, joined_text
from producer.token_names import without_limits

if TYPE_CHECKING:
    from producer.aio import AsyncClient


def template_messages(tokenizer: Any, job: JobRequest, content_format: str = "string") -> list[dict[str, Any]]:
    """The job's messages as the engine gives its chat template (``roseinfer.prompts.for_template``, across the
    border): "developer" as "system" where the template does not name that role; content parts joined by newlines
    but for a template that loops over them (``content_format`` "openai", as the worker found it)."""
    messages = job.engine_prompt()["messages"]
    if content_format != "openai":
        messages = [
            {**m, "content": joined_text(m["content"])} if isinstance(m["content"], list) else m for m in messages
        ]
    if "developer" in str(getattr(tokenizer, "chat_template", None)):
        return messages
    return [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]


class ChatRenderer:
    """One worker's tokenizer and chat template, as a transformers tokenizer that renders as the engine's does."""

    def __init__(self, tokenizer_json: str, template_doc: str) -> None:
        try:  # (the server runs without them, but for this: loaded at the first chat tokenized)
            from tokenizers import Tokenizer
            from transformers import PreTrainedTokenizerFast
        except ImportError as exc:
            raise ImportError(f"{exc.name or exc} is not installed") from exc

        doc = json.loads(template_doc)
        self.content_format = doc.get("content_format", "string")  # (a worker before it: "string", as it rendered)
        self.tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=without_limits(Tokenizer.from_str(tokenizer_json)), chat_template=doc["chat_template"],
            **doc["special_tokens"],
        )  # fmt: skip

    def tokenize(self, job: JobRequest, add_special_tokens: bool = False) -> list[int]:
        """The prompt tokens of a chat job (as the engine renders it, then encodes the text)."""
        messages = template_messages(self.tokenizer, job, self.content_format)
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, **job.template_args())
        # (encode_batch lets go of the GIL, encode held it: a 12 MB message stopped the server's event loop 10 s)
        [encoded] = self.tokenizer.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        return encoded.ids


class ChatRenderers:
    """The renderers of the workers' (tokenizer, template) digests, each read from Redis and built once, off the
    event loop (a few MB of JSON, and transformers' import the first time)."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self._built: dict[tuple[str, str], ChatRenderer] = {}
        self._lock = asyncio.Lock()

    async def get(self, tokenizer: str, template: str) -> ChatRenderer:
        """The renderer; LookupError where Redis no longer holds what the worker wrote, ImportError without
        transformers."""
        key = (tokenizer, template)
        async with self._lock:  # (one build for every request that asks meanwhile)
            if key not in self._built:
                connection = self.client.connection
                tokenizer_json = await connection.get(TOKENIZER_KEY.format(digest=tokenizer))
                template_doc = await connection.get(TEMPLATE_KEY.format(digest=template))
                if tokenizer_json is None or template_doc is None:
                    raise LookupError("the worker's tokenizer or chat template is no longer in Redis")
                text = (tokenizer_json.decode(), template_doc.decode())
                self._built[key] = await asyncio.to_thread(ChatRenderer, *text)
            return self._built[key]


def chat_digests(workers: list[dict[str, Any]], model: str) -> tuple[str, str] | None:
    """The tokenizer's and chat template's digests of a live worker serving ``model`` that wrote both to Redis."""
    return next(
        ((w["tokenizer"], w["template"]) for w in workers if w.get("model") == model and w.get("tokenizer")
         and w.get("template")),
        None,
    )  # fmt: skip
