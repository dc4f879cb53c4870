"""Chunk KDA on CPU: ``k3jax.ops.chunk_kda`` against the pure-torch chunk KDAs; prints one JSON document.

    python bench/kda_cpu.py                       # B 1, T 4096, H 8, K = V = 128, float32
    python bench/kda_cpu.py --T 1024 --repeats 3  # a quicker run

In one process, interleaved repeat by repeat (so that load from other processes hits all alike):

- ``k3jax``: ``k3jax.ops.chunk_kda`` under ``jax.jit`` (XLA optimisations on);
- ``hf``: HF transformers' ``chunk_kimi_delta_attention`` (``models/kimi_linear``), the torch fallback
  that ``KimiLinearForCausalLM`` runs without fla's Triton kernels;
- ``fla_naive``: fla-core's ``naive_chunk_kda`` (torch), when installed.

Forward = ``(o, final_state)`` from an initial state, at ``--T`` (4096); forward + backward = the
gradients of ``sum(o * do) + sum(S * dS)`` with respect to q, k, v, g, beta and the initial state (torch:
autograd), at ``--bwd-T`` (1024: HF's autograd of its pairwise decays needs ~11 GB at 4096, more than
this shared machine allows one process); k3jax's forward + backward is also timed at ``--T``.
The K3 gate (``-5 sigmoid(z)``) feeds all three. Reported per implementation: median seconds over the
repeats, tokens/s, and achieved GFLOP/s of the chunkwise algorithm's useful FLOPs (``kda_flops``: the
same count for every implementation; the backward counted as twice the forward) as a fraction of this
machine's float32 matmul peak, measured here with XLA and torch (the best of both). Ratios
``k3jax / hf`` are the figures to read; ``load_average`` says how busy the machine was. The outputs of
all three are compared once (``parity``: RMS-relative difference against k3jax).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import time

# common first: it pins JAX to the CPU before jax is imported
from common import cpu_info, log, median

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from k3jax.ops import chunk_kda  # noqa: E402


def kda_flops(B, T, H, K, V, C):
    """Useful FLOPs of one chunkwise forward: per chunk the two score matrices (2 C^2 K each), the
    triangular solve (C^3 / 3), U and W (C^2 (K + V)), W S and (q Gamma) S (2 C K V), A_qk delta (C^2 V)
    and the state update (C K V); a multiply-add is 2 FLOPs."""
    N = -(-T // C)
    return 2 * B * H * N * (2 * C * C * K + C**3 / 6 + C * C * (K + V) + 3 * C * K * V + C * C * V)


def matmul_peak_gflops(n=1024, repeats=7):
    """Best float32 GFLOP/s of an n x n x n matmul, XLA and torch (the machine's practical peak)."""
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n))
    f = jax.jit(lambda x, y: x @ y)
    jax.block_until_ready(f(a, a))
    ta, tb = torch.randn(n, n), torch.randn(n, n)
    torch.mm(ta, tb)
    xla, tch = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(a, a))
        xla.append(time.perf_counter() - t)
        t = time.perf_counter()
        torch.mm(ta, tb)
        tch.append(time.perf_counter() - t)
    fl = 2 * n**3
    return {"xla": fl / min(xla) / 1e9, "torch": fl / min(tch) / 1e9}


def inputs(B, T, H, K, V, seed=0):
    """fp32 numpy inputs as the layer feeds them: l2-normalised q/k, beta in (0, 1), the K3 gate."""
    rng = np.random.default_rng(seed)
    nrm = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = nrm(rng.standard_normal((B, T, H, K)))
    k = nrm(rng.standard_normal((B, T, H, K)))
    v = rng.standard_normal((B, T, H, V))
    g = -5.0 / (1.0 + np.exp(-2.0 * rng.standard_normal((B, T, H, K))))
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, H))))
    h0 = 0.5 * rng.standard_normal((B, H, K, V))
    do = rng.standard_normal((B, T, H, V))
    dS = rng.standard_normal((B, H, K, V))
    return [np.asarray(x, np.float32) for x in (q, k, v, g, beta, h0, do, dS)]


def k3jax_fns(C):
    def fwd(q, k, v, g, beta, h0):
        return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=C)

    def loss(q, k, v, g, beta, h0, do, dS):
        o, S = fwd(q, k, v, g, beta, h0)
        return jnp.sum(o * do) + jnp.sum(S * dS)

    return jax.jit(fwd), jax.jit(jax.grad(loss, argnums=tuple(range(6))))


def load_fla_naive():
    """fla-core's naive.py loaded alone (the fla package __init__ imports triton); None if missing."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "ops" / "kda" / "naive.py"
    if not path.exists():
        return None
    mod_spec = importlib.util.spec_from_file_location("_fla_kda_naive", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod.naive_chunk_kda


def torch_fns(fn, C, **kw):
    """(forward, forward + backward) of a torch chunk KDA ``fn(q, k, v, g, beta, ...)``."""

    def fwd(q, k, v, g, beta, h0):
        with torch.no_grad():
            return fn(q, k, v, g, beta, chunk_size=C, initial_state=h0, output_final_state=True, **kw)

    def fwd_bwd(q, k, v, g, beta, h0, do, dS):
        xs = [x.detach().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
        o, S = fn(*xs[:5], chunk_size=C, initial_state=xs[5], output_final_state=True, **kw)
        ((o * do).sum() + (S * dS).sum()).backward()
        return [x.grad for x in xs]

    return fwd, fwd_bwd


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b**2)))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--T", type=int, default=4096, help="sequence length of the forward comparison")
    ap.add_argument("--bwd-T", type=int, default=1024,
                    help="sequence length of the forward + backward comparison (HF's autograd keeps its "
                         "B*T*H*C*K pairwise decays several times over: ~2.8 GB per 1024 tokens here)")
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--V", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--impls", default="k3jax,hf,fla_naive", help="comma-separated subset (k3jax always runs)")
    a = ap.parse_args(argv)
    B, H, K, V, C = a.B, a.H, a.K, a.V, a.chunk
    from transformers.models.kimi_linear import modeling_kimi_linear

    wanted = set(a.impls.split(",")) | {"k3jax"}
    impls = {"k3jax": (*k3jax_fns(C), jnp.asarray, jax.block_until_ready)}
    if "hf" in wanted:
        impls["hf"] = (*torch_fns(modeling_kimi_linear.chunk_kimi_delta_attention, C), torch.from_numpy, lambda x: x)
    fla_naive = load_fla_naive() if "fla_naive" in wanted else None
    if fla_naive is not None:
        impls["fla_naive"] = (*torch_fns(fla_naive, C), torch.from_numpy, lambda x: x)

    # (mode, T): every implementation at the two compared shapes, k3jax's forward + backward also at T
    cases = [("fwd", a.T), ("fwd_bwd", a.bwd_T)]
    extra = [("fwd_bwd", a.T)] if a.bwd_T != a.T else []
    host = {T: inputs(B, T, H, K, V) for T in {a.T, a.bwd_T}}
    runs = {}  # key -> (callable, args, block)
    for name, (fwd, fwd_bwd, convert, block) in impls.items():
        for mode, T in cases + (extra if name == "k3jax" else []):
            args = [convert(x) for x in host[T]]
            f, xs = (fwd, args[:6]) if mode == "fwd" else (fwd_bwd, args)
            runs[f"{name}_{mode}_T{T}"] = (f, xs, block, name, mode, T)

    report = {"shape": {"B": B, "T_fwd": a.T, "T_fwd_bwd": a.bwd_T, "H": H, "K": K, "V": V, "chunk": C,
                        "dtype": "float32", "gate": "K3 lower bound, -5 sigmoid(z)"},
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "machine": cpu_info()}
    first, outs = {}, {}
    for key, (f, args, block, name, mode, T) in runs.items():
        t = time.perf_counter()
        out = block(f(*args))
        first[key] = time.perf_counter() - t
        if mode == "fwd":
            outs[name] = out
        log(f"{key}: first call {first[key]:.1f} s")
    report["first_call_seconds"] = first
    report["parity_rms_rel_vs_k3jax"] = {
        name: {"o": rel(o, outs["k3jax"][0]), "final_state": rel(S, outs["k3jax"][1])}
        for name, (o, S) in outs.items() if name != "k3jax"}

    times = {key: [] for key in runs}
    for r in range(a.repeats):
        for key, (f, args, block, *_) in runs.items():
            t = time.perf_counter()
            block(f(*args))
            times[key].append(time.perf_counter() - t)
        log(f"repeat {r + 1}/{a.repeats}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in times.items()))

    peak = matmul_peak_gflops()
    best_peak = max(peak.values())
    res = {}
    for key, ts in times.items():
        mode, T = runs[key][4:]
        flops = kda_flops(B, T, H, K, V, C) * (3 if mode == "fwd_bwd" else 1)
        s = median(ts)
        res[key] = {"seconds_median": s, "seconds_best": min(ts), "tokens_per_s": B * T / s,
                    "gflops": flops / s / 1e9, "frac_matmul_peak": flops / s / 1e9 / best_peak}
    report["results"] = res
    report["matmul_peak_gflops"] = peak
    report["ratios_tokens_per_s"] = {
        f"k3jax_vs_{peer}_{mode}_T{T}": res[f"{peer}_{mode}_T{T}"]["seconds_median"]
        / res[f"k3jax_{mode}_T{T}"]["seconds_median"]
        for peer in impls if peer != "k3jax" for mode, T in cases}
    report["load_average_end_1_5_15min"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
