"""The OpenAI-compatible HTTP API (FastAPI) over an :class:`~k3jax.serving.engine.Engine`.

``POST /v1/completions`` and ``/v1/chat/completions`` (``stream: true`` as server-sent events),
``GET /v1/models``, ``/health`` and ``/metrics`` (Prometheus text); vLLM's ``POST /tokenize``,
``/detokenize`` and ``GET /tokenizer_info`` (the server's tokenizer, which lm-eval's
``local-completions`` detects and uses: text is encoded as ``/v1/completions`` encodes a text
prompt, special-token spellings as plain text). Sampling fields: ``max_tokens``
(chat: also ``max_completion_tokens``; default: the rest of the context), ``temperature`` (default
1, 0 = greedy), ``top_p``, ``stop`` (strings), ``seed`` (choice j of a request draws with ``seed +
j``), ``n``. Completions take a list of prompts (texts or token-id lists): choice ``i * n + j`` is
sample j of prompt i.

Log-probabilities (``k3jax.serving.logprobs``: the model's, before temperature and top-p;
``k3jax.serving.logprob_fields`` for the fields): completions ``logprobs: k`` (0-20) and ``echo``
(the prompt's text and tokens first; with ``max_tokens: 0`` the request only scores its prompt);
chat ``logprobs: true`` and ``top_logprobs: k``. Streamed too, each chunk with its tokens' entries.

Tools (chat): ``tools``, the history's assistant ``tool_calls`` / ``reasoning_content`` and ``tool``
messages go to the checkpoint's chat format (``k3jax.data.chat.chat_prompt``). A checkpoint in K3's
format (XTML) or with K2 / Kimi Linear's jinja template has its turn parsed back
(``k3jax.serving.assistant_reply``) into ``reasoning_content``, ``content`` and ``tool_calls``
(``finish_reason: tool_calls``), streamed as deltas too; other formats return the raw text.
``tool_choice``: ``auto``, ``none`` (the tools are not offered), ``required`` or a named function
(``{"type": "function", "function": {"name": ...}}``), prompted as the format allows
(``assistant_reply.forced_prefix``); a call of another function than the named one is malformed markup
(plain content, ``finish_reason: stop``). Chat replies stop at the format's end-of-turn tokens
(``k3jax.data.chat.reply_stop_ids``: the transcript's end-of-turn byte for the byte tokenizer).
Extension (as in vLLM): ``return_token_ids: true`` adds ``prompt_token_ids`` and ``token_ids`` to
each choice.

Bad input (malformed JSON, a field of the wrong type, values out of range, a prompt that does not
fit in the context, token ids outside the vocabulary) is answered with HTTP 400 and OpenAI's error
body ``{"error": {"message", "type": "invalid_request_error", "param": <field>, "code"}}``; a full
queue with 503 and ``Retry-After``. A client that goes away (mid-stream or while waiting) cancels
its request, which frees its cache rows before the next decode step.

Overload and shutdown: a body over ``max_body_bytes`` is refused with 413 from its ``Content-Length``
(or as soon as the bytes read pass it), before it is read whole. A stream whose client stops reading
(a send waits more than ``idle_timeout_s``) is cancelled, freeing its rows, and its connection
closed. :meth:`Drain.drain` (the server calls it on SIGTERM / SIGINT) answers new requests with 503
(``Retry-After``, ``Connection: close``) while the running requests finish; those still running at
its deadline end with ``finish_reason: "abort"`` (streams: a last chunk with it, then ``[DONE]``).

With an API key (``create_app(api_key=...)``; ``k3jax.serving.auth``) every request but ``/health`` must
send ``Authorization: Bearer <key>`` (else 401). SGLang's ``POST /start_profile`` (``{"num_steps": N}``,
default 10) traces the engine's next N steps with ``jax.profiler`` (``k3jax.serving.profiling``; 409 while
one is scheduled or running); ``GET /profile`` says where it stands and lists the traces written.

This module holds the app and its handlers; the request bodies and the error body are
``k3jax.serving.api_schemas``'s, the response bodies ``k3jax.serving.replies``', the body limit, the
drain and the event streams ``k3jax.serving.transport``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from k3jax.data.chat import reply_stop_ids
from k3jax.serving.api_schemas import (UNSUPPORTED, BadRequest, ChatRequest, CompletionRequest, DetokenizeRequest,
                                       ProfileRequest, TokenizeRequest, error_response, param_path)
from k3jax.serving.assistant_reply import forced_prefix
from k3jax.serving.auth import RequireApiKey
from k3jax.serving.engine import Engine, QueueFull
from k3jax.serving.logprob_fields import CompletionLogprobs
from k3jax.serving.logprobs import MAX_LOGPROBS
from k3jax.serving.profiling import StepProfiler
from k3jax.serving.replies import Channel, Choice, Reply, Turn
from k3jax.serving.request import SamplingParams, Sequence
from k3jax.serving.text import TextStream, chat_prompt
from k3jax.serving.transport import Drain, EngineStream, PayloadTooLarge, cancel_on_disconnect, read_body, sse

RETRY_AFTER_S = 1
MAX_BODY_BYTES = 16 * 2**20
IDLE_TIMEOUT_S = 60.0


def create_app(engine: Engine, tokenizer, model_name: str, *, max_body_bytes: int = MAX_BODY_BYTES,
               idle_timeout_s: float = IDLE_TIMEOUT_S, api_key: str | None = None,
               profiler: StepProfiler | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` (started and stopped with the app); ``app.state.drain`` is its
    :class:`Drain`. ``api_key``: every request but ``/health`` must carry it (``k3jax.serving.auth``);
    ``profiler``: ``POST /start_profile`` schedules a trace of the engine's next steps with it (it must be
    the engine's ``step_scope``), ``GET /profile`` tells where it stands."""
    drain = Drain()
    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="k3jax", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.drain = drain
    if api_key:
        app.add_middleware(RequireApiKey, api_key=api_key)
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

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return {name: getattr(tokenizer, name, None) for name in ("eos_token", "bos_token", "pad_token")} | {
            "chat_template": getattr(tokenizer, "chat_template", None), "vocab_size": engine.vocab_size,
            "max_model_len": engine.max_len}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        async def run(req: TokenizeRequest):
            ids = list(tokenizer.encode(req.prompt))
            return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_len}
        return await _simple(request, TokenizeRequest, run)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        async def run(req: DetokenizeRequest):
            bad = [t for t in req.tokens if not 0 <= t < engine.vocab_size]
            if bad:
                raise BadRequest(f"token id {bad[0]} is outside the vocabulary [0, {engine.vocab_size})", "tokens")
            return {"prompt": tokenizer.decode(req.tokens)}
        return await _simple(request, DetokenizeRequest, run)

    if profiler is not None:
        @app.post("/start_profile")
        async def start_profile(request: Request):
            async def run(req: ProfileRequest):
                try:
                    profiler.schedule(req.num_steps)
                except ValueError as e:
                    raise BadRequest(str(e), "num_steps") from None
                except RuntimeError as e:
                    raise BadRequest(str(e), None, 409) from None
                return {"status": "scheduled", "num_steps": req.num_steps, "output_dir": str(profiler.directory)}
            return await _simple(request, ProfileRequest, run, empty_ok=True)

        @app.get("/profile")
        async def profile():
            return {"state": profiler.state, "output_dir": str(profiler.directory), "traces": profiler.traces}

    async def _simple(request: Request, schema, run, empty_ok: bool = False):
        """Validate a JSON body against ``schema`` and answer ``run(request)`` (400 naming the field;
        ``empty_ok``: no body is ``{}``)."""
        try:
            body = await read_body(request, max_body_bytes)
            return await run(schema.model_validate(json.loads(body) if body or not empty_ok else {}))
        except PayloadTooLarge as e:
            return error_response(413, str(e), kind="payload_too_large")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error_response(400, f"the request body is not valid JSON: {e}")
        except pydantic.ValidationError as e:
            param = param_path(e.errors()[0]["loc"])
            return error_response(400, f"{param}: {e.errors()[0]['msg']}", param or None)
        except BadRequest as e:
            return error_response(e.status, e.message, e.param)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _handle(request, chat=True)

    def turn_start(req: ChatRequest) -> tuple[dict, str]:
        """(extra chat-template arguments, the text the turn starts with) for the request's tool_choice."""
        choice, name = req.tool_choice, req.forced_function
        if choice == "required" or name is not None:
            if not req.tools:
                raise BadRequest("tool_choice 'required' or a named function needs tools", "tool_choice")
            if name is not None and name not in {t.function.name for t in req.tools}:
                raise BadRequest(f"tool_choice names the function '{name}', which is not in tools", "tool_choice")
            try:
                return forced_prefix(tokenizer, "function" if name is not None else "required", name)
            except ValueError as e:
                raise BadRequest(str(e), "tool_choice") from None
        return {}, ""

    def prompt_ids(req: CompletionRequest | ChatRequest, chat: bool) -> list[list[int]]:
        """The request's prompts as token ids (chat: one, ending with the turn's forced start)."""
        if chat:
            messages = [{**m.model_dump(exclude_none=True, exclude={"content"}),
                         "content": m.content if isinstance(m.content, str) else
                         "".join(p.text for p in m.content or [])} for m in req.messages]
            offered = req.tools if req.tools and req.tool_choice != "none" else None
            tools = [t.model_dump(exclude_none=True) for t in offered] if offered else None
            template_args, start = turn_start(req)
            try:
                ids = (list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools,
                                                          **template_args))
                       if template_args else chat_prompt(tokenizer, messages, tools))
            except Exception as e:  # a template that rejects the conversation (e.g. role order)
                raise BadRequest(f"cannot render the chat template: {e}", "messages") from None
            return [ids + (tokenizer.encode(start, allow_special=True) if start else [])]
        prompt = req.prompt
        many = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
        out = []
        for p in prompt if many else [prompt]:
            ids = tokenizer.encode(p) if isinstance(p, str) else list(p)
            bad = [t for t in ids if not 0 <= t < engine.vocab_size]
            if bad:
                raise BadRequest(f"token id {bad[0]} is outside the vocabulary [0, {engine.vocab_size})", "prompt")
            out.append(ids)
        return out

    def prepare(req: CompletionRequest | ChatRequest, chat: bool):
        """(prompts as ids, sampling parameters of each prompt's choices, stop strings) of a validated
        request (BadRequest)."""
        fields = req.model_extra or {}
        for name in UNSUPPORTED:
            if fields.get(name) not in (None, False, 0, 0.0, [], {}):
                raise BadRequest(f"'{name}' is not supported by this server", name)
        if req.model is not None and req.model != model_name:
            raise BadRequest(f"the model '{req.model}' does not exist; this server serves '{model_name}'", "model", 404)
        n = 1 if req.n is None else req.n
        if n < 1:
            raise BadRequest(f"n must be >= 1, got {n}", "n")
        if req.temperature is not None and req.temperature < 0:
            raise BadRequest(f"temperature must be >= 0, got {req.temperature}", "temperature")
        if req.top_p is not None and not 0 < req.top_p <= 1:
            raise BadRequest(f"top_p must be in (0, 1], got {req.top_p}", "top_p")
        if chat:
            if req.top_logprobs is not None and not req.logprobs:
                raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
            k, k_name = (req.top_logprobs or 0) if req.logprobs else None, "top_logprobs"
            echo = False
        else:
            k, k_name, echo = req.logprobs, "logprobs", bool(req.echo)
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise BadRequest(f"{k_name} must be in [0, {MAX_LOGPROBS}], got {k}", k_name)
        max_tokens, max_name = req.max_tokens, "max_tokens"
        if chat and req.max_completion_tokens is not None:
            max_tokens, max_name = req.max_completion_tokens, "max_completion_tokens"
        if max_tokens is not None and max_tokens < (0 if echo else 1):
            raise BadRequest(f"{max_name} must be >= {0 if echo else 1}{'' if echo else ' (0 only with echo)'}, "
                             f"got {max_tokens}", max_name)
        if req.seed is not None and not 0 <= req.seed < 2**63:
            raise BadRequest(f"seed must be in [0, 2^63), got {req.seed}", "seed")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        prompts = prompt_ids(req, chat)
        prompt_name = "messages" if chat else "prompt"
        if len(prompts) * n > engine.max_batch + engine.max_queue:
            raise BadRequest(f"{len(prompts)} prompt(s) x n={n} sequences; this server takes at most "
                             f"{engine.max_batch + engine.max_queue} at once", "n" if n > 1 else "prompt")
        stops = reply_stop_ids(tokenizer) if chat else tuple(getattr(tokenizer, "stop_ids", ())) or (
            (tokenizer.eos_id,) if getattr(tokenizer, "eos_id", None) is not None else ())
        params = []
        for ids in prompts:
            if not ids:
                raise BadRequest("the prompt is empty", prompt_name)
            scoring = echo and max_tokens == 0  # the whole context may be prompt
            if len(ids) > engine.max_len or (len(ids) == engine.max_len and not scoring):
                raise BadRequest(f"the prompt has {len(ids)} tokens; the context is {engine.max_len} tokens "
                                 f"(prompt + completion)", prompt_name)
            room = engine.max_len - len(ids)
            if max_tokens is not None and max_tokens > room:
                raise BadRequest(f"{max_name} ({max_tokens}) + the prompt ({len(ids)} tokens) exceeds the context "
                                 f"of {engine.max_len} tokens", max_name)
            params.append([SamplingParams(
                max_tokens=room if max_tokens is None else max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                seed=None if req.seed is None else (req.seed + j) % 2**63, stop_ids=stops,
                logprobs=k, prompt_logprobs=echo) for j in range(n)])
        return prompts, params, stop

    async def _handle(request: Request, chat: bool):
        if drain.draining:
            return error_response(503, "the server is shutting down", kind="server_shutting_down",
                                  headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"})
        try:
            body = json.loads(await read_body(request, max_body_bytes))
        except PayloadTooLarge as e:
            return error_response(413, str(e), kind="payload_too_large", headers={"Connection": "close"})
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error_response(400, f"the request body is not valid JSON: {e}")
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object")
        try:
            req = (ChatRequest if chat else CompletionRequest).model_validate(body)
            prompts, params, stop = prepare(req, chat)
        except pydantic.ValidationError as e:
            err = e.errors()[0]
            param = param_path(err["loc"])
            return error_response(400, f"{param}: {err['msg']}" if param else err["msg"], param or None)
        except BadRequest as e:
            return error_response(e.status, e.message, e.param)
        channel = Channel(asyncio.get_running_loop())
        choices: list[Choice] = []
        turn = Turn(tokenizer, req.forced_function, turn_start(req)[1]) if chat else None
        for prompt, prompt_params in zip(prompts, params):
            for p in prompt_params:
                seq = Sequence(prompt, p, *channel.callbacks(len(choices)))
                logprobs = None if chat or p.logprobs is None else CompletionLogprobs(tokenizer, p.logprobs)
                choices.append(Choice(len(choices), seq, TextStream(tokenizer, stop), logprobs,
                                       turn if turn is not None and turn.parsed else None))

        def cancel_all():
            for c in choices:
                engine.cancel(c.seq)
        try:
            for c in choices:
                engine.submit(c.seq)
        except (QueueFull, ValueError) as e:
            cancel_all()
            if isinstance(e, ValueError):
                return error_response(400, str(e), "messages" if chat else "prompt")
            engine.metrics.request_done("rejected")
            return error_response(503, f"the server is busy: {e}; retry later", kind="server_overloaded",
                                  headers={"Retry-After": str(RETRY_AFTER_S)})
        live = drain.enter(lambda: [engine.cancel(c.seq, "abort") for c in choices])
        reply = Reply(chat, model_name, prompts, bool(req.return_token_ids), tokenizer)
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return EngineStream(_stream(choices, channel, reply, usage), cancel_all, idle_timeout_s,
                                 lambda: drain.leave(live), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
        try:
            return await _collect(request, choices, channel, reply, cancel_all)
        finally:
            drain.leave(live)

    async def _events(choices: list[Choice], channel: Channel):
        """(choice, text delta, token id or None, its TokenLogprobs or None, finish reason or None) until
        every choice has ended."""
        live = len(choices)
        while live:
            index, kind, value = await channel.queue.get()
            c = choices[index]
            if c.finish_reason is not None:  # ended at a stop string; the engine's own end comes after
                continue
            if kind == "finish":
                c.finish_reason = value
                live -= 1
                yield c, c.text.finish(), None, None, value
                continue
            token, logprobs = value
            delta = c.text.add(token)
            if c.text.stopped:  # a stop string: the choice is complete, free its row now
                engine.cancel(c.seq, "stop")
                c.finish_reason = "stop"
                live -= 1
                yield c, delta, token, logprobs, "stop"
                continue
            yield c, delta, token, logprobs, None

    async def _stream(choices: list[Choice], channel: Channel, reply: Reply, usage: bool):
        if reply.chat:
            for c in choices:
                yield sse(reply.chunk(c, {"role": "assistant", "content": ""}))
        echoed = set()
        async for c, delta, token, logprobs, reason in _events(choices, channel):
            if reason == "error":
                yield sse({"error": {"message": "generation failed", "type": "server_error", "param": None,
                                      "code": None}})
                return
            if c.seq.params.prompt_logprobs and c.index not in echoed:  # the engine has scored the prompt
                echoed.add(c.index)
                yield sse(reply.chunk(c, reply.echo(c), prompt=True))
            tokens = [] if token is None else [token]
            entries = [logprobs] if logprobs is not None else []
            if c.reply is not None:  # the turn's parts as they complete
                deltas = [reply.reply_delta(c, kind, value)
                          for kind, value in c.reply.feed(c.turn.start + c.text.emitted, final=reason is not None)]
                if not deltas and (entries or (reply.token_ids and tokens)):
                    deltas = [{}]
                for k, d in enumerate(deltas):
                    yield sse(reply.chunk(c, d, tokens if k == 0 else [], entries if k == 0 else []))
            elif delta or (token is not None and (reply.token_ids or logprobs is not None)):
                yield sse(reply.chunk(c, delta, tokens, entries))
            if reason is not None:
                yield sse(reply.chunk(c, None, finish_reason=reply.finish_reason(c, reason)))
        if usage:
            yield sse(reply.usage_chunk(choices))
        yield "data: [DONE]\n\n"

    async def _collect(request: Request, choices: list[Choice], channel: Channel, reply: Reply, cancel_all):
        watcher = asyncio.create_task(cancel_on_disconnect(request.receive, cancel_all))
        try:
            async for c, delta, token, logprobs, reason in _events(choices, channel):
                c.parts.append(delta)
                if token is not None and token not in c.seq.params.stop_ids:
                    c.ids.append(token)
                    if logprobs is not None:
                        c.entries.append(logprobs)
        finally:
            watcher.cancel()
            cancel_all()
        if any(c.finish_reason == "error" for c in choices):
            return error_response(500, "generation failed", kind="server_error")
        return reply.full(choices)

    return app
