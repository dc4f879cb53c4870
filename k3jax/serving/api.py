"""The OpenAI-compatible HTTP API (FastAPI) over an :class:`~k3jax.serving.engine.Engine`.

``POST /v1/completions`` and ``/v1/chat/completions`` (``stream: true`` as server-sent events),
``GET /v1/models``, ``/health`` and ``/metrics`` (Prometheus text). Sampling fields: ``max_tokens``
(chat: also ``max_completion_tokens``; default: the rest of the context), ``temperature`` (default
1, 0 = greedy), ``top_p``, ``stop`` (strings), ``seed``, ``n`` (1 only). Extension (as in vLLM):
``return_token_ids: true`` adds ``prompt_token_ids`` and ``token_ids`` to each choice.

Bad input (malformed JSON, a field of the wrong type, values out of range, a prompt that does not
fit in the context, token ids outside the vocabulary) is answered with HTTP 400 and OpenAI's error
body ``{"error": {"message", "type": "invalid_request_error", "param": <field>, "code"}}``; a full
queue with 503 and ``Retry-After``. A client that goes away (mid-stream or while waiting) cancels
its request, which frees its cache row before the next decode step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Literal

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import ClientDisconnect

from k3jax.serving.engine import Engine, QueueFull, SamplingParams, Sequence
from k3jax.serving.text import TextStream, chat_prompt

RETRY_AFTER_S = 1
# Accepted for compatibility only at their neutral value.
_UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "best_of", "suffix", "logit_bias", "tools", "functions",
                "presence_penalty", "frequency_penalty")


class _Strict(BaseModel):
    # strict: "5" is not an int and 1.5 not an int; unknown fields are ignored, as OpenAI does
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def error_response(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}},
                        status_code=status, headers=headers)


def _param(loc: tuple) -> str:
    """A pydantic error location as a field path: ("messages", 0, "content", ...) -> messages[0].content."""
    out = str(loc[0]) if loc else ""
    for part in loc[1:]:
        if isinstance(part, int):
            out += f"[{part}]"
        elif out.startswith("messages") and part in Message.model_fields:
            out += f".{part}"
        else:
            break  # a union member's name (e.g. "list[int]"), not a field
    return out


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _cancel_on_disconnect(receive, cancel) -> None:
    """Wait for the client to go away, then ``cancel()`` (run as a task beside a response)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    cancel()


class _EngineStream(StreamingResponse):
    """An SSE response that cancels its request when it ends for any reason: the client going away
    while the request waits for its first token (seen by ``receive``) or mid-stream (a failed send)."""

    def __init__(self, content, cancel, **kwargs):
        super().__init__(content, **kwargs)
        self.cancel = cancel

    async def __call__(self, scope, receive, send):
        watcher = asyncio.create_task(_cancel_on_disconnect(receive, self.cancel))
        try:
            await super().__call__(scope, receive, send)
        except (OSError, ClientDisconnect):  # the client left; nothing to answer
            pass
        finally:
            watcher.cancel()
            self.cancel()


class _Channel:
    """Engine-thread callbacks -> an asyncio queue of ("token", id) / ("finish", reason)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def on_token(self, token: int):
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ("token", token))

    def on_finish(self, reason: str):
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ("finish", reason))


def create_app(engine: Engine, tokenizer, model_name: str) -> FastAPI:
    """The FastAPI app serving ``engine`` (started and stopped with the app)."""
    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="k3jax", docs_url=None, redoc_url=None, lifespan=lifespan)
    created = int(time.time())

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "k3jax", "max_model_len": engine.max_len}]}

    @app.get("/metrics")
    async def metrics():
        engine.metrics.gauges(engine.active_count(), engine.queue_length())
        return PlainTextResponse(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _handle(request, chat=True)

    def prepare(req: CompletionRequest | ChatRequest, chat: bool) -> tuple[list[int], SamplingParams, list[str]]:
        """Prompt ids, sampling parameters and stop strings of a validated request (BadRequest)."""
        fields = req.model_extra or {}
        for name in _UNSUPPORTED:
            if fields.get(name) not in (None, False, 0, 0.0, [], {}):
                raise BadRequest(f"'{name}' is not supported by this server", name)
        if req.model is not None and req.model != model_name:
            raise BadRequest(f"the model '{req.model}' does not exist; this server serves '{model_name}'", "model", 404)
        if req.n not in (None, 1):
            raise BadRequest(f"n must be 1, got {req.n}", "n")
        if req.temperature is not None and req.temperature < 0:
            raise BadRequest(f"temperature must be >= 0, got {req.temperature}", "temperature")
        if req.top_p is not None and not 0 < req.top_p <= 1:
            raise BadRequest(f"top_p must be in (0, 1], got {req.top_p}", "top_p")
        max_tokens, max_name = req.max_tokens, "max_tokens"
        if chat and req.max_completion_tokens is not None:
            max_tokens, max_name = req.max_completion_tokens, "max_completion_tokens"
        if max_tokens is not None and max_tokens <= 0:
            raise BadRequest(f"{max_name} must be >= 1, got {max_tokens}", max_name)
        if req.seed is not None and not 0 <= req.seed < 2**63:
            raise BadRequest(f"seed must be in [0, 2^63), got {req.seed}", "seed")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        prompt_name = "messages" if chat else "prompt"
        if chat:
            messages = [{"role": m.role, "content": m.content if isinstance(m.content, str) or m.content is None
                         else "".join(p.text for p in m.content)} for m in req.messages]
            try:
                ids = chat_prompt(tokenizer, [{**m, "content": m["content"] or ""} for m in messages])
            except Exception as e:  # a template that rejects the conversation (e.g. role order)
                raise BadRequest(f"cannot render the chat template: {e}", "messages") from None
        else:
            prompt = req.prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                if len(prompt) != 1:
                    raise BadRequest(f"one prompt per request (n=1, no batches); got {len(prompt)}", "prompt")
                prompt = prompt[0]
            ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            bad = [t for t in ids if not 0 <= t < engine.vocab_size]
            if bad:
                raise BadRequest(f"token id {bad[0]} is outside the vocabulary [0, {engine.vocab_size})", "prompt")
        if not ids:
            raise BadRequest("the prompt is empty", prompt_name)
        if len(ids) >= engine.max_len:
            raise BadRequest(f"the prompt has {len(ids)} tokens; the context is {engine.max_len} tokens "
                             f"(prompt + completion)", prompt_name)
        room = engine.max_len - len(ids)
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise BadRequest(f"{max_name} ({max_tokens}) + the prompt ({len(ids)} tokens) exceeds the context of "
                             f"{engine.max_len} tokens", max_name)
        stops = tuple(getattr(tokenizer, "stop_ids", ())) or (
            (tokenizer.eos_id,) if getattr(tokenizer, "eos_id", None) is not None else ())
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                                top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed, stop_ids=stops)
        return ids, params, stop

    async def _handle(request: Request, chat: bool):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error_response(400, f"the request body is not valid JSON: {e}")
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object")
        try:
            req = (ChatRequest if chat else CompletionRequest).model_validate(body)
            prompt, params, stop = prepare(req, chat)
        except pydantic.ValidationError as e:
            err = e.errors()[0]
            param = _param(err["loc"])
            return error_response(400, f"{param}: {err['msg']}" if param else err["msg"], param or None)
        except BadRequest as e:
            return error_response(e.status, e.message, e.param)
        channel = _Channel(asyncio.get_running_loop())
        seq = Sequence(prompt, params, channel.on_token, channel.on_finish)
        try:
            engine.submit(seq)
        except QueueFull as e:
            engine.metrics.request_done("rejected")
            return error_response(503, f"the server is busy: {e}; retry later", kind="server_overloaded",
                                  headers={"Retry-After": str(RETRY_AFTER_S)})
        except ValueError as e:
            return error_response(400, str(e), "messages" if chat else "prompt")
        reply = _Reply(chat, model_name, prompt, bool(req.return_token_ids))
        text = TextStream(tokenizer, stop)
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return _EngineStream(_stream(seq, channel, text, reply, usage), lambda: engine.cancel(seq),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _collect(request, seq, channel, text, reply)

    async def _events(seq: Sequence, channel: _Channel, text: TextStream):
        """(text delta, token id or None, finish reason or None) until the request ends."""
        while True:
            kind, value = await channel.queue.get()
            if kind == "finish":
                yield text.finish(), None, value
                return
            delta = text.add(value)
            if text.stopped:  # a stop string: the request is complete, free its row now
                engine.cancel(seq, "stop")
                yield delta, value, "stop"
                return
            yield delta, value, None

    async def _stream(seq, channel, text, reply: "_Reply", usage: bool):
        if reply.chat:
            yield _sse(reply.chunk({"role": "assistant", "content": ""}))
        async for delta, token, reason in _events(seq, channel, text):
            if reason == "error":
                yield _sse({"error": {"message": "generation failed", "type": "server_error", "param": None,
                                      "code": None}})
                return
            if delta or (reply.token_ids and token is not None):
                yield _sse(reply.chunk(delta, [token] if token is not None else []))
            if reason is not None:
                yield _sse(reply.chunk(None, [], reason))
        if usage:
            yield _sse(reply.usage_chunk(len(seq.generated)))
        yield "data: [DONE]\n\n"

    async def _collect(request: Request, seq, channel, text, reply: "_Reply"):
        watcher = asyncio.create_task(_cancel_on_disconnect(request.receive, lambda: engine.cancel(seq)))
        parts, ids, reason = [], [], None
        try:
            async for delta, token, reason in _events(seq, channel, text):
                parts.append(delta)
                if token is not None and token not in seq.params.stop_ids:
                    ids.append(token)
        finally:
            watcher.cancel()
            engine.cancel(seq)
        if reason == "error":
            return error_response(500, "generation failed", kind="server_error")
        return reply.full("".join(parts), ids, reason, len(seq.generated))

    return app


class _Reply:
    """OpenAI response bodies for one request."""

    def __init__(self, chat: bool, model: str, prompt: list[int], token_ids: bool):
        self.chat, self.model, self.prompt, self.token_ids = chat, model, prompt, token_ids
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, choice: dict, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": [choice]}

    def _usage(self, generated: int) -> dict:
        return {"prompt_tokens": len(self.prompt), "completion_tokens": generated,
                "total_tokens": len(self.prompt) + generated}

    def chunk(self, delta, token_ids=(), finish_reason=None) -> dict:
        """A stream chunk: ``delta`` is text (completions), a delta dict (chat) or None (final chunk)."""
        if self.chat:
            choice = {"index": 0, "delta": delta if isinstance(delta, dict) else
                      ({} if delta is None else {"content": delta}), "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish_reason}
        if self.token_ids and token_ids:
            choice["token_ids"] = list(token_ids)
        return self._envelope(choice, chunk=True)

    def usage_chunk(self, generated: int) -> dict:
        out = self._envelope({}, chunk=True)
        out["choices"] = []
        out["usage"] = self._usage(generated)
        return out

    def full(self, text: str, token_ids: list[int], finish_reason: str, generated: int) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if self.token_ids:
            choice["prompt_token_ids"], choice["token_ids"] = self.prompt, token_ids
        out = self._envelope(choice, chunk=False)
        out["usage"] = self._usage(generated)
        return out
