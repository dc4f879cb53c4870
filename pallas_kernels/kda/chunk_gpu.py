"""Chunkwise KDA as Pallas **Triton** (GPU) kernels: the ``backend="gpu"`` path of ``pallas_kernels.kda.chunk_kda``.

Why it differs from the TPU kernel (``chunk.py``): a Triton grid is fully parallel (no sequential grid axis
and no scratch memory to carry a state between programs), and Triton tensors are power-of-two register
blocks without slicing or row concatenation. So:

- Grid ``(B, H, V blocks)``; each program walks *all* chunks of its sequence in an in-kernel
  ``lax.fori_loop``, carrying the fp32 state block ``[K, BV]`` in registers. V is split in ``BV``-wide
  blocks (default 64) to bound the registers of the state; the V-independent per-chunk algebra (scores,
  triangular inverse, W) is recomputed per V block (``V / BV`` = 2 for K3).
- The chunk is handled as ``C / 16`` sub-tiles of 16 tokens (``_tiles``): every matrix product is a 2-D
  ``tl.dot`` of ``16 x 16``, ``16 x K`` or ``K x BV`` blocks, every load/store is a ``[16, *]`` row block at a
  dynamic offset. Same anchors as the TPU kernel (the lower bound on g makes the diagonal 16 x 16 tiles
  dense matmuls; ``safe_gate=False`` forms them with exact per-pair exponents, K in pieces of 32).
- K and V are padded to powers of two (>= 16, ``tl.dot``'s minimum); C is any multiple of 16 (it only sets
  the number of unrolled sub-tiles). Padding is zeros (and g = 0), which leaves the recurrence unchanged.

Backward (``jax.custom_vjp``): the forward kernel runs again and stores the fp32 state entering every
chunk (``[B, H, N*K, V]``, as fla's ``h``), then the backward kernel walks the chunks last to first carrying
the state cotangent; dq, dk, d(beta k) and dGs are sums over V blocks (per-block shares written in fp32 and
summed by XLA when V has several blocks); d(beta v) and d initial_state are per block. As in ``chunk.py``,
XLA does the preparation (padding, beta products, sub-tile cumsum of the floored gate, segment vectors)
and its autodiff turns the kernel cotangents into dq, dk, dv, dg, dbeta.

Layout: inputs are viewed as ``[B, T, H*K]`` (free when K is a power of two >= 16) and each program reads
its head's ``[T, K]`` column block with strided loads.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from k3jax.ops import kda as ref_kda
from pallas_kernels._common import next_pow2, triton_params
from pallas_kernels.kda import _tiles
from pallas_kernels.kda._paths import BC, DENSE_MIN_GS, G_FLOOR, select_path
from pallas_kernels.kda._reference_backward import with_reference_backward

F32 = jnp.float32
MIN_DOT = 16  # tl.dot needs every block dim >= 16
BLOCK_V = 64  # V block per program: the fp32 state block [128, 64] is 32 KiB, 64 registers/thread at 4 warps
EXACT_PIECE = 32  # K columns per piece of an exact diagonal tile: [16, 16, 32] fp32 = 8192 values
NUM_WARPS = 4
NUM_STAGES = 2  # untuned (no GPU measurement yet): double-buffer the next chunk's loads
SEG_COLS = 3  # packed segment vectors per token: reset count, reads_state, in_last


@dataclasses.dataclass(frozen=True)
class GpuConfig:
    scale: float
    C: int  # chunk (multiple of BC)
    K: int  # padded key dim (power of two >= 16)
    V: int  # padded value dim
    BV: int  # V block per program
    exact: bool | None  # None = decide at run time from the gate
    interpret: object
    out_dtype: object
    mmdt: object
    num_warps: int = NUM_WARPS
    num_stages: int = NUM_STAGES

    @property
    def NV(self):
        return self.V // self.BV


# ----------------------------------------------------------------------------- specs and loads


def _tok_spec(T, width, nblk=1):
    """Block of one head's [T, width] columns of a [B, T, H * nblk * width] array (v = the V block)."""
    return pl.BlockSpec((pl.Squeezed(), T, width), lambda b, h, v: (b, 0, h * nblk + (v if nblk > 1 else 0)))


def _state_spec(rows, BV):
    return pl.BlockSpec((pl.Squeezed(), pl.Squeezed(), rows, BV), lambda b, h, v: (b, h, 0, v))


def _seg_spec(T):
    return pl.BlockSpec((pl.Squeezed(), T, SEG_COLS), lambda b, h, v: (b, 0, 0))


def _start(n, a, C):
    """First row of sub-tile a of chunk n (a multiple of BC: lets Triton vectorise the loads)."""
    return pl.multiple_of(n * C + a * BC, BC)


def _load_chunk(n, q_ref, k_ref, kb_ref, vb_ref, gs_ref, seg_ref, cfg, exact):
    """Loads chunk n (traced) as a ``_tiles.Chunk`` of C // BC sub-tiles."""
    C, NC = cfg.C, cfg.C // BC
    rows = lambda ref, a: ref[pl.ds(_start(n, a, C), BC), :]
    q = [rows(q_ref, a).astype(F32) * cfg.scale for a in range(NC)]
    k = [rows(k_ref, a).astype(F32) for a in range(NC)]
    kb = [rows(kb_ref, a).astype(F32) for a in range(NC)]
    vb = [rows(vb_ref, a) for a in range(NC)]
    Gs = [rows(gs_ref, a) for a in range(NC)]
    tot = [gs_ref[pl.ds(n * C + a * BC + BC - 1, 1), :] for a in range(NC)]  # [1, K]
    seg = None
    if seg_ref is not None:
        column = lambda a, c: seg_ref[pl.ds(_start(n, a, C), BC), pl.ds(c, 1)]  # [BC, 1]
        seg = _tiles.Segments(
            cnt=[column(a, 0) for a in range(NC)],
            reads_state=[column(a, 1) for a in range(NC)],
            in_last=[column(a, 2) for a in range(NC)],
            no_reset=seg_ref[pl.ds(n * C + C - 1, 1), pl.ds(1, 1)],  # [1, 1]
        )
    pieces = None
    if exact:
        KP = min(EXACT_PIECE, cfg.K)
        piece = lambda ref, a, p: ref[pl.ds(_start(n, a, C), BC), pl.ds(p * KP, KP)]
        pieces = [[(piece(q_ref, a, p).astype(F32) * cfg.scale, piece(k_ref, a, p).astype(F32),
                    piece(kb_ref, a, p).astype(F32), piece(gs_ref, a, p)) for p in range(cfg.K // KP)]
                  for a in range(NC)]
    return _tiles.Chunk(q=q, k=k, kb=kb, vb=vb, Gs=Gs, tot=tot, seg=seg, pieces=pieces)


# ----------------------------------------------------------------------------- forward kernel


def _fwd_kernel(*refs, cfg, exact, N, has_seg, has_h0, emit_states):
    it = iter(refs)
    q_ref, k_ref, kb_ref, vb_ref, gs_ref = (next(it) for _ in range(5))
    seg_ref = next(it) if has_seg else None
    h0_ref = next(it) if has_h0 else None
    o_ref, hT_ref = next(it), next(it)
    hs_ref = next(it) if emit_states else None
    C, K = cfg.C, cfg.K

    def body(n, S):
        if emit_states:  # the state entering chunk n, for the backward
            hs_ref[pl.ds(pl.multiple_of(n * K, K), K), :] = S
        ch = _load_chunk(n, q_ref, k_ref, kb_ref, vb_ref, gs_ref, seg_ref, cfg, exact)
        o, S_new = _tiles.chunk_forward(ch, S, exact=exact, mmdt=cfg.mmdt)
        for a, o_a in enumerate(o):
            o_ref[pl.ds(_start(n, a, C), BC), :] = o_a.astype(o_ref.dtype)
        return S_new

    S0 = h0_ref[...] if has_h0 else jnp.zeros((K, cfg.BV), F32)
    hT_ref[...] = jax.lax.fori_loop(0, N, body, S0)


def _fwd_call(q, k, kb, vb, Gs, seg, h0, *, cfg, exact, B, H, N, emit_states=False):
    """Kernel-layout inputs -> (o [B, Tp, H*V], hT [B, H, K, V] fp32, states [B, H, N*K, V] fp32 or None)."""
    Tp, K, V, BV, NV = N * cfg.C, cfg.K, cfg.V, cfg.BV, cfg.NV
    has_seg, has_h0 = seg is not None, h0 is not None
    ins = [q, k, kb, vb, Gs] + ([seg] if has_seg else []) + ([h0] if has_h0 else [])
    in_specs = [_tok_spec(Tp, K)] * 3 + [_tok_spec(Tp, BV, NV), _tok_spec(Tp, K)]
    in_specs += ([_seg_spec(Tp)] if has_seg else []) + ([_state_spec(K, BV)] if has_h0 else [])
    out_shape = [jax.ShapeDtypeStruct((B, Tp, H * V), cfg.out_dtype), jax.ShapeDtypeStruct((B, H, K, V), F32)]
    out_specs = [_tok_spec(Tp, BV, NV), _state_spec(K, BV)]
    if emit_states:
        out_shape.append(jax.ShapeDtypeStruct((B, H, N * K, V), F32))
        out_specs.append(_state_spec(N * K, BV))
    kernel = functools.partial(_fwd_kernel, cfg=cfg, exact=exact, N=N, has_seg=has_seg, has_h0=has_h0,
                               emit_states=emit_states)
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(B, H, NV),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=triton_params(cfg.num_warps, cfg.num_stages),
        interpret=cfg.interpret,
        name="kda_chunk_fwd_gpu",
    )(*ins)
    return outs[0], outs[1], (outs[2] if emit_states else None)


# ----------------------------------------------------------------------------- backward kernel


def _bwd_kernel(*refs, cfg, exact, N, has_seg):
    it = iter(refs)
    q_ref, k_ref, kb_ref, vb_ref, gs_ref = (next(it) for _ in range(5))
    seg_ref = next(it) if has_seg else None
    hs_ref, do_ref, dhT_ref = next(it), next(it), next(it)
    dq_ref, dk_ref, dkb_ref, dvb_ref, dgs_ref, dh0_ref = (next(it) for _ in range(6))
    C, K = cfg.C, cfg.K

    def body(i, dS):
        n = N - 1 - i  # chunks last to first
        ch = _load_chunk(n, q_ref, k_ref, kb_ref, vb_ref, gs_ref, seg_ref, cfg, exact)
        S = hs_ref[pl.ds(pl.multiple_of(n * K, K), K), :]
        dO = [do_ref[pl.ds(_start(n, a, C), BC), :].astype(F32) for a in range(C // BC)]
        dq, dk, dkb, dvb, dGs, dS = _tiles.chunk_backward(ch, S, dO, dS, exact=exact, mmdt=cfg.mmdt)
        for a in range(C // BC):
            at = pl.ds(_start(n, a, C), BC)
            dq_ref[at, :] = (dq[a] * cfg.scale).astype(dq_ref.dtype)
            dk_ref[at, :] = dk[a].astype(dk_ref.dtype)
            dkb_ref[at, :] = dkb[a].astype(dkb_ref.dtype)
            dvb_ref[at, :] = dvb[a].astype(dvb_ref.dtype)
            dgs_ref[at, :] = dGs[a].astype(dgs_ref.dtype)
        return dS

    dh0_ref[...] = jax.lax.fori_loop(0, N, body, dhT_ref[...])


def _bwd_call(q, k, kb, vb, Gs, seg, hs, do, dhT, *, cfg, exact, B, H, N):
    """Returns (dq, dk, dkb, dvb, dGs, dh0) in the kernel layout and the primals' dtypes."""
    Tp, K, V, BV, NV = N * cfg.C, cfg.K, cfg.V, cfg.BV, cfg.NV
    has_seg = seg is not None
    ins = [q, k, kb, vb, Gs] + ([seg] if has_seg else []) + [hs, do, dhT]
    in_specs = [_tok_spec(Tp, K)] * 3 + [_tok_spec(Tp, BV, NV), _tok_spec(Tp, K)]
    in_specs += ([_seg_spec(Tp)] if has_seg else [])
    in_specs += [_state_spec(N * K, BV), _tok_spec(Tp, BV, NV), _state_spec(K, BV)]
    # dq, dk, dkb, dGs: one share per V block ([NV, ...], fp32 when summed afterwards)
    share = lambda x: jax.ShapeDtypeStruct((NV,) + x.shape, F32 if NV > 1 else x.dtype)
    share_spec = pl.BlockSpec((pl.Squeezed(), pl.Squeezed(), Tp, K), lambda b, h, v: (v, b, 0, h))
    out_shape = [share(q), share(k), share(kb), jax.ShapeDtypeStruct(vb.shape, vb.dtype), share(Gs),
                 jax.ShapeDtypeStruct((B, H, K, V), F32)]
    out_specs = [share_spec] * 3 + [_tok_spec(Tp, BV, NV), share_spec, _state_spec(K, BV)]
    kernel = functools.partial(_bwd_kernel, cfg=cfg, exact=exact, N=N, has_seg=has_seg)
    dq, dk, dkb, dvb, dGs, dh0 = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(B, H, NV),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=triton_params(cfg.num_warps, cfg.num_stages),
        interpret=cfg.interpret,
        name="kda_chunk_bwd_gpu",
    )(*ins)
    total = lambda d, x: jnp.sum(d, axis=0).astype(x.dtype)
    return total(dq, q), total(dk, k), total(dkb, kb), dvb, total(dGs, Gs), dh0


# ----------------------------------------------------------------------------- custom VJP over the kernels


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _core(q, k, kb, vb, Gs, seg, h0, exact_flag, cfg, dims):
    """Kernel-layout inputs -> (o [B, Tp, H*V], final state [B, H, K, V])."""
    return _core_fwd(q, k, kb, vb, Gs, seg, h0, exact_flag, cfg, dims)[0]


def _core_fwd(q, k, kb, vb, Gs, seg, h0, exact_flag, cfg, dims):
    B, H, N = dims
    o, hT, _ = select_path(exact_flag, cfg, lambda ex: _fwd_call(q, k, kb, vb, Gs, seg, h0, cfg=cfg, exact=ex, B=B, H=H,
                                                             N=N))
    return (o, hT), (q, k, kb, vb, Gs, seg, h0, exact_flag)


def _core_bwd(cfg, dims, res, cts):
    q, k, kb, vb, Gs, seg, h0, exact_flag = res
    do, dhT = cts
    B, H, N = dims

    def run(ex):
        _, _, hs = _fwd_call(q, k, kb, vb, Gs, seg, h0, cfg=cfg, exact=ex, B=B, H=H, N=N, emit_states=True)
        return _bwd_call(q, k, kb, vb, Gs, seg, hs, do, dhT, cfg=cfg, exact=ex, B=B, H=H, N=N)

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


def chunk_kda_gpu(q, k, v, g, beta, *, scale, initial_state, segment_ids, chunk, interpret, safe_gate, mmdt,
                  backward, block_v=BLOCK_V, num_warps=NUM_WARPS, num_stages=NUM_STAGES):
    """Validated inputs (see ``chunk.chunk_kda``) -> ``(o, final_state)`` with the Triton kernels.

    chunk: the chunk size (multiple of 16). block_v: V block per program (a power of two >= 16; capped at
    the padded V). num_warps / num_stages: Triton compiler parameters.
    """
    K, V = q.shape[-1], v.shape[-1]
    Kp, Vp = next_pow2(K, MIN_DOT), next_pow2(V, MIN_DOT)
    if block_v < MIN_DOT or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two >= {MIN_DOT}, got {block_v}")
    cfg = GpuConfig(
        scale=float(scale), C=chunk, K=Kp, V=Vp, BV=min(block_v, Vp),
        exact=None if safe_gate is None else not safe_gate,
        interpret=interpret, out_dtype=v.dtype, mmdt=mmdt, num_warps=num_warps, num_stages=num_stages,
    )
    fn = _kda_gpu if backward == "pallas" else _kda_gpu_xla_bwd
    return fn(q, k, v, g, beta, initial_state, segment_ids, cfg)
