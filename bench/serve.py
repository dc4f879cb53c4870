"""Load test of the OpenAI-compatible server on loopback, with HF transformers' ``generate`` as the
peer in the same process; prints one JSON document.

    python bench/serve.py            # `small` config: 64 requests at concurrency 1, 8 and 32
    python bench/serve.py --quick    # smoke run: `tiny`, 8 requests, concurrency 1 and 4
    python bench/serve.py --shared-prefix [--quick]   # the prefix cache on a chat workload (below)

k3jax: one server (``k3jax.serving``: uvicorn in a thread of this process, ``--max-batch`` = the
largest concurrency, XLA optimisations on) and an asyncio ``openai`` client that keeps
``concurrency`` streamed greedy completions in flight until all requests are done. Per level:
requests/s, output tokens/s, time to first token (submit -> first streamed token) and inter-token
latency (gaps between a stream's tokens), p50 / p99, and the model GFLOP/s that throughput means
(``2 N_active`` per prompt and output token) as a fraction of a float32 matmul peak measured in the
same process.

Peer: ``transformers.KimiLinearForCausalLM.generate`` (greedy, exactly ``--max-tokens`` new tokens)
on a Kimi Linear config of the same size (``common.hf_kimi_linear_config``), random weights, over the
same prompts in static batches of ``concurrency``, one batch at a time: what serving without
continuous batching gets from the HF stack. Its "TTFT" is the time until its batch is done (HF
returns whole batches). Both sides run on the same CPU cores; the client's Python shares them with
the server. ``load_average`` says how busy the machine was.

Host memory: a serving engine on CPU makes glibc keep freed memory (``k3jax/runtime/host_memory.py``: no fresh
``mmap`` per large block, so XLA's per-call temporaries are not page-faulted in again on every call;
``common`` sets ``K3JAX_HOST_MEMORY=keep`` for the whole process). The setting is process-wide, so
by default the peer runs with it too (``host_malloc`` in the report). torch's large temporaries gain
from it as much: with glibc's defaults HF ``generate`` page-faults millions of times per batch and its
speed swings with the machine's state (10-140 tokens/s at concurrency 32 in back-to-back runs).
``--peer-malloc glibc`` restores glibc's defaults around the peer's runs: what HF gets in a process of
its own.

``--shared-prefix``: the prefix cache (``Engine(prefix_cache_tokens=...)``) on a chat-like workload,
no peer. ``--users`` conversations (default 16) run at once, each ``--turns`` turns (default 3) one
after another; turn k's prompt is a shared system prompt (``--system-len`` tokens, default 2000), the
conversation so far (its earlier messages and the replies the server gave) and a new user message
(``--message-len`` tokens); ``--max-tokens`` greedy tokens per reply. The same conversations run
twice on one server, its prefix cache off (``engine.prefix_cache = None``), then on (empty at the
start): time to first token (all turns, first turns, later turns), output tokens/s over the whole
run, prompt tokens the model ran and those read from the cache (``/metrics``' counters). Greedy
replies are the same both ways (``same_replies``). ``--quick``: tiny, a 256-token system prompt, 4
users, 2 turns.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import socket
import sys
import threading
import time

# common first: it pins JAX to the CPU before jax is imported
from common import cpu_info, hf_kimi_linear_config, log, matmul_peak, peer_host_memory, randomize_torch

# then out of the import path: bench/kernels.py would pass for the `kernels` package transformers probes for
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from k3jax.config import load_config  # noqa: E402
from k3jax.tokenizer import ByteTokenizer  # noqa: E402
from k3jax.runtime.host_memory import keeps_host_memory  # noqa: E402
from k3jax.model import create_model  # noqa: E402
from k3jax.params import count_params  # noqa: E402
from k3jax.serving.api import create_app  # noqa: E402
from k3jax.serving.engine import Engine  # noqa: E402
from k3jax.serving.metrics import compile_count  # noqa: E402

FIRST_PROMPT_ID = 3  # HF's KimiLinear config reserves 0-2 (pad, bos, eos)
KEPT = "freed memory kept (glibc mmap and trim off)"


def percentiles(xs) -> dict:
    xs = np.asarray(xs, float)
    if not xs.size:
        return {"p50": None, "p99": None}
    return {"p50": round(float(np.percentile(xs, 50)), 5), "p99": round(float(np.percentile(xs, 99)), 5)}


def start_server(engine: Engine, name: str):
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(engine, ByteTokenizer(), name), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


async def load(url: str, name: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict:
    """All prompts as streamed greedy completions, ``concurrency`` in flight."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    gate = asyncio.Semaphore(concurrency)
    ttft, gaps, tokens = [], [], []

    async def one(prompt):
        async with gate:
            t0 = time.perf_counter()
            last, n = None, 0
            stream = await client.completions.create(model=name, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                     stream=True, extra_body={"return_token_ids": True})
            async for chunk in stream:
                k = len(getattr(chunk.choices[0], "token_ids", None) or []) if chunk.choices else 0
                if not k:
                    continue
                now = time.perf_counter()
                if last is None:
                    ttft.append(now - t0)
                else:
                    gaps.append(now - last)
                last, n = now, n + k
            tokens.append(n)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - t0
    await client.close()
    return {"requests": len(prompts), "wall_s": round(wall, 3), "requests_per_s": round(len(prompts) / wall, 3),
            "output_tokens": int(sum(tokens)), "output_tokens_per_s": round(sum(tokens) / wall, 2),
            "ttft_s": percentiles(ttft), "inter_token_latency_s": percentiles(gaps)}


def hf_batches(model, prompts: list[list[int]], max_tokens: int, batch: int, max_batches: int | None = None) -> dict:
    """The prompts through HF ``generate`` in static batches of ``batch``, one after another (the
    first ``max_batches`` batches only, when given: every batch does the same work)."""
    ttft, tokens = [], 0
    starts = list(range(0, len(prompts), batch))[:max_batches]
    prompts = prompts[:starts[-1] + batch]
    t0 = time.perf_counter()
    for i in starts:
        ids = torch.as_tensor(prompts[i:i + batch], dtype=torch.long)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        tokens += (out.shape[1] - ids.shape[1]) * ids.shape[0]
        ttft += [time.perf_counter() - t0] * ids.shape[0]  # whole batches come back at once
    wall = time.perf_counter() - t0
    return {"requests": len(prompts), "wall_s": round(wall, 3), "requests_per_s": round(len(prompts) / wall, 3),
            "output_tokens": tokens, "output_tokens_per_s": round(tokens / wall, 2),
            "ttft_s": percentiles(ttft)}


async def conversations(url: str, name: str, system: list[int], messages: list[list[list[int]]],
                        max_tokens: int) -> dict:
    """Every user's turns in order (each prompt: system, earlier messages and replies, the new message),
    the users concurrently, streamed greedy; -> timings and each user's replies."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    ttft: dict[int, list[float]] = {}
    tokens = 0

    async def user(turns):
        nonlocal tokens
        history, replies = list(system), []
        for k, message in enumerate(turns):
            history += message
            t0, reply = time.perf_counter(), []
            stream = await client.completions.create(model=name, prompt=history, max_tokens=max_tokens, temperature=0,
                                                     stream=True, extra_body={"return_token_ids": True})
            async for chunk in stream:
                ids = (getattr(chunk.choices[0], "token_ids", None) or []) if chunk.choices else []
                if ids and not reply:
                    ttft.setdefault(k, []).append(time.perf_counter() - t0)
                reply += ids
            tokens += len(reply)
            replies.append(reply)
            history += reply
        return replies

    t0 = time.perf_counter()
    replies = await asyncio.gather(*(user(turns) for turns in messages))
    wall = time.perf_counter() - t0
    await client.close()
    later = [t for k, ts in ttft.items() if k > 0 for t in ts]
    return {"wall_s": round(wall, 3), "output_tokens": tokens, "output_tokens_per_s": round(tokens / wall, 2),
            "ttft_s": {"all_turns": percentiles([t for ts in ttft.values() for t in ts]),
                       "first_turns": percentiles(ttft.get(0, [])), "later_turns": percentiles(later)},
            "replies": replies}


def shared_prefix_main(args) -> None:
    q = args.quick
    config = args.config or ("tiny" if q else "small")
    users, turns = args.users or (4 if q else 16), args.turns or (2 if q else 3)
    system_len, message_len = args.system_len or (256 if q else 2000), args.message_len or (16 if q else 32)
    max_tokens = args.max_tokens or (8 if q else 16)
    chunk = args.prefill_chunk if args.prefill_chunk is not None else (32 if q else 256)
    if q:
        jax.config.update("jax_disable_most_optimizations", True)
    cfg = load_config(config).model
    rng = np.random.default_rng(args.seed)
    system = rng.integers(FIRST_PROMPT_ID, cfg.vocab_size, system_len).tolist()
    messages = rng.integers(FIRST_PROMPT_ID, cfg.vocab_size, (users, turns, message_len)).tolist()
    max_len = -(-(system_len + turns * (message_len + max_tokens)) // chunk) * chunk
    budget = args.prefix_cache_tokens or max_len * users
    log(f"shared-prefix bench: k3jax {config!r}, {users} users x {turns} turns, system prompt {system_len} tokens, "
        f"prefix cache off then on ({budget} tokens)")
    engine = Engine(create_model(cfg, seed=args.seed), max_batch=users, max_len=max_len, prefill_chunk=chunk,
                    prefill_batch=args.prefill_batch, max_queue=users, prefix_cache_tokens=budget)
    t0 = time.perf_counter()
    server, thread, url = start_server(engine, config)
    startup_s = time.perf_counter() - t0
    cache = engine.prefix_cache
    warm = rng.integers(FIRST_PROMPT_ID, cfg.vocab_size, (1, 1, message_len)).tolist()
    engine.prefix_cache = None
    asyncio.run(conversations(url, config, [], warm, 2))  # warm the HTTP path (nothing cached)
    compiles = compile_count()
    results = {}
    for mode in ("off", "on"):
        engine.prefix_cache = cache if mode == "on" else None  # swapped while the engine is idle
        m = engine.metrics
        before = (m.prefill_tokens, m.prompt_tokens, m.prefix_hit_tokens, m.prefix_hits, m.prefix_misses)
        log(f"  prefix cache {mode}")
        results[mode] = asyncio.run(conversations(url, config, system, messages, max_tokens))
        after = (m.prefill_tokens, m.prompt_tokens, m.prefix_hit_tokens, m.prefix_hits, m.prefix_misses)
        d = [a - b for a, b in zip(after, before)]
        results[mode].update(prefilled_tokens=d[0], prompt_tokens=d[1], cached_tokens=d[2], hits=d[3], misses=d[4])
    server.should_exit = True
    thread.join(60)
    same = results["off"].pop("replies") == results["on"].pop("replies")
    report = {
        "bench": "serve_shared_prefix", "quick": q, "xla_optimizations": not q, **cpu_info(),
        "settings": {"config": config, "users": users, "turns": turns, "system_len": system_len,
                     "message_len": message_len, "max_tokens": max_tokens, "max_batch": users, "max_len": max_len,
                     "prefill_chunk": chunk, "prefill_batch": args.prefill_batch,
                     "prefix_cache": {"tokens": budget, "block": cache.block,
                                      "block_mib": round(engine.prefix_cache_block_bytes / 2**20, 3)},
                     "dtype": "float32", "sampling": "greedy", "client": "openai.AsyncOpenAI, streamed"},
        "server_startup_s": round(startup_s, 2), "compiles_during_load": compile_count() - compiles,
        "same_replies": same, "prefix_cache_off": results["off"], "prefix_cache_on": results["on"],
        "ratio_on_over_off": {
            "output_tokens_per_s": round(results["on"]["output_tokens_per_s"] / results["off"]["output_tokens_per_s"], 3),
            "ttft_p50_all_turns": round(results["on"]["ttft_s"]["all_turns"]["p50"] /
                                        results["off"]["ttft_s"]["all_turns"]["p50"], 3)},
    }
    print(json.dumps(report, indent=1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny config, 8 requests, concurrency 1, 4")
    ap.add_argument("--config", default=None, help="k3jax config (default: small; tiny with --quick)")
    ap.add_argument("--requests", type=int, default=None, help="requests per level (default 64; 8 quick)")
    ap.add_argument("--concurrency", default=None, help="comma-separated levels (default 1,8,32; 1,4 quick)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 64; 16 quick)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per completion (default 32; 8 quick)")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="default 64 (--shared-prefix: 256; 32 quick)")
    ap.add_argument("--prefill-batch", type=int, default=8, help="waiting prompts prefilled together")
    ap.add_argument("--peer-batches", type=int, default=None, help="HF: time only the first N static batches of "
                    "each level (default: all; its tokens/s is a per-batch rate either way)")
    ap.add_argument("--peer-malloc", choices=("same", "glibc"), default="same",
                    help="the peer's host allocator: the server's setting (same process) or glibc's defaults")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shared-prefix", action="store_true", help="the prefix cache's bench (see the docstring)")
    ap.add_argument("--users", type=int, default=None, help="--shared-prefix: conversations at once (16; 4 quick)")
    ap.add_argument("--turns", type=int, default=None, help="--shared-prefix: turns per conversation (3; 2 quick)")
    ap.add_argument("--system-len", type=int, default=None, help="--shared-prefix: system prompt tokens (2000; "
                    "256 quick)")
    ap.add_argument("--message-len", type=int, default=None, help="--shared-prefix: user message tokens (32; 16 quick)")
    ap.add_argument("--prefix-cache-tokens", type=int, default=None, help="--shared-prefix: the cache's budget "
                    "(default: max_len per user)")
    args = ap.parse_args(argv)
    if args.shared_prefix:
        return shared_prefix_main(args)
    if args.prefill_chunk is None:
        args.prefill_chunk = 64
    q = args.quick
    config = args.config or ("tiny" if q else "small")
    n_requests = args.requests or (8 if q else 64)
    levels = [int(c) for c in (args.concurrency or ("1,4" if q else "1,8,32")).split(",")]
    prompt_len = args.prompt_len or (16 if q else 64)
    max_tokens = args.max_tokens or (8 if q else 32)
    if q:  # compile time dominates a smoke run
        jax.config.update("jax_disable_most_optimizations", True)
    import transformers
    from transformers import KimiLinearForCausalLM

    transformers.logging.set_verbosity_error()
    torch.manual_seed(args.seed)
    cfg = load_config(config).model
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(FIRST_PROMPT_ID, cfg.vocab_size, (n_requests, prompt_len)).tolist()

    log(f"serve bench: k3jax {config!r} server (max_batch {max(levels)}) vs HF KimiLinearForCausalLM.generate")
    engine = Engine(create_model(cfg, seed=args.seed), max_batch=max(levels), max_len=prompt_len + max_tokens,
                    prefill_chunk=args.prefill_chunk, prefill_batch=args.prefill_batch, max_queue=n_requests)
    t0 = time.perf_counter()
    server, thread, url = start_server(engine, config)  # compiles every program (Engine.warmup)
    startup_s = time.perf_counter() - t0
    compiles = compile_count()
    kept = keeps_host_memory()  # K3JAX_HOST_MEMORY=keep (common), or the engine while it runs
    peer_malloc = functools.partial(peer_host_memory, args.peer_malloc)

    asyncio.run(load(url, config, prompts[:2], max_tokens, 2))  # warm the HTTP path
    k3, hf = {}, {}
    hf_model = KimiLinearForCausalLM(hf_kimi_linear_config(cfg)).eval()
    randomize_torch(hf_model, args.seed)
    with peer_malloc():
        hf_batches(hf_model, prompts[:1], 2, 1)  # warm-up
    for c in levels:
        log(f"  concurrency {c}: k3jax server")
        k3[c] = asyncio.run(load(url, config, prompts, max_tokens, c))
        log(f"  concurrency {c}: HF generate, batches of {c}")
        with peer_malloc():
            hf[c] = hf_batches(hf_model, prompts, max_tokens, c, args.peer_batches)
    recompiles = compile_count() - compiles
    log("matmul peak")
    peak = matmul_peak()
    # The server's model FLOPs: 2 N_active per prompt and per output token (attention over <= 96
    # slots and the sampling left out: under 1% at these lengths), against the machine's matmul peak.
    flop_per_token = 2.0 * count_params(cfg)["active"]
    for c in levels:
        gflops = flop_per_token * len(prompts) * (prompt_len + max_tokens) / k3[c]["wall_s"] / 1e9
        k3[c]["model_gflop_per_s"] = round(gflops, 2)
        k3[c]["fraction_of_matmul_peak"] = round(gflops / peak["gflop_per_s"], 4)
    server.should_exit = True
    thread.join(60)
    report = {
        "bench": "serve", "quick": q, "xla_optimizations": not q, **cpu_info(),
        "settings": {"config": config, "requests": n_requests, "concurrency": levels, "prompt_len": prompt_len,
                     "max_tokens": max_tokens, "max_batch": max(levels), "prefill_chunk": args.prefill_chunk,
                     "prefill_batch": args.prefill_batch,
                     "peer_batches": args.peer_batches,
                     "host_malloc": {"server": KEPT if kept else "defaults",
                                     "peer": KEPT if kept and args.peer_malloc == "same" else "defaults"},
                     "dtype": "float32", "sampling": "greedy", "client": "openai.AsyncOpenAI, streamed"},
        "server_startup_s": round(startup_s, 2), "compiles_during_load": recompiles, "matmul_peak": peak,
        "model_flop_per_token": flop_per_token,
        "results": {f"concurrency_{c}": {"k3jax_server": k3[c], "hf_generate_static_batches": hf[c]} for c in levels},
        "ratios_output_tokens_per_s": {f"concurrency_{c}": round(k3[c]["output_tokens_per_s"] /
                                                                 hf[c]["output_tokens_per_s"], 3) for c in levels},
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
