"""One GPU session in one script: the checks and timings that need a GPU; prints one JSON document.

    python bench/gpu.py --out DIR                 # everything, ~6 minutes on one H200
    JAX_PLATFORMS=cpu python bench/gpu.py --quick # smoke run on CPU (kernels in interpret mode, tiny shapes)

Sections, in order (``--sections`` picks some; each is written to ``DIR/gpu.json`` as soon as it ends, so a
run cut off at its time limit keeps what it finished):

- ``ceilings``: the device's measured bf16 and fp32 matmul rates (XLA, 8192^3, median of 10) and its
  device-to-device copy bandwidth (bytes read + written): the peaks every figure below is divided by;
- ``check``: correctness on the device, on fresh random inputs. The Triton chunk-KDA kernel (forward, final
  state and all six gradients; fp32 and bf16; T not a multiple of the chunk; packed segments) and the
  grouped matmuls (``gmm``, transposed, ``tgmm``; uneven groups with an empty expert) against the pure-JAX
  ops at HIGHEST precision on the same device, and the pure-JAX chunk KDA on the device against itself on
  the CPU. RMS-relative errors; fp32 should be ~1e-6, bf16 inputs ~1e-2;
- ``kda``: chunk KDA forward and forward + backward, bf16 q/k/v (fp32 gate and beta), at ``--kda-shape``:
  the Triton kernel, the pure-JAX op (XLA), fla-core's Triton ``chunk_kda`` and HF transformers' torch
  chunk KDA on the same GPU (the torch peers when importable);
- ``moe``: the grouped matmuls at K3's per-device shape, bf16: Triton kernels against ``lax.ragged_dot``;
- ``train``: the step ``train.py`` runs (``make_train_step``; Muon + AdamW, Quantile Balancing) with bf16
  compute, for each ``model.kda_impl`` / ``model.moe_impl`` pair, against HF ``KimiLinearForCausalLM`` of
  the same size (``bench/common.hf_kimi_linear_config``; torch AdamW, bf16 autocast) on the same GPU.
  ``achieved`` = ``6 N_active tokens`` + attention / recurrence FLOPs (``train_step.model_flops_per_step``)
  per second, against the measured bf16 matmul rate.

Timings: warm-up calls first (compiles, Triton autotuning), then the median of ``--repeats`` calls, each
waited for (``block_until_ready`` / ``torch.cuda.synchronize``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import time
import traceback

os.environ.setdefault("JAX_PLATFORMS", "cuda,cpu")  # cpu too: the check compares with it
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

from common import hf_kimi_linear_config, log, median, randomize_torch, torch_param_counts  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import kernels  # noqa: E402

HI = jax.lax.Precision.HIGHEST

# (B, T, H, K, V, chunk)
KDA_SHAPES = {"quick": (1, 96, 2, 32, 32, 32), "full": (2, 8192, 16, 128, 128, 64)}
# (rows M = tokens x top-k, D, F, experts E): K3's per-device expert shape at 64-way EP
MOE_SHAPES = {"quick": (256, 64, 96, 6), "full": (32768, 3584, 3072, 14)}
# train-step runs: (name, config, overrides, batch, seq_len)
MEDIUM = ["model.hidden_size=1024", "model.kda.num_heads=8", "model.kda.head_dim=128", "model.mla.num_heads=8",
          "model.mla.q_lora_rank=512", "model.mla.kv_lora_rank=256", "model.mla.qk_nope_head_dim=128",
          "model.mla.qk_rope_head_dim=64", "model.mla.v_head_dim=128", "model.moe.num_experts=64",
          "model.moe.top_k=8", "model.moe.expert_dim=512", "model.moe.latent_dim=512", "model.dense_ffn_dim=2816"]
TRAIN_RUNS = {"quick": [("tiny", "tiny", [], 2, 32)],
              "full": [("medium", "small", MEDIUM, 4, 2048)]}  # 731M parameters, 202M active
IMPLS = [("xla", "ragged_dot"), ("pallas", "pallas")]


def rms_rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not np.all(np.isfinite(a)):
        return float("nan")
    return float(np.sqrt(np.mean((a - b) ** 2)) / (np.sqrt(np.mean(b**2)) + 1e-30))


def jax_time(f, args, repeats):
    """(first call s, median s) of a jitted ``f(*args)``."""
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    first = time.perf_counter() - t
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return first, median(ts)


def torch_time(f, args, repeats):
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    t = time.perf_counter()
    f(*args)
    sync()
    first = time.perf_counter() - t
    f(*args)
    sync()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        f(*args)
        sync()
        ts.append(time.perf_counter() - t)
    return first, median(ts)


# ----------------------------------------------------------------------------- ceilings


def ceilings(quick, repeats):
    n = 512 if quick else 8192
    out = {}
    for name, dtype, prec in (("bf16", jnp.bfloat16, None), ("fp32_highest", jnp.float32, HI),
                              ("fp32_default", jnp.float32, None)):
        ks = jax.random.split(jax.random.PRNGKey(0), 2)
        a, b = (jax.random.normal(k, (n, n), dtype) for k in ks)
        f = jax.jit(lambda a, b: jnp.matmul(a, b, precision=prec, preferred_element_type=jnp.float32))
        _, t = jax_time(f, (a, b), repeats)
        out[f"matmul_{name}_tflops"] = round(2 * n**3 / t / 1e12, 2)
    x = jax.random.normal(jax.random.PRNGKey(1), ((64 if quick else 1024) * 1024 * 256,), jnp.float32)
    _, t = jax_time(jax.jit(lambda x: x * 2.0), (x,), repeats)
    out["copy_gbps"] = round(2 * x.nbytes / t / 1e9, 1)
    out["matmul_n"] = n
    return out


# ----------------------------------------------------------------------------- check


def kda_inputs(B, T, H, K, V, dtype, seed):
    """bench/kernels.py's KDA inputs (l2-normalised q/k, the K3 gate's range) and random cotangents
    ``do [B, T, H, V]``, ``dS [B, H, K, V]``."""
    ks = jax.random.split(jax.random.PRNGKey(seed + 1000), 2)
    return (*kernels.kda_inputs(B, T, H, K, V, dtype, seed), jax.random.normal(ks[0], (B, T, H, V)),
            jax.random.normal(ks[1], (B, H, K, V)))


def kda_value_and_grads(fn, C, segment_ids=None):
    """jit of ``(q, k, v, g, beta, h0, do, dS) -> ((o, S), (dq, dk, dv, dg, dbeta, dh0))``."""

    def loss(q, k, v, g, beta, h0, do, dS):
        o, S = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=C,
                  segment_ids=segment_ids)
        return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(S * dS), (o, S)

    def f(*args):
        grads, outs = jax.grad(loss, argnums=tuple(range(6)), has_aux=True)(*args)
        return outs, grads

    return jax.jit(f)


def guarded(out, key, fn):
    """``out[key] = fn()``, or the error: one failing case must not hide the others."""
    try:
        out[key] = fn()
        worst = max(out[key].values()) if isinstance(out[key], dict) else out[key]
        log(f"  {key}: worst rms_rel {worst:.2e}")
    except Exception as e:  # noqa: BLE001
        out[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        log(f"  {key}: {out[key]['error']}")


def check(quick, seed, dtypes=(jnp.float32, jnp.bfloat16)):
    out = {}
    check_grouped_matmuls(out, quick, seed, dtypes)
    check_kda(out, quick, seed, dtypes)
    return out


def check_grouped_matmuls(out, quick, seed, dtypes):
    from pallas_kernels.moe import gmm, tgmm

    M, D, F, E = (200, 48, 80, 5) if quick else (3000, 512, 384, 9)
    for dtype in dtypes:
        ks = jax.random.split(jax.random.PRNGKey(seed + 2), 3)
        x = jax.random.normal(ks[0], (M, D)).astype(dtype)
        w = (jax.random.normal(ks[1], (E, D, F)) / math.sqrt(D)).astype(dtype)
        dy = jax.random.normal(ks[2], (M, F)).astype(dtype)
        p = np.random.default_rng(seed).dirichlet(np.ones(E))
        p[E // 2] = 0.0  # an empty expert
        sizes = np.floor(p / p.sum() * (M - 7)).astype(np.int32)  # 7 trailing rows belong to no group
        sizes[0] += M - 7 - sizes.sum()
        gs = jnp.asarray(sizes)
        n = int(sizes.sum())
        up = lambda a: a.astype(jnp.float32)
        ref_tgmm = lambda x, dy: jax.vjp(lambda w: jax.lax.ragged_dot(x, w, gs, precision=HI),
                                         jnp.zeros((E, D, F), x.dtype))[1](dy)[0]
        cases = {"gmm": (lambda x, w: gmm(x, w, gs), lambda x, w: jax.lax.ragged_dot(x, w, gs, precision=HI),
                         (x, w)),
                 "gmm_transposed": (lambda dy, w: gmm(dy, w, gs, transpose_rhs=True),
                                    lambda dy, w: jax.lax.ragged_dot(dy, jnp.swapaxes(w, 1, 2), gs, precision=HI),
                                    (dy, w)),
                 "tgmm": (lambda x, dy: tgmm(x, dy, gs), ref_tgmm, (x, dy))}
        for name, (fp, fr, a) in cases.items():
            rows = slice(None) if name == "tgmm" else slice(0, n)  # rows past the groups are unspecified
            guarded(out, f"{name}_{jnp.dtype(dtype).name}",
                    lambda fp=fp, fr=fr, a=a, rows=rows: rms_rel(jax.jit(fp)(*a)[rows], jax.jit(fr)(*map(up, a))[rows]))


def check_kda(out, quick, seed, dtypes):
    from k3jax.ops import chunk_kda as xla_kda
    from pallas_kernels.kda import chunk_kda as pallas_kda

    B, T, H, K, V, C = (1, 40, 2, 32, 32, 16) if quick else (2, 1000, 4, 128, 128, 64)
    names = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0")
    seg_np = np.ones((B, T), np.int32)
    seg_np[:, T // 3:] = 2  # two packed documents per row

    def pallas_vs_xla(dtype, seg):
        args = kda_inputs(B, T, H, K, V, dtype, seed)
        with jax.default_matmul_precision("highest"):
            (o, S), grads = kda_value_and_grads(pallas_kda, C, seg)(*args)
            (o_r, S_r), grads_r = kda_value_and_grads(xla_kda, C, seg)(*[a.astype(jnp.float32) for a in args])
        return {n: rms_rel(a, b) for n, a, b in zip(names, [o, S, *grads], [o_r, S_r, *grads_r])}

    def xla_device_vs_cpu():  # the pure-JAX op on this device against the same op on the CPU (fp32, HIGHEST)
        args = kda_inputs(B, T, H, K, V, jnp.float32, seed + 1)
        cpu = jax.devices("cpu")[0]
        with jax.default_matmul_precision("highest"):
            (o, S), grads = kda_value_and_grads(xla_kda, C)(*args)
            with jax.default_device(cpu):
                (o_c, S_c), grads_c = kda_value_and_grads(xla_kda, C)(*[jax.device_put(a, cpu) for a in args])
        return {n: rms_rel(a, b) for n, a, b in zip(names, [o, S, *grads], [o_c, S_c, *grads_c])}

    guarded(out, "kda_xla_device_vs_cpu", xla_device_vs_cpu)
    for dtype in sorted(dtypes, key=lambda d: jnp.dtype(d).itemsize):  # bf16 first: fp32 needs more shared memory
        for packed in (False, True):
            seg = jnp.asarray(seg_np) if packed else None
            guarded(out, f"kda_{jnp.dtype(dtype).name}{'_packed' if packed else ''}",
                    lambda dtype=dtype, seg=seg: pallas_vs_xla(dtype, seg))


# ----------------------------------------------------------------------------- kda


def kda_bench(quick, repeats, seed, peers=("fla_triton", "hf_torch")):
    from k3jax.ops import chunk_kda as xla_kda
    from pallas_kernels.kda import chunk_kda as pallas_kda

    B, T, H, K, V, C = KDA_SHAPES["quick" if quick else "full"]
    flops, _ = kernels.kda_cost(B, T, H, K, V, C, 2)
    q, k, v, g, beta, h0, do, dS = kda_inputs(B, T, H, K, V, jnp.bfloat16, seed)
    res = {"shape": {"B": B, "T": T, "H": H, "K": K, "V": V, "chunk": C, "qkv": "bfloat16"},
           "flops_fwd": flops}

    def jax_impl(fn, **kw):
        fwd = jax.jit(lambda q, k, v, g, beta, h0: fn(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                      chunk_size=C, **kw))

        def loss(q, k, v, g, beta, h0):
            o, S = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=C, **kw)
            return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(S * dS)

        return fwd, jax.jit(jax.grad(loss, argnums=tuple(range(6))))

    impls = {"k3jax_pallas": jax_impl(pallas_kda, safe_gate=True), "k3jax_xla": jax_impl(xla_kda)}
    args = (q, k, v, g, beta, h0)
    outs = {}
    for name, (fwd, fb) in impls.items():
        try:
            first, t = jax_time(fwd, args, repeats)
            outs[name] = fwd(*args)
            _, tb = jax_time(fb, args, repeats)
            res[name] = {"fwd_ms": t * 1e3, "fwd_bwd_ms": tb * 1e3, "first_call_s": first,
                         "fwd_tflops": flops / t / 1e12, "fwd_bwd_tflops": 3 * flops / tb / 1e12}
        except Exception as e:  # noqa: BLE001 - report and go on
            res[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        log(f"  {name}: {res[name]}")
    res.update(torch_kda_peers(args, do, dS, C, repeats, flops, outs.get("k3jax_xla"), peers))
    base = res.get("k3jax_pallas", {})
    for name, r in list(res.items()):
        if isinstance(r, dict) and "fwd_ms" in r and "fwd_ms" in base and name != "k3jax_pallas":
            res[f"speedup_pallas_vs_{name}"] = {"fwd": r["fwd_ms"] / base["fwd_ms"],
                                                "fwd_bwd": r["fwd_bwd_ms"] / base["fwd_bwd_ms"]}
    return res


def torch_kda_peers(args, do, dS, C, repeats, flops, ref, wanted):
    """fla-core's Triton chunk_kda and HF's torch chunk KDA on the same GPU, same inputs."""
    try:
        import torch
    except ImportError:
        return {}
    dev = "cuda" if torch.cuda.is_available() else "cpu"

    def tt(x):
        t = torch.from_numpy(np.array(x.astype(jnp.float32))).to(dev)
        return t.to(torch.bfloat16) if x.dtype == jnp.bfloat16 else t

    q, k, v, g, beta, h0 = map(tt, args)
    do_t, dS_t = tt(do), tt(dS)
    peers = {}
    try:
        if "hf_torch" not in wanted:
            raise ImportError("not asked for (--kda-peers)")
        from transformers.models.kimi_linear import modeling_kimi_linear as hf

        peers["hf_torch"] = hf.chunk_kimi_delta_attention
    except Exception as e:  # noqa: BLE001
        log(f"  HF unavailable: {type(e).__name__}: {e}")
    try:  # last: its Triton autotuning takes minutes on the first call
        if "fla_triton" not in wanted:
            raise ImportError("not asked for (--kda-peers)")
        from fla.ops.kda import chunk_kda as fla_kda

        peers["fla_triton"] = lambda *a, **kw: fla_kda(*a, safe_gate=True, **kw)
    except Exception as e:  # noqa: BLE001
        log(f"  fla unavailable: {type(e).__name__}: {e}")
    res = {}
    for name, fn in peers.items():
        def fwd():
            with torch.no_grad():
                return fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)

        def fwd_bwd():
            xs = [x.detach().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
            o, S = fn(*xs[:5], initial_state=xs[5], output_final_state=True)
            ((o.float() * do_t).sum() + (S.float() * dS_t).sum()).backward()
            return [x.grad for x in xs]

        try:
            first, t = torch_time(fwd, (), repeats)
            o, _ = fwd()
            _, tb = torch_time(fwd_bwd, (), repeats)
            res[name] = {"fwd_ms": t * 1e3, "fwd_bwd_ms": tb * 1e3, "first_call_s": first,
                         "fwd_tflops": flops / t / 1e12, "fwd_bwd_tflops": 3 * flops / tb / 1e12}
            if ref is not None:
                res[name]["o_rms_rel_vs_k3jax_xla"] = rms_rel(o.float().cpu().numpy(), ref[0])
        except Exception as e:  # noqa: BLE001
            res[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        log(f"  {name}: {res[name]}")
        torch.cuda.empty_cache() if dev == "cuda" else None
    return res


# ----------------------------------------------------------------------------- moe


def moe_bench(quick, repeats, seed):
    from pallas_kernels.moe import gmm, tgmm

    M, D, F, E = MOE_SHAPES["quick" if quick else "full"]
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(ks[0], (M, D), jnp.bfloat16)
    w = (jax.random.normal(ks[1], (E, D, F)) / math.sqrt(D)).astype(jnp.bfloat16)
    dy = jax.random.normal(ks[2], (M, F), jnp.bfloat16)
    p = np.random.default_rng(seed).dirichlet(20 * np.ones(E))  # near-balanced, as Quantile Balancing keeps it
    sizes = np.floor(p / p.sum() * M).astype(np.int32)
    sizes[0] += M - sizes.sum()
    gs = jnp.asarray(sizes)
    flops = 2 * M * D * F
    tg_ref = lambda x, dy: jax.vjp(lambda w: jax.lax.ragged_dot(x, w, gs), jnp.zeros((E, D, F), x.dtype))[1](dy)[0]
    cases = {"gmm": ((lambda x, w: gmm(x, w, gs)), (lambda x, w: jax.lax.ragged_dot(x, w, gs)), (x, w)),
             "gmm_transposed": ((lambda dy, w: gmm(dy, w, gs, transpose_rhs=True)),
                                (lambda dy, w: jax.lax.ragged_dot(dy, jnp.swapaxes(w, 1, 2), gs)), (dy, w)),
             "tgmm": ((lambda x, dy: tgmm(x, dy, gs)), tg_ref, (x, dy))}
    res = {"shape": {"M": M, "D": D, "F": F, "E": E, "dtype": "bfloat16"}, "flops": flops}
    for name, (fp, fx, a) in cases.items():
        r = {}
        for impl, f in (("pallas", fp), ("ragged_dot", fx)):
            try:
                _, t = jax_time(jax.jit(f), a, repeats)
                r[impl] = {"ms": t * 1e3, "tflops": flops / t / 1e12}
            except Exception as e:  # noqa: BLE001
                r[impl] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        if "ms" in r["pallas"] and "ms" in r["ragged_dot"]:
            r["speedup_pallas_vs_ragged_dot"] = r["ragged_dot"]["ms"] / r["pallas"]["ms"]
        res[name] = r
        log(f"  {name}: {r}")
    return res


# ----------------------------------------------------------------------------- train


def train_bench(quick, repeats, seed):
    import torch
    import transformers
    from transformers import KimiLinearForCausalLM
    from train_step import HFStep, K3jaxStep, model_flops_per_step, synthetic_batch

    from k3jax.config import load_config
    from k3jax.model import create_model
    from k3jax.params import count_params

    transformers.logging.set_verbosity_error()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    res = {}
    for label, name, overrides, batch_size, seq_len in TRAIN_RUNS["quick" if quick else "full"]:
        base = [f"train.batch_size={batch_size}", f"train.seq_len={seq_len}", "model.dtype=bfloat16", *overrides]
        cfg = load_config(name, base)
        batch = synthetic_batch(np.random.default_rng(seed), batch_size, seq_len, cfg.model.vocab_size)
        tokens = batch_size * seq_len
        run = {"config": name, "overrides": overrides, "tokens_per_step": tokens,
               "params": count_params(cfg.model)}
        steps = {}
        for kda_impl, moe_impl in IMPLS:
            key = f"k3jax_kda_{kda_impl}_moe_{moe_impl}"
            try:
                c = load_config(name, [*base, f"model.kda_impl={kda_impl}", f"model.moe_impl={moe_impl}"])
                steps[key] = K3jaxStep(c, create_model(c.model, seed=seed), batch)
            except Exception as e:  # noqa: BLE001
                run[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                log(f"  {key}: {run[key]['error']}")
        hf_model = KimiLinearForCausalLM(hf_kimi_linear_config(cfg.model))
        randomize_torch(hf_model, seed)
        hf_params = torch_param_counts(hf_model)
        steps["hf_kimi_linear"] = HFStep(hf_model.to(dev), batch, device=dev, autocast=torch.bfloat16)
        flops = {k: model_flops_per_step(cfg.model, run["params"]["active"], batch_size, seq_len) for k in steps}
        flops["hf_kimi_linear"] = model_flops_per_step(cfg.model, hf_params["active"], batch_size, seq_len)
        for key, s in steps.items():
            try:
                t = time.perf_counter()
                s.block(s())
                first = time.perf_counter() - t
                ts = []
                for _ in range(repeats):
                    t = time.perf_counter()
                    s.block(s())
                    ts.append(time.perf_counter() - t)
                step = median(ts)
                run[key] = {"tokens_per_s": round(tokens / step), "step_ms": round(step * 1e3, 2),
                            "compile_s": round(s.compile_s, 1), "first_step_s": round(first, 2),
                            "last_loss": round(s.loss, 4), "achieved_tflops": flops[key] / step / 1e12,
                            "model_flops_per_step": flops[key]}
            except Exception as e:  # noqa: BLE001
                run[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            log(f"  {label} {key}: {run[key]}")
        run["hf_params"] = hf_params
        hf = run.get("hf_kimi_linear", {})
        for key in steps:
            if key != "hf_kimi_linear" and "tokens_per_s" in run.get(key, {}) and "tokens_per_s" in hf:
                run[f"ratio_{key}_vs_hf"] = run[key]["tokens_per_s"] / hf["tokens_per_s"]
        res[label] = run
        del steps, hf_model
        torch.cuda.empty_cache() if dev == "cuda" else None
    return res


SECTIONS = {"ceilings": ceilings, "check": check, "kda": kda_bench, "moe": moe_bench, "train": train_bench}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="directory for gpu.json (written after every section)")
    ap.add_argument("--sections", default="ceilings,check,moe,kda,train")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, one repeat (a CPU smoke run)")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls, median taken (default 10; 1 quick)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kda-peers", default="hf_torch,fla_triton", help="torch peers of the kda section")
    ap.add_argument("--check-dtypes", default="float32,bfloat16", help="dtypes of the check section")
    a = ap.parse_args(argv)
    repeats = a.repeats or (1 if a.quick else 10)
    dev = jax.devices()[0]
    report = {"bench": "gpu", "device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
              "quick": a.quick, "load_average_1_5_15min": [round(x, 2) for x in os.getloadavg()]}
    try:
        import torch

        report["torch"] = torch.__version__
    except ImportError:
        pass
    out_path = pathlib.Path(a.out) / "gpu.json" if a.out else None
    for name in a.sections.split(","):
        log(f"== {name}")
        t = time.perf_counter()
        try:
            fn = SECTIONS[name]
            if name == "ceilings":
                report[name] = fn(a.quick, repeats)
            elif name == "check":
                report[name] = fn(a.quick, a.seed, [jnp.dtype(d) for d in a.check_dtypes.split(",")])
            elif name == "kda":
                report[name] = fn(a.quick, repeats, a.seed, a.kda_peers.split(","))
            else:
                report[name] = fn(a.quick, repeats, a.seed)
        except Exception as e:  # noqa: BLE001 - one broken section must not lose the others
            report[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            log(report[name]["traceback"])
        report.setdefault("section_seconds", {})[name] = round(time.perf_counter() - t, 1)
        if out_path:
            out_path.write_text(json.dumps(report, indent=1, default=float))
    print(json.dumps(report, indent=1, default=float))


if __name__ == "__main__":
    sys.exit(main())
