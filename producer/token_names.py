"""Tokens named by their text in OpenAI-shaped logprobs. The server loads no model: a worker writes its tokenizer to
Redis (``TOKENIZER_KEY``, named by the digest in its statistics) and the server reads it once. Where there is none
(a worker that wrote none, ``tokenizers`` not installed), a token goes by its id, ``token_id:N`` (vLLM's form for
``return_tokens_as_token_ids``)."""

from __future__ import annotations

import asyncio
import codecs
import itertools
import logging
import re
from typing import TYPE_CHECKING, Any

from redis import Redis

from producer.protocol import TOKENIZER_KEY

if TYPE_CHECKING:
    from producer.aio import AsyncClient

log = logging.getLogger("roseinfer.server")


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's (GPT-2's, Llama 3's, Qwen's) character for each byte, reversed: printable bytes stand for
    themselves, the others for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = (b for b in range(256) if b not in printable)
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


_BYTE_OF = _byte_level_alphabet()
_FALLBACK_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # (SentencePiece's byte fallback: Llama 2's, Mistral's)


class TokenNames:
    """A token's text (as vLLM's ``decoded_token``: decoded alone, special tokens kept) and its UTF-8 bytes; by id
    without a tokenizer, bytes then None."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def bytes(self, token_id: int) -> list[int] | None:
        """The token's own bytes (OpenAI's ``bytes``: a client joins a character's tokens by them): a token holding
        part of a character decodes alone to U+FFFD, whose bytes are no part of the text."""
        return None if self.tokenizer is None else list(self._raw(token_id))

    def _raw(self, token_id: int) -> bytes:
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._bytes[token_id] = self._own_bytes(token_id)
        return raw

    def _own_bytes(self, token_id: int) -> bytes:
        text = self(token_id)
        if "\ufffd" not in text:
            return text.encode()
        piece = self.tokenizer.id_to_token(token_id) or ""
        if fallback := _FALLBACK_BYTE.fullmatch(piece):
            return bytes([int(fallback[1], 16)])
        if piece and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        return text.encode()

    def offsets(self, token_ids: list[int], start: int = 0) -> list[int]:
        """Each token's place in the text they decode to, from ``start``: a character split over tokens is at the
        token that completes it (the tokens' texts alone counted U+FFFD for each part)."""
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        lengths = (len(decoder.decode(self._raw(t))) for t in token_ids[:-1])
        return list(itertools.accumulate(lengths, initial=start))[: len(token_ids)]


BY_ID = TokenNames()


def digest_of(workers: list[dict[str, Any]], model: str) -> str | None:
    """The digest of the tokenizer a live worker serving ``model`` wrote to Redis (rows of ``Client.workers``)."""
    return next((w["tokenizer"] for w in workers if w.get("model") == model and w.get("tokenizer")), None)


class TokenizerCache:
    """The workers' tokenizers by digest, each read from Redis and parsed once (a few MB of JSON: ~0.1 s, off the
    event loop). A digest whose tokenizer cannot be had names tokens by id, and is tried again a minute later."""

    RETRY_S = 60.0

    def __init__(self, client: AsyncClient) -> None:
        self.client = client  # (its connection is read at the first load: a test's scripted client has none)
        self._names: dict[str, TokenNames] = {}
        self._failed_at: dict[str, float] = {}
        self._loading: dict[str, asyncio.Future] = {}

    async def names(self, digest: str | None) -> TokenNames:
        if not digest:
            return BY_ID
        names = self._names.get(digest)
        if names is not None:
            return names
        loop = asyncio.get_running_loop()
        if loop.time() - self._failed_at.get(digest, -self.RETRY_S) < self.RETRY_S:
            return BY_ID
        if digest not in self._loading:  # one read for every request that asks meanwhile
            self._loading[digest] = asyncio.ensure_future(self._load(digest))
        try:
            return await asyncio.shield(self._loading[digest])
        finally:
            self._loading.pop(digest, None)

    async def _load(self, digest: str) -> TokenNames:
        try:
            text = await self.client.connection.get(TOKENIZER_KEY.format(digest=digest))
            names = await asyncio.to_thread(_parse, digest, text)
        except Exception as exc:  # (ImportError too: a server installed without tokenizers)
            _unavailable(digest, exc)
            self._failed_at[digest] = asyncio.get_running_loop().time()
            return BY_ID
        self._names[digest] = names
        return names


def load_names(connection: Redis, digest: str | None) -> TokenNames:
    """``TokenizerCache.names`` for a synchronous reader, uncached (``roseinfer batch``: once a run and model)."""
    if not digest:
        return BY_ID
    try:
        return _parse(digest, connection.get(TOKENIZER_KEY.format(digest=digest)))
    except Exception as exc:
        _unavailable(digest, exc)
        return BY_ID


def _parse(digest: str, text: bytes | str | None) -> TokenNames:
    from tokenizers import Tokenizer

    if text is None:
        raise LookupError(f"no {TOKENIZER_KEY.format(digest=digest)} in Redis")
    return TokenNames(without_limits(Tokenizer.from_str(text.decode() if isinstance(text, bytes) else text)))


def without_limits(tokenizer: Any) -> Any:
    """``tokenizer`` without the truncation and padding its file may set: the engine encodes with neither (as the
    transformers call vLLM makes), and /tokenize gave 16 of a prompt's 43 ids, or padded it to 64."""
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def _unavailable(digest: str, exc: Exception) -> None:
    log.warning("tokenizer %s unavailable (%s: %s): logprobs name tokens by id", digest, type(exc).__name__, exc)
