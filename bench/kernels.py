"""Benchmark the Pallas kernels against the XLA paths; prints one JSON document.

    python bench/kernels.py                 # CPU: FLOPs/bytes per call + interpret-mode max errors
    python bench/kernels.py --shape k3      # TPU: timings at the full K3 shapes; CPU: only the costs

Per kernel it reports the model FLOPs and HBM bytes of one call (analytic: the useful work of the
chunkwise algorithm / the grouped matmul, the same count for both implementations), and

- on CPU: the max abs and RMS-relative error of the Pallas kernel (interpret mode) against the
  pure-JAX reference, forward and (KDA) every gradient, fp32 and bf16, at a small shape;
- on TPU/GPU: median wall time of the Pallas kernel and of the XLA path, their achieved TFLOP/s and
  GB/s, and the fraction of the device's peak.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from k3jax.ops import chunk_kda as ref_chunk_kda  # noqa: E402
from pallas_kernels.kda import chunk_kda  # noqa: E402
from pallas_kernels.moe import gmm, tgmm  # noqa: E402

# (bf16 dense TFLOP/s, HBM GB/s) per chip, from the vendors' spec sheets
PEAKS = {
    "TPU v5p": (459.0, 2765.0), "TPU v5 lite": (197.0, 819.0), "TPU v5e": (197.0, 819.0),
    "TPU v6 lite": (918.0, 1640.0), "TPU v6e": (918.0, 1640.0), "TPU v4": (275.0, 1200.0),
    "NVIDIA H100": (989.0, 3350.0), "NVIDIA H200": (989.0, 4800.0), "NVIDIA B200": (2250.0, 8000.0),
}

SHAPES = {
    # KDA: B, T, H, K, V, chunk; MoE: rows M (tokens x top-k), D, F, experts E
    "small": dict(kda=(1, 256, 2, 128, 128, 64), moe=(512, 256, 384, 8)),
    "k3": dict(kda=(1, 8192, 96, 128, 128, 64), moe=(32768, 3584, 3072, 112)),
}


def peak(device):
    for name, p in PEAKS.items():
        if device.device_kind.startswith(name):
            return p
    return None


def kda_cost(B, T, H, K, V, C, in_bytes):
    """Useful FLOPs of the chunkwise forward (the backward is counted as 2x) and HBM bytes."""
    N = -(-T // C)
    per_chunk = 2 * (2 * C * C * K + C * C * C / 3 + C * C * (K + V) + 3 * C * K * V + C * C * V)
    flops = B * H * N * per_chunk
    io = B * T * H * (3 * K * in_bytes + V * in_bytes + 4 * K + 4 + V * in_bytes) + 2 * B * H * K * V * 4
    return flops, io


def kda_inputs(B, T, H, K, V, dtype, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    nrm = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q = nrm(jax.random.normal(ks[0], (B, T, H, K))).astype(dtype)
    k = nrm(jax.random.normal(ks[1], (B, T, H, K))).astype(dtype)
    v = jax.random.normal(ks[2], (B, T, H, V)).astype(dtype)
    g = -5.0 * jax.nn.sigmoid(2.0 * jax.random.normal(ks[3], (B, T, H, K)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    h0 = 0.5 * jax.random.normal(ks[5], (B, H, K, V))
    return q, k, v, g, beta, h0


def timeit(f, *args, n=10):
    out = f(*args)
    jax.block_until_ready(out)
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def errs(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return {"max_abs": float(np.max(np.abs(a - b))),
            "rms_rel": float(np.sqrt(np.mean((a - b) ** 2)) / (np.sqrt(np.mean(b**2)) + 1e-30))}


def speed(name, f_pallas, f_xla, args, flops, nbytes, dev):
    res = {"flops": flops, "bytes": nbytes}
    pk = peak(dev)
    for impl, f in (("pallas", f_pallas), ("xla", f_xla)):
        try:
            t = timeit(jax.jit(f), *args)
        except Exception as e:  # e.g. a kernel not available on this backend
            res[impl] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            continue
        r = {"seconds": t, "tflops": flops / t / 1e12, "gbps": nbytes / t / 1e9}
        if pk:
            r["frac_peak_flops"], r["frac_peak_bw"] = r["tflops"] / pk[0], r["gbps"] / pk[1]
        res[impl] = r
    if "seconds" in res.get("pallas", {}) and "seconds" in res.get("xla", {}):
        res["speedup_vs_xla"] = res["xla"]["seconds"] / res["pallas"]["seconds"]
    return res


def bench_kda(shape, dev, on_accel, costs_only=False):
    B, T, H, K, V, C = shape
    out = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        dn = jnp.dtype(dtype).name
        if costs_only:
            flops, nbytes = kda_cost(B, T, H, K, V, C, jnp.dtype(dtype).itemsize)
            out[f"kda_{dn}"] = {"flops_fwd": flops, "bytes_fwd": nbytes}
            continue
        q, k, v, g, beta, h0 = kda_inputs(B, T, H, K, V, dtype)
        flops, nbytes = kda_cost(B, T, H, K, V, C, jnp.dtype(dtype).itemsize)
        kw = dict(initial_state=h0, output_final_state=True, chunk_size=C)
        fwd_p = lambda q, k, v, g, beta: chunk_kda(q, k, v, g, beta, safe_gate=True, **kw)
        fwd_x = lambda q, k, v, g, beta: ref_chunk_kda(q, k, v, g, beta, **kw)
        do = jax.random.normal(jax.random.PRNGKey(1), v.shape)

        def grad_of(f):
            def loss(q, k, v, g, beta, h0):
                o, S = f(q, k, v, g, beta, h0)
                return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(S)
            return jax.grad(loss, argnums=tuple(range(6)))

        gp = grad_of(lambda q, k, v, g, beta, h0: chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                            chunk_size=C, safe_gate=True))
        gx = grad_of(lambda q, k, v, g, beta, h0: ref_chunk_kda(q, k, v, g, beta, initial_state=h0,
                                                                output_final_state=True, chunk_size=C))
        if on_accel:
            out[f"kda_fwd_{dn}"] = speed("kda_fwd", fwd_p, fwd_x, (q, k, v, g, beta), flops, nbytes, dev)
            out[f"kda_fwd_bwd_{dn}"] = speed("kda_fwd_bwd", gp, gx, (q, k, v, g, beta, h0), 3 * flops,
                                             3 * nbytes, dev)
        else:
            up = lambda x: x.astype(jnp.float32)
            o, S = jax.jit(fwd_p)(q, k, v, g, beta)
            o_r, S_r = jax.jit(fwd_x)(up(q), up(k), up(v), g, beta)
            gr_p = jax.jit(gp)(q, k, v, g, beta, h0)
            gr_x = jax.jit(gx)(up(q), up(k), up(v), g, beta, h0)
            e = {"o": errs(o, o_r), "final_state": errs(S, S_r)}
            e.update({n: errs(a, b) for n, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), gr_p, gr_x)})
            out[f"kda_{dn}"] = {"flops_fwd": flops, "bytes_fwd": nbytes, "interpret_error_vs_reference": e}
    return out


def bench_moe(shape, dev, on_accel, costs_only=False):
    M, D, F, E = shape
    out = {}
    hi = jax.lax.Precision.HIGHEST
    for dtype in (jnp.float32, jnp.bfloat16):
        dn = jnp.dtype(dtype).name
        isz = jnp.dtype(dtype).itemsize
        if costs_only:
            out[f"grouped_matmul_{dn}"] = {"flops": 2 * M * D * F, "bytes": (M * D + E * D * F + M * F) * isz}
            continue
        x = jax.random.normal(jax.random.PRNGKey(0), (M, D)).astype(dtype)
        w = (jax.random.normal(jax.random.PRNGKey(1), (E, D, F)) / math.sqrt(D)).astype(dtype)
        dy = jax.random.normal(jax.random.PRNGKey(2), (M, F)).astype(dtype)
        # uneven groups with one empty expert, as routing produces
        p = np.random.RandomState(0).dirichlet(np.ones(E))
        p[E // 2] = 0.0
        sizes = np.floor(p / p.sum() * M).astype(np.int32)
        sizes[0] += M - sizes.sum()
        gs = jnp.asarray(sizes)
        flops = 2 * M * D * F
        cases = {
            "gmm": (lambda x, w: gmm(x, w, gs), lambda x, w: jax.lax.ragged_dot(x, w, gs, precision=hi), (x, w),
                    (M * D + E * D * F + M * F) * isz),
            "gmm_transposed": (lambda dy, w: gmm(dy, w, gs, transpose_rhs=True),
                               lambda dy, w: jax.lax.ragged_dot(dy, jnp.swapaxes(w, 1, 2), gs, precision=hi), (dy, w),
                               (M * F + E * D * F + M * D) * isz),
            "tgmm": (lambda x, dy: tgmm(x, dy, gs),
                     lambda x, dy: jax.vjp(lambda w: jax.lax.ragged_dot(x, w, gs, precision=hi),
                                           jnp.zeros((E, D, F), x.dtype))[1](dy)[0], (x, dy),
                     (M * D + M * F + E * D * F) * isz),
        }
        for name, (fp, fx, args, nbytes) in cases.items():
            if on_accel:
                out[f"{name}_{dn}"] = speed(name, fp, fx, args, flops, nbytes, dev)
            else:
                up = lambda a: a.astype(jnp.float32)
                out[f"{name}_{dn}"] = {"flops": flops, "bytes": nbytes,
                                       "interpret_error_vs_reference": errs(jax.jit(fp)(*args),
                                                                            jax.jit(fx)(*map(up, args)))}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None,
                    help="default: small on CPU, k3 on an accelerator")
    ap.add_argument("--only", choices=["kda", "moe"], default=None)
    a = ap.parse_args()
    dev = jax.devices()[0]
    on_accel = dev.platform in ("tpu", "gpu")
    shape_name = a.shape or ("k3" if on_accel else "small")
    shape = SHAPES[shape_name]
    costs_only = not on_accel and shape_name == "k3"  # interpret mode at K3 size would take hours
    report = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
              "mode": "timed" if on_accel else ("costs" if costs_only else "interpret"), "shapes": shape,
              "peak_bf16_tflops_hbm_gbps": peak(dev)}
    if a.only in (None, "kda"):
        report["kda"] = bench_kda(shape["kda"], dev, on_accel, costs_only)
    if a.only in (None, "moe"):
        report["moe"] = bench_moe(shape["moe"], dev, on_accel, costs_only)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
