"""``python infer.py --serve``: the command-line options of the server and its start (uvicorn).

SIGTERM / SIGINT drain the server (``transport.Drain``): new requests get 503 while the running ones finish,
for up to ``--drain-timeout`` seconds; those left then end with ``finish_reason: "abort"``, and the
server exits. A second SIGINT exits at once. ``--api-key`` (or ``$K3JAX_API_KEY``) makes every request but
``/health`` need the key; ``--profile-steps N`` traces the engine's first N steps into ``--profile-dir``, and
``POST /start_profile`` the next ones (``k3jax.serving.profiling``).

Several hosts (``jax.process_count() > 1``; ``infer.py --serve`` started with the same command on
each, as ``train.py``): the model and the engine's device programs span every process's devices.
Process 0 runs the HTTP server and the engine's scheduling; every other process runs no server, only
the engine's loop on process 0's schedule (``k3jax.serving.schedule``), until process 0 stops it, then
exits. A follower ignores SIGTERM / SIGINT (logged): process 0's drain decides when the slice stops,
and a process that left early would fail its last requests. A process that dies or a step that fails
stops every process with an error and exit code ``schedule.FAILED_EXIT_CODE`` (a lost process seen in a
collective), or JAX's own abort when a process stops answering its heartbeat (``--heartbeat-timeout``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

import jax

from k3jax.serving.engine import Engine
from k3jax.serving.profiling import StepProfiler


def add_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("server (--serve)")
    g.add_argument("--serve", action="store_true", help="serve an OpenAI-compatible HTTP API instead of "
                   "generating once (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--max-batch", type=int, default=8, help="cache slots decoded together")
    g.add_argument("--max-len", type=int, help="tokens per request, prompt + completion (default: the "
                   "model's max_seq_len)")
    g.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens prefilled per call between "
                   "two decode steps")
    g.add_argument("--prefill-batch", type=int, default=8, help="waiting prompts prefilled together (a "
                   "burst of requests joins the running batch in one prefill)")
    g.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 503s")
    g.add_argument("--model-name", help="the model id of the API (default: the config's name)")
    g.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false", help="prefill every prompt "
                   "whole (default: prompts that start with an earlier prompt's blocks resume from them)")
    g.add_argument("--prefix-cache-tokens", type=int, default=32768, help="prefix cache budget in prompt tokens "
                   "(device memory: per block, its MLA latents and one KDA state snapshot; the server logs the "
                   "size of a block); least recently used blocks are evicted")
    g.add_argument("--prefix-cache-block", type=int, help="prompt tokens per prefix cache block, where KDA "
                   "states are snapshotted: a multiple of --prefill-chunk (default: one chunk)")


    g.add_argument("--drain-timeout", type=float, default=30.0, help="seconds the running requests may take to "
                   "finish after SIGTERM before they are aborted (finish_reason abort)")
    g.add_argument("--stream-idle-timeout", type=float, default=60.0, help="seconds a stream may wait for its "
                   "client to read before it is cancelled (its cache rows freed)")
    g.add_argument("--max-body-bytes", type=int, default=16 * 2**20, help="larger request bodies get 413")
    g.add_argument("--api-key", default=os.environ.get("K3JAX_API_KEY") or None, help="requests must send "
                   "'Authorization: Bearer KEY' (else 401); /health stays open (default: $K3JAX_API_KEY; none)")
    g.add_argument("--profile-dir", default="profile", help="where jax.profiler traces of the engine's steps go "
                   "(POST /start_profile {\"num_steps\": N} traces the next N; TensorBoard's profile plugin or "
                   "Perfetto reads them)")
    g.add_argument("--profile-steps", type=int, default=0, help="trace the engine's first N steps after its "
                   "warm-up into --profile-dir (0: none)")


def engine_options(args: argparse.Namespace) -> dict:
    """The Engine keyword arguments of the server's options."""
    return dict(max_batch=args.max_batch, max_len=args.max_len, prefill_chunk=args.prefill_chunk,
                prefill_batch=args.prefill_batch, max_queue=args.max_queue,
                prefix_cache_tokens=args.prefix_cache_tokens if args.prefix_cache else 0,
                prefix_cache_block=args.prefix_cache_block)


def serve(model, tokenizer, args: argparse.Namespace, *, name: str, mesh=None) -> None:
    """Run the server until interrupted."""
    if args.profile_steps < 0:
        raise SystemExit(f"error: --profile-steps must be >= 0, got {args.profile_steps}")
    try:
        engine = Engine(model, mesh=mesh, **engine_options(args))
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if jax.process_index() != 0:
        return follow(engine)
    profiler = StepProfiler(args.profile_dir)
    engine.step_scope = profiler.step
    if args.profile_steps:
        profiler.schedule(args.profile_steps)
    run_server(engine, tokenizer, args.model_name or name, host=args.host, port=args.port,
               drain_timeout_s=args.drain_timeout, idle_timeout_s=args.stream_idle_timeout,
               max_body_bytes=args.max_body_bytes, api_key=args.api_key, profiler=profiler)


def follow(engine: Engine) -> None:
    """A process other than 0: run the engine's loop on process 0's schedule until it stops (module
    docstring)."""
    def ignore(sig, _frame):
        print(f"process {jax.process_index()}: {signal.Signals(sig).name} ignored: process 0's drain stops the "
              f"server, and this process with it", file=sys.stderr, flush=True)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, ignore)
    print(f"process {jax.process_index()} of {jax.process_count()}: running process 0's schedule (process 0 serves "
          f"the API)", file=sys.stderr, flush=True)
    engine.start()
    engine.wait()


def run_server(engine, tokenizer, name: str, *, host: str, port: int, drain_timeout_s: float,
               idle_timeout_s: float, max_body_bytes: int, log_level: str = "info", api_key: str | None = None,
               profiler: StepProfiler | None = None) -> None:
    """Serve ``engine``'s API with uvicorn until a signal has drained it (module docstring)."""
    import uvicorn

    from k3jax.serving.api import create_app  # FastAPI only where a server runs

    app = create_app(engine, tokenizer, name, idle_timeout_s=idle_timeout_s, max_body_bytes=max_body_bytes,
                     api_key=api_key, profiler=profiler)

    class DrainingServer(uvicorn.Server):
        """uvicorn, whose first exit signal drains the app before uvicorn's own shutdown starts."""

        async def serve(self, sockets=None):
            self.loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig, frame):
            if app.state.drain.draining:  # a second signal: uvicorn's (SIGINT: exit now)
                return super().handle_exit(sig, frame)
            app.state.drain.draining = True  # refuse new requests from now on
            self._captured_signals.append(sig)  # uvicorn re-raises it once it has shut down

            async def drain_then_exit():
                await app.state.drain.drain(drain_timeout_s)
                self.should_exit = True
            def start():  # (the task is kept: the loop holds tasks weakly)
                self.drain_task = self.loop.create_task(drain_then_exit())
            self.loop.call_soon_threadsafe(start)

    DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level)).run()
