"""A request's prompt as the engine takes it: text, token ids or a chat (its messages by the model's chat template,
with the template's options as vLLM's chat takes them), tokenized alone or many in one batch; and the tokenizer and
template as documents for readers without the model.

A part of ``LLMEngine`` (a mixin): it uses the engine's ``tokenizer`` and ``model.vocab_size``."""

from __future__ import annotations

import functools
import inspect
import json
import re
from typing import Any

PromptInput = str | list[int] | dict
# A chat prompt's keys: its messages, and the chat template's options beside them (vLLM's chat request's names).
CHAT_KEYS = frozenset(
    ("messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "truncation")
)  # (truncation: the Responses API's "auto", as the tokens its output needs)


class ContextLengthExceeded(ValueError):
    """A request that does not fit the model's context: its prompt, or (asked to be refused, not cut) its prompt
    plus ``max_tokens``. ``code`` is OpenAI's for it, which clients read to shorten a conversation and retry."""

    code = "context_length_exceeded"


class PromptInputs:
    """``LLMEngine``'s prompts (see the module's docstring)."""

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """The most characters one token stands for (its vocabulary entry's length: a byte-level or SentencePiece
        entry has a character per byte, at least one per character of its text); 0 without a tokenizer."""
        return max(map(len, self.tokenizer.get_vocab()), default=0) if self.tokenizer is not None else 0

    def check_chars(self, chars: int) -> None:
        """A text of more characters than the model's context could hold as tokens (at the longest token's length)
        is refused before it is tokenized: a 3.9 MB prompt took 3.3 s of the tokenizing thread to be refused."""
        bound = self.max_model_len * self.longest_token_chars
        if bound and chars > bound:
            raise ContextLengthExceeded(
                f"the prompt has {chars} characters, more than the {self.max_model_len - 1} prompt tokens this model "
                f"allows could hold (at most {self.longest_token_chars} characters a token)"
            )

    def checked_ids(self, ids: list[int] | tuple[int, ...]) -> list[int]:
        """``ids`` as a list, each an integer of the model's vocabulary (else a ValueError)."""
        vocab = self.model.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return list(ids)

    def check_prompt_tokens(self, num_tokens: int) -> None:
        """A prompt of more tokens than the context leaves a token to generate is refused."""
        if num_tokens >= self.max_model_len:
            raise ContextLengthExceeded(
                f"the prompt has {num_tokens} tokens, but this model allows at most "
                f"{self.max_model_len - 1} prompt tokens ({self.max_model_len} in all, with the output)"
            )

    def tokenizer_json(self) -> str | None:
        """The tokenizer as a ``tokenizers`` JSON document (a fast tokenizer's), for readers without the model."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        return backend.to_str() if backend is not None else None

    def chat_template_doc(self) -> str | None:
        """The chat template this engine renders chats with (the operator's, where given) and the special tokens it
        reads (``bos_token`` ...), as JSON, for readers without the model (the server's ``/tokenize`` of messages);
        None for a model without one."""
        template = getattr(self.tokenizer, "chat_template", None)
        if self.tokenizer is None or not template:
            return None
        special = {k: v for k, v in self.tokenizer.special_tokens_map.items() if isinstance(v, str)}
        doc = {"chat_template": template, "special_tokens": special}
        if content_format(template) == "openai":  # (a reader without it joins parts, as for most templates)
            doc["content_format"] = "openai"
        return json.dumps(doc, sort_keys=True)

    def tokenize(self, prompt: PromptInput, tokenizer=None) -> tuple[str | None, list[int]]:
        """(prompt text, token ids) from a string, a list of ids, {"prompt": ...}, {"prompt_token_ids": ...}
        or {"messages": [...]} (chat template applied; beside them the template's options, as vLLM's chat takes them:
        "tools", "add_generation_prompt", "continue_final_message", "chat_template_kwargs").
        {"prompt_token_ids": ..., "prompt": text} is a prompt
        tokenized already (as vLLM's TokensPrompt): the ids are used, the text kept for the output. ``tokenizer``
        replaces the engine's own (a thread that tokenizes beside the step loop brings its own copy)."""
        tokenizer = tokenizer or self.tokenizer
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", *CHAT_KEYS}
            tokenized = set(prompt) == {"prompt", "prompt_token_ids"}
            if unknown or (len(prompt) != 1 and not tokenized and not _is_chat(prompt)):
                raise ValueError(
                    "a prompt dict takes exactly one of 'prompt', 'prompt_token_ids', 'messages' (or "
                    f"'prompt_token_ids' with the 'prompt' they came from, 'messages' with the template's options "
                    f"{sorted(CHAT_KEYS - {'messages'})}); got keys {sorted(prompt)}"
                )
            # (ids under 'prompt' were taken as ids, text under 'prompt_token_ids' encoded, beside its own text)
            if not isinstance(prompt.get("prompt", ""), str):
                raise TypeError(f"'prompt' is a string, not {type(prompt['prompt']).__name__}")
            if not isinstance(prompt.get("prompt_token_ids", []), (list, tuple)):
                raise TypeError(
                    f"'prompt_token_ids' is a list of token ids, not {type(prompt['prompt_token_ids']).__name__}"
                )
            if tokenized:
                return prompt["prompt"], self.tokenize(prompt["prompt_token_ids"])[1]
            if "truncation" in prompt and _is_chat(prompt):
                return None, self.fitted_chat(prompt, tokenizer)
            if "messages" in prompt:
                options = {k: v for k, v in prompt.items() if k != "messages"}
                return None, self.apply_chat_template(prompt["messages"], tokenizer, **options)
            prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt token ids instead of text")
            if not prompt:
                raise ValueError("the prompt is empty")
            self.check_chars(len(prompt))
            return prompt, tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            self.check_prompt_tokens(len(prompt))  # (first: 2M ids took 0.3 s a scan, and the scans were three)
            return None, self.checked_ids(prompt)
        raise TypeError(f"a prompt is a string, a list of token ids or a dict, not {type(prompt).__name__}")

    def tokenize_many(
        self, prompts: list[PromptInput], tokenizer=None
    ) -> list[tuple[str | None, list[int]] | Exception]:
        """``tokenize`` of each prompt, text prompts and chats encoded in one batch (the tokenizer's Rust side
        encodes them in parallel, outside the GIL); a prompt it refuses gets its exception in its place."""
        tokenizer = tokenizer or self.tokenizer
        results: list = [None] * len(prompts)
        batches: dict[bool, list[tuple[int, str, str | None]]] = {True: [], False: []}  # by add_special_tokens
        chats: list[tuple[int, dict]] = []
        for i, prompt in enumerate(prompts):
            try:
                if tokenizer is not None and isinstance(prompt, str) and prompt:
                    self.check_chars(len(prompt))
                    batches[True].append((i, prompt, prompt))
                elif tokenizer is not None and isinstance(prompt, dict) and _is_chat(prompt) and not _truncated(prompt):
                    self._check_chat(tokenizer, **prompt)
                    chats.append((i, prompt))
                else:
                    results[i] = self.tokenize(prompt, tokenizer)
            except Exception as exc:  # this prompt's own fault, reported in its place
                results[i] = exc
        for (i, _), text in zip(chats, _render_chats(tokenizer, [chat for _, chat in chats])):
            if not isinstance(text, Exception):
                try:  # (the template's text, all it shows: 130,000 one-character messages passed the contents' count)
                    self.check_chars(len(text))
                except ContextLengthExceeded as exc:
                    text = exc
            if isinstance(text, Exception):
                results[i] = text
            else:
                batches[False].append((i, text, None))  # as apply_chat_template encodes its text
        for special, items in batches.items():
            if not items:
                continue
            try:
                encoded: list = _encode_batch(tokenizer, [text for _, text, _ in items], special)
            except Exception:  # one text the tokenizer refuses (a lone surrogate): each alone, its fault its own
                encoded = [_encode_alone(tokenizer, text, special) for _, text, _ in items]
            for (i, _, kept), ids in zip(items, encoded):
                results[i] = ids if isinstance(ids, Exception) else (kept, list(ids))
        return results

    def _check_chat(
        self,
        tokenizer,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> None:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template: send a plain prompt instead of messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not _is_content(m.get("content")):
                raise ValueError(f"each message needs a string 'role' and 'content' (text, or text parts), got {m!r}")
            if not isinstance(m.get("name", ""), str):
                raise ValueError(f"a message's 'name' must be a string, got {m['name']!r}")
            if not isinstance(m.get("tool_calls", []), list):
                raise ValueError(f"a message's 'tool_calls' must be a list, got {m['tool_calls']!r}")
        self.check_chars(sum(len(_text_of(m["content"])) for m in messages))
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ValueError(f"tools must be a list of dicts, got {tools!r}")
        if not isinstance(continue_final_message, bool) or not isinstance(add_generation_prompt, (bool, type(None))):
            raise ValueError("add_generation_prompt and continue_final_message are true or false")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message goes on with the last message, add_generation_prompt opens a new "
                             "one: not both")  # fmt: skip
        if chat_template_kwargs is not None:
            if not isinstance(chat_template_kwargs, dict) or not all(isinstance(k, str) for k in chat_template_kwargs):
                raise ValueError(f"chat_template_kwargs must be a dict of names, got {chat_template_kwargs!r}")
            # The call's own arguments are the request's to say: a "chat_template" would run a template of its choosing.
            own = set(inspect.signature(tokenizer.apply_chat_template).parameters)
            if taken := sorted(own & set(chat_template_kwargs)):
                raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)}: those are the request's")

    def fitted_chat(self, chat: dict, tokenizer=None) -> list[int]:
        """A chat's prompt tokens with its earliest turns dropped until its output has the room ``chat["truncation"]``
        asks (tokens) in the model's context (OpenAI's truncation "auto"): its leading system and developer messages
        stay, and what is kept begins at a turn's first message (a user's where it has one). A conversation whose
        last turn alone leaves no such room is refused, as any prompt too long."""
        options = {k: v for k, v in chat.items() if k not in ("messages", "truncation")}
        room, messages = chat["truncation"], chat["messages"]
        if not isinstance(room, int) or isinstance(room, bool) or room < 1:
            raise ValueError(f"truncation is the tokens the output needs, at least 1: not {room!r}")
        if room >= self.max_model_len:  # (max_tokens past the context: as without truncation, the request's length)
            raise ContextLengthExceeded(
                f"max_tokens {room} leaves no room for a prompt: this model's context is {self.max_model_len} tokens"
            )
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        head = next((i for i, m in enumerate(messages) if m.get("role") not in ("system", "developer")), 0)
        starts = [head] + [i for i in range(head + 1, len(messages)) if messages[i].get("role") == "user"]

        def fitted(k: int) -> list[int] | ContextLengthExceeded:  # the prompt kept from the k-th turn on
            try:
                ids = self.apply_chat_template(messages[:head] + messages[starts[k] :], tokenizer, **options)
            except ContextLengthExceeded as exc:  # (its text alone is too long)
                return exc
            if len(ids) + room <= self.max_model_len:
                return ids
            return ContextLengthExceeded(
                f"the prompt has {len(ids)} tokens{' with only its last turn kept' if k else ''}, but this model "
                f"allows at most {self.max_model_len - room} with {room} for the output ({self.max_model_len} in all)"
            )

        whole = fitted(0)
        if not isinstance(whole, Exception):
            return whole
        if len(starts) == 1:
            raise whole
        last = fitted(len(starts) - 1)  # (the least that may be kept; then the most that fits, by halving)
        if isinstance(last, Exception):
            raise last
        lo, hi, best = 1, len(starts) - 1, last  # (fitted(hi) fits: best is its prompt)
        while lo < hi:
            mid = (lo + hi) // 2
            if isinstance(ids := fitted(mid), Exception):
                lo = mid + 1
            else:
                hi, best = mid, ids
        return best

    def apply_chat_template(
        self,
        messages: list[dict],
        tokenizer=None,
        tools: list[dict] | None = None,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> list[int]:
        """The chat's prompt tokens by the model's template, as vLLM's chat renders it: the assistant's turn opened
        after the messages (``add_generation_prompt``, by default unless ``continue_final_message`` leaves the last
        message open to go on with), ``tools`` and the template's own options (``chat_template_kwargs``) given."""
        tokenizer = tokenizer or self.tokenizer
        chat = {
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "chat_template_kwargs": chat_template_kwargs,
        }
        self._check_chat(tokenizer, **chat)
        messages = for_template(tokenizer, messages)
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, **_template_args(chat))
        except Exception as exc:
            raise _refused_by_template(exc) from None
        self.check_chars(len(text))  # (its rendered text, before it is encoded: as ``tokenize_many``'s)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])  # (as the template's own encoding)


def _truncated(chat: dict) -> bool:
    """A chat to be cut to fit (``fitted_chat``): tokenized alone, maybe more than once."""
    return "truncation" in chat


def _is_chat(prompt: dict) -> bool:
    return "messages" in prompt and set(prompt) <= CHAT_KEYS


def _template_args(chat: dict) -> dict:
    """The chat template call's arguments of a chat ``{"messages", <options>}`` (but for its messages)."""
    continuing = bool(chat.get("continue_final_message"))
    opened = chat.get("add_generation_prompt")
    return {
        **(chat.get("chat_template_kwargs") or {}),
        "tools": chat.get("tools"),
        "add_generation_prompt": not continuing if opened is None else opened,
        "continue_final_message": continuing,
    }


def for_template(tokenizer, messages: list[dict]) -> list[dict]:
    """A chat's messages as its template reads them: "developer" as "system" where it does not know the role
    (``developer_as_system``), tool calls' arguments as objects (``calls_as_objects``), content parts as the
    template takes them (``parts_for_template``)."""
    return parts_for_template(tokenizer, calls_as_objects(developer_as_system(tokenizer, messages)))


def _is_content(content: Any) -> bool:
    return isinstance(content, str) or (
        isinstance(content, list)
        and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content)
    )


def _text_of(content: str | list[dict]) -> str:
    return content if isinstance(content, str) else "\n".join(p["text"] for p in content)


def parts_for_template(tokenizer, messages: list[dict]) -> list[dict]:
    """Content given as a list of text parts, as vLLM gives it to the template: the list itself to a template that
    loops over a message's content (Gemma 3's, which joins the parts its own way), else the parts' text joined by
    newlines (a template that prints the content would print the list's Python form)."""
    if not any(isinstance(m, dict) and isinstance(m.get("content"), list) for m in messages):
        return messages
    if content_format(getattr(tokenizer, "chat_template", None)) == "openai":
        return messages
    return [{**m, "content": _text_of(m["content"])} if isinstance(m, dict) and isinstance(m.get("content"), list)
            else m for m in messages]  # fmt: skip


def content_format(template: str | dict | None) -> str:
    """vLLM's detection of a chat template's content format: "openai" where it loops over a message's content (a
    list of parts, itself), else "string"."""
    if isinstance(template, dict):  # (named templates, one picked by the call: a list to one that prints it would
        # show its Python form, where joined parts cost a newline at most)
        return "openai" if template and all(content_format(t) == "openai" for t in template.values()) else "string"
    return _content_format(template) if isinstance(template, str) else "string"


@functools.lru_cache(maxsize=16)
def _content_format(template: str) -> str:
    try:
        import jinja2
        import jinja2.ext
        import jinja2.nodes as nodes

        # (transformers' {% generation %} tag, of assistant masks: a tag jinja2 alone does not know, left out)
        plain = re.sub(r"{%-?\s*(end)?generation\s*-?%}", "", template)
        tree = jinja2.Environment(extensions=[jinja2.ext.loopcontrols]).parse(plain)
    except Exception:  # (no jinja2, or a template of tags it does not know: read as most are)
        return "string"

    def is_content(node: Any, aliases: set[str]) -> bool:
        if isinstance(node, nodes.Getitem):
            return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
        if isinstance(node, nodes.Getattr):
            return node.attr == "content"
        return isinstance(node, nodes.Name) and node.name in aliases

    aliases: set[str] = set()  # ({% set content = message['content'] %})
    for assign in tree.find_all(nodes.Assign):
        if isinstance(assign.target, nodes.Name) and is_content(assign.node, set()):
            aliases.add(assign.target.name)
    loops = (loop.iter.node if isinstance(loop.iter, nodes.Filter) else loop.iter for loop in tree.find_all(nodes.For))
    return "openai" if any(is_content(node, aliases) for node in loops) else "string"


def calls_as_objects(messages: list[dict]) -> list[dict]:
    """OpenAI's tool calls hold their arguments as JSON text; chat templates write them out as an object
    (``tojson``): given as text, the model saw its earlier calls as a quoted, escaped string. Text that is a JSON
    object is given as that object (as vLLM's chat gives it, and the queue's jobs); anything else as it is."""
    if not any(isinstance(m, dict) and m.get("tool_calls") for m in messages):
        return messages
    return [{**m, "tool_calls": [_call_as_object(c) for c in m["tool_calls"]]}
            if isinstance(m, dict) and isinstance(m.get("tool_calls"), list) else m for m in messages]  # fmt: skip


def _call_as_object(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except (ValueError, RecursionError):
        return call
    return {**call, "function": {**function, "arguments": parsed}} if isinstance(parsed, dict) else call


def developer_as_system(tokenizer, messages: list[dict]) -> list[dict]:
    """OpenAI's "developer" messages as "system" ones where the chat template does not know the role (it stands for
    the system's instructions there): Qwen's templates left them out without a word, others showed a header the
    model never saw in training. A template that names the role gets them as they are."""
    template = getattr(tokenizer, "chat_template", None)
    if not any(isinstance(m, dict) and m.get("role") == "developer" for m in messages) or "developer" in str(template):
        return messages
    return [{**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m for m in messages]


def _render_chats(tokenizer, chats: list[dict]) -> list[str | Exception]:
    """Each chat's (``{"messages", <options>}``) prompt text by the chat template: those of messages alone in one
    call (a quarter less time than one call each), or, when the template refuses one of them, one call each, so that
    only that one gets its exception; those with options one call each (a call takes one set of them)."""
    chats = [{**chat, "messages": for_template(tokenizer, chat["messages"])} for chat in chats]
    texts: list[str | Exception | None] = [None] * len(chats)
    plain = [i for i, chat in enumerate(chats) if set(chat) == {"messages"}]
    if plain:
        try:
            rendered = tokenizer.apply_chat_template(
                [chats[i]["messages"] for i in plain], add_generation_prompt=True, tokenize=False
            )
            for i, text in zip(plain, rendered):
                texts[i] = text
        except Exception:
            pass
    for i, chat in enumerate(chats):
        if texts[i] is not None:
            continue
        try:
            texts[i] = tokenizer.apply_chat_template(chat["messages"], tokenize=False, **_template_args(chat))
        except Exception as exc:
            texts[i] = _refused_by_template(exc)
    return texts  # type: ignore[return-value]


def _refused_by_template(exc: Exception) -> Exception:
    """A chat template's own refusal (its ``raise_exception``: "roles must alternate", "System role not supported")
    as the request's fault, a ValueError (a 400, not a 500 with a traceback); any other error as it is."""
    try:
        from jinja2 import TemplateError
    except ImportError:  # (no template was rendered without it)
        return exc
    if isinstance(exc, TemplateError) and not isinstance(exc, ValueError):
        return ValueError(f"the model's chat template refuses these messages: {exc}")
    return exc


def _encode_batch(tokenizer, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """The token ids of ``texts``, as ``tokenizer(texts)`` gives them. A fast tokenizer's Rust side is called
    directly (without offsets), which halves the cost of a burst of short prompts; where its backend truncates or
    pads (the transformers call turns both off first), through the transformers call."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    encode = getattr(backend, "encode_batch_fast", None)
    if encode is None or backend.truncation is not None or backend.padding is not None:
        return tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
    return [e.ids for e in encode(texts, add_special_tokens=add_special_tokens)]


def _encode_alone(tokenizer, text: str, add_special_tokens: bool) -> list[int] | Exception:
    try:
        return _encode_batch(tokenizer, [text], add_special_tokens)[0]
    except Exception as exc:
        return ValueError(f"the tokenizer cannot encode this prompt: {exc}")
