"""One GPU session in one short command: the checks and timings that need a GPU, most important first.

    python bench/gpu.py --out DIR                 # default sections: at most 8.3 minutes (their time boxes)
    JAX_PLATFORMS=cpu python bench/gpu.py --quick # smoke run on CPU (kernels in interpret mode, tiny shapes)

Every section runs in a child process of its own, time-boxed (``BUDGET_S``, ``--budget-scale``): a case
that would start after the section's deadline is skipped and named, and a child still running at its
hard limit is killed without losing what it wrote. Progress goes to stderr as it happens; each section's
results to ``DIR/<section>.json`` after every case, the merged report to ``DIR/gpu.json`` after every
section and to stdout at the end. Sections, in order (``--sections`` picks some):

- ``check``: values on the device, fresh random inputs, RMS-relative errors against the pure-JAX ops at
  HIGHEST precision on the same device: the Triton chunk KDA (output, final state and all six
  gradients; bf16 dense and with packed documents, fp32 with packed documents, the exact-tile path),
  then the grouped matmuls (``gmm``, transposed, ``tgmm``; uneven groups with an empty expert), then the
  pure-JAX KDA on the device against itself on the CPU. fp32 should be ~1e-6, bf16 inputs ~1e-2;
- ``kda``: chunk KDA forward and forward + backward at B 1, T 8192, K = V = 128, chunk 64, bf16 q/k/v
  (fp32 gate and beta), H 16, 32 and 8: the Triton kernels (``pallas_kernels.kda``, ``safe_gate=True``),
  the pure-JAX op (XLA) and fla-core's Triton ``chunk_kda`` (imported, or installed from the ``*.whl``
  files beside this script into a temporary directory when fla is absent: the machine has no package
  index), plus the Triton output's error against XLA's at that shape; then, if the time box allows, the
  Triton kernels with other tiles (``KDA_SWEEP``) at the first shape;
- ``moe``: the grouped matmuls at K3's per-device shape, bf16: Triton kernels against ``lax.ragged_dot``;
- ``ceilings``: the device's measured bf16 and fp32 matmul rates (XLA, 8192^3) and its device-to-device
  copy bandwidth (bytes read + written): the peaks the figures above are divided by;
- ``train`` (not run by default): the step ``train.py`` runs (``make_train_step``; Muon + AdamW, Quantile
  Balancing) with bf16 compute, for each ``model.kda_impl`` / ``model.moe_impl`` pair, against HF
  ``KimiLinearForCausalLM`` of the same size on the same GPU (needs transformers, grain).

Timings: warm-up calls first (compiles, Triton autotuning), then the median of ``--repeats`` calls, each
waited for (``block_until_ready`` / ``torch.cuda.synchronize``). ``first_call_s`` is the compile.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import traceback

os.environ.setdefault("JAX_PLATFORMS", "cuda,cpu")  # cpu too: the check compares with it
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

HERE = pathlib.Path(__file__).resolve().parent
SECTIONS = ["check", "kda", "moe", "ceilings", "train"]
DEFAULT_SECTIONS = "check,kda,moe,ceilings"
# seconds per section on one H100 (the device budget of a session is 15 minutes, all calls together)
BUDGET_S = {"check": 140, "kda": 200, "moe": 50, "ceilings": 25, "train": 300}
GRACE_S = 20  # past the deadline, before the child is killed (a case already running finishes)

# (B, T, H, K, V, chunk) per timed KDA case, in order
KDA_SHAPES = {"quick": [(1, 96, 2, 32, 32, 32)],
              "full": [(1, 8192, 16, 128, 128, 64), (1, 8192, 32, 128, 128, 64), (1, 8192, 8, 128, 128, 64)]}
# (rows M = tokens x top-k, D, F, experts E): K3's per-device expert shape at 64-way EP
# the Triton KDA kernels' options tried last in the kda section, at its first shape (defaults: _gpu_layout.TILING)
KDA_SWEEP = [dict(block_v=32), dict(num_warps=8)]
MOE_SHAPES = {"quick": (256, 64, 96, 6), "full": (32768, 3584, 3072, 14)}
# train-step runs: (name, config, overrides, batch, seq_len)
MEDIUM = ["model.hidden_size=1024", "model.kda.num_heads=8", "model.kda.head_dim=128", "model.mla.num_heads=8",
          "model.mla.q_lora_rank=512", "model.mla.kv_lora_rank=256", "model.mla.qk_nope_head_dim=128",
          "model.mla.qk_rope_head_dim=64", "model.mla.v_head_dim=128", "model.moe.num_experts=64",
          "model.moe.top_k=8", "model.moe.expert_dim=512", "model.moe.latent_dim=512", "model.dense_ffn_dim=2816"]
TRAIN_RUNS = {"quick": [("tiny", "tiny", [], 2, 32)],
              "full": [("medium", "small", MEDIUM, 4, 2048)]}  # 731M parameters, 202M active
IMPLS = [("xla", "ragged_dot"), ("pallas", "pallas")]


class Section:
    """A section's results, saved to ``DIR/<name>.json`` after every case (``{"results": .., "meta": ..}``;
    meta: the device, each case's seconds), and its time box."""

    def __init__(self, name, out_dir, budget_s):
        self.name, self.path = name, pathlib.Path(out_dir) / f"{name}.json"
        self.deadline = time.monotonic() + budget_s
        self.results, self.meta = {}, {"budget_s": budget_s, "case_seconds": {}}

    def left(self):
        return self.deadline - time.monotonic()

    def save(self):
        self.path.write_text(json.dumps({"results": self.results, "meta": self.meta}, indent=1, default=float))

    def case(self, key, fn):
        """``results[key] = fn()``, or its error, or a skip past the deadline: one failing or slow case must
        not hide the others."""
        from common import log

        if self.left() <= 0:
            self.results[key] = {"skipped": "section time box"}
        else:
            t = time.perf_counter()
            try:
                self.results[key] = fn()
            except Exception as e:  # noqa: BLE001 - report and go on
                self.results[key] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            self.meta["case_seconds"][key] = round(time.perf_counter() - t, 1)
        log(f"  {key}: {short(self.results[key])}")
        self.save()
        return self.results[key]


def short(r):
    if isinstance(r, dict):
        return {k: (float(f"{v:.3g}") if isinstance(v, float) else v) for k, v in r.items()}
    return r


def rms_rel(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not np.all(np.isfinite(a)):
        return float("nan")
    return float(np.sqrt(np.mean((a - b) ** 2)) / (np.sqrt(np.mean(b**2)) + 1e-30))


def jax_time(f, args, repeats):
    """(first call s, median s) of a jitted ``f(*args)``."""
    import jax
    from common import median

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
    from common import median

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


def ceilings(sec, quick, repeats, seed, args):
    import jax
    import jax.numpy as jnp

    HI = jax.lax.Precision.HIGHEST
    n = 512 if quick else 8192
    for name, dtype, prec in (("bf16", jnp.bfloat16, None), ("fp32_highest", jnp.float32, HI),
                              ("fp32_default", jnp.float32, None)):
        ks = jax.random.split(jax.random.PRNGKey(0), 2)
        a, b = (jax.random.normal(k, (n, n), dtype) for k in ks)
        f = jax.jit(lambda a, b: jnp.matmul(a, b, precision=prec, preferred_element_type=jnp.float32))
        sec.case(f"matmul_{name}", lambda f=f, a=a, b=b: {"tflops": 2 * n**3 / jax_time(f, (a, b), repeats)[1] / 1e12,
                                                         "n": n})
    x = jax.random.normal(jax.random.PRNGKey(1), ((64 if quick else 1024) * 1024 * 256,), jnp.float32)
    sec.case("copy", lambda: {"gbps": 2 * x.nbytes / jax_time(jax.jit(lambda x: x * 2.0), (x,), repeats)[1] / 1e9})


# ----------------------------------------------------------------------------- check


def kda_inputs(B, T, H, K, V, dtype, seed):
    """bench/kernels.py's KDA inputs (l2-normalised q/k, the K3 gate's range) and random cotangents
    ``do [B, T, H, V]``, ``dS [B, H, K, V]``."""
    import jax
    import kernels

    ks = jax.random.split(jax.random.PRNGKey(seed + 1000), 2)
    return (*kernels.kda_inputs(B, T, H, K, V, dtype, seed), jax.random.normal(ks[0], (B, T, H, V)),
            jax.random.normal(ks[1], (B, H, K, V)))


def kda_value_and_grads(fn, C, segment_ids=None, **kw):
    """jit of ``(q, k, v, g, beta, h0, do, dS) -> ((o, S), (dq, dk, dv, dg, dbeta, dh0))``."""
    import jax
    import jax.numpy as jnp

    def loss(q, k, v, g, beta, h0, do, dS):
        o, S = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=C,
                  segment_ids=segment_ids, **kw)
        return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(S * dS), (o, S)

    def f(*args):
        grads, outs = jax.grad(loss, argnums=tuple(range(6)), has_aux=True)(*args)
        return outs, grads

    return jax.jit(f)


KDA_NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def check(sec, quick, repeats, seed, args):
    """Most telling first: the bf16 KDA kernels (the training dtype), then the grouped matmuls, then fp32."""
    import jax.numpy as jnp

    dtypes = [jnp.dtype(d) for d in args.check_dtypes.split(",")]
    low = [d for d in dtypes if d.itemsize < 4]
    full = [d for d in dtypes if d.itemsize >= 4]
    kda = check_kda(sec, quick, seed)
    for d in low:
        kda(d, packed=False)
        kda(d, packed=True)
    check_grouped_matmuls(sec, quick, seed, low + full)
    for d in full:
        kda(d, packed=True)
    if full:
        kda(full[0], packed=True, safe_gate=False)  # the exact diagonal tiles
    kda_xla_device_vs_cpu(sec, quick, seed)


def check_shape(quick):
    return (1, 40, 2, 32, 32, 16) if quick else (2, 1000, 4, 128, 128, 64)


def check_kda(sec, quick, seed):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from k3jax.ops import chunk_kda as xla_kda
    from pallas_kernels.kda import chunk_kda as pallas_kda

    B, T, H, K, V, C = check_shape(quick)
    seg_np = np.ones((B, T), np.int32)
    seg_np[:, T // 3:] = 2  # two packed documents per row
    seg_np[:, T // 2 + 5:] = 3  # and a third

    def run(dtype, packed, safe_gate=True):
        seg = jnp.asarray(seg_np) if packed else None
        args = kda_inputs(B, T, H, K, V, dtype, seed)
        with jax.default_matmul_precision("highest"):
            (o, S), grads = kda_value_and_grads(pallas_kda, C, seg, safe_gate=safe_gate)(*args)
            (o_r, S_r), grads_r = kda_value_and_grads(xla_kda, C, seg)(*[a.astype(jnp.float32) for a in args])
        return {n: rms_rel(a, b) for n, a, b in zip(KDA_NAMES, [o, S, *grads], [o_r, S_r, *grads_r])}

    def case(dtype, packed, safe_gate=True):
        key = f"kda_{jnp.dtype(dtype).name}{'_packed' if packed else ''}{'' if safe_gate else '_exact'}"
        sec.case(key, lambda: run(dtype, packed, safe_gate))

    return case


def kda_xla_device_vs_cpu(sec, quick, seed):
    """The pure-JAX op on this device against the same op on the CPU (fp32, HIGHEST)."""
    import jax
    import jax.numpy as jnp

    from k3jax.ops import chunk_kda as xla_kda

    B, T, H, K, V, C = check_shape(quick)

    def run():
        args = kda_inputs(B, T, H, K, V, jnp.float32, seed + 1)
        cpu = jax.devices("cpu")[0]
        with jax.default_matmul_precision("highest"):
            (o, S), grads = kda_value_and_grads(xla_kda, C)(*args)
            with jax.default_device(cpu):
                (o_c, S_c), grads_c = kda_value_and_grads(xla_kda, C)(*[jax.device_put(a, cpu) for a in args])
        return {n: rms_rel(a, b) for n, a, b in zip(KDA_NAMES, [o, S, *grads], [o_c, S_c, *grads_c])}

    sec.case("kda_xla_device_vs_cpu", run)


def check_grouped_matmuls(sec, quick, seed, dtypes):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.moe import gmm, tgmm

    HI = jax.lax.Precision.HIGHEST
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
        ref_tgmm = lambda x, dy, gs=gs: jax.vjp(lambda w: jax.lax.ragged_dot(x, w, gs, precision=HI),
                                                jnp.zeros((E, D, F), x.dtype))[1](dy)[0]
        cases = {"gmm": (lambda x, w, gs=gs: gmm(x, w, gs),
                         lambda x, w, gs=gs: jax.lax.ragged_dot(x, w, gs, precision=HI), (x, w)),
                 "gmm_transposed": (lambda dy, w, gs=gs: gmm(dy, w, gs, transpose_rhs=True),
                                    lambda dy, w, gs=gs: jax.lax.ragged_dot(dy, jnp.swapaxes(w, 1, 2), gs,
                                                                            precision=HI), (dy, w)),
                 "tgmm": (lambda x, dy, gs=gs: tgmm(x, dy, gs), ref_tgmm, (x, dy))}
        for name, (fp, fr, a) in cases.items():
            rows = slice(None) if name == "tgmm" else slice(0, n)  # rows past the groups are unspecified
            sec.case(f"{name}_{jnp.dtype(dtype).name}",
                     lambda fp=fp, fr=fr, a=a, rows=rows: rms_rel(jax.jit(fp)(*a)[rows],
                                                                  jax.jit(fr)(*map(up, a))[rows]))


# ----------------------------------------------------------------------------- kda


def import_fla_chunk_kda():
    """fla-core's ``chunk_kda``: imported, or installed with pip from the ``*.whl`` files beside this script
    (no index, no dependencies: fla-core needs torch, triton and einops, the last also a wheel here when
    missing) into a temporary directory first."""
    try:
        from fla.ops.kda import chunk_kda
        return chunk_kda
    except ImportError:
        wheels = sorted(HERE.glob("*.whl"))
        if not wheels:
            raise
    from common import log

    target = tempfile.mkdtemp(prefix="bench_gpu_wheels_")
    log(f"  installing {[w.name for w in wheels]} into {target}")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", target,
                    *map(str, wheels)], check=True)
    sys.path.insert(0, target)
    from fla.ops.kda import chunk_kda
    return chunk_kda


def kda_bench(sec, quick, repeats, seed, args):
    from k3jax.ops import chunk_kda as xla_kda
    from pallas_kernels.kda import chunk_kda as pallas_kda

    peers = [p for p in args.kda_peers.split(",") if p]
    fla = {}
    if "fla_triton" in peers:
        sec.case("fla_import", lambda: fla.setdefault("fn", import_fla_chunk_kda()) and {"ok": True})
    shapes = KDA_SHAPES["quick" if quick else "full"]
    base = [("k3jax_pallas", pallas_kda, dict(safe_gate=True)), ("k3jax_xla", xla_kda, {})]
    for shape in shapes:
        kda_shape(sec, shape, base, fla.get("fn"), repeats, seed)
    # last, if time is left: other tiles of the Triton kernels at the first shape (untuned so far)
    sweep = [(f"k3jax_pallas_{'_'.join(f'{k}{v}' for k, v in opts.items())}", pallas_kda,
              dict(safe_gate=True, gpu_options=opts)) for opts in KDA_SWEEP]
    kda_shape(sec, shapes[0], sweep, None, repeats, seed)


def kda_shape(sec, shape, impls, fla_fn, repeats, seed):
    """Times ``impls`` ``[(name, chunk_kda, kwargs)]`` (and fla's kernel) at one shape, forward and forward +
    backward; the first Pallas output's error against XLA's; speed-ups of the Pallas kernels."""
    import jax
    import jax.numpy as jnp
    import kernels

    B, T, H, K, V, C = shape
    tag = f"B{B}_T{T}_H{H}"
    flops, _ = kernels.kda_cost(B, T, H, K, V, C, 2)
    sec.meta[f"{tag}_shape"] = {"B": B, "T": T, "H": H, "K": K, "V": V, "chunk": C, "qkv": "bfloat16",
                                "flops_fwd": flops}
    q, k, v, g, beta, h0, do, dS = kda_inputs(B, T, H, K, V, jnp.bfloat16, seed)
    inputs = (q, k, v, g, beta, h0)
    outs = {}

    def jax_impl(fn, **kw):
        fwd = jax.jit(lambda q, k, v, g, beta, h0: fn(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                      chunk_size=C, **kw))

        def loss(q, k, v, g, beta, h0):
            o, S = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=C, **kw)
            return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(S * dS)

        return fwd, jax.jit(jax.grad(loss, argnums=tuple(range(6))))

    def timed(name, fwd, fb):
        first, t = jax_time(fwd, inputs, repeats)
        outs[name] = fwd(*inputs)[0]
        first_b, tb = jax_time(fb, inputs, repeats)
        return {"fwd_ms": t * 1e3, "fwd_bwd_ms": tb * 1e3, "first_call_s": first, "first_call_bwd_s": first_b,
                "fwd_tflops": flops / t / 1e12, "fwd_bwd_tflops": 3 * flops / tb / 1e12}

    for name, fn, kw in impls:
        sec.case(f"{tag}_{name}", lambda name=name, fn=fn, kw=kw: timed(name, *jax_impl(fn, **kw)))
    if "k3jax_pallas" in outs and "k3jax_xla" in outs:
        sec.results[f"{tag}_pallas_o_rms_rel_vs_xla"] = rms_rel(outs["k3jax_pallas"], outs["k3jax_xla"])
    if fla_fn is not None:
        sec.case(f"{tag}_fla_triton", lambda: torch_kda(fla_fn, inputs, do, dS, repeats, flops, outs.get("k3jax_xla")))
    pallas = [name for name, _, _ in impls if name.startswith("k3jax_pallas")]
    for mine in pallas:
        base = sec.results.get(f"{tag}_{mine}", {})
        for peer in ("k3jax_xla", "fla_triton"):
            r = sec.results.get(f"{tag}_{peer}", {})
            if "fwd_ms" in r and "fwd_ms" in base:
                sec.results[f"{tag}_speedup_{mine}_vs_{peer}"] = {"fwd": r["fwd_ms"] / base["fwd_ms"],
                                                                  "fwd_bwd": r["fwd_bwd_ms"] / base["fwd_bwd_ms"]}
    sec.save()


def torch_kda(fn, inputs, do, dS, repeats, flops, ref):
    """A torch chunk KDA (fla's Triton kernel) on the same GPU and inputs; its first call autotunes."""
    import numpy as np
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"

    def tt(x):
        t = torch.from_numpy(np.array(x.astype("float32"))).to(dev)
        return t.to(torch.bfloat16) if x.dtype.name == "bfloat16" else t

    q, k, v, g, beta, h0 = map(tt, inputs)
    do_t, dS_t = tt(do), tt(dS)

    def fwd():
        with torch.no_grad():
            return fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, safe_gate=True)

    def fwd_bwd():
        xs = [x.detach().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
        o, S = fn(*xs[:5], initial_state=xs[5], output_final_state=True, safe_gate=True)
        ((o.float() * do_t).sum() + (S.float() * dS_t).sum()).backward()
        return [x.grad for x in xs]

    first, t = torch_time(fwd, (), repeats)
    o, _ = fwd()
    first_b, tb = torch_time(fwd_bwd, (), repeats)
    res = {"fwd_ms": t * 1e3, "fwd_bwd_ms": tb * 1e3, "first_call_s": first, "first_call_bwd_s": first_b,
           "fwd_tflops": flops / t / 1e12, "fwd_bwd_tflops": 3 * flops / tb / 1e12}
    if ref is not None:
        res["o_rms_rel_vs_k3jax_xla"] = rms_rel(o.float().cpu().numpy(), ref)
    torch.cuda.empty_cache() if dev == "cuda" else None
    return res


# ----------------------------------------------------------------------------- moe


def moe_bench(sec, quick, repeats, seed, args):
    import jax
    import jax.numpy as jnp
    import numpy as np

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
    sec.meta["shape"] = {"M": M, "D": D, "F": F, "E": E, "dtype": "bfloat16", "flops": flops}

    def both(fp, fx, a):
        r = {}
        for impl, f in (("pallas", fp), ("ragged_dot", fx)):
            try:
                _, t = jax_time(jax.jit(f), a, repeats)
                r[impl] = {"ms": t * 1e3, "tflops": flops / t / 1e12}
            except Exception as e:  # noqa: BLE001 - the other implementation still runs
                r[impl] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        if "ms" in r["pallas"] and "ms" in r["ragged_dot"]:
            r["speedup_pallas_vs_ragged_dot"] = r["ragged_dot"]["ms"] / r["pallas"]["ms"]
        return r

    for name, (fp, fx, a) in cases.items():
        sec.case(name, lambda fp=fp, fx=fx, a=a: both(fp, fx, a))


# ----------------------------------------------------------------------------- train


def train_bench(sec, quick, repeats, seed, args):
    import numpy as np
    import torch
    import transformers
    from common import hf_kimi_linear_config, log, median, randomize_torch, torch_param_counts
    from transformers import KimiLinearForCausalLM
    from train_step import HFStep, K3jaxStep, model_flops_per_step, synthetic_batch

    from k3jax.config import load_config
    from k3jax.model import create_model
    from k3jax.params import count_params

    transformers.logging.set_verbosity_error()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
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
        sec.results[label] = run
        sec.save()
        del steps, hf_model
        torch.cuda.empty_cache() if dev == "cuda" else None


RUNNERS = {"check": check, "kda": kda_bench, "moe": moe_bench, "ceilings": ceilings, "train": train_bench}


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="directory for gpu.json and the per-section files")
    ap.add_argument("--sections", default=DEFAULT_SECTIONS, help=f"comma-separated, of {SECTIONS}")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, one repeat (a CPU smoke run)")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls, median taken (default 10; 1 quick)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-scale", type=float, default=1.0, help="multiplies every section's time box")
    ap.add_argument("--kda-peers", default="fla_triton", help="torch peers of the kda section ('' for none)")
    ap.add_argument("--check-dtypes", default="bfloat16,float32", help="dtypes of the check section")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # run one section in this process
    return ap.parse_args(argv)


def run_child(a):
    """One section in this process: its results go to ``--out``/<section>.json case by case."""
    sys.path.insert(0, str(HERE))
    from common import log

    import jax

    name = a.child
    sec = Section(name, a.out, BUDGET_S[name] * a.budget_scale)
    dev = jax.devices()[0]
    sec.meta.update(device=f"{dev.platform}: {dev.device_kind}", jax=jax.__version__)
    repeats = a.repeats or (1 if a.quick else 10)
    try:
        RUNNERS[name](sec, a.quick, repeats, a.seed, a)
    except Exception as e:  # noqa: BLE001 - a broken section is reported, not fatal
        sec.results["error"] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        log(sec.results["error"]["traceback"])
    sec.save()


def main(argv=None):
    a = parse(argv)
    if a.child:
        return run_child(a)
    names = [n for n in a.sections.split(",") if n]
    for n in names:
        if n not in RUNNERS:
            raise SystemExit(f"--sections: unknown section {n!r}; choose from {SECTIONS}")
    out = pathlib.Path(a.out or tempfile.mkdtemp(prefix="bench_gpu_"))
    out.mkdir(parents=True, exist_ok=True)
    report = {"bench": "gpu", "quick": a.quick, "out": str(out),
              "load_average_1_5_15min": [round(x, 2) for x in os.getloadavg()], "section_seconds": {}}
    passthrough = [f"--out={out}", f"--seed={a.seed}", f"--budget-scale={a.budget_scale}",
                   f"--kda-peers={a.kda_peers}", f"--check-dtypes={a.check_dtypes}"]
    passthrough += (["--quick"] if a.quick else []) + ([f"--repeats={a.repeats}"] if a.repeats else [])
    for name in names:
        print(f"== {name} (time box {BUDGET_S[name] * a.budget_scale:.0f} s)", file=sys.stderr, flush=True)
        limit = BUDGET_S[name] * a.budget_scale + GRACE_S
        t = time.perf_counter()
        path = out / f"{name}.json"
        path.unlink(missing_ok=True)
        try:  # the child's stdout goes to our stderr: stdout carries only the JSON report
            subprocess.run([sys.executable, __file__, f"--child={name}", *passthrough], timeout=limit,
                           stdout=sys.stderr, check=False)
            killed = None
        except subprocess.TimeoutExpired:
            killed = f"killed at its hard limit, {limit:.0f} s"
        saved = json.loads(path.read_text()) if path.exists() else {"results": {}, "meta": {}}
        report[name] = saved["results"] or {"error": {"error": "the section wrote nothing"}}
        report.setdefault("meta", {})[name] = saved["meta"]
        if killed:
            report[name]["killed"] = {"error": killed}
        report["section_seconds"][name] = round(time.perf_counter() - t, 1)
        (out / "gpu.json").write_text(json.dumps(report, indent=1, default=float))
    print(json.dumps(report, indent=1, default=float))


if __name__ == "__main__":
    sys.exit(main())
