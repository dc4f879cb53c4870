"""OpenAI's ``logprobs`` response fields from the engine's :class:`TokenLogprobs`.

Completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, one entry per token
(with ``echo`` the prompt's tokens first, whose first entry has no log-probability: ``null``);
``top_logprobs[i]`` maps the ``logprobs`` most likely tokens and the token itself to their
log-probabilities, as OpenAI's did. ``text_offset[i]`` is where token i starts in the choice's text
(the echoed prompt included), counted across the chunks of a stream. Chat: ``{"content": [{"token",
"logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}]}``.

A token is shown as its text, or as ``bytes:\\xNN...`` when its bytes are not whole UTF-8 characters
(OpenAI's spelling for such tokens).
"""

from __future__ import annotations

import codecs
from typing import Sequence

from k3jax.serving.logprobs import TokenLogprobs
from k3jax.tokenizer import ByteTokenizer, Tokenizer


def token_bytes(tokenizer, token: int) -> bytes:
    """The bytes a token stands for (a tokenizer without a byte view: its text's UTF-8)."""
    if isinstance(tokenizer, ByteTokenizer):
        return bytes([token])
    if isinstance(tokenizer, Tokenizer):
        return tokenizer.encoding.decode_single_token_bytes(token)
    return tokenizer.decode([token]).encode("utf-8")


def token_text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class CompletionLogprobs:
    """The completions ``logprobs`` object, built in pieces (one per stream chunk) that concatenate
    into the whole; ``text_offset`` runs on from piece to piece."""

    def __init__(self, tokenizer, k: int):
        self.tokenizer, self.k = tokenizer, k
        self._chars = 0  # characters of the choice's text so far
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")  # as the text is decoded

    def piece(self, ids: Sequence[int], entries: Sequence[TokenLogprobs | None]) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entry in zip(ids, entries, strict=True):
            raw = token_bytes(self.tokenizer, token)
            text = token_text(raw)
            out["tokens"].append(text)
            out["text_offset"].append(self._chars)
            self._chars += len(self._utf8.decode(raw))
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(entry.logprob)
            top: dict[str, float] = {}
            for alt, value in zip(entry.top_ids, entry.top_logprobs):
                top.setdefault(token_text(token_bytes(self.tokenizer, alt)), value)
            top.setdefault(text, entry.logprob)  # the token itself is always listed
            out["top_logprobs"].append(top)
        return out


def chat_content(tokenizer, ids: Sequence[int], entries: Sequence[TokenLogprobs]) -> list[dict]:
    """The chat ``logprobs.content`` entries of generated tokens."""
    def item(token: int, logprob: float) -> dict:
        raw = token_bytes(tokenizer, token)
        return {"token": token_text(raw), "logprob": logprob, "bytes": list(raw)}

    return [{**item(token, e.logprob), "top_logprobs": [item(a, v) for a, v in zip(e.top_ids, e.top_logprobs)]}
            for token, e in zip(ids, entries, strict=True)]
