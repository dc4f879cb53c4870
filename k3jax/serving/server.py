"""``python infer.py --serve``: the command-line options of the server and its start (uvicorn)."""

from __future__ import annotations

import argparse

from k3jax.serving.engine import Engine


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


def engine_options(args: argparse.Namespace) -> dict:
    """The Engine keyword arguments of the server's options."""
    return dict(max_batch=args.max_batch, max_len=args.max_len, prefill_chunk=args.prefill_chunk,
                prefill_batch=args.prefill_batch, max_queue=args.max_queue,
                prefix_cache_tokens=args.prefix_cache_tokens if args.prefix_cache else 0,
                prefix_cache_block=args.prefix_cache_block)


def serve(model, tokenizer, args: argparse.Namespace, *, name: str, mesh=None) -> None:
    """Run the server until interrupted."""
    import uvicorn

    from k3jax.serving.api import create_app  # FastAPI only where a server runs

    try:
        engine = Engine(model, mesh=mesh, **engine_options(args))
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    app = create_app(engine, tokenizer, args.model_name or name)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
