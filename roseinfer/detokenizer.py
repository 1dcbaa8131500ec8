"""Incremental detokenization with stop strings.

A fast tokenizer decodes through the ``tokenizers`` library's ``DecodeStream``: one call in Rust per token, which
holds a token back while it ends inside a multi-byte character (about ten times cheaper than two Python
``decode`` calls a token). Other tokenizers decode a short window of tokens each step: the text of the window
minus the text of its older part is what the new tokens added, and a window ending in U+FFFD waits for the next
token. Either way, text that could still turn into a stop string is held back until it cannot; a stop string
found is cut from the output (unless asked to keep it).
"""

from __future__ import annotations

from roseinfer.sampling_params import SamplingParams

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers before 0.21
    DecodeStream = None

# Prompt tokens kept as left context, so the first output tokens decode with the right spacing; more where those
# begin inside a character (up to _MAX_CONTEXT_TOKENS), as vLLM's detokenizer starts on a character's boundary.
_CONTEXT_TOKENS = 5
_MAX_CONTEXT_TOKENS = 24


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.spaces = params.spaces_between_special_tokens
        self.stop_strings = params.stop_strings
        self.include_stop = params.include_stop_str_in_output
        self._max_stop = max((len(s) for s in self.stop_strings), default=0)
        # As with EOS and stop ids, a stop string ends nothing before min_tokens (as in vLLM): one lying wholly in
        # the text of the first min_tokens tokens never matches, so nothing of it already handed out can be cut.
        self._min_tokens = params.min_tokens
        self._num_tokens = 0  # output tokens taken (resumed ones included)
        self._stop_floor = 0  # the end of the first min_tokens tokens' text: a stop string must end past it
        self._backend = getattr(tokenizer, "backend_tokenizer", None) if DecodeStream is not None else None
        self._ids: list[int] = self._context_of(list(prompt_token_ids))
        self._context_len = len(self._ids)  # the prompt's tokens at the head of ``_ids``; output ones come after
        self._prefix_offset = 0
        # A prompt of token ids may end inside a character: its last bytes wait as an output token's would, so the
        # token that completes the character gives that character (not the prompt's words before it).
        read = len(self._ids)
        while read > len(self._ids) - 3 and read and self._context_text(read).endswith("\ufffd"):
            read -= 1
        self._read_offset = read  # tokens up to here have given their text
        self._stream = None
        if self._backend is not None:
            self._stream = DecodeStream(ids=self._ids[:read], skip_special_tokens=self.skip_special_tokens)
            try:
                for token_id in self._ids[read:]:
                    self._stream.step(self._backend, token_id)  # held: an unfinished character
            except Exception:  # "Invalid prefix" (see ``push``): by windows
                self._stream = None
        self.text = ""  # all text decoded so far (cut at a stop string once found)
        self._emitted = 0  # chars of ``text`` already handed out
        self.stop_hit: str | None = None

    @property
    def output_text(self) -> str:
        """The text handed out: a tail that may still begin a stop string waits (a cumulative output never takes
        back what it showed, as vLLM's); all of it once the request ended (``finish``)."""
        return self.text[: self._emitted]

    def _context_of(self, prompt: list[int]) -> list[int]:
        """The prompt's last tokens, from a character's start: a byte-fallback tokenizer (Llama 2, Mistral, Gemma)
        rendered a context that began inside a character as U+FFFD, and every output byte token after it too (a
        prompt ending in CJK or emoji, an output going on in them, came out as U+FFFD alone). Its last tokens may
        end inside a character (token ids given): they wait, as ``__init__`` reads."""
        for k in range(_CONTEXT_TOKENS, min(len(prompt), _MAX_CONTEXT_TOKENS) + 1):
            suffix = prompt[-k:]
            if any("\ufffd" not in self._context_text(end, suffix) for end in range(k, max(k - 4, 0), -1)):
                return suffix
        return prompt[-_CONTEXT_TOKENS:]  # (a prompt whose own text holds U+FFFD: any start is as good)

    def _context_text(self, end: int, ids: list[int] | None = None) -> str:
        ids = (self._ids if ids is None else ids)[:end]
        if self._backend is not None:  # in Rust: this runs for every request admitted
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self._decode(ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, spaces_between_special_tokens=self.spaces
        )

    def update(self, token_id: int | None, finished: bool = False) -> str:
        """Take one new token (None: nothing new) and return the text now safe to show."""
        self.push(token_id, finished)
        return self._flush(finished)

    def push(self, token_id: int | None, finished: bool = False) -> None:
        """Take one new token (None: nothing new), its text kept for a later ``update``; a stop string in it
        shows in ``stop_hit`` at once."""
        if token_id is not None:
            self._num_tokens += 1
        if token_id is not None and self.stop_hit is None and self._stream is not None:
            self._ids.append(token_id)
            try:
                piece = self._stream.step(self._backend, token_id)
            except Exception:
                # tokenizers' "Invalid prefix": held bytes that are no UTF-8 became U+FFFD under a byte-fallback
                # decoder (Llama 2, Mistral, Gemma) and changed the text before them. It raised out of the step,
                # and at every step after; this request decodes by windows from here (vLLM resets its stream).
                self._stream = None
                self._window_step(finished)
                return
            if piece:
                self._add_text(piece)
            if piece is not None:
                self._read_offset = len(self._ids)
                self._prefix_offset = max(0, self._read_offset - _CONTEXT_TOKENS)
        elif token_id is not None and self.stop_hit is None:
            self._ids.append(token_id)
            self._window_step(finished)
        elif finished and self.stop_hit is None and self._read_offset < len(self._ids) and self._held_output():
            # An unfinished last character, as the decoder renders it (U+FFFD): no stop string is looked for in it
            # (the request already ended otherwise; a match there would cut the text under a "length" reason).
            prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
            self.text += self._decode(self._ids[self._prefix_offset :])[len(prefix_text) :]

    def _held_output(self) -> bool:
        """Whether output tokens are among those held, with text of their own: a prompt of token ids cut inside a
        character held its last bytes, which a request that made no text (aborted while waiting, EOS first) gave
        as its output (U+FFFD)."""
        held = self._ids[max(self._read_offset, self._context_len) :]
        return bool(held) and self._decode(held) != ""

    def _window_step(self, finished: bool) -> None:
        """The text the last token added, from a short window of tokens decoded (held while it ends in U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and (finished or not new_text.endswith("\ufffd")):
            self._add_text(new_text[len(prefix_text) :])
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)

    def prime(self, token_ids: list[int]) -> str:
        """Take tokens generated earlier (a resumed request's output so far) as if they had been streamed: their
        text is the start of the output and is not handed out again. Returns that text."""
        for token_id in token_ids:
            self.update(token_id)
        return self.text[: self._emitted]

    def finish(self) -> str:
        """Everything still held back, once the request is over."""
        return self.update(None, finished=True)

    def _add_text(self, delta: str) -> None:
        old_end = len(self.text)
        self.text += delta
        if self._num_tokens <= self._min_tokens:
            self._stop_floor = len(self.text)
            return
        if not self.stop_strings:
            return
        # The earliest in the text wins, whatever the list's order: the output ends where a stop first appears
        # (OpenAI's meaning; vLLM takes the first of the list that matches anywhere in the new text).
        best: tuple[int, str] | None = None
        for stop in self.stop_strings:
            # It may begin in the text of the first min_tokens tokens (held back: it began a stop string), not lie
            # wholly in it (vLLM's stop_check_offset). Each from where it could begin to end in the new text: from
            # the longest one's start, one stop string of 200,000 characters had every other searched through the
            # whole output at every token.
            pos = self.text.find(stop, max(old_end - len(stop) + 1, self._stop_floor - len(stop) + 1, 0))
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is not None:
            pos, stop = best
            self.text = self.text[: pos + len(stop)] if self.include_stop else self.text[:pos]
            self.stop_hit = stop

    def _flush(self, finished: bool) -> str:
        end = len(self.text)
        if not finished and self.stop_hit is None and not self.include_stop:  # (a stop kept in cuts nothing shown)
            end -= self._held_back()
        end = max(end, self._emitted)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is the start of some stop string."""
        for n in range(min(self._max_stop - 1, len(self.text) - self._emitted), 0, -1):
            tail = self.text[-n:]
            if any(stop.startswith(tail) for stop in self.stop_strings):
                return n
        return 0
