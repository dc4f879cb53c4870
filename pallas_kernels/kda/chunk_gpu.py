"""Chunkwise KDA as Pallas **Triton** (GPU) kernels: the ``backend="gpu"`` path of ``pallas_kernels.kda.chunk_kda``.

The work is split as fla's Triton KDA splits it, so that only the state recurrence is sequential:

1. ``kda_intra_fwd_gpu`` (``_gpu_intra``), grid ``(B, H, N chunks)``: per chunk and head, the anchored
   score tiles, the triangular inverse ``(I + L)^-1`` and the WY weights: writes A_qk, W, U, k_out, Qg and
   the chunk's decay.
2. ``kda_state_fwd_gpu`` (``_gpu_state``), grid ``(B, H, V / BV)``: walks the chunks carrying the fp32
   state block ``[K, BV]``; stores the state entering every chunk and the pseudo-values
   ``delta = U - W S``; returns the final state.
3. ``kda_output_gpu`` (``_gpu_output``), grid ``(B, H, N, V / BV)``: ``o = Qg S + A_qk delta``.

Backward (``jax.custom_vjp``; only the inputs are residuals, as fla recomputes by default): kernels 1 and 2
run again, then ``kda_state_bwd_gpu`` walks the chunks last to first carrying the state cotangent (stores
it per chunk with ``ddelta = A_qk^T dO + k_out dS``; returns d initial_state), then ``kda_intra_bwd_gpu``,
chunk-parallel again, recomputes each chunk's scores and inverse and writes dq, dk, d(beta k), d(beta v)
and dGs. XLA does the preparation (padding, beta products, sub-tile cumsum of the floored gate, segment
vectors) and its autodiff turns the kernel cotangents into dq, dk, dv, dg, dbeta.

Within a chunk (kernels 1 and 5) every product is a 2-D ``tl.dot`` of 16-token sub-tiles (``_tiles``: Triton
cannot slice or concatenate register values); the other kernels multiply whole ``[C, *]`` blocks, so the
chunk C is a power of two. K and V are padded to powers of two (>= 16, ``tl.dot``'s minimum) with zeros
(and g = 0), which leaves the recurrence unchanged. Tile sizes per dtype: ``_gpu_layout.TILING``; the
shared memory they need, per kernel: docs/kernels.md.
"""

import functools

import jax
import jax.numpy as jnp

from k3jax.ops import kda as ref_kda
from pallas_kernels._common import next_pow2
from pallas_kernels.kda._gpu_intra import intra_backward, intra_forward
from pallas_kernels.kda._gpu_layout import F32, MIN_DOT, GpuConfig, tiling
from pallas_kernels.kda._gpu_output import output
from pallas_kernels.kda._gpu_state import state_backward, state_forward
from pallas_kernels.kda._paths import BC, DENSE_MIN_GS, G_FLOOR, select_path
from pallas_kernels.kda._reference_backward import with_reference_backward


def _forward(q, k, kb, vb, Gs, seg, h0, *, cfg, exact, B, H, N):
    """Kernels 1-2: ``(A_qk, W, k_out, Qg, decay, hs, delta, final state)``."""
    A, W, U, k_out, Qg, decay = intra_forward(q, k, kb, vb, Gs, seg, cfg=cfg, exact=exact, B=B, H=H, N=N)
    hs, delta, hT = state_forward(W, U, k_out, decay, h0, cfg=cfg, B=B, H=H, N=N)
    return A, W, k_out, Qg, decay, hs, delta, hT


# ----------------------------------------------------------------------------- custom VJP over the kernels


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _core(q, k, kb, vb, Gs, seg, h0, exact_flag, cfg, dims):
    """Kernel-layout inputs -> (o [B, Tp, H*V], final state [B, H, K, V])."""
    return _core_fwd(q, k, kb, vb, Gs, seg, h0, exact_flag, cfg, dims)[0]


def _core_fwd(q, k, kb, vb, Gs, seg, h0, exact_flag, cfg, dims):
    B, H, N = dims

    def run(ex):
        A, _, _, Qg, _, hs, delta, hT = _forward(q, k, kb, vb, Gs, seg, h0, cfg=cfg, exact=ex, B=B, H=H, N=N)
        return output(Qg, hs, A, delta, cfg=cfg, B=B, H=H, N=N), hT

    return select_path(exact_flag, cfg, run), (q, k, kb, vb, Gs, seg, h0, exact_flag)


def _core_bwd(cfg, dims, res, cts):
    q, k, kb, vb, Gs, seg, h0, exact_flag = res
    do, dhT = cts
    B, H, N = dims

    def run(ex):
        A, W, k_out, Qg, decay, hs, delta, _ = _forward(q, k, kb, vb, Gs, seg, h0, cfg=cfg, exact=ex, B=B, H=H, N=N)
        dhs, ddelta, dh0 = state_backward(A, do, k_out, Qg, W, decay, dhT, cfg=cfg, B=B, H=H, N=N)
        grads = intra_backward(q, k, kb, vb, Gs, seg, hs, dhs, delta, ddelta, do, cfg=cfg, exact=ex, B=B, H=H, N=N)
        return (*grads, dh0)

    dq, dk, dkb, dvb, dGs, dh0 = select_path(exact_flag, cfg, run)
    return dq, dk, dkb, dvb, dGs, None, (None if h0 is None else dh0), None


_core.defvjp(_core_fwd, _core_bwd)


# ----------------------------------------------------------------------------- input preparation


def _segment_vectors(segment_ids, B, T, Tp, C):
    """[B, Tp, 3] fp32 per token: running reset count (equal counts = same segment), reads_state (no reset
    at or before the token inside its chunk) and in_last (same segment as the chunk's last token)."""
    resets = jnp.pad(ref_kda.segment_resets(segment_ids, B, T).astype(jnp.int32), ((0, 0), (0, Tp - T)))
    cnt = jnp.cumsum(resets, axis=1)
    c, r = cnt.reshape(B, Tp // C, C), resets.reshape(B, Tp // C, C)
    reads_state = c == (c[..., :1] - r[..., :1])  # count before the chunk's first token
    in_last = c == c[..., -1:]
    vecs = [cnt.astype(F32), reads_state.reshape(B, Tp).astype(F32), in_last.reshape(B, Tp).astype(F32)]
    return jnp.stack(vecs, axis=-1)


def _prepare(q, k, v, g, beta, segment_ids, cfg):
    """Pad T to whole chunks and K / V to cfg.K / cfg.V, form kb, vb, the sub-tile cumsum Gs of the floored
    gate, the segment vectors; returns the kernel-layout inputs ``[B, Tp, H*D]`` and N."""
    B, T, H, _ = q.shape
    N = -(-T // cfg.C)
    Tp = N * cfg.C
    pad = lambda x, d: jnp.pad(x, ((0, 0), (0, Tp - T), (0, 0), (0, d - x.shape[-1])))
    bf = beta.astype(F32)[..., None]
    kb = (bf * k.astype(F32)).astype(cfg.mmdt)
    vb = (bf * v.astype(F32)).astype(cfg.mmdt)
    gf = pad(jnp.maximum(g.astype(F32), G_FLOOR), cfg.K)
    Gs = jnp.cumsum(gf.reshape(B, Tp // BC, BC, H, cfg.K), axis=2).reshape(B, Tp, H, cfg.K)
    flat = lambda x: x.reshape(B, Tp, -1)
    ins = [flat(pad(x.astype(cfg.mmdt), cfg.K)) for x in (q, k, kb)] + [flat(pad(vb, cfg.V)), flat(Gs)]
    seg = None if segment_ids is None else _segment_vectors(segment_ids, B, T, Tp, cfg.C)
    return ins, seg, Gs, N


def _kda_gpu(q, k, v, g, beta, h0, segment_ids, cfg):
    """Preparation in XLA (differentiated by autodiff) around the kernel core."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    ins, seg, Gs, N = _prepare(q, k, v, g, beta, segment_ids, cfg)
    flag = None if cfg.exact is not None else jax.lax.stop_gradient(jnp.min(Gs) < DENSE_MIN_GS)
    h0p = None if h0 is None else jnp.pad(h0, ((0, 0), (0, 0), (0, cfg.K - K), (0, cfg.V - V)))
    o, hT = _core(*ins, seg, h0p, flag, cfg, (B, H, N))
    return o.reshape(B, N * cfg.C, H, cfg.V)[:, :T, :, :V], hT[:, :, :K, :V]


_kda_gpu_xla_bwd = with_reference_backward(_kda_gpu)  # backward="xla"


def gpu_chunk(chunk_size, T):
    """The chunk the GPU kernels use: ``chunk_size`` (a power of two >= 16), or less for a short sequence
    (T rounded up to a power of two >= 16)."""
    if chunk_size < MIN_DOT or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= {MIN_DOT} for the GPU kernels, got {chunk_size}")
    return min(chunk_size, next_pow2(T, BC))


def chunk_kda_gpu(q, k, v, g, beta, *, scale, initial_state, segment_ids, chunk_size, interpret, safe_gate, mmdt,
                  backward, block_v=None, num_warps=None, num_stages=None):
    """Validated inputs (see ``chunk.chunk_kda``) -> ``(o, final_state)`` with the Triton kernels.

    chunk_size: a power of two >= 16 (``gpu_chunk``). block_v: V block of the recurrence and output kernels
    (a power of two >= 16, capped at the padded V); num_warps (every kernel) / num_stages (the recurrence
    loops): Triton compiler parameters. None = the per-dtype defaults of ``_gpu_layout.TILING``.
    """
    T, K, V = q.shape[1], q.shape[-1], v.shape[-1]
    Kp, Vp = next_pow2(K, MIN_DOT), next_pow2(V, MIN_DOT)
    block_v, loop_stages, warps = tiling(mmdt, block_v=block_v, num_warps=num_warps, num_stages=num_stages)
    if block_v < MIN_DOT or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two >= {MIN_DOT}, got {block_v}")
    cfg = GpuConfig(
        scale=float(scale), C=gpu_chunk(chunk_size, T), K=Kp, V=Vp, BV=min(block_v, Vp),
        exact=None if safe_gate is None else not safe_gate,
        interpret=interpret, out_dtype=v.dtype, mmdt=mmdt, loop_stages=loop_stages, warps=warps,
    )
    fn = _kda_gpu if backward == "pallas" else _kda_gpu_xla_bwd
    return fn(q, k, v, g, beta, initial_state, segment_ids, cfg)
