"""Prefill and decode throughput on CPU, k3jax against HF transformers; prints one JSON document.

    python bench/decode.py            # `small` config, batch 1 and 8 (~20 min on 2 busy cores)
    python bench/decode.py --quick    # smoke run: `tiny`, short prompt, XLA optimisations off

Three models, timed in the same process, interleaved repeat by repeat (so that load from other
processes hits all of them alike), after a warm-up call that also gives the compile time:

- ``k3jax_<config>``: the k3jax config itself (K3 mechanisms: AttnRes, latent MoE, gated MLA, ...),
  through ``k3jax.inference.generate.generate``, its layers unrolled once at load (``k3jax.model.unroll_layers``,
  as the serving engine does on CPU; ``--scanned`` decodes the scanned model as stored);
- ``hf_kimi_linear``: ``transformers.KimiLinearForCausalLM.generate`` (greedy) on a Kimi Linear config
  of the same size (``common.hf_kimi_linear_config``: same widths, depth, layout, heads, experts),
  random weights, torch reference kernels (fla / causal_conv1d are not installed);
- ``k3jax_kimi_linear``: that same HF checkpoint loaded with ``k3jax.interop.from_hf``: identical
  weights and architecture, so ``k3jax_kimi_linear / hf_kimi_linear`` is the like-for-like figure;
  the logits are compared once (``parity``).

Prefill = a call generating 1 token (HF: its first token comes from the prefill logits; k3jax also
runs the forward of that token, ~1/100 of a 128-token prefill); decode tokens/s =
``B * N / (t(N + 1 tokens) - t(prefill))``, both sides running N single-token forward passes in that
difference, taken within each repeat. Medians over ``--repeats`` (and the
best repeat, the figure least disturbed by other load; ``load_average`` says how busy the machine
was). Float32 everywhere.

Roofline: a decode step must read at least the weights a step multiplies through (every weight but
the routed experts and the embedding table; of each MoE layer's routed experts the expected number of
distinct ones that ``B`` tokens select, ``E (1 - (1 - k/E)^B)``; ``B`` embedding rows) and its cache
once. That many bytes at this machine's memory read bandwidth (``common.memory_bandwidth``, measured
in the same run) is the fastest a float32 decode step can be; ``roofline`` gives it per model, the
fraction of it each k3jax model reaches, and the largest decode ratio over HF it allows. A step's
matrix-vector products depend on each other, though, and a chain of them reads each small weight
matrix at a fraction of the streaming bandwidth (``common.matvec_bandwidth`` at the model's hidden
size, measured in the same run; numpy and torch are no faster); ``at_matvec_bandwidth`` is the same
bytes at that rate. It is a reference, not a strict floor: the products of a step that do not depend on
each other overlap, and the ``small`` batch-1 step beats it slightly.

Host memory: the process runs with glibc keeping freed memory (``common`` sets
``K3JAX_HOST_MEMORY=keep``: ``k3jax/runtime/host_memory.py``) for both sides; HF's batch-8 ``generate`` otherwise
page-faults its large temporaries in on every call and swings between 9 and 25 tokens/s.
``--peer-malloc glibc`` restores glibc's defaults around HF's calls.

Also: the decoding cache of ``k3`` at 1M context (``--cache-config``, ``--cache-context``), computed
on abstract shapes with ``jax.eval_shape`` (nothing allocated): bytes per token, the fixed part
(KDA states, conv tails) and bytes per sequence.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import tempfile

# common first: it pins JAX to the CPU before jax is imported
from common import (cpu_info, hf_kimi_linear_config, log, matvec_bandwidth, median, memory_bandwidth, peer_host_memory,
                    randomize_torch, timed, torch_param_counts)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from k3jax.cache import cache_bytes, init_cache  # noqa: E402
from k3jax.config import load_config  # noqa: E402
from k3jax.inference.generate import generate  # noqa: E402
from k3jax.interop import from_hf  # noqa: E402
from k3jax.model import create_model, plan_layers, unroll_layers  # noqa: E402
from k3jax.params import count_params  # noqa: E402
from k3jax.runtime.host_memory import keeps_host_memory  # noqa: E402

# First token id of the random prompts: HF's KimiLinear config reserves 0-2 (pad, bos, eos).
FIRST_PROMPT_ID = 3
ONE_MEBI = 1 << 20
MIN_DURATION_S = 1e-6  # floor of a measured decode time (a difference of two timings)


def k3jax_runner(model, prompt, new_tokens):
    """(prefill, generate, block) callables for one k3jax model and prompt batch."""
    prompt = jax.device_put(prompt)
    # generate(n) runs the prefill and n single-token forwards (each sampled token is fed back, the last
    # one too): generate(1) and generate(N + 1) differ by N forwards, as HF's calls below.
    return (lambda: generate(model, prompt, 1), lambda: generate(model, prompt, new_tokens + 1),
            jax.block_until_ready)


def hf_runner(model, prompt, new_tokens):
    ids = torch.as_tensor(prompt, dtype=torch.long)
    mask = torch.ones_like(ids)

    def gen(n):
        with torch.inference_mode():
            return model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  pad_token_id=0)

    # HF's first new token comes from the prefill logits: prefill = 1 token, N decode forwards = N + 1.
    return lambda: gen(1), lambda: gen(new_tokens + 1), lambda out: out


def bench_batch(models: dict, batch: int, prompt_len: int, new_tokens: int, repeats: int, vocab: int, seed: int,
                peer_malloc):
    prompt = np.random.default_rng(seed).integers(FIRST_PROMPT_ID, vocab, (batch, prompt_len)).astype(np.int32)
    runners = {name: (hf_runner if name.startswith("hf_") else k3jax_runner)(m, prompt, new_tokens)
               for name, m in models.items()}
    first = {}
    host = {name: peer_malloc if name.startswith("hf_") else contextlib.nullcontext for name in runners}
    for name, (prefill, gen, block) in runners.items():
        log(f"  batch {batch}: warm-up (compile) {name}")
        with host[name]():
            first[name] = (timed(prefill, block), timed(gen, block))
    times = {name: ([], []) for name in runners}
    for r in range(repeats):
        log(f"  batch {batch}: repeat {r + 1}/{repeats}")
        for name, (prefill, gen, block) in runners.items():
            with host[name]():
                times[name][0].append(timed(prefill, block))
                times[name][1].append(timed(gen, block))
    out = {}
    for name, (t_pre, t_gen) in times.items():
        # decode time from the prefill and generate calls of the same repeat (adjacent in time, so
        # under a fluctuating load their difference is steadier than a difference of medians)
        t_dec = [max(g - p, MIN_DURATION_S) for p, g in zip(t_pre, t_gen)]
        pre, dec = median(t_pre), median(t_dec)
        out[name] = {"prefill_tokens_per_s": round(batch * prompt_len / pre, 2),
                     "decode_tokens_per_s": round(batch * new_tokens / dec, 2),
                     "best_of_repeats": {"prefill_tokens_per_s": round(batch * prompt_len / min(t_pre), 2),
                                         "decode_tokens_per_s": round(batch * new_tokens / min(t_dec), 2)},
                     "prefill_s_all": [round(x, 4) for x in t_pre], "generate_s_all": [round(x, 4) for x in t_gen],
                     "decode_step_s": round(dec / new_tokens, 5),
                     "first_call_minus_median_s": {"prefill": round(first[name][0] - pre, 2),
                                                   "generate": round(first[name][1] - median(t_gen), 2)}}
    return out, prompt


def cache_nbytes(cfg, batch: int, length: int) -> int:
    """Bytes of the decoding cache of model config ``cfg`` for ``batch`` rows of ``length`` tokens, from
    abstract shapes only (nothing allocated)."""
    plan = plan_layers(cfg)
    return cache_bytes(jax.eval_shape(lambda: init_cache(cfg, plan, batch, length)))


def decode_step_bytes(cfg, batch: int, context: int) -> dict:
    """The fewest bytes a float32 decode step of ``batch`` rows at ``context`` cached tokens reads
    (module docstring, "Roofline"): weights, and the cache once."""
    counts = count_params(cfg)
    m = cfg.moe
    distinct = m.num_experts * (1 - (1 - m.top_k / m.num_experts) ** batch)  # expected, per MoE layer
    weights = (counts["total"] - counts["routed_experts"] - counts["embedding"]
               + counts["routed_experts"] * distinct / m.num_experts + batch * cfg.hidden_size)
    item = np.dtype(cfg.param_dtype).itemsize
    return {"weights": int(weights * item), "cache": cache_nbytes(cfg, batch, context),
            "distinct_routed_experts_per_layer": round(distinct, 2)}


def roofline(models: dict, results: dict, prompt_len: int, new_tokens: int, bandwidth: dict,
             matvec: dict) -> dict:
    """Per batch size and k3jax model: the decode step's fewest bytes, the time they take at the
    measured streaming bandwidth, the fraction of it reached, and the decode ratio over HF that time
    allows; ``at_matvec_bandwidth``: the same at a chain of matrix-vector products' bandwidth."""
    out = {}
    context = prompt_len + new_tokens // 2  # the mean cached length over the decoded tokens
    for b, r in results.items():
        step_s = {name: b / r[name]["decode_tokens_per_s"] for name in r}  # unrounded
        hf_step = step_s["hf_kimi_linear"]
        row = {}
        for name, model in models.items():
            nbytes = decode_step_bytes(model.cfg, b, context)
            def floor(gb_per_s):
                floor_s = (nbytes["weights"] + nbytes["cache"]) / (gb_per_s * 1e9)
                return {"floor_step_ms": round(floor_s * 1e3, 4), "fraction_of_floor": round(floor_s / step_s[name], 3),
                        "largest_possible_decode_ratio_vs_hf": round(hf_step / floor_s, 2)}

            row[name] = {"bytes": nbytes, **floor(bandwidth["gb_per_s"]),
                         "at_matvec_bandwidth": floor(matvec["gb_per_s"])}
        out[f"batch_{b}"] = row
    return out


def cache_report(config: str, context: int) -> dict:
    """Bytes of the decoding cache of ``config`` at ``context`` tokens, from abstract shapes only."""
    cfg = load_config(config).model
    half = context // 2
    per_seq = cache_nbytes(cfg, 1, context)
    per_token = (per_seq - cache_nbytes(cfg, 1, half)) / (context - half)
    mla = [i for i in range(cfg.num_layers) if cfg.mixer(i) == "mla"]
    itemsize = np.dtype(cfg.dtype).itemsize
    latent = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
    return {"config": config, "context": context, "dtype": cfg.dtype,
            "bytes_per_token": per_token,
            "bytes_per_token_formula": f"{len(mla)} MLA layers x ({cfg.mla.kv_lora_rank} latent + "
                                       f"{cfg.mla.qk_rope_head_dim} rope) x {itemsize} B + 1 B valid flag "
                                       f"= {len(mla) * latent * itemsize + 1}",
            "bytes_fixed_per_sequence": int(per_seq - per_token * context),
            "bytes_per_sequence": per_seq, "gib_per_sequence": round(per_seq / 2**30, 3)}


def ratios(results: dict, num: str, den: str) -> dict:
    return {f"batch_{b}": {k: round(r[num][f"{k}_tokens_per_s"] / r[den][f"{k}_tokens_per_s"], 3)
                           for k in ("prefill", "decode")} for b, r in results.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny config and sizes, one repeat")
    ap.add_argument("--config", default=None, help="k3jax config (default: small; tiny with --quick)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 128; 16 with --quick)")
    ap.add_argument("--new-tokens", type=int, default=None, help="decoded tokens (default 64; 4 with --quick)")
    ap.add_argument("--batch-sizes", default=None, help="comma-separated (default 1,8; 1,2 with --quick)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats, median taken (default 3; 1 quick)")
    ap.add_argument("--cache-config", default="k3", help="config whose cache size is reported")
    ap.add_argument("--cache-context", type=int, default=ONE_MEBI, help="context length of the cache report")
    ap.add_argument("--scanned", action="store_true", help="decode k3jax's models with their layers scanned, as "
                    "stored (default: unrolled once at load)")
    ap.add_argument("--peer-malloc", choices=("same", "glibc"), default="same",
                    help="HF's host allocator: this process's setting (glibc keeps freed memory) or glibc's defaults")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    q = args.quick
    kept = keeps_host_memory()  # K3JAX_HOST_MEMORY=keep (common)
    config = args.config or ("tiny" if q else "small")
    prompt_len = args.prompt_len or (16 if q else 128)
    new_tokens = args.new_tokens or (4 if q else 64)
    batch_sizes = [int(b) for b in (args.batch_sizes or ("1,2" if q else "1,8")).split(",")]
    repeats = args.repeats or (1 if q else 3)
    if q:
        # A smoke run checks that the bench works; XLA:CPU's optimisation passes would dominate it.
        jax.config.update("jax_disable_most_optimizations", True)
    import transformers
    from transformers import KimiLinearForCausalLM

    transformers.logging.set_verbosity_error()
    torch.manual_seed(args.seed)

    cfg = load_config(config).model
    log(f"decode bench: k3jax {config!r} vs HF KimiLinearForCausalLM (matched size, and identical weights)")
    load = (lambda m: m) if args.scanned else unroll_layers
    models = {f"k3jax_{config}": load(create_model(cfg, seed=args.seed))}
    hf_model = KimiLinearForCausalLM(hf_kimi_linear_config(cfg)).eval()
    randomize_torch(hf_model, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        hf_model.save_pretrained(tmp)
        models["k3jax_kimi_linear"] = load(from_hf(tmp))
    models["hf_kimi_linear"] = hf_model

    results, parity = {}, {}
    for b in batch_sizes:
        results[b], prompt = bench_batch(models, b, prompt_len, new_tokens, repeats, cfg.vocab_size,
                                         args.seed + b, functools.partial(peer_host_memory, args.peer_malloc))
        if not parity:
            with torch.inference_mode():
                ref = hf_model(torch.as_tensor(prompt, dtype=torch.long)).logits.float().numpy()
            ours = np.asarray(models["k3jax_kimi_linear"](jax.numpy.asarray(prompt))[0])
            parity = {"max_abs_logit_diff": float(np.max(np.abs(ours - ref))),
                      "max_rel_logit_diff": float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))}

    log("memory bandwidth")
    bandwidth = memory_bandwidth()
    matvec = matvec_bandwidth(cfg.hidden_size)
    report = {
        "bench": "decode", "quick": q, "xla_optimizations": not q, **cpu_info(),
        "host_malloc": {"keeps_freed_memory": kept, "peer": args.peer_malloc}, "memory_bandwidth": bandwidth,
        "matvec_bandwidth": matvec,
        "settings": {"config": config, "k3jax_layers": "scanned" if args.scanned else "unrolled",
                     "prompt_len": prompt_len, "new_tokens": new_tokens,
                     "batch_sizes": batch_sizes, "repeats": repeats, "dtype": "float32", "sampling": "greedy"},
        "params": {f"k3jax_{config}": count_params(cfg)["total"],
                   "kimi_linear (k3jax and HF, identical)": torch_param_counts(hf_model)["total"]},
        "parity_k3jax_vs_hf_same_weights": parity,
        "results": {f"batch_{b}": r for b, r in results.items()},
        "ratios": {"k3jax_kimi_linear / hf_kimi_linear (identical weights)":
                   ratios(results, "k3jax_kimi_linear", "hf_kimi_linear"),
                   f"k3jax_{config} / hf_kimi_linear (matched size)":
                   ratios(results, f"k3jax_{config}", "hf_kimi_linear")},
        "roofline": roofline({k: v for k, v in models.items() if not k.startswith("hf_")}, results, prompt_len,
                             new_tokens, bandwidth, matvec),
        "cache": cache_report(args.cache_config, args.cache_context),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
