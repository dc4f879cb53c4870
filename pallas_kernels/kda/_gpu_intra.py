"""The chunk-parallel GPU kernels of chunk KDA: grid ``(B, H, N chunks)``, every program one chunk of one
head, no loop and no state carried (``_tiles.intra``: scores, triangular inverse, WY weights).

- ``intra_forward`` (``kda_intra_fwd_gpu``): the state-independent half of the forward: the masked output
  scores A_qk, W, U, k_out, Qg and the chunk's decay, for the recurrence and output kernels.
- ``intra_backward`` (``kda_intra_bwd_gpu``): everything of the backward but the recurrence: recomputes the
  chunk's scores and inverse, takes the stored states, state cotangents, pseudo-values and their
  cotangents V block by V block, and writes dq, dk, d(beta k), d(beta v) and dGs.
"""

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import triton_params
from pallas_kernels.kda import _tiles
from pallas_kernels.kda._gpu_layout import F32, SEG_COLS, head_cols, load_chunk, tile_rows
from pallas_kernels.varying import out_struct

INTRA = "intra"


def _chunk_specs(cfg, has_seg, with_vb):
    """Specs of the prepared inputs q, k, kb, [vb,] Gs[, seg] for grid (b, h, n)."""
    C, K, V = cfg.C, cfg.K, cfg.V
    tok = lambda width: head_cols(C, width, lambda b, h, n: (b, n, h))
    specs = [tok(K)] * 3 + ([tok(V)] if with_vb else []) + [tok(K)]
    if has_seg:
        specs.append(head_cols(C, SEG_COLS, lambda b, h, n: (b, n, 0)))
    return specs


def _decay_spec(K):
    return pl.BlockSpec((pl.Squeezed(), pl.Squeezed(), 1, K), lambda b, h, n: (b, h, n, 0))


def _intra_fwd_kernel(*refs, cfg, exact, has_seg):
    it = iter(refs)
    q_ref, k_ref, kb_ref, vb_ref, gs_ref = (next(it) for _ in range(5))
    seg_ref = next(it) if has_seg else None
    A_ref, w_ref, u_ref, kout_ref, qg_ref, decay_ref = (next(it) for _ in range(6))
    ch = load_chunk(q_ref, k_ref, kb_ref, vb_ref, gs_ref, seg_ref, cfg, exact)
    f = _tiles.intra(ch, exact=exact, mmdt=cfg.mmdt)
    U = _tiles.wy_values(f, ch.vb)
    zero = jnp.zeros_like(f.A_qk[0, 0])
    for a in range(cfg.NC):
        rows = tile_rows(a)
        w_ref[rows, :] = f.W[a].astype(w_ref.dtype)
        u_ref[rows, :] = U[a]
        kout_ref[rows, :] = f.wy.k_out[a].astype(kout_ref.dtype)
        qg_ref[rows, :] = f.wy.Qg[a].astype(qg_ref.dtype)
        for b in range(cfg.NC):  # the upper tiles are written as zeros: the kernels after read [C, C]
            A_ref[rows, tile_rows(b)] = (f.A_qk[a, b] if b <= a else zero).astype(A_ref.dtype)
    decay_ref[...] = f.wy.decay


def intra_forward(q, k, kb, vb, Gs, seg, *, cfg, exact, B, H, N):
    """Prepared inputs ``[B, Tp, H*D]`` -> ``(A_qk [B, Tp, H*C], W, k_out, Qg [B, Tp, H*K] in mmdt,
    U [B, Tp, H*V] fp32, decay [B, H, N, K] fp32)``."""
    Tp, C, K, V = N * cfg.C, cfg.C, cfg.K, cfg.V
    has_seg = seg is not None
    tok = lambda width: head_cols(C, width, lambda b, h, n: (b, n, h))
    out = lambda width, dtype: out_struct((B, Tp, H * width), dtype, q)
    A, W, U, k_out, Qg, decay = pl.pallas_call(
        functools.partial(_intra_fwd_kernel, cfg=cfg, exact=exact, has_seg=has_seg),
        out_shape=[out(C, cfg.mmdt), out(K, cfg.mmdt), out(V, F32), out(K, cfg.mmdt), out(K, cfg.mmdt),
                   out_struct((B, H, N, K), F32, q)],
        grid=(B, H, N),
        in_specs=_chunk_specs(cfg, has_seg, with_vb=True),
        out_specs=[tok(C), tok(K), tok(V), tok(K), tok(K), _decay_spec(K)],
        compiler_params=triton_params(cfg.num_warps(INTRA), 1),
        interpret=cfg.interpret,
        name="kda_intra_fwd_gpu",
    )(q, k, kb, vb, Gs, *([seg] if has_seg else []))
    return A, W, U, k_out, Qg, decay


def _intra_bwd_kernel(*refs, cfg, exact, has_seg):
    it = iter(refs)
    q_ref, k_ref, kb_ref, gs_ref = (next(it) for _ in range(4))
    seg_ref = next(it) if has_seg else None
    vb_ref, hs_ref, dhs_ref, delta_ref, ddelta_ref, do_ref = (next(it) for _ in range(6))
    dq_ref, dk_ref, dkb_ref, dvb_ref, dgs_ref = (next(it) for _ in range(5))
    NC, BV = cfg.NC, cfg.BV
    ch = load_chunk(q_ref, k_ref, kb_ref, None, gs_ref, seg_ref, cfg, exact)
    f = _tiles.intra(ch, exact=exact, mmdt=cfg.mmdt)
    sums = _tiles.VSums.zeros(NC, ch.BC, cfg.K)
    for v in range(cfg.NV):  # static V steps: bounds the live [BC, BV] tiles
        cols = pl.ds(v * BV, BV)
        tiles = lambda ref: [ref[tile_rows(a), cols] for a in range(NC)]
        dvb, sums = _tiles.v_block_backward(f, sums, vb=tiles(vb_ref), delta=tiles(delta_ref),
                                            ddelta=tiles(ddelta_ref), dO=tiles(do_ref), S=hs_ref[:, cols],
                                            dSp=dhs_ref[:, cols], mmdt=cfg.mmdt)
        for a in range(NC):
            dvb_ref[tile_rows(a), cols] = dvb[a].astype(dvb_ref.dtype)
    # the K side from the chunk loaded again: after the dvb stores, so the compiler cannot merge the loads
    # and keep the first load's [16, K] operands alive across the V loop (docs/kernels.md, shared memory)
    ch = load_chunk(q_ref, k_ref, kb_ref, None, gs_ref, seg_ref, cfg, exact)
    dq, dk, dkb, dGs = _tiles.intra_backward(ch, f.inv, sums, exact=exact, mmdt=cfg.mmdt)
    for a in range(NC):
        rows = tile_rows(a)
        dq_ref[rows, :] = (dq[a] * cfg.scale).astype(dq_ref.dtype)
        dk_ref[rows, :] = dk[a].astype(dk_ref.dtype)
        dkb_ref[rows, :] = dkb[a].astype(dkb_ref.dtype)
        dgs_ref[rows, :] = dGs[a].astype(dgs_ref.dtype)


def intra_backward(q, k, kb, vb, Gs, seg, hs, dhs, delta, ddelta, do, *, cfg, exact, B, H, N):
    """-> ``(dq, dk, dkb, dvb, dGs)`` in the kernel layout and the primals' dtypes. hs / dhs: the state
    entering / the cotangent of the state leaving every chunk ``[B, H, N*K, V]``; delta, ddelta, do
    ``[B, Tp, H*V]``."""
    C, K, V = cfg.C, cfg.K, cfg.V
    has_seg = seg is not None
    tok = lambda width: head_cols(C, width, lambda b, h, n: (b, n, h))
    state = pl.BlockSpec((pl.Squeezed(), pl.Squeezed(), K, V), lambda b, h, n: (b, h, n, 0))
    like = lambda x: out_struct(x.shape, x.dtype, q)
    return pl.pallas_call(
        functools.partial(_intra_bwd_kernel, cfg=cfg, exact=exact, has_seg=has_seg),
        out_shape=[like(q), like(k), like(kb), like(vb), like(Gs)],
        grid=(B, H, N),
        in_specs=_chunk_specs(cfg, has_seg, with_vb=False) + [tok(V), state, state, tok(V), tok(V), tok(V)],
        out_specs=[tok(K)] * 3 + [tok(V), tok(K)],
        compiler_params=triton_params(cfg.num_warps(INTRA), 1),
        interpret=cfg.interpret,
        name="kda_intra_bwd_gpu",
    )(q, k, kb, Gs, *([seg] if has_seg else []), vb, hs, dhs, delta, ddelta, do)
