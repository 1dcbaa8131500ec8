"""Offline use: ``LLM(model).generate(prompts, params)`` runs the online engine until every prompt is done."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from typing import Any

from tqdm.auto import tqdm

from roseinfer.config import DEFAULT_MODEL, EngineConfig
from roseinfer.llm_engine import LLMEngine, PromptInput
from roseinfer.outputs import RequestOutput
from roseinfer.sampling_params import SamplingParams

log = logging.getLogger("roseinfer.llm")


# vLLM's names of the numeric types, and "auto" (the engine's default), as vLLM's offline code passes them.
_DTYPE_NAMES = {"half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32", "bf16": "bfloat16"}
# vLLM's options that have nothing to do here (one process, one device; no remote code is ever run; the KV cache is
# sized by kv_cache_memory): taken, and said once, so its offline code runs as written.
_VLLM_ONLY = ("trust_remote_code", "gpu_memory_utilization", "swap_space", "disable_log_stats", "tokenizer_mode")
_ONE_ONLY = ("tensor_parallel_size", "pipeline_parallel_size")


def _engine_options(options: dict[str, Any]) -> dict[str, Any]:
    """``LLM``'s keywords as ``EngineConfig`` takes them: vLLM's dtype names and its options of no meaning here."""
    options = dict(options)
    dtype = options.get("dtype")
    if dtype == "auto":
        options.pop("dtype")
    elif isinstance(dtype, str):
        options["dtype"] = _DTYPE_NAMES.get(dtype, dtype)
    elif dtype is not None and str(dtype).startswith("torch."):  # (torch.bfloat16)
        options["dtype"] = str(dtype).removeprefix("torch.")
    for name in _ONE_ONLY:
        if name in options and options.pop(name) != 1:
            raise ValueError(f"{name} must be 1: roseinfer runs a model on one device")
    ignored = [name for name in _VLLM_ONLY if name in options]
    for name in ignored:
        options.pop(name)
    if ignored:
        log.warning("ignored, as nothing here uses them: %s", ", ".join(ignored))
    return options


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_options) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **_engine_options(engine_options)))
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        options = {k: v for k, v in vars(config).items() if k != "model"}
        return cls(config.model, **options)

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine, by vLLM's name for it (``engine`` here)."""
        return self.engine

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Seq[PromptInput],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: None = None,
        priority: Seq[int] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``. A single string (or dict) counts as one prompt; a list of
        ints is one prompt of token ids. ``priority``: each prompt's (lower runs first), as vLLM's;
        ``lora_request`` is vLLM's too, and only None here (no adapters)."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]
        return self._run(list(prompts), sampling_params, use_tqdm, lora_request, priority)

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams`` with the model's recommended settings (its generation config), as vLLM's: what
        ``generate`` and ``chat`` use when given none."""
        return SamplingParams(**self.engine.sampling_defaults)

    def chat(
        self,
        messages: list[dict] | Seq[list[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        tools: list[dict] | None = None,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        lora_request: None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; the chat template is applied to each, as vLLM's
        ``LLM.chat``: given ``tools`` (OpenAI's function definitions) and the template's own options
        (``chat_template_kwargs``); the assistant's turn opened after the messages (``add_generation_prompt``, by
        default unless ``continue_final_message`` leaves the last one open to go on with)."""
        if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Seq):  # ("hello": messages 'h', ...)
            raise TypeError(f"chat takes a list of messages (dicts), or a list of such lists; got {messages!r:.80}")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        for conversation in conversations:
            if isinstance(conversation, (str, bytes, dict)) or not isinstance(conversation, Seq):
                raise TypeError(f"a conversation is a list of messages (dicts), got {conversation!r:.80}")
        options = {
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message or None,
            "chat_template_kwargs": chat_template_kwargs,
        }
        extra = {k: v for k, v in options.items() if v is not None}
        prompts = [{"messages": [_text_message(m) for m in c], **extra} for c in conversations]
        return self._run(prompts, sampling_params, use_tqdm, lora_request)

    def _run(
        self, prompts: list, sampling_params, use_tqdm: bool, lora_request: None = None, priority=None
    ) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(prompts)
        for i, out in self.finished_in_turn(prompts, sampling_params, use_tqdm, lora_request, priority):
            results[i] = out
        return [r for r in results if r is not None]

    def finished_in_turn(
        self, prompts: list, sampling_params, use_tqdm: bool = False, lora_request: None = None, priority=None
    ) -> Iterator[tuple[int, RequestOutput]]:
        """(index, output) for each prompt as it finishes, in the order they finish: for a caller that writes each
        answer out as it comes (``roseinfer generate``), so that Ctrl-C keeps the ones done."""
        if lora_request is not None:
            raise ValueError("LoRA adapters are not supported: lora_request must be None")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(priorities)} priorities")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        # Only the finished outputs are returned: the engine need not build one for every request at every step.
        final: dict[int, SamplingParams] = {}
        params = [final.setdefault(id(p), dataclasses.replace(p, output_kind="final_only")) for p in params]
        order: dict[str, int] = {}
        try:
            for i, (prompt, p, rank) in enumerate(zip(prompts, params, priorities)):
                request_id = f"llm-{next(self._ids)}"
                self.engine.add_request(request_id, prompt, p, priority=rank)
                order[request_id] = i
        except BaseException:
            self._abort(order)
            raise
        pending = set(order)
        try:
            with tqdm(total=len(prompts), desc="generating", unit="req", disable=not use_tqdm) as bar:
                while pending and self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        if out.finished and out.request_id in pending:
                            pending.discard(out.request_id)
                            bar.update(1)
                            yield order[out.request_id], out
        finally:  # Ctrl-C, an error, a caller that stopped reading: this call's requests leave the engine
            self._abort(pending)

    def _abort(self, request_ids) -> None:
        for request_id in request_ids:
            with contextlib.suppress(Exception):  # (cleanup: the error under way is the one to see)
                self.engine.abort_request(request_id)


def _text_message(message: dict) -> dict:
    """A message as the chat template takes it, from OpenAI's forms as vLLM reads them: content as a list of text
    parts (given to the template as the engine gives them: ``parts_for_template``), and an assistant's turn of tool
    calls alone with content None."""
    if not isinstance(message, dict):
        return message  # (the engine says what is wrong with it)
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise ValueError(
                f"a message's content parts must be text parts ({{'type': 'text', 'text': ...}}), got {content!r}"
            )
        return {**message, "content": [{"type": "text", "text": p["text"]} for p in content]}
    if content is None and message.get("role") == "assistant" and message.get("tool_calls"):
        return {**message, "content": ""}
    return message
