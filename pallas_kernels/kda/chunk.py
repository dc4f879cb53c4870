"""Chunkwise KDA as Pallas kernels: ``chunk_kda``, interchangeable with ``k3jax.ops.chunk_kda``.

This file holds the TPU (Mosaic) kernels and the public entry point; ``backend="gpu"`` dispatches to the
Triton kernels of ``chunk_gpu.py`` (same preparation; the chunk-local work split from the state recurrence
into kernels of its own, as fla does). Both run in interpret mode on CPU.

TPU structure:

- XLA preparation (differentiated by ordinary autodiff): pad T to whole chunks, ``kb = beta*k`` and
  ``vb = beta*v`` (so beta needs no lane-sparse block of its own), the sub-tile-local cumsum ``Gs`` of
  the floored gate, and per chunk a ``[C, C]`` segment matrix (shared by all heads).
- Forward kernel ``kda_chunk_fwd``: grid ``(B, H, chunks)``, chunks sequential with the fp32 state in a
  VMEM scratch; each step does the whole chunk algebra of ``_math.chunk_forward`` (anchored 16x16
  tiles, triangular inverse by doubling, WY form) and writes ``o``; the last step writes the state.
- Backward (``jax.custom_vjp`` over the kernels): the forward kernel runs again and emits the state
  entering every chunk, then ``kda_chunk_bwd`` walks the chunks last to first carrying the state
  cotangent in VMEM and writes dq, dk, d(beta k), d(beta v), dGs per chunk and d initial_state;
  XLA autodiff of the preparation turns those into dq, dk, dv, dg, dbeta. Only the inputs are kept
  as residuals (fla's default: states are recomputed, not stored).
- ``backward="xla"`` swaps the Pallas backward for the VJP of the pure-JAX reference.

Layout: with K and V multiples of 128 the ``[B, T, H, K]`` inputs are viewed as ``[B, T, H*K]`` (free)
and the kernels read ``(C, K)`` tiles at block ``(chunk, head)``: lane-dense, 8x128 aligned for C = 64.
Otherwise (small test shapes) the inputs are transposed to ``[B, H, T, K]``.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from k3jax.ops import kda as ref_kda
from pallas_kernels._common import compiler_params
from pallas_kernels.platform import resolve_backend
from pallas_kernels.kda import _math
from pallas_kernels.kda._paths import BC, DENSE_MIN_GS, G_FLOOR, select_path
from pallas_kernels.kda._reference_backward import with_reference_backward

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Config:
    scale: float
    C: int
    exact: bool | None  # None = decide at run time from the gate
    interpret: object
    backend: str
    out_dtype: object
    mmdt: object
    heads_last: bool
    reverse: bool = False  # index maps walk the chunks last to first (backward kernel)


# ----------------------------------------------------------------------------- layout helpers


def _tok_spec(cfg, width, N=None):
    chunk = (lambda n: N - 1 - n) if cfg.reverse else (lambda n: n)
    if cfg.heads_last:  # x viewed as [B, T, H*width]: a (C, width) tile at (n, h)
        return pl.BlockSpec((pl.Squeezed(), cfg.C, width), lambda b, h, n: (b, chunk(n), h))
    return pl.BlockSpec((pl.Squeezed(), pl.Squeezed(), cfg.C, width), lambda b, h, n: (b, h, chunk(n), 0))


def _to_kernel_layout(x, heads_last):
    """[B, T, H, D] -> [B, T, H*D] (a free view) or [B, H, T, D] (when D is not lane aligned)."""
    B, T, H, D = x.shape
    return x.reshape(B, T, H * D) if heads_last else jnp.transpose(x, (0, 2, 1, 3))


def _from_kernel_layout(x, H, heads_last):
    if heads_last:
        B, T, HD = x.shape
        return x.reshape(B, T, H, HD // H)
    return jnp.transpose(x, (0, 2, 1, 3))


def _state_spec(K, V):
    return pl.BlockSpec((pl.Squeezed(), pl.Squeezed(), K, V), lambda b, h, n: (b, h, 0, 0))


def _seg_spec(C):
    return pl.BlockSpec((pl.Squeezed(), pl.Squeezed(), C, C), lambda b, h, n: (b, n, 0, 0))


# ----------------------------------------------------------------------------- forward kernel


def _fwd_kernel(*refs, cfg, exact, has_seg, has_h0, emit_states):
    it = iter(refs)
    q_ref, k_ref, kb_ref, vb_ref, gs_ref = (next(it) for _ in range(5))
    seg_ref = next(it) if has_seg else None
    h0_ref = next(it) if has_h0 else None
    o_ref, hT_ref = next(it), next(it)
    hs_ref = next(it) if emit_states else None
    S_ref = next(it)
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _():
        S_ref[...] = h0_ref[...] if has_h0 else jnp.zeros(S_ref.shape, F32)

    S = S_ref[...]
    if emit_states:
        hs_ref[...] = S
    q = q_ref[...].astype(F32) * cfg.scale
    o, S_new = _math.chunk_forward(q, k_ref[...].astype(F32), kb_ref[...].astype(F32), vb_ref[...],
                                   gs_ref[...], None if seg_ref is None else seg_ref[...], S,
                                   BC=BC, exact=exact, mmdt=cfg.mmdt)
    o_ref[...] = o.astype(o_ref.dtype)
    S_ref[...] = S_new

    @pl.when(n == pl.num_programs(2) - 1)
    def _():
        hT_ref[...] = S_new


def _fwd_cost(B, H, N, C, K, V, ins, outs):
    # scores 2*(2 C^2 K), inverse ~12 C^3, U/W C^2 (K+V), WS/QS 2 C K V, A delta C^2 V, state C K V
    flops = B * H * N * 2 * (2 * C * C * K + 6 * C ** 3 + C * C * (K + V) + 3 * C * K * V + C * C * V)
    trans = B * H * N * C * K * 6
    nbytes = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in (*ins, *outs))
    return pl.CostEstimate(flops=int(flops), transcendentals=int(trans), bytes_accessed=int(nbytes))


def _fwd_call(q, k, kb, vb, Gs, seg, h0, *, cfg, exact, B, H, N, K, V, emit_states=False):
    """Kernel-layout inputs -> (o, hT [B, H, K, V] fp32, states [B, H, N*K, V] fp32 or None)."""
    C = cfg.C
    has_seg, has_h0 = seg is not None, h0 is not None
    ins = [q, k, kb, vb, Gs] + ([seg] if has_seg else []) + ([h0] if has_h0 else [])
    in_specs = [_tok_spec(cfg, K)] * 3 + [_tok_spec(cfg, V), _tok_spec(cfg, K)]
    in_specs += ([_seg_spec(C)] if has_seg else []) + ([_state_spec(K, V)] if has_h0 else [])
    o_shape = (B, N * C, H * V) if cfg.heads_last else (B, H, N * C, V)
    out_shape = [jax.ShapeDtypeStruct(o_shape, cfg.out_dtype), jax.ShapeDtypeStruct((B, H, K, V), F32)]
    out_specs = [_tok_spec(cfg, V), _state_spec(K, V)]
    if emit_states:
        out_shape.append(jax.ShapeDtypeStruct((B, H, N * K, V), F32))
        out_specs.append(pl.BlockSpec((pl.Squeezed(), pl.Squeezed(), K, V), lambda b, h, n: (b, h, n, 0)))
    kernel = functools.partial(_fwd_kernel, cfg=cfg, exact=exact, has_seg=has_seg, has_h0=has_h0,
                               emit_states=emit_states)
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(B, H, N),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((K, V), F32)],
        compiler_params=compiler_params(cfg.backend, ("parallel", "parallel", "arbitrary")),
        interpret=cfg.interpret,
        cost_estimate=_fwd_cost(B, H, N, C, K, V, ins, out_shape),
        name="kda_chunk_fwd",
    )(*ins)
    return outs[0], outs[1], (outs[2] if emit_states else None)


# ----------------------------------------------------------------------------- input preparation


def _same_segment(segment_ids, B, T, Tp, C):
    """[B, N, C, C] fp32 segment matrix per chunk (see ``_math.seg_vectors``): off the diagonal 1 where
    tokens i, j of the chunk are in the same segment, on the diagonal 1 where token i has no reset at or
    before it inside the chunk (it reads the incoming state)."""
    resets = ref_kda.segment_resets(segment_ids, B, T).astype(jnp.int32)
    resets = jnp.pad(resets, ((0, 0), (0, Tp - T)))
    n = jnp.cumsum(resets.reshape(B, Tp // C, C), axis=-1)
    same = n[..., :, None] == n[..., None, :]
    eye = jnp.eye(C, dtype=bool)
    return jnp.where(eye, (n == 0)[..., :, None], same).astype(F32)


def _prepare(q, k, v, g, beta, segment_ids, cfg):
    """Pad to whole chunks, form kb = beta*k, vb = beta*v, the sub-tile cumsum Gs, the segment matrix."""
    B, T, H, K = q.shape
    C = cfg.C
    N = -(-T // C)
    Tp = N * C
    pad = lambda x: jnp.pad(x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2))
    bf = beta.astype(F32)[..., None]
    kb = (bf * k.astype(F32)).astype(cfg.mmdt)
    vb = (bf * v.astype(F32)).astype(cfg.mmdt)
    gf = jnp.maximum(pad(g.astype(F32)), G_FLOOR)
    Gs = jnp.cumsum(gf.reshape(B, Tp // BC, BC, H, K), axis=2).reshape(B, Tp, H, K)
    lay = lambda x: _to_kernel_layout(x, cfg.heads_last)
    ins = [lay(pad(x.astype(cfg.mmdt))) for x in (q, k, kb, vb)] + [lay(Gs)]
    seg = None if segment_ids is None else _same_segment(segment_ids, B, T, Tp, C)
    return ins, seg, Gs, N


# ----------------------------------------------------------------------------- backward kernel


def _bwd_kernel(*refs, cfg, exact, has_seg, has_h0):
    it = iter(refs)
    q_ref, k_ref, kb_ref, vb_ref, gs_ref = (next(it) for _ in range(5))
    seg_ref = next(it) if has_seg else None
    hs_ref, do_ref, dhT_ref = next(it), next(it), next(it)
    dq_ref, dk_ref, dkb_ref, dvb_ref, dgs_ref, dh0_ref = (next(it) for _ in range(6))
    dS_ref = next(it)
    n = pl.program_id(2)  # chunks run last to first

    @pl.when(n == 0)
    def _():
        dS_ref[...] = dhT_ref[...]

    q = q_ref[...].astype(F32) * cfg.scale
    dq, dk, dkb, dvb, dGs, dS = _math.chunk_backward(
        q, k_ref[...].astype(F32), kb_ref[...].astype(F32), vb_ref[...], gs_ref[...],
        None if seg_ref is None else seg_ref[...], hs_ref[...], do_ref[...].astype(F32), dS_ref[...],
        BC=BC, exact=exact, mmdt=cfg.mmdt)
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dkb_ref[...] = dkb.astype(dkb_ref.dtype)
    dvb_ref[...] = dvb.astype(dvb_ref.dtype)
    dgs_ref[...] = dGs
    dS_ref[...] = dS

    @pl.when(n == pl.num_programs(2) - 1)
    def _():
        dh0_ref[...] = dS


def _bwd_call(q, k, kb, vb, Gs, seg, hs, do, dhT, *, cfg, exact, B, H, N, K, V):
    C = cfg.C
    has_seg = seg is not None
    rev = dataclasses.replace(cfg, reverse=True)
    ins = [q, k, kb, vb, Gs] + ([seg] if has_seg else []) + [hs, do, dhT]
    in_specs = [_tok_spec(rev, K, N)] * 3 + [_tok_spec(rev, V, N), _tok_spec(rev, K, N)]
    if has_seg:
        in_specs.append(pl.BlockSpec((pl.Squeezed(), pl.Squeezed(), C, C), lambda b, h, n: (b, N - 1 - n, 0, 0)))
    in_specs += [pl.BlockSpec((pl.Squeezed(), pl.Squeezed(), K, V), lambda b, h, n: (b, h, N - 1 - n, 0)),
                 _tok_spec(rev, V, N), _state_spec(K, V)]
    tok = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
    out_shape = [tok(q), tok(k), tok(kb), tok(vb), tok(Gs), jax.ShapeDtypeStruct((B, H, K, V), F32)]
    out_specs = [_tok_spec(rev, K, N)] * 3 + [_tok_spec(rev, V, N), _tok_spec(rev, K, N), _state_spec(K, V)]
    kernel = functools.partial(_bwd_kernel, cfg=cfg, exact=exact, has_seg=has_seg, has_h0=True)
    cost = _fwd_cost(B, H, N, C, K, V, ins, out_shape)
    cost = pl.CostEstimate(flops=3 * cost.flops, transcendentals=cost.transcendentals,
                           bytes_accessed=cost.bytes_accessed)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(B, H, N),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((K, V), F32)],
        compiler_params=compiler_params(cfg.backend, ("parallel", "parallel", "arbitrary")),
        interpret=cfg.interpret,
        cost_estimate=cost,
        name="kda_chunk_bwd",
    )(*ins)


# ----------------------------------------------------------------------------- custom VJP over the kernels


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _core(q, k, kb, vb, Gs, seg, h0, exact_flag, cfg, dims):
    """Kernel-layout inputs -> (o in kernel layout, final state)."""
    return _core_fwd(q, k, kb, vb, Gs, seg, h0, exact_flag, cfg, dims)[0]


def _core_fwd(q, k, kb, vb, Gs, seg, h0, exact_flag, cfg, dims):
    B, H, N, K, V = dims
    o, hT, _ = select_path(exact_flag, cfg, lambda ex: _fwd_call(q, k, kb, vb, Gs, seg, h0, cfg=cfg, exact=ex, B=B, H=H,
                                                             N=N, K=K, V=V))
    return (o, hT), (q, k, kb, vb, Gs, seg, h0, exact_flag)


def _core_bwd(cfg, dims, res, cts):
    q, k, kb, vb, Gs, seg, h0, exact_flag = res
    do, dhT = cts
    B, H, N, K, V = dims

    def run(ex):
        _, _, hs = _fwd_call(q, k, kb, vb, Gs, seg, h0, cfg=cfg, exact=ex, B=B, H=H, N=N, K=K, V=V, emit_states=True)
        return _bwd_call(q, k, kb, vb, Gs, seg, hs, do, dhT, cfg=cfg, exact=ex, B=B, H=H, N=N, K=K, V=V)

    dq, dk, dkb, dvb, dGs, dh0 = select_path(exact_flag, cfg, run)
    return dq, dk, dkb, dvb, dGs, None, (None if h0 is None else dh0), None


_core.defvjp(_core_fwd, _core_bwd)


def _kda_pallas(q, k, v, g, beta, h0, segment_ids, cfg):
    """Preparation in XLA (differentiated by autodiff) around the kernel core."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    ins, seg, Gs, N = _prepare(q, k, v, g, beta, segment_ids, cfg)
    flag = None if cfg.exact is not None else jax.lax.stop_gradient(jnp.min(Gs) < DENSE_MIN_GS)
    o, hT = _core(*ins, seg, h0, flag, cfg, (B, H, N, K, V))
    return _from_kernel_layout(o, H, cfg.heads_last)[:, :T], hT


_kda_xla_bwd = with_reference_backward(_kda_pallas)  # backward="xla"


# ----------------------------------------------------------------------------- public API


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, chunk_size=64,
              segment_ids=None, interpret=None, backend=None, safe_gate=None, backward="pallas", gpu_options=None):
    """Pallas chunkwise KDA; same arguments and results as ``k3jax.ops.chunk_kda``.

    Extra keyword arguments:

    - ``interpret``: None = interpret when the target platform (``pallas_kernels.platform``: the
      current mesh's, else the default device's) is neither TPU nor GPU; True = the generic Pallas interpreter
      (runs either backend's kernel on CPU); a ``pltpu.InterpretParams`` = the TPU-semantics interpreter.
    - ``backend``: ``"tpu"`` (Mosaic, this file), ``"gpu"`` (Triton, ``chunk_gpu.py``) or None (the
      target platform's; TPU on a CPU host).
    - ``gpu_options``: GPU only, a dict of ``chunk_gpu.chunk_kda_gpu``'s ``block_v``, ``num_warps``,
      ``num_stages``.
    - ``safe_gate``: True = every 16x16 diagonal tile is a dense matmul (valid when every sum of g over
      16 consecutive tokens is >= -80, e.g. the K3 gate with lower bound -5); False = exact per-pair
      exponents on the diagonal tiles (any g <= 0, e.g. the softplus gate); None = choose at run time
      with ``lax.cond`` on the gate (both variants are compiled).

    ``chunk_size`` must be a multiple of 16 (a power of two on GPU); the chunk is ``min(chunk_size, T rounded
    up to 16)`` (on GPU: up to a power of two).
    float64 inputs fall back to the pure-JAX reference (Pallas kernels run in fp32).

    - ``backward``: ``"pallas"`` (the Pallas backward kernel) or ``"xla"`` (VJP of the pure-JAX reference).

    Gradients: dq, dk, dv, dg, dbeta and d initial_state (``jax.custom_vjp``); none for segment_ids.
    Numerics: matmul operands in the input dtype (bf16 -> bf16 MXU / tensor-core operands) with fp32
    accumulation; state, gate algebra and the triangular inverse in fp32.
    """
    B, T, H, K, V, dtype = ref_kda.check_inputs(q, k, v, g, beta, initial_state, segment_ids)
    if dtype != F32:
        return ref_kda.chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                 output_final_state=output_final_state, chunk_size=chunk_size,
                                 segment_ids=segment_ids)
    if not isinstance(chunk_size, int) or chunk_size <= 0 or chunk_size % BC:
        raise ValueError(f"chunk_size must be a positive multiple of {BC}, got {chunk_size!r}")
    interpret, backend = resolve_backend(interpret, backend)
    if backward not in ("pallas", "xla"):
        raise ValueError(f"backward must be 'pallas' or 'xla', got {backward!r}")
    io = [x.dtype for x in (q, k, v)]
    mmdt = jnp.bfloat16 if jnp.bfloat16 in io else (jnp.float16 if jnp.float16 in io else F32)
    if backend == "gpu":  # the Triton kernels (chunk_gpu.py)
        from pallas_kernels.kda.chunk_gpu import chunk_kda_gpu

        o, hT = chunk_kda_gpu(q, k, v, g, beta, scale=float(K**-0.5 if scale is None else scale),
                              initial_state=initial_state, segment_ids=segment_ids,
                              chunk_size=chunk_size, interpret=interpret, safe_gate=safe_gate,
                              mmdt=mmdt, backward=backward, **(gpu_options or {}))
        return o, (hT if output_final_state else None)
    cfg = Config(
        scale=float(K**-0.5 if scale is None else scale),
        C=min(chunk_size, -(-T // BC) * BC),
        exact=None if safe_gate is None else not safe_gate,
        interpret=interpret,
        backend=backend,
        out_dtype=v.dtype,
        mmdt=mmdt,
        heads_last=(K % 128 == 0 and V % 128 == 0) or H == 1,
    )
    fn = _kda_pallas if backward == "pallas" else _kda_xla_bwd
    o, hT = fn(q, k, v, g, beta, initial_state, segment_ids, cfg)
    return o, (hT if output_final_state else None)
