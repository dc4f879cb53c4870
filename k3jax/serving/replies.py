"""A request's choices as the API tracks them (each one engine request, its text and log-probabilities so
far, its chat turn parsed as it streams), the channel their engine-thread callbacks feed, and the OpenAI
response bodies built from them (:class:`Reply`: whole responses and stream chunks)."""

from __future__ import annotations

import asyncio
import time
import uuid

from k3jax.serving.assistant_reply import parse_reply, reply_stream
from k3jax.serving.logprob_fields import CompletionLogprobs, chat_content
from k3jax.serving.logprobs import TokenLogprobs
from k3jax.serving.request import Sequence
from k3jax.serving.text import TextStream


class Channel:
    """Engine-thread callbacks of a request's sequences -> one asyncio queue of (choice index, "token",
    (id, TokenLogprobs or None)) / (choice index, "finish", reason)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def callbacks(self, index: int):
        def on_token(token: int, logprobs: TokenLogprobs | None):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, "token", (token, logprobs)))

        def on_finish(reason: str):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, "finish", reason))
        return on_token, on_finish


class Turn:
    """How a chat request's turns are read back: the chat format's parser (none: plain text), the
    function a named tool_choice allows and the text the prompt started the turn with."""

    def __init__(self, tokenizer, only: str | None, start: str):
        self.tokenizer, self.only, self.start = tokenizer, only, start
        self.parsed = reply_stream(tokenizer) is not None

    def stream(self):
        return reply_stream(self.tokenizer, self.only)

    def parse(self, text: str):
        return parse_reply(self.start + text, self.stream())


class Choice:
    """One sequence of a request: its engine request, its text so far and its tokens' log-probabilities."""

    def __init__(self, index: int, seq: Sequence, text: TextStream, logprobs: CompletionLogprobs | None,
                 turn: Turn | None):
        self.index, self.seq, self.text, self.logprobs = index, seq, text, logprobs
        self.turn = turn  # a chat format with markup: how the turn is parsed
        # the turn parsed into reasoning, content and tool calls as it streams
        self.reply = turn.stream() if turn is not None else None
        self.ids: list[int] = []  # generated ids handed out (no stop token)
        self.entries: list[TokenLogprobs] = []
        self.parts: list[str] = []
        self.finish_reason: str | None = None


class Reply:
    """OpenAI response bodies for one request."""

    def __init__(self, chat: bool, model: str, prompts: list[list[int]], token_ids: bool, tokenizer):
        self.chat, self.model, self.prompts, self.token_ids = chat, model, prompts, token_ids
        self.tokenizer = tokenizer
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _usage(self, choices: list[Choice]) -> dict:
        prompt = sum(len(p) for p in self.prompts)
        generated = sum(len(c.seq.generated) for c in choices)
        return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}

    def echo(self, c: Choice) -> str:
        """The echoed prompt's text."""
        return self.tokenizer.decode(c.seq.prompt)

    def _logprobs(self, c: Choice, ids: list[int], entries: list[TokenLogprobs], prompt: bool):
        """The choice's logprobs field for ``ids`` (completions with ``prompt``: the echoed prompt's)."""
        if self.chat:
            return None if c.seq.params.logprobs is None else {"content": chat_content(self.tokenizer, ids, entries),
                                                                "refusal": None}
        if c.logprobs is None:
            return None
        if prompt:  # (no entries when the request ended before its prefill did)
            return c.logprobs.piece(c.seq.prompt, c.seq.prompt_logprobs or [None] * len(c.seq.prompt))
        return c.logprobs.piece(ids, entries)

    def chunk(self, c: Choice, delta, token_ids=(), entries=(), finish_reason=None, prompt: bool = False) -> dict:
        """A stream chunk of choice ``c``: ``delta`` is text (completions), a delta dict (chat) or None
        (its final chunk); ``prompt``: the echoed prompt."""
        logprobs = self._logprobs(c, list(token_ids), list(entries), prompt) if entries or prompt else None
        if self.chat:
            choice = {"index": c.index, "delta": delta if isinstance(delta, dict) else
                      ({} if delta is None else {"content": delta}), "logprobs": logprobs,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": c.index, "text": delta or "", "logprobs": logprobs, "finish_reason": finish_reason}
        if self.token_ids and (token_ids or prompt):
            choice["token_ids"] = list(c.seq.prompt if prompt else token_ids)
        return self._envelope([choice], chunk=True)

    @staticmethod
    def reply_delta(c: Choice, kind: str, value) -> dict:
        """A chat delta from a parsed turn's event (``ReplyStream.feed``)."""
        if kind == "tool_call":
            return {"tool_calls": [{"index": c.reply.tool_calls.index(value), **value}]}
        return {"reasoning_content" if kind == "reasoning" else "content": value}

    @staticmethod
    def finish_reason(c: Choice, reason: str, text: str | None = None) -> str:
        """``tool_calls`` for a turn that ended (``stop``) with well-formed tool calls."""
        if c.reply is None or reason != "stop":
            return reason
        if text is not None:
            return "tool_calls" if c.turn.parse(text).tool_calls else reason
        return "tool_calls" if c.reply.tool_calls and not c.reply.malformed else reason

    def usage_chunk(self, choices: list[Choice]) -> dict:
        out = self._envelope([], chunk=True)
        out["usage"] = self._usage(choices)
        return out

    def full(self, choices: list[Choice]) -> dict:
        out = []
        for c in choices:
            text = "".join(c.parts)
            if self.chat:
                message = {"role": "assistant", "content": text}
                if c.reply is not None:
                    turn = c.turn.parse(text)
                    message = {"role": "assistant", "content": turn.content or (None if turn.tool_calls else ""),
                               "reasoning_content": turn.reasoning}
                    if turn.tool_calls:
                        message["tool_calls"] = turn.tool_calls
                choice = {"index": c.index, "message": message, "logprobs": self._logprobs(c, c.ids, c.entries, False),
                          "finish_reason": self.finish_reason(c, c.finish_reason, text)}
            else:
                echo = c.seq.params.prompt_logprobs
                logprobs = None
                if c.logprobs is not None:
                    parts = ([self._logprobs(c, [], [], True)] if echo else []) + [
                        self._logprobs(c, c.ids, c.entries, False)]
                    logprobs = {key: sum((p[key] for p in parts), []) for key in parts[0]}
                choice = {"index": c.index, "text": (self.echo(c) if echo else "") + text, "logprobs": logprobs,
                          "finish_reason": c.finish_reason}
            if self.token_ids:
                choice["prompt_token_ids"], choice["token_ids"] = c.seq.prompt, c.ids
            out.append(choice)
        body = self._envelope(out, chunk=False)
        body["usage"] = self._usage(choices)
        return body
